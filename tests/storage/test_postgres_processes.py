"""Several processes writing, forgetting and embedding against one PostgreSQL at once.

Each worker process runs the storage engine the way a bot process does (issue 24
part 2 adds the gateway and the shard assignment on top): it stores batches of
messages (some of its ids are also stored by another worker), forgets messages
that other workers are storing at that very moment, and embeds the shared backlog
with claims.  Afterwards: no message is lost or duplicated, every deletion won,
no message was claimed by two embedders at once and every one has its vector,
and the keyword documents, windows and totals equal a rebuild from scratch.
"""

from __future__ import annotations

import hashlib
import itertools
import multiprocessing
import random
import time
from collections.abc import Callable

import numpy as np
import pytest

from memory.records import MessageRecord
from memory.storage.postgres import PostgresStorage, windows
from tests.support.builders import BASE_MS, GUILD, snowflake

pytestmark = [pytest.mark.postgres, pytest.mark.slow]

DIM = 16
PER_WORKER = 600
BATCH = 50


def message_id(worker: int, i: int) -> int:
    """Message ``i`` of a worker's slice; neighbouring workers' slices overlap by a third."""
    n = worker * (PER_WORKER * 2 // 3) + i
    return snowflake(BASE_MS + n * 1000, n % 4096)


def record(mid: int) -> MessageRecord:
    n = (mid >> 22) - (BASE_MS - 1420070400000)  # created_at offset in ms
    channel = 3000 + (mid % 3)
    return MessageRecord(
        id=mid, guild_id=GUILD + (mid % 2), channel_id=channel + (mid % 2) * 10, author_id=mid % 7,
        created_at=BASE_MS + n, content=f"talk about topic{mid % 97} and thing{mid % 13}, note {mid}",
        author_name=f"user{mid % 7}", guild_name="g", channel_name="c")


def vector(text: str) -> np.ndarray:
    seed = int.from_bytes(hashlib.blake2b(text.encode(), digest_size=4).digest(), "little")
    return np.random.default_rng(seed).normal(size=DIM).astype(np.float32)


def worker(url: str, index: int, workers: int, start: float) -> dict[str, list]:
    """Store this worker's slice, forget the next worker's victims, embed what is pending."""
    storage = PostgresStorage(url)
    storage.meta.model = "test/hash"
    rng = random.Random(index)
    mine = [message_id(index, i) for i in range(PER_WORKER)]
    rng.shuffle(mine)
    neighbour = (index + 1) % workers
    victims = [message_id(neighbour, i) for i in range(0, PER_WORKER, 7)]  # stored right now
    claimed: list[tuple[int, float, float]] = []
    time.sleep(max(0.0, start - time.time()))
    for n, chunk in enumerate(range(0, len(mine), BATCH)):
        storage.messages.upsert([record(m) for m in mine[chunk:chunk + BATCH]])
        storage.forgetting.forget_messages(victims[n::PER_WORKER // BATCH])
        claimed += _embed(storage, f"w{index}", limit=40)
    storage.forgetting.forget_messages(victims)  # and once more, after everything
    claimed += _embed(storage, f"w{index}-last", limit=1000)
    storage.close()
    return {"victims": victims, "claimed": claimed}


def _embed(storage: PostgresStorage, owner: str, *, limit: int) -> list[tuple[int, float, float]]:
    """Embed up to about ``limit`` messages; returns ``(id, claimed at, written at)`` of each."""
    storage.meta.bind_model("test/hash", DIM)
    done: list[tuple[int, float, float]] = []
    while len(done) < limit and (batch := storage.backlog.claim(20, owner=owner)):
        claimed = time.time()
        storage.backlog.write_vectors(batch, np.stack([vector(m.content) for m in batch]), owner=owner)
        written = time.time()
        done += [(m.id, claimed, written) for m in batch]
    storage.backlog.release(owner)
    return done


@pytest.mark.parametrize("workers", [2, 4])
def test_processes_share_one_memory(workers: int, postgres_url: Callable[..., str]) -> None:
    url = postgres_url()
    start = time.time() + 3.0
    with multiprocessing.get_context("spawn").Pool(workers) as pool:
        results = pool.starmap(worker, [(url, i, workers, start) for i in range(workers)])
    storage = PostgresStorage(url)
    storage.meta.model = "test/hash"
    try:
        _embed(storage, "final", limit=10**6)  # what a forget sent back to the backlog
        victims = {v for r in results for v in r["victims"]}
        written = {message_id(w, i) for w in range(workers) for i in range(PER_WORKER)}
        stored = set(storage.messages.hydrate(sorted(written)))
        assert stored == written - victims  # nothing lost, every deletion won
        assert storage.messages.count() == len(stored)
        assert storage.backlog.pending_count() == 0
        assert set(storage.vectors.floats(sorted(stored))) == stored
        # never two embedders on one message at once (a message is embedded again
        # later when the message before it is forgotten: its vector carried that text)
        spans: dict[int, list[tuple[float, float]]] = {}
        for r in results:
            for mid, claimed, written in r["claimed"]:
                spans.setdefault(mid, []).append((claimed, written))
        for mid, times in spans.items():
            times.sort()
            assert all(a[1] <= b[0] for a, b in itertools.pairwise(times)), mid
        _check_indexes(storage, stored)
    finally:
        storage.close()


def _check_indexes(storage: PostgresStorage, stored: set[int]) -> None:
    """The windows, keyword documents and totals equal a rebuild from the stored rows."""
    read = storage.database.read
    before = read("SELECT id, context, context_ids, contentful FROM search_text ORDER BY id")
    documents = read("SELECT id, term, tf, length FROM window_postings ORDER BY id, term")
    stats = read("SELECT sum(documents), sum(message_tokens), sum(window_tokens), sum(vectors) "
                 "FROM index_stats")
    recount = read("SELECT (SELECT count(*) FROM keyword_messages), "
                   "(SELECT sum(length) FROM keyword_messages), "
                   "(SELECT sum(length) FROM keyword_windows), (SELECT count(*) FROM message_vectors)")
    assert [int(v) for v in stats[0]] == [int(v) for v in recount[0]]
    assert {row[0] for row in before} == stored
    places = read("SELECT channel_id, id FROM messages")
    with storage.database.write() as conn:
        conn.execute("DELETE FROM search_text")  # rebuilt from the messages alone
        windows.reindex(conn, places)
    assert read("SELECT id, context, context_ids, contentful FROM search_text ORDER BY id") == before
    assert read("SELECT id, term, tf, length FROM window_postings ORDER BY id, term") == documents
