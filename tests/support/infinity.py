"""A real Infinity server (PyPI's infinity-emb) serving a tiny local cross-encoder.

``scripts/infinity.sh`` installs infinity-emb in a virtual environment of its own in
a cache folder (it pins sentence-transformers<4 and numpy<2, which the bot's
environment cannot hold); the tests marked ``infinity`` find it there or at
``$INFINITY_EMB`` and skip with a reason when it is absent.
"""

from __future__ import annotations

import os
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

from tests.support.servers import free_port, serving

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
    args = [str(binary), "v2", "--model-id", str(model), "--served-model-name", SERVED_NAME,
            "--host", "127.0.0.1", "--port", str(port), "--engine", "torch", "--device", "cpu",
            "--no-bettertransformer", "--no-model-warmup", "--batch-size", "8"]
    with serving("infinity_emb", args, f"http://127.0.0.1:{port}", log_path,
                 startup_s=startup_s, poll_s=0.5, stop_s=15, env=env,
                 cwd=model.parent) as url:  # its .infinity_cache folder goes there, not into the checkout
        yield url
