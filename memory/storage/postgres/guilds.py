"""What each guild chose, and how far the bot's walks through its channels got, on
PostgreSQL: the shared noun (:mod:`memory.storage.guilds`) with PostgreSQL's locks.

A settings change holds the guild's write lock, so an upsert running beside it in
another process either sees the new rules or committed before them (never stores a
member's message after their opt-out has committed); it also counts the guild's own
settings version (``guild_settings.version``).
"""

from __future__ import annotations

from typing import Any

from memory.storage.guilds import BaseGuilds
from memory.storage.postgres.connection import DIALECT
from memory.storage.postgres.database import PostgresDatabase, lock_guilds

__all__ = ["PostgresGuilds"]


class PostgresGuilds(BaseGuilds):
    """The contract's ``Guilds`` on PostgreSQL."""

    def __init__(self, database: PostgresDatabase) -> None:
        super().__init__(database, DIALECT)

    def lock(self, conn: Any, guild_id: int) -> None:
        """Hold the guild's write lock (:func:`.database.lock_guilds`)."""
        lock_guilds(conn, [guild_id])

    def changed(self, conn: Any, guild_id: int) -> None:
        """Count the guild's settings version."""
        conn.execute("UPDATE guild_settings SET version = version + 1 WHERE guild_id = %s",
                     (guild_id,))
