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

import numpy as np

from memory.records import PendingMessage
from memory.storage import claims
from memory.storage.backlog import KEPT, BaseBacklog
from memory.storage.pending import still_current
from memory.storage.sqlite.connection import DIALECT, IN_IDS, id_list
from memory.storage.sqlite.database import SQLiteDatabase, now_ms
from memory.storage.sqlite.meta import SQLiteMeta
from memory.storage.sqlite.vectors import Vec0Table

log = logging.getLogger(__name__)

# what an embedder reads of a message: a few thousand characters at most, whatever it
# holds (memory.text.EMBED_CHARS), so one huge message cannot fill the memory


class SQLiteBacklog(BaseBacklog):
    """The contract's ``Backlog`` on one database.

    Args:
        database: The database.
        meta: Checked before vectors are written (another process may have
            re-embedded the database with another model).
        table: The vector table the vectors go to.
    """

    def __init__(self, database: SQLiteDatabase, meta: SQLiteMeta, table: Vec0Table) -> None:
        super().__init__(database, DIALECT)
        self._meta = meta
        self._table = table
        self._locks = claims.OwnerLocks(database.location)

    def pending_count(self) -> int:
        """How many stored messages have no vector yet."""
        return self._db.read(f"SELECT count(*) FROM messages m WHERE m.embedded = 0 AND {KEPT}")[0][0]

    def pending(self, limit: int) -> list[PendingMessage]:
        """Return up to ``limit`` unembedded messages, oldest first, with their antecedent.

        A message's antecedent is the message it replies to if stored in the same
        channel (or thread), else the previous message in its channel.  Text from
        another channel never enters a message's vector, whatever path stored the
        reply: a search by that text would tell readers of this channel what the
        other said.  Nothing is claimed: an embedder uses :meth:`claim`.
        """
        return self._pending_where(f"m.embedded = 0 AND {KEPT} ORDER BY m.id LIMIT ?", (limit,))

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
                f"SELECT m.id FROM messages m WHERE m.embedded = 0 AND {KEPT} AND NOT EXISTS "
                "(SELECT 1 FROM embedding_claims c WHERE c.message_id = m.id) "
                "ORDER BY m.id LIMIT ?", (limit,))]
            conn.executemany(
                "INSERT INTO embedding_claims(message_id, owner, expires_at) VALUES (?, ?, ?)",
                [(mid, owner, now + int(ttl_s * 1000)) for mid in ids],
            )
        return self.messages(ids)

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
                current -= self._claimed_by_others(conn, messages, owner, now_ms())
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
