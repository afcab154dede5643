"""A nickname stays in the server it was given in (issue 30, item 1), through the cogs.

Alice and Bob are members of two guilds with a different nickname in each.  Their
messages arrive as gateway payloads, commands as interaction payloads, the chat
model is the OpenAI-compatible stand-in on 127.0.0.1, and the database is a real
SQLite file or a real PostgreSQL database (``db_location``: every test runs on both).
"""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator

import discord
import pytest

from memory.config import LLMConfig, Profile
from memory.engine import MemoryEngine
from tests.support.builders import HashEmbedder
from tests.support.discord_harness import BOT_ID, READ, Harness, channel, guild, member, role, user
from tests.support.engines import inspect
from tests.support.openai_standin import OpenAIStandIn

HOME, HOME_CHANNEL, AWAY, AWAY_CHANNEL = 970, 971, 980, 981
ALICE, BOB, CAROL = 1401, 1402, 1403
SECRET = "Zephyrine"  # Alice's nickname in HOME only


def servers() -> list[dict]:
    """HOME and AWAY; Alice is not in AWAY's member cache (a large guild's usual case),
    so what the bot shows there is the name it stored."""
    return [
        guild(HOME, "Home", owner=CAROL, roles=[role(HOME, "@everyone", READ, position=0)],
              members=[member(ALICE, "alice", nick=SECRET), member(BOB, "bob", nick="Robert"),
                       member(CAROL, "carol")],
              channels=[channel(HOME_CHANNEL, HOME, "general")]),
        guild(AWAY, "Away", owner=CAROL, roles=[role(AWAY, "@everyone", READ, position=0)],
              members=[member(BOB, "bob", nick="Bobby"), member(CAROL, "carol")],
              channels=[channel(AWAY_CHANNEL, AWAY, "general")]),
    ]


@pytest.fixture(scope="module")
def standin() -> object:
    with OpenAIStandIn() as server:
        yield server


@pytest.fixture
async def h(db_location: str, standin: OpenAIStandIn) -> AsyncIterator[Harness]:
    llm = LLMConfig(base_url=standin.base_url("ok"), model="m", timeout_s=5.0)
    engine = MemoryEngine(db_location, Profile(name="test", llm=llm), HashEmbedder(),
                          load_reranker=False)
    harness = Harness(engine, servers())
    await harness.start()
    yield harness
    await harness.close()
    engine.close()


async def say(h: Harness, text: str, who: tuple[int, str], nick: str, where: int) -> discord.Message:
    """MESSAGE_CREATE with the author's member data (their nickname in that guild)."""
    message = h.message(text, author=who, channel=where, nick=nick)
    await h.dispatch("message", message)
    return message


async def settle(h: Harness) -> None:
    await h.runtime.writes.stop()
    h.runtime.writes.start()
    await asyncio.to_thread(h.engine.embed_pending)


async def search_names(h: Harness, query: str) -> list[str]:
    """The author labels of a /search in AWAY, run by Carol."""
    await h.slash("search", invoker=member(CAROL, "carol"), where=AWAY_CHANNEL, query=query)
    return [field["name"] for field in h.adapter.followups[-1]["embeds"][0]["fields"]]


async def chat_prompt(h: Harness, standin: OpenAIStandIn, question: str) -> str:
    """The prompt the chat model gets for a mention in AWAY."""
    asked = h.message(f"<@{BOT_ID}> {question}", author=(CAROL, "carol"), channel=AWAY_CHANNEL,
                      mentions=[user(BOT_ID, "memorybot", bot=True)])
    await h.search.answer_mention(asked)
    return str(standin.requests[-1]["json"]["messages"][1]["content"])


async def test_a_member_is_named_in_each_guild_as_that_guild_knows_them(
    h: Harness, standin: OpenAIStandIn
) -> None:
    await say(h, "the ferry leaves at noon from pier four", (ALICE, "alice"), "Ally", AWAY_CHANNEL)
    await say(h, "bring the spare oars for the ferry", (ALICE, "alice"), SECRET, HOME_CHANNEL)
    await settle(h)
    assert h.guilds[1].get_member(ALICE) is None  # the label below is the stored name

    labels = await search_names(h, "ferry pier noon")
    assert labels and labels[0].endswith("Ally") and not any(SECRET in n for n in labels)
    prompt = await chat_prompt(h, standin, "when does the ferry leave from the pier?")
    assert "ferry leaves at noon" in prompt and "Ally" in prompt and SECRET not in prompt


async def test_forget_me_in_one_guild_removes_only_that_guilds_name(h: Harness) -> None:
    await say(h, "the ferry leaves at noon from pier four", (ALICE, "alice"), "Ally", AWAY_CHANNEL)
    await say(h, "bring the spare oars for the ferry", (ALICE, "alice"), SECRET, HOME_CHANNEL)
    await settle(h)
    await h.slash("memory forget-me", invoker=member(ALICE, "alice", nick=SECRET), where=HOME_CHANNEL)
    await settle(h)
    assert "Deleted 1 of your messages" in h.adapter.followups[-1]["content"]
    assert inspect(h.engine.storage).member_names(ALICE) == {AWAY: ("alice", "Ally")}
    assert (await search_names(h, "ferry pier noon"))[0].endswith("Ally")


async def test_leaving_a_guild_removes_the_names_given_there(h: Harness) -> None:
    await say(h, "the bikes are in the shed", (BOB, "bob"), "Robert", HOME_CHANNEL)
    await say(h, "the canoes are in the boathouse", (BOB, "bob"), "Bobby", AWAY_CHANNEL)
    await say(h, "the oars are in the van", (ALICE, "alice"), SECRET, HOME_CHANNEL)
    await settle(h)
    assert inspect(h.engine.storage).member_names(BOB) == {HOME: ("bob", "Robert"),
                                                           AWAY: ("bob", "Bobby")}
    h.state.parse_guild_delete({"id": str(HOME), "unavailable": False})  # the bot left HOME
    await asyncio.sleep(0)
    await settle(h)
    assert inspect(h.engine.storage).member_names(BOB) == {AWAY: ("bob", "Bobby")}
    assert inspect(h.engine.storage).member_names(ALICE) == {}
    assert inspect(h.engine.storage).author_rows(ALICE) == 0
