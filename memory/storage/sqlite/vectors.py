"""The vector side of the SQLite engine: the vec0 table, its 1-bit KNN, the code
statistics and the window vectors.  The only module that knows vec0's internals.

Each message's vector is kept twice in one sqlite-vec ``vec0`` row: as a 1-bit code
(one bit per dimension) that the KNN searches by Hamming distance, and as the float
vector that ranks the candidates by exact cosine.  At 100k messages that is several
times faster than sqlite-vec's float scan (BENCHMARKS.md).  Filters that a search
must honour are vec0 metadata and partition columns, so they apply inside the KNN
rather than after its top-k.

``code_stats`` keeps, per guild, how many codes have each bit set; it lets
:class:`_RadiusMemory` guess how far a search must look.  The counts are exact:
every write adds its codes, and every delete or replacement subtracts them.

``window_vectors`` keeps each conversational window's mean vector (float16, unit
length; :mod:`memory.storage.sqlite.windows` says which messages a window holds and
when it changes).  :class:`Vec0Table` is the table itself, written inside the
callers' transactions; :class:`SQLiteVectorIndex` is the contract's ``VectorIndex``
over it.
"""

from __future__ import annotations

import functools
import json
import logging
import threading
from collections import deque
from collections.abc import Callable, Iterable, Iterator, Sequence
from contextlib import contextmanager
from typing import TYPE_CHECKING, Any

import numpy as np

from memory.errors import VectorIndexDamaged
from memory.filters import Filters
from memory.storage.contract import EXACT_KNN_MAX
from memory.storage.similarity import similarity_floor
from memory.storage.sqlite.connection import (
    DIALECT,
    IN_IDS,
    as_busy,
    as_disk_full,
    connect,
    id_list,
    sqlite_driver,
)
from memory.storage.sqlite.filters import filter_sql
from memory.storage.windows import stored_window_vectors

if TYPE_CHECKING:
    from memory.storage.sqlite.database import SQLiteDatabase
    from memory.storage.sqlite.meta import SQLiteMeta

log = logging.getLogger(__name__)

# vec0 answers `message_id IN (...)` by scanning the whole table (30 ms at 100k
# messages) but `message_id = ?` by its primary key (0.02 ms): up to this many ids
# are looked up one by one
POINT_LOOKUPS_MAX = 1000

MAX_KNN_K = 4096  # sqlite-vec's upper bound for k
VECTOR_FIELDS = "message_id, guild_id, channel_id, author_id, created_at, has_attachment"

Query = Callable[[str, Sequence[Any]], list[tuple]]
OnChange = Callable[[Any, Sequence[int]], None]
"""Called inside the writing transaction with the ids whose vectors were stored or deleted."""
VectorRow = tuple[int, int, int, int, int, bool, np.ndarray]
"""What :meth:`Vec0Table.write` stores per message: its id, guild, channel, author,
creation time, whether it has attachments, and its vector."""


NEXT = "message_vectors_next"
"""The vector table ``reembed`` builds beside ``message_vectors`` (:mod:`.rebuild`)."""


def vector_table_sql(dimension: int, name: str = "message_vectors") -> str:
    """The vector table: a 1-bit code to search by, the float vector to rank by, filters."""
    bits = -(-int(dimension) // 8) * 8  # whole bytes; padding bits are 0 in every code
    return f"""CREATE VIRTUAL TABLE IF NOT EXISTS {name} USING vec0(
        message_id INTEGER PRIMARY KEY,
        embedding_bits bit[{bits}],
        guild_id INTEGER PARTITION KEY,
        channel_id INTEGER,
        author_id INTEGER,
        created_at INTEGER,
        has_attachment INTEGER,
        +embedding BLOB
    )"""


def binary_code(vector: np.ndarray) -> bytes:
    """The 1-bit code of a vector: one bit per dimension, set where the value is positive.

    Bit order matches sqlite-vec's ``vec_quantize_binary`` (least significant first).
    """
    return np.packbits(np.asarray(vector) > 0, bitorder="little").tobytes()


def shadow_table_readable(query: Query) -> bool:
    """Whether vec0 keeps the ``+embedding`` floats in a shadow table readable by rowid."""
    return bool(query(
        "SELECT 1 FROM pragma_table_info('message_vectors_auxiliary') WHERE name = 'value00'", ()
    ))


def read_floats(query: Query, ids: Iterable[int], *, auxiliary: bool) -> dict[int, np.ndarray]:
    """The stored float vectors of ``ids`` that have one (see :meth:`Vec0Table.floats`)."""
    ids = list(ids)
    if not ids:
        return {}
    sql = (
        f"SELECT rowid, value00 FROM message_vectors_auxiliary WHERE rowid {IN_IDS}"
        if auxiliary else
        f"SELECT message_id, embedding FROM message_vectors WHERE message_id {IN_IDS}"
    )
    return {mid: np.frombuffer(blob, dtype=np.float32) for mid, blob in query(sql, (id_list(ids),))}


def table_columns(conn: Any) -> set[str]:
    """The columns of ``message_vectors`` (empty when the table does not exist)."""
    return {row[1] for row in conn.execute("PRAGMA table_info(message_vectors)")}


def drop_vector_table(conn: Any, name: str) -> None:
    """Drop the vec0 table ``name`` inside the caller's transaction, whatever state its
    shadow tables are in.

    vec0 refuses to drop a table one of whose shadow tables is missing, and when
    dropping one fails (a full disk, a file-size limit) it reports only "SQL logic
    error".  So each shadow table is dropped first by a plain ``DROP TABLE`` (whose
    errors say what happened: :func:`~.connection.as_disk_full` recognises them) and
    left as an empty stand-in, which vec0's own drop then removes.
    """
    if not conn.execute("SELECT 1 FROM sqlite_master WHERE name = ?", (name,)).fetchone():
        return
    for suffix in _shadow_suffixes():
        conn.execute(f'DROP TABLE IF EXISTS "{name}{suffix}"')
        conn.execute(f'CREATE TABLE "{name}{suffix}"(x)')
    conn.execute(f"DROP TABLE {name}")


@functools.cache
def _shadow_suffixes() -> tuple[str, ...]:
    """What vec0 appends to a table's name to name its shadow tables (``_rowids``, …),
    read from a probe table in a database of its own."""
    probe = connect(":memory:")
    try:
        probe.execute(vector_table_sql(8, "probe"))
        names = [row[0] for row in probe.execute(
            "SELECT name FROM sqlite_master WHERE type = 'table' AND name LIKE 'probe_%'")]
    finally:
        probe.close()
    return tuple(name[len("probe"):] for name in names)


def missing_tables(query: Query, name: str = "message_vectors") -> list[str]:
    """The tables of the vec0 table ``name`` (itself and its shadow tables) that are gone.

    sqlite-vec 0.1.9 crashes the process (a segmentation fault) when a row is looked
    up by id in a table whose ``_rowids`` shadow table is gone, so writes ask first.
    """
    wanted = [f"{name}{suffix}" for suffix in ("", *_shadow_suffixes())]
    present = {row[0] for row in query(
        "SELECT name FROM sqlite_master WHERE name IN (SELECT value FROM json_each(?))",
        (json.dumps(wanted),))}
    return [table for table in wanted if table not in present]


def forget_next(conn: Any, ids: Sequence[int]) -> None:
    """Drop ``ids`` from the table ``reembed`` is building, if one is being built.

    Called whenever their vectors in ``message_vectors`` are written or deleted: a
    deleted message leaves both tables at once, and a changed one is embedded again
    (with the new model) before or just after the swap (:mod:`.rebuild`).
    """
    if ids and conn.execute("SELECT 1 FROM sqlite_master WHERE name = ?", (NEXT,)).fetchone():
        conn.executemany(f"DELETE FROM {NEXT} WHERE message_id = ?", [(i,) for i in ids])


def insert_vectors(conn: Any, name: str, rows: Sequence[VectorRow]) -> None:
    """Insert one row per message into the vec0 table ``name`` (none of them is there yet)."""
    conn.executemany(
        f"INSERT INTO {name}({VECTOR_FIELDS}, embedding_bits, embedding) "
        "VALUES (?, ?, ?, ?, ?, ?, vec_bit(?), ?)",
        [
            (mid, guild, channel, author, created, int(attached),
             binary_code(vec), np.ascontiguousarray(vec, dtype=np.float32).tobytes())
            for mid, guild, channel, author, created, attached, vec in rows
        ],
    )


def count_codes(conn: Any, vectors: Iterable[tuple[int, np.ndarray]], sign: int = 1) -> None:
    """Add (``sign`` 1) or subtract (-1) each ``(guild_id, vector)``'s code bits in ``code_stats``."""
    totals: dict[int, tuple[int, np.ndarray]] = {}
    for guild_id, vector in vectors:
        count, ones = totals.get(guild_id, (0, np.zeros(len(vector), dtype=np.int64)))
        totals[guild_id] = (count + 1, ones + (vector > 0))
    for guild_id, (count, ones) in totals.items():
        count, ones = sign * count, sign * ones
        row = conn.execute(
            "SELECT vectors, ones FROM code_stats WHERE guild_id = ?", (guild_id,)
        ).fetchone()
        if row is not None and len(row[1]) == ones.nbytes:
            count += row[0]
            ones = ones + np.frombuffer(row[1], dtype=np.int64)
        if count <= 0:
            conn.execute("DELETE FROM code_stats WHERE guild_id = ?", (guild_id,))
            continue
        conn.execute(
            "INSERT INTO code_stats(guild_id, vectors, ones) VALUES (?, ?, ?) ON CONFLICT"
            "(guild_id) DO UPDATE SET vectors = excluded.vectors, ones = excluded.ones",
            (guild_id, count, np.maximum(ones, 0).tobytes()),
        )


def upgrade_float_table(conn: Any) -> None:
    """Move a first-release vector table (a float vec0 column) to 1-bit codes + floats.

    vec0 tables cannot be altered or renamed, so the rows go through a temporary
    copy inside the caller's transaction; no vector is recomputed.  A database
    without vectors, or already upgraded, is left as it is.
    """
    columns = table_columns(conn)
    row = conn.execute("SELECT value FROM meta WHERE key = 'embedding_dim'").fetchone()
    if not columns or "embedding_bits" in columns or row is None:
        return
    log.info("moving the vectors to 1-bit vector search (one-off)")
    conn.execute(
        f"CREATE TEMP TABLE vectors_copy AS SELECT {VECTOR_FIELDS}, embedding FROM message_vectors"
    )
    conn.execute("DROP TABLE message_vectors")
    conn.execute(vector_table_sql(int(row[0])))
    copied = conn.execute(f"SELECT {VECTOR_FIELDS}, embedding FROM temp.vectors_copy")
    conn.executemany(
        f"INSERT INTO message_vectors({VECTOR_FIELDS}, embedding, embedding_bits) "
        "VALUES (?, ?, ?, ?, ?, ?, ?, vec_bit(?))",
        ((*row, binary_code(np.frombuffer(row[-1], dtype=np.float32))) for row in copied),
    )
    conn.execute("DELETE FROM code_stats")  # recounted from every vector
    count_codes(conn, (
        (guild_id, np.frombuffer(blob, dtype=np.float32))
        for guild_id, blob in conn.execute("SELECT guild_id, embedding FROM temp.vectors_copy")
    ))
    conn.execute("DROP TABLE temp.vectors_copy")


def read_window_vectors(query: Query, ids: Sequence[int]) -> dict[int, np.ndarray]:
    """The stored window vectors of those of ``ids`` that have one, as float32."""
    if not ids:
        return {}
    return stored_window_vectors(
        query(f"SELECT id, vector FROM window_vectors WHERE id {IN_IDS}", (id_list(ids),)))


class _RadiusMemory:
    """Guesses how far, in Hamming bits, a search's k-th nearest 1-bit code lies.

    sqlite-vec 0.1.9 picks each 1024-code chunk's top k with up to k linear passes,
    so a KNN for k = 200 over 100k codes spends more time selecting than measuring.
    A ``distance <= radius`` constraint drops far codes before that selection, and
    the tighter the radius the cheaper the search.

    The guess starts from the query's expected distance to a stored code (from
    the guild's bit frequencies, ``code_stats``): queries near the bulk of the
    codes have near neighbours.  Earlier searches with the same filters (for new
    filters: the guild's unfiltered searches) tell how far below that expectation
    the k-th code lay; the guess takes a high percentile of those offsets.  A
    search that finds fewer than k within it widens the radius and runs again,
    the last try without any constraint, so a wrong guess costs time, never results.
    """

    def __init__(self, history: int = 32, percentile: float = 80.0, max_keys: int = 256) -> None:
        self._history = history
        self._percentile = percentile
        self._max_keys = max_keys
        self._offsets: dict[tuple[Filters, int], deque[float]] = {}
        self._small: set[tuple[Filters, int]] = set()  # scopes with fewer rows than wanted
        self._lock = threading.Lock()

    def search(
        self,
        run: Callable[[int | None], list[tuple]],
        *,
        key: tuple[Filters, int],
        want: int,
        bits: int,
        expected: float = 0.0,
    ) -> list[tuple]:
        """Call ``run(radius)`` until it returns ``want`` rows; at most four tries.

        Later tries widen the guess by one, then three spreads of the offsets
        seen (their 95th minus 50th percentile); the last has no limit.
        ``run`` returns rows nearest first with the Hamming distance at index 1;
        ``expected`` is the query's mean distance to a stored code (0 if unknown).
        A scope that held fewer than ``want`` rows is searched without a limit
        next time, at once (it is small, so that is cheap).
        """
        radius, spread = self._guess(key, expected)
        tries: list[int | None] = [None]
        if radius is not None:
            tries = [radius, radius + spread, radius + 3 * spread, None]
        rows: list[tuple] = []
        for limit in tries:
            if limit is not None and limit >= bits:
                continue
            rows = run(limit)
            if len(rows) >= want:
                self._remember(key, rows[want - 1][1] - expected)
                break
        else:
            with self._lock:
                self._small.add(key)
        return rows

    def _guess(self, key: tuple[Filters, int], expected: float) -> tuple[int | None, int]:
        filters, want = key
        with self._lock:
            if key in self._small:
                return None, 0
            seen = self._offsets.get(key) or self._offsets.get(
                (Filters(guild_id=filters.guild_id), want)
            )
            if not seen:
                return None, 0
            offsets = np.fromiter(seen, dtype=np.float64)
        radius = int(np.ceil(expected + np.percentile(offsets, self._percentile)))
        spread = np.percentile(offsets, 95) - np.percentile(offsets, 50)
        return max(radius, 0), max(2, int(np.ceil(spread)))

    def _remember(self, key: tuple[Filters, int], offset: float) -> None:
        with self._lock:
            self._small.discard(key)
            if key not in self._offsets and len(self._offsets) >= self._max_keys:
                self._offsets.clear()
                self._small.clear()
            self._offsets.setdefault(key, deque(maxlen=self._history)).append(offset)


class Vec0Table:
    """The ``message_vectors`` table and ``code_stats`` of one database.

    Reads go through ``query`` (the database's locked reader); writes take the
    connection of a transaction the caller holds, so a message and its vector
    change together.

    Args:
        query: Runs one read-only statement and returns its rows.
        on_change: Told which messages' vectors each write or delete changed
            (the window vectors are kept in step with them).
    """

    def __init__(self, query: Query, on_change: OnChange | None = None) -> None:
        self._query = query
        self._on_change = on_change or (lambda conn, ids: None)
        self._radii = _RadiusMemory()
        self._auxiliary: bool | None = None  # vec0's float shadow table is readable

    def exists(self) -> bool:
        """Whether the vector table exists (an embedding model was bound)."""
        return bool(self._query("SELECT 1 FROM pragma_table_info('message_vectors')", ()))

    # -- writes (inside the caller's transaction) --------------------------------------

    def create(self, conn: Any, dimension: int) -> None:
        """Create the table for vectors of ``dimension`` and forget learned radii."""
        conn.execute(vector_table_sql(dimension))
        self._radii = _RadiusMemory()  # distances learned under another model mean nothing
        self._auxiliary = None

    @staticmethod
    def drop(conn: Any) -> None:
        """Drop every vector (and any table ``reembed`` was building), every code count
        and every window vector."""
        drop_vector_table(conn, "message_vectors")
        drop_vector_table(conn, NEXT)
        conn.execute("DELETE FROM code_stats")
        conn.execute("DELETE FROM window_vectors")

    def write(self, conn: Any, rows: Sequence[VectorRow]) -> None:
        """Store (or replace) one vector per message and count its code bits.

        A damaged table is dropped first (:meth:`_discard_damaged`).
        """
        self.delete(conn, [row[0] for row in rows])  # vec0 has no INSERT OR REPLACE
        try:
            insert_vectors(conn, "message_vectors", rows)
        except sqlite_driver().DatabaseError as exc:
            self._discard_damaged(conn, exc)
            insert_vectors(conn, "message_vectors", rows)
        count_codes(conn, ((row[1], row[6]) for row in rows))
        self._on_change(conn, [row[0] for row in rows])

    def delete(self, conn: Any, ids: Sequence[int]) -> None:
        """Remove the vectors of ``ids`` (where present) and subtract their code bits.

        The table ``reembed`` is building (if any) loses them too (:func:`forget_next`).
        A damaged table is dropped whole instead (:meth:`_discard_damaged`): a
        deletion or an edit never fails for it.
        """
        forget_next(conn, ids)
        if not ids or not table_columns(conn):
            return
        try:
            if missing := missing_tables(lambda sql, p: conn.execute(sql, p).fetchall()):
                raise sqlite_driver().DatabaseError(f"missing tables: {', '.join(missing)}")
            self._delete(conn, ids)
        except (sqlite_driver().DatabaseError, ValueError) as exc:
            self._discard_damaged(conn, exc)

    def _discard_damaged(self, conn: Any, exc: BaseException) -> None:
        """Drop a vec0 table that refused a write, inside the caller's transaction, and
        create it again empty; every message is embedded again by the backlog.

        What the damaged table held cannot be deleted row by row, but a deleted
        message's vector must go and a member's edit must be stored: so every vector
        goes.  A full disk or another process's lock is not damage and is raised.
        """
        if as_busy(exc, "") or as_disk_full(exc, "") or not isinstance(
                exc, (sqlite_driver().DatabaseError, ValueError)):
            raise exc
        row = conn.execute("SELECT value FROM meta WHERE key = 'embedding_dim'").fetchone()
        if row is None:
            raise exc
        log.warning("the vector index is damaged (%s): every vector is dropped and every "
                    "message waits to be embedded again", exc)
        drop_vector_table(conn, "message_vectors")
        conn.execute("DELETE FROM code_stats")
        conn.execute("DELETE FROM window_vectors")
        self.create(conn, int(row[0]))
        conn.execute("UPDATE messages SET embedded = 0 WHERE embedded = 1")

    def _delete(self, conn: Any, ids: Sequence[int]) -> None:
        found = conn.execute(
            f"SELECT message_id, guild_id, embedding FROM message_vectors WHERE message_id {IN_IDS}",
            (id_list(ids),),
        ).fetchall() if len(ids) > POINT_LOOKUPS_MAX else [
            row for mid in dict.fromkeys(ids) for row in conn.execute(
                "SELECT message_id, guild_id, embedding FROM message_vectors WHERE message_id = ?",
                (mid,))
        ]
        if not found:
            return
        count_codes(conn, ((g, np.frombuffer(blob, dtype=np.float32)) for _, g, blob in found), -1)
        conn.executemany(
            "DELETE FROM message_vectors WHERE message_id = ?", [(row[0],) for row in found]
        )
        self._on_change(conn, [row[0] for row in found])

    # -- reads -------------------------------------------------------------------------

    def damage(self, dimension: int) -> str | None:
        """Why the table cannot be read whole, or ``None`` when every part of it reads.

        A shadow table that is gone, a chunk of codes or of filter columns that
        does not read, or a float vector of the wrong size.
        """
        missing = missing_tables(self._query)
        if missing:
            return f"missing tables: {', '.join(missing)}"
        try:  # every code and every filter column read once
            self._query("SELECT count(*) FROM message_vectors", ())
            self._query(
                "SELECT message_id FROM message_vectors WHERE embedding_bits MATCH vec_bit(?) "
                "AND k = 1 AND channel_id != 0 AND author_id != 0 AND created_at != -1 "
                "AND has_attachment != 2", (binary_code(np.zeros(dimension)),))
            wrong = self._query(
                "SELECT count(*) FROM message_vectors_auxiliary WHERE length(value00) != ?",
                (dimension * 4,))[0][0] if shadow_table_readable(self._query) else 0
        except sqlite_driver().DatabaseError as exc:
            return str(exc)
        return f"{wrong} float vectors of the wrong size" if wrong else None

    def expected_distance(self, code_bits: np.ndarray, guild_id: int | None) -> float:
        """Mean Hamming distance from a code to the guild's stored codes (0 if unknown)."""
        rows = self._query(
            "SELECT vectors, ones FROM code_stats"
            + (" WHERE guild_id = ?" if guild_id is not None else ""),
            () if guild_id is None else (guild_id,),
        )
        rows = [r for r in rows if len(r[1]) == code_bits.size * 8]
        total = sum(r[0] for r in rows)
        if not total:
            return 0.0
        ones = sum(np.frombuffer(r[1], dtype=np.int64) for r in rows) / total
        return float(np.where(code_bits, 1.0 - ones, ones).sum())

    def floats(self, ids: Iterable[int]) -> dict[int, np.ndarray]:
        """The stored float vectors of ``ids`` (those that have one).

        vec0 answers ``message_id IN (...)`` by scanning the whole table (35 ms for
        500 ids at 100k messages), so the floats are read from vec0's own shadow
        table for auxiliary columns, by rowid (= message id): 1.7 ms.  If a
        sqlite-vec release lays its shadow tables out otherwise, the vec0 query is
        used (slower, same answer; tests/storage/test_sqlite_vectors.py checks both agree).
        """
        if self._auxiliary is None:
            self._auxiliary = shadow_table_readable(self._query)
        return read_floats(self._query, ids, auxiliary=self._auxiliary)

    def knn(
        self, vector: np.ndarray, k: int, filters: Filters, *, rescore: int = 4,
        scope: int | None = None,
    ) -> list[tuple[int, float]]:
        """Return up to ``k`` ``(message_id, cosine_similarity)`` pairs, best first.

        The KNN runs inside vec0 over the 1-bit codes (filters included) and fetches
        the ``k × rescore`` nearest by Hamming distance; those are ranked by exact
        cosine from their float vectors.  sqlite-vec scans every code either way,
        but a Hamming distance is far cheaper than a float cosine (BENCHMARKS.md).
        A ``rescore`` that fetches the whole scope makes the result exact; the
        fetch is capped at sqlite-vec's k limit of 4096.  ``scope``: fetch this
        many (at most 4096) whatever ``rescore`` says — every row of a scope that
        holds no more makes the result exact.
        """
        k = max(1, min(int(k), MAX_KNN_K))
        query = np.asarray(vector, dtype=np.float32)
        code = binary_code(query)
        if scope is not None:
            fetch = min(max(int(scope), k), MAX_KNN_K)
            candidates = self._code_knn(code, fetch, filters)
        else:
            fetch = min(k * max(1, int(rescore)), MAX_KNN_K)
            candidates = self._radii.search(
                lambda radius: self._code_knn(code, fetch, filters, radius),
                key=(filters, fetch),
                want=fetch,
                bits=len(code) * 8,
                expected=self.expected_distance(query > 0, filters.guild_id),
            )
        if not candidates:
            return []
        floats = np.frombuffer(b"".join(row[2] for row in candidates), dtype=np.float32)
        floats = floats.reshape(len(candidates), -1)
        norms = np.linalg.norm(floats, axis=1) * float(np.linalg.norm(query))
        similarity = floats @ query / np.maximum(norms, 1e-12)
        best = np.argsort(-similarity, kind="stable")[:k]
        return [(candidates[i][0], float(similarity[i])) for i in best]

    def _code_knn(
        self, code: bytes, k: int, filters: Filters, radius: int | None = None
    ) -> list[tuple]:
        """The ``k`` nearest codes (within ``radius`` bits, if given): id, distance, floats."""
        clauses: list[str] = ["embedding_bits MATCH vec_bit(?)", "k = ?"]
        params: list[Any] = [code, k]
        if radius is not None:
            clauses.append("distance <= ?")
            params.append(radius)
        filter_sql(filters, "", clauses, params)
        return self._query(
            "SELECT message_id, distance, embedding FROM message_vectors "
            f"WHERE {' AND '.join(clauses)} ORDER BY distance",
            params,
        )


class SQLiteVectorIndex:
    """The contract's ``VectorIndex`` over one database's :class:`Vec0Table`.

    Args:
        database: The database.
        table: Its vector table (shared with the nouns that write vectors).
        meta: Which embedding model the vectors belong to (a KNN of another model's
            vector is refused; the similarity floor is cached there).
    """

    def __init__(self, database: SQLiteDatabase, table: Vec0Table, meta: SQLiteMeta) -> None:
        self._db = database
        self.table = table
        """The vec0 table itself, for SQLite-specific tools and tests."""
        self._meta = meta

    def knn(
        self, vector: np.ndarray, k: int, filters: Filters, *, rescore: int = 4
    ) -> list[tuple[int, float]]:
        """Up to ``k`` ``(message_id, cosine_similarity)`` pairs, best first (:meth:`Vec0Table.knn`).

        Empty before anything is embedded.  Exact in a guild of at most
        :data:`~memory.storage.contract.EXACT_KNN_MAX` vectors (every code in scope is
        fetched and ranked by cosine).
        """
        if self._meta.embedding_model() is None:
            return []
        self._meta.check_model_unchanged()
        stored = self.count(filters.guild_id)
        with self._readable():
            return self.table.knn(vector, k, filters, rescore=rescore,
                                  scope=stored if stored <= EXACT_KNN_MAX else None)

    def damage(self) -> str | None:
        """Why the vector index cannot be read whole, or ``None`` (:meth:`Vec0Table.damage`)."""
        model = self._meta.embedding_model()
        return None if model is None else self.table.damage(model[1])

    @contextmanager
    def _readable(self) -> Iterator[None]:
        """Raise a read that failed on a damaged vec0 table as :class:`VectorIndexDamaged`.

        A truncated chunk, a float vector of the wrong size or a missing shadow
        table fail inside sqlite-vec (or in the cosine that follows); the search
        then runs on keywords and names the repair.  A read that failed because
        another process re-embedded the database meanwhile says so instead.
        """
        try:
            yield
        except (sqlite_driver().DatabaseError, ValueError) as exc:
            self._meta.check_model_unchanged()  # re-embedded between the check and the query
            if as_busy(exc, self._db.location):
                raise
            log.debug("the vector index of %s is damaged: %s", self._db.location, exc)
            raise VectorIndexDamaged(
                f"{self._db.location}: the vector index is damaged ({exc}); searches use "
                "keywords only until `python bot.py reembed` rebuilds it from the stored "
                "text (the messages are intact)") from exc

    def window_vectors(self, ids: Sequence[int], *, beside: bool = False) -> dict[int, np.ndarray]:
        """The window vector of each message: its window's mean vector, unit length.

        Kept up to date by :mod:`.windows`; messages without content of their own
        ("lol") or without any embedded member in their window have none.
        ``beside``: read on the second connection (:meth:`SQLiteDatabase.read_beside`).
        """
        return read_window_vectors(self._db.read_beside if beside else self._db.read, ids)

    def similarity_floor(self, guild_id: int | None, quantile: float) -> float | None:
        """The cosine similarity that random pairs of a guild's messages reach at ``quantile``
        (:func:`memory.storage.similarity.similarity_floor`; cached in ``meta``)."""
        return similarity_floor(self._db, self._meta, DIALECT, guild_id=guild_id,
                                quantile=quantile, count=self.count(guild_id), floats=self.floats)

    def floats(self, ids: Iterable[int]) -> dict[int, np.ndarray]:
        """The stored float vectors of ``ids`` (those that have one)."""
        with self._readable():
            return self.table.floats(ids)

    def count(self, guild_id: int | None = None) -> int:
        """How many messages have a vector (in one guild, or in all), from ``code_stats``."""
        where, params = ("WHERE guild_id = ?", [guild_id]) if guild_id is not None else ("", [])
        return int(self._db.read(f"SELECT coalesce(sum(vectors), 0) FROM code_stats {where}",
                                 params)[0][0])
