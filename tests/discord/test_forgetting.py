"""Forgetting that always wins: deletions ordered behind queued writes, edits after
opt-out or in excluded channels, and a forgotten member staying forgotten.

Messages and edits arrive as gateway payloads through discord.py's own parsers,
commands as interaction payloads through the command tree, backfill pages from a
stand-in for Discord's REST API on 127.0.0.1, imports through the CLI; the
database is a real SQLite file or a real PostgreSQL database (every test runs on
both engines, ``db_location``), which another session keeps busy where the race
needs it.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import re
from collections.abc import AsyncIterator
from dataclasses import replace
from datetime import datetime, timedelta, timezone
from pathlib import Path

import discord
import pytest

import bot
from cogs.memory.capture import record_from_message
from memory.config import Profile
from memory.engine import MemoryEngine
from memory.records import datetime_to_ms
from tests.support.builders import HashEmbedder
from tests.support.discord_harness import READ, Harness, channel, guild, member, role
from tests.support.discord_standin import FakeDiscord
from tests.support.engines import another_writer, inspect

G, GENERAL, RANDOM = 960, 961, 962
ALICE, BOB, ADMIN = 1301, 1302, 1303
MANAGE = discord.Permissions(manage_guild=True)
LOCK_S, STORE_WAITS_S = 1.5, 1.0  # another writer holds the lock longer than the store waits


def server() -> dict:
    return guild(G, "Forget Guild", owner=ADMIN, roles=[role(G, "@everyone", READ, position=0)],
                 members=[member(ALICE, "alice"), member(BOB, "bob"), member(ADMIN, "admin")],
                 channels=[channel(GENERAL, G, "general"), channel(RANDOM, G, "random")])


@pytest.fixture
async def setup(db_location, monkeypatch):
    fake = FakeDiscord()
    base = await fake.start()
    monkeypatch.setattr(discord.http.Route, "BASE", base)
    monkeypatch.setattr("cogs.memory.backfill.PAGE_PAUSE_S", 0)
    engine = MemoryEngine(db_location, Profile(name="test"), HashEmbedder(), load_reranker=False)
    h = Harness(engine, [server()])
    await h.start()
    await h.bot.http.static_login("good-token")
    yield h, fake
    await h.close()
    await h.bot.http.close()
    await fake.stop()
    engine.close()


async def events_done() -> None:
    """Wait for the event handlers discord.py's parsers dispatched."""
    for _ in range(3):
        await asyncio.sleep(0)
    await asyncio.gather(*[t for t in asyncio.all_tasks() if t.get_name().startswith("discord.py: ")])


async def settle(h: Harness) -> None:
    await events_done()
    await h.runtime.writes.stop()
    h.runtime.writes.start()


async def send(h: Harness, text: str, who: tuple[int, str] = (ALICE, "alice"),
               where: int = GENERAL) -> dict:
    """MESSAGE_CREATE through the gateway parser; returns the payload."""
    data = h.message_payload(text, author=who, channel=where)
    h.state.parse_message_create(data)
    await events_done()
    return data


async def edit(h: Harness, data: dict, text: str) -> None:
    """MESSAGE_UPDATE with new text through the gateway parser."""
    h.state.parse_message_update(data | {
        "content": text, "edited_timestamp": datetime.now(timezone.utc).isoformat()})
    await events_done()


async def slash(h: Harness, command: str, who: dict, admin: bool = False, **options) -> str:
    await h.slash(command, invoker=who, where=GENERAL, permissions=MANAGE if admin else None,
                  **options)
    return h.adapter.followups[-1]["content"]


def stored(h: Harness, *payloads: dict) -> set[int]:
    ids = [int(p["id"]) for p in payloads]
    return {m for m in ids if m in h.engine.storage.messages.hydrate(ids)}


def found(h: Harness, words: str) -> bool:
    return bool(h.engine.search(words, guild_id=G, mode="keyword").hits)


def tombstoned(h: Harness, *payloads: dict) -> int:
    return inspect(h.engine.storage).tombstones([int(p["id"]) for p in payloads])


@contextlib.asynccontextmanager
async def busy_database(h: Harness) -> AsyncIterator[None]:
    """Another session holds the write lock for LOCK_S from now; the store waits less.

    The store gives up after STORE_WAITS_S (StorageBusy), so the write queue backs off
    and retries: the moment a deletion run beside the queue would slip in front of
    queued writes.
    """
    with another_writer(h.engine.storage, wait_s=STORE_WAITS_S) as release:
        handle = asyncio.get_running_loop().call_later(LOCK_S, release)
        try:
            yield
        finally:
            handle.cancel()


def old(h: Harness, text: str, days: int) -> dict:
    data = h.message_payload(text, author=(ALICE, "alice"), channel=GENERAL)
    data["timestamp"] = (datetime.now(timezone.utc) - timedelta(days=days)).isoformat()
    return data


def old_record(h: Harness, data: dict):
    message = discord.Message(state=h.state, channel=h.guild.get_channel(GENERAL), data=data)
    record = record_from_message(message)
    return replace(record, created_at=datetime_to_ms(datetime.fromisoformat(data["timestamp"])))


def deleted_count(reply: str) -> int:
    return int(re.search(r"(?:Deleted|Forgot|; ) ?(\d+)", reply).group(1))


# -- item 4: a deletion runs behind every write queued before it ---------------------------

async def test_forget_me_deletes_a_message_still_queued_while_the_database_is_busy(setup):
    h, _ = setup
    first = await send(h, "alice's first secret")
    await settle(h)
    async with busy_database(h):
        queued = await send(h, "alice's second secret sent just before forget-me")
        reply = await slash(h, "memory forget-me", member(ALICE, "alice"))
    await settle(h)
    assert "Deleted 2 of your messages" in reply
    assert not stored(h, first, queued) and not found(h, "secret")
    assert tombstoned(h, first, queued) == 2


async def test_forget_me_meeting_a_busy_database_itself_waits_and_deletes(setup):
    """Nothing queued ahead: the deletion is the write that meets the held lock, and the
    queue retries it like any write (it is never answered as a refusal)."""
    h, _ = setup
    first = await send(h, "alice's only secret")
    await settle(h)
    async with busy_database(h):
        reply = await slash(h, "memory forget-me", member(ALICE, "alice"))
    await settle(h)
    assert "Deleted 1 of your messages" in reply, reply
    assert not stored(h, first) and not found(h, "secret")


async def test_opt_out_meeting_a_busy_database_waits_and_holds(setup):
    h, _ = setup
    async with busy_database(h):
        await h.slash("memory opt-out", invoker=member(BOB, "bob"), where=GENERAL)
    await settle(h)
    assert BOB in h.engine.storage.guilds.settings(G).opted_out
    later = await send(h, "bob after opting out", who=(BOB, "bob"))
    await settle(h)
    assert not stored(h, later)


async def test_an_opt_out_outlives_the_bot_leaving_and_coming_back(setup):
    """Leaving forgets the server and its settings, but not who asked not to be
    remembered there: invited back, the bot stores bob's messages only after opt-in."""
    h, _ = setup
    await slash_plain(h, "memory opt-out", member(BOB, "bob"))
    await send(h, "alice before the bot left")
    await settle(h)
    await h.dispatch("guild_remove", h.guild)
    await settle(h)
    assert h.engine.storage.messages.count(G) == 0
    assert G not in h.engine.storage.messages.known_guild_ids(), "nothing else of it stays"
    await h.dispatch("guild_join", h.guild)
    alice, bob = (await send(h, "alice is back"),
                  await send(h, "bob, who opted out, is not stored", who=(BOB, "bob")))
    await settle(h)
    assert stored(h, alice, bob) == {int(alice["id"])}
    await slash_plain(h, "memory opt-in", member(BOB, "bob"))
    after = await send(h, "bob opted in again", who=(BOB, "bob"))
    await settle(h)
    assert stored(h, after)


async def test_purge_channel_deletes_a_message_still_queued_while_the_database_is_busy(setup):
    h, _ = setup
    first = await send(h, "a plan for the party", where=RANDOM)
    kept = await send(h, "general chat stays", where=GENERAL)
    await settle(h)
    async with busy_database(h):
        queued = await send(h, "another plan for the party", who=(BOB, "bob"), where=RANDOM)
        reply = await slash(h, "memory-admin purge-channel", member(ADMIN, "admin"), admin=True,
                            channel=h.guild.get_channel(RANDOM))
    await settle(h)
    assert "Forgot 2 messages" in reply
    assert not stored(h, first, queued) and not found(h, "party")
    assert stored(h, kept)


async def test_retention_deletes_an_old_message_still_queued_while_the_database_is_busy(setup):
    h, _ = setup
    first, queued = old(h, "an ancient recipe", 40), old(h, "another ancient recipe", 50)
    h.engine.storage.messages.upsert([old_record(h, first)])
    async with busy_database(h):
        h.runtime.writes.put(h.engine.storage.messages.upsert, [old_record(h, queued)])  # a backfill page, say
        reply = await slash(h, "memory-admin retention", member(ADMIN, "admin"), admin=True,
                            days=30)
    await settle(h)
    assert not stored(h, first, queued) and not found(h, "recipe")
    # the reply counts what was deleted: a queued copy stored first is counted too
    assert deleted_count(reply) == tombstoned(h, first, queued) >= 1


async def test_the_hourly_retention_pass_runs_behind_queued_writes(setup):
    h, _ = setup
    h.engine.storage.guilds.update_settings(G, retention_days=30)
    queued = old(h, "a stale rumour", 45)
    async with busy_database(h):
        h.runtime.writes.put(h.engine.storage.messages.upsert, [old_record(h, queued)])
        await h.runtime.enforce_retention()
    await settle(h)
    assert not stored(h, queued) and not found(h, "rumour")


# -- item 5: edits of stored messages are always applied -----------------------------------

async def test_an_edit_after_opt_out_deletes_the_stored_copy(setup):
    h, _ = setup
    mine = await send(h, "my address is 12 Elm Street")
    other = await send(h, "bob's unrelated note", who=(BOB, "bob"))
    await settle(h)
    await slash_plain(h, "memory opt-out", member(ALICE, "alice"))
    await edit(h, mine, "my address is none of your business")
    await settle(h)
    assert not stored(h, mine)
    assert not found(h, "Elm") and not found(h, "business")
    assert stored(h, other)

    await slash_plain(h, "memory opt-in", member(ALICE, "alice"))
    await edit(h, mine, "my address is 12 Elm Street again")  # deleted stays deleted
    await settle(h)
    assert not stored(h, mine)


async def test_an_edit_in_an_excluded_channel_updates_the_stored_copy_only(setup):
    h, _ = setup
    before = await send(h, "the wifi password is hunter2", where=RANDOM)
    await settle(h)
    await slash_plain(h, "memory-admin channels mode", member(ADMIN, "admin"), admin=True,
                      mode="exclude")
    await slash_plain(h, "memory-admin channels add", member(ADMIN, "admin"), admin=True,
                      channel=h.guild.get_channel(RANDOM))
    later = await send(h, "the door code is 4417", where=RANDOM)
    await settle(h)
    assert not stored(h, later)

    await edit(h, before, "ask an admin for the wifi password")
    await edit(h, later, "the door code is 9999")  # never stored: an edit does not store it
    await settle(h)
    assert not found(h, "hunter2") and found(h, "admin wifi")
    assert not stored(h, later) and not found(h, "door")

    h.state.parse_message_delete({"id": before["id"], "channel_id": str(RANDOM), "guild_id": str(G)})
    await settle(h)
    assert not stored(h, before)


async def slash_plain(h: Harness, command: str, who: dict, admin: bool = False, **options) -> str:
    """A command that answers at once (no deferral)."""
    await h.slash(command, invoker=who, where=GENERAL, permissions=MANAGE if admin else None,
                  **options)
    return h.adapter.callbacks[-1]["data"]["content"]


# -- item 8: a forgotten member stays forgotten, whichever path brings them ---------------

def export_file(path: Path, messages: list[tuple[int, str]]) -> Path:
    doc = {"guild": {"id": str(G), "name": "Forget Guild"},
           "channel": {"id": str(GENERAL), "name": "general", "type": "GuildTextChat"},
           "messages": [{"id": str(mid), "content": text, "timestamp": "2026-01-05T10:00:00+00:00",
                         "author": {"id": str(ALICE), "name": "alice", "nickname": "Ali"}}
                        for mid, text in messages]}
    path.write_text(json.dumps(doc), encoding="utf-8")
    return path


async def test_a_forgotten_member_is_not_stored_again_by_any_path(setup, tmp_path, capsys,
                                                                   db_location):
    h, fake = setup
    said = await send(h, "alice's stored line about kayaks")
    await settle(h)
    reply = await slash(h, "memory forget-me", member(ALICE, "alice"))
    assert "Deleted 1 of your messages" in reply and "opt-in" in reply
    names = inspect(h.engine.storage).author_rows(ALICE)
    assert names == 0 and ALICE not in {m[0] for m in h.engine.storage.messages.members(None)}

    # live capture, and an edit of the forgotten message
    live = await send(h, "alice's new line about kayaks")
    await edit(h, said, "alice's edited line about kayaks")
    # backfill: older messages of hers that were never stored; bob's are
    older = [h.message_payload(f"alice's old line {i} about kayaks", author=(ALICE, "alice"),
                               channel=GENERAL) for i in range(3)]
    bobs = h.message_payload("bob's old line about canoes", author=(BOB, "bob"), channel=GENERAL)
    fake.history[GENERAL] = [*older, bobs]
    await h.slash("memory-admin backfill", invoker=member(ADMIN, "admin"), where=GENERAL,
                  permissions=MANAGE)
    await settle(h)
    # an import of an export into this guild's database, through the CLI
    exported = export_file(tmp_path / "export.json", [(int(older[0]["id"]) - 5, "kayak export")])
    code = await asyncio.to_thread(bot.main, ["--db", db_location,
                                              "--profile", "cpu-fast",
                                              "import", "--no-embed", str(exported)])
    capsys.readouterr()
    assert code == 0

    assert stored(h, bobs)
    assert not stored(h, said, live, *older) and not found(h, "kayaks") and not found(h, "kayak")
    assert h.engine.storage.messages.guild_stats(G, author_id=ALICE).member_messages == 0
    assert inspect(h.engine.storage).author_rows(ALICE) == 0

    await slash_plain(h, "memory opt-in", member(ALICE, "alice"))
    back = await send(h, "alice is back, talking about rafts")
    await settle(h)
    assert stored(h, back) and not stored(h, said)  # what was forgotten stays forgotten
