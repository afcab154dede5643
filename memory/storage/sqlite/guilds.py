"""What each guild chose, and how far the bot's walks through its channels got, on
SQLite: the shared noun (:mod:`memory.storage.guilds`; one writer, so no locks), plus
the opt-outs an upsert reads inside its transaction.
"""

from __future__ import annotations

from memory.storage.guilds import BaseGuilds
from memory.storage.sqlite.connection import DIALECT
from memory.storage.sqlite.database import SQLiteDatabase

__all__ = ["SQLiteGuilds"]


class SQLiteGuilds(BaseGuilds):
    """The contract's ``Guilds`` on one database."""

    def __init__(self, database: SQLiteDatabase) -> None:
        super().__init__(database, DIALECT)

    def opted_out(self) -> set[tuple[int, int]]:
        """``(guild_id, author_id)`` of every member who opted out of a guild.

        Package-internal: an upsert reads it inside its write transaction.
        """
        return {(row[0], row[1]) for row in self._db.read(
            "SELECT guild_id, author_id FROM member_optouts")}
