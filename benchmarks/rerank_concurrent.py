"""``bench rerank --concurrent N,...``: many searches reranking at once on one reranker.

A bot in many servers has many searches in flight.  This benchmark shares one
:class:`memory.rerank.qwen.QwenReranker` (random weights, the exact Qwen3-Reranker
shape, the shipped GPU profile's static-shape settings) between ``N`` threads, each
reranking ``candidates`` chat messages for its own query, and reports, per ``N``,
searches per second and the latency a search sees (p50, p95), queueing included.

The profile's ``concurrent`` (16) lets searches that queue while one is scored share
the next static steps; ``--one-at-a-time`` sets it to 1, the reranker before issue 33,
which scores one search at a time under its lock.
"""

from __future__ import annotations

import dataclasses
import logging
import threading
import time
from typing import Any

import torch

from benchmarks.common import percentile, require_device
from benchmarks.qwen_models import MODEL_SHAPES, qwen_tokenizer, random_label, random_qwen3
from benchmarks.rerank import _device_name, _profile_static
from benchmarks.rerank_corpus import CANDIDATES, QUERY
from memory.config import QwenConfig
from memory.errors import ConfigError
from memory.rerank.qwen import QwenReranker, resolve_device, resolve_dtype

log = logging.getLogger(__name__)

DEFAULT_LEVELS = (1, 4, 16, 64)


@dataclasses.dataclass(frozen=True)
class ConcurrencyResult:
    """One concurrency level's measurement.

    Attributes:
        concurrent: Searches in flight at once (threads).
        searches: Searches completed.
        seconds: Wall time for all of them.
        searches_per_s: ``searches / seconds``.
        p50_ms: Median latency of one search's rerank, waiting included.
        p95_ms: Its 95th percentile.
        speedup: ``searches_per_s`` over the one-at-a-time level's.
        executed: What the static path ran for this level
            (:meth:`memory.rerank.qwen_static.StepStats.summary`: searches per group,
            head and tail steps, rows per tail step, padding); empty without it.
    """

    concurrent: int
    searches: int
    seconds: float
    searches_per_s: float
    p50_ms: float
    p95_ms: float
    speedup: float
    executed: dict[str, float] = dataclasses.field(default_factory=dict)


def run_concurrent_bench(
    levels: tuple[int, ...] = DEFAULT_LEVELS,
    candidates: int = 30,
    device: str = "cpu",
    dtype: str | None = None,
    model_size: str = "0.6B",
    rounds: int = 2,
    seed: int = 0,
    one_at_a_time: bool = False,
    static: QwenConfig | None = None,
    compile_budget: float | None = None,
) -> dict[str, Any]:
    """Rerank ``candidates`` messages from ``N`` threads at once, for each ``N`` in ``levels``.

    Args:
        levels: Concurrency levels (threads), each at least 1.
        candidates: Messages each search reranks (cycled from the built-in chat).
        device: ``cpu``, ``cuda``, ``mps`` or ``auto``.
        dtype: Model dtype; default bfloat16 on a GPU, float32 on the CPU.
        model_size: ``0.6B``, ``4B``, ``8B`` or ``tiny``.
        rounds: Searches each thread runs per level (after one warm-up search).
        seed: Seed of the random weights.
        one_at_a_time: Score one search at a time (``concurrent = 1``) instead of the
            profile's grouping.
        static: Static-shape settings to use (buckets, run cost, measured
            ``bucket_costs``, ``concurrent``), e.g. a profile ``bench step-costs``
            wrote; default the shipped GPU profile's for ``model_size``.
        compile_budget: Time torch.compile'd static steps instead of the eager ones:
            compiled (and on CUDA captured) in the background at load within this many
            seconds (``reranker.compile_budget``), waited for before the first level;
            past it the eager steps are timed and ``compiled`` says so.

    Returns:
        A JSON-ready dict: device, model, the reranker settings, and ``levels``:
        one :class:`ConcurrencyResult` dict per level.

    Raises:
        ConfigError: A level below 1, an unknown model size or dtype, or a device
            torch does not see.
    """
    check_levels(levels)
    if model_size not in MODEL_SHAPES:
        raise ConfigError(f"bench model size must be one of {', '.join(MODEL_SHAPES)}")
    device = resolve_device(device)
    require_device(device)
    torch_dtype = resolve_dtype(dtype or "auto", device)
    model = random_qwen3(MODEL_SHAPES[model_size], device=device, dtype=torch_dtype, seed=seed)
    config = _config(device, model_size, static)
    if one_at_a_time:
        config = dataclasses.replace(config, concurrent=1)
    if compile_budget is not None:
        config = dataclasses.replace(config, torch_compile=True, compile_budget=compile_budget)
    reranker = QwenReranker.from_model(model, qwen_tokenizer(), config)
    try:
        reranker.wait_for_compile()  # settled within the budget; no-op without torch_compile
        results = measure_levels(reranker, levels, candidates, rounds)
        return concurrency_report(reranker, results, model_size, candidates, rounds)
    finally:
        reranker.close()


def measure_levels(
    reranker: QwenReranker, levels: tuple[int, ...], candidates: int, rounds: int
) -> list[ConcurrencyResult]:
    """Each level's searches/s and latency on ``reranker`` (loaded, its compile settled).

    Raises:
        ConfigError: A level below 1.
    """
    check_levels(levels)
    docs = [CANDIDATES[i % len(CANDIDATES)] for i in range(candidates)]
    reranker.score(QUERY, docs)  # warm-up: allocator, kernels, every graph already captured
    results: list[ConcurrencyResult] = []
    for level in levels:
        results.append(_level(reranker, docs, level, rounds, results[0] if results else None))
        done = results[-1]
        log.info("concurrent %d: %.1f searches/s, p95 %.0f ms; ran %s", level,
                 done.searches_per_s, done.p95_ms, done.executed)
    return results


def check_levels(levels: tuple[int, ...]) -> None:
    """Raise :class:`ConfigError` unless there is a level and each is at least 1."""
    if not levels or min(levels) < 1:
        raise ConfigError(f"concurrency levels must be at least 1, got {levels}")


def concurrency_report(
    reranker: QwenReranker, results: list[ConcurrencyResult], model_size: str,
    candidates: int, rounds: int, torch_compile: bool | None = None,
) -> dict[str, Any]:
    """The JSON-ready report of :func:`measure_levels`' results on ``reranker``.

    ``torch_compile`` says whether a compile was asked for (default: the reranker's
    config; ``bench gpu-rows`` compiles the graphs variant's reranker afterwards).
    """
    config, scorer = reranker.config, reranker.static_scorer
    device = str(reranker.device)
    return {
        "model": random_label(model_size),
        "device": torch.device(device).type,
        "device_name": _device_name(device),
        "dtype": str(reranker.dtype).removeprefix("torch."),
        "torch_threads": torch.get_num_threads(),
        "candidates": candidates,
        "rounds": rounds,
        "concurrent_setting": config.concurrent,
        "buckets": [list(b) for b in config.buckets],
        "measured_step_times": bool(scorer is not None and scorer.measured),
        "packed": bool(scorer is not None and scorer.pack),
        "graphs_live": bool(scorer is not None and scorer.graphs),
        "torch_compile": config.torch_compile if torch_compile is None else torch_compile,
        "compiled": bool(scorer is not None and scorer.compiled),
        "levels": [dataclasses.asdict(r) for r in results],
    }


def _config(device: str, model_size: str, chosen: QwenConfig | None = None) -> QwenConfig:
    """The static-shape settings chosen, else the shipped GPU profile's; graphs where CUDA is."""
    graphs = torch.device(device).type == "cuda"
    if chosen is not None:
        return dataclasses.replace(chosen, model=random_label(model_size), device=device,
                                   cuda_graphs=graphs, torch_compile=False)
    static = _profile_static(model_size)
    return QwenConfig(
        model=random_label(model_size), device=device, max_length=512, batch_size=32,
        buckets=static.buckets, bucket_run_cost=static.run_cost, concurrent=static.concurrent,
        pack=static.pack, cuda_graphs=graphs,
    )


def _level(
    reranker: QwenReranker, docs: list[str], level: int, rounds: int,
    first: ConcurrencyResult | None,
) -> ConcurrencyResult:
    static = reranker.static_scorer
    if static is not None:
        static.stats.reset()
    latencies: list[float] = []
    failures: list[BaseException] = []
    lock = threading.Lock()
    start = threading.Barrier(level + 1)

    def searcher(worker: int) -> None:
        start.wait()
        for turn in range(rounds):
            query = f"{QUERY} ({worker}-{turn})"  # a head of its own, as another server's
            began = time.perf_counter()
            try:
                reranker.score(query, docs)
            except Exception as exc:  # reported below, on the caller's thread
                with lock:
                    failures.append(exc)
                return
            with lock:
                latencies.append(time.perf_counter() - began)

    threads = [threading.Thread(target=searcher, args=(w,), daemon=True) for w in range(level)]
    for thread in threads:
        thread.start()
    start.wait()
    began = time.perf_counter()
    for thread in threads:
        thread.join()
    seconds = time.perf_counter() - began
    if failures:
        raise failures[0]
    rate = len(latencies) / seconds
    return ConcurrencyResult(
        concurrent=level,
        searches=len(latencies),
        seconds=round(seconds, 3),
        searches_per_s=round(rate, 2),
        p50_ms=round(percentile(latencies, 50) * 1000, 1),
        p95_ms=round(percentile(latencies, 95) * 1000, 1),
        speedup=round(rate / first.searches_per_s, 2) if first else 1.0,
        executed=static.stats.summary() if static is not None else {},
    )
