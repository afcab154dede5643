"""Forgotten text leaves the database file, not only its tables.

SQLite normally leaves a deleted row's bytes where they were (in the page's free
space, in free pages, in the write-ahead log), and FTS5 keeps a deleted document's
tokens in its older index segments until they are merged.  So that a forgotten
message cannot be read back from the file:

* every connection that writes runs with ``PRAGMA secure_delete=ON`` (set by
  :func:`memory.storage.sqlite.connection.connect`): deleted content and freed pages are overwritten with
  zeros.  ``FAST`` is not enough: it leaves freed pages as they were.
* both keyword indexes run in FTS5's ``secure-delete`` mode (SQLite 3.46.1 and later:
  earlier releases could corrupt the index in this mode),
  which removes a deleted document's entries from the index at once
  (:func:`secure_keyword_index`).  The option is kept in the database and moves
  the index to a file format that older SQLite cannot read.
* after a transaction that deleted messages or changed a message's text the
  write-ahead log is checkpointed into the file and truncated to zero bytes
  (:func:`truncate_wal`): until then it holds the pages as they were before.
* a database written before these rules held is scrubbed once when it is opened
  (:func:`scrub_file`): the keyword indexes are rebuilt (dropping what earlier
  deletes left in them) and the file is vacuumed (dropping free pages).
* forgetting many messages at once deletes them plainly and then rebuilds the
  keyword indexes, which is much faster than erasing word by word (:func:`erasing`).
"""

from __future__ import annotations

import logging
import time
from collections.abc import Iterator
from contextlib import contextmanager, nullcontext
from typing import Any

from memory.errors import DatabaseFileError
from memory.storage.sqlite.connection import FTS_SECURE_DELETE_SINCE, sqlite_driver

log = logging.getLogger(__name__)

KEYWORD_INDEXES = ("search_fts", "window_fts")
BULK_MIN = 64
BULK_SHARE = 500
"""Forgetting at least :data:`BULK_MIN` messages and 1 in :data:`BULK_SHARE` of those
stored rebuilds the keyword indexes instead of erasing word by word."""


def check_keyword_index_readable(conn: Any, path: str) -> None:
    """Refuse, with what to do, a database whose keyword index this SQLite cannot read.

    Raises:
        DatabaseFileError: The index runs in secure-delete mode and SQLite is older
            than 3.46.1.
    """
    driver = sqlite_driver()
    if driver.sqlite_version_info >= FTS_SECURE_DELETE_SINCE:
        return
    if conn.execute("SELECT 1 FROM search_fts_config WHERE k = 'secure-delete' AND v = 1").fetchone():
        raise DatabaseFileError(
            f"{path}: its keyword index erases deleted messages' words, which needs SQLite "
            f"3.46.1 or later, and this Python's is {driver.sqlite_version}: install "
            "pysqlite3-binary, or use a Python with a newer SQLite"
        )


def secure_keyword_index(conn: Any) -> bool:
    """Turn on FTS5 ``secure-delete`` for both keyword indexes, where it is off.

    Args:
        conn: A writable autocommit connection, outside any transaction.

    Returns:
        Whether the indexes run in secure-delete mode now.  With SQLite older than
        3.46.1 they do not, and a warning says so.
    """
    driver = sqlite_driver()
    if driver.sqlite_version_info < FTS_SECURE_DELETE_SINCE:
        log.warning(
            "SQLite %s cannot remove deleted messages' words from the keyword index at "
            "once (that needs 3.46.1 or later): they stay in the file until the index is "
            "merged. Install pysqlite3-binary, or use a Python with a newer SQLite",
            driver.sqlite_version,
        )
        return False
    off = [table for table in KEYWORD_INDEXES if not conn.execute(
        f"SELECT 1 FROM {table}_config WHERE k = 'secure-delete' AND v = 1").fetchone()]
    if off:
        conn.execute("BEGIN IMMEDIATE")
        try:
            for table in off:
                conn.execute(f"INSERT INTO {table}({table}, rank) VALUES ('secure-delete', 1)")
        except BaseException:
            conn.execute("ROLLBACK")
            raise
        conn.execute("COMMIT")
    return True


def erasing(conn: Any, count: int) -> Any:
    """A context for forgetting ``count`` messages in the caller's transaction.

    FTS5's secure-delete mode finds and rewrites each deleted word's entries one at
    a time (about 11 ms a message at 100k stored, windows included); for a large
    forget it is an order of magnitude faster to delete plainly and then rebuild
    both keyword indexes from the rows that remain (about 2 s at 100k stored),
    which leaves nothing of the deleted ones.  (A merge, ``optimize``, is not
    enough: it can keep a deleted word's term in the index.)  Small forgets keep
    the secure-delete mode.
    """
    if count < BULK_MIN:
        return nullcontext()
    stored = conn.execute("SELECT count(*) FROM messages").fetchone()[0]
    return _rebuilt_after(conn) if count * BULK_SHARE >= stored else nullcontext()


@contextmanager
def _rebuilt_after(conn: Any) -> Iterator[None]:
    secure = sqlite_driver().sqlite_version_info >= FTS_SECURE_DELETE_SINCE
    if secure:
        _set_secure_delete(conn, 0)
    try:
        yield
        for table in KEYWORD_INDEXES:
            conn.execute(f"INSERT INTO {table}({table}) VALUES ('rebuild')")
    finally:  # a failed forget rolls back; the mode must not stay off for the next one
        if secure:
            _set_secure_delete(conn, 1)


def _set_secure_delete(conn: Any, value: int) -> None:
    for table in KEYWORD_INDEXES:
        conn.execute(f"INSERT INTO {table}({table}, rank) VALUES ('secure-delete', ?)", (value,))


def scrub_file(conn: Any) -> None:
    """Remove what earlier deletes and edits left in the file: rebuild the keyword
    indexes, vacuum, and empty the write-ahead log.

    Run once on a database written before deleted content was overwritten; it
    rewrites the whole file (about as long as copying it), so it is logged.

    Args:
        conn: A writable autocommit connection, outside any transaction.
    """
    started = time.perf_counter()
    log.info("removing the leftovers of deleted messages from the database file (once)")
    conn.execute("BEGIN IMMEDIATE")
    try:
        for table in KEYWORD_INDEXES:
            conn.execute(f"INSERT INTO {table}({table}) VALUES ('rebuild')")
    except BaseException:
        conn.execute("ROLLBACK")
        raise
    conn.execute("COMMIT")
    conn.execute("VACUUM")
    truncate_wal(conn)
    log.info("database file scrubbed in %.1f s", time.perf_counter() - started)


def truncate_wal(conn: Any) -> bool:
    """Copy the write-ahead log into the database file and truncate it to zero bytes.

    Waits (up to the busy timeout) for readers that still use older pages.

    Returns:
        Whether the log was emptied; if readers kept it busy, a warning is logged
        and the next delete empties it.
    """
    busy, _, _ = conn.execute("PRAGMA wal_checkpoint(TRUNCATE)").fetchone()
    if busy:
        log.warning("the write-ahead log could not be emptied now (readers are busy); "
                    "deleted text stays in it until the next delete empties it")
    return not busy
