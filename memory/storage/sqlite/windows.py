"""Conversational windows on SQLite: the shared algorithm (:mod:`memory.storage.windows`,
whose module says why windows exist and fixes their shape) over ``search_text``,
whose FTS5 triggers keep ``search_fts`` and ``window_fts`` in step, and the vec0
table's vectors; plus the migrations that first indexed older files.
"""

from __future__ import annotations

import logging
from collections.abc import Iterator, Sequence
from contextlib import contextmanager
from typing import Any

import numpy as np

from memory.storage.sqlite.connection import DIALECT, IN_IDS, id_list
from memory.storage.sqlite.vectors import read_floats, shadow_table_readable, table_columns
from memory.storage.windows import AFTER, BEFORE, GAP_MS, SEGMENT, WindowIndex

__all__ = ["AFTER", "BEFORE", "GAP_MS", "WINDOWS", "index_all_window_vectors", "index_all_windows",
           "refresh_vectors", "reindex", "vectors_changed"]

log = logging.getLogger(__name__)


class SQLiteWindows(WindowIndex):
    """The window algorithm on SQLite: FTS5 triggers follow ``search_text``."""

    dialect = DIALECT

    def drop_rows(self, conn: Any, ids: Sequence[int]) -> None:
        """Remove the rows of those of ``ids`` whose message is gone (the triggers take
        their keyword rows)."""
        for table in ("search_text", "window_vectors"):
            conn.execute(
                f"DELETE FROM {table} WHERE id {IN_IDS} AND id NOT IN (SELECT id FROM messages)",
                (id_list(ids),),
            )

    def member_vectors(self, conn: Any, ids: set[int]) -> dict[int, np.ndarray]:
        """The float32 vectors of those of ``ids`` in the vec0 table ({} while it is missing)."""
        if not table_columns(conn):  # no embedding model bound yet: no vectors
            return {}

        def query(sql: str, params: Sequence[Any]) -> list[tuple]:
            return conn.execute(sql, params).fetchall()
        return read_floats(query, ids, auxiliary=shadow_table_readable(query))


WINDOWS = SQLiteWindows()

reindex = WINDOWS.reindex
vectors_changed = WINDOWS.vectors_changed
refresh_vectors = WINDOWS.refresh_vectors  # the shared algorithm's entry points, as functions



def index_all_window_vectors(conn: Any) -> None:
    """Compute every window's vector (a migration: windows stored before they had one)."""
    conn.execute(
        "CREATE TABLE IF NOT EXISTS window_vectors (id INTEGER PRIMARY KEY, vector BLOB NOT NULL)"
    )
    ids = [row[0] for row in conn.execute("SELECT id FROM search_text WHERE contentful")]
    refresh_vectors(conn, ids)
    log.info("computed the window vectors of %d messages", len(ids))


def index_all_windows(conn: Any) -> None:
    """Index every stored message (a migration: messages stored before windows existed)."""
    with _names_per_guild(conn):
        _index_all_windows(conn)


@contextmanager
def _names_per_guild(conn: Any) -> Iterator[None]:
    """Per-guild names for a database older than migration 11, while the block runs.

    This module reads a message's author from ``member_names`` (migration 11); when
    migration 7 runs on an older database, names are still one ``authors`` row per
    member, so a temporary table holds that row for each guild the member wrote in
    (what migration 11 itself will store), and is dropped afterwards.
    """
    if conn.execute("SELECT 1 FROM sqlite_master WHERE name = 'member_names'").fetchone():
        yield
        return
    conn.execute("CREATE TEMP TABLE member_names (guild_id INTEGER NOT NULL, "
                 "author_id INTEGER NOT NULL, name TEXT NOT NULL, display_name TEXT NOT NULL, "
                 "PRIMARY KEY (guild_id, author_id))")
    try:
        conn.execute("INSERT INTO temp.member_names SELECT p.guild_id, a.id, a.name, a.display_name "
                     "FROM (SELECT DISTINCT guild_id, author_id FROM messages) p "
                     "JOIN authors a ON a.id = p.author_id")
        yield
    finally:
        conn.execute("DROP TABLE temp.member_names")


def _index_all_windows(conn: Any) -> None:
    channels = [row[0] for row in conn.execute("SELECT DISTINCT channel_id FROM messages")]
    for channel_id in channels:
        ids = [row[0] for row in conn.execute(
            "SELECT id FROM messages WHERE channel_id = ? ORDER BY id", (channel_id,))]
        for start in range(0, len(ids), SEGMENT):
            chunk = ids[start:start + SEGMENT]
            WINDOWS.rebuild(conn, channel_id, chunk[0], chunk[-1], vectors=False)  # migration 8's work
    log.info("indexed the windows of %d channels", len(channels))
