"""The keyword index: filters apply to every match when the best are elsewhere, and
reads beside the KNN see every committed write."""

from __future__ import annotations

from collections.abc import Callable

import numpy as np

from memory.engine import MemoryEngine
from memory.filters import Filters
from memory.records import MessageRecord
from tests.support.builders import GUILD

MakeRecord = Callable[..., MessageRecord]


def test_keyword_search_filters_every_match_when_the_best_are_elsewhere(
    engine: MemoryEngine, make_record: MakeRecord
) -> None:
    """The best 4 × k matches are all in another guild: the few here must still come back."""
    loud = [make_record(f"pizza pizza {i}", guild_id=GUILD + 1) for i in range(60)]
    quiet = [make_record(f"we could maybe order some pizza later tonight {i}") for i in range(3)]
    engine.storage.messages.upsert(loud + quiet)
    hits = engine.storage.keywords.ranked(["pizza"], 5, Filters(guild_id=GUILD))
    assert {mid for mid, _ in hits} == {r.id for r in quiet}
    everywhere = engine.storage.keywords.ranked(["pizza"], 5, Filters())
    assert {mid for mid, _ in everywhere} <= {r.id for r in loud}
    scores = [score for _, score in everywhere]
    assert scores == sorted(scores, reverse=True)


def test_keyword_reads_on_the_second_connection_see_every_committed_write(
    engine: MemoryEngine, make_record: MakeRecord
) -> None:
    """Keyword lists (and window vectors) are read on a connection of their own: it must
    never lag behind."""
    first = make_record("the pizza oven is hot")
    engine.ingest([first])
    assert [mid for mid, _ in engine.storage.keywords.ranked(["pizza"], 5, Filters())] == [first.id]
    second = make_record("more pizza tonight")
    engine.ingest([second])
    found = {mid for mid, _ in engine.storage.keywords.ranked(["pizza"], 5, Filters())}
    assert found == {first.id, second.id}
    engine.forget_messages([first.id])
    for field in ("message", "window"):
        found = {mid for mid, _ in
                 engine.storage.keywords.ranked(["oven"], 5, Filters(), field=field)}
        assert found == set(), field  # a deleted message is gone from the reader at once
    hits = engine.search("pizza oven", guild_id=GUILD, adaptive=False)
    assert [h.id for h in hits.hits] == [second.id]
    engine.embed_pending()  # the deleted message's neighbour is embedded again without it
    beside = engine.storage.vectors.window_vectors([first.id, second.id], beside=True)
    assert list(beside) == [second.id]  # so are window vectors
    np.testing.assert_array_equal(beside[second.id],
                                  engine.storage.vectors.window_vectors([second.id])[second.id])
    # (that the SQLite engine's second connection cannot write: test_sqlite_database.py)
