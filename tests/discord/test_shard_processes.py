"""Two, then four bot processes, each running its own shards, sharing one PostgreSQL
(and two sharing one SQLite file).

Each process is :mod:`tests.support.shard_bot` (``bot.py run --shard-count 4
--shards ...`` with the deterministic embedder) connected to one stand-in for
Discord (:class:`tests.support.gateway_standin.FakeGateway`): a gateway that sends
each shard's guilds to the process that identified that shard, and the REST API
those processes call.  Before they start, the database holds what earlier runs
stored: messages of four guilds the bot is still in (some posted or deleted on
Discord while it was offline) and of four guilds it left meanwhile, one per shard.

Then, all at once: messages and deletions on every shard, late copies of deleted
messages, redelivered messages, a profile switch by the owner in one process, a
settings change made by another process, and a guild removing the bot.  The end
state is checked against what each event says: nothing lost or stored twice,
every deletion wins, every message embedded exactly once (counted in the
embedders' own logs), every start-up task done by the process that owns the
guild, and changes reaching every process.  Waits are on conditions, never on
time alone.
"""

from __future__ import annotations

import itertools
import json
import os
import re
import signal
import subprocess
import sys
import time
from collections import Counter
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from datetime import datetime, timedelta, timezone
from pathlib import Path
from typing import Any

import discord
import pytest

from cogs.memory.shards import shard_of
from memory.records import MessageRecord, datetime_to_ms
from memory.storage import Storage, open_storage
from tests.support.discord_harness import READ, channel, guild, member, role, user
from tests.support.gateway_standin import APP_ID, FakeGateway, serve_in_thread

pytestmark = pytest.mark.slow

ROOT = Path(__file__).resolve().parents[2]
SHARDS = 4
ALICE, OWNER = 1301, 1302
ROUNDS = 25  # rounds of live traffic; each sends to every shard's guild
WAIT_S = 120.0  # what a condition may take at most before the test gives up on it

TALK, CHURN, OFFLINE, MISC = 1, 2, 3, 4  # channel id = guild id + this
NAMES = {TALK: "talk", CHURN: "churn", OFFLINE: "offline", MISC: "misc"}


def guild_on(shard: int, n: int) -> int:
    gid = ((2000 + n * SHARDS + shard) << 22) + 17
    assert shard_of(gid, SHARDS) == shard
    return gid


LIVE = [guild_on(s, 1) for s in range(SHARDS)]  # the bot is in these all along
LEFT = [guild_on(s, 2) for s in range(SHARDS)]  # it left these while offline
REMOVED = guild_on(0, 3)  # it is removed from this one while running (shard 0)


def server(gid: int) -> dict[str, Any]:
    return guild(gid, f"guild {gid}", owner=OWNER, roles=[role(gid, "@everyone", READ, position=0)],
                 members=[member(ALICE, "alice"), member(OWNER, "owner")],
                 channels=[channel(gid + k, gid, name) for k, name in NAMES.items()])


class Snowflakes:
    """Message ids from a moment on, a millisecond apart."""

    def __init__(self, start: datetime) -> None:
        self._ids = itertools.count(discord.utils.time_snowflake(start), 1 << 22)

    def __next__(self) -> int:
        return next(self._ids)


def payload(mid: int, gid: int, where: int) -> dict[str, Any]:
    """A message as the gateway and the history pages carry it."""
    return {"id": str(mid), "channel_id": str(gid + where), "guild_id": str(gid),
            "author": user(ALICE, "alice"),
            "member": {"nick": None, "roles": [], "joined_at": "2025-01-01T00:00:00+00:00",
                       "deaf": False, "mute": False, "flags": 0},
            "content": f"note {mid} about the garden plans in {NAMES[where]}",
            "timestamp": discord.utils.snowflake_time(mid).isoformat(),
            "edited_timestamp": None, "tts": False, "mention_everyone": False, "mentions": [],
            "mention_roles": [], "attachments": [], "embeds": [], "pinned": False, "type": 0,
            "flags": 0}


def record(mid: int, gid: int, where: int) -> MessageRecord:
    """What an earlier run stored of :func:`payload`."""
    return MessageRecord(
        id=mid, guild_id=gid, channel_id=gid + where, author_id=ALICE,
        created_at=datetime_to_ms(discord.utils.snowflake_time(mid)),
        content=payload(mid, gid, where)["content"], author_name="alice",
        author_display_name="Alice", guild_name=f"guild {gid}", channel_name=NAMES[where],
        channel_type="text")


@dataclass
class World:
    """What happened, so the end state can be judged."""

    kept: set[int] = field(default_factory=set)  # must be stored at the end
    gone: set[int] = field(default_factory=set)  # must not be (deleted, left, excluded)

    def all(self) -> list[int]:
        return sorted(self.kept | self.gone)


def before_start(storage: Storage, gateway: FakeGateway, world: World) -> None:
    """What earlier runs stored, and what happened on Discord while no process ran."""
    ids = Snowflakes(datetime.now(timezone.utc) - timedelta(hours=2))
    for gid in LIVE:
        talk = [next(ids) for _ in range(5)]
        offline = [next(ids) for _ in range(3)]
        storage.messages.upsert([record(m, gid, TALK) for m in talk]
                                + [record(m, gid, OFFLINE) for m in offline])
        posted = [next(ids) for _ in range(4)]  # while offline: the catch-up reads them
        gateway.history[gid + TALK] = [payload(m, gid, TALK) for m in talk + posted]
        gateway.history[gid + OFFLINE] = [payload(m, gid, OFFLINE) for m in offline[:-1]]
        world.kept |= {*talk, *posted, *offline[:-1]}
        world.gone.add(offline[-1])  # deleted on Discord while offline: the reconcile's
    for gid in [*LEFT, REMOVED]:
        left = [next(ids) for _ in range(3)]
        storage.messages.upsert([record(m, gid, TALK) for m in left])
        gateway.history[gid + TALK] = [payload(m, gid, TALK) for m in left]
        world.gone |= set(left)
    for gid in LEFT:
        storage.guilds.update_settings(gid, retention_days=365)  # settings are forgotten too


# -- the processes ------------------------------------------------------------------------


@dataclass
class BotProcess:
    """One ``bot.py run --shards ...``-style process and the files it writes."""

    shards: tuple[int, ...]
    process: subprocess.Popen
    log: Path
    embeds: Path

    def said(self, text: str) -> int:
        return self.log.read_text(errors="replace").count(text)

    def tail(self) -> str:
        return "\n".join(self.log.read_text(errors="replace").splitlines()[-30:])


@contextmanager
def bot_processes(count: int, url: str, api: str, folder: Path) -> Iterator[list[BotProcess]]:
    """Start ``count`` processes, shard ``s`` in process ``s % count``; SIGTERM them at the end."""
    procs: list[BotProcess] = []
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    for index in range(count):
        shards = tuple(s for s in range(SHARDS) if s % count == index)
        log, embeds = folder / f"bot{index}.log", folder / f"bot{index}.embeds"
        with log.open("w") as out:
            process = subprocess.Popen(
                [sys.executable, "-m", "tests.support.shard_bot", "--db", url, "--api", api,
                 "--shard-count", str(SHARDS), "--shards", ",".join(map(str, shards)),
                 "--owner", str(OWNER), "--embeds", str(embeds)],
                cwd=ROOT, env=env, stdout=out, stderr=subprocess.STDOUT)
        procs.append(BotProcess(shards, process, log, embeds))
    try:
        yield procs
    finally:
        for p in procs:
            if p.process.poll() is None:
                p.process.send_signal(signal.SIGTERM)
        for p in procs:
            try:
                p.process.wait(60)
            except subprocess.TimeoutExpired:
                p.process.kill()
                p.process.wait(10)


def wait_until(condition: Callable[[], bool], what: str, procs: list[BotProcess]) -> None:
    """Poll ``condition`` until it holds; fail at once if a process died, or after WAIT_S."""
    deadline = time.monotonic() + WAIT_S
    while not condition():
        for p in procs:
            if p.process.poll() is not None:
                raise AssertionError(f"process for shards {p.shards} exited "
                                     f"{p.process.returncode} while waiting for {what}:\n{p.tail()}")
        if time.monotonic() > deadline:
            tails = "\n".join(f"-- shards {p.shards}:\n{p.tail()}" for p in procs)
            raise AssertionError(f"gave up waiting for {what}\n{tails}")
        time.sleep(0.1)


def owner_of(shard: int, procs: list[BotProcess]) -> BotProcess:
    return next(p for p in procs if shard in p.shards)


# -- interactions ---------------------------------------------------------------------------


class Commands:
    """Slash commands sent as INTERACTION_CREATE, answers read from the REST stand-in."""

    def __init__(self, gateway: FakeGateway) -> None:
        self.gateway = gateway
        self._ids = Snowflakes(datetime.now(timezone.utc))

    def send(self, gid: int, names: list[str], options: list[dict] | None = None, *,
             invoker: int = OWNER) -> str:
        """Run ``/names...`` in ``gid``'s #talk; returns the interaction's token."""
        data_options = options or []
        for depth, name in reversed(list(enumerate(names[1:], start=1))):
            data_options = [{"name": name, "type": 1 if depth == len(names) - 1 else 2,
                             "options": data_options}]
        iid, token = next(self._ids), f"token-{next(self._ids)}"
        where = gid + TALK
        self.gateway.dispatch(gid, "INTERACTION_CREATE", {
            "id": str(iid), "application_id": str(APP_ID), "type": 2, "token": token,
            "version": 1, "guild_id": str(gid), "channel_id": str(where),
            "channel": {"id": str(where), "type": 0, "name": "talk", "guild_id": str(gid),
                        "position": 0, "permission_overwrites": []},
            "member": member(invoker, "owner") | {
                "permissions": str(discord.Permissions.all().value)},
            "app_permissions": str(discord.Permissions.all().value), "locale": "en-US",
            "guild_locale": "en-US", "entitlements": [], "authorizing_integration_owners": {},
            "context": 0, "attachment_size_limit": 10_485_760,
            "data": {"id": str(next(self._ids)), "name": names[0], "type": 1,
                     "options": data_options}})
        return token

    def answer(self, token: str, procs: list[BotProcess]) -> str:
        """The last thing the bot said for the interaction, once it said something final."""
        replies: list[str] = []

        def answered() -> bool:
            replies[:] = [r for r in self.gateway.replies(token) if r]
            return bool(replies)

        wait_until(answered, f"an answer to interaction {token}", procs)
        return replies[-1]

    def until(self, gid: int, names: list[str], wanted: str, procs: list[BotProcess],
              options: list[dict] | None = None) -> str:
        """Run the command again until its answer contains ``wanted``."""
        seen: list[str] = []

        def says_it() -> bool:
            seen.append(self.answer(self.send(gid, names, options), procs))
            return wanted in seen[-1]

        wait_until(says_it, f"/{' '.join(names)} in guild {gid} to say {wanted!r}", procs)
        return seen[-1]


# -- the test -------------------------------------------------------------------------------


def stored(storage: Storage, ids: list[int]) -> set[int]:
    return set(storage.messages.hydrate(ids))


def live_traffic(gateway: FakeGateway, world: World) -> None:
    """Messages on every shard at once, churn (created then deleted), late and repeated copies."""
    ids = Snowflakes(datetime.now(timezone.utc))
    for n in range(ROUNDS):
        for gid in LIVE:  # one message each, round robin: every process writes at once
            talk, churn = next(ids), next(ids)
            gateway.dispatch(gid, "MESSAGE_CREATE", payload(talk, gid, TALK))
            gateway.dispatch(gid, "MESSAGE_CREATE", payload(churn, gid, CHURN))
            gateway.dispatch(gid, "MESSAGE_DELETE", {"id": str(churn), "channel_id":
                                                     str(gid + CHURN), "guild_id": str(gid)})
            world.kept.add(talk)
            world.gone.add(churn)
            if n % 5 == 4:
                gateway.dispatch(gid, "MESSAGE_CREATE", payload(churn, gid, CHURN))  # late copy
                gateway.dispatch(gid, "MESSAGE_CREATE", payload(talk, gid, TALK))  # redelivered


def embed_counts(procs: list[BotProcess]) -> Counter[int]:
    """How often each message was embedded, over every process's embedder."""
    counts: Counter[int] = Counter()
    for p in procs:
        for line in p.embeds.read_text().splitlines():
            found = re.search(r"note (\d+)", json.loads(line))
            if found:
                counts[int(found.group(1))] += 1
    return counts


@pytest.mark.parametrize(("engine", "processes"), [
    pytest.param("postgres", 2, marks=pytest.mark.postgres),
    pytest.param("postgres", 4, marks=pytest.mark.postgres),
    ("sqlite", 2),  # several processes on one host may share one SQLite file too
])
def test_bot_processes_share_one_memory(engine: str, processes: int, tmp_path: Path,
                                        request: pytest.FixtureRequest) -> None:
    if engine == "postgres":
        url = request.getfixturevalue("postgres_url")()
    else:
        url = str(tmp_path / "shared.sqlite3")
    gateway = FakeGateway(SHARDS, [server(gid) for gid in [*LIVE, REMOVED]])
    world = World()
    storage = open_storage(url)
    try:
        before_start(storage, gateway, world)
        with serve_in_thread(gateway) as api, \
                bot_processes(processes, url, api, tmp_path) as procs:
            run(storage, gateway, world, procs)
        for p in procs:  # SIGTERM: queued writes committed, a clean exit
            assert p.process.returncode == 0, p.tail()
        check_the_end(storage, world, procs)
    finally:
        storage.close()


def run(storage: Storage, gateway: FakeGateway, world: World, procs: list[BotProcess]) -> None:
    wait_until(lambda: gateway.connected() == set(range(SHARDS)), "every shard to connect", procs)
    assert sorted(tuple(i["shard"]) for i in gateway.identified) == [
        (s, SHARDS) for s in range(SHARDS)], "each shard identified once, by one process"
    wait_until(lambda: all(p.said("reconciled with Discord in") for p in procs),
               "every process's start-up catch-up and reconcile", procs)
    # each left guild was judged and forgotten by the process that owns its shard only
    assert set(storage.messages.known_guild_ids()) == {*LIVE, REMOVED}
    for shard, gid in enumerate(LEFT):
        for p in procs:
            forgot = p.said(f"the bot left guild {gid};")
            assert forgot == (1 if shard in p.shards else 0), (gid, p.shards)

    live_traffic(gateway, world)
    commands = Commands(gateway)

    # the owner switches the profile in the process of shard 0: every process follows
    switched = commands.answer(commands.send(LIVE[0], ["memory-owner", "profile"],
                                             [{"name": "name", "type": 3, "value": "cpu-fast"}]),
                               procs)
    assert switched == "Hardware profile is now **cpu-fast**."
    for shard in range(1, SHARDS):
        commands.until(LIVE[shard], ["memory", "stats"], "Hardware profile: cpu-fast", procs)

    # another process (here: the test) excludes #talk of shard 1's guild; its process follows.
    # The live traffic is stored first: a message still queued when the exclusion reaches
    # its process is judged by the new settings (the write thread applies them), so
    # changing them earlier would make this test race its own traffic.
    wait_until(lambda: stored(storage, sorted(world.kept)) == world.kept,
               "the live traffic stored before the settings change", procs)
    gid = LIVE[1]
    storage.guilds.update_settings(gid, channel_mode="exclude", add_channel=gid + TALK)
    commands.until(gid, ["memory-admin", "channels", "show"], "Mode **exclude**", procs)
    ids = Snowflakes(datetime.now(timezone.utc))
    excluded, marker = next(ids), next(ids)
    gateway.dispatch(gid, "MESSAGE_CREATE", payload(excluded, gid, TALK))
    gateway.dispatch(gid, "MESSAGE_CREATE", payload(marker, gid, MISC))
    world.gone.add(excluded)
    world.kept.add(marker)

    # the bot is removed from a guild of shard 0: its process forgets it, no other guild goes
    gateway.remove_guild(REMOVED)
    wait_until(lambda: REMOVED not in storage.messages.known_guild_ids(),
               "the removed guild to be forgotten", procs)
    wait_until(lambda: stored(storage, world.all()) == world.kept
               and storage.backlog.pending_count() == 0,
               "every message stored or forgotten as it should be, and embedded", procs)


def check_the_end(storage: Storage, world: World, procs: list[BotProcess]) -> None:
    kept = sorted(world.kept)
    assert stored(storage, world.all()) == world.kept, "nothing lost, every deletion won"
    assert storage.messages.count() == len(kept), "nothing stored twice, nothing else stored"
    assert set(storage.messages.known_guild_ids()) == set(LIVE)
    assert storage.backlog.pending_count() == 0
    assert set(storage.vectors.floats(kept)) == world.kept, "every stored message has its vector"
    counts = embed_counts(procs)
    assert {m: counts[m] for m in kept if counts[m] != 1} == {}, "each embedded exactly once"
    assert all(counts[m] <= 1 for m in world.gone), "a forgotten one at most before it went"
    assert storage.meta.active_profile == "cpu-fast"
    for p in procs:  # the owner's process switched; every other one followed, once
        assert p.said("as another process chose") == (0 if 0 in p.shards else 1), p.shards
