"""In-process cross-encoder: any Hugging Face cross-encoder, on torch or on onnxruntime.

``backend = "cross-encoder"`` scores (query, message) pairs with a cross-encoder
(``model``: a hub id or a local folder: ms-marco-MiniLM, BGE-reranker, mxbai-rerank,
a Qwen3-Reranker sequence-classification conversion, ...).  Two runtimes, one path:

* ``runtime = "torch"``: sentence-transformers' :class:`~sentence_transformers.CrossEncoder`
  (its ``predict``), on the profile's ``device``; nothing of the model is re-implemented.
* ``runtime = "onnx"``: the model's ONNX file (``onnx_file``, by default
  ``onnx/model.onnx``; HF cross-encoder repos ship int8 ones such as
  ``onnx/model_qint8_avx512_vnni.onnx``, and ``bot.py export-onnx`` makes both) run by
  onnxruntime on the CPU (:mod:`memory.rerank.onnx_runtime`).  Not through
  sentence-transformers' own ONNX support: that needs optimum-onnx, whose only release
  requires transformers < 4.58, while sentence-transformers 6 requires transformers 5
  (huggingface/optimum-onnx#114).

Both runtimes get the same batches: the pairs sorted by length, longest first, cut
into ``batch_size`` batches each padded only to its own longest pair (as
``CrossEncoder.predict`` does within one call), with the deadline
(:mod:`memory.rerank.deadline`) checked between batches.  Both return raw logits, and
one function maps them to [0, 1] the way these models' cards say, so ``min_score``
and the blend mean the same as for the other backends:

* one output (``num_labels == 1``, nearly every reranker): the sigmoid of the logit --
  whatever activation the checkpoint saved (the ms-marco ones save ``Identity``);
* two outputs (``[irrelevant, relevant]``): the softmax's "relevant" probability.
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Iterator, Sequence
from typing import TYPE_CHECKING, Any, Protocol

import numpy as np

from memory.config import CrossEncoderConfig
from memory.errors import RerankerError, RerankerUnavailable
from memory.hardware import detect_accelerator, missing_device
from memory.rerank import deadline
from memory.rerank.base import check_classifier

if TYPE_CHECKING:
    from numpy.typing import NDArray

log = logging.getLogger(__name__)

Pair = tuple[str, str]
# How long a failed load is answered from memory (as the Qwen backend does): searches
# before then fall back at once instead of each asking the hub or the disk again.
LOAD_RETRY_S = 60.0


class CrossEncoderRuntime(Protocol):
    """What runs the model: raw logits for a batch of pairs.

    Attributes:
        labels: Outputs per pair (1: a relevance logit; 2: irrelevant, relevant).
        device: Where it runs, for the log.
    """

    labels: int
    device: str

    def logits(self, pairs: Sequence[Pair]) -> NDArray[np.float32]:
        """Raw logits, shape ``(len(pairs), labels)``, in input order."""
        ...

    def close(self) -> None:
        """Release the model."""
        ...


def resolve_device(device: str) -> str:
    """The torch device a profile's ``device`` means here (``auto``: the best one seen)."""
    return detect_accelerator() if device == "auto" else device


def length_batches(pairs: Sequence[Pair], batch_size: int) -> Iterator[list[int]]:
    """Indexes of ``pairs`` in batches of similar length, longest first.

    The order ``CrossEncoder.predict`` scores in (characters as the length), so a
    batch pads only to its own longest pair and both runtimes pad alike.
    """
    order = sorted(range(len(pairs)), key=lambda i: -(len(pairs[i][0]) + len(pairs[i][1])))
    for start in range(0, len(order), batch_size):
        yield order[start:start + batch_size]


def relevance(logits: NDArray[np.floating[Any]]) -> list[float]:
    """Scores in [0, 1] from a cross-encoder's logits (see the module)."""
    values = np.asarray(logits, dtype=np.float64)
    if values.ndim == 1:
        values = values[:, None]
    if values.shape[1] == 1:
        return (1.0 / (1.0 + np.exp(-values[:, 0]))).tolist()
    shifted = np.exp(values - values.max(axis=1, keepdims=True))
    return (shifted[:, 1] / shifted.sum(axis=1)).tolist()


def check_labels(labels: int, model: str) -> int:
    """``labels`` if a reranker has that many outputs.

    Raises:
        RerankerUnavailable: Not one or two outputs.
    """
    if labels not in (1, 2):
        raise RerankerUnavailable(
            f"{model!r} has {labels} outputs: a reranker has one relevance logit "
            "(or two: irrelevant, relevant)"
        )
    return labels


class CrossEncoderReranker:
    """Scores (query, document) pairs with a cross-encoder, on torch or onnxruntime.

    Thread-safe: the service calls :meth:`score` from its one worker thread, and a
    lock keeps :meth:`close` from freeing the model under a running call.

    Args:
        config: The profile's ``[reranker]`` settings for this backend.
        runtime: An already loaded runtime (tests, benchmarks); loaded from ``config``
            by :meth:`load` otherwise.
    """

    def __init__(
        self, config: CrossEncoderConfig, runtime: CrossEncoderRuntime | None = None
    ) -> None:
        self.config = config
        self.name = "cross-encoder-onnx" if config.runtime == "onnx" else "cross-encoder"
        self._runtime = runtime
        self._lock = threading.Lock()
        self._load_failure: tuple[float, RerankerUnavailable] | None = None

    @property
    def runtime(self) -> CrossEncoderRuntime:
        """The loaded runtime.

        Raises:
            RerankerUnavailable: :meth:`load` has not run or failed.
        """
        if self._runtime is None:
            raise RerankerUnavailable(f"the {self.name} reranker is not loaded")
        return self._runtime

    def load(self) -> None:
        """Load the model (from the local cache or folder, or the hub).

        Raises:
            RerankerUnavailable: The device or the ONNX file is missing here, the
                model cannot be read, or it is not a reranker.
        """
        with self._lock:
            if self._runtime is not None:
                return
            if self._load_failure and time.monotonic() - self._load_failure[0] < LOAD_RETRY_S:
                raise self._load_failure[1]
            try:
                self._runtime = _checked(_load_runtime(self.config), self.config.model)
            except RerankerUnavailable as exc:
                self._load_failure = (time.monotonic(), exc)
                raise
            self._load_failure = None
        log.info("cross-encoder %s loaded on %s (%s runtime, %d output(s))",
                 self.config.model, self._runtime.device, self.config.runtime,
                 self._runtime.labels)

    def score(self, query: str, texts: Sequence[str]) -> list[float]:
        """Return one relevance score in [0, 1] per text, in input order.

        Raises:
            RerankerUnavailable: The model cannot be loaded.
            RerankerError: The model failed, or the deadline passed between batches.
        """
        if not texts:
            return []
        self.load()  # a search before the background load finished waits for it
        pairs = [(query, text) for text in texts]
        scores = [0.0] * len(pairs)
        with self._lock:
            runtime = self.runtime
            for batch in length_batches(pairs, self.config.batch_size):
                if deadline.passed():
                    raise RerankerError("the cross-encoder's deadline passed before every batch "
                                        "was scored")
                for i, value in zip(batch, relevance(self._logits(runtime, pairs, batch))):
                    scores[i] = value
        return scores

    def _logits(self, runtime: CrossEncoderRuntime, pairs: list[Pair], batch: list[int]
                ) -> NDArray[np.float32]:
        try:
            return runtime.logits([pairs[i] for i in batch])
        except RuntimeError as exc:  # torch's and onnxruntime's failures (out of memory, ...)
            raise RerankerError(f"cross-encoder failed: {str(exc)[:300]}") from exc

    def close(self) -> None:
        """Drop the model (and, on CUDA, its cached memory)."""
        with self._lock:
            runtime, self._runtime = self._runtime, None
        if runtime is not None:
            runtime.close()


def _checked(runtime: CrossEncoderRuntime, model: str) -> CrossEncoderRuntime:
    """``runtime`` if its model is a reranker; closed and refused otherwise."""
    try:
        check_labels(runtime.labels, model)
    except RerankerUnavailable:
        runtime.close()
        raise
    return runtime


def _load_runtime(config: CrossEncoderConfig) -> CrossEncoderRuntime:
    if config.runtime == "onnx":
        from memory.rerank.onnx_runtime import OnnxCrossEncoder

        return OnnxCrossEncoder.load(config)
    return TorchCrossEncoder.load(config)


class TorchCrossEncoder:
    """sentence-transformers' ``CrossEncoder`` on the profile's device, returning logits.

    Args:
        model: A loaded ``CrossEncoder``.
        device: The torch device it runs on.
    """

    def __init__(self, model: Any, device: str) -> None:
        self.model = model
        self.device = device
        self.labels = int(model.num_labels)

    @classmethod
    def load(cls, config: CrossEncoderConfig) -> TorchCrossEncoder:
        """Load ``config.model`` with ``CrossEncoder`` on ``config.device``.

        Raises:
            RerankerUnavailable: The device is missing here, the model cannot be
                found or read, or it is not a sequence classifier (a plain encoder
                would get a random relevance head).
        """
        device = resolve_device(config.device)
        missing = missing_device(device)
        if missing:
            raise RerankerUnavailable(
                f"reranker.device is {config.device!r} but {missing}; use a profile for "
                "this machine (e.g. --profile cpu-small)"
            )
        from sentence_transformers import CrossEncoder

        try:
            model = CrossEncoder(config.model, device=device, max_length=config.max_length)
        except (OSError, ValueError, RuntimeError) as exc:
            raise RerankerUnavailable(
                f"cross-encoder {config.model!r} could not be loaded ({type(exc).__name__}: "
                f"{str(exc)[:300]}); give a Hugging Face cross-encoder id or a local folder"
            ) from exc
        runtime = cls(model, device)
        try:
            check_classifier(getattr(model.config, "architectures", None), config.model)
        except RerankerUnavailable:
            runtime.close()
            raise
        return runtime

    def logits(self, pairs: Sequence[Pair]) -> NDArray[np.float32]:
        """Raw logits through ``CrossEncoder.predict`` (one batch: the caller batches)."""
        import torch

        from memory.torch_threads import settle_cpu_threads

        settle_cpu_threads()
        scores = self.model.predict(list(pairs), batch_size=len(pairs), apply_softmax=False,
                                    activation_fn=torch.nn.Identity(), show_progress_bar=False)
        return np.asarray(scores, dtype=np.float32).reshape(len(pairs), -1)

    def close(self) -> None:
        """Drop the model and, on CUDA, torch's cached memory."""
        self.model = None
        if self.device.startswith("cuda"):
            import torch

            torch.cuda.empty_cache()
