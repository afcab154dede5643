"""In-process cross-encoder: any Hugging Face cross-encoder through sentence-transformers.

``backend = "cross-encoder"`` loads ``model`` (a hub id or a local folder:
ms-marco-MiniLM, BGE-reranker, mxbai-rerank, a Qwen3-Reranker sequence-classification
conversion, ...) with :class:`sentence_transformers.CrossEncoder` and scores pairs with
its ``predict``; nothing of the model is re-implemented here.

Scores are mapped to [0, 1] the way these models' cards say, so ``min_score`` and the
blend mean the same as for the other backends:

* one output (``num_labels == 1``, nearly every reranker): the sigmoid of the logit.
  ``CrossEncoder.predict`` applies the model's saved activation, which is a sigmoid
  by default in sentence-transformers 6 but ``Identity`` for checkpoints saved to
  return raw logits (the ms-marco ones), so the activation is passed explicitly:
  the sigmoid is applied exactly once, whatever the checkpoint saved;
* two outputs (``[irrelevant, relevant]``): the softmax's "relevant" probability.

``runtime = "onnx"`` loads the model through sentence-transformers' own ONNX support
(``CrossEncoder(..., backend="onnx")``, which needs ``optimum-onnx`` and
``onnxruntime``), reading ``onnx_file`` (e.g. an int8-quantised file made with
:func:`sentence_transformers.backend.export_dynamic_quantized_onnx_model`) when one is
named.
"""

from __future__ import annotations

import logging
import threading
from collections.abc import Sequence
from typing import Any

from memory.config import RerankerConfig, detect_accelerator, missing_device
from memory.errors import RerankerError, RerankerUnavailable

log = logging.getLogger(__name__)

ONNX_PACKAGES_HINT = (
    "sentence-transformers' ONNX runtime needs optimum-onnx and onnxruntime "
    "(pip install 'optimum-onnx[onnxruntime]'); optimum-onnx 0.1.0, the newest release, "
    "supports transformers < 4.58 only and this bot needs transformers 5 "
    "(huggingface/optimum-onnx#114), so use runtime = \"torch\" until a release supports it"
)


def resolve_device(device: str) -> str:
    """The torch device a profile's ``device`` means here (``auto``: the best one seen)."""
    return detect_accelerator() if device == "auto" else device


class CrossEncoderReranker:
    """Scores (query, document) pairs with a sentence-transformers ``CrossEncoder``.

    Thread-safe: the service calls :meth:`score` from its one worker thread, and a
    lock keeps :meth:`close` from freeing the model under a running call.

    Args:
        config: The ``[reranker]`` section; uses model, device, runtime, onnx_file,
            batch_size and max_length.
        model: An already loaded ``CrossEncoder`` (tests, benchmarks); loaded from
            ``config.model`` by :meth:`load` otherwise.
    """

    name = "cross-encoder"

    def __init__(self, config: RerankerConfig, model: Any | None = None) -> None:
        self.config = config
        self.device = resolve_device(config.device)
        self._model = model
        self._lock = threading.Lock()
        if config.runtime == "onnx":
            self.name = "cross-encoder-onnx"

    @property
    def model(self) -> Any:
        """The loaded ``CrossEncoder``.

        Raises:
            RerankerUnavailable: :meth:`load` has not run or failed.
        """
        if self._model is None:
            raise RerankerUnavailable(f"the {self.name} reranker is not loaded")
        return self._model

    def load(self) -> None:
        """Load the cross-encoder (from the local cache or folder, or the hub).

        Raises:
            RerankerUnavailable: The device is missing here, the ONNX packages are
                missing, or the model cannot be found or read.
        """
        with self._lock:
            if self._model is not None:
                return
            self._model = self._load_model()
        log.info("cross-encoder %s loaded on %s (%s runtime, %d output(s))",
                 self.config.model, self.device, self.config.runtime, self._labels())

    def _load_model(self) -> Any:
        missing = missing_device(self.device)
        if missing:
            raise RerankerUnavailable(
                f"reranker.device is {self.config.device!r} but {missing}; use a profile for "
                "this machine (e.g. --profile cpu-small)"
            )
        if self.config.runtime == "onnx":
            _require_onnx_packages()
        from sentence_transformers import CrossEncoder

        kwargs: dict[str, Any] = {"device": self.device, "max_length": self.config.max_length}
        if self.config.runtime == "onnx":
            kwargs["backend"] = "onnx"
            if self.config.onnx_file:
                kwargs["model_kwargs"] = {"file_name": self.config.onnx_file}
        try:
            return CrossEncoder(self.config.model, **kwargs)
        except (OSError, ValueError, RuntimeError) as exc:
            raise RerankerUnavailable(
                f"cross-encoder {self.config.model!r} could not be loaded ({type(exc).__name__}: "
                f"{str(exc)[:300]}); give a Hugging Face cross-encoder id or a local folder"
            ) from exc

    def _labels(self) -> int:
        labels = int(self.model.num_labels)
        if labels not in (1, 2):
            raise RerankerUnavailable(
                f"{self.config.model!r} has {labels} outputs: a reranker has one relevance logit "
                "(or two: irrelevant, relevant)"
            )
        return labels

    def score(self, query: str, texts: Sequence[str]) -> list[float]:
        """Return one relevance score in [0, 1] per text, in input order.

        Raises:
            RerankerUnavailable: The model cannot be loaded.
            RerankerError: The model failed.
        """
        if not texts:
            return []
        self.load()  # a search before the background load finished waits for it
        with self._lock:
            model = self.model
            labels = self._labels()
            pairs = [(query, text) for text in texts]
            return self._predict(model, pairs, labels)

    def _predict(self, model: Any, pairs: list[tuple[str, str]], labels: int) -> list[float]:
        import torch

        try:
            if labels == 1:
                scores = model.predict(pairs, batch_size=self.config.batch_size,
                                       activation_fn=torch.nn.Sigmoid(), show_progress_bar=False)
                return [float(s) for s in scores]
            probs = model.predict(pairs, batch_size=self.config.batch_size, apply_softmax=True,
                                  activation_fn=torch.nn.Identity(), show_progress_bar=False)
            return [float(row[1]) for row in probs]
        except RuntimeError as exc:
            raise RerankerError(f"cross-encoder failed: {exc}") from exc

    def close(self) -> None:
        """Drop the model (and, on CUDA, its cached memory)."""
        with self._lock:
            model, self._model = self._model, None
        if model is None:
            return
        del model
        if self.device.startswith("cuda"):
            import torch

            torch.cuda.empty_cache()


def _require_onnx_packages() -> None:
    """Check that sentence-transformers' ONNX path can import what it needs.

    Raises:
        RerankerUnavailable: optimum-onnx or onnxruntime is missing or does not import
            with this transformers (the reason in one line).
    """
    try:
        import onnxruntime  # noqa: F401
        from optimum.onnxruntime import ORTModelForSequenceClassification  # noqa: F401
    except ImportError as exc:
        raise RerankerUnavailable(f"{ONNX_PACKAGES_HINT} ({type(exc).__name__}: {exc})") from None
