"""Where a search may look: the filters shared by the keyword and the vector queries.

Engine-neutral: each storage engine turns them into its own query conditions (SQLite:
:mod:`memory.storage.sqlite.filters`).
"""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class Filters:
    """Where a search may look.  ``None`` means "no restriction" for that field.

    Times are unix milliseconds, both bounds exclusive; an empty id tuple matches
    nothing and is refused by the storage (:class:`~memory.errors.SearchInputError`).
    """

    guild_id: int | None = None
    channel_ids: tuple[int, ...] | None = None
    author_ids: tuple[int, ...] | None = None
    after_ms: int | None = None
    before_ms: int | None = None
    has_attachment: bool | None = None

    def __post_init__(self) -> None:
        # id lists given as lists (or sets) become tuples: filters are hashable keys
        for name in ("channel_ids", "author_ids"):
            if getattr(self, name) is not None:
                object.__setattr__(self, name, tuple(getattr(self, name)))
