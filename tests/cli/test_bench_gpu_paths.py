"""The benchmark paths issue 11 adds: model sizes, static-shape variants, the embedder.

Nothing here measures speed (benchmarks go in BENCHMARKS.md); these tests check
that each path runs end to end through the CLI on this CPU and reports what it
claims: the bucketed rows' scores agree with the dynamic path, the model sizes
have the published parameter counts, the embedder reports throughput, latency
and, in float16, its agreement with float32.
"""

from __future__ import annotations

import dataclasses
import json
from pathlib import Path

import pytest
import torch

import bot
from benchmarks.qwen_models import MODEL_SHAPES, qwen3_config

pytestmark = pytest.mark.usefixtures("single_torch_thread")


def run_json(capsys: pytest.CaptureFixture, tmp_path: Path, *argv: str) -> dict:
    out_file = tmp_path / "result.json"
    code = bot.main([*argv, "--json", str(out_file)])
    _, err = capsys.readouterr()
    assert code == 0, err
    return json.loads(out_file.read_text(encoding="utf-8"))


@pytest.mark.parametrize("size, billions", [("0.6B", 0.60), ("4B", 4.02), ("8B", 8.19)])
def test_model_sizes_have_the_published_parameter_counts(size, billions):
    from transformers import Qwen3ForCausalLM

    with torch.device("meta"):  # shapes only, no memory
        model = Qwen3ForCausalLM(qwen3_config(MODEL_SHAPES[size]))
    model.tie_weights()  # as the bench's builder does: transformers 5.0 ties only when asked
    count = sum(p.numel() for p in model.parameters()) / 1e9
    assert count == pytest.approx(billions, abs=0.005)  # the model cards' counts


def test_bench_rerank_quick_reports_static_variants(capsys, tmp_path, cuda_forbidden):
    # cuda_forbidden: on a CPU-only machine no CUDA-only torch call may run
    result = run_json(capsys, tmp_path, "bench", "rerank", "--model-size", "tiny", "--quick",
                      "--candidates", "6")
    assert result["model_size"] == "tiny" and result["quick"] is True
    rows = {row["name"]: row for row in result["variants"]}
    assert list(rows) == [
        "prefix float32 bs8 (reference)", "bucketed float32 eager", "packed float32 eager",
        "prefix bfloat16 bs8", "bucketed bfloat16 eager", "packed bfloat16 eager",
    ]
    bucketed, packed = rows["bucketed float32 eager"], rows["packed float32 eager"]
    assert bucketed["buckets"] and not bucketed["graphs_live"]  # no CUDA here
    assert bucketed["eager_diff"] <= 1e-5 and bucketed["max_abs_diff"] <= 1e-5
    assert packed["eager_diff"] <= 1e-5 and packed["packed"] and not bucketed["packed"]
    assert rows["bucketed bfloat16 eager"]["eager_diff"] <= 1e-2  # issue 11's bar
    assert bucketed["tokens"] > rows["prefix float32 bs8 (reference)"]["tokens"]  # padding


def test_bench_rerank_rejects_unknown_size(capsys):
    code = bot.main(["bench", "rerank", "--model-size", "70B"])
    assert code != 0
    assert "--model-size" in capsys.readouterr().err


@pytest.mark.parametrize("dtype", ["float32", "float16"])
def test_bench_embedder_reports_throughput_latency_agreement(
    capsys, tmp_path, dtype, cuda_forbidden
):
    result = run_json(capsys, tmp_path, "--profile", "cpu-fast", "bench", "embedder",
                      "--dtype", dtype, "--messages", "40", "--queries", "3")
    assert (result["device"], result["dtype"], result["messages"]) == ("cpu", dtype, 40)
    assert result["import_messages_per_s"] > 0
    assert result["query_ms"]["p95"] >= result["query_ms"]["p50"] > 0
    if dtype == "float32":
        assert result["cosine_vs_float32"] is None
    else:
        assert result["cosine_vs_float32"]["min"] > 0.99


@pytest.mark.skipif(torch.cuda.is_available(), reason="this machine has a CUDA GPU")
@pytest.mark.parametrize("command", [["rerank", "--model-size", "tiny"], ["embedder"]])
def test_cuda_asked_without_a_gpu_is_one_clear_line(capsys, command):
    code = bot.main(["bench", *command, "--device", "cuda"])
    err = capsys.readouterr().err
    assert code == 2
    assert "sees no CUDA GPU" in err and "Traceback" not in err
    assert len(err.strip().splitlines()) == 1


@pytest.mark.parametrize("size, profile", [("0.6B", "cuda"), ("4B", "cuda-8b"), ("8B", "cuda-8b")])
def test_gpu_quick_plan_has_graph_variants_with_the_profiles_buckets(size, profile):
    # the plan a CUDA run would time, checked here without one
    from benchmarks.rerank import _profile_static, _variants
    from memory.config import load_profile

    static = _profile_static(size)
    reranker = load_profile(profile).reranker.qwen
    assert (static.buckets, static.run_cost) == (reranker.buckets, reranker.bucket_run_cost)
    plan = {v.name: v for v in _variants("cuda", "bfloat16", static, quick=True)}
    assert list(plan) == [
        "per-pair float32", "batched bfloat16 bs32", "prefix bfloat16 bs32",
        "bucketed bfloat16 eager", "bucketed bfloat16 graphs", "bucketed bfloat16 compiled graphs",
        "packed bfloat16 compiled graphs",
    ]  # issue 33 adds the compiled graphs row, then the same steps packed
    assert plan["bucketed bfloat16 graphs"].cuda_graphs
    compiled = plan["bucketed bfloat16 compiled graphs"]
    one_a_row = dataclasses.replace(static, pack=False)
    assert compiled.cuda_graphs and compiled.torch_compile and compiled.static == one_a_row
    assert not plan["bucketed bfloat16 graphs"].torch_compile
    assert not plan["bucketed bfloat16 eager"].cuda_graphs
    assert plan["bucketed bfloat16 graphs"].static == one_a_row
    assert plan["packed bfloat16 compiled graphs"] == dataclasses.replace(
        compiled, name="packed bfloat16 compiled graphs", static=dataclasses.replace(static, pack=True))
