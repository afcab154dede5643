"""`bench gpu-rows`: one model size's GPU rows from one process (issue 33), checked on this CPU.

The GPU run cannot happen here; the tiny model runs the same steps on the CPU (the
slow smoke test of scripts/gpu-bench.sh runs it with inductor).  A recording backend
stands in for inductor here: what matters is which steps each row timed, and that each
variant was loaded once for every row it serves.  Nothing here measures speed.
"""

from __future__ import annotations

import json

import pytest

import bot
from memory.config import load_profile, load_profile_file
from tests.rerank.test_reranker_compiled import route_compile, sized_backend

pytestmark = pytest.mark.usefixtures("single_torch_thread", "cuda_forbidden", "fresh_dynamo")

ARGS = ["--model-size", "tiny", "--device", "cpu", "--dtype", "bfloat16", "--candidates", "4,6",
        "--concurrent", "1,2", "--repeats", "1", "--rounds", "1", "--compile-budget", "120"]


def rows(capsys, out, *extra: str) -> tuple[int, dict, str]:
    code = bot.main(["bench", "gpu-rows", "--out", str(out), *ARGS, *extra])
    captured = capsys.readouterr()
    return code, json.loads(captured.out) if code in (0, 1) else {}, captured.err


def read(out, name: str) -> dict:
    return json.loads((out / name).read_text(encoding="utf-8"))


def test_every_row_of_a_size_from_one_load_per_variant(capsys, tmp_path, monkeypatch):
    graphs: list[int] = []
    route_compile(monkeypatch, sized_backend(graphs))
    out = tmp_path / "raw"
    code, result, err = rows(capsys, out, "--step-costs", "1", "--label", "0.6B")
    assert code == 0, err
    assert result["failed"] == []
    assert sorted(result["written"]) == sorted([
        "rerank-0.6B.json", "rerank-0.6B-6.json", "concurrent-0.6B.json",
        "concurrent-0.6B-compiled.json", "step-costs-0.6B.json", "cuda-timed.toml"])
    first, second = read(out, "rerank-0.6B.json"), read(out, "rerank-0.6B-6.json")
    assert (first["candidates"], second["candidates"]) == (4, 6)
    names = [v["name"] for v in first["variants"]]
    assert names == [v["name"] for v in second["variants"]]
    assert names[-1] == "bucketed bfloat16 compiled"  # the CPU smoke run compiles too
    # each variant loaded (and compiled) once, then timed at both counts
    assert [v["load_seconds"] for v in first["variants"]] == [
        v["load_seconds"] for v in second["variants"]]
    assert first["variants"][-1]["compiled"] and graphs
    eager, compiled = read(out, "concurrent-0.6B.json"), read(out, "concurrent-0.6B-compiled.json")
    assert (eager["torch_compile"], eager["compiled"]) == (False, False)
    assert (compiled["torch_compile"], compiled["compiled"]) == (True, True)
    for report in (eager, compiled):
        assert report["concurrent_setting"] == load_profile("cuda").reranker.qwen.concurrent
        assert report["candidates"] == 4 and report["dtype"] == "bfloat16"
        assert [level["searches"] for level in report["levels"]] == [1, 2]
    costs = read(out, "step-costs-0.6B.json")
    assert costs["compiled"] and costs["profile"] == "cuda"
    timed = load_profile_file(out / "cuda-timed.toml").reranker.qwen
    assert [list(c) for c in timed.bucket_costs] == costs["bucket_costs"]


def test_a_row_that_fails_costs_no_other_row(capsys, tmp_path, monkeypatch):
    route_compile(monkeypatch, sized_backend([]))
    out = tmp_path / "raw"
    (out / "cuda-timed.toml").mkdir(parents=True)  # the profile copy cannot be written
    code, result, err = rows(capsys, out, "--step-costs", "1")
    assert code == 1
    assert result["failed"] == ["cuda-timed.toml"]
    assert "not measured: cuda-timed.toml" in err.splitlines()[-1]
    assert "Traceback" not in err.splitlines()[-1]
    # the step times it measured are kept, and so is every other row
    assert read(out, "step-costs-tiny.json")["bucket_costs"]
    assert {"rerank-tiny.json", "rerank-tiny-6.json", "concurrent-tiny.json",
            "concurrent-tiny-compiled.json", "step-costs-tiny.json"} <= set(result["written"])


def test_without_step_costs_no_profile_is_written(capsys, tmp_path, monkeypatch):
    route_compile(monkeypatch, sized_backend([]))
    out = tmp_path / "raw"
    code, result, err = rows(capsys, out)
    assert code == 0, err
    assert not any(name.startswith(("step-costs", "cuda-")) for name in result["written"])
    assert not (out / "cuda-timed.toml").exists()


@pytest.mark.parametrize("option, value", [("--concurrent", "0"), ("--candidates", "1,x"),
                                           ("--step-costs", "-1"), ("--label", "tiny")])
def test_bad_options_are_one_clear_line(capsys, tmp_path, option, value):
    code = bot.main(["bench", "gpu-rows", "--out", str(tmp_path), "--model-size", "tiny",
                     "--device", "cpu", option, value])
    err = capsys.readouterr().err
    assert code == 2
    assert option in err and "Traceback" not in err


def test_weights_no_later_variant_runs_are_released(monkeypatch):
    # the 8B's float32 reference is 32 GB: the bfloat16 static variants (graphs, compiled)
    # must not share an 80 GB GPU with it once it is timed
    import gc

    from transformers import Qwen3ForCausalLM

    from benchmarks.rerank import BenchSettings, run_rerank_counts

    def live_dtypes() -> list[str]:
        gc.collect()
        return sorted(str(next(o.parameters()).dtype) for o in gc.get_objects()
                      if issubclass(type(o), Qwen3ForCausalLM))

    seen: dict[str, list[str]] = {}
    settings = BenchSettings(model_size="tiny", dtype="bfloat16", quick=True)
    run_rerank_counts((3,), settings, serve=lambda variant, _: seen.setdefault(
        variant.name, live_dtypes()))
    assert seen["prefix float32 bs8 (reference)"] == ["torch.bfloat16", "torch.float32"]
    assert seen["bucketed bfloat16 eager"] == ["torch.bfloat16"]
