"""How a search's :class:`~memory.filters.Filters` become PostgreSQL conditions.

The keyword tables and the vector table carry the message's guild, channel, author,
creation time and ``has_attachment`` beside each row, under the same names, so a
search's filters apply inside the ranked scan and inside the HNSW scan (pgvector's
iterative index scan keeps walking the graph until enough rows pass), never after
their top ``k``.
"""

from __future__ import annotations

from typing import Any

from memory.errors import SearchInputError
from memory.filters import Filters


def filter_sql(f: Filters, prefix: str, clauses: list[str], params: list[Any]) -> None:
    """Append ``%s``-style WHERE clauses for ``f`` to ``clauses`` and values to ``params``.

    Args:
        f: The filters.
        prefix: The table alias with its dot (``"k."``), or ``""``.
        clauses: Receives SQL conditions, to be joined with AND.
        params: Receives the bound values, in order.

    Raises:
        SearchInputError: An id filter is an empty list (it could match nothing).
    """
    if f.guild_id is not None:
        clauses.append(f"{prefix}guild_id = %s")
        params.append(f.guild_id)
    for column, values in (("channel_id", f.channel_ids), ("author_id", f.author_ids)):
        if values is not None:
            if not values:
                raise SearchInputError(f"empty {column} filter")
            clauses.append(f"{prefix}{column} = ANY(%s::bigint[])")
            params.append(list(values))
    if f.after_ms is not None:
        clauses.append(f"{prefix}created_at > %s")
        params.append(f.after_ms)
    if f.before_ms is not None:
        clauses.append(f"{prefix}created_at < %s")
        params.append(f.before_ms)
    if f.has_attachment is not None:
        clauses.append(f"{prefix}has_attachment = %s")
        params.append(bool(f.has_attachment))
