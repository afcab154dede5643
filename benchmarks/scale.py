"""``bench search-scale``: search latency and import throughput on a synthetic corpus.

Every comparison is measured side by side in one run on one machine, because
timings on shared machines are noisy; ratios are what to read.
"""

from __future__ import annotations

import functools
import itertools
import logging
import random
import tempfile
import time
from collections.abc import Callable
from dataclasses import replace
from pathlib import Path
from typing import Any

import numpy as np

from benchmarks.common import machine_description, percentile, scratch_location
from benchmarks.retrieval import RETRIEVAL_MODES
from memory.config import DEFAULT_EMBEDDER, Profile
from memory.embedder import Embedder, SentenceTransformerEmbedder, resolve_model
from memory.engine import MemoryEngine
from memory.filters import Filters
from memory.records import MessageRecord
from memory.search import SearchRequest
from memory.storage.postgres.connection import is_postgres_url
from memory.storage.sqlite.connection import connect
from memory.text import STOPWORDS

log = logging.getLogger(__name__)

Progress = Callable[[int], None]

_OPENERS = ("anyone know", "I think", "just saw", "reminder:", "quick q:", "lol", "honestly",
            "update:", "so apparently", "can someone")
_VOCABULARY_SIZE = 20_000
SCALE_GUILD = 1000


@functools.cache
def _vocabulary() -> tuple[list[str], list[float]]:
    """Real English words with Zipf-Mandelbrot cumulative weights, most frequent first.

    The words come from the bundled MiniLM's WordPiece vocabulary, whose whole-word
    entries are listed roughly by corpus frequency; stopwords are left out (queries
    drop them too).  Weights ``1 / (rank + 50)`` give the flat head and long tail
    of real chat: the commonest word is in about 3 % of messages and a typical
    search word in well under 1 % (a 70-word vocabulary, used before, put every
    query word in 12 % of messages and made BM25 score half the corpus per query).
    """
    _, folder = resolve_model(DEFAULT_EMBEDDER)
    words = [
        w for w in (Path(folder) / "vocab.txt").read_text(encoding="utf-8").split()
        if w.isascii() and w.isalpha() and w.islower() and len(w) >= 3 and w not in STOPWORDS
    ][:_VOCABULARY_SIZE]
    return words, list(itertools.accumulate(1.0 / (rank + 50) for rank in range(len(words))))


def _words(rng: random.Random, count: int) -> list[str]:
    words, cum_weights = _vocabulary()
    return rng.choices(words, cum_weights=cum_weights, k=count)


def synthetic_records(n: int, seed: int = 0, guilds: int = 1) -> list[MessageRecord]:
    """Build ``n`` chat-like messages across a few channels and authors (deterministic)."""
    rng = random.Random(seed)
    base_ms = int(time.time() * 1000) - 365 * 86_400_000
    records = []
    for i in range(n):
        created = base_ms + i * (365 * 86_400_000 // max(n, 1))
        author = rng.randint(1, 40)
        records.append(
            MessageRecord(
                id=((created - 1420070400000) << 22) | (i & 0x3FFFFF),
                guild_id=SCALE_GUILD + i % guilds, channel_id=2000 + rng.randint(0, 7),
                author_id=author, created_at=created,
                content=f"{rng.choice(_OPENERS)} {' '.join(_words(rng, rng.randint(3, 14)))}",
                author_name=f"user{author}", author_display_name=f"User {author}",
                guild_name="Scale test", channel_name="general",
            )
        )
    return records


def run_search_scale(
    profile: Profile,
    messages: int,
    *,
    queries: int = 100,
    embedder: Embedder | None = None,
    progress: Progress | None = None,
    db_dir: str | Path | None = None,
    postgres: str | None = None,
) -> dict[str, Any]:
    """Build a synthetic corpus, then time import against the raw encoder and searches.

    Import (store, then embed the backlog) runs in slices of 5,000 messages; after
    storing each slice the bare encoder is timed on 500 of its texts (context
    included, exactly what import embeds), so both rates are measured under the
    same machine load.  Search latencies (query embedding included) for fixed,
    adaptive and hybrid are interleaved query by query so noise hits all alike.
    The database is a temporary SQLite file, or with ``postgres`` (a server URL) a
    throw-away database there.
    """
    records = synthetic_records(messages)
    with scratch_location(postgres, name="scale", db_dir=db_dir) as location:
        engine = MemoryEngine(location, profile, embedder, load_reranker=False)
        try:
            result = _measure(engine, records, queries, progress)
            if postgres:
                result["knn_by_index"] = _index_sweep(engine, queries)
        finally:
            engine.close()
    return {"engine": "postgres" if postgres else "sqlite", **result}


def run_search_scale_engines(
    profile: Profile, messages: int, postgres: str, *, queries: int = 100,
    progress: Progress | None = None,
) -> dict[str, Any]:
    """:func:`run_search_scale` on SQLite, then on PostgreSQL, in one run on one machine.

    Both get the same corpus and the same vectors: the second run takes them from
    the first's embedder cache, so its ``import_msgs_per_s`` has no encoder time in
    it (compare ``store_msgs_per_s`` and ``vectors_per_s``, which are storage only).
    """
    from benchmarks.retrieval import CachedEmbedder

    with tempfile.TemporaryDirectory(prefix="memory-scale-cache-") as tmp:
        cached = CachedEmbedder(SentenceTransformerEmbedder(profile.embedder),
                                Path(tmp) / "vectors.npz")
        sqlite = run_search_scale(profile, messages, queries=queries, embedder=cached,
                                  progress=progress)
        server = run_search_scale(profile, messages, queries=queries, embedder=cached,
                                  progress=progress, postgres=postgres)
    hybrid = server["search"]["hybrid"]["p50_ms"] / sqlite["search"]["hybrid"]["p50_ms"]
    return {"sqlite": sqlite, "postgres": server, "postgres_vs_sqlite_hybrid_p50": round(hybrid, 3)}


def _measure(engine: MemoryEngine, records: list[MessageRecord], queries: int,
             progress: Progress | None) -> dict[str, Any]:
    engine.embedder.embed(["warm up"] * 64)  # load the weights outside the timings
    store_s = embed_s = raw_s = 0.0
    raw_texts = 0
    for start in range(0, len(records), 5000):
        started = time.perf_counter()
        engine.storage.messages.upsert(records[start : start + 5000])
        store_s += time.perf_counter() - started
        sample = [engine.embedding_text(m) for m in engine.storage.backlog.pending(500)]
        raw_s += _encoder_seconds(engine, sample)
        raw_texts += len(sample)
        started = time.perf_counter()
        engine.embed_pending(progress=progress)
        embed_s += time.perf_counter() - started
    import_rate = len(records) / (store_s + embed_s)
    raw_rate = raw_texts / raw_s
    latencies = _time_searches(engine, queries)
    knn = _rescore_sweep(engine, queries)
    return {
        "machine": machine_description(),
        "messages": len(records),
        "queries": queries,
        "import_msgs_per_s": round(import_rate, 1),
        "store_msgs_per_s": round(len(records) / store_s, 1),
        "vectors_per_s": round(len(records) / embed_s, 1),
        "raw_encoder_msgs_per_s": round(raw_rate, 1),
        "import_vs_encoder": round(import_rate / raw_rate, 3),
        "search": {
            mode: {"p50_ms": round(percentile(v, 50), 2), "p95_ms": round(percentile(v, 95), 2)}
            for mode, v in latencies.items()
        },
        "adaptive_vs_fixed_p50": round(
            percentile(latencies["adaptive"], 50) / percentile(latencies["fixed"], 50), 3
        ),
        "allow_list_vs_hybrid_p50": round(
            percentile(latencies["hybrid_allow_list_500"], 50)
            / percentile(latencies["hybrid"], 50), 3
        ),
        "knn": knn,
    }


def _encoder_seconds(engine: MemoryEngine, texts: list[str]) -> float:
    """Seconds the bare encoder takes for ``texts``, in import's chunk size."""
    started = time.perf_counter()
    for start in range(0, len(texts), 256):
        engine.embedder.embed(texts[start : start + 256])
    return time.perf_counter() - started


def _time_searches(engine: MemoryEngine, count: int) -> dict[str, list[float]]:
    rng = random.Random(1)
    modes = {"fixed": RETRIEVAL_MODES["fixed"], "adaptive": RETRIEVAL_MODES["adaptive"],
             "hybrid": RETRIEVAL_MODES["hybrid"],
             # a member of a 500-channel server who can read 7 of the 8 busy channels
             "hybrid_allow_list_500": {**RETRIEVAL_MODES["hybrid"],
                                       "allowed_channel_ids": ALLOW_LIST_500}}
    latencies: dict[str, list[float]] = {m: [] for m in modes}
    engine.search("warm up", guild_id=SCALE_GUILD)
    order = list(modes.items())
    for i in range(count):
        text = " ".join(_words(rng, rng.randint(2, 6)))
        # the first mode to run a text finds colder caches: take turns at going first
        turn = i % len(order)
        for mode, fields in order[turn:] + order[:turn]:
            request = replace(SearchRequest(queries=(text,), guild_id=SCALE_GUILD), **fields)
            started = time.perf_counter()
            engine.search(request)
            latencies[mode].append((time.perf_counter() - started) * 1000)
    return latencies


# 7 of the synthetic corpus's 8 channels plus 493 channels with no messages
ALLOW_LIST_500 = tuple(range(2000, 2007)) + tuple(range(50_000, 50_493))

RESCORE_SWEEP = (1, 2, 4, 8, 16)


def _every_vector(engine: MemoryEngine) -> tuple[np.ndarray, np.ndarray]:
    """Every stored message id and float32 vector, read from the database itself.

    A measurement, not a storage read: the exact cosine baseline needs every vector,
    which no storage method lists; its own connection leaves the engine's alone.
    """
    location = engine.storage.database.location
    if is_postgres_url(location):
        from memory.storage.postgres.connection import connect as connect_postgres
        from memory.storage.postgres.vectors import vector_array

        server = connect_postgres(engine.storage.database.url)  # type: ignore[attr-defined]
        try:
            from pgvector.psycopg import register_vector

            register_vector(server)
            rows = [(mid, vector_array(v)) for mid, v in server.execute(
                "SELECT message_id, embedding FROM message_vectors")]
        finally:
            server.close()
        return np.array([r[0] for r in rows]), np.stack([r[1] for r in rows])
    conn = connect(location, read_only=True)
    try:
        stored = conn.execute("SELECT message_id, embedding FROM message_vectors").fetchall()
    finally:
        conn.close()
    matrix = np.frombuffer(b"".join(row[1] for row in stored), dtype=np.float32)
    return np.array([row[0] for row in stored]), matrix.reshape(len(stored), -1)


def _rescore_sweep(engine: MemoryEngine, count: int, k: int = 50) -> dict[str, dict[str, float]]:
    """The vector stage alone: latency and agreement with exact cosine per ``rescore``.

    For each setting the KNN (k = 50, a default search's dense list) is timed on
    the same queries, interleaved, and compared with the exact top 10 and top k
    computed in numpy over every stored vector.
    """
    ids, matrix = _every_vector(engine)
    return _sweep(engine, ids, matrix, count, k, engine.storage.vectors.knn)


def _index_sweep(engine: MemoryEngine, count: int, k: int = 50) -> dict[str, Any]:
    """PostgreSQL only: the KNN sweep over every kind of HNSW index pgvector offers.

    The default index exists; the others are built here (their build time is
    reported), and each is searched through the same ``knn`` with ``index=``.
    """
    from memory.storage.postgres.vectors import INDEXES, create_index

    ids, matrix = _every_vector(engine)
    storage: Any = engine.storage
    report: dict[str, Any] = {}
    for index in INDEXES:
        started = time.perf_counter()
        with storage.database.write() as conn:
            create_index(conn, matrix.shape[1], index)
        built_s = time.perf_counter() - started

        def knn(vector: np.ndarray, k: int, filters: Filters, *, rescore: int,
                index: str = index) -> list[tuple[int, float]]:
            return storage.vectors.knn(vector, k, filters, rescore=rescore, index=index)

        report[index] = {"build_s": round(built_s, 1),
                         "rescore": _sweep(engine, ids, matrix, count, k, knn)}
    size = storage.database.read(
        "SELECT c.relname, pg_relation_size(c.oid) FROM pg_class c "
        "WHERE c.relname LIKE 'message_vectors_hnsw_%%'")
    for name, nbytes in size:
        report[name.removeprefix("message_vectors_hnsw_")]["index_mb"] = round(nbytes / 2**20, 1)
    return report


def _sweep(engine: MemoryEngine, ids: np.ndarray, matrix: np.ndarray, count: int, k: int,
           knn: Callable[..., list[tuple[int, float]]]) -> dict[str, dict[str, float]]:
    rng = random.Random(2)
    texts = [" ".join(_words(rng, rng.randint(2, 6))) for _ in range(count)]
    vectors = engine.embedder.embed(texts)
    filters = Filters(guild_id=SCALE_GUILD)
    for rescore in RESCORE_SWEEP:  # warm-up: the radius memory learns on other queries
        for vector in engine.embedder.embed([f"warm up {i}" for i in range(8)]):
            knn(vector, k, filters, rescore=rescore)
    stats: dict[int, dict[str, list[float]]] = {
        r: {"ms": [], "top10": [], "topk": []} for r in RESCORE_SWEEP
    }
    for vector in vectors:
        exact = ids[np.argsort(-(matrix @ vector), kind="stable")[:k]]
        for rescore in RESCORE_SWEEP:
            started = time.perf_counter()
            found = [mid for mid, _ in knn(vector, k, filters, rescore=rescore)]
            stats[rescore]["ms"].append((time.perf_counter() - started) * 1000)
            stats[rescore]["top10"].append(len(set(found[:10]) & set(exact[:10])) / 10)
            stats[rescore]["topk"].append(len(set(found) & set(exact)) / k)
    return {
        str(rescore): {
            "p50_ms": round(percentile(measured["ms"], 50), 2),
            "p95_ms": round(percentile(measured["ms"], 95), 2),
            "exact_top10_overlap": round(float(np.mean(measured["top10"])), 3),
            f"exact_top{k}_overlap": round(float(np.mean(measured["topk"])), 3),
        }
        for rescore, measured in stats.items()
    }

