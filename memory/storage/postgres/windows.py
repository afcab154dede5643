"""Conversational windows on PostgreSQL: the shared algorithm
(:mod:`memory.storage.windows`, whose module says why windows exist and fixes their
shape) over ``search_text``, with the keyword documents (``keyword_messages``,
``keyword_windows``, :mod:`.keywords`) rewritten in the same transaction and the
members' vectors read from ``message_vectors``.

Every function takes the connection of the caller's write transaction, which holds
the guild's write lock (:func:`.database.lock_guilds`): two processes never rebuild
one window from snapshots that miss each other's rows.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import numpy as np

from memory.storage.postgres import keywords
from memory.storage.postgres.connection import DIALECT
from memory.storage.windows import Entry, WindowIndex, WindowRow

__all__ = ["WINDOWS", "drop_rows", "index_rows", "refresh_vectors", "reindex",
           "vector_table_exists", "vectors_changed", "write_documents"]


def vector_table_exists(conn: Any) -> bool:
    """Whether ``message_vectors`` exists (an embedding model is bound)."""
    return conn.execute("SELECT to_regclass('message_vectors') IS NOT NULL").fetchone()[0]


class PostgresWindows(WindowIndex):
    """The window algorithm on PostgreSQL: keyword documents follow ``search_text``."""

    dialect = DIALECT

    def drop_rows(self, conn: Any, ids: Sequence[int]) -> None:
        """Remove the index rows of those of ``ids`` whose message is gone."""
        drop_rows(conn, ids)

    def member_vectors(self, conn: Any, ids: set[int]) -> dict[int, np.ndarray]:
        """The float32 vectors of those of ``ids`` in ``message_vectors`` ({} while it is missing)."""
        if not vector_table_exists(conn):
            return {}
        return {mid: np.asarray(vector.to_numpy() if hasattr(vector, "to_numpy") else vector,
                                dtype=np.float32)
                for mid, vector in conn.execute(
                    "SELECT message_id, embedding FROM message_vectors WHERE message_id = ANY(%s)",
                    (sorted(ids),))}

    def documents_written(self, conn: Any, changed: list[Entry]) -> None:
        """Rewrite the keyword documents of the ``changed`` rows."""
        write_documents(conn, changed)


WINDOWS = PostgresWindows()

reindex = WINDOWS.reindex
vectors_changed = WINDOWS.vectors_changed
refresh_vectors = WINDOWS.refresh_vectors  # the shared algorithm's entry points, as functions



def drop_rows(conn: Any, ids: Sequence[int]) -> None:
    """Remove the index rows of those of ``ids`` whose message is gone."""
    gone = [row[0] for row in conn.execute(
        "SELECT i FROM unnest(%s::bigint[]) i WHERE NOT EXISTS "
        "(SELECT 1 FROM messages m WHERE m.id = i)", (list(ids),))]
    if not gone:
        return
    conn.execute("DELETE FROM search_text WHERE id = ANY(%s)", (gone,))
    conn.execute("DELETE FROM window_vectors WHERE id = ANY(%s)", (gone,))
    keywords.delete_documents(conn, gone)


def write_documents(conn: Any, changed: list[Entry]) -> None:
    """Rewrite the keyword documents of ``changed`` rows of ``search_text``."""
    keywords.write_documents(conn, [
        keywords.Document(row.id, row.guild_id, row.channel_id, row.author_id, row.created_at,
                          bool(row.attachments), entry[6], (entry[1], entry[2], entry[3], entry[4]))
        for entry, row in changed])


def index_rows(conn: Any, rows: Sequence[tuple]) -> None:
    """Write the keyword documents of ``search_text`` rows (all its columns, in order)
    whose messages are stored: rows copied by ``migrate-db``, or re-tokenized."""
    if not rows:
        return
    places = {row[0]: row[1:] for row in conn.execute(
        "SELECT id, channel_id, created_at, reply_to_id, guild_id, author_id, attachments "
        "FROM messages WHERE id = ANY(%s)", ([row[0] for row in rows],))}
    changed = []
    for row in rows:
        if row[0] not in places:
            continue
        channel, created, reply, guild, author, attachments = places[row[0]]
        message = WindowRow(row[0], channel, created, "", "", row[2], attachments, reply,
                            guild, author)
        changed.append(((row[0], row[1], row[2], row[3], row[4], row[5], bool(row[6])), message))
    write_documents(conn, changed)
