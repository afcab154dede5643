"""The in-process Qwen3-Reranker backend (transformers + torch).

Qwen3-Reranker-0.6B/4B/8B are causal LMs: the relevance of a document is the
probability that the model answers "yes" rather than "no" after the official prompt
(:mod:`memory.rerank.prompt`).  This backend computes exactly that, but only what
it needs: the base model runs to the last hidden state, the last *real* position of
each sequence is gathered, and only the two lm_head rows of "yes" and "no" are
applied, in float32.  Full-vocabulary logits are never materialised.

One query is scored against many documents, and every prompt starts with the same
head (system message, instruction and query).  With ``prefix_cache`` on, the head's
key/value cache is computed once per call and every micro-batch runs only the
document and suffix tokens on top of it; the tokenizer splits head and document at a
boundary where separate tokenization is exact (see :func:`prompt.head_text`), so the
scores are the same as for the whole prompt.

Micro-batches hold candidates of similar length (sorted), right-padded, so padding
never precedes a real token and cannot leak into a score.

With ``buckets`` in the profile, scoring goes through the static-shape path of
:mod:`memory.rerank.qwen_static` instead: fixed (batch, length) shapes, the head
once per query, and on CUDA with ``cuda_graphs`` one CUDA graph per shape, captured
in :meth:`QwenReranker.load` (the background worker of a profile switch) so no
search pays for it; with ``torch_compile`` a background thread then compiles the
steps (inductor, one shared layer function), runs and captures every shape, and
swaps them in, while the eager steps serve; a compile failure, or one past
``compile_budget``, keeps the eager steps (logged once).  If
capture fails, or a static step fails later, the reason is logged once and the
dynamic path above takes over: a search never sees the error.

:class:`QwenReranker` loads the model and chooses the path; the parts live in their
own modules: the dynamic path in :mod:`memory.rerank.qwen_dynamic`, the grouping of
concurrent searches in :mod:`memory.rerank.qwen_groups`, the background compile and
swap in :mod:`memory.rerank.qwen_compile`, the tokenizing of prompts (the documents
while the head step runs) in :mod:`memory.rerank.qwen_encode`.
"""

from __future__ import annotations

import copy
import gc
import logging
import os
import threading
import time
import warnings
from collections.abc import Sequence
from functools import partial
from typing import Any

import torch

from memory.config import QwenConfig
from memory.errors import RerankerError, RerankerUnavailable
from memory.hardware import detect_accelerator, missing_device
from memory.rerank.kv_cache import cache_argument
from memory.rerank.prompt import SUFFIX
from memory.rerank.qwen_compile import BackgroundCompile
from memory.rerank.qwen_dynamic import DynamicScorer
from memory.rerank.qwen_encode import EncodedQuery, PromptEncoder
from memory.rerank.qwen_groups import SearchGroups, Waiting
from memory.rerank.qwen_static import StaticScorer
from memory.rerank.tokenizer_process import TokenizerProcess
from memory.torch_threads import settle_cpu_threads

log = logging.getLogger(__name__)

LOAD_RETRY_S = 60.0  # how long a failed model load is answered from memory
_DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}
_AUTO_DTYPE = {"cuda": torch.bfloat16, "mps": torch.float16, "cpu": torch.float32}

def load_failure(model: str, device: str, exc: BaseException) -> str:
    """One line saying why ``model`` did not load and how to get it.

    The hub's own errors run to several lines (with a link to its offline docs);
    a model that is neither a local folder nor reachable gets one sentence instead.
    """
    offline = any(os.environ.get(v, "").strip().lower() in ("1", "true", "yes", "on")
                  for v in ("HF_HUB_OFFLINE", "TRANSFORMERS_OFFLINE"))
    is_path = os.path.isabs(model) or model.startswith((".", "~")) or model.count("/") > 1
    if is_path and not os.path.isdir(model):
        # Whatever the hub client made of it (OSError, or a ValueError "Repo id must be
        # in the form ..." from huggingface-hub 0.x), a missing folder is the cause.
        return (
            f"reranker model folder {model!r} does not exist: set reranker.model to a "
            "local Qwen3-Reranker folder or a hub id"
        )
    if isinstance(exc, OSError) and not os.path.isdir(model):
        where = ("it is not in the Hugging Face cache and the hub is off (HF_HUB_OFFLINE)"
                 if offline else f"the hub did not provide it ({_first_line(exc)})")
        return (
            f"reranker model {model!r} is not on this machine: {where}. Download it once "
            f"with network (`hf download {model}`), or set reranker.model to a local "
            "Qwen3-Reranker folder"
        )
    return (
        f"could not load reranker model {model!r} on {device}: {_first_line(exc)}. Set "
        "reranker.model to a Qwen3-Reranker hub id or to a local folder holding one"
    )


def _first_line(exc: BaseException, limit: int = 200) -> str:
    text = next((line.strip() for line in str(exc).splitlines() if line.strip()),
                type(exc).__name__)
    return text if len(text) <= limit else text[: limit - 1] + "…"


def resolve_device(name: str) -> str:
    """Return a concrete torch device name for a profile's ``device`` value."""
    return detect_accelerator() if name == "auto" else name


def resolve_dtype(name: str, device: str) -> torch.dtype:
    """Return the torch dtype for a profile's ``dtype`` value on ``device``.

    ``auto`` is bfloat16 on CUDA, float16 on MPS and float32 on CPU.
    """
    if name == "auto":
        return _AUTO_DTYPE.get(torch.device(device).type, torch.float32)
    return _DTYPES[name]


class QwenReranker:
    """Qwen3-Reranker scored in-process with transformers.

    The model loads lazily: :meth:`load` does the work (call it from a worker
    thread to warm up), and :meth:`score` loads on first use.  One lock serialises
    loading, scoring and unloading, so the object may be shared between threads.

    Args:
        config: The profile's ``[reranker]`` settings for this backend; ``model`` is a
            hub id or a local folder holding a Qwen3-Reranker checkpoint.
    """

    name = "transformers"

    def __init__(self, config: QwenConfig) -> None:
        self.config = config
        self.device = resolve_device(config.device)
        self.dtype = resolve_dtype(config.dtype, self.device)
        self._lock = threading.RLock()  # loading, scoring, unloading
        self._encoder = PromptEncoder(config.instruction, config.max_length)
        self._model: Any = None
        self._tokenizer: Any = None
        self._suffix_ids: list[int] = []
        self._dynamic: DynamicScorer | None = None  # the path every model can take
        self._static: StaticScorer | None = None  # the bucketed path, when the profile asks
        self._compile: BackgroundCompile | None = None  # a background compile (torch_compile)
        self._groups = SearchGroups(self._lock, config.concurrent, self._score_group)
        # A failed load is remembered for a while: retrying a missing model on every
        # search would cost a hub round-trip (or its retries) each time.
        self._load_failure: tuple[float, RerankerUnavailable] | None = None

    @classmethod
    def from_model(
        cls, model: Any, tokenizer: Any, config: QwenConfig | None = None
    ) -> QwenReranker:
        """Wrap an already built causal LM and tokenizer (tests, benchmarks).

        The model is used on its own device and in its own dtype; ``config``
        supplies the scoring knobs (batch size, max length, instruction, prefix
        cache, int8).  ``quantize = "int8"`` makes a quantised copy; ``buckets`` lay the
        projection weights out in place (``qwen_layers.fuse_projections``).  After
        :meth:`close`, a later :meth:`score` loads ``config.model`` from disk or the hub.

        Raises:
            RerankerUnavailable: The tokenizer has no single "yes"/"no" tokens.
        """
        config = config or QwenConfig()
        reranker = cls(config)
        param = next(model.parameters())
        reranker.device, reranker.dtype = str(param.device), param.dtype
        with reranker._lock:
            reranker._install(model, tokenizer, owned=False)
        return reranker

    @property
    def concurrent(self) -> bool:
        """Whether searches may call :meth:`score` at once (they are then scored together).

        True with ``reranker.concurrent`` above 1 and the static path in the profile:
        :class:`memory.rerank.service.RerankerService` then calls from many workers, and
        searches that queue while one is scored share the next static steps."""
        return self.config.concurrent > 1 and bool(self.config.buckets)

    @property
    def loaded(self) -> bool:
        """Whether the model is in memory."""
        return self._model is not None

    def load(self) -> None:
        """Load the tokenizer and model if they are not loaded yet; thread-safe.

        Raises:
            RerankerUnavailable: transformers is missing, the model cannot be
                found or loaded, or it is not a yes/no reranker.
        """
        with self._lock:
            if self._model is not None:
                return
            if self._load_failure and time.monotonic() - self._load_failure[0] < LOAD_RETRY_S:
                raise self._load_failure[1]
            try:
                model, tokenizer = self._from_pretrained()
            except RerankerUnavailable as exc:
                self._load_failure = (time.monotonic(), exc)
                raise
            self._load_failure = None
            self._install(model, tokenizer, owned=True)

    def score(self, query: str, texts: Sequence[str]) -> list[float]:
        """Return P(yes) for each text against ``query``, in input order.

        Raises:
            RerankerUnavailable: The model could not be loaded.
            RerankerError: The forward pass failed (e.g. out of memory).
        """
        if not texts:
            return []
        settle_cpu_threads()
        static = self._static  # read without the lock: a search being scored holds it
        grouped = static is not None and self.config.concurrent > 1
        # Outside the scoring lock: queue while others score.  A search that finds the
        # reranker idle has its documents tokenized while its head step runs
        # (qwen_encode); under load each search tokenizes on its own thread while the
        # current group's steps run, so a group never waits for its members' tokenizing.
        encoded = self.encode(query, texts, background=grouped and self._groups.idle)
        if not grouped or static is None or not static.fits(len(encoded.head)):
            with self._lock:
                self.load()
                return self._score_or_raise(encoded)
        return self._groups.score(encoded)

    def _score_or_raise(self, encoded: EncodedQuery) -> list[float]:
        """:meth:`_score_encoded` with a torch failure as :class:`RerankerError`; under the lock."""
        try:
            return self._score_encoded(encoded)
        except RuntimeError as exc:
            raise RerankerError(
                f"reranker forward pass failed on {self.device}: {exc}; "
                "lower reranker.batch_size or reranker.max_length"
            ) from exc

    def _score_group(self, group: list[Waiting[EncodedQuery]]) -> None:
        """Score queued searches in shared static steps; each gets its scores or its error."""
        try:
            self.load()
            static = self._static
            if static is None:  # dropped after a failure, or closed and reloaded
                raise _NoStaticPath
            # each search's tails read once its head step is queued; a search whose
            # documents failed to tokenize gets that error, not the others
            results = static.score_together([(w.encoded.head, partial(_tails, w)) for w in group])
            for waiting, (found, overflow) in zip(group, results, strict=True):
                if waiting.error is None:
                    waiting.scores = self._with_overflow(waiting.encoded, found, overflow)
        except Exception as exc:  # one by one instead; a search never sees a static failure
            if not isinstance(exc, _NoStaticPath):
                log.warning(
                    "reranker static-shape step failed; scoring with dynamic shapes from now on",
                    exc_info=True,
                )
                self._static = None
            for waiting in group:
                try:
                    waiting.scores = self._score_or_raise(waiting.encoded)
                except Exception as error:  # handed to the search that asked
                    waiting.error = error

    def close(self) -> None:
        """Drop the model and tokenizer and return their memory.

        Reference counting frees the weights the moment the last reference goes (the
        model holds no reference cycle); no ``gc.collect()``: a full collection walks
        every object of the process holding the GIL, and stalled the bot's event loop
        0.46-1.7 s on every switch away from a loaded 0.6B model (issue 30, item 5).
        Waits for a background compile still running (see :class:`BackgroundCompile`).
        """
        with self._lock:
            if self._model is None:
                return
            on_cuda = torch.device(self.device).type == "cuda"
            self._model = self._tokenizer = self._static = self._dynamic = None
            self._encoder.close()
            running, self._compile = self._compile, None
        if running is not None:  # outside the lock: its swap_in takes it (and declines)
            running.join()
        if on_cuda:  # the allocator's cached blocks go back to the device
            torch.cuda.empty_cache()
        log.info("reranker %s unloaded", self.config.model)

    unload = close

    def encode(self, query: str, texts: Sequence[str], background: bool = False) -> EncodedQuery:
        """Tokenize the prompts of ``texts`` for ``query``; loads the model if needed.

        Only documents are truncated: each keeps at most ``max_length - len(head) -
        len(suffix)`` tokens (at least one), so query and template stay intact.  With
        ``background`` the documents are tokenized on another thread
        (:class:`memory.rerank.qwen_encode.PromptEncoder`).
        """
        tok, suffix = self._tokenizer_parts()
        return self._encoder.encode(tok, suffix, query, texts, background)

    # -- loading -------------------------------------------------------------------

    def _tokenizer_parts(self) -> tuple[Any, list[int]]:
        """The tokenizer and the suffix ids, loading first if needed: the scoring lock only
        to load, as searches arriving while one is scored (holding it) tokenize and queue
        for the next group.  ``_install`` sets the tokenizer after the suffix ids."""
        tok = self._tokenizer
        if tok is None:
            with self._lock:
                self.load()
                tok = self._tokenizer
        return tok, self._suffix_ids

    def _from_pretrained(self) -> tuple[Any, Any]:
        return from_pretrained(self.config.model, self.device, self.dtype)

    def _install(self, model: Any, tokenizer: Any, owned: bool) -> None:
        yes_id, no_id = _answer_token_ids(tokenizer, self.config.model)
        rows, bias = _answer_rows(model, yes_id, no_id)
        if self.config.quantize == "int8":
            model = quantized(model if owned else copy.deepcopy(model), self.device, self.dtype)
        model.eval()
        pad_id = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else no_id
        self._suffix_ids = list(tokenizer(SUFFIX, add_special_tokens=False)["input_ids"])
        self._dynamic = DynamicScorer(
            model=model, device=self.device, answer_rows=rows, answer_bias=bias, pad_id=pad_id,
            cache_arg=_cache_arg(model, self.config), batch_size=self.config.batch_size,
            prefix_cache=self.config.prefix_cache,
        )
        self._model, self._tokenizer = model, tokenizer
        self._static = static_scorer(self, model) if self.config.buckets else None
        if self.config.torch_compile and self._static is not None:
            self.compile_in_background(model)  # the eager steps serve meanwhile

    def compile_in_background(self, model: Any) -> None:
        """Compile the static steps on a thread while the eager ones serve, then swap.

        Past ``reranker.compile_budget`` seconds the compile is given up (logged once):
        the eager steps keep serving, and a result that comes later is dropped.  A
        failure is logged once by :func:`compiled` and changes nothing either.
        """
        self._compile = BackgroundCompile(
            build=partial(_compile_and_capture, self, model),
            swap_in=partial(self._swap_in, model),
            budget=self.config.compile_budget,
        )
        self._compile.start()

    def wait_for_compile(self, timeout: float | None = None) -> bool:
        """Wait until a background compile is served, failed or given up.

        Returns:
            Whether compiled static steps serve the searches now.
        """
        if self._compile is not None:
            self._compile.wait(timeout)
        static = self.static_scorer
        return bool(static is not None and static.compiled)

    @property
    def static_scorer(self) -> StaticScorer | None:
        """The static-shape scorer searches use now (the compiled one once swapped in)."""
        return self._static

    def _swap_in(self, model: Any, fresh: StaticScorer) -> bool:
        """Serve ``fresh`` unless the model was closed or the static path dropped meanwhile."""
        with self._lock:
            if self._model is not model or self._static is None:
                return False
            self._static = fresh
            return True

    def answer_head(self) -> tuple[torch.Tensor, torch.Tensor | None, int]:
        """The "no"/"yes" rows of the LM head (float32), their bias, and the pad id."""
        assert self._dynamic is not None, "_install sets the answer rows first"
        return self._dynamic.answer_rows, self._dynamic.answer_bias, self._dynamic.pad_id

    # -- scoring -------------------------------------------------------------------

    @torch.inference_mode()
    def _score_encoded(self, encoded: EncodedQuery) -> list[float]:
        static = self._static
        if static is not None and static.fits(len(encoded.head)):
            try:
                return self._score_static(static, encoded)
            except RerankerError:  # the deadline passed: nobody waits for the rest
                raise
            except Exception:  # any failure here must fall back, not reach a search
                # Logged once: the static path is dropped for the life of this model.
                log.warning(
                    "reranker static-shape step failed; scoring with dynamic shapes from now on",
                    exc_info=True,
                )
                self._static = None
        return self._score_dynamic(encoded, range(len(encoded.tails)))

    def _score_static(self, static: StaticScorer, encoded: EncodedQuery) -> list[float]:
        """Bucketed scoring (planned inside, once the head step is queued)."""
        return self._with_overflow(
            encoded, *static.score_together([(encoded.head, encoded.tails)])[0])

    def _with_overflow(self, encoded: EncodedQuery, found: dict[int, float],
                       overflow: list[int]) -> list[float]:
        """Scores in tail order: ``found`` by the static path, ``overflow`` (longer than
        every bucket) on the dynamic path."""
        rest = self._score_dynamic(encoded, overflow) if overflow else []
        return [found[i] if i in found else rest[i] for i in range(len(encoded.tails))]

    def _score_dynamic(self, encoded: EncodedQuery, indices: Sequence[int]) -> list[float]:
        """Score the tails at ``indices`` with shapes fitted to each micro-batch.

        Returns a list over all tails; entries not in ``indices`` stay 0.0.
        """
        assert self._dynamic is not None, "_install builds the dynamic scorer"
        return self._dynamic.score(encoded.head, encoded.tails, indices)


def _tails(waiting: Waiting[EncodedQuery]) -> list[list[int]]:
    """A grouped search's tails; no tails if its tokenizing failed, the error kept for it."""
    try:
        return waiting.encoded.tails
    except Exception as exc:  # handed to the search that asked, as before grouping
        waiting.error = exc
        return []


def static_scorer(reranker: QwenReranker, model: Any) -> StaticScorer | None:
    """Build a reranker's bucketed scorer; capture its CUDA graphs when the profile asks.

    Runs inside :meth:`QwenReranker.load`, so on a profile switch the capture
    happens in the background worker before the new backend goes live.  Returns
    ``None`` (the dynamic path) when the model cannot take the static path.  The
    scorer's steps are eager: with ``torch_compile``, ``load`` then starts
    :meth:`QwenReranker.compile_in_background`, which swaps compiled ones in later.
    """
    config = reranker.config
    if config.quantize == "int8":
        log.warning(
            "reranker.buckets is ignored with quantize = 'int8': dynamic int8 scales "
            "activations per batch, so padding rows would change the scores"
        )
        return None
    attention = getattr(model.config, "_attn_implementation", "sdpa")
    if attention not in ("sdpa", "eager"):
        log.warning(
            "reranker.buckets needs sdpa or eager attention, the model uses %s: "
            "scoring with dynamic shapes", attention,
        )
        return None
    static = _new_static(reranker, model)
    served: StaticScorer | None = static
    if config.cuda_graphs and torch.device(reranker.device).type == "cuda":
        served = captured(static, reranker.device)
    elif config.cuda_graphs:
        log.info("reranker.cuda_graphs is for CUDA devices; %s scores eagerly", reranker.device)
    return served


def _new_static(reranker: QwenReranker, model: Any) -> StaticScorer:
    config = reranker.config
    rows, bias, pad_id = reranker.answer_head()
    return StaticScorer(
        model=model, answer_rows=rows, answer_bias=bias, pad_id=pad_id,
        buckets=config.buckets, max_length=config.max_length, slots=config.concurrent,
        run_cost=config.bucket_run_cost,
        measured={(b, n): ms for b, n, ms in config.bucket_costs} or None,
        pack=config.pack,
    )


def _compile_and_capture(reranker: QwenReranker, model: Any) -> StaticScorer | None:
    """A compiled (and on CUDA captured) static scorer, or ``None`` after a logged failure."""
    static = _new_static(reranker, model)
    if not compiled(static):
        return None
    if reranker.config.cuda_graphs and torch.device(reranker.device).type == "cuda":
        return captured(static, reranker.device)
    return static


def compiled(static: StaticScorer, backend: Any = "inductor") -> bool:
    """Compile ``static``'s steps (:meth:`StaticScorer.compile`); on any failure log once.

    A failure leaves the eager steps, which the CUDA graphs then capture as before:
    compiling is a speed-up, never a reason to score differently or not at all.

    Returns:
        Whether the compiled steps are in place.
    """
    try:
        seconds = static.compile(backend)
    except Exception:  # inductor, a C++/Triton toolchain, dynamo: none may reach a search
        log.warning(
            "reranker torch.compile of the static steps failed; keeping the eager steps",
            exc_info=True,
        )
        static.uncompile()
        return False
    log.info("reranker static steps compiled in %.1f s (every shape run once)", seconds)
    return True


def captured(static: StaticScorer, device: str) -> StaticScorer | None:
    """Capture ``static``'s graphs; on any failure log once and score eagerly.

    Returns ``None`` after a failure: the dynamic path, which never captured
    anything, takes every search from then on.
    """
    try:
        seconds = static.capture()
    except Exception:  # a capture failure must never reach a search
        log.warning(
            "reranker CUDA graph capture failed; scoring with eager PyTorch instead",
            exc_info=True,
        )
        static.release()  # half-captured graphs and their pool go before the swap
        gc.collect()
        if torch.device(device).type == "cuda":
            torch.cuda.empty_cache()
        return None
    log.info(
        "reranker CUDA graphs captured in %.1f s: head capacities %s, buckets %s",
        seconds, list(static.capacities), [list(b) for b in static.buckets],
    )
    return static

def quantized(model: Any, device: str, dtype: torch.dtype) -> Any:
    """Replace the base model's Linear layers by dynamic int8 ones (CPU only).

    Raises:
        RerankerUnavailable: Not on the CPU in float32, or torch has no dynamic int8.
    """
    if torch.device(device).type != "cpu" or dtype != torch.float32:
        raise RerankerUnavailable(
            f"reranker.quantize = 'int8' needs device 'cpu' and dtype 'float32' or "
            f"'auto', not {device}/{dtype}: set quantize = 'none'"
        )
    try:
        from torch.ao.quantization import quantize_dynamic
    except ImportError as exc:
        raise RerankerUnavailable(
            "this torch build has no torch.ao.quantization.quantize_dynamic: "
            "set reranker.quantize = 'none'"
        ) from exc
    with warnings.catch_warnings():
        # torch marks eager quantisation deprecated in favour of torchao, but
        # 2.13 still ships it and it needs no extra dependency.
        warnings.simplefilter("ignore", DeprecationWarning)
        warnings.filterwarnings("ignore", message=".*quantize_per_tensor.*")
        model.model = quantize_dynamic(
            model.model, {torch.nn.Linear}, dtype=torch.qint8, inplace=True
        )
    log.info("reranker Linear layers quantised to dynamic int8")
    return model


class _NoStaticPath(Exception):
    """The static path is gone (an earlier failure); score one search at a time."""


def from_pretrained(name: str, device: str, dtype: torch.dtype) -> tuple[Any, Any]:
    """Load a Qwen3-Reranker's causal LM onto ``device`` and its tokenizer (in a child process).

    Raises:
        RerankerUnavailable: transformers is missing, the device is not there, or the
            model cannot be found or loaded (one line saying what to do).
    """
    try:
        from transformers import AutoModelForCausalLM
    except ImportError as exc:
        raise RerankerUnavailable(
            "the transformers reranker needs the transformers package: "
            "pip install 'transformers>=4.51'"
        ) from exc
    missing = missing_device(device)
    if missing:
        raise RerankerUnavailable(
            f"reranker.device is {device!r} but {missing}: use --profile cpu, "
            "or --profile auto to pick what this machine has"
        )
    log.info("loading reranker %s on %s as %s", name, device, dtype)
    try:
        # in a child process: parsing tokenizer.json holds the GIL for most of a second
        tokenizer = TokenizerProcess(name)
        # device_map puts the weights straight on the device, so an 8B model
        # never needs a full copy in CPU memory first.
        model = AutoModelForCausalLM.from_pretrained(
            name, dtype=dtype, device_map=device
        )
    except Exception as exc:  # any failure here means "no reranker"; the cause is chained
        raise RerankerUnavailable(load_failure(name, device, exc)) from exc
    return model, tokenizer


def _answer_rows(model: Any, yes_id: int, no_id: int) -> tuple[torch.Tensor, torch.Tensor | None]:
    """The lm_head rows of "no" and "yes" as a float32 copy, and their bias (or ``None``)."""
    lm_head = model.get_output_embeddings()
    rows = lm_head.weight.detach()[[no_id, yes_id]].to(torch.float32)
    bias = getattr(lm_head, "bias", None)
    return rows.clone(), None if bias is None else bias.detach()[[no_id, yes_id]].float()


def _cache_arg(model: Any, config: QwenConfig) -> str:
    """forward's KV cache argument (:func:`kv_cache.cache_argument`), checked at load.

    Only the paths that run on a cache need it: ``prefix_cache`` and the buckets.
    """
    return cache_argument(model.model) if config.prefix_cache or config.buckets else ""


def _answer_token_ids(tokenizer: Any, model_name: str) -> tuple[int, int]:
    """Return the ids of the single tokens "yes" and "no".

    Raises:
        RerankerUnavailable: Either word is not one token of this vocabulary.
    """
    ids = []
    for word in ("yes", "no"):
        token_id = tokenizer.convert_tokens_to_ids(word)
        if token_id is None or token_id == tokenizer.unk_token_id:
            raise RerankerUnavailable(
                f"reranker model {model_name!r} has no single token {word!r} in its "
                "vocabulary, so it is not a Qwen3-Reranker: set reranker.model to "
                "Qwen/Qwen3-Reranker-0.6B, -4B or -8B (or a local copy)"
            )
        ids.append(int(token_id))
    return ids[0], ids[1]
