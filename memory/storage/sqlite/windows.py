"""Conversational windows: what the keyword index holds for each message.

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
edited or deleted (:func:`reindex`): deleted text does not live on in a neighbour.

Each contentful window also has a stored *window vector* (``window_vectors``): the
normalised mean of its members' message vectors, kept as float16 so a search ranks
its candidates by their windows with one lookup.  It is recomputed whenever the
window's members change (:func:`reindex`) or a member's vector is stored or deleted
(:func:`vectors_changed`), so an edited or deleted message's vector does not live on
in its neighbours' window vectors either.

The window's shape is part of the index format: changing these constants needs a
new migration that rebuilds it.
"""

from __future__ import annotations

import logging
from collections import defaultdict
from collections.abc import Iterable, Iterator, Sequence
from contextlib import contextmanager
from dataclasses import dataclass
from typing import Any

from memory.storage.member_names import AUTHOR_JOIN, AUTHOR_NAMES
from memory.storage.sqlite.connection import IN_IDS, id_list
from memory.storage.sqlite.vectors import write_window_vectors
from memory.text import EMBED_CHARS, content_words

log = logging.getLogger(__name__)

BEFORE = 2
AFTER = 2
GAP_MS = 2 * 3_600_000  # a conversation pause longer than this ends the window
_SEGMENT = 5000  # messages rebuilt per pass when a whole channel is indexed

_COLUMNS = (
    f"m.id, m.channel_id, m.created_at, {AUTHOR_NAMES}, m.content, m.attachments, "
    f"m.reply_to_id FROM messages m {AUTHOR_JOIN}"
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


def reindex(conn: Any, touched: Iterable[tuple[int, int]]) -> None:
    """Rewrite the index rows of messages whose window includes a touched message.

    Args:
        conn: A connection inside the caller's write transaction.
        touched: ``(channel_id, message_id)`` of every message stored, edited or
            deleted (a deleted one's row goes; its neighbours' windows lose it).
    """
    by_channel: dict[int, set[int]] = defaultdict(set)
    for channel_id, message_id in touched:
        by_channel[channel_id].add(message_id)
    if not by_channel:
        return
    every = sorted({mid for ids in by_channel.values() for mid in ids})
    for table in ("search_text", "window_vectors"):
        conn.execute(
            f"DELETE FROM {table} WHERE id {IN_IDS} AND id NOT IN (SELECT id FROM messages)",
            (id_list(every),),
        )
    rewritten: set[int] = set()
    for channel_id, ids in by_channel.items():
        for lo, hi in _segments(conn, channel_id, sorted(ids)):
            rewritten |= _rebuild(conn, channel_id, lo, hi)
    # a reply carries its target's text in its window: rebuild the replies to touched ones
    replies = [
        (row[0], row[1]) for row in conn.execute(
            f"SELECT channel_id, id FROM messages WHERE reply_to_id {IN_IDS}", (id_list(every),)
        ) if row[1] not in rewritten
    ]
    for channel_id, message_id in replies:
        _rebuild(conn, channel_id, message_id, message_id)


def vectors_changed(conn: Any, ids: Sequence[int]) -> None:
    """Recompute the window vectors of every window holding one of ``ids``.

    Called when those messages' own vectors were stored or deleted.  A window's
    neighbours are symmetric (if B is within two messages and two hours of A, A is
    of B), so the windows holding a message are those of the messages in its own
    window, plus those of the messages replying to it.
    """
    if not ids:
        return
    holders = set(ids)
    batch = (id_list(ids),)
    for (members,) in conn.execute(f"SELECT context_ids FROM search_text WHERE id {IN_IDS}", batch):
        holders.update(int(m) for m in members.split())
    holders.update(row[0] for row in conn.execute(
        f"SELECT id FROM messages WHERE reply_to_id {IN_IDS}", batch))
    refresh_vectors(conn, holders)


def refresh_vectors(conn: Any, ids: Iterable[int]) -> None:
    """Store the window vector of each of ``ids`` (drop it where there is none).

    A window vector is the normalised mean of the window's embedded members'
    vectors (:func:`.vectors.write_window_vectors`); a message without content of
    its own, or whose window has no embedded member yet, has none.
    """
    ids = sorted(set(ids))
    for start in range(0, len(ids), _SEGMENT):  # bounded memory when a whole guild goes
        chunk = ids[start:start + _SEGMENT]
        members = {
            mid: [int(m) for m in context_ids.split()] for mid, context_ids in conn.execute(
                f"SELECT id, context_ids FROM search_text WHERE id {IN_IDS} AND contentful "
                "AND id IN (SELECT id FROM messages)", (id_list(chunk),))  # not one being deleted
        }
        write_window_vectors(conn, {mid: members.get(mid, []) for mid in chunk})


def index_all_window_vectors(conn: Any) -> None:
    """Compute every window's vector (a migration: windows stored before they had one)."""
    conn.execute(
        "CREATE TABLE IF NOT EXISTS window_vectors (id INTEGER PRIMARY KEY, vector BLOB NOT NULL)"
    )
    ids = [row[0] for row in conn.execute("SELECT id FROM search_text WHERE contentful")]
    refresh_vectors(conn, ids)
    log.info("computed the window vectors of %d messages", len(ids))


def index_all_windows(conn: Any) -> None:
    """Index every stored message (a migration: messages stored before windows existed)."""
    with _names_per_guild(conn):
        _index_all_windows(conn)


@contextmanager
def _names_per_guild(conn: Any) -> Iterator[None]:
    """Per-guild names for a database older than migration 11, while the block runs.

    This module reads a message's author from ``member_names`` (migration 11); when
    migration 7 runs on an older database, names are still one ``authors`` row per
    member, so a temporary table holds that row for each guild the member wrote in
    (what migration 11 itself will store), and is dropped afterwards.
    """
    if conn.execute("SELECT 1 FROM sqlite_master WHERE name = 'member_names'").fetchone():
        yield
        return
    conn.execute("CREATE TEMP TABLE member_names (guild_id INTEGER NOT NULL, "
                 "author_id INTEGER NOT NULL, name TEXT NOT NULL, display_name TEXT NOT NULL, "
                 "PRIMARY KEY (guild_id, author_id))")
    try:
        conn.execute("INSERT INTO temp.member_names SELECT p.guild_id, a.id, a.name, a.display_name "
                     "FROM (SELECT DISTINCT guild_id, author_id FROM messages) p "
                     "JOIN authors a ON a.id = p.author_id")
        yield
    finally:
        conn.execute("DROP TABLE temp.member_names")


def _index_all_windows(conn: Any) -> None:
    channels = [row[0] for row in conn.execute("SELECT DISTINCT channel_id FROM messages")]
    for channel_id in channels:
        ids = [row[0] for row in conn.execute(
            "SELECT id FROM messages WHERE channel_id = ? ORDER BY id", (channel_id,))]
        for start in range(0, len(ids), _SEGMENT):
            chunk = ids[start:start + _SEGMENT]
            _rebuild(conn, channel_id, chunk[0], chunk[-1], vectors=False)  # migration 8's work
    log.info("indexed the windows of %d channels", len(channels))


def _segments(conn: Any, channel_id: int, ids: list[int]) -> list[tuple[int, int]]:
    """One id range over the touched messages, or one per message when they lie far apart."""
    lo, hi = ids[0], ids[-1]
    between = conn.execute(
        "SELECT count(*) FROM messages WHERE channel_id = ? AND id BETWEEN ? AND ?",
        (channel_id, lo, hi),
    ).fetchone()[0]
    if between <= 4 * len(ids) + 200:
        return [(lo, hi)]
    return [(i, i) for i in ids]


def _rebuild(conn: Any, channel_id: int, lo: int, hi: int, *, vectors: bool = True) -> set[int]:
    """Rewrite the rows of messages ``lo..hi`` and of the neighbours whose windows reach them."""
    reach = BEFORE + AFTER
    before = _rows(conn, "m.channel_id = ? AND m.id < ? ORDER BY m.id DESC LIMIT ?",
                   (channel_id, lo, reach))[::-1]
    middle = _rows(conn, "m.channel_id = ? AND m.id BETWEEN ? AND ? ORDER BY m.id",
                   (channel_id, lo, hi))
    after = _rows(conn, "m.channel_id = ? AND m.id > ? ORDER BY m.id LIMIT ?",
                  (channel_id, hi, reach))
    rows = before + middle + after
    first = max(0, len(before) - AFTER)  # earlier ones cannot see lo..hi
    last = len(before) + len(middle) + min(BEFORE, len(after))
    targets = _reply_targets(conn, rows[first:last], channel_id)
    entries = []
    for i in range(first, last):
        row = rows[i]
        window = [
            n for n in rows[max(0, i - BEFORE): i + AFTER + 1]
            if abs(n.created_at - row.created_at) <= GAP_MS
        ]
        target = targets.get(row.reply_to_id) if row.reply_to_id else None
        if target is not None and target not in window:
            window.insert(0, target)
        entries.append((
            row.id, row.author, row.content, row.attachments,
            "\n".join(n.line for n in window), " ".join(str(n.id) for n in window),
            int(bool(row.attachments) or content_words(row.content) >= 2),
        ))
    _write(conn, entries, vectors=vectors)
    return {entry[0] for entry in entries}


def _rows(conn: Any, where: str, params: Sequence[Any]) -> list[_Row]:
    return [_Row(*row) for row in conn.execute(f"SELECT {_COLUMNS} WHERE {where}", params)]


def _reply_targets(conn: Any, rows: list[_Row], channel_id: int) -> dict[int, _Row]:
    wanted = {r.reply_to_id for r in rows if r.reply_to_id is not None}
    if not wanted:
        return {}
    found = _rows(conn, f"m.id {IN_IDS} AND m.channel_id = ?", (id_list(wanted), channel_id))
    return {r.id: r for r in found}


def _write(conn: Any, entries: list[tuple], *, vectors: bool = True) -> None:
    """Write index rows, leaving alone the ones that would not change (FTS work is not free)."""
    if not entries:
        return
    stored = {
        row[0]: tuple(row) for row in conn.execute(
            "SELECT id, author, content, attachments, context, context_ids, contentful "
            f"FROM search_text WHERE id {IN_IDS}", (id_list(e[0] for e in entries),))
    }
    changed = [e for e in entries if stored.get(e[0]) != e]
    refresh = [e[0] for e in changed if stored.get(e[0], ())[5:] != e[5:]]  # members, contentful
    conn.executemany(
        "INSERT INTO search_text(id, author, content, attachments, context, context_ids, "
        "contentful) VALUES (?, ?, ?, ?, ?, ?, ?) ON CONFLICT(id) DO UPDATE SET "
        "author = excluded.author, content = excluded.content, "
        "attachments = excluded.attachments, context = excluded.context, "
        "context_ids = excluded.context_ids, contentful = excluded.contentful",
        changed,
    )
    if vectors:
        refresh_vectors(conn, refresh)
