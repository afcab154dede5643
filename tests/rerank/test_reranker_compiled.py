"""The static path's steps compiled with torch.compile (issue 33), tested on this CPU.

Inductor and dynamo run on the CPU too, so the compiled path is exercised here on
the tiny Qwen3 model, with few shapes (compiling is heavy on a shared CPU): the
scores equal the eager static path's within float32 round-off, compilation happens
at load and never on a search, and a compilation failure (a real dynamo error from
a backend that raises, not a patched method) is logged once and leaves the eager
steps scoring.  CUDA graph capture of the compiled steps needs a GPU; on this CPU
the device check keeps every CUDA-only call away (``cuda_forbidden``).
"""

from __future__ import annotations

import logging
from pathlib import Path

import pytest
import torch

from memory.config import ConfigError, load_profile_file
from memory.rerank import qwen
from tests.rerank.test_reranker_qwen import DOCS, QUERY, assert_close
from tests.support.qwen_tiny import wrap

FP32_TOL = 1e-5
MAX_LENGTH = 96  # head sizes 64 and 96 in capacities 64 and 128: few shapes to compile
BUCKETS = ((4, 32),)
QUERIES = (QUERY, "", "bot down?")  # heads of 79, 70 and 72 tokens: both head sizes run

pytestmark = pytest.mark.usefixtures("single_torch_thread")


@pytest.fixture(scope="module")
def eager(parts, config):
    """The eager static path's scores, per query."""
    reranker = wrap(parts, config, buckets=BUCKETS, max_length=MAX_LENGTH)
    return {q: reranker.score(q, DOCS) for q in QUERIES}


def recording_backend(calls: list[str]):
    """A torch.compile backend that records each compilation and runs the graph as traced."""

    def backend(graph_module: torch.fx.GraphModule, example_inputs: list) -> object:
        calls.append(graph_module.__class__.__name__)
        return graph_module.forward

    return backend


def failing_backend(graph_module: torch.fx.GraphModule, example_inputs: list) -> object:
    raise RuntimeError("inductor: no C++ compiler on this machine (forced)")


def test_steps_compile_at_load_and_never_on_a_search(parts, config, eager):
    reranker = wrap(parts, config, buckets=BUCKETS, max_length=MAX_LENGTH)
    static = reranker._static
    calls: list[str] = []
    assert qwen.compiled(static, backend=recording_backend(calls))
    assert static.compiled and calls  # traced and compiled here, at load
    at_load = len(calls)
    for query in QUERIES:
        assert_close(reranker.score(query, DOCS), eager[query], tol=FP32_TOL)
    assert len(calls) == at_load  # every shape was run at load: no search compiles


def test_a_compile_failure_logs_once_and_keeps_the_eager_steps(parts, config, eager, caplog):
    reranker = wrap(parts, config, buckets=BUCKETS, max_length=MAX_LENGTH)
    static = reranker._static
    with caplog.at_level(logging.WARNING, logger="memory.rerank.qwen"):
        assert not qwen.compiled(static, backend=failing_backend)
        scores = [reranker.score(q, DOCS) for q in QUERIES]
    assert caplog.text.count("torch.compile of the static steps failed") == 1
    assert "forced" in caplog.text  # the cause is in the log
    assert reranker._static is static and not static.compiled  # still the static path
    for query, got in zip(QUERIES, scores, strict=True):
        assert_close(got, eager[query], tol=0.0)  # the very same eager steps


def test_the_profile_switch_compiles_at_load_and_a_failure_never_reaches_a_search(
    parts, config, eager, caplog, monkeypatch, cuda_forbidden
):
    # torch_compile through the profile, with CUDA graphs asked for on a CPU: the load
    # path compiles, fails (the backend raises inside dynamo), keeps the eager steps,
    # and never calls CUDA-only torch.
    real_compile = torch.compile
    monkeypatch.setattr(
        torch, "compile", lambda fn, **kw: real_compile(fn, **{**kw, "backend": failing_backend})
    )
    with caplog.at_level(logging.WARNING, logger="memory.rerank.qwen"):
        reranker = wrap(parts, config, buckets=BUCKETS, max_length=MAX_LENGTH,
                        torch_compile=True, cuda_graphs=True)
        got = reranker.score(QUERY, DOCS)
    assert caplog.text.count("torch.compile of the static steps failed") == 1
    assert reranker._static is not None and not reranker._static.compiled
    assert_close(got, eager[QUERY], tol=0.0)


@pytest.mark.slow
# torch's own notice, raised while inductor imports torch.utils.mkldnn: not our call
@pytest.mark.filterwarnings("ignore:`torch.jit.script_method` is deprecated:DeprecationWarning")
def test_inductor_compiled_scores_equal_eager(parts, config, eager, caplog):
    # the real thing: inductor generates and builds C++ kernels here (~2 min on 2 cores)
    with caplog.at_level(logging.INFO, logger="memory.rerank.qwen"):
        reranker = wrap(parts, config, buckets=BUCKETS, max_length=MAX_LENGTH, torch_compile=True)
    assert reranker._static.compiled, caplog.text
    assert "static steps compiled in" in caplog.text
    for query in QUERIES:
        assert_close(reranker.score(query, DOCS), eager[query], tol=FP32_TOL)


def write(tmp_path: Path, text: str) -> Path:
    path = tmp_path / "p.toml"
    path.write_text(text, encoding="utf-8")
    return path


@pytest.mark.parametrize(
    "body, message",
    [
        ("torch_compile = true", "reranker.torch_compile .*needs reranker.buckets"),
        ("torch_compile = 'yes'\nbuckets = [[8, 48]]", "torch_compile"),
    ],
)
def test_bad_torch_compile_names_file_and_key(tmp_path, body, message):
    path = write(tmp_path, f'[reranker]\nbackend = "transformers"\n{body}\n')
    with pytest.raises(ConfigError, match=message) as caught:
        load_profile_file(path)
    assert str(path) in str(caught.value)


def test_torch_compile_parses(tmp_path):
    path = write(tmp_path, '[reranker]\nbackend = "transformers"\nbuckets = [[8, 48]]\n'
                           "torch_compile = true\n")
    assert load_profile_file(path).reranker.qwen.torch_compile is True


def test_compiled_steps_score_searches_together(parts, config, eager):
    # the kernels grouped searches run through are the compiled ones too
    reranker = wrap(parts, config, buckets=BUCKETS, max_length=MAX_LENGTH, concurrent=3)
    calls: list[str] = []
    assert qwen.compiled(reranker._static, backend=recording_backend(calls))
    at_load = len(calls)
    searches = [reranker.encode(q, DOCS) for q in QUERIES]
    results = reranker._static.score_together([(e.head, e.tails) for e in searches], 512)
    for query, (found, overflow) in zip(QUERIES, results, strict=True):
        assert overflow == []
        assert_close([found[i] for i in range(len(DOCS))], eager[query], tol=FP32_TOL)
    assert len(calls) == at_load
