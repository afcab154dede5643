"""The stored messages on PostgreSQL: ``upsert`` and every read of messages, names and
threads.

An upsert holds the ids it writes (:func:`.database.lock_ids`) and then the write
locks of their guilds before it reads anything that decides the write (tombstones,
opt-outs, retention, what is stored), so a forget, a settings change or a second
import of the same ids in another process is either wholly before it or wholly
after it — the order SQLite gets from having one writer.
"""

from __future__ import annotations

import logging
from collections.abc import Iterable, Sequence
from typing import Any

from memory.records import MessageRecord, StoredMessage
from memory.storage.contract import GuildStats, UpsertStats
from memory.storage.member_names import AUTHOR_JOIN, AUTHOR_NAME
from memory.storage.postgres import windows
from memory.storage.postgres.database import (
    DAY_MS,
    PostgresDatabase,
    lock_guilds,
    lock_ids,
    unlock_ids,
)
from memory.storage.postgres.forgetting import PostgresForgetting
from memory.storage.postgres.forgetting import expand_channels as _expand
from memory.storage.postgres.guilds import PostgresGuilds

log = logging.getLogger(__name__)

_UNKNOWN_TYPES = frozenset({"", "None"})
_MESSAGE_COLUMNS = ("id", "guild_id", "channel_id", "author_id", "author_name", "content",
                    "created_at", "channel_name", "reply_to_id")


def message_fields(row: Sequence[Any]) -> dict[str, Any]:
    """A :class:`StoredMessage`'s fields from the first ten columns of a message query."""
    return {**dict(zip(_MESSAGE_COLUMNS, row[:9])), "attachments": split_attachments(row[9])}


def split_attachments(value: str) -> tuple[str, ...]:
    """Attachment names as stored (newline-separated)."""
    return tuple(name for name in value.split("\n") if name)


class PostgresMessages:
    """The contract's ``Messages`` on PostgreSQL."""

    def __init__(self, database: PostgresDatabase, guilds: PostgresGuilds,
                 forgetting: PostgresForgetting) -> None:
        self._db = database
        self._guilds = guilds
        self._forgetting = forgetting

    def upsert(self, records: Iterable[MessageRecord], *, insert: bool = True) -> UpsertStats:
        """Insert new messages and update changed ones, idempotently, in one transaction
        (the contract's rules: retention, opt-outs, tombstones, the first channel wins)."""
        records = list(records)
        if not records:
            return UpsertStats()
        with self._db.write() as conn:
            held = lock_ids(conn, [r.id for r in records])
            lock_guilds(conn, {r.guild_id for r in records} | set(self._stored_guilds(conn, held)))
            stats = self._write(conn, records, insert=insert)
            unlock_ids(conn, held)
        return stats

    @staticmethod
    def _stored_guilds(conn: Any, ids: list[int]) -> list[int]:
        return [row[0] for row in conn.execute(
            "SELECT DISTINCT guild_id FROM messages WHERE id = ANY(%s)", (ids,))]

    def _write(self, conn: Any, records: list[MessageRecord], *, insert: bool) -> UpsertStats:
        records, expired = self._within_retention(records)
        current = len(records)
        records, withheld = self._admissible(conn, records)
        tombstoned = current - len(records) - len(withheld)
        existing, stored_in = self._existing(conn, [r.id for r in [*records, *withheld]])
        if not insert:
            records = [r for r in records if r.id in existing]
        misplaced = [r for r in [*records, *withheld] if stored_in.get(r.id, r.channel_id) != r.channel_id]
        if misplaced:
            log.warning("left out %d messages stored before in another channel (first e.g. %d in "
                        "%d, stored in %d)", len(misplaced), misplaced[0].id,
                        misplaced[0].channel_id, stored_in[misplaced[0].id])
            records = [r for r in records if stored_in.get(r.id, r.channel_id) == r.channel_id]
            withheld = [r for r in withheld if stored_in.get(r.id, r.channel_id) == r.channel_id]
        withdrawn = [r.id for r in withheld if _newer_version(r, existing.get(r.id))]
        inserted = updated = unchanged = 0
        names: dict[tuple, MessageRecord] = {}
        inserts: list[MessageRecord] = []
        updates: list[tuple[MessageRecord, bool]] = []
        touched: list[tuple[int, int]] = []
        edited: list[int] = []
        for record in records:
            names.setdefault(_names_key(record), record)
            before = existing.get(record.id)
            if before is None:
                inserts.append(record)
                touched.append((record.channel_id, record.id))
                inserted += 1
            elif _newer_version(record, before):
                text_changed = before[0::2] != _message_row(record)[0::2]
                updates.append((record, text_changed))
                if text_changed:
                    touched.append((record.channel_id, record.id))
                    edited.append(record.id)
                updated += 1
            else:
                unchanged += 1
            existing[record.id] = _message_row(record)
            stored_in[record.id] = record.channel_id  # the same id twice in one batch
        _write_names(conn, list(names.values()))
        _write_messages(conn, inserts, updates)
        if edited:
            self._forgetting.edited(conn, edited)
        windows.reindex(conn, touched)
        forgotten = self._forgetting.forget_in(conn, withdrawn)
        return UpsertStats(inserted, updated, unchanged, forgotten, expired, len(misplaced),
                           tombstoned=tombstoned, opted_out=len(withheld))

    def _within_retention(self, records: list[MessageRecord]) -> tuple[list[MessageRecord], int]:
        cutoffs = self._guilds.retention_cutoffs({r.guild_id for r in records},
                                                 seen_ms=max(r.created_at for r in records))
        if not cutoffs:
            return records, 0
        kept = [r for r in records if r.created_at >= cutoffs.get(r.guild_id, r.created_at)]
        if expired := len(records) - len(kept):
            log.info("left out %d messages older than their server's retention period", expired)
        return kept, expired

    @staticmethod
    def _admissible(
        conn: Any, records: list[MessageRecord]
    ) -> tuple[list[MessageRecord], list[MessageRecord]]:
        """Split into those that may be stored and those whose author opted out;
        tombstoned ones are in neither."""
        gone = {row[0] for row in conn.execute(
            "SELECT message_id FROM tombstones WHERE message_id = ANY(%s)",
            (sorted({r.id for r in records}),))}
        guilds = sorted({r.guild_id for r in records})
        opted_out = {tuple(row) for row in conn.execute(
            "SELECT guild_id, author_id FROM member_optouts WHERE guild_id = ANY(%s)", (guilds,))}
        admitted: list[MessageRecord] = []
        withheld: list[MessageRecord] = []
        for r in records:
            if r.id not in gone:
                (withheld if (r.guild_id, r.author_id) in opted_out else admitted).append(r)
        return admitted, withheld

    @staticmethod
    def _existing(conn: Any, ids: list[int]) -> tuple[dict[int, tuple], dict[int, int]]:
        rows = conn.execute("SELECT id, channel_id, content, edited_at, attachments FROM messages "
                            "WHERE id = ANY(%s)", (sorted(set(ids)),)).fetchall()
        return {row[0]: tuple(row[2:]) for row in rows}, {row[0]: row[1] for row in rows}

    # -- reads ---------------------------------------------------------------------------

    def hydrate(self, ids: Sequence[int]) -> dict[int, StoredMessage]:
        """Return the stored messages by id (missing and expired ones are left out)."""
        if not ids:
            return {}
        rows = self._db.read(
            f"SELECT m.id, m.guild_id, m.channel_id, m.author_id, {AUTHOR_NAME}, m.content, "
            "m.created_at, c.name, m.reply_to_id, m.attachments FROM messages m "
            f"{AUTHOR_JOIN} JOIN channels c ON c.id = m.channel_id "
            "LEFT JOIN guild_settings s ON s.guild_id = m.guild_id "
            "WHERE m.id = ANY(%s) AND (s.retention_days IS NULL "
            f"OR m.created_at >= %s - s.retention_days::bigint * {DAY_MS})",
            (list(ids), self._guilds.retention_clock()))
        return {row[0]: StoredMessage(**message_fields(row)) for row in rows}

    def neighbours(self, channel_id: int, message_id: int, before: int, after: int) -> list[int]:
        """Ids of up to ``before`` messages before ``message_id`` in its channel and up to
        ``after`` after it, in id order (``message_id`` itself included if stored)."""
        rows = self._db.read(
            "(SELECT id FROM messages WHERE channel_id = %s AND id < %s ORDER BY id DESC LIMIT %s) "
            "UNION ALL "
            "(SELECT id FROM messages WHERE channel_id = %s AND id >= %s ORDER BY id LIMIT %s)",
            (channel_id, message_id, max(0, before), channel_id, message_id, max(0, after) + 1))
        return sorted(row[0] for row in rows)

    def latest_id(self, channel_id: int) -> int | None:
        """The newest stored message id in a channel (or thread), ``None`` when none is."""
        return self._db.read("SELECT max(id) FROM messages WHERE channel_id = %s", (channel_id,))[0][0]

    def count(self, guild_id: int | None = None) -> int:
        """How many messages are stored (in one guild, or in all)."""
        if guild_id is None:
            return int(self._db.read("SELECT count(*) FROM messages")[0][0])
        return int(self._db.read("SELECT count(*) FROM messages WHERE guild_id = %s", (guild_id,))[0][0])

    def has_any(self, guild_id: int | None = None) -> bool:
        """Whether anything is stored (in one guild, or at all)."""
        where, params = ("WHERE guild_id = %s", [guild_id]) if guild_id is not None else ("", [])
        return bool(self._db.read(f"SELECT EXISTS (SELECT 1 FROM messages {where})", params)[0][0])

    def members(self, guild_id: int | None) -> list[tuple[int, str, str]]:
        """``(author_id, name, display_name)`` of everyone with stored messages in the guild,
        named as in that guild (``None``: every guild's names, a row per guild)."""
        if guild_id is None:
            return [tuple(row) for row in self._db.read(
                "SELECT author_id, name, display_name FROM member_names ORDER BY author_id, guild_id")]
        return [tuple(row) for row in self._db.read(
            "SELECT n.author_id, n.name, n.display_name FROM member_names n "
            "WHERE n.guild_id = %s AND EXISTS (SELECT 1 FROM messages m "
            "WHERE m.guild_id = n.guild_id AND m.author_id = n.author_id) ORDER BY n.author_id",
            (guild_id,))]

    def threads(self, guild_id: int) -> list[tuple[int, int, str]]:
        """``(thread_id, parent_id, type)`` of every stored thread in a guild."""
        return [tuple(row) for row in self._db.read(
            "SELECT id, parent_id, type FROM channels WHERE guild_id = %s AND parent_id IS NOT NULL",
            (guild_id,))]

    def expand_channels(self, channel_ids: Sequence[int]) -> tuple[int, ...]:
        """The channels, in order, plus every stored thread whose parent is one of them."""
        with self._db.session() as conn:
            return _expand(conn, list(channel_ids))

    def channel_ids_named(self, name: str, guild_id: int | None = None) -> list[int]:
        """The ids of stored channels called ``name`` (case-insensitive)."""
        sql = "SELECT id FROM channels WHERE lower(name) = lower(%s)"
        params: list[Any] = [name]
        if guild_id is not None:
            sql += " AND guild_id = %s"
            params.append(guild_id)
        return [row[0] for row in self._db.read(sql, params)]

    def guild_stats(
        self, guild_id: int, author_id: int | None = None, channel_ids: Iterable[int] | None = None
    ) -> GuildStats:
        """Counts for one guild only (and one member in it), optionally only in ``channel_ids``."""
        where = "guild_id = %s"
        params: list[Any] = [guild_id]
        if channel_ids is not None:
            where += " AND channel_id = ANY(%s::bigint[])"
            params.append([int(c) for c in channel_ids])
        messages, channels, pending = self._db.read(
            "SELECT count(*), count(DISTINCT channel_id), count(*) FILTER (WHERE NOT embedded) "
            f"FROM messages WHERE {where}", params)[0]
        mine = 0
        if author_id is not None:
            mine = self._db.read("SELECT count(*) FROM messages WHERE guild_id = %s AND author_id = %s",
                                 (guild_id, author_id))[0][0]
        return GuildStats(int(messages), int(channels), int(mine), int(pending))

    def table_counts(self) -> dict[str, int]:
        """Rows in ``guilds``, ``channels``, ``authors`` and ``messages`` (for ``stats``)."""
        row = self._db.read("SELECT (SELECT count(*) FROM guilds), (SELECT count(*) FROM channels), "
                            "(SELECT count(*) FROM authors), (SELECT count(*) FROM messages)")[0]
        return dict(zip(("guilds", "channels", "authors", "messages"), (int(v) for v in row)))

    def known_guild_ids(self) -> list[int]:
        """Every guild something is stored for, ascending."""
        return [row[0] for row in self._db.read(
            "SELECT id FROM guilds UNION SELECT guild_id FROM channels "
            "UNION SELECT guild_id FROM guild_settings UNION SELECT guild_id FROM member_optouts "
            "ORDER BY 1")]

    def channels_with_messages(self, guild_id: int) -> list[tuple[int, int | None]]:
        """``(channel_id, parent_id)`` of a guild's channels and threads that hold messages."""
        return [(row[0], row[1]) for row in self._db.read(
            "SELECT c.id, c.parent_id FROM channels c WHERE c.guild_id = %s AND EXISTS "
            "(SELECT 1 FROM messages m WHERE m.channel_id = c.id) ORDER BY c.id", (guild_id,))]

    def recent_floor(self, channel_id: int, below_id: int, count: int) -> int | None:
        """The oldest of a channel's ``count`` newest stored messages below ``below_id``."""
        return self._db.read(
            "SELECT min(id) FROM (SELECT id FROM messages WHERE channel_id = %s AND id < %s "
            "ORDER BY id DESC LIMIT %s) s", (channel_id, below_id, max(0, count)))[0][0]

    def ids_between(self, channel_id: int, low: int, high: int) -> list[int]:
        """Stored message ids of a channel with ``low <= id < high``, oldest first."""
        return [row[0] for row in self._db.read(
            "SELECT id FROM messages WHERE channel_id = %s AND id >= %s AND id < %s ORDER BY id",
            (channel_id, low, high))]


def _known_type(channel_type: str) -> str:
    """``channel_type``, or ``""`` where it says nothing (a stored type is then kept)."""
    return "" if channel_type.strip() in _UNKNOWN_TYPES else channel_type


def _names_key(r: MessageRecord) -> tuple:
    return (r.guild_id, r.guild_name, r.channel_id, r.parent_id, r.channel_name, r.channel_type,
            r.author_id, r.author_name, r.author_display_name, r.author_is_bot)


def _older_edit(incoming: int | None, stored: int | None) -> bool:
    return stored is not None and (incoming is None or incoming < stored)


def _message_row(r: MessageRecord) -> tuple:
    return (r.content, r.edited_at, "\n".join(r.attachments))


def _newer_version(r: MessageRecord, stored: tuple | None) -> bool:
    return stored is not None and stored != _message_row(r) and not _older_edit(r.edited_at, stored[1])


def _write_names(conn: Any, records: list[MessageRecord]) -> None:
    """The guild, channel and author rows the messages name (unknown names never overwrite).

    Only rows that change are written, in ascending id order: a member of several
    guilds is named by writers of each, and an unchanged row must not be locked
    until their transactions end (nor rows locked in two orders: a deadlock).
    """
    guilds = _merged(conn, "guilds", ("id",), ("name",), [
        ((r.guild_id,), {"name": r.guild_name}) for r in records])
    channels = _merged(conn, "channels", ("id",), ("guild_id", "parent_id", "name", "type"), [
        ((r.channel_id,), {"guild_id": r.guild_id, "parent_id": r.parent_id,
                           "name": r.channel_name, "type": _known_type(r.channel_type)})
        for r in records])
    authors = _merged(conn, "authors", ("id",), ("is_bot",), [
        ((r.author_id,), {"is_bot": bool(r.author_is_bot)}) for r in records])
    # the names an author has in each guild: another guild's row is never touched
    names = _merged(conn, "member_names", ("guild_id", "author_id"), ("name", "display_name"), [
        ((r.guild_id, r.author_id), {"name": r.author_name, "display_name": r.author_display_name})
        for r in records])
    cursor = conn.cursor()
    cursor.executemany(
        "INSERT INTO guilds AS g(id, name) VALUES (%s, %s) ON CONFLICT (id) DO UPDATE SET "
        "name = CASE WHEN excluded.name <> '' THEN excluded.name ELSE g.name END", guilds)
    cursor.executemany(
        "INSERT INTO channels AS c(id, guild_id, parent_id, name, type) VALUES (%s, %s, %s, %s, %s) "
        "ON CONFLICT (id) DO UPDATE SET parent_id = COALESCE(excluded.parent_id, c.parent_id), "
        "name = CASE WHEN excluded.name <> '' THEN excluded.name ELSE c.name END, "
        "type = CASE WHEN excluded.type <> '' THEN excluded.type ELSE c.type END", channels)
    cursor.executemany(
        "INSERT INTO authors AS a(id, is_bot) VALUES (%s, %s) "
        "ON CONFLICT (id) DO UPDATE SET is_bot = excluded.is_bot", authors)
    cursor.executemany(
        "INSERT INTO member_names AS n(guild_id, author_id, name, display_name) "
        "VALUES (%s, %s, %s, %s) ON CONFLICT (guild_id, author_id) DO UPDATE SET "
        "name = CASE WHEN excluded.name <> '' THEN excluded.name ELSE n.name END, "
        "display_name = CASE WHEN excluded.display_name <> '' THEN excluded.display_name "
        "ELSE n.display_name END", names)


def _merged(conn: Any, table: str, key: tuple[str, ...], columns: tuple[str, ...],
            updates: list[tuple[tuple[int, ...], dict[str, Any]]]) -> list[tuple]:
    """The rows of ``table`` that ``updates`` change (in order: later ones win, an empty
    name or type and a missing parent keep what is there), ascending by ``key``."""
    keys = sorted({k for k, _ in updates})
    if not keys:
        return []
    arrays = ", ".join(["%s::bigint[]"] * len(key))
    stored = {tuple(row[:len(key)]): dict(zip(columns, row[len(key):])) for row in conn.execute(
        f"SELECT {', '.join(key)}, {', '.join(columns)} FROM {table} "
        f"WHERE ({', '.join(key)}) IN (SELECT * FROM unnest({arrays}))",
        [list(part) for part in zip(*keys)])}
    merged = {k: dict(values) for k, values in stored.items()}
    for k, values in updates:
        row = merged.setdefault(k, dict(values))
        for column, value in values.items():
            if column == "parent_id":
                row[column] = value if value is not None else row[column]
            elif column in ("name", "display_name", "type"):
                row[column] = value if value != "" else row[column]
            elif column != "guild_id":  # a channel keeps its guild
                row[column] = value
    return [(*k, *merged[k].values()) for k in keys if merged[k] != stored.get(k)]


def _write_messages(conn: Any, inserts: list[MessageRecord],
                    updates: list[tuple[MessageRecord, bool]]) -> None:
    """New messages, then changed ones (in batch order: a later copy updates an earlier one)."""
    cursor = conn.cursor()
    cursor.executemany(
        "INSERT INTO messages(id, guild_id, channel_id, author_id, created_at, edited_at, content, "
        "reply_to_id, attachments) VALUES (%s, %s, %s, %s, %s, %s, %s, %s, %s)",
        [(r.id, r.guild_id, r.channel_id, r.author_id, r.created_at, r.edited_at, r.content,
          r.reply_to_id, "\n".join(r.attachments)) for r in inserts])
    cursor.executemany(
        "UPDATE messages SET content = %s, edited_at = %s, attachments = %s, "
        "embedded = CASE WHEN %s THEN false ELSE embedded END WHERE id = %s",
        [(r.content, r.edited_at, "\n".join(r.attachments), changed, r.id) for r, changed in updates])
