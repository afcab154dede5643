"""``[reranker]``: what every backend shares, and one settings class per backend.

The file keeps one flat ``[reranker]`` table (profiles people have keep loading);
:class:`RerankerConfig` gives each key to every backend that reads it, and each
backend receives only its own settings (:attr:`RerankerConfig.options`).
"""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from memory.config.fields import bounds, choices
from memory.config.sections import LLMConfig
from memory.errors import ConfigError
from memory.urls import refuse_url_credentials

# What the reranker is asked to judge (Qwen3-Reranker's "<Instruct>"); memory.rerank.prompt
# builds the prompt around it.
DEFAULT_INSTRUCTION = (
    "Given a question or topic from a member of a chat server, judge whether this chat "
    "message contains information that answers it"
)


# Keys that several backends read: one spec each, so the flat [reranker] table means
# the same to every backend that reads a key (tests/engine/test_config.py checks it).
DEFAULT_RERANKER_MODEL = "Qwen/Qwen3-Reranker-0.6B"
DEFAULT_RERANK_TIMEOUT = 30.0


def _model() -> Any:
    return field(default=DEFAULT_RERANKER_MODEL)


def _device() -> Any:
    return field(default="cpu", metadata=choices("cpu", "cuda", "mps", "auto"))


def _batch_size() -> Any:
    return field(default=8, metadata=bounds(1, 1024))


def _max_length() -> Any:
    return field(default=512, metadata=bounds(16, 32768))


def _instruction() -> Any:
    return field(default=DEFAULT_INSTRUCTION)


def _url() -> Any:
    return field(default="")


def _parallel() -> Any:
    return field(default=4, metadata=bounds(1, 256))


@dataclass(frozen=True)
class QwenConfig:
    """``backend = "transformers"``: a Qwen3-Reranker (``model``) in this process.

    ``buckets`` turns on the static-shape path: a list of ``[batch, length]`` shapes
    (length counts document + suffix tokens) that the candidates are padded into,
    with the shared head computed once per query.  With ``cuda_graphs`` on a CUDA
    device, every shape is captured as a CUDA graph when the model loads, so a
    search replays graphs instead of launching kernels one by one.
    ``torch_compile`` compiles the static steps with torch.compile (inductor) after
    load, in the background while the eager steps (and their CUDA graphs) serve, runs
    every shape once and captures them, then swaps the compiled steps in; if that
    fails, or takes longer than ``compile_budget`` seconds, the eager steps stay
    (logged once).  ``concurrent`` is how many searches one static
    step may hold: searches that arrive while another is being scored are scored
    together, each candidate attending only to its own query (1: one at a time).
    Each search slot costs one head's keys and values per capacity in memory.
    Empty ``buckets`` keeps the dynamic-shape path.  ``bucket_run_cost`` is what one
    more forward pass costs, in token positions: the candidates are packed to
    minimise padded positions plus runs times this (high where launches dominate, a
    small model; low where compute does, the 8B).  ``bucket_costs``, measured by
    ``bench step-costs`` on the machine that runs the profile (``[batch, length,
    milliseconds]`` for every bucket), replaces that estimate: the candidates are
    then packed to minimise the measured time of the steps.  ``pack`` lets one
    row of a bucket hold several candidates back to back (each attending only to
    itself and its query), wherever that plans cheaper than one candidate a row:
    chat messages are far shorter than the longest bucket they must fit.
    """

    model: str = _model()
    device: str = _device()
    dtype: str = field(
        default="auto", metadata=choices("auto", "float32", "bfloat16", "float16")
    )
    quantize: str = field(default="none", metadata=choices("none", "int8"))
    batch_size: int = _batch_size()
    max_length: int = _max_length()
    instruction: str = _instruction()
    prefix_cache: bool = True
    buckets: tuple[tuple[int, int], ...] = field(default=(), metadata={"shapes": True})
    bucket_run_cost: int = field(default=512, metadata=bounds(0, 1_000_000))
    bucket_costs: tuple[tuple[int, int, float], ...] = field(default=(), metadata={"costs": True})
    pack: bool = False
    cuda_graphs: bool = False
    torch_compile: bool = False
    compile_budget: float = field(default=90.0, metadata=bounds(1.0, 3600.0))
    concurrent: int = field(default=1, metadata=bounds(1, 256))


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
        default="completion", metadata=choices("completion", "chat", "rerank")
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
    runtime: str = field(default="torch", metadata=choices("torch", "onnx"))
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
        default="jina", metadata=choices("cohere", "jina", "tei", "infinity", "voyage")
    )
    model: str = _model()
    api_key_env: str = ""
    max_documents: int = field(default=100, metadata=bounds(1, 10_000))
    score_scale: str = field(default="auto", metadata=choices("auto", "probability", "logit"))


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
    is below ``min_score`` are dropped.  ``keep_margin`` guards recall: a candidate
    from beyond retrieval's top ``limit`` enters the returned page only by beating
    the weakest of them by more than this (in final score); 0 lets the reranker's
    order decide alone.

    The profile file keeps one flat ``[reranker]`` table: :meth:`from_table` gives
    each key to every backend that reads it, and :meth:`table` writes it back.
    """

    backend: str = field(default="none", metadata=choices("none", *BACKEND_SECTIONS))
    oversample: int = field(default=3, metadata=bounds(1, 100))
    max_candidates: int = field(default=30, metadata=bounds(1, 1000))
    timeout: float = field(default=DEFAULT_RERANK_TIMEOUT, metadata=bounds(0.01, 3600.0))
    blend: bool = False
    blend_weight: float = field(default=0.6, metadata=bounds(0.0, 1.0))
    min_score: float = field(default=0.0, metadata=bounds(0.0, 1.0))
    keep_margin: float = field(default=0.2, metadata=bounds(0.0, 1.0))
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


def validate_reranker(source: str, r: RerankerConfig, llm: LLMConfig) -> None:
    """What the keys of ``[reranker]`` must be together.

    Each backend's own checks run whichever backend is chosen, as they always have:
    a file that is wrong for one backend does not become right by naming another.

    Raises:
        ConfigError: A remote backend without an http(s) URL or with credentials in
            it, the ``llm`` backend without ``[llm]``, or keys that contradict each
            other; the message names ``source`` and the key.
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


def _validate_bucket_costs(source: str, q: QwenConfig) -> None:
    """``bucket_costs`` times exactly the buckets: a plan needs every shape's time."""
    if not q.bucket_costs:
        return
    timed = {(batch, length) for batch, length, _ in q.bucket_costs}
    missing = [list(b) for b in q.buckets if b not in timed]
    extra = sorted(list(b) for b in timed - set(q.buckets))
    if missing or extra:
        said = (f"has no time for {missing[0]}" if missing
                else f"times {extra[0]}, which is not in reranker.buckets")
        raise ConfigError(
            f"{source}: reranker.bucket_costs {said}: measure the buckets again "
            "(python bot.py --profile PROFILE bench step-costs --write-profile OUT.toml) "
            "or remove bucket_costs"
        )


def _validate_qwen(source: str, q: QwenConfig) -> None:
    if q.buckets and q.quantize == "int8":
        raise ConfigError(
            f"{source}: reranker.buckets cannot be combined with quantize = 'int8' "
            "(dynamic int8 scales activations per batch, so padding would change scores): "
            "drop one of them"
        )
    if q.pack and not q.buckets:
        raise ConfigError(
            f"{source}: reranker.pack packs candidates into the static-shape steps, so "
            "it needs reranker.buckets: add buckets or set pack = false"
        )
    if q.torch_compile and not q.buckets:
        raise ConfigError(
            f"{source}: reranker.torch_compile compiles the static-shape steps, so "
            "it needs reranker.buckets: add buckets or set torch_compile = false"
        )
    _validate_bucket_costs(source, q)
    too_long = [b for b in q.buckets if b[1] > q.max_length]
    if too_long:
        raise ConfigError(
            f"{source}: reranker.buckets length {too_long[0][1]} is over "
            f"reranker.max_length {q.max_length}: a document and suffix never need more"
        )
