"""The SQLite engine of the storage contract: one database file with sqlite-vec and FTS5.

:class:`SQLiteStorage` composes the nouns of :mod:`memory.storage.contract` over one
:class:`~.database.SQLiteDatabase` (the connection, its lock and its transactions):

==================  ===========================================================
``connection``      the driver that loads sqlite-vec, ``connect()``, read-only
                    opening, WAL, a full disk as one line
``database``        ``SQLiteDatabase``: ``write()`` transactions, ``read()``,
                    ``read_beside()``, the write generation, migrate on open
``migrations``      numbered, append-only schema migrations
``scrub``           how deleted text leaves the file (secure_delete, the WAL)
``messages``        ``upsert`` and every read of messages, names and threads
``forgetting``      every ``forget_*``, tombstones, re-embedding dependants
``guilds``          settings, opt-outs, retention, backfill/reconcile cursors
``backlog``         pending messages, claims, ``write_vectors``
``meta``            the embedding model binding, the active profile
``rebuild``         ``reembed``: a new vector table built beside the live one, swapped in
``keywords``        the FTS5 indexes (``ranked``, ``term_counts``)
``vectors``         vec0: the 1-bit KNN, window vectors, the similarity floor
``windows``         the shared window algorithm over FTS5 triggers and vec0
``filters``         a search's filters as SQL conditions
==================  ===========================================================

What both engines do alike is written once in :mod:`memory.storage` (``windows``,
``guilds``, ``meta``, ``messages``, ``backlog``, ``forgetting``, ``rebuild``,
``filters``, ``similarity``, ``quotes``, over the :mod:`~memory.storage.dialect` seam);
the modules here subclass it with SQLite's own SQL (``quotes`` needs none: it is used
as it is).

Nouns call each other inside one transaction through package-internal methods that
take the open connection (an upsert forgets an opted-out member's edited message and
rewrites the windows in the transaction that stores the batch), so a message and its
indexes always change together.
"""

from __future__ import annotations

from pathlib import Path

from memory.storage.contract import StoreStats, store_stats
from memory.storage.quotes import BaseQuotes
from memory.storage.sqlite import windows
from memory.storage.sqlite.backlog import SQLiteBacklog
from memory.storage.sqlite.connection import DIALECT, as_disk_full
from memory.storage.sqlite.database import SQLiteDatabase
from memory.storage.sqlite.forgetting import SQLiteForgetting
from memory.storage.sqlite.guilds import SQLiteGuilds
from memory.storage.sqlite.keywords import SQLiteKeywordIndex
from memory.storage.sqlite.messages import SQLiteMessages
from memory.storage.sqlite.meta import SQLiteMeta
from memory.storage.sqlite.rebuild import SQLiteRebuild
from memory.storage.sqlite.vectors import SQLiteVectorIndex, Vec0Table

__all__ = ["SQLiteStorage"]


class SQLiteStorage:
    """The contract's ``Storage`` on one SQLite file (created and migrated if needed).

    Args:
        path: The database file, or ``":memory:"``.
        read_only: Open read-only (searches and stats work, writes raise
            :class:`~memory.errors.DatabaseFileError`); by default, when this process
            cannot write the file.
        erase_deleted: Remove deleted text from the file (:mod:`.scrub`).  ``False``
            only measures what that costs (``bench secure-delete``).

    Raises:
        ExtensionLoadError: sqlite-vec cannot be loaded.
        DatabaseFileError: The file is not (or is a newer version of) this bot's database.
        DiskFullError: Creating or upgrading it needed space the disk does not have.
    """

    def __init__(
        self, path: str | Path, *, read_only: bool | None = None, erase_deleted: bool = True
    ) -> None:
        self.database = SQLiteDatabase(path, read_only=read_only, erase_deleted=erase_deleted)
        table = Vec0Table(self.database.read, on_change=windows.vectors_changed)
        self.meta = SQLiteMeta(self.database, table)
        self.guilds = SQLiteGuilds(self.database)
        self.forgetting = SQLiteForgetting(self.database, table)
        self.messages = SQLiteMessages(self.database, self.guilds, self.forgetting)
        self.backlog = SQLiteBacklog(self.database, self.meta, table)
        self.keywords = SQLiteKeywordIndex(self.database)
        self.vectors = SQLiteVectorIndex(self.database, table, self.meta)
        self.rebuild = SQLiteRebuild(self.database, self.meta, table, self.backlog)
        self.quotes = BaseQuotes(self.database, DIALECT)
        if not self.database.read_only:
            self._prepare(path)

    def _prepare(self, path: str | Path) -> None:
        """Repair a lost vector table; make sure deleted text leaves the file."""
        try:
            self.meta.repair_vector_table()
            self.database.protect_deleted_text()
        except BaseException as exc:
            self.database.close()
            if full := as_disk_full(exc, path):
                raise full from exc
            raise

    def stats(self) -> StoreStats:
        """Counts and metadata for the ``stats`` command."""
        return store_stats(self, self.messages.table_counts())

    def close(self) -> None:
        """Let go of the claim owners' locks and close the database's connections."""
        self.backlog.close()
        self.database.close()
