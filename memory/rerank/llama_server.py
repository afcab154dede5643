"""Remote reranker: a llama.cpp ``llama-server`` running Qwen3-Reranker (GGUF).

``LlamaServerConfig.endpoint`` picks how the server is asked:

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

This module holds the backend: what each endpoint is sent, truncation, and the
shared worker pool.  :mod:`memory.rerank.llama_http` talks HTTP (health, requests
within a deadline, token ids); :mod:`memory.rerank.score_parsing` reads the answers.
"""

from __future__ import annotations

import logging
from collections.abc import Sequence
from types import TracebackType
from typing import TypeVar
from urllib.parse import urlsplit

from memory.config import DEFAULT_INSTRUCTION, DEFAULT_RERANK_TIMEOUT, LlamaServerConfig
from memory.errors import RerankerError, RerankerUnavailable
from memory.metrics import RERANK_SERVER_ERRORS
from memory.rerank import deadline
from memory.rerank.llama_http import HEALTH_TIMEOUT_CAP, Call, LlamaServerClient, describe
from memory.rerank.llama_slots import RequestSlots
from memory.rerank.prompt import (
    SUFFIX,
    chat_messages,
    document_text,
    full_prompt,
    head_text,
)
from memory.rerank.score_parsing import (
    parse_chat_score,
    parse_completion_score,
    parse_rerank_scores,
)
from memory.text import valid_unicode

log = logging.getLogger(__name__)

T = TypeVar("T")

COMPLETION_PATH = "/completion"
CHAT_PATH = "/v1/chat/completions"
RERANK_PATH = "/v1/rerank"
TOP_LOGPROBS = 20
# The instruction llama.cpp's convert_hf_to_gguf.py writes into a Qwen3-Reranker rank
# GGUF's "rerank" chat template; /v1/rerank always scores with it.
RERANK_INSTRUCTION = "Given a web search query, retrieve relevant passages that answer the query"
# Error kinds a single document can cause (unlike timeouts and outages).
_DOCUMENT_FAULTS = frozenset({"http_4xx", "http_5xx", "malformed"})


class LlamaServerBackend:
    """Scores documents with Qwen3-Reranker served by a llama.cpp ``llama-server``.

    Thread-safe: any number of threads may call :meth:`score` at once; they share
    ``parallel`` request slots.

    Attributes:
        name: ``"llama-server"``.
        concurrent: True: any number of searches may score at once (they share
            the ``parallel`` request slots).
        host: The server's host name (what ``/memory privacy`` names).
    """

    name = "llama-server"
    concurrent = True

    def __init__(
        self, config: LlamaServerConfig, timeout: float = DEFAULT_RERANK_TIMEOUT
    ) -> None:
        """Prepare the backend; no connection or thread exists before first use.

        Args:
            config: The profile's ``[reranker]`` settings for this backend.
            timeout: Seconds one search's call may take (``reranker.timeout``).

        Raises:
            ConfigError: ``config.url`` is not an http(s) URL.
        """
        self._http = LlamaServerClient(config, timeout)
        self.host = urlsplit(self._http.base_url).hostname or "?"
        self._slots = RequestSlots(config, self._http)
        self._config = config
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

    @property
    def base_url(self) -> str:
        """The server root the paths are appended to."""
        return self._http.base_url

    @property
    def healthy(self) -> bool:
        """Whether the last health check (or request) found the server ready."""
        return self._http.healthy

    @property
    def closed(self) -> bool:
        """Whether :meth:`close` was called."""
        return self._slots.closed

    @property
    def last_error(self) -> str | None:
        """The most recent problem; None again once a health check succeeds."""
        return self._http.last_error

    # -- public API

    def start(self) -> bool:
        """Check the server's health now.

        Returns:
            Whether the server is ready.  A server that is down or loading is not an
            error here; :meth:`score` raises RerankerUnavailable while it lasts.

        Raises:
            RerankerError: The backend was closed.
        """
        self._slots.open()
        return self._http.check_health(Call(deadline.within(HEALTH_TIMEOUT_CAP)))

    def load(self) -> None:
        """The :class:`~memory.rerank.base.RerankerBackend` start-up step: :meth:`start`."""
        self.start()

    def score(self, query: str, texts: Sequence[str]) -> list[float]:
        """Return one relevance score in [0, 1] per text, in input order.

        The call ends by the service's deadline (:mod:`memory.rerank.deadline`), or
        ``timeout`` seconds from now when called directly.

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
        call = Call(deadline.within(self._http.timeout))
        try:
            return self._score(valid_unicode(query), [valid_unicode(t) for t in texts], call)
        except RerankerError as exc:
            self._record_failure(exc)
            raise
        except Exception as exc:  # a bug here must not reach the search as a traceback
            log.exception("llama-server reranker failed unexpectedly")
            raise RerankerError(f"llama-server reranker failed: {describe(exc)}") from exc
        finally:
            call.abandoned.set()

    def close(self) -> None:
        """Cancel queued requests, close the HTTP client and end the worker threads.

        Calls in flight fail with RerankerError at once.  Safe to call more than once.
        """
        if self._slots.close():
            self._http.close()

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

    def _score(self, query: str, docs: list[str], call: Call) -> list[float]:
        self._slots.open()
        self._http.require_healthy(call)
        if self._config.endpoint == "rerank":
            return self._rerank(call, query, docs)
        head = self._head_ids(query, docs, call)
        one = self._completion_one if self._config.endpoint == "completion" else self._chat_one
        futures = [self._slots.submit(call, one, query, doc, head) for doc in docs]
        self._slots.settle(futures, call)
        return _combine(self._slots.outcomes(futures), call)

    def _rerank(self, call: Call, query: str, docs: list[str]) -> list[float]:
        """All documents in one /v1/rerank request; one request each if that is refused.

        The server refuses a whole batch for one document it will not take (an HTTP
        error or an unusable answer), so after such a refusal each document is asked
        alone and only the one at fault goes missing.
        """
        future = self._slots.submit(call, self._score_rerank, query, docs)
        self._slots.settle([future], call)
        scores = self._slots.outcome(future)
        if not isinstance(scores, RerankerError):
            return scores
        if len(docs) == 1 or scores.kind not in _DOCUMENT_FAULTS or call.remaining() <= 0:
            raise scores
        log.info("llama-server refused the rerank batch (%s); asking per document", scores)
        futures = [self._slots.submit(call, self._score_rerank, query, [doc]) for doc in docs]
        self._slots.settle(futures, call)
        return _combine([_single(a) for a in self._slots.outcomes(futures)], call)

    def _completion_one(self, call: Call, query: str, doc: str, head: list[int] | None) -> float:
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
        return self._http.ask(COMPLETION_PATH, payload, call, parse_completion_score)

    def _chat_one(self, call: Call, query: str, doc: str, head: list[int] | None) -> float:
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
        return self._http.ask(CHAT_PATH, payload, call, parse_chat_score)

    def _score_rerank(self, call: Call, query: str, docs: list[str]) -> list[float]:
        """One /v1/rerank request; the server applies the GGUF's own rerank template."""
        long = [
            i for i, d in enumerate(docs)
            if self._too_long(full_prompt(RERANK_INSTRUCTION, query, d))
        ]
        if long:
            head = len(self._http.tokenize(head_text(RERANK_INSTRUCTION, query), call))
            docs = list(docs)
            for i in long:
                docs[i] = self._detokenize(self._doc_ids(docs[i], head, call), call)
        payload = {"query": query, "documents": docs, "top_n": len(docs)}
        return self._http.ask(RERANK_PATH, payload, call,
                              lambda body: parse_rerank_scores(body, len(docs)))

    # -- truncation to max_length tokens, as the in-process backend does

    def _too_long(self, prompt: str) -> bool:
        # every token of a byte-level BPE covers at least one UTF-8 byte
        return len(prompt.encode("utf-8")) > self._config.max_length

    def _head_ids(self, query: str, docs: list[str], call: Call) -> list[int] | None:
        """Token ids of the shared prompt head, fetched only if some document may be long."""
        instruction = self._config.instruction
        if not any(self._too_long(full_prompt(instruction, query, d)) for d in docs):
            return None
        return self._http.tokenize(head_text(instruction, query), call)

    def _suffix(self, call: Call) -> list[int]:
        if self._suffix_ids is None:
            self._suffix_ids = self._http.tokenize(SUFFIX, call)
        return self._suffix_ids

    def _doc_ids(self, doc: str, head_len: int, call: Call) -> list[int]:
        """The document's token ids, cut to what ``max_length`` leaves it (at least one)."""
        budget = max(1, self._config.max_length - head_len - len(self._suffix(call)))
        ids = self._http.tokenize(document_text(doc), call)
        if len(ids) > budget:
            log.debug("document of %d tokens cut to %d for the reranker", len(ids), budget)
        return ids[:budget]

    def _detokenize(self, ids: list[int], call: Call) -> str:
        """Text of document ids (which start with the separating space) without that space."""
        return self._http.detokenize(ids, call).removeprefix(" ")

    # -- lifecycle

    def _record_failure(self, exc: RerankerError) -> None:
        kind = getattr(exc, "kind", None)
        if kind is None:  # closed: a lifecycle error, not a server error
            return
        self._http.last_error = str(exc)
        RERANK_SERVER_ERRORS.labels(kind=kind).inc()
        # The service warns once per distinct cause; repeating it here on every
        # search while the server is down would defeat that.
        log.debug("llama-server rerank failed (%s): %s", kind, exc)


def _single(outcome: list[float] | RerankerError) -> float | RerankerError:
    """The outcome of a one-document rerank request as that document's outcome."""
    return outcome if isinstance(outcome, RerankerError) else outcome[0]


def _combine(outcomes: list[float | RerankerError], call: Call) -> list[float]:
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
    floor = min(o for o in outcomes if not isinstance(o, RerankerError))
    for failure in failures:
        RERANK_SERVER_ERRORS.labels(kind=failure.kind or "error").inc()
    log.warning(
        "llama-server could not score %d of %d documents; they rank last (%s)",
        len(failures), len(outcomes), failures[0],
    )
    return [floor if isinstance(o, RerankerError) else o for o in outcomes]


def _worst(failures: list[RerankerError]) -> RerankerError:
    """The error that explains a failed call best: unavailable, then timeout, then first."""
    for failure in failures:
        if isinstance(failure, RerankerUnavailable):
            return failure
    for failure in failures:
        if failure.kind == "timeout":
            return failure
    return failures[0]
