"""The reranking protocols: what a backend implements, and what a search hands off to.

A backend only scores (:class:`RerankerBackend`).  Ranking, top-k, blending,
timeouts and fallback are written once on top of it, in
:class:`memory.rerank.service.RerankerService`, which is what a search talks to
through :class:`Reranker`.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import TYPE_CHECKING, Protocol, runtime_checkable

if TYPE_CHECKING:
    from memory.records import Hit, Trace


@runtime_checkable
class RerankerBackend(Protocol):
    """Scores documents against a query; higher is more relevant.

    A backend may also set ``enforces_timeout = True`` when :meth:`score` keeps the
    configured timeout itself and leaves no work behind when it gives up (the remote
    one); the service then calls it in the search's own thread instead of its single
    worker thread, so parallel searches are not serialised.
    """

    name: str

    def load(self) -> None:
        """Load the model or check the server, ahead of the first :meth:`score`.

        Raises:
            RerankerUnavailable: The model cannot be loaded or the server reached.
        """
        ...

    def score(self, query: str, texts: Sequence[str]) -> list[float]:
        """Return one relevance score in [0, 1] per text, in input order.

        Raises:
            RerankerError: The backend failed; the caller falls back.
        """
        ...

    def close(self) -> None:
        """Release the model, connections and (on CUDA) cached memory."""
        ...


class Rankable(Protocol):
    """Something a reranker can judge: a text, and a slot for its score."""

    rerank_score: float | None

    @property
    def rerank_text(self) -> str:
        """What the reranker reads."""
        ...


class Reranker(Protocol):
    """The search → rerank hand-off: reorder a search's hits, never fail it."""

    @property
    def name(self) -> str:
        """The backend's name, for logs, metrics and traces."""
        ...

    def rerank_search(self, query: str, hits: list[Hit], limit: int, trace: Trace) -> list[Hit]:
        """Return the hits reranked (or in their order, with the reason in ``trace``)."""
        ...


RerankerProvider = Callable[[], "Reranker | None"]
"""Returns the reranker a search should use now; ``None`` when reranking is off.

A callable rather than an object, so an admin's profile switch takes effect for
the next search."""
