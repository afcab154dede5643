"""Storage: idempotent upserts, edits and deletes across messages, FTS5 and vectors;
the crash-safe embedding backlog; model binding and re-embedding; filters in the KNN."""

from __future__ import annotations

import itertools
import threading
import time
from collections.abc import Callable, Sequence
from dataclasses import replace
from pathlib import Path

import numpy as np
import pytest

import memory.engine
from memory.engine import MemoryEngine
from memory.errors import EmbeddingModelMismatch, SearchInputError
from memory.records import MessageRecord
from memory.store import Filters, MessageStore
from tests.conftest import CHANNEL, GUILD, HashEmbedder

MakeRecord = Callable[..., MessageRecord]


def count(store: MessageStore, sql: str, params: Sequence = ()) -> int:
    return store._query(sql, params)[0][0]


def row_counts(store: MessageStore) -> dict[str, int]:
    """Rows in messages, in the FTS index itself, and in the vector table."""
    vectors = (
        count(store, "SELECT count(*) FROM message_vectors")
        if store.embedding_model() else 0
    )
    return {
        "messages": count(store, "SELECT count(*) FROM messages"),
        # the docsize shadow table has one row per indexed document
        "fts": count(store, "SELECT count(*) FROM search_fts_docsize"),
        "vectors": vectors,
    }


def fts_ids(store: MessageStore, word: str) -> set[int]:
    return {mid for mid, _ in store.keyword(f'"{word}"', 100, Filters())}


def fts_in_sync(store: MessageStore) -> None:
    """FTS5's own check that the index matches the content table (raises if not)."""
    with store._transaction() as conn:
        conn.execute("INSERT INTO search_fts(search_fts) VALUES ('integrity-check')")
        conn.execute("INSERT INTO window_fts(window_fts) VALUES ('integrity-check')")


def stored_vector(store: MessageStore, message_id: int) -> np.ndarray | None:
    rows = store._query(
        "SELECT embedding FROM message_vectors WHERE message_id = ?", (message_id,)
    )
    return np.frombuffer(rows[0][0], dtype=np.float32) if rows else None


# -- upsert -------------------------------------------------------------------------


def test_upsert_is_idempotent(engine: MemoryEngine, make_record: MakeRecord) -> None:
    records = [make_record(f"message number {i} about widgets") for i in range(12)]
    first = engine.ingest(records)
    assert (first.inserted, first.updated, first.unchanged, first.embedded) == (12, 0, 0, 12)
    before = row_counts(engine.store)
    assert before == {"messages": 12, "fts": 12, "vectors": 12}
    vector = stored_vector(engine.store, records[0].id)

    again = engine.ingest(records)
    assert (again.inserted, again.updated, again.unchanged, again.embedded) == (0, 0, 12, 0)
    assert row_counts(engine.store) == before
    assert engine.store.pending_count() == 0
    fts_in_sync(engine.store)
    np.testing.assert_array_equal(stored_vector(engine.store, records[0].id), vector)


def test_duplicate_ids_within_one_batch(engine: MemoryEngine, make_record: MakeRecord) -> None:
    record = make_record("first version")
    stats = engine.upsert([record, record, replace(record, content="second version")])
    assert (stats.inserted, stats.updated, stats.unchanged) == (1, 1, 1)
    assert engine.store.hydrate([record.id])[record.id].content == "second version"
    fts_in_sync(engine.store)


def test_empty_upsert_and_delete_are_noops(engine: MemoryEngine) -> None:
    assert engine.upsert([]).inserted == 0
    assert engine.delete([]) == 0
    assert engine.delete([123456789]) == 0


# -- edits ------------------------------------------------------------------------


def test_edit_updates_text_fts_and_vector(
    engine: MemoryEngine, make_record: MakeRecord
) -> None:
    original = make_record("the meeting is on tuesday in the workshop")
    other = make_record("completely unrelated chatter about gardening")
    engine.ingest([original, other])
    old_vector = stored_vector(engine.store, original.id)
    assert fts_ids(engine.store, "tuesday") == {original.id}

    edited = replace(original, content="the meeting moved to thursday evening",
                     edited_at=original.created_at + 60_000)
    stats = engine.upsert([edited])
    assert (stats.inserted, stats.updated, stats.unchanged) == (0, 1, 0)
    # text and FTS change at once; the stale vector is gone and the message is pending
    assert engine.store.hydrate([original.id])[original.id].content == edited.content
    assert fts_ids(engine.store, "tuesday") == set()
    assert fts_ids(engine.store, "thursday") == {original.id}
    assert stored_vector(engine.store, original.id) is None
    # the next message was embedded with the old text as its context: it goes too
    assert stored_vector(engine.store, other.id) is None
    assert engine.store.pending_count() == 2
    fts_in_sync(engine.store)

    pending = engine.store.pending(10)
    expected = engine.embedder.embed([engine.embedding_text(p) for p in pending])[0]
    assert "thursday" in engine.embedding_text(pending[0])
    assert engine.embed_pending() == 2
    new_vector = stored_vector(engine.store, original.id)
    np.testing.assert_allclose(new_vector, expected, atol=1e-6)
    assert not np.allclose(new_vector, old_vector)
    assert row_counts(engine.store) == {"messages": 2, "fts": 2, "vectors": 2}


def test_edit_of_timestamp_only_keeps_vector(
    engine: MemoryEngine, make_record: MakeRecord
) -> None:
    record = make_record("same words as before")
    engine.ingest([record])
    vector = stored_vector(engine.store, record.id)
    stats = engine.upsert([replace(record, edited_at=record.created_at + 1000)])
    assert stats.updated == 1
    assert engine.store.pending_count() == 0
    np.testing.assert_array_equal(stored_vector(engine.store, record.id), vector)


def test_attachment_change_counts_as_an_edit(
    engine: MemoryEngine, make_record: MakeRecord
) -> None:
    record = make_record("look at this")
    engine.ingest([record])
    engine.upsert([replace(record, attachments=("schematic.png",))])
    assert engine.store.pending_count() == 1
    assert fts_ids(engine.store, "schematic") == {record.id}
    engine.embed_pending()
    hits = engine.store.knn(engine.embedder.embed(["look"])[0], 5,
                            Filters(has_attachment=True))
    assert [mid for mid, _ in hits] == [record.id]


# -- deletes ----------------------------------------------------------------------


def test_delete_purges_messages_fts_and_vectors(
    engine: MemoryEngine, make_record: MakeRecord
) -> None:
    keep = make_record("the router password is on the fridge")
    gone = [make_record(f"secret plan number {i}") for i in range(3)]
    engine.ingest([keep, *gone])
    assert engine.delete([m.id for m in gone] + [999]) == 3
    assert row_counts(engine.store) == {"messages": 1, "fts": 1, "vectors": 1}
    assert fts_ids(engine.store, "secret") == set()
    fts_in_sync(engine.store)
    vec = engine.embedder.embed(["secret plan number 1"])[0]
    assert [mid for mid, _ in engine.store.knn(vec, 10, Filters())] == [keep.id]
    result = engine.search("secret plan", guild_id=GUILD)
    assert all(h.id == keep.id for h in result.hits)


def test_delete_before_embedding(engine: MemoryEngine, make_record: MakeRecord) -> None:
    record = make_record("never embedded")
    engine.upsert([record])
    assert engine.delete([record.id]) == 1
    assert engine.store.pending_count() == 0
    assert engine.embed_pending() == 0


# -- crash-safe backlog -----------------------------------------------------------


class CrashingEmbedder(HashEmbedder):
    """Embeds ``good_calls`` batches, then fails like a killed process would."""

    def __init__(self, good_calls: int) -> None:
        super().__init__()
        self.good_calls = good_calls

    def embed(self, texts: Sequence[str]) -> np.ndarray:
        if self.calls >= self.good_calls:
            raise RuntimeError("embedder crashed")
        return super().embed(texts)


def test_backlog_survives_an_embedder_crash(
    make_engine: Callable[..., MemoryEngine],
    make_record: MakeRecord,
    tmp_db: Path,
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    monkeypatch.setattr(memory.engine, "EMBED_CHUNK", 10)
    records = [make_record(f"backlog message {i}") for i in range(25)]
    crashing = make_engine(tmp_db, CrashingEmbedder(good_calls=1))
    with pytest.raises(RuntimeError, match="crashed"):
        crashing.ingest(records)
    # every message was stored before embedding began; the first chunk's vectors persist
    assert crashing.store.message_count() == 25
    assert crashing.store.pending_count() == 15
    assert row_counts(crashing.store) == {"messages": 25, "fts": 25, "vectors": 10}
    first_chunk = sorted(r.id for r in records)[:10]
    assert all(stored_vector(crashing.store, mid) is not None for mid in first_chunk)
    crashing.close()

    resumed = make_engine(tmp_db, HashEmbedder())  # the next run
    assert resumed.embed_pending() == 15
    assert resumed.store.pending_count() == 0
    assert row_counts(resumed.store)["vectors"] == 25


def test_messages_are_stored_even_if_the_first_batch_fails(
    make_engine: Callable[..., MemoryEngine], make_record: MakeRecord
) -> None:
    engine = make_engine(embedder=CrashingEmbedder(good_calls=0))
    with pytest.raises(RuntimeError):
        engine.ingest([make_record("hello there"), make_record("general kenobi")])
    assert engine.store.message_count() == 2
    assert engine.store.pending_count() == 2
    # keyword search still finds them while the vectors are missing
    result = engine.search("kenobi", guild_id=GUILD, mode="keyword")
    assert len(result.hits) == 1


def test_edit_during_embedding_does_not_leave_a_stale_vector(
    engine: MemoryEngine, make_record: MakeRecord
) -> None:
    # The interleaving of a background embed with a Discord edit event, step by step.
    record = make_record("the meeting is on tuesday")
    engine.upsert([record])
    engine.store.set_embedding_model(engine.embedder.model_id, engine.embedder.dimension)
    batch = engine.store.pending(10)
    vectors = engine.embedder.embed([engine.embedding_text(m) for m in batch])
    engine.upsert([replace(record, content="the meeting is on thursday")])  # the edit lands
    engine.store.write_vectors(batch, vectors)  # the embed of the old text finishes
    assert stored_vector(engine.store, record.id) is None
    assert engine.store.pending_count() == 1
    assert engine.embed_pending() == 1
    (fresh,) = engine.embedder.embed(
        [engine.embedding_text(replace(batch[0], content="the meeting is on thursday"))])
    np.testing.assert_allclose(stored_vector(engine.store, record.id), fresh, atol=1e-6)


def test_delete_during_embedding_leaves_no_orphan_vector(
    engine: MemoryEngine, make_record: MakeRecord
) -> None:
    keep, gone = make_record("keep me"), make_record("delete me")
    engine.upsert([keep, gone])
    engine.store.set_embedding_model(engine.embedder.model_id, engine.embedder.dimension)
    batch = engine.store.pending(10)
    vectors = engine.embedder.embed([engine.embedding_text(m) for m in batch])
    engine.delete([gone.id])  # the delete lands while the batch is being embedded
    engine.store.write_vectors(batch, vectors)
    assert row_counts(engine.store) == {"messages": 1, "fts": 1, "vectors": 1}
    assert stored_vector(engine.store, gone.id) is None
    assert engine.store.pending_count() == 0


def test_pending_uses_reply_target_or_previous_message_as_antecedent(
    engine: MemoryEngine, make_record: MakeRecord
) -> None:
    question = make_record("does anyone have a spare soldering iron", age_days=3)
    chatter = make_record("lunch was great", age_days=2)
    answer = make_record("yes mine", age_days=1, reply_to_id=question.id, author_id=2)
    follow = make_record("thanks", age_days=0.5)
    engine.upsert([question, chatter, answer, follow])
    pending = {p.id: p for p in engine.store.pending(10)}
    assert pending[answer.id].antecedent_content == question.content
    assert pending[follow.id].antecedent_content == answer.content  # previous in channel
    assert pending[question.id].antecedent_content is None
    assert "soldering iron" in engine.embedding_text(pending[answer.id])


# -- embedding model binding --------------------------------------------------------


def test_model_id_and_dimension_are_recorded(
    engine: MemoryEngine, make_record: MakeRecord
) -> None:
    assert engine.store.embedding_model() is None
    engine.ingest([make_record("hello")])
    assert engine.store.embedding_model() == ("test/hash-128", 128)
    stats = engine.store.stats()
    assert (stats.embedding_model, stats.embedding_dim) == ("test/hash-128", 128)


def test_model_mismatch_is_refused(
    make_engine: Callable[..., MemoryEngine], make_record: MakeRecord, tmp_db: Path
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
        engine.store.set_embedding_model("test/hash-128", 64)


def test_reembed_switches_model_and_dimension(
    make_engine: Callable[..., MemoryEngine], make_record: MakeRecord, tmp_db: Path
) -> None:
    records = [make_record(f"note {i} about the garden") for i in range(7)]
    first = make_engine(tmp_db, HashEmbedder(128), context="none")
    first.ingest(records)
    first.close()

    second = make_engine(tmp_db, HashEmbedder(64, model_id="test/other-64"), check_model=False,
                         context="none")  # each vector is its own note's alone
    assert second.reembed() == 7
    assert second.store.embedding_model() == ("test/other-64", 64)
    assert second.store.pending_count() == 0
    assert row_counts(second.store) == {"messages": 7, "fts": 7, "vectors": 7}
    assert stored_vector(second.store, records[0].id).shape == (64,)
    result = second.search("note 3 about the garden", guild_id=GUILD, mode="dense")
    assert result.hits and result.hits[0].id == records[3].id
    second.close()
    # the new model is now the one the database accepts
    make_engine(tmp_db, HashEmbedder(64, model_id="test/other-64")).close()


# -- channels, threads and filters inside the KNN -----------------------------------


def test_thread_parent_is_stored_and_expanded(
    engine: MemoryEngine, make_record: MakeRecord
) -> None:
    thread_id = CHANNEL + 1
    engine.upsert([
        make_record("in the channel"),
        make_record("in the thread", channel_id=thread_id, parent_id=CHANNEL,
                    channel_type="GuildPublicThread", channel_name="a thread"),
    ])
    rows = engine.store._query("SELECT parent_id, type FROM channels WHERE id = ?", (thread_id,))
    assert rows == [(CHANNEL, "GuildPublicThread")]
    assert set(engine.store.expand_channels([CHANNEL])) == {CHANNEL, thread_id}
    assert engine.store.expand_channels([thread_id]) == (thread_id,)
    # a later record without the parent does not erase it
    engine.upsert([make_record("more", channel_id=thread_id)])
    assert engine.store._query("SELECT parent_id FROM channels WHERE id = ?",
                               (thread_id,)) == [(CHANNEL,)]


@pytest.fixture
def crowded(engine: MemoryEngine, make_record: MakeRecord) -> tuple[MemoryEngine, list[int]]:
    """200 messages: 190 close to "raspberry cluster" by others, 10 far ones by author 99."""
    close = [
        make_record(f"raspberry cluster kubernetes node {i} rebuilt", author_id=1 + i % 5,
                    channel_id=CHANNEL + i % 3)
        for i in range(190)
    ]
    far = [
        make_record(f"tomato seedlings compost watering schedule {i}", author_id=99,
                    channel_id=CHANNEL + 2, attachments=("photo.jpg",) if i % 2 else ())
        for i in range(10)
    ]
    engine.ingest(close + far)
    return engine, [r.id for r in far]


@pytest.mark.parametrize("rescore", [1, 8], ids=["rescore-1", "rescore-8"])
def test_author_filter_applies_inside_the_knn(crowded, rescore: int) -> None:
    engine, far = crowded
    vector = engine.embedder.embed(["raspberry cluster kubernetes"])[0]
    unfiltered = engine.store.knn(vector, 5, Filters(guild_id=GUILD), rescore=rescore)
    assert not set(far) & {mid for mid, _ in unfiltered}
    hits = engine.store.knn(vector, 5, Filters(guild_id=GUILD, author_ids=(99,)), rescore=rescore)
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
    hits = engine.store.knn(vector, 5, filters, rescore=rescore)
    assert len(hits) == expected
    assert {mid for mid, _ in hits} <= set(far)


def test_time_filters_inside_the_knn(engine: MemoryEngine, make_record: MakeRecord) -> None:
    old = [make_record(f"backup disk report {i}", age_days=100 + i) for i in range(20)]
    new = [make_record(f"pizza night {i}", age_days=1 + i / 10) for i in range(5)]
    engine.ingest(old + new)
    vector = engine.embedder.embed(["pizza night"])[0]
    cutoff = old[0].created_at + 1
    before = engine.store.knn(vector, 5, Filters(before_ms=cutoff))
    assert len(before) == 5 and {m for m, _ in before} <= {r.id for r in old}
    after = engine.store.knn(vector, 50, Filters(after_ms=cutoff))
    assert {m for m, _ in after} == {r.id for r in new}


# -- 1-bit KNN with exact rescoring -------------------------------------------------------


def exact_cosine(store: MessageStore, vector: np.ndarray) -> dict[int, float]:
    rows = store._query("SELECT message_id, embedding FROM message_vectors")
    return {
        mid: float(np.frombuffer(blob, dtype=np.float32) @ vector
                   / np.linalg.norm(np.frombuffer(blob, dtype=np.float32)) / np.linalg.norm(vector))
        for mid, blob in rows
    }


def test_knn_that_fetches_the_whole_scope_is_exact(crowded) -> None:
    engine, _ = crowded
    vector = engine.embedder.embed(["tomato compost"])[0]
    exact = exact_cosine(engine.store, vector)
    hits = engine.store.knn(vector, 200, Filters(guild_id=GUILD), rescore=1)  # all 200 rows
    assert dict(hits).keys() == exact.keys()
    for mid, similarity in hits:
        assert similarity == pytest.approx(exact[mid], abs=1e-5)
    sims = [s for _, s in hits]
    assert sims == sorted(sims, reverse=True)
    top = sorted(exact.values(), reverse=True)[:10]
    np.testing.assert_allclose(
        [s for _, s in engine.store.knn(vector, 10, Filters(), rescore=20)], top, atol=1e-5
    )


def test_binary_knn_candidates_are_the_nearest_by_hamming(crowded) -> None:
    """The rescored pool is exactly the ``k × rescore`` nearest 1-bit vectors."""
    engine, _ = crowded
    store = engine.store
    vector = engine.embedder.embed(["raspberry node rebuilt"])[0]
    bits = np.packbits(vector > 0, bitorder="little")
    pool = [row[:2] for row in store.vectors._code_knn(bits.tobytes(), 40, Filters(guild_id=GUILD))]
    stored = dict(store._query("SELECT message_id, embedding_bits FROM message_vectors"))
    hamming = {
        m: int(np.unpackbits(np.frombuffer(b, np.uint8) ^ bits).sum()) for m, b in stored.items()
    }
    assert [d for _, d in pool] == sorted(hamming.values())[:40]
    hits = store.knn(vector, 10, Filters(guild_id=GUILD), rescore=4)
    assert {m for m, _ in hits} <= {m for m, _ in pool}
    sims = [s for _, s in hits]
    assert sims == sorted(sims, reverse=True)


def test_learned_radius_never_changes_results(crowded, monkeypatch: pytest.MonkeyPatch) -> None:
    """After a few searches the 1-bit KNN runs with a distance limit; a query whose
    neighbours lie further out widens it, and every answer equals the unlimited one."""
    engine, far = crowded
    store = engine.store
    radii: list[int | None] = []
    original = store.vectors._code_knn

    def recording(code, k, filters, radius=None):
        radii.append(radius)
        return original(code, k, filters, radius)

    monkeypatch.setattr(store.vectors, "_code_knn", recording)
    queries = [f"raspberry cluster node {i}" for i in range(6)] + [
        "tomato seedlings compost watering", "completely unrelated words zebra",
    ]
    filters = Filters(guild_id=GUILD)
    for text in queries:
        vector = engine.embedder.embed([text])[0]
        radii.clear()
        learned = store.knn(vector, 5, filters, rescore=4)
        tries = list(radii)
        store.vectors._radii, saved = type(store.vectors._radii)(), store.vectors._radii  # no memory: no limit
        assert store.knn(vector, 5, filters, rescore=4) == learned, text
        store.vectors._radii = saved
        if text != queries[0]:
            assert tries[0] is not None, "a learned radius limits the KNN"
        assert all(a < b for a, b in itertools.pairwise(tries) if b is not None), tries
    # an author who wrote only far-away messages: widens from the guild's radius
    radii.clear()
    hits = store.knn(engine.embedder.embed(["raspberry cluster"])[0], 5,
                     Filters(guild_id=GUILD, author_ids=(99,)), rescore=4)
    assert len(hits) == 5 and {m for m, _ in hits} <= set(far)
    assert radii[0] is not None and radii[-1] is None and 2 <= len(radii) <= 4
    # 10 messages cannot fill 5 x 4 candidates: next time the small scope is searched
    # without a limit straight away, once
    radii.clear()
    again = store.knn(engine.embedder.embed(["raspberry cluster"])[0], 5,
                      Filters(guild_id=GUILD, author_ids=[99]), rescore=4)  # a list works too
    assert again == hits and radii == [None]


def test_a_vector_table_from_before_the_bits_column_is_upgraded(
    make_engine, make_record: MakeRecord, tmp_path: Path
) -> None:
    db = tmp_path / "old.sqlite3"
    engine = make_engine(db)
    records = [make_record(f"garden note {i} about tomatoes") for i in range(30)]
    records += [make_record(f"other server {i}", guild_id=GUILD + 1) for i in range(4)]
    engine.ingest(records)
    store = engine.store
    before = dict(store._query("SELECT message_id, embedding FROM message_vectors"))
    # rebuild the table as the first release created it: float vectors only, and
    # the schema version from before the upgrade migration
    with store._transaction() as conn:
        conn.execute("PRAGMA user_version = 3")
        conn.execute("DROP TABLE embedding_claims")
        conn.execute("DROP TABLE message_vectors")
        conn.execute(
            "CREATE VIRTUAL TABLE message_vectors USING vec0(message_id INTEGER PRIMARY KEY, "
            "embedding float[128] distance_metric=cosine, guild_id INTEGER PARTITION KEY, "
            "channel_id INTEGER, author_id INTEGER, created_at INTEGER, has_attachment INTEGER)"
        )
        conn.executemany(
            "INSERT INTO message_vectors(message_id, embedding, guild_id, channel_id, author_id, "
            "created_at, has_attachment) VALUES (?, ?, ?, ?, ?, ?, 0)",
            [(r.id, before[r.id], r.guild_id, r.channel_id, r.author_id, r.created_at)
             for r in records],
        )
    engine.close()
    reopened = MessageStore(db)
    try:
        after = reopened._query(
            "SELECT message_id, embedding, embedding_bits, guild_id, author_id FROM message_vectors"
        )
        assert {m: e for m, e, *_ in after} == before
        for mid, embedding, bits, guild, author in after:
            vector = np.frombuffer(embedding, dtype=np.float32)
            assert bits == np.packbits(vector > 0, bitorder="little").tobytes()
            assert (guild, author) == (next(r.guild_id for r in records if r.id == mid), 1)
        stats = {g: (n, np.frombuffer(ones, np.int64))
                 for g, n, ones in reopened._query("SELECT * FROM code_stats")}
        assert {g: n for g, (n, _) in stats.items()} == {GUILD: 30, GUILD + 1: 4}
        in_guild = [np.frombuffer(e, np.float32) for m, e, _, g, _ in after if g == GUILD + 1]
        np.testing.assert_array_equal(stats[GUILD + 1][1], (np.stack(in_guild) > 0).sum(axis=0))
        vector = np.frombuffer(before[records[3].id], dtype=np.float32)
        assert reopened.knn(vector, 1, Filters(guild_id=GUILD), rescore=4)[0][0] == records[3].id
    finally:
        reopened.close()


def test_a_missing_vector_table_is_rebuilt_and_everything_re_embedded(
    make_engine, make_record: MakeRecord, tmp_path: Path
) -> None:
    db = tmp_path / "broken.sqlite3"
    engine = make_engine(db)
    engine.ingest([make_record(f"garden note {i}") for i in range(5)])
    with engine.store._transaction() as conn:
        conn.execute("DROP TABLE message_vectors")
    engine.close()
    again = make_engine(db)
    assert again.store.pending_count() == 5
    assert again.embed_pending() == 5
    assert again.search("garden note", guild_id=GUILD, mode="dense").hits


def test_dimensions_that_do_not_pack_into_bytes_get_padded_codes(
    make_engine, make_record: MakeRecord
) -> None:
    engine = make_engine(embedder=HashEmbedder(dimension=100))
    engine.ingest([make_record("pizza night friday"), make_record("disk backup report")])
    codes = engine.store._query("SELECT embedding_bits FROM message_vectors")
    assert {len(code) for code, in codes} == {13}  # 100 bits + 4 zero bits
    result = engine.search("pizza night", guild_id=GUILD, limit=1, mode="dense")
    assert result.hits[0].content == "pizza night friday"


def test_code_stats_count_the_set_bits_per_guild(
    engine: MemoryEngine, make_record: MakeRecord
) -> None:
    records = [make_record(f"note {i} on the garden") for i in range(12)]
    records += [make_record(f"other server {i}", guild_id=GUILD + 1) for i in range(3)]
    engine.ingest(records)
    store = engine.store
    for guild, expected_count in ((GUILD, 12), (GUILD + 1, 3)):
        count, ones = store._query(
            "SELECT vectors, ones FROM code_stats WHERE guild_id = ?", (guild,)
        )[0]
        vectors = [
            np.frombuffer(v, dtype=np.float32)
            for v, in store._query(
                "SELECT embedding FROM message_vectors WHERE guild_id = ?", (guild,)
            )
        ]
        assert count == expected_count
        np.testing.assert_array_equal(
            np.frombuffer(ones, dtype=np.int64), (np.stack(vectors) > 0).sum(axis=0)
        )
    # the expected distance is the mean Hamming distance to the guild's codes
    query = engine.embedder.embed(["garden"])[0] > 0
    codes = [
        np.unpackbits(np.frombuffer(c, np.uint8), bitorder="little")[:128].astype(bool)
        for c, in store._query("SELECT embedding_bits FROM message_vectors WHERE guild_id = ?",
                               (GUILD,))
    ]
    mean = np.mean([(code != query).sum() for code in codes])
    assert store.vectors.expected_distance(query, GUILD) == pytest.approx(mean)
    assert store.vectors.expected_distance(query, GUILD + 7) == 0.0  # nothing known: no guess
    engine.reembed()
    assert store._query("SELECT sum(vectors) FROM code_stats")[0][0] == 15


def test_keyword_search_filters_every_match_when_the_best_are_elsewhere(
    engine: MemoryEngine, make_record: MakeRecord
) -> None:
    """The best 4 × k matches are all in another guild: the few here must still come back."""
    loud = [make_record(f"pizza pizza {i}", guild_id=GUILD + 1) for i in range(60)]
    quiet = [make_record(f"we could maybe order some pizza later tonight {i}") for i in range(3)]
    engine.store.upsert(loud + quiet)
    hits = engine.store.keyword('"pizza"', 5, Filters(guild_id=GUILD))
    assert {mid for mid, _ in hits} == {r.id for r in quiet}
    everywhere = engine.store.keyword('"pizza"', 5, Filters())
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
    assert [mid for mid, _ in engine.store.keyword('"pizza"', 5, Filters())] == [first.id]
    second = make_record("more pizza tonight")
    engine.ingest([second])
    found = {mid for mid, _ in engine.store.keyword('"pizza"', 5, Filters())}
    assert found == {first.id, second.id}
    engine.delete([first.id])
    for field in ("message", "window"):
        found = {mid for mid, _ in engine.store.keyword('"oven"', 5, Filters(), field=field)}
        assert found == set(), field  # a deleted message is gone from the reader at once
    hits = engine.search("pizza oven", guild_id=GUILD, adaptive=False)
    assert [h.id for h in hits.hits] == [second.id]
    engine.embed_pending()  # the deleted message's neighbour is embedded again without it
    beside = engine.store.window_vectors([first.id, second.id], beside=True)
    assert list(beside) == [second.id]  # so are window vectors
    np.testing.assert_array_equal(beside[second.id],
                                  engine.store.window_vectors([second.id])[second.id])
    with pytest.raises(Exception, match="readonly|read-only|read only"):
        engine.store._read_beside("DELETE FROM search_text")  # it cannot write


def test_empty_id_filter_is_an_input_error(engine: MemoryEngine, make_record: MakeRecord) -> None:
    engine.ingest([make_record("hello")])
    with pytest.raises(SearchInputError):
        engine.store.knn(engine.embedder.embed(["hello"])[0], 5, Filters(author_ids=()))


def test_knn_without_vectors_is_empty(tmp_db: Path) -> None:
    store = MessageStore(tmp_db)
    try:
        assert store.knn(np.ones(4, dtype=np.float32), 5, Filters()) == []
    finally:
        store.close()


def test_wal_mode_on_the_store(engine: MemoryEngine) -> None:
    assert engine.store._query("PRAGMA journal_mode")[0][0].lower() == "wal"


# -- concurrent embedders -------------------------------------------------------------------


class CountingEmbedder(HashEmbedder):
    """Counts every text it embeds; pauses a moment per batch so embedders interleave."""

    def __init__(self) -> None:
        super().__init__()
        self.texts: list[str] = []
        self._lock = threading.Lock()

    def embed(self, texts):
        with self._lock:
            self.texts.extend(texts)
        time.sleep(0.005)
        return super().embed(texts)


def test_claims_split_the_backlog_between_embedders(
    engine: MemoryEngine, make_record: MakeRecord
) -> None:
    engine.store.upsert([make_record(f"note {i}") for i in range(10)])
    first = engine.store.claim(6, owner="a")
    second = engine.store.claim(6, owner="b")
    assert len(first) == 6 and len(second) == 4
    assert not {m.id for m in first} & {m.id for m in second}
    assert engine.store.claim(6, owner="c") == []
    engine.store.release("b")
    assert {m.id for m in engine.store.claim(6, owner="c")} == {m.id for m in second}
    # an expired claim (its embedder died) is free again
    assert len(engine.store.claim(6, owner="d", ttl_s=0)) == 0
    engine.store.release("a")
    assert len(engine.store.claim(6, owner="d", ttl_s=0)) == 6
    assert len(engine.store.claim(6, owner="e")) == 6


def test_a_write_whose_claim_was_taken_over_is_skipped(
    engine: MemoryEngine, make_record: MakeRecord
) -> None:
    engine.store.upsert([make_record("slow embedder's message")])
    engine.store.set_embedding_model(engine.embedder.model_id, engine.embedder.dimension)
    mine = engine.store.claim(1, owner="slow", ttl_s=0)  # expires at once
    theirs = engine.store.claim(1, owner="fast")
    assert [m.id for m in theirs] == [m.id for m in mine]
    engine.store.write_vectors(mine, engine.embedder.embed(["x"]), owner="slow")
    assert engine.store.pending_count() == 1  # left to the embedder that holds the claim
    engine.store.write_vectors(theirs, engine.embedder.embed(["x"]), owner="fast")
    assert engine.store.pending_count() == 0


def test_two_embedders_never_embed_the_same_message(
    make_engine, make_record: MakeRecord, tmp_path: Path
) -> None:
    """Two engines (two connections, as two processes would have) share one backlog;
    afterwards code_stats equals a recount of the stored vectors."""
    db = tmp_path / "shared.sqlite3"
    records = [make_record(f"message {i} about the garden") for i in range(1500)]
    records += [make_record(f"other guild {i}", guild_id=GUILD + 1) for i in range(300)]
    make_engine(db).store.upsert(records)
    embedders = [CountingEmbedder(), CountingEmbedder()]
    engines = [make_engine(db, embedder) for embedder in embedders]
    errors: list[BaseException] = []

    def run(engine: MemoryEngine) -> None:
        try:
            engine.embed_pending()
        except BaseException as exc:  # reported below
            errors.append(exc)

    threads = [threading.Thread(target=run, args=(e,)) for e in engines]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    assert errors == []
    embedded = [t for e in embedders for t in e.texts]
    assert len(embedded) == len(records)  # nobody repeated anybody's work
    assert all(e.texts for e in embedders), "both embedders took part"
    store = engines[0].store
    assert store.pending_count() == 0
    assert_code_stats_exact(store)
    # deletes and edits subtract their old codes
    store.delete([r.id for r in records[:100]])
    edited = replace(records[200], content="an edited message about bicycles")
    engines[0].ingest([edited])
    assert_code_stats_exact(store)


def assert_code_stats_exact(store: MessageStore) -> None:
    recount: dict[int, tuple[int, np.ndarray]] = {}
    for guild, blob in store._query("SELECT guild_id, embedding FROM message_vectors"):
        count, ones = recount.get(guild, (0, 0))
        recount[guild] = (count + 1, ones + (np.frombuffer(blob, np.float32) > 0))
    stats = {g: (n, np.frombuffer(o, np.int64)) for g, n, o in store._query(
        "SELECT guild_id, vectors, ones FROM code_stats")}
    assert stats.keys() == recount.keys()
    for guild, (count, ones) in recount.items():
        assert stats[guild][0] == count
        np.testing.assert_array_equal(stats[guild][1], ones)


def test_floats_read_from_the_shadow_table_equal_the_vec0_query(
    engine: MemoryEngine, make_record: MakeRecord
) -> None:
    records = [make_record(f"note {i} about the garden") for i in range(12)]
    engine.ingest(records)
    ids = [r.id for r in records[::2]] + [123]  # and one id without a vector
    index = engine.store.vectors
    fast = index.floats(ids)
    assert index._auxiliary is True  # this sqlite-vec keeps +embedding in a shadow table
    index._auxiliary = False  # what a differently laid-out release would get
    slow = index.floats(ids)
    assert set(fast) == set(slow) == {r.id for r in records[::2]}
    for mid in fast:
        np.testing.assert_array_equal(fast[mid], slow[mid])
        np.testing.assert_array_equal(fast[mid], stored_vector(engine.store, mid))
