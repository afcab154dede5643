"""The storage contract: what the rest of the bot may ask of a database, engine-neutral.

A :class:`Storage` is one database seen as nine nouns, each a small
:class:`~typing.Protocol`: the :class:`Database` itself, the :class:`Messages`, their
:class:`Forgetting`, the :class:`Guilds`' settings and progress, the embedding
:class:`Backlog`, the :class:`Meta` data (which embedding model the vectors belong
to), the :class:`KeywordIndex`, the :class:`VectorIndex` and the :class:`Quotes` of the
bot's public answers.  SQLite
(:mod:`memory.storage.sqlite`) is the first engine that implements it; a second one
implements the same Protocols and passes the same tests (``tests/storage/``).

Nothing here names SQL or a driver type.  The promises every engine keeps:

* **A message and its indexes change together.**  Storing, editing or forgetting a
  message rewrites its keyword rows, its vector and the conversational windows it is
  part of in the same transaction; a reader never sees one without the other.
* **Forgotten stays forgotten.**  Every deletion is a ``forget_*`` method of
  :class:`Forgetting`; a forgotten message is tombstoned, so no later write (a late
  gateway event, a backfill page, a re-import) brings it back, and the messages whose
  vectors carried its text (the ones replying to it or following it) are embedded
  again without it.
* **Privacy rules hold at the door.**  :meth:`Messages.upsert` stores nothing older
  than the guild's retention period and nothing by a member who opted out there,
  whichever path brings it.
* **Ids are Discord snowflakes** (unsigned, below 2**63); times are unix milliseconds
  (UTC).  Every method is synchronous and safe to call from worker threads.

Errors are the typed ones of :mod:`memory.errors`: a write to a read-only database
raises :class:`~memory.errors.DatabaseFileError`, a full disk
:class:`~memory.errors.DiskFullError`, a write the database could not take *now*
:class:`~memory.errors.StorageBusy` (SQLite: another process held the lock past the
busy timeout; PostgreSQL: a deadlock or serialization failure resolved against it, a
lock wait past ``lock_timeout``, a lost connection) — nothing of it applied, and the
same call can run again (every write method is idempotent for the same arguments,
which is what makes a retry after a connection lost during ``COMMIT`` safe), a
vector of another embedding model
:class:`~memory.errors.EmbeddingModelChanged` /
:class:`~memory.errors.EmbeddingModelMismatch`, an empty id filter
:class:`~memory.errors.SearchInputError`.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any, Protocol

import numpy as np

from memory.filters import Filters
from memory.records import MessageRecord, PendingMessage, SetAside, StoredMessage
from memory.settings import GuildSettings

__all__ = [
    "EXACT_KNN_MAX", "BackfillCursor", "Backlog", "Database", "Forgetting", "GuildStats", "Guilds",
    "KeywordIndex", "Messages", "Meta", "PostedAnswer", "Quotes", "ReconcileCursor", "Storage",
    "StoreStats", "UpsertStats", "VectorIndex", "store_stats",
]


EXACT_KNN_MAX = 4096
"""A KNN whose guild holds at most this many vectors is exact (:meth:`VectorIndex.knn`):
at this size every distance costs a few milliseconds, and the two engines' different
approximations (SQLite's 1-bit codes, pgvector's HNSW graph) would otherwise rank a
small guild's neighbours slightly differently.  4096 is also sqlite-vec's largest k."""


# -- results -------------------------------------------------------------------------------


@dataclass(frozen=True)
class UpsertStats:
    """What an upsert did: new rows, changed rows, rows left as they were."""

    inserted: int = 0
    updated: int = 0
    unchanged: int = 0
    forgotten: int = 0  # stored copies deleted because their author opted out, then edited
    expired: int = 0  # older than the guild's retention period: not stored
    misplaced: int = 0  # stored before in another channel: left out (the first channel wins)
    tombstoned: int = 0  # deleted before (tombstoned): left out, they stay deleted
    opted_out: int = 0  # by a member who opted out of the guild: not stored


@dataclass(frozen=True)
class BackfillCursor:
    """A channel's backfill position: read back to ``before_id``; ``complete`` at its start."""

    before_id: int | None
    complete: bool


@dataclass(frozen=True)
class ReconcileCursor:
    """A channel's place in a reconcile run: recent messages checked down to ``before_id``."""

    run_id: int
    before_id: int | None
    complete: bool


@dataclass(frozen=True)
class PostedAnswer:
    """One public message of the bot that quotes stored messages: where it is (ids only)."""

    answer_id: int
    channel_id: int
    guild_id: int


@dataclass(frozen=True)
class GuildStats:
    """What one guild has stored; ``member_messages`` counts one member's."""

    messages: int
    channels: int
    member_messages: int
    pending: int


def vector_index_state(bound: bool, damage: str | None) -> str:
    """What ``stats`` says of the vector index (:attr:`StoreStats.vector_index`)."""
    if not bound:
        return "none"
    if damage is None:
        return "ok"
    return f"damaged ({damage}): run `python bot.py reembed` to rebuild it from the stored text"


@dataclass(frozen=True)
class StoreStats:
    """What a database holds, for the ``stats`` command.

    ``path`` is where it is: the SQLite file, or the server's URL.
    """

    guilds: int
    channels: int
    authors: int
    messages: int
    pending_embeddings: int
    set_aside_embeddings: int
    embedding_model: str | None
    embedding_dim: int | None
    active_profile: str | None
    schema_version: int
    path: str
    vector_index: str = "ok"
    """``ok``, ``none`` (nothing embedded yet) or why it is damaged (``reembed`` repairs it)."""


# -- the nouns -----------------------------------------------------------------------------


class Database(Protocol):
    """The database itself: where it is, whether this process may write it, and a
    counter of committed writes."""

    @property
    def location(self) -> str:
        """The SQLite file's path, or the server's URL (without its password)."""
        ...

    @property
    def read_only(self) -> bool:
        """Whether this process only reads (searches and stats work; writes raise
        :class:`~memory.errors.DatabaseFileError`)."""
        ...

    @property
    def generation(self) -> int:
        """Bumped by every write this process commits: callers cache what they derive
        from the stored rows (the searcher's member names) until it moves."""
        ...

    def schema_version(self) -> int:
        """How many schema migrations the database has seen."""
        ...

    def set_busy_timeout(self, seconds: float | None) -> None:
        """How long a write waits for another writer's lock before it raises
        :class:`~memory.errors.StorageBusy`.  ``None``: the engine's default (SQLite:
        5 s; PostgreSQL: the server's ``lock_timeout``, which by default waits as long
        as it takes)."""
        ...

    def close(self) -> None:
        """Close every connection."""
        ...


class Messages(Protocol):
    """The stored messages, with their guild, channel and author names."""

    def upsert(self, records: Iterable[MessageRecord], *, insert: bool = True) -> UpsertStats:
        """Insert new messages and update changed ones, idempotently, in one transaction.

        A message whose text or attachments changed (an edit) gets its keyword rows
        rewritten and its vector dropped; it is re-embedded with the backlog, and so
        are the messages whose vectors carried its old text.  Re-importing identical
        messages changes nothing; an older copy of a message (its ``edited_at`` before
        the stored one's) never replaces a newer one.  Messages older than their
        guild's retention period are not stored, whichever path brings them (live
        capture, backfill, import); ``expired`` counts them.  A message id already
        stored in another channel keeps its first channel: the copy is left out and
        counted as ``misplaced`` (Discord's ids are unique, so such a copy comes from
        a damaged or edited export).  A tombstoned (forgotten) id is never stored
        again.

        Nothing by a member who opted out of a guild (``/memory forget-me`` opts out
        too) is stored there, whichever path brings it: an edit of their message
        stored before is applied by forgetting the stored copy, so the bot keeps
        neither their new text nor the text they took out (``forgotten``).

        Names a record does not know (``""``; a channel type of ``""`` or ``"None"``;
        a ``parent_id`` of ``None``) never overwrite the stored ones.

        Args:
            records: The messages, as they are now.
            insert: ``False`` only applies changes to messages already stored (an
                edit in a channel the guild no longer remembers).
        """
        ...

    def hydrate(self, ids: Sequence[int]) -> dict[int, StoredMessage]:
        """Return the stored messages by id (missing ids are left out).

        A message older than its guild's retention period is left out too: the
        hourly forgetting may not have removed it yet, and it is never shown.
        ``author_name`` is the author's display name in the message's own guild if
        they have one, else their user name (``""`` once that guild's names of theirs
        are gone); ``channel_name`` the stored channel name.
        """
        ...

    def neighbours(self, channel_id: int, message_id: int, before: int, after: int) -> list[int]:
        """Ids of up to ``before`` messages before ``message_id`` in its channel, and
        up to ``after`` after it, in id order (``message_id`` itself included if stored).

        Only ``channel_id`` is read, whatever the neighbours' other fields say, so a
        caller that may read that channel can show every id returned.
        """
        ...

    def latest_id(self, channel_id: int, before_id: int | None = None) -> int | None:
        """The newest stored message id in a channel (or thread), below ``before_id``
        when given; ``None`` when there is none."""
        ...

    def latest_in_guild(self, guild_id: int, before_id: int) -> int | None:
        """The newest stored message id in a guild below ``before_id``; ``None`` when none is."""
        ...

    def count(self, guild_id: int | None = None) -> int:
        """How many messages are stored (in one guild, or in all)."""
        ...

    def has_any(
        self, guild_id: int | None = None, channel_ids: Iterable[int] | None = None
    ) -> bool:
        """Whether anything is stored (in one guild, or at all; only in ``channel_ids``
        when given); cheaper than counting."""
        ...

    def members(self, guild_id: int | None) -> list[tuple[int, str, str]]:
        """Return ``(author_id, name, display_name)`` of everyone with stored messages
        in the guild, named as in that guild (``None``: every guild's names, one row
        per guild a member is named in)."""
        ...

    def threads(self, guild_id: int) -> list[tuple[int, int, str]]:
        """Return ``(thread_id, parent_id, type)`` of every stored thread in a guild."""
        ...

    def expand_channels(self, channel_ids: Sequence[int]) -> tuple[int, ...]:
        """Return the channels, in order, plus every stored thread whose parent is one of them."""
        ...

    def channel_ids_named(self, name: str, guild_id: int | None = None) -> list[int]:
        """Return the ids of stored channels called ``name`` (case-insensitive)."""
        ...

    def guild_stats(
        self, guild_id: int, author_id: int | None = None, channel_ids: Iterable[int] | None = None
    ) -> GuildStats:
        """Counts for one guild only (and one member in it), optionally only in ``channel_ids``."""
        ...

    def known_guild_ids(self) -> list[int]:
        """Every guild something is stored for (messages, channels or settings), ascending;
        opt-outs, which outlive their guild, do not count."""
        ...

    def channels_with_messages(self, guild_id: int) -> list[tuple[int, int | None]]:
        """``(channel_id, parent_id)`` of a guild's channels and threads that hold
        messages, by channel id."""
        ...

    def recent_floor(self, channel_id: int, below_id: int, count: int) -> int | None:
        """The oldest of a channel's ``count`` newest stored messages below ``below_id``
        (``None`` when there is none)."""
        ...

    def ids_between(self, channel_id: int, low: int, high: int) -> list[int]:
        """Stored message ids of a channel with ``low <= id < high``, oldest first."""
        ...


class Forgetting(Protocol):
    """Every deletion: messages leave the table, the keyword index, the vectors and
    their neighbours' windows, for good (tombstoned), in one transaction each.

    Each ``forget_*`` returns how many stored messages it removed.  A forgotten
    message's text also leaves the database's files (for SQLite: overwritten, the
    write-ahead log emptied), and the messages whose vectors carried it as their
    antecedent go back to the backlog.
    """

    def forget_messages(self, ids: Iterable[int]) -> int:
        """Forget these messages; ids never stored are tombstoned too, so a late copy
        (a gateway event racing the delete, a backfill page, a re-import) stays out."""
        ...

    def forget_emptied(self, edits: Mapping[int, int]) -> int:
        """Forget messages an edit left with nothing to store (``{id: edit time}``, unix
        ms), without a tombstone: they still exist, and a copy edited later (text put
        back) is stored again; one edited at or before that time (a stale page, an old
        export) is not.  A stored copy edited after that time stays.  Returns how many
        were removed."""
        ...

    def forget_channels(self, channel_ids: Iterable[int]) -> int:
        """Forget every message in these channels and in their stored threads, and
        their backfill progress."""
        ...

    def forget_guild(self, guild_id: int) -> int:
        """Forget a guild entirely: messages, channels, names (its members' names there
        too), settings, cursors.

        Its opt-outs stay: a member who asked not to be remembered there is not stored
        again when the bot is invited back.  They hold two ids and nothing the member
        wrote; ``/memory opt-in`` removes one.
        """
        ...

    def forget_member(self, guild_id: int, author_id: int) -> int:
        """Forget a member in one guild: their messages, their name, their future messages.

        In one transaction the member is opted out of the guild (so no later write,
        whichever path brings it, stores them there again until they opt in), their
        messages there are forgotten, and the names they have in that guild go (not
        those they have in others).
        """
        ...

    def forget_older_than(self, guild_id: int, cutoff_ms: int) -> int:
        """Forget a guild's messages created before ``cutoff_ms`` (unix milliseconds)."""
        ...


class Quotes(Protocol):
    """Which stored messages each public answer of the bot quotes, and the answers due
    to be taken down because one of those is gone.

    A public answer (``/search private:False``, a mention reply and its extra parts)
    shows the text of the messages it quotes to everyone in its channel.  When one of
    them is forgotten — whichever ``forget_*`` of :class:`Forgetting` does it, in the
    same transaction — or edited so that its text or attachments change, the answer
    becomes *due*: the bot replaces it on Discord (:mod:`cogs.memory.retractions`).
    An answer of a guild that is forgotten whole (the bot left it) is dropped, not
    due: the bot can no longer edit there.  Ids only, never what a message said.
    """

    def record(self, answers: Iterable[tuple[PostedAnswer, Sequence[int]]], *,
               edited_since: int | None = None) -> list[int]:
        """Record each answer with the ids of the messages it quotes, in one transaction.

        An answer quoting a message no longer stored (forgotten after the answer was
        written, before this) is due at once instead, and so is one quoting a message
        edited at or after ``edited_since`` (unix ms: when the question was asked; the
        answer may show the text from before the edit).  Recording the same answer
        again changes nothing.

        Returns:
            The answer ids due at once.
        """
        ...

    def due(self, limit: int = 100, guild_ids: Iterable[int] | None = None) -> list[PostedAnswer]:
        """Up to ``limit`` answers due to be taken down, oldest first (only in
        ``guild_ids`` when given: a process takes down only its own guilds' answers)."""
        ...

    def retracted(self, answer_ids: Iterable[int]) -> None:
        """These answers are taken down (or can no longer be): they are no longer due."""
        ...


class Guilds(Protocol):
    """What each guild chose (settings, opt-outs, retention) and how far the bot's
    walks through its channels got (backfill and reconcile cursors)."""

    def settings(self, guild_id: int) -> GuildSettings:
        """A guild's settings (defaults when it never changed any)."""
        ...

    def settings_version(self) -> int:
        """A number that moves whenever any guild's settings or opt-outs change, in any
        process using this database; an equal number means no change committed since.

        :meth:`update_settings`, :meth:`Forgetting.forget_member` (it opts the member
        out) and :meth:`Forgetting.forget_guild` (the guild's settings go) move it in
        the transaction that makes the change.  A process that caches settings reads
        it before the settings it caches and drops its cache when it moves: one cheap
        read tells it whether anything changed, however many guilds there are.  ``0``
        before the first change; it may also move when a change left everything as
        it was.
        """
        ...

    def update_settings(self, guild_id: int, **changes: Any) -> GuildSettings:
        """Change a guild's settings in one transaction; returns them as they are now.

        Keywords: ``channel_mode``, ``retention_days`` (``None`` = keep everything),
        ``autoresponse``, ``add_channel`` / ``remove_channel`` (the channel list),
        ``toggle_autoresponse_channel``, ``opt_out`` / ``opt_in`` (a member id; opting
        out also removes the member's names in that guild).  Any
        other keyword given ``None`` is left as it is.

        Raises:
            SettingsError: An unknown setting or value (nothing is changed).
        """
        ...

    def retention_cutoffs(self, guild_ids: Iterable[int] | None = None, *,
                          seen_ms: int | None = None) -> dict[int, int]:
        """The oldest creation time (unix ms) each guild with a retention period keeps,
        counted back from :meth:`retention_clock`.

        Args:
            guild_ids: Only these guilds; ``None``: every guild that set a period.
            seen_ms: The newest creation time of the messages being stored.

        Returns:
            ``{guild_id: cutoff_ms}``; a guild that keeps everything is absent.
        """
        ...

    def retention_clock(self, seen_ms: int | None = None) -> int:
        """The time retention counts from (unix ms): the host clock, unless it runs
        far past the newest stored message's creation time and ``seen_ms`` — a host
        clock years ahead must not expire everything (:mod:`memory.retention`)."""
        ...

    def backfill_cursor(self, channel_id: int) -> BackfillCursor | None:
        """How far a backfill of this channel got, or ``None`` if none started."""
        ...

    def save_backfill_cursor(
        self, guild_id: int, channel_id: int, before_id: int | None, *, complete: bool = False
    ) -> None:
        """Record that a backfill has read this channel back to ``before_id`` (or to its
        start); a ``None`` keeps the position saved before."""
        ...

    def mark_missed(self, marks: Iterable[tuple[int, int, int]]) -> None:
        """Record messages the bot heard but could not store, as ``(guild_id, channel_id,
        message_id)``: the start-up catch-up reads each channel from before them.
        Ids only, never what a message said."""
        ...

    def missed(self) -> dict[int, list[int]]:
        """The missed messages' ids by channel, oldest first (see :meth:`mark_missed`)."""
        ...

    def clear_missed(self, channel_id: int, message_ids: Iterable[int]) -> None:
        """Drop these marks of a channel: the catch-up has read past them."""
        ...

    def reconcile_run(self, guild_id: int) -> int | None:
        """A guild's unfinished reconcile run (its start, unix ms), or ``None``."""
        ...

    def begin_reconcile_run(self, guild_id: int, run_id: int) -> None:
        """Start a guild's reconcile run; what an earlier run saved is dropped."""
        ...

    def end_reconcile_run(self, guild_id: int) -> None:
        """Mark a guild's reconcile run finished: the next one starts from scratch."""
        ...

    def reconcile_cursor(self, channel_id: int) -> ReconcileCursor | None:
        """Where the current reconcile run got to in a channel, ``None`` if not there yet."""
        ...

    def save_reconcile_cursor(
        self, guild_id: int, channel_id: int, run_id: int, before_id: int | None,
        *, complete: bool = False,
    ) -> None:
        """Record a reconcile run's progress in a channel; a ``None`` ``before_id`` keeps
        the position saved before."""
        ...


class Backlog(Protocol):
    """The messages stored but not embedded yet, and the claims embedders hold on them.

    Messages are written first and embedded later in batches, so a crash between the
    two loses nothing: the next run finds the backlog again.
    """

    def pending_count(self) -> int:
        """How many stored messages have no vector yet."""
        ...

    def pending(self, limit: int) -> list[PendingMessage]:
        """Return up to ``limit`` unembedded messages, oldest first, with their antecedent.

        A message's antecedent is the message it replies to if that is stored in the
        same channel (or thread), else the previous message in its channel.  Text
        from another channel never enters a message's vector, whatever path stored
        the reply: a search by that text would tell readers of this channel what the
        other said.  Nothing is claimed: an embedder uses :meth:`claim`.
        """
        ...

    def claim(self, limit: int, *, owner: str, ttl_s: float = 600.0) -> list[PendingMessage]:
        """Claim up to ``limit`` unembedded messages for ``owner`` and return them (as
        :meth:`pending` does).

        A message claimed by another embedder is left out until its claim is
        released (:meth:`write_vectors`, :meth:`release`), its process ends
        (:mod:`memory.storage.claims`: a killed embedder's batch is back at once, also
        when it comes back under a new host name: a claimer holds a lock the system
        drops when it dies), or the claim expires after ``ttl_s`` (where no lock can
        be seen), so concurrent embedders share the backlog instead of repeating each
        other's work.

        Args:
            owner: A name from :func:`memory.storage.claims.process_owner`.
        """
        ...

    def release(self, owner: str) -> None:
        """Give up every claim ``owner`` still holds (its messages stay pending); a
        read-only database holds none, and this does nothing there."""
        ...

    def write_vectors(
        self, messages: Sequence[PendingMessage], vectors: np.ndarray, *, owner: str | None = None
    ) -> None:
        """Store one vector per pending message and mark them embedded, atomically.

        A message deleted or edited since it was read is skipped: its vector would
        be an orphan or describe the old text.  So is one whose antecedent was
        deleted, edited or forgotten meanwhile (a vector is a fact about every text
        it was made from: :mod:`memory.storage.pending`).  Such a message stays
        pending and is embedded again from its current texts.  With ``owner``, a
        message another embedder has claimed meanwhile (``owner``'s claim expired) is skipped too,
        and ``owner``'s claims on these messages are released.  Each message's
        window vector (:class:`VectorIndex`) follows.

        Raises:
            ValueError: Not one vector per message.
            EmbeddingModelChanged: Another process re-embedded the database with
                another model (:meth:`Meta.model_changed`); nothing is written.
        """
        ...


    def set_aside(self, failures: Mapping[int, str], *, model: str) -> None:
        """Take messages out of the backlog that ``model`` failed to embed.

        A message that makes the embedder fail must not block the backlog for good:
        it is set aside (message id -> the reason, logged by the caller), stays
        stored and keyword-searchable, and is tried again when it is edited, by
        another model, or by :meth:`retry_set_aside` (``reembed``).  Ids no longer
        stored are ignored; claims on these messages are dropped.
        """
        ...

    def set_aside_messages(self, limit: int = 100) -> list[SetAside]:
        """Up to ``limit`` set-aside messages, oldest first, with model and reason."""
        ...

    def set_aside_count(self) -> int:
        """How many messages are set aside (not counted in :meth:`pending_count`)."""
        ...

    def retry_set_aside(self, *, keep_model: str | None = None) -> int:
        """Put the set-aside messages back in the backlog (with ``keep_model``, only
        those another model failed on); returns how many.  Writes nothing when there
        are none, so a read-only database is fine."""
        ...


class Meta(Protocol):
    """The database's own facts: which embedding model its vectors belong to, the
    hardware profile an admin chose, and small cached values."""

    model: str | None
    """The embedding model this process writes and searches with (its engine sets it):
    see :meth:`model_changed`."""

    def get(self, key: str) -> str | None:
        """A stored value, or ``None`` when unset."""
        ...

    def set(self, key: str, value: str) -> None:
        """Store a value (replacing the one before)."""
        ...

    @property
    def active_profile(self) -> str | None:
        """The hardware profile an admin last chose for this database."""
        ...

    @active_profile.setter
    def active_profile(self, name: str) -> None: ...

    def embedding_model(self) -> tuple[str, int] | None:
        """Return ``(model_id, dimension)`` the vectors were made with, if any.

        Raises:
            DatabaseFileError: The stored dimension is not a positive whole number (the
                database was edited or damaged); ``reembed`` rewrites it.
        """
        ...

    def bind_model(self, model_id: str, dimension: int) -> None:
        """Bind this database to an embedding model, making room for its vectors.

        Binding to the model it is bound to already does nothing.

        Raises:
            EmbeddingModelMismatch: The database already holds vectors of another
                model (or another size); run ``python bot.py reembed`` to switch.
            EmbeddingModelChanged: Another process re-embedded it while this one ran.
        """
        ...

    def reset_embeddings(self, model_id: str, dimension: int) -> None:
        """Drop every vector and bind to a new model at once; all messages become
        pending, and :attr:`model` becomes ``model_id``.  ``reembed`` does not: it
        builds the new vectors beside the old ones (:class:`VectorRebuild`).  The cached similarity floors
        (:meth:`VectorIndex.similarity_floor`) go with the vectors they describe."""
        ...

    def model_changed(self) -> str | None:
        """Why this process may no longer use the vectors, or ``None`` while it may.

        :attr:`model` is the embedding model this process writes and searches with.
        When another process re-embeds the database with another model
        (``reembed``), the database's model no longer matches: this process's query
        vectors and new vectors are of another model, perhaps another size.
        """
        ...

    def check_model_unchanged(self) -> None:
        """Raise :class:`~memory.errors.EmbeddingModelChanged` with
        :meth:`model_changed`'s reason, if any."""
        ...


class KeywordIndex(Protocol):
    """Full-text search over each message's own words and over its conversational window.

    A message is indexed by its author's names, its text and its attachments' names
    (``field="message"``), and by its *window*: the message with up to two before and
    two after it in its channel (no further apart than two hours) and the message it
    replies to when that is in the same channel (``field="window"``).  A message
    without content of its own ("lol", "noted") is not found by its window: the
    window would speak for its neighbours, not for it.  A window never holds text
    from another channel.  Terms are plain words (:func:`memory.text.query_terms`);
    the engine builds its own query syntax from them, so no term is ever an operator.
    """

    def ranked(
        self, terms: Sequence[str], k: int, filters: Filters, *, field: str = "message"
    ) -> list[tuple[int, float]]:
        """Up to ``k`` ``(message_id, score)`` pairs matching any of ``terms``, best first.

        The score ranks by how many of the terms a message holds and how rare they are
        (BM25 or the engine's like); higher is better.  No terms: no matches.

        Args:
            terms: Plain words; matched as words (stemmed, case and accents folded).
            k: How many to return at most.
            filters: Where to look; applied before the top ``k`` is taken.
            field: ``"message"`` or ``"window"`` (see the class).

        Raises:
            SearchInputError: An id filter is an empty list.
        """
        ...

    def term_counts(self, terms: Sequence[str]) -> dict[str, int]:
        """In how many messages each term occurs (by text, author or attachment name)."""
        ...


class VectorIndex(Protocol):
    """The message vectors, their window vectors, and what a search needs from them.

    Each message's vector is stored with its guild, channel, author, creation time and
    whether it has attachments, so that a search's filters apply inside the nearest-
    neighbour search rather than after its top ``k``.  Each message with content of
    its own also has a *window vector*: the normalised mean of the vectors of its
    window's embedded members (:class:`KeywordIndex`), kept in step whenever a
    member's vector is stored or deleted or the window changes.
    """

    def knn(
        self, vector: np.ndarray, k: int, filters: Filters, *, rescore: int = 4
    ) -> list[tuple[int, float]]:
        """Return up to ``k`` ``(message_id, cosine_similarity)`` pairs, best first.

        Empty before anything is embedded.  ``rescore`` lets an engine that searches
        approximately first fetch ``k × rescore`` candidates and rank them by exact
        cosine; one that searches exactly may ignore it.  Every engine searches
        exactly when the searched guild (all guilds, without a guild filter) holds at
        most :data:`EXACT_KNN_MAX` vectors: a small guild gets the true nearest
        neighbours, the same list on every engine, at the cost of a few milliseconds.

        Raises:
            SearchInputError: An id filter is an empty list.
            EmbeddingModelChanged: Another process re-embedded the database with
                another model.
            VectorIndexDamaged: Part of the vector index cannot be read (searches
                fall back to keywords; ``reembed`` rebuilds it).
        """
        ...

    def window_vectors(self, ids: Sequence[int], *, beside: bool = False) -> dict[int, np.ndarray]:
        """The window vector of each of ``ids`` that has one: its window's mean, unit length.

        ``beside``: the caller reads this while the same thread pool runs a KNN; an
        engine with a second connection reads it there (it must still see every
        committed write).
        """
        ...

    def similarity_floor(self, guild_id: int | None, quantile: float) -> float | None:
        """The cosine similarity that random pairs of a guild's messages reach at ``quantile``.

        It calibrates the adaptive threshold's floor to the embedding model and to how
        alike the guild's messages are.  Computed from up to 400 stored vectors spread
        evenly over the guild's history (the same messages give the same floor), kept
        (:class:`Meta`) and computed again when the guild's vectors have grown by
        half.  ``None`` while fewer than 20 vectors are stored.
        """
        ...

    def floats(self, ids: Iterable[int]) -> dict[int, np.ndarray]:
        """The stored vectors of those of ``ids`` that have one, as float32."""
        ...

    def count(self, guild_id: int | None = None) -> int:
        """How many messages have a vector (in one guild, or in all)."""
        ...

    def damage(self) -> str | None:
        """Why the vector index cannot be read whole, or ``None`` when it can (or
        nothing is embedded yet).  Reads every part of it once (``stats``)."""
        ...


class VectorRebuild(Protocol):
    """``reembed``: every vector made again in a new table beside the live one, then
    swapped in at once.

    Searches use the live vectors until the swap.  A message deleted meanwhile is
    gone from both tables at once; one whose vector is written or deleted meanwhile
    (an edit) leaves the new table and is embedded again.  A run that stops before
    the swap leaves the live table in use; the next run with the same model goes on
    from where it stopped.
    """

    def start(self, model_id: str, dimension: int) -> bool:
        """Begin the new table for ``model_id``, or go on with an earlier run's.

        Returns:
            Whether an earlier run's table is carried on.
        """
        ...

    def pending(self, after_id: int, limit: int) -> list[PendingMessage]:
        """Up to ``limit`` messages with ids above ``after_id`` the new table lacks, oldest first."""
        ...

    def write(self, messages: Sequence[PendingMessage], vectors: np.ndarray) -> int:
        """Store new vectors (skipping messages deleted or changed since they were read).

        Returns:
            How many were stored.
        """
        ...

    def finish(self, model_id: str, dimension: int) -> int:
        """Swap the new table in and bind ``model_id``, atomically.

        Returns:
            How many messages are left without a vector (the backlog embeds them).
        """
        ...


class Storage(Protocol):
    """One database, one attribute per noun."""

    @property
    def database(self) -> Database:
        """The database: location, read-only, write generation."""
        ...

    @property
    def messages(self) -> Messages:
        """The stored messages and their names."""
        ...

    @property
    def forgetting(self) -> Forgetting:
        """Every deletion."""
        ...

    @property
    def guilds(self) -> Guilds:
        """Settings, opt-outs, retention, backfill and reconcile cursors."""
        ...

    @property
    def backlog(self) -> Backlog:
        """The embedding backlog."""
        ...

    @property
    def meta(self) -> Meta:
        """The embedding model binding and other facts about the database."""
        ...

    @property
    def keywords(self) -> KeywordIndex:
        """Full-text search."""
        ...

    @property
    def rebuild(self) -> VectorRebuild:
        """``reembed``'s new vector table and its swap."""
        ...

    @property
    def vectors(self) -> VectorIndex:
        """Vector search and window vectors."""
        ...

    @property
    def quotes(self) -> Quotes:
        """What the bot's public answers quote, and the answers due to be taken down."""
        ...

    def stats(self) -> StoreStats:
        """Counts and metadata for the ``stats`` command."""
        ...

    def close(self) -> None:
        """Close the database."""
        ...


def store_stats(storage: Storage, table_counts: Mapping[str, int]) -> StoreStats:
    """What the ``stats`` command shows of ``storage``, the same way on every engine.

    Args:
        storage: The database.
        table_counts: How many guilds, channels, authors and messages it holds
            (the engine's ``messages.table_counts()``).
    """
    model = storage.meta.embedding_model()
    return StoreStats(
        **table_counts,
        pending_embeddings=storage.backlog.pending_count(),
        set_aside_embeddings=storage.backlog.set_aside_count(),
        embedding_model=model[0] if model else None,
        embedding_dim=model[1] if model else None,
        active_profile=storage.meta.active_profile,
        schema_version=storage.database.schema_version(),
        path=storage.database.location,
        vector_index=vector_index_state(model is not None, storage.vectors.damage()),
    )
