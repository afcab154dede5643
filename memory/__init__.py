"""The memory engine: store, embed and search a Discord server's messages.

Discord-free and synchronous; the cog and the CLI drive it from outside.  The
public API is what this package names: :class:`MemoryEngine` (the one object a
caller holds), :class:`SearchRequest` in, :class:`SearchResult` of :class:`Hit`
with its :class:`Trace` out, :class:`RerankerStatus`, and the typed errors of
:mod:`memory.errors`.  Everything else is the engine's own business.

The names load on first use, so ``import memory.text`` (the tokenizer's child
process does that) does not pull in the database, numpy and the models.
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from memory.engine import MemoryEngine
    from memory.errors import (
        ChatModelError,
        ConfigError,
        DatabaseFileError,
        DiskFullError,
        EmbeddingModelChanged,
        EmbeddingModelMismatch,
        ImportFormatError,
        MemoryBotError,
        RerankerError,
        RerankerUnavailable,
        SearchInputError,
        SettingsError,
        StorageBusy,
    )
    from memory.records import Hit, SearchResult, Trace
    from memory.rerank.service import RerankerStatus
    from memory.search.request import SearchRequest

_HOMES = {
    "MemoryEngine": "memory.engine",
    "SearchRequest": "memory.search.request",
    "SearchResult": "memory.records",
    "Hit": "memory.records",
    "Trace": "memory.records",
    "RerankerStatus": "memory.rerank.service",
    **{
        name: "memory.errors"
        for name in (
            "MemoryBotError", "ConfigError", "DatabaseFileError", "DiskFullError",
            "EmbeddingModelMismatch", "EmbeddingModelChanged", "ImportFormatError",
            "SettingsError", "SearchInputError", "RerankerError", "RerankerUnavailable",
            "ChatModelError", "StorageBusy",
        )
    },
}

__all__ = [
    "ChatModelError", "ConfigError", "DatabaseFileError", "DiskFullError",
    "EmbeddingModelChanged", "EmbeddingModelMismatch", "Hit", "ImportFormatError",
    "MemoryBotError", "MemoryEngine", "RerankerError", "RerankerStatus", "RerankerUnavailable",
    "SearchInputError", "SearchRequest", "SearchResult", "SettingsError", "StorageBusy", "Trace",
]


def __getattr__(name: str) -> Any:
    """Import a public name from its home module on first use (PEP 562)."""
    home = _HOMES.get(name)
    if home is None:
        raise AttributeError(f"module 'memory' has no attribute {name!r}")
    value = getattr(importlib.import_module(home), name)
    globals()[name] = value
    return value


def __dir__() -> list[str]:
    return sorted(set(globals()) | set(__all__))
