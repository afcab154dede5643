"""The embedding backlog: messages stored with ``embedded = 0``, and embedders' claims.

Messages are written first and embedded later in batches (:meth:`SQLiteBacklog.claim`
/ :meth:`SQLiteBacklog.write_vectors`), so a crash between the two loses nothing: the
next run finds the backlog by the ``embedded = 0`` flag.  A claim
(``embedding_claims``) keeps concurrent embedders off each other's batches and dies
with the process that made it (:mod:`memory.storage.claims`).
"""

from __future__ import annotations

import json
import logging
from collections.abc import Mapping, Sequence
from typing import Any

import numpy as np

from memory.records import PendingMessage, SetAside
from memory.storage import claims
from memory.storage.pending import pending_message, still_current
from memory.storage.sqlite.connection import IN_IDS, id_list
from memory.storage.sqlite.database import SQLiteDatabase, now_ms
from memory.storage.sqlite.messages import AUTHOR_JOIN, AUTHOR_NAME, message_fields
from memory.storage.sqlite.meta import SQLiteMeta
from memory.storage.sqlite.vectors import Vec0Table
from memory.text import EMBED_CHARS

log = logging.getLogger(__name__)

# what an embedder reads of a message: a few thousand characters at most, whatever it
# holds (memory.text.EMBED_CHARS), so one huge message cannot fill the memory
_COLUMNS = (f"m.id, m.guild_id, m.channel_id, m.author_id, {AUTHOR_NAME}, "
            f"substr(m.content, 1, {EMBED_CHARS}), m.created_at, c.name, m.reply_to_id, "
            f"substr(m.attachments, 1, {EMBED_CHARS})")
# not set aside after the embedder failed on it (SetAside)
_KEPT = "NOT EXISTS (SELECT 1 FROM embedding_set_aside s WHERE s.message_id = m.id)"


class SQLiteBacklog:
    """The contract's ``Backlog`` on one database.

    Args:
        database: The database.
        meta: Checked before vectors are written (another process may have
            re-embedded the database with another model).
        table: The vector table the vectors go to.
    """

    def __init__(self, database: SQLiteDatabase, meta: SQLiteMeta, table: Vec0Table) -> None:
        self._db = database
        self._meta = meta
        self._table = table
        self._locks = claims.OwnerLocks(database.location)

    def pending_count(self) -> int:
        """How many stored messages have no vector yet."""
        return self._db.read(f"SELECT count(*) FROM messages m WHERE m.embedded = 0 AND {_KEPT}")[0][0]

    def pending(self, limit: int) -> list[PendingMessage]:
        """Return up to ``limit`` unembedded messages, oldest first, with their antecedent.

        A message's antecedent is the message it replies to if stored in the same
        channel (or thread), else the previous message in its channel.  Text from
        another channel never enters a message's vector, whatever path stored the
        reply: a search by that text would tell readers of this channel what the
        other said.  Nothing is claimed: an embedder uses :meth:`claim`.
        """
        return self._pending_where(f"m.embedded = 0 AND {_KEPT} ORDER BY m.id LIMIT ?", (limit,))

    def messages(self, ids: Sequence[int]) -> list[PendingMessage]:
        """``ids`` as an embedder reads them (with their antecedent), oldest first,
        embedded or not (``reembed`` embeds them again)."""
        return self._pending_where(f"m.id {IN_IDS} ORDER BY m.id", (id_list(ids),))

    def claim(self, limit: int, *, owner: str, ttl_s: float = 600.0) -> list[PendingMessage]:
        """Claim up to ``limit`` unembedded messages for ``owner`` and return them.

        A message claimed by another embedder is left out until its claim is
        released (:meth:`write_vectors`, :meth:`release`), its process ends
        (:mod:`memory.storage.claims`: a killed embedder's batch is back at once, also
        under a new host name, by its lock), or the claim expires after ``ttl_s``
        (where no lock can be seen), so concurrent embedders share the backlog
        instead of repeating each other's work.

        Args:
            owner: A name from :func:`memory.storage.claims.process_owner`.
        """
        self._locks.hold(owner)  # before any claim row names it: alive while it runs
        now = now_ms()
        with self._db.write() as conn:
            conn.execute("DELETE FROM embedding_claims WHERE expires_at <= ?", (now,))
            owners = [row[0] for row in conn.execute("SELECT DISTINCT owner FROM embedding_claims")]
            dead = [o for o in owners if claims.is_dead(o)]
            dead += self._locks.ended([o for o in owners if o not in dead])
            if dead:
                log.info("taking back the embedding claims of %d ended processes", len(dead))
                conn.execute(f"DELETE FROM embedding_claims WHERE owner {IN_IDS}", (json.dumps(dead),))
            ids = [row[0] for row in conn.execute(
                f"SELECT m.id FROM messages m WHERE m.embedded = 0 AND {_KEPT} AND NOT EXISTS "
                "(SELECT 1 FROM embedding_claims c WHERE c.message_id = m.id) "
                "ORDER BY m.id LIMIT ?", (limit,))]
            conn.executemany(
                "INSERT INTO embedding_claims(message_id, owner, expires_at) VALUES (?, ?, ?)",
                [(mid, owner, now + int(ttl_s * 1000)) for mid in ids],
            )
        return self._pending_where(f"m.id {IN_IDS} ORDER BY m.id", (id_list(ids),))

    def release(self, owner: str) -> None:
        """Give up every claim ``owner`` still holds (its messages stay pending)."""
        if not self._db.read_only:
            with self._db.write() as conn:
                conn.execute("DELETE FROM embedding_claims WHERE owner = ?", (owner,))
        self._locks.release(owner)

    def set_aside(self, failures: Mapping[int, str], *, model: str) -> None:
        """Take messages ``model`` failed to embed out of the backlog (see the contract)."""
        now = now_ms()
        with self._db.write() as conn:
            conn.executemany(
                "INSERT OR REPLACE INTO embedding_set_aside(message_id, model, reason, set_at) "
                "SELECT ?, ?, ?, ? WHERE EXISTS (SELECT 1 FROM messages WHERE id = ?)",
                [(mid, model, reason, now, mid) for mid, reason in failures.items()])
            conn.execute(f"DELETE FROM embedding_claims WHERE message_id {IN_IDS}",
                         (id_list(failures),))

    def set_aside_messages(self, limit: int = 100) -> list[SetAside]:
        """The messages set aside, oldest first (see the contract)."""
        return [SetAside(*row) for row in self._db.read(
            "SELECT message_id, model, reason, set_at FROM embedding_set_aside "
            "ORDER BY set_at, message_id LIMIT ?", (limit,))]

    def set_aside_count(self) -> int:
        """How many messages are set aside."""
        return int(self._db.read("SELECT count(*) FROM embedding_set_aside")[0][0])

    def retry_set_aside(self, *, keep_model: str | None = None) -> int:
        """Put set-aside messages back in the backlog (see the contract)."""
        where, params = ("model != ?", (keep_model,)) if keep_model else ("1", ())
        if self._db.read_only or not self._db.read(
                f"SELECT 1 FROM embedding_set_aside WHERE {where} LIMIT 1", params):
            return 0
        with self._db.write() as conn:
            return conn.execute(f"DELETE FROM embedding_set_aside WHERE {where}", params).rowcount

    def close(self) -> None:
        """Let go of every owner's lock (their claims are taken back by the next claim)."""
        self._locks.close()

    def write_vectors(
        self, messages: Sequence[PendingMessage], vectors: np.ndarray, *, owner: str | None = None
    ) -> None:
        """Store one vector per pending message and mark them embedded, atomically.

        A message deleted or edited since it was read is skipped: its vector would
        be an orphan or describe the old text; so is one whose antecedent (or author
        name) changed meanwhile (:func:`memory.storage.pending.still_current`).  An
        edited one stays pending and is embedded again from its current texts.  With
        ``owner``, a message another embedder has claimed meanwhile (``owner``'s claim
        expired) is skipped too, and ``owner``'s claims on these messages are released.
        """
        if len(messages) != len(vectors):
            raise ValueError("one vector per message is required")
        vectors = np.ascontiguousarray(vectors, dtype=np.float32)
        with self._db.write() as conn:
            self._meta.check_model_unchanged()  # inside: no reembed can slip in before the write
            current = still_current(messages, self._reread(messages))
            if owner is not None:
                current -= _claimed_by_others(conn, messages, owner)
            rows = [
                (m.id, m.guild_id, m.channel_id, m.author_id, m.created_at, bool(m.attachments), v)
                for m, v in zip(messages, vectors) if m.id in current
            ]
            self._table.write(conn, rows)
            conn.execute(
                f"UPDATE messages SET embedded = 1 WHERE id {IN_IDS}",
                (id_list(row[0] for row in rows),),
            )
            if owner is not None:
                conn.execute(
                    f"DELETE FROM embedding_claims WHERE owner = ? AND message_id {IN_IDS}",
                    (owner, id_list(m.id for m in messages)),
                )

    def _reread(self, messages: Sequence[PendingMessage]) -> list[PendingMessage]:
        """``messages`` as stored now (inside a write: as that transaction sees them)."""
        return self._pending_where(f"m.id {IN_IDS}", (id_list(m.id for m in messages),))

    def _pending_where(self, where: str, params: Sequence[Any]) -> list[PendingMessage]:
        rows = self._db.read(
            f"""SELECT {_COLUMNS},
                      COALESCE(
                        (SELECT r.id FROM messages r WHERE r.id = m.reply_to_id
                           AND r.channel_id = m.channel_id),
                        (SELECT p.id FROM messages p WHERE p.channel_id = m.channel_id
                           AND p.id < m.id ORDER BY p.id DESC LIMIT 1))
               FROM messages m {AUTHOR_JOIN}
               JOIN channels c ON c.id = m.channel_id
               WHERE {where}""",
            params,
        )
        antecedents = self._antecedents([row[10] for row in rows if row[10] is not None])
        return [pending_message(message_fields(row), antecedents.get(row[10])) for row in rows]

    def _antecedents(self, ids: list[int]) -> dict[int, tuple[int, str, str]]:
        """The id, author (as shown) and text of each of ``ids``."""
        rows = self._db.read(
            f"SELECT m.id, {AUTHOR_NAME}, substr(m.content, 1, {EMBED_CHARS}) FROM messages m "
            f"{AUTHOR_JOIN} WHERE m.id {IN_IDS}",
            (id_list(ids),),
        )
        return {row[0]: (row[0], row[1], row[2]) for row in rows}


def _claimed_by_others(conn: Any, messages: Sequence[PendingMessage], owner: str) -> set[int]:
    return {row[0] for row in conn.execute(
        f"SELECT message_id FROM embedding_claims WHERE owner != ? AND expires_at > ? "
        f"AND message_id {IN_IDS}",
        (owner, now_ms(), id_list(m.id for m in messages)),
    )}

