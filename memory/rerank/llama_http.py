"""The HTTP side of the llama-server reranker: health, requests within a deadline, tokens.

:class:`LlamaServerClient` owns one ``httpx.Client`` for one server.  Every request
belongs to a :class:`Call` (one :meth:`~memory.rerank.llama_server.LlamaServerBackend.score`)
and is given only the time that call has left.  Every failure becomes a
:class:`~memory.errors.RerankerError` (or :class:`~memory.errors.RerankerUnavailable`
when the server cannot be reached or is still loading) whose message names the URL
and whose ``kind`` is the label counted in ``RERANK_SERVER_ERRORS``; no httpx
exception escapes.
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any, TypeVar

import httpx

from memory.config import DEFAULT_RERANK_TIMEOUT, LlamaServerConfig
from memory.errors import ConfigError, RerankerError, RerankerUnavailable
from memory.rerank.score_parsing import typed_field
from memory.urls import public_url, refuse_url_credentials

log = logging.getLogger(__name__)

T = TypeVar("T")

HEALTH_PATH = "/health"
TOKENIZE_PATH = "/tokenize"
DETOKENIZE_PATH = "/detokenize"
# /health answers at once even while the server is busy, so it needs no long wait.
HEALTH_TIMEOUT_CAP = 5.0
# Errors that mean the server closed the connection without a complete answer.
DROPPED = (httpx.RemoteProtocolError, httpx.ReadError, httpx.WriteError)


@dataclass
class Call:
    """One score call: its deadline and whether it gave up."""

    deadline: float
    abandoned: threading.Event = field(default_factory=threading.Event)

    def remaining(self) -> float:
        """Seconds left before the deadline (never negative)."""
        return max(0.0, self.deadline - time.monotonic())


def error(kind: str, message: str, *, unavailable: bool = False) -> RerankerError:
    """Build the error a call raises; ``kind`` is its RERANK_SERVER_ERRORS label."""
    return (RerankerUnavailable if unavailable else RerankerError)(message, kind)


def describe(exc: BaseException) -> str:
    """An exception's type and message on one line."""
    text = str(exc)
    return f"{type(exc).__name__}: {text}" if text else type(exc).__name__


def server_root(url: str) -> str:
    """Return the server root: no trailing slash and no trailing ``/v1``.

    Raises:
        ConfigError: ``url`` is not an http(s) URL, or it carries credentials or a
            query (logs and messages name the root as it is).
    """
    if not url.startswith(("http://", "https://")):
        raise ConfigError("reranker.url must be the http(s) URL of a llama-server, "
                          f"got {public_url(url)!r}")
    refuse_url_credentials("reranker.url", url)
    base = url.rstrip("/")
    return base.removesuffix("/v1")


def _server_message(response: httpx.Response) -> str:
    """Return llama-server's ``error.message``, or the start of the body."""
    try:
        message = response.json()["error"]["message"]
    except (ValueError, KeyError, TypeError):
        return response.text[:200] or "empty body"
    return str(message)


class LlamaServerClient:
    """Requests to one llama-server, each within its call's deadline; thread-safe.

    Attributes:
        base_url: The server root the paths are appended to.
        timeout: Seconds one search's call may take.
        healthy: Whether the last health check (or request) found the server ready;
            False until the first check.
        last_error: The most recent problem (failed health check or failed call),
            reset to None when a health check succeeds.

    Args:
        config: The profile's ``[reranker]`` settings for llama-server; uses url and
            parallel.
        timeout: Seconds one search's call may take (``reranker.timeout``).

    Raises:
        ConfigError: ``config.url`` is not an http(s) URL.
    """

    def __init__(
        self, config: LlamaServerConfig, timeout: float = DEFAULT_RERANK_TIMEOUT
    ) -> None:
        self.base_url = server_root(config.url)
        self.timeout = timeout
        self.healthy = False
        self.last_error: str | None = None
        self._config = config
        self._lock = threading.Lock()
        self._client: httpx.Client | None = None
        self._closed = False

    def open(self) -> httpx.Client:
        """The HTTP client, created on first use.

        Raises:
            RerankerError: The client was closed.
        """
        with self._lock:
            if self._closed:
                raise self.closed_error()
            if self._client is None:
                slots = self._config.parallel
                self._client = httpx.Client(
                    timeout=httpx.Timeout(self.timeout),
                    # the workers, plus health checks made by the calling threads
                    limits=httpx.Limits(max_connections=slots + 2, max_keepalive_connections=slots),
                    trust_env=False,  # a proxy from the environment would not reach a LAN server
                )
            return self._client

    def close(self) -> None:
        """Close the HTTP client; requests on the wire fail at once."""
        with self._lock:
            self._closed = True
            client, self._client = self._client, None
        self.healthy = False
        if client is not None:
            client.close()

    def closed_error(self) -> RerankerError:
        """The error every call after :meth:`close` raises."""
        return RerankerError(f"the llama-server reranker for {self.base_url} is closed")

    # -- health

    def check_health(self, call: Call) -> bool:
        """GET /health: 200 means ready, 503 means loading; never raises httpx errors."""
        client = self.open()
        url = self.base_url + HEALTH_PATH
        try:
            response = client.get(url, timeout=min(call.remaining(), HEALTH_TIMEOUT_CAP) or 0.01)
        except httpx.HTTPError as exc:
            return self.set_health(False, f"{url}: {describe(exc)}")
        except RuntimeError as exc:  # the client was closed under us
            raise self.closed_error() from exc
        if response.status_code == 200:
            return self.set_health(True, None)
        return self.set_health(
            False, f"{url}: HTTP {response.status_code} ({_server_message(response)})"
        )

    def set_health(self, healthy: bool, problem: str | None) -> bool:
        """Record the server's state; log only transitions.  Returns ``healthy``."""
        # one warning when the server goes away, one line when it is back
        if healthy and not self.healthy and self.last_error is not None:
            log.info("llama-server at %s is ready again", self.base_url)
        elif not healthy and (self.healthy or self.last_error is None):
            log.warning("llama-server at %s is not ready: %s", self.base_url, problem)
        self.healthy = healthy
        self.last_error = problem
        return healthy

    def require_healthy(self, call: Call) -> None:
        """Fail fast while unhealthy, after one fresh check (it may have just loaded).

        Raises:
            RerankerUnavailable: The server is down or still loading.
        """
        if self.healthy or self.check_health(call):
            return
        raise error(
            "unavailable",
            f"llama-server at {self.base_url} is not ready ({self.last_error}); "
            "wait for the model to load or check that the server is running",
            unavailable=True,
        )

    # -- requests

    def post(self, path: str, payload: dict[str, Any], call: Call) -> Any:
        """POST ``payload`` within the call's deadline and return the decoded JSON body."""
        url = self.base_url + path
        return self._decode(url, self._send(url, payload, call))

    def ask(self, path: str, payload: dict[str, Any], call: Call, read: Callable[[Any], T]) -> T:
        """POST and read the answer with ``read``; a ValueError from it is a malformed answer.

        Raises:
            RerankerError: The request failed or the answer is unusable (``malformed``).
        """
        body = self.post(path, payload, call)
        try:
            return read(body)
        except ValueError as exc:
            raise error("malformed", f"{self.base_url + path}: unexpected response: {exc}") from None

    def tokenize(self, text: str, call: Call) -> list[int]:
        """The server's token ids of ``text`` (special tokens parsed, none added)."""

        def tokens(body: Any) -> list[int]:
            ids = typed_field(body, "tokens", list)
            if not all(isinstance(i, int) and not isinstance(i, bool) for i in ids):
                raise ValueError("'tokens' holds something other than token ids")
            return ids

        payload = {"content": text, "add_special": False, "parse_special": True}
        return self.ask(TOKENIZE_PATH, payload, call, tokens)

    def detokenize(self, ids: list[int], call: Call) -> str:
        """The text of token ids."""
        return self.ask(DETOKENIZE_PATH, {"tokens": ids}, call,
                        lambda body: typed_field(body, "content", str))

    def _send(self, url: str, payload: dict[str, Any], call: Call) -> httpx.Response:
        """POST, retrying exactly once if the server dropped the connection."""
        try:
            return self._send_once(url, payload, call)
        except DROPPED as exc:
            log.info("%s dropped the connection (%s); retrying once", url, describe(exc))
        try:
            return self._send_once(url, payload, call)
        except DROPPED as exc:
            raise self._transport_error(url, exc) from exc

    def _send_once(self, url: str, payload: dict[str, Any], call: Call) -> httpx.Response:
        """POST once with the time the call has left; dropped connections pass through."""
        client = self.open()
        left = call.remaining()
        if left <= 0 or call.abandoned.is_set():
            raise error("timeout", f"{url}: no time left of {self.timeout:g} s")
        try:
            return client.post(url, json=payload, timeout=left)
        except DROPPED:
            raise
        except httpx.HTTPError as exc:
            raise self._transport_error(url, exc) from exc
        except RuntimeError as exc:  # the client was closed under us
            raise self.closed_error() from exc

    def _transport_error(self, url: str, exc: BaseException) -> RerankerError:
        if isinstance(exc, httpx.TimeoutException):
            return error("timeout", f"{url}: no answer within {self.timeout:g} s")
        if isinstance(exc, httpx.ConnectError):
            message = f"{url}: cannot connect ({describe(exc)}); is llama-server running?"
            self.set_health(False, message)
            return error("connection", message, unavailable=True)
        if isinstance(exc, DROPPED):
            return error("connection", f"{url}: connection dropped ({describe(exc)})")
        return error("connection", f"{url}: {describe(exc)}")

    def _decode(self, url: str, response: httpx.Response) -> Any:
        """Map the HTTP status to an error, or return the JSON body."""
        status = response.status_code
        if status == 503:
            message = f"{url}: HTTP 503 ({_server_message(response)}); the model may be loading"
            self.set_health(False, message)
            raise error("unavailable", message, unavailable=True)
        if status >= 500:
            raise error("http_5xx", f"{url}: HTTP {status} ({_server_message(response)})")
        if status >= 400:
            raise error("http_4xx", f"{url}: HTTP {status} ({_server_message(response)})")
        if status != 200:
            raise error("malformed", f"{url}: unexpected HTTP {status}")
        try:
            return response.json()
        except ValueError as exc:
            raise error(
                "malformed", f"{url}: response is not valid JSON ({exc}): {response.text[:200]!r}"
            ) from None
