"""Where a search may look: the filters shared by the keyword and the vector queries.

Engine-neutral: each storage engine turns them into its own query conditions (SQLite:
:mod:`memory.storage.sqlite.filters`).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from memory.records import StoredMessage


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

    def admits(self, message: StoredMessage) -> bool:
        """Whether a stored message lies where these filters let a search look.

        For candidates a search reaches by another way than the storage's filtered
        queries (the messages beside a hit): the same rules, checked on the row.
        """
        return (
            (self.guild_id is None or message.guild_id == self.guild_id)
            and (self.channel_ids is None or message.channel_id in self.channel_ids)
            and (self.author_ids is None or message.author_id in self.author_ids)
            and (self.after_ms is None or message.created_at > self.after_ms)
            and (self.before_ms is None or message.created_at < self.before_ms)
            and (self.has_attachment is None or bool(message.attachments) == self.has_attachment)
        )
