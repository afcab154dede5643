"""What each guild chose, and how far the bot's walks through its channels got, on
either engine.

Settings (``guild_settings``, ``channel_rules``, ``autoresponse_channels``), the
members who opted out (``member_optouts``), the retention periods that
:meth:`BaseGuilds.retention_cutoffs` turns into cut-off times, the cursors of the
backfill (``backfill_cursors``) and of the reconcile with Discord
(``reconcile_runs``, ``reconcile_cursors``), and the messages heard but not stored
before a stop (``missed_messages``).  Every settings or opt-out change also moves the
database's settings version (a ``meta`` row) as the last statement of its
transaction, so other processes tell that something changed by one read.

The tables and their SQL are the same on both engines, so the whole noun is written
once here, over a :class:`~memory.storage.dialect.Dialect`; an engine subclasses
:class:`BaseGuilds` only to take its locks (:meth:`BaseGuilds.lock`) and count its own
versions (:meth:`BaseGuilds.changed`).
"""

from __future__ import annotations

from collections.abc import Iterable
from typing import Any

from memory.errors import SettingsError
from memory.retention import DAY_MS, retention_now
from memory.settings import AUTORESPONSE_MODES, CHANNEL_MODES, GuildSettings
from memory.storage.contract import BackfillCursor, ReconcileCursor
from memory.storage.dialect import Dialect, DialectNoun

__all__ = ["SETTINGS_VERSION", "BaseGuilds", "settings_changed"]

SETTINGS_VERSION = "settings_version"  # meta: moved by every settings or opt-out change

_LISTS = {
    "add_channel": ("channel_rules", "channel_id"),
    "remove_channel": ("channel_rules", "channel_id"),
    "opt_out": ("member_optouts", "author_id"),
    "opt_in": ("member_optouts", "author_id"),
}
_COLUMNS = {"channel_mode": CHANNEL_MODES, "autoresponse": AUTORESPONSE_MODES}


def settings_changed(conn: Any, dialect: Dialect) -> None:
    """Move the database's settings version inside the caller's write transaction.

    Run it last: on PostgreSQL the ``meta`` row stays locked until the commit, so a
    transaction that then waited for a guild's lock could deadlock with one holding it.
    """
    conn.execute(dialect.sql(
        "INSERT INTO meta(key, value) VALUES (?, '1') ON CONFLICT (key) "
        "DO UPDATE SET value = CAST(CAST(meta.value AS BIGINT) + 1 AS TEXT)"), (SETTINGS_VERSION,))


class BaseGuilds(DialectNoun):
    """The contract's ``Guilds`` over one engine's database (``read`` and ``write``)."""

    def lock(self, conn: Any, guild_id: int) -> None:
        """Inside a settings change, before it reads or writes: what keeps a concurrent
        writer in order (by default nothing: SQLite has one writer)."""

    def changed(self, conn: Any, guild_id: int) -> None:
        """Inside a settings change, once it is applied (by default nothing more)."""

    # -- settings -----------------------------------------------------------------------

    def settings(self, guild_id: int) -> GuildSettings:
        """A guild's settings (defaults when it never changed any)."""
        row = self._read("SELECT channel_mode, retention_days, autoresponse FROM guild_settings "
                         "WHERE guild_id = ?", (guild_id,))
        mode, retention, autoresponse = row[0] if row else ("all", None, "mention")
        lists = self._read(
            "SELECT 'channels', channel_id FROM channel_rules WHERE guild_id = ? UNION ALL "
            "SELECT 'autoresponse', channel_id FROM autoresponse_channels WHERE guild_id = ? "
            "UNION ALL SELECT 'optouts', author_id FROM member_optouts WHERE guild_id = ?",
            (guild_id, guild_id, guild_id))

        def ids(kind: str) -> frozenset[int]:
            return frozenset(value for name, value in lists if name == kind)

        return GuildSettings(
            guild_id=guild_id, channel_mode=mode, channels=ids("channels"),
            retention_days=retention, autoresponse=autoresponse,
            autoresponse_channels=ids("autoresponse"), opted_out=ids("optouts"),
        )

    def settings_version(self) -> int:
        """A number that moves with every settings or opt-out change (0: none yet)."""
        rows = self._read("SELECT value FROM meta WHERE key = ?", (SETTINGS_VERSION,))
        return int(rows[0][0]) if rows else 0

    def update_settings(self, guild_id: int, **changes: Any) -> GuildSettings:
        """Change a guild's settings in one transaction; returns them as they are now.

        Keywords: ``channel_mode``, ``retention_days`` (``None`` = keep), ``autoresponse``,
        ``add_channel`` / ``remove_channel`` (the channel list), ``toggle_autoresponse_channel``,
        ``opt_out`` / ``opt_in`` (a member id).

        Raises:
            SettingsError: An unknown setting or value (nothing is changed).
        """
        with self._db.write() as conn:
            self.lock(conn, guild_id)
            self._execute(conn, "INSERT INTO guild_settings(guild_id) VALUES (?) "
                          "ON CONFLICT DO NOTHING", (guild_id,))
            for key, value in changes.items():
                if value is None and key != "retention_days":
                    continue
                self._apply(conn, guild_id, key, value)
            self.changed(conn, guild_id)
            settings_changed(conn, self._dialect)
        return self.settings(guild_id)

    def _apply(self, conn: Any, guild_id: int, key: str, value: Any) -> None:
        """Apply one of :meth:`update_settings`' keywords inside its transaction."""
        if key in _COLUMNS:
            if value not in _COLUMNS[key]:
                raise SettingsError(f"{key} must be one of {', '.join(_COLUMNS[key])}")
            self._execute(conn, f"UPDATE guild_settings SET {key} = ? WHERE guild_id = ?",
                          (value, guild_id))
        elif key == "retention_days":
            if value is not None and int(value) <= 0:
                raise SettingsError("retention must be a positive number of days")
            self._execute(conn, "UPDATE guild_settings SET retention_days = ? WHERE guild_id = ?",
                          (None if value is None else int(value), guild_id))
        elif key in ("add_channel", "opt_out"):
            table, column = _LISTS[key]
            self._execute(conn, f"INSERT INTO {table}(guild_id, {column}) VALUES (?, ?) "
                          "ON CONFLICT DO NOTHING", (guild_id, int(value)))
            if key == "opt_out":  # the names they have here go with them (not other guilds')
                self._execute(conn, "DELETE FROM member_names WHERE guild_id = ? AND author_id = ?",
                              (guild_id, int(value)))
        elif key in ("remove_channel", "opt_in"):
            table, column = _LISTS[key]
            self._execute(conn, f"DELETE FROM {table} WHERE guild_id = ? AND {column} = ?",
                          (guild_id, int(value)))
        elif key == "toggle_autoresponse_channel":
            if not self._execute(
                    conn, "DELETE FROM autoresponse_channels WHERE guild_id = ? AND channel_id = ?",
                    (guild_id, int(value))).rowcount:
                self._execute(conn, "INSERT INTO autoresponse_channels VALUES (?, ?)",
                              (guild_id, int(value)))
        else:
            raise SettingsError(f"unknown setting {key!r}")

    # -- retention ------------------------------------------------------------------------

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
            sql += f" AND {self._dialect.in_ids('guild_id')}"
            params.append(self._dialect.ids(guild_ids))
        rows = self._read(sql, params)
        if not rows:
            return {}
        now = self.retention_clock(seen_ms)
        return {guild: now - int(days) * DAY_MS for guild, days in rows}

    def retention_clock(self, seen_ms: int | None = None) -> int:
        """The time retention counts from (:func:`memory.retention.retention_now`): the
        host clock, unless it runs far past the newest stored message and ``seen_ms``."""
        newest = self._read("SELECT max((SELECT max(created_at) FROM messages "
                            "WHERE guild_id = g.id)) FROM guilds g")[0][0]
        return retention_now(None if newest is None else int(newest), seen_ms)

    # -- backfill -------------------------------------------------------------------------

    def backfill_cursor(self, channel_id: int) -> BackfillCursor | None:
        """How far a backfill of this channel got, or ``None`` if none started."""
        rows = self._read("SELECT before_id, complete FROM backfill_cursors WHERE channel_id = ?",
                          (channel_id,))
        return BackfillCursor(rows[0][0], bool(rows[0][1])) if rows else None

    def save_backfill_cursor(
        self, guild_id: int, channel_id: int, before_id: int | None, *, complete: bool = False
    ) -> None:
        """Record that a backfill has read this channel back to ``before_id`` (or to its start)."""
        with self._db.write() as conn:
            self._execute(
                conn, "INSERT INTO backfill_cursors AS b(channel_id, guild_id, before_id, complete) "
                "VALUES (?, ?, ?, ?) ON CONFLICT (channel_id) DO UPDATE SET "
                "before_id = COALESCE(excluded.before_id, b.before_id), complete = excluded.complete",
                (channel_id, guild_id, before_id, bool(complete)))

    # -- messages heard but not stored before a stop (the start-up catch-up reads them) ----

    def mark_missed(self, marks: Iterable[tuple[int, int, int]]) -> None:
        """Record messages the bot heard but could not store, as ``(guild_id, channel_id,
        message_id)``: the start-up catch-up reads each channel from before them."""
        marks = sorted({(int(g), int(c), int(m)) for g, c, m in marks})
        if not marks:
            return
        with self._db.write() as conn:
            conn.cursor().executemany(self._dialect.sql(
                "INSERT INTO missed_messages(guild_id, channel_id, message_id) VALUES (?, ?, ?) "
                "ON CONFLICT (channel_id, message_id) DO NOTHING"), marks)

    def missed(self) -> dict[int, list[int]]:
        """The missed messages' ids by channel, oldest first (see :meth:`mark_missed`)."""
        out: dict[int, list[int]] = {}
        for channel_id, message_id in self._read(
                "SELECT channel_id, message_id FROM missed_messages ORDER BY channel_id, message_id"):
            out.setdefault(channel_id, []).append(message_id)
        return out

    def clear_missed(self, channel_id: int, message_ids: Iterable[int]) -> None:
        """Drop these marks of a channel: the catch-up has read past them."""
        with self._db.write() as conn:
            self._execute(conn, "DELETE FROM missed_messages WHERE channel_id = ? AND "
                          f"{self._dialect.in_ids('message_id')}",
                          (channel_id, self._dialect.ids(message_ids)))

    # -- reconciling with what Discord says exists (cogs.reconcile) ----------------------

    def reconcile_run(self, guild_id: int) -> int | None:
        """A guild's unfinished reconcile run (its start, unix ms), or ``None``."""
        rows = self._read("SELECT run_id FROM reconcile_runs WHERE guild_id = ?", (guild_id,))
        return rows[0][0] if rows else None

    def begin_reconcile_run(self, guild_id: int, run_id: int) -> None:
        """Start a guild's reconcile run; what an earlier run saved is dropped."""
        with self._db.write() as conn:
            self._execute(conn, "DELETE FROM reconcile_cursors WHERE guild_id = ?", (guild_id,))
            self._execute(conn, "INSERT INTO reconcile_runs(guild_id, run_id) VALUES (?, ?) "
                          "ON CONFLICT (guild_id) DO UPDATE SET run_id = excluded.run_id",
                          (guild_id, run_id))

    def end_reconcile_run(self, guild_id: int) -> None:
        """Mark a guild's reconcile run finished: the next one starts from scratch."""
        with self._db.write() as conn:
            self._execute(conn, "DELETE FROM reconcile_cursors WHERE guild_id = ?", (guild_id,))
            self._execute(conn, "DELETE FROM reconcile_runs WHERE guild_id = ?", (guild_id,))

    def reconcile_cursor(self, channel_id: int) -> ReconcileCursor | None:
        """Where the current reconcile run got to in a channel, ``None`` if not there yet."""
        rows = self._read("SELECT run_id, before_id, complete FROM reconcile_cursors "
                          "WHERE channel_id = ?", (channel_id,))
        return ReconcileCursor(rows[0][0], rows[0][1], bool(rows[0][2])) if rows else None

    def save_reconcile_cursor(
        self, guild_id: int, channel_id: int, run_id: int, before_id: int | None,
        *, complete: bool = False,
    ) -> None:
        """Record a reconcile run's progress in a channel."""
        with self._db.write() as conn:
            self._execute(
                conn, "INSERT INTO reconcile_cursors AS r(channel_id, guild_id, run_id, before_id, "
                "complete) VALUES (?, ?, ?, ?, ?) ON CONFLICT (channel_id) DO UPDATE SET "
                "run_id = excluded.run_id, before_id = COALESCE(excluded.before_id, r.before_id), "
                "complete = excluded.complete",
                (channel_id, guild_id, run_id, before_id, bool(complete)))
