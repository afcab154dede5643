"""``bench gpu-rows``: issue 33's rows of one model size from one process, each thing loaded once.

``scripts/gpu-bench.sh`` has one device call of at most six minutes.  Run as separate
commands (``bench rerank --quick`` at 30 and at 100 candidates, ``bench rerank
--concurrent`` on the eager graphs and on the compiled steps, ``bench step-costs``),
every process built the model, captured the graphs and compiled the steps again:
on the H200 a compile took 21–35 s a process, a step 70–75 s, and the rows did not fit
one call.  Here the model is built once, each variant of ``bench rerank --quick`` is
loaded once and timed at every candidate count, and before the static variants are
closed the same loaded reranker serves the concurrent levels: the replayed steps (the
eager ones off CUDA) and the compiled ones, which also time each bucket's step
(``bench step-costs``).

Into ``out`` go the files the separate commands write, under the names
``bench gpu-summary`` reads (``SIZE`` is the model size, or ``label``):

* ``rerank-SIZE.json``: the first candidate count; ``rerank-SIZE-N.json`` each further one;
* ``concurrent-SIZE.json``: the levels on the eager static steps, replayed as CUDA graphs
  where CUDA is; ``concurrent-SIZE-compiled.json``: on the compiled steps;
* with ``step_rounds``: ``step-costs-SIZE.json`` (on the compiled steps) and
  ``PROFILE-timed.toml``, the shipped profile with those times as ``bucket_costs``.

Every file is written as soon as its numbers are measured (the rerank reports after
each variant), so a run killed at its time limit keeps what it measured.
"""

from __future__ import annotations

import json
import logging
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch

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


@dataclass(frozen=True)
class RowPlan:
    """What one ``bench gpu-rows`` run measures besides ``bench rerank --quick``.

    Attributes:
        candidates: Candidate counts of the rerank rows; the first is also each
            concurrent search's.
        levels: Concurrent searches in flight, per level.
        rounds: Searches each thread runs per level.
        step_rounds: Rounds of ``bench step-costs`` on the compiled steps (0: none).
        label: The size in the file names (default the model size; the CPU smoke run
            names the tiny model's files after the size it stands in for).
    """

    candidates: tuple[int, ...] = (30, 100)
    levels: tuple[int, ...] = (1, 4, 16, 64)
    rounds: int = 2
    step_rounds: int = 0
    label: str | None = None


@dataclass
class GpuRows:
    """The rows measured on the rerankers ``bench rerank`` loads, written into ``out``.

    Args:
        out: The folder the files go into.
        settings: The ``bench rerank`` settings (model size, device, dtype, repeats,
            compile budget).
        plan: The candidate counts, concurrency levels and step-cost rounds.
    """

    out: Path
    settings: BenchSettings
    plan: RowPlan
    written: list[str] = field(default_factory=list)
    failed: list[str] = field(default_factory=list)

    def run(self, progress: ProgressFn | None = None) -> dict[str, Any]:
        """Measure every row; return what was written and which rows failed.

        Raises:
            ConfigError: A level below 1, an unknown size or dtype, or a device torch
                does not see (before anything is measured).
        """
        check_levels(self.plan.levels)
        self.out.mkdir(parents=True, exist_ok=True)
        run_rerank_counts(self.plan.candidates, self.settings, progress,
                          partial=self._rerank_reports, serve=self._serve)
        return {"model_size": self.settings.model_size, "out": str(self.out),
                "written": self.written, "failed": self.failed}

    @property
    def _label(self) -> str:
        return self.plan.label or self.settings.model_size

    def _rerank_reports(self, reports: list[dict[str, Any]]) -> None:
        size = self._label
        for index, (count, report) in enumerate(zip(self.plan.candidates, reports, strict=True)):
            self._write(f"rerank-{size}.json" if index == 0 else f"rerank-{size}-{count}.json",
                        report)

    def _serve(self, variant: Variant, reranker: QwenReranker) -> None:
        """The concurrent rows (and step costs) on a static variant while it is loaded."""
        if not variant.buckets:
            return
        size = self._label
        if variant.torch_compile:
            self._measured(f"concurrent-{size}-compiled.json", self._concurrent, reranker)
            if self.plan.step_rounds:
                self._measured(f"step-costs-{size}.json", self._step_costs, reranker)
        elif variant.cuda_graphs == (torch.device(str(reranker.device)).type == "cuda"):
            self._measured(f"concurrent-{size}.json", self._concurrent, reranker)

    def _measured(
        self, name: str, measure: Callable[[QwenReranker], dict[str, Any]],
        reranker: QwenReranker,
    ) -> None:
        """Write ``measure(reranker)`` as ``name``; a failure is logged and the others go on."""
        try:
            self._write(name, measure(reranker))
        except Exception:  # one row's failure must not cost the rows after it
            log.exception("gpu-rows: %s not measured", name)
            self.failed.append(name)

    def _concurrent(self, reranker: QwenReranker) -> dict[str, Any]:
        count = self.plan.candidates[0]
        results = measure_levels(reranker, self.plan.levels, count, self.plan.rounds)
        return concurrency_report(reranker, results, self.settings.model_size, count,
                                  self.plan.rounds)

    def _step_costs(self, reranker: QwenReranker) -> dict[str, Any]:
        profile = load_profile(profile_for(self.settings.model_size))
        report = measure_step_costs(reranker, profile.name, self.settings.model_size,
                                    self.plan.step_rounds)
        timed = self.out / f"{profile.name}-timed.toml"
        try:
            note = (f"measured by `bench gpu-rows` on {report['device_name']} "
                    f"({report['dtype']}, {report['model']}): ms per step")
            write_profile(Path(profile.source), timed, report["bucket_costs"], note)
            report["written"] = str(timed)
            self.written.append(timed.name)
        except (ConfigError, OSError) as exc:  # the times are kept even when the profile is not
            log.error("gpu-rows: %s not written: %s", timed, exc)
            self.failed.append(timed.name)
        return report

    def _write(self, name: str, data: dict[str, Any]) -> None:
        path = self.out / name
        path.write_text(json.dumps(data, indent=2, default=str) + "\n", encoding="utf-8")
        if name not in self.written:
            self.written.append(name)
