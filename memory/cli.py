"""The offline command line: import, search, stats, demo, embed, reembed, bench.

``bot.py`` adds the Discord ``run`` command on top of this parser.  Library errors
become one clear line on stderr and exit status 2; progress bars live here only.
"""

from __future__ import annotations

import argparse
import json
import logging
import os
import sys
import tempfile
from collections.abc import Callable, Sequence
from datetime import datetime, timezone
from pathlib import Path
from typing import Any

from memory.config import Profile, available_profiles, load_profile
from memory.errors import MemoryBotError, SearchInputError
from memory.records import SearchResult, ms_to_datetime

log = logging.getLogger(__name__)

ROOT = Path(__file__).resolve().parent.parent
DEFAULT_DB = Path(os.environ.get("MEMORY_DB", ROOT / "data" / "memory.sqlite3"))
DEMO_DIR = ROOT / "data" / "demo-server"
DEMO_QUERIES = ROOT / "data" / "demo-queries.jsonl"


def build_parser() -> argparse.ArgumentParser:
    """Return the argument parser with every offline command."""
    parser = argparse.ArgumentParser(
        prog="bot.py", description="Discord memory bot: offline tools and the bot itself."
    )
    parser.add_argument("--db", type=Path, default=DEFAULT_DB,
                        help=f"SQLite database file (default {DEFAULT_DB}, env MEMORY_DB)")
    parser.add_argument("--profile", default=os.environ.get("MEMORY_PROFILE"),
                        help="hardware profile name or .toml path (default: the one stored "
                        "in the database, else cpu); 'auto' picks cuda, mps or cpu; "
                        f"shipped: {', '.join(available_profiles())}")
    parser.add_argument("--log-level", default="WARNING", help="logging level (default WARNING)")
    parser.add_argument("--metrics-port", type=int, help="expose Prometheus metrics on this port")
    commands = parser.add_subparsers(dest="command", required=True, metavar="COMMAND")

    p = commands.add_parser("import", help="import DiscordChatExporter JSON files or folders")
    p.add_argument("paths", nargs="+", help="export files or folders (searched recursively)")
    p.add_argument("--no-embed", action="store_true", help="store only; embed later with `embed`")
    p.set_defaults(func=cmd_import)

    p = commands.add_parser("search", help="search stored messages")
    p.add_argument("queries", nargs="+", help="one or more queries (up to 20), fused")
    _add_search_options(p)
    p.set_defaults(func=cmd_search)

    p = commands.add_parser("stats", help="show what the database holds")
    p.add_argument("--json", action="store_true", help="print JSON")
    p.set_defaults(func=cmd_stats)

    p = commands.add_parser("embed", help="embed stored messages that have no vector yet")
    p.set_defaults(func=cmd_embed)

    p = commands.add_parser("reembed", help="re-embed every message with the profile's embedder")
    p.set_defaults(func=cmd_reembed)

    p = commands.add_parser("demo", help="import the sample server in data/ and run searches")
    p.add_argument("--keep", action="store_true",
                   help="use --db instead of a temporary database")
    p.set_defaults(func=cmd_demo)

    _add_bench(commands)
    return parser


def _add_search_options(p: argparse.ArgumentParser) -> None:
    p.add_argument("--guild", type=int, help="guild id (default: every guild)")
    p.add_argument("--channel", action="append", help="channel id or name (repeatable)")
    p.add_argument("--author", action="append", help="author id, name or display name (repeatable)")
    p.add_argument("--after", type=_date, help="only messages after this date (ISO 8601)")
    p.add_argument("--before", type=_date, help="only messages before this date (ISO 8601)")
    p.add_argument("--has-attachment", action="store_true", help="only messages with attachments")
    p.add_argument("--limit", type=int, default=10, help="results to return (default 10)")
    p.add_argument("--mode", choices=("hybrid", "dense", "keyword"), default="hybrid",
                   help="retrieval: hybrid (default), dense vectors only, or keywords only")
    p.add_argument("--threshold", type=float, help="fixed similarity threshold (default adaptive)")
    p.add_argument("--no-rerank", action="store_true", help="skip the reranker")
    p.add_argument("--json", action="store_true", help="print JSON")
    p.add_argument("--debug", action="store_true", help="print the trace: stages, timings, rerank")


def _add_bench(commands: Any) -> None:
    bench = commands.add_parser("bench", help="benchmarks (results belong in BENCHMARKS.md)")
    kinds = bench.add_subparsers(dest="bench", required=True, metavar="BENCH")

    p = kinds.add_parser("retrieval", help="recall/MRR/nDCG per mode on a labelled export set")
    p.add_argument("data", type=Path, help="folder of exports (with queries.jsonl)")
    p.add_argument("--queries", type=Path, help="queries.jsonl (default DATA/queries.jsonl)")
    p.add_argument("--k", type=int, default=10, help="results scored per query (default 10)")
    p.add_argument("--scope", choices=("guild", "channel"), default="guild",
                   help="search the whole guild (default) or only the evidence's channel")
    p.add_argument("--modes", help="comma-separated subset of modes")
    p.add_argument("--json", type=Path, dest="json_out", help="write results to this file")
    p.set_defaults(func=cmd_bench_retrieval)

    p = kinds.add_parser("search-scale", help="search latency and import throughput at scale")
    p.add_argument("--messages", type=int, default=100_000,
                   help="synthetic corpus size (default 100000)")
    p.add_argument("--queries", type=int, default=100, help="searches timed per mode (default 100)")
    p.add_argument("--json", type=Path, dest="json_out", help="write results to this file")
    p.set_defaults(func=cmd_bench_scale)

    p = kinds.add_parser("rerank", help="Qwen3-Reranker-0.6B-shaped model: per-pair vs batched")
    p.add_argument("--candidates", type=int, default=30,
                   help="documents scored for one query (default 30)")
    p.add_argument("--repeats", type=int, default=1, help="timed repetitions per variant")
    p.add_argument("--device", default="cpu", help="cpu, cuda or mps (default cpu)")
    p.add_argument("--json", type=Path, dest="json_out", help="write results to this file")
    p.set_defaults(func=cmd_bench_rerank)


def _require_db(path: Path) -> None:
    if not Path(path).exists():
        raise MemoryBotError(f"{path} does not exist yet; run `python bot.py import ...` first")


def _date(text: str) -> datetime:
    try:
        value = datetime.fromisoformat(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"not an ISO 8601 date: {text!r}") from None
    return value if value.tzinfo else value.replace(tzinfo=timezone.utc)


# -- helpers -------------------------------------------------------------------------


def resolve_profile(args: argparse.Namespace, stored: str | None = None) -> Profile:
    """The profile named on the command line, else the stored one, else ``cpu``."""
    return load_profile(args.profile or stored or "cpu")


def open_engine(args: argparse.Namespace, db: Path | None = None, **kwargs: Any):
    """Open the engine on ``db`` (default ``--db``) with the resolved profile."""
    from memory.engine import MemoryEngine
    from memory.store import MessageStore

    path = db or args.db
    stored = None
    if Path(path).exists():
        store = MessageStore(path)
        stored = store.active_profile
        store.close()
    return MemoryEngine(path, resolve_profile(args, stored), **kwargs)


def progress_bar(total: int, desc: str, unit: str = "msg") -> tuple[Callable[[int], None], Any]:
    """A tqdm bar on stderr and its update function."""
    from tqdm import tqdm

    bar = tqdm(total=total, desc=desc, unit=unit, file=sys.stderr, leave=False,
               disable=not sys.stderr.isatty() and bool(os.environ.get("CI")))
    return bar.update, bar


def embed_with_progress(engine: Any) -> int:
    """Embed the engine's backlog behind a progress bar; returns messages embedded."""
    update, bar = progress_bar(engine.store.pending_count(), "embedding")
    try:
        return engine.embed_pending(progress=update)
    finally:
        bar.close()


def _emit_json(data: Any, path: Path | None = None) -> None:
    text = json.dumps(data, indent=2, ensure_ascii=False, default=str)
    if path:
        path.write_text(text + "\n", encoding="utf-8")
    print(text)


# -- commands ------------------------------------------------------------------------


def cmd_import(args: argparse.Namespace) -> int:
    """Import exports: store every file, then embed the backlog, with progress bars."""
    from memory.importer import find_exports

    files = find_exports(args.paths)
    engine = open_engine(args, load_reranker=False)
    try:
        on_file, files_bar = progress_bar(len(files), "reading")
        summary = engine.import_exports(files, embed=False, on_file=on_file)
        files_bar.close()
        if not args.no_embed:
            summary.embedded = embed_with_progress(engine)
    finally:
        engine.close()
    print(
        f"{summary.files} files ({len(summary.errors)} unreadable), {summary.inserted} new, "
        f"{summary.updated} updated, {summary.unchanged} unchanged, "
        f"{summary.skipped} skipped, {summary.embedded} embedded"
    )
    for error in summary.errors:
        print(f"  skipped file: {error}", file=sys.stderr)
    return 1 if summary.errors and len(summary.errors) == summary.files else 0


def cmd_search(args: argparse.Namespace) -> int:
    """Run one search and print a table, JSON, or the trace."""
    from memory.search import SearchRequest

    _require_db(args.db)
    engine = open_engine(args)
    try:
        request = SearchRequest(
            queries=tuple(args.queries), guild_id=args.guild,
            channel_ids=_channel_ids(engine, args.guild, args.channel),
            author_ids=_author_ids(engine, args.guild, args.author),
            after=args.after, before=args.before,
            has_attachment=True if args.has_attachment else None, limit=args.limit,
            mode=args.mode, threshold=args.threshold, rerank=not args.no_rerank,
        )
        if request.rerank and engine.rerankers.current() is not None:
            engine.rerankers.current().load()
        result = engine.search(request)
    finally:
        engine.close()
    if args.json:
        _emit_json(result_to_dict(result))
    else:
        print(format_result(result, debug=args.debug))
    return 0


def _channel_ids(engine: Any, guild: int | None, values: list[str] | None) -> tuple[int, ...] | None:
    if not values:
        return None
    ids = []
    for value in values:
        if value.isdigit():
            ids.append(int(value))
            continue
        found = engine.store.channel_ids_named(value.lstrip("#"), guild)
        if not found:
            raise SearchInputError(f"no stored channel is named {value!r}")
        ids.extend(found)
    return tuple(ids)


def _author_ids(engine: Any, guild: int | None, values: list[str] | None) -> tuple[int, ...] | None:
    if not values:
        return None
    members = engine.store.members(guild)
    ids = []
    for value in values:
        matches = [m[0] for m in members if value.isdigit() and m[0] == int(value)
                   or value.lower() in (m[1].lower(), m[2].lower())]
        if not matches:
            raise SearchInputError(f"no stored author is called {value!r}")
        ids.extend(matches)
    return tuple(ids)


def result_to_dict(result: SearchResult) -> dict[str, Any]:
    """A JSON-ready view of a search result."""
    from dataclasses import asdict

    return {
        "hits": [
            {**asdict(h), "jump_url": h.jump_url,
             "created": ms_to_datetime(h.created_at).isoformat()}
            for h in result.hits
        ],
        "trace": asdict(result.trace),
        "empty_reason": result.empty_reason,
    }


def format_result(result: SearchResult, *, debug: bool = False, width: int = 90) -> str:
    """A plain-text table of hits, with the trace when ``debug``."""
    lines = []
    if not result.hits:
        lines.append(f"no results: {result.empty_reason}")
    for rank, h in enumerate(result.hits, start=1):
        sim = f"{h.similarity:.3f}" if h.similarity is not None else "  -  "
        kw = f"{h.keyword_score:5.2f}" if h.keyword_score is not None else "  -  "
        rr = f" rerank {h.rerank_score:.3f}" if h.rerank_score is not None else ""
        when = ms_to_datetime(h.created_at).strftime("%Y-%m-%d")
        text = " ".join(h.content.split())
        text = text if len(text) <= width else text[: width - 1] + "…"
        lines.append(
            f"{rank:>2}. score {h.score:.4f} sim {sim} bm25 {kw} boost {h.boost:.2f}{rr}  "
            f"#{h.channel_name} {when} {h.author_name}\n    {text}"
        )
    t = result.trace
    threshold = f"{t.threshold:.2f} ({t.threshold_mode})" if t.threshold is not None else t.threshold_mode
    lines.append(
        f"[{t.candidates.get('returned', 0)} results, threshold {threshold}, "
        f"{t.timings_ms.get('total', 0):.1f} ms]"
    )
    if debug:
        lines.append(f"candidates per stage: {t.candidates}")
        lines.append("timings (ms): " + ", ".join(f"{k} {v:.2f}" for k, v in t.timings_ms.items()))
        lines.append(f"threshold iterations: {t.threshold_iterations}")
        if t.rerank_backend:
            lines.append(f"reranker {t.rerank_backend}: reranked={t.reranked} "
                         f"fallback={t.rerank_fallback}")
            lines.append(f"  before: {t.pre_rerank}\n  after:  {t.post_rerank}")
    return "\n".join(lines)


def cmd_stats(args: argparse.Namespace) -> int:
    """Print database counts and metadata."""
    from memory.store import MessageStore

    _require_db(args.db)
    store = MessageStore(args.db)
    try:
        from dataclasses import asdict

        stats = asdict(store.stats())
    finally:
        store.close()
    if args.json:
        _emit_json(stats)
    else:
        for key, value in stats.items():
            print(f"{key:>20}: {value}")
    return 0


def cmd_embed(args: argparse.Namespace) -> int:
    """Embed the backlog of stored, unembedded messages."""
    engine = open_engine(args, load_reranker=False)
    try:
        done = embed_with_progress(engine)
    finally:
        engine.close()
    print(f"embedded {done} messages")
    return 0


def cmd_reembed(args: argparse.Namespace) -> int:
    """Drop all vectors and embed every message with the profile's embedder."""
    engine = open_engine(args, load_reranker=False, check_model=False)
    try:
        update, bar = progress_bar(engine.store.message_count(), "re-embedding")
        done = engine.reembed(progress=update)
        bar.close()
    finally:
        engine.close()
    print(f"re-embedded {done} messages with {engine.embedder.model_id}")
    return 0


def cmd_demo(args: argparse.Namespace) -> int:
    """Import the bundled sample server and show searches with scores and timings."""
    from memory.demo import run_demo

    if args.keep:
        return run_demo(args, args.db)
    with tempfile.TemporaryDirectory(prefix="memory-demo-") as tmp:
        return run_demo(args, Path(tmp) / "demo.sqlite3")


def cmd_bench_retrieval(args: argparse.Namespace) -> int:
    """Score every retrieval mode on a labelled dataset."""
    from memory.bench import RETRIEVAL_MODES, default_modes, load_queries, run_retrieval_bench

    queries = args.queries or args.data / "queries.jsonl"
    modes = args.modes.split(",") if args.modes else None
    unknown = set(modes or []) - set(RETRIEVAL_MODES)
    if unknown:
        raise SearchInputError(f"unknown modes: {', '.join(sorted(unknown))}")
    profile = resolve_profile(args)
    modes = modes or default_modes(profile)
    update, bar = progress_bar(len(load_queries(queries)) * len(modes), "searches", "query")
    result = run_retrieval_bench(args.data, queries, profile, k=args.k, scope=args.scope,
                                 modes=modes, progress=update)
    bar.close()
    result["profile"] = profile.name
    _emit_json(result, args.json_out)
    return 0


def cmd_bench_scale(args: argparse.Namespace) -> int:
    """Time search and import on a synthetic corpus."""
    from memory.bench import run_search_scale

    if args.messages < 100:
        raise SearchInputError("--messages must be at least 100")
    update, bar = progress_bar(args.messages, "importing")
    result = run_search_scale(resolve_profile(args), args.messages, queries=args.queries,
                              progress=update)
    bar.close()
    _emit_json(result, args.json_out)
    return 0


def cmd_bench_rerank(args: argparse.Namespace) -> int:
    """Per-pair vs batched vs shared-prefix scoring on a 0.6B-shaped model."""
    from memory.bench_rerank import run_rerank_bench

    result = run_rerank_bench(candidates=args.candidates, repeats=args.repeats, device=args.device)
    _emit_json(result, args.json_out)
    return 0


def main(argv: Sequence[str] | None = None, parser: argparse.ArgumentParser | None = None) -> int:
    """Parse ``argv``, run the command, and turn engine errors into one line + exit 2."""
    parser = parser or build_parser()
    args = parser.parse_args(argv)
    logging.basicConfig(level=args.log_level.upper(), format="%(levelname)s %(name)s: %(message)s")
    if args.metrics_port:
        from memory.metrics import serve

        serve(args.metrics_port)
    try:
        return args.func(args)
    except MemoryBotError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        print("interrupted; work committed so far is kept", file=sys.stderr)
        return 130
