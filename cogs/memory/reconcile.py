"""What changed while the bot was away: start-up and ``/memory-admin reconcile``.

Live events keep memory in step while the bot runs.  What happened while it was
offline (a message or a thread deleted, a channel removed, the bot removed from a
server) is found by asking Discord what still exists:

1. **Guilds.**  A stored guild the bot is in neither by its cache nor by Discord's
   own list of its guilds is forgotten whole, settings included (start-up only).
   With shards spread over processes, each process judges only the stored guilds
   of its own shards: the others are not in its cache because another process
   runs them, and that process judges them.
2. **Channels and threads.**  A stored channel the cache does not know is looked
   up (archived threads exist but are not cached): 404 *Unknown Channel* means it
   is gone and it is forgotten with its threads; 403 means it exists but the bot
   may not see it, and it is kept.
3. **Recent messages.**  In each channel that is left, the profile's
   ``reconcile.recent_messages`` newest stored messages are compared with the
   channel's history over the same span; stored ones Discord no longer returns
   are forgotten, and edits made meanwhile are applied (an edit that took out all
   the text forgets the message).  Older stored messages are not checked.

Every deletion goes through the runtime's write queue to the engine's forgetting code
(tombstones, vectors, keyword rows, windows), in order with live writes.  A run
saves each channel's position after every page (``reconcile_cursors``), so a run
stopped by a restart resumes where it was.  discord.py waits out Discord's 429s;
``reconcile.pause_s`` after each request keeps a run from crowding out live
traffic.  Only messages older than the run's start are judged, and a missing one
newer than every message Discord returned for its channel is looked up on its own
before it is forgotten: a message posted during a run is never mistaken for a deleted
one, even when the host's clock runs ahead of Discord's.
"""

from __future__ import annotations

import asyncio
import functools
import logging
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import TYPE_CHECKING

import discord
from discord.ext import commands

from cogs.memory.capture import emptied, record_from_message
from cogs.memory.progress import report_progress
from cogs.memory.reruns import Reruns
from memory.records import datetime_to_ms, ms_to_datetime

if TYPE_CHECKING:
    from cogs.memory.runtime import MemoryRuntime
    from memory.engine import MemoryEngine
    from memory.storage.contract import ReconcileCursor

log = logging.getLogger(__name__)

PAGE = 100  # messages per history request (Discord's maximum)
GUILDS_PAGE = 200  # guilds per GET /users/@me/guilds
LOG_EVERY_S = 30.0  # a long run's progress in the log
UNKNOWN_CHANNEL = 10003  # Discord's JSON error code for a channel that does not exist
UNKNOWN_MESSAGE = 10008  # ... and for a message that does not exist

Place = discord.abc.GuildChannel | discord.Thread
# where messages live (a forum or a category holds none of its own)
History = discord.TextChannel | discord.VoiceChannel | discord.StageChannel | discord.Thread
HISTORY_TYPES = (discord.TextChannel, discord.VoiceChannel, discord.StageChannel, discord.Thread)


@dataclass
class ReconcileProgress:
    """What a reconcile has done so far (the command shows it; start-up logs it)."""

    guilds_forgotten: int = 0
    channels: int = 0
    channels_done: int = 0
    channels_forgotten: int = 0
    channels_no_access: int = 0
    channels_unchecked: int = 0
    messages_checked: int = 0
    messages_forgotten: int = 0
    messages_updated: int = 0
    requests: int = 0
    resumed: bool = False

    def line(self) -> str:
        """One line for a progress message or the log."""
        parts = [f"{self.channels_done}/{self.channels} channels checked",
                 f"{self.messages_checked} recent messages compared",
                 f"{self.messages_forgotten} messages forgotten",
                 f"{self.channels_forgotten} channels gone"]
        if self.messages_updated:
            parts.append(f"{self.messages_updated} messages updated")
        if self.guilds_forgotten:
            parts.append(f"{self.guilds_forgotten} servers left")
        if self.channels_no_access:
            parts.append(f"{self.channels_no_access} kept without access")
        if self.channels_unchecked:
            parts.append(f"{self.channels_unchecked} could not be checked")
        parts.append(f"{self.requests} requests to Discord")
        return " · ".join(parts) + (" (resumed)" if self.resumed else "")


class _Gone:
    """Discord says the channel does not exist."""


GONE = _Gone()


class Reconciler:
    """Reconciles memory with what Discord says exists.

    Its runs are the runtime's background work: stopping the runtime stops them
    (saved positions keep what was done).

    Args:
        bot: The bot that asks Discord (its guilds, channels and histories).
        engine: The memory engine being reconciled.
        runtime: The write queue every deletion goes through, and the read threads.
    """

    def __init__(self, bot: commands.Bot, engine: MemoryEngine, runtime: MemoryRuntime) -> None:
        self.bot = bot
        self.engine = engine
        self.runtime = runtime
        self._locks: dict[int, asyncio.Lock] = {}  # guild id -> one run at a time
        self.runs = Reruns(runtime, "memory-reconcile")  # after each READY

    @property
    def _pause_s(self) -> float:
        return self.engine.profile.reconcile.pause_s

    # -- start-up ------------------------------------------------------------------------

    def start_after_ready(self, *, after: asyncio.Task | None = None) -> None:
        """Reconcile every guild in the background after each READY: at start-up, and
        after every fresh session, when what was deleted while the bot was away was
        never sent to it (:mod:`cogs.memory.reruns`).

        Args:
            after: Start once this task (the READY's catch-up) is done, so that the
                two do not share Discord's rate limits at the same time.
        """
        if self.engine.profile.reconcile.on_start:
            self.runs.start(functools.partial(self.at_start_up, after=after))

    async def at_start_up(self, *, after: asyncio.Task | None = None) -> ReconcileProgress:
        """Forget the guilds the bot left, then reconcile each guild it is in.

        A guild that fails is logged and the next one is reconciled; nothing here
        ends the bot.
        """
        if after is not None:
            await asyncio.wait({after})  # its own failures are its own to log
        started = time.monotonic()
        progress = ReconcileProgress()
        try:
            await self.forget_left_guilds(progress)
        except asyncio.CancelledError:
            raise
        except Exception:
            log.exception("reconcile: checking which servers the bot left failed")
        for guild in list(self.bot.guilds):
            if guild.unavailable:  # an outage is not a deletion: judge it next time
                continue
            try:
                await self.reconcile_guild(guild, progress)
            except asyncio.CancelledError:
                raise
            except Exception:
                log.exception("reconcile of guild %d stopped; the next run resumes it", guild.id)
        log.info("reconciled with Discord in %.0f s: %s", time.monotonic() - started,
                 progress.line())
        return progress

    async def forget_left_guilds(self, progress: ReconcileProgress) -> None:
        """Forget every stored guild of this process's shards that the bot is no longer in."""
        storage = self.engine.storage
        stored = await self.runtime.read(storage.messages.known_guild_ids)
        cached = {g.id for g in self.bot.guilds}
        missing = [g for g in stored if g not in cached and self.runtime.owns(g)]
        if not missing:
            return
        # Discord's own list decides: a cache still filling must not cost a server its memory
        member_of: set[int] = set()
        async for guild in self.bot.fetch_guilds(limit=None):
            member_of.add(guild.id)
        progress.requests += 1 + len(member_of) // GUILDS_PAGE
        for guild_id in missing:
            if guild_id in member_of:
                continue
            removed = await self._forget(functools.partial(self.engine.forget_guild, guild_id))
            await self.runtime.writes.run_and_wait(
                functools.partial(storage.guilds.end_reconcile_run, guild_id))
            progress.guilds_forgotten += 1
            progress.messages_forgotten += removed
            log.info("reconcile: the bot left guild %d; forgot its %d messages", guild_id, removed)

    # -- the command ---------------------------------------------------------------------

    async def command(self, interaction: discord.Interaction) -> None:
        """Reconcile the command's guild, editing one progress message in place."""
        guild = interaction.guild
        assert guild is not None  # the command is guild-only
        if self._lock(guild.id).locked():
            await interaction.response.send_message(
                "A reconcile is already running in this server.", ephemeral=True)
            return
        await interaction.response.defer(ephemeral=True, thinking=True)
        progress = ReconcileProgress()
        status = await interaction.followup.send(
            f"Reconciling with Discord… {progress.line()}", ephemeral=True, wait=True)
        task = self.runtime.spawn(self.reconcile_guild(guild, progress), name="memory-reconcile")
        await report_progress(status, task, progress.line, doing="Reconciling with Discord…",
                              noun="Reconcile", guild_id=guild.id)

    # -- one guild -----------------------------------------------------------------------

    def _lock(self, guild_id: int) -> asyncio.Lock:
        return self._locks.setdefault(guild_id, asyncio.Lock())

    async def reconcile_guild(self, guild: discord.Guild, progress: ReconcileProgress) -> None:
        """Check every stored channel of ``guild``, resuming an unfinished run."""
        async with self._lock(guild.id):
            storage = self.engine.storage
            run_id = await self.runtime.read(storage.guilds.reconcile_run, guild.id)
            if run_id is None:
                run_id = int(time.time() * 1000)
                await self.runtime.writes.run_and_wait(
                    lambda: storage.guilds.begin_reconcile_run(guild.id, run_id))
            else:
                progress.resumed = True
            channels = await self.runtime.read(storage.messages.channels_with_messages, guild.id)
            progress.channels += len(channels)
            forgotten: set[int] = set()
            logged = time.monotonic()
            for channel_id, parent_id in channels:
                if time.monotonic() - logged > LOG_EVERY_S:
                    log.info("reconciling guild %d: %s", guild.id, progress.line())
                    logged = time.monotonic()
                if parent_id in forgotten:
                    progress.channels_forgotten += 1  # a thread, forgotten with its channel
                else:
                    await self._reconcile_channel(guild, channel_id, run_id, progress, forgotten)
                progress.channels_done += 1
            await self.runtime.writes.run_and_wait(lambda: storage.guilds.end_reconcile_run(guild.id))
        log.info("reconciled guild %d: %s", guild.id, progress.line())

    async def _reconcile_channel(
        self, guild: discord.Guild, channel_id: int, run_id: int,
        progress: ReconcileProgress, forgotten: set[int],
    ) -> None:
        guilds = self.engine.storage.guilds
        cursor = await self.runtime.read(guilds.reconcile_cursor, channel_id)
        if cursor is not None and cursor.run_id == run_id and cursor.complete:
            return
        place = await self._locate(guild, channel_id, progress)
        if place is GONE:
            await self._forget_channel(channel_id, progress)
            forgotten.add(channel_id)
        elif isinstance(place, HISTORY_TYPES):
            try:
                await self._check_recent(place, run_id, cursor, progress)
            except discord.NotFound as exc:
                if exc.code != UNKNOWN_CHANNEL:
                    raise
                await self._forget_channel(channel_id, progress)  # deleted while we looked
                forgotten.add(channel_id)
            except discord.Forbidden:
                progress.channels_no_access += 1
        await self.runtime.writes.run_and_wait(
            lambda: guilds.save_reconcile_cursor(guild.id, channel_id, run_id, None, complete=True))

    async def _locate(
        self, guild: discord.Guild, channel_id: int, progress: ReconcileProgress
    ) -> Place | _Gone | None:
        """The channel or thread, :data:`GONE`, or ``None`` (exists, but cannot be checked)."""
        place = guild.get_channel_or_thread(channel_id)
        if place is not None:
            return place
        progress.requests += 1
        try:
            fetched = await self.bot.fetch_channel(channel_id)
        except discord.NotFound as exc:
            if exc.code == UNKNOWN_CHANNEL:
                return GONE
            log.warning("reconcile: looking up channel %d answered %s; kept", channel_id, exc)
            progress.channels_unchecked += 1
            return None
        except discord.Forbidden:
            progress.channels_no_access += 1  # it exists; the bot may not see it: keep it
            return None
        except discord.HTTPException as exc:
            log.warning("reconcile: looking up channel %d failed (%s); kept", channel_id, exc)
            progress.channels_unchecked += 1
            return None
        finally:
            await asyncio.sleep(self._pause_s)
        if not isinstance(fetched, (discord.abc.GuildChannel, discord.Thread)) or (
            fetched.guild.id != guild.id
        ):
            log.warning("reconcile: channel %d is not in guild %d any more; kept", channel_id,
                        guild.id)
            progress.channels_unchecked += 1
            return None
        return fetched

    async def _forget_channel(self, channel_id: int, progress: ReconcileProgress) -> None:
        removed = await self._forget(lambda: self.engine.forget_channels([channel_id]))
        progress.channels_forgotten += 1
        progress.messages_forgotten += removed
        log.info("reconcile: channel %d is gone; forgot its %d messages", channel_id, removed)

    # -- recent messages -----------------------------------------------------------------

    async def _check_recent(
        self, place: History, run_id: int, cursor: ReconcileCursor | None,
        progress: ReconcileProgress,
    ) -> None:
        """Forget a channel's recent stored messages that its history no longer has.

        The span is from the run's start back to the oldest of the channel's
        ``recent_messages`` newest stored messages; history is read newest first,
        and after each page every stored message between that page's oldest and
        the previous page's is either in the page or gone.
        """
        count = self.engine.profile.reconcile.recent_messages
        if count == 0:
            return
        if not _readable(place):
            progress.channels_no_access += 1
            return
        channel_id = place.id
        start = discord.utils.time_snowflake(ms_to_datetime(run_id))
        low = await self.runtime.read(self.engine.storage.messages.recent_floor, channel_id, start,
                                  count)
        resumed = cursor.before_id if cursor is not None and cursor.run_id == run_id else None
        upper = resumed or start
        if low is None or upper <= low:
            return
        # every id below one Discord returned existed when it was read; one above may
        # have been posted since (the run's start comes from the host's clock)
        existed = resumed or 0
        seen: list[discord.Message] = []
        progress.requests += 1
        async for message in place.history(limit=None, before=discord.Object(upper)):
            seen.append(message)
            existed = max(existed, message.id)
            if len(seen) == PAGE or message.id <= low:
                lowest = min(m.id for m in seen)
                upper = await self._settle_span(place, run_id, seen, max(lowest, low), upper,
                                                progress, existed)
                seen = []
                if upper <= low:
                    return
                await asyncio.sleep(self._pause_s)
                progress.requests += 1
        # the channel's first message was reached: what is stored below it is gone too
        await self._settle_span(place, run_id, seen, low, upper, progress, existed)

    async def _settle_span(
        self, place: History, run_id: int, seen: list[discord.Message], lower: int,
        upper: int, progress: ReconcileProgress, existed: int,
    ) -> int:
        """Forget stored messages in ``[lower, upper)`` Discord did not return (those above
        ``existed`` once Discord says they do not exist) or that an edit emptied, apply
        the edits of the others; save the place."""
        storage = self.engine.storage
        channel_id, guild_id = place.id, place.guild.id
        stored = set(await self.runtime.read(storage.messages.ids_between, channel_id, lower,
                                             upper))
        edited = [m for m in seen if m.id in stored and m.edited_at is not None]
        gone = sorted(stored.difference(m.id for m in seen))
        if unsure := [i for i in gone if i > existed]:
            gone = [i for i in gone if i <= existed] + await unknown_messages(
                place, unsure, progress, self._pause_s)
        progress.messages_checked += len(stored)
        edits = [r for r in map(record_from_message, edited) if r is not None]
        if edits:
            progress.messages_updated += await self._in_order(
                lambda: storage.messages.upsert(edits, insert=False).updated)
        emptied_at = {m.id: datetime_to_ms(m.edited_at) for m in edited
                      if m.edited_at is not None and emptied(m)}
        if emptied_at:  # a copy edited since (a live edit put text back) stays
            progress.messages_forgotten += await self._in_order(
                functools.partial(self.runtime.forget_emptied, list(emptied_at.items())))
        if gone:
            removed = await self._forget(lambda: self.engine.forget_messages(gone))
            progress.messages_forgotten += removed
            log.info("reconcile: %d messages in channel %d were deleted while the bot was away",
                     removed, channel_id)
        await self.runtime.writes.run_and_wait(
            lambda: storage.guilds.save_reconcile_cursor(guild_id, channel_id, run_id, lower))
        return lower

    async def _forget(self, deletion: Callable[[], int]) -> int:
        """Run an engine deletion in order with the queued writes; how many it removed."""
        return await self._in_order(deletion)

    async def _in_order(self, write: Callable[[], int]) -> int:
        """Run a write in order with the queued writes; the count it returns."""
        counted: list[int] = []
        await self.runtime.writes.run_and_wait(lambda: counted.append(write()))
        return counted[0] if counted else 0


async def unknown_messages(place: History, ids: list[int], progress: ReconcileProgress,
                           pause_s: float) -> list[int]:
    """Those of ``ids`` Discord says do not exist in ``place``; any other answer keeps a
    message (the next run judges it again)."""
    unknown = []
    for message_id in ids:
        progress.requests += 1
        try:
            await place.fetch_message(message_id)
        except discord.NotFound as exc:
            if exc.code == UNKNOWN_MESSAGE:
                unknown.append(message_id)
        except discord.HTTPException as exc:
            log.warning("reconcile: looking up message %d failed (%s); kept", message_id, exc)
        await asyncio.sleep(pause_s)
    return unknown


def _readable(place: History) -> bool:
    """Whether the bot may read ``place``'s history (by the cache; Discord has the last word)."""
    me = place.guild.me
    if me is None:
        return True
    perms = place.permissions_for(me)
    return perms.view_channel and perms.read_message_history
