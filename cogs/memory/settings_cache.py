"""Each guild's settings, cached for a minute, for the event loop and the write thread.

Every message the bot hears is checked against its guild's settings (which channels
are remembered, who opted out) before it is stored, so they are cached: the event
loop reads through the cache (:meth:`SettingsCache.get`), and the write thread,
which decides what a queued batch stores, reads with :meth:`SettingsCache.read_now`
and hands what it read back to the loop, which owns the cache.  Changes made here
apply at once (:meth:`SettingsCache.keep`); changes another process made apply once
:class:`~cogs.memory.follow.Follower` sees the settings version move and drops them
all (:meth:`SettingsCache.drop_all`).  A failed read never drops a message and never
stores one against the rules: the last known settings are used (opt-outs are enforced
again where messages are written).  With none known it raises
:class:`~memory.errors.SettingsUnreadable` (defaulting to "remember every channel" would
store messages of excluded channels): :meth:`SettingsCache.remembered` then holds that
guild's records back, and the other guilds' are stored as ever.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Awaitable, Callable
from dataclasses import dataclass
from typing import TypeGuard

from memory.errors import DiskFullError, SettingsUnreadable, StorageBusy
from memory.records import MessageRecord
from memory.settings import GuildSettings
from memory.storage.contract import Guilds

log = logging.getLogger(__name__)

SETTINGS_TTL_S = 60.0


@dataclass
class Remembered:
    """Records split by their guild's settings (:meth:`SettingsCache.remembered`)."""

    kept: list[MessageRecord]  # the settings remember them
    others: list[MessageRecord]  # they do not (a channel left out, an opted-out author)
    held: list[MessageRecord]  # their guild's settings could not be read
_Cached = tuple[float, GuildSettings]  # when it was kept (monotonic), the settings


class SettingsCache:
    """Each guild's settings, kept for :data:`SETTINGS_TTL_S` seconds.

    Args:
        guilds: Where settings are read (the storage's ``guilds``).
        read: Runs a quick read off the event loop (the runtime's read threads).
    """

    def __init__(self, guilds: Guilds, read: Callable[..., Awaitable[GuildSettings]]) -> None:
        self._guilds = guilds
        self._read = read
        self._cached: dict[int, _Cached] = {}
        self._epoch = 0  # moves when the cache is dropped: reads begun before are not kept
        self._loop: asyncio.AbstractEventLoop | None = None  # set at start

    def start(self) -> None:
        """Bind the cache to the running event loop, which owns it."""
        self._loop = asyncio.get_running_loop()

    def __len__(self) -> int:
        """How many guilds' settings are cached (fresh or not)."""
        return len(self._cached)

    async def get(self, guild_id: int) -> GuildSettings:
        """This guild's settings: the cached ones while fresh, else read now and kept.

        Raises:
            SettingsUnreadable: They could not be read and none are known.
        """
        cached = self._cached.get(guild_id)
        if _fresh(cached):
            return cached[1]
        epoch = self._epoch
        try:
            settings = await self._read(self._guilds.settings, guild_id)
        except Exception as exc:
            return _last_known(guild_id, cached, exc)
        if epoch == self._epoch:  # else a change was seen meanwhile: read again next time
            self.keep(guild_id, settings)
        return settings

    def read_now(self, guild_id: int) -> GuildSettings:
        """A guild's settings for the write thread: the cached ones while fresh (what
        :meth:`get` answers), else read now and handed to the event loop to keep.

        Raises:
            StorageBusy: The database is busy (the write queue retries the batch).
            DiskFullError: The disk is full (likewise).
            SettingsUnreadable: They could not be read otherwise, and none are known.
        """
        cached = self._cached.get(guild_id)
        if _fresh(cached):
            return cached[1]
        epoch = self._epoch
        try:
            settings = self._guilds.settings(guild_id)
        except (StorageBusy, DiskFullError):
            raise  # the queue retries the batch: its writes would meet the same
        except Exception as exc:  # never drop a message over a settings read
            return _last_known(guild_id, cached, exc)
        try:
            if self._loop is not None:
                self._loop.call_soon_threadsafe(self._keep_if_current, guild_id, settings, epoch)
        except RuntimeError:  # the loop closed (a write finishing after the bot stopped)
            pass
        return settings

    def remembered(self, records: list[MessageRecord]) -> Remembered:
        """Split ``records`` by whether their guild's settings (read now, on the write
        thread) remember them; those of a guild whose settings cannot be read are held."""
        settings: dict[int, GuildSettings | None] = {}
        split = Remembered([], [], [])
        for record in records:
            if record.guild_id not in settings:
                try:
                    settings[record.guild_id] = self.read_now(record.guild_id)
                except SettingsUnreadable:
                    settings[record.guild_id] = None
            rules = settings[record.guild_id]
            if rules is None:
                split.held.append(record)
            elif (rules.remembers_channel(record.channel_id, record.parent_id)
                  and rules.remembers_author(record.author_id)):
                split.kept.append(record)
            else:
                split.others.append(record)
        return split

    def keep(self, guild_id: int, settings: GuildSettings) -> None:
        """Cache ``settings`` as the guild's, from now (a change this process made)."""
        self._cached[guild_id] = (time.monotonic(), settings)

    def drop(self, guild_id: int) -> None:
        """Forget a guild's cached settings (they changed elsewhere, or the guild is gone);
        a read already under way is not kept either."""
        self._epoch += 1
        self._cached.pop(guild_id, None)

    def drop_all(self) -> None:
        """Forget every cached guild setting; reads already under way are not kept either."""
        self._epoch += 1
        self._cached.clear()

    def _keep_if_current(self, guild_id: int, settings: GuildSettings, epoch: int) -> None:
        if epoch == self._epoch:  # else a change was seen since they were read
            self.keep(guild_id, settings)


def _fresh(cached: _Cached | None) -> TypeGuard[_Cached]:
    """Whether a cache entry exists and is younger than :data:`SETTINGS_TTL_S`."""
    return cached is not None and time.monotonic() - cached[0] < SETTINGS_TTL_S


def _last_known(guild_id: int, cached: _Cached | None, exc: Exception) -> GuildSettings:
    """The settings to use when reading them failed: the cached ones, stale or not.

    Raises:
        SettingsUnreadable: None are cached.  No default is safe: "every channel" would
            store an excluded channel's messages.
    """
    if cached is None:
        log.warning("reading guild %d settings failed (%s); none are known", guild_id, exc)
        raise SettingsUnreadable(
            "this server's settings could not be read just now; try again in a moment") from exc
    log.warning("reading guild %d settings failed (%s); using the last known", guild_id, exc)
    return cached[1]  # opt-outs are enforced again where messages are written
