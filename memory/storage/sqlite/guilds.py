"""What each guild chose, and how far the bot's walks through its channels got.

Settings (``guild_settings``, ``channel_rules``, ``autoresponse_channels``), the
members who opted out (``member_optouts``), the retention periods that
:meth:`SQLiteGuilds.retention_cutoffs` turns into cut-off times, and the cursors of
the backfill (``backfill_cursors``) and of the reconcile with Discord
(``reconcile_runs``, ``reconcile_cursors``).
"""

from __future__ import annotations

from collections.abc import Iterable
from typing import Any

from memory.errors import SettingsError
from memory.retention import retention_now
from memory.settings import AUTORESPONSE_MODES, CHANNEL_MODES, GuildSettings
from memory.storage.contract import BackfillCursor, ReconcileCursor
from memory.storage.sqlite.connection import IN_IDS, id_list
from memory.storage.sqlite.database import DAY_MS, SQLiteDatabase

_LISTS = {
    "add_channel": ("channel_rules", "channel_id"),
    "remove_channel": ("channel_rules", "channel_id"),
    "opt_out": ("member_optouts", "author_id"),
    "opt_in": ("member_optouts", "author_id"),
}
_COLUMNS = {"channel_mode": CHANNEL_MODES, "autoresponse": AUTORESPONSE_MODES}
SETTINGS_VERSION = "settings_version"  # meta: moved by every settings or opt-out change


def settings_changed(conn: Any) -> None:
    """Move the database's settings version inside the caller's (write) transaction."""
    conn.execute("INSERT INTO meta(key, value) VALUES (?, '1') ON CONFLICT(key) "
                 "DO UPDATE SET value = CAST(value AS INTEGER) + 1", (SETTINGS_VERSION,))


class SQLiteGuilds:
    """The contract's ``Guilds`` on one database."""

    def __init__(self, database: SQLiteDatabase) -> None:
        self._db = database

    # -- settings -----------------------------------------------------------------------

    def settings(self, guild_id: int) -> GuildSettings:
        """A guild's settings (defaults when it never changed any)."""
        row = self._db.read(
            "SELECT channel_mode, retention_days, autoresponse FROM guild_settings "
            "WHERE guild_id = ?", (guild_id,),
        )
        mode, retention, autoresponse = row[0] if row else ("all", None, "mention")

        def ids(table: str, column: str) -> frozenset[int]:
            return frozenset(r[0] for r in self._db.read(
                f"SELECT {column} FROM {table} WHERE guild_id = ?", (guild_id,)))

        return GuildSettings(
            guild_id=guild_id, channel_mode=mode, channels=ids("channel_rules", "channel_id"),
            retention_days=retention, autoresponse=autoresponse,
            autoresponse_channels=ids("autoresponse_channels", "channel_id"),
            opted_out=ids("member_optouts", "author_id"),
        )

    def settings_version(self) -> int:
        """A number that moves with every settings or opt-out change (0: none yet)."""
        rows = self._db.read("SELECT value FROM meta WHERE key = ?", (SETTINGS_VERSION,))
        return int(rows[0][0]) if rows else 0

    def update_settings(self, guild_id: int, **changes: Any) -> GuildSettings:
        """Change a guild's settings; returns them as they are now.

        Keywords: ``channel_mode``, ``retention_days`` (``None`` = keep), ``autoresponse``,
        ``add_channel`` / ``remove_channel`` (the channel list), ``toggle_autoresponse_channel``,
        ``opt_out`` / ``opt_in`` (a member id).

        Raises:
            SettingsError: An unknown setting or value.
        """
        with self._db.write() as conn:
            conn.execute("INSERT OR IGNORE INTO guild_settings(guild_id) VALUES (?)", (guild_id,))
            for key, value in changes.items():
                if value is None and key != "retention_days":
                    continue
                _apply_setting(conn, guild_id, key, value)
            settings_changed(conn)
        return self.settings(guild_id)

    def retention_cutoffs(self, guild_ids: Iterable[int] | None = None, *,
                          seen_ms: int | None = None) -> dict[int, int]:
        """The oldest creation time (unix ms) each guild with a retention period keeps.

        Args:
            guild_ids: Only these guilds; ``None``: every guild that set a period.
            seen_ms: The newest creation time of the messages being stored (it
                vouches for Discord's clock: :func:`memory.retention.retention_now`).

        Returns:
            ``{guild_id: cutoff_ms}``; a guild that keeps everything is absent.
        """
        sql = "SELECT guild_id, retention_days FROM guild_settings WHERE retention_days IS NOT NULL"
        params: list[Any] = []
        if guild_ids is not None:
            sql += f" AND guild_id {IN_IDS}"
            params.append(id_list(guild_ids))
        rows = self._db.read(sql, params)
        if not rows:
            return {}
        now = self.retention_clock(seen_ms)
        return {guild: now - days * DAY_MS for guild, days in rows}

    def retention_clock(self, seen_ms: int | None = None) -> int:
        """The time retention counts from (:func:`memory.retention.retention_now`): the
        host clock, unless it runs far past the newest stored message and ``seen_ms``."""
        newest = self._db.read("SELECT max((SELECT max(created_at) FROM messages "
                               "WHERE guild_id = g.id)) FROM guilds g")[0][0]
        return retention_now(newest, seen_ms)

    def opted_out(self) -> set[tuple[int, int]]:
        """``(guild_id, author_id)`` of every member who opted out of a guild.

        Package-internal: an upsert reads it inside its write transaction.
        """
        return {(row[0], row[1]) for row in self._db.read(
            "SELECT guild_id, author_id FROM member_optouts")}

    # -- backfill ----------------------------------------------------------------------------

    def backfill_cursor(self, channel_id: int) -> BackfillCursor | None:
        """How far a backfill of this channel got, or ``None`` if none started."""
        rows = self._db.read(
            "SELECT before_id, complete FROM backfill_cursors WHERE channel_id = ?", (channel_id,))
        return BackfillCursor(rows[0][0], bool(rows[0][1])) if rows else None

    def save_backfill_cursor(
        self, guild_id: int, channel_id: int, before_id: int | None, *, complete: bool = False
    ) -> None:
        """Record that a backfill has read this channel back to ``before_id`` (or to its start)."""
        with self._db.write() as conn:
            conn.execute(
                "INSERT INTO backfill_cursors(channel_id, guild_id, before_id, complete) "
                "VALUES (?, ?, ?, ?) ON CONFLICT(channel_id) DO UPDATE SET "
                "before_id = COALESCE(excluded.before_id, before_id), complete = excluded.complete",
                (channel_id, guild_id, before_id, int(complete)),
            )

    # -- reconciling with what Discord says exists (cogs.reconcile) ----------------------

    # -- messages heard but not stored before a stop (the start-up catch-up reads them) ----

    def mark_missed(self, marks: Iterable[tuple[int, int, int]]) -> None:
        """Record messages the bot heard but could not store, as ``(guild_id, channel_id,
        message_id)``: the start-up catch-up reads each channel from before them."""
        marks = sorted({(int(g), int(c), int(m)) for g, c, m in marks})
        if not marks:
            return
        with self._db.write() as conn:
            conn.executemany(
                "INSERT INTO missed_messages(guild_id, channel_id, message_id) VALUES (?, ?, ?) "
                "ON CONFLICT(channel_id, message_id) DO NOTHING", marks)

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
            conn.execute(f"DELETE FROM missed_messages WHERE channel_id = ? AND message_id {IN_IDS}",
                         (channel_id, id_list(message_ids)))

    def reconcile_run(self, guild_id: int) -> int | None:
        """A guild's unfinished reconcile run (its start, unix ms), or ``None``."""
        rows = self._db.read("SELECT run_id FROM reconcile_runs WHERE guild_id = ?", (guild_id,))
        return rows[0][0] if rows else None

    def begin_reconcile_run(self, guild_id: int, run_id: int) -> None:
        """Start a guild's reconcile run; what an earlier run saved is dropped."""
        with self._db.write() as conn:
            conn.execute("DELETE FROM reconcile_cursors WHERE guild_id = ?", (guild_id,))
            conn.execute("INSERT OR REPLACE INTO reconcile_runs(guild_id, run_id) VALUES (?, ?)",
                         (guild_id, run_id))

    def end_reconcile_run(self, guild_id: int) -> None:
        """Mark a guild's reconcile run finished: the next one starts from scratch."""
        with self._db.write() as conn:
            conn.execute("DELETE FROM reconcile_cursors WHERE guild_id = ?", (guild_id,))
            conn.execute("DELETE FROM reconcile_runs WHERE guild_id = ?", (guild_id,))

    def reconcile_cursor(self, channel_id: int) -> ReconcileCursor | None:
        """Where the current reconcile run got to in a channel, ``None`` if not there yet."""
        rows = self._db.read("SELECT run_id, before_id, complete FROM reconcile_cursors "
                             "WHERE channel_id = ?", (channel_id,))
        return ReconcileCursor(rows[0][0], rows[0][1], bool(rows[0][2])) if rows else None

    def save_reconcile_cursor(
        self, guild_id: int, channel_id: int, run_id: int, before_id: int | None,
        *, complete: bool = False,
    ) -> None:
        """Record a reconcile run's progress in a channel."""
        with self._db.write() as conn:
            conn.execute(
                "INSERT INTO reconcile_cursors(channel_id, guild_id, run_id, before_id, complete) "
                "VALUES (?, ?, ?, ?, ?) ON CONFLICT(channel_id) DO UPDATE SET "
                "run_id = excluded.run_id, before_id = COALESCE(excluded.before_id, before_id), "
                "complete = excluded.complete",
                (channel_id, guild_id, run_id, before_id, int(complete)),
            )


def _apply_setting(conn: Any, guild_id: int, key: str, value: Any) -> None:
    """Apply one of :meth:`SQLiteGuilds.update_settings`' keywords inside its transaction."""
    if key in _COLUMNS:
        if value not in _COLUMNS[key]:
            raise SettingsError(f"{key} must be one of {', '.join(_COLUMNS[key])}")
        conn.execute(f"UPDATE guild_settings SET {key} = ? WHERE guild_id = ?", (value, guild_id))
    elif key == "retention_days":
        if value is not None and int(value) <= 0:
            raise SettingsError("retention must be a positive number of days")
        conn.execute("UPDATE guild_settings SET retention_days = ? WHERE guild_id = ?",
                     (value, guild_id))
    elif key in ("add_channel", "opt_out"):
        table, column = _LISTS[key]
        conn.execute(f"INSERT OR IGNORE INTO {table}(guild_id, {column}) VALUES (?, ?)",
                     (guild_id, int(value)))
        if key == "opt_out":  # the names they have here go with them (not other guilds')
            conn.execute("DELETE FROM member_names WHERE guild_id = ? AND author_id = ?",
                         (guild_id, int(value)))
    elif key in ("remove_channel", "opt_in"):
        table, column = _LISTS[key]
        conn.execute(f"DELETE FROM {table} WHERE guild_id = ? AND {column} = ?",
                     (guild_id, int(value)))
    elif key == "toggle_autoresponse_channel":
        if not conn.execute(
            "DELETE FROM autoresponse_channels WHERE guild_id = ? AND channel_id = ?",
            (guild_id, int(value)),
        ).rowcount:
            conn.execute("INSERT INTO autoresponse_channels VALUES (?, ?)", (guild_id, int(value)))
    else:
        raise SettingsError(f"unknown setting {key!r}")
