"""The PostgreSQL database: a pool of connections and the transactions every noun
writes through.

:meth:`PostgresDatabase.write` takes a connection from the pool, opens a transaction
and yields the connection; nouns pass it to each other's in-transaction methods, so a
message and its indexes change together, exactly as on SQLite.  Inside a ``write`` on
the same thread :meth:`PostgresDatabase.read` runs on that transaction's connection
(and sees its rows); elsewhere it borrows any pooled connection, so searches run
concurrently with each other and with writes.

SQLite has one writer at a time; PostgreSQL lets transactions run side by side, so a
writer takes the locks that keep the contract's promises where two could collide:

* :func:`lock_ids` — an upsert and a forget of the same message ids wait for each
  other (``message_locks``), so a forget never misses a row another process is
  inserting, and a forgotten id is never stored again.
* :func:`lock_guilds` — every write that rebuilds a guild's conversational windows
  or window vectors holds that guild's transaction-level advisory lock, so two
  processes never rebuild the same window from snapshots that miss each other's rows.

Ids are always locked before guilds, both in ascending order, so no two writers wait
for each other in a circle.
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Iterable, Iterator, Sequence
from contextlib import contextmanager
from typing import Any

from memory.errors import DatabaseFileError
from memory.storage.postgres import connection
from memory.storage.postgres.migrations import migrate, schema_version

log = logging.getLogger(__name__)

GUILD_LOCKS = 0x6D656D  # advisory lock namespace (first key) of the per-guild write locks
POOL_SIZE = 8  # connections: a search's four lists run side by side, writes beside them


def now_ms() -> int:
    """The time now, in unix milliseconds (what every stored time is)."""
    return int(time.time() * 1000)


class PostgresDatabase:
    """One PostgreSQL database holding a bot's memory (the contract's ``Database``).

    Args:
        url: ``postgresql://user:password@host:port/dbname`` (libpq's URL, any of its
            parameters, e.g. ``?sslmode=require`` or ``?options=-csearch_path=memory``).
        read_only: Only read (searches and stats work; writes raise
            :class:`DatabaseFileError`); by default when the server is a read-only
            replica or the role may not insert messages.

    Raises:
        DatabaseFileError: The server cannot be reached, lacks pgvector, holds another
            application's tables, or is at a newer schema.
    """

    def __init__(self, url: str, *, read_only: bool | None = None) -> None:
        self.url = url
        self.location = connection.redact(url)
        setup = connection.connect(url)
        try:
            writable = not setup.execute("SELECT pg_is_in_recovery()").fetchone()[0]
            self.read_only = (not writable) if read_only is None else read_only
            migrate(setup, read_only=self.read_only, location=self.location)
            if read_only is None and not self.read_only:
                self.read_only = not setup.execute(
                    "SELECT has_table_privilege('messages', 'INSERT')").fetchone()[0]
        finally:
            setup.close()
        self._pool = connection.open_pool(url, max_size=POOL_SIZE, read_only=self.read_only)
        self._local = threading.local()  # the connection of this thread's open write
        self.generation = 0  # bumped on every write; lets callers cache derived data
        self._generation_lock = threading.Lock()
        self._lock_timeout: str | None = None  # set_busy_timeout(); None: the server's

    def schema_version(self) -> int:
        """How many schema migrations the database has seen."""
        with self._pool.connection() as conn:
            return schema_version(conn)

    def set_busy_timeout(self, seconds: float | None) -> None:
        """How long a write waits for another transaction's lock before it raises
        :class:`~memory.errors.StorageBusy` (``lock_timeout``, set in each write
        transaction); ``None``: the server's ``lock_timeout`` (by default, no limit)."""
        self._lock_timeout = None if seconds is None else f"{max(1, int(seconds * 1000))}ms"

    def close(self) -> None:
        """Close every pooled connection."""
        self._pool.close()

    @contextmanager
    def write(self) -> Iterator[Any]:
        """A write transaction: yields its connection; commits at the end of the block.

        It rolls back on any exception (a full disk is raised as
        :class:`~memory.errors.DiskFullError`).  A ``write`` inside a ``write`` on the
        same thread joins the outer transaction.

        Raises:
            DatabaseFileError: The database is open read-only.
            StorageBusy: A deadlock or serialization failure was resolved against this
                transaction, a lock wait ran past ``lock_timeout``, the connection was
                lost, or the pool had no connection in time: run it again.
        """
        if self.read_only:
            raise DatabaseFileError(
                f"{self.location} is open read-only (a replica, or this role may not write): "
                "searching works, changing it needs a role with write access on the primary"
            )
        outer = getattr(self._local, "conn", None)
        if outer is not None:
            yield outer
            return
        try:
            with self._pool.connection() as conn:
                self._local.conn = conn
                try:
                    with conn.transaction():
                        if self._lock_timeout is not None:
                            conn.execute("SELECT set_config('lock_timeout', %s, true)",
                                         (self._lock_timeout,))
                        yield conn
                finally:
                    self._local.conn = None
        except Exception as exc:
            if full := connection.as_disk_full(exc, self.url):
                raise full from exc
            if busy := connection.as_busy(exc, self.url):
                raise busy from exc
            raise
        with self._generation_lock:
            self.generation += 1

    def read(self, sql: str, params: Sequence[Any] | dict[str, Any] = ()) -> list[tuple]:
        """Run one statement and return its rows.

        Inside a :meth:`write` on the same thread it runs in that transaction (and
        sees its rows); otherwise on any pooled connection.
        """
        outer = getattr(self._local, "conn", None)
        if outer is not None:
            return outer.execute(sql, params).fetchall()
        with self._pool.connection() as conn:
            return conn.execute(sql, params).fetchall()

    def read_beside(self, sql: str, params: Sequence[Any] | dict[str, Any] = ()) -> list[tuple]:
        """The same as :meth:`read`: every pooled connection reads beside the others."""
        return self.read(sql, params)

    @contextmanager
    def session(self) -> Iterator[Any]:
        """A pooled connection for several reads in a row (outside any transaction)."""
        outer = getattr(self._local, "conn", None)
        if outer is not None:
            yield outer
            return
        with self._pool.connection() as conn:
            yield conn


def lock_guilds(conn: Any, guild_ids: Iterable[int]) -> None:
    """Hold each guild's write lock until the transaction ends (ascending order)."""
    for guild_id in sorted(set(guild_ids)):
        conn.execute("SELECT pg_advisory_xact_lock(%s, %s)",
                     (GUILD_LOCKS, int(guild_id) % 2_147_483_647))


def lock_ids(conn: Any, ids: Iterable[int]) -> list[int]:
    """Make any other writer of these message ids wait for this transaction (see module).

    Call :func:`unlock_ids` before the transaction commits.

    Returns:
        The ids, distinct and ascending.
    """
    ordered = sorted({int(i) for i in ids})
    if ordered:
        conn.execute("INSERT INTO message_locks(id) SELECT unnest(%s::bigint[]) ORDER BY 1 "
                     "ON CONFLICT DO NOTHING", (ordered,))
    return ordered


def unlock_ids(conn: Any, ids: Sequence[int]) -> None:
    """Remove this transaction's rows from ``message_locks`` (they were never visible)."""
    if ids:
        conn.execute("DELETE FROM message_locks WHERE id = ANY(%s)", (list(ids),))
