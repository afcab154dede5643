"""``bench gpu-rows``: issue 33's rows of one model size from one process, each thing loaded once.

``scripts/gpu-bench.sh`` has one device call of at most six minutes.  Run as separate
commands (``bench rerank --quick`` at 30 and at 100 candidates, ``bench rerank
--concurrent`` on the eager graphs and on the compiled steps, ``bench step-costs``, the
concurrent row again with the measured step times), every process built the model,
captured the graphs and compiled the steps again: on the H200 a compile took 21–35 s a
process, a step 70–75 s, and the rows did not fit one call.  Here the model is built
once, each variant of ``bench rerank --quick`` is loaded once and timed at every
candidate count (the compiled variant compiles on the graphs variant's reranker, as a
bot with ``torch_compile`` does), and before the static variants are closed the same
loaded reranker serves the concurrent levels: on the steps a bot runs eagerly (replayed
as CUDA graphs where CUDA is) and on the compiled ones, which also time each bucket's
step (``bench step-costs``) and then run the levels again planning with those times.

Into ``out`` go the files the separate commands write, under the names ``bench
gpu-summary`` reads (``SIZE`` is the model size, or ``label``):

* ``rerank-SIZE.json`` for 30 candidates, ``rerank-SIZE-N.json`` for any other count;
* ``concurrent-SIZE.json`` (eager steps) and ``concurrent-SIZE-compiled.json``;
* with ``step_rounds``: ``step-costs-SIZE.json`` (on the compiled steps),
  ``PROFILE-timed.toml`` (the shipped profile with those times as ``bucket_costs``) and
  ``concurrent-SIZE-timed.json`` (the compiled levels, planned with those times);
* ``concurrent-SIZE-packed.json``: the compiled levels planned packed (``reranker.pack``:
  several candidates a row), with the measured step times when there are some; the
  ``packed`` variant of the rerank reports runs on the same reranker.

Every file is written as soon as its numbers are measured (the rerank reports after
each variant, each file whole or not at all), so a run killed at its time limit keeps
what it measured; a row or variant that fails is logged and the others still run.
"""

from __future__ import annotations

import json
import logging
from collections.abc import Callable
from dataclasses import dataclass, field
from functools import partial
from pathlib import Path
from typing import Any

import torch

from benchmarks.common import write_whole
from benchmarks.rerank import (
    BenchSettings,
    ProgressFn,
    Variant,
    profile_for,
    run_rerank_counts,
)
from benchmarks.rerank_concurrent import check_levels, concurrency_report, measure_levels
from benchmarks.step_costs import measure_step_costs, write_profile
from memory.config import load_profile
from memory.errors import ConfigError
from memory.rerank.qwen import QwenReranker

log = logging.getLogger(__name__)

REFERENCE_COUNT = 30
"""The candidate count whose report is ``rerank-SIZE.json`` (issue 33's table)."""


@dataclass(frozen=True)
class RowPlan:
    """What one ``bench gpu-rows`` run measures besides ``bench rerank --quick``.

    Attributes:
        candidates: Candidate counts of the rerank rows; the first is also each
            concurrent search's.
        levels: Concurrent searches in flight, per level.
        rounds: Searches each thread runs per level.
        step_rounds: Rounds of ``bench step-costs`` on the compiled steps (0: none, and
            no timed row).
        label: The size in the file names (default the model size; the CPU smoke run
            names the tiny model's files after the size it stands in for).
    """

    candidates: tuple[int, ...] = (30, 100)
    levels: tuple[int, ...] = (1, 4, 16, 64)
    rounds: int = 2
    step_rounds: int = 0
    label: str | None = None


def served_rows(variant: Variant, device_type: str) -> str | None:
    """Which concurrent row a loaded variant serves: ``eager``, ``compiled`` or none.

    ``eager`` is the static path as a bot runs it before (or without) the compile:
    replayed as CUDA graphs on CUDA, op by op elsewhere, so on CUDA the graphs variant
    serves it and the op-by-op one does not.
    """
    if not variant.buckets:
        return None
    if variant.torch_compile:
        return "compiled"
    return "eager" if variant.cuda_graphs == (device_type == "cuda") else None


@dataclass
class GpuRows:
    """The rows measured on the rerankers ``bench rerank`` loads, written into ``out``.

    Args:
        out: The folder the files go into.
        settings: The ``bench rerank`` settings (model size, device, one dtype,
            repeats, compile budget).
        plan: The candidate counts, concurrency levels and step-cost rounds.
    """

    out: Path
    settings: BenchSettings
    plan: RowPlan
    written: list[str] = field(init=False, default_factory=list)
    failed: list[str] = field(init=False, default_factory=list)
    _costs: dict[str, Any] | None = field(init=False, default=None)  # step costs measured

    def run(self, progress: ProgressFn | None = None) -> dict[str, Any]:
        """Measure every row.

        Args:
            progress: Called as ``progress(done, total, variant)`` after each variant.

        Returns:
            The model size, the folder, ``written`` (file names) and ``failed`` (the
            files or variants that could not be measured; see the log).

        Raises:
            ConfigError: No dtype, a level below 1, an unknown size, or a device torch
                does not see (before anything is measured).
            Exception: Whatever made the reference variant fail (nothing compares
                without it).
        """
        if self.settings.dtype is None:
            raise ConfigError("bench gpu-rows times one dtype: pass --dtype")
        if len(set(self.plan.candidates)) != len(self.plan.candidates):
            raise ConfigError(f"--candidates must not repeat a count, got {self.plan.candidates}")
        check_levels(self.plan.levels)
        self.out.mkdir(parents=True, exist_ok=True)
        run_rerank_counts(self.plan.candidates, self.settings, progress,
                          partial=self._rerank_reports, serve=self._serve, failed=self.failed)
        return {"model_size": self.settings.model_size, "out": str(self.out),
                "written": self.written, "failed": self.failed}

    @property
    def _size(self) -> str:
        return self.plan.label or self.settings.model_size

    def _rerank_reports(self, reports: list[dict[str, Any]]) -> None:
        for count, report in zip(self.plan.candidates, reports, strict=True):
            suffix = "" if count == REFERENCE_COUNT else f"-{count}"
            self._write(f"rerank-{self._size}{suffix}.json", report)

    def _serve(self, variant: Variant, reranker: QwenReranker) -> None:
        """The concurrent rows (and step costs) on a static variant while it is loaded."""
        row = served_rows(variant, torch.device(str(reranker.device)).type)
        if variant.static.pack:  # the compiled variant's reranker again, planning packed
            if row == "compiled":
                self._measured(f"concurrent-{self._size}-packed.json", self._packed, reranker)
        elif row == "eager":
            self._measured(f"concurrent-{self._size}.json", self._concurrent, reranker)
        elif row == "compiled":
            self._measured(f"concurrent-{self._size}-compiled.json",
                           partial(self._concurrent, compiled=True), reranker)
            if self.plan.step_rounds:
                costs = self._measured(f"step-costs-{self._size}.json", self._step_costs,
                                       reranker)
                self._costs = costs
                if costs is not None:
                    self._timed_profile(costs)
                    self._measured(f"concurrent-{self._size}-timed.json",
                                   lambda r: self._timed(r, costs), reranker)

    def _measured(
        self, name: str, measure: Callable[[QwenReranker], dict[str, Any]],
        reranker: QwenReranker,
    ) -> dict[str, Any] | None:
        """Write ``measure(reranker)`` as ``name``; a failure is logged and the others go on."""
        try:
            report = measure(reranker)
            self._write(name, report)
        except Exception:  # one row's failure must not cost the rows after it
            log.exception("gpu-rows: %s not measured", name)
            self.failed.append(name)
            return None
        return report

    def _concurrent(self, reranker: QwenReranker, compiled: bool = False) -> dict[str, Any]:
        """The levels on ``reranker``; ``compiled``: its steps were asked to compile (the
        compiled variant compiles on the graphs variant's reranker, whose config says not)."""
        count = self.plan.candidates[0]
        results = measure_levels(reranker, self.plan.levels, count, self.plan.rounds)
        return concurrency_report(reranker, results, self.settings.model_size, count,
                                  self.plan.rounds, torch_compile=compiled)

    def _step_costs(self, reranker: QwenReranker) -> dict[str, Any]:
        return measure_step_costs(reranker, profile_for(self.settings.model_size),
                                  self.settings.model_size, self.plan.step_rounds)

    def _timed(self, reranker: QwenReranker, costs: dict[str, Any] | None) -> dict[str, Any]:
        """The compiled levels again, the planner minimising the measured step times
        (``costs``; ``None``: the profile's estimate)."""
        scorer = reranker.static_scorer
        if scorer is None:
            raise ConfigError("the static path was dropped (see the log): no timed row")
        planned_by = scorer.measured
        if costs is not None:
            scorer.measured = {(b, n): ms for b, n, ms in costs["bucket_costs"]}
        try:
            return self._concurrent(reranker, compiled=True)
        finally:
            scorer.measured = planned_by

    def _packed(self, reranker: QwenReranker) -> dict[str, Any]:
        """The compiled levels planned packed, on the step times this run measured if any."""
        return self._timed(reranker, self._costs)

    def _timed_profile(self, costs: dict[str, Any]) -> None:
        """The shipped profile with the measured ``bucket_costs``, for ``--profile``."""
        profile = load_profile(profile_for(self.settings.model_size))
        timed = self.out / f"{profile.name}-timed.toml"
        note = (f"measured by `bench gpu-rows` on {costs['device_name']} "
                f"({costs['dtype']}, {costs['model']}): ms per step")
        try:
            write_profile(Path(profile.source), timed, costs["bucket_costs"], note)
        except Exception:  # the step times are written already; only the copy is lost
            log.exception("gpu-rows: %s not written", timed)
            self.failed.append(timed.name)
            return
        self.written.append(timed.name)

    def _write(self, name: str, data: dict[str, Any]) -> None:
        """Write ``name`` whole or not at all: a kill mid-write keeps the last version."""
        write_whole(self.out / name, json.dumps(data, indent=2, default=str) + "\n")
        if name not in self.written:
            self.written.append(name)
