"""The bot stays answerable: every member-facing path replies, whatever goes wrong.

Failures here are real ones, not patched functions: the database loses a table
underneath the bot (another process dropped it), so SQLite raises its own error,
not the engine's.  Messages arrive through discord.py's gateway parser, commands
through the command tree, as in tests/discord/test_cog.py.
"""

from __future__ import annotations

import asyncio
import logging
from typing import Any

import discord
import pytest

from memory.config import Profile
from memory.engine import MemoryEngine
from memory.storage.sqlite.connection import connect
from tests.discord.test_permissions import (  # noqa: F401  (harness: the permission-matrix server)
    ARCHIVED_PRIVATE,
    ARCHIVED_STAFF_THREAD,
    GENERAL,
    READABLE,
    STAFF_ONLY,
    WORD,
    _invoker,
    _quoted,
    harness,
)
from tests.support.builders import HashEmbedder
from tests.support.discord_harness import (
    BOT_ID,
    READ,
    Harness,
    archived_thread,
    channel,
    guild,
    member,
    next_id,
    role,
    user,
)

G, HALL = 300, 301
ALICE = 3001


@pytest.fixture
async def small(tmp_path):
    engine = MemoryEngine(tmp_path / "bot.sqlite3", Profile(name="test"), HashEmbedder(),
                          load_reranker=False)
    h = Harness(engine, [guild(G, "Small", owner=9999, roles=[role(G, "@everyone", READ)],
                               members=[member(ALICE, "alice")], channels=[channel(HALL, G, "hall")])])
    await h.start()
    await h.listeners.on_message(h.message("the lockbox code is 4417", author=(ALICE, "alice"), channel=HALL))
    await h.runtime.writes.stop()
    h.runtime.writes.start()
    await asyncio.to_thread(engine.embed_pending)
    yield h
    await h.close()
    engine.close()


def break_tables(h: Harness, *tables: str) -> None:
    """Another process drops tables: what reads them next fails inside SQLite."""
    other = connect(h.engine.storage.database.location)
    other.execute("PRAGMA foreign_keys = OFF")
    for table in tables:
        other.execute(f"DROP TABLE {table}")
    other.commit()
    other.close()


def break_search(h: Harness) -> None:
    """Break both sides of a search: a damaged vector table alone is answered from the
    keyword lists (issue 31, item 3), so the keyword table goes too."""
    break_tables(h, "message_vectors", "search_fts")


async def deliver(h: Harness, data: dict[str, Any], invoker: dict[str, Any], where: int) -> None:
    """An INTERACTION_CREATE through the gateway parser, as Discord sends it; wait for the answer."""
    home = h.find_guild(where)
    place = home.get_channel_or_thread(where)
    perms = place.permissions_for(home.get_member(int(invoker["user"]["id"])) or home.default_role)
    answered = len(h.adapter.callbacks)
    h.state.parse_interaction_create({
        "id": str(next_id()), "application_id": str(h.state.application_id), "type": 2,
        "token": "tok", "version": 1, "guild_id": str(home.id), "channel_id": str(where),
        "channel": {"id": str(where), "type": place.type.value, "name": place.name,
                    "guild_id": str(home.id), "position": 0, "permission_overwrites": []},
        "member": invoker | {"permissions": str(perms.value)},
        "app_permissions": str(discord.Permissions.all().value), "locale": "en-US",
        "guild_locale": "en-US", "entitlements": [], "authorizing_integration_owners": {},
        "context": 0, "attachment_size_limit": 10_485_760, "data": data,
    })
    # a deferred command answers twice (thinking, then the result)
    await wait_for(lambda: len(h.adapter.followups) > 0
                   or (len(h.adapter.callbacks) > answered and h.adapter.callbacks[-1]["type"] == 4))


def traced(text: str, caplog: pytest.LogCaptureFixture) -> logging.LogRecord:
    """The log record that carries the trace id quoted in ``text``, with its traceback."""
    assert "Something went wrong (trace id `" in text
    trace = text.split("`")[1]
    records = [r for r in caplog.records if trace in r.getMessage()]
    assert len(records) == 1 and records[0].exc_info is not None
    return records[0]


async def wait_for(condition: Any, seconds: float = 5.0) -> None:
    for _ in range(int(seconds / 0.02)):
        if condition():
            return
        await asyncio.sleep(0.02)
    raise AssertionError("nothing happened in time")


async def test_a_mention_whose_search_fails_gets_an_apology_with_a_trace_id(small, caplog):
    h = small
    break_search(h)
    payload = h.message_payload(f"<@{BOT_ID}> what is the lockbox code?", author=(ALICE, "alice"),
                                channel=HALL, mentions=[user(BOT_ID, "memorybot", bot=True)])
    with caplog.at_level(logging.ERROR):
        h.state.parse_message_create(payload)  # as the gateway delivers it: listeners run as tasks
        await wait_for(lambda: h.sent)
    channel_id, reply = h.sent[-1]
    assert channel_id == HALL and int(reply["message_reference"]["message_id"]) == int(payload["id"])
    assert reply["allowed_mentions"] == {"parse": [], "replied_user": False}
    record = traced(reply["content"], caplog)
    assert "mention reply" in record.getMessage()


@pytest.mark.parametrize(("command", "options"), [
    ("search", {"query": "lockbox"}),
    ("search", {"query": "lockbox", "private": False}),
    ("memory stats", {}),
    ("memory forget-me", {}),
])
async def test_every_slash_command_answers_a_failure_with_a_trace_id(small, caplog, command, options):
    h = small
    break_tables(h, "message_vectors", "search_fts", "messages", "channels")
    with caplog.at_level(logging.ERROR):
        await h.slash(command, invoker=member(ALICE, "alice"), where=HALL, **options)
    answers = [*h.adapter.followups, *(c.get("data", {}) for c in h.adapter.callbacks)]
    texts = [a.get("content") or "" for a in answers]
    assert any("trace id" in t for t in texts), texts
    traced(next(t for t in texts if "trace id" in t), caplog)


async def test_the_context_menu_answers_a_failure_with_a_trace_id(small, caplog):
    h = small
    break_search(h)
    target = h.message("lockbox code?", author=(ALICE, "alice"), channel=HALL)
    with caplog.at_level(logging.ERROR):
        await h.context_menu("Find related messages", invoker=member(ALICE, "alice"), where=HALL,
                             target=target)
    reply = h.adapter.followups[-1]
    assert reply["flags"] == 64
    traced(reply["content"], caplog)


async def test_a_command_the_bot_no_longer_has_is_answered(small):
    """Discord shows removed commands until the next sync: the member hears why nothing ran."""
    h = small
    data = {"id": str(next_id()), "name": "remember", "type": 1, "options": []}
    await deliver(h, data, member(ALICE, "alice"), HALL)
    reply = h.adapter.callbacks[-1]["data"]
    assert "/memory-owner sync" in reply["content"] and reply["flags"] == 64


# -- /search channel:<archived thread> ------------------------------------------------------

@pytest.mark.parametrize("uid", list(READABLE))
@pytest.mark.parametrize(("thread_id", "parent_id", "private"), [
    (ARCHIVED_STAFF_THREAD, STAFF_ONLY, False), (ARCHIVED_PRIVATE, GENERAL, True)])
async def test_search_in_an_archived_thread_follows_who_may_read_it(
    harness, uid, thread_id, parent_id, private  # noqa: F811
):
    h = harness
    assert h.guild.get_thread(thread_id) is None  # archived: not in discord.py's cache
    data = {"id": str(next_id()), "name": "search", "type": 1, "options": [
        {"name": "query", "type": 3, "value": WORD},
        {"name": "channel", "type": 7, "value": str(thread_id)}],
        "resolved": {"channels": {str(thread_id): archived_thread(thread_id, parent_id,
                                                                  private=private)}}}
    await deliver(h, data, _invoker(uid), GENERAL)
    texts = h.adapter.texts()
    assert not any("Something went wrong" in t for t in texts), texts
    expected = {thread_id} & READABLE[uid]
    assert _quoted(texts) == expected
    if not expected:  # refused like any channel the member cannot read
        assert any("readable" in t for t in texts), texts


async def test_the_option_still_takes_channels_and_live_threads(small):
    """Discord is told the option takes channels and threads, each type once."""
    h = small
    option = next(p for p in h.bot.tree.get_command("search").parameters if p.name == "channel")
    types = option.channel_types
    assert len(types) == len(set(types))
    assert {discord.ChannelType.text, discord.ChannelType.public_thread,
            discord.ChannelType.private_thread, discord.ChannelType.forum} <= set(types)


def test_a_busy_database_is_told_without_its_url_or_driver_text(caplog):
    """StorageBusy's text is for the operator (the database's address, the driver's
    words); a member gets a plain line, and the log keeps the detail."""
    from cogs.memory.errors import engine_error
    from memory.storage.postgres.connection import as_busy

    url = "postgresql://bot@db.internal:5432/memory?password=hunter2"
    import psycopg

    busy = as_busy(psycopg.OperationalError("server closed the connection unexpectedly"), url)
    assert busy is not None
    with caplog.at_level(logging.WARNING, logger="cogs.memory.errors"):
        text = engine_error("command memory stats", busy)
    assert text == "The memory database is busy right now; try again in a moment."
    assert "hunter2" not in caplog.text and "db.internal" in caplog.text
