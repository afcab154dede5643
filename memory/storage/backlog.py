"""The embedding backlog on either engine: what an embedder reads, and the messages it
set aside.

Each engine's ``Backlog`` keeps its own claims (SQLite: rows and per-process locks;
PostgreSQL: ``FOR UPDATE SKIP LOCKED`` and advisory locks) and its own
``write_vectors``; :class:`BaseBacklog` holds what is the same on both: a pending
message read with its antecedent (:meth:`BaseBacklog.messages`) and the set-aside
list.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from memory.records import PendingMessage, SetAside
from memory.storage.dialect import DialectNoun
from memory.storage.member_names import AUTHOR_JOIN, AUTHOR_NAME
from memory.storage.messages import message_fields
from memory.storage.pending import pending_message
from memory.text import EMBED_CHARS

__all__ = ["KEPT", "BaseBacklog"]

_COLUMNS = (f"m.id, m.guild_id, m.channel_id, m.author_id, {AUTHOR_NAME}, "
            f"substr(m.content, 1, {EMBED_CHARS}), m.created_at, c.name, m.reply_to_id, "
            f"substr(m.attachments, 1, {EMBED_CHARS})")
KEPT = "NOT EXISTS (SELECT 1 FROM embedding_set_aside s WHERE s.message_id = m.id)"
"""A message ``m`` not set aside after the embedder failed on it (:class:`SetAside`)."""


class BaseBacklog(DialectNoun):
    """The contract's ``Backlog`` reads and set-aside list, on one engine."""

    def messages(self, ids: Sequence[int]) -> list[PendingMessage]:
        """``ids`` as an embedder reads them (with their antecedent), oldest first,
        embedded or not (``reembed`` embeds them again)."""
        return self._pending_where(f"{self._dialect.in_ids('m.id')} ORDER BY m.id",
                                   (self._dialect.ids(ids),))

    def set_aside_messages(self, limit: int = 100) -> list[SetAside]:
        """The messages set aside, oldest first (see the contract)."""
        return [SetAside(*row) for row in self._read(
            "SELECT message_id, model, reason, set_at FROM embedding_set_aside "
            "ORDER BY set_at, message_id LIMIT ?", (int(limit),))]

    def set_aside_count(self) -> int:
        """How many messages are set aside."""
        return int(self._read("SELECT count(*) FROM embedding_set_aside")[0][0])

    def retry_set_aside(self, *, keep_model: str | None = None) -> int:
        """Put set-aside messages back in the backlog (see the contract)."""
        where, params = ("model <> ?", (keep_model,)) if keep_model else ("TRUE", ())
        if self._db.read_only or not self._read(
                f"SELECT 1 FROM embedding_set_aside WHERE {where} LIMIT 1", params):
            return 0
        with self._db.write() as conn:
            return int(self._execute(conn, f"DELETE FROM embedding_set_aside WHERE {where}",
                                     params).rowcount)

    def _reread(self, messages: Sequence[PendingMessage]) -> list[PendingMessage]:
        """``messages`` as stored now (inside a write: as that transaction sees them)."""
        return self._pending_where(self._dialect.in_ids("m.id"),
                                   (self._dialect.ids(m.id for m in messages),))

    def _pending_where(self, where: str, params: Sequence[Any]) -> list[PendingMessage]:
        """Pending messages (shared SQL ``where`` over ``m``) with their antecedent.

        A message's antecedent is the message it replies to if stored in the same
        channel (or thread), else the previous message in its channel.  Text from
        another channel never enters a message's vector, whatever path stored the
        reply: a search by that text would tell readers of this channel what the
        other said.
        """
        rows = self._read(
            f"""SELECT {_COLUMNS},
                      COALESCE(
                        (SELECT r.id FROM messages r WHERE r.id = m.reply_to_id
                           AND r.channel_id = m.channel_id),
                        (SELECT p.id FROM messages p WHERE p.channel_id = m.channel_id
                           AND p.id < m.id ORDER BY p.id DESC LIMIT 1))
               FROM messages m {AUTHOR_JOIN}
               JOIN channels c ON c.id = m.channel_id
               WHERE {where}""", params)
        antecedents = self._antecedents([row[10] for row in rows if row[10] is not None])
        return [pending_message(message_fields(row), antecedents.get(row[10])) for row in rows]

    def _antecedents(self, ids: list[int]) -> dict[int, tuple[int, str, str]]:
        """The id, author (as shown) and text of each of ``ids``."""
        if not ids:
            return {}
        rows = self._read(
            f"SELECT m.id, {AUTHOR_NAME}, substr(m.content, 1, {EMBED_CHARS}) FROM messages m "
            f"{AUTHOR_JOIN} WHERE {self._dialect.in_ids('m.id')}", (self._dialect.ids(ids),))
        return {row[0]: (row[0], row[1], row[2]) for row in rows}

    def _claimed_by_others(
        self, conn: Any, messages: Sequence[PendingMessage], owner: str, now: int
    ) -> set[int]:
        """Those of ``messages`` another owner holds an unexpired claim on (inside ``conn``)."""
        return {row[0] for row in self._execute(
            conn, "SELECT message_id FROM embedding_claims WHERE owner <> ? AND expires_at > ? "
            f"AND {self._dialect.in_ids('message_id')}",
            (owner, now, self._dialect.ids(m.id for m in messages)))}
