"""``bench search-scale``: search latency and import throughput on a synthetic corpus.

Every comparison is measured side by side in one run on one machine, because
timings on shared machines are noisy; ratios are what to read.
"""

from __future__ import annotations

import contextlib
import functools
import itertools
import json
import logging
import random
import re
import tempfile
import time
from collections.abc import Callable, Sequence
from dataclasses import replace
from pathlib import Path
from typing import Any

import numpy as np

from benchmarks.common import machine_description, percentile, scratch_location
from benchmarks.retrieval import RETRIEVAL_MODES
from memory.config import DEFAULT_EMBEDDER, Profile
from memory.embedder import BUNDLED_MODEL_ID, Embedder, SentenceTransformerEmbedder, resolve_model
from memory.engine import MemoryEngine
from memory.errors import ConfigError
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
def _vocabulary(model: str = DEFAULT_EMBEDDER) -> tuple[list[str], list[float]]:
    """Real English words with Zipf-Mandelbrot cumulative weights, most frequent first.

    The words come from a MiniLM WordPiece vocabulary (:func:`vocabulary_words`),
    whose whole-word entries are listed roughly by corpus frequency; stopwords are
    left out (queries drop them too).  Weights ``1 / (rank + 50)`` give the flat head
    and long tail of real chat: the commonest word is in about 3 % of messages and a
    typical search word in well under 1 % (a 70-word vocabulary, used before, put
    every query word in 12 % of messages and made BM25 score half the corpus per query).

    Args:
        model: The profile's embedder model: the default (the bundled package) or a
            local folder holding a WordPiece vocabulary.
    """
    words = [
        w for w in vocabulary_words(model)
        if w.isascii() and w.isalpha() and w.islower() and len(w) >= 3 and w not in STOPWORDS
    ][:_VOCABULARY_SIZE]
    return words, list(itertools.accumulate(1.0 / (rank + 50) for rank in range(len(words))))


def vocabulary_words(model: str = DEFAULT_EMBEDDER) -> list[str]:
    """The WordPiece vocabulary of ``model``, in id order.

    A model folder is read first (``vocab.txt``, or the ``model.vocab`` of its
    ``tokenizer.json``), so a machine holding only a saved copy of MiniLM (the GPU
    image, scripts/gpu-bench.sh) never needs the bundled package; a hub id or a
    folder without a WordPiece vocabulary falls back to the bundled package.

    Raises:
        ConfigError: Neither the folder nor the bundled package has a vocabulary.
    """
    folder = Path(model).expanduser()
    if model not in (DEFAULT_EMBEDDER, BUNDLED_MODEL_ID) and folder.is_dir():
        words = _folder_vocabulary(folder)
        if words:
            return words
        log.info("%s has no WordPiece vocabulary; using the bundled MiniLM's", folder)
    try:
        _, bundled = resolve_model(DEFAULT_EMBEDDER)
    except ConfigError as exc:
        raise ConfigError(
            f"the synthetic chat corpus needs a WordPiece vocabulary: {model!r} has none "
            f"and {exc}, or set embedder.model to a local MiniLM folder"
        ) from None
    return _folder_vocabulary(Path(bundled))


def _folder_vocabulary(folder: Path) -> list[str]:
    """``vocab.txt`` of ``folder``, else its ``tokenizer.json`` WordPiece vocabulary; [] if none."""
    vocab_txt = folder / "vocab.txt"
    if vocab_txt.is_file():
        return vocab_txt.read_text(encoding="utf-8").split()
    tokenizer_json = folder / "tokenizer.json"
    if not tokenizer_json.is_file():
        return []
    vocab = json.loads(tokenizer_json.read_text(encoding="utf-8")).get("model", {}).get("vocab")
    if not isinstance(vocab, dict):  # BPE/Unigram vocabularies are not WordPiece words
        return []
    return [token for token, _ in sorted(vocab.items(), key=lambda item: item[1])]


def _words(rng: random.Random, count: int, model: str = DEFAULT_EMBEDDER) -> list[str]:
    words, cum_weights = _vocabulary(model)
    return rng.choices(words, cum_weights=cum_weights, k=count)


_WORD = re.compile(r"[^\W_]+", re.UNICODE)


class WordAverageEmbedder:
    """A cheap stand-in for MiniLM at corpus sizes MiniLM cannot encode here (1M
    messages: ~2 h on two cores): a text's vector is the mean of MiniLM's vectors of
    its words, each word encoded once on its own, at unit length.

    The vectors are MiniLM's 384 dimensions with MiniLM's geometry between words
    (related words lie close), texts sharing words lie close, and they are as hard
    to index as sentence vectors (no cluster of exact duplicates, no axis-aligned
    structure); queries are embedded the same way.  What it lacks is word order and
    context, which no index cares about.

    Args:
        base: The model that encodes each word (the profile's MiniLM).
    """

    def __init__(self, base: Embedder) -> None:
        self._base = base
        self._words: dict[str, np.ndarray] = {}

    @property
    def model_id(self) -> str:
        """The base model's id, marked as word-averaged."""
        return f"{self._base.model_id}+word-average"

    @property
    def dimension(self) -> int:
        """The base model's vector size."""
        return self._base.dimension

    def embed(self, texts: Sequence[str]) -> np.ndarray:
        """Unit vectors: each text's words' MiniLM vectors, averaged."""
        tokens = [_WORD.findall(text.lower()) or [""] for text in texts]
        missing = sorted({w for words in tokens for w in words} - self._words.keys())
        for start in range(0, len(missing), 1024):
            chunk = missing[start:start + 1024]
            self._words.update(zip(chunk, self._base.embed(chunk)))
        out = np.zeros((len(texts), self.dimension), dtype=np.float32)
        for row, words in enumerate(tokens):
            out[row] = np.sum([self._words[w] for w in words], axis=0)
        out /= np.maximum(np.linalg.norm(out, axis=1, keepdims=True), 1e-12)
        return out


VECTORS = ("minilm", "word-average")
"""What ``bench search-scale --vectors`` embeds the corpus with."""


def synthetic_records(
    n: int, seed: int = 0, guilds: int = 1, model: str = DEFAULT_EMBEDDER
) -> list[MessageRecord]:
    """Build ``n`` chat-like messages across a few channels and authors (deterministic).

    ``model`` is the profile's embedder model, whose vocabulary the words come from
    (:func:`vocabulary_words`).
    """
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
                content=f"{rng.choice(_OPENERS)} {' '.join(_words(rng, rng.randint(3, 14), model))}",
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
    bulk_index: bool = False,
    index_sweep: bool = True,
) -> dict[str, Any]:
    """Build a synthetic corpus, then time import against the raw encoder and searches.

    Import (store, then embed the backlog) runs in slices of 5,000 messages; after
    storing each slice the bare encoder is timed on 500 of its texts (context
    included, exactly what import embeds), so both rates are measured under the
    same machine load.  Search latencies (query embedding included) for fixed,
    adaptive and hybrid are interleaved query by query so noise hits all alike.
    The database is a temporary SQLite file, or with ``postgres`` (a server URL) a
    throw-away database there; ``bulk_index`` and ``index_sweep``: :func:`_build`
    and :func:`_index_sweep`.
    """
    records = synthetic_records(messages)
    name = "postgres" if postgres else "sqlite"
    with scratch_location(postgres, name="scale", db_dir=db_dir) as location:
        engine = MemoryEngine(location, profile, embedder, load_reranker=False)
        try:
            result = _build(engine, records, progress, bulk_index=bool(postgres) and bulk_index)
            _add_searches(result, _time_searches({name: engine}, queries)[name])
            result["knn"] = _rescore_sweep(engine, queries)
            if postgres and index_sweep:
                result["knn_by_index"] = _index_sweep(engine, queries)
        finally:
            engine.close()
    return {"engine": name, **result}


def run_search_scale_engines(
    profile: Profile, messages: int, postgres: str, *, queries: int = 100,
    progress: Progress | None = None, vectors: str = "minilm", bulk_index: bool = False,
    index_sweep: bool = True, cache: Path | None = None,
) -> dict[str, Any]:
    """The same corpus on SQLite and on PostgreSQL, searched side by side in one run.

    Both are built first (SQLite, then PostgreSQL), with the same vectors: with MiniLM
    the second takes them from the first's embedder cache (``cache``, or a temporary
    one), so its ``import_msgs_per_s`` has no encoder time in it (compare
    ``store_msgs_per_s`` and ``vectors_per_s``, which are storage only); with
    ``vectors="word-average"`` (:class:`WordAverageEmbedder`) both share one instance.
    Then every search runs on one engine right after the other (which goes first
    alternates), so a load that comes and goes on a shared machine hits both alike:
    the ratio is what to read.
    """
    from benchmarks.retrieval import CachedEmbedder

    records = synthetic_records(messages)
    with contextlib.ExitStack() as stack:
        tmp = Path(stack.enter_context(tempfile.TemporaryDirectory(prefix="memory-scale-cache-")))
        base = SentenceTransformerEmbedder(profile.embedder)
        cached = None if vectors == "word-average" else CachedEmbedder(
            base, cache or tmp / "vectors.npz")
        shared: Embedder = cached or WordAverageEmbedder(base)
        engines: dict[str, MemoryEngine] = {}
        for name, server in (("sqlite", None), ("postgres", postgres)):
            location = stack.enter_context(scratch_location(server, name="scale"))
            engines[name] = MemoryEngine(location, profile, shared, load_reranker=False)
            stack.callback(engines[name].close)
        results = {name: _build(engine, records, progress,
                                bulk_index=name == "postgres" and bulk_index)
                   for name, engine in engines.items()}
        if cached is not None and cache is not None:
            cached.save()
        for name, latencies in _time_searches(engines, queries).items():
            _add_searches(results[name], latencies)
        for name, engine in engines.items():
            results[name]["knn"] = _rescore_sweep(engine, queries)
        if index_sweep:
            results["postgres"]["knn_by_index"] = _index_sweep(engines["postgres"], queries)
    hybrid = (results["postgres"]["search"]["hybrid"]["p50_ms"]
              / results["sqlite"]["search"]["hybrid"]["p50_ms"])
    return {"vectors": vectors, "searched": "side by side, query by query",
            "sqlite": {"engine": "sqlite", **results["sqlite"]},
            "postgres": {"engine": "postgres", **results["postgres"]},
            "postgres_vs_sqlite_hybrid_p50": round(hybrid, 3)}


def _build(engine: MemoryEngine, records: list[MessageRecord], progress: Progress | None, *,
           bulk_index: bool = False) -> dict[str, Any]:
    """Import ``records`` (store, then embed, per 5,000); the rates and the database size.

    ``bulk_index`` (PostgreSQL): store everything, write every vector without the
    HNSW index and build it once at the end, as ``migrate-db`` does, then let VACUUM
    mark the new pages visible (what autovacuum does in a while), each timed.
    """
    engine.embedder.embed(["warm up"] * 64)  # load the weights outside the timings
    store_s = embed_s = raw_s = 0.0
    raw_texts = 0
    maintenance: dict[str, float] = {}
    for start in range(0, len(records), 5000):
        started = time.perf_counter()
        engine.storage.messages.upsert(records[start : start + 5000])
        store_s += time.perf_counter() - started
        sample = [engine.embedding_text(m) for m in engine.storage.backlog.pending(500)]
        raw_s += _encoder_seconds(engine, sample)
        raw_texts += len(sample)
        if bulk_index:
            continue  # every vector after every message, without the HNSW index
        started = time.perf_counter()
        engine.embed_pending(progress=progress)
        embed_s += time.perf_counter() - started
    if bulk_index:
        engine.storage.meta.bind_model(engine.embedder.model_id, engine.embedder.dimension)
        _drop_hnsw(engine)
        started = time.perf_counter()
        engine.embed_pending(progress=progress)
        embed_s += time.perf_counter() - started
        maintenance = _build_hnsw(engine)
    import_rate = len(records) / (store_s + embed_s)
    raw_rate = raw_texts / raw_s
    return {
        "machine": machine_description(),
        "messages": len(records),
        "import_msgs_per_s": round(import_rate, 1),
        "store_msgs_per_s": round(len(records) / store_s, 1),
        "vectors_per_s": round(len(records) / embed_s, 1),
        **maintenance,
        "database_mb": round(_database_bytes(engine) / 2**20, 1),
        "raw_encoder_msgs_per_s": round(raw_rate, 1),
        "import_vs_encoder": round(import_rate / raw_rate, 3),
    }


def _add_searches(result: dict[str, Any], latencies: dict[str, list[float]]) -> None:
    """Each mode's p50 and p95 into ``result``, and the ratios between modes."""
    result["queries"] = len(latencies["hybrid"])
    result["search"] = {
        mode: {"p50_ms": round(percentile(v, 50), 2), "p95_ms": round(percentile(v, 95), 2)}
        for mode, v in latencies.items()
    }
    result["adaptive_vs_fixed_p50"] = round(
        percentile(latencies["adaptive"], 50) / percentile(latencies["fixed"], 50), 3)
    result["allow_list_vs_hybrid_p50"] = round(
        percentile(latencies["hybrid_allow_list_500"], 50) / percentile(latencies["hybrid"], 50), 3)


def _drop_hnsw(engine: MemoryEngine) -> None:
    """PostgreSQL: no HNSW index while the vectors go in (``migrate-db``'s way)."""
    from memory.storage.postgres.transfer import PostgresEndpoint

    PostgresEndpoint(engine.storage).prepare()  # type: ignore[arg-type]


def _build_hnsw(engine: MemoryEngine) -> dict[str, float]:
    """PostgreSQL: build the HNSW index over every vector, then VACUUM ANALYZE; each timed.

    The build gets 2 GB of ``maintenance_work_mem`` (the graph of 1M ``halfvec``
    vectors is ~1.1 GB; pgvector builds far slower when it does not fit).
    """
    from memory.storage.postgres.connection import connect as connect_postgres
    from memory.storage.postgres.vectors import create_index

    storage: Any = engine.storage
    model = storage.meta.embedding_model()
    started = time.perf_counter()
    with storage.database.write() as conn:
        conn.execute("SET LOCAL maintenance_work_mem = '2GB'")
        create_index(conn, model[1], storage.vectors.index)
    built_s = time.perf_counter() - started
    server = connect_postgres(storage.database.url)
    try:
        started = time.perf_counter()
        server.execute("VACUUM ANALYZE")
        vacuum_s = time.perf_counter() - started
    finally:
        server.close()
    return {"hnsw_build_s": round(built_s, 1), "vacuum_analyze_s": round(vacuum_s, 1)}


def _database_bytes(engine: MemoryEngine) -> int:
    """The database's size: the SQLite file and its WAL, or PostgreSQL's database."""
    location = engine.storage.database.location
    if is_postgres_url(location):
        return int(engine.storage.database.read(  # type: ignore[attr-defined]
            "SELECT pg_database_size(current_database())")[0][0])
    return sum(Path(f"{location}{suffix}").stat().st_size for suffix in ("", "-wal")
               if Path(f"{location}{suffix}").exists())


def _encoder_seconds(engine: MemoryEngine, texts: list[str]) -> float:
    """Seconds the bare encoder takes for ``texts``, in import's chunk size."""
    started = time.perf_counter()
    for start in range(0, len(texts), 256):
        engine.embedder.embed(texts[start : start + 256])
    return time.perf_counter() - started


def _time_searches(engines: dict[str, MemoryEngine],
                   count: int) -> dict[str, dict[str, list[float]]]:
    """Per engine, per mode: the latencies of ``count`` random searches, interleaved.

    Every text runs in every mode on every engine in a row; which mode, and which
    engine, goes first takes turns (the first finds colder caches).
    """
    rng = random.Random(1)
    modes = {"fixed": RETRIEVAL_MODES["fixed"], "adaptive": RETRIEVAL_MODES["adaptive"],
             "hybrid": RETRIEVAL_MODES["hybrid"],
             # a member of a 500-channel server who can read 7 of the 8 busy channels
             "hybrid_allow_list_500": {**RETRIEVAL_MODES["hybrid"],
                                       "allowed_channel_ids": ALLOW_LIST_500}}
    # the default search again with a wider vector walk (``search.rescore``)
    wider = {f"hybrid_rescore_{r}": r for r in HYBRID_RESCORES}
    modes.update({mode: RETRIEVAL_MODES["hybrid"] for mode in wider})
    latencies: dict[str, dict[str, list[float]]] = {name: {m: [] for m in modes} for name in engines}
    for engine in engines.values():
        # no timed search reranks: the warm-up must not load (or miss) the profile's reranker
        engine.search("warm up", guild_id=SCALE_GUILD, rerank=False)
    configs = {name: engine.searcher.config for name, engine in engines.items()}
    order = list(modes.items())
    names = list(engines)
    for i in range(count):
        text = " ".join(_words(rng, rng.randint(2, 6)))
        turn = i % len(order)
        for mode, fields in order[turn:] + order[:turn]:
            request = replace(SearchRequest(queries=(text,), guild_id=SCALE_GUILD), **fields)
            first = (i // len(order)) % len(names)
            for name in names[first:] + names[:first]:
                searcher = engines[name].searcher
                if mode in wider:
                    # that rescore itself, not grown with the guild
                    searcher.config = replace(configs[name], rescore=wider[mode], rescore_step=0)
                started = time.perf_counter()
                try:
                    engines[name].search(request)
                finally:
                    searcher.config = configs[name]
                latencies[name][mode].append((time.perf_counter() - started) * 1000)
    return latencies


# 7 of the synthetic corpus's 8 channels plus 493 channels with no messages
ALLOW_LIST_500 = tuple(range(2000, 2007)) + tuple(range(50_000, 50_493))

RESCORE_SWEEP = (1, 2, 4, 8, 16, 20, 32, 64)
HYBRID_RESCORES = (16, 64)
"""``rescore`` values the hybrid search is timed with besides the profile's."""


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

