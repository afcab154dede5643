"""``reembed`` on PostgreSQL: every vector made again in a table beside the live one,
then swapped in at once (the contract's ``VectorRebuild``).

While :data:`~.vectors.NEXT` fills (without indexes: rows go in faster), searches
keep using ``message_vectors``.  A message deleted meanwhile leaves both tables at
once; one whose vector is written again (an edit) leaves the new table and is
embedded again (:func:`~.vectors.forget_next`).  The swap is one transaction under the
migration lock: the new table gets its indexes and HNSW graph, replaces the old one
by renaming, and the counts, window vectors and model binding follow.  A crash
before it leaves the old table in use; the next ``reembed`` with the same model goes
on from there.
"""

from __future__ import annotations

import logging
from collections.abc import Sequence
from typing import Any

from memory.records import PendingMessage
from memory.storage.meta import BUILDING_KEY
from memory.storage.postgres import vectors, windows
from memory.storage.postgres.backlog import PostgresBacklog
from memory.storage.postgres.connection import DIALECT
from memory.storage.postgres.database import PostgresDatabase, lock_guilds
from memory.storage.postgres.meta import INDEX_KEY, PostgresMeta, set_value
from memory.storage.postgres.migrations import MIGRATE_LOCK
from memory.storage.rebuild import BaseRebuild, not_building

log = logging.getLogger(__name__)

NEXT = vectors.NEXT


class PostgresRebuild(BaseRebuild):
    """The contract's ``VectorRebuild`` on PostgreSQL.

    Args:
        database: The database.
        meta: Where the model being built and, after the swap, the bound model are kept.
        backlog: Reads messages as an embedder sees them.
    """

    def __init__(self, database: PostgresDatabase, meta: PostgresMeta,
                 backlog: PostgresBacklog) -> None:
        super().__init__(database, DIALECT, meta, backlog, NEXT)

    def start(self, model_id: str, dimension: int) -> bool:
        """Begin the new table for ``model_id``, or go on with a stopped run's.

        Returns:
            Whether an earlier run's table is carried on.
        """
        building = f"{model_id}\n{int(dimension)}"
        with self._db.write() as conn:
            conn.execute("SELECT pg_advisory_xact_lock(%s)", (MIGRATE_LOCK,))
            if _building(conn) == building:
                # sent back to the backlog while no run was watching (an upgrade's
                # migration): what the stopped run stored for them may be stale
                conn.execute(f"DELETE FROM {NEXT} v USING messages m "
                             "WHERE m.id = v.message_id AND NOT m.embedded")
                return True
            conn.execute(f"DROP TABLE IF EXISTS {NEXT}")
            vectors.create_bare_table(conn, dimension, NEXT)
            set_value(conn, BUILDING_KEY, building)
        return False

    def _check_building(self, conn: Any, messages: Sequence[PendingMessage]) -> None:
        lock_guilds(conn, {m.guild_id for m in messages})
        if _building(conn) is None:
            raise not_building()

    def _store(self, conn: Any, rows: list[tuple]) -> None:
        conn.cursor().executemany(
            f"INSERT INTO {NEXT}(message_id, guild_id, channel_id, author_id, created_at, "
            "has_attachment, embedding) VALUES (%s, %s, %s, %s, %s, %s, %s) "
            "ON CONFLICT (message_id) DO UPDATE SET embedding = excluded.embedding", rows)

    def finish(self, model_id: str, dimension: int) -> int:
        """Swap the new table in and bind ``model_id``, in one transaction.

        Returns:
            How many messages are left without a vector (the backlog embeds them).

        Raises:
            DatabaseFileError: No table is being built for this model.
        """
        with self._db.write() as conn:
            conn.execute("SELECT pg_advisory_xact_lock(%s)", (MIGRATE_LOCK,))
            if _building(conn) != f"{model_id}\n{int(dimension)}":
                raise not_building()
            index = self._meta.get(INDEX_KEY) or vectors.DEFAULT_INDEX
            vectors.create_indexes(conn, dimension, index, NEXT)
            conn.execute("DROP TABLE IF EXISTS message_vectors")
            _rename(conn, index)
            _recount(conn)
            self._swapped(conn, model_id, dimension)
            # only the rows whose flag changes: an UPDATE of every message rewrites them all
            conn.execute("UPDATE messages m SET embedded = false WHERE embedded AND NOT EXISTS "
                         "(SELECT 1 FROM message_vectors v WHERE v.message_id = m.id)")
            conn.execute("UPDATE messages m SET embedded = true WHERE NOT embedded AND EXISTS "
                         "(SELECT 1 FROM message_vectors v WHERE v.message_id = m.id)")
            left = conn.execute("SELECT count(*) FROM messages WHERE NOT embedded").fetchone()[0]
        self._meta.model = model_id
        log.info("swapped in the vectors of %s; %d messages left to embed", model_id, left)
        return int(left)


def _building(conn: Any) -> str | None:
    """What the table being built is for, or ``None`` when none is (or it is gone)."""
    row = conn.execute("SELECT value FROM meta WHERE key = %s", (BUILDING_KEY,)).fetchone()
    exists = conn.execute("SELECT to_regclass(%s) IS NOT NULL", (NEXT,)).fetchone()[0]
    return row[0] if row is not None and exists else None


def _rename(conn: Any, index: str) -> None:
    """Give the new table and its indexes the live names."""
    conn.execute(f"ALTER TABLE {NEXT} RENAME TO message_vectors")
    for suffix in ("pkey", "by_guild", "by_channel", f"hnsw_{index}"):
        conn.execute(f"ALTER INDEX {NEXT}_{suffix} RENAME TO message_vectors_{suffix}")


def _recount(conn: Any) -> None:
    """Count each guild's vectors and make every window vector again, from the new ones."""
    conn.execute("DELETE FROM message_vectors v WHERE NOT EXISTS "
                 "(SELECT 1 FROM messages m WHERE m.id = v.message_id)")
    conn.execute("UPDATE index_stats SET vectors = 0")
    conn.execute("INSERT INTO index_stats AS s(guild_id, vectors) SELECT guild_id, count(*) "
                 "FROM message_vectors GROUP BY guild_id ON CONFLICT (guild_id) "
                 "DO UPDATE SET vectors = excluded.vectors")
    conn.execute("DELETE FROM window_vectors")
    windows.refresh_vectors(conn, [row[0] for row in conn.execute(
        "SELECT id FROM search_text WHERE contentful")])
