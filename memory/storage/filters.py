"""How a search's :class:`~memory.filters.Filters` become SQL conditions, on either engine.

Every engine keeps the filtered columns (guild, channel, author, creation time, the
attachment flag) beside each indexed row under the same names, so a search's filters
apply inside its ranked scan or KNN rather than after its top ``k``.  Which filters
exist, and that an empty id list is refused, is decided once here
(:class:`FilterSQL`); an engine says only how it writes "one of these ids" and "has
an attachment".
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from memory.errors import SearchInputError
from memory.filters import Filters

__all__ = ["FilterSQL"]


class FilterSQL:
    """Writes a search's filters as one engine's WHERE clauses (call the instance).

    Args:
        placeholder: The engine's parameter marker (``"?"`` or ``"%s"``).
    """

    def __init__(self, placeholder: str) -> None:
        self.placeholder = placeholder

    def one_of(self, column: str, values: Sequence[int], params: list[Any]) -> str:
        """The condition ``column`` is one of ``values`` (non-empty); binds to ``params``."""
        raise NotImplementedError

    def has_attachment(self, prefix: str, wanted: bool, params: list[Any]) -> str:
        """The condition the row's message has (or has not) an attachment."""
        raise NotImplementedError

    def __call__(self, f: Filters, prefix: str, clauses: list[str], params: list[Any]) -> None:
        """Append WHERE clauses for ``f`` to ``clauses`` and their values to ``params``.

        Args:
            f: The filters.
            prefix: The table alias with its dot (``"m."``), or ``""``.
            clauses: Receives SQL conditions, to be joined with AND.
            params: Receives the bound values, in order.

        Raises:
            SearchInputError: An id filter is an empty list (it could match nothing).
        """
        mark = self.placeholder
        if f.guild_id is not None:
            clauses.append(f"{prefix}guild_id = {mark}")
            params.append(f.guild_id)
        for column, values in (("channel_id", f.channel_ids), ("author_id", f.author_ids)):
            if values is not None:
                if not values:
                    raise SearchInputError(f"empty {column} filter")
                clauses.append(self.one_of(f"{prefix}{column}", list(values), params))
        for op, bound in ((">", f.after_ms), ("<", f.before_ms)):
            if bound is not None:
                clauses.append(f"{prefix}created_at {op} {mark}")
                params.append(bound)
        if f.has_attachment is not None:
            clauses.append(self.has_attachment(prefix, f.has_attachment, params))
