"""The stored messages on PostgreSQL: ``upsert`` (the reads, and what an upsert may
store, are the shared ones: :class:`~memory.storage.messages.BaseMessages`).

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

from memory.records import MessageRecord
from memory.storage.contract import UpsertStats
from memory.storage.messages import BaseMessages, channel_rows, message_row, names_key, newer_version
from memory.storage.postgres import windows
from memory.storage.postgres.connection import DIALECT
from memory.storage.postgres.database import (
    PostgresDatabase,
    lock_guilds,
    lock_ids,
    unlock_ids,
)
from memory.storage.postgres.forgetting import PostgresForgetting
from memory.storage.postgres.forgetting import expand_channels as _expand
from memory.storage.postgres.guilds import PostgresGuilds

log = logging.getLogger(__name__)


class PostgresMessages(BaseMessages):
    """The contract's ``Messages`` on PostgreSQL (the reads: :class:`BaseMessages`)."""

    def __init__(self, database: PostgresDatabase, guilds: PostgresGuilds,
                 forgetting: PostgresForgetting) -> None:
        super().__init__(database, DIALECT, guilds)
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
        admitted = self._admit(conn, records, insert=insert)
        existing, stored_in = admitted.existing, admitted.stored_in
        inserted = updated = unchanged = 0
        names: dict[tuple, MessageRecord] = {}
        inserts: list[MessageRecord] = []
        updates: list[tuple[MessageRecord, bool]] = []
        touched: list[tuple[int, int]] = []
        edited: list[int] = []
        for record in admitted.records:
            names.setdefault(names_key(record), record)
            before = existing.get(record.id)
            if before is None:
                inserts.append(record)
                touched.append((record.channel_id, record.id))
                inserted += 1
            elif newer_version(record, before):
                text_changed = before[0::2] != message_row(record)[0::2]
                updates.append((record, text_changed))
                if text_changed:
                    touched.append((record.channel_id, record.id))
                    edited.append(record.id)
                updated += 1
            else:
                unchanged += 1
            existing[record.id] = message_row(record)
            stored_in[record.id] = record.channel_id  # the same id twice in one batch
        _write_names(conn, list(names.values()))
        _write_messages(conn, inserts, updates)
        if edited:
            self._forgetting.edited(conn, edited)
        if inserts:  # a later neighbour's antecedent changed
            self._forgetting.inserted(conn, [r.id for r in inserts])
        windows.reindex(conn, touched)
        forgotten = self._forgetting.forget_in(conn, admitted.withdrawn())
        return admitted.stats(inserted, updated, unchanged, forgotten)

    def _tombstoned(self, conn: Any, ids: set[int]) -> set[int]:
        return {row[0] for row in conn.execute(
            "SELECT message_id FROM tombstones WHERE message_id = ANY(%s)", (sorted(ids),))}

    def _opted_out(self, conn: Any, guild_ids: set[int]) -> set[tuple[int, int]]:
        return {(row[0], row[1]) for row in conn.execute(
            "SELECT guild_id, author_id FROM member_optouts WHERE guild_id = ANY(%s)",
            (sorted(guild_ids),))}

    def _existing(self, conn: Any, ids: list[int]) -> tuple[dict[int, tuple], dict[int, int]]:
        rows = conn.execute("SELECT id, channel_id, content, edited_at, attachments FROM messages "
                            "WHERE id = ANY(%s)", (sorted(set(ids)),)).fetchall()
        return {row[0]: tuple(row[2:]) for row in rows}, {row[0]: row[1] for row in rows}

    def expand_channels(self, channel_ids: Sequence[int]) -> tuple[int, ...]:
        """The channels, in order, plus every stored thread whose parent is one of them."""
        with self._db.session() as conn:
            return _expand(conn, list(channel_ids))


def _write_names(conn: Any, records: list[MessageRecord]) -> None:
    """The guild, channel and author rows the messages name (unknown names never overwrite).

    Only rows that change are written, in ascending id order: a member of several
    guilds is named by writers of each, and an unchanged row must not be locked
    until their transactions end (nor rows locked in two orders: a deadlock).
    """
    guilds = _merged(conn, "guilds", ("id",), ("name",), [
        ((r.guild_id,), {"name": r.guild_name}) for r in records])
    channels = _merged(conn, "channels", ("id",), ("guild_id", "parent_id", "name", "type"), [
        ((row[0],), dict(zip(("guild_id", "parent_id", "name", "type"), row[1:])))
        for r in records for row in channel_rows(r)])
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
