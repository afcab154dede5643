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

from memory.errors import DatabaseFileError, EmbeddingModelChanged, EmbeddingModelMismatch
from memory.storage.postgres import vectors
from memory.storage.postgres.database import PostgresDatabase
from memory.storage.postgres.migrations import MIGRATE_LOCK

MODEL_KEY = "embedding_model"
DIMENSION_KEY = "embedding_dim"
PROFILE_KEY = "active_profile"
INDEX_KEY = "vector_index"
BUILDING_KEY = "vector_rebuild"
"""The model and size ``reembed`` is building a new vector table for (:mod:`.rebuild`)."""


def set_value(conn: Any, key: str, value: str) -> None:
    """Store ``key`` inside the caller's transaction."""
    conn.execute("INSERT INTO meta(key, value) VALUES (%s, %s) "
                 "ON CONFLICT (key) DO UPDATE SET value = excluded.value", (key, value))


class PostgresMeta:
    """The contract's ``Meta`` on PostgreSQL."""

    def __init__(self, database: PostgresDatabase) -> None:
        self._db = database
        self.model: str | None = None
        """The embedding model this process writes and searches with (its engine sets it)."""

    def get(self, key: str) -> str | None:
        """A stored value, or ``None`` when unset."""
        rows = self._db.read("SELECT value FROM meta WHERE key = %s", (key,))
        return rows[0][0] if rows else None

    def set(self, key: str, value: str) -> None:
        """Store a value (replacing the one before)."""
        with self._db.write() as conn:
            set_value(conn, key, value)

    @property
    def active_profile(self) -> str | None:
        """The hardware profile an admin last chose for this database."""
        return self.get(PROFILE_KEY)

    @active_profile.setter
    def active_profile(self, name: str) -> None:
        self.set(PROFILE_KEY, name)

    def embedding_model(self) -> tuple[str, int] | None:
        """Return ``(model_id, dimension)`` the vectors were made with, if any.

        Raises:
            DatabaseFileError: The stored dimension is not a positive whole number.
        """
        rows = dict(self._db.read("SELECT key, value FROM meta WHERE key IN (%s, %s)",
                                  (MODEL_KEY, DIMENSION_KEY)))
        model, dim = rows.get(MODEL_KEY), rows.get(DIMENSION_KEY)
        if not (model and dim):
            return None
        try:
            size = int(dim)
        except ValueError:
            size = 0
        if size <= 0:
            raise DatabaseFileError(
                f"{self._db.location}: the stored vector size (meta.embedding_dim) is "
                f"{dim[:40]!r}, not a positive whole number; run `python bot.py reembed` to "
                "rebuild the vectors and record it again (the messages are intact)")
        return model, size

    def bind_model(self, model_id: str, dimension: int) -> None:
        """Bind this database to an embedding model, creating the vector table.

        Raises:
            EmbeddingModelMismatch: The database holds vectors of another model.
            EmbeddingModelChanged: Another process re-embedded it while this one ran.
        """
        current = self.embedding_model()
        if current == (model_id, dimension):
            return
        if current is not None:
            self.check_model_unchanged()
            raise EmbeddingModelMismatch(
                f"{self._db.location} was embedded with {current[0]} ({current[1]} dims) but "
                f"the profile uses {model_id} ({dimension} dims); run `python bot.py reembed` "
                "to re-embed every message with the new model")
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
            conn.execute("DELETE FROM meta WHERE key IN (%s, %s, %s) "
                         "OR key LIKE 'similarity_floor:%%'", (MODEL_KEY, DIMENSION_KEY, BUILDING_KEY))
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

    def model_changed(self) -> str | None:
        """Why this process may no longer use the vectors, or ``None`` while it may."""
        current = self.embedding_model()
        if self.model is None or current is None or current[0] == self.model:
            return None
        return (f"{self._db.location} was re-embedded with {current[0]} ({current[1]} dims) by "
                f"another process; this one uses {self.model}, so it writes no vectors (new "
                "messages wait in the backlog) and searches by keywords only until it is "
                "restarted with a matching profile")

    def check_model_unchanged(self) -> None:
        """Raise :class:`EmbeddingModelChanged` with :meth:`model_changed`'s reason, if any."""
        if reason := self.model_changed():
            raise EmbeddingModelChanged(reason)
