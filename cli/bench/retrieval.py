"""``bench retrieval``: recall, hit, MRR and nDCG per retrieval mode on a labelled export set.

Every mode is scored side by side in one run on one machine; ``rerank`` is listed
only when a reranker actually ran (a missing model falls back to the hybrid
order, and numbers equal to hybrid's would mislead).
"""

from __future__ import annotations

import logging
import tempfile
import time
from collections import defaultdict
from collections.abc import Callable
from pathlib import Path
from typing import Any

from cli.bench.common import Query, load_queries, percentile, score_ranking
from memory.config import Profile
from memory.embedder import Embedder
from memory.engine import MemoryEngine
from memory.errors import MemoryBotError
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

    ``rerank`` is dropped (and ``rerank_skipped`` says why) when the profile's
    reranker cannot be loaded; its searches would only repeat hybrid's.

    Returns:
        ``{"messages", "queries", "k", "scope", "modes": {mode: metrics}}`` with
        recall/hit/mrr/ndcg at k, mean_returned, p50_ms, p95_ms and recall per
        question category (``by_category``) per mode.

    Raises:
        ImportFormatError: ``data`` or the queries file is missing or malformed.
    """
    queries = load_queries(queries_path or Path(data) / "queries.jsonl")
    modes = list(modes or default_modes(profile))
    report: dict[str, Any] = {}
    with tempfile.TemporaryDirectory(prefix="memory-bench-") as tmp:
        engine = MemoryEngine(Path(tmp) / "bench.sqlite3", profile, embedder, load_reranker=False)
        try:
            if "rerank" in modes and (reason := _reranker_missing(engine)):
                modes.remove("rerank")
                report["rerank_skipped"] = reason
            messages = engine.import_exports([data]).inserted
            results = {
                mode: _run_mode(engine, queries, mode, k, scope, progress) for mode in modes
            }
        finally:
            engine.close()
    return {"messages": messages, "queries": len(queries), "k": k, "scope": scope,
            "modes": results, **report}


def _reranker_missing(engine: MemoryEngine) -> str | None:
    """Why the engine's reranker cannot run (``None`` when it loaded)."""
    service = engine.rerankers.current()
    if service is None:
        return "the profile has no reranker"
    try:
        service.load()
    except MemoryBotError as exc:
        log.warning("rerank mode skipped: %s", exc)
        return str(exc).splitlines()[0]
    return None


def _run_mode(
    engine: MemoryEngine, queries: list[Query], mode: str, k: int, scope: str,
    progress: Progress | None,
) -> dict[str, Any]:
    fields = RETRIEVAL_MODES[mode]
    scores: list[dict[str, float]] = []
    returned, fallbacks, latencies = 0, 0, []
    for query in queries:
        request = SearchRequest(
            queries=(query.text,), guild_id=query.guild_id, limit=k,
            channel_ids=(query.channel_id,) if scope == "channel" else None, **fields,
        )
        started = time.perf_counter()
        result = engine.search(request)
        latencies.append((time.perf_counter() - started) * 1000)
        returned += len(result.hits)
        fallbacks += bool(result.trace.rerank_fallback)
        scores.append(score_ranking([h.id for h in result.hits], query.relevant, k))
        if progress:
            progress(1)
    n = max(1, len(queries))
    summary: dict[str, Any] = {
        name: round(sum(s[name] for s in scores) / n, 4) for name in ("recall", "hit", "mrr", "ndcg")
    }
    summary.update(
        mean_returned=round(returned / n, 3),
        p50_ms=round(percentile(latencies, 50), 2),
        p95_ms=round(percentile(latencies, 95), 2),
        by_category=_recall_by_category(queries, scores),
    )
    if fields.get("rerank"):
        summary["rerank_fallbacks"] = fallbacks
    return summary


def _recall_by_category(queries: list[Query], scores: list[dict[str, float]]) -> dict[str, Any]:
    """Mean recall and query count per question category, categories sorted."""
    groups: dict[str, list[float]] = defaultdict(list)
    for query, score in zip(queries, scores):
        groups[query.category].append(score["recall"])
    return {
        category: {"recall": round(sum(v) / len(v), 4), "queries": len(v)}
        for category, v in sorted(groups.items())
    }
