"""SQLite storage: messages, their context (guilds, channels, authors), the FTS5 index,
the embedding backlog and the database's metadata.

Messages are written first and embedded later in batches (:meth:`MessageStore.claim`
/ :meth:`MessageStore.write_vectors`), so a crash between the two loses nothing: the
next run finds the backlog by the ``embedded = 0`` flag.  The vectors themselves,
their 1-bit KNN and the code statistics live in :mod:`memory.storage.sqlite.vectors`, the
conversational windows and their vectors in :mod:`memory.storage.sqlite.windows`; the store holds
the connection (and its lock) that everything is written through, a message and its
vector in one transaction, and a second, read-only one for a search's reads beside
its vector KNN (:meth:`MessageStore._read_beside`).
"""

from __future__ import annotations

import json
import logging
import threading
import time
from collections.abc import Iterable, Iterator, Sequence
from contextlib import contextmanager, nullcontext
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np

from memory.errors import (
    DatabaseFileError,
    EmbeddingModelChanged,
    EmbeddingModelMismatch,
    SettingsError,
)
from memory.filters import Filters
from memory.records import MessageRecord, PendingMessage, StoredMessage
from memory.settings import AUTORESPONSE_MODES, CHANNEL_MODES, GuildSettings
from memory.storage import claims
from memory.storage.sqlite import scrub, windows
from memory.storage.sqlite.connection import (
    IN_IDS,
    as_disk_full,
    check_ours,
    connect,
    id_list,
    not_writable,
    sqlite_driver,
)
from memory.storage.sqlite.filters import filter_sql
from memory.storage.sqlite.migrations import migrate
from memory.storage.sqlite.vectors import VectorIndex, table_columns
from memory.text import fts_match

__all__ = [
    "BackfillCursor", "Filters", "GuildStats", "MessageStore", "PendingMessage", "ReconcileCursor",
    "StoreStats", "UpsertStats",
]

log = logging.getLogger(__name__)

_META_MODEL = "embedding_model"
_META_DIM = "embedding_dim"
_META_PROFILE = "active_profile"
_META_SCRUBBED = "deleted_text_scrubbed"  # set once the file holds no pre-secure_delete leftovers
_AUTHOR_NAME = "COALESCE(NULLIF(a.display_name, ''), a.name)"
_DAY_MS = 86_400_000

# keyword() fields: the FTS5 table searched, and its bm25() with column weights
_KEYWORD_FIELDS = {
    "message": ("search_fts", "bm25(search_fts, 1.0, 1.0, 0.5)"),  # author, content, attachments
    "window": ("window_fts", "bm25(window_fts)"),
}


@dataclass(frozen=True)
class UpsertStats:
    """What an upsert did: new rows, changed rows, rows left as they were."""

    inserted: int = 0
    updated: int = 0
    unchanged: int = 0
    forgotten: int = 0  # stored copies deleted because their author opted out, then edited
    expired: int = 0  # older than the guild's retention period: not stored
    misplaced: int = 0  # stored before in another channel: left out (the first channel wins)


@dataclass(frozen=True)
class BackfillCursor:
    """A channel's backfill position: read back to ``before_id``; ``complete`` at its start."""

    before_id: int | None
    complete: bool


@dataclass(frozen=True)
class ReconcileCursor:
    """A channel's place in a reconcile run: recent messages checked down to ``before_id``."""

    run_id: int
    before_id: int | None
    complete: bool


@dataclass(frozen=True)
class GuildStats:
    """What one guild has stored; ``member_messages`` counts one member's."""

    messages: int
    channels: int
    member_messages: int
    pending: int


@dataclass(frozen=True)
class StoreStats:
    """What a database holds, for the ``stats`` command."""

    guilds: int
    channels: int
    authors: int
    messages: int
    pending_embeddings: int
    embedding_model: str | None
    embedding_dim: int | None
    active_profile: str | None
    schema_version: int
    path: str


# what an event that does not know a channel's type says: "" (and "None", str(None),
# which live capture wrote before it said "")
_UNKNOWN_TYPES = frozenset({"", "None"})


def _known_type(channel_type: str) -> str:
    """``channel_type``, or ``""`` where it says nothing (a stored type is then kept)."""
    return "" if channel_type.strip() in _UNKNOWN_TYPES else channel_type


def _context_key(r: MessageRecord) -> tuple:
    """Every field :meth:`MessageStore._upsert_context` writes."""
    return (
        r.guild_id, r.guild_name, r.channel_id, r.parent_id, r.channel_name, r.channel_type,
        r.author_id, r.author_name, r.author_display_name, r.author_is_bot,
    )


_SETTING_LISTS = {
    "add_channel": ("channel_rules", "channel_id"),
    "remove_channel": ("channel_rules", "channel_id"),
    "opt_out": ("member_optouts", "author_id"),
    "opt_in": ("member_optouts", "author_id"),
}


def _older_edit(incoming: int | None, stored: int | None) -> bool:
    """Whether an incoming copy of a message predates the edit already stored."""
    return stored is not None and (incoming is None or incoming < stored)


def _message_row(r: MessageRecord) -> tuple:
    """A message's stored text, edit time and attachments, as :meth:`MessageStore._existing` reads them."""
    return (r.content, r.edited_at, "\n".join(r.attachments))


def _newer_version(r: MessageRecord, stored: tuple | None) -> bool:
    """Whether ``r`` changes a stored message (not an older copy of it, not the same)."""
    return stored is not None and stored != _message_row(r) and not _older_edit(r.edited_at, stored[1])


def _split_attachments(value: str) -> tuple[str, ...]:
    return tuple(name for name in value.split("\n") if name)


class MessageStore:
    """One SQLite database file holding a bot's memory.

    Access is serialised by a lock (SQLite has one writer anyway); every method is
    synchronous and safe to call from worker threads.
    """

    def __init__(
        self, path: str | Path, *, read_only: bool | None = None, erase_deleted: bool = True
    ) -> None:
        """Open (creating if needed) and migrate the database at ``path``.

        Args:
            path: The database file.
            read_only: Open read-only (searches and stats work, writes raise
                :class:`DatabaseFileError`); by default, when this process cannot
                write the file.
            erase_deleted: Remove deleted text from the file (:mod:`memory.storage.sqlite.scrub`).
                ``False`` only measures what that costs (``bench secure-delete``):
                deleted text then stays readable in the file.

        Raises:
            ExtensionLoadError: sqlite-vec cannot be loaded.
            DatabaseFileError: The file is not (or is a newer version of) this bot's database.
            DiskFullError: Creating or upgrading it needed space the disk does not have.
        """
        self.path = str(path)
        self.read_only = not_writable(path) if read_only is None else read_only
        try:
            self._conn = connect(path, read_only=self.read_only)
        except Exception as exc:  # creating the file, or switching it to WAL
            if full := as_disk_full(exc, path):
                raise full from exc
            raise
        self._lock = threading.RLock()
        self._beside_conn: Any = None  # opened on the first read beside the KNN (_read_beside)
        self._beside_lock = threading.Lock()
        self.generation = 0  # bumped on every write; lets callers cache derived data
        # the embedding model this process writes and searches with (its engine sets it):
        # see model_changed()
        self.model: str | None = None
        self._forgot = False  # this transaction removed text: empty the WAL after it
        self._erase_deleted = erase_deleted
        self.vectors = VectorIndex(self._query, on_change=windows.vectors_changed)
        try:
            check_ours(self._conn, self.path)  # before any migration writes to it
            migrate(self._conn, read_only=self.read_only)
            scrub.check_keyword_index_readable(self._conn, self.path)
            if not self.read_only:
                self._check_vector_table()
                if erase_deleted:
                    self._secure_deletes()
                else:
                    self._conn.execute("PRAGMA secure_delete=OFF")
        except BaseException as exc:
            self._conn.close()
            if full := as_disk_full(exc, path):  # a migration's write; it was rolled back
                raise full from exc
            raise

    def _check_vector_table(self) -> None:
        """Rebuild a vector table that is gone (dropped by hand?): everything is re-embedded."""
        try:
            model = self.embedding_model()
        except DatabaseFileError as exc:  # said by whatever needs the model; reembed repairs it
            log.info("%s", exc)
            return
        if model is not None and not table_columns(self._conn):
            log.warning("%s has no vector table; every message will be embedded again", self.path)
            self.reset_embeddings(*model)

    def _secure_deletes(self) -> None:
        """Keep deleted text out of the file (see scrub); scrub an older file once."""
        try:
            scrub.secure_keyword_index(self._conn)
            if self.get_meta(_META_SCRUBBED) is not None:
                return
            if self.has_messages():
                scrub.scrub_file(self._conn)
        except sqlite_driver().DatabaseError as exc:  # busy; no room for VACUUM's copy
            log.warning("%s: could not make sure deleted text leaves the file (%s); "
                        "trying again at the next start", self.path, exc)
            return
        self.set_meta(_META_SCRUBBED, "1")

    def close(self) -> None:
        """Close the connections."""
        with self._beside_lock:
            if self._beside_conn is not None:
                self._beside_conn.close()
                self._beside_conn = None
        with self._lock:
            self._conn.close()

    @contextmanager
    def _transaction(self) -> Iterator[Any]:
        if self.read_only:
            raise DatabaseFileError(
                f"{self.path} is open read-only (this process cannot write it): searching "
                "works, changing it needs write access to the file and its folder"
            )
        with self._lock:
            self._conn.execute("BEGIN IMMEDIATE")
            try:
                yield self._conn
                self._conn.execute("COMMIT")
            except BaseException as exc:
                self._forgot = False
                if self._conn.in_transaction:  # SQLite rolls back itself on some errors
                    self._conn.execute("ROLLBACK")
                if full := as_disk_full(exc, self.path):
                    raise full from exc
                raise
            self.generation += 1
            if self._forgot:  # the WAL still holds the changed pages as they were
                self._forgot = False
                if self._erase_deleted:
                    self._truncate_wal()

    def _truncate_wal(self) -> None:
        """Empty the write-ahead log after a commit that removed text (see memory.storage.sqlite.scrub)."""
        try:
            scrub.truncate_wal(self._conn)
        except Exception as exc:  # committed already: a full disk only delays the erasing
            if not as_disk_full(exc, self.path):
                raise
            log.warning("the write-ahead log of %s could not be emptied (%s); deleted text "
                        "stays in it until the next delete empties it", self.path, exc)

    def _query(self, sql: str, params: Sequence[Any] = ()) -> list[tuple]:
        with self._lock:
            return self._conn.execute(sql, params).fetchall()

    def _read_beside(self, sql: str, params: Sequence[Any] = ()) -> list[tuple]:
        """Run a read on the store's second, read-only connection.

        A search reads its keyword lists (and the window vectors of what they found)
        there while its query is embedded and its vector KNN runs on the main
        connection: SQLite lets go of the GIL while it works, so on a multi-core
        machine the two overlap, and a WAL reader sees every committed write.  An
        in-memory database has only the one connection.
        """
        if self.path == ":memory:":
            return self._query(sql, params)
        with self._beside_lock:
            if self._beside_conn is None:
                self._beside_conn = connect(self.path, read_only=True)
            return self._beside_conn.execute(sql, params).fetchall()

    # -- metadata ---------------------------------------------------------------

    def get_meta(self, key: str) -> str | None:
        """Return a value from the ``meta`` table, or ``None`` when unset."""
        rows = self._query("SELECT value FROM meta WHERE key = ?", (key,))
        return rows[0][0] if rows else None

    def set_meta(self, key: str, value: str) -> None:
        """Store a value in the ``meta`` table."""
        with self._transaction() as conn:
            _set_meta(conn, key, value)

    @property
    def active_profile(self) -> str | None:
        """The hardware profile an admin last chose for this database."""
        return self.get_meta(_META_PROFILE)

    @active_profile.setter
    def active_profile(self, name: str) -> None:
        self.set_meta(_META_PROFILE, name)

    def embedding_model(self) -> tuple[str, int] | None:
        """Return ``(model_id, dimension)`` the vectors were made with, if any.

        Raises:
            DatabaseFileError: The stored dimension is not a positive whole number (the
                file was edited or damaged); ``reembed`` rewrites it.
        """
        model, dim = self.get_meta(_META_MODEL), self.get_meta(_META_DIM)
        if not (model and dim):
            return None
        try:
            size = int(dim)
        except ValueError:
            size = 0
        if size <= 0:
            raise DatabaseFileError(
                f"{self.path}: the stored vector size (meta.embedding_dim) is {dim[:40]!r}, "
                "not a positive whole number; run `python bot.py reembed` to rebuild the "
                "vectors and record it again (the messages are intact)"
            )
        return model, size

    def model_changed(self) -> str | None:
        """Why this process may no longer use the vectors, or ``None`` while it may.

        :attr:`model` is the embedding model this process writes and searches with
        (set by its engine).  When another process re-embeds the database with another
        model (``reembed``), the database's model no longer matches: this process's
        query vectors and new vectors are of another model, perhaps another size.
        One read of ``meta``.
        """
        current = self.embedding_model()
        if self.model is None or current is None or current[0] == self.model:
            return None
        return (f"{self.path} was re-embedded with {current[0]} ({current[1]} dims) by another "
                f"process; this one uses {self.model}, so it writes no "
                "vectors (new messages wait in the backlog) and searches by keywords only "
                "until it is restarted with a matching profile")

    def check_model_unchanged(self) -> None:
        """Raise :class:`EmbeddingModelChanged` with :meth:`model_changed`'s reason, if any."""
        if reason := self.model_changed():
            raise EmbeddingModelChanged(reason)

    def set_embedding_model(self, model_id: str, dimension: int) -> None:
        """Bind this database to an embedding model, creating the vector table.

        Raises:
            EmbeddingModelMismatch: The database already holds vectors of another
                model; run ``python bot.py reembed`` to switch.
            EmbeddingModelChanged: Another process re-embedded it while this one ran.
        """
        current = self.embedding_model()
        if current == (model_id, dimension):
            return
        if current is not None:
            self.check_model_unchanged()  # it changed under this process: say so
            raise EmbeddingModelMismatch(
                f"{self.path} was embedded with {current[0]} ({current[1]} dims) but the "
                f"profile uses {model_id} ({dimension} dims); run `python bot.py reembed` "
                "to re-embed every message with the new model"
            )
        with self._transaction() as conn:
            self._bind_model(conn, model_id, dimension)

    def reset_embeddings(self, model_id: str, dimension: int) -> None:
        """Drop every vector and bind to a new model; all messages become pending."""
        with self._transaction() as conn:
            self.vectors.drop(conn)
            conn.execute("DELETE FROM window_vectors")
            conn.execute("DELETE FROM meta WHERE key IN (?, ?)", (_META_MODEL, _META_DIM))
            conn.execute("UPDATE messages SET embedded = 0")
            self._bind_model(conn, model_id, dimension)
        self.model = model_id  # from now on, a reembed by another process is noticed

    def _bind_model(self, conn: Any, model_id: str, dimension: int) -> None:
        self.vectors.create(conn, dimension)
        _set_meta(conn, _META_MODEL, model_id)
        _set_meta(conn, _META_DIM, str(dimension))

    # -- writes -------------------------------------------------------------------

    def upsert(self, records: Iterable[MessageRecord], *, insert: bool = True) -> UpsertStats:
        """Insert new messages and update changed ones, idempotently, in one transaction.

        A message whose text or attachments changed (an edit) gets its FTS entry
        rewritten by trigger and its vector dropped; it is re-embedded with the
        backlog.  Re-importing identical messages changes nothing.  Messages older
        than their guild's retention period are not stored, whichever path brings
        them (live capture, backfill, import); ``expired`` counts them.  A message
        id already stored in another channel keeps its first channel: the copy is
        left out and counted as ``misplaced`` (Discord's ids are unique, so such a
        copy comes from a damaged or edited export).

        Nothing by a member who opted out of a guild (``/memory forget-me`` opts
        out too) is stored there, whichever path brings it: an edit of their
        message stored before is applied by forgetting the stored copy, so the bot
        keeps neither their new text nor the text they took out.

        Args:
            records: The messages, as they are now.
            insert: ``False`` only applies changes to messages already stored (an
                edit in a channel the guild no longer remembers).
        """
        records = list(records)
        if not records:
            return UpsertStats()
        # everything that decides the write is read inside it: a second writer (two
        # imports of the same export) cannot insert the same ids in between
        with self._transaction() as conn:
            records, expired = self._within_retention(records)
            records, withheld = self._admissible(records)
            existing, stored_in = self._existing([r.id for r in [*records, *withheld]])
            if not insert:
                records = [r for r in records if r.id in existing]
            # a message stays in the channel it was first stored in (ids are unique on
            # Discord: a copy elsewhere is a damaged or forged export) and its indexes
            # follow that row; the copy is left out
            misplaced = [r for r in [*records, *withheld]
                         if stored_in.get(r.id, r.channel_id) != r.channel_id]
            if misplaced:
                log.warning("left out %d messages stored before in another channel (first "
                            "e.g. %d in %d, stored in %d)", len(misplaced), misplaced[0].id,
                            misplaced[0].channel_id, stored_in[misplaced[0].id])
                records = [r for r in records if stored_in.get(r.id, r.channel_id) == r.channel_id]
                withheld = [r for r in withheld if stored_in.get(r.id, r.channel_id) == r.channel_id]
            withdrawn = [r.id for r in withheld if _newer_version(r, existing.get(r.id))]
            inserted = updated = unchanged = 0
            contexts_done: set[tuple] = set()
            touched: list[tuple[int, int]] = []  # (channel, message) whose index rows change
            for record in records:
                # a batch repeats the same guild/channel/author many times; writing
                # an identical context row again would change nothing
                context = _context_key(record)
                if context not in contexts_done:
                    self._upsert_context(conn, record)
                    contexts_done.add(context)
                row = _message_row(record)
                before = existing.get(record.id)
                if before is None:
                    self._insert_message(conn, record)
                    touched.append((record.channel_id, record.id))
                    inserted += 1
                elif _newer_version(record, before):
                    text_changed = before[0::2] != row[0::2]
                    self._update_message(conn, record, text_changed=text_changed)
                    if text_changed:
                        touched.append((record.channel_id, record.id))
                    updated += 1
                else:
                    unchanged += 1
                existing[record.id] = row
                stored_in[record.id] = record.channel_id  # the same id twice in one batch
            windows.reindex(conn, touched)
            forgotten = self._forget(conn, withdrawn)
        return UpsertStats(inserted, updated, unchanged, forgotten, expired, len(misplaced))

    def _within_retention(self, records: list[MessageRecord]) -> tuple[list[MessageRecord], int]:
        """Leave out messages older than their guild's retention period; count them."""
        cutoffs = self.retention_cutoffs({r.guild_id for r in records})
        if not cutoffs:
            return records, 0
        kept = [r for r in records if r.created_at >= cutoffs.get(r.guild_id, r.created_at)]
        if expired := len(records) - len(kept):
            log.info("left out %d messages older than their server's retention period", expired)
        return kept, expired

    def retention_cutoffs(self, guild_ids: Iterable[int] | None = None) -> dict[int, int]:
        """The oldest creation time (unix ms) each guild with a retention period keeps.

        Args:
            guild_ids: Only these guilds; ``None``: every guild that set a period.

        Returns:
            ``{guild_id: cutoff_ms}``; a guild that keeps everything is absent.
        """
        sql = (f"SELECT guild_id, ? - retention_days * {_DAY_MS} FROM guild_settings "
               "WHERE retention_days IS NOT NULL")
        params: list[Any] = [_now_ms()]
        if guild_ids is not None:
            sql += f" AND guild_id {IN_IDS}"
            params.append(id_list(guild_ids))
        return {row[0]: row[1] for row in self._query(sql, params)}

    def _admissible(
        self, records: list[MessageRecord]
    ) -> tuple[list[MessageRecord], list[MessageRecord]]:
        """Split ``records`` into those that may be stored and those whose author opted out.

        Deleted (tombstoned) messages are in neither: they stay deleted.
        """
        if not records:
            return records, []
        gone = {row[0] for row in self._query(
            f"SELECT message_id FROM tombstones WHERE message_id {IN_IDS}",
            (id_list(r.id for r in records),),
        )}
        opted_out = {tuple(row) for row in self._query("SELECT guild_id, author_id FROM member_optouts")}
        admitted: list[MessageRecord] = []
        withheld: list[MessageRecord] = []
        for r in records:
            if r.id not in gone:
                (withheld if (r.guild_id, r.author_id) in opted_out else admitted).append(r)
        return admitted, withheld

    def _existing(self, ids: list[int]) -> tuple[dict[int, tuple], dict[int, int]]:
        """The stored text rows (:func:`_message_row`) and channels of those of ``ids`` stored."""
        rows = self._query(
            "SELECT id, channel_id, content, edited_at, attachments FROM messages "
            f"WHERE id {IN_IDS}",
            (id_list(ids),),
        )
        return {row[0]: tuple(row[2:]) for row in rows}, {row[0]: row[1] for row in rows}

    @staticmethod
    def _upsert_context(conn: Any, r: MessageRecord) -> None:
        conn.execute(
            "INSERT INTO guilds(id, name) VALUES (?, ?) ON CONFLICT(id) DO UPDATE SET "
            "name = CASE WHEN excluded.name != '' THEN excluded.name ELSE name END",
            (r.guild_id, r.guild_name),
        )
        conn.execute(
            "INSERT INTO channels(id, guild_id, parent_id, name, type) VALUES (?, ?, ?, ?, ?) "
            "ON CONFLICT(id) DO UPDATE SET "
            "parent_id = COALESCE(excluded.parent_id, parent_id), "
            "name = CASE WHEN excluded.name != '' THEN excluded.name ELSE name END, "
            "type = CASE WHEN excluded.type != '' THEN excluded.type ELSE type END",
            (r.channel_id, r.guild_id, r.parent_id, r.channel_name, _known_type(r.channel_type)),
        )
        conn.execute(
            "INSERT INTO authors(id, name, display_name, is_bot) VALUES (?, ?, ?, ?) "
            "ON CONFLICT(id) DO UPDATE SET "
            "name = CASE WHEN excluded.name != '' THEN excluded.name ELSE name END, "
            "display_name = CASE WHEN excluded.display_name != '' "
            "THEN excluded.display_name ELSE display_name END, is_bot = excluded.is_bot",
            (r.author_id, r.author_name, r.author_display_name, int(r.author_is_bot)),
        )

    @staticmethod
    def _insert_message(conn: Any, r: MessageRecord) -> None:
        conn.execute(
            "INSERT INTO messages(id, guild_id, channel_id, author_id, created_at, edited_at, "
            "content, reply_to_id, attachments) VALUES (?, ?, ?, ?, ?, ?, ?, ?, ?)",
            (
                r.id, r.guild_id, r.channel_id, r.author_id, r.created_at, r.edited_at,
                r.content, r.reply_to_id, "\n".join(r.attachments),
            ),
        )

    def _update_message(self, conn: Any, r: MessageRecord, *, text_changed: bool) -> None:
        conn.execute(
            "UPDATE messages SET content = ?, edited_at = ?, attachments = ?, "
            "embedded = CASE WHEN ? THEN 0 ELSE embedded END WHERE id = ?",
            (r.content, r.edited_at, "\n".join(r.attachments), int(text_changed), r.id),
        )
        if text_changed:
            self._forgot = True  # the author removed the old text: it leaves the file too
            self.vectors.delete(conn, [r.id])
            self._reembed_dependents(conn, [r.id])

    def delete(self, ids: Iterable[int]) -> int:
        """Remove messages from the table, the FTS index and the vectors, for good.

        Each id gets a tombstone, so a late insert (a gateway event racing the
        delete, a backfill page, a re-import of an old export) cannot bring the
        message back; messages whose vectors carried its text as context are
        re-embedded.

        Returns:
            How many messages existed and were removed.
        """
        ids = sorted(set(ids))
        if not ids:
            return 0
        with self._transaction() as conn, self._erasing(conn, len(ids)):
            return self._forget(conn, ids)

    def _forget(self, conn: Any, ids: Sequence[int]) -> int:
        """Delete ``ids`` everywhere inside the caller's transaction; tombstone them."""
        if not ids:
            return 0
        self._forgot = True
        now = int(time.time() * 1000)
        conn.executemany(
            "INSERT OR IGNORE INTO tombstones(message_id, deleted_at) VALUES (?, ?)",
            [(i, now) for i in ids],
        )
        self._reembed_dependents(conn, ids)
        places = conn.execute(
            f"SELECT channel_id, id FROM messages WHERE id {IN_IDS}", (id_list(ids),)
        ).fetchall()
        removed = conn.execute(f"DELETE FROM messages WHERE id {IN_IDS}", (id_list(ids),)).rowcount
        self.vectors.delete(conn, ids)  # after the rows: no window vector is made for them
        windows.reindex(conn, places)  # their rows go; neighbours' windows lose their text
        return removed

    def _reembed_dependents(self, conn: Any, ids: Sequence[int]) -> None:
        """Send back to the backlog the messages whose embedded context includes ``ids``.

        A message is embedded with its reply target, or else the message before it
        in its channel (:meth:`pending`); when that one is edited or deleted, the
        old text must not live on inside its neighbour's vector.
        """
        batch = id_list(ids)
        dependents = [row[0] for row in conn.execute(
            """SELECT id FROM messages WHERE reply_to_id IN (SELECT value FROM json_each(?1))
               UNION
               SELECT (SELECT n.id FROM messages n WHERE n.channel_id = x.channel_id AND n.id > x.id
                       ORDER BY n.id LIMIT 1)
               FROM messages x WHERE x.id IN (SELECT value FROM json_each(?1))""",
            (batch,),
        ) if row[0] is not None]
        dependents = [i for i in dependents if i not in set(ids)]
        if dependents:
            conn.execute(
                f"UPDATE messages SET embedded = 0 WHERE id {IN_IDS}", (id_list(dependents),)
            )
            self.vectors.delete(conn, dependents)

    def _forget_where(self, where: str, params: Sequence[Any]) -> int:
        """Forget every message matching a WHERE clause over ``messages``."""
        with self._transaction() as conn:
            ids = [row[0] for row in conn.execute(f"SELECT id FROM messages WHERE {where}", params)]
            with self._erasing(conn, len(ids)):
                return self._forget(conn, ids)

    def _erasing(self, conn: Any, count: int) -> Any:
        """How the keyword index lets go of ``count`` forgotten messages (:func:`scrub.erasing`)."""
        return scrub.erasing(conn, count) if self._erase_deleted else nullcontext()

    def purge_channels(self, channel_ids: Iterable[int]) -> int:
        """Forget every message in these channels and in their threads.

        Returns:
            How many messages were removed.
        """
        channel_ids = list(channel_ids)
        if not channel_ids:
            return 0
        places = id_list(self.expand_channels(channel_ids))
        removed = self._forget_where(f"channel_id {IN_IDS}", (places,))
        with self._transaction() as conn:
            conn.execute(f"DELETE FROM backfill_cursors WHERE channel_id {IN_IDS}", (places,))
        return removed

    def purge_guild(self, guild_id: int) -> int:
        """Forget a guild entirely: messages, channels, settings, opt-outs, cursors."""
        removed = self._forget_where("guild_id = ?", (guild_id,))
        with self._transaction() as conn:
            self._forgot = True  # the guild's and its channels' names go too
            for table in ("channel_rules", "autoresponse_channels", "member_optouts",
                          "backfill_cursors", "guild_settings", "code_stats"):
                conn.execute(f"DELETE FROM {table} WHERE guild_id = ?", (guild_id,))
            conn.execute("DELETE FROM channels WHERE guild_id = ?", (guild_id,))
            conn.execute("DELETE FROM guilds WHERE id = ?", (guild_id,))
        return removed

    def forget_author(self, guild_id: int, author_id: int) -> int:
        """Forget a member in one guild: their messages, their name, their future messages.

        In one transaction the member is opted out of the guild (so no later
        write, whichever path brings it, stores them there again until they opt
        in), their messages there are deleted and tombstoned, and their name row
        goes once no guild in this database holds a message of theirs.

        Returns:
            How many messages were removed.
        """
        with self._transaction() as conn:
            conn.execute("INSERT OR IGNORE INTO member_optouts(guild_id, author_id) VALUES (?, ?)",
                         (guild_id, author_id))
            ids = [row[0] for row in conn.execute(
                "SELECT id FROM messages WHERE guild_id = ? AND author_id = ?", (guild_id, author_id))]
            removed = self._forget(conn, ids)
            conn.execute("DELETE FROM authors WHERE id = ? AND NOT EXISTS "
                         "(SELECT 1 FROM messages WHERE author_id = ?)", (author_id, author_id))
        return removed

    def purge_older_than(self, guild_id: int, cutoff_ms: int) -> int:
        """Forget a guild's messages created before ``cutoff_ms`` (unix milliseconds)."""
        return self._forget_where("guild_id = ? AND created_at < ?", (guild_id, cutoff_ms))

    # -- guild settings and backfill progress ----------------------------------------------

    def guild_settings(self, guild_id: int) -> GuildSettings:
        """A guild's settings (defaults when it never changed any)."""
        row = self._query(
            "SELECT channel_mode, retention_days, autoresponse FROM guild_settings "
            "WHERE guild_id = ?", (guild_id,),
        )
        mode, retention, autoresponse = row[0] if row else ("all", None, "mention")

        def ids(table: str, column: str) -> frozenset[int]:
            return frozenset(r[0] for r in self._query(
                f"SELECT {column} FROM {table} WHERE guild_id = ?", (guild_id,)))

        return GuildSettings(
            guild_id=guild_id, channel_mode=mode, channels=ids("channel_rules", "channel_id"),
            retention_days=retention, autoresponse=autoresponse,
            autoresponse_channels=ids("autoresponse_channels", "channel_id"),
            opted_out=ids("member_optouts", "author_id"),
        )

    def update_guild_settings(self, guild_id: int, **changes: Any) -> GuildSettings:
        """Change a guild's settings; returns them as they are now.

        Keywords: ``channel_mode``, ``retention_days`` (``None`` = keep), ``autoresponse``,
        ``add_channel`` / ``remove_channel`` (the channel list), ``toggle_autoresponse_channel``,
        ``opt_out`` / ``opt_in`` (a member id).

        Raises:
            SettingsError: An unknown setting or value.
        """
        columns = {"channel_mode": CHANNEL_MODES, "autoresponse": AUTORESPONSE_MODES}
        with self._transaction() as conn:
            conn.execute("INSERT OR IGNORE INTO guild_settings(guild_id) VALUES (?)", (guild_id,))
            for key, value in changes.items():
                if value is None and key != "retention_days":
                    continue
                if key in columns:
                    if value not in columns[key]:
                        raise SettingsError(f"{key} must be one of {', '.join(columns[key])}")
                    conn.execute(f"UPDATE guild_settings SET {key} = ? WHERE guild_id = ?",
                                 (value, guild_id))
                elif key == "retention_days":
                    if value is not None and int(value) <= 0:
                        raise SettingsError("retention must be a positive number of days")
                    conn.execute("UPDATE guild_settings SET retention_days = ? WHERE guild_id = ?",
                                 (value, guild_id))
                elif key in ("add_channel", "opt_out"):
                    table, column = _SETTING_LISTS[key]
                    conn.execute(f"INSERT OR IGNORE INTO {table}(guild_id, {column}) VALUES (?, ?)",
                                 (guild_id, int(value)))
                elif key in ("remove_channel", "opt_in"):
                    table, column = _SETTING_LISTS[key]
                    conn.execute(f"DELETE FROM {table} WHERE guild_id = ? AND {column} = ?",
                                 (guild_id, int(value)))
                elif key == "toggle_autoresponse_channel":
                    if not conn.execute(
                        "DELETE FROM autoresponse_channels WHERE guild_id = ? AND channel_id = ?",
                        (guild_id, int(value)),
                    ).rowcount:
                        conn.execute("INSERT INTO autoresponse_channels VALUES (?, ?)",
                                     (guild_id, int(value)))
                else:
                    raise SettingsError(f"unknown setting {key!r}")
        return self.guild_settings(guild_id)

    def backfill_cursor(self, channel_id: int) -> BackfillCursor | None:
        """How far a backfill of this channel got, or ``None`` if none started."""
        rows = self._query(
            "SELECT before_id, complete FROM backfill_cursors WHERE channel_id = ?", (channel_id,))
        return BackfillCursor(rows[0][0], bool(rows[0][1])) if rows else None

    def save_backfill_cursor(
        self, guild_id: int, channel_id: int, before_id: int | None, *, complete: bool = False
    ) -> None:
        """Record that a backfill has read this channel back to ``before_id`` (or to its start)."""
        with self._transaction() as conn:
            conn.execute(
                "INSERT INTO backfill_cursors(channel_id, guild_id, before_id, complete) "
                "VALUES (?, ?, ?, ?) ON CONFLICT(channel_id) DO UPDATE SET "
                "before_id = COALESCE(excluded.before_id, before_id), complete = excluded.complete",
                (channel_id, guild_id, before_id, int(complete)),
            )

    def latest_message_id(self, channel_id: int) -> int | None:
        """The newest stored message id in a channel (or thread), ``None`` when none is."""
        return self._query("SELECT max(id) FROM messages WHERE channel_id = ?", (channel_id,))[0][0]

    def guild_stats(
        self,
        guild_id: int,
        author_id: int | None = None,
        channel_ids: Iterable[int] | None = None,
    ) -> GuildStats:
        """Counts for one guild only (and one member in it), optionally only in ``channel_ids``."""
        where = "guild_id = ?"
        params: list[int | str] = [guild_id]
        if channel_ids is not None:
            where += f" AND channel_id {IN_IDS}"
            params.append(id_list(channel_ids))
        messages, channels, pending = self._query(
            "SELECT count(*), count(DISTINCT channel_id), coalesce(sum(embedded = 0), 0) "
            f"FROM messages WHERE {where}", params,
        )[0]
        mine = 0
        if author_id is not None:
            mine = self._query("SELECT count(*) FROM messages WHERE guild_id = ? AND author_id = ?",
                               (guild_id, author_id))[0][0]
        return GuildStats(messages, channels, mine, pending)

    # -- embedding backlog ------------------------------------------------------------

    def pending_count(self) -> int:
        """How many stored messages have no vector yet."""
        return self._query("SELECT count(*) FROM messages WHERE embedded = 0")[0][0]

    def pending(self, limit: int) -> list[PendingMessage]:
        """Return up to ``limit`` unembedded messages, oldest first, with their context.

        The context of a message is its reply target if stored in the same channel
        (or thread), else the previous message in its channel.  Text from another
        channel never enters a message's vector, whatever path stored the reply: a
        search by that text would tell readers of this channel what the other said.
        Nothing is claimed: an embedder uses :meth:`claim`.
        """
        return self._pending_where("m.embedded = 0 ORDER BY m.id LIMIT ?", (limit,))

    def claim(self, limit: int, *, owner: str, ttl_s: float = 600.0) -> list[PendingMessage]:
        """Claim up to ``limit`` unembedded messages for ``owner`` and return them.

        A message claimed by another embedder is left out until its claim is
        released (:meth:`write_vectors`, :meth:`release`), its process ends
        (:mod:`memory.storage.claims`: a killed embedder's batch is back at once), or the
        claim expires after ``ttl_s`` (an owner on another host), so concurrent
        embedders share the backlog instead of repeating each other's work.

        Args:
            owner: A name from :func:`memory.storage.claims.process_owner`.
        """
        now = _now_ms()
        with self._transaction() as conn:
            conn.execute("DELETE FROM embedding_claims WHERE expires_at <= ?", (now,))
            dead = [row[0] for row in conn.execute("SELECT DISTINCT owner FROM embedding_claims")
                    if claims.is_dead(row[0])]
            if dead:
                log.info("taking back the embedding claims of %d ended processes", len(dead))
                conn.execute(f"DELETE FROM embedding_claims WHERE owner {IN_IDS}", (json.dumps(dead),))
            ids = [row[0] for row in conn.execute(
                "SELECT m.id FROM messages m WHERE m.embedded = 0 AND NOT EXISTS "
                "(SELECT 1 FROM embedding_claims c WHERE c.message_id = m.id) "
                "ORDER BY m.id LIMIT ?", (limit,))]
            conn.executemany(
                "INSERT INTO embedding_claims(message_id, owner, expires_at) VALUES (?, ?, ?)",
                [(mid, owner, now + int(ttl_s * 1000)) for mid in ids],
            )
        return self._pending_where(f"m.id {IN_IDS} ORDER BY m.id", (id_list(ids),))

    def release(self, owner: str) -> None:
        """Give up every claim ``owner`` still holds (its messages stay pending)."""
        if not self.read_only:
            with self._transaction() as conn:
                conn.execute("DELETE FROM embedding_claims WHERE owner = ?", (owner,))

    def _pending_where(self, where: str, params: Sequence[Any]) -> list[PendingMessage]:
        rows = self._query(
            f"""SELECT m.id, m.guild_id, m.channel_id, m.author_id, {_AUTHOR_NAME}, m.content,
                      m.created_at, c.name, m.reply_to_id, m.attachments,
                      COALESCE(
                        (SELECT r.id FROM messages r WHERE r.id = m.reply_to_id
                           AND r.channel_id = m.channel_id),
                        (SELECT p.id FROM messages p WHERE p.channel_id = m.channel_id
                           AND p.id < m.id ORDER BY p.id DESC LIMIT 1))
               FROM messages m JOIN authors a ON a.id = m.author_id
               JOIN channels c ON c.id = m.channel_id
               WHERE {where}""",
            params,
        )
        antecedents = self._antecedent_rows([row[10] for row in rows if row[10] is not None])
        return [
            PendingMessage(**_message_fields(row),
                           antecedent_author=antecedents.get(row[10], (None, None))[0],
                           antecedent_content=antecedents.get(row[10], (None, None))[1])
            for row in rows
        ]

    def _antecedent_rows(self, ids: list[int]) -> dict[int, tuple[str, str]]:
        rows = self._query(
            f"SELECT m.id, {_AUTHOR_NAME}, m.content FROM messages m "
            f"JOIN authors a ON a.id = m.author_id WHERE m.id {IN_IDS}",
            (id_list(ids),),
        )
        return {row[0]: (row[1], row[2]) for row in rows}

    def write_vectors(
        self, messages: Sequence[PendingMessage], vectors: np.ndarray, *, owner: str | None = None
    ) -> None:
        """Store one vector per pending message and mark them embedded, atomically.

        A message deleted or edited since it was read is skipped: its vector would
        be an orphan or describe the old text.  An edited one stays pending and is
        embedded again with its new text.  With ``owner``, a message another
        embedder has claimed meanwhile (``owner``'s claim expired) is skipped too,
        and ``owner``'s claims on these messages are released.
        """
        if len(messages) != len(vectors):
            raise ValueError("one vector per message is required")
        vectors = np.ascontiguousarray(vectors, dtype=np.float32)
        with self._transaction() as conn:
            self.check_model_unchanged()  # inside: no reembed can slip in before the write
            current = self._unchanged_since_read(conn, messages)
            if owner is not None:
                current -= self._claimed_by_others(conn, messages, owner)
            rows = [
                (m.id, m.guild_id, m.channel_id, m.author_id, m.created_at, bool(m.attachments), v)
                for m, v in zip(messages, vectors) if m.id in current
            ]
            self.vectors.write(conn, rows)
            conn.execute(
                f"UPDATE messages SET embedded = 1 WHERE id {IN_IDS}",
                (id_list(row[0] for row in rows),),
            )
            if owner is not None:
                conn.execute(
                    f"DELETE FROM embedding_claims WHERE owner = ? AND message_id {IN_IDS}",
                    (owner, id_list(m.id for m in messages)),
                )

    @staticmethod
    def _claimed_by_others(conn: Any, messages: Sequence[PendingMessage], owner: str) -> set[int]:
        return {row[0] for row in conn.execute(
            f"SELECT message_id FROM embedding_claims WHERE owner != ? AND expires_at > ? "
            f"AND message_id {IN_IDS}",
            (owner, _now_ms(), id_list(m.id for m in messages)),
        )}

    @staticmethod
    def _unchanged_since_read(conn: Any, messages: Sequence[PendingMessage]) -> set[int]:
        """Ids of ``messages`` still stored with the text and attachments they were read with."""
        stored = {
            mid: (content, _split_attachments(attachments))
            for mid, content, attachments in conn.execute(
                f"SELECT id, content, attachments FROM messages WHERE id {IN_IDS}",
                (id_list(m.id for m in messages),),
            )
        }
        return {m.id for m in messages if stored.get(m.id) == (m.content, m.attachments)}

    # -- reads ----------------------------------------------------------------------

    def knn(
        self, vector: np.ndarray, k: int, filters: Filters, *, rescore: int = 4
    ) -> list[tuple[int, float]]:
        """Return up to ``k`` ``(message_id, cosine_similarity)`` pairs, best first.

        See :meth:`memory.storage.sqlite.vectors.VectorIndex.knn`; empty before anything is embedded.
        """
        if self.embedding_model() is None:
            return []
        self.check_model_unchanged()
        try:
            return self.vectors.knn(vector, k, filters, rescore=rescore)
        except Exception as exc:  # re-embedded between the check and the query
            self.check_model_unchanged()
            raise exc

    def keyword(
        self, match: str, k: int, filters: Filters, *, field: str = "message"
    ) -> list[tuple[int, float]]:
        """Return up to ``k`` ``(message_id, bm25)`` pairs for an FTS5 expression, best first.

        ``field`` is ``message`` (the author's names, the text and attachment names)
        or ``window`` (the message's conversational window, :mod:`memory.storage.sqlite.windows`).
        BM25 is negated so that higher is better.  The best ``4 × k`` matches are
        filtered first, which spares a table lookup per match when the filters
        pass most messages (one guild's bot, no author filter); if fewer than
        ``k`` survive, every match is filtered.
        """
        table, bm25 = _KEYWORD_FIELDS[field]
        clauses: list[str] = ["TRUE"]
        if field == "window":  # a content-free line is not found by its neighbours' words
            clauses.append("(SELECT s.contentful FROM search_text s WHERE s.id = m.id)")
        params: list[Any] = []
        filter_sql(filters, "m.", clauses, params)
        k = int(k)
        for head in (4 * k, -1):  # -1: no limit
            rows = self._read_beside(
                # FTS ranks inside the subquery; CROSS JOIN keeps it the outer loop
                # (a plain JOIN may scan messages and re-run MATCH per row).
                f"SELECT m.id, f.score FROM (SELECT rowid, -{bm25} AS score FROM {table} "
                f"WHERE {table} MATCH ? ORDER BY score DESC LIMIT ?) f "
                f"CROSS JOIN messages m ON m.id = f.rowid WHERE {' AND '.join(clauses)} "
                "ORDER BY f.score DESC LIMIT ?",
                [match, head, *params, k],
            )
            if len(rows) >= k:
                break
        return [(row[0], row[1]) for row in rows]

    def term_counts(self, terms: Sequence[str]) -> dict[str, int]:
        """In how many messages each term occurs (by text, author or attachment name)."""
        return {
            term: self._read_beside("SELECT count(*) FROM search_fts WHERE search_fts MATCH ?",
                                   (fts_match([term]),))[0][0]
            for term in terms
        }

    def window_vectors(
        self, ids: Sequence[int], *, beside: bool = False
    ) -> dict[int, np.ndarray]:
        """The window vector of each message: its window's mean vector, unit length.

        Kept up to date by :mod:`memory.storage.sqlite.windows`; messages without content of their
        own ("lol") or without any embedded member in their window have none.
        ``beside``: read on the second connection (:meth:`_read_beside`).
        """
        if not ids:
            return {}
        read = self._read_beside if beside else self._query
        rows = read(f"SELECT id, vector FROM window_vectors WHERE id {IN_IDS}", (id_list(ids),))
        if not rows:
            return {}
        # one conversion for all rows: per-row numpy calls cost more than the query
        matrix = np.frombuffer(b"".join(row[1] for row in rows), dtype=np.float16)
        return dict(zip((row[0] for row in rows),
                        matrix.reshape(len(rows), -1).astype(np.float32)))

    def similarity_floor(self, guild_id: int | None, quantile: float) -> float | None:
        """The cosine similarity that random pairs of a guild's messages reach at ``quantile``.

        It calibrates the adaptive threshold's floor to the embedding model and to
        how alike the guild's messages are (short chat lines sit closer together
        than long posts).  Computed from up to 400 stored vectors spread evenly over
        the guild's history (the same messages give the same floor), kept
        in ``meta`` and computed again when the guild's vectors have grown by half.
        ``None`` while fewer than 20 vectors are stored.
        """
        key = f"similarity_floor:{guild_id if guild_id is not None else 'all'}"
        count = self._vector_count(guild_id)
        if count < 20:
            return None
        cached = json.loads(self.get_meta(key) or "{}")
        if cached.get("quantile") == quantile and cached.get("vectors", 0) * 1.5 >= count:
            return float(cached["floor"])
        where, params = ("guild_id = ? AND ", [guild_id]) if guild_id is not None else ("", [])
        # evenly spaced over the guild's history: the same floor for the same messages
        sample = [row[0] for row in self._query(
            f"SELECT id FROM (SELECT id, row_number() OVER (ORDER BY id) AS n FROM messages "
            f"WHERE {where}embedded = 1) WHERE n % ? = 0 LIMIT 400",
            [*params, max(1, count // 400)])]
        vectors = np.array(list(self.vectors.floats(sample).values()), dtype=np.float32)
        vectors /= np.maximum(np.linalg.norm(vectors, axis=1, keepdims=True), 1e-12)
        pairs = (vectors @ vectors.T)[np.triu_indices(len(vectors), k=1)]
        floor = round(float(np.quantile(pairs, quantile)), 4)
        if not self.read_only:
            self.set_meta(key, json.dumps({"quantile": quantile, "vectors": count, "floor": floor}))
        return floor

    def _vector_count(self, guild_id: int | None) -> int:
        where, params = ("WHERE guild_id = ?", [guild_id]) if guild_id is not None else ("", [])
        return int(self._query(f"SELECT coalesce(sum(vectors), 0) FROM code_stats {where}",
                               params)[0][0])

    def expand_channels(self, channel_ids: Sequence[int]) -> tuple[int, ...]:
        """Return the channels plus every stored thread whose parent is one of them."""
        marks = ",".join("?" * len(channel_ids))
        threads = self._query(
            f"SELECT id FROM channels WHERE parent_id IN ({marks})", list(channel_ids)
        )
        return tuple(dict.fromkeys([*channel_ids, *(row[0] for row in threads)]))

    def threads(self, guild_id: int) -> list[tuple[int, int, str]]:
        """Return ``(thread_id, parent_id, type)`` of every stored thread in a guild."""
        return [tuple(row) for row in self._query(
            "SELECT id, parent_id, type FROM channels WHERE guild_id = ? AND parent_id IS NOT NULL",
            (guild_id,),
        )]

    def channel_ids_named(self, name: str, guild_id: int | None = None) -> list[int]:
        """Return the ids of stored channels called ``name`` (case-insensitive)."""
        sql = "SELECT id FROM channels WHERE lower(name) = lower(?)"
        params: list[Any] = [name]
        if guild_id is not None:
            sql += " AND guild_id = ?"
            params.append(guild_id)
        return [row[0] for row in self._query(sql, params)]

    def hydrate(self, ids: Sequence[int]) -> dict[int, StoredMessage]:
        """Return the stored messages by id (missing ids are left out).

        A message older than its guild's retention period is left out too: the
        hourly purge may not have removed it yet, and it is never shown.
        """
        rows = self._query(
            f"SELECT m.id, m.guild_id, m.channel_id, m.author_id, {_AUTHOR_NAME}, m.content, "
            "m.created_at, c.name, m.reply_to_id, m.attachments FROM messages m "
            "JOIN authors a ON a.id = m.author_id JOIN channels c ON c.id = m.channel_id "
            "LEFT JOIN guild_settings s ON s.guild_id = m.guild_id "
            f"WHERE m.id {IN_IDS} AND (s.retention_days IS NULL "
            f"OR m.created_at >= ? - s.retention_days * {_DAY_MS})",
            (id_list(ids), _now_ms()),
        )
        return {row[0]: StoredMessage(**_message_fields(row)) for row in rows}

    def channel_window(
        self, channel_id: int, message_id: int, before: int, after: int
    ) -> list[int]:
        """Ids of up to ``before`` messages before ``message_id`` in its channel, and
        up to ``after`` after it, in time order (``message_id`` itself included if stored).

        Only ``channel_id`` is read, whatever the neighbours' other fields say, so a
        caller that may read that channel can show every id returned.
        """
        rows = self._query(
            "SELECT id FROM (SELECT id FROM messages WHERE channel_id = ? AND id < ? "
            "ORDER BY id DESC LIMIT ?) UNION ALL "
            "SELECT id FROM (SELECT id FROM messages WHERE channel_id = ? AND id >= ? "
            "ORDER BY id LIMIT ?)",
            (channel_id, message_id, max(0, before), channel_id, message_id, max(0, after) + 1),
        )
        return sorted(row[0] for row in rows)

    def members(self, guild_id: int | None) -> list[tuple[int, str, str]]:
        """Return ``(author_id, name, display_name)`` of everyone with stored messages."""
        if guild_id is None:
            sql, params = "SELECT id, name, display_name FROM authors", []
        else:
            sql = (
                "SELECT a.id, a.name, a.display_name FROM authors a WHERE EXISTS "
                "(SELECT 1 FROM messages m WHERE m.author_id = a.id AND m.guild_id = ?)"
            )
            params = [guild_id]
        return [tuple(row) for row in self._query(sql, params)]

    def message_count(self, guild_id: int | None = None) -> int:
        """How many messages are stored (in one guild, or in all)."""
        if guild_id is None:
            return self._query("SELECT count(*) FROM messages")[0][0]
        return self._query("SELECT count(*) FROM messages WHERE guild_id = ?", (guild_id,))[0][0]

    def has_messages(self, guild_id: int | None = None) -> bool:
        """Whether anything is stored (in one guild, or at all); cheaper than counting."""
        where, params = ("WHERE guild_id = ?", [guild_id]) if guild_id is not None else ("", [])
        return bool(self._query(f"SELECT EXISTS (SELECT 1 FROM messages {where})", params)[0][0])

    def stats(self) -> StoreStats:
        """Counts and metadata for the ``stats`` command."""
        model = self.embedding_model()
        counts = {
            table: self._query(f"SELECT count(*) FROM {table}")[0][0]
            for table in ("guilds", "channels", "authors", "messages")
        }
        return StoreStats(
            **counts,
            pending_embeddings=self.pending_count(),
            embedding_model=model[0] if model else None,
            embedding_dim=model[1] if model else None,
            active_profile=self.active_profile,
            schema_version=self._query("PRAGMA user_version")[0][0],
            path=self.path,
        )

    # -- reconciling with what Discord says exists (cogs.reconcile) ----------------------

    def known_guild_ids(self) -> list[int]:
        """Every guild something is stored for: messages, channels or settings."""
        return [row[0] for row in self._query(
            "SELECT id FROM guilds UNION SELECT guild_id FROM channels "
            "UNION SELECT guild_id FROM guild_settings UNION SELECT guild_id FROM member_optouts "
            "ORDER BY 1")]

    def channels_with_messages(self, guild_id: int) -> list[tuple[int, int | None]]:
        """``(channel_id, parent_id)`` of a guild's channels and threads that hold messages."""
        return [(row[0], row[1]) for row in self._query(
            "SELECT c.id, c.parent_id FROM channels c WHERE c.guild_id = ? AND EXISTS "
            "(SELECT 1 FROM messages m WHERE m.channel_id = c.id) ORDER BY c.id", (guild_id,))]

    def recent_floor(self, channel_id: int, below_id: int, count: int) -> int | None:
        """The oldest of a channel's ``count`` newest stored messages below ``below_id``."""
        rows = self._query(
            "SELECT min(id) FROM (SELECT id FROM messages WHERE channel_id = ? AND id < ? "
            "ORDER BY id DESC LIMIT ?)", (channel_id, below_id, max(0, count)))
        return rows[0][0]

    def message_ids_between(self, channel_id: int, low: int, high: int) -> list[int]:
        """Stored message ids of a channel with ``low <= id < high``, oldest first."""
        return [row[0] for row in self._query(
            "SELECT id FROM messages WHERE channel_id = ? AND id >= ? AND id < ? ORDER BY id",
            (channel_id, low, high))]

    def reconcile_run(self, guild_id: int) -> int | None:
        """A guild's unfinished reconcile run (its start, unix ms), or ``None``."""
        rows = self._query("SELECT run_id FROM reconcile_runs WHERE guild_id = ?", (guild_id,))
        return rows[0][0] if rows else None

    def begin_reconcile_run(self, guild_id: int, run_id: int) -> None:
        """Start a guild's reconcile run; what an earlier run saved is dropped."""
        with self._transaction() as conn:
            conn.execute("DELETE FROM reconcile_cursors WHERE guild_id = ?", (guild_id,))
            conn.execute("INSERT OR REPLACE INTO reconcile_runs(guild_id, run_id) VALUES (?, ?)",
                         (guild_id, run_id))

    def end_reconcile_run(self, guild_id: int) -> None:
        """Mark a guild's reconcile run finished: the next one starts from scratch."""
        with self._transaction() as conn:
            conn.execute("DELETE FROM reconcile_cursors WHERE guild_id = ?", (guild_id,))
            conn.execute("DELETE FROM reconcile_runs WHERE guild_id = ?", (guild_id,))

    def reconcile_cursor(self, channel_id: int) -> ReconcileCursor | None:
        """Where the current reconcile run got to in a channel, ``None`` if not there yet."""
        rows = self._query("SELECT run_id, before_id, complete FROM reconcile_cursors "
                           "WHERE channel_id = ?", (channel_id,))
        return ReconcileCursor(rows[0][0], rows[0][1], bool(rows[0][2])) if rows else None

    def save_reconcile_cursor(
        self, guild_id: int, channel_id: int, run_id: int, before_id: int | None,
        *, complete: bool = False,
    ) -> None:
        """Record a reconcile run's progress in a channel."""
        with self._transaction() as conn:
            conn.execute(
                "INSERT INTO reconcile_cursors(channel_id, guild_id, run_id, before_id, complete) "
                "VALUES (?, ?, ?, ?, ?) ON CONFLICT(channel_id) DO UPDATE SET "
                "run_id = excluded.run_id, before_id = COALESCE(excluded.before_id, before_id), "
                "complete = excluded.complete",
                (channel_id, guild_id, run_id, before_id, int(complete)),
            )


def _message_fields(row: Sequence[Any]) -> dict[str, Any]:
    """A :class:`StoredMessage`'s fields from the first ten columns of a message query."""
    names = ("id", "guild_id", "channel_id", "author_id", "author_name", "content",
             "created_at", "channel_name", "reply_to_id")
    return {**dict(zip(names, row[:9])), "attachments": _split_attachments(row[9])}


def _now_ms() -> int:
    return int(time.time() * 1000)


def _set_meta(conn: Any, key: str, value: str) -> None:
    conn.execute(
        "INSERT INTO meta(key, value) VALUES (?, ?) "
        "ON CONFLICT(key) DO UPDATE SET value = excluded.value",
        (key, value),
    )
