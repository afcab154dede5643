"""Benchmarks behind ``python bot.py bench``: retrieval quality and search speed.

Every comparison is measured side by side in one run on one machine, because
timings on shared machines are noisy; ratios are what to read.
"""

from __future__ import annotations

import json
import logging
import math
import platform
import random
import tempfile
import time
from collections.abc import Callable
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any

from memory.config import Profile
from memory.embedder import Embedder
from memory.engine import MemoryEngine
from memory.records import MessageRecord
from memory.search import SearchRequest

log = logging.getLogger(__name__)

Progress = Callable[[int], None]

# name -> request fields; "hybrid" is the full default pipeline without reranking.
RETRIEVAL_MODES: dict[str, dict[str, Any]] = {
    "dense": {"mode": "dense", "adaptive": False, "boosts": False, "rerank": False},
    "keyword": {"mode": "keyword", "adaptive": False, "boosts": False, "rerank": False},
    "fixed": {"mode": "dense", "threshold": 0.6, "boosts": False, "rerank": False},
    "adaptive": {"mode": "dense", "adaptive": True, "boosts": False, "rerank": False},
    "hybrid": {"mode": "hybrid", "rerank": False},
    "rerank": {"mode": "hybrid", "rerank": True},
}


@dataclass(frozen=True)
class Query:
    """One benchmark query with its evidence message ids."""

    id: str
    text: str
    guild_id: int
    channel_id: int
    relevant: frozenset[int]


def load_queries(path: str | Path) -> list[Query]:
    """Read ``queries.jsonl`` (format: shared/datasets/README.md)."""
    queries = []
    for line in Path(path).read_text(encoding="utf-8").splitlines():
        if line.strip():
            raw = json.loads(line)
            queries.append(
                Query(
                    id=str(raw["id"]), text=raw["query"], guild_id=int(raw["guild_id"]),
                    channel_id=int(raw["channel_id"]),
                    relevant=frozenset(int(i) for i in raw["relevant"]),
                )
            )
    return queries


def score_ranking(ranked: list[int], relevant: frozenset[int], k: int) -> dict[str, float]:
    """Recall, hit, MRR and binary-gain nDCG at ``k`` for one query."""
    top = ranked[:k]
    found = [i for i, mid in enumerate(top) if mid in relevant]
    dcg = sum(1.0 / math.log2(i + 2) for i in found)
    ideal = sum(1.0 / math.log2(i + 2) for i in range(min(len(relevant), k)))
    return {
        "recall": len(found) / len(relevant) if relevant else 0.0,
        "hit": 1.0 if found else 0.0,
        "mrr": 1.0 / (found[0] + 1) if found else 0.0,
        "ndcg": dcg / ideal if ideal else 0.0,
    }


def percentile(values: list[float], p: float) -> float:
    """The ``p``-th percentile (0-100) by linear interpolation."""
    if not values:
        return 0.0
    ordered = sorted(values)
    pos = (len(ordered) - 1) * p / 100
    lo, hi = math.floor(pos), math.ceil(pos)
    return ordered[lo] + (ordered[hi] - ordered[lo]) * (pos - lo)


def default_modes(profile: Profile) -> list[str]:
    """Every retrieval mode; ``rerank`` only when the profile has a reranker."""
    return [m for m in RETRIEVAL_MODES if m != "rerank" or profile.reranker.enabled]


def run_retrieval_bench(
    data: str | Path,
    queries_path: str | Path | None,
    profile: Profile,
    *,
    k: int = 10,
    scope: str = "guild",
    modes: list[str] | None = None,
    embedder: Embedder | None = None,
    progress: Progress | None = None,
) -> dict[str, Any]:
    """Import ``data`` into a temporary database and score every mode on every query.

    Returns:
        ``{"messages", "queries", "k", "scope", "modes": {mode: metrics}}`` with
        recall/hit/mrr/ndcg at k, mean_returned, p50_ms and p95_ms per mode.
    """
    queries = load_queries(queries_path or Path(data) / "queries.jsonl")
    modes = modes or default_modes(profile)
    with tempfile.TemporaryDirectory(prefix="memory-bench-") as tmp:
        engine = MemoryEngine(Path(tmp) / "bench.sqlite3", profile, embedder, load_reranker=True)
        try:
            messages = engine.import_exports([data]).inserted
            results = {
                mode: _run_mode(engine, queries, mode, k, scope, progress) for mode in modes
            }
        finally:
            engine.close()
    return {"messages": messages, "queries": len(queries), "k": k, "scope": scope, "modes": results}


def _run_mode(
    engine: MemoryEngine, queries: list[Query], mode: str, k: int, scope: str,
    progress: Progress | None,
) -> dict[str, float]:
    fields = RETRIEVAL_MODES[mode]
    totals = {"recall": 0.0, "hit": 0.0, "mrr": 0.0, "ndcg": 0.0}
    returned, latencies = 0, []
    for query in queries:
        request = SearchRequest(
            queries=(query.text,), guild_id=query.guild_id, limit=k,
            channel_ids=(query.channel_id,) if scope == "channel" else None, **fields,
        )
        started = time.perf_counter()
        result = engine.search(request)
        latencies.append((time.perf_counter() - started) * 1000)
        returned += len(result.hits)
        for name, value in score_ranking([h.id for h in result.hits], query.relevant, k).items():
            totals[name] += value
        if progress:
            progress(1)
    n = max(1, len(queries))
    return {
        **{name: round(value / n, 4) for name, value in totals.items()},
        "mean_returned": round(returned / n, 3),
        "p50_ms": round(percentile(latencies, 50), 2),
        "p95_ms": round(percentile(latencies, 95), 2),
    }


# -- search at scale ----------------------------------------------------------------

_WORDS = (
    "deploy server build release bug crash fix patch raspberry cluster printer filament "
    "garden tomato soil compost meeting friday saturday repair cafe solder iron laptop "
    "keyboard docker python rust config backup disk network router wifi coffee pizza "
    "movie game guitar bike trail rain weather ticket invoice budget design sketch paint "
    "camera lens photo drone battery charger cable sensor arduino motor robot kit class"
).split()
_OPENERS = ("anyone know", "I think", "just saw", "reminder:", "quick q:", "lol", "honestly",
            "update:", "so apparently", "can someone")


def synthetic_records(n: int, seed: int = 0, guilds: int = 1) -> list[MessageRecord]:
    """Build ``n`` chat-like messages across a few channels and authors (deterministic)."""
    rng = random.Random(seed)
    base_ms = int(time.time() * 1000) - 365 * 86_400_000
    records = []
    for i in range(n):
        words = rng.sample(_WORDS, rng.randint(3, 14))
        created = base_ms + i * (365 * 86_400_000 // max(n, 1))
        author = rng.randint(1, 40)
        records.append(
            MessageRecord(
                id=((created - 1420070400000) << 22) | (i & 0x3FFFFF),
                guild_id=1000 + i % guilds, channel_id=2000 + rng.randint(0, 7),
                author_id=author, created_at=created,
                content=f"{rng.choice(_OPENERS)} {' '.join(words)}",
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
) -> dict[str, Any]:
    """Build a synthetic corpus, then time import against the raw encoder and searches.

    Import throughput (store + embed the backlog) and raw encoder throughput are
    measured on the same texts, context included, in the same run; search latencies (query embedding included) for fixed, adaptive
    and hybrid are interleaved query by query so machine noise hits all alike.
    """
    records = synthetic_records(messages)
    with tempfile.TemporaryDirectory(prefix="memory-scale-", dir=db_dir) as tmp:
        engine = MemoryEngine(Path(tmp) / "scale.sqlite3", profile, embedder, load_reranker=False)
        try:
            started = time.perf_counter()
            for start in range(0, len(records), 5000):
                engine.upsert(records[start : start + 5000])
            store_s = time.perf_counter() - started
            # the bare encoder on exactly the texts import embeds (context included)
            sample = [engine.embedding_text(m) for m in engine.store.pending(5000)]
            raw_rate = _encoder_rate(engine, sample)
            started = time.perf_counter()
            engine.embed_pending(progress=progress)
            import_rate = len(records) / (store_s + time.perf_counter() - started)
            latencies = _time_searches(engine, queries)
        finally:
            engine.close()
    return {
        "machine": machine_description(),
        "messages": messages,
        "queries": queries,
        "import_msgs_per_s": round(import_rate, 1),
        "raw_encoder_msgs_per_s": round(raw_rate, 1),
        "import_vs_encoder": round(import_rate / raw_rate, 3),
        "search": {
            mode: {"p50_ms": round(percentile(v, 50), 2), "p95_ms": round(percentile(v, 95), 2)}
            for mode, v in latencies.items()
        },
        "adaptive_vs_fixed_p50": round(
            percentile(latencies["adaptive"], 50) / percentile(latencies["fixed"], 50), 3
        ),
    }


def _encoder_rate(engine: MemoryEngine, texts: list[str]) -> float:
    """Messages per second of the bare encoder on ``texts``, in import's chunk size."""
    engine.embedder.embed(texts[:64])  # warm-up: load weights, first-call overheads
    started = time.perf_counter()
    for start in range(0, len(texts), 256):
        engine.embedder.embed(texts[start : start + 256])
    return len(texts) / (time.perf_counter() - started)


def _time_searches(engine: MemoryEngine, count: int) -> dict[str, list[float]]:
    rng = random.Random(1)
    modes = {"fixed": RETRIEVAL_MODES["fixed"], "adaptive": RETRIEVAL_MODES["adaptive"],
             "hybrid": RETRIEVAL_MODES["hybrid"]}
    latencies: dict[str, list[float]] = {m: [] for m in modes}
    engine.search("warm up", guild_id=1000)
    for _ in range(count):
        text = " ".join(rng.sample(_WORDS, rng.randint(2, 6)))
        for mode, fields in modes.items():
            request = replace(SearchRequest(queries=(text,), guild_id=1000), **fields)
            started = time.perf_counter()
            engine.search(request)
            latencies[mode].append((time.perf_counter() - started) * 1000)
    return latencies


def machine_description() -> str:
    """A one-line description of the machine for benchmark records."""
    import os

    try:
        import torch

        threads = torch.get_num_threads()
    except ImportError:  # pragma: no cover
        threads = 0
    return (
        f"{platform.processor() or platform.machine()}, {os.cpu_count()} cores, "
        f"Python {platform.python_version()}, torch threads {threads}"
    )
