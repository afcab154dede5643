"""The ``meta`` table on either engine: which embedding model the vectors belong to,
the hardware profile an admin chose, and small cached values (the similarity floors).

The vectors of one database are all of one model.  :meth:`BaseMeta.bind_model`
records it (and the engine creates the vector table of its size) the first time
anything is embedded; ``reembed`` binds another when it swaps in the vectors it made,
and ``reset_embeddings`` drops every vector and binds another at once.  A process
notices when another process re-embedded the database under it
(:meth:`BaseMeta.model_changed`, one read of ``meta``): its vectors would be of
another model.

What is the same on both engines is written here once, over a
:class:`~memory.storage.dialect.Dialect`; an engine subclasses :class:`BaseMeta` with
its vector table's life (:meth:`BaseMeta.bind`, :meth:`BaseMeta.bind_first`,
``reset_embeddings``).
"""

from __future__ import annotations

from typing import Any

from memory.errors import DatabaseFileError, EmbeddingModelChanged, EmbeddingModelMismatch
from memory.storage.dialect import Dialect, DialectNoun

__all__ = ["BUILDING_KEY", "DIMENSION_KEY", "MODEL_KEY", "PROFILE_KEY", "BaseMeta", "forget_vector_facts",
           "set_meta"]

MODEL_KEY = "embedding_model"
DIMENSION_KEY = "embedding_dim"
PROFILE_KEY = "active_profile"
BUILDING_KEY = "vector_rebuild"
"""The model and size ``reembed`` is building a new vector table for."""


def set_meta(conn: Any, dialect: Dialect, key: str, value: str) -> None:
    """Store ``key`` = ``value`` inside the caller's transaction."""
    conn.execute(dialect.sql("INSERT INTO meta(key, value) VALUES (?, ?) "
                             "ON CONFLICT (key) DO UPDATE SET value = excluded.value"), (key, value))


def forget_vector_facts(conn: Any, dialect: Dialect, *keys: str) -> None:
    """Inside the caller's transaction, delete ``keys`` and every cached similarity floor
    (they describe the vectors being replaced)."""
    conn.execute(dialect.sql(f"DELETE FROM meta WHERE key IN ({', '.join('?' * len(keys))}) "
                             "OR key LIKE 'similarity_floor:%'"), keys)


class BaseMeta(DialectNoun):
    """The contract's ``Meta`` over one engine's database (``read``, ``write``, ``location``).

    Args:
        database: The engine's database.
        dialect: How its SQL differs from the shared SQL.
    """

    def __init__(self, database: Any, dialect: Dialect) -> None:
        super().__init__(database, dialect)
        self.model: str | None = None
        """The embedding model this process writes and searches with (its engine sets
        it): see :meth:`model_changed`."""

    # -- what each engine does its own way -----------------------------------------------

    def bind(self, conn: Any, model_id: str, dimension: int) -> None:
        """Inside the caller's transaction: create the vector table (if missing) and
        record ``model_id`` and ``dimension``."""
        raise NotImplementedError

    def bind_first(self, model_id: str, dimension: int) -> None:
        """Bind a database no model is bound to yet (:meth:`bind_model`)."""
        with self._db.write() as conn:
            self.bind(conn, model_id, dimension)

    # -- values ---------------------------------------------------------------------------

    def get(self, key: str) -> str | None:
        """Return a value from the ``meta`` table, or ``None`` when unset."""
        rows = self._read("SELECT value FROM meta WHERE key = ?", (key,))
        return rows[0][0] if rows else None

    def set(self, key: str, value: str) -> None:
        """Store a value in the ``meta`` table (replacing the one before)."""
        with self._db.write() as conn:
            set_meta(conn, self._dialect, key, value)

    @property
    def active_profile(self) -> str | None:
        """The hardware profile an admin last chose for this database."""
        return self.get(PROFILE_KEY)

    @active_profile.setter
    def active_profile(self, name: str) -> None:
        self.set(PROFILE_KEY, name)

    # -- the embedding model ----------------------------------------------------------------

    def embedding_model(self) -> tuple[str, int] | None:
        """Return ``(model_id, dimension)`` the vectors were made with, if any.

        Raises:
            DatabaseFileError: The stored dimension is not a positive whole number (the
                file was edited or damaged); ``reembed`` rewrites it.
        """
        rows = dict(self._read("SELECT key, value FROM meta WHERE key IN (?, ?)",
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
        self.bind_first(model_id, dimension)
