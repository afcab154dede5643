"""The ``meta`` table: which embedding model the vectors belong to, the hardware profile
an admin chose, and small cached values (the similarity floors).

The vectors of one database are all of one model.  :meth:`SQLiteMeta.bind_model`
records it (and creates the vector table of its size) the first time anything is
embedded; ``reembed`` binds another when it swaps in the vectors it made
(:mod:`.rebuild`), and :meth:`SQLiteMeta.reset_embeddings` drops every vector and binds
another at once (a lost vector table is repaired so).  A process notices when another
process re-embedded the database under it (:meth:`SQLiteMeta.model_changed`): its
vectors would be of another model.
"""

from __future__ import annotations

import logging
from typing import Any

from memory.errors import DatabaseFileError, EmbeddingModelChanged, EmbeddingModelMismatch
from memory.storage.sqlite.database import SQLiteDatabase
from memory.storage.sqlite.vectors import Vec0Table

log = logging.getLogger(__name__)

_MODEL = "embedding_model"
_DIM = "embedding_dim"
_PROFILE = "active_profile"
BUILDING = "vector_rebuild"
"""The model and size ``reembed`` is building a new vector table for (:mod:`.rebuild`)."""


def set_meta(conn: Any, key: str, value: str) -> None:
    """Store ``key`` = ``value`` inside the caller's transaction."""
    conn.execute(
        "INSERT INTO meta(key, value) VALUES (?, ?) "
        "ON CONFLICT(key) DO UPDATE SET value = excluded.value",
        (key, value),
    )


class SQLiteMeta:
    """The contract's ``Meta`` on one database.

    Args:
        database: The database.
        table: Its vector table, created when a model is bound and dropped on reset.
    """

    def __init__(self, database: SQLiteDatabase, table: Vec0Table) -> None:
        self._db = database
        self._table = table
        # the embedding model this process writes and searches with (its engine sets
        # it): see model_changed()
        self.model: str | None = None

    def get(self, key: str) -> str | None:
        """Return a value from the ``meta`` table, or ``None`` when unset."""
        rows = self._db.read("SELECT value FROM meta WHERE key = ?", (key,))
        return rows[0][0] if rows else None

    def set(self, key: str, value: str) -> None:
        """Store a value in the ``meta`` table."""
        with self._db.write() as conn:
            set_meta(conn, key, value)

    @property
    def active_profile(self) -> str | None:
        """The hardware profile an admin last chose for this database."""
        return self.get(_PROFILE)

    @active_profile.setter
    def active_profile(self, name: str) -> None:
        self.set(_PROFILE, name)

    def embedding_model(self) -> tuple[str, int] | None:
        """Return ``(model_id, dimension)`` the vectors were made with, if any.

        Raises:
            DatabaseFileError: The stored dimension is not a positive whole number (the
                file was edited or damaged); ``reembed`` rewrites it.
        """
        model, dim = self.get(_MODEL), self.get(_DIM)
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
                "rebuild the vectors and record it again (the messages are intact)"
            )
        return model, size

    def model_changed(self) -> str | None:
        """Why this process may no longer use the vectors, or ``None`` while it may.

        :attr:`model` is the embedding model this process writes and searches with
        (set by its engine).  When another process re-embeds the database with another
        model (``reembed``), the database's model no longer matches: this process's
        query vectors and new vectors are of another model, perhaps another size.
        One read of ``meta``.
        """
        current = self.embedding_model()
        if self.model is None or current is None or current[0] == self.model:
            return None
        return (f"{self._db.location} was re-embedded with {current[0]} ({current[1]} dims) by "
                f"another process; this one uses {self.model}, so it writes no "
                "vectors (new messages wait in the backlog) and searches by keywords only "
                "until it is restarted with a matching profile")

    def check_model_unchanged(self) -> None:
        """Raise :class:`EmbeddingModelChanged` with :meth:`model_changed`'s reason, if any."""
        if reason := self.model_changed():
            raise EmbeddingModelChanged(reason)

    def bind_model(self, model_id: str, dimension: int) -> None:
        """Bind this database to an embedding model, creating the vector table.

        Raises:
            EmbeddingModelMismatch: The database already holds vectors of another
                model; run ``python bot.py reembed`` to switch.
            EmbeddingModelChanged: Another process re-embedded it while this one ran.
        """
        current = self.embedding_model()
        if current == (model_id, dimension):
            return
        if current is not None:
            self.check_model_unchanged()  # it changed under this process: say so
            raise EmbeddingModelMismatch(
                f"{self._db.location} was embedded with {current[0]} ({current[1]} dims) but "
                f"the profile uses {model_id} ({dimension} dims); run `python bot.py reembed` "
                "to re-embed every message with the new model"
            )
        with self._db.write() as conn:
            self.bind(conn, model_id, dimension)

    def reset_embeddings(self, model_id: str, dimension: int) -> None:
        """Drop every vector and bind to a new model; all messages become pending."""
        with self._db.write() as conn:
            self._table.drop(conn)
            # the cached similarity floors describe the old model's vectors
            conn.execute("DELETE FROM meta WHERE key IN (?, ?, ?) OR key LIKE 'similarity_floor:%'",
                         (_MODEL, _DIM, BUILDING))
            conn.execute("UPDATE messages SET embedded = 0")
            self.bind(conn, model_id, dimension)
        self.model = model_id  # from now on, a reembed by another process is noticed

    def repair_vector_table(self) -> None:
        """Rebuild a vector table that is gone (dropped by hand?): everything is re-embedded.

        Run when the database opens (not read-only).
        """
        try:
            model = self.embedding_model()
        except DatabaseFileError as exc:  # said by whatever needs the model; reembed repairs it
            log.info("%s", exc)
            return
        if model is not None and not self._table.exists():
            log.warning("%s has no vector table; every message will be embedded again",
                        self._db.location)
            self.reset_embeddings(*model)

    def bind(self, conn: Any, model_id: str, dimension: int) -> None:
        """Inside the caller's transaction: create the vector table (if missing) and
        record ``model_id`` and ``dimension``."""
        self._table.create(conn, dimension)
        set_meta(conn, _MODEL, model_id)
        set_meta(conn, _DIM, str(dimension))
