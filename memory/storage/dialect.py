"""The seam between the engine-neutral storage code and each engine's SQL.

The logic both engines need (the conversational windows, the guild-settings switch,
the cursors, meta, a search's filters) is written once, in the modules of
:mod:`memory.storage`, as SQL that both SQLite and PostgreSQL run.  What still
differs between the two is small, and a :class:`Dialect` holds it:

* the parameter marker: shared SQL is written with ``?`` (SQLite's); psycopg wants
  ``%s`` (and a literal ``%`` doubled), which :meth:`Dialect.sql` rewrites;
* "this column is one of these ids": SQLite reads a JSON array
  (``IN (SELECT value FROM json_each(?))``), PostgreSQL a ``bigint[]``
  (``= ANY(?::bigint[])``) — either way one parameter, however many ids.

Each engine builds its one :class:`Dialect` (:data:`memory.storage.sqlite.connection.DIALECT`,
:data:`memory.storage.postgres.connection.DIALECT`); everything else that differs
(locks, upsert forms, types) stays in the engine's own modules.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable
from dataclasses import dataclass
from functools import lru_cache
from typing import Any

__all__ = ["Dialect", "DialectNoun"]


@dataclass(frozen=True)
class Dialect:
    """What one engine's SQL spells differently from the shared SQL.

    Attributes:
        name: ``"sqlite"`` or ``"postgres"`` (for messages and logs).
        placeholder: The driver's parameter marker, ``"?"`` or ``"%s"``.
        one_of_ids: The condition "is one of the ids in the one parameter", written
            after a column (``f"m.id {dialect.one_of_ids}"``), with a ``?`` marker.
        id_param: Turns ids into that one parameter's value.
    """

    name: str
    placeholder: str
    one_of_ids: str
    id_param: Callable[[Iterable[int]], Any]

    def sql(self, text: str) -> str:
        """``text`` (shared SQL with ``?`` markers) as this engine's driver reads it."""
        return text if self.placeholder == "?" else _format_style(text)

    def in_ids(self, column: str) -> str:
        """The condition ``column`` is one of the ids bound by :meth:`ids` (``?`` marker)."""
        return f"{column} {self.one_of_ids}"

    def ids(self, ids: Iterable[int]) -> Any:
        """The parameter for :meth:`in_ids`."""
        return self.id_param(ids)


@lru_cache(maxsize=4096)
def _format_style(text: str) -> str:
    """``?`` markers as ``%s`` (psycopg's), a literal ``%`` doubled (shared SQL has no
    ``?`` other than markers)."""
    return text.replace("%", "%%").replace("?", "%s")


class DialectNoun:
    """A storage noun written once for both engines: its database and its dialect.

    Args:
        database: The engine's database (``read``, ``write``, ``location``, ``read_only``).
        dialect: How the engine's SQL differs from the shared SQL.
    """

    def __init__(self, database: Any, dialect: Dialect) -> None:
        self._db = database
        self._dialect = dialect

    def _read(self, sql: str, params: Any = ()) -> list[tuple]:
        """Run shared SQL (``?`` markers) on the database and return its rows."""
        return self._db.read(self._dialect.sql(sql), params)

    def _execute(self, conn: Any, sql: str, params: Any = ()) -> Any:
        """Run shared SQL on ``conn`` (inside the caller's write transaction)."""
        return conn.execute(self._dialect.sql(sql), params)
