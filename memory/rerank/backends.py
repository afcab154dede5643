"""Which backend a ``[reranker]`` section names, built without loading it.

One module per backend; each is imported here only when a profile names it, so
torch, transformers and httpx load only for the backend in use.  A backend whose
packages are missing becomes a :class:`MissingBackend` that says what to install:
searches go on without reranking.
"""

from __future__ import annotations

from collections.abc import Sequence

from memory.config import LLMConfig, RerankerConfig
from memory.errors import RerankerError, RerankerUnavailable
from memory.rerank.base import RerankerBackend


def make_backend(config: RerankerConfig, llm: LLMConfig | None = None) -> RerankerBackend:
    """Create (but do not load) the backend a reranker config names.

    Heavy imports happen here, only for the backend in use.  Each backend receives
    its own settings (and the remote ones the call timeout); ``llm`` is the
    profile's ``[llm]`` section, which the ``llm`` backend judges with.

    Raises:
        RerankerError: The config names no backend (``none``).
    """
    try:
        if config.backend == "transformers":
            from memory.rerank.qwen import QwenReranker

            return QwenReranker(config.qwen)
        if config.backend == "llama-server":
            from memory.rerank.llama_server import LlamaServerBackend

            return LlamaServerBackend(config.llama_server, config.timeout)
        if config.backend == "cross-encoder":
            from memory.rerank.cross_encoder import CrossEncoderReranker

            return CrossEncoderReranker(config.cross_encoder)
        if config.backend == "rerank-api":
            from memory.rerank.rerank_api import RerankApiBackend

            return RerankApiBackend(config.rerank_api, config.timeout)
        if config.backend == "llm":
            from memory.rerank.llm_judge import LLMJudge

            return LLMJudge(config.llm_judge, llm or LLMConfig(), config.timeout)
    except ImportError as exc:  # searches go on without reranking, saying why
        return MissingBackend(config.backend, (
            f"the {config.backend} reranker cannot run here ({exc}); install the missing "
            "package in this environment"
        ))
    raise RerankerError(f"reranker backend {config.backend!r} has nothing to load")


class MissingBackend:
    """Stands in for a backend whose packages are not installed: every call says why.

    Args:
        name: The backend the profile asked for.
        reason: What is missing and how to install it.
    """

    def __init__(self, name: str, reason: str) -> None:
        self.name = name
        self.reason = reason

    def load(self) -> None:
        """Refuse: the backend's packages are missing.

        Raises:
            RerankerUnavailable: Always, with :attr:`reason`.
        """
        raise RerankerUnavailable(self.reason)

    def score(self, query: str, texts: Sequence[str]) -> list[float]:
        """Refuse, as :meth:`load` does.

        Raises:
            RerankerUnavailable: Always, with :attr:`reason`.
        """
        raise RerankerUnavailable(self.reason)

    def close(self) -> None:
        """Nothing to release."""
