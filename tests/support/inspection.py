"""Looking under the storage contract, one way per engine.

The contract says what a caller may ask; a few tests must also check what only the
engine's own tables show (the keyword index agrees with its rows, a window's stored
text holds no forgotten words, no vector is left without its message).  Each engine
answers these questions in its own terms; the tests stay the same.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any, Protocol

import numpy as np

from tests.support.sqlite import sql_rows, sql_write


class Inspector(Protocol):
    """Questions about a database the storage contract does not answer."""

    def keyword_rows(self) -> int:
        """Documents in the message keyword index."""
        ...

    def vector_rows(self) -> int:
        """Rows in the vector table (0 when none exists yet)."""
        ...

    def window_vector_rows(self) -> int:
        """Stored window vectors."""
        ...

    def every_vector(self) -> dict[int, np.ndarray]:
        """Every stored message vector, by message id."""
        ...

    def check_vector_statistics(self) -> None:
        """Raise if what the engine derives from the vectors (per-guild statistics that
        guide its search) disagrees with a recount of the stored vectors."""
        ...

    def check_keyword_index(self) -> None:
        """Raise if either keyword index disagrees with the rows it indexes."""
        ...

    def window_text(self, message_id: int) -> str:
        """The stored text of a message's window (``""`` when it has none)."""
        ...

    def all_window_text(self) -> str:
        """Every stored window's text, joined."""
        ...

    def window_members(self) -> dict[int, list[int]]:
        """The members of every stored window of a message with content of its own."""
        ...

    def orphan_window_vectors(self) -> int:
        """Window vectors whose message is gone."""
        ...

    def tombstones(self, ids: list[int]) -> int:
        """How many of ``ids`` are tombstoned."""
        ...

    def author_rows(self, author_id: int) -> int:
        """Name rows stored for an author (0 or 1)."""
        ...

    def member_names(self, author_id: int) -> dict[int, tuple[str, str]]:
        """``{guild_id: (name, display_name)}``: the author's name rows, per guild."""
        ...

    def message_rows(self, ids: list[int]) -> int:
        """How many of ``ids`` are stored (expired by retention or not)."""
        ...

    def index_rows(self, ids: list[int]) -> int:
        """How many of ``ids`` have a row in the index text the keyword index is built from."""
        ...

    def contents(self) -> bytes:
        """Everything the database holds that text could hide in.

        SQLite: the file and its write-ahead log as they are on disk, free pages and
        old frames included.  PostgreSQL: every row of every table the bot owns, as
        text — what any query, replica or dump could read; a deleted row's bytes stay
        on the server's disk until VACUUM and later writes reclaim them (docs/privacy.md,
        "On PostgreSQL"), which no client can look at.
        """
        ...


class SQLiteInspector:
    """:class:`Inspector` for an SQLite file: reads on a connection of its own."""

    def __init__(self, location: str) -> None:
        self.location = location

    def _one(self, sql: str, params: tuple = ()) -> int:
        return int(sql_rows(self.location, sql, params)[0][0] or 0)

    def keyword_rows(self) -> int:
        """Documents in ``search_fts`` (its docsize shadow table has one row per document)."""
        return self._one("SELECT count(*) FROM search_fts_docsize")

    def vector_rows(self) -> int:
        """Rows in ``message_vectors``."""
        if not sql_rows(self.location, "SELECT 1 FROM pragma_table_info('message_vectors')"):
            return 0
        return self._one("SELECT count(*) FROM message_vectors")

    def window_vector_rows(self) -> int:
        """Rows in ``window_vectors``."""
        return self._one("SELECT count(*) FROM window_vectors")

    def every_vector(self) -> dict[int, np.ndarray]:
        """The ``embedding`` column of ``message_vectors``."""
        return {mid: np.frombuffer(blob, dtype=np.float32) for mid, blob in sql_rows(
            self.location, "SELECT message_id, embedding FROM message_vectors")}

    def check_vector_statistics(self) -> None:
        """``code_stats`` equals a recount of the stored vectors' set bits, per guild."""
        recount: dict[int, tuple[int, Any]] = {}
        for guild, blob in sql_rows(self.location, "SELECT guild_id, embedding FROM message_vectors"):
            count, ones = recount.get(guild, (0, 0))
            recount[guild] = (count + 1, ones + (np.frombuffer(blob, np.float32) > 0))
        stats = {g: (n, np.frombuffer(o, np.int64)) for g, n, o in sql_rows(
            self.location, "SELECT guild_id, vectors, ones FROM code_stats")}
        assert stats.keys() == recount.keys()
        for guild, (count, ones) in recount.items():
            assert stats[guild][0] == count
            np.testing.assert_array_equal(stats[guild][1], ones)

    def check_keyword_index(self) -> None:
        """FTS5's own check that both indexes match their content table."""
        sql_write(self.location,
                  "INSERT INTO search_fts(search_fts) VALUES ('integrity-check')",
                  "INSERT INTO window_fts(window_fts) VALUES ('integrity-check')")

    def window_text(self, message_id: int) -> str:
        """``search_text.context`` of the message."""
        rows = sql_rows(self.location, "SELECT context FROM search_text WHERE id = ?", (message_id,))
        return rows[0][0] if rows else ""

    def all_window_text(self) -> str:
        """Every ``search_text.context``, joined by spaces."""
        return sql_rows(self.location, "SELECT group_concat(context, ' ') FROM search_text")[0][0] or ""

    def window_members(self) -> dict[int, list[int]]:
        """``search_text.context_ids`` of every contentful row."""
        return {mid: [int(m) for m in members.split()] for mid, members in sql_rows(
            self.location, "SELECT id, context_ids FROM search_text WHERE contentful")}

    def orphan_window_vectors(self) -> int:
        """Rows of ``window_vectors`` without their message."""
        return self._one("SELECT count(*) FROM window_vectors WHERE id NOT IN (SELECT id FROM messages)")

    def message_rows(self, ids: list[int]) -> int:
        """Rows of ``messages`` for ``ids``."""
        marks = ",".join("?" * len(ids))
        return self._one(f"SELECT count(*) FROM messages WHERE id IN ({marks})", tuple(ids))

    def index_rows(self, ids: list[int]) -> int:
        """Rows of ``search_text`` for ``ids``."""
        marks = ",".join("?" * len(ids))
        return self._one(f"SELECT count(*) FROM search_text WHERE id IN ({marks})", tuple(ids))

    def contents(self) -> bytes:
        """The file and its write-ahead log, as they are on disk."""
        path = Path(self.location)
        return b"".join(p.read_bytes() for p in (path, Path(f"{path}-wal")) if p.exists())

    def tombstones(self, ids: list[int]) -> int:
        """Rows of ``tombstones`` for ``ids``."""
        marks = ",".join("?" * len(ids))
        return self._one(f"SELECT count(*) FROM tombstones WHERE message_id IN ({marks})", tuple(ids))

    def author_rows(self, author_id: int) -> int:
        """Rows of ``authors`` for the author."""
        return self._one("SELECT count(*) FROM authors WHERE id = ?", (author_id,))

    def member_names(self, author_id: int) -> dict[int, tuple[str, str]]:
        """Rows of ``member_names`` for the author, by guild."""
        return {row[0]: (row[1], row[2]) for row in sql_rows(
            self.location, "SELECT guild_id, name, display_name FROM member_names WHERE author_id = ?",
            (author_id,))}
