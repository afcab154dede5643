"""Hardware profiles: TOML files in ``profiles/`` turned into frozen dataclasses.

A profile has the tables ``[embedder]``, ``[search]``, ``[reranker]`` and the
optional ``[llm]`` (a chat model for grounded answers; absent means off); each
component receives only its own section.  Unknown keys and out-of-range values are
errors that name the file and the key, so a typo never silently falls back to a
default.

* :mod:`~memory.config.profile`: :class:`Profile`, reading and checking a file;
* :mod:`~memory.config.sections`: the sections other than ``[reranker]``;
* :mod:`~memory.config.reranker`: ``[reranker]``, one settings class per backend;
* :mod:`~memory.config.fields`: how a key's type, choices and range are checked.

What this machine can run is :mod:`memory.hardware`; what a URL may carry,
:mod:`memory.urls`.
"""

from memory.config.profile import (
    PROFILES_DIR,
    Profile,
    available_profiles,
    load_profile,
    load_profile_file,
    parse_profile,
)
from memory.config.reranker import (
    BACKEND_SECTIONS,
    DEFAULT_INSTRUCTION,
    DEFAULT_RERANK_TIMEOUT,
    DEFAULT_RERANKER_MODEL,
    BackendConfig,
    CrossEncoderConfig,
    LlamaServerConfig,
    LlmJudgeConfig,
    QwenConfig,
    RerankApiConfig,
    RerankerConfig,
)
from memory.config.sections import (
    DEFAULT_EMBEDDER,
    EmbedderConfig,
    LLMConfig,
    ReconcileConfig,
    SearchConfig,
    StorageConfig,
)
from memory.errors import ConfigError

__all__ = [
    "BACKEND_SECTIONS", "DEFAULT_EMBEDDER", "DEFAULT_INSTRUCTION", "DEFAULT_RERANKER_MODEL",
    "DEFAULT_RERANK_TIMEOUT", "PROFILES_DIR", "BackendConfig", "ConfigError",
    "CrossEncoderConfig", "EmbedderConfig", "LLMConfig", "LlamaServerConfig", "LlmJudgeConfig",
    "Profile", "QwenConfig", "ReconcileConfig", "RerankApiConfig", "RerankerConfig",
    "SearchConfig", "StorageConfig", "available_profiles", "load_profile", "load_profile_file",
    "parse_profile",
]
