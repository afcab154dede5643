"""The keyword index on PostgreSQL: FTS5's words, BM25 computed in SQL.

Both engines must find the same messages for the same words and rank them alike
(``bench retrieval`` gives the same recall on both).  PostgreSQL's own text search
parses differently from SQLite FTS5's ``porter unicode61 remove_diacritics 2``
(``state-of-the-art`` stays one word beside its parts, a URL becomes a host and a
path, and the bundled servers have no ``unaccent``), and ``ts_rank`` has no
document frequency in it, so it ranks a common word as high as a rare one.  So:

* **Words** come from FTS5's own tokenizer, run in this process on an in-memory
  SQLite table (:class:`Tokenizer`; SQLite is a dependency of the bot anyway):
  the same case folding, accent removal, Porter stems and CJK runs, by construction.
* **Documents** are rows of ``keyword_messages`` (a message's author names, text and
  attachment names) and ``keyword_windows`` (its conversational window): a JSONB
  object ``{word: frequency}`` with a GIN index, and the length in words.  The
  message field's frequencies are weighted per column as SQLite's
  ``bm25(search_fts, 1.0, 1.0, 0.5)`` weights them.
* **Ranking** is FTS5's BM25 formula (k1 = 1.2, b = 0.75; IDF from how many of all
  documents hold the word, floored at 1e-6; the document's length against the
  average), evaluated in one SQL statement over every document holding a query word;
  ``index_stats`` keeps the document and word totals per guild.

Each row carries the message's guild, channel, author, creation time and attachment
flag, so a search's filters apply before the top ``k`` is taken.
"""

from __future__ import annotations

import threading
from collections import Counter
from collections.abc import Iterable, Sequence
from typing import Any

from memory.filters import Filters
from memory.storage.postgres.database import PostgresDatabase
from memory.storage.postgres.filters import filter_sql

TOKENIZE = "porter unicode61 remove_diacritics 2"  # SQLite's search_fts and window_fts
K1, B = 1.2, 0.75  # FTS5's bm25() constants
MESSAGE_WEIGHTS = (1.0, 1.0, 0.5)  # author, content, attachments: as SQLite's bm25() call
_FILTERED = "guild_id, channel_id, author_id, created_at, has_attachment"
_TABLES = {"message": ("keyword_messages", "message_tokens"),
           "window": ("keyword_windows", "window_tokens")}


class Tokenizer:
    """SQLite FTS5's tokenizer, run on an in-memory table (``fts5vocab`` instances).

    Thread-safe; one per process is enough (:func:`tokenizer`).
    """

    def __init__(self) -> None:
        from memory.storage.sqlite.connection import sqlite_driver

        self._conn = sqlite_driver().connect(":memory:", check_same_thread=False,
                                             isolation_level=None)
        self._conn.execute(f"CREATE VIRTUAL TABLE doc USING fts5(c0, c1, c2, c3, "
                           f"tokenize='{TOKENIZE}', detail=full)")
        self._conn.execute("CREATE VIRTUAL TABLE words USING fts5vocab(doc, instance)")
        self._lock = threading.Lock()

    def columns(self, docs: Sequence[Sequence[str]]) -> list[list[list[str]]]:
        """The tokens of each document's columns (up to four), in order.

        Returns:
            ``result[doc][column]``: that column's tokens, in text order.
        """
        out: list[list[list[str]]] = [[[] for _ in range(4)] for _ in docs]
        if not docs:
            return out
        with self._lock:
            self._conn.execute("BEGIN")
            try:
                self._conn.executemany(
                    "INSERT INTO doc(rowid, c0, c1, c2, c3) VALUES (?, ?, ?, ?, ?)",
                    [(i, *(list(doc) + [""] * 4)[:4]) for i, doc in enumerate(docs)])
                rows = self._conn.execute(
                    "SELECT doc, col, term FROM words ORDER BY doc, col, offset").fetchall()
                self._conn.execute("DELETE FROM doc")
            finally:
                self._conn.execute("ROLLBACK")  # the table is only ever a scratch pad
        for doc, column, term in rows:
            out[doc][int(column[1])].append(term)
        return out

    def words(self, text: str) -> list[str]:
        """The tokens of one piece of text (a query term may give none, or several)."""
        return self.columns([(text,)])[0][0]


_tokenizer: Tokenizer | None = None
_tokenizer_lock = threading.Lock()


def tokenizer() -> Tokenizer:
    """This process's :class:`Tokenizer`."""
    global _tokenizer
    with _tokenizer_lock:
        if _tokenizer is None:
            _tokenizer = Tokenizer()
        return _tokenizer


def documents(
    entries: Sequence[tuple[str, str, str, str]],
) -> list[tuple[dict[str, float], int, dict[str, float], int]]:
    """The keyword documents of ``(author, content, attachments, window)`` texts.

    Returns:
        Per entry: the message document's weighted frequencies and length, then the
        window document's frequencies and length.
    """
    result = []
    for author, content, attachments, window in tokenizer().columns(entries):
        message: dict[str, float] = {}
        for weight, tokens in zip(MESSAGE_WEIGHTS, (author, content, attachments)):
            for token in tokens:
                message[token] = message.get(token, 0.0) + weight
        window_terms = {word: float(n) for word, n in Counter(window).items()}
        result.append((message, len(author) + len(content) + len(attachments),
                       window_terms, len(window)))
    return result


def query_words(terms: Iterable[str]) -> list[str]:
    """The distinct tokens of a search's terms, in order.

    A term FTS5 would split (rare: a mark its tokenizer separates on) counts as its
    words, any of which matches.
    """
    words: dict[str, None] = {}
    for term in terms:
        for word in tokenizer().words(term):
            words.setdefault(word, None)
    return list(words)


class PostgresKeywordIndex:
    """The contract's ``KeywordIndex`` on PostgreSQL (see the module)."""

    def __init__(self, database: PostgresDatabase) -> None:
        self._db = database

    def ranked(
        self, terms: Sequence[str], k: int, filters: Filters, *, field: str = "message"
    ) -> list[tuple[int, float]]:
        """Return up to ``k`` ``(message_id, bm25)`` pairs for any of ``terms``, best first.

        ``field`` is ``message`` (the author's names, the text and attachment names)
        or ``window`` (the message's conversational window).  Higher is better.
        """
        table, tokens_column = _TABLES[field]
        clauses: list[str] = ["contentful"] if field == "window" else []
        filter_params: list[Any] = []
        filter_sql(filters, "", clauses, filter_params)
        words = query_words(terms)
        if not words or int(k) <= 0:
            return []
        n = len(words)
        frequencies = ", ".join(f"coalesce((terms ->> %s)::float8, 0) AS f{i}" for i in range(n))
        hits = ", ".join(f"count(*) FILTER (WHERE f{i} > 0) AS n{i}" for i in range(n))
        idf = ", ".join(
            f"CASE WHEN ln((total - n{i} + 0.5) / (n{i} + 0.5)) > 0 "
            f"THEN ln((total - n{i} + 0.5) / (n{i} + 0.5)) ELSE 1e-6 END AS idf{i}"
            for i in range(n))
        score = " + ".join(
            f"idf{i} * (f{i} * {K1 + 1}) / (f{i} + {K1} * ({1 - B} + {B} * length / average))"
            for i in range(n))
        where = " AND ".join(clauses) or "TRUE"
        sql = (
            # N and the average length (FTS5's nRow, avgdl) come from index_stats' totals;
            # each document's JSONB is read once, into its query words' frequencies
            f"WITH totals AS (SELECT sum(documents)::float8 AS total, "
            f"sum({tokens_column})::float8 / nullif(sum(documents), 0) AS average FROM index_stats), "
            f"hits AS MATERIALIZED (SELECT id, length, {frequencies}, {_FILTERED}"
            f"{', contentful' if field == 'window' else ''} FROM {table} "
            "WHERE terms ?| %s::text[]), "
            f"counts AS (SELECT {hits} FROM hits), "
            f"weights AS (SELECT {idf}, average FROM counts, totals) "
            f"SELECT id, {score} AS score FROM hits, weights WHERE {where} "
            "ORDER BY score DESC, id LIMIT %s"
        )
        params: list[Any] = [*words, words, *filter_params, int(k)]
        return [(row[0], float(row[1])) for row in self._db.read_beside(sql, params)]

    def term_counts(self, terms: Sequence[str]) -> dict[str, int]:
        """In how many messages each term occurs (by text, author or attachment name)."""
        counts = {}
        for term in terms:
            words = tokenizer().words(term)
            counts[term] = 0 if not words else int(self._db.read_beside(
                "SELECT count(*) FROM keyword_messages WHERE terms ?& %s::text[]", (words,))[0][0])
        return counts
