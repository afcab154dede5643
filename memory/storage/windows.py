"""Conversational windows: what the keyword index holds for each message, on either engine.

A chat line's meaning often sits in its neighbours ("Why did Monica want to borrow a
hundred bucks?" is answered by "I 've got ta get back in the game ."), so the keyword
index keeps, beside each message's own author and text, its *window*: the message
with up to :data:`BEFORE` messages before it and :data:`AFTER` after it in the same
channel or thread (no further apart in time than :data:`GAP_MS`), and its reply
target when that is in the same channel, as ``author: content`` lines.  A search
ranks messages by their own text and by their windows and fuses the lists
(:mod:`memory.search`).

A line without content of its own ("lol", "noted", "looks great") is not found by its
window: the window would speak for its neighbours, not for it.

A window never holds text from another channel, so it cannot carry a message past a
permission check.  Windows are rewritten whenever a message in them is stored,
edited or deleted (:meth:`WindowIndex.reindex`): deleted text does not live on in a
neighbour.

Each contentful window also has a stored *window vector* (``window_vectors``): the
normalised mean of its members' message vectors (:func:`window_means`), kept as
float16 so a search ranks its candidates by their windows with one lookup.  It is
recomputed whenever the window's members change or a member's vector is stored or
deleted (:meth:`WindowIndex.vectors_changed`), so an edited or deleted message's
vector does not live on in its neighbours' window vectors either.

The algorithm is written once here, over ``search_text`` and ``window_vectors``
(tables both engines have); each engine subclasses :class:`WindowIndex` with what is
its own: how a gone message's index rows leave, how its keyword index follows
``search_text`` (SQLite: FTS5 triggers; PostgreSQL: keyword documents), and how its
message vectors are read.  Every method takes the connection of the caller's write
transaction.

The window's shape is part of the index format: changing these constants needs a
new migration in both engines that rebuilds it.
"""

from __future__ import annotations

from collections import defaultdict
from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np

from memory.storage.dialect import Dialect
from memory.storage.member_names import AUTHOR_JOIN, AUTHOR_NAMES
from memory.text import EMBED_CHARS, content_words

__all__ = ["AFTER", "BEFORE", "GAP_MS", "WindowIndex", "WindowRow", "stored_window_vectors",
           "window_means"]

BEFORE = 2
AFTER = 2
GAP_MS = 2 * 3_600_000  # a conversation pause longer than this ends the window
SEGMENT = 5000  # messages rebuilt (or window vectors computed) per pass

_COLUMNS = (
    f"m.id, m.channel_id, m.created_at, {AUTHOR_NAMES}, m.content, m.attachments, "
    f"m.reply_to_id, m.guild_id, m.author_id FROM messages m {AUTHOR_JOIN}"
)


@dataclass(frozen=True)
class WindowRow:
    """A message as its own and its neighbours' windows show it."""

    id: int
    channel_id: int
    created_at: int
    name: str
    display_name: str
    content: str
    attachments: str
    reply_to_id: int | None
    guild_id: int
    author_id: int

    @property
    def author(self) -> str:
        """Every name the author is known by (questions use either)."""
        names = dict.fromkeys(n for n in (self.display_name, self.name) if n)
        return " ".join(names)

    @property
    def line(self) -> str:
        """The message in its neighbours' windows: a huge one (an import can hold 50 MB)
        gives them its start, as the embedder does, not all of it to index again."""
        return f"{self.display_name or self.name}: {self.content[:EMBED_CHARS]}"


Entry = tuple[tuple[Any, ...], WindowRow]
"""A ``search_text`` row ``(id, author, content, attachments, context, context_ids,
contentful)`` and the message it was made from."""


def window_means(
    windows: dict[int, list[int]], floats: dict[int, np.ndarray]
) -> dict[int, np.ndarray]:
    """The window vector of each message in ``windows`` that has one.

    Args:
        windows: Each message's window members (message ids).
        floats: The members' stored vectors (a member without one is left out).

    Returns:
        The normalised mean of each window's embedded members' vectors; a window none
        of whose members has a vector yet is absent.
    """
    owners, rows = [], []
    for mid, members in windows.items():
        found = [floats[m] for m in members if m in floats]
        if found:
            owners.append(mid)
            rows.append(np.sum(found, axis=0))
    if not owners:
        return {}
    sums = np.stack(rows)
    sums /= np.maximum(np.linalg.norm(sums, axis=1, keepdims=True), 1e-12)
    return dict(zip(owners, sums))


def stored_window_vectors(rows: Sequence[tuple[int, Any]]) -> dict[int, np.ndarray]:
    """``window_vectors`` rows ``(id, float16 bytes)`` as float32 vectors by id."""
    if not rows:
        return {}
    # one conversion for all rows: per-row numpy calls cost more than the query
    matrix = np.frombuffer(b"".join(bytes(row[1]) for row in rows), dtype=np.float16)
    return dict(zip((row[0] for row in rows), matrix.reshape(len(rows), -1).astype(np.float32)))


class WindowIndex:
    """The window algorithm over one engine's SQL (see the module).

    A subclass sets :attr:`dialect` and implements :meth:`drop_rows` and
    :meth:`member_vectors`; :meth:`documents_written` is for an engine whose
    keyword index is not kept by triggers.
    """

    dialect: Dialect

    # -- what each engine does its own way -----------------------------------------------

    def drop_rows(self, conn: Any, ids: Sequence[int]) -> None:
        """Remove the index rows (``search_text``, ``window_vectors``, keyword rows) of
        those of ``ids`` whose message is gone."""
        raise NotImplementedError

    def member_vectors(self, conn: Any, ids: set[int]) -> dict[int, np.ndarray]:
        """The stored float32 vectors of those of ``ids`` that have one ({} while no
        embedding model is bound)."""
        raise NotImplementedError

    def documents_written(self, conn: Any, changed: list[Entry]) -> None:
        """Called after ``changed`` rows of ``search_text`` were written (by default
        nothing: the engine's triggers keep its keyword index)."""

    # -- the algorithm --------------------------------------------------------------------

    def reindex(self, conn: Any, touched: Iterable[tuple[int, int]]) -> None:
        """Rewrite the index rows of messages whose window includes a touched message.

        Args:
            conn: A connection inside the caller's write transaction.
            touched: ``(channel_id, message_id)`` of every message stored, edited or
                deleted (a deleted one's rows go; its neighbours' windows lose it).
        """
        by_channel: dict[int, set[int]] = defaultdict(set)
        for channel_id, message_id in touched:
            by_channel[channel_id].add(message_id)
        if not by_channel:
            return
        every = sorted({mid for ids in by_channel.values() for mid in ids})
        self.drop_rows(conn, every)
        rewritten: set[int] = set()
        for channel_id, ids in by_channel.items():
            for lo, hi in self._segments(conn, channel_id, sorted(ids)):
                rewritten |= self.rebuild(conn, channel_id, lo, hi)
        # a reply carries its target's text in its window: rebuild the replies to touched ones
        replies = [
            (row[0], row[1]) for row in self._execute(
                conn, f"SELECT channel_id, id FROM messages WHERE {self._in('reply_to_id')}",
                (self.dialect.ids(every),))
            if row[1] not in rewritten
        ]
        for channel_id, message_id in replies:
            self.rebuild(conn, channel_id, message_id, message_id)

    def vectors_changed(self, conn: Any, ids: Sequence[int]) -> None:
        """Recompute the window vectors of every window holding one of ``ids``.

        Called when those messages' own vectors were stored or deleted.  A window's
        neighbours are symmetric (if B is within two messages and two hours of A, A is
        of B), so the windows holding a message are those of the messages in its own
        window, plus those of the messages replying to it.
        """
        if not ids:
            return
        holders = set(ids)
        batch = (self.dialect.ids(ids),)
        for (members,) in self._execute(
                conn, f"SELECT context_ids FROM search_text WHERE {self._in('id')}", batch):
            holders.update(int(m) for m in members.split())
        holders.update(row[0] for row in self._execute(
            conn, f"SELECT id FROM messages WHERE {self._in('reply_to_id')}", batch))
        self.refresh_vectors(conn, holders)

    def refresh_vectors(self, conn: Any, ids: Iterable[int]) -> None:
        """Store the window vector of each of ``ids`` (drop it where there is none).

        A message without content of its own, or whose window has no embedded member
        yet, has none (:func:`window_means`).
        """
        ids = sorted(set(ids))
        for start in range(0, len(ids), SEGMENT):  # bounded memory when a whole guild goes
            chunk = ids[start:start + SEGMENT]
            members = {  # the contentful windows of messages still stored
                mid: [int(m) for m in context_ids.split()] for mid, context_ids in self._execute(
                    conn, "SELECT s.id, s.context_ids FROM search_text s "
                    f"WHERE {self._in('s.id')} AND s.contentful "
                    "AND EXISTS (SELECT 1 FROM messages m WHERE m.id = s.id)",
                    (self.dialect.ids(chunk),))
            }
            self.write_window_vectors(conn, {mid: members.get(mid, []) for mid in chunk})

    def write_window_vectors(self, conn: Any, windows: dict[int, list[int]]) -> None:
        """Store the window vector of each message in ``windows`` (drop it where there
        is none): the normalised mean of its members' vectors (:func:`window_means`)."""
        wanted = {m for members in windows.values() for m in members}
        means = window_means(windows, self.member_vectors(conn, wanted)) if wanted else {}
        self._execute(conn, f"DELETE FROM window_vectors WHERE {self._in('id')}",
                      (self.dialect.ids(windows),))
        if means:
            conn.cursor().executemany(
                self.dialect.sql("INSERT INTO window_vectors(id, vector) VALUES (?, ?)"),
                [(mid, vector.astype(np.float16).tobytes()) for mid, vector in means.items()])

    def rebuild(
        self, conn: Any, channel_id: int, lo: int, hi: int, *, vectors: bool = True
    ) -> set[int]:
        """Rewrite the rows of messages ``lo..hi`` of a channel and of the neighbours whose
        windows reach them; their window vectors too unless ``vectors`` is off (a
        migration that computes them later).

        Returns:
            The ids whose rows were computed.
        """
        reach = BEFORE + AFTER
        before = self._rows(conn, "m.channel_id = ? AND m.id < ? ORDER BY m.id DESC LIMIT ?",
                            (channel_id, lo, reach))[::-1]
        middle = self._rows(conn, "m.channel_id = ? AND m.id BETWEEN ? AND ? ORDER BY m.id",
                            (channel_id, lo, hi))
        after = self._rows(conn, "m.channel_id = ? AND m.id > ? ORDER BY m.id LIMIT ?",
                           (channel_id, hi, reach))
        rows = before + middle + after
        first = max(0, len(before) - AFTER)  # earlier ones cannot see lo..hi
        last = len(before) + len(middle) + min(BEFORE, len(after))
        targets = self._reply_targets(conn, rows[first:last], channel_id)
        entries = [(_entry(rows, i, targets), rows[i]) for i in range(first, last)]
        self._write(conn, entries, vectors=vectors)
        return {row.id for _, row in entries}

    # -- helpers --------------------------------------------------------------------------

    def _in(self, column: str) -> str:
        return self.dialect.in_ids(column)

    def _execute(self, conn: Any, sql: str, params: Sequence[Any]) -> Any:
        return conn.execute(self.dialect.sql(sql), params)

    def _segments(self, conn: Any, channel_id: int, ids: list[int]) -> list[tuple[int, int]]:
        """One id range over the touched messages, or one per message when they lie far apart."""
        lo, hi = ids[0], ids[-1]
        between = self._execute(
            conn, "SELECT count(*) FROM messages WHERE channel_id = ? AND id BETWEEN ? AND ?",
            (channel_id, lo, hi)).fetchone()[0]
        if between <= 4 * len(ids) + 200:
            return [(lo, hi)]
        return [(i, i) for i in ids]

    def _rows(self, conn: Any, where: str, params: Sequence[Any]) -> list[WindowRow]:
        return [WindowRow(*row) for row in self._execute(
            conn, f"SELECT {_COLUMNS} WHERE {where}", params)]

    def _reply_targets(
        self, conn: Any, rows: list[WindowRow], channel_id: int
    ) -> dict[int, WindowRow]:
        wanted = {r.reply_to_id for r in rows if r.reply_to_id is not None}
        if not wanted:
            return {}
        found = self._rows(conn, f"{self._in('m.id')} AND m.channel_id = ?",
                           (self.dialect.ids(wanted), channel_id))
        return {r.id: r for r in found}

    def _write(self, conn: Any, entries: list[Entry], *, vectors: bool) -> None:
        """Write index rows, leaving alone the ones that would not change (keyword
        indexing is not free)."""
        if not entries:
            return
        stored = {
            row[0]: tuple(row) for row in self._execute(
                conn, "SELECT id, author, content, attachments, context, context_ids, contentful "
                f"FROM search_text WHERE {self._in('id')}",
                (self.dialect.ids(e[0][0] for e in entries),))
        }
        changed = [e for e in entries if stored.get(e[0][0]) != e[0]]
        if not changed:
            return
        # the members or the contentful flag changed: the window vector too
        refresh = [e[0][0] for e in changed if stored.get(e[0][0], ())[5:] != e[0][5:]]
        conn.cursor().executemany(self.dialect.sql(
            "INSERT INTO search_text(id, author, content, attachments, context, context_ids, "
            "contentful) VALUES (?, ?, ?, ?, ?, ?, ?) ON CONFLICT (id) DO UPDATE SET "
            "author = excluded.author, content = excluded.content, "
            "attachments = excluded.attachments, context = excluded.context, "
            "context_ids = excluded.context_ids, contentful = excluded.contentful"),
            [e[0] for e in changed])
        self.documents_written(conn, changed)
        if vectors:
            self.refresh_vectors(conn, refresh)


def _entry(rows: list[WindowRow], i: int, targets: dict[int, WindowRow]) -> tuple[Any, ...]:
    """The ``search_text`` row of ``rows[i]``: its window among ``rows`` (and its reply
    target from ``targets``)."""
    row = rows[i]
    window = [
        n for n in rows[max(0, i - BEFORE): i + AFTER + 1]
        if abs(n.created_at - row.created_at) <= GAP_MS
    ]
    target = targets.get(row.reply_to_id) if row.reply_to_id else None
    if target is not None and target not in window:
        window.insert(0, target)
    return (
        row.id, row.author, row.content, row.attachments,
        "\n".join(n.line for n in window), " ".join(str(n.id) for n in window),
        bool(row.attachments) or content_words(row.content) >= 2,
    )
