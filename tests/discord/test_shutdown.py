"""Shutdown is bounded: queued writes commit, embedding stops at its next chunk, nothing is lost."""

from __future__ import annotations

import asyncio
import signal
import subprocess
import sys
import threading
import time
from collections.abc import Sequence
from pathlib import Path

import discord
import numpy as np

from cogs.memory.capture import record_from_message
from memory.config import Profile
from memory.embedding import EMBED_CHUNK
from memory.engine import MemoryEngine
from tests.discord.test_bot_run import fake_api  # noqa: F401  (the stand-in for Discord's API)
from tests.support.builders import HashEmbedder, record_factory
from tests.support.discord_harness import READ, Harness, channel, guild, member, role

G, GENERAL, OWNER, ALICE = 100, 200, 10, 11
BACKLOG = 6000
CHUNK_S = 0.25  # per embedded chunk: the whole backlog takes ~6 s, one chunk a quarter second
CLOSE_BOUND_S = 2.0


class PacedEmbedder(HashEmbedder):
    """The hash embedder at a model's pace: each call takes ``CHUNK_S``."""

    def embed(self, texts: Sequence[str]) -> np.ndarray:
        time.sleep(CHUNK_S)
        return super().embed(texts)


def server() -> dict:
    return guild(G, "Test Guild", owner=OWNER, roles=[role(G, "@everyone", READ, position=0)],
                 members=[member(ALICE, "alice")], channels=[channel(GENERAL, G, "general")])


async def embedding_a_backlog(db: Path) -> Harness:
    """A running bot whose backlog of ``BACKLOG`` messages is embedding its first chunk."""
    embedder = PacedEmbedder()
    engine = MemoryEngine(db, Profile(name="test"), embedder, load_reranker=False)
    make = record_factory()
    engine.storage.messages.upsert(make(f"backlog message {i}", guild_id=G, channel_id=GENERAL)
                                   for i in range(BACKLOG))
    h = Harness(engine, [server()])
    await h.start()
    while embedder.calls < 1:
        await asyncio.sleep(0.01)
    return h


async def test_close_stops_embedding_at_the_next_chunk_and_loses_nothing(tmp_path):
    db = tmp_path / "bot.sqlite3"
    h = await embedding_a_backlog(db)
    queued = [h.message(f"sent just before shutdown {i}", author=(ALICE, "alice"),
                        channel=GENERAL) for i in range(300)]
    for message in queued:
        h.runtime.writes.put(h.engine.storage.messages.upsert, [record_from_message(message)])

    started = time.perf_counter()
    await h.bot.close()  # what Ctrl-C / SIGTERM run: the cogs unload, the runtime stops, the engine closes
    took = time.perf_counter() - started

    assert took < CLOSE_BOUND_S, f"close took {took:.1f} s"
    reopened = MemoryEngine(db, Profile(name="test"), HashEmbedder(), load_reranker=False)
    try:
        assert set(reopened.storage.messages.hydrate([m.id for m in queued])) == {m.id for m in queued}
        pending = reopened.storage.backlog.pending_count()
        assert pending >= BACKLOG + len(queued) - 3 * EMBED_CHUNK  # at most a chunk or two done
        assert reopened.embed_pending() == pending
        assert reopened.storage.backlog.pending_count() == 0
    finally:
        reopened.close()


async def test_leaving_the_bot_while_a_signal_closes_it_waits_for_the_whole_close(tmp_path):
    # A SIGTERM during a reconnect: the signal's close() begins, start() returns, and
    # ``async with bot`` is left while the cogs are still stopping.
    db = tmp_path / "bot.sqlite3"
    h = await embedding_a_backlog(db)
    async with h.bot:
        closing = asyncio.ensure_future(h.bot.close())  # what the signal handler starts
        while not h.bot.is_closed():  # hung up: the connection is closed, the cogs stopping
            await asyncio.sleep(0)
    assert closing.done(), "the context was left before the cogs and the engine closed"
    reopened = MemoryEngine(db, Profile(name="test"), HashEmbedder(), load_reranker=False)
    try:
        assert BACKLOG - 3 * EMBED_CHUNK <= reopened.storage.backlog.pending_count() < BACKLOG
    finally:
        reopened.close()


async def test_close_does_not_wait_on_the_event_loop_for_work_still_running(tmp_path):
    """A rerank still running at close (or an embedding chunk behind another process's
    lock) held the event loop: the pools were shut with wait=True on it.  The close now
    waits off the loop, a second at most; the engine closes off the loop too, and a new
    chat client is made off it."""
    engine = MemoryEngine(tmp_path / "bot.sqlite3", Profile(name="test"), HashEmbedder(),
                          load_reranker=False)
    h = Harness(engine, [server()])
    await h.start()
    loop_thread = threading.current_thread()
    search_began, let_go = threading.Event(), threading.Event()
    safety = threading.Timer(30, let_go.set)  # the old code waits for it, on the loop
    safety.start()

    def slow_search() -> None:
        search_began.set()
        let_go.wait()

    searching = asyncio.ensure_future(h.runtime.searching(slow_search))
    while not search_began.is_set():
        await asyncio.sleep(0.01)
    closed_on: list[threading.Thread] = []
    real_close = engine.close
    engine.close = lambda: (closed_on.append(threading.current_thread()), real_close())[1]
    try:
        await h.bot.close()
        assert not let_go.is_set(), "the close waited for the search"
        assert closed_on and closed_on[0] is not loop_thread
    finally:
        let_go.set()
        safety.cancel()
        searching.cancel()


async def test_a_new_chat_model_is_made_off_the_event_loop(tmp_path, monkeypatch):
    engine = MemoryEngine(tmp_path / "bot.sqlite3", Profile(name="test"), HashEmbedder(),
                          load_reranker=False)
    h = Harness(engine, [server()])
    await h.start()
    made_on: list[threading.Thread] = []
    # the module the running extension loaded (unloading an extension drops its modules)
    monkeypatch.setattr(sys.modules[type(h.runtime).__module__], "make_chat_client",
                        lambda profile: made_on.append(threading.current_thread()))
    try:
        await h.runtime.reload_chat()
        assert made_on and made_on[0] is not threading.current_thread()
    finally:
        await h.bot.close()


SIGTERM_SCRIPT = """
import sys, time
import discord, yarl
from memory.config import Profile
from memory.engine import MemoryEngine
from tests.support.builders import record_factory
from tests.discord.test_shutdown import PacedEmbedder
from cli.run import run_bot

base, gateway, db = sys.argv[1:4]
discord.http.Route.BASE = base
discord.gateway.DiscordWebSocket.DEFAULT_GATEWAY = yarl.URL(gateway)


class Announcing(PacedEmbedder):
    def embed(self, texts):
        if len(texts) > 1:
            print("embedding", flush=True)
        return super().embed(texts)


engine = MemoryEngine(db, Profile(name="test"), Announcing(), load_reranker=False)
make = record_factory()
engine.storage.messages.upsert(make(f"backlog message {i}") for i in range(int(sys.argv[4])))
sys.exit(run_bot(engine, "good-token"))
"""


def test_sigterm_to_a_running_bot_exits_within_the_bound_and_keeps_the_backlog(
    fake_api, tmp_path  # noqa: F811  (the fixture imported above)
):
    fake_api.gateway_close_code = None  # the gateway hangs up; the bot keeps reconnecting
    db = tmp_path / "bot.sqlite3"
    root = Path(__file__).resolve().parents[2]
    process = subprocess.Popen(
        [sys.executable, "-c", SIGTERM_SCRIPT, discord.http.Route.BASE,
         str(discord.gateway.DiscordWebSocket.DEFAULT_GATEWAY), str(db), str(BACKLOG)],
        cwd=root, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    try:
        assert process.stdout is not None
        assert process.stdout.readline().strip() == "embedding", process.stderr.read()
        started = time.perf_counter()
        process.send_signal(signal.SIGTERM)
        code = process.wait(timeout=60)
        took = time.perf_counter() - started
    finally:
        if process.poll() is None:
            process.kill()
    assert code == 0, process.stderr.read() if process.stderr else ""
    assert took < 5.0, f"exit took {took:.1f} s after SIGTERM"
    reopened = MemoryEngine(db, Profile(name="test"), HashEmbedder(), load_reranker=False)
    try:
        pending = reopened.storage.backlog.pending_count()
        assert BACKLOG - 3 * EMBED_CHUNK <= pending < BACKLOG
        assert reopened.embed_pending() == pending
    finally:
        reopened.close()
