"""Moving a whole memory between databases (``bot.py migrate-db SOURCE TARGET``).

Engine-neutral: both ends are a :class:`Endpoint` (each engine's ``transfer`` module),
which reads and writes the same logical tables in the same column order — names,
messages, tombstones, settings, opt-outs, cursors, ``meta``, the conversational
windows, the message vectors (float32, never re-embedded) and the window vectors.
What an engine derives from them (SQLite's FTS5 tables and code statistics,
PostgreSQL's keyword documents, totals and HNSW index) it rebuilds as rows arrive.

The copy goes table by table in key order, one page per transaction, so it is
**resumable**: run again after a kill, each table continues after the last key the
target holds, and a row is never written twice.  At the end every table's row count
and every vector (and window vector) are compared; :class:`TransferReport` says what
differs, if anything.
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


TABLES: tuple[Table, ...] = (
    Table("meta", ("key",), ("key", "value")),
    Table("guilds", ("id",), ("id", "name")),
    Table("channels", ("id",), ("id", "guild_id", "parent_id", "name", "type")),
    Table("authors", ("id",), ("id", "is_bot")),
    Table("member_names", ("guild_id", "author_id"), ("guild_id", "author_id", "name", "display_name")),
    Table("messages", ("id",), ("id", "guild_id", "channel_id", "author_id", "created_at",
                                "edited_at", "content", "reply_to_id", "attachments", "embedded")),
    Table("tombstones", ("message_id",), ("message_id", "deleted_at")),
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

    def last_key(self, table: Table) -> tuple | None:
        """The greatest key in ``table`` (``None`` when empty)."""
        ...

    def rows(self, table: Table, after: tuple | None, limit: int) -> list[tuple]:
        """Up to ``limit`` rows with a key greater than ``after``, in key order."""
        ...

    def write(self, table: Table, rows: Sequence[tuple]) -> None:
        """Insert rows (a key already there is left as it is) in one transaction."""
        ...

    def prepare(self) -> None:
        """Get ready for a bulk load (e.g. put off building an index)."""
        ...

    def finish(self) -> None:
        """Build what :meth:`prepare` put off."""
        ...


@dataclass
class TransferReport:
    """What a transfer copied, and whether the copy equals the source."""

    copied: dict[str, int] = field(default_factory=dict)
    counts: dict[str, tuple[int, int]] = field(default_factory=dict)  # source, target
    differences: list[str] = field(default_factory=list)

    @property
    def equal(self) -> bool:
        """Every count and every vector agree."""
        return not self.differences


def transfer(source: Endpoint, target: Endpoint, *, source_name: str,
             progress: Callable[[str, int], None] | None = None) -> TransferReport:
    """Copy every table from ``source`` to ``target`` (resuming), then verify the copy.

    Raises:
        DatabaseFileError: The target holds messages that are not a copy of this
            source (it is left unchanged).
    """
    _claim_target(source, target, source_name)
    model = source.storage.meta.embedding_model()
    if model is not None:
        target.storage.meta.bind_model(*model)
    target.prepare()
    report = TransferReport()
    for table in TABLES:
        report.copied[table.name] = _copy(source, target, table, progress)
    target.finish()
    verify(source, target, report)
    return report


def total_rows(source: Endpoint) -> int:
    """How many rows a full transfer copies (for a progress bar)."""
    return sum(source.count(table) for table in TABLES)


def _claim_target(source: Endpoint, target: Endpoint, source_name: str) -> None:
    marker = target.storage.meta.get(SOURCE_KEY)
    if marker is None and target.storage.messages.has_any():
        raise DatabaseFileError(
            "the target already holds messages that were not copied from this source; "
            "migrate-db only fills an empty database (or resumes its own copy): give a new one")
    if marker is not None and marker != source_name:
        raise DatabaseFileError(
            f"the target is a copy of {marker}, not of {source_name}; give a new database")
    if marker is None:
        target.storage.meta.set(SOURCE_KEY, source_name)


def _copy(source: Endpoint, target: Endpoint, table: Table,
          progress: Callable[[str, int], None] | None) -> int:
    # meta is small and the target has keys of its own there: always from the start
    after = None if table.name == "meta" else target.last_key(table)
    copied = 0
    while rows := source.rows(table, after, PAGE):
        after = tuple(rows[-1][:len(table.key)])
        wanted = [row for row in rows if table.name != "meta" or row[0] not in ENGINE_META]
        target.write(table, wanted)
        copied += len(wanted)
        if progress:
            progress(table.name, len(rows))
    return copied


def verify(source: Endpoint, target: Endpoint, report: TransferReport) -> None:
    """Compare row counts, and every vector and window vector, bit for bit."""
    for table in TABLES:
        counts = (source.count(table), target.count(table))
        if table.name == "meta":
            continue  # each engine keeps facts of its own there
        report.counts[table.name] = counts
        if counts[0] != counts[1]:
            report.differences.append(f"{table.name}: {counts[0]} rows in the source, "
                                      f"{counts[1]} in the target")
    for name in ("message_vectors", "window_vectors", "messages", "search_text"):
        _compare_rows(source, target, BY_NAME[name], report)


def _compare_rows(source: Endpoint, target: Endpoint, table: Table, report: TransferReport) -> None:
    after: tuple | None = None
    differing = 0
    first: Any = None
    while theirs := source.rows(table, after, PAGE):
        ours = {row[:len(table.key)]: row for row in target.rows(table, after, PAGE * 2)
                if row[:len(table.key)] <= theirs[-1][:len(table.key)]}
        for row in theirs:
            if not _same(row, ours.get(row[:len(table.key)])):
                differing += 1
                first = first or row[0]
        after = tuple(theirs[-1][:len(table.key)])
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
