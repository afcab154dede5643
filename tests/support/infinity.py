"""A real Infinity server (PyPI's infinity-emb) serving a tiny local cross-encoder.

``scripts/infinity.sh`` installs infinity-emb in a virtual environment of its own in
a cache folder (it pins sentence-transformers<4 and numpy<2, which the bot's
environment cannot hold); the tests marked ``infinity`` find it there or at
``$INFINITY_EMB`` and skip with a reason when it is absent.
"""

from __future__ import annotations

import os
import subprocess
import time
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

import httpx

from tests.support.llama import free_port

INFINITY_VERSION = os.environ.get("INFINITY_VERSION", "0.0.78")
INFINITY_ROOT = (
    Path(os.environ.get("INFINITY_CACHE", Path(os.environ.get("XDG_CACHE_HOME", Path.home() / ".cache"))
                        / "discord-memory-bot" / "infinity"))
    / INFINITY_VERSION
)
SERVED_NAME = "tiny-cross-encoder"


def infinity_binary() -> Path | None:
    """The ``infinity_emb`` executable, or ``None`` when it is not installed."""
    if os.environ.get("INFINITY_EMB"):
        path = Path(os.environ["INFINITY_EMB"])
    elif (INFINITY_ROOT / ".installed").is_file():
        path = INFINITY_ROOT / "venv" / "bin" / "infinity_emb"
    else:
        return None
    return path if path.is_file() and os.access(path, os.X_OK) else None


def missing_reason() -> str | None:
    """Why the Infinity tests cannot run here, or ``None`` when they can."""
    if infinity_binary() is None:
        return ("Infinity is not installed: run `bash scripts/infinity.sh` (a few minutes) "
                "or set INFINITY_EMB to an infinity_emb executable")
    return None


@contextmanager
def infinity_server(model: Path, startup_s: float = 180.0) -> Iterator[str]:
    """Serve ``model`` (a cross-encoder folder) with Infinity on a free port; yields its URL.

    Raises:
        RuntimeError: The server exited or did not answer in ``startup_s``.
    """
    binary = infinity_binary()
    assert binary is not None, missing_reason()
    port = free_port()
    log_path = model.parent / f"infinity.{port}.log"
    env = dict(os.environ, HF_HUB_OFFLINE="1", INFINITY_ANONYMOUS_USAGE_STATS="0", DO_NOT_TRACK="1")
    with open(log_path, "wb") as log:
        proc = subprocess.Popen(
            [str(binary), "v2", "--model-id", str(model), "--served-model-name", SERVED_NAME,
             "--host", "127.0.0.1", "--port", str(port), "--engine", "torch", "--device", "cpu",
             "--no-bettertransformer", "--no-model-warmup", "--batch-size", "8"],
            stdout=log, stderr=subprocess.STDOUT, env=env,
            cwd=model.parent,  # its .infinity_cache folder goes there, not into the checkout
        )
    url = f"http://127.0.0.1:{port}"
    try:
        _wait_ready(proc, url, startup_s, log_path)
        yield url
    finally:
        proc.terminate()
        try:
            proc.wait(timeout=15)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()


def _wait_ready(proc: subprocess.Popen, url: str, limit: float, log_path: Path) -> None:
    deadline = time.monotonic() + limit
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            raise RuntimeError(f"infinity_emb exited ({proc.returncode}):\n"
                               f"{log_path.read_text(errors='replace')[-3000:]}")
        try:
            if httpx.get(f"{url}/health", timeout=2.0).status_code == 200:
                return
        except httpx.HTTPError:
            pass
        time.sleep(0.5)
    raise RuntimeError(f"infinity_emb not ready after {limit:.0f} s:\n"
                       f"{log_path.read_text(errors='replace')[-3000:]}")
