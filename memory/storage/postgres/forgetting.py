"""Every deletion on PostgreSQL: messages leave the table, the keyword documents, the
vectors and their neighbours' windows, for good (tombstoned), in one transaction each.

Each ``forget_*`` holds the write locks of the guilds it touches
(:func:`.database.lock_guilds`); :meth:`PostgresForgetting.forget_messages` first
holds the ids themselves (:func:`.database.lock_ids`), so an upsert of the same ids
running in another process either committed before the forget (and its rows are
deleted) or waits for it (and finds the tombstones).

Deleted text leaves what any query can read at once.  On disk, PostgreSQL keeps a
deleted row's bytes until VACUUM reclaims the page and a later write reuses it, and
in the write-ahead log until its segment is recycled (and in backups and replicas
for as long as those keep them): docs/privacy.md, "On PostgreSQL", says what to run.
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
from memory.storage.postgres import vectors, windows
from memory.storage.postgres.connection import DIALECT
from memory.storage.postgres.database import (
    PostgresDatabase,
    lock_guilds,
    lock_ids,
    now_ms,
    unlock_ids,
)
from memory.storage.quotes import quotes_gone

_GUILD_TABLES = ("channel_rules", "autoresponse_channels", "backfill_cursors",
                 "missed_messages",
                 "reconcile_cursors", "reconcile_runs", "guild_settings", "index_stats",
                 "member_names",
                 # the bot left: its answers there can no longer be edited
                 "answer_quotes", "retractions")


def expand_channels(conn: Any, channel_ids: Sequence[int]) -> tuple[int, ...]:
    """The channels, in order, plus every stored thread whose parent is one of them."""
    threads = conn.execute("SELECT id FROM channels WHERE parent_id = ANY(%s)",
                           (list(channel_ids),)).fetchall()
    return tuple(dict.fromkeys([*channel_ids, *(row[0] for row in threads)]))


class PostgresForgetting:
    """The contract's ``Forgetting`` on PostgreSQL."""

    def __init__(self, database: PostgresDatabase) -> None:
        self._db = database

    def forget_messages(self, ids: Iterable[int]) -> int:
        """Forget these messages; ids never stored are tombstoned too.

        Returns:
            How many messages existed and were removed.
        """
        return self._forget_ids(sorted({int(i) for i in ids}), None)

    def forget_emptied(self, edits: Mapping[int, int]) -> int:
        """Forget messages an edit emptied, recording when (:meth:`.Forgetting.forget_emptied`)."""
        return self._forget_ids(sorted(edits), edits)

    def _forget_ids(self, wanted: list[int], emptied: Mapping[int, int] | None) -> int:
        """Forget ``wanted``: tombstoned, or (``emptied``) recorded as emptied at a time."""
        if not wanted:
            return 0
        with self._db.write() as conn:
            held = lock_ids(conn, wanted)
            lock_guilds(conn, [row[0] for row in conn.execute(
                "SELECT DISTINCT guild_id FROM messages WHERE id = ANY(%s)", (held,))])
            if emptied is not None:
                held = record_emptied(conn, DIALECT, emptied)
            removed = self.forget_in(conn, held, tombstone=emptied is None)
            unlock_ids(conn, wanted)
        return removed

    def forget_channels(self, channel_ids: Iterable[int]) -> int:
        """Forget every message in these channels and in their threads, their backfill
        progress and their rows (names)."""
        channel_ids = list(channel_ids)
        if not channel_ids:
            return 0
        with self._db.write() as conn:
            lock_guilds(conn, [row[0] for row in conn.execute(
                "SELECT DISTINCT guild_id FROM channels WHERE id = ANY(%s)", (channel_ids,))])
            places = list(expand_channels(conn, channel_ids))
            removed = self._forget_where(conn, "channel_id = ANY(%s)", (places,))
            drop_channel_rows(conn, DIALECT, places)
        return removed

    def forget_guild(self, guild_id: int) -> int:
        """Forget a guild entirely: messages, channels, names (its members' too), settings,
        cursors; its opt-outs stay (:meth:`.Forgetting.forget_guild`)."""
        with self._db.write() as conn:
            lock_guilds(conn, [guild_id])
            removed = self._forget_where(conn, "guild_id = %s", (guild_id,))
            drop_guild_rows(conn, DIALECT, guild_id, _GUILD_TABLES)
        return removed

    def forget_member(self, guild_id: int, author_id: int) -> int:
        """Forget a member in one guild: their messages, their names there (not those
        they have in other guilds), their future messages.

        Returns:
            How many messages were removed.
        """
        with self._db.write() as conn:
            lock_guilds(conn, [guild_id])
            conn.execute("INSERT INTO member_optouts(guild_id, author_id) VALUES (%s, %s) "
                         "ON CONFLICT DO NOTHING", (guild_id, author_id))
            conn.execute("INSERT INTO guild_settings(guild_id) VALUES (%s) ON CONFLICT (guild_id) "
                         "DO UPDATE SET version = guild_settings.version + 1", (guild_id,))
            removed = self._forget_where(conn, "guild_id = %s AND author_id = %s",
                                         (guild_id, author_id))
            drop_member_names(conn, DIALECT, guild_id, author_id)
        return removed

    def forget_older_than(self, guild_id: int, cutoff_ms: int) -> int:
        """Forget a guild's messages created before ``cutoff_ms`` (unix milliseconds)."""
        with self._db.write() as conn:
            lock_guilds(conn, [guild_id])
            return self._forget_where(conn, "guild_id = %s AND created_at < %s",
                                      (guild_id, cutoff_ms))

    # -- inside another noun's transaction (package-internal) ------------------------------

    def forget_in(self, conn: Any, ids: Sequence[int], *, tombstone: bool = True) -> int:
        """Delete ``ids`` everywhere inside the caller's transaction; tombstone them
        (unless ``tombstone`` is false).

        The caller holds the write locks of the guilds the stored ones belong to.

        Returns:
            How many of them were stored.
        """
        if not ids:
            return 0
        ids = sorted(set(ids))
        if tombstone:
            conn.execute("INSERT INTO tombstones(message_id, deleted_at) "
                         "SELECT unnest(%s::bigint[]), %s ON CONFLICT DO NOTHING",
                         (ids, now_ms()))
        self._reembed_dependants(conn, ids)
        quotes_gone(conn, DIALECT, ids)  # the public answers quoting them are taken down
        rows = conn.execute("DELETE FROM messages WHERE id = ANY(%s) "
                            "RETURNING channel_id, id, guild_id, author_id", (ids,)).fetchall()
        conn.execute("DELETE FROM embedding_claims WHERE message_id = ANY(%s)", (ids,))
        vectors.delete(conn, ids)  # after the rows: no window vector is made for them
        # their rows go; neighbours' windows lose their text
        windows.reindex(conn, [(row[0], row[1]) for row in rows])
        drop_left_behind(conn, DIALECT, [(row[0], row[2], row[3]) for row in rows])
        return len(rows)

    def edited(self, conn: Any, ids: Sequence[int]) -> None:
        """Messages whose text changed: their vectors, and those of the messages that
        carried their old text as antecedent, go (all of them wait in the backlog); the
        public answers quoting the old text are due to be taken down."""
        vectors.delete(conn, ids)
        self._reembed_dependants(conn, ids)
        quotes_gone(conn, DIALECT, ids)

    def inserted(self, conn: Any, ids: Sequence[int]) -> None:
        """Messages just stored: the message after each in its channel, embedded with the
        one before it, goes back to the backlog to take its new antecedent."""
        successors = [row[0] for row in conn.execute(
            """SELECT n.id FROM messages n WHERE n.embedded AND n.id IN (
                   SELECT (SELECT s.id FROM messages s WHERE s.channel_id = x.channel_id
                           AND s.id > x.id ORDER BY s.id LIMIT 1)
                   FROM messages x WHERE x.id = ANY(%(ids)s))""",
            {"ids": list(ids)},
        )]
        skip = set(ids)
        self._send_back(conn, sorted(i for i in successors if i not in skip))

    def _reembed_dependants(self, conn: Any, ids: Sequence[int]) -> None:
        """Send back to the backlog the messages whose embedded antecedent is one of ``ids``."""
        dependants = [row[0] for row in conn.execute(
            """SELECT id FROM messages WHERE reply_to_id = ANY(%(ids)s)
               UNION
               SELECT (SELECT n.id FROM messages n WHERE n.channel_id = x.channel_id AND n.id > x.id
                       ORDER BY n.id LIMIT 1)
               FROM messages x WHERE x.id = ANY(%(ids)s)""",
            {"ids": list(ids)},
        ) if row[0] is not None]
        skip = set(ids)
        self._send_back(conn, sorted(i for i in dependants if i not in skip))

    @staticmethod
    def _send_back(conn: Any, ids: list[int]) -> None:
        """Drop the vectors of ``ids``: they wait in the backlog to be embedded again."""
        if ids:
            conn.execute("UPDATE messages SET embedded = false WHERE id = ANY(%s)", (ids,))
            vectors.delete(conn, ids)

    def _forget_where(self, conn: Any, where: str, params: Sequence[Any]) -> int:
        """Forget every message matching a WHERE clause over ``messages``."""
        ids = [row[0] for row in conn.execute(f"SELECT id FROM messages WHERE {where}", params)]
        return self.forget_in(conn, ids)
