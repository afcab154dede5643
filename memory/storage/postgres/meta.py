"""The database's own facts on PostgreSQL: the embedding model binding, the active
profile, small cached values (the ``meta`` table), and the vector table's life.

Binding a model creates ``message_vectors`` for its dimension with the HNSW index
(:mod:`.vectors`); ``reembed`` replaces it with the one it built (:mod:`.rebuild`).
Both run under the migration lock, so two processes binding at once create it once.
Another process's ``reembed`` is noticed by :meth:`PostgresMeta.model_changed` (one
read of ``meta``).
"""

from __future__ import annotations

from typing import Any

from memory.storage import meta
from memory.storage.meta import (
    BUILDING_KEY,
    DIMENSION_KEY,
    MODEL_KEY,
    BaseMeta,
    forget_vector_facts,
)
from memory.storage.postgres import vectors
from memory.storage.postgres.connection import DIALECT
from memory.storage.postgres.database import PostgresDatabase
from memory.storage.postgres.migrations import MIGRATE_LOCK

INDEX_KEY = "vector_index"


def set_value(conn: Any, key: str, value: str) -> None:
    """Store ``key`` inside the caller's transaction."""
    meta.set_meta(conn, DIALECT, key, value)


class PostgresMeta(BaseMeta):
    """The contract's ``Meta`` on PostgreSQL (the shared part: :class:`BaseMeta`)."""

    def __init__(self, database: PostgresDatabase) -> None:
        super().__init__(database, DIALECT)

    def bind_first(self, model_id: str, dimension: int) -> None:
        """Bind under the migration lock: two processes binding at once create the table once."""
        with self._db.write() as conn:
            conn.execute("SELECT pg_advisory_xact_lock(%s)", (MIGRATE_LOCK,))
            if self.embedding_model() is None:  # another process may have bound it meanwhile
                self.bind(conn, model_id, dimension)
        self.bind_model(model_id, dimension)  # what is bound now: ours, or say why not

    def reset_embeddings(self, model_id: str, dimension: int) -> None:
        """Drop every vector and bind to a new model; all messages become pending."""
        with self._db.write() as conn:
            conn.execute("SELECT pg_advisory_xact_lock(%s)", (MIGRATE_LOCK,))
            conn.execute("DROP TABLE IF EXISTS message_vectors")
            conn.execute(f"DROP TABLE IF EXISTS {vectors.NEXT}")
            conn.execute("DELETE FROM window_vectors")
            conn.execute("UPDATE index_stats SET vectors = 0")
            forget_vector_facts(conn, DIALECT, MODEL_KEY, DIMENSION_KEY, BUILDING_KEY)
            conn.execute("UPDATE messages SET embedded = false WHERE embedded")
            self.bind(conn, model_id, dimension)
        self.model = model_id

    def bind(self, conn: Any, model_id: str, dimension: int) -> None:
        """Inside the caller's transaction: create the vector table and its index (if
        missing) and record ``model_id`` and ``dimension``."""
        index = self.get(INDEX_KEY) or vectors.DEFAULT_INDEX
        vectors.create_table(conn, dimension, index)
        set_value(conn, MODEL_KEY, model_id)
        set_value(conn, DIMENSION_KEY, str(dimension))
        set_value(conn, INDEX_KEY, index)
