"""Backfill and start-up catch-up against a stand-in for Discord's REST API on 127.0.0.1.

discord.py's own HTTP client makes the requests (its paging, its 429 handling);
only the server answering them is ours (tests/support/discord_standin.py).
"""

from __future__ import annotations

import asyncio
import threading
from datetime import datetime, timedelta, timezone

import discord
import pytest

from cogs.memory.backfill import Progress
from cogs.memory.capture import record_from_message
from memory.config import Profile, ReconcileConfig
from memory.engine import MemoryEngine
from tests.support.builders import HashEmbedder
from tests.support.discord_harness import (
    BOT_ID,
    HIDE,
    READ,
    Harness,
    archived_thread,
    channel,
    guild,
    member,
    overwrite,
    role,
    thread,
    user,
)
from tests.support.discord_standin import FakeDiscord

G, GENERAL, ARCHIVED = 950, 951, 952
VOICE, FORUM, POST = 953, 954, 955
VOICE_FIELDS = {"bitrate": 64000, "user_limit": 0, "rtc_region": None}
ALICE, ADMIN = 1201, 1202
MANAGE = discord.Permissions(manage_guild=True)


def server() -> dict:
    return guild(G, "Backfill Guild", owner=ADMIN, roles=[role(G, "@everyone", READ, position=0)],
                 members=[member(ALICE, "alice"), member(ADMIN, "admin")],
                 channels=[channel(GENERAL, G, "general"), channel(VOICE, G, "voice", type=2) | VOICE_FIELDS,
                           channel(FORUM, G, "help-forum", type=15)],
                 threads=[thread(POST, G, FORUM, "a forum post", owner=ALICE)])


@pytest.fixture
def memory_location(tmp_path) -> str:
    """The bot's database (a module may override it: tests/test_retention.py runs the
    backfill on every storage engine)."""
    return str(tmp_path / "bot.sqlite3")


@pytest.fixture
async def setup(memory_location, monkeypatch):
    fake = FakeDiscord()
    base = await fake.start()
    monkeypatch.setattr(discord.http.Route, "BASE", base)
    monkeypatch.setattr("cogs.memory.backfill.PAGE_PAUSE_S", 0)
    # start-up reconcile has its own tests (test_reconcile.py); these count backfill requests
    profile = Profile(name="test", reconcile=ReconcileConfig(on_start=False))
    engine = MemoryEngine(memory_location, profile, HashEmbedder(), load_reranker=False)
    h = Harness(engine, [server()])
    await h.start()
    await h.bot.http.static_login("good-token")
    yield h, fake
    await h.close()
    await h.bot.http.close()
    await fake.stop()
    engine.close()


def history(h: Harness, where: int, n: int, word: str = "history") -> list[dict]:
    return [h.message_payload(f"{word} message {i}", author=(ALICE, "alice"), channel=where)
            for i in range(n)]


async def backfill(h: Harness) -> str:
    await h.slash("memory-admin backfill", invoker=member(ADMIN, "admin"), where=GENERAL,
                  permissions=MANAGE)
    return h.adapter.edits[-1]["content"]


async def settle(h: Harness) -> None:
    await h.runtime.writes.stop()
    h.runtime.writes.start()


async def ready(h: Harness) -> None:
    """A READY (start-up, or a fresh session): wait for its catch-up to be stored."""
    await h.listeners.on_ready()
    await h.backfill.catch_ups.task
    await settle(h)


def kept(h: Harness, payloads: list[dict]) -> int:
    """How many of these messages are stored."""
    return len(h.engine.storage.messages.hydrate([int(p["id"]) for p in payloads]))


async def test_backfill_reads_channels_and_archived_threads_through_a_rate_limit(setup):
    h, fake = setup
    fake.history[GENERAL] = history(h, GENERAL, 250)
    archived = thread(ARCHIVED, G, GENERAL, "old thread", owner=ALICE, archived=True)
    fake.archived[GENERAL] = [archived]
    h.guild._add_thread(discord.Thread(guild=h.guild, state=h.state, data=archived))
    fake.history[ARCHIVED] = history(h, ARCHIVED, 30, "thread")
    h.guild._remove_thread(h.guild.get_thread(ARCHIVED))  # archived: not in the cache
    fake.rate_limit_next = 1

    summary = await backfill(h)
    assert summary.startswith("Backfill finished") and "280 stored" in summary
    assert h.engine.storage.messages.count() == 280
    statuses = [r for r in fake.requests if r[0].endswith(f"/{GENERAL}/messages")]
    assert len(statuses) == 1 + 3  # the 429, then 100 + 100 + 50
    assert h.engine.storage.guilds.backfill_cursor(GENERAL).complete
    # a second run reads nothing again
    fake.requests.clear()
    await backfill(h)
    assert not [r for r in fake.requests if r[0].endswith("/messages")]


async def test_a_stage_channels_text_chat_is_backfilled_and_caught_up(setup):
    h, fake = setup
    stage = FORUM + 100
    h.state.parse_channel_create(channel(stage, G, "town-hall", type=13) | VOICE_FIELDS)
    fake.history[stage] = history(h, stage, 5)
    summary = await backfill(h)
    assert "5 stored" in summary, summary
    fake.history[stage] = fake.history[stage] + timed(h, stage, [1])  # said while away
    await ready(h)
    assert kept(h, fake.history[stage]) == 6


async def test_an_archived_thread_named_to_the_backfill_is_fetched_and_read(setup):
    h, fake = setup
    gone = ARCHIVED + 200  # archived: not in discord.py's cache, described by the interaction
    fake.channels[gone] = thread(gone, G, GENERAL, "an old thread", owner=ALICE, archived=True)
    fake.history[gone] = [p | {"channel_id": str(gone)} for p in history(h, GENERAL, 4)]
    await h.slash("memory-admin backfill", invoker=member(ADMIN, "admin"), where=GENERAL,
                  permissions=MANAGE, archived=[archived_thread(gone, GENERAL)], channel=str(gone))
    assert "4 stored" in h.adapter.edits[-1]["content"], h.adapter.edits[-1]
    fake.forbidden.add(gone + 1)  # one the bot may not read
    await h.slash("memory-admin backfill", invoker=member(ADMIN, "admin"), where=GENERAL,
                  permissions=MANAGE, archived=[archived_thread(gone + 1, GENERAL)],
                  channel=str(gone + 1))
    assert h.adapter.followups[-1]["content"] == "I cannot read that thread."


@pytest.mark.parametrize("event", ["guild_channel_delete", "guild_remove"])
async def test_a_place_deleted_while_its_page_is_checked_stays_forgotten(setup, event):
    """CHANNEL_DELETE (or the bot leaving the guild) arrives while a fetched page waits to
    be stored: the forget runs first, and the page must not bring the messages back."""
    h, fake = setup
    fake.history[GENERAL] = history(h, GENERAL, 50, word="secretword")
    original = h.runtime.remembers
    fired: list[str] = []

    async def remembers(message):
        if not fired:
            fired.append(event)
            gone = h.guild.get_channel(GENERAL) if event == "guild_channel_delete" else h.guild
            await h.dispatch(event, gone)
            await settle(h)  # the queued forgetting is applied before the page
        return await original(message)

    h.runtime.remembers = remembers
    await backfill(h)
    await settle(h)
    assert fired == [event]
    assert h.engine.storage.messages.count() == 0
    if event == "guild_remove":  # invited back: the guild's messages are stored again
        await h.dispatch("guild_join", h.guild)
        fake.history[GENERAL] = history(h, GENERAL, 3, word="welcome back")
        h.runtime.remembers = original
        summary = await backfill(h)
        await settle(h)
        assert h.engine.storage.messages.count() == 3, summary


async def test_a_page_queued_before_the_bot_left_is_not_stored_when_it_rejoins(setup):
    """The database is busy: a page fetched before the bot left still waits in the queue
    when the bot is invited back; the rejoin takes effect behind it."""
    h, _ = setup
    stale = [record_from_message(h.message(f"said before the bot left {i}",
                                            author=(ALICE, "alice"), channel=GENERAL))
             for i in range(3)]
    release = threading.Event()
    h.runtime.writes.put(lambda items: release.wait(10), [1])  # the write thread is held up
    await h.dispatch("guild_remove", h.guild)
    h.runtime.writes.put(h.backfill._store_present, stale)
    await h.dispatch("guild_join", h.guild)
    release.set()
    await settle(h)
    assert h.engine.storage.messages.count() == 0
    fresh = record_from_message(h.message("after the rejoin", author=(ALICE, "alice"),
                                          channel=GENERAL))
    await h.runtime.writes.put_and_wait(h.backfill._store_present, [fresh])
    assert h.engine.storage.messages.count() == 1


async def test_backfill_reads_voice_chats_and_forum_posts(setup):
    """A voice channel's chat has no threads; a forum holds messages only in its posts."""
    h, fake = setup
    fake.history[VOICE] = history(h, VOICE, 5, "voice")
    fake.history[POST] = history(h, POST, 4, "post")
    summary = await backfill(h)
    assert summary.startswith("Backfill finished") and "9 stored" in summary
    assert h.engine.storage.messages.count() == 9
    read = {path.split("/")[-2] for path, _ in fake.requests if path.endswith("/messages")}
    assert read == {str(GENERAL), str(VOICE), str(POST)}, "never the forum itself"
    # the forum's name is stored from its posts' messages: the CLI's --channel finds them
    assert h.engine.storage.messages.channel_ids_named("HELP-forum", G) == [FORUM]
    assert h.engine.storage.messages.expand_channels([FORUM]) == (FORUM, POST)


async def test_backfill_resumes_after_a_crash_without_duplicates(setup):
    h, fake = setup
    fake.history[GENERAL] = history(h, GENERAL, 250)
    fake.stall_after = 2  # two pages, then the "process" dies
    run = asyncio.create_task(backfill(h))
    while len(fake.requests) < 3:
        await asyncio.sleep(0.01)
    await settle(h)
    run.cancel()
    with pytest.raises(asyncio.CancelledError):
        await run
    cursor = h.engine.storage.guilds.backfill_cursor(GENERAL)
    assert not cursor.complete and h.engine.storage.messages.count() == 200
    oldest_stored = min(int(m["id"]) for m in fake.history[GENERAL][-200:])
    assert cursor.before_id == oldest_stored

    fake.stall_after = None
    fake.requests.clear()
    summary = await backfill(h)
    assert summary.startswith("Backfill finished")
    assert fake.requests[0][1]["before"] == str(cursor.before_id)  # picked up where it stopped
    assert h.engine.storage.messages.count() == 250


async def test_backfill_and_live_capture_agree(setup):
    h, fake = setup
    payloads = history(h, GENERAL, 20)
    fake.history[GENERAL] = payloads
    # seen live meanwhile: an edit newer than the history page, and a delete
    edited = dict(payloads[5]) | {"content": "edited live",
                                  "edited_timestamp": datetime.now(timezone.utc).isoformat()}
    live = discord.Message(state=h.state, channel=h.guild.get_channel(GENERAL), data=edited)
    await h.listeners.on_raw_message_edit(discord.RawMessageUpdateEvent(edited, live))
    await h.listeners.on_raw_message_delete(discord.RawMessageDeleteEvent(
        {"id": payloads[6]["id"], "channel_id": str(GENERAL), "guild_id": str(G)}))
    await settle(h)
    await backfill(h)
    assert h.engine.storage.messages.count() == 19  # the deleted one stays deleted
    rows = h.engine.storage.messages.hydrate([int(payloads[5]["id"])])
    assert rows[int(payloads[5]["id"])].content == "edited live"


async def test_start_up_catches_up_from_the_newest_stored_message(setup):
    h, fake = setup
    payloads = history(h, GENERAL, 120)  # an hour ago
    fake.history[GENERAL] = payloads
    known = discord.Message(state=h.state, channel=h.guild.get_channel(GENERAL), data=payloads[9])
    h.engine.ingest([record_from_message(known)])  # stored by the bot's last run
    await ready(h)
    assert h.engine.storage.messages.count() == 1 + 110  # the known one and everything after it
    assert all("after" in query for _, query in fake.requests)


def timed(h: Harness, where: int, minutes_ago: list[float]) -> list[dict]:
    """Messages posted the given minutes before now, oldest first."""
    now = datetime.now(timezone.utc)
    payloads = []
    for i, minutes in enumerate(minutes_ago):
        mid = discord.utils.time_snowflake(now - timedelta(minutes=minutes)) + i
        payloads.append(h.message_payload(
            f"gap message {i}", author=(ALICE, "alice"), channel=where, id=str(mid),
            timestamp=discord.utils.snowflake_time(mid).isoformat()))
    return payloads


async def test_a_fresh_session_catches_up_what_was_said_while_the_bot_was_away(setup):
    # RESUME refused (or an outage past its window): Discord replays nothing, and
    # discord.py dispatches on_ready again once the new session is set up
    h, fake = setup
    general = h.guild.get_channel(GENERAL)
    payloads = timed(h, GENERAL, [60, 50, 40, 30, 20, 1])
    fake.history[GENERAL] = payloads[:1]
    await h.listeners.on_message(discord.Message(state=h.state, channel=general, data=payloads[0]))
    await h.listeners.on_ready()  # the first session
    await h.backfill.catch_ups.task
    await settle(h)
    fake.history[GENERAL] = payloads  # 50 to 20 minutes ago: said while the bot was away
    fake.requests.clear()
    # the new session's first live message is stored before its READY's catch-up reads
    await h.listeners.on_message(discord.Message(state=h.state, channel=general, data=payloads[5]))
    await settle(h)
    await ready(h)
    assert h.engine.storage.messages.count() == 6
    # read from the newest message stored before the session: not the whole history
    assert [q.get("after") for p, q in fake.requests if p.endswith(f"/{GENERAL}/messages")] \
        == [payloads[0]["id"]]


async def test_a_catch_up_that_fails_is_read_again_from_where_it_began(setup):
    # the read fails (Discord refuses it for a while); live capture goes on storing, and
    # the next catch-up must still start before the gap, not after the live messages
    h, fake = setup
    general = h.guild.get_channel(GENERAL)
    payloads = timed(h, GENERAL, [60, 50, 40, 30, 20, 1])  # 50-30: said while away
    await h.listeners.on_message(discord.Message(state=h.state, channel=general, data=payloads[0]))
    await settle(h)
    fake.history[GENERAL] = payloads[:4]
    fake.forbidden.add(GENERAL)
    await ready(h)
    for p in payloads[4:]:  # heard live since
        await h.listeners.on_message(discord.Message(state=h.state, channel=general, data=p))
    await settle(h)
    fake.forbidden.clear()
    fake.history[GENERAL] = payloads
    await h.listeners.on_ready()  # a fresh session, later
    await h.backfill.catch_ups.task
    await settle(h)
    assert kept(h, payloads) == 6
    assert h.engine.storage.guilds.missed() == {}, "read: its marks are cleared"


async def test_a_live_message_the_write_queue_gives_up_on_is_caught_up_later(setup, monkeypatch):
    # the database refuses one message for good (not a busy lock); the messages after it
    # are stored, so the next catch-up, reading after the newest stored, would skip it
    # unless the queue marked it missed when it gave up
    monkeypatch.setattr("cogs.memory.write_queue.RETRY_MAX_S", 0.001)
    h, fake = setup
    general = h.guild.get_channel(GENERAL)
    payloads = timed(h, GENERAL, [60, 50, 30, 1])
    refused = int(payloads[1]["id"])
    with h.engine.storage.database.write() as conn:
        conn.execute(f"CREATE TRIGGER refuse BEFORE INSERT ON messages WHEN NEW.id = {refused} "
                     "BEGIN SELECT RAISE(ABORT, 'refused'); END")
    for p in payloads:
        await h.listeners.on_message(discord.Message(state=h.state, channel=general, data=p))
    await settle(h)
    assert kept(h, payloads) == 3
    with h.engine.storage.database.write() as conn:
        conn.execute("DROP TRIGGER refuse")
    fake.history[GENERAL] = payloads
    await ready(h)  # a fresh session, later
    assert kept(h, payloads) == 4
    assert h.engine.storage.guilds.missed() == {}, "read: its marks are cleared"


def refuse_deleting(h: Harness, message_id: int) -> None:
    with h.engine.storage.database.write() as conn:
        conn.execute(f"CREATE TRIGGER refuse BEFORE DELETE ON messages WHEN OLD.id = {message_id} "
                     "BEGIN SELECT RAISE(ABORT, 'refused'); END")


@pytest.mark.parametrize("when", ["later", "at stop"])
async def test_a_deletion_the_write_queue_gives_up_on_is_tried_again(setup, monkeypatch, when):
    # the database refuses a deletion for a while (not a busy lock): a reconcile reads only
    # recent messages, so given up for good the deleted text would stay stored
    h, _ = setup
    # the running bot's copy of the module (loading the extension may have imported its own)
    namespace = type(h.runtime.later)._put_back_later.__globals__
    monkeypatch.setitem(namespace, "RETRY_MAX_S", 0.001)
    monkeypatch.setitem(namespace, "RETRY_GIVEN_UP_S", 1.0 if when == "later" else 60)
    general = h.guild.get_channel(GENERAL)
    payloads = timed(h, GENERAL, [30, 20])
    for p in payloads:
        await h.listeners.on_message(discord.Message(state=h.state, channel=general, data=p))
    await settle(h)
    deleted = int(payloads[0]["id"])
    refuse_deleting(h, deleted)
    await h.listeners.on_raw_message_delete(discord.RawMessageDeleteEvent(
        {"id": str(deleted), "channel_id": str(GENERAL), "guild_id": str(G)}))
    await settle(h)
    assert kept(h, payloads) == 2, "given up while refused"
    with h.engine.storage.database.write() as conn:
        conn.execute("DROP TRIGGER refuse")
    if when == "later":  # put back into the queue 1 s after it was given up
        for _ in range(100):
            await asyncio.sleep(0.1)
            if kept(h, payloads) == 1:
                break
    else:
        await h.runtime.stop()
    assert kept(h, payloads) == 1
    assert h.engine.storage.messages.hydrate([int(payloads[1]["id"])])


async def test_a_guilds_forget_given_up_is_not_run_after_the_bot_is_invited_back(setup, monkeypatch):
    # run later, it would wipe what was stored since the rejoin (a start's reconcile
    # forgets a guild the bot is no longer in)
    h, _ = setup
    namespace = type(h.runtime.later)._put_back_later.__globals__
    monkeypatch.setitem(namespace, "RETRY_MAX_S", 0.001)
    monkeypatch.setitem(namespace, "RETRY_GIVEN_UP_S", 0.2)
    general = h.guild.get_channel(GENERAL)
    old, new = timed(h, GENERAL, [30, 20])
    await h.listeners.on_message(discord.Message(state=h.state, channel=general, data=old))
    await settle(h)
    with h.engine.storage.database.write() as conn:
        conn.execute("CREATE TRIGGER refuse BEFORE DELETE ON messages "
                     "BEGIN SELECT RAISE(ABORT, 'refused'); END")
    await h.listeners.on_guild_remove(h.guild)
    await settle(h)
    with h.engine.storage.database.write() as conn:
        conn.execute("DROP TRIGGER refuse")
    await h.listeners.on_guild_join(h.guild)
    await h.listeners.on_message(discord.Message(state=h.state, channel=general, data=new))
    await settle(h)
    await asyncio.sleep(1.0)  # five times the retry delay
    await settle(h)
    assert kept(h, [new]) == 1


async def test_a_new_channel_whose_messages_are_not_stored_is_not_read_whole_each_time(setup):
    # purged after it was caught up: its tombstones keep it empty, and each READY must go
    # on from where the last read ended, not read the channel from its start again
    h, fake = setup
    heard_an_hour_ago(h, fake)
    room = made(50)
    h.state.parse_channel_create(channel(room, G, "new-room"))
    fake.history[room] = timed(h, room, [49, 48, 47])
    await ready(h)
    await h.slash("memory-admin purge-channel", invoker=member(ADMIN, "admin"), where=GENERAL,
                  permissions=MANAGE, channel=h.guild.get_channel(room))
    await ready(h)  # read once more from its start (the purge took its marks too)
    fake.requests.clear()
    await ready(h)
    reads = [q["after"] for p, q in fake.requests if p.endswith(f"/{room}/messages")]
    assert reads == [fake.history[room][-1]["id"]], "from the newest message read before"
    assert kept(h, fake.history[room]) == 0, "the purge holds"


async def test_one_guilds_trouble_does_not_stop_the_others_catch_up(setup, monkeypatch):
    h, fake = setup
    other, hall = 990, 991
    me = member(BOT_ID, "memorybot") | {"user": user(BOT_ID, "memorybot", bot=True)}
    h.state.parse_guild_create(guild(other, "Other", owner=ADMIN,
                                     members=[member(ALICE, "alice"), me],
                                     roles=[role(other, "@everyone", READ, position=0)],
                                     channels=[channel(hall, other, "hall")]))
    h.guilds.append(h.bot.get_guild(other))  # the bot joined a second server
    payloads = {GENERAL: timed(h, GENERAL, [60, 30]), hall: timed(h, hall, [59, 29])}
    for where, (first, _) in payloads.items():  # the first stored by the bot's last run
        place = h.find_guild(where).get_channel(where)
        h.engine.ingest([record_from_message(discord.Message(state=h.state, channel=place,
                                                             data=first))])
        fake.history[where] = payloads[where]
    h.runtime.guild_settings.drop_all()
    real = h.engine.storage.guilds.settings

    def settings(guild_id: int):
        if guild_id == G:  # whichever guild comes first, the other is caught up
            raise OSError("server closed the connection unexpectedly")
        return real(guild_id)

    monkeypatch.setattr(h.engine.storage.guilds, "settings", settings)
    await ready(h)
    assert kept(h, payloads[hall]) == 2 and kept(h, payloads[GENERAL]) == 1


async def test_a_guild_left_during_its_catch_up_keeps_no_marks(setup):
    # the bot is removed while a page of a channel made while it was away is checked:
    # the page stores nothing, and the mark of how far it was read must not outlive it
    h, fake = setup
    heard_an_hour_ago(h, fake)
    room = made(50)
    h.state.parse_channel_create(channel(room, G, "new-room"))
    fake.history[room] = timed(h, room, [49])
    original = h.runtime.remembers

    async def remembers(message):
        if message.channel.id == room:
            await h.dispatch("guild_remove", h.guild)
            await settle(h)
        return await original(message)

    h.runtime.remembers = remembers
    await ready(h)
    assert h.engine.storage.guilds.missed() == {}, "its marks went with it"
    assert G not in h.engine.storage.messages.known_guild_ids()


async def test_a_thread_archived_while_the_bot_was_away_is_caught_up(setup):
    h, fake = setup
    fake.history[GENERAL] = []
    old_thread = ARCHIVED + 100
    for tid in (ARCHIVED, old_thread):
        h.guild._add_thread(discord.Thread(guild=h.guild, state=h.state,
                                           data=thread(tid, G, GENERAL, "a thread", owner=ALICE)))
    payloads = timed(h, ARCHIVED, [60, 55, 50, 40, 30])
    talk = h.guild.get_thread(ARCHIVED)
    assert talk is not None
    # the bot's last run heard the first three and a message in an older thread
    before = [discord.Message(state=h.state, channel=talk, data=p) for p in payloads[:3]]
    older = timed(h, old_thread, [600])[0]
    before.append(discord.Message(state=h.state, channel=h.guild.get_thread(old_thread), data=older))
    h.engine.ingest([r for r in map(record_from_message, before) if r is not None])
    # while it was away the last two were posted, and the thread archived 25 minutes ago
    fake.history[ARCHIVED] = payloads
    fake.history[old_thread] = [older]
    archived_at = (datetime.now(timezone.utc) - timedelta(minutes=25)).isoformat()
    recent = thread(ARCHIVED, G, GENERAL, "a thread", owner=ALICE, archived=True)
    recent["thread_metadata"]["archive_timestamp"] = archived_at
    long_ago = thread(old_thread, G, GENERAL, "older", owner=ALICE, archived=True)  # 2026-01-01
    fake.archived[GENERAL] = [recent, long_ago]  # the latest archived first, as Discord lists
    for tid in (ARCHIVED, old_thread):
        h.guild._remove_thread(h.guild.get_thread(tid))  # archived: not in the cache
    await ready(h)
    assert h.engine.storage.messages.count() == 5 + 1
    read = {p for p, _ in fake.requests if p.endswith("/messages")}
    assert any(f"/{ARCHIVED}/" in p for p in read)
    assert not any(f"/{old_thread}/" in p for p in read), "archived before the bot went away"


def heard_an_hour_ago(h: Harness, fake: FakeDiscord) -> None:
    """#general's history: one message, an hour ago, stored by the bot's last run."""
    fake.history[GENERAL] = timed(h, GENERAL, [60])
    h.engine.ingest([record_from_message(discord.Message(
        state=h.state, channel=h.guild.get_channel(GENERAL), data=fake.history[GENERAL][0]))])


def made(minutes_ago: float) -> int:
    """A channel or thread id made the given minutes before now."""
    return discord.utils.time_snowflake(datetime.now(timezone.utc) - timedelta(minutes=minutes_ago))


async def test_channels_and_threads_made_while_the_bot_was_away_are_read_from_their_start(
    setup,
):
    h, fake = setup
    heard_an_hour_ago(h, fake)
    room, excluded, talk, closed = made(50), made(45), made(40), made(35)
    h.engine.storage.guilds.update_settings(G, channel_mode="exclude", add_channel=excluded)
    for cid, name in ((room, "new-room"), (excluded, "not-remembered")):
        h.state.parse_channel_create(channel(cid, G, name))
    h.state.parse_thread_create(thread(talk, G, GENERAL, "a new thread", owner=ALICE))
    archived = thread(closed, G, FORUM, "a post closed already", owner=ALICE, archived=True)
    archived["thread_metadata"]["archive_timestamp"] = datetime.now(timezone.utc).isoformat()
    fake.archived[FORUM] = [archived]  # made and archived while away: in no cache
    for where, minutes in ((room, [49, 48]), (excluded, [44]), (talk, [39, 38, 37])):
        fake.history[where] = timed(h, where, minutes)
    fake.history[closed] = [p | {"channel_id": str(closed)} for p in timed(h, FORUM, [34])]
    fake.history[VOICE] = history(h, VOICE, 4)  # there before, never stored: a backfill's job
    await ready(h)
    assert [kept(h, fake.history[c]) for c in (room, excluded, talk, closed, VOICE)] \
        == [2, 0, 3, 1, 0]
    read = [(p, q) for p, q in fake.requests if p.endswith("/messages")]
    assert {p.split("/")[-2] for p, _ in read} == {str(c) for c in (GENERAL, room, talk, closed)}
    assert all(q.get("after") for _, q in read), "each read forward, from its start"
    # listing every private archived thread takes Manage Threads: the bot lists those it is in
    private = {p for p in fake.listings if p.endswith("/archived/private")}
    assert private == {f"/api/v10/channels/{c}/users/@me/threads/archived/private"
                       for c in (GENERAL, room)}


async def test_a_thread_started_while_away_on_an_older_message_is_read(setup):
    h, fake = setup
    starter, heard = timed(h, GENERAL, [90, 60])  # the bot's last run heard both
    h.engine.ingest([record_from_message(discord.Message(
        state=h.state, channel=h.guild.get_channel(GENERAL), data=p)) for p in (starter, heard)])
    fake.history[GENERAL] = [starter, heard]
    talk = int(starter["id"])  # a thread started on a message has the message's id
    started = thread(talk, G, GENERAL, "started on an old message", owner=ALICE)
    started["thread_metadata"]["create_timestamp"] = (
        datetime.now(timezone.utc) - timedelta(minutes=45)).isoformat()
    h.state.parse_thread_create(started)
    fake.history[talk] = timed(h, talk, [40, 30, 20])
    await ready(h)
    assert kept(h, fake.history[talk]) == 3


async def test_a_channel_made_while_away_is_read_from_its_start_after_a_live_message(setup):
    # a member speaks in the new channel as the bot comes back, before the catch-up
    h, fake = setup
    heard_an_hour_ago(h, fake)
    room = made(50)
    h.state.parse_channel_create(channel(room, G, "new-room"))
    away, live = timed(h, room, [49, 48]), timed(h, room, [0])
    fake.history[room] = away + live
    await h.listeners.on_message(discord.Message(state=h.state, channel=h.guild.get_channel(room),
                                                 data=live[0]))
    await settle(h)
    await ready(h)
    assert kept(h, away + live) == 3


async def test_a_ready_during_a_catch_up_queues_one_more_and_no_more(setup):
    h, fake = setup
    fake.history[GENERAL] = history(h, GENERAL, 3)
    h.engine.ingest([record_from_message(discord.Message(
        state=h.state, channel=h.guild.get_channel(GENERAL), data=fake.history[GENERAL][0]))])
    fake.stall_after = 0  # the first catch-up's requests hang until released
    await h.listeners.on_ready()
    first = h.backfill.catch_ups.task
    await h.listeners.on_ready()
    queued = h.backfill.catch_ups.task
    await h.listeners.on_ready()
    assert queued is not first and h.backfill.catch_ups.task is queued
    fake.stall_after = None
    fake.release()
    await asyncio.wait_for(queued, 10)
    assert first.done()
    await settle(h)
    assert h.engine.storage.messages.count() == 3


async def test_the_progress_names_only_channels_the_admin_can_see(setup):
    # Manage Server is not View Channel: a hidden channel's name is not the admin's to learn
    h, fake = setup
    secret = GENERAL + 100
    h.state.parse_channel_create(channel(secret, G, "secret-room", overwrites=[
        overwrite(G, deny=HIDE), overwrite(BOT_ID, allow=READ, member=True)]))
    fake.stall_after = 0  # every history request hangs: the walk stays on its channel
    admin = discord.Member(data=member(ALICE, "alice"), guild=h.guild, state=h.state)
    for target, shown in ((GENERAL, "general"), (secret, "")):
        fake.requests.clear()
        progress = Progress(channels=1)
        walk = asyncio.create_task(h.backfill.run([h.guild.get_channel(target)], progress, admin))
        while not fake.requests:
            await asyncio.sleep(0.01)
        assert progress.current == shown
        assert "secret-room" not in progress.line()
        walk.cancel()
        await asyncio.gather(walk, return_exceptions=True)


async def test_the_progress_names_a_private_thread_only_to_who_may_read_it(setup):
    # a thread's permissions are its parent's: seeing #general does not open its private
    # threads (nor their names, which a member wrote)
    h, fake = setup
    hidden = GENERAL + 200
    h.guild._add_thread(discord.Thread(guild=h.guild, state=h.state, data=thread(
        hidden, G, GENERAL, "plans for the surprise", owner=ADMIN, private=True)))
    fake.stall_after = 0  # every history request hangs: the walk stays on its thread
    admin = discord.Member(data=member(ALICE, "alice"), guild=h.guild, state=h.state)
    progress = Progress(channels=1)
    walk = asyncio.create_task(h.backfill.run([h.guild.get_thread(hidden)], progress, admin))
    while not fake.requests:
        await asyncio.sleep(0.01)
    assert progress.current == ""
    assert "surprise" not in progress.line()
    walk.cancel()
    await asyncio.gather(walk, return_exceptions=True)


async def test_the_progress_counts_only_what_the_admin_can_read(setup):
    # Manage Server is not View Channel: how much a hidden channel holds is not the
    # admin's to learn either (as purge-channel's count); it is still backfilled
    h, fake = setup
    secret = GENERAL + 100
    h.state.parse_channel_create(channel(secret, G, "secret-room", overwrites=[
        overwrite(G, deny=HIDE), overwrite(BOT_ID, allow=READ, member=True)]))
    fake.history[secret] = history(h, secret, 7)
    fake.history[GENERAL] = history(h, GENERAL, 2)
    await h.slash("memory-admin backfill", invoker=member(ALICE, "alice"), where=GENERAL,
                  permissions=MANAGE, channel=h.guild.get_channel(secret))
    summary = h.adapter.edits[-1]["content"]
    assert summary.startswith("Backfill finished") and "7" not in summary, summary
    assert kept(h, fake.history[secret]) == 7
    await h.slash("memory-admin backfill", invoker=member(ALICE, "alice"), where=GENERAL,
                  permissions=MANAGE, channel=h.guild.get_channel(GENERAL))
    assert "2 stored" in h.adapter.edits[-1]["content"]
