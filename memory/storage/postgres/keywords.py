"""The keyword index on PostgreSQL: FTS5's words, BM25 computed in SQL over postings.

Both engines must find the same messages for the same words and rank them alike
(``bench retrieval`` gives the same recall on both).  PostgreSQL's own text search
parses differently from SQLite FTS5's ``porter unicode61 remove_diacritics 2``
(``state-of-the-art`` stays one word beside its parts, a URL becomes a host and a
path, and the bundled servers have no ``unaccent``), and ``ts_rank`` has no
document frequency in it, so it ranks a common word as high as a rare one.  So:

* **Words** come from FTS5's own tokenizer, run in this process on an in-memory
  SQLite table (:class:`memory.storage.tokens.Tokenizer`; SQLite is a dependency of the bot anyway):
  the same case folding, accent removal, Porter stems and CJK runs, by construction.
* **Documents** are a message's author names, text and attachment names (the
  message field, each column weighted as SQLite's ``bm25(search_fts, 1.0, 1.0,
  0.5)`` weights it) and its conversational window (the window field).  Each is a
  row of ``keyword_messages`` / ``keyword_windows`` (its length in words) and one
  **posting** per distinct word in ``message_postings`` / ``window_postings``: the
  word, its weighted frequency, the document's length, and the message's guild,
  channel, author, creation time and attachment flag.  A B-tree on ``(term,
  guild_id)`` that carries every other column answers a query from the index alone,
  reading only the postings of the query's words in the searched guild — what an
  inverted index is — where reading each matching document (as this engine did
  first) cost a heap visit per match.
* **Ranking** is FTS5's BM25 formula (k1 = 1.2, b = 0.75; IDF from how many of all
  documents hold the word, floored at 1e-6; the document's length against the
  average), summed over the query's words per document in one SQL statement.  As
  in FTS5, N, the average length and the document frequencies count every
  document in the database (every guild): ``index_stats`` keeps N and the lengths
  per guild, ``keyword_terms`` the document frequencies per guild and word, so a
  search reads a few rows for them and writers of different guilds never share a
  row.

The filters apply to the postings themselves, inside the ranking, so a search's
allow-list, author, time and attachment filters hold before the top ``k`` is taken.
A word no document holds any more leaves ``keyword_terms`` in the same transaction
(a forgotten message's words must not stay behind, not even as a count).
"""

from __future__ import annotations

from collections import Counter, defaultdict
from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from memory.filters import Filters
from memory.storage.postgres.filters import filter_sql
from memory.storage.tokens import tokenizer

if TYPE_CHECKING:  # the database runs the migrations, and migration 10 writes documents
    from memory.storage.postgres.database import PostgresDatabase

K1, B = 1.2, 0.75  # FTS5's bm25() constants
MESSAGE_WEIGHTS = (1.0, 1.0, 0.5)  # author, content, attachments: as SQLite's bm25() call


@dataclass(frozen=True)
class _Field:
    """One keyword field's tables: its documents, its postings, its columns."""

    documents: str  # one row per document: its length in words
    postings: str
    frequencies: str  # keyword_terms' column: documents holding a word
    tokens: str  # index_stats' column: the words of every document


_FIELDS = {
    "message": _Field("keyword_messages", "message_postings", "messages", "message_tokens"),
    "window": _Field("keyword_windows", "window_postings", "windows", "window_tokens"),
}
_PLACE = "guild_id, id, channel_id, author_id, created_at"


@dataclass(frozen=True)
class Document:
    """A message's two keyword documents, as :func:`write_documents` stores them.

    ``texts``: the author's names, the text, the attachment names, the window's text.
    """

    id: int
    guild_id: int
    channel_id: int
    author_id: int
    created_at: int
    has_attachment: bool
    contentful: bool  # a window of a message without content of its own is not searched
    texts: tuple[str, str, str, str]


def term_frequencies(
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
        spec = _FIELDS[field]
        clauses: list[str] = ["p.contentful"] if field == "window" else []
        filter_params: list[Any] = []
        filter_sql(filters, "p.", clauses, filter_params)
        words = query_words(terms)
        if not words or int(k) <= 0:
            return []
        where = "".join(f" AND {clause}" for clause in clauses)
        # each word's IDF enters as a constant looked up once per statement (an InitPlan),
        # not through a join: the postings are then scanned by the words alone, the
        # planner sees from the statistics how many there are, and sums them in a hash
        idf = " ".join("WHEN %s THEN (SELECT idf FROM weights WHERE term = %s)" for _ in words)
        sql = (
            # N and the average length (FTS5's nRow, avgdl) from index_stats, each word's
            # document frequency from keyword_terms: all documents, every guild, as FTS5
            f"WITH totals AS MATERIALIZED (SELECT sum(documents)::float8 AS total, "
            f"sum({spec.tokens})::float8 / nullif(sum(documents), 0) AS average FROM index_stats), "
            "weights AS MATERIALIZED (SELECT term, CASE WHEN ln((total - n + 0.5) / (n + 0.5)) > 0 "
            "THEN ln((total - n + 0.5) / (n + 0.5)) ELSE 1e-6 END AS idf FROM totals, "
            f"(SELECT term, sum({spec.frequencies})::float8 AS n FROM keyword_terms "
            "WHERE term = ANY(%s) GROUP BY term) f) "
            # FTS5's bm25(), term by term, in its own order of operations
            f"SELECT p.id, sum((CASE p.term {idf} END) * (p.tf * {K1 + 1}::float8) / (p.tf + "
            f"{K1}::float8 * ({1 - B}::float8 + {B}::float8 * p.length / "
            "(SELECT average FROM totals)))) AS score "
            f"FROM {spec.postings} p WHERE p.term = ANY(%s){where} "
            "GROUP BY p.id ORDER BY score DESC, p.id LIMIT %s"
        )
        params = [words, *(word for word in words for _ in range(2)), words, *filter_params,
                  int(k)]
        return [(row[0], float(row[1])) for row in self._db.read_beside(sql, params)]

    def term_counts(self, terms: Sequence[str]) -> dict[str, int]:
        """In how many messages each term occurs (by text, author or attachment name)."""
        split = {term: tokenizer().words(term) for term in terms}
        single = sorted({words[0] for words in split.values() if len(words) == 1})
        found = dict(self._db.read_beside(
            "SELECT term, sum(messages) FROM keyword_terms WHERE term = ANY(%s) GROUP BY term",
            (single,))) if single else {}
        counts = {}
        for term, words in split.items():
            if len(words) == 1:
                counts[term] = int(found.get(words[0], 0))
            else:  # a term FTS5 would split: the messages holding all of its words
                counts[term] = 0 if not words else int(self._db.read_beside(
                    "SELECT count(*) FROM (SELECT id FROM message_postings WHERE term = ANY(%s) "
                    "GROUP BY id HAVING count(*) = %s) x", (sorted(set(words)), len(set(words))))[0][0])
        return counts


# -- writing documents (inside the caller's transaction) ------------------------------------


def write_documents(conn: Any, documents: Sequence[Document]) -> None:
    """Store (or replace) the keyword documents of these messages, their postings,
    their words' document frequencies and their share of ``index_stats``.

    The caller holds the write locks of the documents' guilds.
    """
    if not documents:
        return
    deltas = _remove(conn, [d.id for d in documents])
    frequencies: Counter[tuple[str, int, str]] = Counter()
    messages: list[tuple] = []
    windows: list[tuple] = []
    message_postings: list[tuple] = []
    window_postings: list[tuple] = []
    for doc, (terms, length, window_terms, window_length) in zip(
            documents, term_frequencies([d.texts for d in documents])):
        place = (doc.guild_id, doc.id, doc.channel_id, doc.author_id, doc.created_at)
        messages.append((*place, doc.has_attachment, length))
        windows.append((*place, doc.has_attachment, doc.contentful, window_length))
        for term, tf in terms.items():
            message_postings.append((*place, tf, length, doc.has_attachment, term))
            frequencies[(term, doc.guild_id, "messages")] += 1
        for term, tf in window_terms.items():
            window_postings.append((*place, tf, window_length, doc.has_attachment,
                                    doc.contentful, term))
            frequencies[(term, doc.guild_id, "windows")] += 1
        deltas[doc.guild_id][0] += 1
        deltas[doc.guild_id][1] += length
        deltas[doc.guild_id][2] += window_length
    _copy(conn, "keyword_messages", f"{_PLACE}, has_attachment, length", messages)
    _copy(conn, "keyword_windows", f"{_PLACE}, has_attachment, contentful, length", windows)
    _copy(conn, "message_postings", f"{_PLACE}, tf, length, has_attachment, term",
          message_postings)
    _copy(conn, "window_postings", f"{_PLACE}, tf, length, has_attachment, contentful, term",
          window_postings)
    _count_terms(conn, frequencies)
    add_stats(conn, deltas)
    _drop_unused_terms(conn)


def delete_documents(conn: Any, ids: Sequence[int]) -> None:
    """Remove the keyword documents of ``ids`` (where present), their postings, their
    words' document frequencies and their share of ``index_stats``."""
    if ids:
        add_stats(conn, _remove(conn, ids))
        _drop_unused_terms(conn)


def add_stats(conn: Any, deltas: dict[int, list[int]]) -> None:
    """Add ``{guild: [documents, message_tokens, window_tokens]}`` to ``index_stats``."""
    rows = [(g, *d) for g, d in sorted(deltas.items()) if any(d)]
    if rows:
        conn.cursor().executemany(
            "INSERT INTO index_stats AS s(guild_id, documents, message_tokens, window_tokens) "
            "VALUES (%s, %s, %s, %s) ON CONFLICT (guild_id) DO UPDATE SET "
            "documents = s.documents + excluded.documents, "
            "message_tokens = s.message_tokens + excluded.message_tokens, "
            "window_tokens = s.window_tokens + excluded.window_tokens", rows)


def _remove(conn: Any, ids: Sequence[int]) -> defaultdict[int, list[int]]:
    """Delete the documents of ``ids`` and their postings; count their words out of
    ``keyword_terms``.  Returns their ``index_stats`` deltas (negative)."""
    deltas: defaultdict[int, list[int]] = defaultdict(lambda: [0, 0, 0])
    ids = sorted(set(ids))
    for field, spec in _FIELDS.items():
        slot = 1 if field == "message" else 2
        for guild_id, length in conn.execute(
                f"DELETE FROM {spec.documents} WHERE id = ANY(%s) RETURNING guild_id, length",
                (ids,)):
            deltas[guild_id][slot] -= length
            if slot == 1:
                deltas[guild_id][0] -= 1
        conn.execute(
            f"WITH gone AS (DELETE FROM {spec.postings} WHERE id = ANY(%s) "
            "RETURNING term, guild_id), "
            "counts AS (SELECT term, guild_id, count(*)::int AS n FROM gone GROUP BY 1, 2) "
            f"UPDATE keyword_terms k SET {spec.frequencies} = k.{spec.frequencies} - c.n "
            "FROM counts c WHERE k.term = c.term AND k.guild_id = c.guild_id", (ids,))
    return deltas


def _copy(conn: Any, table: str, columns: str, rows: list[tuple]) -> None:
    if rows:
        with conn.cursor().copy(f"COPY {table} ({columns}) FROM STDIN") as copy:
            for row in rows:
                copy.write_row(row)


def _count_terms(conn: Any, frequencies: Counter[tuple[str, int, str]]) -> None:
    """Add new documents' words to ``keyword_terms`` (one row per word and guild)."""
    rows: dict[tuple[str, int], list[int]] = {}
    for (term, guild_id, column), n in frequencies.items():
        rows.setdefault((term, guild_id), [0, 0])[column == "windows"] += n
    if rows:
        ordered = sorted(rows.items())
        conn.execute(
            "INSERT INTO keyword_terms AS k (term, guild_id, messages, windows) "
            "SELECT * FROM unnest(%s::text[], %s::bigint[], %s::int[], %s::int[]) "
            "ON CONFLICT (term, guild_id) DO UPDATE SET messages = k.messages + excluded.messages, "
            "windows = k.windows + excluded.windows",
            ([key[0] for key, _ in ordered], [key[1] for key, _ in ordered],
             [n[0] for _, n in ordered], [n[1] for _, n in ordered]))


def _drop_unused_terms(conn: Any) -> None:
    conn.execute("DELETE FROM keyword_terms WHERE messages <= 0 AND windows <= 0")
