"""Migration steps both engines run alike (each engine keeps its own numbered list:
:mod:`memory.storage.sqlite.migrations`, :mod:`memory.storage.postgres.migrations`).

A step here runs exactly the SQL the engine's migration ran when it shipped; only the
column types and the engine's own catalogue reads come from the caller.
"""

from __future__ import annotations

import logging
from collections.abc import Sequence
from typing import Any

__all__ = ["names_per_guild"]

log = logging.getLogger(__name__)


def names_per_guild(conn: Any, *, integer: str, text: str, author_columns: set[str],
                    drop_names: Sequence[str]) -> None:
    """Move each member's one ``authors`` name row to a row per guild they wrote in.

    A nickname is a fact about one server (issue 30): the global row let the name a
    member has in one guild label their messages in every other.  Each guild the
    member has stored messages in gets a copy of the row they had (it is the name that
    guild's members saw); a guild with none of their messages gets nothing.  The
    global columns go: ``authors`` keeps the id and whether the account is a bot.

    Args:
        conn: The migration's connection (inside its transaction).
        integer: The engine's 64-bit integer type.
        text: The engine's text type.
        author_columns: The columns ``authors`` has now.
        drop_names: The engine's statements that drop ``authors.name`` and
            ``authors.display_name``.
    """
    conn.execute(f"""
        CREATE TABLE IF NOT EXISTS member_names (
            guild_id {integer} NOT NULL,
            author_id {integer} NOT NULL,
            name {text} NOT NULL DEFAULT '',
            display_name {text} NOT NULL DEFAULT '',
            PRIMARY KEY (guild_id, author_id)
        )""")
    conn.execute("CREATE INDEX IF NOT EXISTS member_names_by_author ON member_names(author_id)")
    if "display_name" not in author_columns:
        return  # a schema that has had them moved already
    moved = conn.execute(
        "INSERT INTO member_names(guild_id, author_id, name, display_name) "
        "SELECT p.guild_id, a.id, a.name, a.display_name "
        "FROM (SELECT DISTINCT guild_id, author_id FROM messages) p "
        "JOIN authors a ON a.id = p.author_id").rowcount
    members = conn.execute("SELECT count(*) FROM authors").fetchone()[0]
    for statement in drop_names:
        conn.execute(statement)
    log.info("the names of %d members are now kept per server: %d rows", members, moved)
