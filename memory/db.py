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
import sqlite3 as _stdlib_sqlite3
from collections.abc import Iterable
from pathlib import Path
from types import ModuleType
from typing import Any

from memory.errors import DatabaseFileError, ExtensionLoadError

log = logging.getLogger(__name__)

_driver: ModuleType | None = None

IN_IDS = "IN (SELECT value FROM json_each(?))"
"""``column IN_IDS`` with :func:`id_list` as its one parameter: any number of ids, one query."""


def id_list(ids: Iterable[int]) -> str:
    """The parameter for :data:`IN_IDS`: the ids as a JSON array (SQLite reads them as int64)."""
    return json.dumps([int(i) for i in ids])


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
    for module in candidates:
        if hasattr(module.Connection, "enable_load_extension") and _can_load_extensions(module):
            _driver = module
            log.debug("using %s (SQLite %s)", module.__name__, module.sqlite_version)
            return module
    raise ExtensionLoadError(
        "sqlite-vec could not be loaded: this Python's sqlite3 cannot load extensions. "
        "Install pysqlite3-binary (`pip install pysqlite3-binary`) or use a Python built "
        "with --enable-loadable-sqlite-extensions."
    )


def connect(path: str | Path, *, check_same_thread: bool = False) -> Any:
    """Open ``path`` with sqlite-vec loaded, WAL journaling and foreign keys on.

    Args:
        path: Database file, or ``":memory:"``.
        check_same_thread: Passed to the driver; the store serialises access itself.

    Returns:
        A DB-API connection in autocommit mode (transactions are explicit).

    Raises:
        ExtensionLoadError: sqlite-vec cannot be loaded.
        DatabaseFileError: The path cannot be opened or is not an SQLite database.
    """
    driver = sqlite_driver()
    try:
        if str(path) != ":memory:":
            Path(path).parent.mkdir(parents=True, exist_ok=True)
        conn = driver.connect(str(path), check_same_thread=check_same_thread, isolation_level=None)
    except (OSError, driver.Error) as exc:
        raise DatabaseFileError(f"{path}: cannot open the database ({exc})") from exc
    conn.enable_load_extension(True)
    import sqlite_vec

    sqlite_vec.load(conn)
    conn.enable_load_extension(False)
    try:
        # The first statement that reads the file: a non-SQLite file fails here.
        conn.execute("PRAGMA journal_mode=WAL")
        conn.execute("PRAGMA synchronous=NORMAL")
        conn.execute("PRAGMA foreign_keys=ON")
        conn.execute("PRAGMA busy_timeout=5000")
    except driver.DatabaseError as exc:
        conn.close()
        raise DatabaseFileError(
            f"{path}: not a usable SQLite database ({exc}); point --db at another file"
        ) from exc
    return conn
