"""Storing many messages at once: DiscordChatExporter files and other long streams.

An import commits in short transactions (about half a second of work each), so a
live writer — the bot, another import — never waits past its busy timeout, and
what was committed stays when a file turns out to be damaged part-way.  Embedding
is not done here: the engine embeds the backlog afterwards
(:meth:`memory.engine.MemoryEngine.import_exports`).
"""

from __future__ import annotations

import itertools
import time
from collections.abc import Callable, Iterable, Mapping
from dataclasses import astuple, dataclass, field
from pathlib import Path

from memory.errors import ImportFormatError
from memory.importer import find_exports, iter_exports
from memory.records import MessageRecord
from memory.storage.contract import Messages, UpsertStats

COMMIT_SECONDS = 0.5  # work per import transaction: well inside another writer's busy timeout
Progress = Callable[[int], None]


@dataclass(frozen=True)
class IngestStats:
    """What an ingest did: the upsert counts plus how many vectors were written.

    ``expired``: messages older than their server's retention period, not stored.
    """

    inserted: int = 0
    updated: int = 0
    unchanged: int = 0
    embedded: int = 0
    expired: int = 0


@dataclass
class ImportSummary:
    """What an import of export files did.

    ``skipped``: entries that are not messages; ``expired``: messages older than
    their server's retention period, not stored; ``misplaced``: messages whose id is
    stored in another channel (the first channel keeps it), not stored;
    ``tombstoned``: messages deleted before (they stay deleted); ``opted_out``:
    messages of members who opted out, not stored; ``damaged``: files that failed
    part-way, whose messages before the damage are stored (and counted).
    """

    files: int = 0
    inserted: int = 0
    updated: int = 0
    unchanged: int = 0
    skipped: int = 0
    embedded: int = 0
    expired: int = 0
    misplaced: int = 0
    tombstoned: int = 0
    opted_out: int = 0
    damaged: int = 0
    emptied: int = 0  # stored copies forgotten: an edit in the export took out their text
    errors: list[str] = field(default_factory=list)

    def add(self, stats: UpsertStats, skipped: int) -> None:
        """Count one export's stored messages and the entries that were not messages."""
        self.skipped += skipped
        self.inserted += stats.inserted
        self.updated += stats.updated
        self.unchanged += stats.unchanged
        self.expired += stats.expired
        self.misplaced += stats.misplaced
        self.tombstoned += stats.tombstoned
        self.opted_out += stats.opted_out

    @property
    def read(self) -> int:
        """Messages read from the files, stored or not."""
        return (self.inserted + self.updated + self.unchanged + self.expired + self.misplaced
                + self.tombstoned + self.opted_out)


class PartialImport(ImportFormatError):
    """An export failed part-way; what was read before the damage is stored.

    Attributes:
        partial: The counts of the messages stored before the failure.
    """

    def __init__(self, message: str, partial: UpsertStats) -> None:
        super().__init__(message)
        self.partial = partial


def store_exports(
    messages: Messages, paths: Iterable[str | Path], *, on_file: Progress | None = None,
    forget_emptied: Callable[[Mapping[int, int]], int] | None = None,
) -> ImportSummary:
    """Store every DiscordChatExporter file under ``paths`` (not embedded yet).

    Unreadable files are reported in the summary, not raised, so one bad file
    does not stop an import of many.  A message an edit left with nothing to store
    is given to ``forget_emptied`` (:meth:`.Forgetting.forget_emptied`): its stored
    copy, if no newer, goes.

    Raises:
        ImportFormatError: A path does not exist.
    """
    files = find_exports(list(paths))
    summary = ImportSummary(files=len(files))
    for export in iter_exports(files):
        if on_file:
            on_file(1)
        if isinstance(export, ImportFormatError):
            summary.errors.append(str(export))
            continue
        try:
            stats = store_in_chunks(messages, export.records())
        except ImportFormatError as exc:
            summary.errors.append(str(exc))
            stats = exc.partial if isinstance(exc, PartialImport) else UpsertStats()
            summary.damaged += any(astuple(stats))  # some of it was read before the damage
        summary.add(stats, export.skipped)
        if forget_emptied is not None and export.emptied:
            summary.emptied += forget_emptied(export.emptied)
    return summary


def store_in_chunks(
    messages: Messages, records: Iterable[MessageRecord], *, seconds: float = COMMIT_SECONDS
) -> UpsertStats:
    """Store a stream of messages, committing about every ``seconds`` of work.

    The chunk size adapts to the measured speed.  What was committed stays if the
    stream fails part-way.

    Raises:
        PartialImport: The stream failed (an :class:`ImportFormatError`); its
            ``partial`` holds the counts of what was stored before.
    """
    totals = UpsertStats()
    size = 500
    iterator = iter(records)
    while True:
        chunk: list[MessageRecord] = []
        failure = None
        try:
            chunk.extend(itertools.islice(iterator, size))
        except ImportFormatError as exc:  # keep what came before the damage
            failure = exc
        if chunk:
            started = time.perf_counter()
            stats = messages.upsert(chunk)
            totals = UpsertStats(*(a + b for a, b in zip(astuple(totals), astuple(stats))))
            elapsed = max(time.perf_counter() - started, 1e-3)
            size = max(50, min(20_000, int(size * seconds / elapsed)))
        if failure is not None:
            raise PartialImport(str(failure), totals) from failure
        if not chunk:
            break
    return totals
