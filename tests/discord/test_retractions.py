"""Public answers taken down once a message they quote is deleted or edited.

Messages, deletions and edits arrive as gateway payloads through discord.py's own
parsers, ``/search`` as an interaction through the command tree, mentions through the
cog's listener; the bot's edits go through discord.py's HTTP client to a stand-in for
Discord's REST API on 127.0.0.1 (tests/support/discord_standin.py), which records them.
"""

from __future__ import annotations

import asyncio
import logging
from datetime import datetime, timezone

import discord
import pytest

from cogs.memory.retractions import NOTE
from memory.config import LLMConfig, Profile
from memory.engine import MemoryEngine
from memory.llm import ChatClient
from tests.support.builders import HashEmbedder
from tests.support.discord_harness import BOT_ID, READ, Harness, channel, guild, member, role, user
from tests.support.discord_standin import FakeDiscord
from tests.support.openai_standin import OpenAIStandIn

G, GENERAL, RANDOM = 970, 971, 972
ALICE, BOB = (1401, "alice"), (1402, "bob")


def server() -> dict:
    return guild(G, "Retract Guild", owner=9999, roles=[role(G, "@everyone", READ, position=0)],
                 members=[member(ALICE[0], "alice"), member(BOB[0], "bob")],
                 channels=[channel(GENERAL, G, "general"), channel(RANDOM, G, "random")])


@pytest.fixture
async def setup(tmp_path, monkeypatch):
    fake = FakeDiscord()
    base = await fake.start()
    monkeypatch.setattr(discord.http.Route, "BASE", base)
    engine = MemoryEngine(tmp_path / "bot.sqlite3", Profile(name="test"), HashEmbedder(),
                          load_reranker=False)
    h = Harness(engine, [server()])
    await h.start()
    await h.bot.http.static_login("good-token")
    yield h, fake
    await h.close()
    await h.bot.http.close()
    await fake.stop()
    engine.close()


async def settle(h: Harness) -> None:
    """Every event handler done and every queued write applied."""
    for _ in range(3):
        await asyncio.sleep(0)
    await asyncio.gather(*[t for t in asyncio.all_tasks() if t.get_name().startswith("discord.py: ")])
    await h.runtime.writes.stop()
    h.runtime.writes.start()


async def send(h: Harness, text: str, who: tuple[int, str] = BOB, where: int = GENERAL,
               **extra) -> dict:
    data = h.message_payload(text, author=who, channel=where, **extra)
    h.state.parse_message_create(data)
    await settle(h)
    return data


async def delete(h: Harness, data: dict) -> None:
    h.state.parse_message_delete({"id": data["id"], "channel_id": data["channel_id"],
                                  "guild_id": str(G)})
    await settle(h)


async def public_search(h: Harness, query: str, *, private: bool = False) -> int:
    """``/search`` in #general; the id of the message it posted."""
    await h.slash("search", invoker=member(*ALICE), where=GENERAL, query=query, private=private)
    await settle(h)
    return h.adapter.posted[-1]


async def ask(h: Harness, question: str) -> None:
    """A mention of the bot in #general, answered by the cog's listener."""
    await send(h, f"<@{BOT_ID}> {question}", who=ALICE,
               mentions=[user(BOT_ID, "memorybot", bot=True)])


def tune(monkeypatch: pytest.MonkeyPatch, h: Harness, **constants: float) -> None:
    """Set constants of the retractions module the running bot uses (loading the
    extension may have imported its own copy of the module)."""
    namespace = type(h.runtime.retractions).retract_due.__globals__
    for name, value in constants.items():
        monkeypatch.setitem(namespace, name, value)


def taken_down(fake: FakeDiscord) -> list[tuple[int, int]]:
    """``(channel, message)`` of every edit that replaced a message with the note."""
    return [(c, m) for c, m, payload in fake.edits
            if payload.get("content") == NOTE and payload.get("embeds") == []]


async def test_a_public_search_is_taken_down_when_a_message_it_shows_is_deleted(setup):
    h, fake = setup
    raid = await send(h, "the raid password is swordfish")
    other = await send(h, "lunch is at noon", where=RANDOM)
    answer = await public_search(h, "raid password swordfish")
    private = await public_search(h, "raid password swordfish", private=True)
    assert "swordfish" in str(h.adapter.followups[-1]["embeds"])
    await delete(h, other)  # quoted by nothing
    assert await h.runtime.retractions.retract_due() == 0 and taken_down(fake) == []
    await delete(h, raid)
    assert await h.runtime.retractions.retract_due() == 1
    assert taken_down(fake) == [(GENERAL, answer)], "the private answer vanishes by itself"
    assert private != answer
    assert h.engine.storage.quotes.due() == []
    assert await h.runtime.retractions.retract_due() == 0, "taken down once"


async def test_no_public_search_where_the_bot_could_not_take_it_down(setup):
    # slash commands work in a channel the bot cannot see (Discord posts the answer), but
    # the bot could never edit that answer once a message it shows is deleted
    h, _ = setup
    await send(h, "the raid password is swordfish")
    blind = discord.Permissions.all()
    blind.view_channel = False
    await h.slash("search", invoker=member(*ALICE), where=GENERAL, query="raid password",
                  private=False, app_permissions=blind)
    await settle(h)
    assert h.adapter.callbacks[-1]["data"]["flags"] == 64, "answered to the member alone"
    assert "swordfish" in str(h.adapter.followups[-1]["embeds"])
    assert h.engine.storage.database.read("SELECT count(*) FROM answer_quotes") == [(0,)]


async def test_a_mention_reply_listing_hits_is_taken_down_when_a_hit_is_edited(setup):
    h, fake = setup
    raid = await send(h, "the raid moved to nine on saturday")
    await ask(h, "when is the raid?")
    reply = h.sent_ids[-1]
    assert "nine" in str(h.sent[-1][1].get("embeds"))
    h.state.parse_message_update(raid | {"content": "never mind, I was wrong",
                                         "edited_timestamp": datetime.now(timezone.utc).isoformat()})
    await settle(h)
    assert await h.runtime.retractions.retract_due() == 1
    assert taken_down(fake) == [(GENERAL, reply)]


async def test_an_answer_whose_source_was_edited_after_the_question_is_taken_down(setup):
    """The edit lands while the answer is searched or streamed: Discord dates it after
    the question, and it is applied before the answer's quotes are recorded, so no
    quote row was there for it (the answer may show the text from before it)."""
    h, fake = setup
    raid = await send(h, "the raid password is swordfish")
    h.state.parse_message_update(raid | {"content": "the raid password is swordfish, not",
                                         "edited_timestamp": datetime.now(timezone.utc).isoformat()})
    await settle(h)  # the harness's question is dated earlier than the edit
    answer = await public_search(h, "raid password swordfish")
    assert await h.runtime.retractions.retract_due() == 1
    assert taken_down(fake) == [(GENERAL, answer)]


@pytest.fixture(scope="module")
def chat_server():
    with OpenAIStandIn() as server:
        yield server


async def test_every_part_of_a_chat_answer_is_taken_down_when_a_source_is_deleted(
        setup, chat_server):
    h, fake = setup
    raid = await send(h, "the raid moved to nine on saturday")
    h.runtime.chat = ChatClient(LLMConfig(base_url=chat_server.base_url("long"), model="m",
                                          timeout_s=5.0))
    try:
        await ask(h, "when is the raid?")
    finally:
        h.runtime.chat.close()
        h.runtime.chat = None
    assert len(h.sent) == 2, "the reply (a placeholder, then edited), then a second part"
    parts = h.sent_ids[-2:]
    await delete(h, raid)
    assert await h.runtime.retractions.retract_due() == 2
    assert sorted(taken_down(fake)) == sorted((GENERAL, p) for p in parts)


async def test_an_answer_already_gone_on_discord_is_dropped(setup):
    h, fake = setup
    raid = await send(h, "the raid password is swordfish")
    answer = await public_search(h, "raid password swordfish")
    fake.deleted.add(answer)  # a moderator deleted the answer
    await delete(h, raid)
    assert await h.runtime.retractions.retract_due() == 1
    assert [m for _, m, _ in fake.edits] == [answer], "tried once, then dropped"
    assert h.engine.storage.quotes.due() == []


async def test_a_failed_edit_is_tried_again_later(setup, monkeypatch):
    h, fake = setup
    tune(monkeypatch, h, RETRY_MIN_S=0.0)  # at once, for the test
    raid = await send(h, "the raid password is swordfish")
    answer = await public_search(h, "raid password swordfish")
    fake.fail_edits = 1  # 400 Thread is archived
    await delete(h, raid)
    assert await h.runtime.retractions.retract_due() == 0
    assert [a.answer_id for a in h.engine.storage.quotes.due()] == [answer]
    assert await h.runtime.retractions.retract_due() == 1
    assert taken_down(fake) == [(GENERAL, answer)] * 2, "the refused edit, then the one taken"
    assert h.engine.storage.quotes.due() == []


async def test_answers_waiting_to_be_tried_again_hold_back_no_other(setup, monkeypatch):
    """A page of due answers all waiting (archived threads) must not stop the ones after."""
    h, fake = setup
    tune(monkeypatch, h, DUE_PAGE=1)
    raid = await send(h, "the raid password is swordfish")
    first = await public_search(h, "raid password swordfish")
    second = await public_search(h, "raid password swordfish")
    fake.fail_edits = 1  # 400 Thread is archived: the oldest waits half a minute
    await delete(h, raid)
    assert await h.runtime.retractions.retract_due() == 0
    assert await h.runtime.retractions.retract_due() == 1
    assert taken_down(fake) == [(GENERAL, first), (GENERAL, second)]
    assert [a.answer_id for a in h.engine.storage.quotes.due()] == [first]


async def test_an_answer_recorded_after_its_source_went_is_taken_down(setup):
    """The deletion was queued before the answer's quotes: they are recorded as due."""
    h, fake = setup
    raid = await send(h, "the raid password is swordfish")
    h.state.parse_message_delete({"id": raid["id"], "channel_id": str(GENERAL),
                                  "guild_id": str(G)})  # queued, not yet applied
    h.runtime.retractions.record(G, GENERAL, [4242], [int(raid["id"])], asked=int(raid["id"]))
    await settle(h)
    assert await h.runtime.retractions.retract_due() == 1
    assert taken_down(fake) == [(GENERAL, 4242)]


async def test_the_loop_outlives_a_foreign_error(setup, monkeypatch, caplog):
    h, fake = setup
    raid = await send(h, "the raid password is swordfish")
    answer = await public_search(h, "raid password swordfish")
    await delete(h, raid)
    quotes = h.engine.storage.quotes
    real_due, calls = quotes.due, []

    def flaky(*args, **kwargs):
        calls.append(args)
        if len(calls) == 1:
            raise KeyError("not one of ours")
        return real_due(*args, **kwargs)

    monkeypatch.setattr(quotes, "due", flaky)
    tune(monkeypatch, h, RETRACT_INTERVAL_S=0.01)  # the back-off after the error
    loop = h.runtime.retractions.retract_loop
    with caplog.at_level(logging.ERROR, logger="cogs.memory.retractions"):
        loop.change_interval(seconds=0.02)
        for _ in range(200):
            if taken_down(fake):
                break
            await asyncio.sleep(0.02)
    assert "taking down answers failed" in caplog.text and "KeyError" in caplog.text
    assert loop.is_running()
    assert taken_down(fake) == [(GENERAL, answer)]


async def test_another_process_s_guild_is_left_to_it(setup):
    """With shards spread over processes, a guild this process lacks is another's."""
    h, fake = setup
    elsewhere = G + 100  # not in this bot's cache: another process runs its shard
    h.runtime.retractions.record(elsewhere, elsewhere + 1, [4343], [12345],  # gone: due at once
                                 asked=12346)
    await settle(h)
    assert await h.runtime.retractions.retract_due() == 0 and fake.edits == []
    assert [a.answer_id for a in h.engine.storage.quotes.due()] == [4343]
