"""The stored messages, with the names of their guild, channel and author.

:meth:`SQLiteMessages.upsert` is the one way in: it decides, inside its write
transaction, what may be stored (retention, opt-outs, tombstones, the first channel
of an id), writes the names and the messages, and rewrites the windows of the
keyword index (:mod:`.windows`) in the same transaction.  The rest are reads: what a
search hydrates, the neighbours a chat model is shown, counts, members, threads, and
what the reconcile with Discord compares.
"""

from __future__ import annotations

import logging
from collections.abc import Iterable, Sequence
from typing import Any

from memory.records import MessageRecord, StoredMessage
from memory.storage.contract import GuildStats, UpsertStats
from memory.storage.member_names import AUTHOR_JOIN, AUTHOR_NAME
from memory.storage.sqlite import windows
from memory.storage.sqlite.connection import IN_IDS, id_list
from memory.storage.sqlite.database import DAY_MS, SQLiteDatabase
from memory.storage.sqlite.forgetting import SQLiteForgetting, expand_channels
from memory.storage.sqlite.guilds import SQLiteGuilds

log = logging.getLogger(__name__)

MESSAGE_COLUMNS = (
    f"m.id, m.guild_id, m.channel_id, m.author_id, {AUTHOR_NAME}, m.content, m.created_at, "
    "c.name, m.reply_to_id, m.attachments"
)
"""The columns :func:`message_fields` reads (``m``: messages, ``a``: the author's names in
the message's guild (:data:`AUTHOR_JOIN`), ``c``: channels)."""

# what an event that does not know a channel's type says: "" (and "None", str(None),
# which live capture wrote before it said "")
_UNKNOWN_TYPES = frozenset({"", "None"})


def message_fields(row: Sequence[Any]) -> dict[str, Any]:
    """A :class:`StoredMessage`'s fields from the first ten columns (:data:`MESSAGE_COLUMNS`)."""
    names = ("id", "guild_id", "channel_id", "author_id", "author_name", "content",
             "created_at", "channel_name", "reply_to_id")
    return {**dict(zip(names, row[:9])), "attachments": split_attachments(row[9])}


def split_attachments(value: str) -> tuple[str, ...]:
    """The attachment names stored one per line."""
    return tuple(name for name in value.split("\n") if name)


class SQLiteMessages:
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
        self._db = database
        self._guilds = guilds
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
            records, expired = self._within_retention(records)
            current = len(records)
            records, withheld = self._admissible(records)
            tombstoned = current - len(records) - len(withheld)
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
            inserted, updated, unchanged = self._write(conn, records, existing, stored_in)
            forgotten = self._forgetting.forget_in(conn, withdrawn)
        return UpsertStats(inserted, updated, unchanged, forgotten, expired, len(misplaced),
                           tombstoned=tombstoned, opted_out=len(withheld))

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
        for record in records:
            # a batch repeats the same guild/channel/author many times; writing
            # an identical names row again would change nothing
            if (names := _names_key(record)) not in names_done:
                _write_names(conn, record)
                names_done.add(names)
            row = _message_row(record)
            before = existing.get(record.id)
            if before is None:
                _insert_message(conn, record)
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
        return inserted, updated, unchanged

    def _within_retention(self, records: list[MessageRecord]) -> tuple[list[MessageRecord], int]:
        """Leave out messages older than their guild's retention period; count them."""
        cutoffs = self._guilds.retention_cutoffs({r.guild_id for r in records},
                                                 seen_ms=max(r.created_at for r in records))
        if not cutoffs:
            return records, 0
        kept = [r for r in records if r.created_at >= cutoffs.get(r.guild_id, r.created_at)]
        if expired := len(records) - len(kept):
            log.info("left out %d messages older than their server's retention period", expired)
        return kept, expired

    def _admissible(
        self, records: list[MessageRecord]
    ) -> tuple[list[MessageRecord], list[MessageRecord]]:
        """Split ``records`` into those that may be stored and those whose author opted out.

        Deleted (tombstoned) messages are in neither: they stay deleted.
        """
        if not records:
            return records, []
        gone = self._forgetting.tombstoned(r.id for r in records)
        opted_out = self._guilds.opted_out()
        admitted: list[MessageRecord] = []
        withheld: list[MessageRecord] = []
        for r in records:
            if r.id not in gone:
                (withheld if (r.guild_id, r.author_id) in opted_out else admitted).append(r)
        return admitted, withheld

    def _existing(self, ids: list[int]) -> tuple[dict[int, tuple], dict[int, int]]:
        """The stored text rows (:func:`_message_row`) and channels of those of ``ids`` stored."""
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

    def hydrate(self, ids: Sequence[int]) -> dict[int, StoredMessage]:
        """Return the stored messages by id (missing ids are left out).

        A message older than its guild's retention period is left out too: the
        hourly forgetting may not have removed it yet, and it is never shown.
        """
        rows = self._db.read(
            f"SELECT {MESSAGE_COLUMNS} FROM messages m "
            f"{AUTHOR_JOIN} JOIN channels c ON c.id = m.channel_id "
            "LEFT JOIN guild_settings s ON s.guild_id = m.guild_id "
            f"WHERE m.id {IN_IDS} AND (s.retention_days IS NULL "
            f"OR m.created_at >= ? - s.retention_days * {DAY_MS})",
            (id_list(ids), self._guilds.retention_clock()),
        )
        return {row[0]: StoredMessage(**message_fields(row)) for row in rows}

    def neighbours(self, channel_id: int, message_id: int, before: int, after: int) -> list[int]:
        """Ids of up to ``before`` messages before ``message_id`` in its channel, and
        up to ``after`` after it, in time order (``message_id`` itself included if stored).

        Only ``channel_id`` is read, whatever the neighbours' other fields say, so a
        caller that may read that channel can show every id returned.
        """
        rows = self._db.read(
            "SELECT id FROM (SELECT id FROM messages WHERE channel_id = ? AND id < ? "
            "ORDER BY id DESC LIMIT ?) UNION ALL "
            "SELECT id FROM (SELECT id FROM messages WHERE channel_id = ? AND id >= ? "
            "ORDER BY id LIMIT ?)",
            (channel_id, message_id, max(0, before), channel_id, message_id, max(0, after) + 1),
        )
        return sorted(row[0] for row in rows)

    def latest_id(self, channel_id: int) -> int | None:
        """The newest stored message id in a channel (or thread), ``None`` when none is."""
        return self._db.read("SELECT max(id) FROM messages WHERE channel_id = ?", (channel_id,))[0][0]

    def count(self, guild_id: int | None = None) -> int:
        """How many messages are stored (in one guild, or in all)."""
        if guild_id is None:
            return self._db.read("SELECT count(*) FROM messages")[0][0]
        return self._db.read("SELECT count(*) FROM messages WHERE guild_id = ?", (guild_id,))[0][0]

    def has_any(self, guild_id: int | None = None) -> bool:
        """Whether anything is stored (in one guild, or at all); cheaper than counting."""
        where, params = ("WHERE guild_id = ?", [guild_id]) if guild_id is not None else ("", [])
        return bool(self._db.read(f"SELECT EXISTS (SELECT 1 FROM messages {where})", params)[0][0])

    def members(self, guild_id: int | None) -> list[tuple[int, str, str]]:
        """Return ``(author_id, name, display_name)`` of everyone with stored messages.

        The names are those given in ``guild_id`` (``None``: every guild's, one row
        per guild a member is named in).
        """
        if guild_id is None:
            sql = "SELECT author_id, name, display_name FROM member_names ORDER BY author_id, guild_id"
            params: list[int] = []
        else:
            sql = (
                "SELECT n.author_id, n.name, n.display_name FROM member_names n "
                "WHERE n.guild_id = ? AND EXISTS (SELECT 1 FROM messages m "
                "WHERE m.guild_id = n.guild_id AND m.author_id = n.author_id) ORDER BY n.author_id"
            )
            params = [guild_id]
        return [(row[0], row[1], row[2]) for row in self._db.read(sql, params)]

    def threads(self, guild_id: int) -> list[tuple[int, int, str]]:
        """Return ``(thread_id, parent_id, type)`` of every stored thread in a guild."""
        return [(row[0], row[1], row[2]) for row in self._db.read(
            "SELECT id, parent_id, type FROM channels WHERE guild_id = ? AND parent_id IS NOT NULL",
            (guild_id,),
        )]

    def expand_channels(self, channel_ids: Sequence[int]) -> tuple[int, ...]:
        """Return the channels plus every stored thread whose parent is one of them."""
        return expand_channels(self._db.read, channel_ids)

    def channel_ids_named(self, name: str, guild_id: int | None = None) -> list[int]:
        """Return the ids of stored channels called ``name`` (case-insensitive)."""
        sql = "SELECT id FROM channels WHERE lower(name) = lower(?)"
        params: list[Any] = [name]
        if guild_id is not None:
            sql += " AND guild_id = ?"
            params.append(guild_id)
        return [row[0] for row in self._db.read(sql, params)]

    def guild_stats(
        self, guild_id: int, author_id: int | None = None, channel_ids: Iterable[int] | None = None
    ) -> GuildStats:
        """Counts for one guild only (and one member in it), optionally only in ``channel_ids``."""
        where = "guild_id = ?"
        params: list[int | str] = [guild_id]
        if channel_ids is not None:
            where += f" AND channel_id {IN_IDS}"
            params.append(id_list(channel_ids))
        messages, channels, pending = self._db.read(
            "SELECT count(*), count(DISTINCT channel_id), coalesce(sum(embedded = 0), 0) "
            f"FROM messages WHERE {where}", params,
        )[0]
        mine = 0
        if author_id is not None:
            mine = self._db.read("SELECT count(*) FROM messages WHERE guild_id = ? AND author_id = ?",
                                 (guild_id, author_id))[0][0]
        return GuildStats(messages, channels, mine, pending)

    def table_counts(self) -> dict[str, int]:
        """Rows in ``guilds``, ``channels``, ``authors`` and ``messages`` (for ``stats``)."""
        return {table: self._db.read(f"SELECT count(*) FROM {table}")[0][0]
                for table in ("guilds", "channels", "authors", "messages")}

    # -- reconciling with what Discord says exists (cogs.reconcile) ----------------------

    def known_guild_ids(self) -> list[int]:
        """Every guild something is stored for: messages, channels or settings."""
        return [row[0] for row in self._db.read(
            "SELECT id FROM guilds UNION SELECT guild_id FROM channels "
            "UNION SELECT guild_id FROM guild_settings UNION SELECT guild_id FROM member_optouts "
            "ORDER BY 1")]

    def channels_with_messages(self, guild_id: int) -> list[tuple[int, int | None]]:
        """``(channel_id, parent_id)`` of a guild's channels and threads that hold messages."""
        return [(row[0], row[1]) for row in self._db.read(
            "SELECT c.id, c.parent_id FROM channels c WHERE c.guild_id = ? AND EXISTS "
            "(SELECT 1 FROM messages m WHERE m.channel_id = c.id) ORDER BY c.id", (guild_id,))]

    def recent_floor(self, channel_id: int, below_id: int, count: int) -> int | None:
        """The oldest of a channel's ``count`` newest stored messages below ``below_id``."""
        rows = self._db.read(
            "SELECT min(id) FROM (SELECT id FROM messages WHERE channel_id = ? AND id < ? "
            "ORDER BY id DESC LIMIT ?)", (channel_id, below_id, max(0, count)))
        return rows[0][0]

    def ids_between(self, channel_id: int, low: int, high: int) -> list[int]:
        """Stored message ids of a channel with ``low <= id < high``, oldest first."""
        return [row[0] for row in self._db.read(
            "SELECT id FROM messages WHERE channel_id = ? AND id >= ? AND id < ? ORDER BY id",
            (channel_id, low, high))]


# -- what an upsert writes -------------------------------------------------------------------


def _known_type(channel_type: str) -> str:
    """``channel_type``, or ``""`` where it says nothing (a stored type is then kept)."""
    return "" if channel_type.strip() in _UNKNOWN_TYPES else channel_type


def _names_key(r: MessageRecord) -> tuple:
    """Every field :func:`_write_names` writes."""
    return (
        r.guild_id, r.guild_name, r.channel_id, r.parent_id, r.channel_name, r.channel_type,
        r.author_id, r.author_name, r.author_display_name, r.author_is_bot,
    )


def _older_edit(incoming: int | None, stored: int | None) -> bool:
    """Whether an incoming copy of a message predates the edit already stored."""
    return stored is not None and (incoming is None or incoming < stored)


def _message_row(r: MessageRecord) -> tuple:
    """A message's stored text, edit time and attachments, as ``_existing`` reads them."""
    return (r.content, r.edited_at, "\n".join(r.attachments))


def _newer_version(r: MessageRecord, stored: tuple | None) -> bool:
    """Whether ``r`` changes a stored message (not an older copy of it, not the same)."""
    return stored is not None and stored != _message_row(r) and not _older_edit(r.edited_at, stored[1])


def _write_names(conn: Any, r: MessageRecord) -> None:
    """The guild's, channel's and author's rows (the author's names in this guild); a
    name the record does not know is kept."""
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
