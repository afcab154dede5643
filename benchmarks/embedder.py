"""``bench embedder``: the embedder alone, for import throughput and query latency.

The engine's :class:`memory.embedder.SentenceTransformerEmbedder` is loaded on the
chosen device and, for ``float16``, cast to half precision after loading (the
profile has no embedder dtype yet, so this measures what one would give).  Then:

* import throughput: all synthetic messages through ``embed`` at the profile's
  batch size, the way ``embed_pending`` feeds it;
* query latency: one short query per ``embed`` call, as a search does;
* agreement: in ``float16``, the cosine between each vector and the float32
  model's vector for the same text (1.0 means identical directions).

The texts are :func:`benchmarks.scale.synthetic_records` chat lines, so numbers are
comparable with ``bench search-scale``.
"""

from __future__ import annotations

import dataclasses
import logging
import time
from typing import Any

import numpy as np

from benchmarks.common import cpu_model, machine_description, percentile, require_device
from benchmarks.scale import synthetic_records
from memory.config import EmbedderConfig
from memory.embedder import SentenceTransformerEmbedder
from memory.errors import ConfigError
from memory.hardware import detect_accelerator

log = logging.getLogger(__name__)

AGREEMENT_SAMPLE = 512


def run_embedder_bench(
    config: EmbedderConfig,
    *,
    device: str = "cpu",
    dtype: str | None = None,
    messages: int = 5000,
    queries: int = 100,
    seed: int = 0,
) -> dict[str, Any]:
    """Time the embedder's import throughput and single-query latency.

    Args:
        config: The profile's ``[embedder]`` section (model and batch size).
        device: ``cpu``, ``cuda``, ``mps`` or ``auto``.
        dtype: ``float32`` or ``float16``; default float16 on a GPU, float32 on CPU.
        messages: Synthetic messages embedded for the throughput.
        queries: Single-text ``embed`` calls timed for the latency.
        seed: Seed of the synthetic texts.

    Returns:
        A JSON-ready dict: machine, device, dtype, throughput (messages/s), query
        latency percentiles in ms and, in float16, the cosine agreement with float32.

    Raises:
        ConfigError: Unknown dtype, a device torch does not see, or the model
            cannot be loaded.
    """
    if dtype not in (None, "float32", "float16"):
        raise ConfigError(f"bench embedder dtype must be float32 or float16, got {dtype!r}")
    device = detect_accelerator() if device == "auto" else device
    require_device(device)
    dtype = dtype or ("float32" if device == "cpu" else "float16")
    texts = [r.content for r in synthetic_records(messages, seed=seed, model=config.model)]
    probes = [r.content for r in synthetic_records(queries, seed=seed + 1, model=config.model)]
    embedder = _loaded(config, device, dtype)
    embedder.embed(["warm up"] * min(64, config.batch_size))
    embedder.embed([probes[0]])  # builds the traced single-query forward
    started = time.perf_counter()
    embedder.embed(texts)
    import_s = time.perf_counter() - started
    latencies = []
    for text in probes:
        started = time.perf_counter()
        embedder.embed([text])
        latencies.append((time.perf_counter() - started) * 1000)
    return {
        "machine": machine_description(),
        "device": device,
        "device_name": _device_name(device),
        "model": embedder.model_id,
        "dtype": dtype,
        "batch_size": config.batch_size,
        "messages": messages,
        "import_seconds": round(import_s, 3),
        "import_messages_per_s": round(messages / import_s, 1),
        "queries": queries,
        "query_ms": {
            "p50": round(percentile(latencies, 50), 2),
            "p95": round(percentile(latencies, 95), 2),
            "mean": round(sum(latencies) / len(latencies), 2),
        },
        "cosine_vs_float32": _agreement(embedder, config, device, texts) if dtype != "float32"
        else None,
    }


def _loaded(config: EmbedderConfig, device: str, dtype: str) -> SentenceTransformerEmbedder:
    embedder = SentenceTransformerEmbedder(dataclasses.replace(config, device=device))
    model = embedder._load()  # cast before the first embed builds the traced forward
    if dtype == "float16":
        model.half()
    else:  # a folder saved in float16 (to travel light) would otherwise load as float16
        model.float()
    log.info("embedder %s on %s in %s", embedder.model_id, device, dtype)
    return embedder


def _agreement(
    embedder: SentenceTransformerEmbedder, config: EmbedderConfig, device: str, texts: list[str]
) -> dict[str, float]:
    """Cosine between this embedder's vectors and float32 ones, over a sample."""
    sample = texts[:AGREEMENT_SAMPLE]
    reference = _loaded(config, device, "float32").embed(sample)
    cosines = np.sum(embedder.embed(sample) * reference, axis=1)  # both are unit vectors
    return {"min": round(float(cosines.min()), 6), "mean": round(float(cosines.mean()), 6)}


def _device_name(device: str) -> str:
    if device.startswith("cuda"):
        import torch

        return torch.cuda.get_device_name(device)
    return cpu_model() if device == "cpu" else device
