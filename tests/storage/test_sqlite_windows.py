"""The SQLite file written before windows (or their vectors) existed: the migrations
index the stored messages' windows and compute their window vectors."""

from __future__ import annotations

from collections.abc import Callable

import pytest

from memory.engine import MemoryEngine
from memory.filters import Filters
from memory.records import MessageRecord
from memory.storage import open_storage
from memory.storage.sqlite.connection import connect
from memory.storage.sqlite.migrations import MIGRATIONS, statements
from memory.storage.windows import GAP_MS
from tests.storage.test_windows import LINES, assert_window_vectors_fresh, conversation
from tests.support.builders import CHANNEL, GUILD
from tests.support.inspection import SQLiteInspector
from tests.support.sqlite import sql_write

MakeRecord = Callable[..., MessageRecord]


@pytest.fixture
def storage_kind() -> str:
    """These tests write SQLite files as older versions left them."""
    return "sqlite"


def test_the_window_gap_is_the_contracts() -> None:
    from tests.storage import test_windows

    assert test_windows.GAP_MS == GAP_MS


def test_upgrading_an_older_database_indexes_its_messages(
    make_location: Callable[[str], str], make_record: MakeRecord
) -> None:
    path = make_location("old")
    conn = connect(path)
    for migration in MIGRATIONS[:5]:  # the schema before windows
        if callable(migration):
            migration(conn)
        else:
            for statement in statements(migration):
                conn.execute(statement)
    conn.execute("PRAGMA user_version = 5")
    records = conversation(make_record, LINES)
    conn.execute("INSERT INTO guilds(id) VALUES (?)", (GUILD,))
    conn.execute("INSERT INTO channels(id, guild_id) VALUES (?, ?)", (CHANNEL, GUILD))
    for r in records:
        conn.execute("INSERT OR IGNORE INTO authors(id, display_name) VALUES (?, ?)",
                     (r.author_id, r.author_display_name))
        conn.execute("INSERT INTO messages(id, guild_id, channel_id, author_id, created_at, "
                     "content) VALUES (?, ?, ?, ?, ?, ?)",
                     (r.id, GUILD, CHANNEL, r.author_id, r.created_at, r.content))
    conn.close()
    storage = open_storage(path)
    try:
        assert storage.stats().schema_version == len(MIGRATIONS)
        assert "hundred bucks" in SQLiteInspector(path).window_text(records[1].id)
        found = storage.keywords.ranked(["bucks"], 10, Filters())
        assert {mid for mid, _ in found} == {records[0].id}
    finally:
        storage.close()


def test_upgrading_computes_the_window_vectors_of_stored_messages(
    engine: MemoryEngine, make_record: MakeRecord
) -> None:
    records = conversation(make_record, LINES)
    engine.ingest(records)
    path = engine.storage.database.location
    engine.close()
    # the database as migration 7 left it
    sql_write(path, "DROP TABLE window_vectors", "PRAGMA user_version = 7")
    storage = open_storage(path)
    try:
        assert storage.stats().schema_version == len(MIGRATIONS)
        assert len(storage.vectors.window_vectors([r.id for r in records])) == 4
        assert_window_vectors_fresh(storage, SQLiteInspector(path), [r.id for r in records])
    finally:
        storage.close()
