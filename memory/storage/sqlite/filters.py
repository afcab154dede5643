"""How a search's :class:`~memory.filters.Filters` become SQLite conditions
(:mod:`memory.storage.filters` decides which).

The keyword queries filter the ``messages`` table; the vector KNN filters the vec0
table's metadata and partition columns, which share the names used here, so the
filters apply inside the KNN rather than after its top ``k``.  An id list is spelled
out (``IN (?, ?, ...)``), which vec0 reads as a metadata filter.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from memory.storage.filters import FilterSQL

__all__ = ["filter_sql"]


class _SQLiteFilters(FilterSQL):
    def one_of(self, column: str, values: Sequence[int], params: list[Any]) -> str:
        params.extend(values)
        return f"{column} IN ({','.join('?' * len(values))})"

    def has_attachment(self, prefix: str, wanted: bool, params: list[Any]) -> str:
        # ``prefix`` "m.": the messages table; "": the vec0 table's metadata column
        params.append(int(wanted))
        return f"({prefix}attachments != '') = ?" if prefix else "has_attachment = ?"


filter_sql = _SQLiteFilters("?")
"""``filter_sql(f, prefix, clauses, params)``: see :meth:`FilterSQL.__call__`; ``prefix``
is ``"m."`` for the ``messages`` table, ``""`` for the vec0 table."""
