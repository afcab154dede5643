"""Moving a whole memory between databases (``bot.py migrate-db SOURCE TARGET``).

Engine-neutral: both ends are a :class:`Endpoint` (each engine's ``transfer`` module),
which reads and writes the same logical tables in the same column order — names,
messages, tombstones, settings, opt-outs, cursors, ``meta``, the conversational
windows, the message vectors (float32, never re-embedded) and the window vectors.
What an engine derives from them (SQLite's FTS5 tables and code statistics,
PostgreSQL's keyword documents, totals and HNSW index) it rebuilds as rows arrive.

The copy goes table by table in key order, one page per transaction, comparing each
page of the source with the same key range of the target: what the target lacks is
written, what differs is overwritten, what the source no longer holds is deleted.  So
it is **resumable** (run again after a kill: the rows already there are equal and
left alone) and it **updates** an older copy (run again after the source changed:
edits, older messages backfilled, forgotten messages and members, settings and
opt-outs all reach the target; a forgotten message leaves the copy with everything
derived from it).  At the end every table's row count and rows, vectors bit for bit,
are compared; :class:`TransferReport` says what differs, if anything.
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any, Protocol

import numpy as np

from memory.errors import DatabaseFileError
from memory.storage.contract import Storage

log = logging.getLogger(__name__)

PAGE = 2000
SOURCE_KEY = "migrated_from"  # meta: which database a target is a copy of


@dataclass(frozen=True)
class Table:
    """A logical table: its key columns and every column, in transfer order."""

    name: str
    key: tuple[str, ...]
    columns: tuple[str, ...]

    def insert_sql(self, values: str, *, replace: bool) -> str:
        """The INSERT of this table's rows: keys already there kept, or with ``replace``
        overwritten (an UPDATE, so that SQLite's ``search_text`` trigger re-indexes the row).

        Args:
            values: The engine's ``VALUES`` list, one marker per column.
            replace: Overwrite a row whose key is there already.
        """
        head = f"INSERT INTO {self.name}({', '.join(self.columns)}) VALUES ({values})"
        others = [c for c in self.columns if c not in self.key]
        if not replace or not others:
            return f"{head} ON CONFLICT DO NOTHING"
        updates = ", ".join(f"{c} = excluded.{c}" for c in others)
        return f"{head} ON CONFLICT ({', '.join(self.key)}) DO UPDATE SET {updates}"


TABLES: tuple[Table, ...] = (
    Table("meta", ("key",), ("key", "value")),
    Table("guilds", ("id",), ("id", "name")),
    Table("channels", ("id",), ("id", "guild_id", "parent_id", "name", "type")),
    Table("authors", ("id",), ("id", "is_bot")),
    Table("member_names", ("guild_id", "author_id"), ("guild_id", "author_id", "name", "display_name")),
    Table("messages", ("id",), ("id", "guild_id", "channel_id", "author_id", "created_at",
                                "edited_at", "content", "reply_to_id", "attachments", "embedded")),
    Table("tombstones", ("message_id",), ("message_id", "deleted_at")),
    Table("emptied_messages", ("message_id",), ("message_id", "edited_at")),
    # messages heard but not stored (held, or their catch-up failed): the next catch-up's
    # only way back to them once later messages are stored
    Table("missed_messages", ("channel_id", "message_id"), ("channel_id", "message_id", "guild_id")),
    # the bot's public answers: what each quotes, and those due to be taken down
    Table("answer_quotes", ("answer_id", "quoted_id"), ("answer_id", "quoted_id", "channel_id",
                                                       "guild_id")),
    Table("retractions", ("answer_id",), ("answer_id", "channel_id", "guild_id")),
    Table("guild_settings", ("guild_id",), ("guild_id", "channel_mode", "retention_days",
                                            "autoresponse")),
    Table("channel_rules", ("guild_id", "channel_id"), ("guild_id", "channel_id")),
    Table("autoresponse_channels", ("guild_id", "channel_id"), ("guild_id", "channel_id")),
    Table("member_optouts", ("guild_id", "author_id"), ("guild_id", "author_id")),
    Table("backfill_cursors", ("channel_id",), ("channel_id", "guild_id", "before_id", "complete")),
    Table("reconcile_runs", ("guild_id",), ("guild_id", "run_id")),
    Table("reconcile_cursors", ("channel_id",), ("channel_id", "guild_id", "run_id", "before_id",
                                                 "complete")),
    Table("search_text", ("id",), ("id", "author", "content", "attachments", "context",
                                   "context_ids", "contentful")),
    # vectors as float32 bytes, window vectors as float16 bytes: the same in both engines
    Table("message_vectors", ("message_id",), ("message_id", "guild_id", "channel_id",
                                               "author_id", "created_at", "has_attachment",
                                               "embedding")),
    Table("window_vectors", ("id",), ("id", "vector")),
)
BY_NAME = {table.name: table for table in TABLES}
BOOLEANS = frozenset({"is_bot", "embedded", "complete", "contentful", "has_attachment"})
"""Columns both ends read and write as 0/1 (SQLite stores them so; PostgreSQL as boolean)."""
# meta keys that describe one engine's files, not the memory: never copied
ENGINE_META = frozenset({"deleted_text_scrubbed", "vector_index", SOURCE_KEY,
                         "embedding_model", "embedding_dim"})


class Endpoint(Protocol):
    """One side of a transfer: an open storage seen as logical tables."""

    @property
    def storage(self) -> Storage:
        """The open storage (its contract: meta, messages)."""
        ...

    def count(self, table: Table) -> int:
        """Rows in ``table``."""
        ...

    def rows(self, table: Table, after: tuple | None, limit: int) -> list[tuple]:
        """Up to ``limit`` rows with a key greater than ``after``, in key order."""
        ...

    def write(self, table: Table, rows: Sequence[tuple], *, replace: bool = False) -> None:
        """Store rows and what derives from them, in one transaction.

        Args:
            table: The table.
            rows: Its rows, every column in order.
            replace: The keys are there already with other values: overwrite them
                (their old text leaves the file).  Otherwise a key already there is
                left as it is.
        """
        ...

    def remove(self, table: Table, keys: Sequence[tuple]) -> None:
        """Delete rows by key, and what derives from them, for good, in one transaction.

        Removing a message removes everything kept under its id (its index text,
        vector and window vector) with it.
        """
        ...

    def prepare(self, vectors: int) -> None:
        """Get ready for a load that brings ``vectors`` message vectors (e.g. put off
        building an index when the target holds few of them yet)."""
        ...

    def finish(self) -> None:
        """Build what :meth:`prepare` put off."""
        ...


@dataclass
class TransferReport:
    """What a transfer wrote, and whether the copy equals the source."""

    copied: dict[str, int] = field(default_factory=dict)  # rows the target did not hold
    updated: dict[str, int] = field(default_factory=dict)  # rows it held with other values
    removed: dict[str, int] = field(default_factory=dict)  # rows the source no longer holds
    counts: dict[str, tuple[int, int]] = field(default_factory=dict)  # source, target
    differences: list[str] = field(default_factory=list)

    @property
    def equal(self) -> bool:
        """Every count and every vector agree."""
        return not self.differences


REFERENCED = ("guilds", "channels", "authors")
"""Tables other rows point at: their rows the source no longer holds go last."""


def transfer(source: Endpoint, target: Endpoint, *, source_name: str,
             former_names: Sequence[str] = (),
             progress: Callable[[str, int], None] | None = None) -> TransferReport:
    """Bring ``target`` to what ``source`` holds now, then verify the copy.

    Every table is compared in key order, page by page: rows the target lacks are
    copied, rows that differ (an edit, a changed setting, a window that gained a
    neighbour) are overwritten, and rows the source no longer holds (a forgotten
    message, an opt-in, a removed channel rule) are deleted with what derives from
    them.  So the same call fills an empty target, resumes a killed copy, and brings
    an older copy up to date.

    Args:
        source: What to copy.
        target: Where to; empty, or a copy this function made of ``source``.
        source_name: How the source is named in the target's ``meta``.
        former_names: Names an older version gave the same source (accepted, and
            replaced by ``source_name``).
        progress: Called with a table's name and the source rows just compared.

    Raises:
        DatabaseFileError: The target holds messages that are not a copy of this
            source (it is left unchanged).
    """
    _claim_target(source, target, source_name, former_names)
    model = source.storage.meta.embedding_model()
    if model is not None:
        target.storage.meta.bind_model(*model)
    target.prepare(source.count(BY_NAME["message_vectors"]))
    report = TransferReport()
    late: dict[str, list[tuple]] = {}
    for table in TABLES:
        late[table.name] = _sync(source, target, table, report, progress)
    for name in reversed(REFERENCED):
        _remove(target, BY_NAME[name], late[name], report)
    target.finish()
    verify(source, target, report)
    return report


def total_rows(source: Endpoint) -> int:
    """How many rows a full transfer copies (for a progress bar)."""
    return sum(source.count(table) for table in TABLES)


def _claim_target(source: Endpoint, target: Endpoint, source_name: str,
                  former_names: Sequence[str]) -> None:
    marker = target.storage.meta.get(SOURCE_KEY)
    if marker is None and target.storage.messages.has_any():
        raise DatabaseFileError(
            "the target already holds messages that were not copied from this source; "
            "migrate-db only fills an empty database (or updates its own copy): give a new one")
    if marker is not None and marker != source_name and marker not in former_names:
        raise DatabaseFileError(
            f"the target is a copy of {marker}, not of {source_name}; give a new database")
    if marker != source_name:
        target.storage.meta.set(SOURCE_KEY, source_name)


def _key(table: Table, row: tuple) -> tuple:
    return tuple(row[:len(table.key)])


def _sync(source: Endpoint, target: Endpoint, table: Table, report: TransferReport,
          progress: Callable[[str, int], None] | None) -> list[tuple]:
    """Make ``table`` in the target equal the source's, page by page.

    Returns:
        The keys to remove that other rows may still point at (:data:`REFERENCED`);
        every other table's surplus is removed here, page by page.
    """
    for name in ("copied", "updated", "removed"):
        getattr(report, name)[table.name] = 0
    after: tuple | None = None
    late: list[tuple] = []
    while page := source.rows(table, after, PAGE):
        upper = _key(table, page[-1])
        theirs = _wanted(table, page)
        ours = {_key(table, row): row for row in _rows_upto(target, table, after, upper)}
        fresh = [row for row in theirs if _key(table, row) not in ours]
        changed = [row for row in theirs
                   if _key(table, row) in ours and not _same(row, ours[_key(table, row)])]
        target.write(table, fresh)
        target.write(table, changed, replace=True)
        report.copied[table.name] += len(fresh)
        report.updated[table.name] += len(changed)
        wanted = {_key(table, row) for row in theirs}
        late += _surplus(target, table, [k for k in ours if k not in wanted], report)
        after = upper
        if progress:
            progress(table.name, len(page))
    while rest := target.rows(table, after, PAGE):  # past the source's last key
        after = _key(table, rest[-1])
        late += _surplus(target, table, [_key(table, row) for row in rest], report)
    return late


def _wanted(table: Table, rows: list[tuple]) -> list[tuple]:
    """The rows a copy takes: ``meta`` keeps each engine's facts about its own files."""
    if table.name != "meta":
        return rows
    return [row for row in rows if row[0] not in ENGINE_META]


def _surplus(target: Endpoint, table: Table, keys: list[tuple],
             report: TransferReport) -> list[tuple]:
    """Remove the target's rows the source does not hold, or return them to remove later."""
    if table.name == "meta" or not keys:
        return []  # the target's meta is its own (schema, engine facts)
    if table.name in REFERENCED:
        return keys
    _remove(target, table, keys, report)
    return []


def _remove(target: Endpoint, table: Table, keys: list[tuple], report: TransferReport) -> None:
    if keys:
        target.remove(table, keys)
        report.removed[table.name] = report.removed.get(table.name, 0) + len(keys)
        log.info("migrate-db: removed %d rows of %s the source no longer holds", len(keys),
                 table.name)


def _rows_upto(target: Endpoint, table: Table, after: tuple | None, upper: tuple) -> list[tuple]:
    """The target's rows with a key after ``after`` and up to ``upper``."""
    found: list[tuple] = []
    while page := target.rows(table, after, PAGE):
        found += [row for row in page if _key(table, row) <= upper]
        after = _key(table, page[-1])
        if after >= upper:
            break
    return found


def verify(source: Endpoint, target: Endpoint, report: TransferReport) -> None:
    """Compare every table's row count and rows (vectors bit for bit); ``meta`` aside."""
    for table in TABLES:
        if table.name == "meta":
            continue  # each engine keeps facts of its own there
        counts = (source.count(table), target.count(table))
        report.counts[table.name] = counts
        if counts[0] != counts[1]:
            report.differences.append(f"{table.name}: {counts[0]} rows in the source, "
                                      f"{counts[1]} in the target")
        _compare_rows(source, target, table, report)


def _compare_rows(source: Endpoint, target: Endpoint, table: Table, report: TransferReport) -> None:
    after: tuple | None = None
    differing = 0
    first: Any = None
    while theirs := source.rows(table, after, PAGE):
        upper = _key(table, theirs[-1])
        ours = {_key(table, row): row for row in _rows_upto(target, table, after, upper)}
        for row in theirs:
            if not _same(row, ours.get(_key(table, row))):
                differing += 1
                first = first or row[0]
        after = upper
    if differing:
        report.differences.append(f"{table.name}: {differing} rows differ (first: {first})")


def _same(a: tuple, b: tuple | None) -> bool:
    if b is None or len(a) != len(b):
        return False
    for x, y in zip(a, b):
        if isinstance(x, bytes | bytearray | memoryview) or isinstance(y, bytes | bytearray | memoryview):
            if bytes(x) != bytes(y):
                return False
        elif isinstance(x, np.ndarray) or isinstance(y, np.ndarray):
            if not np.array_equal(np.asarray(x), np.asarray(y)):
                return False
        elif x != y:
            return False
    return True
