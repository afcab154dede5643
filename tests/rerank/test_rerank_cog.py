"""The new rerankers through the cog: the owner's profile switch, /search, mention
answers and /memory privacy, with real discord.py objects and real HTTP servers.

The rerank API and the judge's chat model are scripted servers on 127.0.0.1
(tests/support/http_stub.py); the cog, the engine and the SQLite file are real.
"""

from __future__ import annotations

import asyncio
import json
from pathlib import Path

import discord
import pytest

from cogs.memory.capture import record_from_message
from memory.config import (
    LlamaServerConfig,
    LLMConfig,
    Profile,
    RerankApiConfig,
    RerankerConfig,
)
from memory.engine import MemoryEngine
from tests.support.builders import HashEmbedder
from tests.support.discord_harness import BOT_ID, READ, Harness, channel, guild, member, role, user
from tests.support.http_stub import Request, StubServer

G, GENERAL = 900, 901
ALICE, BOB, OWNER = 1001, 1002, 1003


def server() -> dict:
    return guild(G, "Test Guild", owner=OWNER, roles=[role(G, "@everyone", READ, position=0)],
                 members=[member(ALICE, "alice"), member(BOB, "bob")],
                 channels=[channel(GENERAL, G, "general")])


@pytest.fixture
async def harness(tmp_path):
    engine = MemoryEngine(tmp_path / "bot.sqlite3", Profile(name="test"), HashEmbedder(),
                          load_reranker=False)
    h = Harness(engine, [server()], owner_ids=[OWNER])
    await h.start()
    messages = [h.message(text, author=(BOB, "bob"), channel=GENERAL) for text in (
        "the raid moved to 9pm on saturday", "the raid needs two healers", "lunch was great")]
    engine.ingest([record_from_message(m) for m in messages])
    await asyncio.to_thread(engine.embed_pending)
    yield h
    await h.close()
    engine.close()


def rerank_answer(request: Request):
    """Infinity's documented shape: the document mentioning '9pm' scores highest."""
    results = [{"index": i, "relevance_score": 0.9 if "9pm" in d else 0.1, "document": None}
               for i, d in enumerate(request.body["documents"])]
    return 200, {"object": "rerank", "results": results, "model": "m",
                 "usage": {"total_tokens": 1}}, {}


async def switch(h: Harness, profile: Path) -> str:
    await h.slash("memory-owner profile", invoker=member(OWNER, "owner"), where=GENERAL,
                  permissions=discord.Permissions.all(), name=str(profile))
    return h.adapter.followups[-1]["content"]


async def test_a_rerank_api_profile_switch_reranks_search_and_names_the_host(harness, tmp_path):
    h = harness
    with StubServer(rerank_answer) as api:
        profile = tmp_path / "hosted.toml"
        profile.write_text(f'[reranker]\nbackend = "rerank-api"\ndialect = "infinity"\n'
                           f'url = "{api.url}"\nmodel = "m"\n', "utf-8")
        assert "hosted.toml**" in await switch(h, profile)
        await h.slash("search", invoker=member(ALICE, "alice"), where=GENERAL, query="raid time")
        embed = h.adapter.followups[-1]["embeds"][0]
        assert len(api.requests) == 1 and "raid" in api.requests[0].body["query"]
        # the reranker put the 9pm message first, above the other raid message
        rendered = json.dumps(embed)
        assert rendered.index("9pm") < rendered.index("two healers")
        await h.slash("memory privacy", invoker=member(BOB, "bob"), where=GENERAL)
        text = h.adapter.followups[-1]["content"]  # the servers follow the notice
    assert "`rerank-api` at `127.0.0.1`" in text and "candidate messages are sent" in text


async def test_a_local_profile_names_no_reranker_host(harness):
    await harness.slash("memory privacy", invoker=member(BOB, "bob"), where=GENERAL)
    assert "reranked by a remote service" not in harness.adapter.callbacks[-1]["data"]["content"]


async def test_the_llm_judge_profile_reranks_the_context_of_mention_answers(harness, tmp_path):
    h = harness
    judged: list[str] = []

    def judge(request: Request):
        user_turn = request.body["messages"][1]["content"]
        judged.append(user_turn)
        score = 9 if "9pm" in user_turn else 1
        return 200, {"choices": [{"message": {"content": json.dumps({"score": score})},
                                  "finish_reason": "stop"}],
                     "model": "m", "usage": {"total_tokens": 5}}, {}

    with StubServer(judge) as llm:
        profile = tmp_path / "judge.toml"
        profile.write_text(
            '[reranker]\nbackend = "llm"\nblend = true\nparallel = 2\n'
            f'[llm]\nbase_url = "{llm.url}"\nmodel = "m"\nstream = false\n', "utf-8")
        assert "judge.toml**" in await switch(h, profile)
        question = h.message(f"<@{BOT_ID}> when is the raid?", author=(ALICE, "alice"),
                             channel=GENERAL, mentions=[user(BOT_ID, "memorybot", bot=True)])
        context = await h.search.context_for(question)
    assert context.trace.reranked and context.trace.rerank_backend == "llm"
    assert judged and all("Message (untrusted):" in j for j in judged)
    assert all(r.body["response_format"]["type"] == "json_schema" for r in llm.requests)
    assert "9pm" in context.text


# -- /memory privacy names every server the profile sends text to (issue 30.6) --------------

HOSTED_LLM = LLMConfig(base_url="https://api.llm.example/v1", model="judge-8b")


@pytest.mark.parametrize(("reranker", "llm", "named"), [
    pytest.param(RerankerConfig(backend="llama-server",
                                llama_server=LlamaServerConfig(url="http://gpu-box.example:8080")),
                 LLMConfig(), "remote service (`llama-server` at `gpu-box.example`)",
                 id="llama-server"),
    pytest.param(RerankerConfig(backend="llama-server",
                                llama_server=LlamaServerConfig(url="http://127.0.0.1:8080")),
                 LLMConfig(), "remote service (`llama-server` at `127.0.0.1`)",
                 id="llama-server-here"),
    pytest.param(RerankerConfig(backend="rerank-api", rerank_api=RerankApiConfig(
                     url="https://rerank.example/v1/rerank", model="m")), LLMConfig(),
                 "remote service (`rerank-api` at `rerank.example`)", id="rerank-api"),
    pytest.param(RerankerConfig(backend="llm"), HOSTED_LLM,
                 "chat model judging relevance (`judge-8b` at `api.llm.example`)", id="llm-judge"),
])
async def test_the_privacy_notice_names_every_server_that_receives_text(
        tmp_path, reranker, llm, named):
    """The reranker's server and what it receives; the chat model's too; and that
    forgetting cannot reach a hosted copy.  Nothing is loaded or sent for it."""
    engine = MemoryEngine(tmp_path / "bot.sqlite3", Profile(name="p", reranker=reranker, llm=llm),
                          HashEmbedder(), load_reranker=False)
    h = Harness(engine, [server()])
    await h.start()
    try:
        await h.slash("memory privacy", invoker=member(BOB, "bob"), where=GENERAL)
        notice = h.adapter.callbacks[-1]["data"]["content"]
        text = h.adapter.followups[-1]["content"]  # the servers follow the notice
    finally:
        await h.close()
        engine.close()
    assert f"Searches are reranked by a {named}" in text
    assert "question and its candidate messages are sent to it, with their authors' names" in text
    assert "cannot reach what such a service has already kept" in text
    answers = "Mention answers are written by a chat model (`judge-8b` at `api.llm.example`)"
    assert (answers in text) == bool(llm.base_url)
    assert max(len(notice), len(text)) <= 2000  # each one Discord message


async def test_a_local_profile_sends_nothing_away(harness):
    await harness.slash("memory privacy", invoker=member(BOB, "bob"), where=GENERAL)
    text = harness.adapter.callbacks[-1]["data"]["content"]
    assert "Servers that receive message text" not in text and "at `" not in text
    assert not harness.adapter.followups
