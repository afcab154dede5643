"""The one place that opens SQLite and loads sqlite-vec.

Many Python builds (this project's CI among them) ship a ``sqlite3`` module compiled
without extension loading.  We try the standard library first and fall back to
``pysqlite3`` (the ``pysqlite3-binary`` wheel: a current SQLite with FTS5 and
extension loading); if neither can load sqlite-vec, :class:`ExtensionLoadError` says
what to install.
"""

from __future__ import annotations

import json
import logging
import os
import re
import shutil
import sqlite3 as _stdlib_sqlite3
import time
from collections.abc import Iterable
from pathlib import Path
from types import ModuleType
from typing import Any

from memory.errors import DatabaseFileError, DiskFullError, ExtensionLoadError, StorageBusy
from memory.storage.dialect import Dialect

log = logging.getLogger(__name__)

_driver: ModuleType | None = None

FTS_SECURE_DELETE_SINCE = (3, 46, 1)
"""The first SQLite whose FTS5 ``secure-delete`` (:mod:`memory.storage.sqlite.scrub`) is safe to use.

The option came in 3.42, but up to 3.46.0 deleting rows in that mode can leave the
index malformed (``database disk image is malformed`` on the next edit or delete:
this project's store tests fail that way with 3.42.0, 3.43.1 and 3.46.0 and pass
with 3.46.1 and 3.51.1)."""

# scheme://… (a Path folds the two slashes into one); two letters at least, so a
# Windows drive (C:/) is still a path
_URL = re.compile(r"[A-Za-z][A-Za-z0-9+.-]+:/")

BUSY_TIMEOUT_MS = 5000
"""How long a statement waits for another connection's lock before SQLite says "database
is locked" (raised as :class:`~memory.errors.StorageBusy` by writes)."""

IN_IDS = "IN (SELECT value FROM json_each(?))"
"""``column IN_IDS`` with :func:`id_list` as its one parameter: any number of ids, one query."""


def as_busy(exc: BaseException, path: str | Path) -> StorageBusy | None:
    """The retryable error for a write SQLite refused because another connection holds
    its lock past the busy timeout ("database is locked", "database is busy"), else
    ``None``."""
    text = str(exc).lower()
    if type(exc).__name__ != "OperationalError" or not ("locked" in text or "busy" in text):
        return None
    return StorageBusy(f"{path} is busy: another process held its write lock ({exc}); "
                       "nothing was written, try again")


def as_disk_full(exc: BaseException, path: str | Path) -> DiskFullError | None:
    """The one-line error for a write that failed because the disk is full, else ``None``.

    SQLite says "database or disk is full" when the disk has no space left (ENOSPC)
    and "disk I/O error" when a write fails otherwise (e.g. EFBIG, a file-size
    limit); either way it has rolled the transaction back, so what was committed
    before is intact, and the message says so.
    """
    text = str(exc).lower()
    if type(exc).__name__ != "OperationalError" or not (
        "disk is full" in text or "disk i/o error" in text
    ):
        return None
    folder = Path(path).expanduser().resolve().parent
    try:
        free = f"{shutil.disk_usage(folder).free / 2**20:.0f} MB free there"
    except OSError:
        free = "free space unknown"
    return DiskFullError(
        f"could not write {path} ({exc}; {free}): the disk is full or the file is at a "
        "size limit; the interrupted write was rolled back and everything stored before "
        "it is intact; free some space and run it again"
    )


def id_list(ids: Iterable[int]) -> str:
    """The parameter for :data:`IN_IDS`: the ids as a JSON array (SQLite reads them as int64)."""
    return json.dumps([int(i) for i in ids])


DIALECT = Dialect(name="sqlite", placeholder="?", one_of_ids=IN_IDS, id_param=id_list)
"""How SQLite spells what the engine-neutral SQL leaves open (:mod:`memory.storage.dialect`)."""


def _can_load_extensions(module: ModuleType) -> bool:
    try:
        conn = module.connect(":memory:")
    except Exception:  # pragma: no cover - a broken driver is just skipped
        return False
    try:
        conn.enable_load_extension(True)
        import sqlite_vec

        sqlite_vec.load(conn)
        return True
    except Exception as exc:
        log.debug("%s cannot load sqlite-vec: %s", module.__name__, exc)
        return False
    finally:
        conn.close()


def sqlite_driver() -> ModuleType:
    """Return the DB-API module (``sqlite3`` or ``pysqlite3.dbapi2``) that can load sqlite-vec.

    Raises:
        ExtensionLoadError: No available driver can load the extension.
    """
    global _driver
    if _driver is not None:
        return _driver
    try:
        import sqlite_vec  # noqa: F401
    except ImportError:
        raise ExtensionLoadError(
            "sqlite-vec is not installed: run `pip install sqlite-vec` in this environment"
        ) from None
    candidates: list[ModuleType] = [_stdlib_sqlite3]
    try:
        import pysqlite3.dbapi2 as pysqlite3

        candidates.append(pysqlite3)
    except ImportError:
        pass
    usable = [module for module in candidates
              if hasattr(module.Connection, "enable_load_extension") and _can_load_extensions(module)]
    # an SQLite that can erase deleted words from the keyword index (memory.storage.sqlite.scrub)
    # first: a database that uses it cannot be read by an older one
    usable.sort(key=lambda module: module.sqlite_version_info < FTS_SECURE_DELETE_SINCE)
    if usable:
        _driver = usable[0]
        log.debug("using %s (SQLite %s)", _driver.__name__, _driver.sqlite_version)
        return _driver
    raise ExtensionLoadError(
        "sqlite-vec could not be loaded: this Python's sqlite3 cannot load extensions. "
        "On x86-64 Linux install pysqlite3-binary (`pip install pysqlite3-binary`); it has "
        "no wheels for other platforms (Linux on ARM, macOS), where you need a Python "
        "whose sqlite3 loads extensions (python.org, Homebrew or conda builds, or one "
        "built with --enable-loadable-sqlite-extensions)."
    )


def refuse_url(path: str | Path) -> None:
    """Refuse an SQLite database given as a URL, which would become folders.

    A ``postgresql://`` URL opens the PostgreSQL engine instead
    (:func:`memory.storage.check_location` lets it through before this is asked).

    Raises:
        DatabaseFileError: ``path`` starts with ``scheme:/``.
    """
    if _URL.match(str(path)):
        raise DatabaseFileError(
            f"{path} is a URL, but only postgresql:// URLs name a database the bot can "
            "open; give an SQLite file path such as data/memory.sqlite3, or a "
            "postgresql://user@host/dbname URL"
        )


def connect(
    path: str | Path, *, check_same_thread: bool = False, read_only: bool | None = None
) -> Any:
    """Open ``path`` with sqlite-vec loaded, foreign keys on and a 5 s busy timeout.

    A new database (or one of this bot's) is switched to WAL journaling and
    ``secure_delete`` (deleted content is overwritten with zeros); any other
    SQLite file keeps its journal mode, so a foreign file is never changed.  A file
    this process cannot write (or whose folder it cannot write: WAL needs its side
    files) is opened read-only, so searches and stats still work: with SQLite's
    ``mode=ro`` where the WAL index can be opened, else (a read-only folder and no
    write-ahead log to lose) as an immutable snapshot.

    Args:
        path: Database file, or ``":memory:"``.
        check_same_thread: Passed to the driver; the database serialises access itself.
        read_only: Force read-only (True) or read-write (False); ``None`` decides by
            the file's permissions.

    Returns:
        A DB-API connection in autocommit mode (transactions are explicit).

    Raises:
        ExtensionLoadError: sqlite-vec cannot be loaded.
        DatabaseFileError: The path cannot be opened, is a URL or is not an SQLite database.
    """
    refuse_url(path)
    driver = sqlite_driver()
    if read_only is None:
        read_only = not_writable(path)
    if read_only:
        return _open_read_only(driver, Path(path), check_same_thread)
    try:
        if str(path) != ":memory:":
            Path(path).parent.mkdir(parents=True, exist_ok=True)
        conn = driver.connect(str(path), check_same_thread=check_same_thread,
                              isolation_level=None)
    except (OSError, driver.Error) as exc:
        raise DatabaseFileError(f"{path}: cannot open the database ({exc})") from exc
    _load_vec(conn)
    try:
        conn.execute(f"PRAGMA busy_timeout={BUSY_TIMEOUT_MS}")  # first: WAL switching waits for locks too
        # The first statement that reads the file: a non-SQLite file fails here.
        if _new_or_ours(conn):
            _set_wal(conn, driver)
            conn.execute("PRAGMA synchronous=NORMAL")
            # deleted rows and freed pages are overwritten with zeros, so forgotten
            # text does not linger in the file (FAST would leave it in freelist pages)
            conn.execute("PRAGMA secure_delete=ON")
        conn.execute("PRAGMA foreign_keys=ON")
    except driver.DatabaseError as exc:
        conn.close()
        raise _unusable(path, exc) from exc
    return conn


def _open_read_only(driver: ModuleType, path: Path, check_same_thread: bool) -> Any:
    """Open ``path`` read-only: ``mode=ro``, else an immutable snapshot (see :func:`connect`).

    ``mode=ro`` needs the WAL index (``-shm``): it opens when that file exists or the
    folder lets SQLite create it.  Otherwise the file is read as immutable, which
    is exact when no write-ahead log holds commits the file lacks; when one does,
    reading without it would silently miss them, so that is an error instead.
    """
    try:
        return _read_only_connection(driver, path, "mode=ro", check_same_thread)
    except driver.OperationalError as exc:
        wal = Path(f"{path}-wal")
        if not path.is_file() or os.access(path.resolve().parent, os.W_OK):
            raise DatabaseFileError(f"{path}: cannot open the database read-only ({exc})") from exc
        if wal.exists() and wal.stat().st_size > 0:
            raise DatabaseFileError(
                f"{path}: cannot be read here: this process may not write its folder, "
                f"and {wal.name} holds commits that SQLite reads only with write access "
                "to the folder (for its -shm index); open it once with write access, or "
                "copy the database with its -wal file somewhere writable"
            ) from exc
    log.info("%s: the folder is read-only; reading the file as an immutable snapshot", path)
    try:
        return _read_only_connection(driver, path, "immutable=1", check_same_thread)
    except driver.OperationalError as exc:
        raise DatabaseFileError(f"{path}: cannot open the database read-only ({exc})") from exc


def _read_only_connection(
    driver: ModuleType, path: Path, mode: str, check_same_thread: bool
) -> Any:
    """Connect to ``path`` with the URI parameter ``mode`` and read it once.

    Raises:
        DatabaseFileError: The file cannot be opened or is not an SQLite database.
        OperationalError: (the driver's) SQLite cannot set up reading (the WAL index).
    """
    uri = f"{path.resolve().as_uri()}?{mode}"
    try:
        conn = driver.connect(uri, uri=True, check_same_thread=check_same_thread,
                              isolation_level=None)
    except driver.Error as exc:
        raise DatabaseFileError(f"{path}: cannot open the database ({exc})") from exc
    try:
        _load_vec(conn)
        conn.execute(f"PRAGMA busy_timeout={BUSY_TIMEOUT_MS}")
        # the first read: a file that is not SQLite, or a WAL index that cannot open, fails here
        conn.execute("SELECT count(*) FROM sqlite_master").fetchone()
        conn.execute("PRAGMA foreign_keys=ON")
    except driver.OperationalError:
        conn.close()
        raise
    except driver.DatabaseError as exc:
        conn.close()
        raise _unusable(path, exc) from exc
    return conn


def check_ours(conn: Any, path: str | Path) -> None:
    """Refuse an SQLite file that another application made, before anything writes to it.

    Ours is empty (new) or holds this bot's ``meta`` and ``messages`` tables; a file
    with other tables is left exactly as it is, whatever its ``user_version`` says.

    Raises:
        DatabaseFileError: The file holds another application's tables.
    """
    if _new_or_ours(conn):
        return
    tables = sorted(_table_names(conn))
    shown = ", ".join(tables[:4]) + (", …" if len(tables) > 4 else "")
    raise DatabaseFileError(
        f"{path}: this SQLite file holds another application's tables ({shown}) and is not "
        "the memory bot's; it was left unchanged. Point --db at another file"
    )


def not_writable(path: str | Path) -> bool:
    """Whether ``path`` exists but this process cannot write it (or its folder's side files)."""
    if str(path) == ":memory:" or str(path).startswith("file:"):
        return False
    path = Path(path)
    if not path.exists():
        return False
    return not (os.access(path, os.W_OK) and os.access(path.resolve().parent, os.W_OK))


def _table_names(conn: Any) -> set[str]:
    return {row[0] for row in conn.execute("SELECT name FROM sqlite_master WHERE type = 'table'")}


def _new_or_ours(conn: Any) -> bool:
    """An empty database, or one holding this bot's tables (``meta`` and ``messages``)."""
    names = _table_names(conn)
    return not names or {"meta", "messages"} <= names


def _load_vec(conn: Any) -> None:
    import sqlite_vec

    conn.enable_load_extension(True)
    sqlite_vec.load(conn)
    conn.enable_load_extension(False)


def _unusable(path: str | Path, exc: BaseException) -> DatabaseFileError:
    return DatabaseFileError(
        f"{path}: not a usable SQLite database ({exc}); point --db at another file"
    )


def _set_wal(conn: Any, driver: Any, *, deadline_s: float = 10.0) -> None:
    """Switch to WAL, retrying while another process holds the lock it needs.

    Switching a new file to WAL takes an exclusive lock, and SQLite answers
    "database is locked" there without waiting on the busy timeout when several
    processes open the same new file at once.
    """
    give_up = time.monotonic() + deadline_s
    delay = 0.005
    while True:
        try:
            conn.execute("PRAGMA journal_mode=WAL")
            return
        except driver.OperationalError as exc:
            if "locked" not in str(exc) and "busy" not in str(exc):
                raise
            if time.monotonic() > give_up:
                raise
            time.sleep(delay)
            delay = min(delay * 2, 0.2)
