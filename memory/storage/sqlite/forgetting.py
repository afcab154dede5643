"""Every deletion: messages leave the table, the keyword index, the vectors and their
neighbours' windows, for good.

Each forgotten id gets a tombstone, so a late insert (a gateway event racing the
delete, a backfill page, a re-import of an old export) cannot bring the message back
(:meth:`SQLiteForgetting.tombstoned`, read by every upsert).  A message is embedded
with its antecedent (the message it replies to, or the one before it), so the
messages whose vectors carried a forgotten or edited text go back to the backlog
(:meth:`SQLiteForgetting.edited`).  The text leaves the file too: the transaction is
marked as erasing (:meth:`.SQLiteDatabase.erased`), and a large forget rebuilds the
keyword indexes instead of erasing word by word (:func:`.scrub.erasing`).
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping, Sequence
from typing import Any

from memory.storage.forgetting import (
    drop_channel_rows,
    drop_guild_rows,
    drop_left_behind,
    drop_member_names,
    record_emptied,
)
from memory.storage.quotes import quotes_gone
from memory.storage.sqlite import windows
from memory.storage.sqlite.connection import DIALECT, IN_IDS, id_list
from memory.storage.sqlite.database import SQLiteDatabase, now_ms
from memory.storage.sqlite.vectors import Vec0Table

# what forgetting a guild removes besides its messages, channels and name
_GUILD_TABLES = ("channel_rules", "autoresponse_channels", "backfill_cursors",
                 "missed_messages", "reconcile_cursors", "reconcile_runs",
                 "guild_settings", "code_stats", "member_names",
                 # the bot left: its answers there can no longer be edited
                 "answer_quotes", "retractions")


def expand_channels(read: Any, channel_ids: Sequence[int]) -> tuple[int, ...]:
    """The channels, in order, plus every stored thread whose parent is one of them.

    Args:
        read: A locked read (:meth:`.SQLiteDatabase.read`).
        channel_ids: The channels.
    """
    threads = read(f"SELECT id FROM channels WHERE parent_id {IN_IDS}", (id_list(channel_ids),))
    return tuple(dict.fromkeys([*channel_ids, *(row[0] for row in threads)]))


class SQLiteForgetting:
    """The contract's ``Forgetting`` on one database.

    Args:
        database: The database.
        table: Its vector table (forgotten messages' vectors leave it).
    """

    def __init__(self, database: SQLiteDatabase, table: Vec0Table) -> None:
        self._db = database
        self._table = table

    def forget_messages(self, ids: Iterable[int]) -> int:
        """Remove messages from the table, the keyword index and the vectors, for good.

        Each id gets a tombstone; messages whose vectors carried its text as their
        antecedent are re-embedded.

        Returns:
            How many messages existed and were removed.
        """
        ids = sorted(set(ids))
        if not ids:
            return 0
        with self._db.write() as conn, self._db.erasing(conn, len(ids)):
            return self.forget_in(conn, ids)

    def forget_emptied(self, edits: Mapping[int, int]) -> int:
        """Forget messages an edit emptied, recording when (:meth:`.Forgetting.forget_emptied`)."""
        if not edits:
            return 0
        with self._db.write() as conn, self._db.erasing(conn, len(edits)):
            return self.forget_in(conn, record_emptied(conn, DIALECT, edits), tombstone=False)

    def forget_channels(self, channel_ids: Iterable[int]) -> int:
        """Forget every message in these channels and in their threads, their backfill
        progress and their rows (names).

        Returns:
            How many messages were removed.
        """
        channel_ids = list(channel_ids)
        if not channel_ids:
            return 0
        places = list(expand_channels(self._db.read, channel_ids))
        removed = self._forget_where(f"channel_id {IN_IDS}", (id_list(places),))
        with self._db.write() as conn:
            self._db.erased()  # the channels' and threads' names go too
            drop_channel_rows(conn, DIALECT, places)
        return removed

    def forget_guild(self, guild_id: int) -> int:
        """Forget a guild entirely: messages, channels, members' names there, settings,
        cursors; its opt-outs stay (:meth:`.Forgetting.forget_guild`)."""
        removed = self._forget_where("guild_id = ?", (guild_id,))
        with self._db.write() as conn:
            self._db.erased()  # the guild's, its channels' and its members' names go too
            drop_guild_rows(conn, DIALECT, guild_id, _GUILD_TABLES)
        return removed

    def forget_member(self, guild_id: int, author_id: int) -> int:
        """Forget a member in one guild: their messages, their name, their future messages.

        In one transaction the member is opted out of the guild (so no later
        write, whichever path brings it, stores them there again until they opt
        in), their messages there are deleted and tombstoned, and the names they
        have in that guild go (those they have in other guilds stay); their
        ``authors`` row goes once no guild holds a message or a name of theirs.

        Returns:
            How many messages were removed.
        """
        with self._db.write() as conn:
            conn.execute("INSERT OR IGNORE INTO member_optouts(guild_id, author_id) VALUES (?, ?)",
                         (guild_id, author_id))
            ids = [row[0] for row in conn.execute(
                "SELECT id FROM messages WHERE guild_id = ? AND author_id = ?", (guild_id, author_id))]
            with self._db.erasing(conn, len(ids)):  # a prolific member: rebuilt, not word by word
                removed = self.forget_in(conn, ids)
            self._db.erased()  # their name leaves the file too
            drop_member_names(conn, DIALECT, guild_id, author_id)
        return removed

    def forget_older_than(self, guild_id: int, cutoff_ms: int) -> int:
        """Forget a guild's messages created before ``cutoff_ms`` (unix milliseconds)."""
        return self._forget_where("guild_id = ? AND created_at < ?", (guild_id, cutoff_ms))

    # -- inside another noun's transaction (package-internal) ------------------------------

    def forget_in(self, conn: Any, ids: Sequence[int], *, tombstone: bool = True) -> int:
        """Delete ``ids`` everywhere inside the caller's transaction; tombstone them
        (unless ``tombstone`` is false).

        Returns:
            How many of them were stored.
        """
        if not ids:
            return 0
        self._db.erased()
        if tombstone:
            now = now_ms()
            conn.executemany(
                "INSERT OR IGNORE INTO tombstones(message_id, deleted_at) VALUES (?, ?)",
                [(i, now) for i in ids],
            )
        self._reembed_dependants(conn, ids)
        quotes_gone(conn, DIALECT, ids)  # the public answers quoting them are taken down
        rows = conn.execute(
            f"SELECT channel_id, id, guild_id, author_id FROM messages WHERE id {IN_IDS}",
            (id_list(ids),)).fetchall()
        removed = conn.execute(f"DELETE FROM messages WHERE id {IN_IDS}", (id_list(ids),)).rowcount
        self._table.delete(conn, ids)  # after the rows: no window vector is made for them
        # their rows go; neighbours' windows lose their text
        windows.reindex(conn, [(row[0], row[1]) for row in rows])
        drop_left_behind(conn, DIALECT, [(row[0], row[2], row[3]) for row in rows])
        return removed

    def edited(self, conn: Any, ids: Sequence[int]) -> None:
        """Messages whose text changed: their old text leaves the vectors and the file.

        Inside the caller's transaction (an upsert's): their own vectors and those of
        the messages that carried their old text as antecedent go (all of them wait
        in the backlog again), the public answers quoting the old text are due to be
        taken down, and the write-ahead log is emptied after the commit.
        """
        self._db.erased()  # the author removed the old text: it leaves the file too
        self._table.delete(conn, ids)
        self._reembed_dependants(conn, ids)
        quotes_gone(conn, DIALECT, ids)

    def tombstoned(self, ids: Iterable[int]) -> set[int]:
        """Those of ``ids`` forgotten before (an upsert leaves them out)."""
        return {row[0] for row in self._db.read(
            f"SELECT message_id FROM tombstones WHERE message_id {IN_IDS}", (id_list(ids),))}

    def inserted(self, conn: Any, ids: Sequence[int]) -> None:
        """Messages just stored: the message after each in its channel may have been
        embedded with the one before it as antecedent (a catch-up, backfill or import
        stored these in between later), so it goes back to the backlog and takes its
        new antecedent; otherwise deleting the old one would leave its text there."""
        batch = id_list(ids)
        successors = [row[0] for row in conn.execute(
            """SELECT n.id FROM messages n WHERE n.embedded = 1 AND n.id IN (
                   SELECT (SELECT s.id FROM messages s WHERE s.channel_id = x.channel_id
                           AND s.id > x.id ORDER BY s.id LIMIT 1)
                   FROM messages x WHERE x.id IN (SELECT value FROM json_each(?1)))""",
            (batch,),
        )]
        skip = set(ids)
        self._send_back(conn, [i for i in successors if i not in skip])

    def _reembed_dependants(self, conn: Any, ids: Sequence[int]) -> None:
        """Send back to the backlog the messages whose embedded antecedent is one of ``ids``.

        A message is embedded with the message it replies to, or else the message
        before it in its channel (:meth:`.SQLiteBacklog.pending`); when that one is
        edited or deleted, the old text must not live on inside its neighbour's vector.
        """
        batch = id_list(ids)
        dependants = [row[0] for row in conn.execute(
            """SELECT id FROM messages WHERE reply_to_id IN (SELECT value FROM json_each(?1))
               UNION
               SELECT (SELECT n.id FROM messages n WHERE n.channel_id = x.channel_id AND n.id > x.id
                       ORDER BY n.id LIMIT 1)
               FROM messages x WHERE x.id IN (SELECT value FROM json_each(?1))""",
            (batch,),
        ) if row[0] is not None]
        self._send_back(conn, [i for i in dependants if i not in set(ids)])

    def _send_back(self, conn: Any, ids: Sequence[int]) -> None:
        """Drop the vectors of ``ids``: they wait in the backlog to be embedded again."""
        if ids:
            conn.execute(f"UPDATE messages SET embedded = 0 WHERE id {IN_IDS}", (id_list(ids),))
            self._table.delete(conn, ids)

    def _forget_where(self, where: str, params: Sequence[Any]) -> int:
        """Forget every message matching a WHERE clause over ``messages``."""
        with self._db.write() as conn:
            ids = [row[0] for row in conn.execute(f"SELECT id FROM messages WHERE {where}", params)]
            with self._db.erasing(conn, len(ids)):
                return self.forget_in(conn, ids)
