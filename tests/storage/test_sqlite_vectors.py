"""The SQLite vector table (vec0): 1-bit codes searched by Hamming distance and rescored
by exact cosine, the learned search radius, the per-guild code statistics, padded
codes, the float shadow table, deletes by point lookups or one scan, the upgrade from
the first release's float table, and a lost table rebuilt.

These tests read the SQLite file on a connection of their own
(``memory.storage.sqlite.connection.connect``) and the vector table's own object
(``storage.vectors.table``); the contract-level vector tests are in test_vectors.py.
"""

from __future__ import annotations

import itertools
from collections.abc import Callable

import numpy as np
import pytest

from memory.engine import MemoryEngine
from memory.filters import Filters
from memory.records import MessageRecord
from memory.storage import open_storage
from memory.storage.sqlite import vectors
from memory.storage.sqlite.connection import connect
from tests.support.builders import GUILD, HashEmbedder
from tests.support.sqlite import sql_rows
from tests.support.storage import stored_vector

MakeRecord = Callable[..., MessageRecord]


@pytest.fixture
def storage_kind() -> str:
    """These tests read the SQLite file itself."""
    return "sqlite"


def test_binary_knn_candidates_are_the_nearest_by_hamming(crowded) -> None:
    """The rescored pool is exactly the ``k × rescore`` nearest 1-bit vectors."""
    engine, _ = crowded
    storage = engine.storage
    vector = engine.embedder.embed(["raspberry node rebuilt"])[0]
    bits = np.packbits(vector > 0, bitorder="little")
    pool = [row[:2] for row in
            storage.vectors.table._code_knn(bits.tobytes(), 40, Filters(guild_id=GUILD))]
    stored = dict(sql_rows(storage.database.location,
                           "SELECT message_id, embedding_bits FROM message_vectors"))
    hamming = {
        m: int(np.unpackbits(np.frombuffer(b, np.uint8) ^ bits).sum()) for m, b in stored.items()
    }
    assert [d for _, d in pool] == sorted(hamming.values())[:40]
    # the 1-bit path itself (what a guild of more than EXACT_KNN_MAX vectors takes)
    hits = storage.vectors.table.knn(vector, 10, Filters(guild_id=GUILD), rescore=4)
    assert {m for m, _ in hits} <= {m for m, _ in pool}
    sims = [s for _, s in hits]
    assert sims == sorted(sims, reverse=True)


def test_learned_radius_never_changes_results(crowded, monkeypatch: pytest.MonkeyPatch) -> None:
    """After a few searches the 1-bit KNN runs with a distance limit; a query whose
    neighbours lie further out widens it, and every answer equals the unlimited one."""
    engine, far = crowded
    table = engine.storage.vectors.table  # the 1-bit path of a guild above EXACT_KNN_MAX
    radii: list[int | None] = []
    original = table._code_knn

    def recording(code, k, filters, radius=None):
        radii.append(radius)
        return original(code, k, filters, radius)

    monkeypatch.setattr(table, "_code_knn", recording)
    queries = [f"raspberry cluster node {i}" for i in range(6)] + [
        "tomato seedlings compost watering", "completely unrelated words zebra",
    ]
    filters = Filters(guild_id=GUILD)
    for text in queries:
        vector = engine.embedder.embed([text])[0]
        radii.clear()
        learned = table.knn(vector, 5, filters, rescore=4)
        tries = list(radii)
        table._radii, saved = type(table._radii)(), table._radii  # no memory: no limit
        assert table.knn(vector, 5, filters, rescore=4) == learned, text
        table._radii = saved
        if text != queries[0]:
            assert tries[0] is not None, "a learned radius limits the KNN"
        assert all(a < b for a, b in itertools.pairwise(tries) if b is not None), tries
    # an author who wrote only far-away messages: widens from the guild's radius
    radii.clear()
    hits = table.knn(engine.embedder.embed(["raspberry cluster"])[0], 5,
                               Filters(guild_id=GUILD, author_ids=(99,)), rescore=4)
    assert len(hits) == 5 and {m for m, _ in hits} <= set(far)
    assert radii[0] is not None and radii[-1] is None and 2 <= len(radii) <= 4
    # 10 messages cannot fill 5 x 4 candidates: next time the small scope is searched
    # without a limit straight away, once
    radii.clear()
    again = table.knn(engine.embedder.embed(["raspberry cluster"])[0], 5,
                                Filters(guild_id=GUILD, author_ids=[99]), rescore=4)  # a list works too
    assert again == hits and radii == [None]


def test_a_vector_table_from_before_the_bits_column_is_upgraded(
    make_engine, make_record: MakeRecord, make_location: Callable[[str], str]
) -> None:
    db = make_location("old")
    engine = make_engine(db)
    records = [make_record(f"garden note {i} about tomatoes") for i in range(30)]
    records += [make_record(f"other server {i}", guild_id=GUILD + 1) for i in range(4)]
    engine.ingest(records)
    engine.close()
    before = dict(sql_rows(db, "SELECT message_id, embedding FROM message_vectors"))
    # rebuild the table as the first release created it: float vectors only, and
    # the schema version from before the upgrade migration
    conn = connect(db)
    try:
        conn.execute("BEGIN IMMEDIATE")
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
        conn.execute("COMMIT")
    finally:
        conn.close()
    reopened = open_storage(db)
    try:
        after = sql_rows(
            db, "SELECT message_id, embedding, embedding_bits, guild_id, author_id FROM message_vectors"
        )
        assert {m: e for m, e, *_ in after} == before
        for mid, embedding, bits, guild, author in after:
            vector = np.frombuffer(embedding, dtype=np.float32)
            assert bits == np.packbits(vector > 0, bitorder="little").tobytes()
            assert (guild, author) == (next(r.guild_id for r in records if r.id == mid), 1)
        stats = {g: (n, np.frombuffer(ones, np.int64))
                 for g, n, ones in sql_rows(db, "SELECT * FROM code_stats")}
        assert {g: n for g, (n, _) in stats.items()} == {GUILD: 30, GUILD + 1: 4}
        in_guild = [np.frombuffer(e, np.float32) for m, e, _, g, _ in after if g == GUILD + 1]
        np.testing.assert_array_equal(stats[GUILD + 1][1], (np.stack(in_guild) > 0).sum(axis=0))
        vector = np.frombuffer(before[records[3].id], dtype=np.float32)
        hits = reopened.vectors.knn(vector, 1, Filters(guild_id=GUILD), rescore=4)
        assert hits[0][0] == records[3].id
    finally:
        reopened.close()


def test_a_missing_vector_table_is_rebuilt_and_everything_re_embedded(
    make_engine, make_record: MakeRecord, make_location: Callable[[str], str]
) -> None:
    db = make_location("broken")
    engine = make_engine(db)
    engine.ingest([make_record(f"garden note {i}") for i in range(5)])
    engine.close()
    conn = connect(db)
    try:
        conn.execute("DROP TABLE message_vectors")
    finally:
        conn.close()
    again = make_engine(db)
    assert again.storage.backlog.pending_count() == 5
    assert again.embed_pending() == 5
    assert again.search("garden note", guild_id=GUILD, mode="dense").hits


def test_dimensions_that_do_not_pack_into_bytes_get_padded_codes(
    make_engine, make_record: MakeRecord
) -> None:
    engine = make_engine(embedder=HashEmbedder(dimension=100))
    engine.ingest([make_record("pizza night friday"), make_record("disk backup report")])
    codes = sql_rows(engine.storage.database.location, "SELECT embedding_bits FROM message_vectors")
    assert {len(code) for code, in codes} == {13}  # 100 bits + 4 zero bits
    result = engine.search("pizza night", guild_id=GUILD, limit=1, mode="dense")
    assert result.hits[0].content == "pizza night friday"


def test_code_stats_count_the_set_bits_per_guild(
    engine: MemoryEngine, make_record: MakeRecord
) -> None:
    records = [make_record(f"note {i} on the garden") for i in range(12)]
    records += [make_record(f"other server {i}", guild_id=GUILD + 1) for i in range(3)]
    engine.ingest(records)
    db = engine.storage.database.location
    for guild, expected_count in ((GUILD, 12), (GUILD + 1, 3)):
        count, ones = sql_rows(db, "SELECT vectors, ones FROM code_stats WHERE guild_id = ?",
                               (guild,))[0]
        vectors = [
            np.frombuffer(v, dtype=np.float32)
            for v, in sql_rows(db, "SELECT embedding FROM message_vectors WHERE guild_id = ?",
                               (guild,))
        ]
        assert count == expected_count
        np.testing.assert_array_equal(
            np.frombuffer(ones, dtype=np.int64), (np.stack(vectors) > 0).sum(axis=0)
        )
    # the expected distance is the mean Hamming distance to the guild's codes
    query = engine.embedder.embed(["garden"])[0] > 0
    codes = [
        np.unpackbits(np.frombuffer(c, np.uint8), bitorder="little")[:128].astype(bool)
        for c, in sql_rows(db, "SELECT embedding_bits FROM message_vectors WHERE guild_id = ?",
                           (GUILD,))
    ]
    mean = np.mean([(code != query).sum() for code in codes])
    table = engine.storage.vectors.table
    assert table.expected_distance(query, GUILD) == pytest.approx(mean)
    assert table.expected_distance(query, GUILD + 7) == 0.0  # nothing known: no guess
    engine.reembed()
    assert sql_rows(db, "SELECT sum(vectors) FROM code_stats")[0][0] == 15


def test_floats_read_from_the_shadow_table_equal_the_vec0_query(
    engine: MemoryEngine, make_record: MakeRecord
) -> None:
    records = [make_record(f"note {i} about the garden") for i in range(12)]
    engine.ingest(records)
    ids = [r.id for r in records[::2]] + [123]  # and one id without a vector
    table = engine.storage.vectors.table
    fast = table.floats(ids)
    assert table._auxiliary is True  # this sqlite-vec keeps +embedding in a shadow table
    table._auxiliary = False  # what a differently laid-out release would get
    slow = table.floats(ids)
    assert set(fast) == set(slow) == {r.id for r in records[::2]}
    for mid in fast:
        np.testing.assert_array_equal(fast[mid], slow[mid])
        np.testing.assert_array_equal(fast[mid], stored_vector(engine.storage, mid))


@pytest.mark.parametrize("point_lookups_max", [0, 1000])
def test_deleted_vectors_and_their_code_counts_go_either_way(
    engine, make_record, monkeypatch, point_lookups_max
):
    """Deleting vectors by primary-key lookups (few ids) or one scan (many) leaves the same state."""
    monkeypatch.setattr(vectors, "POINT_LOOKUPS_MAX", point_lookups_max)
    records = [make_record(f"note {i} about tomatoes") for i in range(30)]
    engine.ingest(records)
    db = engine.storage.database.location
    kept = records[10:]
    removed = engine.forget_messages([r.id for r in records[:10]] + [123456789])  # one never stored
    assert removed == 10
    left = {row[0] for row in sql_rows(db, "SELECT message_id FROM message_vectors")}
    assert left <= {r.id for r in kept}, "no deleted message keeps a vector"
    assert len(left) >= len(kept) - 2, "only neighbours that quoted them wait to be re-embedded"
    # the code counts are those of the vectors that are left
    (count, ones), = sql_rows(db, "SELECT vectors, ones FROM code_stats")
    floats = engine.storage.vectors.floats(sorted(left))
    expected = sum((np.asarray(v) > 0).astype(np.int64) for v in floats.values())
    assert count == len(left)
    assert np.array_equal(np.frombuffer(ones, dtype=np.int64), expected)
