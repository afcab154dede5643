"""The permission matrix's three leaks (issue 19), each replayed through discord.py's parsers.

The world is tests/discord/test_permissions.py's server: #general for everyone, #staff-only
for the staff role, a private thread of #general that alice belongs to, a mods
role that may manage threads.  Each test drives the gateway events that opened a
leak (THREAD_CREATE, THREAD_MEMBERS_UPDATE, THREAD_LIST_SYNC, THREAD_UPDATE
archiving a thread, MESSAGE_UPDATE for a message discord.py no longer caches) or
an ingest path (live capture, backfill from a stand-in of Discord's REST API on
127.0.0.1, a DiscordChatExporter import), then searches by every member route:
the cog's allow-list, ``/search`` private and public, the mention reply and the
prompt the chat model (a stand-in on 127.0.0.1) receives.

1. A private thread is readable by its current members and by those who can manage
   threads in its parent; its creator only while a member.
2. An event that does not know a channel's type never overwrites the stored one,
   and an unknown thread type is judged like a private one.
3. Text from another channel never enters a message's vector.
"""

from __future__ import annotations

import asyncio
import json
from collections.abc import Sequence
from dataclasses import asdict
from pathlib import Path
from typing import Any

import discord
import numpy as np
import pytest

from cogs.memory.answers import make_chat_client
from cogs.memory.permissions import StoredThread, readable_channel_ids
from memory.config import LLMConfig, Profile
from memory.engine import MemoryEngine
from memory.records import MessageRecord, PendingMessage
from memory.search import SearchRequest
from memory.storage.sqlite.connection import connect
from memory.storage.sqlite.migrations import MIGRATIONS, migrate, reembed_cross_channel_replies
from tests.discord.test_permissions import (
    ALICE,
    BOB,
    CAROL,
    EVE,
    GENERAL,
    NAMES,
    PRIVATE_THREAD,
    ROLES,
    STAFF,
    STAFF_ONLY,
    G,
    other_server,
    server,
)
from tests.support.builders import HashEmbedder
from tests.support.discord_harness import BOT_ID, Harness, member, thread, user
from tests.support.discord_standin import FakeDiscord
from tests.support.openai_standin import OpenAIStandIn

BOBS_THREAD = 705
SECRET = "the vault code is mangosteen"
STAFF_WORDS = "the merger with globex closes on friday"
MANAGE = discord.Permissions(manage_guild=True)


class RecordingEmbedder(HashEmbedder):
    """The fake embedder, keeping every text it was asked to embed."""

    def __init__(self) -> None:
        super().__init__()
        self.texts: list[str] = []

    def embed(self, texts):  # type: ignore[no-untyped-def]
        self.texts.extend(texts)
        return super().embed(texts)


class Edits:
    """Discord's REST API for message edits (the one call a streamed answer makes)."""

    def __init__(self, h: Harness) -> None:
        self.h = h
        self.payloads: list[dict[str, Any]] = []
        h.bot.http.request = self.request

    async def request(self, route: discord.http.Route, **kwargs: Any) -> Any:
        payload = kwargs.get("json") or {}
        self.payloads.append(payload)
        data = self.h.message_payload(payload.get("content") or "", author=(BOT_ID, "memorybot"),
                                      channel=int(route.channel_id or GENERAL), bot=True)
        return data | {"id": route.url.rsplit("/", 1)[-1], "embeds": payload.get("embeds") or []}


@pytest.fixture(scope="module")
def standin():
    with OpenAIStandIn() as server_:
        yield server_


@pytest.fixture
async def harness(db_location, standin):
    """The bot on a fresh database of each storage engine (``db_location``): the allow-lists
    apply inside both engines' vector and keyword stages."""
    llm = LLMConfig(base_url=standin.base_url("ok"), model="m", timeout_s=5.0)
    engine = MemoryEngine(db_location, Profile(name="test", llm=llm),
                          RecordingEmbedder(), load_reranker=False)
    h = Harness(engine, [server(), other_server()])
    await h.start()
    h.edits = Edits(h)  # type: ignore[attr-defined]
    h.standin = standin  # type: ignore[attr-defined]
    members_update(h, PRIVATE_THREAD, added=[ALICE])
    yield h
    await h.close()
    engine.close()


# -- gateway events, as Discord sends them -------------------------------------------------

def members_update(h: Harness, thread_id: int, *, added: Sequence[int] = (),
                   removed: Sequence[int] = ()) -> None:
    """THREAD_MEMBERS_UPDATE: members join (added) or leave / are removed (removed)."""
    h.state.parse_thread_members_update({
        "id": str(thread_id), "guild_id": str(G), "member_count": len(added),
        "added_members": [{"id": str(thread_id), "user_id": str(uid), "flags": 0,
                           "join_timestamp": "2026-01-01T00:00:00+00:00"} for uid in added],
        "removed_member_ids": [str(uid) for uid in removed],
    })


async def events_done() -> None:
    """Let the listeners discord.py scheduled for dispatched events run to the end."""
    for _ in range(50):
        pending = [t for t in asyncio.all_tasks() if t.get_name().startswith("discord.py: ")]
        if not pending:
            return
        await asyncio.gather(*pending)


async def settle(h: Harness) -> None:
    """Listeners finished, queued writes committed, the backlog embedded."""
    await events_done()
    await h.runtime.writes.stop()
    h.runtime.writes.start()
    await asyncio.to_thread(h.engine.embed_pending)


async def say(h: Harness, text: str, *, uid: int, where: int, **extra: Any) -> dict[str, Any]:
    """MESSAGE_CREATE through discord.py's parser; returns the payload."""
    data = h.message_payload(text, author=(uid, NAMES[uid]), channel=where, roles=ROLES[uid],
                             **extra)
    h.state.parse_message_create(data)
    await settle(h)
    return data


def as_member(h: Harness, uid: int) -> discord.Member:
    return discord.Member(data=member(uid, NAMES[uid], roles=ROLES[uid]), guild=h.guild,
                          state=h.state)


def stored_threads(h: Harness) -> list[StoredThread]:
    return [StoredThread(*row) for row in h.engine.storage.messages.threads(G)]


async def found(h: Harness, uid: int, words: str) -> set[str]:
    """Texts of the hits a search by ``words`` gives ``uid`` (the cog's allow-list)."""
    result, _ = await h.search.member_search(as_member(h, uid),
                                          SearchRequest(queries=(words,), limit=50))
    return {hit.content for hit in result.hits}


async def every_route(h: Harness, uid: int, words: str) -> dict[str, str]:
    """What each member route shows ``uid`` for ``words``: /search private and public
    (the public answer and the asker's ephemeral note), the mention reply in #general
    and the chat model's prompt for it."""
    invoker = member(uid, NAMES[uid], roles=ROLES[uid])
    routes = {}
    await h.slash("search", invoker=invoker, where=GENERAL, query=words, limit=10)
    routes["/search private"] = "\n".join(h.adapter.texts())
    h.adapter.followups.clear()
    h.adapter.callbacks.clear()
    await h.slash("search", invoker=invoker, where=GENERAL, query=words, limit=10, private=False)
    public, *to_the_asker = h.adapter.followups
    routes["/search public"] = str(public)
    routes["/search public, told the asker alone"] = "\n".join(str(p) for p in to_the_asker)
    asked_model = len(h.standin.requests)  # type: ignore[attr-defined]
    question = h.message(f"<@{BOT_ID}> {words}?", author=(uid, NAMES[uid]), channel=GENERAL,
                         roles=ROLES[uid], mentions=[user(BOT_ID, "memorybot", bot=True)])
    await h.search.answer_mention(question)
    routes["mention reply"] = "\n".join(str(p) for _, p in h.sent) + "\n".join(
        str(p) for p in h.edits.payloads)  # type: ignore[attr-defined]
    routes["chat model prompt"] = "\n".join(
        json.dumps(r["json"]["messages"])
        for r in h.standin.requests[asked_model:])  # type: ignore[attr-defined]
    return routes


# -- 1. a private thread's creator, after leaving ------------------------------------------

async def bobs_private_thread(h: Harness) -> None:
    """Bob creates a private thread in #general (THREAD_CREATE, then he is its member)."""
    h.state.parse_thread_create(
        thread(BOBS_THREAD, G, GENERAL, "bob's plans", owner=BOB, private=True)
        | {"newly_created": True})
    members_update(h, BOBS_THREAD, added=[BOB])
    await say(h, SECRET, uid=BOB, where=BOBS_THREAD)


async def test_a_private_threads_creator_reads_it_only_while_a_member(harness):
    h = harness
    await bobs_private_thread(h)
    assert BOBS_THREAD in readable_channel_ids(as_member(h, BOB), stored_threads(h))
    assert SECRET in await found(h, BOB, "vault code mangosteen")

    members_update(h, BOBS_THREAD, removed=[BOB])  # he left, or a moderator removed him
    assert h.guild.get_thread(BOBS_THREAD).owner_id == BOB  # still its creator
    assert BOBS_THREAD not in readable_channel_ids(as_member(h, BOB), stored_threads(h))
    assert SECRET not in await found(h, BOB, "vault code mangosteen")
    for route, text in (await every_route(h, BOB, "vault code mangosteen")).items():
        assert "code is mangosteen" not in text, route  # the query itself may be echoed
        assert f"/{PRIVATE_THREAD}/" not in text, route  # nor a link to it
        assert f"/{BOBS_THREAD}/" not in text, route  # nor a link to it
    # a moderator who manages threads in #general still reads it
    assert SECRET in await found(h, CAROL, "vault code mangosteen")


async def test_a_creator_the_cache_does_not_list_as_a_member_is_refused(harness):
    """Without the members intent Discord tells no one's membership but the bot's: a thread
    known from GUILD_CREATE or THREAD_LIST_SYNC with its creator unlisted is closed to them."""
    h = harness
    await bobs_private_thread(h)
    h.state.parse_thread_list_sync({  # the bot regains the channel: Discord resends its threads
        "guild_id": str(G), "channel_ids": [str(GENERAL)],
        "threads": [thread(BOBS_THREAD, G, GENERAL, "bob's plans", owner=BOB, private=True)],
        "members": [],
    })
    assert h.guild.get_thread(BOBS_THREAD) is not None
    assert BOBS_THREAD not in readable_channel_ids(as_member(h, BOB), stored_threads(h))
    assert SECRET not in await found(h, BOB, "vault code mangosteen")

    h.state.parse_thread_list_sync({  # ... and now with bob among its members
        "guild_id": str(G), "channel_ids": [str(GENERAL)],
        "threads": [thread(BOBS_THREAD, G, GENERAL, "bob's plans", owner=BOB, private=True)],
        "members": [{"id": str(BOBS_THREAD), "user_id": str(BOB), "flags": 0,
                     "join_timestamp": "2026-01-01T00:00:00+00:00"}],
    })
    assert SECRET in await found(h, BOB, "vault code mangosteen")


# -- 2. an archived private thread stays private -------------------------------------------

async def archive_and_update(h: Harness, data: dict[str, Any], **changes: Any) -> None:
    """THREAD_UPDATE archives the thread (discord.py drops it), then MESSAGE_UPDATE."""
    h.state.parse_thread_update(
        thread(PRIVATE_THREAD, G, GENERAL, "secret thread", owner=9999, private=True,
               archived=True))
    assert h.guild.get_thread(PRIVATE_THREAD) is None  # what makes the event's channel unknown
    h.state.parse_message_update(data | changes)
    await settle(h)


@pytest.mark.parametrize("changes", [
    pytest.param({"embeds": [{"type": "link", "url": "https://example.com/"}]},
                 id="an-embed-resolves"),
    pytest.param({"content": SECRET + " (updated)",
                  "edited_timestamp": "2026-06-01T00:00:00+00:00"}, id="an-edit"),
])
async def test_an_archived_private_thread_stays_private_after_a_message_update(harness, changes):
    h = harness
    data = await say(h, SECRET, uid=ALICE, where=PRIVATE_THREAD)
    assert SECRET not in await found(h, BOB, "vault code mangosteen")

    await archive_and_update(h, data, **changes)

    assert (PRIVATE_THREAD, GENERAL, "private_thread") in h.engine.storage.messages.threads(G)
    assert PRIVATE_THREAD not in readable_channel_ids(as_member(h, BOB), stored_threads(h))
    assert not {t for t in await found(h, BOB, "vault code mangosteen") if "mangosteen" in t}
    for route, text in (await every_route(h, BOB, "vault code mangosteen")).items():
        assert "code is mangosteen" not in text, route  # the query itself may be echoed
    # who manages threads in #general still finds it, edited text included
    assert any("mangosteen" in t for t in await found(h, CAROL, "vault code mangosteen"))


# -- what a public answer leaves out is no one else's business (issue 30.3) ----------------

@pytest.mark.parametrize("chat", ["ok", "server", None],
                         ids=["answered", "the-chat-model-fails", "no-chat-model"])
async def test_a_public_answer_says_nothing_of_what_it_left_out(harness, chat):
    """Alice finds her private thread's words; answered in #general (the mention reply,
    /search private:False) nobody there learns that a channel they cannot read holds
    matches.  Only alice is told, in an ephemeral note to her /search."""
    h = harness
    h.runtime.chat = chat and make_chat_client(Profile(name="test", llm=LLMConfig(
        base_url=h.standin.base_url(chat), model="m", timeout_s=5.0)))  # type: ignore[attr-defined]
    await say(h, SECRET, uid=ALICE, where=PRIVATE_THREAD)
    await say(h, "the vault is in the basement", uid=BOB, where=GENERAL)
    routes = await every_route(h, ALICE, "vault code mangosteen")
    for route in ("/search public", "mention reply"):
        assert "vault is in the basement" in routes[route] or chat == "ok", route
        assert "withheld" not in routes[route] and "more result" not in routes[route], route
        assert "code is mangosteen" not in routes[route], route
    public, note = h.adapter.followups
    assert not public.get("flags") and note["flags"] == 64  # the note is alice's alone
    assert "1 more result left out" in note["content"]
    assert "code is mangosteen" not in note["content"]  # and it names nothing
    assert "mangosteen" in routes["/search private"]  # privately she sees it all


async def test_an_unknown_thread_type_is_never_public(harness):
    """A thread the database knows only from an event without its type (or as "None",
    what older versions wrote) is read like a private one: Manage Threads only."""
    h = harness
    for kind in ("", "None"):
        h.engine.storage.messages.upsert([MessageRecord(
            id=9_000 + len(kind), guild_id=G, channel_id=9_100 + len(kind), author_id=EVE,
            created_at=1_700_000_000_000, content=f"unknown {kind!r} thread", parent_id=GENERAL,
            channel_type=kind)])
    unknown = {9_100, 9_104}
    assert not unknown & readable_channel_ids(as_member(h, BOB), stored_threads(h))
    assert not unknown & readable_channel_ids(as_member(h, ALICE), stored_threads(h))
    assert unknown <= readable_channel_ids(as_member(h, CAROL), stored_threads(h))


@pytest.mark.parametrize("unknown", ["", "None"])
async def test_a_stored_channel_type_is_never_overwritten_by_an_unknown_one(harness, unknown):
    h = harness
    record = MessageRecord(id=9_200, guild_id=G, channel_id=9_201, author_id=EVE,
                           created_at=1_700_000_000_000, content="first", parent_id=GENERAL,
                           channel_name="plans", channel_type="private_thread")
    h.engine.storage.messages.upsert([record])
    h.engine.storage.messages.upsert([MessageRecord(id=9_202, guild_id=G, channel_id=9_201, author_id=EVE,
                                   created_at=1_700_000_000_001, content="second",
                                   channel_type=unknown)])
    assert (9_201, GENERAL, "private_thread") in h.engine.storage.messages.threads(G)


# -- 3. no text from another channel in a message's vector ---------------------------------

STAFF_MSG, CROSS_REPLY, GENERAL_MSG, SAME_REPLY = 7_001, 7_002, 7_003, 7_004
CROSS_TEXT = "sounds good, noted for the board"
SAME_TEXT = "count me in as well"
PICNIC = "the picnic moves to the lakeside park"


def embedded_text(h: Harness, content: str) -> str:
    """The text the embedder was given for the message whose content is ``content``."""
    texts = [t for t in h.engine.embedder.texts if content in t]  # type: ignore[attr-defined]
    assert texts, f"{content!r} was never embedded"
    return texts[-1]


async def assert_reply_context_stays_in_its_channel(h: Harness) -> None:
    """#general's reply to #staff-only carries none of its words; one to #general does."""
    assert "globex" not in embedded_text(h, CROSS_TEXT)
    assert "lakeside" in embedded_text(h, SAME_TEXT)
    # bob cannot read #staff-only: searching for its words tells him nothing
    assert not {t for t in await found(h, BOB, "merger with globex friday") if CROSS_TEXT in t}
    # eve can: she finds the staff message itself
    assert STAFF_WORDS in await found(h, EVE, "merger with globex friday")
    # a same-channel reply is found by its target's words
    assert SAME_TEXT in await found(h, BOB, "picnic lakeside park")


def reply_payload(h: Harness, text: str, *, target: int, target_channel: int,
                  mid: int) -> dict[str, Any]:
    data = h.message_payload(text, author=(EVE, "eve"), channel=GENERAL, roles=ROLES[EVE],
                             type=19, message_reference={
                                 "message_id": str(target), "channel_id": str(target_channel),
                                 "guild_id": str(G)})
    return data | {"id": str(mid)}


def conversation(h: Harness) -> list[dict[str, Any]]:
    """#staff-only's message, #general's message, and eve's replies to each, in #general."""
    staff = h.message_payload(STAFF_WORDS, author=(EVE, "eve"), channel=STAFF_ONLY,
                              roles=ROLES[EVE]) | {"id": str(STAFF_MSG)}
    picnic = h.message_payload(PICNIC, author=(ALICE, "alice"), channel=GENERAL,
                               roles=ROLES[ALICE]) | {"id": str(GENERAL_MSG)}
    return [staff, picnic,
            reply_payload(h, CROSS_TEXT, target=STAFF_MSG, target_channel=STAFF_ONLY,
                          mid=CROSS_REPLY),
            reply_payload(h, SAME_TEXT, target=GENERAL_MSG, target_channel=GENERAL,
                          mid=SAME_REPLY)]


async def test_live_capture_keeps_reply_context_in_its_channel(harness):
    h = harness
    for data in conversation(h):
        h.state.parse_message_create(data)
    await settle(h)
    await assert_reply_context_stays_in_its_channel(h)


@pytest.fixture
async def rest(harness, monkeypatch):
    """Discord's REST API as a stand-in on 127.0.0.1, for the backfill."""
    fake = FakeDiscord()
    monkeypatch.setattr(discord.http.Route, "BASE", await fake.start())
    monkeypatch.setattr("cogs.memory.backfill.PAGE_PAUSE_S", 0)
    del harness.bot.http.request  # discord.py's own HTTP client again
    # the bot has the staff role (GUILD_MEMBER_UPDATE), so it backfills #staff-only too
    harness.state.parse_guild_member_update({
        "guild_id": str(G), "user": user(BOT_ID, "memorybot", bot=True), "roles": [str(STAFF)],
        "joined_at": "2025-01-01T00:00:00+00:00", "nick": None, "flags": 0})
    await harness.bot.http.static_login("good-token")
    yield fake
    await harness.bot.http.close()
    await fake.stop()


async def test_backfill_keeps_reply_context_in_its_channel(harness, rest):
    h = harness
    for data in conversation(h):
        rest.history[int(data["channel_id"])].append(data)
    await h.slash("memory-admin backfill", invoker=member(CAROL, "carol", roles=ROLES[CAROL]),
                  where=GENERAL, permissions=MANAGE)
    assert "finished" in h.adapter.edits[-1]["content"]
    await settle(h)
    await assert_reply_context_stays_in_its_channel(h)


def write_export(path: Path, channel_id: int, name: str, messages: list[dict]) -> None:
    path.write_text(json.dumps({
        "guild": {"id": str(G), "name": "Main"},
        "channel": {"id": str(channel_id), "name": name, "type": "GuildTextChat"},
        "messages": messages}), encoding="utf-8")


def exported(mid: int, text: str, author: tuple[int, str], **extra: Any) -> dict[str, Any]:
    return {"id": str(mid), "type": "Default", "content": text,
            "timestamp": discord.utils.snowflake_time(mid << 22).isoformat(),
            "author": {"id": str(author[0]), "name": author[1]}, **extra}


@pytest.mark.parametrize("with_channel", [True, False], ids=["reference-names-its-channel",
                                                             "reference-without-channel"])
async def test_an_import_keeps_reply_context_in_its_channel(harness, tmp_path, with_channel):
    """DiscordChatExporter's reference names the target's channel; without it the store
    still embeds a reply with its target only when both share a channel."""
    h = harness

    def ref(target: int, channel_id: int) -> dict[str, Any]:
        return {"reference": {"messageId": str(target), "guildId": str(G),
                              **({"channelId": str(channel_id)} if with_channel else {})}}

    write_export(tmp_path / "staff.json", STAFF_ONLY, "staff-only",
                 [exported(STAFF_MSG, STAFF_WORDS, (EVE, "eve"))])
    write_export(tmp_path / "general.json", GENERAL, "general", [
        exported(GENERAL_MSG, PICNIC, (ALICE, "alice")),
        exported(CROSS_REPLY, CROSS_TEXT, (EVE, "eve"), **ref(STAFF_MSG, STAFF_ONLY)),
        exported(SAME_REPLY, SAME_TEXT, (EVE, "eve"), **ref(GENERAL_MSG, GENERAL))])
    summary = await asyncio.to_thread(h.engine.import_exports, [tmp_path])
    assert summary.errors == [] and summary.inserted == 4
    await assert_reply_context_stays_in_its_channel(h)


# SQLite's migration 9; PostgreSQL's first schema came after the fix
@pytest.mark.parametrize("storage_kind", ["sqlite"])
async def test_vectors_built_with_another_channels_text_are_embedded_again(harness):
    """The migration: a database whose replies were embedded with another channel's text
    (before this fix) sends them back to the backlog; they re-embed with their own."""
    h = harness
    storage = h.engine.storage
    h.engine.storage.messages.upsert([
        MessageRecord(id=STAFF_MSG, guild_id=G, channel_id=STAFF_ONLY, author_id=EVE,
                      created_at=1_700_000_000_000, content=STAFF_WORDS, author_name="eve"),
        MessageRecord(id=CROSS_REPLY, guild_id=G, channel_id=GENERAL, author_id=EVE,
                      created_at=1_700_000_001_000, content=CROSS_TEXT, author_name="eve",
                      reply_to_id=STAFF_MSG)])
    await asyncio.to_thread(h.engine.embed_pending)
    # the reply's vector as the old code made it: with #staff-only's words
    reply = PendingMessage(**asdict(storage.messages.hydrate([CROSS_REPLY])[CROSS_REPLY]))
    leaky = f"{CROSS_TEXT} (replying to eve: {STAFF_WORDS})"
    storage.backlog.write_vectors([reply], np.asarray(h.engine.embedder.embed([leaky])))
    assert any(CROSS_TEXT in t for t in await found(h, BOB, "merger with globex friday"))

    conn = connect(storage.database.location)  # reopened by the version before the migration
    conn.execute(f"PRAGMA user_version = {MIGRATIONS.index(reembed_cross_channel_replies)}")
    migrate(conn)
    conn.close()
    assert [p.id for p in storage.backlog.pending(10)] == [CROSS_REPLY]
    assert not {t for t in await found(h, BOB, "merger with globex friday") if CROSS_TEXT in t}
    await asyncio.to_thread(h.engine.embed_pending)
    assert "globex" not in embedded_text(h, CROSS_TEXT)
    assert not {t for t in await found(h, BOB, "merger with globex friday") if CROSS_TEXT in t}
    assert STAFF_WORDS in await found(h, EVE, "merger with globex friday")
