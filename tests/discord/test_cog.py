"""The memory cog with real discord.py objects (gateway payloads) and a real SQLite file.

Capture, edits and deletes through the write queue; data lifecycle (tombstones,
neighbour re-embedding, forget-me, opt-out, retention, channel/thread/guild
removal); commands, checks and the error handler; resilience when the database is
locked by another process or the embedder fails.  Permissions have their own
matrix in test_permissions.py.
"""

from __future__ import annotations

import asyncio
import importlib
import logging
import sys
import time
from dataclasses import replace
from datetime import datetime, timedelta, timezone

import discord
import pytest

from cogs.memory.answers import make_chat_client
from cogs.memory.capture import record_from_message
from cogs.memory.settings_cache import SettingsCache
from cogs.memory.write_queue import WriteQueue
from memory.config import LLMConfig, Profile
from memory.engine import MemoryEngine
from memory.records import datetime_to_ms
from memory.storage.sqlite.connection import connect
from tests.support.builders import HashEmbedder
from tests.support.discord_harness import (
    BOT_ID,
    READ,
    Harness,
    archived_thread,
    channel,
    guild,
    member,
    role,
    thread,
    user,
)
from tests.support.sqlite import sql_rows

G, GENERAL, RANDOM, THREAD = 900, 901, 903, 902
ALICE, BOB, OWNER = 1001, 1002, 1003


def server() -> dict:
    return guild(
        G, "Test Guild", owner=OWNER, roles=[role(G, "@everyone", READ, position=0)],
        members=[member(ALICE, "alice", nick="Ali"), member(BOB, "bob")],
        channels=[channel(GENERAL, G, "general"), channel(RANDOM, G, "random")],
        threads=[thread(THREAD, G, GENERAL, "a thread", owner=ALICE)],
    )


@pytest.fixture
async def harness(tmp_path):
    engine = MemoryEngine(tmp_path / "bot.sqlite3", Profile(name="test"), HashEmbedder(),
                          load_reranker=False)
    h = Harness(engine, [server()], owner_ids=[OWNER])
    await h.start()
    yield h
    await h.close()
    engine.close()


def alice() -> dict:
    return member(ALICE, "alice", nick="Ali")


def bob() -> dict:
    return member(BOB, "bob")


async def say(h: Harness, text: str, who: tuple[int, str] = (ALICE, "alice"),
              where: int = GENERAL, **extra) -> discord.Message:
    """MESSAGE_CREATE: every listener runs (capture, and the answer to a mention)."""
    msg = h.message(text, author=who, channel=where, **extra)
    await h.dispatch("message", msg)
    return msg


async def settle(h: Harness, embed: bool = True) -> None:
    """Wait until queued writes are committed (and the backlog embedded)."""
    await h.runtime.writes.stop()
    h.runtime.writes.start()
    if embed:
        await asyncio.to_thread(h.engine.embed_pending)


async def until(condition, timeout: float = 30.0) -> None:
    """Wait until ``condition()`` holds, checking between event-loop turns."""
    deadline = asyncio.get_running_loop().time() + timeout
    while not condition():
        assert asyncio.get_running_loop().time() < deadline, "the condition never held"
        await asyncio.sleep(0.01)


def ids_for(h: Harness, query: str, **options) -> list[int]:
    return [hit.id for hit in h.engine.search(query, guild_id=G, limit=20, **options).hits]


async def test_each_memory_cog_is_registered_under_its_class_name(harness):
    """``bot.get_cog`` finds a cog by the name a reader sees on its class."""
    cogs = harness.bot.cogs
    assert {name: type(cog).__name__ for name, cog in cogs.items()} == {n: n for n in cogs}
    assert {"MemoryCog", "MemoryListeners"} <= set(cogs)
    assert harness.search is cogs["MemoryCog"]


# -- capture -------------------------------------------------------------------------------

def test_record_from_a_gateway_message(tmp_path):
    async def scenario():
        engine = MemoryEngine(tmp_path / "x.sqlite3", Profile(name="t"), HashEmbedder(),
                              load_reranker=False)
        h = Harness(engine, [server()])
        msg = h.message("the wifi password is on the fridge", author=(ALICE, "alice"),
                        channel=GENERAL, nick="Ali")
        record = record_from_message(msg)
        assert record.guild_id == G and record.channel_id == GENERAL
        assert record.author_id == ALICE and record.author_display_name == "Ali"
        assert record.created_at == int(msg.created_at.timestamp() * 1000)
        assert record.parent_id is None
        in_thread = record_from_message(h.message("hi", author=(ALICE, "alice"), channel=THREAD))
        assert in_thread.channel_id == THREAD and in_thread.parent_id == GENERAL
        assert (in_thread.parent_name, record.parent_name) == ("general", "")
        engine.close()

    asyncio.run(scenario())


def forward(of: discord.Message | None, content: str, attachments: list[dict] | None = None,
            embeds: list[dict] | None = None) -> dict:
    """A forward's gateway fields: a reference of type 1 and a snapshot of the message."""
    where = of.channel.id if of else RANDOM + 1000  # another server's channel
    return {"message_reference": {"type": 1, "message_id": str(of.id if of else 77),
                                  "channel_id": str(where), "guild_id": str(G)},
            "message_snapshots": [{"message": {
                "type": 0, "content": content, "embeds": embeds or [],
                "attachments": attachments or [], "timestamp": "2026-01-01T00:00:00+00:00",
                "edited_timestamp": None, "flags": 0, "mentions": [], "mention_roles": []}}]}


async def test_a_forward_is_stored_as_the_forwarders_message_marked_forwarded(harness):
    h = harness
    original = await say(h, "the staging database moves to friday", where=RANDOM)
    same_channel = await say(h, "", who=(BOB, "bob"), where=RANDOM,
                             **forward(original, "the staging database moves to friday"))
    shared = await say(h, "", who=(BOB, "bob"), **forward(None, "", attachments=[{
        "id": "5", "filename": "roadmap.pdf", "size": 10, "url": "https://cdn.example/r.pdf",
        "proxy_url": "https://cdn.example/r.pdf"}]))
    preview = await say(h, "", who=(BOB, "bob"), **forward(None, "", embeds=[{
        "type": "rich", "title": "a link preview"}]))  # nothing to remember
    await settle(h)
    stored = h.engine.storage.messages.hydrate([same_channel.id, shared.id, preview.id])
    assert set(stored) == {same_channel.id, shared.id}
    copy = stored[same_channel.id]
    assert copy.content == "[forwarded] the staging database moves to friday"
    assert copy.author_id == BOB and copy.channel_id == RANDOM
    assert copy.reply_to_id is None, "a forward is not a reply to the message it forwards"
    assert stored[shared.id].content == "[forwarded]"
    assert stored[shared.id].attachments == ("roadmap.pdf",)
    assert same_channel.id in ids_for(h, "staging database friday", mode="keyword")


async def test_a_poll_is_stored_with_its_question_and_answers(harness):
    h = harness
    expiry = (datetime.now(timezone.utc) + timedelta(hours=24)).isoformat()
    answers = [{"answer_id": i, "poll_media": {"text": text}}
               for i, text in enumerate(["the lake", "", "the old mill"], start=1)]
    answers.append({"answer_id": 4, "poll_media": {"text": "", "emoji": {"id": None,
                                                                         "name": "🌲"}}})
    answers.append({"answer_id": 5, "poll_media": {"text": "", "emoji": {"id": "77", "name": "tacos"}}})
    poll = await say(h, "", poll={"question": {"text": "Where is the summer picnic?"},
                                  "answers": answers, "expiry": expiry,
                                  "allow_multiselect": False, "layout_type": 1})
    await settle(h)
    stored = h.engine.storage.messages.hydrate([poll.id])[poll.id]
    assert stored.content == ("[poll] Where is the summer picnic? "
                              "(answers: the lake; the old mill; 🌲; tacos)")
    assert poll.id in ids_for(h, "summer picnic old mill", mode="keyword")


async def test_messages_are_stored_edited_and_deleted(harness):
    h = harness
    msg = await say(h, "the wifi password is hunter2")
    await settle(h)
    assert ids_for(h, "wifi password") == [msg.id]

    edited = h.message_payload("the door code is 4417", author=(ALICE, "alice"), channel=GENERAL)
    edited |= {"id": str(msg.id), "edited_timestamp": datetime.now(timezone.utc).isoformat()}
    new = discord.Message(state=h.state, channel=msg.channel, data=edited)
    await h.listeners.on_raw_message_edit(discord.RawMessageUpdateEvent(edited, new))
    await settle(h)
    assert h.engine.search("door code", guild_id=G).hits[0].content.startswith("the door code")
    assert not ids_for(h, "hunter2", mode="keyword")

    await h.listeners.on_raw_message_delete(discord.RawMessageDeleteEvent(
        {"id": str(msg.id), "channel_id": str(GENERAL), "guild_id": str(G)}))
    await settle(h)
    assert h.engine.storage.messages.count() == 0


async def test_an_edit_that_takes_out_all_the_text_forgets_the_stored_copy(harness):
    h = harness
    sticker = {"sticker_items": [{"id": "7", "name": "wave", "format_type": 1}]}
    msg = await say(h, "the vault code is 0451", **sticker)
    await settle(h)
    assert ids_for(h, "vault code", mode="keyword") == [msg.id]
    edited = h.message_payload("", author=(ALICE, "alice"), channel=GENERAL, **sticker)
    edited |= {"id": str(msg.id), "edited_timestamp": datetime.now(timezone.utc).isoformat()}
    new = discord.Message(state=h.state, channel=msg.channel, data=edited)
    await h.listeners.on_raw_message_edit(discord.RawMessageUpdateEvent(edited, new))
    await settle(h)
    assert h.engine.storage.messages.count() == 0
    assert not ids_for(h, "vault 0451", mode="keyword")
    # a page of history read before that edit (a backfill, a catch-up) stores nothing
    h.runtime.writes.put(h.runtime.store_messages, [record_from_message(msg)])
    await settle(h)
    assert not ids_for(h, "vault 0451", mode="keyword")
    # the message still exists: text put back by a later edit is stored again
    again = edited | {"content": "the vault code is now 9999",
                      "edited_timestamp": datetime.now(timezone.utc).isoformat()}
    new = discord.Message(state=h.state, channel=msg.channel, data=again)
    await h.listeners.on_raw_message_edit(discord.RawMessageUpdateEvent(again, new))
    await settle(h)
    assert ids_for(h, "vault 9999", mode="keyword") == [msg.id]


async def test_an_edit_in_a_thread_not_cached_only_updates_a_stored_copy(harness):
    # an archived thread is not in discord.py's cache: its parent (here an excluded
    # channel) is unknown, so the edit must not store a message never stored
    h = harness
    archived = h.bot.get_partial_messageable(RANDOM + 500, guild_id=G)
    stored_before = h.message("the offsite is in march", author=(ALICE, "alice"), channel=RANDOM)
    record = replace(record_from_message(stored_before), channel_id=archived.id,
                     parent_id=RANDOM, channel_type="public_thread")
    h.engine.storage.messages.upsert([record])  # stored before the channel was excluded
    h.engine.storage.guilds.update_settings(G, channel_mode="exclude", add_channel=RANDOM)
    h.runtime.guild_settings.drop_all()

    async def edit(message_id: int, text: str) -> None:
        data = h.message_payload(text, author=(ALICE, "alice"), channel=GENERAL) | {
            "id": str(message_id), "channel_id": str(archived.id),
            "edited_timestamp": datetime.now(timezone.utc).isoformat()}
        new = discord.Message(state=h.state, channel=archived, data=data)
        await h.listeners.on_raw_message_edit(discord.RawMessageUpdateEvent(data, new))

    await edit(stored_before.id + 1, "salary of bob is 91k")  # never stored
    await edit(stored_before.id, "the offsite moved to april")
    await settle(h, embed=False)
    stored = h.engine.storage.messages.hydrate([stored_before.id, stored_before.id + 1])
    assert set(stored) == {stored_before.id}
    assert stored[stored_before.id].content == "the offsite moved to april"


async def test_the_bots_own_messages_are_not_stored_but_other_bots_are(harness):
    h = harness
    await say(h, "I am the bot", who=(BOT_ID, "memorybot"), bot=True)
    await say(h, "RSS: new release 2.0", who=(4242, "rssbot"), bot=True)
    await settle(h, embed=False)
    assert h.engine.storage.messages.count() == 1


async def test_a_delete_before_its_insert_does_not_resurrect_the_message(harness):
    h = harness
    msg = h.message("a message deleted while in flight", author=(ALICE, "alice"), channel=GENERAL)
    await h.listeners.on_raw_message_delete(discord.RawMessageDeleteEvent(
        {"id": str(msg.id), "channel_id": str(GENERAL), "guild_id": str(G)}))
    await h.listeners.on_message(msg)  # the create event arrives late (or a backfill page has it)
    await settle(h)
    assert h.engine.storage.messages.count() == 0
    h.engine.storage.messages.upsert([record_from_message(msg)])  # and a re-import of an old export
    assert h.engine.storage.messages.count() == 0


async def test_an_older_copy_never_overwrites_a_newer_edit(harness):
    h = harness
    msg = await say(h, "first version")
    edited = h.message_payload("second version", author=(ALICE, "alice"), channel=GENERAL)
    edited |= {"id": str(msg.id), "edited_timestamp": datetime.now(timezone.utc).isoformat()}
    new = discord.Message(state=h.state, channel=msg.channel, data=edited)
    await h.listeners.on_raw_message_edit(discord.RawMessageUpdateEvent(edited, new))
    await settle(h)
    h.engine.storage.messages.upsert([record_from_message(msg)])  # a backfill page read before the edit
    assert h.engine.storage.messages.hydrate([msg.id])[msg.id].content == "second version"


async def test_editing_or_deleting_a_message_re_embeds_its_neighbour(harness):
    h = harness
    first = await say(h, "my locker combination is 31-7-22")
    reply = await say(h, "noted", who=(BOB, "bob"),
                      message_reference={"message_id": str(first.id), "channel_id": str(GENERAL),
                                         "guild_id": str(G)})
    await settle(h)
    embedded = h.engine.embedder.calls
    await h.listeners.on_raw_message_delete(discord.RawMessageDeleteEvent(
        {"id": str(first.id), "channel_id": str(GENERAL), "guild_id": str(G)}))
    await settle(h, embed=False)
    # the reply's vector carried the deleted text as context: it goes back to the backlog
    pending = h.engine.storage.backlog.pending(10)
    assert [p.id for p in pending] == [reply.id]
    assert "31-7-22" not in h.engine.embedding_text(pending[0])
    await settle(h)
    assert h.engine.embedder.calls > embedded and h.engine.storage.backlog.pending_count() == 0


async def test_forget_me_opt_out_and_opt_in(harness):
    h = harness
    await say(h, "alice likes tea")
    await say(h, "bob likes coffee", who=(BOB, "bob"))
    await settle(h)
    await h.slash("memory forget-me", invoker=alice(), where=GENERAL)
    assert "Deleted 1 of your messages" in h.adapter.followups[-1]["content"]
    assert ids_for(h, "likes") and all(
        hit.author_id == BOB for hit in h.engine.search("likes", guild_id=G).hits)

    await h.slash("memory opt-out", invoker=alice(), where=GENERAL)
    await say(h, "alice now likes mate")
    await settle(h)
    assert not ids_for(h, "mate", mode="keyword")

    await h.slash("memory opt-in", invoker=alice(), where=GENERAL)
    await say(h, "alice likes rooibos")
    await settle(h)
    assert ids_for(h, "rooibos", mode="keyword")


async def test_a_long_channel_list_keeps_admin_replies_under_discords_limit(harness):
    """Past about 80 channels the list made a reply over 2,000 characters: Discord refused
    it, so the admin read an error though the change was saved, and `channels show`
    never worked again."""
    h = harness
    admin = discord.Permissions(manage_guild=True)
    many = [10**17 + i for i in range(120)]
    for channel_id in many:
        await h.runtime.update_settings(G, add_channel=channel_id,
                                        toggle_autoresponse_channel=channel_id)
    await h.slash("memory-admin channels mode", invoker=bob(), where=GENERAL, permissions=admin,
                  mode="include")
    await h.slash("memory-admin channels show", invoker=bob(), where=GENERAL, permissions=admin)
    await h.slash("memory-admin autoresponse", invoker=bob(), where=GENERAL, permissions=admin,
                  mode="channels")
    replies = [c["data"]["content"] for c in h.adapter.callbacks[-3:]]
    assert all(len(reply) <= 2000 for reply in replies), [len(r) for r in replies]
    assert all("and 80 more" in reply for reply in replies)
    assert f"<#{many[0]}>" in replies[1] and f"<#{many[-1]}>" not in replies[1]


async def test_admins_choose_channels_and_purge_them(harness):
    h = harness
    admin = discord.Permissions(manage_guild=True)
    await h.slash("memory-admin channels mode", invoker=bob(), where=GENERAL, permissions=admin,
                  mode="exclude")
    await h.slash("memory-admin channels add", invoker=bob(), where=GENERAL, permissions=admin,
                  channel=h.guild.get_channel(RANDOM))
    await say(h, "kept in general")
    await say(h, "not kept in random", where=RANDOM)
    await settle(h, embed=False)
    assert h.engine.storage.messages.count() == 1

    await say(h, "in the thread", where=THREAD)
    await settle(h, embed=False)
    await h.slash("memory-admin purge-channel", invoker=bob(), where=GENERAL, permissions=admin,
                  channel=h.guild.get_channel(GENERAL))
    assert "Forgot 2 messages" in h.adapter.followups[-1]["content"]
    assert h.engine.storage.messages.count() == 0


async def test_admin_commands_take_an_archived_thread(harness):
    # not in discord.py's cache: Discord describes it in the interaction, and purging
    # or listing it must not fail on the missing cache entry
    h = harness
    admin = discord.Permissions(manage_guild=True)
    gone = RANDOM + 500
    said = h.message("notes from the old thread", author=(ALICE, "alice"), channel=GENERAL)
    h.engine.storage.messages.upsert([replace(record_from_message(said), channel_id=gone,
                                              parent_id=GENERAL, channel_type="public_thread")])
    described = [archived_thread(gone, GENERAL)]
    await h.slash("memory-admin channels add", invoker=bob(), where=GENERAL, permissions=admin,
                  archived=described, channel=str(gone))
    assert gone in h.engine.storage.guilds.settings(G).channels
    await h.slash("memory-admin purge-channel", invoker=bob(), where=GENERAL, permissions=admin,
                  archived=described, channel=str(gone))
    assert f"Forgot 1 messages from <#{gone}>" in h.adapter.followups[-1]["content"]
    assert h.engine.storage.messages.count() == 0


async def test_admin_commands_check_permissions_at_run_time(harness):
    h = harness  # default_permissions is only a hint a server admin can override
    await h.slash("memory-admin purge-channel", invoker=bob(), where=GENERAL,
                  permissions=discord.Permissions(send_messages=True),
                  channel=h.guild.get_channel(GENERAL))
    reply = h.adapter.callbacks[-1]["data"]
    assert reply["flags"] == 64 and "Manage Server" in reply["content"]


async def store_an_old_and_a_new_message(h) -> None:
    """A message stored 40 days ago (by the host clock) and one said now."""
    old = h.message_payload("an old message", author=(ALICE, "alice"), channel=GENERAL)
    old_record = record_from_message(discord.Message(state=h.state, channel=h.guild.get_channel(
        GENERAL), data=old))
    h.engine.storage.messages.upsert([replace(old_record, created_at=datetime_to_ms(
        datetime.now(timezone.utc) - timedelta(days=40)))])
    await say(h, "a new message")
    await settle(h)


async def test_retention_purges_old_messages(harness):
    h = harness
    await store_an_old_and_a_new_message(h)
    await h.slash("memory-admin retention", invoker=bob(), where=GENERAL,
                  permissions=discord.Permissions(manage_guild=True), days=30)
    assert "1 older messages forgotten" in h.adapter.followups[-1]["content"]
    assert h.engine.storage.messages.count() == 1
    assert h.engine.storage.guilds.settings(G).retention_days == 30


async def test_a_guild_whose_settings_cannot_be_read_is_held_back_not_defaulted(
    harness, monkeypatch
):
    """With nothing cached (the follower dropped it), a failed read (a pooled PostgreSQL
    connection the server closed, a damaged row) once fell back to "remember every
    channel"; raised as busy instead, it stalled every later write of every guild."""
    h = harness
    stored = await say(h, "the offsite is in march")
    await settle(h, embed=False)
    h.engine.storage.guilds.update_settings(G, channel_mode="exclude", add_channel=RANDOM)
    h.runtime.guild_settings.drop_all()

    def unreadable(guild_id: int):
        raise OSError("server closed the connection unexpectedly")

    monkeypatch.setattr(h.engine.storage.guilds, "settings", unreadable)
    excluded = await say(h, "bob's disciplinary hearing is on friday", where=RANDOM)
    held = await say(h, "the picnic is on saturday")
    edited = h.message_payload("the offsite moved to april", author=(ALICE, "alice"),
                               channel=GENERAL) | {
        "id": str(stored.id), "edited_timestamp": datetime.now(timezone.utc).isoformat()}
    new = discord.Message(state=h.state, channel=stored.channel, data=edited)
    await h.listeners.on_raw_message_edit(discord.RawMessageUpdateEvent(edited, new))
    later: list[int] = []
    h.runtime.writes.put(lambda items: later.extend(items), [1])  # any write queued after
    await settle(h, embed=False)
    assert later == [1], "the queue went on"
    found = h.engine.storage.messages.hydrate([excluded.id, held.id, stored.id])
    assert set(found) == {stored.id} and found[stored.id].content == "the offsite moved to april"
    monkeypatch.undo()
    # held for the catch-up, which reads the channels again once the settings can be read
    assert h.engine.storage.guilds.missed() == {RANDOM: [excluded.id], GENERAL: [held.id]}
    ask = h.message(f"<@{BOT_ID}> when is the offsite?", author=(ALICE, "alice"),
                    channel=GENERAL, mentions=[user(BOT_ID, "memorybot", bot=True)])
    monkeypatch.setattr(h.engine.storage.guilds, "settings", unreadable)
    await h.search.on_mention(ask)  # where it may answer cannot be judged: no answer, no error


class _HostClockAhead(datetime):
    """``datetime.now`` of a host clock 20 years ahead."""

    @classmethod
    def now(cls, tz=None):  # type: ignore[no-untyped-def, override]
        return datetime.now(tz) + timedelta(days=7300)


async def test_the_hourly_retention_pass_with_a_host_clock_far_ahead(harness, monkeypatch, caplog):
    """Issue 31, item 5: with the host clock 20 years ahead the hourly pass forgot every
    message; it counts from the newest message seen from Discord (its snowflake) now."""
    h = harness
    await store_an_old_and_a_new_message(h)
    h.engine.storage.guilds.update_settings(G, retention_days=30)
    h.runtime.guild_settings.drop_all()
    real = time.time
    monkeypatch.setattr(time, "time", lambda: real() + 7300 * 86_400)
    # every reader of the host clock sees it ahead (the starting commit's pass read this one)
    monkeypatch.setattr("cogs.memory.runtime.datetime", _HostClockAhead, raising=False)

    with caplog.at_level(logging.WARNING):
        await h.runtime.enforce_retention()

    assert h.engine.storage.messages.count() == 1  # the 40-day-old one went, the new one stays
    assert h.runtime.clock.now_ms() is not None  # measured from the gateway message
    assert "not from the host clock" in caplog.text


async def test_deleted_channels_threads_and_guilds_are_forgotten(harness):
    h = harness
    await say(h, "general text")
    await say(h, "thread text", where=THREAD)
    await say(h, "random text", where=RANDOM)
    await settle(h)
    h.state.parse_thread_delete({"id": str(THREAD), "guild_id": str(G),
                                 "parent_id": str(GENERAL), "type": 11})
    await asyncio.sleep(0)
    await settle(h)
    assert h.engine.storage.messages.count() == 2
    h.state.parse_channel_delete({"id": str(RANDOM), "guild_id": str(G), "type": 0})
    await asyncio.sleep(0)
    await settle(h)
    assert h.engine.storage.messages.count() == 1
    h.state.parse_guild_delete({"id": str(G), "unavailable": False})
    await asyncio.sleep(0)
    await settle(h)
    assert h.engine.storage.messages.count() == 0
    vectors = sql_rows(h.engine.storage.database.location, "SELECT count(*) FROM message_vectors")[0][0]
    fts = sql_rows(h.engine.storage.database.location, "SELECT count(*) FROM search_fts")[0][0]
    assert vectors == 0 and fts == 0


# -- commands ------------------------------------------------------------------------------

async def test_slash_search_defers_then_sends_hits_with_jump_links(harness):
    h = harness
    for text in ("bring the soldering iron on friday", "pizza tonight?", "the iron is broken"):
        await say(h, text, who=(BOB, "bob"))
    await settle(h)
    await h.slash("search", invoker=alice(), where=GENERAL, query="soldering iron", limit=2)
    callback = h.adapter.callbacks[0]
    assert callback["type"] == 5 and callback["data"]["flags"] == 64  # deferred, ephemeral
    embed = h.adapter.followups[0]["embeds"][0]
    assert "soldering iron" in embed["title"]
    assert 1 <= len(embed["fields"]) <= 2
    value = embed["fields"][0]["value"]
    assert "soldering iron" in value and f"<#{GENERAL}>" in value and "<t:" in value
    assert f"https://discord.com/channels/{G}/{GENERAL}/" in value


async def test_results_escape_markdown_links_and_mentions(harness):
    h = harness
    await say(h, "@everyone [free nitro](https://evil.example) **now** <@1001>")
    await settle(h)
    await h.slash("search", invoker=alice(), where=GENERAL, query="free nitro")
    value = h.adapter.followups[0]["embeds"][0]["fields"][0]["value"]
    assert "@\u200beveryone" in value and "\\[free nitro\\]" in value and "\\*\\*now" in value
    assert h.adapter.followups[0]["allowed_mentions"]["parse"] == []


async def test_slash_search_rejects_a_bad_date_in_one_line(harness):
    await harness.slash("search", invoker=alice(), where=GENERAL, query="x", after="yesterday")
    reply = harness.adapter.callbacks[-1]["data"]
    assert reply["flags"] == 64 and "after must be a date like" in reply["content"]


async def test_slash_search_on_an_empty_memory_says_why(harness):
    await harness.slash("search", invoker=alice(), where=GENERAL, query="anything")
    assert "nothing is stored" in harness.adapter.followups[0]["embeds"][0]["description"]


async def test_memory_stats_counts_this_guild_only(harness):
    h = harness
    await say(h, "hello there")
    h.engine.storage.messages.upsert([record_from_message(h.message("elsewhere", author=(BOB, "bob"),
                                                   channel=GENERAL)).__class__(
        id=5, guild_id=777, channel_id=778, author_id=BOB, created_at=1, content="other guild")])
    await settle(h, embed=False)
    await h.slash("memory stats", invoker=alice(), where=GENERAL)
    content = h.adapter.followups[0]["content"]
    assert "Messages you can search here: **1**" in content and "Your messages: **1**" in content
    assert "2" not in content.split("\n")[0]


async def test_privacy_notice(harness):
    await harness.slash("memory privacy", invoker=bob(), where=GENERAL)
    text = harness.adapter.callbacks[-1]["data"]["content"]
    assert "forget-me" in text and "opt-out" in text and "channels *you* can read" in text
    assert "public answers that quote a message are taken down" in text
    assert "chat model" not in text
    # with a chat model, a second message says where quoted messages go
    harness.engine.profile = replace(harness.engine.profile, llm=LLMConfig(
        base_url="http://llm.internal.example:8080/v1", model="qwen3-8b"))
    harness.runtime.chat = make_chat_client(harness.engine.profile)
    await harness.slash("memory privacy", invoker=bob(), where=GENERAL)
    assert harness.adapter.callbacks[-1]["data"]["content"] == text
    remote = harness.adapter.followups[-1]
    assert "`qwen3-8b` at `llm.internal.example`" in remote["content"]
    assert remote["flags"] == 64, "ephemeral, like the notice"
    # Discord refuses a message over 2,000 characters: the longest names still fit
    harness.engine.profile = replace(harness.engine.profile, llm=LLMConfig(
        base_url=f"http://{'h' * 63}.{'i' * 60}.example/v1", model="m" * 200))
    harness.runtime.chat = make_chat_client(harness.engine.profile)
    await harness.slash("memory privacy", invoker=bob(), where=GENERAL)
    assert max(len(text), len(harness.adapter.followups[-1]["content"])) <= 2000


async def test_the_profile_switch_is_for_the_bot_owner_only(harness):
    h = harness
    admin = discord.Permissions.all()
    await h.slash("memory-owner profile", invoker=bob(), where=GENERAL, permissions=admin,
                  name="cpu-fast")
    assert "Only the bot's owner" in h.adapter.callbacks[-1]["data"]["content"]
    assert h.engine.storage.meta.active_profile is None
    await h.slash("memory-owner profile", invoker=member(OWNER, "owner"), where=GENERAL,
                  permissions=admin, name="cpu-fast")
    assert "now **cpu-fast**" in h.adapter.followups[-1]["content"]
    assert h.engine.storage.meta.active_profile == "cpu-fast"
    await h.slash("memory-owner profile", invoker=member(OWNER, "owner"), where=GENERAL,
                  permissions=admin, name="no-such-profile")
    assert "Could not switch" in h.adapter.followups[-1]["content"]
    assert h.engine.storage.meta.active_profile == "cpu-fast"


async def test_unexpected_errors_end_the_thinking_state_with_a_trace_id(harness, caplog):
    h = harness

    def broken(request):
        raise RuntimeError("boom")

    h.engine.search = broken
    with caplog.at_level(logging.ERROR):
        await h.slash("search", invoker=alice(), where=GENERAL, query="anything")
    reply = h.adapter.followups[-1]
    assert "trace id" in reply["content"] and reply["flags"] == 64
    trace = reply["content"].split("`")[1]
    assert any(trace in r.getMessage() for r in caplog.records)


async def test_search_has_a_cooldown(harness):
    h = harness
    for _ in range(4):
        await h.slash("search", invoker=alice(), where=GENERAL, query="anything")
    assert "Slow down" in h.adapter.callbacks[-1]["data"]["content"]


# -- mention replies -----------------------------------------------------------------------

async def test_a_mention_is_answered_from_memory_without_pinging(harness):
    h = harness
    await say(h, "the lockbox code is 4417 @everyone", who=(BOB, "bob"))
    await settle(h)
    await say(h, f"<@{BOT_ID}> what is the lockbox code",
              mentions=[user(BOT_ID, "memorybot", bot=True)])
    _, payload = h.sent[-1]
    assert "4417" in payload["embeds"][0]["fields"][0]["value"]
    assert payload["message_reference"]["message_id"]
    assert payload["allowed_mentions"] == {"parse": [], "replied_user": False}


async def test_mentions_from_bots_and_reply_pings_are_not_answered(harness):
    h = harness
    await say(h, "the lockbox code is 4417", who=(BOB, "bob"))
    await settle(h)
    await say(h, f"<@{BOT_ID}> lockbox?", who=(4242, "otherbot"), bot=True,
              mentions=[user(BOT_ID, "memorybot", bot=True)])
    # a reply to the bot's answer pings it, but does not mention it in the text
    await say(h, "thanks!", mentions=[user(BOT_ID, "memorybot", bot=True)],
              message_reference={"message_id": "1", "channel_id": str(GENERAL), "guild_id": str(G)})
    assert h.sent == []


async def test_mention_replies_follow_the_autoresponse_setting_and_a_cooldown(harness):
    h = harness
    await say(h, "the lockbox code is 4417", who=(BOB, "bob"))
    await settle(h)
    ask = dict(mentions=[user(BOT_ID, "memorybot", bot=True)])
    await say(h, f"<@{BOT_ID}> lockbox code?", **ask)
    await say(h, f"<@{BOT_ID}> lockbox code again?", **ask)  # within the cooldown
    assert len(h.sent) == 1
    await h.slash("memory-admin autoresponse", invoker=bob(), where=GENERAL,
                  permissions=discord.Permissions(manage_guild=True), mode="off")
    await say(h, f"<@{BOT_ID}> lockbox code?", who=(BOB, "bob"), **ask)
    assert len(h.sent) == 1


# -- resilience ----------------------------------------------------------------------------

async def test_live_writes_survive_another_process_holding_the_lock(harness, tmp_path):
    h = harness
    other = connect(h.engine.storage.database.location)
    other.execute("PRAGMA busy_timeout = 0")
    h.engine.storage.database.set_busy_timeout(0.05)
    other.execute("BEGIN IMMEDIATE")  # another process's long write transaction
    sent = [await say(h, f"message number {i}") for i in range(30)]
    await asyncio.sleep(0.5)
    assert h.engine.storage.messages.count() == 0  # still waiting for the lock...
    other.execute("COMMIT")
    other.close()
    await settle(h, embed=False)
    assert h.engine.storage.messages.count() == len(sent)  # ...and nothing was lost


@pytest.mark.parametrize("warn_after_s", [0.0, 3600.0])
async def test_a_long_busy_spell_is_a_warning_with_the_writes_waiting(
        harness, monkeypatch, caplog, warn_after_s):
    """The queue retries a busy database for ever; once that lasts (PostgreSQL down
    for good reads as pool timeouts, i.e. StorageBusy) it says so at WARNING, with
    how many writes wait, then only every BUSY_WARN_EVERY_S; a short spell stays INFO."""
    h = harness
    # the module the loaded extension runs (discord.py re-imports it per load)
    queue = sys.modules["cogs.memory.write_queue"]
    monkeypatch.setattr(queue, "BUSY_WARN_AFTER_S", warn_after_s)
    monkeypatch.setattr(queue, "BUSY_WARN_EVERY_S", 3600.0)
    other = connect(h.engine.storage.database.location)
    other.execute("PRAGMA busy_timeout = 0")
    h.engine.storage.database.set_busy_timeout(0.05)
    with caplog.at_level(logging.INFO, logger="cogs.memory.write_queue"):
        other.execute("BEGIN IMMEDIATE")
        sent = [await say(h, f"message number {i}") for i in range(5)]
        await until(lambda: sum("database busy" in r.getMessage() for r in caplog.records) >= 3)
        other.execute("COMMIT")
        other.close()
        await settle(h, embed=False)
    assert h.engine.storage.messages.count() == len(sent)  # nothing was lost
    warnings = [r.getMessage() for r in caplog.records
                if r.name == "cogs.memory.write_queue" and r.levelno >= logging.WARNING]
    if warn_after_s:
        assert warnings == []
        return
    busy, recovered = warnings  # once, not per retry
    assert busy.startswith("database busy for ") and "still retrying, nothing is dropped" in busy
    waiting = int(busy.split("): ", 1)[1].split(" writes wait", 1)[0])
    assert 1 <= waiting <= len(sent)
    assert recovered.startswith("database takes writes again after ")


async def test_the_embed_loop_survives_any_error(harness, monkeypatch):
    h = harness
    calls = []

    def failing(**kwargs):
        calls.append(1)
        raise RuntimeError("database is locked")

    monkeypatch.setattr(h.engine, "embed_pending", failing)
    monkeypatch.setattr("cogs.memory.runtime.EMBED_INTERVAL_S", 0.001)
    h.runtime.embed_backlog.change_interval(seconds=0.01)
    await asyncio.sleep(0.3)
    assert calls and h.runtime.embed_backlog.is_running()


async def test_a_model_replaced_under_the_bot_stops_embedding_in_one_line(harness, caplog):
    """Another process re-embeds the bot's database with another model (``reembed``).

    The embedding loop says so in one line and stops, so no vector of the old model
    gets in; what members send is still stored (it waits in the backlog for a restart
    with the new profile), and searches still answer, by keywords.
    """
    h = harness
    loop = h.runtime.embed_backlog
    loop.change_interval(seconds=0.01)
    for text in ("the soldering iron is in the red drawer", "the kettle descaler is under the sink"):
        await say(h, text)
    await settle(h, embed=False)
    await until(lambda: h.engine.storage.backlog.pending_count() == 0)  # the loop embeds them
    other = MemoryEngine(h.engine.storage.database.location, Profile(name="other"),
                         HashEmbedder(64, model_id="test/other-64"), load_reranker=False,
                         check_model=False)  # as `python bot.py reembed` with another profile
    assert other.reembed() == 2
    other.close()

    with caplog.at_level(logging.INFO, logger="cogs.memory.runtime"):
        await say(h, "the soldering iron tips are in the blue box")
        await settle(h, embed=False)
        await until(lambda: not loop.is_running())
        await say(h, "the glue gun is next to the soldering iron")  # after the loop stopped
        await settle(h, embed=False)
    stopped = [r for r in caplog.records if r.name == "cogs.memory.runtime"
               and r.levelno >= logging.WARNING]
    assert len(stopped) == 1 and stopped[0].levelno == logging.ERROR, stopped
    line = stopped[0].getMessage()
    assert line.startswith("embedding stopped until the bot restarts: ") and "\n" not in line
    assert "re-embedded with test/other-64 (64 dims)" in line and stopped[0].exc_info is None
    assert not loop.is_running()

    storage = h.engine.storage
    assert storage.messages.count() == 4  # nothing a member sent is lost
    assert storage.backlog.pending_count() == 2  # waiting for a restart with the new model
    assert sql_rows(storage.database.location, "SELECT count(*) FROM message_vectors") == [(2,)]
    assert storage.meta.embedding_model() == ("test/other-64", 64)

    with caplog.at_level(logging.WARNING, logger="memory.search.searcher"):
        await h.slash("search", invoker=alice(), where=GENERAL, query="soldering iron")
    fields = h.adapter.followups[-1]["embeds"][0]["fields"]
    assert len(fields) == 3 and all("soldering iron" in f["value"] for f in fields)
    assert any("searching by keywords only: " in r.getMessage() and "re-embedded with" in
               r.getMessage() for r in caplog.records if r.name == "memory.search.searcher")
    result = h.engine.search("glue gun", guild_id=G)
    assert result.hits and result.trace.keyword_only == line.split(": ", 1)[1]


async def run_inline(fn):
    """A write queue's runner for tests: applies each batch on the event loop itself."""
    fn()


async def test_write_queue_retries_busy_errors_in_order():
    applied: list[list[int]] = []
    failures = iter([True, True, False, False])

    class OperationalError(Exception):
        pass

    def store(items):
        if next(failures, False):
            raise OperationalError("database is locked")
        applied.append(("store", items))

    def forget(items):
        applied.append(("forget", items))

    queue = WriteQueue(run_inline)
    queue.start()
    queue.put(store, [1, 2])
    queue.put(store, [4])
    queue.put(forget, [1])
    await queue.put_and_wait(store, [3])
    await queue.stop()
    # consecutive writes of one call are applied as one call; the order holds
    assert applied == [("store", [1, 2, 4]), ("forget", [1]), ("store", [3])]


async def test_a_write_the_database_refuses_is_given_up_alone(monkeypatch, caplog):
    """One item no retry can write is given up by itself: the messages and the deletion
    that shared its batch are applied, in order, and its waiter hears why."""
    # the module as it is loaded now (a harness's teardown unloads the extension's modules)
    write_queue = importlib.import_module("cogs.memory.write_queue")
    monkeypatch.setattr(write_queue, "RETRY_MAX_S", 0.001)
    applied: list[tuple[str, list[int]]] = []

    def store(items):
        if 13 in items:
            raise ValueError("cannot store item 13")
        applied.append(("store", items))

    def forget(items):
        applied.append(("forget", items))

    queue = write_queue.WriteQueue(run_inline)
    queue.start()
    with caplog.at_level(logging.ERROR, logger="cogs.memory.write_queue"):
        queue.put(store, [1, 2])
        queue.put(store, [13])
        queue.put(store, [4])
        queue.put(forget, [1])
        await queue.put_and_wait(store, [5])  # one batch: the five writes above
        with pytest.raises(ValueError, match="item 13"):
            await queue.put_and_wait(store, [13, 6])
        await queue.stop()
    assert applied == [("store", [1]), ("store", [2]), ("store", [4]), ("forget", [1]),
                       ("store", [5]), ("store", [6])]
    given_up = [r.getMessage() for r in caplog.records if r.levelno >= logging.ERROR]
    assert given_up == ["giving up on 1 writes after 2 tries: store[13] (cannot store item 13)"] * 2


async def test_a_database_that_refuses_everything_is_given_up_on_quickly(monkeypatch, caplog):
    """When the items of a split batch fail in a row, the error is the database's: the
    rest of the batch is given up untried, not retried item by item for minutes."""
    write_queue = importlib.import_module("cogs.memory.write_queue")
    monkeypatch.setattr(write_queue, "RETRY_MAX_S", 0.001)
    calls: list[list[int]] = []

    def broken(items):
        calls.append(items)
        raise RuntimeError("no such table: messages")

    queue = write_queue.WriteQueue(run_inline)
    queue.start()
    with caplog.at_level(logging.ERROR, logger="cogs.memory.write_queue"):
        with pytest.raises(RuntimeError, match="no such table"):
            await queue.put_and_wait(broken, list(range(200)))
        await queue.stop()
    tries = write_queue.SPLIT_AFTER + write_queue.SYSTEMIC_AFTER * write_queue.SPLIT_TRIES
    assert len(calls) == tries
    assert "giving up on the 195 after them untried" in caplog.records[-1].getMessage()


async def test_a_stop_during_a_split_hands_back_only_what_is_not_settled(monkeypatch):
    write_queue = importlib.import_module("cogs.memory.write_queue")
    monkeypatch.setattr(write_queue, "RETRY_MAX_S", 0.001)
    applied: list[object] = []
    holding = asyncio.Event()
    release = asyncio.Event()

    def store(items):
        if len(items) > 1:
            raise ValueError("one of these cannot be stored")
        applied.append(items[0])

    def forget(ids):
        applied.append(("forget", ids))

    async def run(fn):
        fn()
        if len(applied) == 3:  # the split reached the last write: hold it there
            holding.set()
            await release.wait()

    queue = write_queue.WriteQueue(run)
    queue.start()
    queue.put(store, [1, 2])
    queue.put(forget, [3])
    await holding.wait()
    left = await queue.stop(timeout=0)  # the split is cut short while it holds the write thread
    release.set()
    # the split settled the first write: only the one it was applying comes back
    assert [(w.apply, w.items) for w in left] == [(forget, [3])]
    assert applied == [1, 2, ("forget", [3])]


async def test_settings_dropped_while_being_read_are_not_kept(harness):
    """The bot leaves a guild while its settings are being read: the read's answer (the
    settings as they were) is not cached for the next minute."""
    h = harness
    started, release = asyncio.Event(), asyncio.Event()

    async def slow_read(fn, *args):
        started.set()
        await release.wait()
        return fn(*args)

    cache = SettingsCache(h.engine.storage.guilds, slow_read)
    cache.start()
    reading = asyncio.create_task(cache.get(G))
    await started.wait()
    cache.drop(G)
    release.set()
    assert (await reading).guild_id == G  # the caller gets its answer
    assert len(cache) == 0  # but it is not kept


async def test_a_lone_surrogate_from_the_gateway_is_stored_as_a_replacement(harness):
    """discord.py's JSON accepts ``"\\ud83d"``; the message is stored (with U+FFFD), not
    retried and given up with the writes around it."""
    h = harness
    broken = await say(h, "broken emoji \ud83d here", who=(BOB, "b\udc00b"))
    ordinary = await say(h, "an ordinary message")
    await settle(h)
    stored = h.engine.storage.messages.hydrate([broken.id, ordinary.id])
    assert stored[broken.id].content == "broken emoji \ufffd here"
    assert stored[ordinary.id].content == "an ordinary message"
    assert h.engine.search("broken emoji", guild_id=G).hits[0].id == broken.id


async def test_captures_are_not_queued_behind_slow_searches(harness):
    h = harness
    original = h.engine.search
    release = asyncio.Event()
    loop = asyncio.get_running_loop()

    def slow_search(request):
        asyncio.run_coroutine_threadsafe(release.wait(), loop).result(5)
        return original(request)

    h.engine.search = slow_search
    searches = [asyncio.create_task(h.slash("search", invoker=member(2000 + i, f"m{i}"),
                                            where=GENERAL, query="x")) for i in range(8)]
    await asyncio.sleep(0.1)
    await say(h, "stored while eight searches run")
    await settle(h, embed=False)
    assert h.engine.storage.messages.count() == 1
    release.set()
    await asyncio.gather(*searches)


def _write_from_another_process(path: str, first_id: int, batches: int) -> None:
    """Another process (an import, a second bot) writing batches in long-ish transactions."""
    from memory.records import MessageRecord
    from memory.storage import open_storage

    storage = open_storage(path)
    for b in range(batches):
        storage.messages.upsert(
            MessageRecord(id=first_id + b * 200 + i, guild_id=G, channel_id=RANDOM,
                          author_id=BOB, created_at=1_700_000_000_000 + i,
                          content=f"imported line {b} {i} " + "padding " * 40)
            for i in range(200)
        )
    storage.close()


async def test_two_processes_writing_while_the_bot_captures_lose_nothing(harness):
    import multiprocessing

    h = harness
    context = multiprocessing.get_context("spawn")
    writers = [context.Process(target=_write_from_another_process,
                               args=(h.engine.storage.database.location, 10_000_000 * (n + 1), 25))
               for n in range(2)]
    for writer in writers:
        writer.start()
    captured = []
    for i in range(200):
        captured.append(await say(h, f"live message {i}"))
        await asyncio.sleep(0.005)
    await asyncio.to_thread(lambda: [w.join(120) for w in writers])
    assert all(w.exitcode == 0 for w in writers)
    await settle(h, embed=False)
    assert h.engine.storage.messages.count() == 200 + 2 * 25 * 200
    stored = h.engine.storage.messages.hydrate([m.id for m in captured])
    assert len(stored) == 200
