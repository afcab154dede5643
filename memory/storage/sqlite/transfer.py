"""The SQLite end of ``migrate-db`` (:mod:`memory.storage.transfer`): the logical tables
read and written on one file.

Messages, names and windows go in as rows (``search_text``'s triggers fill the FTS5
tables); vectors go into vec0 with their 1-bit codes, counted in ``code_stats``, and
window vectors as they were computed — nothing is embedded or averaged again.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import numpy as np

from memory.storage.sqlite import SQLiteStorage
from memory.storage.sqlite.vectors import VECTOR_FIELDS, binary_code, count_codes, table_columns
from memory.storage.transfer import BOOLEANS, Table


class SQLiteEndpoint:
    """:class:`memory.storage.transfer.Endpoint` on an SQLite file."""

    def __init__(self, storage: SQLiteStorage) -> None:
        self.storage = storage
        self._db = storage.database

    def _vectors(self) -> bool:
        return bool(self._db.read("SELECT 1 FROM sqlite_master WHERE name = 'message_vectors'"))

    def count(self, table: Table) -> int:
        """Rows in ``table``."""
        if table.name == "message_vectors" and not self._vectors():
            return 0
        return int(self._db.read(f"SELECT count(*) FROM {table.name}")[0][0])

    def rows(self, table: Table, after: tuple | None, limit: int) -> list[tuple]:
        """Up to ``limit`` rows after ``after``, in key order (vectors as float32 bytes)."""
        if table.name == "message_vectors":
            return self._vector_rows(after, limit)
        keys = ", ".join(table.key)
        where = f"WHERE ({keys}) > ({', '.join('?' * len(table.key))})" if after else ""
        if after and len(table.key) == 1:
            where = f"WHERE {keys} > ?"
        return [tuple(row) for row in self._db.read(
            f"SELECT {', '.join(table.columns)} FROM {table.name} {where} ORDER BY {keys} LIMIT ?",
            [*(after or ()), limit])]

    def _vector_rows(self, after: tuple | None, limit: int) -> list[tuple]:
        """vec0 finds a row fast only by ``message_id = ?``: page the ids through ``messages``."""
        if not self._vectors():
            return []
        found: list[tuple] = []
        start = after[0] if after else -(2**63)
        while len(found) < limit:
            ids = [row[0] for row in self._db.read(
                "SELECT id FROM messages WHERE id > ? ORDER BY id LIMIT ?", (start, limit))]
            if not ids:
                break
            for mid in ids:
                found += [tuple(row) for row in self._db.read(
                    f"SELECT {VECTOR_FIELDS}, embedding FROM message_vectors WHERE message_id = ?",
                    (mid,))]
            start = ids[-1]
        return found[:limit]

    def write(self, table: Table, rows: Sequence[tuple], *, replace: bool = False) -> None:
        """Store ``rows`` in one transaction: keys already there are kept, or with
        ``replace`` overwritten (their old text leaves the file)."""
        if not rows:
            return
        rows = [_ints(table, row) for row in rows]
        with self._db.write() as conn, self._db.erasing(conn, _texts(table, rows, replace)):
            if replace:
                self._db.erased()
            if table.name == "message_vectors":
                if replace:
                    _delete_vectors(conn, [row[0] for row in rows])
                _write_vectors(conn, rows)
                return
            conn.executemany(_insert(table, replace), rows)

    def remove(self, table: Table, keys: Sequence[tuple]) -> None:
        """Delete rows by key for good; a message takes its index text, vector and
        window vector with it (the keyword index lets go of their words at once)."""
        if not keys:
            return
        with self._db.write() as conn, self._db.erasing(conn, _texts(table, keys, True)):
            self._db.erased()
            if table.name in ("messages", "message_vectors"):
                _delete_vectors(conn, [key[0] for key in keys])
            if table.name == "messages":
                for other in ("search_text", "window_vectors", "embedding_claims"):
                    conn.executemany(f"DELETE FROM {other} WHERE {_KEYS[other]} = ?", keys)
            if table.name != "message_vectors":
                where = " AND ".join(f"{k} = ?" for k in table.key)
                conn.executemany(f"DELETE FROM {table.name} WHERE {where}", keys)

    def prepare(self, vectors: int) -> None:
        """Nothing to put off: vec0 has no index to build."""

    def finish(self) -> None:
        """Nothing was put off."""


def _texts(table: Table, rows: Sequence[tuple], erasing: bool) -> int:
    """How many indexed texts a write erases (a large erase rebuilds the keyword index)."""
    return len(rows) if erasing and table.name in ("messages", "search_text") else 0


_KEYS = {"search_text": "id", "window_vectors": "id", "embedding_claims": "message_id"}


def _insert(table: Table, replace: bool) -> str:
    """The INSERT of ``table``'s rows (:meth:`Table.insert_sql`)."""
    return table.insert_sql(", ".join("?" * len(table.columns)), replace=replace)


def _ints(table: Table, row: tuple) -> tuple:
    return tuple(int(v) if c in BOOLEANS and v is not None else v for c, v in zip(table.columns, row))


def _delete_vectors(conn: Any, ids: Sequence[int]) -> None:
    """Delete these messages' vectors (where stored) and subtract their code bits."""
    if not table_columns(conn):
        return
    found = [row for mid in ids for row in conn.execute(
        "SELECT message_id, guild_id, embedding FROM message_vectors WHERE message_id = ?", (mid,))]
    count_codes(conn, ((g, np.frombuffer(blob, dtype=np.float32)) for _, g, blob in found), -1)
    conn.executemany("DELETE FROM message_vectors WHERE message_id = ?", [(row[0],) for row in found])


def _write_vectors(conn: Any, rows: Sequence[tuple]) -> None:
    if not table_columns(conn):
        raise ValueError("vectors before an embedding model is bound")
    fresh = [row for row in rows if not conn.execute(
        "SELECT 1 FROM message_vectors WHERE message_id = ?", (row[0],)).fetchone()]
    vectors = [np.frombuffer(bytes(row[6]), dtype=np.float32) for row in fresh]
    conn.executemany(
        f"INSERT INTO message_vectors({VECTOR_FIELDS}, embedding_bits, embedding) "
        "VALUES (?, ?, ?, ?, ?, ?, vec_bit(?), ?)",
        [(*row[:6], binary_code(vector), bytes(row[6])) for row, vector in zip(fresh, vectors)])
    count_codes(conn, ((row[1], vector) for row, vector in zip(fresh, vectors)))
