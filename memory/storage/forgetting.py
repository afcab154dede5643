"""What both engines' ``Forgetting`` do alike once a guild's, a channel's or a member's
messages are gone: their other rows leave, and an author nobody names any more leaves
with them.

Each engine's ``forget_*`` takes its own locks (PostgreSQL) or marks its transaction
as erasing (SQLite) and deletes the messages its own way (tombstones, vectors, the
keyword index); then it calls these, inside the same transaction.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

from memory.storage.dialect import Dialect
from memory.storage.guilds import settings_changed

__all__ = ["drop_channel_rows", "drop_guild_rows", "drop_left_behind", "drop_member_names",
           "drop_unknown_authors", "record_emptied"]


def record_emptied(conn: Any, dialect: Dialect, edits: Mapping[int, int]) -> list[int]:
    """Record that these messages were emptied by an edit at these times (unix ms): no
    copy edited at or before then is stored again (:meth:`.Forgetting.forget_emptied`).
    Inside the caller's write transaction.

    Returns:
        Those stored whose copy is no newer than that edit: the ones to forget (a copy
        edited since, text put back, stays).
    """
    sql = dialect.sql(
        "INSERT INTO emptied_messages(message_id, edited_at) VALUES (?, ?) "
        "ON CONFLICT (message_id) DO UPDATE SET edited_at = CASE WHEN excluded.edited_at > "
        "emptied_messages.edited_at THEN excluded.edited_at ELSE emptied_messages.edited_at END")
    for message_id, edited_at in sorted(edits.items()):  # a few per edit event or page
        conn.execute(sql, (message_id, edited_at))
    stored = conn.execute(dialect.sql(
        f"SELECT id, edited_at FROM messages WHERE {dialect.in_ids('id')}"),
        (dialect.ids(sorted(edits)),)).fetchall()
    return sorted(row[0] for row in stored if (row[1] or 0) <= edits[row[0]])


def drop_guild_rows(conn: Any, dialect: Dialect, guild_id: int, tables: Sequence[str]) -> None:
    """Delete a guild's rows from ``tables`` (each has a ``guild_id``), its channels and its
    name, and the authors only it named; move the settings version.

    Args:
        conn: A connection inside the caller's write transaction.
        dialect: How the engine's SQL differs from the shared SQL.
        guild_id: The guild being forgotten (its messages are gone already).
        tables: The engine's tables that hold the guild's settings, cursors and names.
    """
    named = [row[0] for row in conn.execute(
        dialect.sql("SELECT author_id FROM member_names WHERE guild_id = ?"), (guild_id,))]
    for table in tables:
        conn.execute(dialect.sql(f"DELETE FROM {table} WHERE guild_id = ?"), (guild_id,))
    conn.execute(dialect.sql("DELETE FROM channels WHERE guild_id = ?"), (guild_id,))
    conn.execute(dialect.sql("DELETE FROM guilds WHERE id = ?"), (guild_id,))
    drop_unknown_authors(conn, dialect, named)
    settings_changed(conn, dialect)


def drop_channel_rows(conn: Any, dialect: Dialect, channel_ids: Sequence[int]) -> None:
    """Delete forgotten channels' and threads' backfill progress, missed marks and rows.

    A channel's row holds its name, and a thread's name is text a member wrote; a row
    that still has messages (one stored since, in another transaction) stays.  Inside
    the caller's write transaction, after the channels' messages are gone.
    """
    ids = dialect.ids(channel_ids)
    for table in ("backfill_cursors", "missed_messages"):
        conn.execute(dialect.sql(f"DELETE FROM {table} WHERE {dialect.in_ids('channel_id')}"),
                     (ids,))
    conn.execute(dialect.sql(
        f"DELETE FROM channels WHERE {dialect.in_ids('id')} AND NOT EXISTS "
        "(SELECT 1 FROM messages m WHERE m.channel_id = channels.id)"), (ids,))


def drop_left_behind(conn: Any, dialect: Dialect, gone: Sequence[tuple[int, int, int]]) -> None:
    """After messages ``(channel_id, guild_id, author_id)`` are forgotten (retention, a
    deletion, forget-me): the rows of their threads that hold no message any more (a
    thread's name is text a member wrote), and their authors' names in a guild where no
    message of theirs is left.  Inside the caller's write transaction."""
    if not gone:
        return
    conn.execute(dialect.sql(
        f"DELETE FROM channels WHERE {dialect.in_ids('id')} AND parent_id IS NOT NULL AND "
        "NOT EXISTS (SELECT 1 FROM messages m WHERE m.channel_id = channels.id)"),
        (dialect.ids(sorted({channel for channel, _, _ in gone})),))
    pairs = sorted({(guild, author) for _, guild, author in gone})
    conn.cursor().executemany(dialect.sql(
        "DELETE FROM member_names WHERE guild_id = ? AND author_id = ? AND NOT EXISTS "
        "(SELECT 1 FROM messages m WHERE m.guild_id = member_names.guild_id "
        "AND m.author_id = member_names.author_id)"), pairs)
    drop_unknown_authors(conn, dialect, sorted({author for _, author in pairs}))


def drop_member_names(conn: Any, dialect: Dialect, guild_id: int, author_id: int) -> None:
    """Delete the names a forgotten member has in one guild (not those they have in
    others), their ``authors`` row once nothing names them, and move the settings
    version (they are opted out now).  Inside the caller's write transaction."""
    conn.execute(dialect.sql("DELETE FROM member_names WHERE guild_id = ? AND author_id = ?"),
                 (guild_id, author_id))
    drop_unknown_authors(conn, dialect, [author_id])
    settings_changed(conn, dialect)


def drop_unknown_authors(conn: Any, dialect: Dialect, author_ids: Sequence[int]) -> None:
    """Delete the ``authors`` rows of those of ``author_ids`` that no guild names any more
    and no stored message refers to (one pass over the messages, only if any is left)."""
    unnamed = [row[0] for row in conn.execute(dialect.sql(
        f"SELECT id FROM authors WHERE {dialect.in_ids('id')} AND NOT EXISTS "
        "(SELECT 1 FROM member_names n WHERE n.author_id = authors.id)"),
        (dialect.ids(author_ids),))]
    if unnamed:
        conn.execute(dialect.sql(f"DELETE FROM authors WHERE {dialect.in_ids('id')} AND id NOT IN "
                                 "(SELECT author_id FROM messages)"), (dialect.ids(unnamed),))
