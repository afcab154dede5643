"""``reembed`` on either engine: what both engines' ``VectorRebuild`` do alike.

Every vector is made again into a table beside the live one (the engine's ``NEXT``
table) while searches keep using the live one; then the engine swaps it in, in one
transaction.  :class:`BaseRebuild` holds the parts that are the same on both: which
messages the new table still lacks, which of a batch are still as the embedder read
them, the swap's clean-up of ``meta``, and the error when no rebuild is in progress.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import numpy as np

from memory.errors import DatabaseFileError
from memory.records import PendingMessage
from memory.storage.dialect import Dialect, DialectNoun
from memory.storage.meta import BUILDING_KEY, forget_vector_facts

__all__ = ["BaseRebuild", "not_building"]


def not_building() -> DatabaseFileError:
    """The error of a rebuild step with no table being built for its model."""
    return DatabaseFileError("no re-embedding is in progress for this model (another "
                             "`reembed` replaced it?); run `python bot.py reembed` again")


class BaseRebuild(DialectNoun):
    """The engine-neutral half of the contract's ``VectorRebuild``.

    Args:
        database: The engine's database.
        dialect: How its SQL differs from the shared SQL.
        meta: Its ``Meta`` (the model being built and, after the swap, the bound one).
        backlog: Its ``Backlog`` (reads messages as an embedder sees them).
        next_table: The table the new vectors go to.
    """

    def __init__(self, database: Any, dialect: Dialect, meta: Any, backlog: Any,
                 next_table: str) -> None:
        super().__init__(database, dialect)
        self._meta = meta
        self._backlog = backlog
        self._next = next_table

    # -- what each engine does its own way -----------------------------------------------

    def _check_building(self, conn: Any, messages: Sequence[PendingMessage]) -> None:
        """Inside :meth:`write`'s transaction, first: take the engine's locks and raise
        :func:`not_building` when no table is being built."""
        raise NotImplementedError

    def _store(self, conn: Any, rows: list[tuple]) -> None:
        """Write rows ``(message_id, guild_id, channel_id, author_id, created_at,
        has_attachment, float32 vector)`` to the new table, replacing any there."""
        raise NotImplementedError

    # -- the shared steps -------------------------------------------------------------------

    def write(self, messages: Sequence[PendingMessage], vectors: np.ndarray) -> int:
        """Store the new vectors of ``messages``; returns how many were stored.

        A message deleted or changed since it was read (its text, attachments,
        name or antecedent) is skipped: it is embedded again later.
        """
        if len(messages) != len(vectors):
            raise ValueError("one vector per message is required")
        with self._db.write() as conn:
            self._check_building(conn, messages)
            rows = self._unchanged_rows(messages, vectors)
            self._store(conn, rows)
        return len(rows)

    def pending(self, after_id: int, limit: int) -> list[PendingMessage]:
        """Up to ``limit`` messages after ``after_id`` the new table has no vector for."""
        ids = [row[0] for row in self._read(
            f"SELECT id FROM messages m WHERE id > ? AND NOT EXISTS "
            f"(SELECT 1 FROM {self._next} v WHERE v.message_id = m.id) ORDER BY id LIMIT ?",
            (int(after_id), int(limit)))]
        return self._backlog.messages(ids) if ids else []

    def _unchanged_rows(
        self, messages: Sequence[PendingMessage], vectors: np.ndarray
    ) -> list[tuple]:
        """The new table's rows of those of ``messages`` still as the embedder read them
        (a message deleted or changed since, in its text, attachments, name or
        antecedent, is skipped: it is embedded again later)."""
        current = {m.id: m for m in self._backlog.messages([m.id for m in messages])}
        return [(m.id, m.guild_id, m.channel_id, m.author_id, m.created_at,
                 bool(m.attachments), np.ascontiguousarray(v, dtype=np.float32))
                for m, v in zip(messages, vectors) if current.get(m.id) == m]

    def _swapped(self, conn: Any, model_id: str, dimension: int) -> None:
        """Inside the swap's transaction, once the new table is live: the build marker and
        the cached similarity floors go, and ``model_id`` is bound."""
        forget_vector_facts(conn, self._dialect, BUILDING_KEY)
        self._meta.bind(conn, model_id, dimension)
