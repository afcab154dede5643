"""The SQLite database file: the one ``connect()`` (sqlite-vec loaded, via pysqlite3
where needed; FTS5; WAL), a clear error when no driver can load extensions,
idempotent migrations, foreign and read-only files, and the second connection."""

from __future__ import annotations

import os
import sqlite3
import sys
import time
from pathlib import Path

import pytest

import memory.storage.sqlite.connection
from memory.errors import DatabaseFileError, ExtensionLoadError, MemoryBotError
from memory.storage import open_storage
from memory.storage.sqlite.connection import connect, sqlite_driver
from memory.storage.sqlite.migrations import MIGRATIONS, migrate
from tests.support.sqlite import sql_rows


@pytest.fixture
def storage_kind() -> str:
    """These tests are about the SQLite file itself."""
    return "sqlite"


def _stdlib_can_load_extensions() -> bool:
    conn = sqlite3.connect(":memory:")
    try:
        if not hasattr(conn, "enable_load_extension"):
            return False
        import sqlite_vec

        conn.enable_load_extension(True)
        sqlite_vec.load(conn)
        return True
    except Exception:
        return False
    finally:
        conn.close()


def test_connect_loads_sqlite_vec(tmp_db: str) -> None:
    conn = connect(tmp_db)
    try:
        (version,) = conn.execute("SELECT vec_version()").fetchone()
        assert version.startswith("v")
        # a vec0 table answers a KNN query
        conn.execute("CREATE VIRTUAL TABLE v USING vec0(embedding float[2])")
        conn.execute("INSERT INTO v(rowid, embedding) VALUES (1, '[1, 0]'), (2, '[0, 1]')")
        rows = conn.execute(
            "SELECT rowid FROM v WHERE embedding MATCH '[0.9, 0.1]' AND k = 1"
        ).fetchall()
        assert rows == [(1,)]
    finally:
        conn.close()


def test_connect_has_fts5_and_wal(tmp_db: str) -> None:
    conn = connect(tmp_db)
    try:
        conn.execute("CREATE VIRTUAL TABLE t USING fts5(body)")
        conn.execute("INSERT INTO t(body) VALUES ('state of the art soldering')")
        assert conn.execute("SELECT count(*) FROM t WHERE t MATCH 'solder*'").fetchone() == (1,)
        assert conn.execute("PRAGMA journal_mode").fetchone()[0].lower() == "wal"
        assert conn.execute("PRAGMA foreign_keys").fetchone() == (1,)
    finally:
        conn.close()


def test_driver_is_cached_and_usable() -> None:
    driver = sqlite_driver()
    assert sqlite_driver() is driver
    assert driver.__name__ in ("sqlite3", "pysqlite3.dbapi2")


def test_clear_error_when_no_driver_can_load_extensions(
    monkeypatch: pytest.MonkeyPatch, tmp_db: str
) -> None:
    if _stdlib_can_load_extensions():
        pytest.skip("this Python's sqlite3 can load extensions itself; no fallback to test")
    monkeypatch.setattr(memory.storage.sqlite.connection, "_driver", None)
    monkeypatch.setitem(sys.modules, "pysqlite3", None)
    monkeypatch.setitem(sys.modules, "pysqlite3.dbapi2", None)
    with pytest.raises(ExtensionLoadError) as excinfo:
        connect(tmp_db)
    message = str(excinfo.value)
    assert "pysqlite3-binary" in message
    assert "extension" in message
    assert not Path(tmp_db).exists()  # failed before touching the file


def test_fallback_driver_is_pysqlite3_when_stdlib_cannot_load() -> None:
    if _stdlib_can_load_extensions():
        pytest.skip("the stdlib sqlite3 loads extensions here")
    assert sqlite_driver().__name__ == "pysqlite3.dbapi2"


def test_migrations_are_idempotent(tmp_db: str) -> None:
    first = open_storage(tmp_db)
    first.close()
    second = open_storage(tmp_db)  # opening again must not re-run anything
    try:
        assert second.stats().schema_version == len(MIGRATIONS)
    finally:
        second.close()
    conn = connect(tmp_db)
    try:
        assert migrate(conn) == len(MIGRATIONS)
        assert conn.execute("PRAGMA user_version").fetchone() == (len(MIGRATIONS),)
        tables = {row[0] for row in conn.execute("SELECT name FROM sqlite_master")}
        assert {"meta", "guilds", "channels", "authors", "messages", "search_fts", "window_fts",
                "search_text"} <= tables
    finally:
        conn.close()


def test_newer_schema_is_refused(tmp_db: str) -> None:
    open_storage(tmp_db).close()
    conn = connect(tmp_db)
    conn.execute(f"PRAGMA user_version = {len(MIGRATIONS) + 1}")
    conn.close()
    with pytest.raises(DatabaseFileError, match="newer"):
        open_storage(tmp_db)


def test_not_a_database_file_is_a_clear_error(tmp_path: Path) -> None:
    path = tmp_path / "notes.sqlite3"
    path.write_text("these are my notes, not a database\n" * 200)
    with pytest.raises(MemoryBotError, match="not a usable SQLite database"):
        open_storage(path)
    assert path.read_text().startswith("these are my notes")  # left untouched


def test_foreign_database_is_a_clear_error(tmp_path: Path) -> None:
    path = tmp_path / "other-app.sqlite3"
    conn = connect(path)
    conn.execute("CREATE TABLE messages (x TEXT)")
    conn.execute("INSERT INTO messages VALUES ('keep me')")
    conn.close()
    with pytest.raises(DatabaseFileError, match="another application's tables"):
        open_storage(path)
    conn = connect(path)
    try:  # the failed migration was rolled back entirely
        assert conn.execute("SELECT x FROM messages").fetchall() == [("keep me",)]
        assert conn.execute("PRAGMA user_version").fetchone() == (0,)
        assert conn.execute("SELECT count(*) FROM sqlite_master WHERE name = 'meta'").fetchone() == (0,)
    finally:
        conn.close()


def test_directory_as_database_is_a_clear_error(tmp_path: Path) -> None:
    with pytest.raises(DatabaseFileError):
        open_storage(tmp_path)


def _open_and_close(path_and_start: tuple[str, float]) -> str:
    path, start = path_and_start
    while time.time() < start:  # every process opens at the same instant
        pass
    try:
        open_storage(path).close()
    except Exception as exc:  # reported to the parent, which asserts there are none
        return f"{type(exc).__name__}: {exc}"
    return ""


def test_processes_opening_a_new_database_at_once_all_succeed(tmp_path: Path) -> None:
    """The schema version is read under the write lock: each migration runs exactly once."""
    import multiprocessing

    context = multiprocessing.get_context("spawn")
    with context.Pool(4) as pool:
        pool.map(_open_and_close, [(str(tmp_path / "warm-up.sqlite3"), 0.0)] * 4)  # imports
        for round_ in range(5):
            path = str(tmp_path / f"new-{round_}.sqlite3")
            start = time.time() + 0.2
            errors = [e for e in pool.map(_open_and_close, [(path, start)] * 4) if e]
            assert errors == [], errors
            conn = connect(path)
            try:
                assert migrate(conn) == len(MIGRATIONS)
                names = [r[0] for r in conn.execute("SELECT name FROM sqlite_master")]
                assert len(names) == len(set(names))
            finally:
                conn.close()


@pytest.mark.parametrize("script, expected", [
    ("CREATE TABLE a (x);\nCREATE TABLE b (y);", ["CREATE TABLE a (x);", "CREATE TABLE b (y);"]),
    ("CREATE TRIGGER t AFTER INSERT ON a BEGIN\n  INSERT INTO b VALUES (1);\nEND;",
     ["CREATE TRIGGER t AFTER INSERT ON a BEGIN\n  INSERT INTO b VALUES (1);\nEND;"]),
    ("\n  \n", []),
    ("SELECT ';'; SELECT 2;", ["SELECT ';';", "SELECT 2;"]),
])
def test_migration_scripts_split_into_statements(script: str, expected: list[str]) -> None:
    from memory.storage.sqlite.migrations import statements

    assert list(statements(script)) == expected


# -- read-only files and foreign files ------------------------------------------------------


def _journal_mode(path: Path) -> str:
    conn = sqlite3.connect(path)
    try:
        return conn.execute("PRAGMA journal_mode").fetchone()[0].lower()
    finally:
        conn.close()


def test_a_foreign_sqlite_file_keeps_its_journal_mode(tmp_path: Path) -> None:
    path = tmp_path / "other-app.sqlite3"
    conn = sqlite3.connect(path)
    conn.execute("CREATE TABLE notes (x TEXT)")
    conn.commit()
    conn.close()
    assert _journal_mode(path) == "delete"
    with pytest.raises(DatabaseFileError, match="another application's tables"):
        open_storage(path)
    assert _journal_mode(path) == "delete"  # never flipped to WAL


@pytest.mark.parametrize("journal", ["delete", "wal"])
@pytest.mark.parametrize("user_version", [0, 1, 3, len(MIGRATIONS) - 1, 7, 42])
def test_another_applications_sqlite_file_is_left_byte_identical(
    tmp_path: Path, capsys: pytest.CaptureFixture, user_version: int, journal: str
) -> None:
    """Whatever its user_version claims, a file with another application's tables is
    refused before anything writes to it: no migration, no journal-mode switch."""
    import bot

    path = tmp_path / "other-app.sqlite3"
    conn = sqlite3.connect(path)
    conn.execute(f"PRAGMA journal_mode={journal}")
    conn.execute("CREATE TABLE notes (x TEXT)")
    conn.execute("CREATE TABLE meta (key TEXT PRIMARY KEY, value TEXT)")  # a name we use too
    conn.execute("INSERT INTO notes VALUES ('keep me')")
    conn.execute(f"PRAGMA user_version = {user_version}")
    conn.commit()
    conn.close()
    before = path.read_bytes()
    with pytest.raises(DatabaseFileError, match="another application's tables"):
        open_storage(path)
    for command in (["stats"], ["--profile", "cpu-fast", "search", "x"], ["embed"]):
        assert bot.main(["--db", str(path), *command]) == 2
        (line,) = capsys.readouterr().err.splitlines()
        assert line.startswith("error: ") and "another application's tables (meta, notes)" in line
    assert path.read_bytes() == before
    assert sorted(p.name for p in tmp_path.iterdir()) == ["other-app.sqlite3"]
    assert _journal_mode(path) == journal


def test_new_and_own_databases_use_wal(tmp_path: Path) -> None:
    path = tmp_path / "ours.sqlite3"
    open_storage(path).close()
    assert _journal_mode(path) == "wal"


@pytest.mark.skipif(sys.platform == "win32" or os.geteuid() == 0,
                    reason="file permissions do not bind root")
def test_a_file_without_write_permission_is_opened_read_only(tmp_path: Path) -> None:
    path = tmp_path / "ro.sqlite3"
    open_storage(path).close()
    path.chmod(0o444)
    storage = open_storage(path)
    try:
        assert storage.database.read_only and storage.stats().messages == 0
    finally:
        storage.close()


def test_wal_mode_on_the_storage(storage) -> None:
    assert sql_rows(storage.database.location, "PRAGMA journal_mode")[0][0].lower() == "wal"


def test_the_second_connection_cannot_write(storage) -> None:
    """Keyword lists are read beside the KNN on a read-only connection of their own."""
    with pytest.raises(Exception, match="readonly|read-only|read only"):
        storage.database.read_beside("DELETE FROM search_text")
