"""Shutdown is bounded: queued writes commit, embedding stops at its next chunk, nothing is lost."""

from __future__ import annotations

import asyncio
import time
from collections.abc import Sequence

import numpy as np

from cogs.capture import record_from_message
from memory.config import Profile
from memory.engine import EMBED_CHUNK, MemoryEngine
from tests.conftest import HashEmbedder, record_factory
from tests.discord_harness import READ, Harness, channel, guild, member, role

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


async def test_close_stops_embedding_at_the_next_chunk_and_loses_nothing(tmp_path):
    db = tmp_path / "bot.sqlite3"
    embedder = PacedEmbedder()
    engine = MemoryEngine(db, Profile(name="test"), embedder, load_reranker=False)
    make = record_factory()
    engine.upsert(make(f"backlog message {i}", guild_id=G, channel_id=GENERAL)
                  for i in range(BACKLOG))
    h = Harness(engine, [server()])
    await h.start()
    while embedder.calls < 1:  # the backlog loop is embedding its first chunk
        await asyncio.sleep(0.01)
    queued = [h.message(f"sent just before shutdown {i}", author=(ALICE, "alice"),
                        channel=GENERAL) for i in range(300)]
    for message in queued:
        h.cog.writes.put("upsert", [record_from_message(message)])

    started = time.perf_counter()
    await h.bot.close()  # what Ctrl-C / SIGTERM run: the cog unloads, the engine closes
    took = time.perf_counter() - started

    assert took < CLOSE_BOUND_S, f"close took {took:.1f} s"
    reopened = MemoryEngine(db, Profile(name="test"), HashEmbedder(), load_reranker=False)
    try:
        assert set(reopened.store.hydrate([m.id for m in queued])) == {m.id for m in queued}
        pending = reopened.store.pending_count()
        assert pending >= BACKLOG + len(queued) - 3 * EMBED_CHUNK  # at most a chunk or two done
        assert reopened.embed_pending() == pending
        assert reopened.store.pending_count() == 0
    finally:
        reopened.close()
