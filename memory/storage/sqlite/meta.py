"""The ``meta`` table on SQLite (:mod:`memory.storage.meta` says what it holds): the vec0
table's life.

Binding a model creates the vec0 table of its size; :meth:`SQLiteMeta.reset_embeddings`
drops every vector and binds another at once, which is also how a lost vector table
is repaired (:meth:`SQLiteMeta.repair_vector_table`, when the file opens).
"""

from __future__ import annotations

import logging
from typing import Any

from memory.errors import DatabaseFileError
from memory.storage import meta
from memory.storage.meta import (
    BUILDING_KEY,
    DIMENSION_KEY,
    MODEL_KEY,
    BaseMeta,
    forget_vector_facts,
)
from memory.storage.sqlite.connection import DIALECT
from memory.storage.sqlite.database import SQLiteDatabase
from memory.storage.sqlite.vectors import Vec0Table

log = logging.getLogger(__name__)


def set_meta(conn: Any, key: str, value: str) -> None:
    """Store ``key`` = ``value`` inside the caller's transaction."""
    meta.set_meta(conn, DIALECT, key, value)


class SQLiteMeta(BaseMeta):
    """The contract's ``Meta`` on one database (the shared part: :class:`BaseMeta`).

    Args:
        database: The database.
        table: Its vector table, created when a model is bound and dropped on reset.
    """

    def __init__(self, database: SQLiteDatabase, table: Vec0Table) -> None:
        super().__init__(database, DIALECT)
        self._table = table

    def reset_embeddings(self, model_id: str, dimension: int) -> None:
        """Drop every vector and bind to a new model; all messages become pending."""
        with self._db.write() as conn:
            self._table.drop(conn)
            # the cached similarity floors describe the old model's vectors
            forget_vector_facts(conn, DIALECT, MODEL_KEY, DIMENSION_KEY, BUILDING_KEY)
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
        set_meta(conn, MODEL_KEY, model_id)
        set_meta(conn, DIMENSION_KEY, str(dimension))
