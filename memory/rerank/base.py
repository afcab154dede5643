"""The reranking protocols: what a backend implements, and what a search hands off to.

A backend only scores (:class:`RerankerBackend`).  Ranking, top-k, the deadline,
metrics and fallback are written once on top of it, in
:class:`memory.rerank.service.RerankerService`, which is what a search talks to
through :class:`Reranker`: it returns ``(index, score)`` pairs (:class:`Ranked`),
as sentence-transformers' ``CrossEncoder.rank`` does, and never touches the
search's candidates.  How those scores become a hit's final score (the blend, the
minimum score) is :mod:`memory.search.ranking`'s business.
:func:`check_classifier` is what a sequence-classification model must be to score at
all (the cross-encoder's torch and ONNX runtimes and ``export-onnx`` apply it).
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, NamedTuple, Protocol, runtime_checkable

from memory.errors import RerankerUnavailable

if TYPE_CHECKING:
    from memory.config import RerankerConfig


@runtime_checkable
class RerankerBackend(Protocol):
    """Scores documents against a query; higher is more relevant.

    The service calls :meth:`score` on a worker thread with a deadline
    (:mod:`memory.rerank.deadline`): a backend may read it to stop early, and
    must leave no work behind when it does.  A backend that may be called from
    several threads at once (a remote server, or the transformers backend that
    scores queued searches together) sets ``concurrent = True``; without it,
    calls run one at a time on the service's single worker, so a local model
    never shares its device between searches.
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


class Ranked(NamedTuple):
    """One text's place in a ranking: ``(item, score)``, ``item`` its index in the input."""

    item: int
    score: float


@dataclass(frozen=True)
class Ranking:
    """A search's reranker call: the texts best first, or why there is no ranking.

    Attributes:
        ranked: One pair per text, best first; empty when ``fallback`` is set.
        fallback: Why the search keeps its retrieval order (``None``: it ranked).
    """

    ranked: tuple[Ranked, ...] = ()
    fallback: str | None = None


class Reranker(Protocol):
    """The search → rerank hand-off: rank a search's texts, never fail it."""

    @property
    def name(self) -> str:
        """The backend's name, for logs, metrics and traces."""
        ...

    @property
    def config(self) -> RerankerConfig:
        """The profile's ``[reranker]`` section: how many to send, blend, minimum score."""
        ...

    def rank_for_search(self, query: str, texts: Sequence[str]) -> Ranking:
        """Rank ``texts`` against ``query``; on any failure say why instead of raising."""
        ...


RerankerProvider = Callable[[], "Reranker | None"]
"""Returns the reranker a search should use now; ``None`` when reranking is off.

A callable rather than an object, so an admin's profile switch takes effect for
the next search."""


def check_classifier(architectures: Sequence[str] | None, model: str,
                     missing: Iterable[str] = ()) -> None:
    """Refuse a model whose relevance head would be random weights.

    ``AutoModelForSequenceClassification`` (and sentence-transformers' ``CrossEncoder``
    on top of it) loads an embedding model or a plain ``BertModel`` folder without a
    word, adding a newly initialised classifier: its scores are noise.

    Args:
        architectures: ``config.architectures`` of the model's config.json.
        model: The model id or folder, for the message.
        missing: Weights the checkpoint lacked (``output_loading_info``'s
            ``missing_keys``), when known.

    Raises:
        RerankerUnavailable: No ``*ForSequenceClassification`` architecture, or
            classifier weights missing from the checkpoint.
    """
    names = list(architectures or ())
    if not any(name.endswith("ForSequenceClassification") for name in names):
        found = ", ".join(names) if names else "no architecture"
        raise RerankerUnavailable(
            f"{model!r} is not a cross-encoder: its config.json names {found}, not a "
            "*ForSequenceClassification, so its relevance head would be random weights"
        )
    heads = sorted(key for key in missing if "classifier" in key or "score" in key)
    if heads:
        raise RerankerUnavailable(
            f"{model!r} has no trained relevance head ({', '.join(heads)} missing from its "
            "weights): its scores would be random"
        )
