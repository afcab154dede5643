"""The ranking module on its own: no database, no model, no I/O.

Every number that decides a search's order comes from memory.search.ranking; these
tables pin it down on hand-made lists, rows and reranker scores.
"""

from __future__ import annotations

import ast
import math
from dataclasses import replace
from datetime import datetime, timezone
from pathlib import Path

import numpy as np
import pytest

from memory.config import RerankerConfig, SearchConfig
from memory.records import StoredMessage, datetime_to_ms
from memory.rerank.base import Ranked
from memory.search import ranking
from memory.search.ranking import (
    BLEND_ORIGINAL,
    BLEND_RERANK,
    Bonuses,
    Candidate,
    RerankScores,
    Scored,
)

CONFIG = SearchConfig()
NOW = datetime(2026, 1, 1, tzinfo=timezone.utc)
NOW_MS = datetime_to_ms(NOW)
DAY_MS = 86_400_000
UNIT = 1.0 / (CONFIG.rrf_k + 1)


def message(mid: int, content: str = "the raid starts at nine", *, author: int = 1,
            age_days: float = 0.0, attachments: tuple[str, ...] = ()) -> StoredMessage:
    return StoredMessage(id=mid, guild_id=1, channel_id=2, author_id=author, author_name="a",
                         content=content, created_at=NOW_MS - int(age_days * DAY_MS),
                         attachments=attachments)


def pool_of(lists: dict[str, list[tuple[int, float]]], query: int = 0) -> dict[int, Candidate]:
    pool: dict[int, Candidate] = {}
    for name, ranked in lists.items():
        ranking.add_list(pool, name, ranked, query)
    return pool


def scored(fused: list[float], bonuses: list[float] | None = None) -> list[Scored]:
    bonuses = bonuses or [0.0] * len(fused)
    return [Scored(Candidate(i, fused=f), message(i), b)
            for i, (f, b) in enumerate(zip(fused, bonuses))]


# -- ranked lists: ties share a rank ---------------------------------------------------


@pytest.mark.parametrize("ranked, ranks", [
    ([], {}),
    ([(1, 0.9)], {1: 1}),
    ([(1, 0.9), (2, 0.8), (3, 0.7)], {1: 1, 2: 2, 3: 3}),
    ([(1, 0.9), (2, 0.9), (3, 0.7)], {1: 1, 2: 1, 3: 3}),  # a tie, then the next position
    ([(1, 0.5), (2, 0.5), (3, 0.5)], {1: 1, 2: 1, 3: 1}),  # all equal
    ([(1, -1.0), (2, -1.0)], {1: 1, 2: 1}),
])
def test_add_list_gives_ties_one_rank(ranked, ranks) -> None:
    pool = pool_of({"keyword": ranked})
    assert {mid: c.ranks["keyword"] for mid, c in pool.items()} == ranks
    assert all(c.keyword_score == dict(ranked)[mid] for mid, c in pool.items())


def test_add_list_keeps_each_lists_score_and_the_query() -> None:
    pool = pool_of({"dense": [(1, 0.8)], "keyword": [(1, 7.5), (2, 3.0)], "window": [(3, 2.0)]},
                   query=4)
    assert (pool[1].similarity, pool[1].keyword_score) == (0.8, 7.5)
    assert pool[2].similarity is None and pool[3].keyword_score is None
    assert pool[3].by_keyword and pool[1].by_keyword and {4} == pool[2].queries
    assert not pool_of({"dense": [(5, 0.1)]})[5].by_keyword


# -- fusion ----------------------------------------------------------------------------


def test_rrf_sums_weighted_reciprocal_ranks() -> None:
    config = replace(CONFIG, keyword_weight=2.0, window_weight=0.5, window_dense_weight=0.25)
    lists = {"dense": [(1, 0.9), (2, 0.8)], "keyword": [(2, 5.0)], "window": [(1, 3.0)],
             "window_dense": [(2, 0.7)]}
    pool = pool_of(lists)
    ranking.fuse(pool, lists, config)
    k = config.rrf_k
    assert pool[1].fused == pytest.approx(1 / (k + 1) + 0.5 / (k + 1))
    assert pool[2].fused == pytest.approx(1 / (k + 2) + 2.0 / (k + 1) + 0.25 / (k + 1))


@pytest.mark.parametrize("lists", [
    {"dense": [], "keyword": []},
    {"dense": [(1, 0.5), (2, 0.5)], "keyword": []},  # all-equal similarities
    {"dense": [], "keyword": [(1, 3.0), (2, 3.0)]},
])
@pytest.mark.parametrize("fusion", ["rrf", "score_sum", "score_max"])
def test_fusion_of_empty_and_all_equal_lists(lists, fusion) -> None:
    pool = pool_of(lists)
    ranking.fuse(pool, lists, replace(CONFIG, fusion=fusion))
    fused = {c.fused for c in pool.values()}
    assert len(fused) <= 1, "equal scores fuse equally"
    assert all(math.isfinite(f) and f > 0 for f in fused)


@pytest.mark.parametrize("fusion, expected", [
    ("score_sum", {1: 1.0 + 0.0, 2: 0.0 + 1.0, 3: 0.5}),
    ("score_max", {1: 1.0, 2: 1.0, 3: 0.5}),
])
def test_score_fusions_combine_min_max_normalised_scores(fusion, expected) -> None:
    lists = {"dense": [(1, 0.9), (3, 0.7), (2, 0.5)], "keyword": [(2, 8.0), (1, 2.0)]}
    pool = pool_of(lists)
    ranking.fuse(pool, lists, replace(CONFIG, fusion=fusion))
    assert {mid: c.fused for mid, c in pool.items()} == pytest.approx(expected)


def test_window_dense_list_ranks_by_cosine_and_breaks_ties_by_id() -> None:
    means = {3: np.array([1.0, 0.0]), 1: np.array([1.0, 0.0]), 2: np.array([0.0, 1.0])}
    assert ranking.window_dense_list(np.array([2.0, 0.0]), means, 10) == [
        (1, 1.0), (3, 1.0), (2, 0.0)]
    assert ranking.window_dense_list(np.array([2.0, 0.0]), means, 1) == [(1, 1.0)]
    assert ranking.window_dense_list(np.array([1.0, 0.0]), {}, 10) == []


# -- several queries -------------------------------------------------------------------


def test_one_query_comes_back_as_it_is() -> None:
    pool = pool_of({"dense": [(1, 0.9), (2, 0.8)]})
    ranking.fuse(pool, {"dense": [], "keyword": []}, CONFIG)
    assert ranking.merge_queries([pool], CONFIG) == list(pool.values())


def test_many_queries_fuse_by_rank_with_a_bonus_for_agreement() -> None:
    first, second = pool_of({"dense": [(1, 0.9), (2, 0.8)]}, 0), pool_of({"dense": [(2, 0.9)]}, 1)
    for pool in (first, second):
        ranking.fuse(pool, {}, CONFIG)
    merged = {c.id: c for c in ranking.merge_queries([first, second], CONFIG)}
    k = CONFIG.rrf_k
    assert merged[1].fused == pytest.approx(1 / (k + 1))
    assert merged[2].fused == pytest.approx(
        (1 / (k + 2) + 1 / (k + 1)) * (1 + CONFIG.multi_query_bonus))
    assert merged[2].queries == {0, 1} and merged[2].similarity == 0.9
    assert merged[2].ranks["dense"] == 1, "the best rank of any query"


def test_merging_no_lists_is_empty() -> None:
    assert ranking.merge_queries([{}, {}], CONFIG) == []


# -- the threshold ---------------------------------------------------------------------


@pytest.mark.parametrize("sims, limit, threshold, passed", [
    ([], 10, 0.1, []),  # nothing: the floor, nothing passes
    ([0.9, 0.8], 1, 0.75, [0, 1]),  # enough at the first step (0.8 >= 0.75)
    ([0.5, 0.5, 0.5], 3, 0.5, [0, 1, 2]),  # all equal: the step that reaches them
    ([0.3, None], 5, 0.1, [0, 1]),  # a keyword-only candidate always passes
])
def test_adaptive_threshold_table(sims, limit, threshold, passed) -> None:
    outcome = ranking.adaptive_threshold(sims, limit, CONFIG)
    assert outcome.threshold == pytest.approx(threshold)
    assert outcome.passed == passed and outcome.mode == "adaptive"


def test_thresholds_over_a_pool_let_keyword_finds_pass() -> None:
    pool = list(pool_of({"dense": [(1, 0.9), (2, 0.05)], "keyword": [(2, 1.0)],
                         "window": [(3, 1.0)]}).values())
    fixed = ranking.fixed_threshold(pool, 0.5)
    assert (fixed.mode, fixed.iterations, fixed.passed) == ("fixed", 1, [0, 1, 2])
    dense_only = [c for c in pool if c.id != 2] + [Candidate(4, similarity=0.05)]
    assert ranking.fixed_threshold(dense_only, 0.5).passed == [0, 1]
    adaptive = ranking.adaptive_threshold_pool(dense_only, 10, CONFIG, floor=0.3)
    assert adaptive.threshold == pytest.approx(0.3) and adaptive.passed == [0, 1]


# -- bonuses ---------------------------------------------------------------------------


def bonuses(queries: tuple[str, ...] = ("raid",), named: tuple[int, ...] = ()) -> Bonuses:
    return ranking.bonuses_for(queries, NOW, named, CONFIG)


@pytest.mark.parametrize("queries, named, row, expected", [
    (("raid",), (), message(1), ranking.TIE_BREAK),  # recency only breaks ties
    (("raid",), (1,), message(1), CONFIG.member_weight + ranking.TIE_BREAK),
    (("latest raid",), (), message(1), CONFIG.recency_weight + ranking.TIE_BREAK),
    (("raid yesterday",), (), message(1, age_days=1.0), None),  # inside the span (below)
    (("raid",), (1,), message(1, "lol"), ranking.TIE_BREAK),  # content-free: no bonus
    (("raid",), (1,), message(1, "lol", attachments=("a.png",)),
     CONFIG.member_weight + ranking.TIE_BREAK),  # an attachment is content
])
def test_bonus_table(queries, named, row, expected) -> None:
    given = bonuses(queries, named)
    got = ranking.bonus(row, given, CONFIG) / UNIT
    if expected is None:
        fresh = ranking.recency(1.0, CONFIG)
        expected = CONFIG.time_weight + CONFIG.recency_weight * fresh + ranking.TIE_BREAK * fresh
    assert got == pytest.approx(expected)


@pytest.mark.parametrize("queries, named", [
    (("raid",), ()), (("latest raid",), (1, 2)), (("raid last week",), (1,)),
    (("what did Sam say recently about the raid in May",), (1, 2, 3)),
])
def test_bonuses_never_exceed_the_largest_bonus(queries, named) -> None:
    given = bonuses(queries, named)
    most = ranking.max_bonus(given, CONFIG)
    rows = [message(i, author=a, age_days=d) for i, (a, d) in
            enumerate((a, d) for a in (1, 2, 9) for d in (0.0, 1.0, 8.0, 40.0, 400.0, -3.0))]
    assert all(0.0 <= ranking.bonus(r, given, CONFIG) <= most for r in rows)
    assert most <= (CONFIG.member_weight + CONFIG.recency_weight + CONFIG.time_weight + 1e-6) * UNIT


def test_no_bonuses_means_no_reach_and_no_bonus() -> None:
    assert ranking.max_bonus(None, CONFIG) == 0.0
    rows = {i: message(i) for i in range(3)}
    order = ranking.order([Candidate(i, fused=f) for i, f in enumerate((0.1, 0.3, 0.2))],
                          rows, None, CONFIG)
    assert [(s.candidate.id, s.bonus) for s in order] == [(1, 0.0), (2, 0.0), (0, 0.0)]


@pytest.mark.parametrize("fused, limit, kept, kept_without_bonuses", [
    ([], 3, [], []),
    ([0.5, 0.4], 3, [0, 1], [0, 1]),  # no more than the limit: all kept
    ([0.5, 0.4, 0.3, 0.01], 2, [0, 1, 2], [0, 1]),  # 0.3 can reach 0.4 with a bonus
    ([0.2, 0.2, 0.2, 0.2], 1, [0, 1, 2, 3], [0, 1, 2, 3]),  # all equal: all contend
])
def test_contenders_are_those_a_bonus_can_lift_into_the_top(
    fused, limit, kept, kept_without_bonuses
) -> None:
    pool = [Candidate(i, fused=f) for i, f in enumerate(fused)]
    given = replace(bonuses(), unit=0.25)  # the largest bonus: (0.5 + 1e-6) × 0.25 = 0.125
    assert [c.id for c in ranking.contenders(pool, limit, given, CONFIG)] == kept
    assert [c.id for c in ranking.contenders(pool, limit, None, CONFIG)] == kept_without_bonuses


def test_order_leaves_out_deleted_rows_and_sorts_by_fused_plus_bonus() -> None:
    pool = [Candidate(1, fused=0.30), Candidate(2, fused=0.29), Candidate(3, fused=0.5)]
    rows = {1: message(1, author=5), 2: message(2, author=6)}  # 3 was deleted meanwhile
    order = ranking.order(pool, rows, bonuses(named=(6,)), CONFIG)
    assert [s.candidate.id for s in order] == [2, 1]
    assert order[0].retrieval == pytest.approx(0.29 + (CONFIG.member_weight + 1e-6) * UNIT)


# -- the final order and scores ---------------------------------------------------------


def test_without_a_reranker_the_score_is_fused_plus_bonus() -> None:
    hits = ranking.final_hits(scored([0.5, 0.3], [0.01, 0.0]))
    assert [(h.id, h.score, h.bonus, h.rerank_score) for h in hits] == [
        (0, 0.51, 0.01, None), (1, 0.3, 0.0, None)]
    assert ranking.final_hits([]) == []


@pytest.mark.parametrize("blend", [False, True])
@pytest.mark.parametrize("reranker, order", [
    ([0.1, 0.9, 0.5], [1, 2, 0]),
    ([0.5, 0.5, 0.5], [0, 1, 2]),  # all equal: the retrieval order stays
])
def test_the_reranked_head_comes_first_then_the_rest(blend, reranker, order) -> None:
    items = scored([0.9, 0.6, 0.3, 0.2, 0.1])
    ranked = sorted((Ranked(i, s) for i, s in enumerate(reranker)), key=lambda r: -r.score)
    hits = ranking.final_hits(items, RerankScores(ranked, blend=blend))
    head, tail = hits[:3], hits[3:]
    assert [(h.id, h.score, h.rerank_score) for h in tail] == [(3, 0.2, None), (4, 0.1, None)]
    assert all(h.rerank_score is not None for h in head)
    if not blend:
        assert [h.id for h in head] == order
        assert [h.score for h in head] == [reranker[i] for i in order]
        return
    expected = {i: BLEND_ORIGINAL * (f - 0.3) / (0.9 - 0.3) + BLEND_RERANK * reranker[i]
                for i, f in enumerate((0.9, 0.6, 0.3))}
    assert [h.score for h in head] == pytest.approx(sorted(expected.values(), reverse=True))
    assert {h.id: h.score for h in head} == pytest.approx(expected)


def test_a_blend_of_all_equal_retrieval_scores_counts_them_as_one() -> None:
    hits = ranking.final_hits(scored([0.4, 0.4]), RerankScores([Ranked(1, 0.8), Ranked(0, 0.2)],
                                                              blend=True))
    assert [(h.id, h.score) for h in hits] == [
        (1, pytest.approx(BLEND_ORIGINAL + BLEND_RERANK * 0.8)),
        (0, pytest.approx(BLEND_ORIGINAL + BLEND_RERANK * 0.2))]


@pytest.mark.parametrize("weight, ids, scores", [
    (0.6, [1, 0], [0.4 * 0.5 + 0.6 * 0.8, 0.4 + 0.6 * 0.2]),  # the default
    (1.0, [1, 0], [0.8, 0.2]),  # the reranker alone
    (0.0, [0, 1], [1.0, 0.5]),  # retrieval alone (0.5: halfway between lo and hi)
    (0.25, [0, 1], [0.75 + 0.25 * 0.2, 0.75 * 0.5 + 0.25 * 0.8]),  # retrieval leads
])
def test_the_blend_weight_is_the_rerankers_share(weight, ids, scores) -> None:
    items = scored([0.9, 0.6, 0.3])
    ranked = [Ranked(1, 0.8), Ranked(0, 0.2), Ranked(2, 0.1)]
    hits = ranking.final_hits(items, RerankScores(ranked, blend=True, blend_weight=weight))
    assert [h.id for h in hits[:2]] == ids
    assert [h.score for h in hits[:2]] == pytest.approx(scores)


@pytest.mark.parametrize("min_score, ids", [
    (0.0, [1, 0, 2, 3]),  # off: the head, then the rest
    (0.5, [1]),  # on: weak reranked hits go, and the rest with them
    (0.95, []),
])
def test_min_score(min_score, ids) -> None:
    hits = ranking.final_hits(scored([0.9, 0.6, 0.3, 0.2]),
                              RerankScores([Ranked(1, 0.9), Ranked(0, 0.4)], min_score=min_score))
    assert [h.id for h in hits] == ids


def test_an_empty_reranking_keeps_the_retrieval_order() -> None:
    hits = ranking.final_hits(scored([0.9, 0.6]), RerankScores([]))
    assert [(h.id, h.score, h.rerank_score) for h in hits] == [(0, 0.9, None), (1, 0.6, None)]


@pytest.mark.parametrize("available, limit, oversample, cap, count", [
    (0, 10, 3, 50, 0), (100, 10, 3, 50, 30), (100, 10, 6, 50, 50), (7, 10, 3, 50, 7),
])
def test_rerank_count(available, limit, oversample, cap, count) -> None:
    config = RerankerConfig(oversample=oversample, max_candidates=cap)
    assert ranking.rerank_count(available, limit, config) == count


def test_hits_carry_every_stage() -> None:
    cand = Candidate(7, similarity=0.7, keyword_score=3.0, ranks={"dense": 2, "keyword": 1},
                     fused=0.2, queries={0, 1})
    (hit,) = ranking.final_hits([Scored(cand, message(7, age_days=2.0), 0.01)],
                                RerankScores([Ranked(0, 0.66)]))
    assert (hit.similarity, hit.keyword_score, hit.dense_rank, hit.keyword_rank) == (0.7, 3.0, 2, 1)
    assert (hit.fused, hit.bonus, hit.score, hit.rerank_score, hit.queries_matched) == (
        0.2, 0.01, 0.66, 0.66, 2)
    assert hit.created_at == NOW_MS - 2 * DAY_MS and hit.content == "the raid starts at nine"


def test_a_hits_score_is_set_in_one_place() -> None:
    """Only ranking.final_hits writes Hit.score (STYLE 23): no other module of the
    engine assigns a ``score`` to a hit."""
    root = Path(ranking.__file__).resolve().parents[1]
    writers = []
    for path in sorted(root.rglob("*.py")):
        for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"))):
            if isinstance(node, ast.Attribute) and node.attr == "score" and isinstance(
                node.ctx, ast.Store
            ):
                writers.append(f"{path.name}:{node.lineno}")
            if isinstance(node, ast.Call) and getattr(node.func, "id", None) == "Hit" and any(
                k.arg == "score" for k in node.keywords
            ):
                writers.append(f"{path.name}:{node.lineno}")
    assert len(writers) == 1 and writers[0].startswith("ranking.py:"), writers


def test_recency_halves_about_every_point_seven_decay_periods() -> None:
    assert ranking.recency(0.0, CONFIG) == 1.0
    assert ranking.recency(-5.0, CONFIG) == 1.0, "a message from the future is brand new"
    half = CONFIG.recency_decay_days * math.log(2)
    assert ranking.recency(half, CONFIG) == pytest.approx(0.5)


def test_a_time_span_counts_from_the_searchs_now() -> None:
    given = bonuses(("the raid last week",))
    assert given.span is not None and given.recent is False
    inside = message(1, age_days=9.0)  # NOW is a Thursday: nine days back is last week
    assert ranking.bonus(inside, given, CONFIG) >= CONFIG.time_weight * UNIT


@pytest.mark.parametrize(("vectors", "rescore"), [
    (0, 4), (4_096, 4), (100_000, 4), (200_000, 4), (250_000, 5), (500_000, 10),
    (1_000_000, 20), (10_000_000, 200),
])
def test_a_large_guild_looks_wider(vectors: int, rescore: int) -> None:
    """``rescore`` grows in proportion to the guild past ``rescore_step`` vectors, so the
    candidates stay the same share of a guild of 1M as of one of 200k."""
    assert ranking.rescore_for(vectors, CONFIG) == rescore
    assert ranking.rescore_for(vectors, replace(CONFIG, rescore_step=0)) == CONFIG.rescore
    assert ranking.rescore_for(vectors, replace(CONFIG, rescore=32)) == max(32, rescore * 8)


# -- the page guard: the reranker cannot trade retrieval's top `keep` for order -----------------


def _guarded(reranker: list[float], keep: int, margin: float, *, blend: bool = False
             ) -> list[int]:
    items = scored([1.0 - 0.1 * i for i in range(len(reranker))])
    ranked = sorted((Ranked(i, s) for i, s in enumerate(reranker)), key=lambda r: -r.score)
    rerank = RerankScores(ranked, blend=blend, keep=keep, keep_margin=margin)
    return [h.id for h in ranking.final_hits(items, rerank)]


@pytest.mark.parametrize("reranker, keep, margin, page", [
    # retrieval's top 2 are ids 0 and 1; id 3 is a newcomer
    pytest.param([0.5, 0.4, 0.1, 0.55], 2, 0.2, [0, 1], id="unsure-newcomer-stays-out"),
    pytest.param([0.5, 0.4, 0.1, 0.65], 2, 0.2, [3, 0], id="clear-newcomer-replaces-weakest"),
    pytest.param([0.5, 0.4, 0.1, 0.6], 2, 0.2, [0, 1], id="equal-to-the-margin-stays-out"),
    pytest.param([0.5, 0.4, 0.1, 0.55], 2, 0.0, [3, 0], id="no-margin-is-the-plain-order"),
    pytest.param([0.1, 0.2, 0.9, 0.8], 2, 0.2, [2, 3], id="two-clear-newcomers"),
    pytest.param([0.1, 0.2, 0.9, 0.35], 2, 0.2, [2, 1], id="second-newcomer-not-clear"),
    pytest.param([0.3, 0.9, 0.1, 0.2], 2, 0.2, [1, 0], id="guards-reordered-freely"),
    pytest.param([0.3, 0.9, 0.1, 0.2], 9, 0.2, [1, 0, 3, 2], id="keep-past-the-head"),
    pytest.param([0.5, 0.5, 0.5, 0.5], 2, 0.0, [0, 1], id="all-equal"),
])
def test_a_newcomer_enters_the_page_only_by_a_clear_margin(reranker, keep, margin, page) -> None:
    ids = _guarded(reranker, keep, margin)
    assert ids[:len(page)] == page
    assert sorted(ids) == list(range(len(reranker)))  # nothing lost, nothing doubled


def test_a_guard_leaves_the_page_only_for_a_newcomer_clearly_above_it() -> None:
    """Random reranker scores, blended: every guard (retrieval's top 5) missing from the
    page was out-scored by more than the margin by a newcomer on it."""
    rng = np.random.default_rng(7)
    for _ in range(200):
        items = scored([1.0 - 0.05 * i for i in range(12)])
        ranked = sorted((Ranked(i, s) for i, s in enumerate(rng.random(12).round(2).tolist())),
                        key=lambda r: -r.score)
        hits = ranking.final_hits(items, RerankScores(ranked, blend=True, keep=5,
                                                      keep_margin=0.2))
        score = {h.id: h.score for h in hits}
        page = [h.id for h in hits[:5]]
        newcomers = [score[i] for i in page if i >= 5]
        for lost in set(range(5)) - set(page):
            assert any(s > score[lost] + 0.2 for s in newcomers)
        assert [score[i] for i in page] == sorted((score[i] for i in page), reverse=True)


def test_without_keep_the_head_is_simply_sorted() -> None:
    assert _guarded([0.5, 0.4, 0.1, 0.55], 0, 0.9) == [3, 0, 1, 2]
