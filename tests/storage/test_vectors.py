"""The vector index: filters apply inside the KNN (never after its top k), a KNN that
fetches the whole scope is exact, and so is every KNN in a small guild."""

from __future__ import annotations

from collections.abc import Callable

import numpy as np
import pytest

from memory.engine import MemoryEngine
from memory.errors import SearchInputError
from memory.filters import Filters
from memory.records import MessageRecord
from memory.storage import Storage
from tests.support.builders import CHANNEL, GUILD
from tests.support.inspection import Inspector

MakeRecord = Callable[..., MessageRecord]
Inspect = Callable[[Storage], Inspector]


@pytest.mark.parametrize("rescore", [1, 8], ids=["rescore-1", "rescore-8"])
def test_author_filter_applies_inside_the_knn(crowded, rescore: int) -> None:
    engine, far = crowded
    vector = engine.embedder.embed(["raspberry cluster kubernetes"])[0]
    unfiltered = engine.storage.vectors.knn(vector, 5, Filters(guild_id=GUILD), rescore=rescore)
    assert not set(far) & {mid for mid, _ in unfiltered}
    hits = engine.storage.vectors.knn(vector, 5, Filters(guild_id=GUILD, author_ids=(99,)),
                                      rescore=rescore)
    assert len(hits) == 5 and {mid for mid, _ in hits} <= set(far)
    # the same through a search: dense mode, no threshold, limit 5
    result = engine.search("raspberry cluster kubernetes", guild_id=GUILD, author_ids=(99,),
                           limit=5, mode="dense", adaptive=False)
    assert len(result.hits) == 5
    assert all(h.author_id == 99 for h in result.hits)


@pytest.mark.parametrize(
    "filters, expected",
    [
        pytest.param(Filters(channel_ids=(CHANNEL + 2,), author_ids=(99,)), 5, id="channel+author"),
        pytest.param(Filters(author_ids=(99,), has_attachment=True), 5, id="attachment"),
        pytest.param(Filters(author_ids=(99,), has_attachment=False), 5, id="no-attachment"),
        pytest.param(Filters(guild_id=GUILD + 1), 0, id="other-guild"),
    ],
)
@pytest.mark.parametrize("rescore", [1, 8], ids=["rescore-1", "rescore-8"])
def test_metadata_filters_inside_the_knn(
    crowded, filters: Filters, expected: int, rescore: int
) -> None:
    engine, far = crowded
    vector = engine.embedder.embed(["raspberry cluster kubernetes"])[0]
    hits = engine.storage.vectors.knn(vector, 5, filters, rescore=rescore)
    assert len(hits) == expected
    assert {mid for mid, _ in hits} <= set(far)


def test_time_filters_inside_the_knn(engine: MemoryEngine, make_record: MakeRecord) -> None:
    old = [make_record(f"backup disk report {i}", age_days=100 + i) for i in range(20)]
    new = [make_record(f"pizza night {i}", age_days=1 + i / 10) for i in range(5)]
    engine.ingest(old + new)
    vector = engine.embedder.embed(["pizza night"])[0]
    cutoff = old[0].created_at + 1
    before = engine.storage.vectors.knn(vector, 5, Filters(before_ms=cutoff))
    assert len(before) == 5 and {m for m, _ in before} <= {r.id for r in old}
    after = engine.storage.vectors.knn(vector, 50, Filters(after_ms=cutoff))
    assert {m for m, _ in after} == {r.id for r in new}


def exact_cosine(stored: dict[int, np.ndarray], vector: np.ndarray) -> dict[int, float]:
    return {
        mid: float(floats @ vector / np.linalg.norm(floats) / np.linalg.norm(vector))
        for mid, floats in stored.items()
    }


def test_knn_that_fetches_the_whole_scope_is_exact(crowded, inspector: Inspect) -> None:
    engine, _ = crowded
    vector = engine.embedder.embed(["tomato compost"])[0]
    exact = exact_cosine(inspector(engine.storage).every_vector(), vector)
    # all 200 rows
    hits = engine.storage.vectors.knn(vector, 200, Filters(guild_id=GUILD), rescore=1)
    assert dict(hits).keys() == exact.keys()
    for mid, similarity in hits:
        assert similarity == pytest.approx(exact[mid], abs=1e-5)
    sims = [s for _, s in hits]
    assert sims == sorted(sims, reverse=True)
    top = sorted(exact.values(), reverse=True)[:10]
    np.testing.assert_allclose(
        [s for _, s in engine.storage.vectors.knn(vector, 10, Filters(), rescore=20)], top,
        atol=1e-5
    )


@pytest.mark.parametrize("rescore", [1, 4])
def test_a_small_guilds_knn_is_exact_whatever_rescore_says(
    crowded, inspector: Inspect, rescore: int
) -> None:
    """A guild of at most EXACT_KNN_MAX vectors gets the true nearest neighbours: the same
    list on every engine (their approximations would rank near-ties differently)."""
    engine, _ = crowded
    for text in ("kubernetes node", "tomato watering", "cluster compost rebuilt"):
        vector = engine.embedder.embed([text])[0]
        exact = exact_cosine(inspector(engine.storage).every_vector(), vector)
        best = sorted(exact, key=lambda mid: (-exact[mid], mid))[:20]
        hits = engine.storage.vectors.knn(vector, 20, Filters(guild_id=GUILD), rescore=rescore)
        np.testing.assert_allclose([s for _, s in hits], [exact[m] for m in best], atol=1e-5)
        assert {m for m, _ in hits} == set(best) or len({round(exact[m], 5) for m in best}) < 20


def test_empty_id_filter_is_an_input_error(engine: MemoryEngine, make_record: MakeRecord) -> None:
    engine.ingest([make_record("hello")])
    with pytest.raises(SearchInputError):
        engine.storage.vectors.knn(engine.embedder.embed(["hello"])[0], 5, Filters(author_ids=()))


def test_knn_without_vectors_is_empty(storage: Storage) -> None:
    assert storage.vectors.knn(np.ones(4, dtype=np.float32), 5, Filters()) == []
