"""Concurrent searches scored together on the static path (issue 33), on the tiny model.

With ``reranker.concurrent`` above 1, searches that arrive while another is being
scored share the next static steps: their heads go into separate head slots and one
tail step holds rows of several searches.  Each row must attend only to its own
head, so every search's scores equal the ones it gets alone, whatever it was
grouped with.
"""

from __future__ import annotations

import copy
import dataclasses
import logging
import threading
import time
from pathlib import Path

import pytest
import torch

from memory.config import ConfigError, RerankerConfig, load_profile_file
from memory.rerank.qwen import QwenReranker
from tests.rerank.test_reranker_qwen import DOCS, HOSTILE, QUERY, assert_close
from tests.support.qwen_tiny import wrap

FP32_TOL = 1e-5
BUCKETS = ((4, 16), (8, 32), (2, 64))
QUERIES = (QUERY, "", "bot down?", "x" * 40, "where is the raid " * 12)  # heads in 3 capacities
TEXTS = {
    QUERY: DOCS,
    "": DOCS[:3],
    "bot down?": [HOSTILE[k] for k in sorted(HOSTILE)],
    "x" * 40: DOCS[2:7],
    "where is the raid " * 12: [*DOCS[:2], "ok"],
}


@pytest.fixture(scope="module")
def alone(parts, config):
    """Each query's scores on the dynamic path, one search at a time."""
    reranker = wrap(parts, config, batch_size=8)
    return {q: reranker.score(q, TEXTS[q]) for q in QUERIES}


@pytest.mark.parametrize("slots", [1, 2, 5])
def test_searches_scored_together_equal_each_alone(parts, config, alone, slots):
    reranker = wrap(parts, config, buckets=BUCKETS, concurrent=slots)
    static = reranker._static
    searches = [reranker.encode(q, TEXTS[q]) for q in QUERIES]
    results = static.score_together([(e.head, e.tails) for e in searches])
    for query, encoded, (found, overflow) in zip(QUERIES, searches, results, strict=True):
        if overflow:  # tails past every bucket go to the dynamic path, as alone
            rest = reranker._score_dynamic(encoded, overflow)
            found.update((i, rest[i]) for i in overflow)
        assert_close([found[i] for i in range(len(encoded.tails))], alone[query], tol=FP32_TOL)


def test_a_row_never_sees_another_search_s_head(parts, config, alone):
    # the same document under two queries in one step: each score is its own query's
    reranker = wrap(parts, config, buckets=((8, 64),), concurrent=2)
    doc = DOCS[0]
    first, second = (reranker.encode(q, [doc]) for q in (QUERY, "bot down?"))
    results = reranker._static.score_together(
        [(first.head, first.tails), (second.head, second.tails)]
    )
    assert_close([results[0][0][0]], alone[QUERY][:1], tol=FP32_TOL)
    expected = wrap(parts, config, batch_size=8).score("bot down?", [doc])
    assert_close([results[1][0][0]], expected, tol=FP32_TOL)
    assert abs(results[0][0][0] - results[1][0][0]) > 1e-4  # the heads do differ


def forward_calls(model) -> list[int]:
    calls: list[int] = []
    model.model.embed_tokens.register_forward_hook(lambda _m, args, _o: calls.append(1))
    return calls


def concurrent_scores(reranker, queries) -> tuple[dict[str, list[float]], list[BaseException]]:
    """Queue one search per query while the reranker is busy; release it once all wait.

    The prompts are encoded first (score() encodes under the reranker's lock, which
    this holds), then each thread enters the queue as score() does after encoding.
    """
    got: dict[str, list[float]] = {}
    errors: list[BaseException] = []
    encoded = {q: reranker.encode(q, TEXTS[q]) for q in queries}

    def search(query: str) -> None:
        try:
            got[query] = reranker._groups.score(encoded[query])
        except BaseException as exc:
            errors.append(exc)

    threads = [threading.Thread(target=search, args=(q,)) for q in queries]
    with reranker._lock:  # a search is being scored: the others queue
        for thread in threads:
            thread.start()
        deadline = time.monotonic() + 60
        while len(reranker._groups.waiting) < len(queries) and time.monotonic() < deadline:
            time.sleep(0.01)
        assert len(reranker._groups.waiting) == len(queries)
    for thread in threads:
        thread.join(timeout=120)
    return got, errors


def test_queued_searches_share_steps_and_get_their_own_scores(tiny_dir, config, alone):
    from transformers import AutoModelForCausalLM, AutoTokenizer

    model = AutoModelForCausalLM.from_pretrained(tiny_dir, dtype=torch.float32).eval()
    parts = (model, AutoTokenizer.from_pretrained(tiny_dir))
    queries = (QUERY, "", "bot down?")
    one_by_one = wrap(parts, config, buckets=BUCKETS)
    calls = forward_calls(model)
    for query in queries:
        assert_close(one_by_one.score(query, TEXTS[query]), alone[query], tol=FP32_TOL)
    separate = len(calls)
    together = wrap(parts, config, buckets=BUCKETS, concurrent=4)
    calls.clear()
    got, errors = concurrent_scores(together, queries)
    assert errors == []
    for query in queries:
        assert_close(got[query], alone[query], tol=FP32_TOL)
    assert len(calls) < separate  # the three searches' tails shared forward passes


def test_a_failing_step_scores_every_queued_search_dynamically(parts, config, alone, caplog):
    reranker = wrap(parts, config, buckets=BUCKETS, concurrent=4)
    reranker._static.pad_id = 10**9  # an id past the vocabulary: the embedding lookup fails
    queries = (QUERY, "", "bot down?")
    with caplog.at_level(logging.WARNING, logger="memory.rerank.qwen"):
        got, errors = concurrent_scores(reranker, queries)
        again = reranker.score(QUERY, TEXTS[QUERY])
    assert errors == []
    assert caplog.text.count("static-shape step failed") == 1
    assert reranker._static is None
    for query in queries:
        assert_close(got[query], alone[query], tol=FP32_TOL)
    assert_close(again, alone[QUERY], tol=FP32_TOL)


def test_one_search_alone_takes_the_together_path_unchanged(parts, config, alone):
    reranker = wrap(parts, config, buckets=BUCKETS, concurrent=16)
    for query in QUERIES:
        assert_close(reranker.score(query, TEXTS[query]), alone[query], tol=FP32_TOL)
    assert reranker._groups.waiting == []


@pytest.mark.parametrize("value", ["0", "257", "1.5", "'many'"])
def test_bad_concurrent_names_file_and_key(tmp_path: Path, value):
    path = tmp_path / "p.toml"
    path.write_text(f'[reranker]\nbackend = "transformers"\nconcurrent = {value}\n',
                    encoding="utf-8")
    with pytest.raises(ConfigError, match="concurrent") as caught:
        load_profile_file(path)
    assert str(path) in str(caught.value)


def test_bfloat16_together_within_issue_bar_of_bfloat16_eager(parts, config):
    model, tokenizer = parts
    bf16 = QwenReranker.from_model(
        copy.deepcopy(model).to(torch.bfloat16), tokenizer,
        dataclasses.replace(config, buckets=BUCKETS, concurrent=4),
    )
    queries = (QUERY, "", "bot down?")
    searches = [bf16.encode(q, TEXTS[q]) for q in queries]
    results = bf16._static.score_together([(e.head, e.tails) for e in searches])
    bf16._static = None
    for query, encoded, (found, overflow) in zip(queries, searches, results, strict=True):
        expected = bf16.score(query, TEXTS[query])  # the dynamic bf16 path
        got = [found.get(i, expected[i]) for i in range(len(encoded.tails))]
        assert_close(got, expected, tol=1e-2)  # issue 33: within 0.01 of same-dtype eager


# -- a group of 16 searches, as many servers search at once (issue 33, second round) -----

CUDA_BUCKETS = load_profile_file(Path(__file__).parents[2] / "profiles" / "cuda.toml").reranker.qwen.buckets
GROUP = 16
THIRTY = [DOCS[i % len(DOCS)] + f" #{i}" for i in range(30)]  # 30 candidates, as the bench


def group_queries() -> list[str]:
    return [f"{QUERY} ({server})" for server in range(GROUP)]


@pytest.fixture(scope="module")
def one_at_a_time(parts, config):
    """Each of the 16 searches scored alone on the static path, and the steps one ran."""
    reranker = wrap(parts, config, buckets=CUDA_BUCKETS, bucket_run_cost=640)
    scores = {q: reranker.score(q, THIRTY) for q in group_queries()}
    stats = reranker._static.stats
    return scores, (stats.head_steps + stats.tail_steps) / stats.searches


def score_sixteen_at_once(reranker, call) -> tuple[dict[str, list[float]], list[BaseException]]:
    """16 searches call ``call`` while a search is being scored (the lock held); then go."""
    got: dict[str, list[float]] = {}
    errors: list[BaseException] = []

    def search(query: str) -> None:
        try:
            got[query] = call(query, THIRTY)
        except BaseException as exc:
            errors.append(exc)

    threads = [threading.Thread(target=search, args=(q,)) for q in group_queries()]
    with reranker._lock:
        for thread in threads:
            thread.start()
        deadline = time.monotonic() + 20
        while len(reranker._groups.waiting) < GROUP and time.monotonic() < deadline:
            time.sleep(0.01)
        queued = len(reranker._groups.waiting)
    for thread in threads:
        thread.join(timeout=120)
    assert queued == GROUP, f"{queued} of {GROUP} searches queued while one was scored"
    return got, errors


@pytest.mark.parametrize("through", ["reranker", "service"])
def test_sixteen_searches_at_once_run_in_one_group_of_few_steps(
    parts, config, one_at_a_time, through
):
    # Before: a search tokenized under the scoring lock, so the others could not even
    # queue while one was scored, and the service called a local model from one worker;
    # each head ran as a step of its own.  Now all 16 queue, and run as one head step
    # and a few full tail steps, each score as alone.
    from memory.rerank.service import RerankerService

    reranker = wrap(parts, config, buckets=CUDA_BUCKETS, bucket_run_cost=640, concurrent=GROUP)
    service = RerankerService(RerankerConfig(backend="transformers", qwen=reranker.config),
                              backend=reranker)
    stats = reranker._static.stats  # closing the service drops the static path
    call = reranker.score if through == "reranker" else service.score
    try:
        got, errors = score_sixteen_at_once(reranker, call)
    finally:
        service.close()
    assert errors == []
    alone, steps_alone = one_at_a_time
    for query in group_queries():
        assert_close(got[query], alone[query], tol=FP32_TOL)
    assert (stats.groups, stats.searches, stats.head_steps) == (1, GROUP, 1)
    assert stats.head_steps + stats.tail_steps <= GROUP * steps_alone / 4
    assert stats.tail_rows / stats.tail_steps >= 4 * 30 / steps_alone  # fuller steps


def test_a_group_s_overflow_rows_score_without_autograd(parts, config):
    # tails longer than every bucket go to the dynamic path from inside the group's
    # worker; they once ran with autograd on, every activation kept until the end
    model, _ = parts
    reranker = wrap(parts, config, buckets=((4, 16),), concurrent=4)
    modes: list[bool] = []
    handle = model.model.embed_tokens.register_forward_hook(
        lambda *_: modes.append(torch.is_inference_mode_enabled())
    )
    try:
        reranker.score(QUERY, [*DOCS, HOSTILE["chat-template"]])
    finally:
        handle.remove()
    assert reranker._static is not None and len(modes) > 1  # head, tails and overflow ran
    assert all(modes)
