"""``python bot.py demo``: the sample server in ``data/``, imported and searched.

Shows what the bot does on a fresh machine with the embedded defaults: an import
with its summary, a few searches with every stage's score and timing, a filtered
search, and the retrieval quality on the demo's own labelled questions.
"""

from __future__ import annotations

import logging
import time
from pathlib import Path

import click

from cli.context import Settings, data_dir, open_engine
from cli.output import embed_with_progress, format_result, progress_bar
from cli.scoring import Query, load_queries, score_ranking
from memory.engine import MemoryEngine
from memory.search import SearchRequest

log = logging.getLogger(__name__)

SHOWCASE = ("demo-q0", "demo-q2", "demo-q9", "demo-q12")


def demo_dir() -> Path:
    """The sample server's channel exports."""
    return data_dir() / "demo-server"


def demo_queries() -> Path:
    """The sample server's labelled questions."""
    return demo_dir() / "queries.jsonl"


def run_demo(settings: Settings, db: Path | str) -> int:
    """Import the demo export into ``db`` and print searches; returns an exit status."""
    engine = open_engine(settings, db=db, load_reranker=False)
    try:
        _import(engine)
        rerank = _reranker_status(engine)
        queries = load_queries(demo_queries())
        by_id = {q.id: q for q in queries}
        for qid in SHOWCASE:
            query = by_id[qid]
            click.echo(f"\n>>> search: {query.text}")
            result = engine.search(query.text, guild_id=query.guild_id, limit=3, rerank=rerank)
            click.echo(format_result(result, debug=qid == SHOWCASE[0]))
        _filtered(engine, queries[0].guild_id, rerank)
        _quality(engine, queries)
    finally:
        engine.close()
    return 0


def _import(engine: MemoryEngine) -> None:
    started = time.perf_counter()
    folder = demo_dir()
    on_file, bar = progress_bar(len(list(folder.glob("*.json"))), "reading")
    summary = engine.import_exports([folder], embed=False, on_file=on_file)
    bar.close()
    summary.embedded = embed_with_progress(engine)
    stats = engine.storage.stats()
    click.echo(
        f"imported {summary.files} channel exports from {folder.name}/: "
        f"{summary.inserted} new messages ({summary.unchanged} unchanged), "
        f"{summary.embedded} embedded with {stats.embedding_model} "
        f"in {time.perf_counter() - started:.1f} s; "
        f"{stats.channels} channels, {stats.authors} authors; profile {engine.profile.name}"
    )


def _reranker_status(engine: MemoryEngine) -> bool:
    """Say once, in one line, whether searches are reranked (and how to turn it on).

    Returns:
        Whether the reranker loaded (the demo's searches rerank only then).
    """
    status = engine.reranker_status()
    settings = engine.profile.reranker.table()  # the profile's keys, whichever backend
    if status.name is None:
        click.echo("reranker: off in this profile; results are the hybrid order")
        return False
    if not status.loaded:
        log.info("reranker unavailable: %s", status.reason)
        click.echo(
            f"reranker: off ({settings['model']} is not available here); results are the "
            "hybrid order. To turn it on, point reranker.model in the profile at a local "
            "Qwen3-Reranker folder, or use a llama-server profile."
        )
        return False
    click.echo(f"reranker: {settings['model']} on {settings['device']}")
    return True


def _filtered(engine: MemoryEngine, guild_id: int, rerank: bool) -> None:
    text = "what is the wifi password or door code"
    click.echo(f"\n>>> search only #general (and its threads): {text}")
    channels = engine.storage.messages.channel_ids_named("general", guild_id)
    result = engine.search(text, guild_id=guild_id, channel_ids=tuple(channels), limit=3,
                           rerank=rerank)
    click.echo(format_result(result))


def _quality(engine: MemoryEngine, queries: list[Query]) -> None:
    click.echo(f"\n>>> retrieval on the demo's {len(queries)} labelled questions (k=5)")
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
        click.echo(f"  {mode:8s} recall@5 {recall / n:.2f}  hit@5 {hits / n:.2f}  "
                   f"median {latencies[n // 2]:.1f} ms")
