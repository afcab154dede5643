"""Numbered, append-only schema migrations for the PostgreSQL engine.

Each entry runs once, in order, in its own transaction that first takes
``pg_advisory_xact_lock`` on the migration key and then reads the version again, so
several processes opening a new database at the same moment migrate it exactly once
(the others wait on the lock, then find nothing left to do).  The version is the
highest row of ``schema_migrations``.  A shipped migration is never edited: change
the schema by appending a new one.

The vector table is not created here because its dimension depends on the
embedding model; :meth:`memory.storage.postgres.meta.PostgresMeta.bind_model`
creates it.
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from typing import Any

from memory.errors import DatabaseFileError
from memory.storage import migrations as shared
from memory.storage.postgres.connection import one_line
from memory.storage.postgres.windows import index_rows
from memory.storage.tokens import MAX_TERM_BYTES

log = logging.getLogger(__name__)

Migration = str | Callable[[Any], None]

MIGRATE_LOCK = 0x6D656D6F7279  # "memory": the advisory lock every migration runs under

_OUR_TABLES = {"schema_migrations", "meta", "messages"}


def create_vector_extension(conn: Any) -> None:
    """``CREATE EXTENSION vector`` unless it exists; say who may run it when we may not."""
    if conn.execute("SELECT 1 FROM pg_extension WHERE extname = 'vector'").fetchone():
        return
    try:
        conn.execute("CREATE EXTENSION IF NOT EXISTS vector")
    except Exception as exc:  # InsufficientPrivilege, FeatureNotSupported (not installed)
        raise DatabaseFileError(
            f"the pgvector extension is missing in this database and this role cannot create "
            f"it ({one_line(exc)}): as the database owner or a superuser run "
            "`CREATE EXTENSION vector;` in it (pgvector 0.8 or newer must be installed on "
            "the server), then start again"
        ) from exc


def denser_vector_graph(conn: Any) -> None:
    """Rebuild each HNSW graph built with pgvector's defaults as ``m`` 24,
    ``ef_construction`` 128 (:data:`memory.storage.postgres.vectors.GRAPH` says why).

    Once per database; searches wait for it.  The build is fastest with the graph
    inside ``maintenance_work_mem`` (1.2 GB for a million 384-dimension vectors).
    """
    if conn.execute("SELECT to_regclass('message_vectors')").fetchone()[0] is None:
        return
    vectors = conn.execute("SELECT coalesce(sum(vectors), 0) FROM index_stats").fetchone()[0]
    for (name,) in conn.execute(
            "SELECT c.relname FROM pg_index i JOIN pg_class c ON c.oid = i.indexrelid "
            "JOIN pg_am a ON a.oid = c.relam WHERE i.indrelid = 'message_vectors'::regclass "
            "AND a.amname = 'hnsw' AND NOT coalesce(c.reloptions @> "
            "ARRAY['m=24', 'ef_construction=128'], false) ORDER BY c.relname").fetchall():
        log.warning("rebuilding the vector index %s over %d vectors as a denser graph (once; "
                    "searches wait; about 20 minutes per million vectors on 2 cores)",
                    name, vectors)
        conn.execute(f'ALTER INDEX "{name}" SET (m = 24, ef_construction = 128)')
        conn.execute(f'REINDEX INDEX "{name}"')


def names_per_guild(conn: Any) -> None:
    """A member's names per guild (:func:`memory.storage.migrations.names_per_guild`)."""
    shared.names_per_guild(
        conn, integer="bigint", text="text",
        author_columns={row[0] for row in conn.execute(
            "SELECT column_name FROM information_schema.columns "
            "WHERE table_schema = current_schema() AND table_name = 'authors'")},
        drop_names=("ALTER TABLE authors DROP COLUMN name, DROP COLUMN display_name",))


# Every column that holds a message's text, a word of it or a name.  ANALYZE (run by
# autovacuum on its own) copies sample values of a column into pg_statistic; a
# forgotten message's text then stays in that catalog, where no DELETE of ours
# reaches it, and an ANALYZE of an emptied table leaves it there.
TEXT_COLUMNS: dict[str, tuple[str, ...]] = {
    "guilds": ("name",), "channels": ("name",), "member_names": ("name", "display_name"),
    "messages": ("content", "attachments"),
    "search_text": ("author", "content", "attachments", "context"),
    "keyword_terms": ("term",), "message_postings": ("term",), "window_postings": ("term",),
}
_SET_ASIDE_TRIGGER = "DROP TRIGGER IF EXISTS embedding_set_aside_au ON messages"


def text_out_of_statistics(conn: Any) -> None:
    """No text, word or name in the planner's statistics, now or after any ANALYZE.

    Each column's statistics target goes to 0 (ANALYZE skips it) and what an earlier
    ANALYZE stored for it is removed: with ``pg_clear_attribute_stats`` (PostgreSQL 18,
    the table owner may call it), else by altering the column to its own type, which
    drops its statistics without rewriting the table (the set-aside trigger names two
    of messages' columns, so it is dropped and created again around that).
    """
    clear = conn.execute("SELECT to_regproc('pg_clear_attribute_stats')").fetchone()[0]
    if clear is None:
        conn.execute(_SET_ASIDE_TRIGGER)
    for table, columns in TEXT_COLUMNS.items():
        for column in columns:
            if clear is not None:
                conn.execute("SELECT pg_clear_attribute_stats(current_schema(), %s, %s, false)",
                             (table, column))
            else:
                collation = ' COLLATE "C"' if column == "term" else ""
                conn.execute(f"ALTER TABLE {table} ALTER COLUMN {column} TYPE text{collation}")
            conn.execute(f"ALTER TABLE {table} ALTER COLUMN {column} SET STATISTICS 0")
    if clear is None:
        conn.execute(MIGRATIONS[5])  # the set-aside table's migration runs again: the trigger


def capped_terms(conn: Any) -> None:
    """Keyword documents holding a word longer than :data:`~memory.storage.tokens.MAX_TERM_BYTES`
    are written again with it cut, as queries now cut it (a longer one was refused)."""
    ids = [row[0] for row in conn.execute(
        "SELECT id FROM message_postings WHERE octet_length(term) > %s "
        "UNION SELECT id FROM window_postings WHERE octet_length(term) > %s",
        (MAX_TERM_BYTES, MAX_TERM_BYTES))]
    if ids:
        index_rows(conn, conn.execute("SELECT id, author, content, attachments, context, "
                                      "context_ids, contentful FROM search_text "
                                      "WHERE id = ANY(%s)", (ids,)).fetchall())


MIGRATIONS: list[Migration] = [
    # 1: pgvector (created by the database owner beforehand where this role may not).
    create_vector_extension,
    # 2: the tables of SQLite's migrations 1-10 as they stand, in one step.
    """
    CREATE TABLE meta (key text PRIMARY KEY, value text NOT NULL);
    CREATE TABLE guilds (id bigint PRIMARY KEY, name text NOT NULL DEFAULT '');
    CREATE TABLE channels (
        id bigint PRIMARY KEY,
        guild_id bigint NOT NULL REFERENCES guilds(id),
        parent_id bigint,
        name text NOT NULL DEFAULT '',
        type text NOT NULL DEFAULT ''
    );
    CREATE INDEX channels_by_parent ON channels(parent_id) WHERE parent_id IS NOT NULL;
    CREATE INDEX channels_by_guild ON channels(guild_id);
    CREATE TABLE authors (
        id bigint PRIMARY KEY,
        name text NOT NULL DEFAULT '',
        display_name text NOT NULL DEFAULT '',
        is_bot boolean NOT NULL DEFAULT false
    );
    CREATE TABLE messages (
        id bigint PRIMARY KEY,
        guild_id bigint NOT NULL REFERENCES guilds(id),
        channel_id bigint NOT NULL REFERENCES channels(id),
        author_id bigint NOT NULL REFERENCES authors(id),
        created_at bigint NOT NULL,
        edited_at bigint,
        content text NOT NULL DEFAULT '',
        reply_to_id bigint,
        attachments text NOT NULL DEFAULT '',
        embedded boolean NOT NULL DEFAULT false
    );
    CREATE INDEX messages_by_channel ON messages(channel_id, id);
    CREATE INDEX messages_by_guild ON messages(guild_id, id);
    CREATE INDEX messages_pending ON messages(id) WHERE NOT embedded;
    CREATE INDEX messages_by_author ON messages(guild_id, author_id);
    CREATE INDEX messages_by_reply ON messages(reply_to_id) WHERE reply_to_id IS NOT NULL;
    CREATE INDEX messages_by_age ON messages(guild_id, created_at);
    CREATE TABLE tombstones (  -- forgotten messages: a late insert or re-import skips them
        message_id bigint PRIMARY KEY,
        deleted_at bigint NOT NULL
    );
    -- never holds a committed row: an upsert and a forget insert the ids they are about
    -- to write here first (and delete them before committing), so the two wait for each
    -- other on the same id instead of each missing the other's uncommitted rows
    CREATE UNLOGGED TABLE message_locks (id bigint PRIMARY KEY);
    CREATE TABLE guild_settings (
        guild_id bigint PRIMARY KEY,
        channel_mode text NOT NULL DEFAULT 'all'
            CHECK (channel_mode IN ('all', 'include', 'exclude')),
        retention_days integer CHECK (retention_days IS NULL OR retention_days > 0),
        autoresponse text NOT NULL DEFAULT 'mention'
            CHECK (autoresponse IN ('off', 'mention', 'channels')),
        version bigint NOT NULL DEFAULT 0  -- bumped by every change: other processes notice
    );
    CREATE TABLE channel_rules (
        guild_id bigint NOT NULL,
        channel_id bigint NOT NULL,
        PRIMARY KEY (guild_id, channel_id)
    );
    CREATE TABLE autoresponse_channels (
        guild_id bigint NOT NULL,
        channel_id bigint NOT NULL,
        PRIMARY KEY (guild_id, channel_id)
    );
    CREATE TABLE member_optouts (
        guild_id bigint NOT NULL,
        author_id bigint NOT NULL,
        PRIMARY KEY (guild_id, author_id)
    );
    CREATE TABLE backfill_cursors (
        channel_id bigint PRIMARY KEY,
        guild_id bigint NOT NULL,
        before_id bigint,
        complete boolean NOT NULL DEFAULT false
    );
    CREATE TABLE reconcile_runs (guild_id bigint PRIMARY KEY, run_id bigint NOT NULL);
    CREATE TABLE reconcile_cursors (
        channel_id bigint PRIMARY KEY,
        guild_id bigint NOT NULL,
        run_id bigint NOT NULL,
        before_id bigint,
        complete boolean NOT NULL DEFAULT false
    );
    CREATE TABLE embedding_claims (
        message_id bigint PRIMARY KEY,
        owner text NOT NULL,
        lock_key bigint NOT NULL,  -- the owner's session advisory lock: held while it lives
        expires_at bigint NOT NULL  -- unix ms
    );
    CREATE INDEX embedding_claims_by_owner ON embedding_claims(owner);
    -- the conversational windows (memory.storage.postgres.windows), as SQLite keeps them
    CREATE TABLE search_text (
        id bigint PRIMARY KEY,
        author text NOT NULL DEFAULT '',
        content text NOT NULL DEFAULT '',
        attachments text NOT NULL DEFAULT '',
        context text NOT NULL DEFAULT '',
        context_ids text NOT NULL DEFAULT '',
        contentful boolean NOT NULL DEFAULT true
    );
    -- the keyword documents (memory.storage.postgres.keywords): FTS5's tokens with their
    -- (column-weighted) frequency per document, and the document's length in tokens
    CREATE TABLE keyword_messages (
        id bigint PRIMARY KEY,
        guild_id bigint NOT NULL,
        channel_id bigint NOT NULL,
        author_id bigint NOT NULL,
        created_at bigint NOT NULL,
        has_attachment boolean NOT NULL,
        terms jsonb NOT NULL,
        length integer NOT NULL
    );
    CREATE INDEX keyword_messages_terms ON keyword_messages USING gin (terms);
    CREATE TABLE keyword_windows (
        id bigint PRIMARY KEY,
        guild_id bigint NOT NULL,
        channel_id bigint NOT NULL,
        author_id bigint NOT NULL,
        created_at bigint NOT NULL,
        has_attachment boolean NOT NULL,
        contentful boolean NOT NULL,
        terms jsonb NOT NULL,
        length integer NOT NULL
    );
    CREATE INDEX keyword_windows_terms ON keyword_windows USING gin (terms);
    -- per guild: documents and tokens of both keyword tables (BM25's N and avgdl), and
    -- stored vectors; one row per guild keeps writers of different guilds apart
    CREATE TABLE index_stats (
        guild_id bigint PRIMARY KEY,
        documents bigint NOT NULL DEFAULT 0,
        message_tokens bigint NOT NULL DEFAULT 0,
        window_tokens bigint NOT NULL DEFAULT 0,
        vectors bigint NOT NULL DEFAULT 0
    );
    CREATE TABLE window_vectors (id bigint PRIMARY KEY, vector bytea NOT NULL);  -- float16
    """,
    # 3: keyword postings (memory.storage.postgres.keywords): one row per word per
    # document, read through a covering B-tree by the query's words alone, instead of
    # each matching document's JSONB; per guild, how many documents hold each word
    """
    CREATE TABLE message_postings (
        guild_id bigint NOT NULL,
        id bigint NOT NULL,
        channel_id bigint NOT NULL,
        author_id bigint NOT NULL,
        created_at bigint NOT NULL,
        tf real NOT NULL,  -- the word's column-weighted frequency in the document
        length integer NOT NULL,  -- the document's length in words
        has_attachment boolean NOT NULL,
        term text COLLATE "C" NOT NULL
    );
    CREATE INDEX message_postings_by_term ON message_postings (term, guild_id)
        INCLUDE (id, channel_id, author_id, created_at, has_attachment, tf, length);
    CREATE INDEX message_postings_by_id ON message_postings (id);
    CREATE TABLE window_postings (
        guild_id bigint NOT NULL,
        id bigint NOT NULL,
        channel_id bigint NOT NULL,
        author_id bigint NOT NULL,
        created_at bigint NOT NULL,
        tf real NOT NULL,
        length integer NOT NULL,
        has_attachment boolean NOT NULL,
        contentful boolean NOT NULL,
        term text COLLATE "C" NOT NULL
    );
    CREATE INDEX window_postings_by_term ON window_postings (term, guild_id)
        INCLUDE (id, channel_id, author_id, created_at, has_attachment, contentful, tf, length);
    CREATE INDEX window_postings_by_id ON window_postings (id);
    CREATE TABLE keyword_terms (
        term text COLLATE "C" NOT NULL,
        guild_id bigint NOT NULL,
        messages integer NOT NULL DEFAULT 0,  -- documents holding the word, per field
        windows integer NOT NULL DEFAULT 0,
        PRIMARY KEY (term, guild_id)
    );
    -- a word no document holds any more leaves at once (it may be a forgotten one)
    CREATE INDEX keyword_terms_unused ON keyword_terms (term)
        WHERE messages <= 0 AND windows <= 0;
    INSERT INTO message_postings
        SELECT d.guild_id, d.id, d.channel_id, d.author_id, d.created_at, t.value::real,
               d.length, d.has_attachment, t.key
        FROM keyword_messages d, jsonb_each_text(d.terms) t;
    INSERT INTO window_postings
        SELECT d.guild_id, d.id, d.channel_id, d.author_id, d.created_at, t.value::real,
               d.length, d.has_attachment, d.contentful, t.key
        FROM keyword_windows d, jsonb_each_text(d.terms) t;
    INSERT INTO keyword_terms (term, guild_id, messages, windows)
        SELECT term, guild_id, count(*) FILTER (WHERE field = 'm'),
               count(*) FILTER (WHERE field = 'w')
        FROM (SELECT term, guild_id, 'm' AS field FROM message_postings
              UNION ALL SELECT term, guild_id, 'w' FROM window_postings) p
        GROUP BY term, guild_id;
    DROP INDEX keyword_messages_terms;
    DROP INDEX keyword_windows_terms;
    ALTER TABLE keyword_messages DROP COLUMN terms;
    ALTER TABLE keyword_windows DROP COLUMN terms;
    ANALYZE message_postings, window_postings, keyword_terms;
    """,
    # 4: the HNSW graphs a version before this one built with pgvector's defaults.
    denser_vector_graph,
    # 5: a member's names are kept per guild, not one row for every guild (issue 30).
    names_per_guild,
    # 6: messages the embedder failed on, set aside so they no longer block the
    # backlog (issue 31, item 2); an edit or a deletion ends the set-aside.  Written to
    # run again on a database that has it (as the tests of earlier migrations do).
    """
    CREATE TABLE IF NOT EXISTS embedding_set_aside (
        message_id bigint PRIMARY KEY REFERENCES messages(id) ON DELETE CASCADE,
        model text NOT NULL,  -- the model that failed on it: another one tries again
        reason text NOT NULL,
        set_at bigint NOT NULL  -- unix ms
    );
    CREATE OR REPLACE FUNCTION embedding_set_aside_edited() RETURNS trigger LANGUAGE plpgsql AS $$
    BEGIN
        DELETE FROM embedding_set_aside WHERE message_id = OLD.id;
        RETURN NULL;
    END $$;
    DROP TRIGGER IF EXISTS embedding_set_aside_au ON messages;
    CREATE TRIGGER embedding_set_aside_au AFTER UPDATE OF content, attachments ON messages
        FOR EACH ROW WHEN (OLD.content IS DISTINCT FROM NEW.content
                           OR OLD.attachments IS DISTINCT FROM NEW.attachments)
        EXECUTE FUNCTION embedding_set_aside_edited();
    """,
    # 7: messages the bot heard but could not store before it stopped (issue 30, item
    # 4): the start-up catch-up reads each such channel from before the oldest of them.
    """
    CREATE TABLE IF NOT EXISTS missed_messages (
        channel_id bigint NOT NULL,
        message_id bigint NOT NULL,
        guild_id bigint NOT NULL,
        PRIMARY KEY (channel_id, message_id)
    );
    """,
    # 8: no message text, word or name in pg_statistic (docs/privacy.md).
    text_out_of_statistics,
    # 9: messages an edit left with nothing to store: forgotten without a tombstone
    # (they still exist: text put back later is stored), and no copy edited at or
    # before this time (a stale page, an old export) brings the taken-out text back.
    """
    CREATE TABLE IF NOT EXISTS emptied_messages (
        message_id bigint PRIMARY KEY,
        edited_at bigint NOT NULL  -- unix ms of the edit that emptied it
    );
    """,
    # 10: a word is cut to memory.storage.tokens.MAX_TERM_BYTES (PostgreSQL's indexes
    # refused a message holding one of ~2,700 bytes): the documents of longer ones again.
    capped_terms,
    # 11: the bot's public answers and the stored messages each quotes; an answer whose
    # quoted message is forgotten or edited is due to be taken down (ids only).
    """
    CREATE TABLE IF NOT EXISTS answer_quotes (
        answer_id bigint NOT NULL,  -- the bot's message on Discord
        quoted_id bigint NOT NULL,  -- a stored message it shows
        channel_id bigint NOT NULL,  -- the answer's channel or thread
        guild_id bigint NOT NULL,
        PRIMARY KEY (answer_id, quoted_id)
    );
    CREATE INDEX IF NOT EXISTS answer_quotes_quoted ON answer_quotes(quoted_id);
    CREATE INDEX IF NOT EXISTS answer_quotes_guild ON answer_quotes(guild_id);
    CREATE TABLE IF NOT EXISTS retractions (
        answer_id bigint PRIMARY KEY,
        channel_id bigint NOT NULL,
        guild_id bigint NOT NULL
    );
    """,
]


def schema_version(conn: Any) -> int:
    """How many migrations the database on ``conn`` has seen (0: none, or a new database)."""
    if conn.execute("SELECT to_regclass('schema_migrations')").fetchone()[0] is None:
        return 0
    return int(conn.execute("SELECT coalesce(max(version), 0) FROM schema_migrations").fetchone()[0])


def migrate(conn: Any, *, read_only: bool = False, location: str = "the database") -> int:
    """Apply every migration the database has not seen yet.

    Args:
        conn: An autocommit connection.
        read_only: Only check that nothing is missing.
        location: Named in errors (the URL without its password).

    Returns:
        The schema version after migrating.

    Raises:
        DatabaseFileError: The database is newer than this code, holds another
            application's tables, or a migration failed (nothing of it was applied).
    """
    while (version := _check(schema_version(conn), location)) < len(MIGRATIONS):
        if read_only:
            raise DatabaseFileError(
                f"{location} is read-only here and at schema version {version} of "
                f"{len(MIGRATIONS)}: open it once with a role that may write to upgrade it"
            )
        with conn.transaction():
            conn.execute("SELECT pg_advisory_xact_lock(%s)", (MIGRATE_LOCK,))
            _version_table(conn, location)
            # read again under the lock: another process may have migrated meanwhile
            version = _check(int(conn.execute(
                "SELECT coalesce(max(version), 0) FROM schema_migrations").fetchone()[0]), location)
            if version < len(MIGRATIONS):
                _apply(conn, version + 1, location)
    return len(MIGRATIONS)


def _check(version: int, location: str) -> int:
    if version > len(MIGRATIONS):
        raise DatabaseFileError(
            f"{location} has schema version {version} but this code knows only "
            f"{len(MIGRATIONS)}: it was written by a newer version of the bot; upgrade it"
        )
    return version


def _refuse_foreign(conn: Any, location: str) -> None:
    """A schema with tables but no ``schema_migrations`` is another application's."""
    tables = [row[0] for row in conn.execute(
        "SELECT tablename FROM pg_tables WHERE schemaname = current_schema() "
        "ORDER BY tablename LIMIT 5")]
    if tables and not _OUR_TABLES & set(tables):
        raise DatabaseFileError(
            f"{location}: its schema holds another application's tables "
            f"({', '.join(tables[:4])}) and is not the memory bot's; it was left unchanged. "
            "Give the bot a database (or a schema, ?options=-csearch_path=NAME) of its own"
        )


def _version_table(conn: Any, location: str) -> None:
    """Create ``schema_migrations`` in a new database (under the migration lock).

    Creating it, rather than asking whether it exists, also makes this session see
    a table another process created a moment ago (a catalog lookup alone may not).
    """
    if conn.execute("SELECT to_regclass('schema_migrations')").fetchone()[0] is None:
        _refuse_foreign(conn, location)
    conn.execute("CREATE TABLE IF NOT EXISTS schema_migrations "
                 "(version integer PRIMARY KEY, applied_at timestamptz NOT NULL DEFAULT now())")


def _apply(conn: Any, number: int, location: str) -> None:
    log.info("applying schema migration %d to %s", number, location)
    migration = MIGRATIONS[number - 1]
    try:
        if callable(migration):
            migration(conn)
        else:
            conn.execute(migration)
    except DatabaseFileError:
        raise
    except Exception as exc:
        raise DatabaseFileError(
            f"schema migration {number} failed on {location} ({one_line(exc)}); nothing of "
            "it was applied"
        ) from exc
    conn.execute("INSERT INTO schema_migrations(version) VALUES (%s)", (number,))
