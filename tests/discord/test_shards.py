"""One memory, several bot processes: shards, whose guild is whose, and changes that
reach every process.

Each process runs some of the bot's shards (``bot.py run --shard-count N --shards
a,b``) over one shared database.  Here two real bots (discord.py objects from
gateway payloads, as Discord would send each process the guilds of its shards)
stand for two processes on one SQLite file; the stand-in for Discord's REST API
answers the guild list.  tests/discord/test_shard_processes.py runs real processes
against a stand-in gateway and PostgreSQL.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Callable

import discord
import pytest
from discord.ext import commands

from cogs.memory.bot import MemoryBot, ShardedMemoryBot, memory_bot
from cogs.memory.shards import Shards, shard_of
from memory.config import Profile, ReconcileConfig
from memory.engine import MemoryEngine
from memory.errors import ConfigError
from memory.storage import open_storage
from tests.support.builders import HashEmbedder, record_factory
from tests.support.discord_harness import READ, Harness, channel, guild, member, role
from tests.support.discord_standin import FakeDiscord
from tests.support.sqlite import sql_write

ALICE, OWNER = 1301, 1302
# recent messages are not compared here: what is checked is which guilds are judged
PROFILE = Profile(name="test", reconcile=ReconcileConfig(pause_s=0, recent_messages=0))


def guild_on(shard: int, n: int, count: int = 2) -> int:
    """A guild id Discord sends on ``shard`` of ``count`` (its creation time picks it)."""
    gid = ((1000 + n * count + shard) << 22) + n
    assert shard_of(gid, count) == shard
    return gid


G0, L0 = guild_on(0, 1), guild_on(0, 2)  # shard 0: the bot is in G0, left L0 while offline
G1, L1 = guild_on(1, 1), guild_on(1, 2)  # shard 1: the bot is in G1, left L1 while offline


def server(gid: int) -> dict:
    return guild(gid, f"guild {gid}", owner=OWNER, roles=[role(gid, "@everyone", READ, position=0)],
                 members=[member(ALICE, "alice"), member(OWNER, "owner")],
                 channels=[channel(gid + 1, gid, "general"), channel(gid + 2, gid, "random")])


def listed(*gids: int) -> list[dict]:
    """GET /users/@me/guilds: every guild the bot is in, whichever shard it is on."""
    return [{"id": str(g), "name": f"guild {g}", "icon": None, "owner": False,
             "permissions": "0", "features": []} for g in gids]


# -- which shard is whose -----------------------------------------------------------------


@pytest.mark.parametrize(("count", "ids", "problem"), [
    (0, (0,), "--shard-count must be 1 or more"),
    (2, (), "names no shard"),
    (2, (2,), "--shards 2: with --shard-count 2 the ids are 0 to 1"),
    (4, (0, 4, 7), "--shards 4,7: with --shard-count 4 the ids are 0 to 3"),
    (4, (-1,), "--shards -1"),
    (4, (1, 3, 1), "names shard 1 twice"),
])
def test_shards_outside_the_count_or_twice_are_refused(count, ids, problem):
    with pytest.raises(ConfigError, match=problem):
        Shards(count, ids)


@pytest.mark.parametrize(("shards", "guilds", "owned"), [
    (Shards(), [G0, L0, G1, L1], [G0, L0, G1, L1]),  # unsharded: every guild
    (Shards(2, (0,)), [G0, L0, G1, L1], [G0, L0]),
    (Shards(2, (1,)), [G0, L0, G1, L1], [G1, L1]),
    (Shards(2, (1, 0)), [G0, G1], [G0, G1]),
    (Shards(4, (0, 2)), [guild_on(s, 1, 4) for s in range(4)],
     [guild_on(0, 1, 4), guild_on(2, 1, 4)]),
])
def test_a_process_owns_the_guilds_of_its_shards(shards, guilds, owned):
    assert [g for g in guilds if shards.owns(g)] == owned


def test_shards_are_kept_in_order_and_described():
    assert Shards(4, (3, 1)).ids == (1, 3)
    assert Shards(4, (3, 1)).describe() == "shards 1,3 of 4"
    assert Shards(4, (2,)).describe() == "shard 2 of 4"
    assert Shards(2, (0, 1)).describe() == "all 2 shards" and Shards(2, (0, 1)).all
    assert Shards().describe() == "one shard"


def test_the_bot_is_sharded_only_when_asked(tmp_path):
    engine = MemoryEngine(tmp_path / "bot.sqlite3", PROFILE, HashEmbedder(), load_reranker=False)
    try:
        plain = memory_bot(engine, owns_engine=False)
        assert type(plain) is MemoryBot and not isinstance(plain, commands.AutoShardedBot)
        assert plain.shard_count is None and Shards.of(plain) == Shards()
        sharded = memory_bot(engine, shards=Shards(4, (2, 0)), owns_engine=False)
        assert isinstance(sharded, ShardedMemoryBot) and isinstance(sharded, commands.AutoShardedBot)
        assert isinstance(sharded, MemoryBot)
        assert sharded.shard_count == 4 and sharded.shard_ids == [0, 2]
        assert Shards.of(sharded) == Shards(4, (0, 2))
    finally:
        engine.close()


# -- forgetting the guilds the bot left: each process judges its own ----------------------


@pytest.fixture
async def fake(monkeypatch):
    stand_in = FakeDiscord()
    monkeypatch.setattr(discord.http.Route, "BASE", await stand_in.start())
    yield stand_in
    await stand_in.stop()


@pytest.fixture
def shared_db(tmp_path) -> str:
    """One database holding all four guilds, as the bot's processes wrote it before."""
    location = str(tmp_path / "shared.sqlite3")
    engine = MemoryEngine(location, PROFILE, HashEmbedder(), load_reranker=False)
    make_record = record_factory()
    try:
        for gid in (G0, L0, G1, L1):
            engine.storage.messages.upsert([make_record(f"hello {gid}", guild_id=gid,
                                                        channel_id=gid + 1, age_days=0)])
            engine.storage.guilds.update_settings(gid, retention_days=30)
    finally:
        engine.close()
    return location


async def run_process(location: str, fake: FakeDiscord, shards: Shards, guilds: list[int]):
    """Start one process's bot (the guilds of its shards cached), reconcile as at start-up."""
    engine = MemoryEngine(location, PROFILE, HashEmbedder(), load_reranker=False)
    h = Harness(engine, [server(g) for g in guilds], shards=shards)
    await h.start()
    await h.bot.http.static_login("good-token")
    try:
        progress = await h.reconciler.at_start_up()
    finally:
        await h.close()
        await h.bot.http.close()
        engine.close()
    return progress


def stored_guilds(location: str) -> set[int]:
    storage = open_storage(location)
    try:
        return set(storage.messages.known_guild_ids())
    finally:
        storage.close()


async def test_each_process_forgets_only_the_left_guilds_of_its_own_shards(fake, shared_db):
    """Shard 1's guilds are not in shard 0's cache because another process runs them:
    shard 0's process must not judge them, or one process forgets another's guilds."""
    fake.guilds = listed(G0, G1)
    progress = await run_process(shared_db, fake, Shards(2, (0,)), [G0])
    assert stored_guilds(shared_db) == {G0, G1, L1}, "L0 forgotten; shard 1's guilds untouched"
    assert progress.guilds_forgotten == 1

    progress = await run_process(shared_db, fake, Shards(2, (1,)), [G1])
    assert stored_guilds(shared_db) == {G0, G1}
    assert progress.guilds_forgotten == 1


async def test_a_process_whose_guilds_are_all_there_does_not_ask_for_the_guild_list(
    fake, shared_db
):
    """Other shards' guilds are never missing from this process's point of view: with
    thousands of guilds spread over processes, none of them pages through the list."""
    fake.guilds = listed(G0, G1)
    await run_process(shared_db, fake, Shards(2, (1,)), [G1])  # forgets L1
    fake.requests.clear()
    await run_process(shared_db, fake, Shards(2, (0,)), [G0, L0])  # the bot is back in L0
    assert not [p for p, _ in fake.requests if p.endswith("/users/@me/guilds")]
    assert stored_guilds(shared_db) == {G0, L0, G1}


async def test_an_unsharded_bot_still_judges_every_stored_guild(fake, shared_db):
    fake.guilds = listed(G0, G1)
    progress = await run_process(shared_db, fake, Shards(), [G0, G1])
    assert stored_guilds(shared_db) == {G0, G1} and progress.guilds_forgotten == 2


async def test_retention_runs_in_the_process_of_the_guilds_shard(tmp_path):
    """Each process purges the guilds of its own shards: the ones Discord sends it."""
    location = str(tmp_path / "shared.sqlite3")
    make_record = record_factory()
    old = [make_record(f"old news {gid}", guild_id=gid, channel_id=gid + 1, age_days=400)
           for gid in (G0, G1)]
    engines = [MemoryEngine(location, PROFILE, HashEmbedder(), load_reranker=False)
               for _ in range(2)]
    engines[0].storage.messages.upsert(old)
    for gid in (G0, G1):
        engines[0].storage.guilds.update_settings(gid, retention_days=30)
    processes = [Harness(engines[shard], [server(gid)], shards=Shards(2, (shard,)))
                 for shard, gid in enumerate((G0, G1))]
    try:
        for h in processes:
            await h.start()
        messages = engines[0].storage.messages
        await processes[0].runtime.enforce_retention()
        assert messages.count(G0) == 0, "its own guild: purged"
        assert messages.count(G1) == 1, "shard 1's: left to the process that runs it"
        await processes[1].runtime.enforce_retention()
        assert messages.count(G1) == 0
    finally:
        for h in processes:
            await h.close()
        for engine in engines:
            engine.close()


# -- changes made by another process reach this one ----------------------------------------


@pytest.fixture
async def harness(tmp_path):
    engine = MemoryEngine(tmp_path / "bot.sqlite3", PROFILE, HashEmbedder(), load_reranker=False)
    h = Harness(engine, [server(G0)], owner_ids=[OWNER])
    await h.start()
    h.runtime.follower.follow_changes.cancel()  # the tests run its passes by hand, when they choose
    await h.runtime.follower.follow_settings()  # what the loop's first pass does at start-up
    await h.runtime.follower.follow_profile()
    yield h
    await h.close()
    engine.close()


def another_process(h: Harness, change: Callable) -> None:
    """Run ``change`` on a storage of its own on the bot's database: another process."""
    storage = open_storage(h.engine.storage.database.location)
    try:
        change(storage)
    finally:
        storage.close()


async def said(h: Harness, text: str, where: int) -> bool:
    """Dispatch a message; whether it was stored."""
    message = h.message(text, author=(ALICE, "alice"), channel=where)
    await h.listeners.on_message(message)
    await h.runtime.writes.run_and_wait(lambda: None)
    return bool(h.engine.storage.messages.hydrate([message.id]))


async def test_a_settings_change_made_elsewhere_applies_once_followed(harness):
    h, general, rnd = harness, G0 + 1, G0 + 2
    assert await said(h, "kept", rnd)  # the guild's settings are cached now
    another_process(h, lambda s: s.guilds.update_settings(G0, channel_mode="exclude",
                                                          add_channel=rnd))
    assert await said(h, "still cached: kept", rnd), "the cache is what this test is about"
    await h.runtime.follower.follow_settings()
    assert not await said(h, "excluded now", rnd)
    assert await said(h, "general is still remembered", general)
    await h.slash("memory-admin channels show", invoker=member(OWNER, "owner"), where=general,
                  permissions=discord.Permissions(manage_guild=True))
    assert "Mode **exclude**" in h.adapter.callbacks[-1]["data"]["content"]


async def test_the_cache_stays_while_the_version_does_not_move(harness):
    """Following is one read of one number; the cached settings stay until it moves."""
    h = harness
    another_process(h, lambda s: s.guilds.update_settings(G0, autoresponse="channels"))
    await h.runtime.follower.follow_settings()
    assert (await h.runtime.guild_settings.get(G0)).autoresponse == "channels"  # cached now
    # a write that does not move the version (a hand edit, or an older bot version)
    sql_write(h.engine.storage.database.location,
              f"UPDATE guild_settings SET autoresponse = 'off' WHERE guild_id = {G0}")
    await h.runtime.follower.follow_settings()
    assert (await h.runtime.guild_settings.get(G0)).autoresponse == "channels", "nothing said it moved"
    another_process(h, lambda s: s.forgetting.forget_member(G0, ALICE))  # forget-me elsewhere
    await h.runtime.follower.follow_settings()
    settings = await h.runtime.guild_settings.get(G0)
    assert ALICE in settings.opted_out and settings.autoresponse == "off"


async def wait_for(condition: Callable[[], bool], what: str) -> None:
    for _ in range(400):
        if condition():
            return
        await asyncio.sleep(0.025)
    raise AssertionError(f"timed out waiting for {what}")


async def test_a_profile_switch_made_elsewhere_is_followed_and_not_written_back(harness, caplog):
    h = harness
    assert h.engine.rerankers.profile_name == "test"
    another_process(h, lambda s: setattr(s.meta, "active_profile", "cpu-fast"))
    with caplog.at_level(logging.INFO, logger="cogs.memory.follow"):
        await h.runtime.follower.follow_profile()
        await wait_for(lambda: h.engine.profile.name == "cpu-fast", "the profile to follow")
    assert h.engine.rerankers.profile_name == "cpu-fast"
    assert h.engine.storage.meta.active_profile == "cpu-fast"
    assert any("as another process chose" in r.getMessage() for r in caplog.records)
    await h.runtime.follower.follow_profile()  # the same choice again: nothing more to do
    assert sum("loading it" in r.getMessage() for r in caplog.records) == 1


async def test_a_profile_this_process_cannot_load_is_said_once_and_the_old_one_kept(
    harness, caplog
):
    h = harness
    another_process(h, lambda s: setattr(s.meta, "active_profile", "made-on-another-machine"))
    with caplog.at_level(logging.ERROR, logger="cogs.memory.follow"):
        await h.runtime.follower.follow_profile()
        await wait_for(lambda: bool(caplog.records), "the failure to be logged")
        for _ in range(3):
            await h.runtime.follower.follow_profile()
    assert h.engine.rerankers.profile_name == "test"
    [record] = caplog.records
    assert "made-on-another-machine" in record.getMessage()
    assert "this process keeps test" in record.getMessage()


async def test_the_profile_a_process_started_with_is_kept_until_the_next_switch(tmp_path):
    """``run --profile X`` beside a stored choice Y: the stored Y is not a new switch."""
    location = tmp_path / "bot.sqlite3"
    first = MemoryEngine(location, PROFILE, HashEmbedder(), load_reranker=False)
    first.storage.meta.active_profile = "cpu-fast"
    first.close()
    engine = MemoryEngine(location, PROFILE, HashEmbedder(), load_reranker=False)
    h = Harness(engine, [server(G0)])
    await h.start()
    try:
        for _ in range(3):
            await h.runtime.follower.follow_profile()
        assert h.engine.rerankers.profile_name == "test"
    finally:
        await h.close()
        engine.close()


async def test_an_owner_switch_here_is_not_followed_again(harness, caplog):
    h = harness
    with caplog.at_level(logging.INFO, logger="cogs.memory.follow"):
        await h.slash("memory-owner profile", invoker=member(OWNER, "owner"), where=G0 + 1,
                      permissions=discord.Permissions.all(), name="cpu-fast")
        await h.runtime.follower.follow_profile()
    assert "now **cpu-fast**" in h.adapter.followups[-1]["content"]
    assert h.engine.storage.meta.active_profile == "cpu-fast"
    assert not [r for r in caplog.records if "another process" in r.getMessage()]


async def test_following_survives_a_database_error_that_is_not_ours(harness, caplog):
    h = harness
    location = h.engine.storage.database.location
    sql_write(location, "ALTER TABLE meta RENAME TO meta_away")
    with caplog.at_level(logging.WARNING, logger="cogs.memory.follow"):
        await h.runtime.follower.follow_changes()  # one pass of the loop, run by hand
    assert "reading other processes' changes failed" in caplog.records[-1].getMessage()
    sql_write(location, "ALTER TABLE meta_away RENAME TO meta")
    another_process(h, lambda s: s.guilds.update_settings(G0, autoresponse="off"))
    await h.runtime.follower.follow_changes()
    assert (await h.runtime.guild_settings.get(G0)).autoresponse == "off"
