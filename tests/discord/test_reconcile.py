"""What changed while the bot was away: reconcile against a stand-in for Discord on 127.0.0.1.

Each test lives twice: the bot first runs with the whole server (messages are
captured from gateway payloads), stops, and starts again with the server as its
gateway describes it after changes made while it was offline.  Discord's REST API
(channel lookups, history pages, the bot's guild list) is tests/support/discord_standin.py;
discord.py's own HTTP client makes the requests.  The bot's memory is a database of
each storage engine (``db_location``).
"""

from __future__ import annotations

import asyncio
import json
import time
from dataclasses import dataclass, field, replace
from datetime import datetime, timedelta, timezone

import discord
import pytest

import bot
from memory.config import Profile, ReconcileConfig, parse_profile
from memory.engine import MemoryEngine
from memory.errors import ConfigError
from tests.support.builders import HashEmbedder
from tests.support.discord_harness import READ, Harness, channel, guild, member, role, thread
from tests.support.discord_standin import FakeDiscord
from tests.support.engines import inspect

G, GENERAL, OLD, THREAD, ARCHIVED, PRIVATE, OLD_THREAD = 960, 961, 962, 963, 964, 965, 966
OTHER_G, OTHER_CHANNEL = 970, 971
ALICE, ADMIN = 1301, 1302
MANAGE = discord.Permissions(manage_guild=True)
PROFILE = Profile(name="test", reconcile=ReconcileConfig(pause_s=0))


def server(*, deleted_offline: bool) -> dict:
    """The guild as GUILD_CREATE shows it: before, or after what happened offline.

    Offline, #old was deleted (with its thread), the thread in #general was
    deleted, and two threads were archived (archived threads are not in
    GUILD_CREATE): a public one the bot can read, a private one it cannot.
    """
    channels = [channel(GENERAL, G, "general")]
    threads = []
    if not deleted_offline:
        channels.append(channel(OLD, G, "old"))
        threads = [thread(THREAD, G, GENERAL, "a thread", owner=ALICE),
                   thread(ARCHIVED, G, GENERAL, "archived later", owner=ALICE),
                   thread(PRIVATE, G, GENERAL, "private", owner=ALICE, private=True),
                   thread(OLD_THREAD, G, OLD, "in old", owner=ALICE)]
    return guild(G, "Reconcile Guild", owner=ADMIN, roles=[role(G, "@everyone", READ, position=0)],
                 members=[member(ALICE, "alice"), member(ADMIN, "admin")],
                 channels=channels, threads=threads)


def other_server() -> dict:
    return guild(OTHER_G, "Left Guild", owner=ADMIN,
                 roles=[role(OTHER_G, "@everyone", READ, position=0)],
                 members=[member(ALICE, "alice")], channels=[channel(OTHER_CHANNEL, OTHER_G, "x")])


@dataclass
class World:
    """What the first run stored, by place, and the stand-in serving the second."""

    engine: MemoryEngine
    fake: FakeDiscord
    stored: dict[int, list[dict]] = field(default_factory=dict)

    def ids(self, place: int) -> list[int]:
        return [int(p["id"]) for p in self.stored[place]]

    def count(self, place: int) -> int:
        return len(self.engine.storage.messages.ids_between(place, 0, (1 << 63) - 1))


@pytest.fixture
async def fake(monkeypatch):
    stand_in = FakeDiscord()
    monkeypatch.setattr(discord.http.Route, "BASE", await stand_in.start())
    yield stand_in
    await stand_in.stop()


@pytest.fixture
async def world(db_location, fake):
    """Run one: the bot stores messages everywhere, then stops."""
    engine = MemoryEngine(db_location, PROFILE, HashEmbedder(), load_reranker=False)
    first = Harness(engine, [server(deleted_offline=False), other_server()])
    await first.start()
    w = World(engine, fake)
    sizes = {GENERAL: 250, OLD: 5, THREAD: 4, ARCHIVED: 6, PRIVATE: 3, OLD_THREAD: 2,
             OTHER_CHANNEL: 7}
    for place, n in sizes.items():
        w.stored[place] = [first.message_payload(f"words {place} {i}", author=(ALICE, "alice"),
                                                 channel=place) for i in range(n)]
        for payload in w.stored[place]:
            where = first.find_guild(place).get_channel_or_thread(place)
            await first.listeners.on_message(discord.Message(state=first.state, channel=where,
                                                       data=payload))
    await first.close()  # every queued write committed
    engine.storage.guilds.update_settings(OTHER_G, retention_days=30, opt_out=ALICE)
    # what Discord holds now: every place as it was, minus what the tests delete
    for place, payloads in w.stored.items():
        fake.history[place] = list(payloads)
    fake.channels[ARCHIVED] = thread(ARCHIVED, G, GENERAL, "archived later", owner=ALICE,
                                     archived=True)
    fake.forbidden.add(PRIVATE)  # an archived private thread the bot is not a member of
    fake.guilds = [{"id": str(G), "name": "Reconcile Guild", "icon": None, "owner": False,
                    "permissions": "0", "features": []}]
    yield w
    engine.close()


async def restart(w: World, profile: Profile = PROFILE) -> Harness:
    """Run two: the bot starts again with the server as it is now."""
    w.engine.profile = profile
    h = Harness(w.engine, [server(deleted_offline=True)])
    await h.start()
    await h.bot.http.static_login("good-token")
    return h


async def stop(h: Harness) -> None:
    await h.close()
    await h.bot.http.close()


def delete_on_discord(w: World, place: int, ids: list[int]) -> None:
    w.fake.history[place] = [p for p in w.fake.history[place] if int(p["id"]) not in ids]


def forgotten(w: World, ids: list[int]) -> bool:
    """Gone from the rows, the keyword index and the vectors, and tombstoned."""
    rows = inspect(w.engine.storage)
    left, indexed, tombs = rows.message_rows(ids), rows.index_rows(ids), rows.tombstones(ids)
    return left == 0 and indexed == 0 and tombs == len(ids)


async def test_messages_deleted_offline_are_forgotten_newer_ones_kept(world):
    w = world
    deleted = [w.ids(GENERAL)[3], w.ids(GENERAL)[120], w.ids(GENERAL)[-1], w.ids(ARCHIVED)[0]]
    for place in (GENERAL, ARCHIVED):
        delete_on_discord(w, place, deleted)
    w.engine.embed_pending()
    assert w.engine.search("words").hits, "searchable before the reconcile"
    h = await restart(w)
    # posted while the reconcile runs: newer than its start, not in the history it reads
    later = discord.utils.time_snowflake(datetime.now(timezone.utc) + timedelta(minutes=1))
    live = h.message_payload("posted during the run", author=(ALICE, "alice"), channel=GENERAL)
    live["id"] = str(later)
    await h.listeners.on_message(discord.Message(state=h.state, channel=h.guild.get_channel(GENERAL),
                                           data=live))
    progress = await h.reconciler.at_start_up()
    await stop(h)

    assert forgotten(w, deleted)
    assert w.count(GENERAL) == 250 - 3 + 1 and w.count(ARCHIVED) == 6 - 1
    assert not {hit.id for hit in w.engine.search("words", limit=50).hits} & set(deleted)
    assert progress.messages_forgotten >= 4 and progress.resumed is False
    # a second run finds nothing more to forget
    h = await restart(w)
    again = await h.reconciler.at_start_up()
    await stop(h)
    assert again.messages_forgotten == 0


async def test_a_message_posted_during_the_run_is_kept_when_the_host_clock_runs_ahead(
    world, monkeypatch
):
    """The run's start comes from the host's clock: ten minutes ahead of Discord's, a
    message posted after its channel's page was read had an id below the start and was
    judged deleted (forgotten and tombstoned for good)."""
    w = world
    host_time = time.time
    monkeypatch.setattr(time, "time", lambda: host_time() + 600)
    deleted = [w.ids(GENERAL)[-1]]  # the newest: above every message Discord returns
    delete_on_discord(w, GENERAL, deleted)
    h = await restart(w)
    posted: list[int] = []
    settle = h.reconciler._settle_span

    async def post_then_settle(place, *args):
        if place.id == GENERAL and not posted:  # after the page was read, before it is settled
            live = h.message_payload("posted during the run", author=(ALICE, "alice"),
                                     channel=GENERAL)
            live["id"] = str(discord.utils.time_snowflake(datetime.now(timezone.utc)))
            w.fake.history[GENERAL].append(live)
            posted.append(int(live["id"]))
            await h.listeners.on_message(discord.Message(
                state=h.state, channel=h.guild.get_channel(GENERAL), data=live))
            await h.runtime.writes.run_and_wait(lambda: None)
        return await settle(place, *args)

    monkeypatch.setattr(h.reconciler, "_settle_span", post_then_settle)
    await h.reconciler.at_start_up()
    await stop(h)

    rows = inspect(w.engine.storage)
    assert (rows.message_rows(posted), rows.tombstones(posted)) == (1, 0)
    assert forgotten(w, deleted)
    looked_up = [path for path, _ in w.fake.requests if "/messages/" in path]
    assert sorted(looked_up) == sorted(f"/api/v10/channels/{GENERAL}/messages/{i}"
                                       for i in (*posted, *deleted))


def gone_untombstoned(w: World, ids: list[int]) -> bool:
    """Gone from the rows, the keyword index and the vectors, with no tombstone."""
    rows = inspect(w.engine.storage)
    return (rows.message_rows(ids), rows.index_rows(ids), rows.tombstones(ids)) == (0, 0, 0)


async def test_edits_made_offline_are_applied_and_an_emptied_message_forgotten(world):
    w = world
    history = w.fake.history[GENERAL]
    now = datetime.now(timezone.utc)
    sticker = {"sticker_items": [{"id": "7", "name": "wave", "format_type": 1}]}
    # among the newest: the span it compares
    edited, emptied, refilled = history[-2], history[-5], history[-7]
    history[history.index(edited)] = edited | {"content": "the meeting moved to noon",
                                               "edited_timestamp": now.isoformat()}
    history[history.index(emptied)] = emptied | {"content": "", **sticker,
                                                 "edited_timestamp": now.isoformat()}
    # emptied offline, then put back live before the run reads the page (a stale page)
    history[history.index(refilled)] = refilled | {"content": "", **sticker,
                                                   "edited_timestamp": now.isoformat()}
    h = await restart(w)
    back = refilled | {"content": "put back", **sticker,
                       "edited_timestamp": (now + timedelta(seconds=5)).isoformat()}
    live = discord.Message(state=h.state, channel=h.guild.get_channel(GENERAL), data=back)
    await h.listeners.on_raw_message_edit(discord.RawMessageUpdateEvent(back, live))
    progress = await h.reconciler.at_start_up()
    await stop(h)
    stored = w.engine.storage.messages.hydrate([int(edited["id"]), int(refilled["id"])])
    assert stored[int(edited["id"])].content == "the meeting moved to noon"
    assert stored[int(refilled["id"])].content == "put back", "the newer live edit stays"
    # still on Discord with a sticker: no tombstone, so text put back later is stored
    assert gone_untombstoned(w, [int(emptied["id"])])
    assert progress.messages_updated == 1 and "1 messages updated" in progress.line()
    h = await restart(w)
    again = await h.reconciler.at_start_up()
    await stop(h)
    assert again.messages_updated == 0, "an edit already applied is not applied again"


async def test_a_thread_deleted_offline_is_forgotten(world):
    w = world
    h = await restart(w)
    progress = await h.reconciler.at_start_up()
    await stop(h)
    assert w.count(THREAD) == 0 and forgotten(w, w.ids(THREAD))
    assert progress.channels_forgotten >= 1
    lookups = [path for path, _ in w.fake.requests if path.endswith(f"/channels/{THREAD}")]
    assert lookups, "an uncached thread is asked about, not assumed gone"


async def test_a_channel_deleted_offline_is_forgotten_with_its_threads(world):
    w = world
    h = await restart(w)
    await h.reconciler.at_start_up()
    await stop(h)
    assert w.count(OLD) == 0 and w.count(OLD_THREAD) == 0
    assert forgotten(w, w.ids(OLD) + w.ids(OLD_THREAD))
    assert w.count(GENERAL) == 250, "the channels that exist keep everything"


async def test_a_guild_left_offline_is_forgotten_entirely(world):
    w = world
    assert w.engine.storage.messages.count(OTHER_G) == 7
    h = await restart(w)
    progress = await h.reconciler.at_start_up()
    await stop(h)
    storage = w.engine.storage
    assert storage.messages.count(OTHER_G) == 0 and forgotten(w, w.ids(OTHER_CHANNEL))
    assert OTHER_G not in storage.messages.known_guild_ids()
    assert storage.guilds.settings(OTHER_G).retention_days is None
    assert storage.guilds.settings(OTHER_G).opted_out == {ALICE}, "an opt-out outlives the guild"
    assert progress.guilds_forgotten == 1
    assert storage.messages.count(G) > 0, "the guild the bot is still in is kept"


async def test_a_guild_missing_from_the_cache_but_listed_by_discord_is_kept(world):
    """A cache that has not filled yet must not cost a server its memory."""
    w = world
    w.fake.guilds.append({"id": str(OTHER_G), "name": "Left Guild", "icon": None,
                          "owner": False, "permissions": "0", "features": []})
    h = await restart(w)
    await h.reconciler.at_start_up()
    await stop(h)
    assert w.engine.storage.messages.count(OTHER_G) == 7


async def test_a_forbidden_thread_is_kept(world):
    """403 Missing Access: the thread exists, the bot may not see it: nothing is forgotten."""
    w = world
    h = await restart(w)
    progress = await h.reconciler.at_start_up()
    await stop(h)
    assert w.count(PRIVATE) == 3
    assert progress.channels_no_access >= 1
    assert not [p for p, _ in w.fake.requests if p.endswith(f"/channels/{PRIVATE}/messages")]


async def test_only_the_recent_window_is_checked(world):
    """With recent_messages = 50 only #general's 50 newest are compared: one history page."""
    w = world
    old, recent = w.ids(GENERAL)[10], w.ids(GENERAL)[-5]
    delete_on_discord(w, GENERAL, [old, recent])
    h = await restart(w, replace(PROFILE, reconcile=ReconcileConfig(recent_messages=50,
                                                                      pause_s=0)))
    await h.reconciler.at_start_up()
    await stop(h)
    assert forgotten(w, [recent])
    assert w.engine.storage.messages.hydrate([old]), "older than the window: not checked, kept"
    pages = [q for p, q in w.fake.requests if p.endswith(f"/channels/{GENERAL}/messages")]
    assert len(pages) == 1


async def test_reconcile_resumes_from_its_cursor_after_an_interruption(world):
    w = world
    deleted = [w.ids(GENERAL)[5], w.ids(GENERAL)[200]]
    delete_on_discord(w, GENERAL, deleted)
    h = await restart(w)
    w.fake.stall_after = 2  # two history pages, then the "process" dies
    run = asyncio.create_task(h.reconciler.at_start_up())
    while len([p for p, _ in w.fake.requests if p.endswith("/messages")]) < 3:
        await asyncio.sleep(0.01)
    await asyncio.sleep(0.05)
    run.cancel()
    with pytest.raises(asyncio.CancelledError):
        await run
    await stop(h)
    cursor = w.engine.storage.guilds.reconcile_cursor(GENERAL)
    assert cursor is not None and not cursor.complete and cursor.before_id is not None
    assert forgotten(w, [deleted[1]]), "the newest pages were settled before the stop"
    assert w.engine.storage.messages.hydrate([deleted[0]]), "not reached yet"

    w.fake.stall_after = None
    w.fake.requests.clear()
    h = await restart(w)
    progress = await h.reconciler.at_start_up()
    await stop(h)
    pages = [q for p, q in w.fake.requests if p.endswith(f"/channels/{GENERAL}/messages")]
    assert pages[0]["before"] == str(cursor.before_id), "picked up where it stopped"
    assert progress.resumed and forgotten(w, deleted)
    assert w.engine.storage.guilds.reconcile_run(G) is None, "a finished run leaves no cursor"


async def test_admin_command_reports_counts_and_is_admin_only(world):
    w = world
    delete_on_discord(w, GENERAL, [w.ids(GENERAL)[7]])
    h = await restart(w)
    await h.slash("memory-admin reconcile", invoker=member(ALICE, "alice"), where=GENERAL,
                  permissions=discord.Permissions(view_channel=True))
    assert w.count(GENERAL) == 250, "a member without Manage Server cannot run it"
    await h.slash("memory-admin reconcile", invoker=member(ADMIN, "admin"), where=GENERAL,
                  permissions=MANAGE)
    await stop(h)
    final = h.adapter.edits[-1]["content"]
    assert final.startswith("Reconcile finished")
    # one in #general, then #old (5), the deleted thread (4) and #old's thread (2)
    assert f"{1 + 5 + 4 + 2} messages forgotten" in final and "3 channels gone" in final
    assert w.engine.storage.messages.count(OTHER_G) == 7, "the command judges its own server only"


async def test_a_fresh_session_reconciles_again(world):
    # what was deleted while a session was down never reaches the bot: its READY
    # reconciles as a start-up does
    w = world
    h = await restart(w)
    await h.listeners.on_ready()
    await h.reconciler.runs.task
    first = h.reconciler.runs.task
    delete_on_discord(w, GENERAL, [w.ids(GENERAL)[-1]])
    await h.listeners.on_ready()  # RESUME refused: a new session
    assert h.reconciler.runs.task is not first
    await h.reconciler.runs.task
    await stop(h)
    assert forgotten(w, [w.ids(GENERAL)[-1]])


async def test_start_up_runs_reconcile_after_the_catch_up(world):
    w = world
    delete_on_discord(w, GENERAL, [w.ids(GENERAL)[0]])
    h = await restart(w)
    await h.listeners.on_ready()
    await h.reconciler.runs.task
    await stop(h)
    assert forgotten(w, [w.ids(GENERAL)[0]])
    kinds = [("before" in q) for p, q in w.fake.requests if p.endswith(f"/{GENERAL}/messages")]
    assert kinds[0] is False and kinds[-1] is True, "catch-up (after) first, then reconcile"


@pytest.mark.parametrize(("table", "problem"), [
    ({"recent_messages": -1}, "reconcile.recent_messages"),
    ({"pause_s": "fast"}, "reconcile.pause_s"),
    ({"window": 10}, "window"),
])
def test_a_bad_reconcile_setting_is_refused_by_name(table, problem):
    with pytest.raises(ConfigError, match=problem):
        parse_profile("bad", {"reconcile": table}, "bad.toml")


def test_reconcile_settings_come_from_the_profile():
    profile = parse_profile("ok", {"reconcile": {"recent_messages": 200, "on_start": False}},
                            "ok.toml")
    assert profile.reconcile == ReconcileConfig(on_start=False, recent_messages=200)


def test_bench_reconcile_runs_and_counts_requests(tmp_path, capsys):
    out = tmp_path / "reconcile.json"
    code = bot.main(["--profile", "cpu-fast", "bench", "reconcile", "--messages", "1000",
                     "--channels", "4", "--gone", "1", "--deleted", "0.02", "--recent", "50,1000",
                     "--json", str(out)])
    assert code == 0, capsys.readouterr().err
    report = json.loads(out.read_text())
    narrow, wide = report["runs"]
    # three channels left, 250 messages each: one page each for 50, three for all 250
    assert narrow["requests"] == {"GET /channels/{id}/messages": 3, "GET /channels/{id}": 1}
    assert wide["requests"] == {"GET /channels/{id}/messages": 9, "GET /channels/{id}": 1}
    assert wide["channels_forgotten"] == 1 and wide["messages_compared"] == 750
    assert wide["stored_before"] - wide["stored_after"] == wide["messages_forgotten"]
    assert narrow["messages_forgotten"] < wide["messages_forgotten"]
    assert wide["rate_limited_s"] == pytest.approx(10 * report["pause_s"])
