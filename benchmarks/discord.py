"""``bench discord``: what the bot costs its event loop and its members, without Discord.

The bot runs for real — :class:`cogs.memory.MemoryBot`, the memory cogs, their worker
threads — on a server built from gateway payloads (:mod:`benchmarks.gateway`).
Measured in one run, side by side:

* the permission allow-lists for a member of a large server (channels, active and
  archived threads);
* the event loop's worst stall while the runtime embeds a backlog, with the model
  loaded lazily (the first pass loads it) and preloaded (what ``run`` does);
* the event loop's worst stall while an owner switches to a profile whose
  reranker loads in the background;
* how long a captured message takes to be committed, idle and while eight
  reranked searches run.

The reranker is a Qwen3-Reranker-shaped model with random weights and the real
Qwen vocabulary, saved to a temporary folder and loaded from it as a user's
downloaded model would be.
"""

from __future__ import annotations

import asyncio
import statistics
import tempfile
import time
from collections.abc import Awaitable, Callable
from dataclasses import replace
from pathlib import Path
from typing import Any, cast

import discord

from benchmarks.common import machine_description, percentile
from benchmarks.gateway import HIDE, READ, channel, guild, member, overwrite, role, thread, user
from benchmarks.scale import synthetic_records
from memory.config import Profile, RerankerConfig
from memory.engine import MemoryEngine
from memory.search import SearchRequest

GUILD = 7_000
MEMBER = 7_001
PROBE_S = 0.002  # the lag probe's sleep: its lateness is the loop's stall


def run_discord_bench(
    profile: Profile,
    *,
    channels: int = 400,
    threads: int = 100,
    backlog: int = 2000,
    searches: int = 8,
    captures: int = 40,
    reranker_shape: str = "0.6B",
    progress: Callable[[str], None] = lambda _: None,
) -> dict[str, Any]:
    """Run every measurement; returns a JSON-ready dict (see the module docstring)."""
    return asyncio.run(_run(profile, channels, threads, backlog, searches, captures,
                            reranker_shape, progress))


async def _run(profile: Profile, channels: int, threads: int, backlog: int, searches: int,
               captures: int, reranker_shape: str, progress: Callable[[str], None]) -> dict:
    result: dict[str, Any] = {"machine": machine_description(), "profile": profile.name}
    payload = _server(channels, threads)
    with tempfile.TemporaryDirectory(prefix="memory-discord-bench-") as tmp:
        progress("allow-lists")
        result["allow_list"] = await _allow_lists(Path(tmp), profile, payload)
        progress("embedding stall (lazy model load)")
        lazy = await _embedding_stall(Path(tmp) / "lazy.sqlite3", profile, payload, backlog,
                                      preload=False)
        progress("embedding stall (preloaded)")
        warm = await _embedding_stall(Path(tmp) / "warm.sqlite3", profile, payload, backlog,
                                      preload=True)
        result["embedding_stall"] = {"backlog": backlog, "lazy_load": lazy, "preloaded": warm}
        progress(f"building a {reranker_shape}-shaped reranker")
        folder = _save_reranker(Path(tmp) / "reranker", reranker_shape)
        reranking = replace(profile, name="bench-rerank", reranker=(
            profile.reranker if profile.reranker.enabled else RerankerConfig()).with_keys(
            backend="transformers", model=str(folder), device="cpu", dtype="float32",
            timeout=600.0))
        progress("reranker load stall and capture latency")
        result["reranker"] = await _rerank_and_capture(
            Path(tmp) / "capture.sqlite3", profile, reranking, payload, searches, captures)
        result["reranker"]["shape"] = reranker_shape
    return result


# -- a server that exists only in payloads ------------------------------------------------

def _server(channels: int, threads: int) -> dict:
    """A guild with 20 roles, ``channels`` channels (a third private), ``threads`` threads."""
    roles = [role(GUILD, "@everyone", READ, position=0)]
    roles += [role(GUILD + 1 + i, f"role {i}", discord.Permissions.none()) for i in range(20)]
    chans = []
    for i in range(channels):
        overwrites = [overwrite(GUILD + 1 + i % 20, allow=READ)]
        if i % 3 == 0:
            overwrites.append(overwrite(GUILD, deny=HIDE))
        chans.append(channel(10_000 + i, GUILD, f"channel-{i}", overwrites=overwrites))
    active = [thread(20_000 + i, GUILD, 10_000 + i, f"thread-{i}", owner=MEMBER,
                     private=i % 2 == 0) for i in range(threads)]
    return guild(GUILD, "Bench server", owner=1, roles=roles, channels=chans, threads=active,
                 members=[member(MEMBER, "member", roles=[GUILD + 1, GUILD + 2, GUILD + 3])])


async def _offline_bot(engine: MemoryEngine, payload: dict) -> tuple[Any, Any, discord.Guild]:
    """The real bot, its memory cogs and their runtime, Discord state filled from payloads,
    not connected; returns the bot, the runtime and the guild."""
    from cogs.memory import MemoryBot

    bot = MemoryBot(engine)
    state = bot._connection
    state.user = discord.ClientUser(state=state, data=cast(Any, user(1, "memorybot", bot=True)))
    bot.loop = asyncio.get_running_loop()
    server = state._add_guild_from_data(cast(Any, payload))
    await bot.load_extension("cogs.memory")
    return bot, cast(Any, bot.get_cog("MemoryCog")).runtime, server


def _member(server: discord.Guild, state: Any) -> discord.Member:
    return discord.Member(data=cast(Any, member(MEMBER, "member", roles=[GUILD + 1, GUILD + 2, GUILD + 3])),
                          guild=server, state=state)


def _messages(server: discord.Guild, state: Any, texts: list[str]) -> list[discord.Message]:
    general = server.get_channel(10_001)
    assert isinstance(general, discord.TextChannel)
    return [discord.Message(state=state, channel=general, data=cast(Any, data))
            for data in _message_payloads(texts)]


def _message_payloads(texts: list[str]) -> list[dict]:
    """MESSAGE_CREATE payloads from the member in channel 10001, one per text."""
    first = discord.utils.time_snowflake(discord.utils.utcnow())
    out: list[dict] = []
    for i, text in enumerate(texts):
        mid = first + (i << 22)
        out.append({
            "id": str(mid), "channel_id": "10001", "guild_id": str(GUILD),
            "author": user(MEMBER, "member"), "content": text,
            "member": {"roles": [], "joined_at": "2025-01-01T00:00:00+00:00", "deaf": False,
                       "mute": False, "flags": 0},
            "timestamp": discord.utils.snowflake_time(mid).isoformat(),
            "edited_timestamp": None, "tts": False, "mention_everyone": False, "mentions": [],
            "mention_roles": [], "attachments": [], "embeds": [], "pinned": False, "type": 0,
            "flags": 0})
    return out


# -- measurements -------------------------------------------------------------------------

async def _allow_lists(tmp: Path, profile: Profile, payload: dict) -> dict[str, Any]:
    from cogs.memory.permissions import StoredThread, public_reply_sources, readable_channel_ids

    engine = MemoryEngine(tmp / "allow.sqlite3", replace(profile, reranker=RerankerConfig()),
                          load_reranker=False)
    bot, _, server = await _offline_bot(engine, payload)
    try:
        stored = [StoredThread(30_000 + i, 10_000 + i, "public_thread") for i in range(200)]
        who = _member(server, bot._connection)
        reply_in = server.get_channel(10_001)
        assert reply_in is not None
        member_ms, public_ms = [], []
        for _ in range(200):
            started = time.perf_counter()
            readable = readable_channel_ids(who, stored)
            member_ms.append((time.perf_counter() - started) * 1000)
            started = time.perf_counter()
            public = public_reply_sources(reply_in, readable, stored)
            public_ms.append((time.perf_counter() - started) * 1000)
        return {
            "channels": len(server.channels), "active_threads": len(server.threads),
            "stored_threads": len(stored), "readable": len(readable), "public": len(public),
            "member_p50_ms": round(percentile(member_ms, 50), 3),
            "member_p95_ms": round(percentile(member_ms, 95), 3),
            "public_p50_ms": round(percentile(public_ms, 50), 3),
            "public_p95_ms": round(percentile(public_ms, 95), 3),
        }
    finally:
        await bot.close()


async def _stall_during(work: Awaitable[Any]) -> tuple[Any, dict[str, float]]:
    """Run ``work`` while a probe measures how late the event loop wakes it."""
    lags: list[float] = []
    done = asyncio.Event()

    async def probe() -> None:
        while not done.is_set():
            started = time.perf_counter()
            await asyncio.sleep(PROBE_S)
            lags.append((time.perf_counter() - started - PROBE_S) * 1000)

    prober = asyncio.create_task(probe())
    started = time.perf_counter()
    try:
        value = await work
    finally:
        done.set()
        await prober
    return value, {
        "seconds": round(time.perf_counter() - started, 2),
        "max_stall_ms": round(max(lags, default=0.0), 1),
        "p99_stall_ms": round(percentile(lags, 99), 1) if lags else 0.0,
        "stalls_over_50ms": sum(1 for lag in lags if lag > 50),
        "ticks": len(lags),
    }


async def _embedding_stall(db: Path, profile: Profile, payload: dict, backlog: int,
                           *, preload: bool) -> dict[str, Any]:
    engine = MemoryEngine(db, replace(profile, reranker=RerankerConfig()), load_reranker=False)
    if preload:
        engine.preload()
    engine.storage.messages.upsert(replace(r, guild_id=GUILD, channel_id=10_001)
                                   for r in synthetic_records(backlog))
    bot, runtime, _ = await _offline_bot(engine, payload)
    runtime.embed_backlog.cancel()  # driven by hand below, so the probe sees exactly one pass
    try:
        embedded, stall = await _stall_during(runtime.embed_pending())
        return {"embedded": embedded, **stall}
    finally:
        await bot.close()


def _save_reranker(folder: Path, shape: str) -> Path:
    import torch

    from benchmarks.qwen_models import QWEN3_RERANKER_06B, TINY_QWEN3, qwen_tokenizer, random_qwen3

    tokenizer = qwen_tokenizer()
    sizes = {"0.6B": QWEN3_RERANKER_06B, "tiny": TINY_QWEN3}
    model = random_qwen3(sizes[shape], vocab_size=len(tokenizer), dtype=torch.float32)
    model.save_pretrained(folder)
    tokenizer.save_pretrained(folder)
    return folder


async def _rerank_and_capture(db: Path, profile: Profile, reranking: Profile, payload: dict,
                              searches: int, captures: int) -> dict[str, Any]:
    engine = MemoryEngine(db, replace(profile, reranker=RerankerConfig()), load_reranker=False)
    engine.preload()
    engine.storage.messages.upsert(replace(r, guild_id=GUILD, channel_id=10_001 + r.id % 7)
                  for r in synthetic_records(3000))
    engine.embed_pending()
    bot, runtime, server = await _offline_bot(engine, payload)
    search = bot.get_cog("MemoryCog")
    state = bot._connection
    try:
        _, load = await _stall_during(asyncio.wrap_future(engine.switch_profile(reranking)))
        idle = await _capture_latencies(runtime, _messages(server, state, [
            f"idle capture {i}" for i in range(captures)]))
        who = _member(server, state)
        request = SearchRequest(queries=("printer filament settings",), limit=10)
        busy_searches = [asyncio.create_task(search.member_search(who, request))
                         for _ in range(searches)]
        await asyncio.sleep(0.05)
        busy, stall = await _stall_during(_capture_latencies(runtime, _messages(server, state, [
            f"busy capture {i}" for i in range(captures)])))
        started = time.perf_counter()
        results = await asyncio.gather(*busy_searches)
        reranked = sum(1 for r, _ in results if r.trace.reranked)
        return {
            "load": load,
            "captures": captures, "concurrent_searches": searches, "reranked": reranked,
            "searches_finished_s_after_captures": round(time.perf_counter() - started, 2),
            "capture_idle_ms": _summary(idle),
            "capture_during_searches_ms": _summary(busy),
            "loop_during_searches": stall,
        }
    finally:
        await bot.close()


async def _capture_latencies(runtime: Any, messages: list[discord.Message]) -> list[float]:
    """Per message: from the gateway event to the row being committed."""
    from cogs.memory.capture import record_from_message

    latencies = []
    for message in messages:
        started = time.perf_counter()  # what on_message does, then wait for the commit
        if await runtime.remembers(message):
            await runtime.writes.put_and_wait(runtime.engine.storage.messages.upsert,
                                          [record_from_message(message)])
        latencies.append((time.perf_counter() - started) * 1000)
        await asyncio.sleep(0.02)
    return latencies


def _summary(values: list[float]) -> dict[str, float]:
    return {"p50": round(statistics.median(values), 1), "p95": round(percentile(values, 95), 1),
            "max": round(max(values), 1)}
