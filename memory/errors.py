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


class ConfigError(MemoryBotError):
    """A profile file or value is invalid; the message names the file and key."""


class EmbeddingModelMismatch(MemoryBotError):
    """The store was embedded with a different model than the one configured."""


class ImportFormatError(MemoryBotError):
    """An input file is not a DiscordChatExporter JSON export."""


class SettingsError(MemoryBotError):
    """A guild setting or its value is unknown."""


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
