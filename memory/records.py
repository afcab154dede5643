"""Plain records that cross the engine's boundary.

One type per concept: :class:`MessageRecord` goes in (from an export or the
gateway); :class:`StoredMessage` comes back out of the store, extended by
:class:`PendingMessage` (with the antecedent to embed it with) and :class:`Hit` (with
every search stage's score); :class:`Trace` and :class:`SearchResult` describe a
search.
"""

from __future__ import annotations

from collections.abc import Iterator
from dataclasses import dataclass, field
from datetime import datetime, timedelta, timezone

DISCORD_EPOCH_MS = 1420070400000
_UNIX_EPOCH = datetime(1970, 1, 1, tzinfo=timezone.utc)
_DATETIME_RANGE_MS = tuple(
    (edge.replace(tzinfo=timezone.utc) - _UNIX_EPOCH) // timedelta(milliseconds=1)
    for edge in (datetime.min, datetime.max)
)


def snowflake_time_ms(snowflake: int) -> int:
    """Return the creation time (unix milliseconds) encoded in a Discord snowflake."""
    return (snowflake >> 22) + DISCORD_EPOCH_MS


def ms_to_datetime(ms: int) -> datetime:
    """Convert unix milliseconds to an aware UTC datetime.

    A time beyond what a datetime holds (years 1 to 9999) is shown at that edge: the
    importer refuses such times, but a database written before it did may hold one.
    """
    low, high = _DATETIME_RANGE_MS
    return _UNIX_EPOCH + timedelta(milliseconds=min(max(ms, low), high))


def datetime_to_ms(value: datetime) -> int:
    """Convert a datetime (naive means UTC) to unix milliseconds."""
    if value.tzinfo is None:
        value = value.replace(tzinfo=timezone.utc)
    return int(value.timestamp() * 1000)


# A forward's stored text starts with this.  Discord shows a forward as the forwarder's
# message, but its words are another message's (a forward carries no text of its own).
FORWARDED = "[forwarded]"


def forwarded_text(content: str, attachments: tuple[str, ...]) -> str:
    """A forward's stored text: the forwarded words marked :data:`FORWARDED`; ``content``
    as it is when there is nothing to store (no words and no attachment)."""
    return f"{FORWARDED} {content}".rstrip() if content.strip() or attachments else content


def poll_text(question: str, answers: list[str]) -> str:
    """A poll's stored text: its question and answers (a poll has no text of its own)."""
    listed = "; ".join(a for a in answers if a.strip())
    return f"[poll] {question}" + (f" (answers: {listed})" if listed else "")


def jump_url(guild_id: int, channel_id: int, message_id: int) -> str:
    """Return the discord.com link that opens a message in the client."""
    return f"https://discord.com/channels/{guild_id}/{channel_id}/{message_id}"


@dataclass(frozen=True)
class MessageRecord:
    """One Discord message as the store keeps it, independent of where it came from.

    Times are unix milliseconds (UTC).  ``parent_id`` is the parent channel of a
    thread, ``None`` for a normal channel or when the source does not know it;
    ``parent_name`` is that parent's name (a forum holds no messages of its own, so
    its name is known only from its threads' messages).  ``channel_type``,
    ``channel_name`` and ``parent_name`` are ``""`` when the source does not know
    them.  Unknown fields never overwrite what the store already knows.
    """

    id: int
    guild_id: int
    channel_id: int
    author_id: int
    created_at: int
    content: str
    author_name: str = ""
    author_display_name: str = ""
    author_is_bot: bool = False
    guild_name: str = ""
    channel_name: str = ""
    channel_type: str = ""
    parent_id: int | None = None
    parent_name: str = ""
    edited_at: int | None = None
    reply_to_id: int | None = None
    attachments: tuple[str, ...] = ()


@dataclass
class StoredMessage:
    """A message as the store returns it: what a reader sees, with its channel's name.

    ``author_name`` is the display name if the author has one, else the user name.
    """

    id: int
    guild_id: int
    channel_id: int
    author_id: int
    author_name: str
    content: str
    created_at: int
    channel_name: str = ""
    reply_to_id: int | None = None
    attachments: tuple[str, ...] = ()

    @property
    def jump_url(self) -> str:
        """The discord.com link that opens the message in the client."""
        return jump_url(self.guild_id, self.channel_id, self.id)

    @property
    def rerank_text(self) -> str:
        """What a reranker judges: who said it and what they said."""
        return f"{self.author_name}: {self.content}" if self.author_name else self.content


@dataclass
class PendingMessage(StoredMessage):
    """A stored message whose vector is missing, with its antecedent to embed it with.

    The antecedent is the message it replies to if that is stored in the same
    channel, else the previous message in the channel (``None`` for the first
    message of a channel); ``antecedent_id`` says which message that was.
    """

    antecedent_id: int | None = None
    antecedent_author: str | None = None
    antecedent_content: str | None = None


@dataclass(frozen=True)
class SetAside:
    """A message the embedder failed on, kept out of the backlog so it blocks nothing.

    It stays stored and keyword-searchable; an edit of it, another embedding model or
    ``reembed`` tries it again.  ``set_at`` is unix ms.
    """

    message_id: int
    model: str
    reason: str
    set_at: int


@dataclass
class Hit(StoredMessage):
    """One search result: the stored message and every stage's score.

    ``similarity`` is the cosine similarity to the closest query (``None`` when the
    message was found by keywords only); ``keyword_score`` is BM25 (higher is
    better, ``None`` when not matched); ``fused`` is the fusion score before bonuses;
    ``bonus`` is the bounded bonus added to it (a named member, recency, a time span
    the query names); ``score`` is the final ranking score; ``rerank_score`` is set
    when reranked.  How each is computed: :mod:`memory.search.ranking`.
    """

    similarity: float | None = None
    keyword_score: float | None = None
    dense_rank: int | None = None
    keyword_rank: int | None = None
    fused: float = 0.0
    bonus: float = 0.0
    score: float = 0.0
    rerank_score: float | None = None
    queries_matched: int = 1

    @property
    def created(self) -> datetime:
        """Creation time as an aware UTC datetime."""
        return ms_to_datetime(self.created_at)


@dataclass
class Trace:
    """How a search went: candidates per stage, the threshold, and per-stage latency."""

    candidates: dict[str, int] = field(default_factory=dict)
    timings_ms: dict[str, float] = field(default_factory=dict)
    threshold: float | None = None
    threshold_floor: float | None = None
    threshold_mode: str = "none"
    threshold_iterations: int = 0
    reranked: bool = False
    rerank_backend: str | None = None
    rerank_fallback: str | None = None
    pre_rerank: list[int] = field(default_factory=list)
    post_rerank: list[int] = field(default_factory=list)
    # why vector search was left out (the database was re-embedded with another model)
    keyword_only: str | None = None


@dataclass
class SearchResult:
    """The answer to one search: hits best first, the trace, and why it is empty if it is."""

    hits: list[Hit]
    trace: Trace
    empty_reason: str | None = None

    def __len__(self) -> int:
        return len(self.hits)

    def __iter__(self) -> Iterator[Hit]:
        return iter(self.hits)
