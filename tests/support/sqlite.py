"""Looking at an SQLite database file itself, beside the storage contract.

A test that must check what the contract does not say (file bytes, a migration's
tables, what an older version wrote) opens its own connection here, never a storage
object's private one.
"""

from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path
from typing import Any

from memory.storage.sqlite.connection import connect


def sql_rows(location: str | Path, sql: str, params: Sequence[Any] = ()) -> list[tuple]:
    """Rows of one read of the SQLite file at ``location``, on a connection of its own."""
    conn = connect(location, read_only=True)
    try:
        return conn.execute(sql, params).fetchall()
    finally:
        conn.close()


def sql_write(location: str | Path, *statements: str) -> None:
    """Run ``statements`` on the SQLite file at ``location`` in one transaction of their own
    (what another process, or an older version of the bot, would have written)."""
    conn = connect(location)
    try:
        conn.execute("BEGIN IMMEDIATE")
        for statement in statements:
            conn.execute(statement)
        conn.execute("COMMIT")
    finally:
        conn.close()
