"""The second retrieval pass: messages beside the first pass's best hits.

Real temporary SQLite with sqlite-vec (the privacy tests also on the real PostgreSQL)
and the hashing embedder (texts that share no
word are near-orthogonal), so the answer beside a hit is found by neither its own
words nor its own vector: only by where it sits.  The window lists are off in these
engines so that nothing but the second pass can bring it in.
"""

from __future__ import annotations

from collections.abc import Callable
from datetime import timedelta

import pytest

from memory.config import SearchConfig
from memory.engine import MemoryEngine
from memory.records import MessageRecord
from memory.search import ranking
from memory.search.ranking import Candidate
from tests.support.builders import BASE_MS, CHANNEL, GUILD, NOW

MakeRecord = Callable[..., MessageRecord]
MakeEngine = Callable[..., MemoryEngine]
THREAD = CHANNEL + 1
PRIVATE = CHANNEL + 2
MINUTE = 60_000
# no window lists; the neighbour list weighs as much as two first-pass lists together, so
# that a message found only beside a hit can outrank the fillers at a small limit
NO_WINDOWS = {"window_weight": 0.0, "window_dense_weight": 0.0, "neighbour_weight": 3.0}
QUERY = "who broke the blue ceramic vase"


def _scene(make_record: MakeRecord, channel_id: int = CHANNEL, start: int = 0,
           **fields: object) -> dict[str, MessageRecord]:
    """A question asked, the answer one line later (sharing no word with the query)."""
    at = BASE_MS - 86_400_000 + start * MINUTE
    return {
        "hit": make_record("the blue ceramic vase broke this morning", channel_id=channel_id,
                           created_at=at, **fields),
        "answer": make_record("Joey knocked it over chasing Chandler", channel_id=channel_id,
                              created_at=at + MINUTE, author_id=2, **fields),
    }


def _filler(make_record: MakeRecord) -> list[MessageRecord]:
    """Lines days before the scene that share a word with the query: without the second
    pass they outrank the answer, which shares none."""
    return [make_record(f"a vase for sale, lot number {i}", age_days=10 + i) for i in range(12)]


def _ids(engine: MemoryEngine, **options: object) -> list[int]:
    return [h.id for h in engine.search(QUERY, guild_id=GUILD, now=NOW, **options).hits]


@pytest.mark.parametrize("seeds, found", [(0, False), (1, True)])
def test_the_message_beside_a_hit_joins_only_with_the_second_pass(
    make_engine: MakeEngine, make_record: MakeRecord, seeds: int, found: bool
) -> None:
    engine = make_engine(neighbour_seeds=seeds, **NO_WINDOWS)
    scene = _scene(make_record)
    engine.ingest([*scene.values(), *_filler(make_record)])
    ids = _ids(engine, limit=3)
    assert scene["hit"].id in ids
    assert (scene["answer"].id in ids) is found


def test_a_neighbour_outside_the_span_stays_out(
    make_engine: MakeEngine, make_record: MakeRecord
) -> None:
    engine = make_engine(neighbour_seeds=1, neighbour_span=1, **NO_WINDOWS)
    scene = _scene(make_record)
    between = make_record("ok", created_at=scene["hit"].created_at + MINUTE // 2)
    engine.ingest([*scene.values(), between, *_filler(make_record)])
    ids = _ids(engine, limit=3)
    assert between.id in ids and scene["answer"].id not in ids


def test_the_trace_counts_the_neighbours(make_engine: MakeEngine,
                                         make_record: MakeRecord) -> None:
    engine = make_engine(neighbour_seeds=2, **NO_WINDOWS)
    engine.ingest([*_scene(make_record).values(), *_filler(make_record)])
    result = engine.search(QUERY, guild_id=GUILD, now=NOW)
    assert result.trace.candidates["neighbour"] >= 1


@pytest.mark.parametrize("mode", ["dense", "keyword"])
def test_only_hybrid_searches_look_beside_their_hits(
    make_engine: MakeEngine, make_record: MakeRecord, mode: str
) -> None:
    engine = make_engine(neighbour_seeds=3, **NO_WINDOWS)
    engine.ingest([*_scene(make_record).values(), *_filler(make_record)])
    result = engine.search(QUERY, guild_id=GUILD, now=NOW, mode=mode)
    assert result.hits and "neighbour" not in result.trace.candidates


# -- privacy: the second pass honours every filter of the first -------------------------------


@pytest.fixture
def interleaved(make_engine: MakeEngine, make_record: MakeRecord, db_location: str
                ) -> tuple[MemoryEngine, dict[str, MessageRecord]]:
    """One scene in the readable channel, with a thread and a private channel whose
    messages are written at the same minutes (beside the hit in time, not in place);
    on each storage engine (SQLite and PostgreSQL)."""
    engine = make_engine(db_location, neighbour_seeds=5, neighbour_span=3,
                         **{**NO_WINDOWS, "neighbour_weight": 0.5})
    scene = _scene(make_record)
    at = scene["hit"].created_at
    records = {
        **scene,
        "thread": make_record("secret plans in the thread", channel_id=THREAD,
                              parent_id=CHANNEL, channel_type="GuildPrivateThread",
                              created_at=at + MINUTE // 3),
        "private": make_record("staff only salary numbers", channel_id=PRIVATE,
                               channel_name="staff", created_at=at + MINUTE // 2),
        "private-hit": make_record("the blue ceramic vase insurance claim", channel_id=PRIVATE,
                                   channel_name="staff", created_at=at + 2 * MINUTE),
    }
    engine.ingest([*records.values(), *_filler(make_record)])
    return engine, records


def test_the_second_pass_never_brings_in_a_channel_outside_the_allow_list(
    interleaved: tuple[MemoryEngine, dict[str, MessageRecord]],
) -> None:
    engine, records = interleaved
    allowed = frozenset({CHANNEL})
    result = engine.search(QUERY, guild_id=GUILD, now=NOW, limit=30, allowed_channel_ids=allowed)
    assert result.trace.candidates["neighbour"] >= 1
    assert {h.channel_id for h in result.hits} == {CHANNEL}
    ids = {h.id for h in result.hits}
    assert records["answer"].id in ids
    assert not ids & {records[k].id for k in ("thread", "private", "private-hit")}


def test_with_the_private_channel_allowed_its_neighbours_come_too(
    interleaved: tuple[MemoryEngine, dict[str, MessageRecord]],
) -> None:
    """The same search, allowed everywhere: the exclusion above is the allow-list's."""
    engine, records = interleaved
    ids = set(_ids(engine, limit=30, allowed_channel_ids=frozenset({CHANNEL, THREAD, PRIVATE})))
    assert {records["private"].id, records["private-hit"].id} <= ids


@pytest.mark.parametrize(
    "options",
    [
        pytest.param({"author_ids": (1,)}, id="author"),
        pytest.param({"before": NOW - timedelta(hours=23, minutes=59, seconds=30)},
                     id="before"),
        pytest.param({"has_attachment": False}, id="attachment"),
        pytest.param({"channel_ids": (CHANNEL,)}, id="channel"),
    ],
)
def test_the_second_pass_honours_the_search_filters(
    make_engine: MakeEngine, make_record: MakeRecord, db_location: str, options: dict
) -> None:
    engine = make_engine(db_location, neighbour_seeds=3, **NO_WINDOWS)
    scene = _scene(make_record)
    answer = scene["answer"]
    if "has_attachment" in options:
        answer = scene["answer"] = make_record(answer.content, created_at=answer.created_at,
                                               author_id=1, attachments=("vase.png",))
    if "channel_ids" in options:
        answer = scene["answer"] = make_record(answer.content, created_at=answer.created_at,
                                               channel_id=PRIVATE, author_id=1)
    engine.ingest([*scene.values(), *_filler(make_record)])
    ids = _ids(engine, **options)
    assert scene["hit"].id in ids and answer.id not in ids


# -- the pure parts ------------------------------------------------------------------------------


def test_neighbour_list_ranks_each_message_by_its_best_seed() -> None:
    beside = {10: [9, 10, 11], 20: [11, 19, 20, 21], 30: []}
    assert ranking.neighbour_list([10, 20, 30], beside) == [
        (9, -1.0), (11, -1.0), (19, -2.0), (21, -2.0),
    ]


@pytest.mark.parametrize(
    "pool, count, expected",
    [
        pytest.param([], 3, [], id="empty"),
        pytest.param([Candidate(5, fused=0.1), Candidate(3, fused=0.1)], 1, [3], id="tie-by-id"),
        pytest.param([Candidate(1, fused=0.1), Candidate(2, fused=0.3)], 5, [2, 1], id="fewer"),
    ],
)
def test_neighbour_seeds_are_the_best_fused(pool: list[Candidate], count: int,
                                            expected: list[int]) -> None:
    assert ranking.neighbour_seeds(pool, count) == expected


def test_add_neighbours_adds_the_weighted_share_once() -> None:
    config = SearchConfig(neighbour_weight=0.5, rrf_k=20)
    pool = [Candidate(1, fused=0.2), Candidate(2, fused=0.1)]
    out = {c.id: c for c in ranking.add_neighbours(pool, [(2, -1.0), (3, -1.0), (4, -2.0)],
                                                   config)}
    assert out[1].fused == pytest.approx(0.2)
    assert out[2].fused == pytest.approx(0.1 + 0.5 / 21)
    assert out[3].fused == pytest.approx(0.5 / 21) and out[3].similarity is None
    assert out[4].fused == pytest.approx(0.5 / 23)  # ranks count positions, ties shared
