"""Keeping up with other bot processes that share the database.

Several processes may share one memory (shards spread over processes, or a
command-line tool beside the bot).  Every couple of seconds :class:`Follower` reads
two small values: the storage's settings version (when it moved, the runtime drops
every cached guild setting) and the stored profile choice (when another process
switched it, this one loads the same profile and swaps it in, without storing the
choice again).
"""

from __future__ import annotations

import asyncio
import logging
from typing import TYPE_CHECKING

from discord.ext import tasks

from memory.config import load_profile

if TYPE_CHECKING:
    from cogs.memory.runtime import MemoryRuntime

log = logging.getLogger(__name__)

FOLLOW_INTERVAL_S = 2.0  # how often other processes' settings and profile changes are read


class _Unread:
    """A value not read yet (``None`` is a value: no profile stored)."""


UNREAD = _Unread()


class Follower:
    """Follows the settings and profile changes other processes store.

    Args:
        runtime: The runtime whose settings cache and profile follow the changes.
    """

    def __init__(self, runtime: MemoryRuntime) -> None:
        self.runtime = runtime
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
        runtime = self.runtime
        version = await runtime.read(runtime.engine.storage.guilds.settings_version)
        if version == self._settings_version:
            return
        if self._settings_version is not None:
            log.debug("guild settings changed (version %d -> %d); cached settings dropped",
                      self._settings_version, version)
        self._settings_version = version
        runtime.drop_all_settings()

    async def follow_profile(self) -> None:
        """Switch to the profile another process chose, once each time the choice changes.

        Only a change of the stored choice counts: the first read learns it, so a
        process started with ``--profile`` keeps that profile until an owner
        switches again.  The choice is loaded by name from this process's profiles.
        """
        runtime = self.runtime
        stored = await runtime.read(lambda: runtime.engine.storage.meta.active_profile)
        seen, self._stored_profile = self._stored_profile, stored
        if isinstance(seen, _Unread) or stored is None or stored == seen:
            return
        if stored != runtime.engine.rerankers.profile_name:
            log.info("another process switched the hardware profile to %s; loading it", stored)
            runtime.spawn(self._take_profile(stored), name="memory-follow-profile")

    async def _take_profile(self, name: str) -> None:
        runtime = self.runtime
        async with self._switching:
            if self._stored_profile != name:
                return  # chosen again since: that switch follows
            try:
                profile = await runtime.read(load_profile, name)
                await runtime.switch_profile(profile, remember=False)
            except Exception as exc:  # this process keeps its profile; the next switch tries again
                log.error("another process switched the hardware profile to %s, but it cannot "
                          "be used here (%s); this process keeps %s", name, exc,
                          runtime.engine.rerankers.profile_name)
                return
        log.info("hardware profile is now %s, as another process chose", name)
