"""``bench plan``: how long the static path's planner takes on the host, per search.

Before a static step runs, the planner (:func:`memory.rerank.qwen_static.cheapest_plan`)
chooses the bucket shapes for a search's tails, or for a group of searches scored
together: pure Python on the host, while the GPU waits for its next step.  This
times it with a profile's buckets, ``bucket_costs`` and ``pack``, on seeded chat-like
tail lengths (25-70 tokens: a chat message and the prompt's suffix), for one search
and for groups of searches planned together.  No model is loaded.
"""

from __future__ import annotations

import random
import statistics
import time
from collections.abc import Sequence
from typing import Any

from benchmarks.common import machine_description
from memory.config import Profile
from memory.errors import ConfigError
from memory.rerank.qwen_static import cheapest_plan, plan_cost

TAIL_LENGTHS = (25, 70)  # tokens of a chat candidate's tail, as `bench rerank` builds them


def run_plan_timing(profile: Profile, cases: Sequence[tuple[int, int]], repeats: int,
                    seed: int = 0) -> dict[str, Any]:
    """Median planning time of each ``(candidates per search, searches)`` case.

    Raises:
        ConfigError: The profile's reranker has no ``buckets`` (nothing to plan).
    """
    qwen = profile.reranker.qwen
    if not qwen.buckets:
        raise ConfigError(f"profile {profile.name!r}: reranker.buckets is empty, so no "
                          "static plans are made; use a profile with buckets (cuda, cuda-8b)")
    measured = {(b, n): ms for b, n, ms in qwen.bucket_costs} or None
    prices = (qwen.buckets, qwen.bucket_run_cost, measured)
    rng = random.Random(seed)
    rows = []
    for per_search, searches in cases:
        lengths = [rng.randint(*TAIL_LENGTHS) for _ in range(per_search * searches)]
        owners = [i // per_search for i in range(len(lengths))]
        timings: dict[bool, list[float]] = {False: [], True: []}
        for _ in range(repeats):
            for pack in (False, True):  # side by side, taking turns
                started = time.perf_counter()
                cheapest_plan(lengths, *prices, pack=pack, owners=owners)
                timings[pack].append((time.perf_counter() - started) * 1e3)
        row: dict[str, Any] = {"candidates": per_search, "searches": searches}
        for pack, label in ((False, "one_a_row"), (True, "packed")):
            runs, _ = cheapest_plan(lengths, *prices, pack=pack, owners=owners)
            row[label] = {"plan_ms": round(statistics.median(timings[pack]), 4),
                          "steps": len(runs), "planned_cost": round(plan_cost(runs, *prices), 3)}
        rows.append(row)
    return {
        "profile": profile.name, "machine": machine_description(), "repeats": repeats,
        "tail_lengths": list(TAIL_LENGTHS), "pack": qwen.pack,
        "costs": "bucket_costs (ms)" if measured else "estimate (positions)", "cases": rows,
    }
