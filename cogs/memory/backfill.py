"""Filling memory from Discord's own history: ``/memory-admin backfill`` and start-up catch-up.

A backfill walks a channel (and its active and archived threads) from the newest
message back to the oldest, 100 messages a page.  After each page is committed
the position is saved (``backfill_cursors``), so a backfill stopped by a crash or
a restart resumes where it was, and a finished channel is not read again.
Writes go through the same queue as live capture and upserts are idempotent, so
a message seen both live and by the backfill is stored once, and a message deleted
meanwhile stays deleted (its tombstone wins).

After each READY (start-up, and every fresh session after an outage) the bot
catches up each remembered channel it has stored messages from: everything after
the newest message stored before the session began.  Channels and threads made while
it was away (after the newest message stored from their guild) are read from their
start, archived threads among them: live capture never saw them.  discord.py's HTTP client waits
out Discord's rate limits (429); a short pause between pages keeps a long backfill
from hogging the shared limits.
"""

from __future__ import annotations

import asyncio
import functools
import logging
import time
from dataclasses import dataclass
from datetime import datetime
from typing import TYPE_CHECKING

import discord
from discord import app_commands
from discord.ext import commands

from cogs.memory.capture import record_from_message
from cogs.memory.permissions import can_read as member_can_read
from cogs.memory.progress import report_progress
from cogs.memory.reruns import Reruns
from memory.records import MessageRecord, ms_to_datetime

if TYPE_CHECKING:
    from cogs.memory.runtime import MemoryRuntime
    from memory.engine import MemoryEngine
    from memory.settings import GuildSettings

log = logging.getLogger(__name__)

PAGE = 100
PAGE_PAUSE_S = 0.25
# a catch-up reads from this long before its READY: what live capture stored while
# the session was being set up must not hide what was said before it
OVERLAP_MS = 10 * 60_000

Walkable = (discord.TextChannel | discord.VoiceChannel | discord.StageChannel | discord.ForumChannel
            | discord.Thread)
# where messages are read from: a forum holds none itself, only its threads
History = discord.TextChannel | discord.VoiceChannel | discord.StageChannel | discord.Thread


@dataclass
class Progress:
    """What a backfill has done so far."""

    channels: int = 0
    done_channels: int = 0
    fetched: int = 0
    stored: int = 0
    skipped_channels: int = 0
    current: str = ""
    uncounted: bool = False  # places the admin cannot read were read but not counted

    def line(self) -> str:
        return (
            f"{self.done_channels}/{self.channels} channels · {self.fetched} messages read · "
            f"{self.stored} stored" + (f" · now in #{self.current}" if self.current else "")
            + (f" · {self.skipped_channels} unreadable" if self.skipped_channels else "")
            + (" · what you cannot read is not counted" if self.uncounted else "")
        )


class Backfiller:
    """Backfills channels (the admin command) and catches them up after each READY.

    Its walks run as the runtime's background work: stopping the runtime stops them
    (cursors keep what was committed).

    Args:
        bot: The bot whose guilds and channels are read.
        engine: Where cursors and the newest stored ids are read.
        runtime: The write queue pages go through, and the guild settings that decide
            which messages are stored.
    """

    def __init__(self, bot: commands.Bot, engine: MemoryEngine, runtime: MemoryRuntime) -> None:
        self.bot = bot
        self.engine = engine
        self.runtime = runtime
        self._running: dict[int, asyncio.Task] = {}  # guild id -> backfill task
        self.catch_ups = Reruns(runtime, "memory-catch-up")

    # -- the command ---------------------------------------------------------------------

    async def command(self, interaction: discord.Interaction,
                      channel: Walkable | app_commands.AppCommandThread | None) -> None:
        """Run a backfill for the command, editing one progress message in place."""
        guild = interaction.guild
        assert guild is not None  # the command is guild-only
        if guild.id in self._running and not self._running[guild.id].done():
            await interaction.response.send_message(
                "A backfill is already running in this server.", ephemeral=True)
            return
        await interaction.response.defer(ephemeral=True, thinking=True)
        if isinstance(channel, app_commands.AppCommandThread):
            try:
                channel = await channel.fetch()  # archived threads are not in the cache
            except (discord.Forbidden, discord.NotFound):
                await interaction.followup.send("I cannot read that thread.", ephemeral=True)
                return
        targets = [channel] if channel is not None else channels_of(guild)
        progress = Progress(channels=len(targets))
        status = await interaction.followup.send(
            f"Backfilling… {progress.line()}", ephemeral=True, wait=True)
        viewer = interaction.user if isinstance(interaction.user, discord.Member) else None
        task = self.runtime.spawn(self.run(targets, progress, viewer), name="memory-backfill")
        self._running[guild.id] = task
        try:
            await report_progress(status, task, progress.line, doing="Backfilling…",
                                  noun="Backfill", guild_id=guild.id)
        finally:
            self._running.pop(guild.id, None)

    async def run(self, targets: list[Walkable], progress: Progress,
                  viewer: discord.Member | None = None) -> None:
        """Backfill each target and its threads.  The progress names a channel only
        when ``viewer`` (the admin who asked) may see it, and counts the messages of a
        channel or thread only when they may read it: Manage Server is not View
        Channel, and a channel's name or how much it holds is not theirs to learn."""
        for channel in targets:
            shown = viewer is None or _sees(viewer, channel)
            progress.current = channel.name if shown else ""
            for place in await self._with_threads(channel):
                counted = viewer is None or member_can_read(viewer, place)
                progress.uncounted |= not counted
                await self.walk_back(place, progress if counted else Progress())
            progress.done_channels += 1
        progress.current = ""

    async def _with_threads(self, channel: Walkable) -> list[History]:
        if isinstance(channel, discord.Thread):
            return [channel]
        if isinstance(channel, (discord.VoiceChannel, discord.StageChannel)):
            return [channel]  # voice and stage channels have a text chat but no threads
        places: list[History] = [] if isinstance(channel, discord.ForumChannel) else [channel]
        places.extend(channel.threads)
        places.extend(await archived_threads(channel))
        return list({p.id: p for p in places}.values())

    async def _archived_since(self, guild: discord.Guild, last_heard: int | None,
                              before_id: int) -> list[discord.Thread]:
        """Threads archived since the bot last heard from the guild (``guild.threads``
        holds the active ones only): stored ones that went on while it was away, and
        remembered ones made while it was away (:meth:`_made_while_away`).  One listing
        per channel threads are stored under or may be made in, public and private."""
        stored = await self.runtime.read(self.engine.storage.messages.threads, guild.id)
        active = {t.id for t in guild.threads}
        wanted = {tid for tid, _, _ in stored if tid not in active}
        parents = {parent for tid, parent, _ in stored if tid in wanted}
        settings = await self.runtime.guild_settings.get(guild.id)
        if last_heard is not None:  # a thread may have been made in any channel
            parents.update(c.id for c in guild.channels
                           if isinstance(c, (discord.TextChannel, discord.ForumChannel))
                           and can_read(c) and settings.remembers_channel(c.id))
        since = discord.utils.snowflake_time(last_heard if last_heard is not None else before_id)
        found: list[discord.Thread] = []
        for parent_id in sorted(parents):
            channel = guild.get_channel(parent_id)
            if isinstance(channel, (discord.TextChannel, discord.ForumChannel)):
                found.extend(t for t in await archived_threads(channel, since)
                             if t.id in wanted or made_while_away(t, last_heard, settings))
        return found

    # -- walking history -----------------------------------------------------------------

    async def walk_back(self, channel: History, progress: Progress) -> None:
        """Read ``channel`` from its saved position back to its first message."""
        guilds = self.engine.storage.guilds
        if not can_read(channel):
            progress.skipped_channels += 1
            return
        cursor = await self.runtime.read(guilds.backfill_cursor, channel.id)
        if cursor is not None and cursor.complete:
            return
        before = discord.Object(cursor.before_id) if cursor and cursor.before_id else None
        page: list[discord.Message] = []
        try:
            async for message in channel.history(limit=None, before=before):
                page.append(message)
                if len(page) >= PAGE:
                    await self._store(channel, page, progress)
                    page = []
                    await asyncio.sleep(PAGE_PAUSE_S)
        except discord.Forbidden:
            progress.skipped_channels += 1
            return
        if page:
            await self._store(channel, page, progress)
        await self.runtime.writes.run_and_wait(
            lambda: self._save_cursor(channel.guild.id, channel.id, None, complete=True))

    async def _catch_up_from(self, place: History, missed: list[int], before_id: int,
                             made_while_away: bool) -> int | None:
        """Where a channel's catch-up starts: after its newest message stored before
        ``before_id``; at its start when nothing was stored there before and it was made
        while the bot was away (live capture may have stored some since), unless a mark
        says how far it was read; at ``before_id`` when all it holds is newer; or before
        its oldest mark (a message missed at the last stop, a catch-up's start or end),
        whichever is first.  ``None`` when it holds nothing and was there before (reading
        it is a backfill's job)."""
        messages = self.engine.storage.messages
        latest = await self.runtime.read(messages.latest_id, place.id, before_id)
        if latest is None and made_while_away and not missed:  # a mark says how far it was read
            latest = place.id - 1  # a thread's first message has the thread's id, or a later one
        elif latest is None and await self.runtime.read(messages.latest_id, place.id) is not None:
            latest = before_id
        starts = [] if latest is None else [latest]
        if missed:
            starts.append(min(missed) - 1)
        return min(starts, default=None)

    async def catch_up(self, channel: History, after_id: int, progress: Progress) -> int | None:
        """Read what was posted in ``channel`` after message ``after_id``.

        Returns:
            The id of the newest message read; ``None`` when there was none.
        """
        page: list[discord.Message] = []
        newest = None
        async for message in channel.history(limit=None, after=discord.Object(after_id),
                                             oldest_first=True):
            page.append(message)
            newest = message.id
            if len(page) >= PAGE:
                await self._store(channel, page, progress, save_cursor=False)
                page = []
                await asyncio.sleep(PAGE_PAUSE_S)
        if page:
            await self._store(channel, page, progress, save_cursor=False)
        return newest

    async def _store(
        self, channel: History, page: list[discord.Message], progress: Progress,
        *, save_cursor: bool = True,
    ) -> None:
        progress.fetched += len(page)
        me = self.bot.user
        records = []
        for message in page:
            if me is not None and message.author.id == me.id:
                continue
            record = record_from_message(message)
            if record is not None and await self.runtime.remembers(message):
                records.append(record)
        if records:
            await self.runtime.writes.put_and_wait(self._store_present, records)
            progress.stored += len(records)
        if save_cursor:
            oldest = min(m.id for m in page)
            await self.runtime.writes.run_and_wait(
                lambda: self._save_cursor(channel.guild.id, channel.id, oldest))

    def _store_present(self, records: list[MessageRecord]) -> None:
        """Store a fetched page on the write thread, less what Discord deleted after it
        was fetched (:class:`~cogs.memory.capture.Gone`)."""
        self.engine.storage.messages.upsert(self.runtime.gone.present(records))

    def _save_cursor(self, guild_id: int, channel_id: int, oldest: int | None, *,
                     complete: bool = False) -> None:
        """Save how far back a channel was read, on the write thread, unless it is gone."""
        if not self.runtime.gone.holds(guild_id, channel_id):
            self.engine.storage.guilds.save_backfill_cursor(guild_id, channel_id, oldest,
                                                            complete=complete)

    # -- start-up catch-up ---------------------------------------------------------------

    def catch_up_after_ready(self) -> asyncio.Task:
        """Start catching up every remembered channel, after this READY's predecessor
        (:mod:`cogs.memory.reruns`).

        Each channel is read from its newest message stored before the session began
        (:data:`OVERLAP_MS` before now, on Discord's clock where a message showed it):
        messages stored live since then must not hide those said while the bot was away.
        """
        clock = self.runtime.clock.now_ms()
        now = clock if clock is not None else int(time.time() * 1000)
        before_id = discord.utils.time_snowflake(ms_to_datetime(now - OVERLAP_MS))
        return self.catch_ups.start(functools.partial(self._catch_up_all, before_id))

    async def _catch_up_all(self, before_id: int) -> None:
        started = time.monotonic()
        progress = Progress()
        missed = await self.runtime.read(self.engine.storage.guilds.missed)  # at the last stop
        for guild in list(self.bot.guilds):
            try:
                await self._catch_up_guild(guild, before_id, missed, progress)
            except asyncio.CancelledError:
                raise
            except Exception as exc:  # one guild's trouble does not cost the others theirs
                log.warning("catching up guild %d failed (read again at the next catch-up): "
                            "%s", guild.id, exc)
        if progress.fetched:
            log.info("caught up %d messages (%d stored) in %.0f s", progress.fetched,
                     progress.stored, time.monotonic() - started)

    async def _catch_up_guild(self, guild: discord.Guild, before_id: int,
                              missed: dict[int, list[int]], progress: Progress) -> None:
        """Catch up every channel and thread of one guild (:meth:`_catch_up_from`).

        Each start is held as a missed mark until its read succeeds: a catch-up cut
        short (Discord failing a request, a restart) starts there again next time,
        instead of after the live messages stored meanwhile.  A place read with nothing
        of it stored keeps a mark where the read ended, so the next catch-up goes on
        from there rather than from its start.
        """
        plan = await self._plan_catch_up(guild, before_id, missed)
        if not plan:
            return
        await self.runtime.writes.run_and_wait(functools.partial(
            self._mark, [(place, after + 1) for place, after, _ in plan]))
        read: list[tuple[History, list[int], int]] = []
        messages = self.engine.storage.messages
        for place, after, marks in plan:
            try:
                newest = await self.catch_up(place, after, progress)
            except asyncio.CancelledError:
                raise
            except Exception as exc:
                log.warning("catching up #%s failed (read again at the next catch-up): %s",
                            getattr(place, "name", place.id), exc)
                continue
            read.append((place, [*marks, after + 1], (newest or after) + 1))

        def settle() -> None:
            for place, marks, read_to in read:
                self.engine.storage.guilds.clear_missed(place.id, marks)
                if messages.latest_id(place.id) is None:
                    self._mark([(place, read_to)])

        await self.runtime.writes.run_and_wait(settle)

    def _mark(self, starts: list[tuple[History, int]]) -> None:
        """Record where places' catch-ups start, on the write thread, unless they are gone
        (the bot left, the channel was deleted: their marks went with them)."""
        gone = self.runtime.gone
        self.engine.storage.guilds.mark_missed(
            (place.guild.id, place.id, start) for place, start in starts
            if not gone.holds(place.guild.id, place.id, getattr(place, "parent_id", None)))

    async def _plan_catch_up(self, guild: discord.Guild, before_id: int,
                             missed: dict[int, list[int]]
                             ) -> list[tuple[History, int, list[int]]]:
        """``(place, after_id, marks)`` of every place of a guild a catch-up reads."""
        last_heard = await self.runtime.read(self.engine.storage.messages.latest_in_guild,
                                             guild.id, before_id)
        settings = await self.runtime.guild_settings.get(guild.id)
        places: list[Walkable] = [*channels_of(guild), *guild.threads,
                                  *await self._archived_since(guild, last_heard, before_id)]
        plan: list[tuple[History, int, list[int]]] = []
        for place in places:
            if isinstance(place, discord.ForumChannel) or not can_read(place):
                continue
            marks = missed.get(place.id, [])
            after = await self._catch_up_from(
                place, marks, before_id, made_while_away(place, last_heard, settings))
            if after is not None:
                plan.append((place, after, marks))
        return plan


async def archived_threads(
    channel: discord.TextChannel | discord.ForumChannel, since: datetime | None = None,
) -> list[discord.Thread]:
    """The channel's archived threads, public and private, those archived after
    ``since`` only when given (Discord lists the latest archived first)."""
    found: list[discord.Thread] = []
    # forum posts are all public threads; text channels have private ones too
    for private in (False,) if isinstance(channel, discord.ForumChannel) else (False, True):
        try:
            if private:  # all of them takes Manage Threads; else those the bot is in
                assert isinstance(channel, discord.TextChannel)
                joined = not channel.permissions_for(channel.guild.me).manage_threads
                archived = channel.archived_threads(limit=None, private=True, joined=joined)
            else:
                archived = channel.archived_threads(limit=None)
            async for thread in archived:
                if since is not None and thread.archive_timestamp < since:
                    break
                found.append(thread)
        except (discord.Forbidden, discord.NotFound):
            log.debug("cannot list %s archived threads of %s",
                      "private" if private else "public", channel.id)
        except discord.HTTPException as exc:
            log.warning("listing archived threads of %s failed: %s", channel.id, exc)
    return found


def made_while_away(place: History, last_heard: int | None,
                     settings: GuildSettings) -> bool:
    """Whether ``place`` is a remembered channel or thread made after the newest
    message stored from its guild: the bot was away, so live capture never saw it
    (a guild it never heard from at all is a backfill's job).  A thread started on
    an older message has that message's id, so its creation time is what counts."""
    if last_heard is None:
        return False
    made = discord.utils.snowflake_time(place.id)
    parent_id = None
    if isinstance(place, discord.Thread):
        made, parent_id = place.created_at or made, place.parent_id
    return (made > discord.utils.snowflake_time(last_heard)
            and settings.remembers_channel(place.id, parent_id))


def can_read(channel: Walkable) -> bool:
    """Whether the bot may read ``channel``'s history (by the cache)."""
    perms = channel.permissions_for(channel.guild.me)
    return perms.view_channel and perms.read_message_history


def _sees(member: discord.Member, channel: Walkable) -> bool:
    """Whether ``member`` sees ``channel`` and its name: View Channel, and for a private
    thread (whose permissions are its parent's) what opens it to a search too."""
    if isinstance(channel, discord.Thread) and channel.is_private():
        return member_can_read(member, channel)
    return channel.permissions_for(member).view_channel


def channels_of(guild: discord.Guild) -> list[Walkable]:
    """Every channel in a guild that holds messages (threads are walked under them)."""
    return [
        c for c in guild.channels
        if isinstance(c, (discord.TextChannel, discord.VoiceChannel, discord.StageChannel,
                          discord.ForumChannel))
    ]
