"""Messages in flight when the bot stops are stored, or marked for the next start's catch-up.

Issue 30, item 4: with the guild settings not cached, a message's listener awaited
them while the stop had already drained the write queue, and every message that
arrived while the cogs unloaded reached no listener at all.  Every test here runs on
both storage engines; none asserts a time.
"""

from __future__ import annotations

import asyncio
import itertools
import threading
import time
from datetime import datetime, timezone
from typing import Any

import discord
import pytest
import yarl

from cogs.memory import MemoryBot
from cogs.memory.runtime import EMBED_CHUNK_LIVE, _finish_at_stop
from cogs.memory.write_queue import Write
from memory.config import Profile, ReconcileConfig
from memory.engine import MemoryEngine
from tests.discord.test_shutdown import PacedEmbedder
from tests.support.builders import HashEmbedder, record_factory
from tests.support.discord_harness import READ, Harness, channel, guild, member, role, user
from tests.support.discord_standin import FakeDiscord
from tests.support.gateway_standin import FakeGateway, serve_in_thread

G, GENERAL, QUIET, SECRET, OWNER, ALICE = 100, 200, 201, 202, 10, 11
PROFILE = Profile(name="test", reconcile=ReconcileConfig(on_start=False))


def server() -> dict:
    return guild(G, "Test Guild", owner=OWNER, roles=[role(G, "@everyone", READ, position=0)],
                 members=[member(ALICE, "alice"), member(OWNER, "owner")],
                 channels=[channel(GENERAL, G, "general"), channel(QUIET, G, "quiet"),
                           channel(SECRET, G, "not-remembered")])


def open_engine(location: str, embedder: HashEmbedder | None = None) -> MemoryEngine:
    return MemoryEngine(location, PROFILE, embedder or HashEmbedder(), load_reranker=False)


def stored(location: str, ids: list[int]) -> set[int]:
    engine = open_engine(location)
    try:
        return set(engine.storage.messages.hydrate(ids))
    finally:
        engine.close()


def forget_secret(location: str) -> None:
    """The guild remembers every channel but SECRET (committed before the bot starts)."""
    engine = open_engine(location)
    try:
        engine.storage.guilds.update_settings(G, channel_mode="exclude", add_channel=SECRET)
    finally:
        engine.close()


async def hold_the_write_thread(h: Harness) -> threading.Event:
    """Hold the write thread up (as a long lock would) until the returned event is set."""
    release = threading.Event()

    def stuck(items: list) -> None:
        release.wait(10)

    h.runtime.writes.put(stuck, [1])
    await asyncio.sleep(0.05)  # the write thread has taken it
    return release


async def close_then_release(h: Harness, release: threading.Event) -> None:
    """Stop the bot while the write thread is held up, then let the thread go."""
    try:
        await h.bot.close()
    finally:
        release.set()


def deliver(h: Harness, messages: list[discord.Message]) -> None:
    """MESSAGE_CREATE as discord.py dispatches it: each listener becomes a task."""
    for message in messages:
        h.bot.dispatch("message", message)


async def test_messages_in_flight_at_close_with_a_cold_settings_cache_are_stored(db_location):
    forget_secret(db_location)
    h = Harness(open_engine(db_location), [server()])
    await h.start()
    assert not len(h.runtime.guild_settings), "the guild's settings are not cached yet"
    live = [h.message(f"sent as the bot stops {i}", author=(ALICE, "alice"), channel=GENERAL)
            for i in range(50)]
    hidden = h.message("in a channel the guild does not remember", author=(ALICE, "alice"),
                       channel=SECRET)
    deliver(h, [*live, hidden])
    await h.bot.close()  # in the same tick: every listener is still to run

    assert stored(db_location, [m.id for m in live]) == {m.id for m in live}
    assert not stored(db_location, [hidden.id]), "the guild's settings still decide"


async def test_live_messages_while_a_backlog_is_embedded_are_all_stored(db_location):
    embedder = PacedEmbedder()
    engine = open_engine(db_location, embedder)
    make = record_factory()
    engine.storage.messages.upsert(make(f"backlog message {i}", guild_id=G, channel_id=QUIET)
                                   for i in range(2000))
    h = Harness(engine, [server()])
    await h.start()
    while embedder.calls < 1:  # the backlog loop is embedding its first chunk
        await asyncio.sleep(0.01)
    live = [h.message(f"live message {i}", author=(ALICE, "alice"), channel=GENERAL)
            for i in range(200)]
    for start in range(0, len(live), 20):  # over a few ticks, as a gateway delivers them
        deliver(h, live[start:start + 20])
        await asyncio.sleep(0)
    await h.bot.close()

    assert stored(db_location, [m.id for m in live]) == {m.id for m in live}
    reopened = open_engine(db_location)
    try:
        # the stop waited for the small chunk being embedded (two at most), not a 256 one
        pending = reopened.storage.backlog.pending_count()
        assert pending >= 2000 + len(live) - 2 * EMBED_CHUNK_LIVE, pending
    finally:
        reopened.close()


# -- a real gateway connection: events keep coming while the bot closes -------------------

def message_payload(mid: int, where: int) -> dict[str, Any]:
    return {"id": str(mid), "channel_id": str(where), "guild_id": str(G),
            "author": user(ALICE, "alice"),
            "member": {"nick": None, "roles": [], "joined_at": "2025-01-01T00:00:00+00:00",
                       "deaf": False, "mute": False, "flags": 0},
            "content": f"live note {mid}", "timestamp": discord.utils.snowflake_time(mid).isoformat(),
            "edited_timestamp": None, "tts": False, "mention_everyone": False, "mentions": [],
            "mention_roles": [], "attachments": [], "embeds": [], "pinned": False, "type": 0,
            "flags": 0}


class Stream:
    """Sends MESSAGE_CREATEs one after another from its own thread until stopped."""

    def __init__(self, gateway: FakeGateway) -> None:
        self.gateway = gateway
        self.ids = itertools.count(discord.utils.time_snowflake(datetime.now(timezone.utc)), 1 << 22)
        self.stopped = threading.Event()
        self.sent = 0
        self.thread = threading.Thread(target=self._run, daemon=True, name="message-stream")

    def _run(self) -> None:
        while not self.stopped.is_set():
            try:
                self.gateway.dispatch(G, "MESSAGE_CREATE", message_payload(next(self.ids), GENERAL))
            except Exception:  # the bot hung up: its connection is gone
                time.sleep(0.01)
                continue
            self.sent += 1
            time.sleep(0.002)


@pytest.fixture
def gateway(monkeypatch):
    fake = FakeGateway(1, [server()])
    with serve_in_thread(fake) as base:
        monkeypatch.setattr(discord.http.Route, "BASE", base)
        monkeypatch.setattr(discord.gateway.DiscordWebSocket, "DEFAULT_GATEWAY",
                            yarl.URL(f"ws://127.0.0.1:{fake.port}/ws"))
        yield fake


async def test_every_message_heard_while_the_bot_closes_is_stored(gateway, db_location):
    embedder = PacedEmbedder()  # closing waits for a chunk: the gateway keeps talking meanwhile
    engine = open_engine(db_location, embedder)
    make = record_factory()
    engine.storage.messages.upsert(make(f"backlog message {i}", guild_id=G, channel_id=QUIET)
                                   for i in range(2000))
    bot = MemoryBot(engine, owner_ids={OWNER})
    heard: list[int] = []

    async def hear(message: discord.Message) -> None:  # the bot's own listener: never unloaded
        heard.append(message.id)

    bot.add_listener(hear, "on_message")
    await bot.login("good-token")
    connection = asyncio.create_task(bot.connect(reconnect=False))
    await asyncio.wait_for(bot.wait_until_ready(), 30)
    while embedder.calls < 1:
        await asyncio.sleep(0.01)
    stream = Stream(gateway)
    stream.thread.start()
    while len(heard) < 50:
        await asyncio.sleep(0.01)
    try:
        await bot.close()
    finally:
        stream.stopped.set()
        await asyncio.to_thread(stream.thread.join, 10)
        await asyncio.wait_for(connection, 10)

    assert len(heard) >= 50
    assert stored(db_location, heard) == set(heard), (
        f"{len(set(heard) - stored(db_location, heard))} of {len(heard)} heard messages lost")


# -- what cannot be stored in time is marked, and the next start's catch-up reads it ------

async def test_a_message_the_stop_cannot_store_is_marked_and_caught_up(db_location, monkeypatch):
    monkeypatch.setattr("cogs.memory.runtime.SHUTDOWN_WRITES_S", 0.2)
    older = record_factory()("said before in general", guild_id=G, channel_id=GENERAL)
    engine = open_engine(db_location)
    engine.storage.messages.upsert([older])
    h = Harness(engine, [server()])
    await h.start()
    release = await hold_the_write_thread(h)
    general = [h.message(f"general, after the stored one {i}", author=(ALICE, "alice"),
                         channel=GENERAL) for i in range(3)]
    first = h.message("the first message ever in quiet", author=(ALICE, "alice"), channel=QUIET)
    deliver(h, [*general, first])
    await close_then_release(h, release)

    reopened = open_engine(db_location)
    try:
        assert not reopened.storage.messages.hydrate([m.id for m in [*general, first]])
        assert reopened.storage.guilds.missed() == {GENERAL: [m.id for m in general],
                                                    QUIET: [first.id]}
    finally:
        reopened.close()

    # the next start: Discord's history holds them (and one sent while the bot was down)
    fake = FakeDiscord()
    monkeypatch.setattr(discord.http.Route, "BASE", await fake.start())
    monkeypatch.setattr("cogs.memory.backfill.PAGE_PAUSE_S", 0)
    after_stop = h.message("sent while the bot was away", author=(ALICE, "alice"), channel=QUIET)
    for m in [*general, first, after_stop]:
        data = h.message_payload(m.content, author=(ALICE, "alice"), channel=m.channel.id)
        fake.history[m.channel.id].append(data | {"id": str(m.id)})
    again = Harness(open_engine(db_location), [server()])
    await again.start()
    await again.bot.http.static_login("good-token")
    try:
        await again.listeners.on_ready()
        await again.backfill.catch_ups.task
        await again.runtime.writes.run_and_wait(lambda: None)
        wanted = [m.id for m in [*general, first, after_stop]]
        assert set(again.engine.storage.messages.hydrate(wanted)) == set(wanted)
        assert again.engine.storage.guilds.missed() == {}
        starts = {path.split("/")[-2]: query.get("after") for path, query in fake.requests}
        assert starts[str(QUIET)] == str(first.id - 1), "the channel's first message included"
    finally:
        await again.bot.close()
        await fake.stop()


async def test_a_delete_and_an_edit_the_stop_cannot_queue_are_applied_at_stop(
    db_location, monkeypatch
):
    """The write thread is held up when the bot stops: a deletion and an edit heard just
    before are applied by the stop itself (the next start's reconcile reads only recent
    messages, and nothing would find the edit), not only logged."""
    monkeypatch.setattr("cogs.memory.runtime.SHUTDOWN_WRITES_S", 0.2)
    make = record_factory()
    deleted = make("my phone number is 555-0199", guild_id=G, channel_id=GENERAL, author_id=ALICE)
    edited = make("my address is 12 Elm Street", guild_id=G, channel_id=GENERAL, author_id=ALICE)
    engine = open_engine(db_location)
    engine.ingest([deleted, edited])
    h = Harness(engine, [server()])
    await h.start()
    release = await hold_the_write_thread(h)
    h.bot.dispatch("raw_message_delete", discord.RawMessageDeleteEvent(
        {"id": str(deleted.id), "channel_id": str(GENERAL), "guild_id": str(G)}))
    data = h.message_payload("(removed)", author=(ALICE, "alice"), channel=GENERAL)
    data |= {"id": str(edited.id), "edited_timestamp": "2026-01-02T00:00:00+00:00"}
    message = discord.Message(state=h.state, channel=h.guild.get_channel(GENERAL), data=data)
    h.bot.dispatch("raw_message_edit", discord.RawMessageUpdateEvent(data=data, message=message))
    await asyncio.sleep(0.05)  # both listeners have queued their write
    await close_then_release(h, release)
    reopened = open_engine(db_location)
    try:
        left = reopened.storage.messages.hydrate([deleted.id, edited.id])
        assert deleted.id not in left
        assert left[edited.id].content == "(removed)"
        assert reopened.search("Elm Street", guild_id=G, mode="keyword").hits == []
        assert reopened.storage.guilds.missed() == {}  # nothing for the catch-up to read
    finally:
        reopened.close()


async def test_one_write_refused_at_stop_costs_the_others_nothing(db_location):
    """At stop, new messages are marked first, then each edit and deletion is applied
    alone: one the database refuses leaves the others done."""
    make = record_factory()
    deleted = make("my phone number is 555-0199", guild_id=G, channel_id=GENERAL)
    new = make("sent as the bot stopped", guild_id=G, channel_id=QUIET)
    engine = open_engine(db_location)
    engine.ingest([deleted])

    def refused_edit(records: list) -> None:
        raise ValueError("a record the database refuses")

    def store_new(records: list) -> None:
        raise AssertionError("new messages are marked, not stored, at stop")

    left = [Write(refused_edit, [make("edited")]), Write(engine.forget_messages, [deleted.id]),
            Write(store_new, [new])]
    try:
        await _finish_at_stop(left, new=store_new, order_free=(refused_edit, engine.forget_messages),
                              guilds=engine.storage.guilds)
        assert engine.storage.messages.hydrate([deleted.id]) == {}
        assert engine.storage.guilds.missed() == {QUIET: [new.id]}
    finally:
        engine.close()


def test_missed_marks_are_ids_only_and_go_with_their_channel_or_guild(db_location):
    engine = open_engine(db_location)
    try:
        marks = engine.storage.guilds
        marks.mark_missed([(G, GENERAL, 5), (G, GENERAL, 3), (G, QUIET, 7), (G + 1, 900, 9)])
        marks.mark_missed([(G, GENERAL, 3)])  # marked twice: kept once
        assert marks.missed() == {GENERAL: [3, 5], QUIET: [7], 900: [9]}
        marks.clear_missed(GENERAL, [3])
        assert marks.missed() == {GENERAL: [5], QUIET: [7], 900: [9]}
        engine.forget_channels([QUIET])
        engine.forget_guild(G + 1)
        assert marks.missed() == {GENERAL: [5]}
    finally:
        engine.close()
