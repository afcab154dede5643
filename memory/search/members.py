"""The member names a searcher keeps indexed, per guild, for the named-member bonus.

Indexing a guild's names (:class:`memory.search.names.MemberNames`) takes 46 ms for 2,500
members and 200 ms for 5,000, so it is kept between searches and built again only
when a name, or who the guild's members are, has changed.
"""

from __future__ import annotations

import threading
from collections.abc import Sequence

from memory.search.names import MemberNames
from memory.storage.contract import Storage

GUILDS = 64  # guilds whose member names a searcher keeps indexed


class MemberIndex:
    """Each guild's member names, indexed again only when they changed.

    Args:
        storage: Where the members' names are read from.
    """

    def __init__(self, storage: Storage) -> None:
        self._storage = storage
        # guild -> (storage generation, its members' rows, their index)
        self._known: dict[int | None, tuple[int, list, MemberNames]] = {}
        self._lock = threading.Lock()  # searches run on several threads

    def named(self, queries: Sequence[str], guild_id: int | None) -> set[int]:
        """Ids of the guild's members the queries name (:mod:`memory.search.names`)."""
        return self.names(guild_id).named_in("\n".join(queries))

    def names(self, guild_id: int | None) -> MemberNames:
        """The guild's member names, indexed again only when they changed.

        Every write bumps the storage's generation, and in a busy guild nearly every
        search follows one; the members are read again then (a cheap query), but
        indexed again only when the rows differ.
        """
        generation = self._storage.database.generation
        with self._lock:
            known = self._known.get(guild_id)
        if known is not None and known[0] == generation:
            return known[2]
        rows = self._storage.messages.members(guild_id)
        names = known[2] if known is not None and known[1] == rows else MemberNames.build(rows)
        with self._lock:
            self._known.pop(guild_id, None)
            if len(self._known) >= GUILDS:  # the longest unchecked guild goes
                self._known.pop(next(iter(self._known)))
            self._known[guild_id] = (generation, rows, names)
        return names

    def forget(self, guild_id: int) -> None:
        """Drop the guild's indexed names (and those of all guilds, which hold them too):
        a guild or member forgotten leaves nothing of their names in memory."""
        with self._lock:
            self._known.pop(guild_id, None)
            self._known.pop(None, None)

    def guilds(self) -> list[int | None]:
        """The guilds whose names are indexed now, the longest unchecked first."""
        with self._lock:
            return list(self._known)
