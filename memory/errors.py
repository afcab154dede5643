"""The memory engine's error hierarchy.

Every error the engine raises on purpose derives from :class:`MemoryBotError`, and its
message says what to do next.  The CLI and the Discord cog translate these into one
clear line; anything else is a bug.
"""

from __future__ import annotations


class MemoryBotError(Exception):
    """Base class for all errors raised deliberately by the memory engine."""


class ExtensionLoadError(MemoryBotError):
    """sqlite-vec could not be loaded into any available SQLite driver."""


class DatabaseFileError(MemoryBotError):
    """The database path cannot be opened, is not SQLite, or is from a newer bot."""


class DiskFullError(DatabaseFileError):
    """SQLite could not write the database file: its disk is full (or the file is at a
    size limit).  The interrupted transaction was rolled back; everything committed
    before it is intact."""


class VectorIndexDamaged(DatabaseFileError):
    """The vector index cannot be read (a damaged or missing part of it); the messages
    are intact.  Searches fall back to keywords; ``reembed`` rebuilds the index from
    the stored text."""


class StorageBusy(MemoryBotError):
    """The database could not take a write now, and the same write can simply be tried
    again: SQLite's lock is held by another process past the busy timeout; on
    PostgreSQL a deadlock or serialization failure was resolved against this
    transaction, a lock wait ran past ``lock_timeout``, or the connection to the
    server was lost (a restart, a fail-over).

    Nothing of the interrupted transaction is visible — except that a connection lost
    during ``COMMIT`` leaves it unknown whether the commit landed, which is why every
    write the bot retries is idempotent (an upsert of the same records, a forget of
    the same ids).
    """


class ConfigError(MemoryBotError):
    """A profile file or value is invalid; the message names the file and key."""


class EmbeddingModelMismatch(MemoryBotError):
    """The store was embedded with a different model than the one configured."""


class EmbeddingModelChanged(EmbeddingModelMismatch):
    """Another process re-embedded the database with another model while this one ran.

    This process stops writing vectors (they would be of the wrong model or size) and
    its searches fall back to keyword search, until it is restarted with a profile
    whose embedder matches the database.
    """


class ImportFormatError(MemoryBotError):
    """An input file is not a DiscordChatExporter JSON export."""


class SettingsError(MemoryBotError):
    """A guild setting or its value is unknown."""


class SettingsUnreadable(MemoryBotError):
    """A guild's settings could not be read and none are known, so what they decide
    (which channels are remembered) cannot be judged now.  Its text names no file or
    host (the cause is logged where it happened)."""


class SearchInputError(MemoryBotError):
    """A search request is malformed (empty query list, bad filter, bad limit)."""


class RerankerError(MemoryBotError):
    """The reranker backend failed; search falls back to the pre-rerank order.

    Attributes:
        kind: A short machine-readable cause (``timeout``, ``http_5xx``, ...), used as
            a metrics label; ``None`` when not classified.
    """

    def __init__(self, message: str, kind: str | None = None) -> None:
        super().__init__(message)
        self.kind = kind


class RerankerUnavailable(RerankerError):
    """The reranker backend cannot be reached or its model cannot be loaded."""


class ChatModelError(MemoryBotError):
    """The chat model (``[llm]``) failed to answer; callers fall back to the list of hits.

    Attributes:
        kind: A short machine-readable cause: ``auth``, ``rate_limited``, ``server``,
            ``bad_request``, ``bad_response``, ``timeout`` or ``unavailable``.
        status: The HTTP status, when the server sent one.
    """

    kind = "error"

    def __init__(self, message: str, status: int | None = None) -> None:
        super().__init__(message)
        self.status = status


class ChatModelAuthError(ChatModelError):
    """The server refused the API key (401/403): check ``llm.api_key_env``."""

    kind = "auth"


class ChatModelRateLimited(ChatModelError):
    """The server said 429 and a retry did not fit in the timeout.

    Attributes:
        retry_after: Seconds the server asked to wait, when it said.
    """

    kind = "rate_limited"

    def __init__(self, message: str, status: int | None = 429,
                 retry_after: float | None = None) -> None:
        super().__init__(message, status)
        self.retry_after = retry_after


class ChatModelServerError(ChatModelError):
    """The server failed (5xx)."""

    kind = "server"


class ChatModelRequestError(ChatModelError):
    """The server rejected the request (4xx other than auth and 429), e.g. a prompt too long."""

    kind = "bad_request"


class ChatModelResponseError(ChatModelError):
    """The response was not OpenAI-shaped: bad JSON, a malformed or cut-off stream."""

    kind = "bad_response"


class ChatModelTimeout(ChatModelError):
    """No complete answer within ``llm.timeout_s``."""

    kind = "timeout"


class ChatModelUnavailable(ChatModelError):
    """The server cannot be reached (connection refused, DNS, TLS)."""

    kind = "unavailable"
