"""What the bot's public answers quote, on PostgreSQL: the shared noun
(:mod:`memory.storage.quotes`) with PostgreSQL's locks.

Recording an answer holds its guild's write lock, as every ``forget_*`` of the guild's
messages does: a forget in another process either committed before (the quoted
message is gone, so the answer is due at once) or waits and finds the quote rows.
"""

from __future__ import annotations

from typing import Any

from memory.storage.postgres.connection import DIALECT
from memory.storage.postgres.database import PostgresDatabase, lock_guilds
from memory.storage.quotes import BaseQuotes

__all__ = ["PostgresQuotes"]


class PostgresQuotes(BaseQuotes):
    """The contract's ``Quotes`` on PostgreSQL."""

    def __init__(self, database: PostgresDatabase) -> None:
        super().__init__(database, DIALECT)

    def lock(self, conn: Any, guild_id: int) -> None:
        """Hold the guild's write lock (:func:`.database.lock_guilds`)."""
        lock_guilds(conn, [guild_id])
