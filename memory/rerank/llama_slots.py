"""The llama-server's request slots: one bounded worker pool shared by every call.

The server serves ``parallel`` requests at once (``llama-server --parallel``), so
this process never has more on the wire: each call submits one request per
document here, waits for them until its deadline, and when it gives up (the
deadline, a server found down, the backend closing) cancels what is still queued,
so nothing of a call outlives it.
"""

from __future__ import annotations

import logging
import threading
from collections.abc import Callable
from concurrent.futures import FIRST_COMPLETED, Future, ThreadPoolExecutor, wait
from typing import Any, TypeVar

from memory.config import LlamaServerConfig
from memory.errors import RerankerError, RerankerUnavailable
from memory.rerank.llama_http import Call, LlamaServerClient, describe, error

log = logging.getLogger(__name__)

T = TypeVar("T")

# How long a call that gave up waits for its requests already on the wire to end
# (each is bounded by the call's deadline, so this is only scheduling slack).
SETTLE_TIMEOUT = 1.0


class RequestSlots:
    """``parallel`` worker threads that send a server's requests; thread-safe.

    Args:
        config: The profile's ``[reranker]`` settings for llama-server; uses parallel
            and endpoint.
        http: The server's client (opened with the pool, the source of the "closed"
            error, and of the call timeout).
    """

    def __init__(self, config: LlamaServerConfig, http: LlamaServerClient) -> None:
        self._config = config
        self._http = http
        self._lock = threading.Lock()
        self._closed = False
        self._closing: Future[None] = Future()  # resolved by close(); wakes waiting calls
        self._pool: ThreadPoolExecutor | None = None

    @property
    def closed(self) -> bool:
        """Whether :meth:`close` was called."""
        return self._closed

    def open(self) -> ThreadPoolExecutor:
        """Return the worker pool, creating it (and the HTTP client) on first use.

        Raises:
            RerankerError: The slots were closed.
        """
        with self._lock:
            if self._closed:
                raise self._http.closed_error()
            if self._pool is None:
                self._http.open()
                slots = self._config.parallel
                self._pool = ThreadPoolExecutor(slots, thread_name_prefix="llama-server")
                log.info(
                    "llama-server reranker at %s (endpoint %s, parallel %d)",
                    self._http.base_url, self._config.endpoint, slots,
                )
            return self._pool

    def close(self) -> bool:
        """Cancel queued requests and end the worker threads; waiting calls fail at once.

        Returns:
            Whether this call closed them (False: they were closed already).
        """
        with self._lock:
            if self._closed:
                return False
            self._closed = True
            pool = self._pool
        self._closing.set_result(None)
        if pool is not None:
            pool.shutdown(wait=False, cancel_futures=True)
        return True

    def submit(self, call: Call, fn: Callable[..., T], *args: Any) -> Future[T]:
        """Queue ``fn(call, *args)``; it is skipped if the call has given up by its turn.

        Raises:
            RerankerError: The slots were closed.
        """
        pool = self.open()
        try:
            return pool.submit(self._run_job, call, fn, *args)
        except RuntimeError:  # shut down between the check and the submit
            raise self._http.closed_error() from None

    @staticmethod
    def _run_job(call: Call, fn: Callable[..., T], *args: Any) -> T:
        """Worker side of one request: skipped if its call has already given up."""
        if call.abandoned.is_set() or call.remaining() <= 0:
            raise error("timeout", "the call gave up before this document was sent")
        return fn(call, *args)

    def settle(self, futures: list[Future[Any]], call: Call) -> None:
        """Wait for the call's requests until its deadline; cancel what is left.

        The call gives up at its deadline, when the server turns out to be down, or
        when the backend closes; then its queued requests are cancelled (never sent)
        and those on the wire are waited for, as each ends by the deadline.

        Raises:
            RerankerError: The slots were closed meanwhile.
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
                raise self._http.closed_error()
            wait(pending, SETTLE_TIMEOUT)

    def outcomes(self, futures: list[Future[T]]) -> list[T | RerankerError]:
        """Each future's result, or the RerankerError that explains why there is none."""
        outcomes: list[T | RerankerError] = []
        for future in futures:
            # a variable, not append(...) directly: mypy infers T from append's context
            outcome = self.outcome(future)
            outcomes.append(outcome)
        return outcomes

    def outcome(self, future: Future[T]) -> T | RerankerError:
        """The future's result, or the RerankerError that explains why there is none."""
        if future.done() and not future.cancelled():
            failure = future.exception()
            if failure is None:
                return future.result()
            if isinstance(failure, RerankerError):
                return failure
            log.error("llama-server request failed unexpectedly", exc_info=failure)
            return RerankerError(f"llama-server request failed: {describe(failure)}", "error")
        return error(
            "timeout",
            f"llama-server at {self._http.base_url} gave no answer within "
            f"{self._http.timeout:g} s",
        )


def _unavailable(future: Future[Any]) -> bool:
    """Whether a finished document future failed because the server is unavailable."""
    return (
        not future.cancelled()
        and future.done()
        and isinstance(future.exception(), RerankerUnavailable)
    )
