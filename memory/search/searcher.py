"""The searcher: reads what a search needs, and lets :mod:`memory.search.ranking` score it.

One search embeds its queries once and, per query text, ranks messages four ways:
by their own vector (KNN), by their own words and author (BM25), by the words of
their conversational window (BM25, :mod:`memory.windows`) and by the mean vector of
that window (stored per message; looked up for the candidates the other lists
found).  The two keyword lists (and the window vectors of what they found) are read
on the storage's second connection while the query is embedded and the vector KNN
runs on the first (torch and SQLite release the GIL).  Then the searcher reads the
guild's similarity floor for the threshold, the members a query names for the
bonuses, the candidates' rows, and asks the reranker (if any) to rank the head.
No score is computed here: every number that decides the order comes from the
ranking module.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Iterable
from concurrent.futures import Future, ThreadPoolExecutor, wait
from contextlib import nullcontext
from dataclasses import replace
from datetime import datetime, timezone

import numpy as np

from memory import metrics
from memory.config import SearchConfig
from memory.embedder import Embedder
from memory.errors import EmbeddingModelChanged, VectorIndexDamaged
from memory.filters import Filters
from memory.records import Hit, SearchResult, Trace
from memory.rerank.base import Reranker, RerankerProvider
from memory.search import neighbours, ranking, scope
from memory.search.members import MemberIndex
from memory.search.ranking import Candidate, RankedList, RerankScores, Scored
from memory.search.request import SearchRequest, validate
from memory.storage.contract import Storage, VectorIndex
from memory.text import query_terms
from memory.torch_threads import one_cpu_thread

log = logging.getLogger(__name__)

Lists = dict[str, RankedList]
"""One query's ranked lists by name: dense, keyword, window (and window_dense)."""


class _WindowVectors:
    """The window vectors one search has read so far, and which ids it asked for."""

    def __init__(self, vectors: VectorIndex) -> None:
        self._index = vectors
        self._asked: set[int] = set()
        self._vectors: dict[int, np.ndarray] = {}

    def read(self, ids: Iterable[int], *, beside: bool = False) -> dict[int, np.ndarray]:
        """The window vectors of ``ids`` (those that have one), reading only new ids."""
        ids = list(ids)
        new = [i for i in ids if i not in self._asked]
        self._asked.update(new)
        self._vectors.update(self._index.window_vectors(new, beside=beside))
        return {i: self._vectors[i] for i in ids if i in self._vectors}


_WordLists = tuple[list[Lists], _WindowVectors]
"""Each query's keyword and window lists, and the window vectors of what they found."""


class Searcher:
    """Runs searches against a :class:`MessageStore` with one embedder.

    Args:
        storage: Where the messages and vectors are.
        embedder: The model the storage was embedded with.
        config: The profile's ``[search]`` section.
        reranker: Returns the reranker to use now (``None``: reranking is off); a
            callable so an admin's profile switch takes effect for the next search.
    """

    def __init__(
        self,
        storage: Storage,
        embedder: Embedder,
        config: SearchConfig,
        reranker: RerankerProvider | None = None,
    ) -> None:
        self.storage = storage
        self.embedder = embedder
        self.config = config
        self.members = MemberIndex(storage)
        self._reranker: RerankerProvider = reranker or (lambda: None)
        self._beside = ThreadPoolExecutor(max_workers=2, thread_name_prefix="memory-keyword")
        self._said_keyword_only = False

    def run(self, request: SearchRequest) -> SearchResult:
        """Run one search (``MemoryEngine.search`` is the public entry point).

        When another process has re-embedded the database with another model, this
        process's query vectors no longer fit, and a damaged vector index cannot be
        read: the search runs on keywords only (with the same filters and
        allow-list) and ``trace.keyword_only`` says why.

        Raises:
            SearchInputError: No query, more than 20 queries or 4000 characters, a bad
                limit or mode.
        """
        try:
            return self._run(request)
        except (EmbeddingModelChanged, VectorIndexDamaged) as exc:
            if request.mode == "keyword":
                raise
            if not self._said_keyword_only:
                self._said_keyword_only = True
                log.warning("searching by keywords only: %s", exc)
            result = self._run(replace(request, mode="keyword"))
            result.trace.keyword_only = str(exc)
            return result

    def close(self) -> None:
        """Stop the worker thread that runs keyword lists beside the vector side."""
        self._beside.shutdown(wait=True)

    def _run(self, request: SearchRequest) -> SearchResult:
        queries = validate(request)
        trace = Trace()
        clock = _Clock(trace)
        filters = scope.filters_for(self.storage, request)
        if request.allowed_channel_ids is not None and not filters.channel_ids:
            trace.timings_ms["total"] = 0.0
            return SearchResult([], trace, "none of the channels searched are readable here")
        pool = self._candidates(queries, filters, request, trace, clock)
        pool = self._threshold(pool, request, trace)
        trace.candidates["passed_threshold"] = len(pool)
        if request.mode == "hybrid":  # the second pass, beside the best candidates
            pool = neighbours.add_beside(self.storage.messages, pool, filters, self.config, trace)
        clock.lap("fuse")
        bonuses = self._bonuses(queries, request)
        reranker = self._reranker() if request.rerank else None
        if reranker is None:  # a reranker takes a wider head than the limit
            pool = ranking.contenders(pool, request.limit, bonuses, self.config)
        rows = self.storage.messages.hydrate([c.id for c in pool])
        clock.lap("hydrate")
        scored = ranking.order(pool, rows, bonuses, self.config)
        clock.lap("bonus")
        hits = _final_hits(reranker, queries[0], scored, request.limit, trace)
        clock.lap("rerank")
        hits = hits[: request.limit]
        trace.candidates["returned"] = len(hits)
        trace.timings_ms["total"] = round(sum(trace.timings_ms.values()), 3)
        _observe(trace)
        return SearchResult(hits, trace, self._empty_reason(hits, request))

    # -- retrieval ----------------------------------------------------------------------

    def _candidates(
        self, queries: list[str], filters: Filters, request: SearchRequest, trace: Trace,
        clock: _Clock,
    ) -> list[Candidate]:
        """Every query's lists, fused per query, then merged across the queries."""
        k = min(request.limit * self.config.oversample, 4096)
        # hybrid: the keyword lists start on the worker thread before the query is
        # embedded, and run on while this thread embeds it (on one core) and runs the KNN
        words = (
            self._beside.submit(self._word_lists, queries, k, filters, request)
            if request.mode == "hybrid" else None
        )
        try:
            with one_cpu_thread() if words is not None else nullcontext():
                vectors = self._embed(queries) if request.mode in ("hybrid", "dense") else None
            clock.lap("embed")
            query_vectors = list(vectors) if vectors is not None else [None] * len(queries)
            lists, windows = self._retrieve(queries, query_vectors, k, filters, request, words)
        except BaseException:
            if words is not None and not words.cancel():
                wait([words])  # no search leaves work behind on the worker
            raise
        per_query = [
            self._pool(i, vector, lists[i], windows, k, request, trace)
            for i, vector in enumerate(query_vectors)
        ]
        clock.lap("retrieve")
        pool = ranking.merge_queries(per_query, self.config)
        trace.candidates["fused"] = len(pool)
        return pool

    def _embed(self, queries: list[str]) -> np.ndarray | None:
        if self.storage.meta.embedding_model() is None:
            return None
        self.storage.meta.check_model_unchanged()  # before embedding with a model that no longer fits
        return self.embedder.embed(queries)

    def _retrieve(
        self,
        queries: list[str],
        vectors: list[np.ndarray | None],
        k: int,
        filters: Filters,
        request: SearchRequest,
        words: Future[_WordLists] | None,
    ) -> tuple[list[Lists], _WindowVectors]:
        """Each query's ranked lists, and the window vectors read so far.

        The vector KNN runs here.  ``words`` holds the keyword lists when they already
        run on the worker thread (and the storage's second connection); otherwise they
        are read here, after the KNN.
        """
        rescore = self._rescore(filters) if any(v is not None for v in vectors) else 0
        dense = [self._dense(vector, k, filters, rescore) for vector in vectors]
        word_lists, windows = (
            words.result() if words is not None else self._word_lists(queries, k, filters, request)
        )
        return [{"dense": d, **w} for d, w in zip(dense, word_lists)], windows

    def _word_lists(
        self, queries: list[str], k: int, filters: Filters, request: SearchRequest
    ) -> _WordLists:
        """Each query's keyword list (its own words) and window list (its window's words).

        In hybrid mode the window vectors of what they found are read here too: on the
        worker thread that is time the KNN takes anyway.
        """
        lists: list[Lists] = []
        for query in queries:
            terms = query_terms(query) if request.mode in ("hybrid", "keyword") else []
            # keyword mode stays literal (messages holding the words); windows join hybrid
            windows = request.mode == "hybrid" and self.config.window_weight and terms
            lists.append({
                "keyword": self._keyword(terms, k, filters, "message"),
                "window": self._keyword(self._window_terms(terms), k, filters, "window")
                if windows else [],
            })
        found = _WindowVectors(self.storage.vectors)
        if request.mode == "hybrid" and self.config.window_dense_weight:
            found.read({mid for named in lists for ranked in named.values() for mid, _ in ranked},
                       beside=True)
        return lists, found

    def _pool(
        self,
        index: int,
        vector: np.ndarray | None,
        lists: Lists,
        windows: _WindowVectors,
        k: int,
        request: SearchRequest,
        trace: Trace,
    ) -> dict[int, Candidate]:
        """One query's candidates from its lists, with the window-vector list, fused."""
        pool: dict[int, Candidate] = {}
        for name, ranked in lists.items():
            _add(pool, name, ranked, index, trace)
        if request.mode == "hybrid" and vector is not None and self.config.window_dense_weight:
            lists["window_dense"] = ranking.window_dense_list(vector, windows.read(pool), k)
            _add(pool, "window_dense", lists["window_dense"], index, trace)
        ranking.fuse(pool, lists, self.config)
        return pool

    def _rescore(self, filters: Filters) -> int:
        """The vector lists' ``rescore``: a large guild looks wider (SearchConfig);
        the guild's vectors are counted only when ``rescore_step`` asks for it."""
        if not self.config.rescore_step:
            return self.config.rescore
        return ranking.rescore_for(self.storage.vectors.count(filters.guild_id), self.config)

    def _dense(self, vector: np.ndarray | None, k: int, filters: Filters,
               rescore: int) -> RankedList:
        return (self.storage.vectors.knn(vector, k, filters, rescore=rescore)
                if vector is not None else [])

    def _keyword(self, terms: list[str], k: int, filters: Filters, field: str) -> RankedList:
        return self.storage.keywords.ranked(terms, k, filters, field=field) if terms else []

    def _window_terms(self, terms: list[str]) -> list[str]:
        """The query's terms for the window index, leaving out the very common ones.

        A window holds five messages, so a term found in thousands of messages
        matches five times as many windows, and ranking them all is most of a
        search's time at 100k messages while such a term says little about which
        window matters (it still counts in the message list).  The rarest term is
        always kept.
        """
        limit = self.config.window_term_max_df
        if limit and len(terms) > 1:
            counts = self.storage.keywords.term_counts(terms)
            rare = [t for t in terms if counts.get(t, 0) <= limit]
            terms = rare or [min(terms, key=lambda t: counts.get(t, 0))]
        return terms

    # -- threshold and bonuses ----------------------------------------------------------

    def _threshold(
        self, pool: list[Candidate], request: SearchRequest, trace: Trace
    ) -> list[Candidate]:
        if request.mode == "keyword":
            return pool
        if request.threshold is not None:
            outcome = ranking.fixed_threshold(pool, request.threshold)
        elif request.adaptive:
            floor = self._floor(request.guild_id)
            trace.threshold_floor = floor
            outcome = ranking.adaptive_threshold_pool(pool, request.limit, self.config, floor)
        else:
            return pool
        trace.threshold = outcome.threshold
        trace.threshold_mode = outcome.mode
        trace.threshold_iterations = outcome.iterations
        return [pool[i] for i in outcome.passed]

    def _floor(self, guild_id: int | None) -> float:
        """The adaptive threshold's floor: the guild's calibrated one, never below the profile's."""
        cfg = self.config
        calibrated = (
            self.storage.vectors.similarity_floor(guild_id, cfg.floor_quantile)
            if cfg.floor_quantile else None
        )
        return max(cfg.threshold_floor, calibrated if calibrated is not None else -1.0)

    def _bonuses(self, queries: list[str], request: SearchRequest) -> ranking.Bonuses | None:
        """What this search's bonuses depend on (``None``: bonuses are off)."""
        if not request.bonuses:
            return None
        named = self.members.named(queries, request.guild_id)
        return ranking.bonuses_for(
            queries, request.now or datetime.now(timezone.utc), named, self.config
        )

    # -- what the trace and the metrics say ------------------------------------------------

    def _empty_reason(self, hits: list[Hit], request: SearchRequest) -> str | None:
        if hits:
            return None
        # a member's search asks only of the channels they may read: what the rest of the
        # server holds is not theirs to learn
        allowed = request.allowed_channel_ids
        if not self.storage.messages.has_any(request.guild_id, allowed):
            return ("nothing is stored for this server yet" if allowed is None
                    else "nothing is stored from the channels you can read")
        if request.mode != "keyword" and self.storage.meta.embedding_model() is None:
            return "messages are stored but not embedded yet; run `python bot.py embed`"
        return "no stored message matched the query and filters closely enough"


class _Clock:
    """Records the time since the previous lap into ``trace.timings_ms``."""

    def __init__(self, trace: Trace) -> None:
        self.trace = trace
        self.last = time.perf_counter()

    def lap(self, stage: str) -> None:
        now = time.perf_counter()
        self.trace.timings_ms[stage] = round((now - self.last) * 1000, 3)
        self.last = now


def _add(
    pool: dict[int, Candidate], name: str, ranked: RankedList, index: int, trace: Trace
) -> None:
    """Add one ranked list to a query's pool, counting it in the trace."""
    trace.candidates[name] = trace.candidates.get(name, 0) + len(ranked)
    ranking.add_list(pool, name, ranked, index)


def _final_hits(
    reranker: Reranker | None, query: str, scored: list[Scored], limit: int, trace: Trace
) -> list[Hit]:
    """The hits in their final order, the head reranked when there is a reranker."""
    if reranker is None or not scored:
        return ranking.final_hits(scored)
    head = scored[: ranking.rerank_count(len(scored), limit, reranker.config)]
    trace.rerank_backend = reranker.name
    trace.pre_rerank = [s.candidate.id for s in head]
    trace.candidates["rerank"] = len(head)
    outcome = reranker.rank_for_search(query, [s.message.rerank_text for s in head])
    if outcome.fallback is not None:
        trace.rerank_fallback = outcome.fallback
        return ranking.final_hits(scored)
    config = reranker.config
    hits = ranking.final_hits(scored, RerankScores(
        outcome.ranked, config.blend, config.min_score, config.blend_weight,
        keep=limit, keep_margin=config.keep_margin,
    ))
    trace.reranked = True
    trace.post_rerank = [h.id for h in hits if h.rerank_score is not None]
    return hits


def _observe(trace: Trace) -> None:
    for stage, ms in trace.timings_ms.items():
        metrics.SEARCH_LATENCY.labels(stage=stage).observe(ms / 1000)
    if trace.threshold_mode == "adaptive":
        metrics.ADAPTIVE_ITERATIONS.observe(trace.threshold_iterations)
    if trace.threshold is not None:
        metrics.FINAL_THRESHOLD.observe(trace.threshold)
    metrics.RESULT_COUNT.observe(trace.candidates.get("returned", 0))
