"""How a search result is scored: pure functions, no database, no I/O.

Everything that decides a hit's order and its ``score`` is here, with the
profile's ``[search]`` section (:class:`~memory.config.SearchConfig`) and, for the
blend, the ``[reranker]`` one.  The searcher (:mod:`memory.search.searcher`, with
:mod:`~memory.search.scope` and :mod:`~memory.search.neighbours`) only reads the
inputs (ranked lists, message rows, the reranker's scores) and calls:

1. :func:`add_list` puts each ranked list (vector KNN, message keywords, window
   keywords, window vectors -- :func:`window_dense_list`) into one query's pool;
   equal scores share a rank.
2. :func:`fuse`: reciprocal rank fusion, ``sum(weight / (rrf_k + rank))`` over the
   lists that found a candidate (or ``score_sum`` / ``score_max`` of the two
   message lists' min-max normalised scores).
3. :func:`merge_queries`: several queries fuse again by rank, times
   ``1 + multi_query_bonus`` for each further query that found the message.
4. :func:`adaptive_threshold` / :func:`fixed_threshold`: the similarity bar;
   keyword finds always pass.
5. :func:`bonuses_for`, :func:`contenders`, :func:`bonus`: small bounded bonuses,
   in units of one list's rank-1 share, for a member the query names, recency
   (only when the query asks for it) and a time span it names; content-free lines
   get none; a candidate that cannot reach the top even with every bonus is not
   read back.
6. :func:`order`: fused + bonus, best first.
7. :func:`final_hits`: the reranked head first (its reranker score, or a blend of
   0.4 × the normalised retrieval score and 0.6 × the reranker's), then the rest;
   ``min_score`` drops weak reranked hits; retrieval's top ``limit`` hold the
   returned page unless a candidate from further down beats the weakest of them
   by ``keep_margin``.  The only place a
   :class:`~memory.records.Hit`'s ``score`` is set.
"""

from __future__ import annotations

import bisect
import math
from collections.abc import Callable, Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from datetime import datetime

import numpy as np

from memory.config import RerankerConfig, SearchConfig
from memory.records import Hit, StoredMessage, datetime_to_ms
from memory.rerank.base import Ranked
from memory.search.when import TimeSpan, asks_recent, parse_when
from memory.text import content_words

# The default blend: retrieval's and the reranker's shares (``reranker.blend_weight``).
BLEND_ORIGINAL, BLEND_RERANK = 0.4, 0.6
TIE_BREAK = 1e-6  # recency's share when it only breaks ties, in bonus units
RankedList = Sequence[tuple[int, float]]
"""One list: ``(message id, score)`` pairs, best first."""


@dataclass
class Candidate:
    """A message some list found, with what each list said about it.

    ``ranks`` maps a list's name to the message's rank in it (1 = best);
    ``queries`` holds the indexes of the queries that found it.
    """

    id: int
    similarity: float | None = None
    keyword_score: float | None = None
    ranks: dict[str, int] = field(default_factory=dict)
    fused: float = 0.0
    queries: set[int] = field(default_factory=set)

    @property
    def by_keyword(self) -> bool:
        """Found by its words or its window's words (passes any similarity threshold)."""
        return "keyword" in self.ranks or "window" in self.ranks


# -- lists and fusion --------------------------------------------------------------------


def add_list(pool: dict[int, Candidate], name: str, ranked: RankedList, query: int) -> None:
    """Add one ranked list to a query's pool; equal scores share a rank.

    Args:
        pool: The query's candidates by id, updated in place.
        name: ``dense``, ``keyword``, ``window`` or ``window_dense``.
        ranked: The list, best first.
        query: The index of the query the list answers.
    """
    rank, previous = 0, None
    for position, (mid, score) in enumerate(ranked, start=1):
        if score != previous:  # a tie stays a tie in fusion
            rank, previous = position, score
        cand = pool.setdefault(mid, Candidate(mid, queries={query}))
        cand.ranks[name] = rank
        if name == "dense":
            cand.similarity = score
        elif name == "keyword":
            cand.keyword_score = score


def window_dense_list(
    vector: np.ndarray, means: Mapping[int, np.ndarray], k: int
) -> list[tuple[int, float]]:
    """Candidates ranked by how close their window's mean vector is to the query.

    Args:
        vector: The query's vector.
        means: The window mean vectors of the candidates the other lists found.
        k: How many to keep.
    """
    if not means:
        return []
    query = vector / max(float(np.linalg.norm(vector)), 1e-12)
    ids = sorted(means)  # equal scores: by id, whichever order the reads came in
    sims = np.stack([means[i] for i in ids]) @ query
    order = np.argsort(-sims, kind="stable")[:k]
    return [(ids[i], float(sims[i])) for i in order]


def rescore_for(vectors: int, config: SearchConfig) -> int:
    """The vector list's ``rescore`` in a guild of ``vectors``: ``config.rescore``,
    grown in proportion to the guild past ``config.rescore_step`` vectors."""
    if not config.rescore_step:
        return config.rescore
    return max(config.rescore, round(config.rescore * vectors / config.rescore_step))


def fuse(pool: dict[int, Candidate], lists: Mapping[str, RankedList], config: SearchConfig) -> None:
    """Set each candidate's ``fused`` score from its lists (``config.fusion``)."""
    if config.fusion == "rrf":
        weights = {"dense": 1.0, "keyword": config.keyword_weight,
                   "window": config.window_weight, "window_dense": config.window_dense_weight}
        for cand in pool.values():
            cand.fused = sum(
                weights[name] / (config.rrf_k + rank) for name, rank in cand.ranks.items()
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
            parts.append(config.keyword_weight * kw_norm(cand.keyword_score))
        cand.fused = (sum(parts) if config.fusion == "score_sum" else max(parts)) if parts else 0.0


def merge_queries(per_query: Sequence[dict[int, Candidate]], config: SearchConfig) -> list[Candidate]:
    """Fuse the per-query pools: RRF over query ranks, with a bonus for agreement.

    A message found by ``n`` queries has its fused score multiplied by
    ``1 + multi_query_bonus × (n - 1)``.  One query's pool comes back as it is.
    """
    if len(per_query) == 1:
        return list(per_query[0].values())
    merged: dict[int, Candidate] = {}
    for pool in per_query:
        ranked = sorted(pool.values(), key=lambda c: -c.fused)
        for rank, cand in enumerate(ranked, start=1):
            into = merged.setdefault(cand.id, Candidate(cand.id))
            into.fused += 1.0 / (config.rrf_k + rank)
            into.queries |= cand.queries
            into.similarity = _max_or_none(into.similarity, cand.similarity)
            into.keyword_score = _max_or_none(into.keyword_score, cand.keyword_score)
            for name, r in cand.ranks.items():
                into.ranks[name] = min(r, into.ranks.get(name, r))
    for cand in merged.values():
        cand.fused *= 1.0 + config.multi_query_bonus * (len(cand.queries) - 1)
    return list(merged.values())


# -- the second pass: beside the first hits ----------------------------------------------


def neighbour_seeds(pool: Sequence[Candidate], count: int) -> list[int]:
    """The ids of the ``count`` best fused candidates, best first (ties: lower id)."""
    return [c.id for c in sorted(pool, key=lambda c: (-c.fused, c.id))[:count]]


def neighbour_list(
    seeds: Sequence[int], beside: Mapping[int, Sequence[int]]
) -> list[tuple[int, float]]:
    """The messages beside the seeds as one ranked list: each ranked by its best seed.

    Args:
        seeds: The seeds' ids, best first.
        beside: Each seed's neighbours (the seed itself left out or not: it is
            never listed as its own neighbour).

    Returns:
        ``(message id, -seed rank)`` pairs, best first: the neighbours of one seed
        share its rank.
    """
    best: dict[int, int] = {}
    for rank, seed in enumerate(seeds, start=1):
        for mid in beside.get(seed, ()):
            if mid != seed and mid not in best:
                best[mid] = rank
    return sorted(((mid, -float(rank)) for mid, rank in best.items()), key=lambda p: (-p[1], p[0]))


def add_neighbours(
    pool: list[Candidate], ranked: RankedList, config: SearchConfig
) -> list[Candidate]:
    """The pool with the neighbour list fused in (RRF, weight ``neighbour_weight``).

    A neighbour already in the pool gains the list's share; one that is not joins
    with that share alone (the threshold has run: it judged the first pass only).
    """
    by_id = {c.id: c for c in pool}
    extra: dict[int, Candidate] = {}
    add_list(extra, "neighbour", ranked, 0)
    for mid, found in extra.items():
        cand = by_id.get(mid)
        if cand is None:
            cand = by_id[mid] = Candidate(mid, queries=set())
        cand.ranks["neighbour"] = found.ranks["neighbour"]
        cand.fused += config.neighbour_weight / (config.rrf_k + found.ranks["neighbour"])
    return list(by_id.values())


# -- the similarity threshold ------------------------------------------------------------


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


def adaptive_threshold_pool(
    pool: Sequence[Candidate], limit: int, config: SearchConfig, floor: float
) -> ThresholdOutcome:
    """:func:`adaptive_threshold` over a pool's similarities and keyword finds."""
    return adaptive_threshold(
        [c.similarity for c in pool], limit, config, [c.by_keyword for c in pool], floor
    )


def fixed_threshold(pool: Sequence[Candidate], threshold: float) -> ThresholdOutcome:
    """The candidates at or above a fixed similarity, and every keyword find."""
    passed = _passing([c.similarity for c in pool], threshold, [c.by_keyword for c in pool])
    return ThresholdOutcome(threshold, "fixed", 1, passed)


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


# -- bonuses -----------------------------------------------------------------------------


@dataclass(frozen=True)
class Bonuses:
    """What the bonuses of one search depend on.

    Attributes:
        unit: One list's rank-1 share of the fused score; bonuses are measured in it.
        now_ms: The search's "now" (unix milliseconds).
        named: The members the queries name.
        recent: Whether a query asks for recent things.
        span: The time span a query names, if any.
    """

    unit: float
    now_ms: int
    named: frozenset[int]
    recent: bool
    span: TimeSpan | None


def bonuses_for(
    queries: Sequence[str], now: datetime, named: Iterable[int], config: SearchConfig
) -> Bonuses:
    """What this search's bonuses depend on.

    Args:
        queries: The search's queries.
        now: The search's "now": recency and time spans count from it.
        named: The members the queries name (:mod:`memory.search.names`).
        config: The profile's ``[search]`` section.
    """
    return Bonuses(
        unit=1.0 / (config.rrf_k + 1) if config.fusion == "rrf" else 1.0,
        now_ms=datetime_to_ms(now),
        named=frozenset(named),
        recent=any(asks_recent(q) for q in queries),
        span=next((span for q in queries if (span := parse_when(q, now))), None),
    )


def recency(age_days: float, config: SearchConfig) -> float:
    """How recent a message is: 1.0 when brand new, halving about every 0.7 decay periods."""
    return math.exp(-max(0.0, age_days) / config.recency_decay_days)


def max_bonus(bonuses: Bonuses | None, config: SearchConfig) -> float:
    """The largest bonus this search can give one message (0 with bonuses off)."""
    if bonuses is None:
        return 0.0
    most = config.member_weight + TIE_BREAK
    if bonuses.recent:
        most += config.recency_weight
    if bonuses.span is not None:
        most += config.time_weight
    return most * bonuses.unit


def contenders(
    pool: list[Candidate], limit: int, bonuses: Bonuses | None, config: SearchConfig
) -> list[Candidate]:
    """The candidates that can still reach the top ``limit`` once bonuses are added.

    Bonuses are bounded: a candidate whose fused score plus the largest bonus
    this search can give stays below the ``limit``-th best fused score cannot
    make the top, so it is neither read back from the database nor scored.
    """
    if len(pool) <= limit:
        return pool
    bar = sorted((c.fused for c in pool), reverse=True)[limit - 1]
    reach = max_bonus(bonuses, config)
    return [c for c in pool if c.fused + reach >= bar]


def bonus(message: StoredMessage, bonuses: Bonuses, config: SearchConfig) -> float:
    """A message's bonus: small and bounded, so relevance always decides first.

    A named member, recency (only when the query asks for recent things) and a
    time span the query names each add a share of ``bonuses.unit``; lines without
    content ("noted", "lol") get none, so no bonus alone can lift them.  Otherwise
    recency only breaks ties.
    """
    fresh = recency((bonuses.now_ms - message.created_at) / 86_400_000, config)
    if content_words(message.content) < 2 and not message.attachments:
        return TIE_BREAK * bonuses.unit * fresh  # content-free: a tie-breaker at most
    total = 0.0
    if message.author_id in bonuses.named:
        total += config.member_weight
    if bonuses.recent:
        total += config.recency_weight * fresh
    if bonuses.span is not None and bonuses.span.contains_ms(message.created_at):
        total += config.time_weight
    return (total + TIE_BREAK * fresh) * bonuses.unit


# -- the final order -------------------------------------------------------------------


@dataclass(frozen=True)
class Scored:
    """A candidate read back from the store, with its bonus."""

    candidate: Candidate
    message: StoredMessage
    bonus: float

    @property
    def retrieval(self) -> float:
        """The retrieval score: fused + bonus."""
        return self.candidate.fused + self.bonus


def order(
    pool: Iterable[Candidate],
    rows: Mapping[int, StoredMessage],
    bonuses: Bonuses | None,
    config: SearchConfig,
) -> list[Scored]:
    """The candidates still stored, each with its bonus, best retrieval score first.

    Args:
        pool: The candidates that passed the threshold.
        rows: Their stored messages (one deleted since retrieval is left out).
        bonuses: What the bonuses depend on; ``None`` turns them off.
        config: The profile's ``[search]`` section.
    """
    scored = [
        Scored(c, rows[c.id], 0.0 if bonuses is None else bonus(rows[c.id], bonuses, config))
        for c in pool if c.id in rows
    ]
    return sorted(scored, key=lambda s: -s.retrieval)


def rerank_count(available: int, limit: int, config: RerankerConfig) -> int:
    """How many of the best candidates the reranker judges.

    ``limit × oversample``, capped at ``max_candidates`` and at what there is.
    """
    return min(available, limit * config.oversample, config.max_candidates)


@dataclass(frozen=True)
class RerankScores:
    """What the reranker said about the head of a search's order.

    Attributes:
        ranked: ``(index into the head, score)``, best first; one per head entry.
        blend: Mix the normalised retrieval score into the final score.
        min_score: Reranked hits below this final score are dropped (0: none), and
            then the candidates after the head are dropped too.
        blend_weight: The reranker's share of a blend (retrieval gets the rest).
        keep: How many of retrieval's best the search returns (its limit); 0: the
            head is simply sorted by final score.
        keep_margin: With ``keep``, a candidate from beyond retrieval's top ``keep``
            takes the place of the weakest of them only when its final score is
            higher by more than this (see :func:`final_hits`).
    """

    ranked: Sequence[Ranked]
    blend: bool = False
    min_score: float = 0.0
    blend_weight: float = BLEND_RERANK
    keep: int = 0
    keep_margin: float = 0.0


def final_hits(scored: Sequence[Scored], rerank: RerankScores | None = None) -> list[Hit]:
    """The search's hits in their final order; the one place a hit's score is set.

    Without ``rerank`` the score is the retrieval score (fused + bonus).  With it,
    the reranked head comes first, scored by the reranker (or by
    ``(1 - w) × normalised retrieval + w × reranker`` with ``blend``, ``w`` the
    ``blend_weight``, 0.6 by default), then the rest in retrieval order with their
    retrieval scores.

    Which candidates make the first ``rerank.keep`` places (the page a search
    returns) is guarded: retrieval's own top ``keep`` hold them, and a candidate
    from further down the head takes the place of the weakest of them (by final
    score) only while it beats it by more than ``keep_margin``.  A small margin
    lets a clear find in; a reranker unsure between two candidates cannot push a
    retrieval hit off the page, so recall at ``keep`` is not traded for order.
    Within the page, and after it, the order is the final score's.

    Args:
        scored: The candidates from :func:`order`, best first.
        rerank: The reranker's scores for the first ``len(rerank.ranked)`` of them.
    """
    placed = _retrieval_order(scored) if rerank is None else _reranked(scored, rerank)
    return [
        Hit(
            **vars(item.message),
            similarity=item.candidate.similarity,
            keyword_score=item.candidate.keyword_score,
            dense_rank=item.candidate.ranks.get("dense"),
            keyword_rank=item.candidate.ranks.get("keyword"),
            fused=item.candidate.fused,
            bonus=item.bonus,
            score=final,
            rerank_score=reranker_score,
            queries_matched=max(1, len(item.candidate.queries)),
        )
        for item, reranker_score, final in placed
    ]


_Placed = tuple[Scored, float | None, float]
"""A candidate in its final place: its reranker score (if reranked) and final score."""


def _retrieval_order(scored: Sequence[Scored]) -> list[_Placed]:
    return [(s, None, s.retrieval) for s in scored]


def _reranked(scored: Sequence[Scored], rerank: RerankScores) -> list[_Placed]:
    """The head in the reranker's order with its final scores, then the tail."""
    head = [(scored[r.item], r.score) for r in rerank.ranked]
    if rerank.blend and head:
        lo = min(item.retrieval for item, _ in head)
        hi = max(item.retrieval for item, _ in head)
        weight = rerank.blend_weight
        finals = [
            (1.0 - weight) * ((item.retrieval - lo) / (hi - lo) if hi > lo else 1.0)
            + weight * value
            for item, value in head
        ]
    else:
        finals = [value for _, value in head]
    # each with whether retrieval had it in its top ``keep`` (the page's guards)
    entries: list[tuple[_Placed, bool]] = [
        ((item, value, final), r.item < rerank.keep)
        for r, (item, value), final in zip(rerank.ranked, head, finals)
    ]
    if rerank.blend:
        entries.sort(key=lambda e: -e[0][2])  # stable: equal blends keep the reranker's order
    placed = [p for p, _ in entries]
    if rerank.keep:
        placed = _guard_page(placed, [k for _, k in entries], rerank.keep, rerank.keep_margin)
    if rerank.min_score:
        return [p for p in placed if p[2] >= rerank.min_score]
    return placed + _retrieval_order(scored[len(head):])


def _guard_page(placed: list[_Placed], kept: list[bool], keep: int,
                margin: float) -> list[_Placed]:
    """``placed`` (best final score first) with retrieval's top ``keep`` guarding the page.

    ``kept[i]`` says whether ``placed[i]`` was in retrieval's top ``keep``.  The
    newcomers, best first, each replace the weakest guard while they beat it by more
    than ``margin``; the page and the rest each stay in final-score order.
    """
    guards = [i for i, k in enumerate(kept) if k]
    newcomers = [i for i, k in enumerate(kept) if not k]
    page = guards[:keep]
    for i in newcomers:
        if len(page) < keep:
            page.append(i)
            continue
        weakest = max(page)  # ``placed`` is best first: the highest index is the weakest
        if placed[i][2] <= placed[weakest][2] + margin:
            break
        page.remove(weakest)
        page.append(i)
    chosen = set(page)
    return ([placed[i] for i in sorted(chosen)]
            + [p for i, p in enumerate(placed) if i not in chosen])


def _normaliser(values: list[float]) -> Callable[[float], float]:
    if not values:
        return lambda v: 0.0
    lo, hi = min(values), max(values)
    if hi - lo < 1e-12:
        return lambda v: 1.0
    return lambda v: (v - lo) / (hi - lo)


def _max_or_none(a: float | None, b: float | None) -> float | None:
    return b if a is None else a if b is None else max(a, b)
