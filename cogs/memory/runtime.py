"""What the memory cogs share: worker threads, the ordered write queue, the background loops.

:class:`MemoryRuntime` is not a cog.  The extension's ``setup`` builds one, starts
it and hands it to every memory cog; ``teardown`` stops it after the cogs are gone.

* **Threads.**  Every engine call runs off the event loop, each kind on its own
  workers: writes on one thread behind the retrying queue (:mod:`cogs.memory.write_queue`),
  quick reads (settings, counts) on two, searches on a small capped pool, embedding
  on its own, so a slow rerank never delays storing a message.
* **Order.**  Deletions (forget-me, purges, retention) run in the same queue as the
  writes they must win against (:meth:`MemoryRuntime.forget`).
* **Loops.**  The embedding backlog every few seconds, public answers whose quoted
  messages are gone taken down every few seconds (:mod:`cogs.memory.retractions`),
  retention every hour; a failure is logged and retried, never the end of a loop.
* **Other processes.**  Several bot processes may share the database (shards spread
  over processes, or a command-line tool beside the bot); :mod:`cogs.memory.follow`
  picks up their settings and profile changes within seconds.
* **Shards.**  A guild's events, its commands and its background work (retention,
  catch-up, reconcile, backfill) belong to the process running its shard
  (:meth:`MemoryRuntime.owns`); embedding the backlog may run anywhere, the
  storage's claims keep embedders apart.
* **Background work** (backfills, catch-up, reconciles) is started with
  :meth:`MemoryRuntime.spawn`, so stopping the runtime cancels it before the queue drains.
* **Settings and time.**  Each guild's settings are cached a minute
  (:mod:`cogs.memory.settings_cache`); retention counts from Discord's clock as the
  gateway shows it (:mod:`cogs.memory.discord_clock`).
"""

from __future__ import annotations

import asyncio
import functools
import gc
import logging
import threading
from collections.abc import Callable, Coroutine, Sequence
from concurrent.futures import Future, ThreadPoolExecutor
from typing import TYPE_CHECKING, Any, TypeVar

import discord
from discord.ext import commands, tasks

from cogs.memory.answers import make_chat_client
from cogs.memory.capture import Gone
from cogs.memory.discord_clock import DiscordClock
from cogs.memory.follow import Follower
from cogs.memory.retractions import Retractions
from cogs.memory.settings_cache import SettingsCache
from cogs.memory.shards import Shards
from cogs.memory.write_queue import (
    Apply,
    LaterTries,
    Write,
    WriteQueue,
    apply_in_order,
    describe,
)
from memory.config import Profile
from memory.errors import (
    DiskFullError,
    EmbeddingModelChanged,
    MemoryBotError,
    SearchInputError,
    StorageBusy,
)
from memory.records import MessageRecord, SearchResult
from memory.search import SearchRequest
from memory.settings import GuildSettings

if TYPE_CHECKING:
    from memory.engine import MemoryEngine
    from memory.llm import ChatClient
    from memory.storage.contract import Guilds

log = logging.getLogger(__name__)

T = TypeVar("T")


EMBED_INTERVAL_S = 5.0
EMBED_BACKOFF_MAX_S = 300.0
RETENTION_INTERVAL_H = 1.0
SEARCH_WORKERS = 2  # searches running at once; more wait their turn on the event loop
SEARCH_QUEUE = 8  # searches waiting before new ones are turned away
SHUTDOWN_WRITES_S = 3.0  # queued writes get this long at stop: the whole stop stays under 5 s
SHUTDOWN_WORKERS_S = 1.0  # then a search, read or embedding chunk still running, off the loop
SHUTDOWN_MARKS_S = 1.0  # then what could not be stored is marked for the catch-up, this long
# A stop waits for the chunk being embedded: 256 took 3-4 s on a loaded 2-core machine,
# which alone broke the 5 s bound.  The encoder batches within a chunk anyway.
EMBED_CHUNK_LIVE = 64


class MemoryRuntime:
    """The threads, queue, settings cache and loops behind the memory cogs.

    Args:
        bot: The bot the cogs run on (its guilds are what retention walks).
        engine: The memory engine every call goes to.
    """

    def __init__(self, bot: commands.Bot, engine: MemoryEngine) -> None:
        self.bot = bot
        self.engine = engine
        self._write_pool = ThreadPoolExecutor(1, thread_name_prefix="memory-write")
        self._read_pool = ThreadPoolExecutor(2, thread_name_prefix="memory-read")
        self._search_pool = ThreadPoolExecutor(SEARCH_WORKERS, thread_name_prefix="memory-search")
        self._embed_pool = ThreadPoolExecutor(1, thread_name_prefix="memory-embed")
        self._search_slots = asyncio.Semaphore(SEARCH_WORKERS + SEARCH_QUEUE)
        self.writes = WriteQueue(self._write, given_up=functools.partial(_given_up, self))
        self.later = LaterTries(self.writes, self.spawn)  # deletions and edits given up
        self.shards = Shards.of(bot)
        self.guild_settings = SettingsCache(engine.storage.guilds, self.read)
        self.clock = DiscordClock()  # Discord's time, measured from the gateway
        self.gone = Gone()  # deleted on Discord while running: fetched pages leave them out
        self._embed_failures = 0
        self._stop_embedding = threading.Event()  # set at stop: embedding ends at its next chunk
        self._background: set[asyncio.Task] = set()
        self.follower = Follower(  # other processes' settings and profile changes
            engine.storage, read=self.read, profile_name=lambda: engine.profile.reference,
            drop_settings=self.guild_settings.drop_all, spawn=self.spawn,
            switch_profile=functools.partial(self.switch_profile, remember=False),
        )
        self.chat: ChatClient | None = make_chat_client(engine.profile)  # None without [llm]
        self.retractions = Retractions(bot, engine.storage.quotes, self.writes, self.read)

    # -- life cycle ------------------------------------------------------------------------

    def start(self) -> None:
        """Start the write queue, the embedding loop and the loop that follows other
        processes' changes (retention starts when the bot is ready)."""
        self.guild_settings.start()
        # What is alive now (modules, the loaded models) lives as long as the process:
        # frozen, the collector's full passes no longer walk it.  A full pass over it
        # holds the GIL 0.6-1 s, and one falling on a reranker's loading thread stalled
        # the event loop that long (issue 30, item 5).
        gc.freeze()
        self.writes.start()
        self._stop_embedding.clear()
        self.embed_backlog.start()
        self.follower.follow_changes.start()
        self.retractions.retract_loop.start()

    def owns(self, guild_id: int) -> bool:
        """Whether ``guild_id`` is this process's: its shard runs here (always, unsharded)."""
        return self.shards.owns(guild_id)

    def start_retention(self) -> None:
        """Start the hourly retention job, once."""
        if not self.enforce_retention.is_running():
            self.enforce_retention.start()

    def spawn(self, work: Coroutine[Any, Any, T], *, name: str | None = None) -> asyncio.Task[T]:
        """Run ``work`` in the background until it ends or the runtime stops."""
        task = asyncio.create_task(work, name=name)
        self._background.add(task)
        task.add_done_callback(self._background.discard)
        return task

    async def stop(self) -> None:
        """Finish queued writes, stop the loops and background work, release the threads.

        A backlog being embedded stops at its next chunk and stays pending (the next
        start embeds it), so stopping waits for one chunk, not the whole backlog.
        """
        self._stop_embedding.set()
        self.enforce_retention.cancel()
        self.embed_backlog.cancel()
        self.follower.follow_changes.cancel()
        self.retractions.retract_loop.cancel()
        for task in list(self._background):
            task.cancel()
        left = await self.writes.stop(SHUTDOWN_WRITES_S)
        # a write thread still busy with a batch (a locked database) is not waited for
        self._write_pool.shutdown(wait=not left, cancel_futures=True)
        if left := left + self.later.take():
            await _finish_at_stop(left, new=self.store_messages, order_free=self.order_free,
                                  guilds=self.engine.storage.guilds)
        await release_workers((self._search_pool, self._read_pool, self._embed_pool))
        if self.chat is not None:
            await asyncio.to_thread(self.chat.close)
        gc.unfreeze()  # what the bot held may be collected again (a process may start another)

    @property
    def order_free(self) -> tuple[Apply, ...]:
        """Edits, deletions, public answers' quotes: what the next start could not find."""
        return (self.store_edits, self.apply_edits, self.engine.forget_messages,
                self.forget_emptied, self.retractions.record_now,
                self.engine.forget_channels, self.forget_guilds)

    async def reload_chat(self) -> None:
        """Use the chat model of the engine's current profile (after a profile switch),
        made off the event loop (an HTTP client loads the certificates: 50-160 ms)."""
        new = await asyncio.to_thread(make_chat_client, self.engine.profile)
        old, self.chat = self.chat, new
        if old is not None:
            await asyncio.to_thread(old.close)

    async def switch_profile(self, profile: Profile, *, remember: bool = True) -> None:
        """Load ``profile``'s reranker in the background, swap it in, then its chat model.

        Args:
            profile: The profile to switch to.
            remember: Store the choice for every process (an owner's command); ``False``
                follows a choice another process stored.

        Raises:
            Exception: Whatever stopped the new reranker loading; the old profile stays.
        """
        await asyncio.wrap_future(self.engine.switch_profile(profile, remember=remember))
        await self.reload_chat()

    # -- worker threads --------------------------------------------------------------------

    async def _on(self, pool: ThreadPoolExecutor, fn: Callable[..., T], *args: Any) -> T:
        return await asyncio.get_running_loop().run_in_executor(
            pool, functools.partial(fn, *args)
        )

    async def _write(self, fn: Callable[[], None]) -> None:
        await self._on(self._write_pool, fn)

    async def read(self, fn: Callable[..., T], *args: Any) -> T:
        """Run a quick read-only engine call (settings, counts) off the event loop."""
        return await self._on(self._read_pool, fn, *args)

    async def search(self, request: SearchRequest) -> SearchResult:
        """Run an engine search on the search pool (at most a few at once)."""
        return await self.searching(self.engine.search, request)

    async def searching(self, fn: Callable[..., T], *args: Any) -> T:
        """Run a search-like engine call on the search pool, refusing when it is full.

        Raises:
            SearchInputError: Too many searches are running or waiting already.
        """
        if self._search_slots.locked():
            raise SearchInputError("the bot is busy with other searches; try again in a moment")
        async with self._search_slots:
            return await self._on(self._search_pool, fn, *args)

    async def embed_pending(self) -> int:
        """Embed the stored-but-unembedded messages on the embedding thread; how many."""
        embed = functools.partial(self.engine.embed_pending, stop=self._stop_embedding,
                                  chunk=EMBED_CHUNK_LIVE)
        return await self._on(self._embed_pool, embed)

    # -- the ordered write queue -----------------------------------------------------------

    def store_messages(self, records: list[MessageRecord]) -> None:
        """Store the new messages their guild's settings let the bot remember.

        Runs on the write thread, so the listener queues a message the moment its event
        arrives, with nothing awaited first that a stop could cut short.  The settings
        are those the listener would have read (:meth:`SettingsCache.read_now`).
        """
        split = self.guild_settings.remembered(records)
        self.engine.storage.messages.upsert(split.kept)
        if split.held:  # their settings cannot be read now: the next catch-up reads them
            self.engine.storage.guilds.mark_missed(
                (r.guild_id, r.channel_id, r.id) for r in split.held)
            log.warning("%d new messages held for the next catch-up: their server's "
                        "settings could not be read", len(split.held))

    def store_edits(self, records: list[MessageRecord]) -> None:
        """Apply edits: a message the settings let the bot remember is (re)stored; one
        they do not (or whose guild's settings cannot be read) is only updated where
        stored (or forgotten, if its author opted out)."""
        split = self.guild_settings.remembered(records)
        self.engine.storage.messages.upsert(split.kept)
        self.apply_edits([*split.others, *split.held])

    def apply_edits(self, records: list[MessageRecord]) -> None:
        """Apply edits to stored messages only (an edit in a channel no longer remembered).

        The stored copy is updated, or forgotten if its author opted out; a message
        never stored is not stored now.
        """
        self.engine.storage.messages.upsert(records, insert=False)

    def forget_emptied(self, edits: list[tuple[int, int]]) -> int:
        """Forget messages an edit left with nothing to store, ``(id, edit time)``: they
        still exist, so a later edit that puts text back stores them again, while an
        older copy (a stale page) does not bring back what was taken out."""
        return self.engine.forget_emptied(dict(edits))

    def forget_guilds(self, guild_ids: list[int]) -> None:
        """Forget every guild in ``guild_ids`` (the bot left them)."""
        for guild_id in guild_ids:
            self.engine.forget_guild(guild_id)

    async def in_order(self, fn: Callable[..., T], *args: Any) -> list[T]:
        """Run ``fn`` on the write queue, behind every write queued before it.

        Returns what each run returned: a batch retried while the database is busy
        runs it again (every engine write is one transaction, so a run either
        committed or changed nothing).  ``fn`` itself meeting a busy or full
        database is retried by the queue like any write, never answered as a refusal.

        Raises:
            MemoryBotError: The engine refused (at once: it is not worth retrying).
        """
        results: list[T] = []
        refused: list[MemoryBotError] = []

        def run() -> None:
            try:
                results.append(fn(*args))
            except (StorageBusy, DiskFullError):
                raise  # the queue retries these: the same call, once the database can take it
            except MemoryBotError as exc:
                refused.append(exc)

        await self.writes.run_and_wait(run)
        if refused:
            raise refused[-1]
        return results

    async def forget(self, fn: Callable[..., int], *args: Any) -> int:
        """Run a deletion behind every write queued before it; return what it really removed.

        A message captured just before ``/memory forget-me`` (or a purge) may still
        wait in the queue while the database is busy; in the same ordered queue it
        is stored first and then deleted, never stored after.  What each run of a
        retried batch removed is added up, so nothing is missed or counted twice.
        """
        return sum(await self.in_order(fn, *args))

    # -- settings --------------------------------------------------------------------------

    async def update_settings(self, guild_id: int, **changes: Any) -> GuildSettings:
        """Change a guild's settings in the write queue (retried while the database is busy)
        and cache the result (:attr:`guild_settings`)."""
        settings = (await self.in_order(
            lambda: self.engine.storage.guilds.update_settings(guild_id, **changes)))[-1]
        self.guild_settings.keep(guild_id, settings)
        return settings

    async def remembers(self, message: discord.Message) -> bool:
        """Whether this guild's settings let the bot store ``message``."""
        if message.guild is None:
            return False
        self.clock.seen(message)
        settings = await self.guild_settings.get(message.guild.id)
        channel = message.channel
        parent_id = channel.parent_id if isinstance(channel, discord.Thread) else None
        return settings.remembers_channel(channel.id, parent_id) and settings.remembers_author(
            message.author.id
        )

    # -- background loops ------------------------------------------------------------------

    @tasks.loop(seconds=EMBED_INTERVAL_S)
    async def embed_backlog(self) -> None:
        """Embed stored-but-unembedded messages; any failure is logged and retried later."""
        try:
            await self.embed_pending()
            self._embed_failures = 0
        except EmbeddingModelChanged as exc:  # no vector of this model fits any more
            log.error("embedding stopped until the bot restarts: %s", exc)
            self.embed_backlog.stop()
        except Exception as exc:
            self._embed_failures += 1
            pause = min(EMBED_INTERVAL_S * 2 ** self._embed_failures, EMBED_BACKOFF_MAX_S)
            log.error("embedding the backlog failed (%s); trying again in %.0f s", exc, pause,
                      exc_info=not isinstance(exc, MemoryBotError))
            await asyncio.sleep(pause)

    @tasks.loop(hours=RETENTION_INTERVAL_H)
    async def enforce_retention(self) -> None:
        """Purge messages older than each guild's retention period.

        The guilds are the bot's cached ones: with shards, those of this process's shards.
        """
        for guild in list(self.bot.guilds):
            try:
                settings = await self.guild_settings.get(guild.id)
                if settings.retention_days:
                    removed = await self.forget_older_than(guild.id, settings.retention_days)
                    if removed:
                        log.info("retention: forgot %d messages in guild %d", removed, guild.id)
            except Exception:
                log.exception("retention pass failed for guild %d", guild.id)

    async def forget_older_than(self, guild_id: int, days: int) -> int:
        """Forget a guild's messages older than ``days``, in order with the queued writes.

        Counted from Discord's clock as measured from the gateway where a message was
        seen (:attr:`clock`), never from a host clock ahead of it.
        """
        expire = functools.partial(self.engine.forget_expired,
                                   discord_now_ms=self.clock.now_ms())
        return await self.forget(expire, guild_id, days)


def _given_up(runtime: MemoryRuntime, writes: list[Write]) -> None:
    """What the write queue gave up on is not dropped.  Edits and deletions go back into
    the queue later (:class:`LaterTries`).  New messages are marked for the next
    catch-up, which reads them from Discord again: without a mark it reads only after
    the newest message stored, and the messages stored after them would hide them.  The
    mark is a write in the queue too, left out where their place is gone by then (the
    bot left, the channel was deleted: their marks went with it)."""
    # not a guild's forget: run later, it would wipe what the bot stored since it was invited
    # back (a start's reconcile forgets a guild the bot is no longer in)
    runtime.later.add([w for w in writes
                       if w.apply in runtime.order_free and w.apply != runtime.forget_guilds])
    records = [r for w in writes if w.apply == runtime.store_messages for r in w.items]
    if not records:
        return
    log.warning("marking %d messages given up for the next catch-up: %s",
                len(records), [r.id for r in records])
    guilds, gone = runtime.engine.storage.guilds, runtime.gone

    def mark_missed(given_up: list[MessageRecord]) -> None:
        guilds.mark_missed((r.guild_id, r.channel_id, r.id) for r in gone.present(given_up))

    runtime.writes.put(mark_missed, records)


async def _finish_at_stop(
    left: list[Write], *, new: Apply, order_free: tuple[Apply, ...], guilds: Guilds
) -> None:
    """Writes left unapplied at stop, within :data:`SHUTDOWN_MARKS_S`, on a thread of
    their own (the write thread may be stuck on its batch).

    New messages are marked for the next start's catch-up, which reads them from
    Discord.  Then deletions, edits and public answers' quotes are applied, each alone:
    their order against the stuck batch does not matter (tombstones and edit times
    decide what a later store may do; an answer recorded after a message it quotes
    went is due at once), and the next start could not find them again (its reconcile reads
    only recent messages, and an edit of an old message would send the catch-up back
    to it).  What could not be done, and any other write left, is said by id at ERROR.

    Args:
        new: The write that stores new messages.
        order_free: The writes applied here (edits and deletions).
        guilds: Where the missed marks go.
    """
    now = [w for w in left if w.apply in order_free]
    missed = [(r.guild_id, r.channel_id, r.id) for w in left if w.apply == new for r in w.items]
    others = [w for w in left if w.apply != new and w.apply not in order_free]
    if others:
        log.error("stopped with these writes not applied: %s", describe(others))
    if not now and not missed:
        return
    marked = threading.Event()
    done: list[int] = []  # positions in ``now`` applied

    def finish() -> None:
        if missed:  # first: a mark takes no guild lock that a stuck batch may hold
            guilds.mark_missed(missed)
            marked.set()
        for i, write in enumerate(now):  # each alone: one refused does not cost the others
            try:
                apply_in_order([write])
                done.append(i)
            except Exception as exc:
                log.error("could not apply at stop: %s (%s)", describe([write]), exc)

    try:
        await asyncio.wait_for(asyncio.wrap_future(_in_daemon_thread(finish)), SHUTDOWN_MARKS_S)
    except Exception as exc:  # a timeout or the database's own error: the log is all left
        log.error("the stop could not finish its writes (%s)", exc)
    if missed and marked.is_set():
        log.warning("stopped before storing %d messages; the next start's catch-up reads them: %s",
                    len(missed), [m for _, _, m in missed])
    elif missed:
        log.error("stopped before storing %d messages and could not mark them for the catch-up; "
                  "their (channel, message) ids: %s", len(missed), [(c, m) for _, c, m in missed])
    finished = set(done)  # a list: safe to read while the thread may still append
    if applied := [w for i, w in enumerate(now) if i in finished]:
        log.warning("applied at stop, after the write queue: %s", describe(applied))
    if undone := [w for i, w in enumerate(now) if i not in finished]:
        log.error("stopped with these edits and deletions not applied: %s", describe(undone))


async def release_workers(pools: Sequence[ThreadPoolExecutor]) -> None:
    """Stop these pools' threads, waiting off the event loop (up to
    :data:`SHUTDOWN_WORKERS_S`) for work still running: a rerank or a chunk stuck behind
    another process's lock holds up nothing else.  What is given up writes nothing a
    restart does not redo (reads; a claimed chunk stays pending)."""
    for pool in pools:
        pool.shutdown(wait=False, cancel_futures=True)

    def join() -> None:
        for pool in pools:
            pool.shutdown(wait=True)

    try:
        await asyncio.wait_for(asyncio.wrap_future(_in_daemon_thread(join)), SHUTDOWN_WORKERS_S)
    except TimeoutError:
        log.warning("stopped without waiting for a search, read or embedding still running")


def _in_daemon_thread(fn: Callable[..., T], *args: Any) -> Future[T]:
    """Run ``fn`` on a daemon thread of its own: one stuck on a locked database never
    holds up the process's exit."""
    future: Future[T] = Future()

    def run() -> None:
        if not future.set_running_or_notify_cancel():
            return  # given up on before it began
        try:
            future.set_result(fn(*args))
        except BaseException as exc:
            future.set_exception(exc)

    threading.Thread(target=run, daemon=True, name="memory-mark-missed").start()
    return future
