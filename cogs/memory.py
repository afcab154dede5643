"""The memory cog: Discord glue around :class:`memory.engine.MemoryEngine`.

It captures guild messages as they arrive (edits, deletes and removed channels
too), embeds the backlog in the background, and serves members through ``/search``,
the "Find related messages" context menu, the ``/memory`` group and mention
replies; admins get ``/memory-admin`` and the bot owner ``/memory-owner``.

Three rules hold everywhere:

* A search made for a member only sees channels that member can read now
  (:mod:`cogs.permissions`), and a reply others will read only quotes sources
  everyone in the reply channel can read.
* Every engine call runs on the cog's own worker threads: writes on one thread
  behind a retrying queue (:mod:`cogs.capture`), searches on a small capped pool,
  embedding on its own, so a slow rerank never delays storing a message and the
  event loop never waits on SQLite, torch or HTTP.
* Errors reach the member as one short line, never silence; unexpected ones are
  logged with a trace id the member can quote (:mod:`cogs.errors`: the bot's
  command tree answers failed commands, :func:`cogs.errors.answering` mentions).
"""

from __future__ import annotations

import asyncio
import functools
import logging
import threading
import time
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from dataclasses import replace
from datetime import datetime, timedelta, timezone
from typing import TYPE_CHECKING, Any, TypeVar
from urllib.parse import urlsplit

import discord
from discord import app_commands
from discord.ext import commands, tasks

from cogs import answers
from cogs.backfill import Backfiller
from cogs.capture import Write, WriteQueue, record_from_message
from cogs.errors import answering
from cogs.permissions import StoredThread, public_reply_sources, readable_channel_ids
from cogs.reconcile import Reconciler
from cogs.render import inert, render_hits
from memory.config import available_profiles, load_profile
from memory.context import Context
from memory.errors import EmbeddingModelChanged, MemoryBotError, SearchInputError
from memory.records import SearchResult
from memory.search import SearchRequest
from memory.settings import AUTORESPONSE_MODES, CHANNEL_MODES, GuildSettings

if TYPE_CHECKING:
    from memory.engine import MemoryEngine

log = logging.getLogger(__name__)

T = TypeVar("T")

EMBED_INTERVAL_S = 5.0
EMBED_BACKOFF_MAX_S = 300.0
RETENTION_INTERVAL_H = 1.0
SETTINGS_TTL_S = 60.0
SEARCH_WORKERS = 2  # searches running at once; more wait their turn on the event loop
SEARCH_QUEUE = 8  # searches waiting before new ones are turned away
MENTION_COOLDOWN_S = 10.0
SHUTDOWN_WRITES_S = 10.0

PRIVACY_NOTICE = """\
**What this bot remembers**
• The text, attachment names, author, channel and time of messages in this server's \
channels it can read (admins choose which channels with `/memory-admin channels`).
• Nothing from DMs. Nothing from members who used `/memory opt-out`.

**Who can find it**
• A search only ever shows messages from channels *you* can read right now.
• Public answers only quote channels everyone in that channel can read.

**How it goes away**
• Deleting a message on Discord deletes it here (text, search index and vectors).
• Editing a stored message updates it here, even in a channel no longer remembered; \
after `/memory opt-out` an edit deletes the stored copy instead.
• `/memory forget-me` deletes all your messages and your name from this server's memory, \
including ones still being saved, and stops storing you (a backfill or import too) until \
`/memory opt-in`.
• `/memory opt-out` stops storing your new messages; `/memory opt-in` resumes.
• Deleted channels and threads are forgotten; when the bot leaves, the server is forgotten.
• Admins may set a retention period (`/memory-admin retention`) and purge channels."""


def _parse_day(value: str | None, name: str) -> datetime | None:
    if value is None:
        return None
    try:
        day = datetime.strptime(value.strip(), "%Y-%m-%d")
    except ValueError:
        raise SearchInputError(f"{name} must be a date like 2026-01-31, not {value!r}") from None
    return day.replace(tzinfo=timezone.utc)


def _mentions_bot(message: discord.Message, bot_id: int) -> bool:
    """Whether the text itself mentions the bot (a reply's automatic ping does not count)."""
    return f"<@{bot_id}>" in message.content or f"<@!{bot_id}>" in message.content


class MemoryCog(commands.Cog):
    """Remembers guild messages and answers questions about them."""

    memory = app_commands.Group(
        name="memory", description="What the bot remembers about you and this server",
        guild_only=True,
    )
    admin = app_commands.Group(
        name="memory-admin", description="Manage what the bot remembers in this server",
        guild_only=True, default_permissions=discord.Permissions(manage_guild=True),
    )
    admin_channels = app_commands.Group(
        name="channels", description="Which channels are remembered", parent=admin,
    )
    owner = app_commands.Group(
        name="memory-owner", description="Bot-wide settings (bot owner only)",
        guild_only=True, default_permissions=discord.Permissions(administrator=True),
    )

    def __init__(
        self, bot: commands.Bot, engine: MemoryEngine, *, owner_ids: frozenset[int] = frozenset()
    ) -> None:
        self.bot = bot
        self.engine = engine
        self.owner_ids = frozenset(owner_ids)
        self._write_pool = ThreadPoolExecutor(1, thread_name_prefix="memory-write")
        self._read_pool = ThreadPoolExecutor(2, thread_name_prefix="memory-read")
        self._search_pool = ThreadPoolExecutor(SEARCH_WORKERS, thread_name_prefix="memory-search")
        self._embed_pool = ThreadPoolExecutor(1, thread_name_prefix="memory-embed")
        self._search_slots = asyncio.Semaphore(SEARCH_WORKERS + SEARCH_QUEUE)
        self.writes = WriteQueue(self._apply_writes, self._write)
        self.backfill = Backfiller(self)
        self.reconciler = Reconciler(self)
        self._settings: dict[int, tuple[float, GuildSettings]] = {}
        self._mention_cooldown = commands.CooldownMapping.from_cooldown(
            1, MENTION_COOLDOWN_S, commands.BucketType.member
        )
        self._embed_failures = 0
        self._stop_embedding = threading.Event()  # set at unload: embedding ends at its next chunk
        self.chat = answers.make_chat_client(engine.profile)  # None without an [llm] section
        self.find_related_menu = app_commands.ContextMenu(
            name="Find related messages", callback=self.find_related
        )
        self.find_related_menu.guild_only = True

    # -- life cycle ------------------------------------------------------------------------

    async def cog_load(self) -> None:
        """Start the write queue and the background loops."""
        self.bot.tree.add_command(self.find_related_menu)
        self.writes.start()
        self._stop_embedding.clear()
        self.embed_backlog.start()

    async def cog_unload(self) -> None:
        """Finish queued writes, stop the loops, release the worker threads.

        A backlog being embedded stops at its next chunk and stays pending (the next
        start embeds it), so shutdown waits for one chunk, not the whole backlog.
        """
        self._stop_embedding.set()
        self.bot.tree.remove_command(
            self.find_related_menu.name, type=self.find_related_menu.type
        )
        self.enforce_retention.cancel()
        self.embed_backlog.cancel()
        self.backfill.cancel()
        self.reconciler.cancel()
        await self.writes.stop(SHUTDOWN_WRITES_S)
        for pool in (self._search_pool, self._read_pool, self._embed_pool, self._write_pool):
            pool.shutdown(wait=True, cancel_futures=True)
        if self.chat is not None:
            self.chat.close()

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

    def _apply_writes(self, batch: list[Write]) -> None:
        """Apply a batch from the write queue, in order (runs on the write thread)."""
        actions: dict[str, Callable[[list], object]] = {
            "upsert": self.engine.upsert,
            "edit": self.engine.apply_edits,
            "delete": self.engine.delete,
            "purge_channels": self.engine.purge_channels,
            "purge_guilds": lambda ids: [self.engine.purge_guild(g) for g in ids],
            "call": lambda calls: [call() for call in calls],
        }
        run: list[Write] = []
        for write in [*batch, None]:
            if run and (write is None or write.kind != run[0].kind):
                actions[run[0].kind]([item for w in run for item in w.items])
                run = []
            if write is not None:
                run.append(write)

    async def _in_order(self, fn: Callable[..., T], *args: Any) -> list[T]:
        """Run ``fn`` on the write queue, behind every write queued before it.

        Returns what each run returned: a batch retried while the database is busy
        runs it again (every engine write is one transaction, so a run either
        committed or changed nothing).

        Raises:
            MemoryBotError: The engine refused (at once: it is not worth retrying).
        """
        results: list[T] = []
        refused: list[MemoryBotError] = []

        def run() -> None:
            try:
                results.append(fn(*args))
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
        return sum(await self._in_order(fn, *args))

    # -- settings --------------------------------------------------------------------------

    async def settings(self, guild_id: int) -> GuildSettings:
        """This guild's settings, cached for a minute (changes made here apply at once)."""
        cached = self._settings.get(guild_id)
        if cached is not None and time.monotonic() - cached[0] < SETTINGS_TTL_S:
            return cached[1]
        try:
            settings = await self.read(self.engine.settings, guild_id)
        except Exception as exc:  # never drop a message over a settings read
            log.warning("reading guild %d settings failed (%s); using the last known", guild_id, exc)
            # opt-outs are enforced again where messages are written
            return cached[1] if cached is not None else GuildSettings(guild_id)
        self._settings[guild_id] = (time.monotonic(), settings)
        return settings

    async def _update_settings(self, guild_id: int, **changes: Any) -> GuildSettings:
        # in the write queue: retried while the database is busy, in order with the writes
        settings = (await self._in_order(lambda: self.engine.update_settings(guild_id, **changes)))[-1]
        self._settings[guild_id] = (time.monotonic(), settings)
        return settings

    # -- background loops ------------------------------------------------------------------

    @tasks.loop(seconds=EMBED_INTERVAL_S)
    async def embed_backlog(self) -> None:
        """Embed stored-but-unembedded messages; any failure is logged and retried later."""
        try:
            await self._on(self._embed_pool, functools.partial(
                self.engine.embed_pending, stop=self._stop_embedding))
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
        """Purge messages older than each guild's retention period."""
        for guild in list(self.bot.guilds):
            try:
                settings = await self.settings(guild.id)
                if settings.retention_days:
                    cutoff = datetime.now(timezone.utc) - timedelta(days=settings.retention_days)
                    removed = await self.forget(self.engine.purge_older_than, guild.id, cutoff)
                    if removed:
                        log.info("retention: forgot %d messages in guild %d", removed, guild.id)
            except Exception:
                log.exception("retention pass failed for guild %d", guild.id)

    # -- capture ---------------------------------------------------------------------------

    async def remembers(self, message: discord.Message) -> bool:
        """Whether this guild's settings let the bot store ``message``."""
        if message.guild is None:
            return False
        settings = await self.settings(message.guild.id)
        channel = message.channel
        parent_id = channel.parent_id if isinstance(channel, discord.Thread) else None
        return settings.remembers_channel(channel.id, parent_id) and settings.remembers_author(
            message.author.id
        )

    @commands.Cog.listener()
    async def on_message(self, message: discord.Message) -> None:
        """Store the message; answer from memory when the bot is mentioned."""
        me = self.bot.user
        if message.guild is None or (me is not None and message.author.id == me.id):
            return
        record = record_from_message(message)
        if record is not None and await self.remembers(message):
            self.writes.put("upsert", [record])
        if me is not None and not message.author.bot and _mentions_bot(message, me.id):
            await self._maybe_answer(message)

    @commands.Cog.listener()
    async def on_raw_message_edit(self, payload: discord.RawMessageUpdateEvent) -> None:
        """Re-store an edited message (text, FTS and vector are refreshed)."""
        message = payload.message
        if self.bot.user is not None and message.author.id == self.bot.user.id:
            return
        record = record_from_message(message)
        if record is None:
            return
        # an edit of a stored message is always applied: where a new message would not
        # be stored, the stored copy is updated (or forgotten, if its author opted out)
        self.writes.put("upsert" if await self.remembers(message) else "edit", [record])

    @commands.Cog.listener()
    async def on_raw_message_delete(self, payload: discord.RawMessageDeleteEvent) -> None:
        """Forget a deleted message everywhere."""
        self.writes.put("delete", [payload.message_id])

    @commands.Cog.listener()
    async def on_raw_bulk_message_delete(self, payload: discord.RawBulkMessageDeleteEvent) -> None:
        """Forget bulk-deleted messages everywhere."""
        self.writes.put("delete", sorted(payload.message_ids))

    @commands.Cog.listener()
    async def on_guild_channel_delete(self, channel: discord.abc.GuildChannel) -> None:
        """Forget a deleted channel's messages and its threads'."""
        self.writes.put("purge_channels", [channel.id])

    @commands.Cog.listener()
    async def on_raw_thread_delete(self, payload: discord.RawThreadDeleteEvent) -> None:
        """Forget a deleted thread's messages."""
        self.writes.put("purge_channels", [payload.thread_id])

    @commands.Cog.listener()
    async def on_guild_remove(self, guild: discord.Guild) -> None:
        """The bot left (or was removed from) a guild: forget everything from it."""
        self._settings.pop(guild.id, None)
        self.writes.put("purge_guilds", [guild.id])

    @commands.Cog.listener()
    async def on_ready(self) -> None:
        """Start the retention job; catch up on what was said and deleted while the bot was away."""
        if not self.enforce_retention.is_running():
            self.enforce_retention.start()
        self.reconciler.start_once(after=self.backfill.catch_up_once())

    # -- searching for members ---------------------------------------------------------------

    async def allowed_channels(
        self,
        member: discord.Member,
        reply_channel: discord.abc.GuildChannel | discord.Thread | None = None,
    ) -> frozenset[int]:
        """The channel ids a search for ``member`` may look in.

        With ``reply_channel`` (a reply others will read), only sources everyone who
        can read that channel can read too.
        """
        readable, safe = await self._scopes(member, reply_channel)
        return readable if safe is None else safe

    async def _scopes(
        self, member: discord.Member, reply_channel: discord.abc.GuildChannel | discord.Thread | None
    ) -> tuple[frozenset[int], frozenset[int] | None]:
        """What ``member`` can read, and what a reply in ``reply_channel`` may quote (if any)."""
        rows = await self.read(self.engine.store.threads, member.guild.id)
        threads = [StoredThread(*row) for row in rows]
        readable = readable_channel_ids(member, threads)
        if reply_channel is None:
            return readable, None
        return readable, public_reply_sources(reply_channel, readable, threads)

    async def member_search(
        self,
        member: discord.Member,
        request: SearchRequest,
        *,
        reply_channel: discord.abc.GuildChannel | discord.Thread | None = None,
    ) -> tuple[SearchResult, int]:
        """Search as ``member`` sees the server; returns the result and how many were withheld.

        With ``reply_channel`` the answer is public: sources not everyone there can read
        are left out, and a second, cheaper search (no reranking) counts how many of
        the member's own top results that withheld.
        """
        readable, public = await self._scopes(member, reply_channel)
        safe = readable if public is None else public
        request = replace(request, guild_id=member.guild.id)
        result = await self.search(replace(request, allowed_channel_ids=safe))
        return result, await self._withheld(request, readable, safe)

    async def _withheld(
        self, request: SearchRequest, readable: frozenset[int], safe: frozenset[int]
    ) -> int:
        """How many of the member's own top hits a public reply leaves out (a cheap search)."""
        if safe == readable:
            return 0
        wider = await self.search(replace(request, allowed_channel_ids=readable, rerank=False))
        return sum(1 for hit in wider.hits if hit.channel_id not in safe)

    async def search(self, request: SearchRequest) -> SearchResult:
        """Run an engine search on the search pool (at most a few at once)."""
        return await self._searching(self.engine.search, request)

    async def _searching(self, fn: Callable[..., T], *args: Any) -> T:
        """Run a search-like engine call on the search pool, refusing when it is full."""
        if self._search_slots.locked():
            raise SearchInputError("the bot is busy with other searches; try again in a moment")
        async with self._search_slots:
            return await self._on(self._search_pool, fn, *args)

    async def _maybe_answer(self, message: discord.Message) -> None:
        if message.guild is None:
            return
        settings = await self.settings(message.guild.id)
        channel = message.channel
        parent_id = channel.parent_id if isinstance(channel, discord.Thread) else None
        if not settings.answers_in(channel.id, parent_id):
            return
        if self._mention_cooldown.update_rate_limit(message):
            log.debug("mention from %s ignored: cooldown", message.author.id)
            return
        await self.answer_mention(message)

    async def answer_mention(self, message: discord.Message) -> None:
        """Reply publicly: the chat model's grounded answer, or the list of hits without one.

        Only messages everyone in the reply's channel can read are searched.
        """
        place = _place(message.channel)
        question = answers.question_text(message)
        if not question or not isinstance(message.author, discord.Member) or place is None:
            return
        async with answering(message, "mention reply"):
            readable, public = await self._scopes(message.author, place)
            safe = readable if public is None else public
            probe = SearchRequest(queries=(question[:answers.MAX_QUERY_CHARS],),
                                  limit=answers.CONTEXT_LIMIT)
            withheld = await self._withheld(replace(probe, guild_id=message.author.guild.id),
                                            readable, safe)
            await answers.answer_mention(message, self.engine, self.chat, allowed_channel_ids=safe,
                                         question=question, withheld=withheld, run=self._searching)

    async def context_for(
        self,
        message_or_interaction: discord.Message | discord.Interaction,
        query: str | None = None,
        *,
        private: bool = False,
        budget_tokens: int | None = None,
    ) -> Context:
        """Conversations memory holds about a question, for other cogs' answers.

        Limited to what the asking member can read and, unless ``private`` (the
        answer goes only to that member), to what everyone who can read the
        channel it was asked in can read: the answer is assumed to be public there.

        Args:
            message_or_interaction: The question's message (its text is the query
                unless ``query`` is given) or an interaction (pass ``query``).
            query: The question.
            private: The caller will show the answer only to the asking member.
            budget_tokens: Token budget of the quoted history (the profile's by default).

        Raises:
            SearchInputError: Outside a server, no question, or a channel whose
                readers cannot be judged for a public answer.
        """
        source = message_or_interaction
        member = source.author if isinstance(source, discord.Message) else source.user
        if not isinstance(member, discord.Member):
            raise SearchInputError("memory context is only available inside a server")
        place = _place(source.channel)
        if place is None and not private:
            raise SearchInputError("cannot tell who reads this channel; ask with private=True")
        readable, public = await self._scopes(member, None if private else place)
        return await answers.context_for(
            self.engine, source, query, allowed_channel_ids=readable if public is None else public,
            budget_tokens=budget_tokens, run=self._searching,
        )

    # -- slash commands for members ----------------------------------------------------------

    @app_commands.command(name="search", description="Search this server's message history")
    @app_commands.describe(
        query="What to look for", channel="Only this channel (and its threads)",
        author="Only messages by this member", after="Only after this day (YYYY-MM-DD)",
        before="Only before this day (YYYY-MM-DD)", limit="How many results (1-10)",
        private="Only you see the answer (default: yes)",
    )
    @app_commands.guild_only()
    @app_commands.checks.cooldown(3, 15.0, key=lambda i: (i.guild_id, i.user.id))
    async def search_command(
        self,
        interaction: discord.Interaction,
        query: app_commands.Range[str, 1, 500],
        # a thread comes as Discord describes it: archived ones are not in discord.py's
        # cache, and only the id is needed (the allow-list judges who may read it)
        channel: discord.TextChannel | app_commands.AppCommandThread | discord.VoiceChannel
        | discord.ForumChannel | None = None,
        author: discord.Member | None = None,
        after: str | None = None,
        before: str | None = None,
        limit: app_commands.Range[int, 1, 10] = 5,
        private: bool = True,
    ) -> None:
        """Run a memory search and show the hits with jump links."""
        request = SearchRequest(
            queries=(query,), limit=limit,
            channel_ids=(channel.id,) if channel else None,
            author_ids=(author.id,) if author else None,
            after=_parse_day(after, "after"), before=_parse_day(before, "before"),
        )
        place = _place(interaction.channel)
        if place is None:
            private = True  # who reads this channel cannot be judged: answer only the member
        await interaction.response.defer(ephemeral=private, thinking=True)
        result, withheld = await self.member_search(
            _member(interaction), request, reply_channel=None if private else place
        )
        await interaction.followup.send(
            embed=render_hits(result, f"🔎 {query}", interaction.guild, withheld=withheld),
            ephemeral=private, allowed_mentions=discord.AllowedMentions.none(),
        )

    async def find_related(self, interaction: discord.Interaction, message: discord.Message) -> None:
        """Context menu: messages related to this one, shown only to the member."""
        query = message.content.strip()
        if not query:
            await interaction.response.send_message(
                "That message has no text to search with.", ephemeral=True)
            return
        await interaction.response.defer(ephemeral=True, thinking=True)
        request = SearchRequest(queries=(query[:500],), limit=6)
        result, _ = await self.member_search(_member(interaction), request)
        result.hits = [h for h in result.hits if h.id != message.id][:5]
        await interaction.followup.send(
            embed=render_hits(result, "Related messages", interaction.guild), ephemeral=True,
            allowed_mentions=discord.AllowedMentions.none(),
        )

    @memory.command(name="stats", description="How much the bot remembers from this server")
    async def memory_stats(self, interaction: discord.Interaction) -> None:
        """Counts for this guild's channels the member can read, theirs, the backlog, the profile."""
        await interaction.response.defer(ephemeral=True, thinking=True)
        readable = await self.allowed_channels(_member(interaction))
        stats = await self.read(self.engine.guild_stats, _guild_id(interaction), interaction.user.id,
                                readable)
        settings = await self.settings(_guild_id(interaction))
        lines = [
            f"Messages you can search here: **{stats.messages}** in {stats.channels} channels and threads",
            f"Your messages: **{stats.member_messages}**"
            + ("" if settings.remembers_author(interaction.user.id)
               else " (you opted out: new ones are not stored)"),
            f"Waiting to be embedded: {stats.pending}",
            f"Channels remembered: {settings.channel_mode}"
            + (f" ({len(settings.channels)} listed)" if settings.channel_mode != "all" else ""),
            f"Retention: {f'{settings.retention_days} days' if settings.retention_days else 'until deleted'}",
            f"Hardware profile: {self.engine.rerankers.profile_name}",
        ]
        await interaction.followup.send("\n".join(lines), ephemeral=True)

    @memory.command(name="forget-me", description="Delete all your messages from this server's memory")
    async def forget_me(self, interaction: discord.Interaction) -> None:
        """Delete every stored message by the member in this guild."""
        await interaction.response.defer(ephemeral=True, thinking=True)
        guild_id = _guild_id(interaction)
        removed = await self.forget(self.engine.forget_member, guild_id, interaction.user.id)
        self._settings.pop(guild_id, None)  # the member is opted out now
        await interaction.followup.send(
            f"Deleted {removed} of your messages from my memory of this server. Your new "
            "messages here are not stored either until you use `/memory opt-in`.", ephemeral=True)

    @memory.command(name="opt-out", description="Stop storing your messages in this server")
    async def opt_out(self, interaction: discord.Interaction) -> None:
        """Stop storing the member's messages (what is stored stays until forget-me)."""
        await self._update_settings(_guild_id(interaction), opt_out=interaction.user.id)
        await interaction.response.send_message(
            "Your new messages here will not be stored. `/memory forget-me` deletes the ones "
            "already stored; `/memory opt-in` starts storing again.", ephemeral=True)

    @memory.command(name="opt-in", description="Store your messages in this server again")
    async def opt_in(self, interaction: discord.Interaction) -> None:
        """Undo opt-out."""
        await self._update_settings(_guild_id(interaction), opt_in=interaction.user.id)
        await interaction.response.send_message("Your new messages here will be stored again.",
                                                ephemeral=True)

    @memory.command(name="privacy", description="What the bot stores and how to remove it")
    async def privacy(self, interaction: discord.Interaction) -> None:
        """The privacy notice, naming the chat model's host when answers use one."""
        notice = PRIVACY_NOTICE
        llm = self.engine.profile.llm
        if self.chat is not None:
            host = urlsplit(llm.base_url).hostname or "?"
            notice += ("\n\n**Answers**\n• Mention answers are written by a chat model "
                       f"(`{inert(llm.model, 60)}` at `{inert(host, 80)}`): the messages quoted "
                       "to answer a question are sent to it.")
        service = self.engine.rerankers.current()
        reranker_host = getattr(service.backend, "host", None) if service else None
        if service is not None and reranker_host:  # a remote reranker: rerank-api, llm
            notice += ("\n\n**Search**\n• Searches are reranked by a remote service "
                       f"(`{inert(service.name, 40)}` at `{inert(reranker_host, 80)}`): each "
                       "search's question and candidate messages are sent to it.")
        await interaction.response.send_message(notice, ephemeral=True)

    # -- admin commands ----------------------------------------------------------------------

    @admin.command(name="backfill", description="Read past messages into memory")
    @app_commands.describe(channel="Only this channel and its threads (default: every channel)")
    @app_commands.checks.has_permissions(manage_guild=True)
    async def admin_backfill(
        self, interaction: discord.Interaction,
        channel: discord.TextChannel | discord.Thread | discord.VoiceChannel
        | discord.ForumChannel | None = None,
    ) -> None:
        """Backfill history with a progress message edited in place."""
        await self.backfill.command(interaction, channel)

    @admin.command(name="reconcile", description="Forget what was deleted on Discord while the bot was away")
    @app_commands.checks.has_permissions(manage_guild=True)
    async def admin_reconcile(self, interaction: discord.Interaction) -> None:
        """Check stored channels and recent messages against Discord, with progress."""
        await self.reconciler.command(interaction)

    @admin.command(name="retention", description="Forget messages older than this many days")
    @app_commands.describe(days="Days to keep messages; 0 keeps them until deleted")
    @app_commands.checks.has_permissions(manage_guild=True)
    async def admin_retention(
        self, interaction: discord.Interaction, days: app_commands.Range[int, 0, 36500]
    ) -> None:
        """Set the retention period; the hourly job (and this command) purges older messages."""
        await interaction.response.defer(ephemeral=True, thinking=True)
        await self._update_settings(_guild_id(interaction), retention_days=days or None)
        removed = 0
        if days:
            cutoff = datetime.now(timezone.utc) - timedelta(days=days)
            removed = await self.forget(self.engine.purge_older_than, interaction.guild_id, cutoff)
        text = f"Messages are kept for {days} days" if days else "Messages are kept until deleted"
        await interaction.followup.send(f"{text}; {removed} older messages forgotten now.",
                                        ephemeral=True)

    @admin.command(name="purge-channel", description="Forget everything stored from a channel")
    @app_commands.describe(channel="The channel (its threads are forgotten too)")
    @app_commands.checks.has_permissions(manage_guild=True)
    async def admin_purge_channel(
        self, interaction: discord.Interaction,
        channel: discord.TextChannel | discord.Thread | discord.VoiceChannel | discord.ForumChannel,
    ) -> None:
        """Delete a channel's and its threads' stored messages."""
        await interaction.response.defer(ephemeral=True, thinking=True)
        removed = await self.forget(self.engine.purge_channels, [channel.id])
        await interaction.followup.send(
            f"Forgot {removed} messages from {channel.mention} and its threads.", ephemeral=True)

    @admin.command(name="autoresponse", description="When the bot answers mentions")
    @app_commands.describe(mode="off, mention (everywhere) or channels (only listed ones)",
                           channel="With mode channels: add or remove this channel")
    @app_commands.choices(mode=[app_commands.Choice(name=m, value=m) for m in AUTORESPONSE_MODES])
    @app_commands.checks.has_permissions(manage_guild=True)
    async def admin_autoresponse(
        self, interaction: discord.Interaction, mode: str,
        channel: discord.TextChannel | discord.Thread | discord.VoiceChannel | None = None,
    ) -> None:
        """Switch mention answers off, on everywhere, or on in chosen channels."""
        settings = await self._update_settings(
            _guild_id(interaction), autoresponse=mode,
            toggle_autoresponse_channel=channel.id if channel else None,
        )
        where = ", ".join(f"<#{c}>" for c in sorted(settings.autoresponse_channels)) or "none yet"
        text = {"off": "I will not answer mentions.", "mention": "I answer mentions everywhere.",
                "channels": f"I answer mentions in: {where}."}[settings.autoresponse]
        await interaction.response.send_message(text, ephemeral=True)

    @admin_channels.command(name="show", description="Which channels are remembered")
    @app_commands.checks.has_permissions(manage_guild=True)
    async def channels_show(self, interaction: discord.Interaction) -> None:
        """Show the channel mode and list."""
        settings = await self.settings(_guild_id(interaction))
        await interaction.response.send_message(self._describe_channels(settings), ephemeral=True)

    @admin_channels.command(name="mode", description="Remember all, only listed, or all but listed channels")
    @app_commands.choices(mode=[app_commands.Choice(name=m, value=m) for m in CHANNEL_MODES])
    @app_commands.checks.has_permissions(manage_guild=True)
    async def channels_mode(self, interaction: discord.Interaction, mode: str) -> None:
        """Set how the channel list is read."""
        settings = await self._update_settings(_guild_id(interaction), channel_mode=mode)
        await interaction.response.send_message(self._describe_channels(settings), ephemeral=True)

    @admin_channels.command(name="add", description="Add a channel to the list")
    @app_commands.checks.has_permissions(manage_guild=True)
    async def channels_add(
        self, interaction: discord.Interaction,
        channel: discord.TextChannel | discord.VoiceChannel | discord.ForumChannel | discord.Thread,
    ) -> None:
        """Add a channel to the include/exclude list."""
        settings = await self._update_settings(_guild_id(interaction), add_channel=channel.id)
        await interaction.response.send_message(self._describe_channels(settings), ephemeral=True)

    @admin_channels.command(name="remove", description="Remove a channel from the list")
    @app_commands.checks.has_permissions(manage_guild=True)
    async def channels_remove(
        self, interaction: discord.Interaction,
        channel: discord.TextChannel | discord.VoiceChannel | discord.ForumChannel | discord.Thread,
    ) -> None:
        """Remove a channel from the include/exclude list."""
        settings = await self._update_settings(_guild_id(interaction), remove_channel=channel.id)
        await interaction.response.send_message(self._describe_channels(settings), ephemeral=True)

    @staticmethod
    def _describe_channels(settings: GuildSettings) -> str:
        listed = ", ".join(f"<#{c}>" for c in sorted(settings.channels)) or "none"
        meaning = {
            "all": "every channel the bot can read is remembered",
            "include": f"only these are remembered: {listed}",
            "exclude": f"every channel except these is remembered: {listed}",
        }[settings.channel_mode]
        note = ("\nStopping a channel keeps what is stored; `/memory-admin purge-channel` forgets it."
                if settings.channel_mode != "all" else "")
        return f"Mode **{settings.channel_mode}**: {meaning}.{note}"

    # -- owner commands ----------------------------------------------------------------------

    async def _is_owner(self, user: discord.abc.User) -> bool:
        if user.id in self.owner_ids:
            return True
        try:
            return await self.bot.is_owner(user)
        except discord.HTTPException:
            return False

    async def interaction_check(self, interaction: discord.Interaction) -> bool:
        """Owner commands are refused at run time to anyone but the bot's owners."""
        command = interaction.command
        root = command.root_parent if isinstance(command, app_commands.Command) else None
        if root is not None and root.name == self.owner.name and (
            not await self._is_owner(interaction.user)
        ):
            raise app_commands.CheckFailure("Only the bot's owner can change bot-wide settings.")
        return True

    @owner.command(name="profile", description="Switch the hardware profile for every server")
    @app_commands.describe(name="Profile to load")
    async def owner_profile(self, interaction: discord.Interaction, name: str) -> None:
        """Load a profile's reranker in the background and swap it in."""
        await interaction.response.defer(ephemeral=True, thinking=True)
        try:
            profile = await self.read(load_profile, name)
            await asyncio.wrap_future(self.engine.switch_profile(profile))
        except Exception as exc:  # the old profile stays active; say why
            log.warning("profile switch to %s failed: %s", name, exc)
            await interaction.followup.send(f"Could not switch to **{inert(name, 100)}**: {exc}",
                                            ephemeral=True)
            return
        old, self.chat = self.chat, answers.make_chat_client(self.engine.profile)
        if old is not None:
            old.close()
        await interaction.followup.send(f"Hardware profile is now **{name}**.", ephemeral=True)

    @owner_profile.autocomplete("name")
    async def _profile_names(
        self, interaction: discord.Interaction, current: str
    ) -> list[app_commands.Choice[str]]:
        names = [p for p in available_profiles() if current.lower() in p.lower()]
        return [app_commands.Choice(name=p, value=p) for p in names[:25]]

    @owner.command(name="sync", description="Publish the bot's slash commands to Discord")
    @app_commands.describe(here="Only to this server (instant) instead of everywhere")
    async def owner_sync(self, interaction: discord.Interaction, here: bool = False) -> None:
        """Sync the command tree globally or to this guild."""
        await interaction.response.defer(ephemeral=True, thinking=True)
        guild = interaction.guild if here else None
        if guild is not None:
            self.bot.tree.copy_global_to(guild=guild)
        synced = await self.bot.tree.sync(guild=guild)
        await interaction.followup.send(f"Synced {len(synced)} commands.", ephemeral=True)


async def setup(bot: commands.Bot) -> None:
    """Extension entry point: the bot must carry an ``engine`` attribute."""
    engine = getattr(bot, "engine", None)
    if engine is None:
        raise RuntimeError("load cogs.memory on a bot that carries an `engine` (see bot.MemoryBot)")
    await bot.add_cog(MemoryCog(bot, engine, owner_ids=frozenset(getattr(bot, "owner_ids", None) or ())))


def _guild_id(interaction: discord.Interaction) -> int:
    assert interaction.guild_id is not None  # every command here is guild-only
    return interaction.guild_id


def _member(interaction: discord.Interaction) -> discord.Member:
    assert isinstance(interaction.user, discord.Member)  # guild-only: the user is a member
    return interaction.user


def _place(channel: object) -> discord.abc.GuildChannel | discord.Thread | None:
    """The guild channel or thread a reply goes to, or None when it is not one we can judge."""
    if isinstance(channel, (discord.abc.GuildChannel, discord.Thread)):
        return channel
    return None
