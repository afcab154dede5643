"""The PostgreSQL end of ``migrate-db`` (:mod:`memory.storage.transfer`).

Rows go in with ``ON CONFLICT DO NOTHING``; each page of ``search_text`` gets its
keyword documents and ``index_stats`` totals in the same transaction, each page of
vectors its per-guild count.  The HNSW index is dropped while vectors arrive and
built once at the end (:meth:`PostgresEndpoint.finish`): building it from all rows is
far cheaper than growing it row by row.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import numpy as np

from memory.storage.postgres import PostgresStorage, keywords, vectors, windows
from memory.storage.transfer import BOOLEANS, BY_NAME, Table


class PostgresEndpoint:
    """:class:`memory.storage.transfer.Endpoint` on a PostgreSQL database."""

    def __init__(self, storage: PostgresStorage) -> None:
        self.storage = storage
        self._db = storage.database

    def _vectors(self) -> bool:
        return bool(self._db.read("SELECT to_regclass('message_vectors') IS NOT NULL")[0][0])

    def _columns(self, table: Table) -> str:
        return ", ".join(
            f"{c}::int" if c in BOOLEANS else c for c in table.columns)

    def count(self, table: Table) -> int:
        """Rows in ``table``."""
        if table.name == "message_vectors" and not self._vectors():
            return 0
        return int(self._db.read(f"SELECT count(*) FROM {table.name}")[0][0])

    def rows(self, table: Table, after: tuple | None, limit: int) -> list[tuple]:
        """Up to ``limit`` rows after ``after``, in key order (0/1 for booleans, vectors
        as float32 bytes)."""
        if table.name == "message_vectors" and not self._vectors():
            return []
        keys = ", ".join(table.key)
        where = f"WHERE ({keys}) > ({', '.join(['%s'] * len(table.key))})" if after else ""
        if after and len(table.key) == 1:
            where = f"WHERE {keys} > %s"
        rows = self._db.read(
            f"SELECT {self._columns(table)} FROM {table.name} {where} ORDER BY {keys} LIMIT %s",
            [*(after or ()), limit])
        if table.name == "message_vectors":
            return [(*row[:6], vectors.vector_array(row[6]).tobytes()) for row in rows]
        if table.name == "window_vectors":
            return [(row[0], bytes(row[1])) for row in rows]
        return [tuple(row) for row in rows]

    def write(self, table: Table, rows: Sequence[tuple], *, replace: bool = False) -> None:
        """Store ``rows`` and what derives from them: keys already there are kept, or
        with ``replace`` overwritten (their keyword documents rewritten)."""
        if not rows:
            return
        if table.name == "message_vectors":
            rows = [(*row[:6], np.frombuffer(bytes(row[6]), dtype=np.float32)) for row in rows]
        with self._db.write() as conn:
            new = set()
            if table.name in ("search_text", "message_vectors"):
                keys = [row[0] for row in rows]
                known = {row[0] for row in conn.execute(
                    f"SELECT {table.key[0]} FROM {table.name} WHERE {table.key[0]} = ANY(%s)",
                    (keys,))}
                new = set(keys) - known
            conn.cursor().executemany(_insert(table, replace), rows)
            if table.name == "search_text":
                windows.index_rows(conn, [row for row in rows if replace or row[0] in new])
            elif table.name == "message_vectors":
                counts: dict[int, int] = {}
                for row in rows:
                    if row[0] in new:
                        counts[row[1]] = counts.get(row[1], 0) + 1
                vectors._count(conn, counts)

    def remove(self, table: Table, keys: Sequence[tuple]) -> None:
        """Delete rows by key for good; a message takes its index text, keyword
        documents, vector and window vector with it."""
        if not keys:
            return
        ids = [key[0] for key in keys]
        with self._db.write() as conn:
            if table.name in ("messages", "message_vectors"):
                _delete_vectors(conn, ids)
            if table.name in ("messages", "search_text"):
                conn.execute("DELETE FROM search_text WHERE id = ANY(%s)", (ids,))
                keywords.delete_documents(conn, ids)
            if table.name == "messages":
                conn.execute("DELETE FROM window_vectors WHERE id = ANY(%s)", (ids,))
                conn.execute("DELETE FROM embedding_claims WHERE message_id = ANY(%s)", (ids,))
            if table.name not in ("message_vectors", "search_text"):
                where = " AND ".join(f"{k} = %s" for k in table.key)
                conn.cursor().executemany(f"DELETE FROM {table.name} WHERE {where}", keys)

    def prepare(self, vectors: int | None = None) -> None:
        """Drop the HNSW index while most of ``vectors`` are still to arrive (nobody
        searches a copy in progress); a copy being brought up to date keeps it.
        ``None``: drop it whatever the table holds."""
        if not self._vectors():
            return
        if vectors is not None and self.count(BY_NAME["message_vectors"]) * 2 > vectors:
            return
        with self._db.write() as conn:
            for (name,) in conn.execute("SELECT indexname FROM pg_indexes WHERE tablename = "
                                        "'message_vectors' AND indexname LIKE 'message_vectors_hnsw_%%'",
                                        ()).fetchall():
                conn.execute(f"DROP INDEX {name}")

    def finish(self) -> None:
        """Build the HNSW index over every vector (where :meth:`prepare` dropped it)."""
        model = self.storage.meta.embedding_model()
        if model is None:
            return
        with self._db.write() as conn:
            vectors.create_index(conn, model[1], self.storage.vectors.index)


def _insert(table: Table, replace: bool) -> str:
    """The INSERT of ``table``'s rows (:meth:`Table.insert_sql`; flags travel as 0/1)."""
    return table.insert_sql(", ".join("%s::int::boolean" if c in BOOLEANS else "%s"
                                      for c in table.columns), replace=replace)


def _delete_vectors(conn: Any, ids: Sequence[int]) -> None:
    """Delete these messages' vectors (where stored) and count them out of ``index_stats``
    (the window vectors are copied, not recomputed)."""
    if not vectors.vector_table_exists(conn):
        return
    counts: dict[int, int] = {}
    for (guild_id,) in conn.execute("DELETE FROM message_vectors WHERE message_id = ANY(%s) "
                                    "RETURNING guild_id", (list(ids),)):
        counts[guild_id] = counts.get(guild_id, 0) - 1
    vectors._count(conn, counts)
