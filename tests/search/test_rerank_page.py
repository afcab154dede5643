"""The rerank stage never trades retrieval's page for order: a whole search, real SQLite.

The reranker is a real :class:`RerankerService` over a scripted backend (no trained
model exists here): it prefers the texts a test names, by a little or by a lot.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import replace

import pytest

from memory.config import RerankerConfig, SearchConfig
from memory.engine import MemoryEngine
from memory.records import MessageRecord
from memory.rerank.service import RerankerService
from memory.search import SearchRequest
from memory.search.searcher import Searcher
from tests.support.builders import GUILD, NOW, HashEmbedder

MakeRecord = Callable[..., MessageRecord]
MakeEngine = Callable[..., MemoryEngine]
QUERY = "widget repair bench notes"


class Prefers:
    """A scripted backend: ``high`` for texts holding a favoured line, 0.5 for the rest."""

    name = "scripted"

    def __init__(self, favoured: Sequence[str], high: float) -> None:
        self.favoured, self.high = list(favoured), high

    def load(self) -> None:
        """Nothing to load."""

    def score(self, query: str, texts: Sequence[str]) -> list[float]:
        """``high`` for a favoured text, 0.5 otherwise."""
        return [self.high if any(f in t for f in self.favoured) else 0.5 for t in texts]

    def close(self) -> None:
        """Nothing to close."""


def _corpus(make_engine: MakeEngine, make_record: MakeRecord) -> MemoryEngine:
    engine = make_engine()
    words = QUERY.split()
    engine.ingest(
        make_record(" ".join(words[: 1 + i % 4]) + f" entry {i} of the log", age_days=1 + i)
        for i in range(40)
    )
    return engine


def _search(engine: MemoryEngine, reranker: RerankerService | None) -> list[int]:
    searcher = Searcher(engine.storage, HashEmbedder(), SearchConfig(),
                        reranker=(lambda: reranker) if reranker else None)
    try:
        result = searcher.run(SearchRequest((QUERY,), guild_id=GUILD, limit=10, now=NOW))
    finally:
        searcher.close()
    assert reranker is None or result.trace.reranked
    return [h.id for h in result.hits]


@pytest.mark.parametrize("high, margin, enters", [
    pytest.param(0.55, None, False, id="unsure-default-margin"),
    pytest.param(0.95, None, True, id="clear-default-margin"),
    pytest.param(0.55, 0.0, True, id="unsure-no-margin"),
])
def test_retrievals_page_is_kept_unless_a_newcomer_is_clearly_better(
    make_engine: MakeEngine, make_record: MakeRecord, high: float, margin: float | None,
    enters: bool,
) -> None:
    engine = _corpus(make_engine, make_record)
    hybrid = _search(engine, None)
    assert len(hybrid) == 10
    rows = engine.storage.messages.hydrate(hybrid)
    # two messages retrieval ranks below its page, found again by the reranker
    order = [h.id for h in engine.search(QUERY, guild_id=GUILD, limit=30, now=NOW,
                                          rerank=False).hits]
    newcomers = [i for i in order if i not in hybrid][:2]
    texts = [m.content for m in engine.storage.messages.hydrate(newcomers).values()]
    config = RerankerConfig(backend="cross-encoder")
    if margin is not None:
        config = replace(config, keep_margin=margin)
    service = RerankerService(config, backend=Prefers(texts, high))
    try:
        page = _search(engine, service)
    finally:
        service.close()
    assert set(newcomers) <= set(page) if enters else set(page) == set(rows)
