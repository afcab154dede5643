"""The keyword index: two FTS5 tables over ``search_text``, ranked by BM25.

``search_fts`` indexes each message's author names, text and attachment names;
``window_fts`` its conversational window (:mod:`.windows`, which keeps
``search_text`` in step with the messages).  The window index is a table of its own:
window postings are about five times a message's, and a message search must not walk
them.  Callers give plain terms; :func:`match_expression` quotes them, so no term is
ever FTS5 syntax.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from memory.filters import Filters
from memory.storage.sqlite.database import SQLiteDatabase
from memory.storage.sqlite.filters import filter_sql

# ranked() fields: the FTS5 table searched, and its bm25() with column weights
_FIELDS = {
    "message": ("search_fts", "bm25(search_fts, 1.0, 1.0, 0.5)"),  # author, content, attachments
    "window": ("window_fts", "bm25(window_fts)"),
}


def match_expression(terms: Sequence[str]) -> str | None:
    """Build an FTS5 MATCH expression from terms that can never raise a syntax error.

    Every term is a double-quoted string (FTS5 syntax characters and keywords such
    as ``AND``/``NEAR`` inside quotes are plain text), OR-ed together so BM25 ranks
    messages by how many and how rare the matching words are.

    Returns:
        The expression, or ``None`` when there is no term (nothing to search for).
    """
    if not terms:
        return None
    return " OR ".join('"' + term.replace('"', '""') + '"' for term in terms)


class SQLiteKeywordIndex:
    """The contract's ``KeywordIndex`` on one database.

    Reads run on the database's second connection (:meth:`.SQLiteDatabase.read_beside`):
    a search reads its keyword lists there while its vector KNN runs on the first.
    """

    def __init__(self, database: SQLiteDatabase) -> None:
        self._db = database

    def ranked(
        self, terms: Sequence[str], k: int, filters: Filters, *, field: str = "message"
    ) -> list[tuple[int, float]]:
        """Return up to ``k`` ``(message_id, bm25)`` pairs for any of ``terms``, best first.

        ``field`` is ``message`` (the author's names, the text and attachment names)
        or ``window`` (the message's conversational window, :mod:`.windows`).
        BM25 is negated so that higher is better.  The best ``4 × k`` matches are
        filtered first, which spares a table lookup per match when the filters
        pass most messages (one guild's bot, no author filter); if fewer than
        ``k`` survive, every match is filtered.
        """
        match = match_expression(terms)
        if match is None:
            return []
        table, bm25 = _FIELDS[field]
        clauses: list[str] = ["TRUE"]
        if field == "window":  # a content-free line is not found by its neighbours' words
            clauses.append("(SELECT s.contentful FROM search_text s WHERE s.id = m.id)")
        params: list[Any] = []
        filter_sql(filters, "m.", clauses, params)
        k = int(k)
        for head in (4 * k, -1):  # -1: no limit
            rows = self._db.read_beside(
                # FTS ranks inside the subquery; CROSS JOIN keeps it the outer loop
                # (a plain JOIN may scan messages and re-run MATCH per row).
                f"SELECT m.id, f.score FROM (SELECT rowid, -{bm25} AS score FROM {table} "
                f"WHERE {table} MATCH ? ORDER BY score DESC LIMIT ?) f "
                f"CROSS JOIN messages m ON m.id = f.rowid WHERE {' AND '.join(clauses)} "
                "ORDER BY f.score DESC LIMIT ?",
                [match, head, *params, k],
            )
            if len(rows) >= k:
                break
        return [(row[0], row[1]) for row in rows]

    def term_counts(self, terms: Sequence[str]) -> dict[str, int]:
        """In how many messages each term occurs (by text, author or attachment name)."""
        return {
            term: self._db.read_beside("SELECT count(*) FROM search_fts WHERE search_fts MATCH ?",
                                       (match_expression([term]),))[0][0]
            for term in terms
        }
