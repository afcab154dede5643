"""Hybrid retrieval: vector KNN + FTS5 BM25 over messages and their windows, fused,
thresholded, boosted, reranked.

One search embeds its queries once and, per query text, ranks messages four ways:
by their own vector (KNN), by their own words and author (BM25), by the words of
their conversational window (BM25, :mod:`memory.storage.sqlite.windows`) and by the mean vector of
that window (stored per message; looked up for the candidates the other lists
found).  The two keyword lists (and the window vectors of what they found) are read
on the storage's second connection while the query is embedded and the vector KNN
runs on the first (torch and SQLite release the GIL).  Reciprocal rank fusion
merges the lists; an adaptive similarity threshold over that one pool (never
re-querying) drops what is too far, with a floor calibrated to the guild's own
similarity distribution; small bounded bonuses (a named member, recency when the
query asks for it, a time span the query names) are added to the fused score, never
multiplied into it (so a candidate that cannot reach the top even with every bonus
is never read back); a cross-encoder may rerank the head; the top ``limit`` return.
"""

from __future__ import annotations

import bisect
import logging
import math
import threading
import time
from collections.abc import Callable, Iterable, Sequence
from concurrent.futures import Future, ThreadPoolExecutor, wait
from contextlib import nullcontext
from dataclasses import dataclass, field, replace
from datetime import datetime, timezone

import numpy as np

from memory import metrics
from memory.config import SearchConfig
from memory.embedder import Embedder, one_cpu_thread
from memory.errors import EmbeddingModelChanged, SearchInputError
from memory.filters import Filters
from memory.names import MemberNames
from memory.records import Hit, SearchResult, StoredMessage, Trace, datetime_to_ms
from memory.reranker.base import Reranker, RerankerProvider
from memory.storage.contract import Storage, VectorIndex
from memory.text import content_words, query_terms
from memory.when import TimeSpan, asks_recent, parse_when

log = logging.getLogger(__name__)

MAX_QUERIES = 20
# The characters a search's queries hold in all.  No question is longer: a Discord
# message holds at most 4000 (with Nitro), and the embedder reads only the first ~1000
# of each query (256 word pieces).  On two busy cores the worst search allowed (20
# queries of 200 characters) takes 0.5 s; 20 of 4000 took 2.5 s, one pasted megabyte
# 1.6 to 3 s of tokenising and keyword matching (issue 21).
MAX_QUERY_CHARS = 4000
MAX_LIMIT = 100
MODES = ("hybrid", "dense", "keyword")


@dataclass(frozen=True)
class SearchRequest:
    """What to search for and where.

    ``threshold`` set means fixed-threshold mode; otherwise ``adaptive`` decides
    between the adaptive loop and no threshold.  ``boosts`` turns recency and member
    boosts on; ``rerank`` lets the reranker (if the profile has one) run.

    ``allowed_channel_ids`` is a permission allow-list: when set, only messages in
    those channels and threads can be found, whatever ``channel_ids`` asks for (a
    channel named there is expanded to its threads first, then cut to the list).
    It filters inside the KNN and keyword stages, so a search still fills ``limit``.
    """

    queries: tuple[str, ...]
    guild_id: int | None = None
    channel_ids: tuple[int, ...] | None = None
    author_ids: tuple[int, ...] | None = None
    allowed_channel_ids: tuple[int, ...] | frozenset[int] | None = None
    after: datetime | None = None
    before: datetime | None = None
    has_attachment: bool | None = None
    limit: int = 10
    mode: str = "hybrid"
    threshold: float | None = None
    adaptive: bool = True
    boosts: bool = True
    rerank: bool = True
    now: datetime | None = None


@dataclass
class _Candidate:
    id: int
    similarity: float | None = None
    keyword_score: float | None = None
    ranks: dict[str, int] = field(default_factory=dict)  # list name -> rank (1 = best)
    fused: float = 0.0
    queries: set[int] = field(default_factory=set)

    @property
    def dense_rank(self) -> int | None:
        return self.ranks.get("dense")

    @property
    def keyword_rank(self) -> int | None:
        return self.ranks.get("keyword")

    @property
    def by_keyword(self) -> bool:
        """Found by its words or its window's words (passes any similarity threshold)."""
        return "keyword" in self.ranks or "window" in self.ranks


@dataclass(frozen=True)
class ThresholdOutcome:
    """The result of the threshold stage over one candidate pool."""

    threshold: float | None
    mode: str
    iterations: int
    passed: list[int]


def adaptive_threshold(
    similarities: Sequence[float | None],
    limit: int,
    config: SearchConfig,
    keyword: Sequence[bool] | None = None,
    floor: float | None = None,
) -> ThresholdOutcome:
    """Lower the threshold from ``threshold_start`` in steps until enough candidates pass.

    The loop stops at the first threshold where at least ``threshold_target`` ×
    ``limit`` vector candidates pass; if none does it keeps the best seen, the floor
    (``floor``, else ``threshold_floor``), which passes the most.  Keyword matches
    (``keyword[i]`` true, or no similarity at all) always pass, however low their
    similarity, and do not count towards the target, so a pool rich in keyword hits
    cannot hold the threshold high and starve the semantic side.  It works on the
    one pool it is given, in O(n log n), without re-running any query.

    Returns:
        The final threshold, iterations tried and the indexes that pass.
    """
    need = math.ceil(config.threshold_target * limit)
    scored = sorted(s for s in similarities if s is not None)
    steps = _threshold_steps(config, config.threshold_floor if floor is None else floor)
    chosen, iterations = steps[-1], len(steps)
    for iterations, threshold in enumerate(steps, start=1):
        passing = len(scored) - bisect.bisect_left(scored, threshold - 1e-9)
        if passing >= need:
            chosen = threshold
            break
    return ThresholdOutcome(
        chosen, "adaptive", iterations, _passing(similarities, chosen, keyword)
    )


def _threshold_steps(config: SearchConfig, floor: float) -> list[float]:
    steps, t = [], config.threshold_start
    while t >= floor - 1e-9:
        steps.append(round(t, 6))
        t -= config.threshold_step
    if not steps or steps[-1] > floor + 1e-9:
        steps.append(round(floor, 6))  # the floor itself is the last step
    return steps


def _passing(
    similarities: Sequence[float | None], threshold: float, keyword: Sequence[bool] | None = None
) -> list[int]:
    return [
        i for i, s in enumerate(similarities)
        if s is None or s >= threshold - 1e-9 or (keyword is not None and keyword[i])
    ]


def recency(age_days: float, config: SearchConfig) -> float:
    """How recent a message is: 1.0 when brand new, halving about every 0.7 decay periods."""
    return math.exp(-max(0.0, age_days) / config.recency_decay_days)


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


_WordLists = tuple[list[dict[str, list]], _WindowVectors]
"""Each query's keyword and window lists, and the window vectors of what they found."""


@dataclass(frozen=True)
class _BoostContext:
    """What the bonuses of one search depend on."""

    unit: float  # one list's rank-1 share of the fused score: bonuses are measured in it
    now_ms: int
    named: set[int]
    recent: bool
    span: TimeSpan | None


class Searcher:
    """Runs searches against a :class:`~memory.storage.contract.Storage` with one embedder.

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
        self._reranker: RerankerProvider = reranker or (lambda: None)
        # guild -> (storage generation, its members' rows, their index); see _member_names
        self._members: dict[int | None, tuple[int, list, MemberNames]] = {}
        self._members_lock = threading.Lock()
        self._beside = ThreadPoolExecutor(max_workers=2, thread_name_prefix="memory-keyword")
        self._said_keyword_only = False

    def search(self, request: SearchRequest) -> SearchResult:
        """Run one search.

        When another process has re-embedded the database with another model, this
        process's query vectors no longer fit: the search runs on keywords only and
        ``trace.keyword_only`` says why.

        Raises:
            SearchInputError: No query, more than 20 queries or 4000 characters, a bad
                limit or mode.
        """
        try:
            return self._search(request)
        except EmbeddingModelChanged as exc:
            if request.mode == "keyword":
                raise
            if not self._said_keyword_only:
                self._said_keyword_only = True
                log.warning("searching by keywords only: %s", exc)
            result = self._search(replace(request, mode="keyword"))
            result.trace.keyword_only = str(exc)
            return result

    def _search(self, request: SearchRequest) -> SearchResult:
        queries = self._validate(request)
        trace = Trace()
        clock = _Clock(trace)
        filters = self._filters(request)
        if request.allowed_channel_ids is not None and not filters.channel_ids:
            trace.timings_ms["total"] = 0.0
            return SearchResult([], trace, "none of the channels searched are readable here")
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
        pool = self._merge(per_query, len(queries))
        trace.candidates["fused"] = len(pool)
        pool = self._threshold(pool, request, trace)
        trace.candidates["passed_threshold"] = len(pool)
        clock.lap("fuse")
        context = self._boost_context(queries, request)
        reranker = self._reranker() if request.rerank else None
        if reranker is None:  # a reranker takes a wider head than the limit
            pool = self._contenders(pool, request.limit, context)
        rows = self.storage.messages.hydrate([c.id for c in pool])
        clock.lap("hydrate")
        hits = self._hits(self._boost(pool, rows, context), rows)
        clock.lap("boost")
        hits = self._rerank(reranker, queries[0], hits, request.limit, trace)
        clock.lap("rerank")
        hits = hits[: request.limit]
        trace.candidates["returned"] = len(hits)
        trace.timings_ms["total"] = round(sum(trace.timings_ms.values()), 3)
        self._observe(trace)
        return SearchResult(hits, trace, self._empty_reason(hits, request))

    # -- stages -------------------------------------------------------------------------

    def _validate(self, request: SearchRequest) -> list[str]:
        if isinstance(request.queries, str):
            raise SearchInputError("queries must be a list of strings, not one string")
        if len(request.queries) > MAX_QUERIES:  # before reading them: a million is refused at once
            raise SearchInputError(
                f"at most {MAX_QUERIES} queries per search, got {len(request.queries)}")
        queries = [q for q in (_scrub(str(q)).strip() for q in request.queries) if q]
        if not queries:
            raise SearchInputError("give at least one non-empty query")
        total = sum(len(q) for q in queries)
        if total > MAX_QUERY_CHARS:
            raise SearchInputError(
                f"a search's queries may hold at most {MAX_QUERY_CHARS} characters in all, got "
                f"{total}: search with the words that matter")
        if not 1 <= request.limit <= MAX_LIMIT:
            raise SearchInputError(f"limit must be between 1 and {MAX_LIMIT}")
        if request.mode not in MODES:
            raise SearchInputError(f"mode must be one of {', '.join(MODES)}")
        if request.threshold is not None and not -1.0 <= request.threshold <= 1.0:
            raise SearchInputError("threshold must be between -1 and 1 (cosine similarity)")
        if request.after and request.before and (
            datetime_to_ms(request.after) >= datetime_to_ms(request.before)
        ):
            raise SearchInputError("'after' must be earlier than 'before'")
        return queries

    def _filters(self, request: SearchRequest) -> Filters:
        channels = request.channel_ids
        if channels:
            channels = self.storage.messages.expand_channels(channels)
        if request.allowed_channel_ids is not None:
            allowed = frozenset(request.allowed_channel_ids)
            channels = tuple(sorted(allowed)) if channels is None else tuple(
                c for c in channels if c in allowed
            )
        after_ms = datetime_to_ms(request.after) if request.after else None
        if request.guild_id is not None:
            # past the guild's retention period nothing is returned, purged yet or not;
            # as a filter inside the KNN and keyword queries, not after their top-k
            cutoff = self.storage.guilds.retention_cutoffs([request.guild_id]).get(request.guild_id)
            if cutoff is not None:
                after_ms = max(cutoff - 1, after_ms if after_ms is not None else cutoff - 1)
        return Filters(
            guild_id=request.guild_id,
            channel_ids=channels,
            author_ids=request.author_ids,
            after_ms=after_ms,
            before_ms=datetime_to_ms(request.before) if request.before else None,
            has_attachment=request.has_attachment,
        )

    def _embed(self, queries: list[str]) -> np.ndarray | None:
        if self.storage.meta.embedding_model() is None:
            return None
        self.storage.meta.check_model_unchanged()  # before embedding with a model that no longer fits
        return self.embedder.embed(queries)

    def close(self) -> None:
        """Stop the worker thread that runs keyword lists beside the vector side."""
        self._beside.shutdown(wait=True)

    def _retrieve(
        self,
        queries: list[str],
        vectors: list[np.ndarray | None],
        k: int,
        filters: Filters,
        request: SearchRequest,
        words: Future[_WordLists] | None,
    ) -> tuple[list[dict[str, list]], _WindowVectors]:
        """Each query's ranked lists, and the window vectors read so far.

        The vector KNN runs here.  ``words`` holds the keyword lists when they already
        run on the worker thread (and the storage's second connection); otherwise they
        are read here, after the KNN.
        """
        dense = [self._dense(vector, k, filters) for vector in vectors]
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
        lists = []
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
        lists: dict[str, list],
        windows: _WindowVectors,
        k: int,
        request: SearchRequest,
        trace: Trace,
    ) -> dict[int, _Candidate]:
        """One query's candidates from its lists, with the window-vector list, fused."""
        cfg = self.config
        pool: dict[int, _Candidate] = {}
        for name, ranked in lists.items():
            self._add(pool, name, ranked, index, trace)
        if request.mode == "hybrid" and vector is not None and cfg.window_dense_weight:
            lists["window_dense"] = self._window_dense(vector, pool, windows, k)
            self._add(pool, "window_dense", lists["window_dense"], index, trace)
        self._fuse(pool, lists)
        return pool

    @staticmethod
    def _add(
        pool: dict[int, _Candidate], name: str, ranked: list, index: int, trace: Trace
    ) -> None:
        trace.candidates[name] = trace.candidates.get(name, 0) + len(ranked)
        rank, previous = 0, None
        for position, (mid, score) in enumerate(ranked, start=1):
            if score != previous:  # equal scores share a rank: a tie stays a tie in fusion
                rank, previous = position, score
            cand = pool.setdefault(mid, _Candidate(mid, queries={index}))
            cand.ranks[name] = rank
            if name == "dense":
                cand.similarity = score
            elif name == "keyword":
                cand.keyword_score = score

    def _dense(self, vector: np.ndarray | None, k: int, filters: Filters) -> list:
        return (
            self.storage.vectors.knn(vector, k, filters, rescore=self.config.rescore)
            if vector is not None else []
        )

    def _keyword(self, terms: list[str], k: int, filters: Filters, field: str) -> list:
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

    @staticmethod
    def _window_dense(
        vector: np.ndarray, pool: dict[int, _Candidate], windows: _WindowVectors, k: int
    ) -> list[tuple[int, float]]:
        """The pool's candidates ranked by how close their window's mean vector is.

        Only candidates the other lists found are ranked: a window around a message
        no list found is not looked for (that would be a second KNN).
        """
        means = windows.read(pool)
        if not means:
            return []
        query = vector / max(float(np.linalg.norm(vector)), 1e-12)
        ids = sorted(means)  # equal scores: by id, whichever order the reads came in
        sims = np.stack([means[i] for i in ids]) @ query
        order = np.argsort(-sims, kind="stable")[:k]
        return [(ids[i], float(sims[i])) for i in order]

    def _fuse(self, pool: dict[int, _Candidate], lists: dict[str, list]) -> None:
        cfg = self.config
        if cfg.fusion == "rrf":
            weights = {"dense": 1.0, "keyword": cfg.keyword_weight,
                       "window": cfg.window_weight, "window_dense": cfg.window_dense_weight}
            for cand in pool.values():
                cand.fused = sum(
                    weights[name] / (cfg.rrf_k + rank) for name, rank in cand.ranks.items()
                )
            return
        # score fusions combine the two message-level lists (windows join RRF only)
        dense_norm = _normaliser([s for _, s in lists["dense"]])
        kw_norm = _normaliser([s for _, s in lists["keyword"]])
        for cand in pool.values():
            parts = []
            if cand.similarity is not None:
                parts.append(dense_norm(cand.similarity))
            if cand.keyword_score is not None:
                parts.append(cfg.keyword_weight * kw_norm(cand.keyword_score))
            cand.fused = (sum(parts) if cfg.fusion == "score_sum" else max(parts)) if parts else 0.0

    def _merge(self, per_query: list[dict[int, _Candidate]], n: int) -> list[_Candidate]:
        """Fuse the per-query pools: RRF over query ranks, boosted by how many queries agree."""
        if n == 1:
            return list(per_query[0].values())
        merged: dict[int, _Candidate] = {}
        for pool in per_query:
            ranked = sorted(pool.values(), key=lambda c: -c.fused)
            for rank, cand in enumerate(ranked, start=1):
                into = merged.setdefault(cand.id, _Candidate(cand.id))
                into.fused += 1.0 / (self.config.rrf_k + rank)
                into.queries |= cand.queries
                into.similarity = _max_or_none(into.similarity, cand.similarity)
                into.keyword_score = _max_or_none(into.keyword_score, cand.keyword_score)
                for name, r in cand.ranks.items():
                    into.ranks[name] = min(r, into.ranks.get(name, r))
        for cand in merged.values():
            cand.fused *= 1.0 + self.config.multi_query_boost * (len(cand.queries) - 1)
        return list(merged.values())

    def _threshold(
        self, pool: list[_Candidate], request: SearchRequest, trace: Trace
    ) -> list[_Candidate]:
        if request.mode == "keyword":
            return pool
        sims = [c.similarity for c in pool]
        keyword = [c.by_keyword for c in pool]
        if request.threshold is not None:
            outcome = ThresholdOutcome(
                request.threshold, "fixed", 1, _passing(sims, request.threshold, keyword)
            )
        elif request.adaptive:
            floor = self._floor(request.guild_id)
            trace.threshold_floor = floor
            outcome = adaptive_threshold(sims, request.limit, self.config, keyword, floor)
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

    def _boost_context(self, queries: list[str], request: SearchRequest) -> _BoostContext | None:
        """What this search's bonuses depend on (``None``: bonuses are off)."""
        if not request.boosts:
            return None
        now = request.now or datetime.now(timezone.utc)
        return _BoostContext(
            unit=1.0 / (self.config.rrf_k + 1) if self.config.fusion == "rrf" else 1.0,
            now_ms=datetime_to_ms(now),
            named=self._named_members(queries, request.guild_id),
            recent=any(asks_recent(q) for q in queries),
            span=next((span for q in queries if (span := parse_when(q, now))), None),
        )

    def _contenders(
        self, pool: list[_Candidate], limit: int, context: _BoostContext | None
    ) -> list[_Candidate]:
        """The candidates that can still reach the top ``limit`` once bonuses are added.

        Bonuses are bounded: a candidate whose fused score plus the largest bonus
        this search can give stays below the ``limit``-th best fused score cannot
        make the top, so it is neither read back from the database nor boosted.
        """
        if len(pool) <= limit:
            return pool
        bar = sorted((c.fused for c in pool), reverse=True)[limit - 1]
        reach = self._max_bonus(context)
        return [c for c in pool if c.fused + reach >= bar]

    def _max_bonus(self, context: _BoostContext | None) -> float:
        if context is None:
            return 0.0
        cfg = self.config
        most = cfg.member_weight + 1e-6  # the tie-break (see _bonus)
        if context.recent:
            most += cfg.recency_weight
        if context.span is not None:
            most += cfg.time_weight
        return most * context.unit

    def _boost(
        self,
        pool: list[_Candidate],
        rows: dict[int, StoredMessage],
        context: _BoostContext | None,
    ) -> list[tuple[_Candidate, float]]:
        """Pair each candidate with its bonus, best final score (fused + bonus) first.

        Bonuses are small and bounded, in units of one list's rank-1 share of the
        fused score, so relevance always decides first.  A named member, recency
        (only when the query asks for recent things) and a time span the query names
        each add a share; lines without content ("noted", "lol") get none, so no
        bonus alone can lift them.  Otherwise recency only breaks ties.
        """
        pool = [c for c in pool if c.id in rows]  # deleted since retrieval
        if context is None:
            return sorted(((c, 0.0) for c in pool), key=lambda cb: -cb[0].fused)
        boosted = [(cand, self._bonus(rows[cand.id], context)) for cand in pool]
        return sorted(boosted, key=lambda cb: -(cb[0].fused + cb[1]))

    def _bonus(self, row: StoredMessage, context: _BoostContext) -> float:
        cfg = self.config
        fresh = recency((context.now_ms - row.created_at) / 86_400_000, cfg)
        if content_words(row.content) < 2 and not row.attachments:
            return 1e-6 * context.unit * fresh  # content-free: a tie-breaker at most
        bonus = 0.0
        if row.author_id in context.named:
            bonus += cfg.member_weight
        if context.recent:
            bonus += cfg.recency_weight * fresh
        if context.span is not None and context.span.contains_ms(row.created_at):
            bonus += cfg.time_weight
        return (bonus + 1e-6 * fresh) * context.unit

    def _named_members(self, queries: list[str], guild_id: int | None) -> set[int]:
        """Ids of members a query names (:mod:`memory.names`)."""
        return self._member_names(guild_id).named_in("\n".join(queries))

    def _member_names(self, guild_id: int | None) -> MemberNames:
        """The guild's member names, indexed again only when they changed.

        Every write bumps the storage's generation, and in a busy guild nearly every
        search follows one; the members are read again then (a cheap query), but
        indexing them (46 ms for 2,500 members, 200 ms for 5,000) waits until a
        name, or who the guild's members are, has changed.
        """
        generation = self.storage.database.generation
        with self._members_lock:  # searches run on several threads
            known = self._members.get(guild_id)
        if known is not None and known[0] == generation:
            return known[2]
        rows = self.storage.messages.members(guild_id)
        names = known[2] if known is not None and known[1] == rows else MemberNames.build(rows)
        with self._members_lock:
            self._members.pop(guild_id, None)
            if len(self._members) >= _MEMBER_GUILDS:  # the longest unchecked guild goes
                self._members.pop(next(iter(self._members)))
            self._members[guild_id] = (generation, rows, names)
        return names

    @staticmethod
    def _hits(
        ranked: list[tuple[_Candidate, float]], rows: dict[int, StoredMessage]
    ) -> list[Hit]:
        return [
            Hit(
                **vars(rows[cand.id]),
                similarity=cand.similarity,
                keyword_score=cand.keyword_score,
                dense_rank=cand.dense_rank,
                keyword_rank=cand.keyword_rank,
                fused=cand.fused,
                boost=boost,
                score=cand.fused + boost,
                queries_matched=max(1, len(cand.queries)),
            )
            for cand, boost in ranked
        ]

    @staticmethod
    def _rerank(
        service: Reranker | None, query: str, hits: list[Hit], limit: int, trace: Trace
    ) -> list[Hit]:
        if service is None or not hits:
            return hits
        return service.rerank_search(query, hits, limit, trace)

    def _empty_reason(self, hits: list[Hit], request: SearchRequest) -> str | None:
        if hits:
            return None
        if not self.storage.messages.has_any(request.guild_id):
            return "nothing is stored for this server yet"
        if request.mode != "keyword" and self.storage.meta.embedding_model() is None:
            return "messages are stored but not embedded yet; run `python bot.py embed`"
        return "no stored message matched the query and filters closely enough"

    @staticmethod
    def _observe(trace: Trace) -> None:
        for stage, ms in trace.timings_ms.items():
            metrics.SEARCH_LATENCY.labels(stage=stage).observe(ms / 1000)
        if trace.threshold_mode == "adaptive":
            metrics.ADAPTIVE_ITERATIONS.observe(trace.threshold_iterations)
        if trace.threshold is not None:
            metrics.FINAL_THRESHOLD.observe(trace.threshold)
        metrics.RESULT_COUNT.observe(trace.candidates.get("returned", 0))


_MEMBER_GUILDS = 64  # guilds whose member names a searcher keeps indexed


class _Clock:
    """Records the time since the previous lap into ``trace.timings_ms``."""

    def __init__(self, trace: Trace) -> None:
        self.trace = trace
        self.last = time.perf_counter()

    def lap(self, stage: str) -> None:
        now = time.perf_counter()
        self.trace.timings_ms[stage] = round((now - self.last) * 1000, 3)
        self.last = now


def _scrub(text: str) -> str:
    """Replace lone surrogates (undecodable command-line bytes) that tokenizers reject."""
    return text.encode("utf-8", "surrogatepass").decode("utf-8", "replace")


def _normaliser(values: list[float]) -> Callable[[float], float]:
    if not values:
        return lambda v: 0.0
    lo, hi = min(values), max(values)
    if hi - lo < 1e-12:
        return lambda v: 1.0
    return lambda v: (v - lo) / (hi - lo)


def _max_or_none(a: float | None, b: float | None) -> float | None:
    return b if a is None else a if b is None else max(a, b)

