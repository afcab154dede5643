"""Issue 31, item 3: a damaged vector index.

SQLite: a sqlite-vec table whose chunk of 1-bit codes was cut short, one of whose
float vectors has the wrong size, or one of whose shadow tables is gone (a bad
sector, a hand edit, a half-copied file).  ``search`` answers from the keyword index
(with the same allow-list) and names the repair, ``stats`` says the index is damaged,
and ``reembed`` rebuilds every vector table from the stored text whatever state it
is in.  PostgreSQL checks its own pages; what can be missing there is the table or
its HNSW graph, which ``stats`` reports and ``reembed`` rebuilds.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import replace

import pytest

from memory.engine import MemoryEngine
from memory.records import MessageRecord
from memory.search import SearchRequest
from memory.storage.sqlite.connection import connect
from tests.support.builders import CHANNEL, GUILD, HashEmbedder

MakeRecord = Callable[..., MessageRecord]
PRIVATE = CHANNEL + 1

DAMAGE = {
    "a cut chunk of codes": "UPDATE message_vectors_vector_chunks00 SET vectors = substr(vectors, 1, 10)",
    "a float vector of the wrong size": "UPDATE message_vectors_auxiliary SET value00 = zeroblob(12) "
                                        "WHERE rowid = (SELECT min(rowid) FROM message_vectors_auxiliary)",
    "no chunk table": "DROP TABLE message_vectors_chunks",
    "no code chunks": "DROP TABLE message_vectors_vector_chunks00",
    "no float table": "DROP TABLE message_vectors_auxiliary",
    "no row ids": "DROP TABLE message_vectors_rowids",
    "no filter column chunk": "DROP TABLE message_vectors_metadatachunks00",
    "no info table": "DROP TABLE message_vectors_info",
}
BREAKS_SEARCH = {"a cut chunk of codes", "a float vector of the wrong size", "no chunk table",
                 "no code chunks", "no float table", "no filter column chunk"}


def stored(make_engine: Callable[..., MemoryEngine], make_record: MakeRecord,
           location: str) -> list[MessageRecord]:
    """Thirty notes in a public channel and thirty in a private one, embedded."""
    records = [make_record(f"note {i} about the garden shed", channel_id=CHANNEL)
               for i in range(30)]
    records += [make_record(f"secret {i} about the garden shed", channel_id=PRIVATE,
                            channel_name="private") for i in range(30)]
    engine = make_engine(location, HashEmbedder(), context="none")
    engine.ingest(records)
    engine.close()
    return records


def search(engine: MemoryEngine) -> tuple[set[int], str | None]:
    """A hybrid search by a member who may read only the public channel."""
    result = engine.search(SearchRequest(queries=("garden shed",), guild_id=GUILD, limit=20,
                                         allowed_channel_ids=frozenset({CHANNEL})))
    return {hit.channel_id for hit in result.hits}, result.trace.keyword_only


@pytest.mark.parametrize("storage_kind", ["sqlite"])
@pytest.mark.parametrize("damage", list(DAMAGE))
def test_a_damaged_sqlite_vector_table_is_searched_by_keywords_reported_and_rebuilt(
    make_engine: Callable[..., MemoryEngine], make_record: MakeRecord, tmp_db: str, damage: str,
) -> None:
    stored(make_engine, make_record, tmp_db)
    conn = connect(tmp_db)
    conn.execute(DAMAGE[damage])
    conn.close()

    engine = make_engine(tmp_db, HashEmbedder(), context="none")
    channels, keyword_only = search(engine)
    assert channels == {CHANNEL}  # answered, and never from the channel the member cannot read
    if damage in BREAKS_SEARCH:
        assert keyword_only is not None and "damaged" in keyword_only
        assert "python bot.py reembed" in keyword_only
    state = engine.storage.stats().vector_index
    assert state.startswith("damaged (") and "reembed" in state, state

    assert engine.reembed() == 60
    assert engine.storage.stats().vector_index == "ok"
    assert engine.storage.vectors.count(GUILD) == 60
    assert engine.storage.backlog.pending_count() == 0
    assert search(engine) == ({CHANNEL}, None)  # vectors again


def test_stats_says_ok_or_none_for_a_whole_index(
    make_engine: Callable[..., MemoryEngine], make_record: MakeRecord, tmp_db: str,
) -> None:
    engine = make_engine(tmp_db, HashEmbedder(), context="none")
    assert engine.storage.stats().vector_index == "none"
    engine.ingest([make_record("a note about the garden")])
    assert engine.storage.stats().vector_index == "ok"


@pytest.mark.postgres
@pytest.mark.parametrize("storage_kind", ["postgres"])
def test_a_missing_hnsw_graph_on_postgres_is_reported_and_rebuilt_by_reembed(
    make_engine: Callable[..., MemoryEngine], make_record: MakeRecord, tmp_db: str,
) -> None:
    stored(make_engine, make_record, tmp_db)
    engine = make_engine(tmp_db, HashEmbedder(), context="none")
    with engine.storage.database.write() as conn:
        conn.execute("DROP INDEX message_vectors_hnsw_halfvec")
    state = engine.storage.stats().vector_index
    assert state.startswith("damaged (missing: message_vectors_hnsw_halfvec)"), state
    assert search(engine) == ({CHANNEL}, None)  # exact search still answers
    assert engine.reembed() == 60
    assert engine.storage.stats().vector_index == "ok"
    assert engine.storage.vectors.count(GUILD) == 60


@pytest.mark.parametrize("storage_kind", ["sqlite"])
@pytest.mark.parametrize("damage", list(DAMAGE))
def test_deleting_editing_and_storing_never_fail_on_a_damaged_sqlite_vector_table(
    make_engine: Callable[..., MemoryEngine], make_record: MakeRecord, tmp_db: str, damage: str,
) -> None:
    """A deleted message's vector must go and an edit must be stored even when vec0
    cannot delete rows: the damaged table goes whole, and the backlog embeds again."""
    records = stored(make_engine, make_record, tmp_db)
    conn = connect(tmp_db)
    conn.execute(DAMAGE[damage])
    conn.close()
    engine = make_engine(tmp_db, HashEmbedder(), context="none")
    forgotten, edited = records[3], replace(records[5], content="the shed burned down",
                                            edited_at=1)
    assert engine.storage.forgetting.forget_messages([forgotten.id]) == 1
    engine.ingest([edited, make_record("a brand new note about the garden shed")])
    engine.embed_pending()

    storage = engine.storage
    assert storage.stats().vector_index == "ok"
    assert storage.backlog.pending_count() == 0
    assert storage.vectors.count(GUILD) == storage.messages.count() == 60
    assert forgotten.id not in storage.vectors.floats([forgotten.id])
    found = engine.search("note 3 about the garden shed", guild_id=GUILD, mode="dense", limit=60)
    assert forgotten.id not in {hit.id for hit in found.hits}
    assert storage.messages.hydrate([edited.id])[edited.id].content == "the shed burned down"
