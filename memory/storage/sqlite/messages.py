"""The stored messages on SQLite, with the names of their guild, channel and author.

:meth:`SQLiteMessages.upsert` is the one way in: it decides, inside its write
transaction, what may be stored (:meth:`memory.storage.messages.BaseMessages._admit`:
retention, opt-outs, tombstones, the first channel of an id), writes the names and
the messages row by row, and rewrites the windows of the keyword index
(:mod:`.windows`) in the same transaction.  The reads are the shared ones
(:class:`~memory.storage.messages.BaseMessages`).
"""

from __future__ import annotations

import logging
from collections.abc import Iterable, Sequence
from typing import Any

from memory.records import MessageRecord
from memory.storage.contract import UpsertStats
from memory.storage.messages import BaseMessages, channel_rows, message_row, names_key, newer_version
from memory.storage.sqlite import windows
from memory.storage.sqlite.connection import DIALECT, IN_IDS, id_list
from memory.storage.sqlite.database import SQLiteDatabase
from memory.storage.sqlite.forgetting import SQLiteForgetting, expand_channels
from memory.storage.sqlite.guilds import SQLiteGuilds

log = logging.getLogger(__name__)


class SQLiteMessages(BaseMessages):
    """The contract's ``Messages`` on one database.

    Args:
        database: The database.
        guilds: Read inside an upsert: retention periods and opt-outs.
        forgetting: Called inside an upsert: tombstones, edits that take text out,
            and the stored copies of opted-out members' edited messages.
    """

    def __init__(
        self, database: SQLiteDatabase, guilds: SQLiteGuilds, forgetting: SQLiteForgetting
    ) -> None:
        super().__init__(database, DIALECT, guilds)
        self._guilds: SQLiteGuilds = guilds
        self._forgetting = forgetting

    # -- the one write --------------------------------------------------------------------

    def upsert(self, records: Iterable[MessageRecord], *, insert: bool = True) -> UpsertStats:
        """Insert new messages and update changed ones, idempotently, in one transaction.

        See :meth:`memory.storage.contract.Messages.upsert` for every rule.

        Args:
            records: The messages, as they are now.
            insert: ``False`` only applies changes to messages already stored.
        """
        records = list(records)
        if not records:
            return UpsertStats()
        # everything that decides the write is read inside it: a second writer (two
        # imports of the same export) cannot insert the same ids in between
        with self._db.write() as conn:
            admitted = self._admit(conn, records, insert=insert)
            inserted, updated, unchanged = self._write(conn, admitted.records, admitted.existing,
                                                       admitted.stored_in)
            forgotten = self._forgetting.forget_in(conn, admitted.withdrawn())
        return admitted.stats(inserted, updated, unchanged, forgotten)

    def _write(
        self, conn: Any, records: list[MessageRecord], existing: dict[int, tuple],
        stored_in: dict[int, int],
    ) -> tuple[int, int, int]:
        """Write admitted records and their names; reindex their windows.

        Returns:
            How many were inserted, updated and left unchanged.
        """
        inserted = updated = unchanged = 0
        names_done: set[tuple] = set()
        touched: list[tuple[int, int]] = []  # (channel, message) whose index rows change
        new: list[int] = []
        for record in records:
            # a batch repeats the same guild/channel/author many times; writing
            # an identical names row again would change nothing
            if (names := names_key(record)) not in names_done:
                _write_names(conn, record)
                names_done.add(names)
            row = message_row(record)
            before = existing.get(record.id)
            if before is None:
                _insert_message(conn, record)
                touched.append((record.channel_id, record.id))
                new.append(record.id)
                inserted += 1
            elif newer_version(record, before):
                text_changed = before[0::2] != row[0::2]
                self._update_message(conn, record, text_changed=text_changed)
                if text_changed:
                    touched.append((record.channel_id, record.id))
                updated += 1
            else:
                unchanged += 1
            existing[record.id] = row
            stored_in[record.id] = record.channel_id  # the same id twice in one batch
        if new:
            self._forgetting.inserted(conn, new)  # a later neighbour's antecedent changed
        windows.reindex(conn, touched)
        return inserted, updated, unchanged

    def _tombstoned(self, conn: Any, ids: set[int]) -> set[int]:
        return self._forgetting.tombstoned(ids)

    def _opted_out(self, conn: Any, guild_ids: set[int]) -> set[tuple[int, int]]:
        return self._guilds.opted_out()

    def _existing(self, conn: Any, ids: list[int]) -> tuple[dict[int, tuple], dict[int, int]]:
        """The stored text rows (:func:`~memory.storage.messages.message_row`) and channels
        of those of ``ids`` stored."""
        rows = self._db.read(
            "SELECT id, channel_id, content, edited_at, attachments FROM messages "
            f"WHERE id {IN_IDS}",
            (id_list(ids),),
        )
        return {row[0]: tuple(row[2:]) for row in rows}, {row[0]: row[1] for row in rows}

    def _update_message(self, conn: Any, r: MessageRecord, *, text_changed: bool) -> None:
        conn.execute(
            "UPDATE messages SET content = ?, edited_at = ?, attachments = ?, "
            "embedded = CASE WHEN ? THEN 0 ELSE embedded END WHERE id = ?",
            (r.content, r.edited_at, "\n".join(r.attachments), int(text_changed), r.id),
        )
        if text_changed:
            self._forgetting.edited(conn, [r.id])

    # -- reads ----------------------------------------------------------------------------

    def expand_channels(self, channel_ids: Sequence[int]) -> tuple[int, ...]:
        """Return the channels plus every stored thread whose parent is one of them."""
        return expand_channels(self._db.read, channel_ids)


# -- what an upsert writes -------------------------------------------------------------------


def _write_names(conn: Any, r: MessageRecord) -> None:
    """The guild's, channel's and author's rows (the author's names in this guild); a
    name the record does not know is kept."""
    conn.execute(
        "INSERT INTO guilds(id, name) VALUES (?, ?) ON CONFLICT(id) DO UPDATE SET "
        "name = CASE WHEN excluded.name != '' THEN excluded.name ELSE name END",
        (r.guild_id, r.guild_name),
    )
    conn.executemany(
        "INSERT INTO channels(id, guild_id, parent_id, name, type) VALUES (?, ?, ?, ?, ?) "
        "ON CONFLICT(id) DO UPDATE SET "
        "parent_id = COALESCE(excluded.parent_id, parent_id), "
        "name = CASE WHEN excluded.name != '' THEN excluded.name ELSE name END, "
        "type = CASE WHEN excluded.type != '' THEN excluded.type ELSE type END",
        channel_rows(r),
    )
    conn.execute(
        "INSERT INTO authors(id, is_bot) VALUES (?, ?) "
        "ON CONFLICT(id) DO UPDATE SET is_bot = excluded.is_bot",
        (r.author_id, int(r.author_is_bot)),
    )
    # the names the author has in this guild: another guild's row is never touched
    conn.execute(
        "INSERT INTO member_names(guild_id, author_id, name, display_name) VALUES (?, ?, ?, ?) "
        "ON CONFLICT(guild_id, author_id) DO UPDATE SET "
        "name = CASE WHEN excluded.name != '' THEN excluded.name ELSE name END, "
        "display_name = CASE WHEN excluded.display_name != '' "
        "THEN excluded.display_name ELSE display_name END",
        (r.guild_id, r.author_id, r.author_name, r.author_display_name),
    )


def _insert_message(conn: Any, r: MessageRecord) -> None:
    conn.execute(
        "INSERT INTO messages(id, guild_id, channel_id, author_id, created_at, edited_at, "
        "content, reply_to_id, attachments) VALUES (?, ?, ?, ?, ?, ?, ?, ?, ?)",
        (
            r.id, r.guild_id, r.channel_id, r.author_id, r.created_at, r.edited_at,
            r.content, r.reply_to_id, "\n".join(r.attachments),
        ),
    )
