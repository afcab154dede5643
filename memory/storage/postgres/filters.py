"""How a search's :class:`~memory.filters.Filters` become PostgreSQL conditions
(:mod:`memory.storage.filters` decides which).

The keyword tables and the vector table carry the message's guild, channel, author,
creation time and ``has_attachment`` beside each row, under the same names, so a
search's filters apply inside the ranked scan and inside the HNSW scan (pgvector's
iterative index scan keeps walking the graph until enough rows pass), never after
their top ``k``.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from memory.storage.filters import FilterSQL

__all__ = ["filter_sql"]


class _PostgresFilters(FilterSQL):
    def one_of(self, column: str, values: Sequence[int], params: list[Any]) -> str:
        params.append(list(values))
        return f"{column} = ANY(%s::bigint[])"

    def has_attachment(self, prefix: str, wanted: bool, params: list[Any]) -> str:
        params.append(bool(wanted))
        return f"{prefix}has_attachment = %s"


filter_sql = _PostgresFilters("%s")
"""``filter_sql(f, prefix, clauses, params)``: ``%s``-style, see :meth:`FilterSQL.__call__`."""
