"""Tests that run once per storage engine: where the database is, how to look under
the contract, and another writer holding the database's write lock.

A pytest plugin (``tests/conftest.py`` loads it), so ``tests/storage/``,
``tests/discord/`` and the top-level tests share it.  A test that takes
``storage_kind`` — itself, or through ``make_location``, ``db_location`` or
``inspector`` — runs once per engine of :data:`ENGINES`; the ``postgres`` leg runs on
the session's server (:mod:`tests.support.postgres`) and skips with the reason where
that cannot start.  A test that must stay on one engine parametrises ``storage_kind``
itself (``@pytest.mark.parametrize("storage_kind", ["sqlite"])``) or overrides the
fixture in its module.
"""

from __future__ import annotations

import contextlib
import threading
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest

from memory.storage import Storage
from memory.storage.postgres.connection import is_postgres_url
from tests.support.inspection import Inspector, SQLiteInspector
from tests.support.postgres_inspection import PostgresInspector

ENGINES = ["sqlite", pytest.param("postgres", marks=pytest.mark.postgres)]
"""The engines a test parametrised by ``storage_kind`` runs against."""


@pytest.fixture(params=ENGINES)
def storage_kind(request: pytest.FixtureRequest) -> str:
    """Which storage engine this run of the test uses."""
    return str(request.param)


@pytest.fixture
def make_location(storage_kind: str, tmp_path: Path,
                  request: pytest.FixtureRequest) -> Callable[[str], str]:
    """Factory: a fresh, empty database location of this engine, one per ``name``."""
    made: dict[str, str] = {}

    def make(name: str = "memory") -> str:
        if storage_kind == "sqlite":
            return str(tmp_path / f"{name}.sqlite3")
        if storage_kind == "postgres":
            if name not in made:
                made[name] = request.getfixturevalue("postgres_url")()
            return made[name]
        raise AssertionError(f"no locations for storage engine {storage_kind!r}")

    return make


@pytest.fixture
def db_location(make_location: Callable[[str], str]) -> str:
    """The test's database location: an SQLite file in ``tmp_path`` or a fresh
    PostgreSQL database (its URL)."""
    return make_location("bot")


def inspect(storage: Storage) -> Inspector:
    """An :class:`Inspector` for a storage's database, whichever engine it is."""
    if is_postgres_url(storage.database.location):
        return PostgresInspector(storage.database.url)  # type: ignore[attr-defined]
    return SQLiteInspector(storage.database.location)


@pytest.fixture
def inspector(storage_kind: str) -> Callable[[Storage], Inspector]:
    """Factory: an :class:`Inspector` for a storage's database."""
    return inspect


def holds_text(storage: Storage, text: str) -> bool:
    """Whether the database holds ``text``, or a word the keyword index makes of it (an
    FTS5 stem), anywhere :meth:`Inspector.contents` looks: SQLite's file and WAL bytes,
    PostgreSQL's rows."""
    from memory.storage.tokens import tokenizer

    contents = inspect(storage).contents()
    needles = {text, *(word for word in tokenizer().words(text) if len(word) >= 6)}
    return any(needle.encode() in contents for needle in needles)


@contextlib.contextmanager
def another_writer(storage: Storage, *, wait_s: float) -> Iterator[Callable[[], None]]:
    """Another session holds the database's write lock; this storage's writes wait
    ``wait_s`` for it, then raise :class:`~memory.errors.StorageBusy`.

    SQLite: another connection's ``BEGIN IMMEDIATE``.  PostgreSQL: another session's
    ``LOCK TABLE messages IN EXCLUSIVE MODE`` (reads go on; every write of a message
    waits).  Yields ``release``, which ends the other session's transaction (at the
    end of the block at the latest); it may be called from another thread.
    """
    database: Any = storage.database
    database.set_busy_timeout(wait_s)
    if is_postgres_url(database.location):
        import psycopg

        other = psycopg.connect(database.url, autocommit=True)
        other.execute("BEGIN")
        other.execute("LOCK TABLE messages IN EXCLUSIVE MODE")
    else:
        from memory.storage.sqlite.connection import connect

        other = connect(database.location, check_same_thread=False)
        other.execute("BEGIN IMMEDIATE")
    lock = threading.Lock()
    held = [True]

    def release() -> None:
        with lock:
            if held[0]:
                held[0] = False
                other.execute("COMMIT")
                other.close()

    try:
        yield release
    finally:
        release()
        database.set_busy_timeout(None)
