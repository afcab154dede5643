"""The keyword index's words, the same on both engines: SQLite FTS5's own tokenizer.

SQLite's keyword index (``search_fts``, ``window_fts``) splits text with FTS5's
``porter unicode61 remove_diacritics 2`` tokenizer; PostgreSQL's keyword index
(:mod:`memory.storage.postgres.keywords`) must find the same messages for the same
words, so it runs that very tokenizer in this process, on an in-memory SQLite table:
the same case folding, accent removal, Porter stems and CJK runs, by construction.
SQLite (with FTS5) is a dependency of the bot on either engine.

One difference is needed: PostgreSQL's B-tree indexes refuse an entry over about
2,700 bytes, and a pasted key or a long CJK run without punctuation is one token.
Tokens are cut to :data:`MAX_TERM_BYTES` (at a character boundary), for the index and
for queries alike, so such a message is stored and its word still found.
"""

from __future__ import annotations

import threading
from collections.abc import Sequence

from memory.storage.sqlite.connection import sqlite_driver

__all__ = ["MAX_TERM_BYTES", "TOKENIZE", "Tokenizer", "tokenizer"]

TOKENIZE = "porter unicode61 remove_diacritics 2"  # SQLite's search_fts and window_fts
MAX_TERM_BYTES = 240  # a term's UTF-8 length in PostgreSQL's indexes (they allow ~2,700)


class Tokenizer:
    """SQLite FTS5's tokenizer, run on an in-memory table (``fts5vocab`` instances).

    Thread-safe; one per process is enough (:func:`tokenizer`).
    """

    def __init__(self) -> None:
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
            out[doc][int(column[1])].append(_capped(term))
        return out

    def words(self, text: str) -> list[str]:
        """The tokens of one piece of text (a query term may give none, or several)."""
        return self.columns([(text,)])[0][0]


def _capped(term: str) -> str:
    """``term`` cut to at most :data:`MAX_TERM_BYTES` of UTF-8, never inside a character."""
    if len(term) * 4 <= MAX_TERM_BYTES:  # the usual word: no encoding needed
        return term
    return term.encode()[:MAX_TERM_BYTES].decode(errors="ignore")


_tokenizer: Tokenizer | None = None
_tokenizer_lock = threading.Lock()


def tokenizer() -> Tokenizer:
    """This process's :class:`Tokenizer`."""
    global _tokenizer
    with _tokenizer_lock:
        if _tokenizer is None:
            _tokenizer = Tokenizer()
        return _tokenizer
