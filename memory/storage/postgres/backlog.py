"""The embedding backlog on PostgreSQL: messages stored with ``embedded = false``, and
embedders' claims, shared by any number of processes on any number of hosts.

A claim is a row of ``embedding_claims`` written in a short transaction that picks
its messages with ``FOR UPDATE SKIP LOCKED``, so concurrent claimers never wait for
each other and never pick the same message (the claim rows' primary key settles
the one race left: a row another claimer committed a moment before).

A claim dies with its process, on any host: each owner holds a session-level
advisory lock on a connection of its own for as long as it claims; when its process
ends (killed or not) the server closes that session and the lock goes.  A claim
whose owner's lock is no longer held (``pg_locks``) is taken back by the next
``claim``, so a killed embedder's batch is embedded again at once; the
time-to-live stays as a last resort (a session the network left half-open).
"""

from __future__ import annotations

import hashlib
import logging
import threading
from collections.abc import Mapping, Sequence
from typing import Any

import numpy as np

from memory.records import PendingMessage
from memory.storage.backlog import KEPT, BaseBacklog
from memory.storage.pending import still_current
from memory.storage.postgres import connection, vectors
from memory.storage.postgres.connection import DIALECT
from memory.storage.postgres.database import PostgresDatabase, lock_guilds, now_ms

log = logging.getLogger(__name__)

# what an embedder reads of a message: a few thousand characters at most, whatever it
# holds (memory.text.EMBED_CHARS), so one huge message cannot fill the memory


# Reads of the backlog one claim makes when other claims keep taking what it read.
CLAIM_TRIES = 5


def owner_key(owner: str) -> int:
    """The 64-bit advisory lock key of a claim owner (signed, as PostgreSQL's bigint)."""
    return int.from_bytes(hashlib.blake2b(owner.encode(), digest_size=8).digest(), "big",
                          signed=True)


class PostgresBacklog(BaseBacklog):
    """The contract's ``Backlog`` on PostgreSQL (see the module)."""

    def __init__(self, database: PostgresDatabase, meta: Any) -> None:
        super().__init__(database, DIALECT)
        self._meta = meta
        self._owners: dict[str, Any] = {}  # owner -> the session holding its advisory lock
        self._owners_lock = threading.Lock()

    def pending_count(self) -> int:
        """How many stored messages have no vector yet."""
        return int(self._db.read(
            f"SELECT count(*) FROM messages m WHERE NOT m.embedded AND {KEPT}")[0][0])

    def pending(self, limit: int) -> list[PendingMessage]:
        """Up to ``limit`` unembedded messages, oldest first, with their antecedent
        (same channel only); nothing is claimed."""
        return self._pending_where(f"NOT m.embedded AND {KEPT} ORDER BY m.id LIMIT ?",
                                   (int(limit),))

    def claim(self, limit: int, *, owner: str, ttl_s: float = 600.0) -> list[PendingMessage]:
        """Claim up to ``limit`` unembedded messages for ``owner`` and return them."""
        key = self._hold(owner)
        now = now_ms()
        with self._db.write() as conn:
            self._take_back(conn, now)
            for _ in range(CLAIM_TRIES):
                candidates = [row[0] for row in conn.execute(
                    f"SELECT m.id FROM messages m WHERE NOT m.embedded AND {KEPT} AND NOT EXISTS "
                    "(SELECT 1 FROM embedding_claims c WHERE c.message_id = m.id) "
                    "ORDER BY m.id LIMIT %s FOR UPDATE OF m SKIP LOCKED", (int(limit),))]
                ids = [row[0] for row in conn.execute(
                    "INSERT INTO embedding_claims(message_id, owner, lock_key, expires_at) "
                    "SELECT unnest(%s::bigint[]), %s, %s, %s ON CONFLICT DO NOTHING "
                    "RETURNING message_id", (candidates, owner, key, now + int(ttl_s * 1000)))]
                # All taken: another claim committed after this SELECT's snapshot, on rows
                # it could still lock (nothing of theirs changed).  Read again: an empty
                # answer would tell the caller the backlog is done.
                if ids or not candidates:
                    break
        return self.messages(ids)

    def _hold(self, owner: str) -> int:
        """Open ``owner``'s session and take its advisory lock (once per owner)."""
        key = owner_key(owner)
        with self._owners_lock:
            if owner not in self._owners:
                session = connection.connect(self._db.url)
                session.execute("SELECT pg_advisory_lock(%s)", (key,))
                self._owners[owner] = session
        return key

    @staticmethod
    def _take_back(conn: Any, now: int) -> None:
        """Delete expired claims and those whose owner's session has ended."""
        dead = conn.execute(
            "DELETE FROM embedding_claims c WHERE c.expires_at <= %s OR NOT EXISTS ("
            "SELECT 1 FROM pg_locks l WHERE l.locktype = 'advisory' AND l.granted "
            "AND l.objsubid = 1 AND l.database = (SELECT oid FROM pg_database "
            "WHERE datname = current_database()) "
            "AND (l.classid::bigint << 32 | l.objid::bigint) = c.lock_key) "
            "RETURNING c.owner", (now,)).fetchall()
        if dead:
            log.info("took back %d embedding claims of %d ended or expired owners",
                     len(dead), len({row[0] for row in dead}))

    def release(self, owner: str) -> None:
        """Give up every claim ``owner`` still holds (its messages stay pending)."""
        if self._db.read_only:
            return
        with self._db.write() as conn:
            conn.execute("DELETE FROM embedding_claims WHERE owner = %s", (owner,))
        with self._owners_lock:
            session = self._owners.pop(owner, None)
        if session is not None:
            session.close()  # the advisory lock ends with the session

    def set_aside(self, failures: Mapping[int, str], *, model: str) -> None:
        """Take messages ``model`` failed to embed out of the backlog (see the contract)."""
        ids = list(failures)
        with self._db.write() as conn:
            conn.execute(
                "INSERT INTO embedding_set_aside(message_id, model, reason, set_at) "
                "SELECT f.id, %s, f.reason, %s FROM unnest(%s::bigint[], %s::text[]) "
                "AS f(id, reason) JOIN messages m ON m.id = f.id "
                "ON CONFLICT (message_id) DO UPDATE SET model = excluded.model, "
                "reason = excluded.reason, set_at = excluded.set_at",
                (model, now_ms(), ids, [failures[i] for i in ids]))
            conn.execute("DELETE FROM embedding_claims WHERE message_id = ANY(%s)", (ids,))

    def close(self) -> None:
        """End every owner's session (their claims are taken back by the next claim)."""
        with self._owners_lock:
            sessions, self._owners = list(self._owners.values()), {}
        for session in sessions:
            session.close()

    def write_vectors(
        self, messages: Sequence[PendingMessage], vectors_: np.ndarray, *, owner: str | None = None
    ) -> None:
        """Store one vector per pending message and mark them embedded, atomically
        (skipping those deleted, edited, whose antecedent changed, or claimed by another
        meanwhile: :func:`memory.storage.pending.still_current`)."""
        if len(messages) != len(vectors_):
            raise ValueError("one vector per message is required")
        matrix = np.ascontiguousarray(vectors_, dtype=np.float32)
        with self._db.write() as conn:
            lock_guilds(conn, {m.guild_id for m in messages})
            self._meta.check_model_unchanged()  # inside: no reembed can slip in before the write
            current = still_current(messages, self._reread(messages))
            if owner is not None:
                current -= self._claimed_by_others(conn, messages, owner, now_ms())
            rows = [(m.id, m.guild_id, m.channel_id, m.author_id, m.created_at,
                     bool(m.attachments), v) for m, v in zip(messages, matrix) if m.id in current]
            vectors.write(conn, rows)
            conn.execute("UPDATE messages SET embedded = true WHERE id = ANY(%s)",
                         ([row[0] for row in rows],))
            if owner is not None:
                conn.execute("DELETE FROM embedding_claims WHERE owner = %s AND message_id = ANY(%s)",
                             (owner, [m.id for m in messages]))
