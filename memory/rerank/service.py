"""RerankerService: ranking, the deadline, metrics and fallback over one backend.

Backends only score (see :mod:`memory.rerank.base`).  The service ranks their
scores into ``(index, score)`` pairs, best first, and never touches what it was
given -- the way sentence-transformers' ``CrossEncoder.rank`` does -- so the
search decides the final scores (:mod:`memory.search.ranking`).  Around every
call it keeps one deadline (:mod:`memory.rerank.deadline`), counts metrics, and
for a search turns any failure into a reason to keep the retrieval order.
:class:`memory.rerank.manager.RerankerManager` holds the active service.
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Iterator, Sequence
from concurrent.futures import ThreadPoolExecutor
from concurrent.futures import TimeoutError as FutureTimeout
from contextlib import contextmanager
from dataclasses import dataclass

from memory import metrics
from memory.config import LLMConfig, RerankerConfig
from memory.errors import RerankerError, RerankerUnavailable
from memory.rerank import deadline
from memory.rerank.backends import make_backend
from memory.rerank.base import Ranked, Ranking, RerankerBackend

log = logging.getLogger(__name__)

# Calls a concurrent (remote) backend may have running at once; more wait for a
# worker, within their deadline.  The searches themselves are fewer (the cog's
# search pool), so in practice no call waits.
CONCURRENT_CALLS = 32


@dataclass(frozen=True)
class RerankerStatus:
    """Whether searches are reranked now, and if not, why.

    Attributes:
        name: The backend's name; ``None`` when the profile has no reranker.
        loaded: Whether the backend loaded (its model, or a check of its server).
        reason: Why searches keep the retrieval order (``None`` when loaded).
    """

    name: str | None
    loaded: bool
    reason: str | None = None


class RerankerService:
    """Ranks texts with one backend, within the profile's timeout.

    Every call runs on a worker thread under a deadline of ``config.timeout``
    seconds that the backend may read to stop early; the caller stops waiting at
    the deadline either way.  A local backend runs on one worker, so a model never
    serves two searches at once; a ``concurrent`` one (a remote server, or a local
    model that groups the searches it is given) on many.

    Args:
        config: The profile's ``[reranker]`` section.
        backend: A ready backend (tests, benchmarks); built from ``config`` if omitted.
        llm: The profile's ``[llm]`` section, for the ``llm`` backend.
    """

    def __init__(
        self, config: RerankerConfig, backend: RerankerBackend | None = None,
        llm: LLMConfig | None = None,
    ) -> None:
        self.config = config
        self.backend = backend or make_backend(config, llm)
        workers = CONCURRENT_CALLS if getattr(self.backend, "concurrent", False) else 1
        self._pool = ThreadPoolExecutor(max_workers=workers, thread_name_prefix="reranker")
        self._inflight = 0
        self._idle = threading.Condition()
        self._last_warning: str | None = None

    @property
    def name(self) -> str:
        """The backend's name, for logs, metrics and traces."""
        return self.backend.name

    @property
    def remote_host(self) -> str | None:
        """The host a remote backend sends each search to (``None``: scored on this machine).

        Backends that send searches to a server (llama-server, rerank-api, llm) name
        it in ``host``, even one on this machine; ``/memory privacy`` tells members.
        """
        host = getattr(self.backend, "host", None)
        return host if isinstance(host, str) and host else None

    def load(self) -> None:
        """Load the backend's model or check its server.

        Raises:
            RerankerError: The model cannot be loaded or the server reached.
        """
        try:
            self.backend.load()
        except RerankerError:
            raise
        except Exception as exc:  # a backend bug must not reach the user as a traceback
            raise RerankerUnavailable(f"{self.name} could not be loaded: {exc!r}") from exc

    def status(self) -> RerankerStatus:
        """Load the backend if it is not loaded yet, and say whether searches rerank.

        The caller reports the reason; a search that then falls back for the
        same reason logs it at debug level only, so it is said once.
        """
        try:
            self.load()
        except RerankerError as exc:
            self._last_warning = str(exc)
            return RerankerStatus(self.name, False, str(exc))
        return RerankerStatus(self.name, True)

    def score(self, query: str, texts: Sequence[str]) -> list[float]:
        """Score texts through the backend within the profile's timeout.

        Raises:
            RerankerError: The backend failed or did not answer in time.
        """
        if not texts:
            return []
        try:
            scores = self._scores_by_deadline(query, list(texts))
        except RerankerError:
            raise
        except Exception as exc:  # a backend bug must not reach the user
            raise RerankerError(f"{self.name} failed: {exc!r}") from exc
        if len(scores) != len(texts):
            raise RerankerError(f"{self.name} returned {len(scores)} scores for {len(texts)} texts")
        return [float(s) for s in scores]

    def rank(self, query: str, texts: Sequence[str], top_k: int | None = None) -> list[Ranked]:
        """Rank texts against a query: ``(index, score)`` pairs, best first.

        Args:
            query: The search query.
            texts: What to judge; left unchanged.
            top_k: Keep only the best ``top_k``; all when ``None``.

        Raises:
            RerankerError: Scoring failed (callers fall back to their own order).
        """
        scores = self.score(query, texts)
        order = sorted(range(len(scores)), key=lambda i: -scores[i])  # stable: ties keep input order
        ranked = [Ranked(i, scores[i]) for i in order]
        return ranked if top_k is None else ranked[:top_k]

    def rank_for_search(self, query: str, texts: Sequence[str]) -> Ranking:
        """Rank a search's texts; never raises.

        Counts the call in the metrics; on failure logs the reason (a warning once
        per distinct cause) and returns it as :attr:`Ranking.fallback`.
        """
        started = time.perf_counter()
        with self._track():
            try:
                ranked = self.rank(query, texts)
            except RerankerError as exc:
                return self._fallback(str(exc))
        metrics.RERANK_CALLS.labels(backend=self.name, status="ok").inc()
        metrics.RERANK_CANDIDATES.observe(len(texts))
        metrics.RERANK_LATENCY.labels(backend=self.name).observe(time.perf_counter() - started)
        self._last_warning = None
        return Ranking(tuple(ranked))

    def _scores_by_deadline(self, query: str, texts: list[str]) -> list[float]:
        """Run the backend on a worker under the deadline; stop waiting when it passes.

        A call still queued at the deadline is cancelled rather than run for nobody;
        one running is told by the deadline itself (a backend that cannot stop, a
        local model mid-batch, finishes its batch for nobody).
        """
        timeout = self.config.timeout
        until = time.monotonic() + timeout
        try:
            future = self._pool.submit(self._call, until, query, texts)
        except RuntimeError:  # closed meanwhile (a profile switch unloaded it)
            raise RerankerError(f"the {self.name} reranker is closed") from None
        try:
            return future.result(timeout=max(0.0, until - time.monotonic()))
        except FutureTimeout:
            future.cancel()
            raise RerankerError(f"{self.name} did not answer within {timeout:g} s") from None

    def _call(self, until: float, query: str, texts: list[str]) -> list[float]:
        with deadline.until(until):
            return self.backend.score(query, texts)

    def _fallback(self, reason: str) -> Ranking:
        # warn once per distinct cause; a missing model would otherwise log per search
        level = logging.DEBUG if reason == self._last_warning else logging.WARNING
        self._last_warning = reason
        log.log(level, "reranking skipped, keeping retrieval order: %s", reason)
        metrics.RERANK_CALLS.labels(backend=self.name, status="error").inc()
        return Ranking(fallback=reason)

    @contextmanager
    def _track(self) -> Iterator[None]:
        """Count a rerank as in flight so :meth:`close` can wait for it."""
        with self._idle:
            self._inflight += 1
        try:
            yield
        finally:
            with self._idle:
                self._inflight -= 1
                self._idle.notify_all()

    def close(self, wait_for_inflight: bool = True) -> None:
        """Unload the backend, after in-flight reranks finish when asked to."""
        if wait_for_inflight:
            with self._idle:
                self._idle.wait_for(lambda: self._inflight == 0)
        self._pool.shutdown(wait=False, cancel_futures=True)
        try:
            self.backend.close()
        except Exception:
            log.exception("closing reranker backend %s failed", self.name)
