"""Real servers the tests start as child processes on 127.0.0.1.

:func:`serving` owns the life of one: it starts the command with its output in a log
file, waits until ``GET /health`` answers 200 (or says why not, with the log's tail),
yields, and stops the process, killing it if it lingers.
"""

from __future__ import annotations

import socket
import subprocess
import time
from collections.abc import Iterator, Sequence
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import httpx


def free_port() -> int:
    """A TCP port on 127.0.0.1 that nothing listens on right now."""
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


@contextmanager
def serving(name: str, args: Sequence[str], url: str, log_path: Path, *, startup_s: float,
            poll_s: float, stop_s: float, **popen: Any) -> Iterator[str]:
    """Run ``args`` (a server listening at ``url``) until the block ends; yields ``url``.

    Args:
        name: What the errors call the server.
        args: The command line.
        url: Its base URL; ``{url}/health`` answers 200 once it is ready.
        log_path: Where its stdout and stderr go.
        startup_s: How long it may take to become ready.
        poll_s: Pause between two health checks.
        stop_s: How long it may take to exit after SIGTERM before it is killed.
        **popen: More arguments for :class:`subprocess.Popen` (``env``, ``cwd``).

    Raises:
        RuntimeError: The server exited or was not ready in ``startup_s``.
    """
    with open(log_path, "wb") as log:
        proc = subprocess.Popen(list(args), stdout=log, stderr=subprocess.STDOUT, **popen)
    try:
        _wait_ready(name, proc, url, log_path, startup_s, poll_s)
        yield url
    finally:
        proc.terminate()
        try:
            proc.wait(timeout=stop_s)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()


def _wait_ready(name: str, proc: subprocess.Popen, url: str, log_path: Path, limit: float,
                poll_s: float) -> None:
    deadline = time.monotonic() + limit
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            raise RuntimeError(f"{name} exited ({proc.returncode}):\n"
                               f"{log_path.read_text(errors='replace')[-3000:]}")
        try:
            if httpx.get(f"{url}/health", timeout=2.0).status_code == 200:
                return
        except httpx.HTTPError:
            pass
        time.sleep(poll_s)
    raise RuntimeError(f"{name} not ready after {limit:.0f} s:\n"
                       f"{log_path.read_text(errors='replace')[-3000:]}")
