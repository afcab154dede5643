"""How a search's :class:`~memory.filters.Filters` become SQL conditions.

The keyword queries filter the ``messages`` table; the vector KNN filters the vec0
table's metadata and partition columns, which share the names used here, so the
filters apply inside the KNN rather than after its top ``k``.
"""

from __future__ import annotations

from typing import Any

from memory.errors import SearchInputError
from memory.filters import Filters


def filter_sql(f: Filters, prefix: str, clauses: list[str], params: list[Any]) -> None:
    """Append WHERE clauses for ``f`` to ``clauses`` and their values to ``params``.

    Args:
        f: The filters.
        prefix: ``"m."`` for the ``messages`` table, ``""`` for the vec0 table (whose
            metadata columns share the names used here).
        clauses: Receives SQL conditions, to be joined with AND.
        params: Receives the bound values, in order.

    Raises:
        SearchInputError: An id filter is an empty list (it could match nothing).
    """
    if f.guild_id is not None:
        clauses.append(f"{prefix}guild_id = ?")
        params.append(f.guild_id)
    for column, values in (("channel_id", f.channel_ids), ("author_id", f.author_ids)):
        if values is not None:
            if not values:
                raise SearchInputError(f"empty {column} filter")
            clauses.append(f"{prefix}{column} IN ({','.join('?' * len(values))})")
            params.extend(values)
    if f.after_ms is not None:
        clauses.append(f"{prefix}created_at > ?")
        params.append(f.after_ms)
    if f.before_ms is not None:
        clauses.append(f"{prefix}created_at < ?")
        params.append(f.before_ms)
    if f.has_attachment is not None:
        clauses.append(f"({prefix}attachments != '') = ?" if prefix else "has_attachment = ?")
        params.append(int(f.has_attachment))
