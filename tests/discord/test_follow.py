"""The Follower on its own: built from a real database and plain callables, no runtime.

tests/discord/test_shards.py checks following through the whole bot; these check
that a :class:`~cogs.memory.follow.Follower` needs nothing but what it is handed.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Callable, Coroutine
from typing import Any

import pytest

from cogs.memory.follow import Follower
from memory.config import Profile
from memory.storage import Storage, open_storage

GUILD = 1


class Process:
    """What the follower calls, recorded: the profile this process runs, drops, switches."""

    def __init__(self, storage: Storage) -> None:
        self.profile = "test"
        self.drops = 0
        self.switched: list[str] = []
        self.tasks: list[asyncio.Task] = []
        self.follower = Follower(
            storage, read=asyncio.to_thread, profile_name=lambda: self.profile,
            drop_settings=self.drop, switch_profile=self.switch, spawn=self.spawn,
        )

    def drop(self) -> None:
        self.drops += 1

    async def switch(self, profile: Profile) -> None:
        self.switched.append(profile.name)
        self.profile = profile.name

    def spawn(self, work: Coroutine[Any, Any, None], *, name: str | None = None) -> object:
        task = asyncio.create_task(work, name=name)
        self.tasks.append(task)
        return task

    async def settled(self) -> None:
        await asyncio.gather(*self.tasks)


@pytest.fixture
def database(tmp_path):
    """This process's storage, and a way to change the database as another process."""
    path = tmp_path / "shared.sqlite3"
    storage = open_storage(path)

    def elsewhere(change: Callable[[Storage], object]) -> None:
        other = open_storage(path)
        try:
            change(other)
        finally:
            other.close()

    yield storage, elsewhere
    storage.close()


async def test_settings_are_dropped_once_each_time_the_version_moves(database):
    storage, elsewhere = database
    process = Process(storage)
    await process.follower.follow_settings()
    assert process.drops == 1  # the first read drops what was cached before it
    await process.follower.follow_settings()
    assert process.drops == 1  # nothing moved
    elsewhere(lambda s: s.guilds.update_settings(GUILD, autoresponse="channels"))
    await process.follower.follow_settings()
    await process.follower.follow_settings()
    assert process.drops == 2


async def test_a_profile_chosen_elsewhere_is_loaded_and_switched_to(database, caplog):
    storage, elsewhere = database
    process = Process(storage)
    await process.follower.follow_profile()  # learns the stored choice (none): no switch
    elsewhere(lambda s: setattr(s.meta, "active_profile", "cpu-fast"))
    with caplog.at_level(logging.INFO, logger="cogs.memory.follow"):
        await process.follower.follow_profile()
        await process.settled()
    assert process.switched == ["cpu-fast"]
    assert "hardware profile is now cpu-fast, as another process chose" in caplog.text
    await process.follower.follow_profile()
    await process.settled()
    assert process.switched == ["cpu-fast"]  # once per change of the stored choice


async def test_a_profile_that_cannot_load_here_leaves_this_one(database, caplog):
    storage, elsewhere = database
    process = Process(storage)
    await process.follower.follow_profile()
    elsewhere(lambda s: setattr(s.meta, "active_profile", "no-such-profile"))
    with caplog.at_level(logging.ERROR, logger="cogs.memory.follow"):
        await process.follower.follow_profile()
        await process.settled()
    assert process.switched == [] and process.profile == "test"
    assert "cannot be used here" in caplog.text and "this process keeps test" in caplog.text
