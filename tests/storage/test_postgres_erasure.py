"""Forgotten text leaves a PostgreSQL server's files when the operator runs the documented steps.

The bot deletes rows; their bytes stay in the table files until ``VACUUM FULL``
rewrites them, and in the write-ahead log until its segments go.  A checkpoint
lets old segments go, but by default PostgreSQL *recycles* them (renames them for
reuse, contents and all), so the text stays under ``pg_wal/`` until overwritten.
With ``wal_recycle = off`` they are deleted instead.  The test runs the commands of
docs/privacy.md, as written there, on the test session's real server, then reads every
file under its data directory (issue 30.6).
"""

from __future__ import annotations

import random
import re
import string
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest

from memory.filters import Filters
from memory.records import MessageRecord
from memory.storage.postgres import PostgresStorage, migrations
from memory.storage.postgres.migrations import TEXT_COLUMNS
from memory.storage.tokens import tokenizer
from tests.support.builders import BASE_MS, CHANNEL, GUILD, snowflake
from tests.support.postgres import PostgresServer, database_name

pytestmark = pytest.mark.postgres

PRIVACY_DOC = Path(__file__).resolve().parents[2] / "docs" / "privacy.md"
# Words no other test writes: the session's server recycles old WAL segments (other
# tests' words and all) until this test turns that off, so a word shared with another
# test (test_migrate_db's "zanzibarquokka" held "quokka") can be found in a segment this
# test never wrote.  Each run draws its own.
_RUN = "".join(random.Random().choices(string.ascii_lowercase, k=10))
SECRET = f"the {_RUN}quokka smuggler hides under {_RUN}wharf"
NAME = f"{_RUN}queen"  # the forgotten member's name
ONCE = "ALTER SYSTEM SET wal_recycle = off;\nSELECT pg_reload_conf();"
AFTER_A_FORGET = ("VACUUM FULL messages, search_text, message_postings, window_postings, "
                  "keyword_terms,\n  member_names, authors, channels, guilds, pg_statistic;\n"
                  "SELECT pg_switch_wal();\nCHECKPOINT;")


def statements(block: str) -> list[str]:
    """The SQL statements of a documented block, as psql sends them (comments dropped)."""
    text = " ".join(line.split("--")[0].strip() for line in block.splitlines())
    return [sql.strip() for sql in text.split(";") if sql.strip()]


def documented_blocks() -> str:
    """Every ```sql block of docs/privacy.md, joined."""
    return "\n".join(re.findall(r"```sql\n(.*?)```", PRIVACY_DOC.read_text(encoding="utf-8"), re.S))


def files_holding(folder: Path, database_oid: int, needles: set[bytes]) -> list[str]:
    """The server's files holding any of ``needles``: the WAL, the shared catalogs and the
    database's own files (the session's other databases, gigabytes of them, cannot)."""
    found = []
    places = [folder / "pg_wal", folder / "global", folder / "base" / str(database_oid)]
    for path in (p for place in places for p in place.rglob("*")):
        try:
            data = path.read_bytes() if path.is_file() else b""
        except OSError:  # a file removed while we walk (a temporary stats file)
            continue
        if any(needle in data for needle in needles):
            found.append(str(path.relative_to(folder)))
    return found


@pytest.fixture
def server(postgres_server: PostgresServer) -> Iterator[PostgresServer]:
    """The session's server; ``wal_recycle`` is back to its default afterwards."""
    yield postgres_server
    with postgres_server.connect("postgres") as admin:
        admin.execute("ALTER SYSTEM RESET wal_recycle")
        admin.execute("SELECT pg_reload_conf()")


def settled(server: PostgresServer, timeout_s: float = 10.0) -> None:
    """Wait until the server has taken ``wal_recycle = off`` in.

    ``pg_reload_conf()`` only signals the postmaster, which passes the signal on to the
    checkpointer: a CHECKPOINT sent straight after it could still recycle the old
    segments (contents and all) under a new name.  A new session shows the setting once
    the postmaster has reloaded, and the checkpointer reloads before its next
    checkpoint.  (An operator runs "once" long before a forget; the test runs it just
    before one, so it waits.)
    """
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        with server.connect("postgres") as conn:
            if conn.execute("SHOW wal_recycle").fetchone()[0] == "off":
                return
        time.sleep(0.05)
    raise AssertionError("the server did not take wal_recycle = off in")


def test_the_privacy_doc_names_the_steps_this_test_runs() -> None:
    blocks = documented_blocks()
    assert ONCE in blocks and AFTER_A_FORGET in blocks


def test_forgotten_text_leaves_the_table_files_and_the_wal(
    server: PostgresServer, postgres_url: Callable[..., str]
) -> None:
    url = postgres_url()
    with server.connect("postgres") as admin:  # the documented "once", done before any forget
        for sql in statements(ONCE):
            admin.execute(sql)
    settled(server)
    storage = PostgresStorage(url)
    records = [MessageRecord(
        id=snowflake(BASE_MS + i, i), guild_id=GUILD, channel_id=CHANNEL, author_id=77,
        created_at=BASE_MS + i, content=f"{SECRET} ({i})", author_name=NAME,
        channel_name="general") for i in range(40)]
    storage.messages.upsert(records)
    with server.connect(database_name(url)) as conn:
        # what autovacuum does on its own on a live server, at a moment of its choosing
        # (in the long CI session it did, and the text stayed in pg_statistic)
        conn.execute("ANALYZE")
        conn.execute("CHECKPOINT")  # the rows reach the table files, as on any server later
        oid = conn.execute("SELECT oid FROM pg_database WHERE datname = current_database()"
                           ).fetchone()[0]
        needles = {SECRET.encode(), NAME.encode(),
                   *(word.encode() for word in tokenizer().words(SECRET) if _RUN in word)}
        assert any(f.startswith("base") for f in files_holding(server.folder, oid, needles))

        assert storage.forgetting.forget_member(GUILD, 77) == len(records)
        storage.close()
        left = files_holding(server.folder, oid, needles)
        assert any(f.startswith("pg_wal") for f in left)  # the test reads the right bytes

        for sql in statements(AFTER_A_FORGET):  # as psql -c runs each
            conn.execute(sql)
        # where the WAL stood, should the assertion below ever fail again
        state = (conn.execute("SELECT pg_walfile_name(pg_current_wal_lsn())").fetchone(),
                 sorted(p.name for p in (server.folder / "pg_wal").iterdir()))
    assert files_holding(server.folder, oid, needles) == [], state


def analyzed_columns(conn: Any) -> set[tuple[str, str]]:
    """The (table, column) pairs of this database that pg_statistic holds values of."""
    return {tuple(row) for row in conn.execute(
        "SELECT tablename, attname FROM pg_stats WHERE schemaname = current_schema() "
        "AND (most_common_vals IS NOT NULL OR histogram_bounds IS NOT NULL)").fetchall()}


TEXT = {(table, column) for table, columns in TEXT_COLUMNS.items() for column in columns}


@pytest.mark.parametrize("clear_function", [True, False], ids=["pg18-clear", "older-alter-type"])
def test_migration_8_takes_text_out_of_the_statistics(
    server: PostgresServer, postgres_url: Callable[..., str], clear_function: bool
) -> None:
    """A database an older version analyzed: its text columns' statistics are removed and
    never gathered again; the other columns keep theirs."""
    url = postgres_url()
    storage = PostgresStorage(url)
    storage.messages.upsert([MessageRecord(
        id=snowflake(BASE_MS + i, i), guild_id=GUILD, channel_id=CHANNEL, author_id=70 + i % 5,
        created_at=BASE_MS + i, content=f"{_RUN} note {i} " + "word " * (i % 7),
        author_name=f"{_RUN}member{i % 5}", channel_name="general") for i in range(300)])
    storage.close()
    with server.connect(database_name(url)) as conn:  # as an older version left it
        for table, column in TEXT:
            conn.execute(f"ALTER TABLE {table} ALTER COLUMN {column} SET STATISTICS -1")
        conn.execute("ANALYZE")
        assert TEXT & analyzed_columns(conn)  # the test reads the right catalog
        conn.execute("DELETE FROM schema_migrations WHERE version >= 8")
        if not clear_function:  # PostgreSQL before 18 has no pg_clear_attribute_stats
            migrations.text_out_of_statistics(WithoutClearFunction(conn))
            conn.execute("INSERT INTO schema_migrations(version) VALUES (8)")
    again = PostgresStorage(url)
    try:
        assert again.database.schema_version() >= 8
        with server.connect(database_name(url)) as conn:
            assert not TEXT & analyzed_columns(conn)
            conn.execute("ANALYZE")
            left = analyzed_columns(conn)
            assert not TEXT & left and ("messages", "created_at") in left
            # the set-aside trigger is back (the older path drops it around the change)
            assert conn.execute("SELECT count(*) FROM pg_trigger WHERE tgname = "
                                "'embedding_set_aside_au'").fetchone() == (1,)
        assert len(again.keywords.ranked([_RUN], 5, Filters(guild_id=GUILD))) == 5
    finally:
        again.close()


class WithoutClearFunction:
    """A connection to a real server that answers as one before PostgreSQL 18 would:
    no ``pg_clear_attribute_stats`` (nothing else differs for this migration)."""

    def __init__(self, conn: Any) -> None:
        self.conn = conn

    def execute(self, sql: str, params: Any = None) -> Any:
        if "to_regproc('pg_clear_attribute_stats')" in sql:
            return self.conn.execute("SELECT NULL::regproc")
        assert "pg_clear_attribute_stats(" not in sql
        return self.conn.execute(sql, params)
