"""Remote reranker: a llama.cpp ``llama-server`` running Qwen3-Reranker (GGUF).

``RerankerConfig.endpoint`` picks how the server is asked:

* ``chat``: one ``POST /v1/chat/completions`` per document with the official
  Qwen3-Reranker prompt, ``max_tokens=1`` and ``top_logprobs=20``.  The score is
  P(yes) over the two answer tokens (:func:`parse_chat_score`).
* ``rerank``: one ``POST /v1/rerank`` for all documents (a GGUF served with
  ``--reranking``).  Its ``relevance_score`` is a raw logit, squashed with a sigmoid
  (:func:`parse_rerank_scores`) so both paths give comparable scores in [0, 1].

The engine is synchronous and calls :meth:`LlamaServerBackend.score` from worker
threads, while httpx's client is async.  So the backend owns a private event loop in
a daemon thread with one ``httpx.AsyncClient``; ``score`` submits a coroutine to it
and waits at most ``timeout`` seconds for the whole call, and each HTTP request is
bounded by ``httpx.Timeout(timeout)``.  An ``asyncio.Semaphore(concurrency)`` shared
by all callers bounds the requests in flight.  A call that gives up sends none of its
queued requests, but lets the ones already sent finish (see :func:`_shielded`: httpcore
leaks pool slots when requests are cancelled).

Every failure becomes a :class:`~memory.errors.RerankerError` (or
:class:`~memory.errors.RerankerUnavailable` when the server cannot be reached or is
still loading its model) whose message names the URL; its ``kind`` attribute is the
label counted in ``RERANK_SERVER_ERRORS``.  No httpx exception escapes.  The only
retry is a single one when the server drops a connection without answering (a
keep-alive connection closed under us); everything else fails at once and the search
falls back to its pre-rerank order.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import logging
import math
import threading
from collections.abc import Callable, Coroutine, Sequence
from types import TracebackType
from typing import Any, TypeVar

import httpx

from memory.config import RerankerConfig
from memory.errors import ConfigError, RerankerError, RerankerUnavailable
from memory.metrics import RERANK_SERVER_ERRORS
from memory.reranker.prompt import chat_messages

log = logging.getLogger(__name__)

T = TypeVar("T")

HEALTH_PATH = "/health"
CHAT_PATH = "/v1/chat/completions"
RERANK_PATH = "/v1/rerank"
TOP_LOGPROBS = 20
# /health answers at once even while the server is busy, so it needs no long wait.
HEALTH_TIMEOUT_CAP = 5.0
CLOSE_TIMEOUT = 5.0
# A token missing from the top list is placed this many nats below the lowest listed one.
MISSING_TOKEN_MARGIN = 1.0
# Smallest leftover probability considered, so log(leftover) stays finite (about -30).
MIN_LEFTOVER = 1e-13
# Errors that mean the server closed the connection without a complete answer.
_DROPPED = (httpx.RemoteProtocolError, httpx.ReadError, httpx.WriteError)


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
    softmax over the two, ``sigmoid(lp_yes - lp_no)``.  A token missing from the list
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


def _top_logprobs(choice: dict[str, Any]) -> list[Any]:
    """Return ``choice.logprobs.content[0].top_logprobs``, or [] when absent."""
    logprobs = choice.get("logprobs")
    content = logprobs.get("content") if isinstance(logprobs, dict) else None
    if not isinstance(content, list) or not content or not isinstance(content[0], dict):
        return []
    top = content[0].get("top_logprobs")
    return top if isinstance(top, list) else []


def parse_chat_score(body: Any) -> float:
    """Return the relevance score from one ``/v1/chat/completions`` response.

    The score comes from ``choices[0].logprobs.content[0].top_logprobs`` (see
    :func:`yes_probability`).  When the server sent no top logprobs (absent or empty),
    it falls back to the generated token ``choices[0].message.content``: "yes" gives
    1.0, "no" gives 0.0, anything else is an error.

    Raises:
        ValueError: The response lacks the fields needed, or the answer is unusable.
    """
    choice = _get(_get(body, "choices", list), 0, dict)
    top = _top_logprobs(choice)
    if top:
        return yes_probability(top)
    text = _get(_get(choice, "message", dict), "content", str).strip().lower()
    if text in ("yes", "no"):
        return 1.0 if text == "yes" else 0.0
    raise ValueError(f"no logprobs, and the generated text {text!r} is neither yes nor no")


def parse_rerank_scores(body: Any, count: int) -> list[float]:
    """Return one score per document, in input order, from a ``/v1/rerank`` response.

    Results may come in any order (llama-server sorts them by score), so they are
    mapped back by ``index``.  ``relevance_score`` from a rerank-pooled GGUF is a raw
    logit; a sigmoid maps it to [0, 1], the same scale as the chat path's P(yes).

    Args:
        body: The decoded JSON response.
        count: How many documents were sent.

    Raises:
        ValueError: A field is missing, an index is out of range, or a document has
            no result.
    """
    scores: dict[int, float] = {}
    for item in _get(body, "results", list):
        index = _get(item, "index", int)
        if not 0 <= index < count:
            raise ValueError(f"result index {index} is out of range for {count} documents")
        scores[index] = sigmoid(_number(item, "relevance_score"))
    missing = [i for i in range(count) if i not in scores]
    if missing:
        raise ValueError(f"no result for document index(es) {missing[:10]}")
    return [scores[i] for i in range(count)]


# ------------------------------------------------------------------------ helpers


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


def _run_loop(loop: asyncio.AbstractEventLoop) -> None:
    """Thread target: run ``loop`` until stopped, then release and close it."""
    asyncio.set_event_loop(loop)
    try:
        loop.run_forever()
    finally:
        try:
            # as asyncio.run does: tasks started while close() cancelled the others
            # (anyio's connection attempts) must still run to their cancellation
            pending = asyncio.all_tasks(loop)
            for task in pending:
                task.cancel()
            loop.run_until_complete(asyncio.gather(*pending, return_exceptions=True))
            loop.run_until_complete(loop.shutdown_asyncgens())
            loop.run_until_complete(loop.shutdown_default_executor())
        finally:
            loop.close()


def _detach(request: Coroutine[Any, Any, T]) -> asyncio.Task[T]:
    """Run ``request`` as its own task whose outcome is always retrieved.

    ``asyncio.shield`` stops watching the inner task once its caller is cancelled, so
    the failure of an abandoned request would otherwise be logged by asyncio as
    "Task exception was never retrieved".
    """
    task = asyncio.ensure_future(request)
    task.add_done_callback(_consume_outcome)
    return task


def _consume_outcome(task: asyncio.Task[Any]) -> None:
    if not task.cancelled() and task.exception() is not None:
        log.debug("a request nobody waits for anymore ended with %s", task.exception())


async def _shielded(request: Coroutine[Any, Any, T]) -> T:
    """Await ``request`` in its own task, so cancelling the caller does not cancel it.

    httpcore 1.0 leaks a connection-pool slot when a request is cancelled while it
    waits for or opens a connection (encode/httpcore#1093, #830); a few leaks and
    every later request hangs.  So a caller that gives up (whole-call timeout, a
    sibling request's failure) only stops waiting; the request runs on until it ends
    or httpx's own timeout ends it.  Only :meth:`LlamaServerBackend.close` cancels
    requests, and it discards the pool right after.
    """
    return await asyncio.shield(_detach(request))


# ------------------------------------------------------------------------ backend


class LlamaServerBackend:
    """Scores documents with Qwen3-Reranker served by a llama.cpp ``llama-server``.

    Thread-safe: any number of worker threads may call :meth:`score` at once.

    Attributes:
        name: ``"llama-server"``.
        base_url: The server root the paths are appended to.
        healthy: Whether the last health check (or request) found the server ready;
            False until the first check.
        last_error: The most recent problem (failed health check or failed call),
            reset to None when a health check succeeds.
    """

    name = "llama-server"

    def __init__(self, config: RerankerConfig) -> None:
        """Prepare the backend; nothing is started until :meth:`start` or first use.

        Args:
            config: The reranker section; uses url, endpoint, instruction, timeout,
                concurrency and health_interval.

        Raises:
            ConfigError: ``config.url`` is not an http(s) URL.
        """
        self.base_url = _base_url(config.url)
        self.healthy = False
        self.last_error: str | None = None
        self._config = config
        self._health_timeout = min(config.timeout, HEALTH_TIMEOUT_CAP)
        self._lock = threading.Lock()
        self._closed = False
        self._loop: asyncio.AbstractEventLoop | None = None
        self._thread: threading.Thread | None = None
        self._client: httpx.AsyncClient | None = None
        self._semaphore: asyncio.Semaphore | None = None

    # -- public API

    def start(self) -> bool:
        """Start the client and periodic health checks (once), and check health now.

        Returns:
            Whether the server is ready.  A server that is down or loading is not an
            error here; :meth:`score` raises RerankerUnavailable while it lasts.

        Raises:
            RerankerError: The backend was closed.
        """
        return self._wait(self._submit(self._check_health), self._health_timeout + 1.0)

    def load(self) -> None:
        """The :class:`~memory.reranker.base.RerankerBackend` start-up step: :meth:`start`."""
        self.start()

    def score(self, query: str, texts: Sequence[str]) -> list[float]:
        """Return one relevance score in [0, 1] per text, in input order.

        Args:
            query: The search query.
            texts: The candidate documents.

        Returns:
            The scores; ``[]`` for no texts (no request is made).

        Raises:
            RerankerUnavailable: The server is down or still loading its model.
            RerankerError: Timeout, HTTP error, malformed answer, dropped connection,
                or the backend was closed.
        """
        docs = list(texts)
        if not docs:
            return []
        try:
            future = self._submit(lambda: self._score(query, docs))
            return self._wait(future, self._config.timeout)
        except RerankerError as exc:
            self._record_failure(exc)
            raise

    def close(self) -> None:
        """Stop the health task, close the HTTP client and end the loop thread.

        Calls still in flight fail with RerankerError.  Safe to call more than once.
        """
        with self._lock:
            if self._closed:
                return
            self._closed = True
            loop, thread = self._loop, self._thread
        self.healthy = False
        if loop is None or thread is None:
            return
        try:
            asyncio.run_coroutine_threadsafe(self._shutdown(), loop).result(CLOSE_TIMEOUT)
        except Exception as exc:  # closing must not raise; the thread is stopped anyway
            log.warning("closing the llama-server client for %s failed: %s", self.base_url, exc)
        loop.call_soon_threadsafe(loop.stop)
        thread.join(CLOSE_TIMEOUT)
        if thread.is_alive():
            log.warning("the llama-server reranker thread did not stop within %s s", CLOSE_TIMEOUT)

    def __enter__(self) -> LlamaServerBackend:
        return self

    def __exit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        self.close()

    # -- the loop thread

    def _ensure_loop(self) -> asyncio.AbstractEventLoop:
        """Return the private loop, starting its thread and client on first use."""
        with self._lock:
            if self._closed:
                raise RerankerError(f"the llama-server reranker for {self.base_url} is closed")
            if self._loop is None:
                loop = asyncio.new_event_loop()
                thread = threading.Thread(
                    target=_run_loop, args=(loop,), name="llama-server-reranker", daemon=True
                )
                thread.start()
                asyncio.run_coroutine_threadsafe(self._open(), loop).result(CLOSE_TIMEOUT)
                self._loop, self._thread = loop, thread
            return self._loop

    def _submit(self, make: Callable[[], Coroutine[Any, Any, T]]) -> concurrent.futures.Future[T]:
        """Schedule ``make()`` on the private loop (the coroutine is built only then)."""
        loop = self._ensure_loop()
        coro = make()
        try:
            return asyncio.run_coroutine_threadsafe(coro, loop)
        except RuntimeError:  # the loop closed between the check and the submit
            coro.close()
            raise RerankerError(f"the llama-server reranker for {self.base_url} is closed") from None

    def _wait(self, future: concurrent.futures.Future[T], timeout: float) -> T:
        """Wait for ``future``; on timeout cancel it so its queued requests are never sent."""
        try:
            return future.result(timeout)
        except concurrent.futures.TimeoutError:
            future.cancel()
            raise _error(
                "timeout", f"llama-server at {self.base_url} gave no answer within {timeout:g} s"
            ) from None
        except concurrent.futures.CancelledError:
            raise RerankerError(
                f"the llama-server reranker for {self.base_url} was closed during the call"
            ) from None

    def _record_failure(self, exc: RerankerError) -> None:
        kind = getattr(exc, "kind", None)
        if kind is None:  # closed: a lifecycle error, not a server error
            return
        self.last_error = str(exc)
        RERANK_SERVER_ERRORS.labels(kind=kind).inc()
        log.warning("llama-server rerank failed (%s): %s", kind, exc)

    async def _open(self) -> None:
        """Create the client, the semaphore and the periodic health task (in the loop)."""
        slots = self._config.concurrency + 1  # one spare connection for /health
        self._client = httpx.AsyncClient(
            timeout=httpx.Timeout(self._config.timeout),
            limits=httpx.Limits(max_connections=slots, max_keepalive_connections=slots),
            trust_env=False,  # a proxy from the environment would not reach a LAN server
        )
        self._semaphore = asyncio.Semaphore(self._config.concurrency)
        asyncio.get_running_loop().create_task(self._health_loop(), name="llama-server-health")
        log.info(
            "llama-server reranker at %s (endpoint %s, concurrency %d)",
            self.base_url, self._config.endpoint, self._config.concurrency,
        )

    async def _shutdown(self) -> None:
        """Cancel every task on the loop (health, calls in flight), close the client."""
        current = asyncio.current_task()
        tasks = [task for task in asyncio.all_tasks() if task is not current]
        for task in tasks:
            task.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)
        if self._client is not None:
            await self._client.aclose()

    # -- health

    async def _health_loop(self) -> None:
        while True:
            await asyncio.sleep(self._config.health_interval)
            try:
                await self._check_health()
            except Exception:  # keep checking; a bug here must not stop the loop
                log.exception("health check of %s failed unexpectedly", self.base_url)

    async def _check_health(self) -> bool:
        """GET /health: 200 means ready, 503 means loading; never raises httpx errors."""
        assert self._client is not None
        url = self.base_url + HEALTH_PATH
        request = self._client.get(url, timeout=self._health_timeout)
        try:
            response = await _shielded(request)
        except httpx.HTTPError as exc:
            return self._set_health(False, f"{url}: {_describe(exc)}")
        if response.status_code == 200:
            return self._set_health(True, None)
        return self._set_health(
            False, f"{url}: HTTP {response.status_code} ({_server_message(response)})"
        )

    def _set_health(self, healthy: bool, error: str | None) -> bool:
        if healthy and not self.healthy:
            log.info("llama-server at %s is ready", self.base_url)
        elif not healthy and (self.healthy or error != self.last_error):
            log.warning("llama-server at %s is not ready: %s", self.base_url, error)
        self.healthy = healthy
        self.last_error = error
        return healthy

    async def _require_healthy(self) -> None:
        """Fail fast while unhealthy, after one fresh check (it may have just loaded)."""
        if self.healthy or await self._check_health():
            return
        raise _error(
            "unavailable",
            f"llama-server at {self.base_url} is not ready ({self.last_error}); "
            "wait for the model to load or check that the server is running",
            unavailable=True,
        )

    # -- scoring

    async def _score(self, query: str, docs: list[str]) -> list[float]:
        await self._require_healthy()
        if self._config.endpoint == "rerank":
            return await self._score_rerank(query, docs)
        return await self._score_chat(query, docs)

    async def _score_chat(self, query: str, docs: list[str]) -> list[float]:
        """One chat request per document, all submitted, the semaphore pacing them."""
        tasks = [asyncio.ensure_future(self._score_one(query, doc)) for doc in docs]
        try:
            return list(await asyncio.gather(*tasks))
        finally:
            for task in tasks:  # after a failure, send none of the queued requests
                task.cancel()

    async def _score_one(self, query: str, doc: str) -> float:
        url = self.base_url + CHAT_PATH
        payload = {
            "messages": chat_messages(self._config.instruction, query, doc),
            "max_tokens": 1,
            "temperature": 0,
            "logprobs": True,
            "top_logprobs": TOP_LOGPROBS,
        }
        body = await self._post(url, payload)
        return self._parse(url, lambda: parse_chat_score(body))

    async def _score_rerank(self, query: str, docs: list[str]) -> list[float]:
        """One /v1/rerank request; the server applies the model's own rerank template."""
        url = self.base_url + RERANK_PATH
        body = await self._post(url, {"query": query, "documents": docs, "top_n": len(docs)})
        return self._parse(url, lambda: parse_rerank_scores(body, len(docs)))

    @staticmethod
    def _parse(url: str, parse: Callable[[], T]) -> T:
        try:
            return parse()
        except ValueError as exc:
            raise _error("malformed", f"{url}: unexpected response: {exc}") from None

    # -- HTTP

    async def _post(self, url: str, payload: dict[str, Any]) -> Any:
        """POST ``payload`` holding a semaphore slot and return the decoded JSON body.

        The slot is taken here (waiting for it is safely cancellable, so a call that
        gives up sends nothing more) and freed when the request itself ends, so the
        server never sees more than ``concurrency`` requests, even from abandoned calls.
        """
        assert self._semaphore is not None
        semaphore = self._semaphore
        await semaphore.acquire()
        request = _detach(self._send(url, payload))
        request.add_done_callback(lambda _: semaphore.release())
        response = await asyncio.shield(request)
        return self._decode(url, response)

    async def _send(self, url: str, payload: dict[str, Any]) -> httpx.Response:
        """POST, retrying exactly once if the server dropped the connection."""
        try:
            return await self._send_once(url, payload)
        except _DROPPED as exc:
            log.info("%s dropped the connection (%s); retrying once", url, _describe(exc))
        try:
            return await self._send_once(url, payload)
        except _DROPPED as exc:
            raise self._transport_error(url, exc) from exc

    async def _send_once(self, url: str, payload: dict[str, Any]) -> httpx.Response:
        """POST once; dropped connections pass through raw, other failures translate.

        The request is bounded by the client's ``httpx.Timeout(timeout)`` (connect,
        write, pool and read each), never by cancelling it: see :func:`_shielded`.
        """
        assert self._client is not None
        try:
            return await self._client.post(url, json=payload)
        except _DROPPED:
            raise
        except httpx.HTTPError as exc:
            raise self._transport_error(url, exc) from exc

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
            raise _error(
                "http_4xx",
                f"{url}: HTTP {status} ({_server_message(response)}); "
                "check reranker.endpoint and the server's flags",
            )
        if status != 200:
            raise _error("malformed", f"{url}: unexpected HTTP {status}")
        try:
            return response.json()
        except ValueError as exc:
            raise _error(
                "malformed", f"{url}: response is not valid JSON ({exc}): {response.text[:200]!r}"
            ) from None
