"""What each guild chose, and how far the bot's walks through its channels got, on
PostgreSQL: settings, opt-outs, retention, backfill and reconcile cursors.

A settings change holds the guild's write lock, so an upsert running beside it in
another process either sees the new rules or committed before them (never stores a
member's message after their opt-out has committed).  Every change also moves the
database's settings version (a ``meta`` row, :meth:`PostgresGuilds.settings_version`)
as the last statement of its transaction, so other processes tell that something
changed by one read.
"""

from __future__ import annotations

from collections.abc import Iterable
from typing import Any

from memory.errors import SettingsError
from memory.retention import retention_now
from memory.settings import AUTORESPONSE_MODES, CHANNEL_MODES, GuildSettings
from memory.storage.contract import BackfillCursor, ReconcileCursor
from memory.storage.postgres.database import DAY_MS, PostgresDatabase, lock_guilds

SETTINGS_VERSION = "settings_version"  # meta: moved by every settings or opt-out change


def settings_changed(conn: Any) -> None:
    """Move the database's settings version inside the caller's transaction.

    Run it last: the ``meta`` row stays locked until the commit, so a transaction
    that then waited for a guild's lock could deadlock with one holding that lock.
    """
    conn.execute("INSERT INTO meta(key, value) VALUES (%s, '1') ON CONFLICT (key) "
                 "DO UPDATE SET value = (meta.value::bigint + 1)::text", (SETTINGS_VERSION,))


_LISTS = {
    "add_channel": ("channel_rules", "channel_id"),
    "remove_channel": ("channel_rules", "channel_id"),
    "opt_out": ("member_optouts", "author_id"),
    "opt_in": ("member_optouts", "author_id"),
}


class PostgresGuilds:
    """The contract's ``Guilds`` on PostgreSQL."""

    def __init__(self, database: PostgresDatabase) -> None:
        self._db = database

    def settings(self, guild_id: int) -> GuildSettings:
        """A guild's settings (defaults when it never changed any)."""
        row = self._db.read("SELECT channel_mode, retention_days, autoresponse FROM guild_settings "
                            "WHERE guild_id = %s", (guild_id,))
        mode, retention, autoresponse = row[0] if row else ("all", None, "mention")
        lists = self._db.read(
            "SELECT 'channels', channel_id FROM channel_rules WHERE guild_id = %(g)s UNION ALL "
            "SELECT 'autoresponse', channel_id FROM autoresponse_channels WHERE guild_id = %(g)s "
            "UNION ALL SELECT 'optouts', author_id FROM member_optouts WHERE guild_id = %(g)s",
            {"g": guild_id})

        def ids(kind: str) -> frozenset[int]:
            return frozenset(value for name, value in lists if name == kind)

        return GuildSettings(
            guild_id=guild_id, channel_mode=mode, channels=ids("channels"),
            retention_days=retention, autoresponse=autoresponse,
            autoresponse_channels=ids("autoresponse"), opted_out=ids("optouts"),
        )

    def settings_version(self) -> int:
        """A number that moves with every settings or opt-out change (0: none yet)."""
        rows = self._db.read("SELECT value FROM meta WHERE key = %s", (SETTINGS_VERSION,))
        return int(rows[0][0]) if rows else 0

    def update_settings(self, guild_id: int, **changes: Any) -> GuildSettings:
        """Change a guild's settings in one transaction; returns them as they are now.

        Raises:
            SettingsError: An unknown setting or value (nothing is changed).
        """
        with self._db.write() as conn:
            lock_guilds(conn, [guild_id])
            conn.execute("INSERT INTO guild_settings(guild_id) VALUES (%s) ON CONFLICT DO NOTHING",
                         (guild_id,))
            for key, value in changes.items():
                if value is None and key != "retention_days":
                    continue
                _apply(conn, guild_id, key, value)
            conn.execute("UPDATE guild_settings SET version = version + 1 WHERE guild_id = %s",
                         (guild_id,))
            settings_changed(conn)
        return self.settings(guild_id)

    def retention_cutoffs(self, guild_ids: Iterable[int] | None = None, *,
                          seen_ms: int | None = None) -> dict[int, int]:
        """The oldest creation time (unix ms) each guild with a retention period keeps,
        counted from :meth:`retention_clock`."""
        sql = "SELECT guild_id, retention_days FROM guild_settings WHERE retention_days IS NOT NULL"
        params: list[Any] = []
        if guild_ids is not None:
            sql += " AND guild_id = ANY(%s::bigint[])"
            params.append(sorted({int(g) for g in guild_ids}))
        rows = self._db.read(sql, params)
        if not rows:
            return {}
        now = self.retention_clock(seen_ms)
        return {guild: now - int(days) * DAY_MS for guild, days in rows}

    def retention_clock(self, seen_ms: int | None = None) -> int:
        """The time retention counts from (:func:`memory.retention.retention_now`): the
        host clock, unless it runs far past the newest stored message and ``seen_ms``."""
        newest = self._db.read("SELECT max((SELECT max(created_at) FROM messages "
                               "WHERE guild_id = g.id)) FROM guilds g")[0][0]
        return retention_now(None if newest is None else int(newest), seen_ms)

    def backfill_cursor(self, channel_id: int) -> BackfillCursor | None:
        """How far a backfill of this channel got, or ``None`` if none started."""
        rows = self._db.read("SELECT before_id, complete FROM backfill_cursors WHERE channel_id = %s",
                             (channel_id,))
        return BackfillCursor(rows[0][0], bool(rows[0][1])) if rows else None

    def save_backfill_cursor(
        self, guild_id: int, channel_id: int, before_id: int | None, *, complete: bool = False
    ) -> None:
        """Record that a backfill has read this channel back to ``before_id`` (or to its start)."""
        with self._db.write() as conn:
            conn.execute(
                "INSERT INTO backfill_cursors AS b(channel_id, guild_id, before_id, complete) "
                "VALUES (%s, %s, %s, %s) ON CONFLICT (channel_id) DO UPDATE SET "
                "before_id = COALESCE(excluded.before_id, b.before_id), complete = excluded.complete",
                (channel_id, guild_id, before_id, complete))

    # -- messages heard but not stored before a stop (the start-up catch-up reads them) ----

    def mark_missed(self, marks: Iterable[tuple[int, int, int]]) -> None:
        """Record messages the bot heard but could not store, as ``(guild_id, channel_id,
        message_id)``: the start-up catch-up reads each channel from before them."""
        marks = sorted({(int(g), int(c), int(m)) for g, c, m in marks})
        if not marks:
            return
        with self._db.write() as conn:
            conn.cursor().executemany(
                "INSERT INTO missed_messages(guild_id, channel_id, message_id) VALUES (%s, %s, %s) "
                "ON CONFLICT (channel_id, message_id) DO NOTHING", marks)

    def missed(self) -> dict[int, list[int]]:
        """The missed messages' ids by channel, oldest first (see :meth:`mark_missed`)."""
        out: dict[int, list[int]] = {}
        for channel_id, message_id in self._db.read(
                "SELECT channel_id, message_id FROM missed_messages ORDER BY channel_id, message_id"):
            out.setdefault(channel_id, []).append(message_id)
        return out

    def clear_missed(self, channel_id: int, message_ids: Iterable[int]) -> None:
        """Drop these marks of a channel: the catch-up has read past them."""
        with self._db.write() as conn:
            conn.execute("DELETE FROM missed_messages WHERE channel_id = %s AND message_id = "
                         "ANY(%s::bigint[])", (channel_id, sorted({int(i) for i in message_ids})))

    def reconcile_run(self, guild_id: int) -> int | None:
        """A guild's unfinished reconcile run (its start, unix ms), or ``None``."""
        rows = self._db.read("SELECT run_id FROM reconcile_runs WHERE guild_id = %s", (guild_id,))
        return rows[0][0] if rows else None

    def begin_reconcile_run(self, guild_id: int, run_id: int) -> None:
        """Start a guild's reconcile run; what an earlier run saved is dropped."""
        with self._db.write() as conn:
            conn.execute("DELETE FROM reconcile_cursors WHERE guild_id = %s", (guild_id,))
            conn.execute("INSERT INTO reconcile_runs(guild_id, run_id) VALUES (%s, %s) "
                         "ON CONFLICT (guild_id) DO UPDATE SET run_id = excluded.run_id",
                         (guild_id, run_id))

    def end_reconcile_run(self, guild_id: int) -> None:
        """Mark a guild's reconcile run finished: the next one starts from scratch."""
        with self._db.write() as conn:
            conn.execute("DELETE FROM reconcile_cursors WHERE guild_id = %s", (guild_id,))
            conn.execute("DELETE FROM reconcile_runs WHERE guild_id = %s", (guild_id,))

    def reconcile_cursor(self, channel_id: int) -> ReconcileCursor | None:
        """Where the current reconcile run got to in a channel, ``None`` if not there yet."""
        rows = self._db.read("SELECT run_id, before_id, complete FROM reconcile_cursors "
                             "WHERE channel_id = %s", (channel_id,))
        return ReconcileCursor(rows[0][0], rows[0][1], bool(rows[0][2])) if rows else None

    def save_reconcile_cursor(
        self, guild_id: int, channel_id: int, run_id: int, before_id: int | None,
        *, complete: bool = False,
    ) -> None:
        """Record a reconcile run's progress in a channel."""
        with self._db.write() as conn:
            conn.execute(
                "INSERT INTO reconcile_cursors AS r(channel_id, guild_id, run_id, before_id, "
                "complete) VALUES (%s, %s, %s, %s, %s) ON CONFLICT (channel_id) DO UPDATE SET "
                "run_id = excluded.run_id, before_id = COALESCE(excluded.before_id, r.before_id), "
                "complete = excluded.complete",
                (channel_id, guild_id, run_id, before_id, complete))


def _apply(conn: Any, guild_id: int, key: str, value: Any) -> None:
    """One settings change inside the caller's transaction."""
    columns = {"channel_mode": CHANNEL_MODES, "autoresponse": AUTORESPONSE_MODES}
    if key in columns:
        if value not in columns[key]:
            raise SettingsError(f"{key} must be one of {', '.join(columns[key])}")
        conn.execute(f"UPDATE guild_settings SET {key} = %s WHERE guild_id = %s", (value, guild_id))
    elif key == "retention_days":
        if value is not None and int(value) <= 0:
            raise SettingsError("retention must be a positive number of days")
        conn.execute("UPDATE guild_settings SET retention_days = %s WHERE guild_id = %s",
                     (None if value is None else int(value), guild_id))
    elif key in ("add_channel", "opt_out"):
        table, column = _LISTS[key]
        conn.execute(f"INSERT INTO {table}(guild_id, {column}) VALUES (%s, %s) ON CONFLICT DO NOTHING",
                     (guild_id, int(value)))
        if key == "opt_out":  # the names they have here go with them (not other guilds')
            conn.execute("DELETE FROM member_names WHERE guild_id = %s AND author_id = %s",
                         (guild_id, int(value)))
    elif key in ("remove_channel", "opt_in"):
        table, column = _LISTS[key]
        conn.execute(f"DELETE FROM {table} WHERE guild_id = %s AND {column} = %s",
                     (guild_id, int(value)))
    elif key == "toggle_autoresponse_channel":
        if not conn.execute("DELETE FROM autoresponse_channels WHERE guild_id = %s AND channel_id = %s",
                            (guild_id, int(value))).rowcount:
            conn.execute("INSERT INTO autoresponse_channels VALUES (%s, %s)", (guild_id, int(value)))
    else:
        raise SettingsError(f"unknown setting {key!r}")
