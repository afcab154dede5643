"""Hybrid search: hostile input, fusion, the adaptive threshold, bonuses, multi-query,
filters, empty-result reasons, and the shape of hits and traces.

The fake embedder makes dense similarity a function of shared words, so keyword mode
is used where a test needs ranking ties that only a bonus can break.
"""

from __future__ import annotations

import json
import math
import threading
from collections.abc import Callable, Iterator, Sequence
from dataclasses import replace
from datetime import datetime, timedelta, timezone
from pathlib import Path

import pytest
import torch

from memory.config import SearchConfig
from memory.engine import MemoryEngine
from memory.errors import SearchInputError
from memory.records import MessageRecord, SearchResult, StoredMessage, ms_to_datetime
from memory.search import MAX_QUERIES, SearchRequest, ranking
from memory.search.names import MemberNames
from memory.search.ranking import adaptive_threshold, recency
from memory.torch_threads import one_cpu_thread, settle_cpu_threads
from tests.support.builders import (
    BASE_MS,
    CHANNEL,
    GUILD,
    NOW,
    HashEmbedder,
    make_profile,
    record_factory,
)

MakeRecord = Callable[..., MessageRecord]
MakeEngine = Callable[..., MemoryEngine]
CONFIG = SearchConfig()
THREAD = CHANNEL + 1
OTHER_CHANNEL = CHANNEL + 2
THREADS = torch.get_num_threads()

HOSTILE_QUERIES = {
    # as long as a search may be (MAX_QUERY_CHARS); longer is refused (test_hostile_inputs.py)
    "4000-chars": "solder iron " * 333,
    "4000-chars-one-word": "x" * 4000,
    "nul": "solder\x00iron\x00",
    "only-nul": "\x00\x00",
    "zero-width": "sol\u200bder\u200c \ufeffiron",
    "c++": "C++",
    "apostrophe": "don't",
    "and": "AND",
    "or-not": "OR NOT",
    "quote": '"',
    "unbalanced-quotes": 'he said "solder',
    "hyphens": "state-of-the-art",
    "near": "NEAR(a b)",
    "near-comma": "NEAR(solder iron, 2)",
    "star": "*",
    "prefix-star": "sold*",
    "column": "col:term",
    "content-column": "content:solder",
    "caret": "^solder",
    "minus": "-solder +iron",
    "parens": "((solder) OR (iron",
    "emoji-only": "🔥🎉👍🏽",
    "sql": "'; DROP TABLE messages; --",
    "rtl": "\u202eevil\u202c مرحبا",
    "combining": "e\u0301\u0301 Z\u0335\u0321",
    "newlines": "solder\n\r\niron\t",
    "like-wildcards": "%_%",
}


@pytest.fixture(scope="module")
def corpus(tmp_path_factory: pytest.TempPathFactory) -> Iterator[MemoryEngine]:
    """A small read-only server: two channels, a thread, two authors."""
    engine = MemoryEngine(tmp_path_factory.mktemp("corpus") / "m.sqlite3", make_profile(),
                          HashEmbedder())
    rec = record_factory()
    engine.ingest([
        rec("who has a spare soldering iron I could borrow"),
        rec("Hannah has a solder iron, an old Hakko"),
        rec("I write C++ and Rust at work"),
        rec("state-of-the-art 3D printer arrived"),
        rec("don't forget the AND gate kit"),
        rec("the wifi password is on the fridge", author_id=2),
        rec("tomatoes need more compost", channel_id=OTHER_CHANNEL, channel_name="garden"),
        rec("repair cafe moved to saturday", channel_id=THREAD, parent_id=CHANNEL,
            channel_type="GuildPublicThread", channel_name="repair thread"),
    ])
    yield engine
    engine.close()


# -- hostile input ------------------------------------------------------------------


@pytest.mark.parametrize("query", ["", " ", "\n\t  \r\n", "\u200b", "\x01\x02", "\u200b\u200c\u200d\ufeff"],
                         ids=["empty", "space", "whitespace", "zero-width", "control", "invisible"])
def test_empty_query_is_an_input_error(corpus: MemoryEngine, query: str) -> None:
    with pytest.raises(SearchInputError):
        corpus.search(query, guild_id=GUILD)


@pytest.mark.parametrize("mode", ["hybrid", "dense", "keyword"])
@pytest.mark.parametrize("query", HOSTILE_QUERIES.values(), ids=HOSTILE_QUERIES.keys())
def test_hostile_queries_never_raise(corpus: MemoryEngine, query: str, mode: str) -> None:
    result = corpus.search(query, guild_id=GUILD, mode=mode)
    assert isinstance(result, SearchResult)
    assert len({h.id for h in result.hits}) == len(result.hits)
    if not result.hits:
        assert result.empty_reason


@pytest.mark.parametrize(
    "bad",
    [
        pytest.param({"limit": 0}, id="limit-0"),
        pytest.param({"limit": 101}, id="limit-101"),
        pytest.param({"mode": "fuzzy"}, id="mode"),
        pytest.param({"threshold": 1.5}, id="threshold"),
        pytest.param({"after": NOW, "before": NOW - timedelta(days=1)}, id="after>=before"),
        pytest.param({"author_ids": ()}, id="empty-authors"),
        # ids no Discord object has: SQLite's INTEGER ends at 2**63 - 1 (an OverflowError)
        pytest.param({"channel_ids": (CHANNEL, 2**63)}, id="channel-over-63-bits"),
        pytest.param({"author_ids": (-1,)}, id="author-negative"),
        pytest.param({"allowed_channel_ids": frozenset({2**70})}, id="allowed-huge"),
        pytest.param({"channel_ids": ("general",)}, id="channel-name"),
        pytest.param({"limit": 5.5}, id="limit-float"),
        pytest.param({"limit": "10"}, id="limit-text"),
    ],
)
def test_malformed_requests_are_input_errors(corpus: MemoryEngine, bad: dict) -> None:
    with pytest.raises(SearchInputError):
        corpus.search("solder", guild_id=GUILD, **bad)


@pytest.mark.parametrize("guild_id", [2**64, -1, "111"])
def test_a_guild_id_no_discord_guild_has_is_an_input_error(
    corpus: MemoryEngine, guild_id: object
) -> None:
    with pytest.raises(SearchInputError, match="guild_id: .* is not a Discord id"):
        corpus.search(SearchRequest(queries=("solder",), guild_id=guild_id))  # type: ignore[arg-type]


def test_queries_as_one_string_is_an_input_error(corpus: MemoryEngine) -> None:
    with pytest.raises(SearchInputError):
        corpus.search(SearchRequest(queries="solder iron", guild_id=GUILD))  # type: ignore[arg-type]


def test_naive_and_aware_dates_mix(corpus: MemoryEngine) -> None:
    result = corpus.search("solder", guild_id=GUILD, after=datetime(2020, 1, 1),
                           before=datetime(2030, 1, 1, tzinfo=timezone.utc))
    assert result.hits


HOSTILE_CONTENT = {
    "c++": ("I write C++ templates all day", "C++ templates"),
    "apostrophe": ("don't unplug the kiln", "don't unplug"),
    "and-keyword": ("wire the AND gate first", "AND gate"),
    "or-not": ("OR NOT is a weird opcode", "OR NOT opcode"),
    "quotes": ('he said "bring the multimeter"', '"multimeter'),
    "hyphens": ("a state-of-the-art lathe", "state-of-the-art"),
    "near": ("NEAR(a b) looks like fts syntax", "NEAR(a b) syntax"),
    "star": ("rate it * * * * out of five", "* rate"),
    "column": ("col:term is not a column filter", "col:term"),
    "nul": ("null\x00byte inside", "null\x00byte"),
    "zero-width": ("zero\u200bwidth joiner", "zero\u200bwidth"),
    "sql": ("'; DROP TABLE messages; -- lol", "DROP TABLE messages"),
    "diacritics": ("the Repair Café is open", "repair cafe"),
}


@pytest.mark.parametrize("content, query", HOSTILE_CONTENT.values(), ids=HOSTILE_CONTENT.keys())
def test_hostile_content_is_stored_and_found_by_keyword(
    engine: MemoryEngine, make_record: MakeRecord, content: str, query: str
) -> None:
    target = make_record(content)
    engine.ingest([target, make_record("unrelated filler about tomatoes")])
    assert engine.storage.messages.hydrate([target.id])[target.id].content == content
    result = engine.search(query, guild_id=GUILD, mode="keyword")
    assert target.id in [h.id for h in result.hits]
    assert result.hits[0].id == target.id
    hybrid = engine.search(query, guild_id=GUILD)
    assert target.id in [h.id for h in hybrid.hits]


def test_emoji_only_content_is_stored_and_searchable(
    engine: MemoryEngine, make_record: MakeRecord
) -> None:
    target = make_record("🔥🎉👍🏽")
    engine.ingest([target])
    result = engine.search("🔥🎉👍🏽", guild_id=GUILD, mode="dense", adaptive=False)
    assert [h.id for h in result.hits] == [target.id]


# -- fusion ---------------------------------------------------------------------------


@pytest.mark.parametrize("fusion", ["rrf", "score_sum", "score_max"])
def test_fusion_modes_dedupe_and_keep_both_scores(
    make_engine: MakeEngine, make_record: MakeRecord, fusion: str
) -> None:
    engine = make_engine(fusion=fusion, context="none")
    target = make_record("the soldering iron lives in the red cabinet")
    others = [make_record(f"chatter about gardening and tomatoes {i}") for i in range(6)]
    engine.ingest([target, *others])
    result = engine.search("soldering iron cabinet", guild_id=GUILD, adaptive=False,
                           bonuses=False)
    ids = [h.id for h in result.hits]
    assert len(ids) == len(set(ids)) == 7  # dense found all 7; the target only once
    top = result.hits[0]
    assert top.id == target.id
    assert top.similarity is not None and top.keyword_score is not None
    assert top.dense_rank == 1 and top.keyword_rank == 1
    assert top.fused > 0 and top.score == pytest.approx(top.fused + top.bonus)
    assert all(h.keyword_score is None for h in result.hits[1:])
    assert [h.score for h in result.hits] == sorted((h.score for h in result.hits), reverse=True)


def test_rrf_fused_score_is_reciprocal_rank(
    make_engine: MakeEngine, make_record: MakeRecord
) -> None:
    engine = make_engine(context="none")
    target = make_record("the soldering iron lives in the red cabinet")
    engine.ingest([target, make_record("nothing to see here")])
    hit = engine.search("soldering iron", guild_id=GUILD, adaptive=False, bonuses=False).hits[0]
    assert hit.id == target.id
    # first by its vector and its words; its window's words and vector add two more shares
    most = 1 + CONFIG.keyword_weight + CONFIG.window_weight + CONFIG.window_dense_weight
    assert 2 / (CONFIG.rrf_k + 1) < hit.fused <= most / (CONFIG.rrf_k + 1)
    plain = make_engine(context="none", window_weight=0.0, window_dense_weight=0.0,
                        db=engine.storage.database.location + ".2")
    plain.ingest([target])
    hit = plain.search("soldering iron", guild_id=GUILD, adaptive=False, bonuses=False).hits[0]
    assert hit.fused == pytest.approx(2 / (CONFIG.rrf_k + 1))


# -- adaptive threshold ---------------------------------------------------------------


SPEC = replace(CONFIG, threshold_floor=0.35)  # the seed's loop: 0.75 down to 0.35 by 0.05


def _steps(config: SearchConfig = SPEC) -> list[float]:
    n = round((config.threshold_start - config.threshold_floor) / config.threshold_step) + 1
    return [round(config.threshold_start - i * config.threshold_step, 6) for i in range(n)]


def test_threshold_steps_match_the_spec() -> None:
    assert (CONFIG.threshold_start, CONFIG.threshold_step, CONFIG.threshold_target) == (
        0.75, 0.05, 0.8)
    assert _steps() == [0.75, 0.7, 0.65, 0.6, 0.55, 0.5, 0.45, 0.4, 0.35]
    # the profile's floor is only the lowest a guild's calibrated floor may go
    assert CONFIG.threshold_floor == 0.1 and _steps(CONFIG)[-1] == 0.1


@pytest.mark.parametrize(
    "sims, limit, threshold, iterations, passed",
    [
        pytest.param([], 10, 0.35, 9, [], id="no-candidates"),
        pytest.param([0.5] * 10, 10, 0.5, 6, list(range(10)), id="all-equal"),
        pytest.param([0.9] * 8 + [0.1] * 2, 10, 0.75, 1, list(range(8)), id="exactly-target"),
        pytest.param([0.75] * 8, 10, 0.75, 1, list(range(8)), id="exactly-at-start"),
        pytest.param([0.9] * 7 + [0.72], 10, 0.7, 2, list(range(8)), id="second-step"),
        pytest.param([0.9, 0.9, 0.4, 0.3, 0.1], 10, 0.35, 9, [0, 1, 2], id="never-keeps-floor"),
        pytest.param([0.2] * 5, 5, 0.35, 9, [], id="all-below-floor"),
        pytest.param([None, 0.1, None], 10, 0.35, 9, [0, 2], id="keyword-only-pass"),
        pytest.param([None] * 20 + [0.6] * 8, 10, 0.6, 4, list(range(28)),
                     id="keyword-only-dont-count"),
        pytest.param([1.0, -1.0], 1, 0.75, 1, [0], id="limit-1"),
    ],
)
def test_adaptive_threshold_edges(
    sims: list[float | None], limit: int, threshold: float, iterations: int, passed: list[int]
) -> None:
    outcome = adaptive_threshold(sims, limit, SPEC)
    assert outcome.mode == "adaptive"
    assert outcome.threshold == pytest.approx(threshold)
    assert outcome.iterations == iterations
    assert outcome.passed == passed


@pytest.mark.parametrize("floor, threshold, iterations", [
    (0.35, 0.35, 9), (0.3, 0.3, 10), (0.22, 0.22, 12), (0.9, 0.9, 1)])
def test_adaptive_threshold_stops_at_a_given_floor(
    floor: float, threshold: float, iterations: int
) -> None:
    outcome = adaptive_threshold([0.2] * 5, 5, SPEC, floor=floor)
    assert outcome.threshold == pytest.approx(threshold)
    assert outcome.iterations == iterations


def test_adaptive_threshold_respects_config() -> None:
    config = replace(CONFIG, threshold_start=0.9, threshold_step=0.1, threshold_floor=0.5,
                     threshold_target=0.5)
    outcome = adaptive_threshold([0.85, 0.65, 0.2, 0.1], 4, config)
    assert outcome.threshold == pytest.approx(0.6)
    assert outcome.iterations == 4
    assert outcome.passed == [0, 1]


def test_engine_reports_the_adaptive_threshold(corpus: MemoryEngine) -> None:
    result = corpus.search("soldering iron", guild_id=GUILD)
    trace = result.trace
    assert trace.threshold_mode == "adaptive"
    assert trace.threshold_floor is not None
    assert CONFIG.threshold_floor <= trace.threshold_floor <= trace.threshold <= 0.75
    assert trace.threshold_iterations >= 1
    assert trace.candidates["passed_threshold"] <= trace.candidates["fused"]
    dense = corpus.search("soldering iron", guild_id=GUILD, mode="dense")
    # (in hybrid, matches by words -- their own or their window's -- pass any threshold)
    assert all(h.similarity >= dense.trace.threshold - 1e-6 for h in dense.hits)


def test_the_floor_is_calibrated_per_guild_stored_and_renewed_as_it_grows(
    make_engine: MakeEngine, make_record: MakeRecord
) -> None:
    engine = make_engine()
    assert engine.storage.vectors.similarity_floor(GUILD, 0.5) is None  # too few vectors to say
    engine.ingest([make_record(f"note {i} about {word}") for i, word in
                   enumerate(["tomatoes", "routers", "solder", "beans", "printers"] * 6)])
    floor = engine.storage.vectors.similarity_floor(GUILD, 0.5)
    assert floor is not None and -1.0 < floor < 1.0
    stored = json.loads(engine.storage.meta.get(f"similarity_floor:{GUILD}") or "{}")
    assert stored == {"quantile": 0.5, "vectors": 30, "floor": floor}
    assert engine.storage.vectors.similarity_floor(GUILD, 0.9) > floor  # a higher quantile, higher floor
    result = engine.search("tomatoes", guild_id=GUILD, now=NOW)
    assert result.trace.threshold_floor == pytest.approx(max(CONFIG.threshold_floor, floor))
    engine.ingest([make_record(f"off topic chatter {i}") for i in range(20)])  # grew by 2/3
    engine.storage.vectors.similarity_floor(GUILD, 0.5)
    assert json.loads(engine.storage.meta.get(f"similarity_floor:{GUILD}") or "{}")["vectors"] == 50


def test_the_floor_is_the_same_for_the_same_messages(
    make_engine: MakeEngine, make_record: MakeRecord
) -> None:
    engine = make_engine()
    engine.ingest([make_record(f"note {i} about {word}") for i, word in
                   enumerate(["tomatoes", "routers", "solder", "beans", "printers"] * 200)])
    floors = set()
    for _ in range(3):  # the sample is spread over the history, not drawn at random
        engine.storage.meta.set(f"similarity_floor:{GUILD}", "{}")
        floors.add(engine.storage.vectors.similarity_floor(GUILD, 0.5))
    assert len(floors) == 1


@pytest.mark.parametrize(("fields", "prunes"), [
    ({}, True), ({"bonuses": False}, True),
    ({"queries": ("what did Sam say about the solder last week", "iron")}, None),
    # one list: ranks 11-85 are within a member bonus of rank 10, and the pool is smaller
    ({"mode": "dense"}, False), ({"mode": "keyword"}, False),
    ({"limit": 3}, None),  # (near-ties in this corpus: whether any is left out varies)
])
def test_only_candidates_that_cannot_reach_the_top_are_left_unread(
    make_engine: MakeEngine, make_record: MakeRecord, fields: dict, prunes: bool | None,
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """Leaving out candidates whose best possible score cannot reach the top changes nothing."""
    corpus = make_engine()
    words = ["solder", "iron", "pizza", "tomatoes", "hakko", "tip", "router", "compost"]
    corpus.ingest([
        make_record(f"{words[i % 8]} and {words[i * 3 % 8]} note {i}", author_id=1 + i % 4,
                    author_display_name=("Sam", "Priya", "Ollie", "Hannah")[i % 4],
                    created_at=BASE_MS + i * 86_400_000 * 2)
        for i in range(160)
    ])
    hydrated: list[int] = []  # how many candidates each search read back
    hydrate = corpus.storage.messages.hydrate

    def counting_hydrate(ids: Sequence[int]) -> dict[int, StoredMessage]:
        hydrated.append(len(ids))
        return hydrate(ids)

    corpus.storage.messages.hydrate = counting_hydrate  # type: ignore[method-assign]
    pruned_any = False
    for query in ("soldering iron", "Sam", "recent pizza", "tomatoes in May", "hakko tip"):
        request = replace(SearchRequest(queries=(query,), guild_id=GUILD, now=NOW), **fields)
        pruned = corpus.search(request)
        pruned_read = hydrated[-1]
        with monkeypatch.context() as patch:
            patch.setattr(ranking, "contenders", lambda pool, limit, bonuses, config: pool)
            full = corpus.search(request)
        assert [(h.id, h.score) for h in pruned.hits] == [(h.id, h.score) for h in full.hits]
        pruned_any |= pruned_read < pruned.trace.candidates["passed_threshold"]
    assert prunes is None or pruned_any == prunes


def test_search_embeds_queries_once(corpus: MemoryEngine) -> None:
    before = corpus.embedder.calls
    corpus.search(SearchRequest(queries=("solder", "iron", "hakko"), guild_id=GUILD))
    assert corpus.embedder.calls == before + 1


class _EmbedderWatch:
    """Wraps an engine's embedder: what was true of the rest of the search while it embedded."""

    def __init__(
        self, engine: MemoryEngine, monkeypatch: pytest.MonkeyPatch, wait: float = 5.0
    ) -> None:
        self.keyword_started = threading.Event()
        self.seen: list[tuple[bool, int]] = []  # (keyword list started, torch threads)
        keyword, embed = engine.storage.keywords.ranked, engine.embedder.embed

        def watched_keyword(*args, **kwargs):
            self.keyword_started.set()
            return keyword(*args, **kwargs)

        def watched_embed(texts: Sequence[str]):
            self.seen.append((self.keyword_started.wait(timeout=wait), torch.get_num_threads()))
            return embed(texts)

        monkeypatch.setattr(engine.storage.keywords, "ranked", watched_keyword)
        monkeypatch.setattr(engine.embedder, "embed", watched_embed)


def test_keyword_lists_run_while_the_query_is_embedded_on_one_torch_thread(
    corpus: MemoryEngine, monkeypatch: pytest.MonkeyPatch
) -> None:
    want = corpus.search(SearchRequest(queries=("solder iron",), guild_id=GUILD))
    torch.set_num_threads(2)  # the test machine may have one core
    try:
        watch = _EmbedderWatch(corpus, monkeypatch)
        got = corpus.search(SearchRequest(queries=("solder iron",), guild_id=GUILD))
        assert watch.seen == [(True, 1)]
        assert torch.get_num_threads() == 2
    finally:
        torch.set_num_threads(THREADS)
    assert [(h.id, h.score) for h in got.hits] == [(h.id, h.score) for h in want.hits]


def test_a_failed_embedding_leaves_no_keyword_work_running(
    corpus: MemoryEngine, monkeypatch: pytest.MonkeyPatch
) -> None:
    started, release, finished = threading.Event(), threading.Event(), threading.Event()
    keyword = corpus.storage.keywords.ranked

    def slow_keyword(*args, **kwargs):
        started.set()
        release.wait(timeout=5)
        try:
            return keyword(*args, **kwargs)
        finally:
            finished.set()

    def failing_embed(texts: Sequence[str]):
        started.wait(timeout=5)
        threading.Timer(0.2, release.set).start()
        raise RuntimeError("the embedder broke")

    monkeypatch.setattr(corpus.storage.keywords, "ranked", slow_keyword)
    monkeypatch.setattr(corpus.embedder, "embed", failing_embed)
    with pytest.raises(RuntimeError, match="embedder broke"):
        corpus.search(SearchRequest(queries=("solder iron",), guild_id=GUILD))
    assert finished.is_set()  # the search waited for the worker before it gave up


def test_a_dense_search_embeds_on_torchs_own_threads(
    corpus: MemoryEngine, monkeypatch: pytest.MonkeyPatch
) -> None:
    torch.set_num_threads(2)  # the test machine may have one core
    try:
        watch = _EmbedderWatch(corpus, monkeypatch, wait=0.0)  # no keyword list comes
        corpus.search(SearchRequest(queries=("solder iron",), guild_id=GUILD, mode="dense"))
        assert watch.seen == [(False, 2)]
    finally:
        torch.set_num_threads(THREADS)


def test_window_vectors_of_keyword_finds_are_read_beside_the_knn(
    corpus: MemoryEngine, monkeypatch: pytest.MonkeyPatch
) -> None:
    want = corpus.search(SearchRequest(queries=("solder iron", "hakko tip"), guild_id=GUILD))
    reads: list[tuple[bool, list[int]]] = []
    window_vectors = corpus.storage.vectors.window_vectors

    def watched(ids, *, beside=False):
        reads.append((beside, list(ids)))
        return window_vectors(ids, beside=beside)

    monkeypatch.setattr(corpus.storage.vectors, "window_vectors", watched)
    got = corpus.search(SearchRequest(queries=("solder iron", "hakko tip"), guild_id=GUILD))
    assert [(h.id, h.score) for h in got.hits] == [(h.id, h.score) for h in want.hits]
    assert reads[0][0] and reads[0][1]  # the keyword lists' finds, on the worker thread
    assert not any(beside for beside, _ in reads[1:])  # then only what the KNN added
    read = [i for _, ids in reads for i in ids]
    assert len(read) == len(set(read))  # no id is read twice
    before = len(reads)
    keyword_only = corpus.search(SearchRequest(queries=("solder iron",), guild_id=GUILD,
                                               mode="keyword"))
    assert keyword_only.hits and len(reads) == before  # keyword mode has no window lists


def test_one_cpu_thread_restores_the_count_after_an_error() -> None:
    torch.set_num_threads(2)
    try:
        with pytest.raises(RuntimeError), one_cpu_thread():
            assert torch.get_num_threads() == 1
            raise RuntimeError("embedding failed")
        assert torch.get_num_threads() == 2
    finally:
        torch.set_num_threads(THREADS)


def test_a_thread_starting_torch_work_during_a_block_gets_the_default_count() -> None:
    torch.set_num_threads(2)
    inside, release = threading.Event(), threading.Event()
    counts: list[int] = []

    def narrowed() -> None:
        with one_cpu_thread():
            inside.set()
            release.wait(timeout=5)

    def fresh() -> None:  # e.g. an import's first batch, on a thread new to torch
        settle_cpu_threads()
        torch.ones(64).sum()
        counts.append(torch.get_num_threads())

    try:
        block = threading.Thread(target=narrowed)
        block.start()
        inside.wait(timeout=5)
        worker = threading.Thread(target=fresh)
        worker.start()
        threading.Timer(0.2, release.set).start()
        block.join()
        worker.join()
    finally:
        torch.set_num_threads(THREADS)
    assert counts == [2]  # not the 1 of the block it began beside


def test_one_cpu_thread_leaves_torchs_own_thread_pool_alone(
    monkeypatch: pytest.MonkeyPatch
) -> None:
    # without OpenMP, torch's pool cannot be resized once used (it would only warn)
    monkeypatch.setattr(torch.backends.openmp, "is_available", lambda: False)
    torch.set_num_threads(2)
    try:
        with one_cpu_thread():
            assert torch.get_num_threads() == 2
    finally:
        torch.set_num_threads(THREADS)


@pytest.mark.parametrize("threshold", [0.0, 0.3, 0.99])
def test_fixed_threshold_mode(corpus: MemoryEngine, threshold: float) -> None:
    result = corpus.search("soldering iron", guild_id=GUILD, threshold=threshold,
                           mode="dense")
    assert result.trace.threshold == threshold
    assert result.trace.threshold_mode == "fixed"
    assert result.trace.threshold_iterations == 1
    assert all(h.similarity >= threshold - 1e-6 for h in result.hits)


def test_no_threshold_mode(corpus: MemoryEngine) -> None:
    result = corpus.search("soldering iron", guild_id=GUILD, adaptive=False, mode="dense")
    assert result.trace.threshold is None
    assert result.trace.threshold_mode == "none"
    assert len(result.hits) == 8  # the whole guild, nothing thrown away


def test_keyword_only_matches_survive_the_threshold(
    make_engine: MakeEngine, make_record: MakeRecord
) -> None:
    engine = make_engine(oversample=1)  # k = limit: the dense pool holds only `limit` rows
    filler = [make_record(f"raspberry cluster node {i} rebuilt today") for i in range(40)]
    target = make_record("order number XK4471 was shipped with other stuff like paint")
    engine.ingest([*filler, target])
    result = engine.search("raspberry cluster node XK4471", guild_id=GUILD, limit=5)
    hit = next(h for h in result.hits if h.id == target.id)
    assert hit.similarity is None and hit.keyword_score is not None


def test_exact_keyword_match_is_never_thrown_away_in_a_small_corpus(
    make_engine: MakeEngine, make_record: MakeRecord
) -> None:
    engine = make_engine()
    filler = [make_record(f"printer filament garden tomato soil compost {i}") for i in range(30)]
    target = make_record("long chatter about printers and filament plus the order number "
                         "XK4471 somewhere in the middle of it all")
    engine.ingest([*filler, target])
    result = engine.search("XK4471", guild_id=GUILD)
    assert target.id in [h.id for h in result.hits]


# -- bonuses ------------------------------------------------------------------------


@pytest.mark.parametrize(
    "age, expected",
    [
        (0.0, 1.0),
        (-5.0, 1.0),  # clock skew: never above brand new
        (30.0, 1 / math.e),
        (10_000.0, 0.0),
    ],
)
def test_recency_values(age: float, expected: float) -> None:
    assert recency(age, CONFIG) == pytest.approx(expected, abs=1e-9)


def test_recency_only_breaks_ties_unless_the_query_asks_for_recent_things(
    engine: MemoryEngine, make_record: MakeRecord
) -> None:
    old = make_record("the repair cafe is on saturday", age_days=200)
    new = make_record("the repair cafe is on saturday", age_days=0.0)
    engine.ingest([old, new])
    result = engine.search("repair cafe saturday", guild_id=GUILD, mode="keyword", now=NOW)
    assert [h.id for h in result.hits].index(new.id) < [h.id for h in result.hits].index(old.id)
    unit = 1 / (CONFIG.rrf_k + 1)
    assert all(0 <= h.bonus < 1e-5 * unit for h in result.hits)  # a tie-breaker, nothing more
    latest = engine.search("latest on the repair cafe saturday", guild_id=GUILD, mode="keyword",
                           now=NOW)
    by_id = {h.id: h for h in latest.hits}
    assert by_id[new.id].bonus == pytest.approx(CONFIG.recency_weight * unit, rel=1e-3)
    assert by_id[old.id].bonus < 0.01 * unit
    plain = engine.search("repair cafe saturday", guild_id=GUILD, mode="keyword", bonuses=False)
    assert {h.bonus for h in plain.hits} == {0.0}


@pytest.mark.parametrize("named", ["Alice", "Bobby", "<@800000000000000008>", "<@!800000000000000008>",
                                   "Bobbby"])
def test_member_named_in_query_gets_a_bounded_bonus(
    engine: MemoryEngine, make_record: MakeRecord, named: str
) -> None:
    alice = make_record("the meeting moved to friday", author_id=700000000000000007,
                        author_name="alice.w", author_display_name="Alice",
                        created_at=BASE_MS - 86_400_000)
    bobby = make_record("the meeting moved to friday", author_id=800000000000000008,
                        author_name="bobby_t", author_display_name="Bobby",
                        created_at=BASE_MS - 86_400_000)
    engine.ingest([alice, bobby])
    result = engine.search(f"what did {named} say about the meeting", guild_id=GUILD,
                           mode="keyword", now=NOW)
    expected = "Alice" if named == "Alice" else "Bobby"
    first, second = result.hits[:2]
    assert first.author_name == expected
    assert first.bonus - second.bonus == pytest.approx(CONFIG.member_weight / (CONFIG.rrf_k + 1))


def test_member_names_are_indexed_again_only_when_they_change(
    engine: MemoryEngine, make_record: MakeRecord, monkeypatch: pytest.MonkeyPatch
) -> None:
    built: list[list] = []
    build = MemberNames.build
    monkeypatch.setattr(MemberNames, "build", staticmethod(lambda rows: (
        built.append(rows), build(rows))[1]))

    def with_bonus(query: str) -> set[int]:
        result = engine.search(query, guild_id=GUILD, mode="keyword", now=NOW)
        return {h.author_id for h in result.hits if h.bonus > 1e-4}

    alice, bobby = 700000000000000007, 800000000000000008
    engine.ingest([make_record("the meeting moved to friday", author_id=alice,
                               author_name="alice.w", author_display_name="Alice")])
    assert with_bonus("what did Alice say about the meeting") == {alice}
    engine.ingest([make_record("and the meeting room too", author_id=alice,  # same members
                               author_name="alice.w", author_display_name="Alice")])
    assert with_bonus("what did Alice say about the meeting") == {alice}
    assert len(built) == 1
    engine.ingest([make_record("meeting notes are up", author_id=bobby,
                               author_name="bobby_t", author_display_name="Bobby")])
    assert with_bonus("what did Bobby say about the meeting") == {bobby}  # a new member
    engine.ingest([make_record("meeting again", author_id=alice,
                               author_name="alice.w", author_display_name="Ally")])
    assert with_bonus("what did Ally say about the meeting") == {alice}  # a new name
    assert len(built) == 3


def test_member_names_are_kept_for_at_most_64_guilds(
    engine: MemoryEngine, make_record: MakeRecord
) -> None:
    engine.ingest([make_record("hello there", guild_id=GUILD + g, author_id=10 + g,
                               author_name=f"member{g}", author_display_name="")
                   for g in range(70)])
    members = engine.searcher.members
    for g in range(70):
        assert members.named([f"what did member{g} say"], GUILD + g) == {10 + g}
    assert len(members.guilds()) == 64
    assert GUILD not in members.guilds()  # the first guild went first
    assert members.named(["what did member0 say"], GUILD) == {10}


def test_member_bonus_matches_username_case_insensitively(
    engine: MemoryEngine, make_record: MakeRecord
) -> None:
    marta = make_record("beans go in the north bed", author_id=7, author_name="marta.gardens",
                        author_display_name="Marta", created_at=BASE_MS)
    other = make_record("beans go in the north bed", author_id=8, created_at=BASE_MS)
    engine.ingest([other, marta])
    result = engine.search("where do beans go says MARTA.GARDENS", guild_id=GUILD,
                           mode="keyword", now=NOW)
    assert result.hits[0].id == marta.id


def test_a_bonus_never_lifts_a_content_free_line_over_a_relevant_one(
    make_engine: MakeEngine, make_record: MakeRecord
) -> None:
    engine = make_engine(context="none")
    priya = {"author_id": 9, "author_name": "priya", "author_display_name": "Priya"}
    filler = [make_record(text, **priya) for text in
              ("looks great", "noted. very noted.", "lol")]
    answer = make_record("I print everything in PETG filament, galaxy black", author_id=10,
                         author_display_name="Sam")
    engine.ingest([*filler, answer])
    for mode in ("hybrid", "keyword"):
        result = engine.search("What filament does Priya use?", guild_id=GUILD, mode=mode,
                               adaptive=False, now=NOW)
        ranked = [h.id for h in result.hits]
        assert ranked[0] == answer.id, mode
        for hit in result.hits:
            if hit.content in ("looks great", "noted. very noted.", "lol"):
                assert hit.bonus < 1e-5, (mode, hit.content)


# -- multi-query --------------------------------------------------------------------


def test_too_many_queries_is_an_input_error(corpus: MemoryEngine) -> None:
    corpus.search(SearchRequest(queries=("solder",) * MAX_QUERIES, guild_id=GUILD))
    with pytest.raises(SearchInputError, match=str(MAX_QUERIES)):
        corpus.search(SearchRequest(queries=("solder",) * (MAX_QUERIES + 1), guild_id=GUILD))


def test_blank_queries_among_others_are_ignored(corpus: MemoryEngine) -> None:
    result = corpus.search(SearchRequest(queries=("", "  ", "soldering"), guild_id=GUILD))
    assert result.hits


def test_message_found_by_more_queries_ranks_higher(
    engine: MemoryEngine, make_record: MakeRecord
) -> None:
    single = make_record("apple pie recipe")
    double = make_record("zebra yak sighting")
    engine.ingest([single, double])
    result = engine.search(
        SearchRequest(queries=("apple", "zebra", "yak"), guild_id=GUILD, mode="keyword",
                      bonuses=False)
    )
    assert [h.id for h in result.hits] == [double.id, single.id]
    assert [h.queries_matched for h in result.hits] == [2, 1]
    # each was rank 1 in every query that found it: only the agreement differs
    assert result.hits[0].keyword_rank == result.hits[1].keyword_rank == 1


def test_multi_query_dedupes_across_queries(corpus: MemoryEngine) -> None:
    result = corpus.search(
        SearchRequest(queries=("soldering iron", "solder iron hakko", "borrow iron"),
                      guild_id=GUILD, adaptive=False)
    )
    ids = [h.id for h in result.hits]
    assert len(ids) == len(set(ids))
    assert max(h.queries_matched for h in result.hits) == 3


# -- filters --------------------------------------------------------------------------


@pytest.fixture
def filtered(engine: MemoryEngine, make_record: MakeRecord) -> dict[str, MessageRecord]:
    """Messages that all mention "widget", spread over places, people, times, files."""
    records = {
        "channel-old": make_record("widget report from the channel", age_days=60),
        "channel-new": make_record("widget update in the channel", age_days=1, author_id=2),
        "thread": make_record("widget thread discussion", age_days=5, channel_id=THREAD,
                              parent_id=CHANNEL, channel_type="GuildPublicThread"),
        "other": make_record("widget in another channel", age_days=10,
                             channel_id=OTHER_CHANNEL, author_id=2),
        "file": make_record("widget photo attached", age_days=20, attachments=("w.png",),
                            channel_id=OTHER_CHANNEL),
        "other-guild": make_record("widget elsewhere", guild_id=GUILD + 1,
                                   channel_id=CHANNEL + 100),
    }
    engine.ingest(records.values())
    return records


@pytest.mark.parametrize("mode", ["hybrid", "dense", "keyword"])
@pytest.mark.parametrize(
    "options, expected",
    [
        pytest.param({}, {"channel-old", "channel-new", "thread", "other", "file"}, id="guild"),
        pytest.param({"channel_ids": (CHANNEL,)}, {"channel-old", "channel-new", "thread"},
                     id="parent-includes-thread"),
        pytest.param({"channel_ids": (THREAD,)}, {"thread"}, id="thread-only"),
        pytest.param({"channel_ids": (THREAD, OTHER_CHANNEL)}, {"thread", "other", "file"},
                     id="several-channels"),
        pytest.param({"author_ids": (2,)}, {"channel-new", "other"}, id="author"),
        pytest.param({"author_ids": (1, 2), "channel_ids": (OTHER_CHANNEL,)},
                     {"other", "file"}, id="authors+channel"),
        pytest.param({"after": NOW - timedelta(days=7)}, {"channel-new", "thread"}, id="after"),
        pytest.param({"before": NOW - timedelta(days=15)}, {"channel-old", "file"}, id="before"),
        pytest.param({"after": NOW - timedelta(days=30), "before": NOW - timedelta(days=3)},
                     {"thread", "other", "file"}, id="between"),
        pytest.param({"has_attachment": True}, {"file"}, id="attachment"),
        pytest.param({"has_attachment": False},
                     {"channel-old", "channel-new", "thread", "other"}, id="no-attachment"),
        pytest.param({"author_ids": (12345,)}, set(), id="nobody"),
    ],
)
def test_filters(
    engine: MemoryEngine, filtered: dict[str, MessageRecord], mode: str, options: dict,
    expected: set[str],
) -> None:
    result = engine.search("widget", guild_id=GUILD, mode=mode, adaptive=False, now=NOW,
                           **options)
    names = {name for name, r in filtered.items() if r.id in {h.id for h in result.hits}}
    assert names == expected


def test_guild_filter_is_always_honoured(
    engine: MemoryEngine, filtered: dict[str, MessageRecord]
) -> None:
    result = engine.search("widget", guild_id=GUILD + 1, adaptive=False)
    assert [h.id for h in result.hits] == [filtered["other-guild"].id]


# -- empty results --------------------------------------------------------------------


def test_empty_reason_nothing_stored(engine: MemoryEngine) -> None:
    result = engine.search("anything at all", guild_id=GUILD)
    assert result.hits == []
    assert "nothing is stored" in result.empty_reason


def test_empty_reason_names_this_server_when_only_others_have_messages(
    engine: MemoryEngine, make_record: MakeRecord
) -> None:
    engine.ingest([make_record("hello from elsewhere", guild_id=GUILD + 1)])
    assert engine.storage.messages.has_any() and engine.storage.messages.has_any(GUILD + 1)
    assert not engine.storage.messages.has_any(GUILD)
    result = engine.search("hello", guild_id=GUILD)
    assert result.hits == [] and "nothing is stored for this server" in result.empty_reason


def test_empty_reason_not_embedded_yet(engine: MemoryEngine, make_record: MakeRecord) -> None:
    engine.storage.messages.upsert([make_record("stored but not embedded")])
    result = engine.search("stored", guild_id=GUILD, mode="dense")
    assert result.hits == []
    assert "embed" in result.empty_reason
    # keyword search works without vectors
    assert len(engine.search("stored", guild_id=GUILD, mode="keyword").hits) == 1


def test_empty_reason_nothing_passed(
    engine: MemoryEngine, filtered: dict[str, MessageRecord]
) -> None:
    result = engine.search("widget", guild_id=GUILD, author_ids=(12345,))
    assert result.hits == []
    reason = result.empty_reason
    assert "nothing is stored" not in reason and "embed" not in reason
    assert "matched" in reason


def test_other_guild_reports_nothing_stored(
    engine: MemoryEngine, filtered: dict[str, MessageRecord]
) -> None:
    result = engine.search("widget", guild_id=GUILD + 999)
    assert "nothing is stored" in result.empty_reason


# -- hits and traces --------------------------------------------------------------------


def test_hit_fields(engine: MemoryEngine, make_record: MakeRecord) -> None:
    question = make_record("who can lend me a multimeter", age_days=2)
    answer = make_record("my multimeter is in locker 4", age_days=1, author_id=5,
                         author_name="hannah_k", author_display_name="Hannah",
                         reply_to_id=question.id, attachments=("locker.jpg",))
    engine.ingest([question, answer])
    result = engine.search("multimeter locker", guild_id=GUILD, now=NOW)
    hit = next(h for h in result.hits if h.id == answer.id)
    assert hit.jump_url == f"https://discord.com/channels/{GUILD}/{CHANNEL}/{answer.id}"
    assert (hit.guild_id, hit.channel_id, hit.author_id) == (GUILD, CHANNEL, 5)
    assert hit.author_name == "Hannah"
    assert hit.channel_name == "general"
    assert hit.content == answer.content
    assert hit.created_at == answer.created_at
    assert hit.created == ms_to_datetime(answer.created_at)
    assert hit.created.tzinfo is not None
    assert hit.reply_to_id == question.id
    assert hit.attachments == ("locker.jpg",)
    assert hit.rerank_score is None
    assert hit.rerank_text == "Hannah: my multimeter is in locker 4"


def test_trace_has_candidates_and_timings_per_stage(corpus: MemoryEngine) -> None:
    result = corpus.search("soldering iron", guild_id=GUILD, limit=3)
    trace = result.trace
    assert {"embed", "retrieve", "fuse", "hydrate", "bonus", "rerank", "total"} <= set(
        trace.timings_ms
    )
    assert all(v >= 0 for v in trace.timings_ms.values())
    assert {"dense", "keyword", "fused", "passed_threshold", "returned"} <= set(trace.candidates)
    assert trace.candidates["returned"] == len(result.hits) <= 3
    assert trace.candidates["fused"] <= trace.candidates["dense"] + trace.candidates["keyword"]
    assert trace.reranked is False


def test_limit_is_respected(corpus: MemoryEngine) -> None:
    for limit in (1, 2, 5):
        assert len(corpus.search("iron", guild_id=GUILD, limit=limit, adaptive=False)) == limit


@pytest.mark.usefixtures("single_torch_thread")
def test_lone_surrogate_query_with_the_real_embedder(
    minilm, tmp_path: Path, make_record: MakeRecord
) -> None:
    engine = MemoryEngine(tmp_path / "m.sqlite3", make_profile(), minilm)
    try:
        engine.ingest([make_record("soldering iron in the cabinet")])
        result = engine.search("soldering \udcff iron", guild_id=GUILD)
        assert result.hits
    finally:
        engine.close()


@pytest.mark.parametrize(("step", "expected"), [(0, 4), (100, 4), (50, 8), (25, 16)])
def test_the_vector_list_looks_wider_in_a_larger_guild(
    make_engine: MakeEngine, make_record: MakeRecord, monkeypatch: pytest.MonkeyPatch,
    step: int, expected: int,
) -> None:
    """A search hands the index ``rescore`` grown with the guild's vectors (here 100 of
    them against ``rescore_step``), and a search of every guild counts every vector."""
    engine = make_engine(rescore=4, rescore_step=step)
    engine.ingest([make_record(f"backup report number {i}") for i in range(100)])
    asked: list[int] = []
    knn = engine.storage.vectors.knn

    def spy(*args, rescore: int, **kwargs):  # type: ignore[no-untyped-def]
        asked.append(rescore)
        return knn(*args, rescore=rescore, **kwargs)

    monkeypatch.setattr(engine.storage.vectors, "knn", spy)
    for guild in (GUILD, None):
        assert engine.search("backup report", guild_id=guild, mode="dense", adaptive=False,
                             threshold=-1.0).hits
    assert asked == [expected, expected]
    # several queries in one search: one vector list each, the guild counted once
    counted: list[int] = []
    rescore_for = ranking.rescore_for
    monkeypatch.setattr(ranking, "rescore_for",
                        lambda vectors, config: counted.append(vectors) or rescore_for(vectors, config))
    engine.search(SearchRequest(queries=("backup report", "report number"), guild_id=GUILD,
                                mode="dense", adaptive=False, threshold=-1.0))
    assert asked[2:] == [expected, expected]
    assert counted == ([100] if step else [])


@pytest.mark.parametrize("forget", ["guild", "member"])
def test_forgotten_names_leave_the_searchers_memory(
    engine: MemoryEngine, make_record: MakeRecord, forget: str
) -> None:
    engine.ingest([make_record("the harbour opens at nine", author_id=9,
                               author_name="zoltanprivate", author_display_name="Zoltan")])
    members = engine.searcher.members
    assert members.named(["what did zoltanprivate say"], GUILD) == {9}
    assert members.named(["what did zoltanprivate say"], None) == {9}  # every guild's names
    if forget == "guild":
        engine.forget_guild(GUILD)  # the bot left the server
    else:
        engine.forget_member(GUILD, 9)
    # nobody searches there again: nothing of the names is kept all the same
    assert GUILD not in members.guilds() and None not in members.guilds()
