"""``bench stalls``: how long the bot's event loop waits, and how long it takes to stop.

The real bot and memory cogs (:mod:`benchmarks.discord`'s offline bot, its Discord state
built from gateway payloads), a real SQLite database and the profile's embedder,
preloaded as ``run`` does.  A probe task on the loop sleeps a few milliseconds and
records how late it wakes; the worst lateness is the stall.  Measured:

* the first embed pass of a backlog (what a start after an import does);
* a burst of messages delivered in one tick, until they are stored and embedded;
* a runtime profile switch to a Qwen3-shaped reranker saved to a folder;
* switching to and from every reranker backend (issue 30, item 5): from no reranker to
  each backend, from each back to none, and between the two in-process models, each
  switch measured until the old backend is unloaded (``switch_matrix``);
* a member's allow-list and a public reply's over 20,000 stored threads (``allow_lists``:
  the stored threads are read and indexed on a worker thread, the cache judged on the loop);
* ``bot.close()`` (what Ctrl-C and SIGTERM run) while a backlog is being embedded;
* ``bot.close()`` in the tick after live messages arrived, the guild settings not cached
  yet, over a backlog being embedded (issue 30, item 4): how many were stored, marked
  for the next start's catch-up, or lost (``in_flight_shutdown``).
"""

from __future__ import annotations

import asyncio
import tempfile
import time
from collections.abc import Callable
from dataclasses import replace
from pathlib import Path
from typing import Any, cast

from benchmarks.common import machine_description
from benchmarks.discord import (
    GUILD,
    _message_payloads,
    _offline_bot,
    _save_reranker,
    _server,
    _stall_during,
)
from benchmarks.scale import synthetic_records
from memory.config import (
    CrossEncoderConfig,
    LlamaServerConfig,
    Profile,
    RerankApiConfig,
    RerankerConfig,
)
from memory.engine import MemoryEngine
from memory.records import MessageRecord


def run_stalls_bench(
    profile: Profile,
    *,
    backlog: int = 3000,
    burst: int = 300,
    shutdown: tuple[int, ...] = (1500, 6000),
    reranker_shape: str = "tiny",
    progress: Callable[[str], None] = lambda _: None,
) -> dict[str, Any]:
    """Run every measurement; returns a JSON-ready dict (see the module docstring)."""
    return asyncio.run(_run(profile, backlog, burst, shutdown, reranker_shape, progress))


async def _run(profile: Profile, backlog: int, burst: int, shutdown: tuple[int, ...],
               reranker_shape: str, progress: Callable[[str], None]) -> dict[str, Any]:
    result: dict[str, Any] = {"machine": machine_description(), "profile": profile.name}
    payload = _server(20, 0)
    plain = replace(profile, reranker=RerankerConfig())
    with tempfile.TemporaryDirectory(prefix="memory-stalls-bench-") as tmp:
        root = Path(tmp)
        progress(f"first embed pass of {backlog} messages")
        result["first_embed_pass"] = await _embed_pass(root / "pass.sqlite3", plain, payload,
                                                       backlog)
        progress(f"{burst} messages in one tick")
        result["burst"] = await _burst(root / "burst.sqlite3", plain, payload, burst)
        progress("allow-lists over 20,000 stored threads")
        result["allow_lists"] = await _allow_lists(root / "allow.sqlite3", plain)
        progress(f"building a {reranker_shape}-shaped reranker")
        folder = _save_reranker(root / "reranker", reranker_shape)
        reranking = replace(profile, name="bench-rerank", reranker=(
            profile.reranker if profile.reranker.enabled else RerankerConfig()).with_keys(
            backend="transformers", model=str(folder), device="cpu", dtype="float32",
            timeout=600.0))
        progress("profile switch")
        result["profile_switch"] = await _switch(root / "switch.sqlite3", plain, reranking,
                                                 payload)
        result["profile_switch"]["shape"] = reranker_shape
        progress("switching to and from every reranker backend")
        result["switch_matrix"] = await _switch_matrix(root, plain, reranking, payload)
        result["shutdown"] = []
        for size in shutdown:
            progress(f"shutdown with a {size}-message backlog")
            result["shutdown"].append(await _shutdown(root / f"stop-{size}.sqlite3", plain,
                                                      payload, size))
        progress(f"shutdown with {burst} live messages in flight over a backlog")
        result["in_flight_shutdown"] = await _in_flight_shutdown(
            root / "in-flight.sqlite3", plain, payload, shutdown[0], burst)
    return result


def _engine(db: Path, profile: Profile, backlog: int) -> MemoryEngine:
    engine = MemoryEngine(db, profile, load_reranker=False)
    engine.preload()
    engine.storage.messages.upsert(replace(r, guild_id=GUILD, channel_id=10_001)
                  for r in synthetic_records(backlog))
    return engine


async def _embed_pass(db: Path, profile: Profile, payload: dict, backlog: int) -> dict:
    engine = _engine(db, profile, backlog)
    bot, runtime, _ = await _offline_bot(engine, payload)
    runtime.embed_backlog.cancel()  # one pass, driven by hand, as the loop would run it
    try:
        embedded, stall = await _stall_during(runtime.embed_pending())
        return {"messages": embedded, **stall}
    finally:
        await bot.close()


async def _burst(db: Path, profile: Profile, payload: dict, count: int) -> dict:
    """``count`` MESSAGE_CREATEs dispatched in one tick, until stored and embedded."""
    engine = _engine(db, profile, 0)
    bot, runtime, _ = await _offline_bot(engine, payload)
    runtime.embed_backlog.cancel()
    state = bot._connection
    # the gateway's payloads, parsed on the loop as discord.py does on MESSAGE_CREATE
    payloads = _message_payloads([
        f"burst message {i} about the printer and its filament" for i in range(count)])
    await runtime.guild_settings.get(GUILD)  # as on a running bot, the guild's settings are cached

    async def deliver() -> int:
        for data in payloads:
            state.parse_message_create(data)
        await asyncio.sleep(0)  # the listeners run
        await runtime.writes.run_and_wait(lambda: None)  # every upsert before it is committed
        return await runtime.embed_pending()

    try:
        embedded, stall = await _stall_during(deliver())
        return {"messages": count, "embedded": embedded, **stall}
    finally:
        await bot.close()


async def _switch(db: Path, profile: Profile, reranking: Profile, payload: dict) -> dict:
    engine = _engine(db, profile, 0)
    bot, _, _ = await _offline_bot(engine, payload)
    try:
        _, stall = await _stall_during(asyncio.wrap_future(engine.switch_profile(reranking)))
        return stall
    finally:
        await bot.close()


async def _allow_lists(db: Path, profile: Profile, threads: int = 20_000,
                       channels: int = 60) -> dict:
    """The stall of ``allowed_channels`` (a member's own, and a public reply's in a channel)
    with ``threads`` stored threads under ``channels`` channels, half of them private."""
    from benchmarks.discord import _member

    engine = _engine(db, profile, 0)
    engine.storage.messages.upsert(MessageRecord(
        id=1_300_000_000_000_000_000 + i, guild_id=GUILD, channel_id=40_000 + i, author_id=5,
        created_at=1_700_000_000_000 + i, content="a thread", channel_name=f"thread-{i}",
        channel_type="public_thread" if i % 2 else "private_thread",
        parent_id=10_000 + i % channels) for i in range(threads))
    bot, _, server = await _offline_bot(engine, _server(channels, 50))
    search = cast(Any, bot.get_cog("MemoryCog"))
    who = _member(server, bot._connection)
    rows: dict[str, Any] = {"stored_threads": threads, "channels": channels}
    try:
        for name, reply_in in (("member", None), ("public_reply", server.get_channel(10_001))):
            stalls = []
            for _ in range(5):
                ids, stall = await _stall_during(search.allowed_channels(who, reply_in))
                stalls.append(stall["max_stall_ms"])
            rows[name] = {"ids": len(ids), "max_stall_ms": stalls}
        return rows
    finally:
        await bot.close()


async def _shutdown(db: Path, profile: Profile, payload: dict, backlog: int) -> dict:
    """``bot.close()`` one second into embedding a backlog; what stayed pending."""
    engine = _engine(db, profile, backlog)
    path = engine.storage.database.location
    bot, _, _ = await _offline_bot(engine, payload)  # the runtime's loop starts embedding
    await asyncio.sleep(1.0)
    started = time.perf_counter()
    await bot.close()
    seconds = time.perf_counter() - started
    reopened = MemoryEngine(path, profile, load_reranker=False)
    try:
        pending = reopened.storage.backlog.pending_count()
    finally:
        reopened.close()
    return {"backlog": backlog, "close_s": round(seconds, 2), "left_pending": pending}


# -- switching to and from every backend (issue 30, item 5) ---------------------------------

def _backend_profiles(root: Path, plain: Profile, qwen: Profile) -> dict[str, Profile]:
    """A profile per reranker backend, none of which needs a download or a server to load.

    The remote backends (``rerank-api``, ``llm``, ``llama-server``) open a connection
    pool at load and send nothing, so they point at a port nothing listens on.
    """
    from benchmarks.rerank_backends import save_minilm_cross_encoder

    cross = save_minilm_cross_encoder(root / "cross-encoder")
    nowhere = "http://127.0.0.1:9"
    return {
        "none": plain,
        "transformers": qwen,
        "cross-encoder": replace(plain, name="bench-cross-encoder", reranker=RerankerConfig(
            backend="cross-encoder", cross_encoder=CrossEncoderConfig(model=str(cross)))),
        "rerank-api": replace(plain, name="bench-rerank-api", reranker=RerankerConfig(
            backend="rerank-api", rerank_api=RerankApiConfig(url=nowhere, model="bench"))),
        "llm": replace(plain, name="bench-llm", reranker=RerankerConfig(backend="llm"),
                       llm=replace(plain.llm, base_url=nowhere, model="bench")),
        "llama-server": replace(plain, name="bench-llama-server", reranker=RerankerConfig(
            backend="llama-server", llama_server=LlamaServerConfig(url=nowhere))),
    }


def _switch_pairs(backends: list[str]) -> list[tuple[str, str]]:
    """From none to each backend and back, then between the two in-process models."""
    pairs: list[tuple[str, str]] = []
    for name in backends:
        if name != "none":
            pairs += [("none", name), (name, "none")]
    return [*pairs, ("transformers", "cross-encoder"), ("cross-encoder", "transformers")]


async def _switch_matrix(root: Path, plain: Profile, qwen: Profile, payload: dict) -> list[dict]:
    """Each switch: the stall from the command until the old backend is unloaded."""
    profiles = _backend_profiles(root, plain, qwen)
    engine = _engine(root / "matrix.sqlite3", plain, 0)
    bot, _, _ = await _offline_bot(engine, payload)
    rows: list[dict] = []
    try:
        for old, new in _switch_pairs(list(profiles)):
            rows.append(await _one_switch(engine, profiles[old], profiles[new], old, new))
    finally:
        await bot.close()
    return rows


async def _one_switch(engine: MemoryEngine, old: Profile, new: Profile, old_name: str,
                      new_name: str) -> dict:
    row: dict[str, Any] = {"from": old_name, "to": new_name}
    try:
        if engine.profile.name != old.name:  # the starting point, loaded, not measured
            await asyncio.wrap_future(engine.switch_profile(old))
            await _unloaded(engine)
        await asyncio.to_thread(engine.rerankers.status)  # loaded, as a profile in use is

        async def switch() -> None:  # the switch, the new backend loaded, the old unloaded
            await asyncio.wrap_future(engine.switch_profile(new))
            await asyncio.to_thread(engine.rerankers.status)
            await _unloaded(engine)

        _, stall = await _stall_during(switch())
        row.update(stall)
    except Exception as exc:  # a backend that cannot load here: said, not fatal
        row["error"] = f"{type(exc).__name__}: {exc}"
    return row


async def _unloaded(engine: MemoryEngine) -> None:
    """Wait until the manager's switch thread (which unloads the old backend) ended."""
    import threading

    while any(t.name == "reranker-switch" for t in threading.enumerate()):
        await asyncio.sleep(0.005)


# -- live messages in flight at shutdown (issue 30, item 4) ----------------------------------

async def _in_flight_shutdown(db: Path, profile: Profile, payload: dict, backlog: int,
                              count: int) -> dict:
    """``count`` MESSAGE_CREATEs over a few ticks one second into embedding a backlog,
    the guild's settings never read yet, then ``bot.close()`` at once."""
    engine = _engine(db, profile, backlog)
    path = engine.storage.database.location
    bot, _, _ = await _offline_bot(engine, payload)
    state = bot._connection
    payloads = _message_payloads([f"live message {i} as the bot stops" for i in range(count)])
    await asyncio.sleep(1.0)
    for start in range(0, count, 20):  # a gateway delivers them a few per tick
        for data in payloads[start:start + 20]:
            state.parse_message_create(data)
        await asyncio.sleep(0)
    started = time.perf_counter()
    await bot.close()
    seconds = time.perf_counter() - started
    ids = [int(p["id"]) for p in payloads]
    reopened = MemoryEngine(path, profile, load_reranker=False)
    try:
        stored = len(reopened.storage.messages.hydrate(ids))
        marked = sum(len(v) for v in reopened.storage.guilds.missed().values())
    finally:
        reopened.close()
    return {"backlog": backlog, "messages": count, "close_s": round(seconds, 2),
            "stored": stored, "marked_for_catch_up": marked, "lost": count - stored - marked}
