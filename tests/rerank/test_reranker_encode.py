"""A grouped search's documents are tokenized while its head step runs (issue 33).

On an H200, tokenizing 30 chat messages took ~1.4 ms of a 9.7 ms search, all of it
before the first step.  With the static path serving and ``concurrent`` above 1, the
head is tokenized at once and the documents on the encoder's own thread; the tails
are read only once the head step is queued.  Tiny Qwen3 on the CPU; the tokenizer is
the real one, wrapped to observe (and, in one test, to fail) its document calls.
"""

from __future__ import annotations

import dataclasses
import logging
import threading
import time

import pytest

from memory.rerank.qwen import QwenReranker
from tests.rerank.test_reranker_qwen import DOCS, QUERY, assert_close
from tests.support.qwen_tiny import wrap

BUCKETS = ((4, 16), (8, 32), (2, 64))


class WatchedTokenizer:
    """The tiny model's tokenizer; calls with a list of texts (the documents) first
    run ``before_documents``, on the thread that tokenizes them."""

    def __init__(self, tokenizer, before_documents) -> None:
        self._tokenizer = tokenizer
        self._before_documents = before_documents

    def __call__(self, text, **kwargs):
        if isinstance(text, list):
            self._before_documents(text)
        return self._tokenizer(text, **kwargs)

    def __getattr__(self, name):
        return getattr(self._tokenizer, name)


def watched(parts, config, before_documents, **overrides) -> QwenReranker:
    """A reranker over the tiny model whose tokenizer runs ``before_documents`` first."""
    model, tokenizer = parts
    return QwenReranker.from_model(model, WatchedTokenizer(tokenizer, before_documents),
                                   dataclasses.replace(config, **overrides))


@pytest.fixture(scope="module")
def alone(parts, config):
    reranker = wrap(parts, config, batch_size=8)
    return {q: reranker.score(q, DOCS) for q in (QUERY, "bot down?")}


def test_the_head_step_runs_before_the_documents_are_tokenized(parts, config, alone):
    model, _ = parts
    head_step_ran = threading.Event()
    seen: list[tuple[bool, str]] = []

    def before_documents(_texts) -> None:
        # Were the tails needed before the head step, this would wait its 10 s out.
        seen.append((head_step_ran.wait(10), threading.current_thread().name))

    reranker = watched(parts, config, before_documents, buckets=BUCKETS, concurrent=4)
    handle = model.model.embed_tokens.register_forward_hook(lambda *_: head_step_ran.set())
    try:
        scores = reranker.score(QUERY, DOCS)
    finally:
        handle.remove()
    assert seen and seen[0][0], "the documents were tokenized before any step ran"
    assert seen[0][1].startswith("reranker-tokenize")
    assert_close(scores, alone[QUERY], tol=1e-5)
    assert reranker._static is not None and reranker._static.stats.tail_steps > 0


def test_without_the_static_path_documents_are_tokenized_on_the_searching_thread(
    parts, config, alone
):
    threads: list[str] = []
    reranker = watched(parts, config, lambda _t: threads.append(threading.current_thread().name),
                       concurrent=4)
    assert_close(reranker.score(QUERY, DOCS), alone[QUERY], tol=1e-5)
    assert threads == [threading.current_thread().name]


def test_a_search_whose_documents_fail_to_tokenize_gets_that_error_alone(
    parts, config, alone, caplog
):
    def refuse_poison(texts) -> None:
        if any("POISON" in t for t in texts):
            raise OSError("the tokenizer process ended (test)")

    reranker = watched(parts, config, refuse_poison, buckets=BUCKETS, concurrent=4)
    got: dict[str, list[float]] = {}
    errors: dict[str, BaseException] = {}

    def search(query: str, texts: list[str]) -> None:
        try:
            got[query] = reranker.score(query, texts)
        except BaseException as exc:
            errors[query] = exc

    first = threading.Thread(target=search, args=("poisoned", [*DOCS[:2], "POISON"]))
    others = [threading.Thread(target=search, args=(QUERY, DOCS)),
              threading.Thread(target=search, args=("bot down?", DOCS))]
    threads = [first, *others]
    with caplog.at_level(logging.WARNING, logger="memory.rerank.qwen"), reranker._lock:
        # a search is being scored: the poisoned one queues first (the reranker idle
        # when it came, so its documents are tokenized in the background), then the
        # others; one group
        first.start()
        wait_until_queued(reranker, 1)
        for thread in others:
            thread.start()
        wait_until_queued(reranker, len(threads))
    for thread in threads:
        thread.join(timeout=60)
    assert set(errors) == {"poisoned"}
    assert isinstance(errors["poisoned"], OSError)
    assert_close(got[QUERY], alone[QUERY], tol=1e-5)
    assert_close(got["bot down?"], alone["bot down?"], tol=1e-5)
    assert reranker._static is not None, "a tokenizer failure is no static-step failure"
    assert "static-shape step failed" not in caplog.text
    assert reranker._static.stats.groups == 1


def test_under_load_each_search_tokenizes_on_its_own_thread(parts, config, alone):
    # a group waiting for its members' background tokenizing would leave the GPU idle:
    # a search arriving while another is queued or scored tokenizes before it queues
    threads: list[str] = []
    reranker = watched(parts, config, lambda _t: threads.append(threading.current_thread().name),
                       buckets=BUCKETS, concurrent=4)
    got: dict[str, list[float]] = {}
    searches = [threading.Thread(target=lambda q=q: got.update({q: reranker.score(q, DOCS)}),
                                 name=f"search-{i}") for i, q in enumerate((QUERY, "bot down?"))]
    with reranker._lock:
        searches[0].start()
        wait_until_queued(reranker, 1)
        searches[1].start()
        wait_until_queued(reranker, 2)
    for thread in searches:
        thread.join(timeout=60)
    assert len(threads) == 2 and "search-1" in threads  # the second, on its own thread
    assert any(name.startswith("reranker-tokenize") for name in threads)  # the first
    for query in (QUERY, "bot down?"):
        assert_close(got[query], alone[query], tol=1e-5)


def wait_until_queued(reranker: QwenReranker, count: int) -> None:
    deadline = time.monotonic() + 30
    while len(reranker._groups.waiting) < count and time.monotonic() < deadline:
        time.sleep(0.01)
    assert len(reranker._groups.waiting) == count


def test_close_stops_the_thread_and_a_reload_tokenizes_through_the_tokenizer_process(
    parts, config, alone
):
    reranker = wrap(parts, config, buckets=BUCKETS, concurrent=4)
    reranker.score(QUERY, DOCS[:2])
    reranker.close()
    assert reranker._encoder._thread is None
    # loaded again from the folder: its tokenizer is a TokenizerProcess (a child
    # process), waited on through a pipe from the encoder's new thread
    try:
        reranker.score(QUERY, DOCS[:1])  # loads; tokenized on this thread (no static path yet)
        assert_close(reranker.score(QUERY, DOCS), alone[QUERY], tol=1e-5)
        assert type(reranker._tokenizer).__name__ == "TokenizerProcess"
        assert reranker._static is not None and reranker._static.stats.tail_steps > 0
        assert reranker._encoder._thread is not None
    finally:
        reranker.close()
