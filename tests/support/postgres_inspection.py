"""Looking under the storage contract on PostgreSQL (the :class:`Inspector` questions).

Reads on a connection of its own, so it sees what other sessions see: only
committed rows.
"""

from __future__ import annotations

from typing import Any

import numpy as np

from memory.storage.postgres.keywords import term_frequencies
from memory.storage.postgres.vectors import vector_array


class PostgresInspector:
    """:class:`tests.support.inspection.Inspector` for a PostgreSQL database."""

    def __init__(self, url: str) -> None:
        self.url = url

    def _rows(self, sql: str, params: Any = ()) -> list[tuple]:
        import psycopg
        from pgvector.psycopg import register_vector

        with psycopg.connect(self.url, autocommit=True) as conn:
            if conn.execute("SELECT to_regclass('message_vectors')").fetchone()[0] is not None:
                register_vector(conn)
            return conn.execute(sql, params).fetchall()

    def _one(self, sql: str, params: Any = ()) -> int:
        return int(self._rows(sql, params)[0][0] or 0)

    def _has_vectors(self) -> bool:
        return self._rows("SELECT to_regclass('message_vectors')")[0][0] is not None

    def keyword_rows(self) -> int:
        """Documents in ``keyword_messages``."""
        return self._one("SELECT count(*) FROM keyword_messages")

    def vector_rows(self) -> int:
        """Rows in ``message_vectors`` (0 before a model is bound)."""
        return self._one("SELECT count(*) FROM message_vectors") if self._has_vectors() else 0

    def window_vector_rows(self) -> int:
        """Rows in ``window_vectors``."""
        return self._one("SELECT count(*) FROM window_vectors")

    def every_vector(self) -> dict[int, np.ndarray]:
        """The ``embedding`` column of ``message_vectors``."""
        if not self._has_vectors():
            return {}
        return {mid: vector_array(v) for mid, v in self._rows(
            "SELECT message_id, embedding FROM message_vectors")}

    def check_vector_statistics(self) -> None:
        """``index_stats.vectors`` equals a recount of the stored vectors, per guild."""
        recount = dict(self._rows("SELECT guild_id, count(*) FROM message_vectors GROUP BY 1")
                       if self._has_vectors() else [])
        stats = {g: n for g, n in self._rows("SELECT guild_id, vectors FROM index_stats") if n}
        assert stats == recount

    def check_keyword_index(self) -> None:
        """Every keyword document and its postings are what its ``search_text`` row gives,
        the per-word document frequencies recount the postings, and the totals add up."""
        texts = self._rows("SELECT id, author, content, attachments, context, contentful "
                           "FROM search_text ORDER BY id")
        expected = dict(zip((row[0] for row in texts),
                            term_frequencies([tuple(row[1:5]) for row in texts])))
        contentful = {row[0]: row[5] for row in texts}
        for table, postings, slot in (("keyword_messages", "message_postings", 0),
                                      ("keyword_windows", "window_postings", 2)):
            lengths = dict(self._rows(f"SELECT id, length FROM {table}"))
            assert lengths == {mid: doc[slot + 1] for mid, doc in expected.items()}, table
            found: dict[int, dict[str, float]] = {mid: {} for mid in expected}
            for mid, term, tf, length in self._rows(f"SELECT id, term, tf, length FROM {postings}"):
                assert length == lengths[mid]
                found[mid][term] = tf
            assert found == {mid: doc[slot] for mid, doc in expected.items()}, postings
        flags = dict(self._rows("SELECT DISTINCT id, contentful FROM window_postings"))
        assert flags == {mid: contentful[mid] for mid in flags}
        recount = {(term, guild): [m, w] for term, guild, m, w in self._rows(
            "SELECT term, guild_id, count(*) FILTER (WHERE field = 'm'), "
            "count(*) FILTER (WHERE field = 'w') FROM (SELECT term, guild_id, 'm' AS field "
            "FROM message_postings UNION ALL SELECT term, guild_id, 'w' FROM window_postings) p "
            "GROUP BY 1, 2")}
        terms = {(term, guild): [m, w] for term, guild, m, w in self._rows(
            "SELECT term, guild_id, messages, windows FROM keyword_terms")}
        assert terms == recount  # and no word without a document left behind
        totals = self._rows("SELECT coalesce(sum(documents), 0), coalesce(sum(message_tokens), 0), "
                            "coalesce(sum(window_tokens), 0) FROM index_stats")[0]
        assert [int(v) for v in totals] == [
            len(expected), sum(d[1] for d in expected.values()), sum(d[3] for d in expected.values())]

    def window_text(self, message_id: int) -> str:
        """``search_text.context`` of the message."""
        rows = self._rows("SELECT context FROM search_text WHERE id = %s", (message_id,))
        return rows[0][0] if rows else ""

    def all_window_text(self) -> str:
        """Every ``search_text.context``, joined by spaces."""
        return self._rows("SELECT string_agg(context, ' ') FROM search_text")[0][0] or ""

    def window_members(self) -> dict[int, list[int]]:
        """``search_text.context_ids`` of every contentful row."""
        return {mid: [int(m) for m in members.split()] for mid, members in self._rows(
            "SELECT id, context_ids FROM search_text WHERE contentful")}

    def orphan_window_vectors(self) -> int:
        """Rows of ``window_vectors`` without their message."""
        return self._one("SELECT count(*) FROM window_vectors w WHERE NOT EXISTS "
                         "(SELECT 1 FROM messages m WHERE m.id = w.id)")

    def tombstones(self, ids: list[int]) -> int:
        """Rows of ``tombstones`` for ``ids``."""
        return self._one("SELECT count(*) FROM tombstones WHERE message_id = ANY(%s)", (ids,))

    def author_rows(self, author_id: int) -> int:
        """Rows of ``authors`` for the author."""
        return self._one("SELECT count(*) FROM authors WHERE id = %s", (author_id,))

    def member_names(self, author_id: int) -> dict[int, tuple[str, str]]:
        """Rows of ``member_names`` for the author, by guild."""
        return {row[0]: (row[1], row[2]) for row in self._rows(
            "SELECT guild_id, name, display_name FROM member_names WHERE author_id = %s",
            (author_id,))}

    def message_rows(self, ids: list[int]) -> int:
        """Rows of ``messages`` for ``ids``."""
        return self._one("SELECT count(*) FROM messages WHERE id = ANY(%s)", (ids,))

    def index_rows(self, ids: list[int]) -> int:
        """Rows of ``search_text`` for ``ids``."""
        return self._one("SELECT count(*) FROM search_text WHERE id = ANY(%s)", (ids,))

    def contents(self) -> bytes:
        """Every row of every table in the bot's schema, as text (see the protocol)."""
        tables = [row[0] for row in self._rows(
            "SELECT tablename FROM pg_tables WHERE schemaname = current_schema() ORDER BY 1")]
        return "\n".join(
            self._rows(f"SELECT coalesce(string_agg(t::text, E'\\n'), '') FROM {table} t")[0][0]
            for table in tables).encode()
