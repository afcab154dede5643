"""Hardware profiles: every shipped profile loads; every mistake is a ConfigError that
names the file and the key."""

from __future__ import annotations

import dataclasses
from pathlib import Path

import pytest

from memory.config import (
    PROFILES_DIR,
    CrossEncoderConfig,
    EmbedderConfig,
    LlamaServerConfig,
    LlmJudgeConfig,
    Profile,
    QwenConfig,
    RerankApiConfig,
    RerankerConfig,
    SearchConfig,
    available_profiles,
    load_profile,
    load_profile_file,
)
from memory.errors import ConfigError
from memory.hardware import cpu_runs_bf16_fast, detect_accelerator

SHIPPED = available_profiles()


def write(tmp_path: Path, text: str, name: str = "custom.toml") -> Path:
    path = tmp_path / name
    path.write_text(text, encoding="utf-8")
    return path


def test_the_documented_profiles_are_shipped() -> None:
    assert {"cpu", "cpu-fast", "cuda", "cuda-8b", "mps", "remote-llama"} <= set(SHIPPED)


@pytest.mark.parametrize("name", SHIPPED)
def test_every_shipped_profile_loads(name: str) -> None:
    profile = load_profile(name)
    assert isinstance(profile, Profile)
    assert profile.name == name
    assert profile.source == str(PROFILES_DIR / f"{name}.toml")
    assert isinstance(profile.embedder, EmbedderConfig)
    assert isinstance(profile.search, SearchConfig)
    assert isinstance(profile.reranker, RerankerConfig)
    assert profile.search.threshold_floor <= profile.search.threshold_start
    if profile.reranker.backend == "llama-server":
        assert profile.reranker.llama_server.url.startswith(("http://", "https://"))


def test_a_profile_loads_by_path(tmp_path: Path) -> None:
    path = write(tmp_path, '[search]\nfusion = "score_max"\nrrf_k = 10\nkeyword_weight = 2\n')
    profile = load_profile(str(path))
    assert profile.name == "custom"
    assert profile.search.fusion == "score_max"
    assert profile.search.keyword_weight == 2.0  # an int where a float is expected is fine
    assert isinstance(profile.search.keyword_weight, float)
    assert profile.embedder == EmbedderConfig()  # absent tables keep their defaults


def test_empty_profile_is_all_defaults(tmp_path: Path) -> None:
    profile = load_profile_file(write(tmp_path, "# nothing here\n"))
    assert (profile.embedder, profile.search, profile.reranker) == (
        EmbedderConfig(), SearchConfig(), RerankerConfig())


def test_auto_resolves_to_a_cpu_profile_here() -> None:
    if detect_accelerator() != "cpu":
        pytest.skip("this machine has an accelerator")
    profile = load_profile("auto")
    # cpu-small (a cross-encoder) where the CPU lacks bfloat16: tests/rerank/test_cross_encoder.py
    assert profile.name == ("cpu" if cpu_runs_bf16_fast() else "cpu-small")
    assert profile.embedder.device == "cpu"


@pytest.mark.parametrize(
    "text, key",
    [
        pytest.param("[embeder]\nmodel = 'x'\n", "embeder", id="unknown-table"),
        pytest.param("top_level = 1\n", "top_level", id="unknown-top-level-key"),
        pytest.param("[search]\noversampel = 5\n", "search.oversampel", id="unknown-key"),
        pytest.param("[search]\noversample = '5'\n", "search.oversample", id="string-for-int"),
        pytest.param("[search]\noversample = 5.0\n", "search.oversample", id="float-for-int"),
        pytest.param("[search]\noversample = true\n", "search.oversample", id="bool-for-int"),
        pytest.param("[reranker]\nprefix_cache = 1\n", "reranker.prefix_cache", id="int-for-bool"),
        pytest.param("[reranker]\nurl = 8080\n", "reranker.url", id="int-for-str"),
        pytest.param("[search]\nthreshold_target = 1.5\n", "search.threshold_target",
                     id="above-max"),
        pytest.param("[search]\noversample = 0\n", "search.oversample", id="below-min"),
        pytest.param("[embedder]\nbatch_size = -1\n", "embedder.batch_size", id="negative"),
        pytest.param("[reranker]\ntimeout = 0.0\n", "reranker.timeout", id="zero-timeout"),
        pytest.param("[search]\nfusion = 'magic'\n", "search.fusion", id="bad-fusion"),
        pytest.param("[embedder]\ndevice = 'tpu'\n", "embedder.device", id="bad-device"),
        pytest.param("[reranker]\nbackend = 'openai'\n", "reranker.backend", id="bad-backend"),
        pytest.param("[reranker]\ndtype = 'int4'\n", "reranker.dtype", id="bad-dtype"),
        pytest.param("search = 5\n", "[search]", id="section-not-a-table"),
        pytest.param("[search]\nthreshold_floor = 0.8\nthreshold_start = 0.7\n",
                     "search.threshold_floor", id="floor-above-start"),
        pytest.param("[search]\nfloor_quantile = 1.5\n", "search.floor_quantile",
                     id="quantile-above-1"),
        pytest.param("[search]\nwindow_weight = -1\n", "search.window_weight",
                     id="negative-window-weight"),
        pytest.param("[reranker]\nbackend = 'llama-server'\n", "reranker.url",
                     id="llama-server-without-url"),
        pytest.param("[reranker]\nbackend = 'llama-server'\nurl = '127.0.0.1:8080'\n",
                     "reranker.url", id="llama-server-url-without-scheme"),
        pytest.param("[search]\nthreshold_start = nan\n", "search.threshold_start",
                     id="nan"),
        pytest.param("[reranker]\ntimeout = nan\n", "reranker.timeout", id="nan-timeout"),
    ],
)
def test_bad_profiles_name_file_and_key(tmp_path: Path, text: str, key: str) -> None:
    path = write(tmp_path, text)
    with pytest.raises(ConfigError) as excinfo:
        load_profile_file(path)
    message = str(excinfo.value)
    assert str(path) in message
    assert key in message


def test_invalid_toml_names_the_file(tmp_path: Path) -> None:
    path = write(tmp_path, "[search\noversample = \n")
    with pytest.raises(ConfigError, match="not valid TOML") as excinfo:
        load_profile(str(path))
    assert str(path) in str(excinfo.value)


def test_missing_profile_file(tmp_path: Path) -> None:
    with pytest.raises(ConfigError, match="not found"):
        load_profile(str(tmp_path / "nope.toml"))


def test_unknown_profile_name_lists_the_shipped_ones() -> None:
    with pytest.raises(ConfigError) as excinfo:
        load_profile("quantum")
    message = str(excinfo.value)
    assert "quantum" in message
    assert all(name in message for name in SHIPPED)


def test_profiles_are_frozen() -> None:
    profile = load_profile("cpu")
    with pytest.raises(AttributeError):
        profile.search.oversample = 3  # type: ignore[misc]


def test_a_profile_with_retired_reranker_keys_still_loads(tmp_path: Path, caplog) -> None:
    """`concurrency` became `parallel` and `health_interval` went away: older files load, with a warning."""
    path = write(tmp_path, '[reranker]\nbackend = "llama-server"\nurl = "http://127.0.0.1:8080"\n'
                           "concurrency = 3\nhealth_interval = 30.0\n")
    with caplog.at_level("WARNING", logger="memory.config"):
        profile = load_profile(str(path))
    assert profile.reranker.llama_server.parallel == 3
    assert "reranker.concurrency is retired; read as reranker.parallel" in caplog.text
    assert "reranker.health_interval is retired and ignored" in caplog.text
    both = write(tmp_path, '[reranker]\nconcurrency = 3\nparallel = 2\n', "both.toml")
    assert load_profile(str(both)).reranker.llama_server.parallel == 2, "the new key wins"


def test_a_profile_with_the_old_multiplicative_boosts_still_loads(tmp_path: Path, caplog) -> None:
    """Issue 9 replaced member_boost and recency_min/max by bounded bonuses."""
    path = write(tmp_path, "[search]\nmember_boost = 2.0\nrecency_min = 0.8\nrecency_max = 1.5\n"
                           "oversample = 6\n")
    with caplog.at_level("WARNING", logger="memory.config"):
        profile = load_profile(str(path))
    assert profile.search.oversample == 6
    assert profile.search.member_weight == SearchConfig().member_weight
    for key in ("member_boost", "recency_min", "recency_max"):
        assert f"search.{key} is retired and ignored" in caplog.text


def test_a_profile_with_multi_query_boost_reads_it_as_multi_query_bonus(
    tmp_path: Path, caplog
) -> None:
    """Issue 22 named every bonus a bonus: the old key still loads, with a warning."""
    path = write(tmp_path, "[search]\nmulti_query_boost = 0.3\n")
    with caplog.at_level("WARNING", logger="memory.config"):
        profile = load_profile(str(path))
    assert profile.search.multi_query_bonus == 0.3
    assert "search.multi_query_boost is retired; read as search.multi_query_bonus" in caplog.text


# -- [reranker]: one flat table in the file, one settings class per backend (issue 34.3) --

FLAT_RERANKER_KEYS = {
    "backend", "model", "device", "dtype", "quantize", "batch_size", "max_length", "instruction",
    "prefix_cache", "oversample", "max_candidates", "timeout", "blend", "blend_weight",
    "min_score", "keep_margin", "url", "endpoint", "parallel", "buckets", "bucket_run_cost",
    "bucket_costs", "pack", "cuda_graphs", "torch_compile", "compile_budget", "concurrent",
    "runtime", "onnx_file", "dialect", "api_key_env", "max_documents", "score_scale",
}
BACKEND_SETTINGS = [QwenConfig, LlamaServerConfig, CrossEncoderConfig, RerankApiConfig,
                    LlmJudgeConfig]


def test_the_reranker_table_keeps_every_key_profiles_have_used(tmp_path: Path) -> None:
    """Profiles people already have must keep loading: no key lost or renamed."""
    path = write(tmp_path, "[reranker]\nbakend = 'none'\n")
    with pytest.raises(ConfigError) as excinfo:
        load_profile_file(path)
    known = str(excinfo.value).split("(known: ", 1)[1].rstrip(")")
    assert set(known.split(", ")) == FLAT_RERANKER_KEYS


def test_a_key_several_backends_read_means_the_same_to_each() -> None:
    """``model``, ``url``, ``max_length``, ...: one default and one range for every reader."""
    specs: dict[str, dataclasses.Field] = {}
    for settings in BACKEND_SETTINGS:
        for f in dataclasses.fields(settings):
            first = specs.setdefault(f.name, f)
            assert (f.default, dict(f.metadata)) == (first.default, dict(first.metadata)), (
                f"{settings.__name__}.{f.name}")


@pytest.mark.parametrize("name", SHIPPED)
def test_every_shipped_profile_round_trips_through_its_flat_table(name: str) -> None:
    reranker = load_profile(name).reranker
    assert set(reranker.table()) == FLAT_RERANKER_KEYS
    assert RerankerConfig.from_table(reranker.table()) == reranker


@pytest.mark.parametrize("backend, settings", [
    ("none", None),
    ("transformers", QwenConfig(model="m", batch_size=4, max_length=256)),
    ("llama-server", LlamaServerConfig(url="http://127.0.0.1:8080", max_length=256)),
    ("cross-encoder", CrossEncoderConfig(model="m", batch_size=4, max_length=256)),
    ("rerank-api", RerankApiConfig(url="http://127.0.0.1:8080", model="m")),
    ("llm", LlmJudgeConfig()),
])
def test_each_backend_receives_only_its_own_keys(
    tmp_path: Path, backend: str, settings: object
) -> None:
    path = write(tmp_path, f"[reranker]\nbackend = '{backend}'\nmodel = 'm'\nbatch_size = 4\n"
                           "max_length = 256\nurl = 'http://127.0.0.1:8080'\ntimeout = 5\n"
                           "[llm]\nbase_url = 'http://127.0.0.1:8080'\nmodel = 'chat'\n")
    reranker = load_profile_file(path).reranker
    assert reranker.options == settings
    assert (reranker.backend, reranker.timeout) == (backend, 5.0)


def test_a_key_of_another_backend_is_accepted_and_still_checked(tmp_path: Path) -> None:
    """As before the split: a key the chosen backend does not read loads (a profile can
    switch backend with one line), but a bad value for it is still an error."""
    path = write(tmp_path, "[reranker]\nbackend = 'transformers'\ndialect = 'cohere'\n")
    assert load_profile_file(path).reranker.rerank_api.dialect == "cohere"
    bad = write(tmp_path, "[reranker]\nbackend = 'transformers'\ndialect = 'klingon'\n", "b.toml")
    with pytest.raises(ConfigError, match="reranker.dialect must be one of"):
        load_profile_file(bad)


def test_set_changes_a_reranker_key_for_every_backend_that_reads_it() -> None:
    from benchmarks.retrieval import with_settings

    profile = with_settings(load_profile("cpu"), ['reranker.backend="cross-encoder"',
                                                  "reranker.batch_size=4"])
    assert profile.reranker.options == CrossEncoderConfig(
        model=load_profile("cpu").reranker.qwen.model, batch_size=4, max_length=256)
    assert profile.reranker.qwen.batch_size == 4
    assert profile.reranker.qwen.buckets == ()
