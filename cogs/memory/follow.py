"""Keeping up with other bot processes that share the database.

Several processes may share one memory (shards spread over processes, or a
command-line tool beside the bot).  Every couple of seconds :class:`Follower` reads
two small values: the storage's settings version (when it moved, the runtime drops
every cached guild setting) and the stored profile choice (when another process
switched it, this one loads the same profile and swaps it in, without storing the
choice again).

A follower is handed only what it uses: the storage it reads, a way to run a read
off the event loop, and what to call when something changed (the runtime passes
its own methods), so it can be built and tested without a runtime.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Awaitable, Callable, Coroutine
from typing import Any, Protocol, TypeVar

from discord.ext import tasks

from memory.config import Profile, load_profile
from memory.storage.contract import Storage

log = logging.getLogger(__name__)

T = TypeVar("T")

FOLLOW_INTERVAL_S = 2.0  # how often other processes' settings and profile changes are read


class _Unread:
    """A value not read yet (``None`` is a value: no profile stored)."""


UNREAD = _Unread()


class Read(Protocol):
    """Runs a blocking call off the event loop and returns what it returned."""

    def __call__(self, fn: Callable[..., T], *args: Any) -> Awaitable[T]:
        """Run ``fn(*args)`` on a worker thread."""
        ...


class Spawn(Protocol):
    """Runs a coroutine in the background until it ends or the bot stops."""

    def __call__(self, work: Coroutine[Any, Any, None], *, name: str | None = None) -> object:
        """Start ``work``."""
        ...


class Follower:
    """Follows the settings and profile changes other processes store.

    Args:
        storage: The shared database, where the changes are read.
        read: Runs a read off the event loop (the runtime's read threads).
        profile_name: The name of the profile this process runs now.
        drop_settings: Drops every cached guild setting (the settings version moved).
        switch_profile: Swaps in the profile another process chose, without storing the
            choice again.
        spawn: Runs a switch in the background, so that stopping the bot cancels it.
    """

    def __init__(
        self,
        storage: Storage,
        *,
        read: Read,
        profile_name: Callable[[], str],
        drop_settings: Callable[[], None],
        switch_profile: Callable[[Profile], Awaitable[None]],
        spawn: Spawn,
    ) -> None:
        self._storage = storage
        self._read = read
        self._profile_name = profile_name
        self._drop_settings = drop_settings
        self._switch_profile = switch_profile
        self._spawn = spawn
        self._settings_version: int | None = None  # the storage's, when last read
        self._stored_profile: str | _Unread | None = UNREAD  # meta.active_profile, when last read
        self._failures = 0
        self._switching = asyncio.Lock()  # one followed switch at a time, the latest choice last

    @tasks.loop(seconds=FOLLOW_INTERVAL_S)
    async def follow_changes(self) -> None:
        """Pick up settings and profile changes other processes made; never ends on a failure."""
        try:
            await self.follow_settings()
            await self.follow_profile()
            self._failures = 0
        except Exception as exc:  # the database may be away for a moment: try next time
            self._failures += 1
            if self._failures == 1 or self._failures % 30 == 0:
                log.warning("reading other processes' changes failed (%s; %d times in a row); "
                            "cached settings expire within a minute meanwhile", exc,
                            self._failures)

    async def follow_settings(self) -> None:
        """Drop every cached guild setting when the storage's settings version moved.

        Any process's change moves it (this one's too), so one read covers every
        guild; the first read only learns it, and drops what was cached before it.
        """
        version = await self._read(self._storage.guilds.settings_version)
        if version == self._settings_version:
            return
        if self._settings_version is not None:
            log.debug("guild settings changed (version %d -> %d); cached settings dropped",
                      self._settings_version, version)
        self._settings_version = version
        self._drop_settings()

    async def follow_profile(self) -> None:
        """Switch to the profile another process chose, once each time the choice changes.

        Only a change of the stored choice counts: the first read learns it, so a
        process started with ``--profile`` keeps that profile until an owner
        switches again.  The choice is loaded by name from this process's profiles.
        """
        stored = await self._read(lambda: self._storage.meta.active_profile)
        seen, self._stored_profile = self._stored_profile, stored
        if isinstance(seen, _Unread) or stored is None or stored == seen:
            return
        if stored != self._profile_name():
            log.info("another process switched the hardware profile to %s; loading it", stored)
            self._spawn(self._take_profile(stored), name="memory-follow-profile")

    async def _take_profile(self, name: str) -> None:
        async with self._switching:
            if self._stored_profile != name:
                return  # chosen again since: that switch follows
            try:
                profile = await self._read(load_profile, name)
                await self._switch_profile(profile)
            except Exception as exc:  # this process keeps its profile; the next switch tries again
                log.error("another process switched the hardware profile to %s, but it cannot "
                          "be used here (%s); this process keeps %s", name, exc,
                          self._profile_name())
                return
        log.info("hardware profile is now %s, as another process chose", name)
