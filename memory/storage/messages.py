"""The stored messages on either engine: every read, and the rules an upsert decides by.

Each engine's ``Messages`` keeps its own write path (SQLite writes row by row under
its one writer; PostgreSQL takes locks and writes in batches) and subclasses
:class:`BaseMessages` for what is the same on both: what an upsert may store
(retention, tombstones, opt-outs, the first channel of an id, an older copy of an
edit) and every read of messages, names, threads and counts, in SQL both engines run.
"""

from __future__ import annotations

import logging
from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from typing import Any

from memory.records import MessageRecord, StoredMessage
from memory.retention import DAY_MS
from memory.storage.contract import GuildStats, UpsertStats
from memory.storage.dialect import Dialect, DialectNoun
from memory.storage.member_names import AUTHOR_JOIN, AUTHOR_NAME

__all__ = [
    "MESSAGE_COLUMNS", "Admission", "BaseMessages", "channel_rows", "known_type", "message_fields",
    "message_row", "names_key", "newer_version", "split_attachments",
]

log = logging.getLogger(__name__)

MESSAGE_COLUMNS = (
    f"m.id, m.guild_id, m.channel_id, m.author_id, {AUTHOR_NAME}, m.content, m.created_at, "
    "c.name, m.reply_to_id, m.attachments"
)
"""The columns :func:`message_fields` reads (``m``: messages, ``a``: the author's names in
the message's guild (:data:`AUTHOR_JOIN`), ``c``: channels)."""

_FIELDS = ("id", "guild_id", "channel_id", "author_id", "author_name", "content",
           "created_at", "channel_name", "reply_to_id")

# what an event that does not know a channel's type says: "" (and "None", str(None),
# which live capture wrote before it said "")
_UNKNOWN_TYPES = frozenset({"", "None"})


def message_fields(row: Sequence[Any]) -> dict[str, Any]:
    """A :class:`StoredMessage`'s fields from the first ten columns (:data:`MESSAGE_COLUMNS`)."""
    return {**dict(zip(_FIELDS, row[:9])), "attachments": split_attachments(row[9])}


def split_attachments(value: str) -> tuple[str, ...]:
    """The attachment names stored one per line."""
    return tuple(name for name in value.split("\n") if name)


def known_type(channel_type: str) -> str:
    """``channel_type``, or ``""`` where it says nothing (a stored type is then kept)."""
    return "" if channel_type.strip() in _UNKNOWN_TYPES else channel_type


def names_key(r: MessageRecord) -> tuple:
    """Every field an upsert writes to the guild, channel, author and names rows."""
    return (
        r.guild_id, r.guild_name, r.channel_id, r.parent_id, r.channel_name, r.channel_type,
        r.parent_name, r.author_id, r.author_name, r.author_display_name, r.author_is_bot,
    )


def channel_rows(r: MessageRecord) -> list[tuple[int, int, int | None, str, str]]:
    """The ``(id, guild_id, parent_id, name, type)`` rows of ``channels`` a record names:
    its channel, and a thread's parent when the record knows the parent's name (a
    forum's row exists only so: ``--channel <forum>`` then finds its posts)."""
    rows = [(r.channel_id, r.guild_id, r.parent_id, r.channel_name, known_type(r.channel_type))]
    if r.parent_id is not None and r.parent_name.strip():
        rows.append((r.parent_id, r.guild_id, None, r.parent_name, ""))
    return rows


def message_row(r: MessageRecord) -> tuple:
    """A message's stored text, edit time and attachments, as an upsert compares them."""
    return (r.content, r.edited_at, "\n".join(r.attachments))


def older_edit(incoming: int | None, stored: int | None) -> bool:
    """Whether an incoming copy of a message predates the edit already stored."""
    return stored is not None and (incoming is None or incoming < stored)


def newer_version(r: MessageRecord, stored: tuple | None) -> bool:
    """Whether ``r`` changes a stored message (not an older copy of it, not the same)."""
    return stored is not None and stored != message_row(r) and not older_edit(r.edited_at, stored[1])


@dataclass
class Admission:
    """What an upsert may write, decided inside its transaction (:meth:`BaseMessages._admit`)."""

    records: list[MessageRecord]  # to store (new, or changing a stored one)
    withheld: list[MessageRecord]  # by members who opted out: not stored
    existing: dict[int, tuple]  # the stored rows (:func:`message_row`) of their ids
    stored_in: dict[int, int]  # the channel each stored id is in
    expired: int  # older than the guild's retention period
    tombstoned: int  # deleted before: they stay deleted
    misplaced: int  # stored before in another channel: the first channel wins

    def withdrawn(self) -> list[int]:
        """Stored messages of opted-out members that this batch edits: they are forgotten."""
        return [r.id for r in self.withheld if newer_version(r, self.existing.get(r.id))]

    def stats(self, inserted: int, updated: int, unchanged: int, forgotten: int) -> UpsertStats:
        """The upsert's :class:`UpsertStats`, given what its write did."""
        return UpsertStats(inserted, updated, unchanged, forgotten, self.expired, self.misplaced,
                           tombstoned=self.tombstoned, opted_out=len(self.withheld))


class BaseMessages(DialectNoun):
    """The contract's ``Messages`` reads, and an upsert's admission rules, on one engine.

    Args:
        database: The engine's database.
        dialect: How its SQL differs from the shared SQL.
        guilds: Its ``Guilds`` (retention periods and clock).
    """

    def __init__(self, database: Any, dialect: Dialect, guilds: Any) -> None:
        super().__init__(database, dialect)
        self._guilds = guilds

    # -- what each engine does its own way ---------------------------------------------------

    def _tombstoned(self, conn: Any, ids: set[int]) -> set[int]:
        """Those of ``ids`` that were deleted (tombstoned), read inside the upsert."""
        raise NotImplementedError

    def _opted_out(self, conn: Any, guild_ids: set[int]) -> set[tuple[int, int]]:
        """``(guild_id, author_id)`` of the members who opted out of these guilds (or more)."""
        raise NotImplementedError

    def _existing(self, conn: Any, ids: list[int]) -> tuple[dict[int, tuple], dict[int, int]]:
        """The stored rows (:func:`message_row`) and channels of those of ``ids`` stored."""
        raise NotImplementedError

    # -- what an upsert may store -----------------------------------------------------------

    def _admissible(
        self, conn: Any, records: list[MessageRecord]
    ) -> tuple[list[MessageRecord], list[MessageRecord]]:
        """Split ``records`` into those that may be stored and those whose author opted out.

        Deleted (tombstoned) messages are in neither: they stay deleted; nor is a copy of
        a message an edit emptied that is no newer than that edit (its taken-out text).
        """
        if not records:
            return records, []
        gone = self._tombstoned(conn, {r.id for r in records})
        emptied = self._emptied_at(conn, [r.id for r in records])
        opted_out = self._opted_out(conn, {r.guild_id for r in records})
        admitted: list[MessageRecord] = []
        withheld: list[MessageRecord] = []
        for r in records:
            if r.id in gone or (r.id in emptied and (r.edited_at or 0) <= emptied[r.id]):
                continue
            (withheld if (r.guild_id, r.author_id) in opted_out else admitted).append(r)
        return admitted, withheld

    def _emptied_at(self, conn: Any, ids: list[int]) -> dict[int, int]:
        """When an edit emptied those of ``ids`` it did (:meth:`.Forgetting.forget_emptied`)."""
        return {row[0]: row[1] for row in conn.execute(self._dialect.sql(
            f"SELECT message_id, edited_at FROM emptied_messages "
            f"WHERE {self._dialect.in_ids('message_id')}"), (self._dialect.ids(ids),))}

    def _admit(self, conn: Any, records: list[MessageRecord], *, insert: bool) -> Admission:
        """Decide, inside the upsert's transaction, what of ``records`` it writes (see
        :meth:`memory.storage.contract.Messages.upsert` for every rule)."""
        records, expired = self._within_retention(records)
        current = len(records)
        records, withheld = self._admissible(conn, records)
        tombstoned = current - len(records) - len(withheld)
        existing, stored_in = self._existing(conn, [r.id for r in [*records, *withheld]])
        if not insert:
            records = [r for r in records if r.id in existing]
        records, withheld, misplaced = self._in_first_channel(records, withheld, stored_in)
        return Admission(records, withheld, existing, stored_in, expired, tombstoned, misplaced)

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

    @staticmethod
    def _in_first_channel(
        records: list[MessageRecord], withheld: list[MessageRecord], stored_in: dict[int, int]
    ) -> tuple[list[MessageRecord], list[MessageRecord], int]:
        """Leave out copies of messages stored before in another channel; count them.

        A message stays in the channel it was first stored in (ids are unique on
        Discord: a copy elsewhere is a damaged or forged export) and its indexes
        follow that row.
        """
        misplaced = [r for r in [*records, *withheld]
                     if stored_in.get(r.id, r.channel_id) != r.channel_id]
        if not misplaced:
            return records, withheld, 0
        log.warning("left out %d messages stored before in another channel (first e.g. %d in "
                    "%d, stored in %d)", len(misplaced), misplaced[0].id,
                    misplaced[0].channel_id, stored_in[misplaced[0].id])
        return ([r for r in records if stored_in.get(r.id, r.channel_id) == r.channel_id],
                [r for r in withheld if stored_in.get(r.id, r.channel_id) == r.channel_id],
                len(misplaced))

    # -- reads ------------------------------------------------------------------------------

    def hydrate(self, ids: Sequence[int]) -> dict[int, StoredMessage]:
        """Return the stored messages by id (missing ids are left out).

        A message older than its guild's retention period is left out too: the
        hourly forgetting may not have removed it yet, and it is never shown.
        """
        if not ids:
            return {}
        rows = self._read(
            f"SELECT {MESSAGE_COLUMNS} FROM messages m "
            f"{AUTHOR_JOIN} JOIN channels c ON c.id = m.channel_id "
            "LEFT JOIN guild_settings s ON s.guild_id = m.guild_id "
            f"WHERE {self._dialect.in_ids('m.id')} AND (s.retention_days IS NULL "
            f"OR m.created_at >= ? - CAST(s.retention_days AS BIGINT) * {DAY_MS})",
            (self._dialect.ids(ids), self._guilds.retention_clock()))
        return {row[0]: StoredMessage(**message_fields(row)) for row in rows}

    def neighbours(self, channel_id: int, message_id: int, before: int, after: int) -> list[int]:
        """Ids of up to ``before`` messages before ``message_id`` in its channel, and
        up to ``after`` after it, in time order (``message_id`` itself included if stored).

        Only ``channel_id`` is read, whatever the neighbours' other fields say, so a
        caller that may read that channel can show every id returned.
        """
        rows = self._read(
            "SELECT id FROM (SELECT id FROM messages WHERE channel_id = ? AND id < ? "
            "ORDER BY id DESC LIMIT ?) b UNION ALL "
            "SELECT id FROM (SELECT id FROM messages WHERE channel_id = ? AND id >= ? "
            "ORDER BY id LIMIT ?) a",
            (channel_id, message_id, max(0, before), channel_id, message_id, max(0, after) + 1))
        return sorted(row[0] for row in rows)

    def latest_id(self, channel_id: int, before_id: int | None = None) -> int | None:
        """The newest stored message id in a channel (or thread), below ``before_id``
        when given; ``None`` when there is none."""
        if before_id is None:
            return self._read("SELECT max(id) FROM messages WHERE channel_id = ?",
                              (channel_id,))[0][0]
        return self._read("SELECT max(id) FROM messages WHERE channel_id = ? AND id < ?",
                          (channel_id, before_id))[0][0]

    def latest_in_guild(self, guild_id: int, before_id: int) -> int | None:
        """The newest stored message id in a guild below ``before_id``; ``None`` when none is."""
        return self._read("SELECT max(id) FROM messages WHERE guild_id = ? AND id < ?",
                          (guild_id, before_id))[0][0]

    def count(self, guild_id: int | None = None) -> int:
        """How many messages are stored (in one guild, or in all)."""
        if guild_id is None:
            return int(self._read("SELECT count(*) FROM messages")[0][0])
        return int(self._read("SELECT count(*) FROM messages WHERE guild_id = ?", (guild_id,))[0][0])

    def has_any(
        self, guild_id: int | None = None, channel_ids: Iterable[int] | None = None
    ) -> bool:
        """Whether anything is stored (in one guild, or at all; only in ``channel_ids``
        when given); cheaper than counting."""
        where, params = ["TRUE"], []
        if guild_id is not None:
            where.append("guild_id = ?")
            params.append(guild_id)
        if channel_ids is not None:
            where.append(self._dialect.in_ids("channel_id"))
            params.append(self._dialect.ids(channel_ids))
        sql = f"SELECT EXISTS (SELECT 1 FROM messages WHERE {' AND '.join(where)})"
        return bool(self._read(sql, params)[0][0])

    def members(self, guild_id: int | None) -> list[tuple[int, str, str]]:
        """Return ``(author_id, name, display_name)`` of everyone with stored messages.

        The names are those given in ``guild_id`` (``None``: every guild's, one row
        per guild a member is named in).
        """
        if guild_id is None:
            sql = "SELECT author_id, name, display_name FROM member_names ORDER BY author_id, guild_id"
            params: list[int] = []
        else:
            sql = ("SELECT n.author_id, n.name, n.display_name FROM member_names n "
                   "WHERE n.guild_id = ? AND EXISTS (SELECT 1 FROM messages m "
                   "WHERE m.guild_id = n.guild_id AND m.author_id = n.author_id) ORDER BY n.author_id")
            params = [guild_id]
        return [(row[0], row[1], row[2]) for row in self._read(sql, params)]

    def threads(self, guild_id: int) -> list[tuple[int, int, str]]:
        """Return ``(thread_id, parent_id, type)`` of every stored thread in a guild."""
        return [(row[0], row[1], row[2]) for row in self._read(
            "SELECT id, parent_id, type FROM channels WHERE guild_id = ? AND parent_id IS NOT NULL",
            (guild_id,))]

    def channel_ids_named(self, name: str, guild_id: int | None = None) -> list[int]:
        """Return the ids of stored channels called ``name``, case ignored as Unicode does.

        Compared here, not in SQL: SQLite's ``lower()`` folds only ASCII, PostgreSQL's
        folds by the database's locale, and a guild has at most a few thousand channels.
        """
        sql = "SELECT id, name FROM channels"
        params: list[Any] = []
        if guild_id is not None:
            sql += " WHERE guild_id = ?"
            params.append(guild_id)
        wanted = name.casefold()
        return [row[0] for row in self._read(sql + " ORDER BY id", params)
                if row[1] is not None and row[1].casefold() == wanted]

    def guild_stats(
        self, guild_id: int, author_id: int | None = None, channel_ids: Iterable[int] | None = None
    ) -> GuildStats:
        """Counts for one guild only (and one member in it), optionally only in ``channel_ids``."""
        where = "guild_id = ?"
        params: list[Any] = [guild_id]
        if channel_ids is not None:
            where += f" AND {self._dialect.in_ids('channel_id')}"
            params.append(self._dialect.ids(channel_ids))
        messages, channels, pending = self._read(
            "SELECT count(*), count(DISTINCT channel_id), count(*) FILTER (WHERE NOT embedded) "
            f"FROM messages WHERE {where}", params)[0]
        mine = 0
        if author_id is not None:
            mine = self._read("SELECT count(*) FROM messages WHERE guild_id = ? AND author_id = ?",
                              (guild_id, author_id))[0][0]
        return GuildStats(int(messages), int(channels), int(mine), int(pending))

    def table_counts(self) -> dict[str, int]:
        """Rows in ``guilds``, ``channels``, ``authors`` and ``messages`` (for ``stats``)."""
        row = self._read("SELECT (SELECT count(*) FROM guilds), (SELECT count(*) FROM channels), "
                         "(SELECT count(*) FROM authors), (SELECT count(*) FROM messages)")[0]
        return dict(zip(("guilds", "channels", "authors", "messages"), (int(v) for v in row)))

    # -- reconciling with what Discord says exists (cogs.reconcile) ----------------------

    def known_guild_ids(self) -> list[int]:
        """Every guild something is stored for: messages, channels or settings, ascending.

        Opt-outs do not count: they outlive the guild (:meth:`.Forgetting.forget_guild`).
        """
        return [row[0] for row in self._read(
            "SELECT id FROM guilds UNION SELECT guild_id FROM channels "
            "UNION SELECT guild_id FROM guild_settings ORDER BY 1")]

    def channels_with_messages(self, guild_id: int) -> list[tuple[int, int | None]]:
        """``(channel_id, parent_id)`` of a guild's channels and threads that hold messages."""
        return [(row[0], row[1]) for row in self._read(
            "SELECT c.id, c.parent_id FROM channels c WHERE c.guild_id = ? AND EXISTS "
            "(SELECT 1 FROM messages m WHERE m.channel_id = c.id) ORDER BY c.id", (guild_id,))]

    def recent_floor(self, channel_id: int, below_id: int, count: int) -> int | None:
        """The oldest of a channel's ``count`` newest stored messages below ``below_id``."""
        return self._read(
            "SELECT min(id) FROM (SELECT id FROM messages WHERE channel_id = ? AND id < ? "
            "ORDER BY id DESC LIMIT ?) s", (channel_id, below_id, max(0, count)))[0][0]

    def ids_between(self, channel_id: int, low: int, high: int) -> list[int]:
        """Stored message ids of a channel with ``low <= id < high``, oldest first."""
        return [row[0] for row in self._read(
            "SELECT id FROM messages WHERE channel_id = ? AND id >= ? AND id < ? ORDER BY id",
            (channel_id, low, high))]
