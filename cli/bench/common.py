"""What every benchmark shares: labelled queries, ranking metrics, percentiles, the machine."""

from __future__ import annotations

import json
import math
import os
import platform
import tempfile
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path

from memory.errors import ConfigError, ImportFormatError


@dataclass(frozen=True)
class Query:
    """One benchmark query with its evidence message ids."""

    id: str
    text: str
    guild_id: int
    channel_id: int
    relevant: frozenset[int]
    category: str = "all"


def load_queries(path: str | Path) -> list[Query]:
    """Read ``queries.jsonl`` (format: shared/datasets/README.md).

    Raises:
        ImportFormatError: The file is missing, or a line is not a labelled query.
    """
    path = Path(path)
    try:
        text = path.read_text(encoding="utf-8")
    except (OSError, UnicodeDecodeError) as exc:
        raise ImportFormatError(f"{path}: cannot read the queries ({exc})") from None
    queries = []
    for number, line in enumerate(text.splitlines(), start=1):
        if line.strip():
            try:
                queries.append(_query(json.loads(line)))
            except (ValueError, TypeError, KeyError) as exc:
                raise ImportFormatError(
                    f"{path}:{number}: not a labelled query ({type(exc).__name__}: {exc})"
                ) from None
    return queries


def _query(raw: dict) -> Query:
    return Query(
        id=str(raw["id"]), text=str(raw["query"]), guild_id=int(raw["guild_id"]),
        channel_id=int(raw["channel_id"]), relevant=frozenset(int(i) for i in raw["relevant"]),
        category=str(raw.get("category") or "all"),
    )


def score_ranking(ranked: list[int], relevant: frozenset[int], k: int) -> dict[str, float]:
    """Recall, hit, MRR and binary-gain nDCG at ``k`` for one query."""
    top = ranked[:k]
    found = [i for i, mid in enumerate(top) if mid in relevant]
    dcg = sum(1.0 / math.log2(i + 2) for i in found)
    ideal = sum(1.0 / math.log2(i + 2) for i in range(min(len(relevant), k)))
    return {
        "recall": len(found) / len(relevant) if relevant else 0.0,
        "hit": 1.0 if found else 0.0,
        "mrr": 1.0 / (found[0] + 1) if found else 0.0,
        "ndcg": dcg / ideal if ideal else 0.0,
    }


def percentile(values: list[float], p: float) -> float:
    """The ``p``-th percentile (0-100) by linear interpolation."""
    if not values:
        return 0.0
    ordered = sorted(values)
    pos = (len(ordered) - 1) * p / 100
    lo, hi = math.floor(pos), math.ceil(pos)
    return ordered[lo] + (ordered[hi] - ordered[lo]) * (pos - lo)



def machine_description() -> str:
    """A one-line description of the machine for benchmark records."""
    try:
        import torch

        threads = torch.get_num_threads()
    except ImportError:  # pragma: no cover
        threads = 0
    return (
        f"{cpu_model()}, {os.cpu_count()} cores, "
        f"Python {platform.python_version()}, torch threads {threads}"
    )


def cpu_model() -> str:
    """The CPU's marketing name where Linux says it, else the architecture."""
    try:
        with open("/proc/cpuinfo", encoding="utf-8") as info:
            for line in info:
                if line.startswith("model name"):
                    return line.partition(":")[2].strip()
    except OSError:  # not Linux: platform is the best there is
        pass
    return platform.processor() or platform.machine()


def require_device(device: str) -> None:
    """Refuse a ``--device`` this torch cannot use, before any model is built.

    Raises:
        ConfigError: ``cuda`` or ``mps`` asked for where torch does not see one.
    """
    import torch

    kind = device.split(":")[0]
    if kind == "cuda" and not torch.cuda.is_available():
        raise ConfigError(
            f"--device {device}: torch {torch.__version__} sees no CUDA GPU here; run on a "
            "machine with one (scripts/gpu-bench.sh) or use --device cpu"
        )
    mps = getattr(torch.backends, "mps", None)
    if kind == "mps" and not (mps is not None and mps.is_available()):
        raise ConfigError(f"--device {device}: torch sees no Apple GPU here; use --device cpu")


@contextmanager
def scratch_location(postgres: str | None = None, *, name: str = "bench",
                     db_dir: str | Path | None = None) -> Iterator[str]:
    """A throw-away database for one benchmark run, removed afterwards.

    Args:
        postgres: A PostgreSQL server's URL: a new database on it (the role needs
            CREATEDB); ``None``: a temporary SQLite file.
        name: The SQLite file's name.
        db_dir: Where the SQLite file's temporary folder goes.
    """
    if postgres:
        from memory.storage.postgres.connection import scratch_database

        with scratch_database(postgres) as url:
            yield url
        return
    with tempfile.TemporaryDirectory(prefix="memory-bench-", dir=db_dir) as tmp:
        yield str(Path(tmp) / f"{name}.sqlite3")
