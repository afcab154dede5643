"""``python bot.py demo``: the sample server in ``data/``, imported and searched.

Shows what the bot does on a fresh machine with the embedded defaults: an import
with its summary, a few searches with every stage's score and timing, a filtered
search, and the retrieval quality on the demo's own labelled questions.
"""

from __future__ import annotations

import argparse
import logging
import time
from pathlib import Path

from memory.bench import load_queries, score_ranking
from memory.cli import (
    DEMO_DIR, DEMO_QUERIES, embed_with_progress, format_result, open_engine, progress_bar,
)
from memory.errors import MemoryBotError
from memory.search import SearchRequest

log = logging.getLogger(__name__)

SHOWCASE = ("demo-q0", "demo-q2", "demo-q9", "demo-q12")


def run_demo(args: argparse.Namespace, db: Path) -> int:
    """Import the demo export into ``db`` and print searches; returns an exit status."""
    engine = open_engine(args, db=db)
    try:
        _import(engine)
        _reranker_status(engine)
        queries = load_queries(DEMO_QUERIES)
        by_id = {q.id: q for q in queries}
        for qid in SHOWCASE:
            query = by_id[qid]
            print(f"\n>>> search: {query.text}")
            result = engine.search(query.text, guild_id=query.guild_id, limit=3)
            print(format_result(result, debug=qid == SHOWCASE[0]))
        _filtered(engine, queries[0].guild_id)
        _quality(engine, queries)
    finally:
        engine.close()
    return 0


def _import(engine) -> None:
    started = time.perf_counter()
    on_file, bar = progress_bar(len(list(DEMO_DIR.glob("*.json"))), "reading")
    summary = engine.import_exports([DEMO_DIR], embed=False, on_file=on_file)
    bar.close()
    summary.embedded = embed_with_progress(engine)
    stats = engine.store.stats()
    print(
        f"imported {summary.files} channel exports from {DEMO_DIR.name}/: "
        f"{summary.inserted} new messages ({summary.unchanged} unchanged), "
        f"{summary.embedded} embedded with {stats.embedding_model} "
        f"in {time.perf_counter() - started:.1f} s; "
        f"{stats.channels} channels, {stats.authors} authors; profile {engine.profile.name}"
    )


def _reranker_status(engine) -> None:
    service = engine.rerankers.current()
    if service is None:
        print("reranker: off in this profile; results are the hybrid order")
        return
    try:
        service.load()
    except MemoryBotError as exc:
        reason = str(exc).splitlines()[0][:160]
        print(f"reranker: {service.config.model} is not available here ({reason}); "
              "searches fall back to the hybrid order. Point reranker.model at a local "
              "Qwen3-Reranker folder or allow a download to enable it.")
        logging.getLogger("memory.reranker.service").setLevel(logging.ERROR)
        return
    print(f"reranker: {service.config.model} on {service.config.device}")


def _filtered(engine, guild_id: int) -> None:
    text = "what is the wifi password or door code"
    print(f"\n>>> search only #general (and its threads): {text}")
    channels = engine.store.channel_ids_named("general", guild_id)
    result = engine.search(text, guild_id=guild_id, channel_ids=tuple(channels), limit=3)
    print(format_result(result))


def _quality(engine, queries) -> None:
    print(f"\n>>> retrieval on the demo's {len(queries)} labelled questions (k=5)")
    for mode in ("dense", "keyword", "hybrid"):
        recall = hits = 0.0
        latencies = []
        for q in queries:
            request = SearchRequest(queries=(q.text,), guild_id=q.guild_id, limit=5, mode=mode,
                                    rerank=False)
            started = time.perf_counter()
            result = engine.search(request)
            latencies.append((time.perf_counter() - started) * 1000)
            scores = score_ranking([h.id for h in result.hits], q.relevant, 5)
            recall += scores["recall"]
            hits += scores["hit"]
        n = len(queries)
        latencies.sort()
        print(f"  {mode:8s} recall@5 {recall / n:.2f}  hit@5 {hits / n:.2f}  "
              f"median {latencies[n // 2]:.1f} ms")
