"""The PostgreSQL engine of the storage contract: pgvector for the vectors, BM25 over
FTS5's own words for the keywords, any number of processes on one database.

:class:`PostgresStorage` composes the nouns of :mod:`memory.storage.contract` over one
:class:`~.database.PostgresDatabase` (a connection pool and its transactions):

==================  ===========================================================
``connection``      psycopg 3 and its pool, URLs (passwords never shown), errors
``database``        ``write()`` transactions, ``read()``, the locks that keep
                    concurrent writers in a safe order, migrate on open
``migrations``      numbered, append-only, under an advisory lock
``messages``        ``upsert`` and every read of messages, names and threads
``forgetting``      every ``forget_*``, tombstones, re-embedding dependants
``guilds``          settings (versioned), opt-outs, retention, cursors
``backlog``         pending messages, ``FOR UPDATE SKIP LOCKED`` claims that die
                    with their process, ``write_vectors``
``meta``            the embedding model binding, the vector table's life
``rebuild``         ``reembed``: a new vector table built beside the live one, swapped in
``keywords``        keyword postings over FTS5's words (:mod:`memory.storage.tokens`),
                    BM25 in SQL
``vectors``         pgvector HNSW with iterative scans, window vectors, the
                    similarity floor
``windows``         the conversational windows both keyword fields share
``filters``         a search's filters as SQL conditions
``quotes``          what public answers quote (the shared noun, with locks)
==================  ===========================================================

What both engines do alike is written once in :mod:`memory.storage` (over the
:mod:`~memory.storage.dialect` seam); the modules here hold PostgreSQL's own SQL,
locks and types.  Nothing here imports :mod:`memory.storage.sqlite`.

Selected by a ``postgresql://`` URL (:func:`memory.storage.open_storage`); needs the
``[postgres]`` extra and a server with pgvector 0.8 or newer.
"""

from __future__ import annotations

from memory.storage.contract import StoreStats, store_stats
from memory.storage.postgres.backlog import PostgresBacklog
from memory.storage.postgres.database import PostgresDatabase
from memory.storage.postgres.forgetting import PostgresForgetting
from memory.storage.postgres.guilds import PostgresGuilds
from memory.storage.postgres.keywords import PostgresKeywordIndex
from memory.storage.postgres.messages import PostgresMessages
from memory.storage.postgres.meta import PostgresMeta
from memory.storage.postgres.quotes import PostgresQuotes
from memory.storage.postgres.rebuild import PostgresRebuild
from memory.storage.postgres.vectors import PostgresVectorIndex

__all__ = ["PostgresStorage"]


class PostgresStorage:
    """The contract's ``Storage`` on one PostgreSQL database (migrated on open).

    Args:
        url: A ``postgresql://`` URL.
        read_only: Only read; by default when the server is a replica or the role
            may not write.

    Raises:
        DatabaseFileError: The server cannot be reached, lacks pgvector, holds
            another application's tables or a newer schema, or the driver is missing.
    """

    def __init__(self, url: str, *, read_only: bool | None = None) -> None:
        self.database = PostgresDatabase(url, read_only=read_only)
        self.meta = PostgresMeta(self.database)
        self.guilds = PostgresGuilds(self.database)
        self.forgetting = PostgresForgetting(self.database)
        self.messages = PostgresMessages(self.database, self.guilds, self.forgetting)
        self.backlog = PostgresBacklog(self.database, self.meta)
        self.keywords = PostgresKeywordIndex(self.database)
        self.vectors = PostgresVectorIndex(self.database, self.meta)
        self.rebuild = PostgresRebuild(self.database, self.meta, self.backlog)
        self.quotes = PostgresQuotes(self.database)

    def stats(self) -> StoreStats:
        """Counts and metadata for the ``stats`` command."""
        return store_stats(self, self.messages.table_counts())

    def close(self) -> None:
        """End the claim owners' sessions and close the pool."""
        self.backlog.close()
        self.database.close()
