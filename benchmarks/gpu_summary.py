"""``bench gpu-summary DIR``: one table of issue 33's GPU rows from scripts/gpu-bench.sh's files.

``scripts/gpu-bench.sh run OUT`` writes one JSON file per measurement into a folder
(``OUT/raw``, packed into ``OUT/raw.tar.gz`` afterwards); this reads them and writes
``summary.md`` (a markdown table: row, measured,
target, met) and ``summary.json`` (the same rows as data) beside them.  A file
that is missing (a step failed or was skipped) gives a row that says so instead of
stopping the summary.
"""

from __future__ import annotations

import json
import logging
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class Row:
    """One line of the summary.

    Attributes:
        row: What was measured.
        measured: The headline number, with its unit.
        target: Issue 33's target.
        met: Whether the target is met (``None``: no target, or not measured).
        detail: The numbers behind the headline.
        source: The file it came from.
    """

    row: str
    measured: str
    target: str
    met: bool | None
    detail: str
    source: str


def summarize(folder: Path) -> list[Row]:
    """Every row of issue 33's table from the files in ``folder``."""
    rows = [
        _rerank(folder, "rerank-0.6B.json", "0.6B, 30 candidates, static path", 8.0),
        _rerank(folder, "rerank-0.6B-100.json", "0.6B, 100 candidates, static path", 20.0),
        _rerank(folder, "rerank-8B.json", "8B, 30 candidates, static path", 50.0),
        _peer(folder, rows_best=_best_ms(folder / "rerank-0.6B.json")),
        _concurrent(folder, "concurrent-0.6B.json", "0.6B, 16 concurrent searches", 16),
        _concurrent(folder, "concurrent-0.6B-compiled.json",
                    "0.6B, 16 concurrent searches, compiled steps", 16),
        _concurrent(folder, "concurrent-8B.json", "8B, 16 concurrent searches", 16),
        _concurrent(folder, "concurrent-8B-compiled.json",
                    "8B, 16 concurrent searches, compiled steps", 16),
        _concurrent(folder, "concurrent-0.6B-timed.json",
                    "0.6B, 16 concurrent searches, measured step times", 16),
        _concurrent(folder, "concurrent-8B-timed.json",
                    "8B, 16 concurrent searches, measured step times", 16),
        _concurrent(folder, "concurrent-0.6B-packed.json",
                    "0.6B, 16 concurrent searches, packed rows", 16),
        _concurrent(folder, "concurrent-8B-packed.json",
                    "8B, 16 concurrent searches, packed rows", 16),
        _embedder(folder, "embedder-float16.json"),
        _step_costs(folder, "step-costs-0.6B.json", "0.6B"),
        _step_costs(folder, "step-costs-8B.json", "8B"),
    ]
    return rows


def write_summary(folder: Path) -> dict[str, Any]:
    """Write ``summary.md`` and ``summary.json`` into ``folder``; return the JSON data."""
    rows = summarize(folder)
    data = {"folder": str(folder), "rows": [asdict(r) for r in rows]}
    (folder / "summary.json").write_text(json.dumps(data, indent=2) + "\n", encoding="utf-8")
    (folder / "summary.md").write_text(markdown(rows), encoding="utf-8")
    return data


def markdown(rows: list[Row]) -> str:
    """The rows as a markdown table."""
    mark = {True: "yes", False: "**no**", None: "—"}
    lines = ["| row | measured | target | met | detail | file |", "|---|---:|---|---|---|---|"]
    lines += [
        f"| {r.row} | {r.measured} | {r.target} | {mark[r.met]} | {r.detail} | {r.source} |"
        for r in rows
    ]
    return "\n".join(lines) + "\n"


def _load(path: Path) -> dict[str, Any] | None:
    try:
        return json.loads(path.read_text(encoding="utf-8"))
    except (OSError, ValueError) as exc:
        log.warning("summary: %s not read (%s)", path, exc)
        return None


def _missing(row: str, target: str, source: str) -> Row:
    return Row(row, "not measured", target, None, "the file is missing or unreadable", source)


def _best_ms(path: Path) -> float | None:
    data = _load(path) if path.exists() else None
    if data is None:
        return None
    static = [v for v in data["variants"] if v["buckets"]]
    return min(v["seconds"] for v in static) * 1000 if static else None


def _rerank(folder: Path, name: str, row: str, target_ms: float) -> Row:
    data = _load(folder / name)
    target = f"≤ {target_ms:g} ms"
    if data is None:
        return _missing(row, target, name)
    variants = data["variants"]
    static = [v for v in variants if v["buckets"]] or variants
    best = min(static, key=lambda v: v["seconds"])
    ms = best["seconds"] * 1000
    judged = {j["name"]: j for j in data["recommended"].get("judgements", [])}
    detail = "; ".join(f"{v['name']} {v['seconds'] * 1000:.1f} ms" + _static_note(v, judged)
                       for v in variants)
    detail += f"; recommended: {data['recommended']['variant']}; {data['device_name']}"
    return Row(row, f"{ms:.2f} ms ({best['name']})", target, ms <= target_ms, detail, name)


def _static_note(variant: dict[str, Any], judged: dict[str, dict[str, Any]]) -> str:
    """A static variant's load time and how far it is from what it was judged against."""
    if not variant["buckets"]:
        return ""
    judgement = judged.get(variant["name"])
    if judgement is not None and judgement["baseline"] != variant["name"]:
        against = f", Δ {judgement['baseline']} {judgement['baseline_diff']:.4f}"
    elif variant.get("eager_diff") is not None:  # a report from before the judgements
        against = f", Δ eager {variant['eager_diff']:.4f}"
    else:
        against = ""
    return f" (load {variant['load_seconds']:.1f} s{against})"


def _peer(folder: Path, rows_best: float | None) -> Row:
    name, row = "peer-0.6B.json", "peer: sentence-transformers CrossEncoder, Qwen3-0.6B-shaped"
    data = _load(folder / name)
    if data is None:
        return _missing(row, "the static path stays ahead", name)
    ms = data["seconds"] * 1000
    met = None if rows_best is None else rows_best < ms
    ahead = f"static path best {rows_best:.1f} ms" if rows_best is not None else "no static row"
    return Row(row, f"{ms:.1f} ms", "the static path stays ahead", met,
               f"{data['candidates']} pairs, {data['dtype']}; {ahead}", name)


def _concurrent(folder: Path, name: str, row: str, level: int) -> Row:
    target = "≥ 4× one at a time, p95 ≤ 50 ms"
    data = _load(folder / name)
    if data is None:
        return _missing(row, target, name)
    levels = {item["concurrent"]: item for item in data["levels"]}
    at = levels.get(level) or levels[max(levels)]
    met = at["speedup"] >= 4 and at["p95_ms"] <= 50 if at["concurrent"] == level else None
    detail = "; ".join(
        f"N={n}: {v['searches_per_s']:.1f}/s, p95 {v['p95_ms']:.0f} ms" for n, v in levels.items()
    )
    if data.get("compiled"):
        detail += "; compiled steps"
    elif data.get("torch_compile"):  # given up past its budget: the eager steps were timed
        detail += "; eager steps (the compile was given up or failed)"
    measured = f"{at['searches_per_s']:.1f} searches/s (×{at['speedup']:.2f}), p95 {at['p95_ms']:.0f} ms"
    return Row(row, measured, target, met, detail, name)


def _embedder(folder: Path, name: str) -> Row:
    row, target = "embedder (MiniLM) single query", "p95 ≤ 2 × p50"
    data = _load(folder / name)
    if data is None:
        return _missing(row, target, name)
    p50, p95 = data["query_ms"]["p50"], data["query_ms"]["p95"]
    return Row(row, f"p50 {p50:.1f} ms, p95 {p95:.1f} ms", target, p95 <= 2 * p50,
               f"{data['dtype']}, {data['import_messages_per_s']:.0f} messages/s import", name)


def _step_costs(folder: Path, name: str, size: str) -> Row:
    row, target = f"{size} planner: measured step times vs estimate", "faster or equal"
    data = _load(folder / name)
    if data is None:
        return _missing(row, target, name)
    plans = data["plans"]
    measured = ", ".join(f"×{p['speedup']:.2f}" for p in plans)
    detail = "; ".join(
        f"{p['candidates']}: estimate {p['estimate']['ms']:.1f} ms, measured "
        f"{p['measured']['ms']:.1f} ms" + (" (same plan)" if p["same_plan"] else "")
        for p in plans
    )
    steps = ", ".join(f"{s['batch']}x{s['length']} {s['ms']:.2f}" for s in data["steps"])
    return Row(row, measured, target, all(p["speedup"] >= 0.98 for p in plans),
               f"{detail}; head {data['head_ms']:.2f} ms; steps ms: {steps}", name)
