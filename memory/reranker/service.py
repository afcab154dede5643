"""RerankerService: ranking, top-k, blending, timeouts and fallback over one backend.

Backends only score (see :mod:`memory.reranker.base`).  Everything a search needs
around that is written once here: picking how many candidates to send, sorting by
the new score, the optional blend with the retrieval score, a minimum score, a hard
timeout, metrics, and falling back to the retrieval order when anything goes wrong.
:class:`RerankerManager` holds the active service and swaps it at runtime.
"""

from __future__ import annotations

import copy
import logging
import threading
import time
from collections.abc import Callable, Iterator, Sequence
from concurrent.futures import Future, ThreadPoolExecutor
from concurrent.futures import TimeoutError as FutureTimeout
from contextlib import contextmanager
from typing import TypeVar

from memory import metrics
from memory.config import LLMConfig, Profile, RerankerConfig
from memory.errors import RerankerError, RerankerUnavailable
from memory.records import Hit, Trace
from memory.reranker.base import Rankable, RerankerBackend

log = logging.getLogger(__name__)

T = TypeVar("T", bound=Rankable)


def make_backend(config: RerankerConfig, llm: LLMConfig | None = None) -> RerankerBackend:
    """Create (but do not load) the backend a reranker config names.

    Heavy imports happen here, only for the backend in use.  ``llm`` is the
    profile's ``[llm]`` section, which the ``llm`` backend judges with.
    """
    try:
        if config.backend == "transformers":
            from memory.reranker.qwen import QwenReranker

            return QwenReranker(config)
        if config.backend == "llama-server":
            from memory.reranker.llama_server import LlamaServerBackend

            return LlamaServerBackend(config)
        if config.backend == "cross-encoder":
            from memory.reranker.cross_encoder import CrossEncoderReranker

            return CrossEncoderReranker(config)
        if config.backend == "rerank-api":
            from memory.reranker.rerank_api import RerankApiBackend

            return RerankApiBackend(config)
        if config.backend == "llm":
            from memory.reranker.llm_judge import LLMJudge

            return LLMJudge(config, llm or LLMConfig())
    except ImportError as exc:  # searches go on without reranking, saying why
        return MissingBackend(config.backend, (
            f"the {config.backend} reranker cannot run here ({exc}); install the missing "
            "package in this environment"
        ))
    raise RerankerError(f"reranker backend {config.backend!r} has nothing to load")


class MissingBackend:
    """Stands in for a backend whose packages are not installed: every call says why.

    Args:
        name: The backend the profile asked for.
        reason: What is missing and how to install it.
    """

    def __init__(self, name: str, reason: str) -> None:
        self.name = name
        self.reason = reason

    def load(self) -> None:
        """Refuse: the backend's packages are missing.

        Raises:
            RerankerUnavailable: Always, with :attr:`reason`.
        """
        raise RerankerUnavailable(self.reason)

    def score(self, query: str, texts: Sequence[str]) -> list[float]:
        """Refuse, as :meth:`load` does.

        Raises:
            RerankerUnavailable: Always, with :attr:`reason`.
        """
        raise RerankerUnavailable(self.reason)

    def close(self) -> None:
        """Nothing to release."""


class RerankerService:
    """Re-scores search candidates with a cross-encoder backend.

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
        self._pool = ThreadPoolExecutor(max_workers=1, thread_name_prefix="reranker")
        self._inflight = 0
        self._idle = threading.Condition()
        self._last_warning: str | None = None

    @property
    def name(self) -> str:
        """The backend's name, for logs, metrics and traces."""
        return self.backend.name

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

    def score(self, query: str, texts: Sequence[str]) -> list[float]:
        """Score texts through the backend with the profile's timeout.

        Raises:
            RerankerError: The backend failed or did not answer in time.
        """
        if not texts:
            return []
        try:
            scores = self._scores_within_timeout(query, list(texts))
        except RerankerError:
            raise
        except Exception as exc:  # a backend bug must not reach the user
            raise RerankerError(f"{self.name} failed: {exc!r}") from exc
        if len(scores) != len(texts):
            raise RerankerError(f"{self.name} returned {len(scores)} scores for {len(texts)} texts")
        return [float(s) for s in scores]

    def _scores_within_timeout(self, query: str, texts: list[str]) -> list[float]:
        """Call the backend so that the search gets an answer within the timeout.

        A backend that keeps ``timeout`` itself and leaves no work behind (the remote
        one: its requests share the server's slots and are cancelled at the deadline)
        runs in the calling thread, so parallel searches are not serialised here.  A
        local model cannot be interrupted, so it runs in this service's one worker
        thread and the search stops waiting after ``timeout``; a call still queued
        then is cancelled rather than run for nobody.
        """
        if getattr(self.backend, "enforces_timeout", False):
            return self.backend.score(query, texts)
        future = self._pool.submit(self.backend.score, query, texts)
        try:
            return future.result(timeout=self.config.timeout)
        except FutureTimeout:
            future.cancel()
            raise RerankerError(
                f"{self.name} did not answer within {self.config.timeout:g} s"
            ) from None

    def rerank_results(
        self, query: str, candidates: Sequence[T], top_k: int | None = None
    ) -> list[T]:
        """Return copies of ``candidates`` sorted by ``rerank_score`` (set on each copy).

        Args:
            query: The search query.
            candidates: What to judge (each by its ``rerank_text``); left unchanged.
            top_k: Keep only the best ``top_k``; all when ``None``.

        Raises:
            RerankerError: Scoring failed (callers fall back to the original order).
        """
        scores = self.score(query, [c.rerank_text or "" for c in candidates])
        ranked = []
        for cand, s in zip(candidates, scores):
            clone = copy.copy(cand)
            clone.rerank_score = s
            ranked.append(clone)
        ranked.sort(key=lambda c: -(c.rerank_score or 0.0))
        return ranked if top_k is None else ranked[:top_k]

    def rerank_search(self, query: str, hits: list[Hit], limit: int, trace: Trace) -> list[Hit]:
        """Rerank the head of a search's hit list; never raises.

        Sends ``limit × oversample`` candidates (capped at ``max_candidates``), applies
        the optional blend and minimum score, and records the pre/post order, the
        latency and any fallback in ``trace``.  On failure the hits come back in
        their retrieval order and the trace says why.
        """
        count = min(len(hits), limit * self.config.oversample, self.config.max_candidates)
        head, tail = hits[:count], hits[count:]
        trace.rerank_backend = self.name
        trace.pre_rerank = [h.id for h in head]
        trace.candidates["rerank"] = len(head)
        started = time.perf_counter()
        with self._track():
            try:
                ranked = self.rerank_results(query, head)
            except RerankerError as exc:
                return self._fallback(hits, trace, str(exc))
        elapsed = time.perf_counter() - started
        metrics.RERANK_CALLS.labels(backend=self.name, status="ok").inc()
        metrics.RERANK_CANDIDATES.observe(len(head))
        metrics.RERANK_LATENCY.labels(backend=self.name).observe(elapsed)
        ranked = self._finalise(ranked)
        self._last_warning = None
        trace.reranked = True
        trace.post_rerank = [h.id for h in ranked]
        return ranked + tail if not self.config.min_score else ranked

    def _finalise(self, ranked: list[Hit]) -> list[Hit]:
        """Apply the optional blend and minimum final score."""
        if self.config.blend and ranked:
            lo = min(h.score for h in ranked)
            hi = max(h.score for h in ranked)
            for h in ranked:
                original = (h.score - lo) / (hi - lo) if hi > lo else 1.0
                weight = self.config.blend_weight
                h.score = (1.0 - weight) * original + weight * (h.rerank_score or 0.0)
            ranked.sort(key=lambda h: -h.score)
        else:
            for h in ranked:
                h.score = h.rerank_score or 0.0
        if self.config.min_score:
            ranked = [h for h in ranked if h.score >= self.config.min_score]
        return ranked

    def _fallback(self, hits: list[Hit], trace: Trace, reason: str) -> list[Hit]:
        # warn once per distinct cause; a missing model would otherwise log per search
        level = logging.DEBUG if reason == self._last_warning else logging.WARNING
        self._last_warning = reason
        log.log(level, "reranking skipped, keeping retrieval order: %s", reason)
        metrics.RERANK_CALLS.labels(backend=self.name, status="error").inc()
        trace.rerank_fallback = reason
        return hits

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


class RerankerManager:
    """Holds the active :class:`RerankerService` and swaps it atomically at runtime."""

    def __init__(self, profile: Profile, *, load: bool = True) -> None:
        """Create the profile's service (if it has a reranker) and start loading it."""
        self._lock = threading.Lock()
        self._service: RerankerService | None = None
        self.profile_name = profile.name
        if profile.reranker.enabled:
            self._service = RerankerService(profile.reranker, llm=profile.llm)
            if load:
                threading.Thread(
                    target=self._load_quietly, args=(self._service,), daemon=True,
                    name="reranker-load",
                ).start()

    @staticmethod
    def _load_quietly(service: RerankerService) -> None:
        try:
            service.load()
        except Exception as exc:
            log.warning("reranker %s could not be loaded yet: %s", service.name, exc)

    def current(self) -> RerankerService | None:
        """The service searches should use right now (``None`` when reranking is off)."""
        with self._lock:
            return self._service

    def switch(
        self, profile: Profile, on_switched: Callable[[Profile], None] | None = None
    ) -> Future:
        """Load ``profile``'s reranker in the background, then swap it in.

        Searches already running finish on the old service, which is unloaded
        afterwards.  If loading fails the old service stays and the future raises.
        ``on_switched`` runs right after the swap, before the future resolves.

        Returns:
            A future that resolves to the new profile's name once it is active.
        """
        future: Future = Future()

        def work() -> None:
            try:
                new = (RerankerService(profile.reranker, llm=profile.llm)
                       if profile.reranker.enabled else None)
                if new is not None:
                    new.load()
            except Exception as exc:
                log.error("switching to profile %s failed: %s", profile.name, exc)
                future.set_exception(exc)
                return
            with self._lock:
                old, self._service = self._service, new
                self.profile_name = profile.name
            log.info("reranker profile is now %s", profile.name)
            if on_switched is not None:
                on_switched(profile)
            future.set_result(profile.name)
            if old is not None:
                old.close(wait_for_inflight=True)

        threading.Thread(target=work, daemon=True, name="reranker-switch").start()
        return future

    def close(self) -> None:
        """Unload the active service."""
        with self._lock:
            service, self._service = self._service, None
        if service is not None:
            service.close(wait_for_inflight=False)

