"""Where the bot's memory is kept: the storage contract and its engines.

:mod:`memory.storage.contract` says what the rest of the bot may ask of a database
(one Protocol per noun: messages, forgetting, guilds, the embedding backlog, meta,
the keyword index, the vector index); :mod:`memory.storage.sqlite` implements it on
one SQLite file, :mod:`memory.storage.postgres` on a PostgreSQL server with pgvector.
:func:`open_storage` picks the engine from the location (a path, or a
``postgresql://`` URL).  Nothing
above this package writes SQL.

What both engines need is written once here, engine-neutral, over a small seam
(:mod:`.dialect`: the parameter marker, "one of these ids"): :mod:`.windows` (the
conversational windows), :mod:`.guilds`, :mod:`.meta`, :mod:`.messages` (every read,
what an upsert may store), :mod:`.backlog`, :mod:`.forgetting`, :mod:`.rebuild`,
:mod:`.filters`, :mod:`.similarity`, :mod:`.tokens` (FTS5's words), :mod:`.migrations`;
each engine package subclasses them with only the SQL that really differs, and
neither engine imports the other.
"""

from __future__ import annotations

from pathlib import Path

from memory.storage.contract import Storage
from memory.storage.postgres.connection import is_postgres_url
from memory.storage.sqlite import SQLiteStorage
from memory.storage.sqlite.connection import refuse_url

__all__ = ["Storage", "check_location", "open_storage"]


def check_location(location: str | Path) -> None:
    """Refuse, before any work, a location no storage engine here can open.

    A path is an SQLite file; a ``postgresql://`` (or ``postgres://``) URL is a
    PostgreSQL database; any other URL is refused with one line (it would become
    folders).

    Raises:
        DatabaseFileError: ``location`` is a URL of another kind.
    """
    if isinstance(location, Path) or not is_postgres_url(location):
        refuse_url(location)  # a Path has folded a URL's "//" already: not usable either


def open_storage(
    location: str | Path, *, read_only: bool | None = None, erase_deleted: bool = True
) -> Storage:
    """Open (creating and migrating if needed) the database at ``location``.

    Args:
        location: An SQLite file's path (or ``":memory:"``), or a ``postgresql://``
            URL (:mod:`memory.storage.postgres`; the ``[postgres]`` extra).
        read_only: Open read-only (searches and stats work, writes raise
            :class:`~memory.errors.DatabaseFileError`); by default, when this process
            cannot write the database.
        erase_deleted: Remove deleted text from the database's files.  ``False`` only
            measures what that costs (``bench secure-delete``).  SQLite only: on
            PostgreSQL, VACUUM decides (see docs/privacy.md, "On PostgreSQL").

    Raises:
        ExtensionLoadError: sqlite-vec cannot be loaded.
        DatabaseFileError: ``location`` is a URL of another kind, not (or a newer
            version of) this bot's database, or a server that cannot be reached.
        DiskFullError: Creating or upgrading it needed space the disk does not have.
    """
    check_location(location)
    if is_postgres_url(location):
        from memory.storage.postgres import PostgresStorage  # psycopg only when asked for

        return PostgresStorage(str(location), read_only=read_only)
    return SQLiteStorage(location, read_only=read_only, erase_deleted=erase_deleted)
