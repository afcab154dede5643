"""Entry point: ``python bot.py --help`` (the ``discord-memory-bot`` command).

The command line lives in ``cli/`` (its ``run`` command starts the Discord bot,
:class:`cogs.memory.MemoryBot`), the Discord glue in ``cogs/`` and the engine in
``memory/``.
"""

from __future__ import annotations

import importlib.util
import os
import sys
from collections.abc import Sequence
from pathlib import Path

from cli.app import cli_group
from cli.app import main as cli_main


def main(argv: Sequence[str] | None = None) -> int:
    """Run the command line (the offline tools plus ``run``); returns the exit status."""
    idle_threads_sleep()
    prog = "bot.py" if argv is not None or sys.argv[0].endswith(".py") else Path(sys.argv[0]).name
    return cli_main(argv, prog_name=prog)


def add_benchmarks() -> None:
    """Add ``bench`` when the benchmarks are here.

    They live in ``benchmarks/`` beside ``cli/``, in a source checkout only: a wheel
    (``pip install .``) ships the bot, the engine and the CLI, not the tooling that
    measures them.
    """
    if importlib.util.find_spec("benchmarks") is not None:
        from benchmarks import bench

        cli_group.add_command(bench)


def idle_threads_sleep() -> None:
    """Let torch's idle OpenMP workers sleep at once instead of spinning.

    By default each worker spins for about 10 ms of CPU after every parallel region
    (a query's embedding), taking a core from the SQLite work that follows: the
    vector KNN right after an embedding ran 14 ms instead of 9 on a 2-core machine
    (BENCHMARKS.md).  OpenMP reads the policy when torch is first imported, which
    the engine does lazily, after this; a value set in the environment wins.
    """
    os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")


add_benchmarks()

if __name__ == "__main__":
    sys.exit(main())
