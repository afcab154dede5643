"""Where the bot's memory is kept: the storage contract and its engines.

:mod:`memory.storage.contract` says what the rest of the bot may ask of a database
(one Protocol per noun: messages, forgetting, guilds, the embedding backlog, meta,
the keyword index, the vector index); :mod:`memory.storage.sqlite` implements it on
one SQLite file.  :func:`open_storage` picks the engine from the location.  Nothing
above this package writes SQL.
"""

from __future__ import annotations

from pathlib import Path

from memory.storage.contract import Storage
from memory.storage.sqlite import SQLiteStorage
from memory.storage.sqlite.connection import refuse_url

__all__ = ["Storage", "check_location", "open_storage"]


def check_location(location: str | Path) -> None:
    """Refuse, before any work, a location no storage engine here can open.

    A path is an SQLite file; a URL (``postgresql://…``) is refused with one line
    until an engine for URLs exists.

    Raises:
        DatabaseFileError: ``location`` is a URL.
    """
    refuse_url(location)


def open_storage(
    location: str | Path, *, read_only: bool | None = None, erase_deleted: bool = True
) -> Storage:
    """Open (creating and migrating if needed) the database at ``location``.

    Args:
        location: An SQLite file's path (or ``":memory:"``).
        read_only: Open read-only (searches and stats work, writes raise
            :class:`~memory.errors.DatabaseFileError`); by default, when this process
            cannot write the database.
        erase_deleted: Remove deleted text from the database's files.  ``False`` only
            measures what that costs (``bench secure-delete``).

    Raises:
        ExtensionLoadError: sqlite-vec cannot be loaded.
        DatabaseFileError: ``location`` is a URL, or not (or a newer version of) this
            bot's database.
        DiskFullError: Creating or upgrading it needed space the disk does not have.
    """
    check_location(location)
    return SQLiteStorage(location, read_only=read_only, erase_deleted=erase_deleted)
