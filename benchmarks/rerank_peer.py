"""``bench rerank --peer``: the peer a GPU reranker should beat, on the same pairs.

sentence-transformers' ``CrossEncoder`` over a Qwen3 sequence classifier of the
Qwen3-Reranker shape (random weights, the real Qwen vocabulary, saved to a temporary
folder and loaded the way a user loads a cross-encoder), scoring the benchmark's
query against the same chat candidates as ``bench rerank``, in one ``predict`` call.
Issue 33's H100 measurement: 49.5 ms for 30 pairs, against 29 ms for the 0.6B
reranker's CUDA graphs.
"""

from __future__ import annotations

import logging
import tempfile
import time
from pathlib import Path
from typing import Any

import torch

from benchmarks.common import require_device
from benchmarks.qwen_models import MODEL_SHAPES, qwen_tokenizer, random_qwen3
from benchmarks.rerank import _device_name, _synchronize
from benchmarks.rerank_corpus import CANDIDATES, QUERY
from memory.errors import ConfigError
from memory.rerank.qwen import resolve_device, resolve_dtype

log = logging.getLogger(__name__)


def run_peer_bench(
    candidates: int = 30,
    repeats: int = 5,
    device: str = "cpu",
    dtype: str | None = None,
    model_size: str = "0.6B",
    seed: int = 0,
) -> dict[str, Any]:
    """Time ``CrossEncoder.predict`` on a Qwen3-shaped classifier for the bench's pairs.

    Args:
        candidates: Pairs scored in one call (the built-in chat, cycled).
        repeats: Timed calls after one warm-up; the best is reported.
        device: ``cpu``, ``cuda``, ``mps`` or ``auto``.
        dtype: Model dtype; default bfloat16 on a GPU, float32 on the CPU.
        model_size: ``0.6B``, ``4B``, ``8B`` or ``tiny``.
        seed: Seed of the random weights.

    Returns:
        A JSON-ready dict: device, dtype, model, ``seconds`` (best call),
        ``median_seconds`` and ``load_seconds``.

    Raises:
        ConfigError: Unknown model size, a device torch does not see, or
            sentence-transformers is missing.
    """
    if model_size not in MODEL_SHAPES:
        raise ConfigError(f"bench model size must be one of {', '.join(MODEL_SHAPES)}")
    try:
        from sentence_transformers import CrossEncoder
    except ImportError as exc:
        raise ConfigError(f"bench rerank --peer needs sentence-transformers ({exc})") from exc
    device = resolve_device(device)
    require_device(device)
    torch_dtype = resolve_dtype(dtype or "auto", device)
    pairs = [(QUERY, CANDIDATES[i % len(CANDIDATES)]) for i in range(candidates)]
    with tempfile.TemporaryDirectory(prefix="peer-cross-encoder-") as folder:
        save_qwen3_classifier(Path(folder), model_size, torch_dtype, seed, device)
        started = time.perf_counter()
        model = CrossEncoder(folder, device=device, model_kwargs={"dtype": torch_dtype})
        load_seconds = time.perf_counter() - started
    model.predict(pairs[:2], batch_size=len(pairs), show_progress_bar=False)  # warm-up
    times = []
    for _ in range(max(1, repeats)):
        _synchronize(device)
        started = time.perf_counter()
        model.predict(pairs, batch_size=len(pairs), show_progress_bar=False)
        _synchronize(device)
        times.append(time.perf_counter() - started)
    return {
        "peer": "sentence-transformers CrossEncoder",
        "model": f"Qwen3ForSequenceClassification, Qwen3-Reranker-{model_size} shape, "
                 "random weights",
        "device": device,
        "device_name": _device_name(device),
        "dtype": str(torch_dtype).removeprefix("torch."),
        "candidates": candidates,
        "repeats": repeats,
        "load_seconds": round(load_seconds, 2),
        "seconds": round(min(times), 4),
        "median_seconds": round(sorted(times)[len(times) // 2], 4),
    }


def save_qwen3_classifier(
    folder: Path, model_size: str, dtype: torch.dtype, seed: int = 0, device: str = "cpu"
) -> Path:
    """Save a random one-label Qwen3 sequence classifier with the real Qwen tokenizer.

    The weights are drawn on ``device`` (seconds on a GPU where a CPU init of the
    0.6B took most of the peer step's time limit).
    """
    tokenizer = qwen_tokenizer()
    if tokenizer.pad_token is None:
        tokenizer.pad_token = "<|endoftext|>"
    model = random_qwen3(MODEL_SHAPES[model_size], device=device, dtype=dtype, seed=seed,
                         num_labels=1, pad_token_id=tokenizer.pad_token_id)
    model.save_pretrained(folder)
    tokenizer.save_pretrained(folder)
    return folder
