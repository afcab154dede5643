"""Meta: the database is bound to one embedding model; another is refused until
``reembed`` switches every vector to it, and a process whose model another process
replaced meanwhile notices it (``model_changed`` / ``check_model_unchanged``)."""

from __future__ import annotations

from collections.abc import Callable

import numpy as np
import pytest

from memory.engine import MemoryEngine
from memory.errors import EmbeddingModelChanged, EmbeddingModelMismatch
from memory.records import MessageRecord
from memory.storage import Storage, open_storage
from tests.support.builders import GUILD, HashEmbedder
from tests.support.inspection import Inspector
from tests.support.storage import row_counts, stored_vector

MakeRecord = Callable[..., MessageRecord]
Inspect = Callable[[Storage], Inspector]


def test_model_id_and_dimension_are_recorded(
    engine: MemoryEngine, make_record: MakeRecord
) -> None:
    assert engine.storage.meta.embedding_model() is None
    engine.ingest([make_record("hello")])
    assert engine.storage.meta.embedding_model() == ("test/hash-128", 128)
    stats = engine.storage.stats()
    assert (stats.embedding_model, stats.embedding_dim) == ("test/hash-128", 128)


def test_model_mismatch_is_refused(
    make_engine: Callable[..., MemoryEngine], make_record: MakeRecord, tmp_db: str
) -> None:
    first = make_engine(tmp_db, HashEmbedder(128))
    first.ingest([make_record("hello")])
    first.close()
    with pytest.raises(EmbeddingModelMismatch, match="reembed") as excinfo:
        make_engine(tmp_db, HashEmbedder(64))
    assert "test/hash-128" in str(excinfo.value) and "test/hash-64" in str(excinfo.value)


def test_same_model_id_with_another_dimension_is_refused(
    engine: MemoryEngine, make_record: MakeRecord
) -> None:
    engine.ingest([make_record("hello")])
    with pytest.raises(EmbeddingModelMismatch, match="reembed"):
        engine.storage.meta.bind_model("test/hash-128", 64)


def test_reembed_switches_model_and_dimension(
    make_engine: Callable[..., MemoryEngine], make_record: MakeRecord, tmp_db: str,
    inspector: Inspect,
) -> None:
    records = [make_record(f"note {i} about the garden") for i in range(7)]
    first = make_engine(tmp_db, HashEmbedder(128), context="none")
    first.ingest(records)
    first.close()

    second = make_engine(tmp_db, HashEmbedder(64, model_id="test/other-64"), check_model=False,
                         context="none")  # each vector is its own note's alone
    assert second.reembed() == 7
    assert second.storage.meta.embedding_model() == ("test/other-64", 64)
    assert second.storage.backlog.pending_count() == 0
    assert row_counts(second.storage, inspector) == {"messages": 7, "fts": 7, "vectors": 7}
    assert stored_vector(second.storage, records[0].id).shape == (64,)
    result = second.search("note 3 about the garden", guild_id=GUILD, mode="dense")
    assert result.hits and result.hits[0].id == records[3].id
    second.close()
    # the new model is now the one the database accepts
    make_engine(tmp_db, HashEmbedder(64, model_id="test/other-64")).close()


def test_a_model_replaced_by_another_process_is_noticed_before_anything_is_written(
    make_engine: Callable[..., MemoryEngine], make_record: MakeRecord, tmp_db: str,
    inspector: Inspect,
) -> None:
    records = [make_record(f"note {i} about the garden") for i in range(5)]
    running = make_engine(tmp_db, HashEmbedder(128))
    running.ingest(records)
    assert running.storage.meta.model_changed() is None
    running.storage.meta.check_model_unchanged()  # its own model: nothing to say
    late = make_record("a late note about the greenhouse")
    running.storage.messages.upsert([late])
    pending = running.storage.backlog.pending(10)  # read before the other process re-embeds
    assert [m.id for m in pending] == [late.id]

    other = make_engine(tmp_db, HashEmbedder(64, model_id="test/other-64"), check_model=False)
    assert other.reembed() == 6  # the late note too, with the new model

    reason = running.storage.meta.model_changed()
    assert reason is not None and "\n" not in reason
    assert "test/other-64 (64 dims)" in reason and "test/hash-128" in reason
    with pytest.raises(EmbeddingModelChanged) as caught:
        running.storage.meta.check_model_unchanged()
    assert str(caught.value) == reason
    vectors = running.embedder.embed([running.embedding_text(m) for m in pending])
    with pytest.raises(EmbeddingModelChanged):  # not one vector of the old model gets in
        running.storage.backlog.write_vectors(pending, vectors)
    with pytest.raises(EmbeddingModelChanged):  # nor through a new binding
        running.storage.meta.bind_model("test/hash-128", 128)
    result = running.search("garden", guild_id=GUILD)  # keywords only, saying why
    assert result.hits and result.trace.keyword_only == reason

    other.storage.meta.check_model_unchanged()  # the re-embedding process carries on
    assert other.storage.meta.model_changed() is None
    fresh = open_storage(tmp_db)  # nor does a process that has not chosen a model yet
    try:
        assert fresh.meta.model_changed() is None
        fresh.meta.check_model_unchanged()
    finally:
        fresh.close()
    assert running.storage.meta.embedding_model() == ("test/other-64", 64)
    assert row_counts(running.storage, inspector) == {"messages": 6, "fts": 6, "vectors": 6}
    assert stored_vector(running.storage, late.id).shape == (64,)


def test_reembed_forgets_the_old_models_similarity_floors(
    make_engine: Callable[..., MemoryEngine], make_record: MakeRecord, tmp_db: str
) -> None:
    """A floor is a property of one model's vectors: after ``reembed`` it is computed again
    from the new vectors, not served from the old model's cache."""
    words = ["garden", "kayak", "pizza", "oven", "router", "violin", "tax", "chess", "moss",
             "comet", "ferry", "quilt", "lemon", "badge"]
    records = [make_record(f"{words[i % 14]} {words[(i * 5 + 3) % 14]} {i}") for i in range(60)]
    first = make_engine(tmp_db, HashEmbedder(128), context="none")
    first.ingest(records)
    old = first.storage.vectors.similarity_floor(GUILD, 0.9)
    first.close()

    # a model whose vectors all point the same way: every pair is nearly identical
    second = make_engine(tmp_db, _SameDirection(), check_model=False, context="none")
    second.reembed()
    floor = second.storage.vectors.similarity_floor(GUILD, 0.9)
    assert old is not None and old < 0.9
    assert floor is not None and floor > 0.99


class _SameDirection(HashEmbedder):
    """A model whose vectors are all close to one direction (pairs' cosine near 1)."""

    def __init__(self) -> None:
        super().__init__(32, model_id="test/same-direction")

    def embed(self, texts):  # type: ignore[no-untyped-def]
        noise = super().embed(texts) * 0.01
        noise[:, 0] += 1.0
        return noise / np.linalg.norm(noise, axis=1, keepdims=True)
