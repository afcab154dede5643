"""Remote reranker: a llama.cpp ``llama-server`` running Qwen3-Reranker (GGUF).

``RerankerConfig.endpoint`` picks how the server is asked:

* ``completion`` (default): one ``POST /completion`` per document whose prompt is
  the exact official Qwen3-Reranker text (:func:`memory.rerank.prompt.full_prompt`,
  the same text the in-process backend tokenizes), with ``n_predict=1`` and
  ``n_probs``.  The score is P(yes) over the two answer tokens of the reported
  log-probabilities (:func:`parse_completion_score`).  Needs a *causal* GGUF.
* ``chat``: one ``POST /v1/chat/completions`` per document with the system and user
  turns only and ``chat_template_kwargs.enable_thinking = false``: Qwen3's template
  then opens the assistant turn with the empty think block itself.  (Sending that
  block as an assistant prefill makes the server render a second one.)  For servers
  that only expose the OpenAI API; needs a causal GGUF with its chat template.
* ``rerank``: one ``POST /v1/rerank`` for all documents, for a *rank-pooled* GGUF
  served with ``--reranking``.  llama.cpp already returns P(yes) (a softmax over the
  yes/no rows), used as is.  Its instruction is the one llama.cpp's converter baked
  into the GGUF (:data:`RERANK_INSTRUCTION`); ``reranker.instruction`` cannot reach it.

Documents longer than ``max_length`` prompt tokens are cut the way the in-process
backend cuts them: only the document loses tokens.  Token counts come from the
server's ``/tokenize`` and only for documents whose prompt has more UTF-8 bytes than
``max_length`` (a byte-level BPE token is at least one byte, so shorter ones fit).

The backend is synchronous, like the rest of the engine.  One ``httpx.Client`` and a
pool of ``parallel`` worker threads, shared by every caller, send the per-document
requests, so the server never sees more than ``parallel`` scoring requests from this
process (match ``llama-server --parallel``).  Every call has a deadline: the
service's (:mod:`memory.rerank.deadline`), or ``timeout`` seconds when called
directly.  Each request is given only the time left, and when the deadline passes
(or the server turns out to be down) the call cancels its queued requests, so
nothing of a call outlives it; llama-server stops a task whose client has gone.

A document whose request fails (HTTP error, unusable answer) is *missing*: it gets
the lowest score of the call, so it stays in the results behind every scored one.
Only when every document fails does :meth:`LlamaServerBackend.score` raise.  Every
failure is a :class:`~memory.errors.RerankerError` (or
:class:`~memory.errors.RerankerUnavailable` when the server cannot be reached or is
still loading) whose message names the URL; its ``kind`` is the label counted in
``RERANK_SERVER_ERRORS``.  No httpx exception escapes, and no other one either.
"""

from __future__ import annotations

import logging
import math
import re
import threading
import time
from collections.abc import Callable, Sequence
from concurrent.futures import FIRST_COMPLETED, Future, ThreadPoolExecutor, wait
from dataclasses import dataclass, field
from types import TracebackType
from typing import Any, TypeVar

import httpx

from memory.config import DEFAULT_INSTRUCTION, RerankerConfig
from memory.errors import ConfigError, RerankerError, RerankerUnavailable
from memory.metrics import RERANK_SERVER_ERRORS
from memory.rerank import deadline
from memory.rerank.prompt import (
    SUFFIX,
    chat_messages,
    document_text,
    full_prompt,
    head_text,
)

log = logging.getLogger(__name__)

T = TypeVar("T")

HEALTH_PATH = "/health"
COMPLETION_PATH = "/completion"
CHAT_PATH = "/v1/chat/completions"
RERANK_PATH = "/v1/rerank"
TOKENIZE_PATH = "/tokenize"
DETOKENIZE_PATH = "/detokenize"
TOP_LOGPROBS = 20
# The instruction llama.cpp's convert_hf_to_gguf.py writes into a Qwen3-Reranker rank
# GGUF's "rerank" chat template; /v1/rerank always scores with it.
RERANK_INSTRUCTION = "Given a web search query, retrieve relevant passages that answer the query"
# /health answers at once even while the server is busy, so it needs no long wait.
HEALTH_TIMEOUT_CAP = 5.0
# How long a call that gave up waits for its requests already on the wire to end
# (each is bounded by the call's deadline, so this is only scheduling slack).
SETTLE_TIMEOUT = 1.0
# A token missing from the top list is placed this many nats below the lowest listed one.
MISSING_TOKEN_MARGIN = 1.0
# Smallest leftover probability considered, so log(leftover) stays finite (about -30).
MIN_LEFTOVER = 1e-13
# Errors that mean the server closed the connection without a complete answer.
_DROPPED = (httpx.RemoteProtocolError, httpx.ReadError, httpx.WriteError)
# Error kinds a single document can cause (unlike timeouts and outages).
_DOCUMENT_FAULTS = frozenset({"http_4xx", "http_5xx", "malformed"})
_SURROGATE = re.compile("[\ud800-\udfff]")
_THINK_BLOCK = re.compile(r"<think>.*?</think>", re.DOTALL)


# --------------------------------------------------------------------------- math


def logsumexp(values: Sequence[float]) -> float:
    """Return ``log(sum(exp(v)))`` computed without overflow or underflow.

    Raises:
        ValueError: ``values`` is empty.
    """
    top = max(values)
    if math.isinf(top):
        return top
    return top + math.log(sum(math.exp(v - top) for v in values))


def sigmoid(x: float) -> float:
    """Return ``1 / (1 + exp(-x))``, stable for large ``|x|``."""
    if x >= 0:
        return 1.0 / (1.0 + math.exp(-x))
    z = math.exp(x)
    return z / (1.0 + z)


def _missing_logprob(listed: Sequence[float]) -> float:
    """Estimate the logprob of an answer token absent from the top list.

    An absent token is less likely than every listed one and than the probability mass
    the list leaves over; take the smaller of (lowest listed - margin) and
    log(leftover), which is at least about -30.
    """
    leftover = 1.0 - sum(math.exp(lp) for lp in listed)
    return min(min(listed) - MISSING_TOKEN_MARGIN, math.log(max(leftover, MIN_LEFTOVER)))


def yes_probability(top_logprobs: Sequence[Any]) -> float:
    """Return P(yes) over {yes, no} from llama-server's ``top_logprobs`` list.

    Token strings are normalised with ``strip().lower()`` (" Yes", "YES" and "yes" are
    the same answer) and duplicates are combined by log-sum-exp.  The score is the
    softmax over the two, ``sigmoid(lp_yes - lp_no)``, which is exactly what the
    in-process backend computes from the two logits.  A token missing from the list
    gets a floor logprob (see :func:`_missing_logprob`).

    Args:
        top_logprobs: ``[{"token": str, "logprob": float}, ...]``.

    Returns:
        The relevance score in [0, 1].

    Raises:
        ValueError: An entry is malformed, or neither "yes" nor "no" is listed.
    """
    answers: dict[str, list[float]] = {"yes": [], "no": []}
    listed: list[float] = []
    for entry in top_logprobs:
        token = _get(entry, "token", str).strip().lower()
        logprob = _number(entry, "logprob")
        listed.append(logprob)
        if token in answers:
            answers[token].append(logprob)
    if not answers["yes"] and not answers["no"]:
        raise ValueError(f"neither 'yes' nor 'no' among the {len(listed)} top tokens")
    floor = _missing_logprob(listed)
    lp_yes = logsumexp(answers["yes"]) if answers["yes"] else floor
    lp_no = logsumexp(answers["no"]) if answers["no"] else floor
    return sigmoid(lp_yes - lp_no)


def answer_from_text(text: str) -> float:
    """Return 1.0 for a generated "yes", 0.0 for "no" (last resort without logprobs).

    Any ``<think>...</think>`` block the server echoes is dropped first, so
    ``"<think>\\n\\n</think>\\n\\nno"`` reads as "no".

    Raises:
        ValueError: What is left is neither yes nor no.
    """
    answer = _THINK_BLOCK.sub("", text).strip().lower()
    if answer in ("yes", "no"):
        return 1.0 if answer == "yes" else 0.0
    raise ValueError(f"no logprobs, and the generated text {text!r} is neither yes nor no")


# ------------------------------------------------------------------------ parsing


def _get(obj: Any, key: str | int, kind: type) -> Any:
    """Return ``obj[key]`` if it exists and is a ``kind``; else raise ValueError."""
    try:
        value = obj[key]
    except (KeyError, IndexError, TypeError):
        raise ValueError(f"missing {key!r}") from None
    if not isinstance(value, kind) or (kind is int and isinstance(value, bool)):
        raise ValueError(f"{key!r} is {type(value).__name__}, expected {kind.__name__}")
    return value


def _number(obj: Any, key: str) -> float:
    """Return ``obj[key]`` as a float, rejecting booleans, null and NaN."""
    value = _get(obj, key, object)
    if not isinstance(value, (int, float)) or isinstance(value, bool) or math.isnan(value):
        raise ValueError(f"{key!r} is not a number: {value!r}")
    return float(value)


def _first_top(entries: Any) -> list[Any]:
    """Return ``entries[0].top_logprobs`` when it is a non-empty list, else []."""
    if not isinstance(entries, list) or not entries or not isinstance(entries[0], dict):
        return []
    top = entries[0].get("top_logprobs")
    return top if isinstance(top, list) else []


def parse_completion_score(body: Any) -> float:
    """Return the relevance score from one ``/completion`` response.

    The score comes from ``completion_probabilities[0].top_logprobs`` (see
    :func:`yes_probability`); without it (llama-server leaves it out when the sampled
    token is an incomplete UTF-8 piece) the generated ``content`` decides
    (:func:`answer_from_text`).

    Raises:
        ValueError: The response lacks the fields needed, or the answer is unusable.
    """
    if not isinstance(body, dict):
        raise ValueError(f"expected an object, got {type(body).__name__}")
    top = _first_top(body.get("completion_probabilities"))
    if top:
        return yes_probability(top)
    return answer_from_text(_get(body, "content", str))


def parse_chat_score(body: Any) -> float:
    """Return the relevance score from one ``/v1/chat/completions`` response.

    The score comes from ``choices[0].logprobs.content[0].top_logprobs`` (see
    :func:`yes_probability`); without top logprobs the generated
    ``choices[0].message.content`` decides (:func:`answer_from_text`).

    Raises:
        ValueError: The response lacks the fields needed, or the answer is unusable.
    """
    choice = _get(_get(body, "choices", list), 0, dict)
    logprobs = choice.get("logprobs")
    top = _first_top(logprobs.get("content") if isinstance(logprobs, dict) else None)
    if top:
        return yes_probability(top)
    return answer_from_text(_get(_get(choice, "message", dict), "content", str))


def parse_rerank_scores(body: Any, count: int) -> list[float]:
    """Return one score per document, in input order, from a ``/v1/rerank`` response.

    Results may come in any order (llama-server sorts them by score), so they are
    mapped back by ``index``.  For a Qwen3-Reranker rank GGUF ``relevance_score`` is
    already P(yes) (llama.cpp takes the softmax over the yes/no rows), so it is used
    as is; a score outside [0, 1] means the GGUF is some other kind of reranker.

    Args:
        body: The decoded JSON response.
        count: How many documents were sent.

    Raises:
        ValueError: A field is missing, an index is out of range, a score is not a
            probability, or a document has no result.
    """
    scores: dict[int, float] = {}
    for item in _get(body, "results", list):
        index = _get(item, "index", int)
        if not 0 <= index < count:
            raise ValueError(f"result index {index} is out of range for {count} documents")
        score = _number(item, "relevance_score")
        if not 0.0 <= score <= 1.0:
            raise ValueError(
                f"relevance_score {score:g} is not a probability: serve a Qwen3-Reranker "
                "GGUF converted with rank pooling"
            )
        scores[index] = score
    missing = [i for i in range(count) if i not in scores]
    if missing:
        raise ValueError(f"no result for document index(es) {missing[:10]}")
    return [scores[i] for i in range(count)]


# ------------------------------------------------------------------------ helpers


def clean_text(text: str) -> str:
    """Return ``text`` as valid Unicode: each surrogate code point becomes U+FFFD.

    A Python ``str`` may hold surrogates (from a broken decoder or a hostile
    message); they cannot be encoded as UTF-8 JSON.  NUL and emoji pass unchanged.
    """
    return _SURROGATE.sub("\ufffd", text)


def _error(kind: str, message: str, *, unavailable: bool = False) -> RerankerError:
    """Build the error ``score`` raises; ``kind`` is its RERANK_SERVER_ERRORS label."""
    return (RerankerUnavailable if unavailable else RerankerError)(message, kind)


def _describe(exc: BaseException) -> str:
    text = str(exc)
    return f"{type(exc).__name__}: {text}" if text else type(exc).__name__


def _server_message(response: httpx.Response) -> str:
    """Return llama-server's ``error.message``, or the start of the body."""
    try:
        message = response.json()["error"]["message"]
    except (ValueError, KeyError, TypeError):
        return response.text[:200] or "empty body"
    return str(message)


def _base_url(url: str) -> str:
    """Return the server root: no trailing slash and no trailing ``/v1``."""
    if not url.startswith(("http://", "https://")):
        raise ConfigError(f"reranker.url must be the http(s) URL of a llama-server, got {url!r}")
    base = url.rstrip("/")
    return base.removesuffix("/v1")


@dataclass
class _Call:
    """One :meth:`LlamaServerBackend.score` call: its deadline and whether it gave up."""

    deadline: float
    abandoned: threading.Event = field(default_factory=threading.Event)

    def remaining(self) -> float:
        """Seconds left before the deadline (never negative)."""
        return max(0.0, self.deadline - time.monotonic())


# ------------------------------------------------------------------------ backend


class LlamaServerBackend:
    """Scores documents with Qwen3-Reranker served by a llama.cpp ``llama-server``.

    Thread-safe: any number of threads may call :meth:`score` at once; they share
    ``parallel`` request slots.

    Attributes:
        name: ``"llama-server"``.
        concurrent: True: any number of searches may score at once (they share
            the ``parallel`` request slots).
        base_url: The server root the paths are appended to.
        healthy: Whether the last health check (or request) found the server ready;
            False until the first check.
        last_error: The most recent problem (failed health check or failed call),
            reset to None when a health check succeeds.
    """

    name = "llama-server"
    concurrent = True

    def __init__(self, config: RerankerConfig) -> None:
        """Prepare the backend; no connection or thread exists before first use.

        Args:
            config: The reranker section; uses url, endpoint, instruction, timeout,
                max_length and parallel.

        Raises:
            ConfigError: ``config.url`` is not an http(s) URL.
        """
        self.base_url = _base_url(config.url)
        self.healthy = False
        self.last_error: str | None = None
        self._config = config
        self._lock = threading.Lock()
        self._closed = False
        self._closing: Future[None] = Future()  # resolved by close(); wakes waiting calls
        self._client: httpx.Client | None = None
        self._pool: ThreadPoolExecutor | None = None
        self._suffix_ids: list[int] | None = None
        if config.endpoint == "rerank" and config.instruction != RERANK_INSTRUCTION:
            # only a changed instruction is worth a warning; the default is a note
            custom = config.instruction != DEFAULT_INSTRUCTION
            log.log(
                logging.WARNING if custom else logging.INFO,
                "reranker.instruction is not used with endpoint = \"rerank\": llama.cpp scores "
                "with the instruction its converter wrote into the GGUF (%r); use endpoint = "
                "\"completion\" for another one", RERANK_INSTRUCTION,
            )

    # -- public API

    def start(self) -> bool:
        """Check the server's health now.

        Returns:
            Whether the server is ready.  A server that is down or loading is not an
            error here; :meth:`score` raises RerankerUnavailable while it lasts.

        Raises:
            RerankerError: The backend was closed.
        """
        self._ensure_open()
        return self._check_health(_Call(time.monotonic() + HEALTH_TIMEOUT_CAP))

    def load(self) -> None:
        """The :class:`~memory.rerank.base.RerankerBackend` start-up step: :meth:`start`."""
        self.start()

    def score(self, query: str, texts: Sequence[str]) -> list[float]:
        """Return one relevance score in [0, 1] per text, in input order.

        Args:
            query: The search query.
            texts: The candidate documents.

        Returns:
            The scores; ``[]`` for no texts (no request is made).  A document the
            server failed on gets the lowest score of the others.

        Raises:
            RerankerUnavailable: The server is down or still loading its model.
            RerankerError: Timeout, every document failed, or the backend was closed.
        """
        if not texts:
            return []
        call = _Call(deadline.within(self._config.timeout))
        try:
            return self._score(clean_text(query), [clean_text(t) for t in texts], call)
        except RerankerError as exc:
            self._record_failure(exc)
            raise
        except Exception as exc:  # a bug here must not reach the search as a traceback
            log.exception("llama-server reranker failed unexpectedly")
            raise RerankerError(f"llama-server reranker failed: {_describe(exc)}") from exc
        finally:
            call.abandoned.set()

    def close(self) -> None:
        """Cancel queued requests, close the HTTP client and end the worker threads.

        Calls in flight fail with RerankerError at once.  Safe to call more than once.
        """
        with self._lock:
            if self._closed:
                return
            self._closed = True
            client, pool = self._client, self._pool
        self.healthy = False
        self._closing.set_result(None)
        if pool is not None:
            pool.shutdown(wait=False, cancel_futures=True)
        if client is not None:
            client.close()

    def __enter__(self) -> LlamaServerBackend:
        return self

    def __exit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        self.close()

    # -- scoring

    def _score(self, query: str, docs: list[str], call: _Call) -> list[float]:
        self._require_healthy(call)
        if self._config.endpoint == "rerank":
            return self._rerank(call, query, docs)
        head = self._head_ids(query, docs, call)
        one = self._completion_one if self._config.endpoint == "completion" else self._chat_one
        futures = [self._submit(call, one, query, doc, head) for doc in docs]
        self._settle(futures, call)
        return self._combine(self._outcomes(futures, call), call)

    def _rerank(self, call: _Call, query: str, docs: list[str]) -> list[float]:
        """All documents in one /v1/rerank request; one request each if that is refused.

        The server refuses a whole batch for one document it will not take (an HTTP
        error or an unusable answer), so after such a refusal each document is asked
        alone and only the one at fault goes missing.
        """
        future = self._submit(call, self._score_rerank, query, docs)
        self._settle([future], call)
        scores = self._outcome(future, call)
        if not isinstance(scores, RerankerError):
            return scores
        if len(docs) == 1 or scores.kind not in _DOCUMENT_FAULTS or call.remaining() <= 0:
            raise scores
        log.info("llama-server refused the rerank batch (%s); asking per document", scores)
        futures = [self._submit(call, self._score_rerank, query, [doc]) for doc in docs]
        self._settle(futures, call)
        return self._combine([_single(a) for a in self._outcomes(futures, call)], call)

    def _completion_one(
        self, call: _Call, query: str, doc: str, head: list[int] | None
    ) -> float:
        text = full_prompt(self._config.instruction, query, doc)
        prompt: str | list[int] = text
        if head is not None and self._too_long(text):
            prompt = head + self._doc_ids(doc, len(head), call) + self._suffix(call)
        payload = {
            "prompt": prompt,
            "n_predict": 1,
            "n_probs": TOP_LOGPROBS,
            "temperature": 0,
            "cache_prompt": True,
        }
        url = self.base_url + COMPLETION_PATH
        return self._parse(url, parse_completion_score, self._post(url, payload, call))

    def _chat_one(self, call: _Call, query: str, doc: str, head: list[int] | None) -> float:
        instruction = self._config.instruction
        if head is not None and self._too_long(full_prompt(instruction, query, doc)):
            doc = self._detokenize(self._doc_ids(doc, len(head), call), call)
        payload = {
            "messages": chat_messages(instruction, query, doc),
            "chat_template_kwargs": {"enable_thinking": False},
            "max_tokens": 1,
            "temperature": 0,
            "logprobs": True,
            "top_logprobs": TOP_LOGPROBS,
        }
        url = self.base_url + CHAT_PATH
        return self._parse(url, parse_chat_score, self._post(url, payload, call))

    def _score_rerank(self, call: _Call, query: str, docs: list[str]) -> list[float]:
        """One /v1/rerank request; the server applies the GGUF's own rerank template."""
        long = [
            i for i, d in enumerate(docs)
            if self._too_long(full_prompt(RERANK_INSTRUCTION, query, d))
        ]
        if long:
            head = len(self._tokenize(head_text(RERANK_INSTRUCTION, query), call))
            docs = list(docs)
            for i in long:
                docs[i] = self._detokenize(self._doc_ids(docs[i], head, call), call)
        url = self.base_url + RERANK_PATH
        body = self._post(url, {"query": query, "documents": docs, "top_n": len(docs)}, call)
        return self._parse(url, lambda b: parse_rerank_scores(b, len(docs)), body)

    @staticmethod
    def _parse(url: str, parse: Callable[[Any], T], body: Any) -> T:
        try:
            return parse(body)
        except ValueError as exc:
            raise _error("malformed", f"{url}: unexpected response: {exc}") from None

    # -- truncation to max_length tokens, as the in-process backend does

    def _too_long(self, prompt: str) -> bool:
        # every token of a byte-level BPE covers at least one UTF-8 byte
        return len(prompt.encode("utf-8")) > self._config.max_length

    def _head_ids(self, query: str, docs: list[str], call: _Call) -> list[int] | None:
        """Token ids of the shared prompt head, fetched only if some document may be long."""
        instruction = self._config.instruction
        if not any(self._too_long(full_prompt(instruction, query, d)) for d in docs):
            return None
        return self._tokenize(head_text(instruction, query), call)

    def _suffix(self, call: _Call) -> list[int]:
        if self._suffix_ids is None:
            self._suffix_ids = self._tokenize(SUFFIX, call)
        return self._suffix_ids

    def _doc_ids(self, doc: str, head_len: int, call: _Call) -> list[int]:
        """The document's token ids, cut to what ``max_length`` leaves it (at least one)."""
        budget = max(1, self._config.max_length - head_len - len(self._suffix(call)))
        ids = self._tokenize(document_text(doc), call)
        if len(ids) > budget:
            log.debug("document of %d tokens cut to %d for the reranker", len(ids), budget)
        return ids[:budget]

    def _tokenize(self, text: str, call: _Call) -> list[int]:
        url = self.base_url + TOKENIZE_PATH
        body = self._post(url, {"content": text, "add_special": False, "parse_special": True}, call)

        def tokens(b: Any) -> list[int]:
            ids = _get(b, "tokens", list)
            if not all(isinstance(i, int) and not isinstance(i, bool) for i in ids):
                raise ValueError("'tokens' holds something other than token ids")
            return ids

        return self._parse(url, tokens, body)

    def _detokenize(self, ids: list[int], call: _Call) -> str:
        """Text of document ids (which start with the separating space) without that space."""
        url = self.base_url + DETOKENIZE_PATH
        body = self._post(url, {"tokens": ids}, call)
        text = self._parse(url, lambda b: _get(b, "content", str), body)
        return text.removeprefix(" ")

    # -- the worker pool: bounded, shared, cancellable

    def _submit(self, call: _Call, fn: Callable[..., T], *args: Any) -> Future[T]:
        pool = self._ensure_open()[1]
        try:
            return pool.submit(self._run_job, call, fn, *args)
        except RuntimeError:  # shut down between the check and the submit
            raise self._closed_error() from None

    def _run_job(self, call: _Call, fn: Callable[..., T], *args: Any) -> T:
        """Worker side of one request: skipped if its call has already given up."""
        if call.abandoned.is_set() or call.remaining() <= 0:
            raise _error("timeout", "the call gave up before this document was sent")
        return fn(call, *args)

    def _settle(self, futures: list[Future[Any]], call: _Call) -> None:
        """Wait for the call's requests until its deadline; cancel what is left.

        The call gives up at its deadline, when the server turns out to be down, or
        when the backend closes; then its queued requests are cancelled (never sent)
        and those on the wire are waited for, as each ends by the deadline.

        Raises:
            RerankerError: The backend was closed meanwhile.
        """
        pending = set(futures)
        while pending and call.remaining() > 0 and not self._closing.done():
            done, pending = wait(
                pending | {self._closing}, call.remaining(), return_when=FIRST_COMPLETED
            )
            pending.discard(self._closing)
            if any(_unavailable(f) for f in done):
                break
        if pending:
            call.abandoned.set()
            for future in pending:
                future.cancel()
            if self._closing.done():
                raise self._closed_error()
            wait(pending, SETTLE_TIMEOUT)

    def _outcomes(self, futures: list[Future[T]], call: _Call) -> list[T | RerankerError]:
        """Each future's result, or the RerankerError that explains why there is none."""
        outcomes: list[T | RerankerError] = []
        for future in futures:
            # a variable, not append(...) directly: mypy infers T from append's context
            outcome = self._outcome(future, call)
            outcomes.append(outcome)
        return outcomes

    def _outcome(self, future: Future[T], call: _Call) -> T | RerankerError:
        """The future's result, or the RerankerError that explains why there is none."""
        if future.done() and not future.cancelled():
            error = future.exception()
            if error is None:
                return future.result()
            if isinstance(error, RerankerError):
                return error
            log.error("llama-server request failed unexpectedly", exc_info=error)
            return RerankerError(f"llama-server request failed: {_describe(error)}", "error")
        return _error(
            "timeout",
            f"llama-server at {self.base_url} gave no answer within {self._config.timeout:g} s",
        )

    def _combine(self, outcomes: list[float | RerankerError], call: _Call) -> list[float]:
        """Per-document outcomes to scores: missing ones rank last, unless all failed.

        Raises:
            RerankerError: Every document failed, the deadline passed or the server
                is unavailable.
        """
        failures = [o for o in outcomes if isinstance(o, RerankerError)]
        if not failures:
            return outcomes  # type: ignore[return-value]
        gave_up = call.remaining() <= 0 or any(isinstance(f, RerankerUnavailable) for f in failures)
        if gave_up or len(failures) == len(outcomes):
            raise _worst(failures)
        return self._fill_missing(outcomes, failures)

    def _fill_missing(
        self, outcomes: list[float | RerankerError], failures: list[RerankerError]
    ) -> list[float]:
        floor = min(o for o in outcomes if not isinstance(o, RerankerError))
        for failure in failures:
            RERANK_SERVER_ERRORS.labels(kind=failure.kind or "error").inc()
        log.warning(
            "llama-server could not score %d of %d documents; they rank last (%s)",
            len(failures), len(outcomes), failures[0],
        )
        return [floor if isinstance(o, RerankerError) else o for o in outcomes]

    # -- lifecycle

    def _ensure_open(self) -> tuple[httpx.Client, ThreadPoolExecutor]:
        """Return the client and the worker pool, creating them on first use."""
        with self._lock:
            if self._closed:
                raise self._closed_error()
            if self._client is None or self._pool is None:
                slots = self._config.parallel
                self._client = httpx.Client(
                    timeout=httpx.Timeout(self._config.timeout),
                    # the workers, plus health checks made by the calling threads
                    limits=httpx.Limits(max_connections=slots + 2, max_keepalive_connections=slots),
                    trust_env=False,  # a proxy from the environment would not reach a LAN server
                )
                self._pool = ThreadPoolExecutor(slots, thread_name_prefix="llama-server")
                log.info(
                    "llama-server reranker at %s (endpoint %s, parallel %d)",
                    self.base_url, self._config.endpoint, slots,
                )
            return self._client, self._pool

    def _closed_error(self) -> RerankerError:
        return RerankerError(f"the llama-server reranker for {self.base_url} is closed")

    def _record_failure(self, exc: RerankerError) -> None:
        kind = getattr(exc, "kind", None)
        if kind is None:  # closed: a lifecycle error, not a server error
            return
        self.last_error = str(exc)
        RERANK_SERVER_ERRORS.labels(kind=kind).inc()
        # The service warns once per distinct cause; repeating it here on every
        # search while the server is down would defeat that.
        log.debug("llama-server rerank failed (%s): %s", kind, exc)

    # -- health

    def _check_health(self, call: _Call) -> bool:
        """GET /health: 200 means ready, 503 means loading; never raises httpx errors."""
        client = self._ensure_open()[0]
        url = self.base_url + HEALTH_PATH
        try:
            response = client.get(url, timeout=min(call.remaining(), HEALTH_TIMEOUT_CAP) or 0.01)
        except httpx.HTTPError as exc:
            return self._set_health(False, f"{url}: {_describe(exc)}")
        except RuntimeError as exc:  # the client was closed under us
            raise self._closed_error() from exc
        if response.status_code == 200:
            return self._set_health(True, None)
        return self._set_health(
            False, f"{url}: HTTP {response.status_code} ({_server_message(response)})"
        )

    def _set_health(self, healthy: bool, error: str | None) -> bool:
        # Log transitions only: one warning when the server goes away, one line when back.
        if healthy and not self.healthy and self.last_error is not None:
            log.info("llama-server at %s is ready again", self.base_url)
        elif not healthy and (self.healthy or self.last_error is None):
            log.warning("llama-server at %s is not ready: %s", self.base_url, error)
        self.healthy = healthy
        self.last_error = error
        return healthy

    def _require_healthy(self, call: _Call) -> None:
        """Fail fast while unhealthy, after one fresh check (it may have just loaded)."""
        if self.healthy or self._check_health(call):
            return
        raise _error(
            "unavailable",
            f"llama-server at {self.base_url} is not ready ({self.last_error}); "
            "wait for the model to load or check that the server is running",
            unavailable=True,
        )

    # -- HTTP

    def _post(self, url: str, payload: dict[str, Any], call: _Call) -> Any:
        """POST ``payload`` within the call's deadline and return the decoded JSON body."""
        response = self._send(url, payload, call)
        return self._decode(url, response)

    def _send(self, url: str, payload: dict[str, Any], call: _Call) -> httpx.Response:
        """POST, retrying exactly once if the server dropped the connection."""
        try:
            return self._send_once(url, payload, call)
        except _DROPPED as exc:
            log.info("%s dropped the connection (%s); retrying once", url, _describe(exc))
        try:
            return self._send_once(url, payload, call)
        except _DROPPED as exc:
            raise self._transport_error(url, exc) from exc

    def _send_once(self, url: str, payload: dict[str, Any], call: _Call) -> httpx.Response:
        """POST once with the time the call has left; dropped connections pass through."""
        client = self._ensure_open()[0]
        left = call.remaining()
        if left <= 0 or call.abandoned.is_set():
            raise _error("timeout", f"{url}: no time left of {self._config.timeout:g} s")
        try:
            return client.post(url, json=payload, timeout=left)
        except _DROPPED:
            raise
        except httpx.HTTPError as exc:
            raise self._transport_error(url, exc) from exc
        except RuntimeError as exc:  # the client was closed under us
            raise self._closed_error() from exc

    def _transport_error(self, url: str, exc: BaseException) -> RerankerError:
        if isinstance(exc, httpx.TimeoutException):
            return _error("timeout", f"{url}: no answer within {self._config.timeout:g} s")
        if isinstance(exc, httpx.ConnectError):
            message = f"{url}: cannot connect ({_describe(exc)}); is llama-server running?"
            self._set_health(False, message)
            return _error("connection", message, unavailable=True)
        if isinstance(exc, _DROPPED):
            return _error("connection", f"{url}: connection dropped ({_describe(exc)})")
        return _error("connection", f"{url}: {_describe(exc)}")

    def _decode(self, url: str, response: httpx.Response) -> Any:
        """Map the HTTP status to an error, or return the JSON body."""
        status = response.status_code
        if status == 503:
            message = f"{url}: HTTP 503 ({_server_message(response)}); the model may be loading"
            self._set_health(False, message)
            raise _error("unavailable", message, unavailable=True)
        if status >= 500:
            raise _error("http_5xx", f"{url}: HTTP {status} ({_server_message(response)})")
        if status >= 400:
            raise _error("http_4xx", f"{url}: HTTP {status} ({_server_message(response)})")
        if status != 200:
            raise _error("malformed", f"{url}: unexpected HTTP {status}")
        try:
            return response.json()
        except ValueError as exc:
            raise _error(
                "malformed", f"{url}: response is not valid JSON ({exc}): {response.text[:200]!r}"
            ) from None


def _single(outcome: list[float] | RerankerError) -> float | RerankerError:
    """The outcome of a one-document rerank request as that document's outcome."""
    return outcome if isinstance(outcome, RerankerError) else outcome[0]


def _unavailable(future: Future[Any]) -> bool:
    """Whether a finished document future failed because the server is unavailable."""
    return (
        not future.cancelled()
        and future.done()
        and isinstance(future.exception(), RerankerUnavailable)
    )


def _worst(failures: list[RerankerError]) -> RerankerError:
    """The error that explains a failed call best: unavailable, then timeout, then first."""
    for failure in failures:
        if isinstance(failure, RerankerUnavailable):
            return failure
    for failure in failures:
        if failure.kind == "timeout":
            return failure
    return failures[0]
