"""What the bot's public answers quote, on either engine (the contract's ``Quotes``).

A public answer shows stored messages' text to everyone in its channel.  Its message
id, channel and guild are kept with the id of each message it quotes
(``answer_quotes``); when one of those is forgotten or its text edited, the answer
moves to ``retractions`` (:func:`quotes_gone`, run by each engine's ``Forgetting``
inside the transaction that forgets or edits the message) and the cog takes it down
on Discord.  Ids only, never text.

The tables and their SQL are the same on both engines; an engine subclasses
:class:`BaseQuotes` only to take its locks (:meth:`BaseQuotes.lock`).
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from typing import Any

from memory.storage.contract import PostedAnswer
from memory.storage.dialect import Dialect, DialectNoun

__all__ = ["BaseQuotes", "quotes_gone"]

_DUE = "INSERT INTO retractions(answer_id, channel_id, guild_id) VALUES (?, ?, ?) " \
       "ON CONFLICT (answer_id) DO NOTHING"


def quotes_gone(conn: Any, dialect: Dialect, message_ids: Sequence[int]) -> None:
    """The answers quoting any of ``message_ids`` (forgotten, or their text edited) are due
    to be taken down; their quote rows go.  So do the rows of the answers among
    ``message_ids`` (deleted on Discord: nothing is left to take down).  Inside the
    caller's write transaction."""
    if not message_ids:
        return
    for table in ("answer_quotes", "retractions"):
        conn.execute(dialect.sql(f"DELETE FROM {table} WHERE {dialect.in_ids('answer_id')}"),
                     (dialect.ids(message_ids),))
    answers = conn.execute(dialect.sql(
        "SELECT DISTINCT answer_id, channel_id, guild_id FROM answer_quotes "
        f"WHERE {dialect.in_ids('quoted_id')} ORDER BY answer_id"),
        (dialect.ids(message_ids),)).fetchall()
    if not answers:
        return
    conn.cursor().executemany(dialect.sql(_DUE), [tuple(row) for row in answers])
    conn.execute(dialect.sql(f"DELETE FROM answer_quotes WHERE {dialect.in_ids('answer_id')}"),
                 (dialect.ids(row[0] for row in answers),))


class BaseQuotes(DialectNoun):
    """The contract's ``Quotes`` over one engine's database (``read`` and ``write``)."""

    def lock(self, conn: Any, guild_id: int) -> None:
        """Before an answer is recorded: what keeps a concurrent forget in order (by
        default nothing: SQLite has one writer)."""

    def record(self, answers: Iterable[tuple[PostedAnswer, Sequence[int]]], *,
               edited_since: int | None = None) -> list[int]:
        """Record each answer with the messages it quotes; one quoting a message no longer
        stored, or edited at or after ``edited_since``, is due at once (returned)."""
        due: list[int] = []
        with self._db.write() as conn:
            # guild by guild in ascending order, as every writer takes PostgreSQL's guild locks
            for answer, quoted in sorted(answers, key=lambda p: (p[0].guild_id, p[0].answer_id)):
                if not quoted:
                    continue
                self.lock(conn, answer.guild_id)
                quoted = sorted(set(quoted))
                stored = {row[0]: row[1] for row in self._execute(
                    conn, f"SELECT id, edited_at FROM messages WHERE {self._dialect.in_ids('id')}",
                    (self._dialect.ids(quoted),))}
                # an edit applied before this, after the answer's search read the old text,
                # found no quote row to make it due
                edited = edited_since is not None and any(
                    at is not None and at >= edited_since for at in stored.values())
                where = (answer.answer_id, answer.channel_id, answer.guild_id)
                if set(stored) != set(quoted) or edited:
                    self._execute(conn, _DUE, where)
                    due.append(answer.answer_id)
                    continue
                conn.cursor().executemany(self._dialect.sql(
                    "INSERT INTO answer_quotes(answer_id, quoted_id, channel_id, guild_id) "
                    "VALUES (?, ?, ?, ?) ON CONFLICT (answer_id, quoted_id) DO NOTHING"),
                    [(answer.answer_id, q, answer.channel_id, answer.guild_id) for q in quoted])
        return due

    def due(self, limit: int = 100, guild_ids: Iterable[int] | None = None) -> list[PostedAnswer]:
        """Up to ``limit`` answers due to be taken down, oldest first (only in ``guild_ids``
        when given)."""
        where, params = "", [limit]
        if guild_ids is not None:
            where, params = f"WHERE {self._dialect.in_ids('guild_id')} ", [
                self._dialect.ids(sorted(set(guild_ids))), limit]
        return [PostedAnswer(*row) for row in self._read(
            f"SELECT answer_id, channel_id, guild_id FROM retractions {where}"
            "ORDER BY answer_id LIMIT ?", params)]

    def retracted(self, answer_ids: Iterable[int]) -> None:
        """These answers are taken down (or can no longer be): no longer due."""
        ids = sorted(set(answer_ids))
        if not ids:
            return
        with self._db.write() as conn:
            self._execute(conn, f"DELETE FROM retractions WHERE {self._dialect.in_ids('answer_id')}",
                          (self._dialect.ids(ids),))
