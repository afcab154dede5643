"""The vector side on PostgreSQL: pgvector's HNSW over the message vectors, window
vectors, and the similarity floor.

``message_vectors`` keeps each message's float32 vector (pgvector ``vector(d)``)
beside its guild, channel, author, creation time and attachment flag.  The KNN walks
an HNSW index with pgvector 0.8's *iterative index scan*: the filters are part of
the query, and the scan keeps walking the graph until ``k`` rows have passed them
(up to ``hnsw.max_scan_tuples``), so a filtered search still fills its page.  A
scope so narrow that the walk gives up early (a small channel in a large guild) is
searched exactly instead: the filtered rows by their B-tree indexes, every distance
computed.

What the HNSW graph is built over is :data:`INDEXES`' choice (``BENCHMARKS.md``
measures them): the float vectors themselves, their ``halfvec`` copies, or their
1-bit ``binary_quantize`` codes (Hamming distance); with a quantised index the
``k × rescore`` nearest candidates are ranked again by exact cosine from the float
vectors, as SQLite's 1-bit vec0 search does.
"""

from __future__ import annotations

import logging
import weakref
from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np

from memory.filters import Filters
from memory.storage.contract import EXACT_KNN_MAX
from memory.storage.postgres.connection import DIALECT
from memory.storage.postgres.database import PostgresDatabase
from memory.storage.postgres.filters import filter_sql
from memory.storage.postgres.windows import vector_table_exists, vectors_changed
from memory.storage.similarity import similarity_floor
from memory.storage.windows import stored_window_vectors

log = logging.getLogger(__name__)

VectorRow = tuple[int, int, int, int, int, bool, np.ndarray]
"""``(message_id, guild_id, channel_id, author_id, created_at, has_attachment, vector)``"""

MAX_EF_SEARCH = 1000  # pgvector's ceiling for hnsw.ef_search

GRAPH = "m = 24, ef_construction = 128"
"""How densely every HNSW graph is built (pgvector's defaults: ``m`` 16,
``ef_construction`` 64).  ``BENCHMARKS.md`` (1M messages in one guild): the default
graph's top-10 agreement with exact search stops near 0.89 however wide the walk; this
one reaches 0.96 at ``ef_search`` 1,000, for a build 3× as long.  Migration 4
rebuilds a graph an older version built."""


@dataclass(frozen=True)
class Index:
    """One way to build the HNSW graph: its expression, operator class and distance.

    ``expression`` and ``query`` use ``{d}`` for the dimension; ``query`` has one
    ``%s`` for the query vector.  ``exact``: its distances are the float cosine
    distances (no rescoring needed).
    """

    expression: str
    opclass: str
    query: str
    operator: str
    exact: bool


INDEXES = {
    "vector": Index("embedding", "vector_cosine_ops", "%s::vector", "<=>", True),
    "halfvec": Index("(embedding::halfvec({d}))", "halfvec_cosine_ops",
                     "%s::vector::halfvec({d})", "<=>", False),
    "bit": Index("(binary_quantize(embedding)::bit({d}))", "bit_hamming_ops",
                 "binary_quantize(%s::vector)::bit({d})", "<~>", False),
}
DEFAULT_INDEX = "halfvec"
"""The index a newly bound database gets (``BENCHMARKS.md``: recall and latency)."""


NEXT = "message_vectors_next"
"""The vector table ``reembed`` builds beside ``message_vectors`` (:mod:`.rebuild`)."""


def create_table(conn: Any, dimension: int, index: str = DEFAULT_INDEX) -> None:
    """Create ``message_vectors`` for ``dimension``-sized vectors with its HNSW index."""
    create_bare_table(conn, dimension)
    create_indexes(conn, dimension, index)


def create_bare_table(conn: Any, dimension: int, name: str = "message_vectors") -> None:
    """Create the vector table ``name`` without its indexes (but its primary key)."""
    conn.execute(
        f"CREATE TABLE IF NOT EXISTS {name} ("
        "message_id bigint PRIMARY KEY, guild_id bigint NOT NULL, channel_id bigint NOT NULL, "
        "author_id bigint NOT NULL, created_at bigint NOT NULL, has_attachment boolean NOT NULL, "
        f"embedding vector({int(dimension)}) NOT NULL)")


def create_indexes(conn: Any, dimension: int, index: str, name: str = "message_vectors") -> None:
    """Create the vector table ``name``'s B-tree indexes and its HNSW graph if missing."""
    conn.execute(f"CREATE INDEX IF NOT EXISTS {name}_by_guild ON {name}(guild_id, created_at)")
    conn.execute(f"CREATE INDEX IF NOT EXISTS {name}_by_channel ON {name}(channel_id)")
    create_index(conn, dimension, index, name)


def create_index(conn: Any, dimension: int, index: str, name: str = "message_vectors") -> None:
    """Build the HNSW index of kind ``index`` (:data:`INDEXES`) if it is missing."""
    spec = INDEXES[index]
    conn.execute(
        f"CREATE INDEX IF NOT EXISTS {name}_hnsw_{index} ON {name} "
        f"USING hnsw ({spec.expression.format(d=int(dimension))} {spec.opclass}) WITH ({GRAPH})")


def forget_next(conn: Any, ids: Sequence[int]) -> None:
    """Drop ``ids`` from the table ``reembed`` is building, if one is being built.

    Called whenever their vectors in ``message_vectors`` are written or deleted: a
    deleted message leaves both tables at once, and a changed one is embedded again
    (with the new model) before or just after the swap (:mod:`.rebuild`).
    """
    if ids and conn.execute("SELECT to_regclass(%s) IS NOT NULL", (NEXT,)).fetchone()[0]:
        conn.execute(f"DELETE FROM {NEXT} WHERE message_id = ANY(%s)", (list(ids),))


def vector_array(value: Any) -> np.ndarray:
    """A pgvector value (``Vector`` or an array) as float32."""
    return np.asarray(value.to_numpy() if hasattr(value, "to_numpy") else value, dtype=np.float32)


def write(conn: Any, rows: Sequence[VectorRow]) -> None:
    """Store (or replace) one vector per message inside the caller's transaction."""
    if not rows:
        return
    forget_next(conn, [row[0] for row in rows])
    previous = dict(conn.execute(
        "SELECT message_id, guild_id FROM message_vectors WHERE message_id = ANY(%s)",
        ([row[0] for row in rows],)).fetchall())
    conn.cursor().executemany(
        "INSERT INTO message_vectors(message_id, guild_id, channel_id, author_id, created_at, "
        "has_attachment, embedding) VALUES (%s, %s, %s, %s, %s, %s, %s) "
        "ON CONFLICT (message_id) DO UPDATE SET embedding = excluded.embedding, "
        "has_attachment = excluded.has_attachment",
        [(mid, g, c, a, t, bool(att), np.ascontiguousarray(v, dtype=np.float32))
         for mid, g, c, a, t, att, v in rows])
    counts: dict[int, int] = {}
    for row in rows:
        if row[0] not in previous:
            counts[row[1]] = counts.get(row[1], 0) + 1
    _count(conn, counts)
    vectors_changed(conn, [row[0] for row in rows])


def delete(conn: Any, ids: Sequence[int]) -> None:
    """Remove the vectors of ``ids`` (where present) inside the caller's transaction."""
    forget_next(conn, ids)
    if not ids or not vector_table_exists(conn):
        return
    found = conn.execute("DELETE FROM message_vectors WHERE message_id = ANY(%s) "
                         "RETURNING message_id, guild_id", (list(ids),)).fetchall()
    if not found:
        return
    counts: dict[int, int] = {}
    for _, guild_id in found:
        counts[guild_id] = counts.get(guild_id, 0) - 1
    _count(conn, counts)
    vectors_changed(conn, [row[0] for row in found])


def _count(conn: Any, counts: dict[int, int]) -> None:
    rows = sorted((g, n) for g, n in counts.items() if n)
    if rows:
        conn.cursor().executemany(
            "INSERT INTO index_stats AS s(guild_id, vectors) VALUES (%s, %s) ON CONFLICT "
            "(guild_id) DO UPDATE SET vectors = s.vectors + excluded.vectors", rows)


class PostgresVectorIndex:
    """The contract's ``VectorIndex`` on PostgreSQL (see the module).

    Args:
        database: The database.
        meta: Its meta (the bound model, the floor cache, :meth:`check_model_unchanged`).
    """

    def __init__(self, database: PostgresDatabase, meta: Any) -> None:
        self._db = database
        self._meta = meta
        # each pooled connection's hnsw.ef_search, as this index last set it
        self._effort: weakref.WeakKeyDictionary[Any, int] = weakref.WeakKeyDictionary()

    @property
    def index(self) -> str:
        """Which of :data:`INDEXES` searches run on (what the database was bound with)."""
        return self._meta.get("vector_index") or DEFAULT_INDEX

    def knn(
        self, vector: np.ndarray, k: int, filters: Filters, *, rescore: int = 4,
        index: str | None = None,
    ) -> list[tuple[int, float]]:
        """Return up to ``k`` ``(message_id, cosine_similarity)`` pairs, best first.

        A quantised index fetches ``k × rescore`` candidates and ranks them by exact
        cosine; the float index ranks by exact cosine already.  Either way the HNSW
        walk keeps ``k × rescore`` (at least 40, at most 1000) candidates in view
        (``hnsw.ef_search``), and a fetch of more goes on walking (the iterative scan):
        ``rescore`` buys recall with time.  ``index`` (for
        ``bench``) searches another of :data:`INDEXES` built beside the default.  A
        guild of at most :data:`~memory.storage.contract.EXACT_KNN_MAX` vectors is
        searched exactly, by every distance.
        """
        model = self._meta.embedding_model()
        if model is None:
            return []
        self._meta.check_model_unchanged()
        clauses: list[str] = []
        params: list[Any] = []
        filter_sql(filters, "", clauses, params)
        spec = INDEXES[index or self.index]
        k = max(1, int(k))
        fetch = k if spec.exact else k * max(1, int(rescore))
        query = np.ascontiguousarray(vector, dtype=np.float32)
        try:
            if self.count(filters.guild_id) <= EXACT_KNN_MAX:  # a small guild: every distance
                rows = self._exact(query, k, clauses, params)
            else:
                effort = min(MAX_EF_SEARCH, max(40, k * max(1, int(rescore))))
                rows = self._hnsw(query, fetch, effort, spec, model[1], clauses, params)
                if len(rows) < fetch:  # the walk gave up before the filters let enough through
                    rows = self._exact(query, fetch, clauses, params)
        except Exception:
            self._meta.check_model_unchanged()  # re-embedded between the check and the query
            raise
        rows.sort(key=lambda row: (row[1], row[0]))
        return [(mid, 1.0 - float(distance)) for mid, distance in rows[:k]]

    def _hnsw(self, query: np.ndarray, fetch: int, effort: int, spec: Index, dimension: int,
              clauses: list[str], params: list[Any]) -> list[tuple[int, float]]:
        where = " AND ".join(clauses) or "TRUE"
        order = f"{spec.expression.format(d=dimension)} {spec.operator} " \
                f"{spec.query.format(d=dimension)}"
        sql = (f"WITH near AS MATERIALIZED (SELECT message_id, embedding FROM message_vectors "
               f"WHERE {where} ORDER BY {order} LIMIT %s) "
               "SELECT message_id, embedding <=> %s::vector FROM near")
        with self._db.session() as conn:
            # a session setting, sent only when it changes: a search costs one round trip
            if self._effort.get(conn) != effort:
                conn.execute(f"SET hnsw.ef_search = {int(effort)}")
                self._effort[conn] = effort
            return [(row[0], float(row[1])) for row in
                    conn.execute(sql, [*params, query, fetch, query]).fetchall()]

    def _exact(self, query: np.ndarray, fetch: int, clauses: list[str],
               params: list[Any]) -> list[tuple[int, float]]:
        where = " AND ".join(clauses) or "TRUE"
        rows = self._db.read_beside(
            f"WITH scope AS MATERIALIZED (SELECT message_id, embedding FROM message_vectors "
            f"WHERE {where}) SELECT message_id, embedding <=> %s::vector AS d FROM scope "
            "ORDER BY d LIMIT %s", [*params, query, fetch])
        return [(row[0], float(row[1])) for row in rows]

    def window_vectors(self, ids: Sequence[int], *, beside: bool = False) -> dict[int, np.ndarray]:
        """The window vector of each of ``ids`` that has one: its window's mean, unit length."""
        if not ids:
            return {}
        return stored_window_vectors(self._db.read_beside(
            "SELECT id, vector FROM window_vectors WHERE id = ANY(%s)", (list(ids),)))

    def floats(self, ids: Iterable[int]) -> dict[int, np.ndarray]:
        """The stored vectors of those of ``ids`` that have one, as float32."""
        ids = list(ids)
        if not ids or self._meta.embedding_model() is None:
            return {}
        return {mid: vector_array(vector) for mid, vector in self._db.read_beside(
            "SELECT message_id, embedding FROM message_vectors WHERE message_id = ANY(%s)", (ids,))}

    def damage(self) -> str | None:
        """Why the vector index cannot be used whole, or ``None``: the table or its HNSW
        graph is missing while a model is bound (PostgreSQL checks its own pages)."""
        if self._meta.embedding_model() is None:
            return None
        index = self._meta.get("vector_index") or DEFAULT_INDEX
        missing = [name for name in ("message_vectors", f"message_vectors_hnsw_{index}")
                   if self._db.read("SELECT to_regclass(%s) IS NULL", (name,))[0][0]]
        return f"missing: {', '.join(missing)}" if missing else None

    def count(self, guild_id: int | None = None) -> int:
        """How many messages have a vector (in one guild, or in all)."""
        where, params = ("WHERE guild_id = %s", [guild_id]) if guild_id is not None else ("", [])
        return int(self._db.read(f"SELECT coalesce(sum(vectors), 0) FROM index_stats {where}",
                                 params)[0][0])

    def similarity_floor(self, guild_id: int | None, quantile: float) -> float | None:
        """The cosine similarity that random pairs of a guild's messages reach at ``quantile``
        (:func:`memory.storage.similarity.similarity_floor`; cached in ``meta``)."""
        return similarity_floor(self._db, self._meta, DIALECT, guild_id=guild_id,
                                quantile=quantile, count=self.count(guild_id), floats=self.floats)
