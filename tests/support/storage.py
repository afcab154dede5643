"""Small checks the storage tests share, written against the contract (and the inspector)."""

from __future__ import annotations

from collections.abc import Callable

import numpy as np

from memory.filters import Filters
from memory.storage import Storage
from tests.support.inspection import Inspector


def row_counts(storage: Storage, inspector: Callable[[Storage], Inspector]) -> dict[str, int]:
    """Rows in messages, in the keyword index itself, and in the vector table."""
    inspect = inspector(storage)
    return {
        "messages": storage.messages.count(),
        "fts": inspect.keyword_rows(),
        "vectors": inspect.vector_rows(),
    }


def keyword_ids(storage: Storage, word: str, field: str = "message") -> set[int]:
    """The messages the keyword index finds for one word."""
    return {mid for mid, _ in storage.keywords.ranked([word], 100, Filters(), field=field)}


def stored_vector(storage: Storage, message_id: int) -> np.ndarray | None:
    """The message's stored vector, or ``None``."""
    return storage.vectors.floats([message_id]).get(message_id)
