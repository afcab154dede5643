"""``reembed`` on SQLite: every vector made again in a table beside the live one, then
swapped in at once (the contract's ``VectorRebuild``).

While the new table (:data:`~.vectors.NEXT`) fills, searches keep using
``message_vectors`` and its window vectors, so their quality does not drop.  A
message deleted meanwhile leaves both tables at once; one whose vector is written
again (an edit) leaves the new table and is embedded again with the new model
(:func:`~.vectors.forget_next`).  The swap is one transaction: the new rows replace the
old table (vec0 tables cannot be renamed, so they are copied), the code counts and
window vectors are recomputed and the new model is bound.  A crash before it leaves
the old table in use and the new one half full; the next ``reembed`` with the same
model goes on from there, with another model it starts again.
"""

from __future__ import annotations

import logging
from collections.abc import Sequence
from typing import Any

import numpy as np

from memory.records import PendingMessage
from memory.storage.meta import BUILDING_KEY as BUILDING
from memory.storage.rebuild import BaseRebuild, not_building
from memory.storage.sqlite import windows
from memory.storage.sqlite.backlog import SQLiteBacklog
from memory.storage.sqlite.connection import DIALECT
from memory.storage.sqlite.database import SQLiteDatabase
from memory.storage.sqlite.meta import SQLiteMeta, set_meta
from memory.storage.sqlite.vectors import (
    NEXT,
    VECTOR_FIELDS,
    Vec0Table,
    count_codes,
    drop_vector_table,
    insert_vectors,
    vector_table_sql,
)

log = logging.getLogger(__name__)


class SQLiteRebuild(BaseRebuild):
    """The contract's ``VectorRebuild`` on one database.

    Args:
        database: The database.
        meta: Where the model being built and, after the swap, the bound model are kept.
        table: The live vector table (recreated at the swap).
        backlog: Reads messages as an embedder sees them.
    """

    def __init__(
        self, database: SQLiteDatabase, meta: SQLiteMeta, table: Vec0Table, backlog: SQLiteBacklog
    ) -> None:
        super().__init__(database, DIALECT, meta, backlog, NEXT)
        self._table = table

    def start(self, model_id: str, dimension: int) -> bool:
        """Begin building the new table for ``model_id``, or go on with one a stopped
        run left for the same model and size.

        Returns:
            Whether an earlier run's table is carried on.
        """
        building = f"{model_id}\n{int(dimension)}"
        with self._db.write() as conn:
            exists = conn.execute("SELECT 1 FROM sqlite_master WHERE name = ?", (NEXT,)).fetchone()
            stored = conn.execute("SELECT value FROM meta WHERE key = ?", (BUILDING,)).fetchone()
            if exists and stored is not None and stored[0] == building and _readable(conn):
                # sent back to the backlog while no run was watching (an upgrade's
                # migration): what the stopped run stored for them may be stale
                conn.executemany(f"DELETE FROM {NEXT} WHERE message_id = ?", conn.execute(
                    "SELECT id FROM messages WHERE embedded = 0").fetchall())
                return True
            drop_vector_table(conn, NEXT)
            conn.execute(vector_table_sql(dimension, NEXT))
            set_meta(conn, BUILDING, building)
        return False

    def _check_building(self, conn: Any, messages: Sequence[PendingMessage]) -> None:
        _require_building(conn)

    def _store(self, conn: Any, rows: list[tuple]) -> None:
        conn.executemany(f"DELETE FROM {NEXT} WHERE message_id = ?", [(r[0],) for r in rows])
        insert_vectors(conn, NEXT, rows)

    def finish(self, model_id: str, dimension: int) -> int:
        """Swap the new table in and bind ``model_id``, in one transaction.

        Returns:
            How many messages are left without a vector (changed or stored since
            they were embedded again): the backlog embeds them with the new model.

        Raises:
            DatabaseFileError: No table is being built for this model (``start`` first).
        """
        with self._db.write() as conn:
            _require_building(conn, f"{model_id}\n{int(dimension)}")
            drop_vector_table(conn, "message_vectors")
            self._table.create(conn, dimension)
            conn.execute(f"INSERT INTO message_vectors({VECTOR_FIELDS}, embedding_bits, embedding) "
                         f"SELECT {VECTOR_FIELDS}, embedding_bits, embedding FROM {NEXT} "
                         "WHERE message_id IN (SELECT id FROM messages)")
            drop_vector_table(conn, NEXT)
            _recount(conn)
            self._swapped(conn, model_id, dimension)
            left = _mark_embedded(conn)
        self._meta.model = model_id
        log.info("swapped in the vectors of %s; %d messages left to embed", model_id, left)
        return left


def _readable(conn: Any) -> bool:
    """Whether the table being built can be read (its shadow tables are whole)."""
    try:
        conn.execute(f"SELECT count(*) FROM {NEXT}").fetchone()
    except Exception as exc:  # damaged: it is built again
        log.warning("the half-built vector table is damaged (%s); starting it again", exc)
        return False
    return True


def _require_building(conn: Any, building: str | None = None) -> None:
    stored = conn.execute("SELECT value FROM meta WHERE key = ?", (BUILDING,)).fetchone()
    exists = conn.execute("SELECT 1 FROM sqlite_master WHERE name = ?", (NEXT,)).fetchone()
    if not exists or stored is None or (building is not None and stored[0] != building):
        raise not_building()


def _recount(conn: Any) -> None:
    """Count every code bit and make every window vector again, from the new vectors."""
    conn.execute("DELETE FROM code_stats")
    count_codes(conn, (
        (guild_id, np.frombuffer(blob, dtype=np.float32))
        for guild_id, blob in conn.execute("SELECT guild_id, embedding FROM message_vectors")))
    conn.execute("DELETE FROM window_vectors")
    windows.refresh_vectors(conn, [row[0] for row in conn.execute(
        "SELECT id FROM search_text WHERE contentful")])


def _mark_embedded(conn: Any) -> int:
    """``embedded`` says whether each message has a vector now; returns how many lack one."""
    conn.execute("UPDATE messages SET embedded = 0 WHERE embedded = 1 AND NOT EXISTS "
                 "(SELECT 1 FROM message_vectors v WHERE v.message_id = messages.id)")
    conn.execute("UPDATE messages SET embedded = 1 WHERE embedded = 0 AND EXISTS "
                 "(SELECT 1 FROM message_vectors v WHERE v.message_id = messages.id)")
    return int(conn.execute("SELECT count(*) FROM messages WHERE embedded = 0").fetchone()[0])
