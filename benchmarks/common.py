"""What every benchmark shares: percentiles, the machine, scratch databases.

Labelled queries and their ranking metrics are in :mod:`cli.scoring` (the demo
scores its questions with them too).
"""

from __future__ import annotations

import math
import os
import platform
import tempfile
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from pathlib import Path

from memory.errors import ConfigError


def write_whole(path: Path, text: str, check: Callable[[Path], object] | None = None) -> None:
    """Write ``text`` to ``path`` whole or not at all, ``check``-ed first if given.

    The text goes to a hidden file beside ``path``, which ``check`` may read (raising
    to refuse it) and which then replaces ``path``: a benchmark killed at its time limit,
    or a check that fails, leaves the earlier ``path`` (or none) and nothing half-written.
    """
    partial = path.with_name(f".{path.name}.partial{path.suffix}")
    try:
        partial.write_text(text, encoding="utf-8")
        if check is not None:
            check(partial)
        os.replace(partial, path)
    finally:
        partial.unlink(missing_ok=True)


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
