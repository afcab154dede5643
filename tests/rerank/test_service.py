"""RerankerService and its place in the search pipeline.

Backends are real: the llama-server stand-in is an HTTP server on 127.0.0.1
(tests/fake_llama_server.py) and the in-process path uses a tiny Qwen3 model built
and saved locally (tests/qwen_tiny.py).  Only the trained weights are missing.
"""

from __future__ import annotations

import logging
import sys
import threading
import time
from dataclasses import replace

import pytest

from memory import metrics
from memory.config import Profile, QwenConfig, RerankerConfig
from memory.engine import MemoryEngine
from memory.errors import RerankerError, RerankerUnavailable, StorageBusy
from memory.records import MessageRecord
from memory.rerank.service import RerankerService
from memory.search import SearchRequest
from tests.support.builders import HashEmbedder
from tests.support.engines import another_writer
from tests.support.llama_standin import FakeLlamaServer, relevance

GUILD = 42
CHANNEL = 7
BASE_MS = 1_700_000_000_000

DOCS = [
    "the raspberry pi cluster runs kubernetes now",
    "raspberry jam recipe from grandma",
    "my pi overheated so I added a fan",
    "cluster of grapes on the vine",
    "kubernetes on a raspberry pi cluster is fun",
    "nothing to see here",
]


def records() -> list[MessageRecord]:
    """Six messages that share words with the test query in different amounts."""
    out = []
    for i, text in enumerate(DOCS):
        created = BASE_MS + i * 60_000
        out.append(
            MessageRecord(
                id=((created - 1420070400000) << 22) | i, guild_id=GUILD, channel_id=CHANNEL,
                author_id=100 + i % 2, created_at=created, content=text,
                author_name=f"user{i % 2}", author_display_name=f"User{i % 2}",
            )
        )
    return out


def remote_profile(url: str, **overrides) -> Profile:
    reranker = RerankerConfig.from_table({"backend": "llama-server", "url": url, "timeout": 3.0,
                                          **overrides})
    return Profile(name="remote-test", reranker=reranker)


@pytest.fixture
def server():
    with FakeLlamaServer() as fake:
        yield fake


@pytest.fixture
def remote_engine(tmp_path, server):
    engine = MemoryEngine(tmp_path / "m.sqlite3", remote_profile(server.url), HashEmbedder())
    engine.ingest(records())
    yield engine
    engine.close()


QUERY = "raspberry pi cluster kubernetes"


def search(engine: MemoryEngine, **options) -> object:
    options.setdefault("limit", 3)
    return engine.search(SearchRequest(queries=(QUERY,), guild_id=GUILD, **options))


# -- rank: the public ranking API ---------------------------------------------------


class WordOverlap:
    """A deterministic backend: the fake server's relevance, in-process."""

    name = "word-overlap"

    def __init__(self) -> None:
        self.calls: list[list[str]] = []
        self.closed = False

    def load(self):
        pass

    def score(self, query, texts):
        self.calls.append(list(texts))
        return [relevance(query, t) for t in texts]

    def close(self):
        self.closed = True


def test_rank_returns_index_score_pairs_best_first_and_leaves_its_input_alone():
    service = RerankerService(RerankerConfig(backend="transformers"), backend=WordOverlap())
    texts = list(DOCS)
    ranked = service.rank(QUERY, texts)
    assert [r.score for r in ranked] == sorted(
        (relevance(QUERY, t) for t in DOCS), reverse=True
    )
    assert all(r.score == relevance(QUERY, DOCS[r.item]) for r in ranked)
    assert sorted(r.item for r in ranked) == list(range(len(DOCS)))
    assert DOCS[ranked[0].item] in (DOCS[0], DOCS[4])
    assert texts == DOCS, "inputs must not be mutated"
    service.close()


@pytest.mark.parametrize("top_k, expected", [(None, 6), (2, 2), (0, 0), (50, 6)])
def test_rank_top_k(top_k, expected):
    service = RerankerService(RerankerConfig(backend="transformers"), backend=WordOverlap())
    assert len(service.rank(QUERY, DOCS, top_k=top_k)) == expected
    service.close()


def test_rank_judges_each_text_as_given():
    backend = WordOverlap()
    service = RerankerService(RerankerConfig(backend="transformers"), backend=backend)
    service.rank(QUERY, tuple(DOCS))
    assert backend.calls == [list(DOCS)]
    service.close()


def test_ties_keep_their_input_order():
    service = RerankerService(RerankerConfig(backend="transformers"), backend=WordOverlap())
    assert [r.item for r in service.rank("zzz", ["a", "b", "c"])] == [0, 1, 2]
    service.close()


def test_empty_candidates_make_no_backend_call():
    backend = WordOverlap()
    service = RerankerService(RerankerConfig(backend="transformers"), backend=backend)
    assert service.rank(QUERY, []) == []
    assert backend.calls == []
    service.close()


class Broken:
    name = "broken"

    def __init__(self, result):
        self.result = result

    def load(self):
        pass

    def score(self, query, texts):
        if isinstance(self.result, BaseException):
            raise self.result
        return self.result

    def close(self):
        pass


@pytest.mark.parametrize(
    "result", [ValueError("bug"), RerankerError("down"), [0.5], "not a list of floats"]
)
def test_backend_failures_become_reranker_errors(result):
    service = RerankerService(RerankerConfig(backend="transformers"), backend=Broken(result))
    with pytest.raises(RerankerError):
        service.rank(QUERY, ["a", "b"])
    outcome = service.rank_for_search(QUERY, ["a", "b"])
    assert outcome.ranked == () and outcome.fallback
    service.close()


# -- in the search pipeline ----------------------------------------------------------


def test_search_reranks_the_head_with_the_remote_backend(remote_engine, server):
    plain = search(remote_engine, rerank=False)
    result = search(remote_engine)
    trace = result.trace
    assert trace.reranked and trace.rerank_fallback is None
    assert trace.rerank_backend == "llama-server"
    # limit 3 × oversample 3 = 9, capped by the 6 candidates that exist
    assert trace.candidates["rerank"] == len(trace.pre_rerank) <= 9
    assert set(trace.post_rerank) == set(trace.pre_rerank)
    scores = [h.rerank_score for h in result.hits]
    assert scores == sorted(scores, reverse=True)
    for hit in result.hits:
        assert hit.rerank_score == pytest.approx(relevance(QUERY, hit.rerank_text), abs=1e-6)
        assert hit.score == hit.rerank_score
    assert len(result.hits) == 3 and len(plain.hits) == 3
    sent = server.bodies("/completion")
    assert len(sent) == trace.candidates["rerank"]
    assert all(f"<Query>: {QUERY}\n" in body["prompt"] for body in sent)


def test_rerank_candidate_count_is_capped(tmp_path, server):
    profile = remote_profile(server.url, oversample=2, max_candidates=3)
    engine = MemoryEngine(tmp_path / "m.sqlite3", profile, HashEmbedder())
    engine.ingest(records())
    result = engine.search(SearchRequest(queries=(QUERY,), guild_id=GUILD, limit=2))
    assert result.trace.candidates["rerank"] == 3
    assert len(server.requests) == 3
    assert len(result.hits) == 2
    engine.close()


def test_blend_mixes_normalised_retrieval_score_with_rerank(tmp_path, server):
    engine = MemoryEngine(
        tmp_path / "m.sqlite3", remote_profile(server.url, blend=True), HashEmbedder()
    )
    engine.ingest(records())
    before = {h.id: h.score for h in search(engine, rerank=False, limit=6).hits}
    result = search(engine, limit=6)
    lo, hi = min(before.values()), max(before.values())
    for hit in result.hits:
        original = (before[hit.id] - lo) / (hi - lo)
        assert hit.score == pytest.approx(0.4 * original + 0.6 * hit.rerank_score, abs=1e-9)
    assert [h.score for h in result.hits] == sorted((h.score for h in result.hits), reverse=True)
    engine.close()


def test_min_score_drops_weak_results(tmp_path, server):
    engine = MemoryEngine(
        tmp_path / "m.sqlite3", remote_profile(server.url, min_score=0.5), HashEmbedder()
    )
    engine.ingest(records())
    result = search(engine, limit=6)
    assert result.hits, "the two on-topic messages pass"
    assert all(h.rerank_score >= 0.5 for h in result.hits)
    assert len(result.hits) < 6
    engine.close()


def _error_count() -> float:
    value = metrics.REGISTRY.get_sample_value(
        "memory_rerank_calls_total", {"backend": "llama-server", "status": "error"}
    )
    return value or 0.0


@pytest.mark.parametrize("mode", ["error", "malformed", "drop", "loading", "bad_request"])
def test_reranker_failure_falls_back_to_retrieval_order(remote_engine, server, mode, caplog):
    expected = [h.id for h in search(remote_engine, rerank=False).hits]
    server.mode = mode
    errors = _error_count()
    with caplog.at_level(logging.WARNING, logger="memory.rerank.service"):
        result = search(remote_engine)
    assert [h.id for h in result.hits] == expected
    assert not result.trace.reranked
    assert result.trace.rerank_fallback
    assert all(h.rerank_score is None for h in result.hits)
    assert "reranking skipped" in caplog.text
    assert _error_count() == errors + 1


def test_reranker_timeout_falls_back_in_bounded_time(tmp_path, server):
    server.delay = 5.0
    profile = remote_profile(server.url)
    profile = replace(profile, reranker=replace(profile.reranker, timeout=0.5))
    engine = MemoryEngine(tmp_path / "m.sqlite3", profile, HashEmbedder())
    engine.ingest(records())
    started = time.monotonic()
    result = search(engine)
    assert time.monotonic() - started < 4.0  # far below the server's 5 s delay
    assert not result.trace.reranked and "0.5" in result.trace.rerank_fallback
    assert len(result.hits) == 3
    engine.close()


def test_missing_local_model_falls_back(tmp_path):
    reranker = RerankerConfig(backend="transformers",
                              qwen=QwenConfig(model=str(tmp_path / "no-such-model")))
    engine = MemoryEngine(
        tmp_path / "m.sqlite3", Profile(name="x", reranker=reranker), HashEmbedder()
    )
    engine.ingest(records())
    result = search(engine)
    assert len(result.hits) == 3
    assert result.trace.rerank_fallback and not result.trace.reranked
    engine.close()


@pytest.mark.parametrize("backend, module", [
    ("transformers", "memory.rerank.qwen"),  # torch or transformers missing
    ("llama-server", "memory.rerank.llama_server"),  # httpx missing
])
def test_a_backend_whose_packages_are_missing_never_fails_a_search(
    tmp_path, monkeypatch, backend, module
):
    monkeypatch.setitem(sys.modules, module, None)  # `import` of it raises ImportError
    config = RerankerConfig.from_table({"backend": backend, "model": "Qwen/Qwen3-Reranker-0.6B",
                                        "url": "http://127.0.0.1:9"})
    engine = MemoryEngine(tmp_path / "m.sqlite3", Profile(name="x", reranker=config),
                          HashEmbedder())
    try:
        engine.ingest(records())
        result = search(engine)
        assert len(result.hits) == 3 and not result.trace.reranked
        assert f"the {backend} reranker cannot run here" in result.trace.rerank_fallback
        with pytest.raises(RerankerUnavailable, match="install the missing package"):
            engine.rerankers.current().load()
    finally:
        engine.close()


# -- runtime profile switching ---------------------------------------------------------


def test_switch_profile_swaps_after_load_and_keeps_inflight_on_old(remote_engine, server):
    with FakeLlamaServer() as second:
        server.delay = 0.4  # the in-flight search is slow on the old backend
        old = remote_engine.rerankers.current()
        results: list = []
        worker = threading.Thread(target=lambda: results.append(search(remote_engine)))
        worker.start()
        time.sleep(0.15)  # the search is now waiting on the old server
        future = remote_engine.switch_profile(remote_profile(second.url, timeout=3.0))
        assert future.result(timeout=10) == "remote-test"
        worker.join(10)
        assert results[0].trace.reranked, "the in-flight search finished on the old backend"
        assert remote_engine.rerankers.current() is not old
        old_requests = len(server.requests)
        result = search(remote_engine)
        assert result.trace.reranked
        assert len(server.requests) == old_requests, "new searches use the new server"
        assert len(second.requests) == result.trace.candidates["rerank"]
        for _ in range(50):  # the old service is closed once idle
            if old.backend.closed:
                break
            time.sleep(0.05)
        assert old.backend.closed
    assert remote_engine.storage.meta.active_profile == "remote-test"


def test_failed_switch_keeps_the_old_reranker(remote_engine, tmp_path):
    old = remote_engine.rerankers.current()
    broken = Profile(
        name="broken",
        reranker=RerankerConfig(backend="transformers",
                                qwen=QwenConfig(model=str(tmp_path / "missing"))),
    )
    future = remote_engine.switch_profile(broken)
    with pytest.raises(RerankerUnavailable, match="missing"):
        future.result(timeout=30)
    assert remote_engine.rerankers.current() is old
    assert remote_engine.storage.meta.active_profile != "broken"
    assert search(remote_engine).trace.reranked


def test_a_switch_whose_choice_cannot_be_stored_is_undone(remote_engine):
    """Storing ``meta.active_profile`` fails (another writer holds the lock): the
    future raises instead of never resolving, the old reranker stays in use and the
    new one is unloaded, so two models are never left loaded."""
    old = remote_engine.rerankers.current()
    with FakeLlamaServer() as second:
        loaded: list = []
        switched: list = []

        def on_switched(profile: Profile) -> None:
            loaded.append(remote_engine.rerankers.current())
            with another_writer(remote_engine.storage, wait_s=0.05):
                remote_engine._use_profile(profile, remember=True)
            switched.append(profile.name)

        future = remote_engine.rerankers.switch(
            replace(remote_profile(second.url), name="second"), on_switched=on_switched)
        with pytest.raises(StorageBusy):
            future.result(timeout=30)
        assert not switched
        assert remote_engine.rerankers.current() is old
        assert remote_engine.rerankers.profile_name == "remote-test"
        assert remote_engine.profile.name == "remote-test"
        assert remote_engine.storage.meta.active_profile != "second"
        (new,) = loaded
        assert new is not old and new.backend.closed, "the new reranker was unloaded"
        assert not old.backend.closed
        result = search(remote_engine)
        assert result.trace.reranked and not second.requests
        # the same through the engine's own switch: the owner's command gets the error
        with another_writer(remote_engine.storage, wait_s=0.05):
            future = remote_engine.switch_profile(replace(remote_profile(second.url), name="third"))
            with pytest.raises(StorageBusy):
                future.result(timeout=30)
        assert remote_engine.rerankers.current() is old
        assert remote_engine.profile.name == "remote-test"
        assert search(remote_engine).trace.reranked and not second.requests


def test_switch_to_a_profile_without_reranker(remote_engine):
    future = remote_engine.switch_profile(Profile(name="plain"))
    assert future.result(timeout=10) == "plain"
    result = search(remote_engine)
    assert remote_engine.rerankers.current() is None
    assert not result.trace.reranked and result.trace.rerank_backend is None
    assert remote_engine.storage.meta.active_profile == "plain"


def test_following_another_process_switches_without_storing_the_choice(remote_engine):
    """A bot process that follows a switch stored by another never writes it back: that
    write could overwrite a newer choice an owner made meanwhile in a third process."""
    remote_engine.storage.meta.active_profile = "newer-choice"
    future = remote_engine.switch_profile(Profile(name="plain"), remember=False)
    assert future.result(timeout=10) == "plain"
    assert remote_engine.profile.name == "plain" and remote_engine.rerankers.current() is None
    assert remote_engine.storage.meta.active_profile == "newer-choice"


# -- the in-process backend end to end ---------------------------------------------


@pytest.fixture(scope="module")
def tiny_model_dir(tmp_path_factory):
    from tests.support.qwen_tiny import save_tiny_reranker

    return save_tiny_reranker(tmp_path_factory.mktemp("tiny-qwen"))


def test_search_reranks_in_process_with_a_locally_saved_qwen3(tmp_path, tiny_model_dir):
    reranker = RerankerConfig(backend="transformers",
                              qwen=QwenConfig(model=str(tiny_model_dir), batch_size=4))
    engine = MemoryEngine(
        tmp_path / "m.sqlite3", Profile(name="tiny", reranker=reranker), HashEmbedder()
    )
    engine.ingest(records())
    result = search(engine)
    assert result.trace.reranked, result.trace.rerank_fallback
    assert result.trace.rerank_backend
    scores = [h.rerank_score for h in result.hits]
    assert scores == sorted(scores, reverse=True)
    assert all(0.0 <= s <= 1.0 for s in scores)
    # the same pairs scored directly agree with what the search recorded
    direct = engine.rerankers.current().score(QUERY, [h.rerank_text for h in result.hits])
    assert direct == pytest.approx(scores, abs=1e-5)
    engine.close()


def test_a_failed_model_load_is_remembered_not_retried_per_search(tmp_path, monkeypatch):
    from memory.rerank.qwen import QwenReranker

    backend = QwenReranker(QwenConfig(model=str(tmp_path / "gone")))
    with pytest.raises(RerankerError) as first:
        backend.load()
    calls = []
    monkeypatch.setattr(backend, "_from_pretrained", lambda: calls.append(1))
    with pytest.raises(RerankerError) as second:
        backend.score(QUERY, ["a document"])
    assert second.value is first.value and calls == []


def test_fallback_warns_once_per_cause(tmp_path, caplog):
    reranker = RerankerConfig(backend="transformers",
                              qwen=QwenConfig(model=str(tmp_path / "no-such-model")))
    engine = MemoryEngine(
        tmp_path / "m.sqlite3", Profile(name="x", reranker=reranker), HashEmbedder(),
        load_reranker=False,
    )
    engine.ingest(records())
    with caplog.at_level(logging.DEBUG, logger="memory.rerank.service"):
        for _ in range(3):
            assert search(engine).trace.rerank_fallback
    warnings = [r for r in caplog.records if r.levelno == logging.WARNING]
    assert len(warnings) == 1
    engine.close()


def test_metrics_are_exposed_over_http(remote_engine):
    import socket
    import urllib.request

    search(remote_engine)
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        port = sock.getsockname()[1]
    metrics.serve(port)
    body = urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=5).read().decode()
    for name in ("memory_rerank_calls_total", "memory_rerank_candidates",
                 "memory_rerank_seconds", "memory_rerank_server_errors_total",
                 "memory_adaptive_threshold_iterations", "memory_final_threshold",
                 "memory_search_results", "memory_search_seconds"):
        assert name in body
    assert 'memory_rerank_calls_total{backend="llama-server",status="ok"}' in body


def test_the_in_process_model_stops_between_batches_once_the_deadline_passed(tiny_model_dir):
    from memory.rerank import deadline
    from memory.rerank.qwen import QwenReranker

    backend = QwenReranker(QwenConfig(model=str(tiny_model_dir), batch_size=1))
    try:
        with deadline.until(time.monotonic() - 1.0), pytest.raises(RerankerError, match="deadline"):
            backend.score(QUERY, DOCS)
        assert len(backend.score(QUERY, DOCS)) == len(DOCS), "no deadline outside the service"
    finally:
        backend.close()
