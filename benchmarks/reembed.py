"""``bench reembed``: search quality while ``reembed`` runs (issue 31, item 7).

A labelled export set is imported and embedded; each query's hybrid top 10 is taken
as the reference.  Then every message is embedded again with the same model, in a
worker thread, while a second engine on the same database (the running bot) searches
the queries over and over; each search's top 10 is compared with its reference
(overlap: shared ids / 10).  Two ways to re-embed are measured:

* ``swap`` — ``reembed`` as it ships: a new table beside the live one, swapped in.
* ``drop-first`` — how ``reembed`` worked before: every vector dropped, then the
  backlog embedded again (``reset_embeddings`` + ``embed_pending``).
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

from benchmarks.common import percentile, scratch_location
from cli.scoring import Query, load_queries
from memory.config import Profile
from memory.embedder import Embedder, SentenceTransformerEmbedder
from memory.engine import MemoryEngine
from memory.search import SearchRequest

STRATEGIES = ("swap", "drop-first")


def run_reembed_bench(
    data: Path, profile: Profile, *, queries: int = 40, postgres: str | None = None,
    embedder_factory: Callable[[], Embedder] | None = None,
) -> dict[str, Any]:
    """Import ``data``, then re-embed it both ways while searching; see the module.

    Returns:
        ``{"engine", "messages", "queries", "strategies": {name: {"seconds",
        "samples", "overlap_mean", "overlap_p5", "overlap_min", "overlap_after",
        "swap_ms"}}}``.
    """
    make = embedder_factory or (lambda: SentenceTransformerEmbedder(profile.embedder))
    asked = load_queries(data / "queries.jsonl")[:queries]
    report: dict[str, Any] = {"engine": "postgres" if postgres else "sqlite",
                              "queries": len(asked), "strategies": {}}
    with scratch_location(postgres) as location:
        bot = MemoryEngine(location, profile, make(), load_reranker=False)
        try:
            report["messages"] = bot.import_exports([data]).inserted
            before = _top10(bot, asked)
            for strategy in STRATEGIES:
                report["strategies"][strategy] = _measure(bot, location, profile, make(),
                                                          strategy, asked, before)
        finally:
            bot.close()
    return report


def _measure(bot: MemoryEngine, location: str, profile: Profile, embedder: Embedder,
             strategy: str, asked: list[Query], before: list[list[int]]) -> dict[str, Any]:
    worker = MemoryEngine(location, profile, embedder, load_reranker=False, check_model=False)
    swap_ms: list[float] = []
    finish = worker.storage.rebuild.finish

    def timed_finish(model_id: str, dimension: int) -> int:
        started = time.perf_counter()
        try:
            return finish(model_id, dimension)
        finally:
            swap_ms.append((time.perf_counter() - started) * 1000)

    worker.storage.rebuild.finish = timed_finish  # type: ignore[method-assign]

    def reembed() -> None:
        if strategy == "swap":
            worker.reembed()
        else:
            worker.storage.meta.reset_embeddings(embedder.model_id, embedder.dimension)
            worker.embed_pending()

    thread = threading.Thread(target=reembed, name=f"reembed-{strategy}")
    started = time.perf_counter()
    thread.start()
    overlaps: list[float] = []
    try:
        while thread.is_alive():
            for query, reference in zip(asked, before):
                overlaps.append(_overlap(_search(bot, query), reference))
                if not thread.is_alive():
                    break
        thread.join()
        seconds = time.perf_counter() - started
        after = [_overlap(found, reference) for found, reference in zip(_top10(bot, asked), before)]
    finally:
        worker.close()
    return {
        "seconds": round(seconds, 1),
        "samples": len(overlaps),
        "overlap_mean": round(sum(overlaps) / max(1, len(overlaps)), 3),
        "overlap_p5": round(percentile(overlaps, 5), 3) if overlaps else None,
        "overlap_min": round(min(overlaps), 3) if overlaps else None,
        "overlap_after": round(sum(after) / max(1, len(after)), 3),
        "swap_ms": round(swap_ms[0], 1) if swap_ms else None,
    }


def _search(engine: MemoryEngine, query: Query) -> list[int]:
    result = engine.search(SearchRequest(queries=(query.text,), guild_id=query.guild_id,
                                         limit=10, rerank=False))
    return [hit.id for hit in result.hits]


def _top10(engine: MemoryEngine, asked: list[Query]) -> list[list[int]]:
    return [_search(engine, query) for query in asked]


def _overlap(found: list[int], reference: list[int]) -> float:
    return len(set(found) & set(reference)) / max(1, len(reference))
