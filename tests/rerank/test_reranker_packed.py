"""Several candidates packed into one row of a static step (``reranker.pack``, issue 33).

A chat message and its suffix are 20-80 tokens, so one candidate a row leaves most of
a wide bucket as padding that the GPU computes anyway.  Packed, a row holds several
candidates back to back, each attending only to its own tokens and its row's head,
with rotary positions counted from its own start: every score must equal the score
the candidate gets alone (the dynamic path) within float32 round-off, whatever it
shares a row with, and the planner must never plan a packed search dearer than an
unpacked one.
"""

from __future__ import annotations

import math
import random

import pytest

from memory.config import ConfigError, load_profile_file
from memory.rerank import qwen_static
from memory.rerank.qwen_buffers import reads_per_row
from memory.rerank.qwen_static import Run, plan_cost, plan_packed, plan_runs
from tests.rerank.test_reranker_qwen import DOCS, HOSTILE, QUERY, assert_close
from tests.support.qwen_tiny import wrap

FP32_TOL = 1e-5
BUCKETS = ((4, 16), (8, 32), (2, 64))  # tails of DOCS + HOSTILE run 12..433 tokens
ALL_DOCS = DOCS + [HOSTILE[k] for k in sorted(HOSTILE)]
# the cuda profile's buckets and their measured H100 step times (ms)
CUDA_COSTS = {
    (8, 48): 3.021, (32, 48): 5.967, (128, 48): 19.754, (8, 64): 3.296, (32, 64): 7.006,
    (128, 64): 23.712, (8, 96): 3.781, (32, 96): 9.276, (8, 128): 4.312, (32, 128): 11.499,
    (8, 256): 6.539, (8, 512): 12.036,
}


@pytest.fixture(scope="module")
def dynamic(parts, config):
    return wrap(parts, config, batch_size=8).score(QUERY, ALL_DOCS)


# -- planning ------------------------------------------------------------------------


def test_short_tails_share_rows():
    runs, overflow = plan_packed([10, 12, 9, 30, 40], [(2, 64)], run_cost=0)
    assert overflow == []
    assert runs == [Run((2, 64), [4, 1, 0, 3, 2], (3, 2))]  # longest first, first fit
    assert runs[0].rows() == [[4, 1, 0], [3, 2]]


def test_a_row_holds_at_most_reads_per_row_candidates():
    runs, _ = plan_packed([1] * 10, [(8, 32)], run_cost=0)
    assert [len(row) for row in runs[0].rows()] == [2] * 5  # 32 // 16 = 2 a row
    assert reads_per_row(32) == 2 and reads_per_row(8) == 1


@pytest.mark.parametrize("seed", range(40))
def test_plan_packed_places_every_candidate_once_within_its_row(seed):
    rng = random.Random(seed)
    lengths = [rng.randint(5, 140) for _ in range(rng.randint(1, 90))]
    owners = [rng.randrange(4) for _ in lengths]
    buckets = list(dict.fromkeys(
        (rng.choice([1, 2, 4, 8, 32]), rng.choice([16, 48, 64, 128])) for _ in range(4)))
    longest = max(length for _, length in buckets)
    runs, overflow = plan_packed(lengths, buckets, rng.choice([0, 64, 512]), owners=owners)
    placed = [i for run in runs for i in run.indices] + overflow
    assert sorted(placed) == list(range(len(lengths)))
    assert overflow == sorted((i for i in range(len(lengths)) if lengths[i] > longest),
                              key=lambda i: lengths[i])
    for run in runs:
        batch, length = run.shape
        assert run.shape in buckets and 0 < len(run.rows()) <= batch
        for row in run.rows():
            assert 0 < len(row) <= reads_per_row(length)
            assert sum(lengths[i] for i in row) <= length
            assert len({owners[i] for i in row}) == 1  # a row attends to one head


@pytest.mark.parametrize("seed", range(40))
def test_skipping_row_lengths_that_cannot_win_never_changes_the_plan(monkeypatch, seed):
    # the planner skips packing a row length when a floor under its cost is above the
    # best found; with the floor at minus infinity it packs every length
    rng = random.Random(seed)
    lengths = [rng.randint(5, rng.choice([70, 140, 600])) for _ in range(rng.randint(1, 200))]
    owners = [rng.randrange(rng.choice([1, 4, 16])) for _ in lengths]
    buckets = rng.choice([list(CUDA_COSTS), list(dict.fromkeys(
        (rng.choice([1, 2, 4, 8, 32]), rng.choice([16, 48, 64, 128, 256])) for _ in range(5)))])
    measured = rng.choice([None, {b: rng.uniform(1, 30) for b in buckets}])
    run_cost = rng.choice([0, 64, 640])
    skipping = plan_packed(lengths, buckets, run_cost, measured, owners)
    monkeypatch.setattr(qwen_static, "_least_packing", lambda *_: -math.inf)
    assert plan_packed(lengths, buckets, run_cost, measured, owners) == skipping


@pytest.mark.parametrize("seed", range(40))
def test_the_scorer_takes_the_cheaper_of_packed_and_one_a_row(parts, config, seed):
    rng = random.Random(seed)
    lengths = [rng.randint(12, 120) for _ in range(rng.randint(1, 100))]
    measured = rng.choice([None, CUDA_COSTS])
    static = wrap(parts, config, buckets=tuple(CUDA_COSTS), max_length=512, pack=True,
                  bucket_costs=tuple((b, n, ms) for (b, n), ms in CUDA_COSTS.items())
                  if measured else ())._static
    prices = (static.buckets, static.run_cost, static.measured)
    costs = [plan_cost(plan(lengths, *prices)[0], *prices) for plan in (plan_runs, plan_packed)]
    assert plan_cost(static.plan(lengths)[0], *prices) == min(costs)


def test_rows_fill_steps_of_several_batch_sizes():
    # 74 tails of 60 tokens, two a 128-long row: 37 rows; on the measured H100 times one
    # [32, 128] and one [8, 128] (15.8 ms) beat five [8, 128] (21.6) or two [32, 128] (23.0)
    costs = {(8, 128): CUDA_COSTS[(8, 128)], (32, 128): CUDA_COSTS[(32, 128)]}
    runs, _ = plan_packed([60] * 74, list(costs), measured=costs)
    assert [(run.shape, len(run.rows())) for run in runs] == [((32, 128), 32), ((8, 128), 5)]


def test_one_long_tail_does_not_stretch_every_row():
    # 29 short tails and one of 200 tokens: the short ones two a 64-long row (two [8, 64],
    # 1,152 positions + 2 runs), the long one alone in a [1, 256], rather than every row
    # 256 long (one [8, 256]: 2,048 positions)
    lengths = [30] * 29 + [200]
    runs, overflow = plan_packed(lengths, [(8, 64), (1, 256), (8, 256)], run_cost=64)
    assert overflow == []
    assert sorted((run.shape, bool(run.per_row)) for run in runs) == [
        ((1, 256), False), ((8, 64), True), ((8, 64), True)]
    assert [i for run in runs for i in run.indices if i == 29] == [29]


def test_thirty_chat_messages_plan_a_third_cheaper_on_the_measured_h100_times():
    # 30 chat candidates: tails of ~45 tokens, a few to 90 (the bench's corpus shape)
    rng = random.Random(0)
    lengths = [rng.randint(25, 70) for _ in range(27)] + [80, 88, 93]
    single, _ = plan_runs(lengths, list(CUDA_COSTS), measured=CUDA_COSTS)
    packed, _ = plan_packed(lengths, list(CUDA_COSTS), measured=CUDA_COSTS)
    cost_single = plan_cost(single, list(CUDA_COSTS), measured=CUDA_COSTS)
    cost_packed = plan_cost(packed, list(CUDA_COSTS), measured=CUDA_COSTS)
    assert cost_packed < 0.75 * cost_single, (single, packed)


# -- scores --------------------------------------------------------------------------


@pytest.mark.parametrize(
    "buckets",
    [
        pytest.param(BUCKETS, id="three-buckets"),
        pytest.param(((4, 512),), id="wide-rows"),
        pytest.param(((1, 64),), id="one-row"),
        pytest.param(((2, 48), (1, 128)), id="some-overflow"),
    ],
)
def test_packed_scores_equal_dynamic_path(parts, config, dynamic, buckets):
    reranker = wrap(parts, config, buckets=buckets, pack=True)
    static = reranker._static
    runs, _ = static.plan([len(t) for t in reranker.encode(QUERY, ALL_DOCS).tails])
    assert any(len(row) > 1 for run in runs for row in run.rows())  # it did pack
    assert_close(reranker.score(QUERY, ALL_DOCS), dynamic, tol=FP32_TOL)
    assert_static_scored(reranker, static)


def assert_static_scored(reranker, static) -> None:
    """The static path scored (a failing step falls back to the dynamic path, whose
    scores are the reference: equal scores alone would not tell)."""
    assert reranker._static is static and static.stats.tail_steps > 0


@pytest.mark.parametrize("seed", range(4))
def test_a_packed_score_does_not_depend_on_its_row_mates(parts, config, dynamic, seed):
    rng = random.Random(seed)
    picked = rng.sample(range(len(ALL_DOCS)), k=rng.randint(1, len(ALL_DOCS)))
    reranker = wrap(parts, config, buckets=((4, 64), (2, 128)), pack=True)
    static = reranker._static
    scores = reranker.score(QUERY, [ALL_DOCS[i] for i in picked])
    assert_close(scores, [dynamic[i] for i in picked], tol=FP32_TOL)
    assert_static_scored(reranker, static)


def test_packed_searches_scored_together_equal_each_alone(parts, config):
    queries = {QUERY: DOCS, "bot down?": DOCS[2:7], "x" * 40: ["ok", "yes", *DOCS[:2]]}
    alone = wrap(parts, config, batch_size=8)
    reranker = wrap(parts, config, buckets=((4, 64), (2, 128)), pack=True, concurrent=3)
    encoded = [reranker.encode(q, docs) for q, docs in queries.items()]
    results = reranker._static.score_together([(e.head, e.tails) for e in encoded])
    for (query, docs), (found, overflow) in zip(queries.items(), results, strict=True):
        assert overflow == []
        assert_close([found[i] for i in range(len(docs))], alone.score(query, docs),
                     tol=FP32_TOL)
    assert reranker._static.stats.tail_rows == sum(len(d) for d in queries.values())


# -- the profile key -----------------------------------------------------------------


def test_pack_loads_and_needs_buckets(tmp_path):
    path = tmp_path / "p.toml"
    path.write_text('[reranker]\nbackend = "transformers"\nbuckets = [[8, 64]]\npack = true\n')
    assert load_profile_file(path).reranker.qwen.pack is True
    path.write_text('[reranker]\nbackend = "transformers"\npack = true\n')
    with pytest.raises(ConfigError, match="reranker.pack .*needs reranker.buckets") as caught:
        load_profile_file(path)
    assert str(path) in str(caught.value)


def test_a_step_given_more_candidates_than_it_holds_is_a_clear_error():
    from memory.rerank.qwen_static import _layout

    with pytest.raises(ValueError, match=r"a \[2, 32\] step holds at most 2 rows and 4 "
                                         r"candidates, got 2 rows and 5"):
        _layout([[[1] * 5] * 4, [[1]]], 2, 32)
