"""Remote reranker: any server that speaks a rerank API (Cohere, Jina, TEI, Infinity, Voyage).

``backend = "rerank-api"`` sends the query and the candidates to ``url`` in the
profile's ``dialect``:

============  ================  ==================================  ======================
dialect       path              request                             scores
============  ================  ==================================  ======================
cohere        ``/v2/rerank``    model, query, documents, top_n      results[].relevance_score
jina          ``/v1/rerank``    model, query, documents, top_n      results[].relevance_score
tei           ``/rerank``       query, texts, raw_scores=false      [].score
infinity      ``/rerank``       model, query, documents, top_n      results[].relevance_score
voyage        ``/v1/rerank``    model, query, documents, top_k      data[].relevance_score
============  ================  ==================================  ======================

The ``jina`` dialect is also what vLLM and llama.cpp's ``llama-server --reranking``
speak.  ``url`` is the server root; a path the profile already ends with (``/v1``,
``/v2``) is not repeated.  Cohere also serves ``/v1/rerank`` (same request, same
answer): a root ending in ``/v1`` is sent there, not to ``/v1/v2/rerank``.

Scores: Cohere, Jina and Voyage document ``relevance_score`` in [0, 1]; TEI and
Infinity apply the model's sigmoid unless asked for raw scores (we never ask);
llama.cpp returns P(yes) for a Qwen3 rank GGUF but the raw logit for a BERT-style
cross-encoder GGUF.  ``score_scale = "auto"`` (or ``"probability"``) uses scores as
they come and treats one outside [0, 1] as a malformed answer that names the fix;
``"logit"`` applies the sigmoid.

Requests are split at ``max_documents`` documents (TEI's default client batch is 32,
Cohere's and Voyage's limit is 1,000) and sent one after another.  Every call has a
deadline of ``timeout`` seconds: each request gets only the time left, a 429 is
retried after its ``Retry-After`` and a 5xx after a short pause while that still
fits, and at the deadline the call gives up: nothing of it keeps running (the one
request in flight is bounded by the same deadline).  Called by the service, the
deadline is the service's (:mod:`memory.rerank.deadline`), so there is one
timeout; called directly (a benchmark), it is ``timeout`` from now.

The API key is read from the environment variable ``api_key_env`` names when the
backend is created; it is sent only in the ``Authorization`` header and never logged,
stored or put in a trace or an error message.
"""

from __future__ import annotations

import logging
import os
import threading
import time
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any
from urllib.parse import urlsplit

import httpx

from memory.config import DEFAULT_RERANK_TIMEOUT, RerankApiConfig
from memory.errors import ConfigError, RerankerError, RerankerUnavailable
from memory.llm import error_message, retry_after
from memory.metrics import RERANK_SERVER_ERRORS
from memory.rerank import deadline
from memory.rerank.score_parsing import sigmoid
from memory.text import valid_unicode
from memory.urls import public_url, refuse_url_credentials

log = logging.getLogger(__name__)

# How long to wait before retrying a 5xx that gave no Retry-After.
SERVER_ERROR_PAUSE = 0.5
# Attempts per request (the first included) while the deadline allows.
MAX_ATTEMPTS = 4
USER_AGENT = "discord-memory-bot (rerank-api)"

@dataclass(frozen=True)
class Dialect:
    """How one rerank API is asked and answers.

    Attributes:
        path: Appended to the server root.
        documents_key: The request field holding the documents.
        top_key: The request field asking for every result (None: not sent).
        results_key: Where the list of results sits in the answer (None: the answer is the list).
        score_key: The score field of one result.
        sends_model: Whether the request names ``model``.
        extra: Further fields sent with every request.
        other_paths: Older versions of ``path`` the API still serves with the same
            request and answer: a root that ends with their version is kept.
    """

    path: str
    documents_key: str = "documents"
    top_key: str | None = "top_n"
    results_key: str | None = "results"
    score_key: str = "relevance_score"
    sends_model: bool = True
    extra: tuple[tuple[str, Any], ...] = ()
    other_paths: tuple[str, ...] = ()

DIALECTS: dict[str, Dialect] = {
    # Cohere serves POST /v1/rerank beside /v2/rerank (its v1 and v2 clients): the same
    # model, query, documents and top_n, the same results[].relevance_score
    "cohere": Dialect("/v2/rerank", other_paths=("/v1/rerank",)),
    "jina": Dialect("/v1/rerank", extra=(("return_documents", False),)),
    "tei": Dialect("/rerank", documents_key="texts", top_key=None, results_key=None,
                   score_key="score", sends_model=False,
                   extra=(("raw_scores", False), ("return_text", False), ("truncate", True))),
    "infinity": Dialect("/rerank", extra=(("return_documents", False), ("raw_scores", False))),
    "voyage": Dialect("/v1/rerank", top_key="top_k", results_key="data",
                      extra=(("return_documents", False), ("truncation", True))),
}

def endpoint_url(base_url: str, dialect: Dialect) -> str:
    """The rerank URL for a server root given with or without its version prefix.

    Raises:
        ConfigError: ``base_url`` is not an http(s) URL, or it carries credentials
            or a query (see :func:`~memory.urls.refuse_url_credentials`).
    """
    if not base_url.startswith(("http://", "https://")):
        raise ConfigError(f"reranker.url must be an http(s) URL, got {public_url(base_url)!r}")
    refuse_url_credentials("reranker.url", base_url)
    base = base_url.rstrip("/")
    paths = (dialect.path, *dialect.other_paths)
    for path in paths:
        if base.endswith(path):
            return base
    for path in paths:  # a root given with its version keeps it: ".../v1" -> ".../v1/rerank"
        prefix = path.rsplit("/", 1)[0]  # "/v1", "/v2" or ""
        if prefix and base.endswith(prefix):
            return base[: -len(prefix)] + path
    return base + dialect.path

def read_api_key(env_name: str) -> str | None:
    """The key in the environment variable ``env_name`` (None when no variable is named).

    Raises:
        RerankerUnavailable: The variable is named but unset or empty.
    """
    if not env_name:
        return None
    key = os.environ.get(env_name, "").strip()
    if not key:
        raise RerankerUnavailable(
            f"reranker.api_key_env names {env_name}, which is not set: export it "
            "(the key is read from the environment only, never from the profile)", "auth"
        )
    return key

def parse_scores(body: Any, dialect: Dialect, count: int, scale: str) -> list[float]:
    """One score per document, in input order, from a rerank answer.

    Results may come in any order (most servers sort by score); they are mapped back by
    ``index``.

    Args:
        body: The decoded JSON answer.
        dialect: The API's shape.
        count: How many documents were sent.
        scale: ``auto``/``probability`` (used as is, must lie in [0, 1]) or ``logit``.

    Raises:
        ValueError: A field is missing, an index is out of range or repeated, a score is
            not a number or not a probability, or a document has no result.
    """
    results = body if dialect.results_key is None else _field(body, dialect.results_key)
    if not isinstance(results, list):
        raise ValueError(f"expected a list of results, got {type(results).__name__}")
    scores: dict[int, float] = {}
    for item in results:
        index = _field(item, "index")
        if not isinstance(index, int) or isinstance(index, bool) or not 0 <= index < count:
            raise ValueError(f"result index {index!r} is not one of the {count} documents sent")
        if index in scores:
            raise ValueError(f"document {index} has two results")
        scores[index] = _scaled(_field(item, dialect.score_key), scale)
    missing = [i for i in range(count) if i not in scores]
    if missing:
        raise ValueError(f"no result for document index(es) {missing[:10]}")
    return [scores[i] for i in range(count)]

def _field(obj: Any, key: str) -> Any:
    if not isinstance(obj, dict) or key not in obj:
        raise ValueError(f"missing {key!r}")
    return obj[key]

def _scaled(value: Any, scale: str) -> float:
    if not isinstance(value, (int, float)) or isinstance(value, bool) or value != value:
        raise ValueError(f"score {value!r} is not a number")
    if scale == "logit":
        return sigmoid(float(value))
    if not 0.0 <= value <= 1.0:
        raise ValueError(
            f"score {value:g} is not in [0, 1]: the server returns raw logits "
            "(llama.cpp does for BERT-style cross-encoders); set reranker.score_scale = \"logit\""
        )
    return float(value)

class RerankApiBackend:
    """Scores documents with a remote rerank API.

    Thread-safe: parallel searches share one pooled ``httpx.Client``.

    Attributes:
        name: ``"rerank-api"``.
        concurrent: True: parallel searches may score at once (each request is
            bounded by its call's deadline, so none outlives it).
        url: The rerank endpoint.
        host: The server's host name (what ``/memory privacy`` names).
        requests_sent: Requests sent so far (for benchmarks and metrics).

    Raises:
        ConfigError: ``config.url`` is not an http(s) URL, or it carries credentials
            or a query: logs and messages name ``url`` as it is.
    """

    name = "rerank-api"
    concurrent = True

    def __init__(self, config: RerankApiConfig, timeout: float = DEFAULT_RERANK_TIMEOUT) -> None:
        self.config = config
        self.timeout = timeout
        self.dialect = DIALECTS[config.dialect]
        self.url = endpoint_url(config.url, self.dialect)
        self.host = urlsplit(self.url).hostname or "?"
        self.requests_sent = 0
        self._key: str | None = None
        self._key_error: RerankerUnavailable | None = None
        try:
            self._key = read_api_key(config.api_key_env)
        except RerankerUnavailable as exc:  # said at load and on every search, never raised here
            self._key_error = exc
        self._lock = threading.Lock()
        self._client: httpx.Client | None = None
        self._closed = threading.Event()

    # -- public API

    def load(self) -> None:
        """Check that the key is there and open the connection pool.

        Nothing is sent: a hosted API bills per request, and the first search shows
        soon enough whether the server answers.

        Raises:
            RerankerUnavailable: The key's environment variable is unset.
        """
        if self._key_error is not None:
            raise self._key_error
        self._ensure_client()
        log.info("rerank-api reranker: %s dialect at %s (model %r, %d documents a request)",
                 self.config.dialect, self.url, self.config.model, self.config.max_documents)

    def score(self, query: str, texts: Sequence[str]) -> list[float]:
        """Return one relevance score in [0, 1] per text, in input order.

        Raises:
            RerankerUnavailable: No key, the key was refused, or the server is unreachable.
            RerankerError: Timeout, an HTTP error that outlived the retries, or a
                malformed answer.
        """
        if not texts:
            return []
        if self._key_error is not None:
            raise self._key_error
        until = deadline.within(self.timeout)
        query = valid_unicode(query)
        docs = [valid_unicode(t) for t in texts]
        size = self.config.max_documents
        scores: list[float] = []
        try:
            for start in range(0, len(docs), size):
                scores += self._score_chunk(query, docs[start:start + size], until)
        except RerankerError as exc:
            RERANK_SERVER_ERRORS.labels(kind=exc.kind or "error").inc()
            raise
        return scores

    def close(self) -> None:
        """Close the connections; calls in flight fail at once.  Safe to call twice."""
        self._closed.set()
        with self._lock:
            client, self._client = self._client, None
        if client is not None:
            client.close()

    # -- one request (with its retries)

    def _score_chunk(self, query: str, docs: list[str], until: float) -> list[float]:
        body = self._post_with_retries(self._payload(query, docs), until)
        try:
            return parse_scores(body, self.dialect, len(docs), self.config.score_scale)
        except ValueError as exc:
            raise RerankerError(f"{self.url}: unexpected answer: {exc}", "malformed") from None

    def _payload(self, query: str, docs: list[str]) -> dict[str, Any]:
        payload: dict[str, Any] = {"query": query, self.dialect.documents_key: docs}
        if self.dialect.sends_model:
            payload["model"] = self.config.model
        if self.dialect.top_key:
            payload[self.dialect.top_key] = len(docs)
        payload.update(self.dialect.extra)
        return payload

    def _post_with_retries(self, payload: dict[str, Any], until: float) -> Any:
        for attempt in range(1, MAX_ATTEMPTS + 1):
            response = self._post(payload, until)
            status = response.status_code
            if status == 200:
                return self._json(response)
            wait = self._retry_wait(response, attempt, until)
            if wait is None:
                raise self._http_error(response)
            log.info("%s answered %d; retrying in %.2f s (attempt %d)", self.host, status, wait,
                     attempt + 1)
            if self._closed.wait(wait):
                raise RerankerError("the rerank-api reranker was closed", "closed")
        raise AssertionError("unreachable: the last attempt returns or raises")

    def _retry_wait(self, response: httpx.Response, attempt: int, until: float) -> float | None:
        """Seconds to wait before trying again, or None when not to retry."""
        status = response.status_code
        if attempt >= MAX_ATTEMPTS or not (status == 429 or status >= 500):
            return None
        asked = retry_after(response.headers)
        wait = asked if asked is not None else (0.0 if status == 429 else SERVER_ERROR_PAUSE)
        # the retry needs time of its own after the wait
        return wait if time.monotonic() + wait < until else None

    def _post(self, payload: dict[str, Any], until: float) -> httpx.Response:
        left = until - time.monotonic()
        if left <= 0:
            raise self._timeout()
        client = self._ensure_client()
        try:
            with self._lock:
                self.requests_sent += 1
            return client.post(self.url, json=payload, headers=self._headers(), timeout=left)
        except httpx.TimeoutException:
            raise self._timeout() from None
        except httpx.TransportError as exc:
            raise RerankerUnavailable(
                f"cannot reach the rerank API at {self.url} ({type(exc).__name__}); "
                "is the server running and reranker.url right?", "connection"
            ) from None
        except RuntimeError:  # the client was closed under us
            raise RerankerError("the rerank-api reranker was closed", "closed") from None

    def _headers(self) -> dict[str, str]:
        headers = {"Accept": "application/json", "User-Agent": USER_AGENT}
        if self._key is not None:
            headers["Authorization"] = f"Bearer {self._key}"
        return headers

    def _json(self, response: httpx.Response) -> Any:
        try:
            return response.json()
        except ValueError:
            raise RerankerError(
                f"{self.url}: the answer is not JSON: {response.text[:120]!r}", "malformed"
            ) from None

    def _http_error(self, response: httpx.Response) -> RerankerError:
        status = response.status_code
        said = self._redacted(error_message(response.content))
        if status in (401, 403):
            where = f"check {self.config.api_key_env}" if self.config.api_key_env else (
                "set reranker.api_key_env to the variable holding the key")
            return RerankerUnavailable(
                f"the rerank API at {self.host} refused the API key ({status}: {said}); {where}",
                "auth",
            )
        if status == 429:
            return RerankerError(f"the rerank API at {self.host} is rate-limited ({said})",
                                 "rate_limited")
        kind = "http_5xx" if status >= 500 else "http_4xx"
        return RerankerError(f"{self.url}: HTTP {status} ({said})", kind)

    def _redacted(self, text: str) -> str:
        """``text`` without the API key, in case a server echoes it."""
        return text.replace(self._key, "[key]") if self._key else text

    def _timeout(self) -> RerankerError:
        return RerankerError(
            f"the rerank API at {self.host} gave no answer within {self.timeout:g} s",
            "timeout",
        )

    def _ensure_client(self) -> httpx.Client:
        with self._lock:
            if self._closed.is_set():
                raise RerankerError("the rerank-api reranker was closed", "closed")
            if self._client is None:
                self._client = httpx.Client(timeout=httpx.Timeout(self.timeout))
            return self._client
