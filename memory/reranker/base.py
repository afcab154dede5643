"""The one-method protocol every reranker backend implements."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Protocol, runtime_checkable


@runtime_checkable
class RerankerBackend(Protocol):
    """Scores documents against a query; higher is more relevant.

    Ranking, top-k, blending, timeouts and fallback live once in
    :class:`memory.reranker.service.RerankerService`; a backend only scores.
    """

    name: str

    def score(self, query: str, texts: Sequence[str]) -> list[float]:
        """Return one relevance score in [0, 1] per text, in input order.

        Raises:
            RerankerError: The backend failed; the caller falls back.
        """
        ...

    def close(self) -> None:
        """Release the model, connections and (on CUDA) cached memory."""
        ...
