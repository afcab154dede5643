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

from memory.storage.postgres import PostgresStorage, vectors, windows
from memory.storage.transfer import BOOLEANS, Table


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

    def last_key(self, table: Table) -> tuple | None:
        """The greatest key in ``table``."""
        if table.name == "message_vectors" and not self._vectors():
            return None
        order = ", ".join(f"{k} DESC" for k in table.key)
        rows = self._db.read(f"SELECT {', '.join(table.key)} FROM {table.name} ORDER BY {order} LIMIT 1")
        return tuple(rows[0]) if rows else None

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

    def write(self, table: Table, rows: Sequence[tuple]) -> None:
        """Insert ``rows`` (keys already there are kept) and what derives from them."""
        if not rows:
            return
        values = ", ".join("%s::int::boolean" if c in BOOLEANS else "%s" for c in table.columns)
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
            conn.cursor().executemany(
                f"INSERT INTO {table.name}({', '.join(table.columns)}) VALUES ({values}) "
                "ON CONFLICT DO NOTHING", rows)
            if table.name == "search_text":
                _index_documents(conn, [row for row in rows if row[0] in new])
            elif table.name == "message_vectors":
                counts: dict[int, int] = {}
                for row in rows:
                    if row[0] in new:
                        counts[row[1]] = counts.get(row[1], 0) + 1
                vectors._count(conn, counts)

    def prepare(self) -> None:
        """Drop the HNSW index while vectors arrive (nobody searches a copy in progress)."""
        if not self._vectors():
            return
        with self._db.write() as conn:
            for (name,) in conn.execute("SELECT indexname FROM pg_indexes WHERE tablename = "
                                        "'message_vectors' AND indexname LIKE 'message_vectors_hnsw_%%'",
                                        ()).fetchall():
                conn.execute(f"DROP INDEX {name}")

    def finish(self) -> None:
        """Build the HNSW index over every vector."""
        model = self.storage.meta.embedding_model()
        if model is None:
            return
        with self._db.write() as conn:
            vectors.create_index(conn, model[1], self.storage.vectors.index)


def _index_documents(conn: Any, rows: Sequence[tuple]) -> None:
    """The keyword documents of copied ``search_text`` rows (their messages are copied)."""
    if not rows:
        return
    places = {row[0]: row[1:] for row in conn.execute(
        "SELECT id, channel_id, created_at, reply_to_id, guild_id, author_id, attachments "
        "FROM messages WHERE id = ANY(%s)", ([row[0] for row in rows],))}
    changed = []
    for row in rows:
        if row[0] not in places:
            continue
        channel, created, reply, guild, author, attachments = places[row[0]]
        message = windows._Row(row[0], channel, created, "", "", row[2], attachments, reply,
                               guild, author)
        changed.append(((row[0], row[1], row[2], row[3], row[4], row[5], bool(row[6])), message))
    windows._write_documents(conn, changed)
