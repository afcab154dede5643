"""The SQLite database file: its connection and lock, and the transactions every noun
writes through.

One connection (and an ``RLock`` around it) serves every write and most reads: SQLite
has one writer anyway, and a noun that reads inside another noun's write transaction
(an upsert reading the guild's retention period) sees that transaction's own rows.
:meth:`SQLiteDatabase.write` is the transaction (``BEGIN IMMEDIATE`` … ``COMMIT``,
rolled back on any error, a full disk raised as one clear line);
:meth:`SQLiteDatabase.read` a locked read; :meth:`SQLiteDatabase.read_beside` a read on
a second, read-only connection that a search uses while the first runs its vector
KNN.  Opening the file migrates it (:mod:`memory.storage.sqlite.migrations`); a
transaction that removed text empties the write-ahead log after it commits
(:mod:`memory.storage.sqlite.scrub`).
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Iterator, Sequence
from contextlib import contextmanager, nullcontext
from pathlib import Path
from typing import Any

from memory.errors import DatabaseFileError
from memory.storage.sqlite import scrub
from memory.storage.sqlite.connection import (
    BUSY_TIMEOUT_MS,
    as_busy,
    as_disk_full,
    check_ours,
    connect,
    not_writable,
    sqlite_driver,
)
from memory.storage.sqlite.migrations import migrate, schema_version

log = logging.getLogger(__name__)

_SCRUBBED = "deleted_text_scrubbed"  # meta key: the file holds no pre-secure_delete leftovers


def now_ms() -> int:
    """The time now, in unix milliseconds (what every stored time is)."""
    return int(time.time() * 1000)


class SQLiteDatabase:
    """One SQLite database file holding a bot's memory (the contract's ``Database``).

    Every method is synchronous and safe to call from worker threads.

    Args:
        path: The database file (created if missing), or ``":memory:"``.
        read_only: Open read-only (searches and stats work, writes raise
            :class:`DatabaseFileError`); by default, when this process cannot write
            the file.
        erase_deleted: Remove deleted text from the file (:mod:`.scrub`).  ``False``
            only measures what that costs (``bench secure-delete``): deleted text
            then stays readable in the file.

    Raises:
        ExtensionLoadError: sqlite-vec cannot be loaded.
        DatabaseFileError: The file is not (or is a newer version of) this bot's database.
        DiskFullError: Creating or upgrading it needed space the disk does not have.
    """

    def __init__(
        self, path: str | Path, *, read_only: bool | None = None, erase_deleted: bool = True
    ) -> None:
        self.location = str(path)
        self.read_only = not_writable(path) if read_only is None else read_only
        self.erase_deleted = erase_deleted
        try:
            self._conn = connect(path, read_only=self.read_only)
        except Exception as exc:  # creating the file, or switching it to WAL
            if full := as_disk_full(exc, path):
                raise full from exc
            raise
        self._lock = threading.RLock()
        self._beside_conn: Any = None  # opened on the first read beside the KNN
        self._beside_lock = threading.Lock()
        self.generation = 0  # bumped on every write; lets callers cache derived data
        self._erased = False  # this transaction removed text: empty the WAL after it
        try:
            check_ours(self._conn, self.location)  # before any migration writes to it
            migrate(self._conn, read_only=self.read_only)
            scrub.check_keyword_index_readable(self._conn, self.location)
        except BaseException as exc:
            self.close()
            if full := as_disk_full(exc, path):  # a migration's write; it was rolled back
                raise full from exc
            raise

    def protect_deleted_text(self) -> None:
        """Set up how deleted text leaves the file (:mod:`.scrub`); scrub an older file once.

        Called once the database is open; does nothing on a read-only one.  With
        ``erase_deleted`` off, deleted rows are left where they were instead.
        """
        if self.read_only:
            return
        if not self.erase_deleted:
            self._conn.execute("PRAGMA secure_delete=OFF")
            return
        try:
            scrub.secure_keyword_index(self._conn)
            if self.read("SELECT 1 FROM meta WHERE key = ?", (_SCRUBBED,)):
                return
            if self.read("SELECT EXISTS (SELECT 1 FROM messages)")[0][0]:
                scrub.scrub_file(self._conn)
        except sqlite_driver().DatabaseError as exc:  # busy; no room for VACUUM's copy
            log.warning("%s: could not make sure deleted text leaves the file (%s); "
                        "trying again at the next start", self.location, exc)
            return
        with self.write() as conn:
            conn.execute("INSERT OR REPLACE INTO meta(key, value) VALUES (?, '1')", (_SCRUBBED,))

    def schema_version(self) -> int:
        """How many schema migrations the file has seen (``PRAGMA user_version``)."""
        with self._lock:
            return schema_version(self._conn)

    def set_busy_timeout(self, seconds: float | None) -> None:
        """How long a write waits for another process's lock before it raises
        :class:`~memory.errors.StorageBusy`; ``None``: 5 s, as :func:`.connect` sets it."""
        millis = BUSY_TIMEOUT_MS if seconds is None else int(seconds * 1000)
        with self._lock:
            self._conn.execute(f"PRAGMA busy_timeout = {millis}")

    def close(self) -> None:
        """Close both connections."""
        with self._beside_lock:
            if self._beside_conn is not None:
                self._beside_conn.close()
                self._beside_conn = None
        with self._lock:
            self._conn.close()

    # -- transactions and reads ------------------------------------------------------------

    @contextmanager
    def write(self) -> Iterator[Any]:
        """A write transaction on the main connection: yields the connection.

        It commits when the block ends and rolls back on any exception (a full disk
        is raised as :class:`~memory.errors.DiskFullError`, another process's lock
        held past the busy timeout as :class:`~memory.errors.StorageBusy`).  Nouns pass the
        connection to each other's in-transaction methods, so a message and its
        indexes change together.

        Raises:
            DatabaseFileError: The database is open read-only.
            StorageBusy: Another process held the write lock past the busy timeout;
                nothing was written.
        """
        if self.read_only:
            raise DatabaseFileError(
                f"{self.location} is open read-only (this process cannot write it): searching "
                "works, changing it needs write access to the file and its folder"
            )
        with self._lock:
            try:
                self._conn.execute("BEGIN IMMEDIATE")
            except Exception as exc:
                if busy := as_busy(exc, self.location):
                    raise busy from exc
                raise
            try:
                yield self._conn
                self._conn.execute("COMMIT")
            except BaseException as exc:
                self._erased = False
                if self._conn.in_transaction:  # SQLite rolls back itself on some errors
                    self._conn.execute("ROLLBACK")
                if full := as_disk_full(exc, self.location):
                    raise full from exc
                if busy := as_busy(exc, self.location):
                    raise busy from exc
                raise
            self.generation += 1
            if self._erased:  # the WAL still holds the changed pages as they were
                self._erased = False
                if self.erase_deleted:
                    self._truncate_wal()

    def erased(self) -> None:
        """Say that the open transaction removed text: the WAL is emptied after it commits."""
        self._erased = True

    def erasing(self, conn: Any, count: int) -> Any:
        """How the keyword index lets go of ``count`` forgotten messages (:func:`.scrub.erasing`)."""
        return scrub.erasing(conn, count) if self.erase_deleted else nullcontext()

    def read(self, sql: str, params: Sequence[Any] = ()) -> list[tuple]:
        """Run one statement on the main connection and return its rows.

        Inside a :meth:`write` on the same thread it sees that transaction's rows.
        """
        with self._lock:
            return self._conn.execute(sql, params).fetchall()

    def read_beside(self, sql: str, params: Sequence[Any] = ()) -> list[tuple]:
        """Run a read on the database's second, read-only connection.

        A search reads its keyword lists (and the window vectors of what they found)
        there while its query is embedded and its vector KNN runs on the main
        connection: SQLite lets go of the GIL while it works, so on a multi-core
        machine the two overlap, and a WAL reader sees every committed write.  An
        in-memory database has only the one connection.
        """
        if self.location == ":memory:":
            return self.read(sql, params)
        with self._beside_lock:
            if self._beside_conn is None:
                self._beside_conn = connect(self.location, read_only=True)
            return self._beside_conn.execute(sql, params).fetchall()

    def _truncate_wal(self) -> None:
        """Empty the write-ahead log after a commit that removed text (see :mod:`.scrub`)."""
        try:
            scrub.truncate_wal(self._conn)
        except Exception as exc:  # committed already: a full disk only delays the erasing
            if not as_disk_full(exc, self.location):
                raise
            log.warning("the write-ahead log of %s could not be emptied (%s); deleted text "
                        "stays in it until the next delete empties it", self.location, exc)
