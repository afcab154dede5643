"""Numbered, append-only schema migrations.

Each entry runs once, in order, in its own ``BEGIN IMMEDIATE`` transaction that
also reads and bumps ``PRAGMA user_version``, so processes opening a new database
at the same time apply each migration exactly once.  An entry is an SQL script or
a function of the connection (for a change SQL alone cannot express).  A shipped
migration is never edited: change the schema by appending a new one.

The sqlite-vec table is not created here because its dimension depends on the
embedding model; :meth:`memory.storage.sqlite.meta.SQLiteMeta.bind_model` creates it.
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Iterator
from typing import Any

from memory.errors import DatabaseFileError
from memory.storage import migrations as shared
from memory.storage.sqlite.connection import IN_IDS, id_list, sqlite_driver
from memory.storage.sqlite.vectors import Vec0Table, upgrade_float_table
from memory.storage.sqlite.windows import index_all_window_vectors, index_all_windows, vectors_changed

log = logging.getLogger(__name__)

Migration = str | Callable[[Any], None]


def reembed_cross_channel_replies(conn: Any) -> None:
    """Drop the vectors of replies embedded with another channel's text; they re-embed.

    Before :meth:`memory.storage.sqlite.backlog.SQLiteBacklog.pending` kept a reply's
    antecedent to its own channel, an imported reply to a message elsewhere was embedded with that
    message's text.  Their vectors (and the window vectors holding them) are
    removed and the messages marked pending, so the embedder redoes them with
    same-channel antecedents.
    """
    ids = [row[0] for row in conn.execute(
        "SELECT m.id FROM messages m JOIN messages r ON r.id = m.reply_to_id "
        "WHERE m.embedded = 1 AND r.channel_id != m.channel_id"
    )]
    if ids:
        conn.execute(f"UPDATE messages SET embedded = 0 WHERE id {IN_IDS}", (id_list(ids),))
        index = Vec0Table(lambda sql, params: conn.execute(sql, params).fetchall(),
                            on_change=vectors_changed)
        index.delete(conn, ids)
    log.info("%d replies embedded with another channel's text will be embedded again", len(ids))


def names_per_guild(conn: Any) -> None:
    """Migration 11: a member's names per guild (:func:`memory.storage.migrations.names_per_guild`)."""
    shared.names_per_guild(
        conn, integer="INTEGER", text="TEXT",
        author_columns={row[0] for row in conn.execute("SELECT name FROM pragma_table_info('authors')")},
        drop_names=("ALTER TABLE authors DROP COLUMN name",
                    "ALTER TABLE authors DROP COLUMN display_name"))


MIGRATIONS: list[Migration] = [
    # 1: core tables, FTS5 index kept in sync by triggers.
    """
    CREATE TABLE meta (key TEXT PRIMARY KEY, value TEXT NOT NULL);
    CREATE TABLE guilds (id INTEGER PRIMARY KEY, name TEXT NOT NULL DEFAULT '');
    CREATE TABLE channels (
        id INTEGER PRIMARY KEY,
        guild_id INTEGER NOT NULL REFERENCES guilds(id),
        parent_id INTEGER,
        name TEXT NOT NULL DEFAULT '',
        type TEXT NOT NULL DEFAULT ''
    );
    CREATE TABLE authors (
        id INTEGER PRIMARY KEY,
        name TEXT NOT NULL DEFAULT '',
        display_name TEXT NOT NULL DEFAULT '',
        is_bot INTEGER NOT NULL DEFAULT 0
    );
    CREATE TABLE messages (
        id INTEGER PRIMARY KEY,
        guild_id INTEGER NOT NULL REFERENCES guilds(id),
        channel_id INTEGER NOT NULL REFERENCES channels(id),
        author_id INTEGER NOT NULL REFERENCES authors(id),
        created_at INTEGER NOT NULL,
        edited_at INTEGER,
        content TEXT NOT NULL DEFAULT '',
        reply_to_id INTEGER,
        attachments TEXT NOT NULL DEFAULT '',
        embedded INTEGER NOT NULL DEFAULT 0
    );
    CREATE INDEX messages_by_channel ON messages(channel_id, id);
    CREATE INDEX messages_by_guild ON messages(guild_id, id);
    CREATE INDEX messages_pending ON messages(id) WHERE embedded = 0;
    CREATE VIRTUAL TABLE messages_fts USING fts5(
        content, attachments,
        content='messages', content_rowid='id',
        tokenize='porter unicode61 remove_diacritics 2'
    );
    CREATE TRIGGER messages_ai AFTER INSERT ON messages BEGIN
        INSERT INTO messages_fts(rowid, content, attachments)
        VALUES (new.id, new.content, new.attachments);
    END;
    CREATE TRIGGER messages_ad AFTER DELETE ON messages BEGIN
        INSERT INTO messages_fts(messages_fts, rowid, content, attachments)
        VALUES ('delete', old.id, old.content, old.attachments);
    END;
    CREATE TRIGGER messages_au AFTER UPDATE OF content, attachments ON messages BEGIN
        INSERT INTO messages_fts(messages_fts, rowid, content, attachments)
        VALUES ('delete', old.id, old.content, old.attachments);
        INSERT INTO messages_fts(rowid, content, attachments)
        VALUES (new.id, new.content, new.attachments);
    END;
    """,
    # 2: per guild, how often each bit of the stored 1-bit codes is set; it lets a
    # search guess how far its k-th nearest code lies (memory.storage.sqlite.vectors._RadiusMemory).
    """
    CREATE TABLE code_stats (
        guild_id INTEGER PRIMARY KEY,
        vectors INTEGER NOT NULL,
        ones BLOB NOT NULL  -- int64 per bit: how many of those codes have it set
    );
    """,
    # 3: what a guild chose to be remembered, what must stay forgotten, backfill progress.
    """
    CREATE TABLE tombstones (  -- deleted messages: a late insert or re-import skips them
        message_id INTEGER PRIMARY KEY,
        deleted_at INTEGER NOT NULL
    );
    CREATE TABLE guild_settings (
        guild_id INTEGER PRIMARY KEY,
        channel_mode TEXT NOT NULL DEFAULT 'all'
            CHECK (channel_mode IN ('all', 'include', 'exclude')),
        retention_days INTEGER CHECK (retention_days IS NULL OR retention_days > 0),
        autoresponse TEXT NOT NULL DEFAULT 'mention'
            CHECK (autoresponse IN ('off', 'mention', 'channels'))
    );
    CREATE TABLE channel_rules (  -- the include/exclude list of guild_settings.channel_mode
        guild_id INTEGER NOT NULL,
        channel_id INTEGER NOT NULL,
        PRIMARY KEY (guild_id, channel_id)
    );
    CREATE TABLE autoresponse_channels (
        guild_id INTEGER NOT NULL,
        channel_id INTEGER NOT NULL,
        PRIMARY KEY (guild_id, channel_id)
    );
    CREATE TABLE member_optouts (
        guild_id INTEGER NOT NULL,
        author_id INTEGER NOT NULL,
        PRIMARY KEY (guild_id, author_id)
    );
    CREATE TABLE backfill_cursors (
        channel_id INTEGER PRIMARY KEY,
        guild_id INTEGER NOT NULL,
        before_id INTEGER,  -- the oldest message read so far; the walk goes on before it
        complete INTEGER NOT NULL DEFAULT 0
    );
    CREATE INDEX messages_by_author ON messages(guild_id, author_id);
    CREATE INDEX messages_by_reply ON messages(reply_to_id) WHERE reply_to_id IS NOT NULL;
    CREATE INDEX messages_by_age ON messages(guild_id, created_at);
    """,
    # 4: first-release vector tables (a float vec0 column) move to 1-bit codes + floats
    # (memory.storage.sqlite.vectors).
    upgrade_float_table,
    # 5: embedders claim their batches (memory.storage.sqlite.backlog.SQLiteBacklog.claim), so that two
    # never embed the same message; an expired claim (its embedder died) is free again.
    """
    CREATE TABLE embedding_claims (
        message_id INTEGER PRIMARY KEY,
        owner TEXT NOT NULL,
        expires_at INTEGER NOT NULL  -- unix ms
    );
    """,
    # 6: the keyword index sees author names, and each message's conversational window
    # (memory.storage.sqlite.windows) gets an index of its own; both read `search_text`, which the
    # storage keeps in step with `messages` (a message's row and its neighbours' together).
    """
    DROP TRIGGER IF EXISTS messages_ai;
    DROP TRIGGER IF EXISTS messages_ad;
    DROP TRIGGER IF EXISTS messages_au;
    DROP TABLE IF EXISTS messages_fts;
    CREATE TABLE IF NOT EXISTS search_text (
        id INTEGER PRIMARY KEY,  -- the message's id
        author TEXT NOT NULL DEFAULT '',  -- name and display name
        content TEXT NOT NULL DEFAULT '',
        attachments TEXT NOT NULL DEFAULT '',
        context TEXT NOT NULL DEFAULT '',  -- the window: "author: content" lines
        context_ids TEXT NOT NULL DEFAULT '',  -- the window's message ids, space-separated
        contentful INTEGER NOT NULL DEFAULT 1  -- 0: "lol", "noted": its window speaks not for it
    );
    CREATE VIRTUAL TABLE IF NOT EXISTS search_fts USING fts5(
        author, content, attachments,
        content='search_text', content_rowid='id',
        tokenize='porter unicode61 remove_diacritics 2'
    );
    -- a table of its own: window postings are ~5x a message's, and a message search
    -- must not walk them
    CREATE VIRTUAL TABLE IF NOT EXISTS window_fts USING fts5(
        context,
        content='search_text', content_rowid='id',
        tokenize='porter unicode61 remove_diacritics 2'
    );
    CREATE TRIGGER IF NOT EXISTS search_text_ai AFTER INSERT ON search_text BEGIN
        INSERT INTO search_fts(rowid, author, content, attachments)
        VALUES (new.id, new.author, new.content, new.attachments);
        INSERT INTO window_fts(rowid, context) VALUES (new.id, new.context);
    END;
    CREATE TRIGGER IF NOT EXISTS search_text_ad AFTER DELETE ON search_text BEGIN
        INSERT INTO search_fts(search_fts, rowid, author, content, attachments)
        VALUES ('delete', old.id, old.author, old.content, old.attachments);
        INSERT INTO window_fts(window_fts, rowid, context) VALUES ('delete', old.id, old.context);
    END;
    CREATE TRIGGER IF NOT EXISTS search_text_au AFTER UPDATE ON search_text BEGIN
        INSERT INTO search_fts(search_fts, rowid, author, content, attachments)
        VALUES ('delete', old.id, old.author, old.content, old.attachments);
        INSERT INTO window_fts(window_fts, rowid, context) VALUES ('delete', old.id, old.context);
        INSERT INTO search_fts(rowid, author, content, attachments)
        VALUES (new.id, new.author, new.content, new.attachments);
        INSERT INTO window_fts(rowid, context) VALUES (new.id, new.context);
    END;
    """,
    # 7: fill the new index for messages stored before migration 6.
    index_all_windows,
    # 8: each window's mean vector, stored (memory.storage.sqlite.windows) so that a
    # search looks it up instead of averaging its members' vectors for every candidate.
    index_all_window_vectors,
    # 9: replies embedded with a reply target from another channel go back to the
    # backlog: their vectors carried that channel's text (issue 19, item 3).
    reembed_cross_channel_replies,
    # 10: where a guild's reconcile with Discord (cogs.reconcile) got to, per channel,
    # so an interrupted run resumes; both go when the run finishes.
    """
    CREATE TABLE IF NOT EXISTS reconcile_runs (
        guild_id INTEGER PRIMARY KEY,
        run_id INTEGER NOT NULL  -- the run's start, unix ms
    );
    CREATE TABLE IF NOT EXISTS reconcile_cursors (
        channel_id INTEGER PRIMARY KEY,
        guild_id INTEGER NOT NULL,
        run_id INTEGER NOT NULL,  -- the run's start, unix ms
        before_id INTEGER,  -- recent messages checked down to this id; the rest lie before it
        complete INTEGER NOT NULL DEFAULT 0
    );
    """,
    # 11: a member's names are kept per guild, not one row for every guild (issue 30).
    names_per_guild,
    # 12: messages the embedder failed on, set aside so they no longer block the
    # backlog (issue 31, item 2); an edit or a deletion ends the set-aside.
    """
    CREATE TABLE IF NOT EXISTS embedding_set_aside (
        message_id INTEGER PRIMARY KEY,
        model TEXT NOT NULL,  -- the model that failed on it: another one tries again
        reason TEXT NOT NULL,
        set_at INTEGER NOT NULL  -- unix ms
    );
    CREATE TRIGGER IF NOT EXISTS embedding_set_aside_ad AFTER DELETE ON messages BEGIN
        DELETE FROM embedding_set_aside WHERE message_id = old.id;
    END;
    CREATE TRIGGER IF NOT EXISTS embedding_set_aside_au
    AFTER UPDATE OF content, attachments ON messages
    WHEN old.content IS NOT new.content OR old.attachments IS NOT new.attachments BEGIN
        DELETE FROM embedding_set_aside WHERE message_id = old.id;
    END;
    """,
    # 13: messages the bot heard but could not store before it stopped (issue 30, item
    # 4): the start-up catch-up reads each such channel from before the oldest of them.
    """
    CREATE TABLE IF NOT EXISTS missed_messages (
        channel_id INTEGER NOT NULL,
        message_id INTEGER NOT NULL,
        guild_id INTEGER NOT NULL,
        PRIMARY KEY (channel_id, message_id)
    );
    """,
    # 14: messages an edit left with nothing to store: forgotten without a tombstone
    # (they still exist: text put back later is stored), and no copy edited at or
    # before this time (a stale page, an old export) brings the taken-out text back.
    """
    CREATE TABLE IF NOT EXISTS emptied_messages (
        message_id INTEGER PRIMARY KEY,
        edited_at INTEGER NOT NULL  -- unix ms of the edit that emptied it
    );
    """,
    # 15: the bot's public answers and the stored messages each quotes; an answer whose
    # quoted message is forgotten or edited is due to be taken down (ids only).
    """
    CREATE TABLE IF NOT EXISTS answer_quotes (
        answer_id INTEGER NOT NULL,  -- the bot's message on Discord
        quoted_id INTEGER NOT NULL,  -- a stored message it shows
        channel_id INTEGER NOT NULL,  -- the answer's channel or thread
        guild_id INTEGER NOT NULL,
        PRIMARY KEY (answer_id, quoted_id)
    );
    CREATE INDEX IF NOT EXISTS answer_quotes_quoted ON answer_quotes(quoted_id);
    CREATE INDEX IF NOT EXISTS answer_quotes_guild ON answer_quotes(guild_id);
    CREATE TABLE IF NOT EXISTS retractions (
        answer_id INTEGER PRIMARY KEY,
        channel_id INTEGER NOT NULL,
        guild_id INTEGER NOT NULL
    );
    """,
]


def statements(script: str) -> Iterator[str]:
    """Split an SQL script into complete statements (trigger bodies stay whole).

    ``executescript`` would commit the caller's transaction first, so migrations
    run their scripts one statement at a time instead.
    """
    complete = sqlite_driver().complete_statement
    pending = ""
    for piece in script.split(";"):
        pending += piece + ";"
        if complete(pending):
            if pending.strip(" \t\n;"):
                yield pending.strip()
            pending = ""
    if pending.rstrip(";").strip():
        yield pending.rstrip(";").strip()


def schema_version(conn: Any) -> int:
    """The number of migrations applied to the database on ``conn``."""
    return int(conn.execute("PRAGMA user_version").fetchone()[0])


def migrate(conn: Any, *, read_only: bool = False) -> int:
    """Apply every migration the database has not seen yet.

    Args:
        conn: An autocommit connection from :func:`memory.storage.sqlite.connection.connect`.
        read_only: The connection cannot write: only check that nothing is missing.

    Returns:
        The schema version after migrating.

    Raises:
        DatabaseFileError: The database is newer than this code, or is not this
            bot's (a migration failed; nothing of it was applied).
    """
    while (version := _check(schema_version(conn))) < len(MIGRATIONS):
        if read_only:
            raise DatabaseFileError(
                f"the database is read-only and at schema version {version} of "
                f"{len(MIGRATIONS)}: open it once with write access to upgrade it"
            )
        try:
            conn.execute("BEGIN IMMEDIATE")
        except sqlite_driver().OperationalError as exc:
            raise DatabaseFileError(
                f"could not lock the database to upgrade it ({exc}); if another process "
                "is using it, try again when it is done"
            ) from exc
        try:
            # read again under the write lock: another process may have migrated meanwhile
            version = _check(schema_version(conn))
            if version < len(MIGRATIONS):
                _apply(conn, version + 1)
            conn.execute("COMMIT")
        except BaseException:
            if conn.in_transaction:
                conn.execute("ROLLBACK")
            raise
    return len(MIGRATIONS)


def _refuse_foreign(conn: Any) -> None:
    """A database at version 0 with tables belongs to another application: leave it alone."""
    tables = [row[0] for row in conn.execute(
        "SELECT name FROM sqlite_master WHERE type = 'table' ORDER BY name LIMIT 4")]
    if tables:
        raise DatabaseFileError(
            f"this SQLite file holds another application's tables ({', '.join(tables)}) and "
            "is not the memory bot's; it was left unchanged. Point --db at another file"
        )


def _check(version: int) -> int:
    if version > len(MIGRATIONS):
        raise DatabaseFileError(
            f"the database has schema version {version} but this code knows only "
            f"{len(MIGRATIONS)}: it was written by a newer version of the bot; upgrade it"
        )
    return version


def _apply(conn: Any, number: int) -> None:
    if number == 1:
        _refuse_foreign(conn)
    log.info("applying schema migration %d", number)
    migration = MIGRATIONS[number - 1]
    try:
        if callable(migration):
            migration(conn)
        else:
            for statement in statements(migration):
                conn.execute(statement)
    except sqlite_driver().DatabaseError as exc:
        # e.g. another application's database that already has a `messages` table
        raise DatabaseFileError(
            f"schema migration {number} failed ({exc}); is this database file "
            "really the memory bot's? Point --db at another file"
        ) from exc
    conn.execute(f"PRAGMA user_version = {number}")
