"""Conversational windows on PostgreSQL: what both keyword fields hold for each message.

The same windows as SQLite's (:mod:`memory.storage.sqlite.windows`, whose module
says why they exist and whose constants fix their shape): a message with up to two
before and two after it in its channel, no further apart than two hours, plus the
message it replies to when that is in the same channel.  ``search_text`` keeps each
window's text and members; :mod:`.keywords` turns the rows into keyword documents
(``keyword_messages``, ``keyword_windows``) in the same transaction, and
``index_stats`` follows their totals.  Each contentful window's vector (the
normalised mean of its members' vectors, float16) is kept in ``window_vectors``.

Every function takes the connection of the caller's write transaction, which holds
the guild's write lock (:func:`.database.lock_guilds`): two processes never rebuild
one window from snapshots that miss each other's rows.
"""

from __future__ import annotations

import logging
from collections import defaultdict
from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np

from memory.storage.member_names import AUTHOR_JOIN, AUTHOR_NAMES
from memory.storage.postgres import keywords
from memory.storage.sqlite.windows import AFTER, BEFORE, GAP_MS  # one window shape for both engines
from memory.text import EMBED_CHARS, content_words

log = logging.getLogger(__name__)

_SEGMENT = 5000

_COLUMNS = (
    f"m.id, m.channel_id, m.created_at, {AUTHOR_NAMES}, m.content, m.attachments, "
    f"m.reply_to_id, m.guild_id, m.author_id FROM messages m {AUTHOR_JOIN}"
)


@dataclass(frozen=True)
class _Row:
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
        return " ".join(dict.fromkeys(n for n in (self.display_name, self.name) if n))

    @property
    def line(self) -> str:
        """The message in its neighbours' windows: a huge one (an import can hold 50 MB)
        gives them its start, as the embedder does, not all of it to index again."""
        return f"{self.display_name or self.name}: {self.content[:EMBED_CHARS]}"


def vector_table_exists(conn: Any) -> bool:
    """Whether ``message_vectors`` exists (an embedding model is bound)."""
    return conn.execute("SELECT to_regclass('message_vectors') IS NOT NULL").fetchone()[0]


def reindex(conn: Any, touched: Iterable[tuple[int, int]]) -> None:
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
    drop_rows(conn, every)
    rewritten: set[int] = set()
    for channel_id, ids in by_channel.items():
        for lo, hi in _segments(conn, channel_id, sorted(ids)):
            rewritten |= _rebuild(conn, channel_id, lo, hi)
    replies = [
        (row[0], row[1]) for row in conn.execute(
            "SELECT channel_id, id FROM messages WHERE reply_to_id = ANY(%s)", (every,))
        if row[1] not in rewritten
    ]
    for channel_id, message_id in replies:
        _rebuild(conn, channel_id, message_id, message_id)


def drop_rows(conn: Any, ids: Sequence[int]) -> None:
    """Remove the index rows of those of ``ids`` whose message is gone."""
    gone = [row[0] for row in conn.execute(
        "SELECT i FROM unnest(%s::bigint[]) i WHERE NOT EXISTS "
        "(SELECT 1 FROM messages m WHERE m.id = i)", (list(ids),))]
    if not gone:
        return
    conn.execute("DELETE FROM search_text WHERE id = ANY(%s)", (gone,))
    conn.execute("DELETE FROM window_vectors WHERE id = ANY(%s)", (gone,))
    keywords.delete_documents(conn, gone)


def vectors_changed(conn: Any, ids: Sequence[int]) -> None:
    """Recompute the window vectors of every window holding one of ``ids``.

    Called when those messages' own vectors were stored or deleted: the windows
    holding a message are those of the messages in its own window, plus those of the
    messages replying to it.
    """
    if not ids:
        return
    holders = set(ids)
    for (members,) in conn.execute("SELECT context_ids FROM search_text WHERE id = ANY(%s)",
                                   (list(ids),)):
        holders.update(int(m) for m in members.split())
    holders.update(row[0] for row in conn.execute(
        "SELECT id FROM messages WHERE reply_to_id = ANY(%s)", (list(ids),)))
    refresh_vectors(conn, holders)


def refresh_vectors(conn: Any, ids: Iterable[int]) -> None:
    """Store the window vector of each of ``ids`` (drop it where there is none)."""
    ids = sorted(set(ids))
    for start in range(0, len(ids), _SEGMENT):
        chunk = ids[start:start + _SEGMENT]
        means = _window_means(conn, chunk)
        conn.execute("DELETE FROM window_vectors WHERE id = ANY(%s)", (chunk,))
        if means:
            conn.cursor().executemany(
                "INSERT INTO window_vectors(id, vector) VALUES (%s, %s)",
                [(mid, vector.astype(np.float16).tobytes()) for mid, vector in means.items()])


def _window_means(conn: Any, ids: list[int]) -> dict[int, np.ndarray]:
    if not vector_table_exists(conn):
        return {}
    members = {
        mid: [int(m) for m in context_ids.split()] for mid, context_ids in conn.execute(
            "SELECT s.id, s.context_ids FROM search_text s WHERE s.id = ANY(%s) AND s.contentful "
            "AND EXISTS (SELECT 1 FROM messages m WHERE m.id = s.id)", (ids,))
    }
    wanted = sorted({m for window in members.values() for m in window})
    floats = {mid: np.asarray(vector.to_numpy() if hasattr(vector, "to_numpy") else vector,
                              dtype=np.float32)
              for mid, vector in conn.execute(
                  "SELECT message_id, embedding FROM message_vectors WHERE message_id = ANY(%s)",
                  (wanted,))} if wanted else {}
    owners, rows = [], []
    for mid, window in members.items():
        found = [floats[m] for m in window if m in floats]
        if found:
            owners.append(mid)
            rows.append(np.sum(found, axis=0))
    if not owners:
        return {}
    sums = np.stack(rows)
    sums /= np.maximum(np.linalg.norm(sums, axis=1, keepdims=True), 1e-12)
    return dict(zip(owners, sums))


def _segments(conn: Any, channel_id: int, ids: list[int]) -> list[tuple[int, int]]:
    """One id range over the touched messages, or one per message when they lie far apart."""
    lo, hi = ids[0], ids[-1]
    between = conn.execute(
        "SELECT count(*) FROM messages WHERE channel_id = %s AND id BETWEEN %s AND %s",
        (channel_id, lo, hi)).fetchone()[0]
    if between <= 4 * len(ids) + 200:
        return [(lo, hi)]
    return [(i, i) for i in ids]


def _rebuild(conn: Any, channel_id: int, lo: int, hi: int) -> set[int]:
    """Rewrite the rows of messages ``lo..hi`` and of the neighbours whose windows reach them."""
    reach = BEFORE + AFTER
    before = _rows(conn, "m.channel_id = %s AND m.id < %s ORDER BY m.id DESC LIMIT %s",
                   (channel_id, lo, reach))[::-1]
    middle = _rows(conn, "m.channel_id = %s AND m.id BETWEEN %s AND %s ORDER BY m.id",
                   (channel_id, lo, hi))
    after = _rows(conn, "m.channel_id = %s AND m.id > %s ORDER BY m.id LIMIT %s",
                  (channel_id, hi, reach))
    rows = before + middle + after
    first = max(0, len(before) - AFTER)
    last = len(before) + len(middle) + min(BEFORE, len(after))
    targets = _reply_targets(conn, rows[first:last], channel_id)
    entries = []
    for i in range(first, last):
        row = rows[i]
        window = [n for n in rows[max(0, i - BEFORE): i + AFTER + 1]
                  if abs(n.created_at - row.created_at) <= GAP_MS]
        target = targets.get(row.reply_to_id) if row.reply_to_id else None
        if target is not None and target not in window:
            window.insert(0, target)
        entries.append((
            (row.id, row.author, row.content, row.attachments,
             "\n".join(n.line for n in window), " ".join(str(n.id) for n in window),
             bool(row.attachments) or content_words(row.content) >= 2),
            row,
        ))
    _write(conn, entries)
    return {entry[0][0] for entry in entries}


def _rows(conn: Any, where: str, params: Sequence[Any]) -> list[_Row]:
    return [_Row(*row) for row in conn.execute(f"SELECT {_COLUMNS} WHERE {where}", params)]


def _reply_targets(conn: Any, rows: list[_Row], channel_id: int) -> dict[int, _Row]:
    wanted = sorted({r.reply_to_id for r in rows if r.reply_to_id is not None})
    if not wanted:
        return {}
    found = _rows(conn, "m.id = ANY(%s) AND m.channel_id = %s", (wanted, channel_id))
    return {r.id: r for r in found}


def _write(conn: Any, entries: list[tuple[tuple, _Row]]) -> None:
    """Write index rows, leaving alone the ones that would not change."""
    if not entries:
        return
    stored = {
        row[0]: tuple(row) for row in conn.execute(
            "SELECT id, author, content, attachments, context, context_ids, contentful "
            "FROM search_text WHERE id = ANY(%s)", ([e[0][0] for e in entries],))
    }
    changed = [e for e in entries if stored.get(e[0][0]) != e[0]]
    if not changed:
        return
    refresh = [e[0][0] for e in changed if stored.get(e[0][0], ())[5:] != e[0][5:]]
    conn.cursor().executemany(
        "INSERT INTO search_text(id, author, content, attachments, context, context_ids, "
        "contentful) VALUES (%s, %s, %s, %s, %s, %s, %s) ON CONFLICT (id) DO UPDATE SET "
        "author = excluded.author, content = excluded.content, "
        "attachments = excluded.attachments, context = excluded.context, "
        "context_ids = excluded.context_ids, contentful = excluded.contentful",
        [e[0] for e in changed])
    _write_documents(conn, changed)
    refresh_vectors(conn, refresh)


def _write_documents(conn: Any, changed: list[tuple[tuple, _Row]]) -> None:
    """Rewrite the keyword documents of ``changed`` rows."""
    keywords.write_documents(conn, [
        keywords.Document(row.id, row.guild_id, row.channel_id, row.author_id, row.created_at,
                          bool(row.attachments), entry[6], (entry[1], entry[2], entry[3], entry[4]))
        for entry, row in changed])
