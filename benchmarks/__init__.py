"""``bench``: retrieval quality, search speed at scale, and reranker scoring designs.

Tooling beside ``cli/``, not shipped in the wheel: ``bot.py`` adds this group when the
package is importable (a source checkout).  Results belong in BENCHMARKS.md with the
machine named; each benchmark module is imported only when its command runs (the
rerank one needs torch and transformers).
"""

from __future__ import annotations

import json
import time
from pathlib import Path

import click

from cli.context import Settings, resolve_profile
from cli.output import emit_json, progress_bar
from cli.params import OUTPUT_FILE, CountList
from memory.errors import ImportFormatError, SearchInputError

JSON_OUT = click.option("--json", "json_out", type=OUTPUT_FILE,
                        help="Write results to this file.")


POSTGRES = click.option(
    "--postgres", metavar="URL",
    help="Run on throw-away databases on this PostgreSQL server (the role needs CREATEDB) "
    "instead of temporary SQLite files.")


@click.group("bench")
def bench() -> None:
    """Benchmarks (results belong in BENCHMARKS.md)."""


@bench.command("retrieval")
@click.argument("data", nargs=-1, type=click.Path(path_type=Path, exists=True, file_okay=False))
@click.option("--queries", type=click.Path(path_type=Path, dir_okay=False),
              help="queries.jsonl (default DATA/queries.jsonl; one DATA only).")
@click.option("--k", type=click.IntRange(1, 100), default=10, show_default=True,
              help="Results scored per query.")
@click.option("--scope", type=click.Choice(("guild", "channel")), default="guild",
              show_default=True, help="Search the whole guild or only the evidence's channel.")
@click.option("--modes", help="Comma-separated subset of modes.")
@click.option("--set", "overrides", multiple=True, metavar="SECTION.KEY=VALUE",
              help="Change a profile setting for this run (repeatable), e.g. search.rrf_k=30.")
@click.option("--cache", type=click.Path(path_type=Path, dir_okay=False),
              help="Keep the embedder's vectors in this .npz between runs.")
@click.option("--rerank-cache", type=click.Path(path_type=Path, dir_okay=False),
              help="Keep the reranker's scores in this .npz between runs (for tuning; "
              "its latencies are then not the reranker's).")
@click.option("--compare", nargs=2, type=click.Path(path_type=Path, dir_okay=False, exists=True),
              help="Compare two --json reports (BEFORE AFTER) instead of running.")
@POSTGRES
@JSON_OUT
@click.pass_obj
def retrieval_command(
    settings: Settings, data: tuple[Path, ...], queries: Path | None, k: int, scope: str,
    modes: str | None, overrides: tuple[str, ...], cache: Path | None,
    rerank_cache: Path | None, compare: tuple[Path, Path] | None, postgres: str | None,
    json_out: Path | None,
) -> int:
    """Recall/MRR/nDCG per mode and category on labelled export sets (DATA...)."""
    from benchmarks.retrieval import (
        RETRIEVAL_MODES,
        CachedEmbedder,
        CachedScores,
        compare_reports,
        default_modes,
        recall_table,
        rerank_table,
        run_retrieval_bench,
        with_settings,
    )
    from cli.scoring import load_queries
    from memory.embedder import SentenceTransformerEmbedder

    if compare:
        click.echo(compare_reports(*(_read_report(path) for path in compare)))
        return 0
    if not data:
        raise SearchInputError("give at least one dataset folder (or --compare BEFORE AFTER)")
    if queries and len(data) > 1:
        raise SearchInputError("--queries goes with one dataset folder only")
    query_files = [queries or folder / "queries.jsonl" for folder in data]
    for path in query_files:
        if not path.is_file():
            raise ImportFormatError(f"{path}: no such queries file (give --queries)")
    chosen = [m.strip() for m in modes.split(",") if m.strip()] if modes else None
    unknown = set(chosen or []) - set(RETRIEVAL_MODES)
    if unknown:
        raise SearchInputError(f"unknown modes: {', '.join(sorted(unknown))}")
    profile = with_settings(resolve_profile(settings), overrides)
    chosen = chosen or default_modes(profile)
    embedder = SentenceTransformerEmbedder(profile.embedder)
    cached = CachedEmbedder(embedder, cache) if cache else None
    scores = CachedScores(rerank_cache) if rerank_cache else None
    total = sum(len(load_queries(path)) for path in query_files) * len(chosen)
    update, bar = progress_bar(total, "searches", "query")
    try:
        result = run_retrieval_bench(data, profile, queries_path=queries, k=k, scope=scope,
                                     modes=chosen, embedder=cached or embedder, progress=update,
                                     postgres=postgres, rerank_cache=scores)
    finally:
        bar.close()
        if cached:
            cached.save()
        if scores:
            scores.save()
    result["profile"] = profile.name
    result["settings"] = list(overrides)
    click.echo(recall_table(result), err=True)
    if side_by_side := rerank_table(result):
        click.echo(side_by_side, err=True)
    emit_json(result, json_out)
    return 0


def _read_report(path: Path) -> dict:
    import json

    try:
        return json.loads(path.read_text(encoding="utf-8"))
    except (OSError, UnicodeDecodeError, ValueError) as exc:
        raise ImportFormatError(f"{path}: not a JSON report ({exc})") from None


@bench.command("train-reranker")
@click.argument("data", nargs=-1, required=True,
                type=click.Path(path_type=Path, exists=True, file_okay=False))
@click.option("--out", required=True, type=click.Path(path_type=Path),
              help="New folder for the model (outside the repository).")
@click.option("--negatives", type=click.IntRange(1, 50), default=4, show_default=True,
              help="Hard negatives per question, drawn from the hybrid search's head.")
@click.option("--easy-negatives", type=click.IntRange(0, 50), default=2, show_default=True,
              help="Easy negatives per question: other questions' evidence in the same set.")
@click.option("--pool", type=click.IntRange(2, 200), default=30, show_default=True,
              help="How deep in the hybrid order negatives are drawn from.")
@click.option("--epochs", type=click.IntRange(1, 20), default=1, show_default=True,
              help="Passes over the training pairs.")
@click.option("--batch-size", type=click.IntRange(1, 512), default=16, show_default=True,
              help="Pairs per training step.")
@click.option("--lr", type=click.FloatRange(1e-7, 1e-2), default=1e-4, show_default=True,
              help="Peak learning rate.")
@click.option("--max-length", type=click.IntRange(16, 512), default=128, show_default=True,
              help="Tokens per (question, message) pair.")
@click.option("--seed", type=click.IntRange(0, 2**31 - 1), default=12, show_default=True,
              help="Seed for the head, the negatives and the batch order.")
@click.option("--base", default="all-MiniLM-L6-v2", show_default=True,
              help="Encoder to start from (the bundled MiniLM, or a local folder).")
@click.option("--holdout-channels", type=CountList(0, 2**63 - 1),
              help="Comma-separated channel ids whose questions are left out (a "
              "cross-validation fold).")
@click.option("--cache", type=click.Path(path_type=Path, dir_okay=False),
              help="Keep the embedder's vectors in this .npz between runs.")
@JSON_OUT
@click.pass_obj
def train_reranker_command(
    settings: Settings, data: tuple[Path, ...], out: Path, negatives: int, easy_negatives: int,
    pool: int,
    epochs: int, batch_size: int, lr: float, max_length: int, seed: int, base: str,
    holdout_channels: list[int] | None, cache: Path | None, json_out: Path | None,
) -> int:
    """Fine-tune a cross-encoder on labelled sets (DATA...) with hybrid-mined hard negatives."""
    from benchmarks.retrieval import CachedEmbedder
    from benchmarks.train_reranker import (
        LICENCE_NOTICE,
        TrainingSettings,
        check_output_folder,
        run_train_reranker,
    )
    from cli.scoring import load_queries
    from memory.embedder import SentenceTransformerEmbedder

    check_output_folder(out)
    for folder in data:
        if not (folder / "queries.jsonl").is_file():
            raise ImportFormatError(f"{folder / 'queries.jsonl'}: no such queries file")
    click.echo(f"note: {LICENCE_NOTICE}", err=True)
    profile = resolve_profile(settings)
    embedder = SentenceTransformerEmbedder(profile.embedder)
    cached = CachedEmbedder(embedder, cache) if cache else None
    training = TrainingSettings(
        base=base, negatives=negatives, easy_negatives=easy_negatives, pool=pool,
        epochs=epochs, batch_size=batch_size, learning_rate=lr, max_length=max_length, seed=seed,
        holdout_channels=frozenset(holdout_channels or ()))
    total = sum(len(load_queries(folder / "queries.jsonl")) for folder in data)
    update, bar = progress_bar(total, "mining negatives", "query")
    try:
        result = run_train_reranker(data, out, profile, cached or embedder, training,
                                    progress=update, on_mined=cached.save if cached else None)
    finally:
        bar.close()
        if cached:
            cached.save()
    click.echo(f"profile: --profile {result['profile']}", err=True)
    emit_json(result, json_out)
    check = result["check"]
    if check["collapsed"]:
        click.echo(
            f"error: the trained model does not tell its own training pairs apart (score "
            f"spread {check['spread']}, AUC {check['auc']}; a healthy one: ~0.2 and ~0.85): as a "
            "reranker it would only add noise. Train again with another --seed (on a small "
            "set, more --epochs).", err=True)
        return 1
    click.echo(f"check: spread {check['spread']}, AUC {check['auc']} on {check['pairs']} "
               "training pairs", err=True)
    return 0


@bench.command("search-scale")
@POSTGRES
@click.option("--messages", type=click.IntRange(100, 10_000_000), default=100_000,
              show_default=True, help="Synthetic corpus size.")
@click.option("--queries", type=click.IntRange(1, 100_000), default=100, show_default=True,
              help="Searches timed per mode.")
@click.option("--vectors", type=click.Choice(("minilm", "word-average")), default="minilm",
              show_default=True,
              help="Embed the corpus with MiniLM, or with MiniLM's word vectors averaged "
              "(cheap enough for 1M messages; queries alike).")
@click.option("--bulk-index", is_flag=True,
              help="With --postgres: write every vector first and build the HNSW index once, "
              "timed (as migrate-db does), then VACUUM ANALYZE.")
@click.option("--index-sweep/--no-index-sweep", default=True, show_default=True,
              help="With --postgres: also build and measure the other HNSW index kinds.")
@click.option("--cache", type=click.Path(path_type=Path, dir_okay=False),
              help="With --postgres and MiniLM: keep the corpus's vectors in this .npz "
              "between runs.")
@JSON_OUT
@click.pass_obj
def scale_command(settings: Settings, messages: int, queries: int, postgres: str | None,
                  vectors: str, bulk_index: bool, index_sweep: bool, cache: Path | None,
                  json_out: Path | None) -> int:
    """Search latency and import throughput at scale (with --postgres: both engines, side by side)."""
    from benchmarks.scale import WordAverageEmbedder, run_search_scale, run_search_scale_engines
    from memory.embedder import SentenceTransformerEmbedder

    profile = resolve_profile(settings)
    update, bar = progress_bar(messages * (2 if postgres else 1), "importing")
    try:
        if postgres:
            result = run_search_scale_engines(profile, messages, postgres, queries=queries,
                                              progress=update, vectors=vectors,
                                              bulk_index=bulk_index, index_sweep=index_sweep,
                                              cache=cache)
        else:
            embedder = (WordAverageEmbedder(SentenceTransformerEmbedder(profile.embedder))
                        if vectors == "word-average" else None)
            result = run_search_scale(profile, messages, queries=queries, embedder=embedder,
                                      progress=update)
    finally:
        bar.close()
    emit_json(result, json_out)
    return 0


@bench.command("reembed")
@click.argument("data", type=click.Path(path_type=Path, exists=True, file_okay=False))
@click.option("--queries", type=click.IntRange(1, 10_000), default=40, show_default=True,
              help="Queries searched over and over while re-embedding.")
@POSTGRES
@JSON_OUT
@click.pass_obj
def reembed_bench_command(settings: Settings, data: Path, queries: int, postgres: str | None,
                          json_out: Path | None) -> int:
    """Search quality (hybrid top-10 overlap with before) while reembed runs, both ways."""
    from benchmarks.reembed import run_reembed_bench

    emit_json(run_reembed_bench(data, resolve_profile(settings), queries=queries,
                                postgres=postgres), json_out)
    return 0


@bench.command("write-throughput")
@click.option("--messages", type=click.IntRange(1000, 10_000_000), default=20_000, show_default=True,
              help="Messages each process stores (each in a guild of its own).")
@click.option("--processes", type=CountList(1, 64), default="1,2,4", show_default=True,
              help="Comma-separated process counts.")
@POSTGRES
@JSON_OUT
def write_throughput_command(messages: int, processes: list[int], postgres: str | None,
                             json_out: Path | None) -> int:
    """Messages stored and vectors written per second by 1, 2, 4 processes on one database."""
    from benchmarks.throughput import run_write_throughput

    emit_json(run_write_throughput(messages, processes, postgres), json_out)
    return 0


@bench.command("member-names")
@click.option("--members", "sizes", type=CountList(1, 200_000), default="40,500,2500,5000,20000",
              show_default=True, help="Comma-separated member counts.")
@click.option("--queries", type=click.IntRange(1, 100_000), default=200, show_default=True,
              help="Query texts timed per member count.")
@click.option("--plain-max", type=click.IntRange(0, 100_000), default=5000, show_default=True,
              help="Largest member count to time the plain definition at (it is slow).")
@JSON_OUT
def member_names_command(
    sizes: list[int], queries: int, plain_max: int, json_out: Path | None
) -> int:
    """How fast a query's member names are found, index against one regex per name."""
    from benchmarks.names import run_member_names

    emit_json(run_member_names(sizes, queries=queries, plain_max=plain_max), json_out)
    return 0


@bench.command("secure-delete")
@click.option("--messages", "sizes", type=CountList(100, 2_000_000), default="20000",
              show_default=True, help="Comma-separated message counts.")
@click.option("--repeats", type=click.IntRange(1, 20), default=2, show_default=True,
              help="Runs per setting, off and on taking turns; figures are medians.")
@click.option("--db-dir", type=click.Path(path_type=Path, file_okay=False),
              help="Folder for the temporary databases (default: the system's temp folder).")
@JSON_OUT
def secure_delete_command(
    sizes: list[int], repeats: int, db_dir: Path | None, json_out: Path | None
) -> int:
    """What erasing deleted text from the file costs: import, edits and deletes, on and off."""
    from benchmarks.erasure import run_secure_delete

    emit_json(run_secure_delete(sizes, repeats=repeats, db_dir=db_dir), json_out)
    return 0


@bench.command("rerank")
@click.option("--candidates", type=click.IntRange(1, 1000), default=30, show_default=True,
              help="Documents scored for one query.")
@click.option("--repeats", type=click.IntRange(1, 100), default=1, show_default=True,
              help="Timed repetitions per variant.")
@click.option("--device", type=click.Choice(("cpu", "cuda", "mps")), default="cpu",
              show_default=True, help="Where the model runs.")
@click.option("--model-size", type=click.Choice(("0.6B", "4B", "8B", "tiny")), default="0.6B",
              show_default=True,
              help="Exact Qwen3-Reranker shape with random weights (tiny: 2 layers, smoke test).")
@click.option("--dtype", type=click.Choice(("float32", "bfloat16", "float16")),
              help="Only this dtype for the fast variants (default: float32 and bfloat16, "
                   "plus float16 off the CPU); the reference is always float32.")
@click.option("--quick", is_flag=True,
              help="Only the reference, the prefix path and the static-shape (bucketed, "
                   "CUDA graph) variants.")
@click.option("--compile-budget", type=click.FloatRange(1.0, 3600.0), default=90.0,
              show_default=True,
              help="Seconds the compiled variant may compile and capture (in the "
                   "background, reranker.compile_budget); past them it times the eager "
                   "graphs it kept.")
@click.option("--backends", metavar="A,B,...",
              help="Compare reranker backends instead: cross-encoder, cross-encoder-onnx, "
                   "cross-encoder-onnx-int8 (MiniLM-L6 on torch, onnxruntime float32 and "
                   "int8), cross-encoder-l12, qwen (real shapes, nothing downloaded), "
                   "profile (the --profile's reranker) or any profile name.")
@click.option("--concurrent", metavar="N,N,...",
              help="Searches/s and p95 latency with N searches reranking at once on one "
                   "reranker (the GPU profile's static shapes, or those of a --profile that "
                   "has reranker.buckets), e.g. 1,4,16,64; --repeats is searches per thread.")
@click.option("--one-at-a-time", is_flag=True,
              help="With --concurrent: score one search at a time (reranker.concurrent = 1), "
                   "as before issue 33.")
@click.option("--compiled", is_flag=True,
              help="With --concurrent: time torch.compile'd static steps (compiled in the "
                   "background at load within --compile-budget, waited for first).")
@click.option("--peer", is_flag=True,
              help="Time the peer instead: sentence-transformers' CrossEncoder on a Qwen3 "
                   "classifier of --model-size's shape, the same pairs.")
@JSON_OUT
@click.pass_obj
def rerank_command(
    settings: Settings, candidates: int, repeats: int, device: str, model_size: str,
    dtype: str | None, quick: bool, compile_budget: float, backends: str | None,
    concurrent: str | None, one_at_a_time: bool, compiled: bool, peer: bool,
    json_out: Path | None,
) -> int:
    """Qwen3-Reranker-shaped model: per-pair vs batched vs shared prefix vs static shapes."""
    if (compiled or one_at_a_time) and not concurrent:
        raise click.UsageError("--compiled and --one-at-a-time go with --concurrent N,...")
    if peer:
        from benchmarks.rerank_peer import run_peer_bench

        emit_json(run_peer_bench(candidates=candidates, repeats=repeats, device=device,
                                 dtype=dtype, model_size=model_size), json_out)
        return 0
    if concurrent:
        from benchmarks.rerank_concurrent import run_concurrent_bench

        chosen = resolve_profile(settings).reranker if settings.profile else None
        static = chosen.qwen if chosen is not None and chosen.qwen.buckets else None
        emit_json(run_concurrent_bench(_levels(concurrent), candidates=candidates,
                                       device=device, dtype=dtype, model_size=model_size,
                                       rounds=repeats, one_at_a_time=one_at_a_time,
                                       static=static,
                                       compile_budget=compile_budget if compiled else None),
                  json_out)
        return 0
    if backends:
        from benchmarks.rerank_backends import run_backends_bench

        names = [n.strip() for n in backends.split(",") if n.strip()]
        emit_json(run_backends_bench(names, resolve_profile(settings), candidates=candidates,
                                     repeats=max(repeats, 3),
                                     progress=lambda name: click.echo(f"… {name}", err=True)),
                  json_out)
        return 0
    from benchmarks.common import write_whole
    from benchmarks.rerank import run_rerank_bench

    def partial(data: dict) -> None:  # what is measured so far, should the run be cut short
        if json_out is not None:  # whole: a kill mid-write keeps the last variant's report
            write_whole(json_out, json.dumps(data, indent=2, default=str) + "\n")

    result = run_rerank_bench(candidates=candidates, repeats=repeats, device=device,
                              dtype=dtype, model_size=model_size, quick=quick,
                              compile_budget=compile_budget, partial=partial)
    emit_json(result, json_out)
    return 0


def _levels(text: str) -> tuple[int, ...]:
    """``--concurrent``'s comma-separated levels."""
    try:
        levels = tuple(int(part) for part in text.split(",") if part.strip())
    except ValueError:
        raise click.BadParameter(f"expected numbers like 1,4,16,64, got {text!r}",
                                 param_hint="--concurrent") from None
    if not levels or min(levels) < 1 or max(levels) > 1024:
        raise click.BadParameter(f"levels must be 1 to 1024, got {text!r}",
                                 param_hint="--concurrent")
    return levels


@bench.command("step-costs")
@click.option("--model-size", type=click.Choice(("0.6B", "4B", "8B", "tiny")),
              help="Qwen3-Reranker shape with random weights (default: from reranker.model).")
@click.option("--device", type=click.Choice(("cpu", "cuda", "mps", "auto")),
              help="Where to run (default: the profile's reranker.device).")
@click.option("--repeats", type=click.IntRange(1, 1000), default=20, show_default=True,
              help="Timed rounds over all buckets (after one warm-up round).")
@click.option("--write-profile", type=OUTPUT_FILE, metavar="OUT.toml",
              help="Write the profile again with reranker.bucket_costs set to the times.")
@JSON_OUT
@click.pass_obj
def step_costs_command(
    settings: Settings, model_size: str | None, device: str | None, repeats: int,
    write_profile: Path | None, json_out: Path | None,
) -> int:
    """Time each static bucket of the --profile's reranker, for its planner (bucket_costs)."""
    from benchmarks.step_costs import run_step_costs
    from benchmarks.step_costs import write_profile as write_costs

    profile = resolve_profile(settings)
    update, bar = progress_bar(repeats + 1, "bucket steps", "round")
    try:
        result = run_step_costs(profile, model_size=model_size, device=device,
                                repeats=repeats, progress=update)
    finally:
        bar.close()
    try:
        if write_profile is not None:
            note = (f"measured by `bench step-costs` on {result['device_name']} "
                    f"({result['dtype']}, {result['model']}): ms per step")
            write_costs(Path(profile.source), write_profile, result["bucket_costs"], note)
            result["written"] = str(write_profile)
    finally:  # the times are kept even when the profile cannot be written
        emit_json(result, json_out)
    return 0


@bench.command("plan")
@click.option("--candidates", "sizes", type=CountList(1, 1000), default="30,100",
              show_default=True, help="Comma-separated candidates per search.")
@click.option("--searches", type=CountList(1, 256), default="1,4,16,64", show_default=True,
              help="Comma-separated numbers of searches planned together.")
@click.option("--repeats", type=click.IntRange(1, 10_000), default=50, show_default=True,
              help="Timed plans per case and way (figures are medians).")
@JSON_OUT
@click.pass_obj
def plan_command(
    settings: Settings, sizes: list[int], searches: list[int], repeats: int,
    json_out: Path | None,
) -> int:
    """How long the static path's planner takes for the --profile's buckets (no model)."""
    from benchmarks.planner import run_plan_timing

    cases = [(size, count) for size in sizes for count in searches]
    emit_json(run_plan_timing(resolve_profile(settings), cases, repeats), json_out)
    return 0


@bench.command("gpu-rows")
@click.option("--out", type=click.Path(path_type=Path, file_okay=False), required=True,
              help="Folder the rows' JSON files go into (gpu-bench.sh's raw folder).")
@click.option("--model-size", type=click.Choice(("0.6B", "4B", "8B", "tiny")), default="0.6B",
              show_default=True, help="Exact Qwen3-Reranker shape with random weights.")
@click.option("--device", type=click.Choice(("cpu", "cuda", "mps")), default="cuda",
              show_default=True, help="Where the model runs (cpu: the smoke run, tiny model).")
@click.option("--dtype", type=click.Choice(("float32", "bfloat16", "float16")),
              default="bfloat16", show_default=True,
              help="The fast variants' dtype (the GPU profiles' is bfloat16).")
@click.option("--candidates", type=CountList(1, 1000), default="30,100", show_default=True,
              help="Candidate counts of the rerank rows; the first is each concurrent search's.")
@click.option("--concurrent", "levels", type=CountList(1, 1024), default="1,4,16,64",
              show_default=True, help="Searches in flight at once, per level.")
@click.option("--repeats", type=click.IntRange(1, 100), default=5, show_default=True,
              help="Timed repetitions per rerank variant.")
@click.option("--reference-repeats", type=click.IntRange(1, 100), default=1, show_default=True,
              help="Timed repetitions of the per-pair float32 reference (its scores are what "
                   "the rows need; at 100 candidates it takes seconds a run).")
@click.option("--rounds", type=click.IntRange(1, 100), default=2, show_default=True,
              help="Searches each thread runs per concurrency level.")
@click.option("--step-costs", "step_rounds", type=click.IntRange(0, 1000), default=0,
              show_default=True,
              help="Rounds of bench step-costs on the compiled steps (0: none); then writes "
                   "PROFILE-timed.toml with the times and runs the compiled levels again, "
                   "planning with them.")
@click.option("--compile-budget", type=click.FloatRange(1.0, 3600.0), default=90.0,
              show_default=True, help="Seconds the compiled variant may compile and capture.")
@click.option("--label", type=click.Choice(("0.6B", "4B", "8B")),
              help="The size in the file names (default --model-size; the smoke run names "
                   "the tiny model's files after the size it stands in for).")
@JSON_OUT
def gpu_rows_command(
    out: Path, model_size: str, device: str, dtype: str, candidates: list[int],
    levels: list[int], repeats: int, reference_repeats: int, rounds: int, step_rounds: int,
    compile_budget: float, label: str | None, json_out: Path | None,
) -> int:
    """Every GPU row of one model size from one process (scripts/gpu-bench.sh's steps)."""
    from benchmarks.gpu_rows import GpuRows, RowPlan
    from benchmarks.rerank import BenchSettings

    settings = BenchSettings(repeats=repeats, device=device, dtype=dtype, model_size=model_size,
                             quick=True, compile_budget=compile_budget, compile_on_cpu=True,
                             reference_repeats=reference_repeats)
    plan = RowPlan(tuple(candidates), tuple(levels), rounds, step_rounds, label)
    started = time.monotonic()
    result = GpuRows(out, settings, plan).run(  # the log says where a step's time went
        progress=lambda done, total, name: click.echo(
            f"… {done}/{total} {name} (at {time.monotonic() - started:.1f} s)", err=True))
    emit_json(result, json_out)
    if result["failed"]:
        click.echo(f"not measured: {', '.join(result['failed'])} (see the log above)", err=True)
        return 1
    return 0


@bench.command("gpu-summary")
@click.argument("folder", type=click.Path(exists=True, file_okay=False, path_type=Path))
@JSON_OUT
def gpu_summary_command(folder: Path, json_out: Path | None) -> int:
    """One table (summary.md, summary.json) of scripts/gpu-bench.sh's files in FOLDER."""
    from benchmarks.gpu_summary import write_summary

    emit_json(write_summary(folder), json_out)
    return 0


@bench.command("embedder")
@click.option("--device", type=click.Choice(("cpu", "cuda", "mps")), default="cpu",
              show_default=True, help="Where MiniLM runs.")
@click.option("--dtype", type=click.Choice(("float32", "float16")), default=None,
              help="Weights dtype (default: float32 on the CPU, float16 on a GPU).")
@click.option("--messages", type=click.IntRange(1, 1_000_000), default=5000, show_default=True,
              help="Synthetic messages embedded for the import throughput.")
@click.option("--queries", type=click.IntRange(1, 10_000), default=100, show_default=True,
              help="Single queries timed for the query latency.")
@JSON_OUT
@click.pass_obj
def embedder_command(
    settings: Settings, device: str, dtype: str | None, messages: int, queries: int,
    json_out: Path | None,
) -> int:
    """The embedder alone: import throughput and query latency (MiniLM on CUDA in fp16)."""
    from benchmarks.embedder import run_embedder_bench

    profile = resolve_profile(settings)
    result = run_embedder_bench(profile.embedder, device=device, dtype=dtype,
                                messages=messages, queries=queries)
    emit_json(result, json_out)
    return 0


@bench.command("discord")
@click.option("--backlog", type=click.IntRange(10, 1_000_000), default=2000, show_default=True,
              help="Messages embedded while the event loop is probed.")
@click.option("--searches", type=click.IntRange(1, 64), default=8, show_default=True,
              help="Reranked searches running while messages are captured.")
@click.option("--reranker", "reranker_shape", type=click.Choice(("0.6B", "tiny")),
              default="0.6B", show_default=True,
              help="Shape of the random-weight Qwen3 reranker that is loaded and used.")
@JSON_OUT
@click.pass_obj
def discord_command(settings: Settings, backlog: int, searches: int, reranker_shape: str,
                    json_out: Path | None) -> int:
    """The bot without Discord: allow-lists, event-loop stalls, capture latency."""
    from benchmarks.discord import run_discord_bench

    result = run_discord_bench(resolve_profile(settings), backlog=backlog, searches=searches,
                               reranker_shape=reranker_shape,
                               progress=lambda stage: click.echo(f"… {stage}", err=True))
    emit_json(result, json_out)
    return 0


@bench.command("stalls")
@click.option("--backlog", type=click.IntRange(10, 1_000_000), default=3000, show_default=True,
              help="Messages in the first embed pass that is probed.")
@click.option("--burst", type=click.IntRange(1, 100_000), default=300, show_default=True,
              help="Messages delivered in one event-loop tick.")
@click.option("--shutdown", "shutdown", type=CountList(10, 1_000_000), default="1500,6000",
              show_default=True, help="Comma-separated backlogs that bot.close() interrupts.")
@click.option("--reranker", "reranker_shape", type=click.Choice(("0.6B", "tiny")),
              default="tiny", show_default=True,
              help="Shape of the random-weight Qwen3 reranker a profile switch loads.")
@JSON_OUT
@click.pass_obj
def stalls_command(settings: Settings, backlog: int, burst: int, shutdown: list[int],
                   reranker_shape: str, json_out: Path | None) -> int:
    """Event-loop stalls (embed pass, message burst, profile switch) and shutdown time."""
    from benchmarks.stalls import run_stalls_bench

    result = run_stalls_bench(resolve_profile(settings), backlog=backlog, burst=burst,
                              shutdown=tuple(shutdown), reranker_shape=reranker_shape,
                              progress=lambda stage: click.echo(f"… {stage}", err=True))
    emit_json(result, json_out)
    return 0


@bench.command("remote")
@click.option("--queries", type=click.IntRange(1, 20), default=20, show_default=True,
              help="Demo questions in the agreement table.")
@click.option("--candidates", type=click.IntRange(5, 200), default=30, show_default=True,
              help="Demo messages scored per question.")
@click.option("--repeats", type=click.IntRange(1, 100), default=5, show_default=True,
              help="Timed calls per latency cell (median kept).")
@click.option("--sizes", type=CountList(1, 1000), default="20,50", show_default=True,
              help="Comma-separated candidate counts of the latency rows.")
@click.option("--agreement/--no-agreement", default=True, show_default=True,
              help="Measure the agreement table (most of the run's time).")
@click.option("--parallel", type=click.IntRange(1, 64), default=2, show_default=True,
              help="llama-server --parallel slots, and the backend's parallel.")
@click.option("--threads", type=click.IntRange(1, 256), default=2, show_default=True,
              help="llama-server --threads.")
@JSON_OUT
def remote_command(queries: int, candidates: int, repeats: int, sizes: list[int], agreement: bool,
                   parallel: int, threads: int, json_out: Path | None) -> int:
    """llama-server reranker vs in-process on a tiny model: agreement and latency."""
    from benchmarks.remote import run_remote_bench

    result = run_remote_bench(queries=queries, candidates=candidates, repeats=repeats,
                              sizes=sizes, parallel=parallel, threads=threads,
                              with_agreement=agreement,
                              progress=lambda stage: click.echo(f"… {stage}", err=True))
    emit_json(result, json_out)
    return 0


@bench.command("reconcile")
@click.option("--channels", type=click.IntRange(1, 10_000), default=100, show_default=True,
              help="Text channels in the server.")
@click.option("--messages", type=click.IntRange(1, 10_000_000), default=100_000,
              show_default=True, help="Stored messages, spread evenly over the channels.")
@click.option("--deleted", type=click.FloatRange(0.0, 1.0), default=0.01, show_default=True,
              help="Share of the stored messages deleted on Discord while the bot was away.")
@click.option("--gone", type=click.IntRange(0, 10_000), default=0, show_default=True,
              help="Channels (of --channels) deleted on Discord while the bot was away.")
@click.option("--recent", "windows", type=CountList(0, 1_000_000), default="100,1000",
              show_default=True, help="Comma-separated reconcile.recent_messages values to run.")
@JSON_OUT
@click.pass_obj
def reconcile_command(settings: Settings, channels: int, messages: int, deleted: float,
                      gone: int, windows: list[int], json_out: Path | None) -> int:
    """Reconcile with a local Discord stand-in: wall time, requests, rate-limited time."""
    from benchmarks.reconcile import run_reconcile_bench

    result = run_reconcile_bench(resolve_profile(settings), channels=channels, messages=messages,
                                 deleted_share=deleted, gone_channels=min(gone, channels),
                                 windows=windows,
                                 progress=lambda stage: click.echo(f"… {stage}", err=True))
    emit_json(result, json_out)
    return 0
