"""``bench step-costs``: each static bucket's step time, for the planner to minimise.

The static path (:mod:`memory.rerank.qwen_static`) packs a search's candidates into
the profile's ``[batch, length]`` buckets.  Without measurements its planner
estimates a step's price as padded token positions plus ``bucket_run_cost``; how
far that is from the truth depends on the machine (a launch-bound GPU prices a
small step like a large one, a CPU prices positions).  This benchmark builds the
profile's reranker with random weights of the exact Qwen3-Reranker shape (speed does
not depend on the weights, and nothing is downloaded), runs every bucket full on the
head of a realistic chat query, and times it: one full step minus the head alone,
the median of ``repeats`` rounds, the buckets taken in turn within each round so
that a slow moment of a shared machine spreads over all of them.

It then plans the built-in chat candidates (30 and 100 of them) three ways, the
estimate, the measured times, and the measured times with several candidates packed
into a row where that is cheaper (``reranker.pack``), and times each plan side by
side, so the report says what the measured model and packing buy on this machine.
``--write-profile OUT.toml`` writes the profile again with ``bucket_costs`` set (its comments kept), for
``--profile OUT.toml``.

The step time depends on the head's capacity too (attention reads the head's keys);
the times are taken at the capacity of the built-in query's head (128 positions),
which is what chat queries use: only their ratios steer the planner.
"""

from __future__ import annotations

import dataclasses
import logging
import re
import statistics
import time
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

import torch

from benchmarks.common import require_device, write_whole
from benchmarks.qwen_models import MODEL_SHAPES, qwen_tokenizer, random_label, random_qwen3
from benchmarks.rerank import _device_name, _synchronize
from benchmarks.rerank_corpus import CANDIDATES, QUERY
from memory.config import Profile, QwenConfig, load_profile_file
from memory.errors import ConfigError
from memory.rerank.qwen import QwenReranker, resolve_device, resolve_dtype
from memory.rerank.qwen_static import (
    Run,
    Shape,
    StaticScorer,
    cheapest_plan,
    head_size,
    plan_runs,
)

log = logging.getLogger(__name__)

PLAN_SIZES = (30, 100)
_SIZE_IN_NAME = re.compile(r"(0\.6B|4B|8B)", re.IGNORECASE)
ProgressFn = Callable[[int], None]


def model_size_of(model: str) -> str:
    """The Qwen3-Reranker size a model name or folder names (``0.6B``, ``4B``, ``8B``).

    Raises:
        ConfigError: The name says no size.
    """
    found = _SIZE_IN_NAME.search(Path(model).name or model)
    if found is None:
        raise ConfigError(
            f"cannot tell the Qwen3-Reranker size from reranker.model {model!r}: "
            "pass --model-size 0.6B, 4B or 8B"
        )
    return found.group(1).upper()


def run_step_costs(
    profile: Profile,
    model_size: str | None = None,
    device: str | None = None,
    repeats: int = 20,
    plan_sizes: Sequence[int] = PLAN_SIZES,
    seed: int = 0,
    progress: ProgressFn | None = None,
) -> dict[str, Any]:
    """Time every bucket of ``profile``'s static path, then compare the two planners.

    Args:
        profile: A profile with ``backend = "transformers"`` and ``reranker.buckets``.
        model_size: ``0.6B``, ``4B``, ``8B`` or ``tiny``; default: from the model's name.
        device: Where to run (default the profile's device; ``auto`` resolves).
        repeats: Rounds timed (after one warm-up round).
        plan_sizes: Candidate counts whose plans are compared.
        seed: Seed of the random weights.
        progress: Called with 1 after each of the ``repeats + 1`` rounds.

    Returns:
        A JSON-ready dict: the machine, ``head_ms``, ``steps`` (per bucket: ms,
        positions, microseconds per position), ``bucket_costs`` (the profile key's
        value) and ``plans`` (per candidate count: both plans, their predicted and
        measured ms, and the measured model's speedup).

    Raises:
        ConfigError: The profile has no static path, the size is unknown, or the
            device is not available.
    """
    config = _static_config(profile, device)
    size = model_size or model_size_of(config.model)
    if size not in MODEL_SHAPES:
        raise ConfigError(f"bench model size must be one of {', '.join(MODEL_SHAPES)}")
    require_device(config.device)
    dtype = resolve_dtype(config.dtype, config.device)
    model = random_qwen3(MODEL_SHAPES[size], device=config.device, dtype=dtype, seed=seed)
    reranker = QwenReranker.from_model(model, qwen_tokenizer(), config)
    try:
        if config.torch_compile:
            reranker.wait_for_compile(config.compile_budget)
        return measure_step_costs(reranker, profile.name, size, repeats, plan_sizes, progress)
    finally:
        reranker.close()


def measure_step_costs(
    reranker: QwenReranker, profile: str, model_size: str, repeats: int = 20,
    plan_sizes: Sequence[int] = PLAN_SIZES, progress: ProgressFn | None = None,
) -> dict[str, Any]:
    """:func:`run_step_costs` on a loaded reranker with the static path (its compile settled).

    ``profile`` names where its buckets came from, for the report.

    Raises:
        ConfigError: The reranker has no static path.
    """
    config = reranker.config
    static = reranker.static_scorer  # the scorer the searches use (compiled once swapped in)
    if static is None:
        raise ConfigError("the static path did not load (see the log): nothing to time")
    device = str(reranker.device)
    timer = _Timer(static, device)
    chat = reranker.encode(QUERY, CANDIDATES)
    head = chat.head
    steps, head_ms = timer.steps(head, chat.tails, repeats, progress)
    costs = {shape: max(0.001, round(ms, 3)) for shape, ms in steps.items()}
    plans = [timer.compare(reranker, head, n, costs, repeats) for n in plan_sizes]
    return {
        "model": random_label(model_size),
        "profile": profile,
        "device": torch.device(device).type,
        "device_name": _device_name(device),
        "dtype": str(reranker.dtype).removeprefix("torch."),
        "torch_threads": torch.get_num_threads(),
        "graphs": bool(static.graphs),
        "compiled": static.compiled,
        "repeats": repeats,
        "head_tokens": len(head),
        "head_capacity": head_size(len(head), config.max_length)[1],
        "head_ms": round(head_ms, 3),
        "steps": [
            {"batch": b, "length": n, "ms": round(ms, 3), "positions": b * n,
             "us_per_position": round(1000 * ms / (b * n), 3)}
            for (b, n), ms in steps.items()
        ],
        "bucket_costs": bucket_costs(costs),
        "run_cost": config.bucket_run_cost,
        "plans": plans,
    }


def bucket_costs(costs: dict[Shape, float]) -> list[list[int | float]]:
    """The ``reranker.bucket_costs`` value for step times in ms, in the buckets' order."""
    return [[b, n, ms] for (b, n), ms in costs.items()]


def write_profile(source: Path, out: Path, costs: list[list[int | float]], note: str) -> None:
    """Write ``source``'s profile to ``out`` with ``reranker.bucket_costs = costs``.

    Everything else, comments included, is kept as it was (tomlkit edits the
    document rather than re-serialising it); the result is loaded once to check it.

    Raises:
        ConfigError: ``source`` is not TOML, or the written profile does not load.
    """
    import tomlkit
    from tomlkit.exceptions import TOMLKitError

    try:
        document = tomlkit.parse(source.read_text(encoding="utf-8"))
    except (OSError, TOMLKitError) as exc:
        raise ConfigError(f"{source}: cannot read the profile to copy it ({exc})") from None
    table = document["reranker"]
    value = tomlkit.array()
    value.multiline(True)
    value.extend(costs)
    if "bucket_costs" not in table:
        table.add(tomlkit.comment(note))
    table["bucket_costs"] = value
    write_whole(out, tomlkit.dumps(document), check=load_profile_file)


def _static_config(profile: Profile, device: str | None) -> QwenConfig:
    """The profile's Qwen settings with the static path to time, on ``device``."""
    reranker = profile.reranker
    if reranker.backend != "transformers" or not reranker.qwen.buckets:
        raise ConfigError(
            f"bench step-costs times the static-shape buckets of a transformers reranker; "
            f"profile {profile.name!r} has backend {reranker.backend!r}"
            + ("" if reranker.backend != "transformers" else " without reranker.buckets")
            + " (try --profile cuda)"
        )
    chosen = resolve_device(device or reranker.qwen.device)
    return dataclasses.replace(reranker.qwen, device=chosen, bucket_costs=(), concurrent=1)


class _Timer:
    """Times static steps on one scorer; every time waits for the device to finish."""

    def __init__(self, static: StaticScorer, device: str) -> None:
        self.static = static
        self.device = device

    def seconds(self, head: list[int], tails: Sequence[list[int]], runs: list[Run]) -> float:
        """Wall time of one ``score`` call (head step plus ``runs``)."""
        _synchronize(self.device)
        began = time.perf_counter()
        self.static.score(head, tails, runs)
        _synchronize(self.device)
        return time.perf_counter() - began

    def steps(
        self, head: list[int], real_tails: Sequence[list[int]], repeats: int,
        progress: ProgressFn | None,
    ) -> tuple[dict[Shape, float], float]:
        """Each bucket's step time in ms (full step minus head alone), and the head's.

        In the buckets' order (a profile's are sorted by length, then batch).
        """
        base = [token for tail in real_tails for token in tail]
        full = {shape: ([(base * (1 + shape[1] // len(base)))[: shape[1]]] * shape[0],
                        [Run(shape, list(range(shape[0])))])
                for shape in self.static.buckets}
        heads: list[float] = []
        with_step: dict[Shape, list[float]] = {shape: [] for shape in full}
        for turn in range(repeats + 1):  # round 0 warms every shape up, untimed
            alone = self.seconds(head, [], [])
            took = {shape: self.seconds(head, tails, runs) for shape, (tails, runs) in full.items()}
            if turn:
                heads.append(alone)
                for shape, seconds in took.items():
                    with_step[shape].append(seconds)
            if progress is not None:
                progress(1)
        head_ms = 1000 * statistics.median(heads)
        return ({shape: max(0.0, 1000 * statistics.median(times) - head_ms)
                 for shape, times in with_step.items()}, head_ms)

    def compare(
        self, reranker: QwenReranker, head: list[int], count: int, costs: dict[Shape, float],
        repeats: int,
    ) -> dict[str, Any]:
        """Plan ``count`` chat candidates by estimate, by measurement and packed by
        measurement (several candidates a row where that is cheaper); time all three."""
        docs = [CANDIDATES[i % len(CANDIDATES)] for i in range(count)]
        tails = reranker.encode(QUERY, docs).tails
        lengths = [len(t) for t in tails]
        buckets, run_cost = self.static.buckets, self.static.run_cost
        plans = {"estimate": plan_runs(lengths, buckets, run_cost)[0],
                 "measured": plan_runs(lengths, buckets, measured=costs)[0],
                 "packed": cheapest_plan(lengths, buckets, measured=costs, pack=True)[0]}
        timed: dict[str, list[float]] = {name: [] for name in plans}
        for turn in range(repeats + 1):
            for name, runs in plans.items():
                seconds = self.seconds(head, tails, runs)
                if turn:
                    timed[name].append(seconds)
        report: dict[str, Any] = {"candidates": count,
                                  "same_plan": plans["estimate"] == plans["measured"]}
        for name, runs in plans.items():
            report[name] = {
                "runs": [[*run.shape, len(run.indices)] for run in runs],
                "packed": any(run.per_row for run in runs),
                "positions": sum(run.shape[0] * run.shape[1] for run in runs),
                "predicted_ms": round(sum(costs[run.shape] for run in runs), 3),
                "ms": round(1000 * statistics.median(timed[name]), 3),
            }
        report["speedup"] = round(report["estimate"]["ms"] / max(1e-9, report["measured"]["ms"]), 3)
        report["packed_speedup"] = round(
            report["measured"]["ms"] / max(1e-9, report["packed"]["ms"]), 3)
        return report
