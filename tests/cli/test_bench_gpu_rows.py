"""`bench gpu-rows`: one model size's GPU rows from one process (issue 33), checked on this CPU.

The GPU run cannot happen here; the tiny model runs the same steps on the CPU (the
slow smoke test of scripts/gpu-bench.sh runs it with inductor).  A recording backend
stands in for inductor here: what matters is which steps each row timed, and that each
variant was loaded once for every row it serves.  Nothing here measures speed.
"""

from __future__ import annotations

import json

import pytest

import benchmarks.rerank as rerank_bench
import bot
from benchmarks import gpu_rows
from benchmarks.gpu_rows import served_rows
from benchmarks.rerank import _profile_static, _variants
from benchmarks.rerank_concurrent import measure_levels
from memory.config import load_profile, load_profile_file
from memory.rerank.qwen import QwenReranker
from memory.rerank.qwen_static import StaticScorer
from tests.rerank.test_reranker_compiled import failing_backend, route_compile, sized_backend

pytestmark = pytest.mark.usefixtures("single_torch_thread", "cuda_forbidden", "fresh_dynamo")

ARGS = ["--model-size", "tiny", "--device", "cpu", "--candidates", "30,6", "--concurrent", "1,2",
        "--repeats", "1", "--rounds", "1", "--compile-budget", "120"]


def rows(capsys, out, *extra: str) -> tuple[int, dict, str]:
    code = bot.main(["bench", "gpu-rows", "--out", str(out), *ARGS, *extra])
    captured = capsys.readouterr()
    return code, json.loads(captured.out) if code in (0, 1) else {}, captured.err


def read(out, name: str) -> dict:
    return json.loads((out / name).read_text(encoding="utf-8"))


def tracked_rerankers(monkeypatch) -> tuple[list[QwenReranker], list[QwenReranker]]:
    """Every reranker ``from_model`` makes and every ``close`` call, objects kept alive."""
    made: list[QwenReranker] = []
    closed: list[QwenReranker] = []
    real_make, real_close = QwenReranker.from_model.__func__, QwenReranker.close

    def from_model(cls, model, tokenizer, config=None):
        made.append(real_make(cls, model, tokenizer, config))
        return made[-1]

    def close(self):
        closed.append(self)
        return real_close(self)

    monkeypatch.setattr(QwenReranker, "from_model", classmethod(from_model))
    monkeypatch.setattr(QwenReranker, "close", close)
    return made, closed


def test_every_row_of_a_size_from_one_load_per_variant(capsys, tmp_path, monkeypatch):
    graphs: list[int] = []
    route_compile(monkeypatch, sized_backend(graphs))
    made, _ = tracked_rerankers(monkeypatch)
    planned_by: list[bool] = []  # whether each plan minimised measured step times
    packed_by: list[bool] = []  # and whether it packed
    real_plan = StaticScorer.plan

    def plan(self, lengths, owners=None):
        planned_by.append(bool(self.measured))
        packed_by.append(self.pack)
        return real_plan(self, lengths, owners)

    monkeypatch.setattr(StaticScorer, "plan", plan)
    out = tmp_path / "raw"
    code, result, err = rows(capsys, out, "--step-costs", "1", "--label", "0.6B")
    assert code == 0, err
    assert result["failed"] == []
    assert sorted(result["written"]) == sorted([
        "rerank-0.6B.json", "rerank-0.6B-6.json", "concurrent-0.6B.json",
        "concurrent-0.6B-compiled.json", "step-costs-0.6B.json", "cuda-timed.toml",
        "concurrent-0.6B-timed.json", "concurrent-0.6B-packed.json"])
    assert sorted(p.name for p in out.iterdir()) == sorted(result["written"])  # no leftovers
    first, second = read(out, "rerank-0.6B.json"), read(out, "rerank-0.6B-6.json")
    assert (first["candidates"], second["candidates"]) == (30, 6)
    names = [v["name"] for v in first["variants"]]
    assert names == [v["name"] for v in second["variants"]]
    # the CPU smoke run compiles too, then plans the compiled steps packed
    assert names[-2:] == ["bucketed bfloat16 compiled", "packed bfloat16 compiled"]
    assert first["variants"][-2]["compiled"] and graphs
    assert first["variants"][-1]["compiled"] and first["variants"][-1]["packed"]
    assert [v["concurrent"] for v in first["variants"]] == [1, 1, 16, 16, 16]  # as the bot runs
    # each variant loaded (and compiled) once, though it served two counts and, compiled,
    # three concurrent rows and the step costs; the compiled variant compiled on the eager
    # one's reranker, as a bot with torch_compile compiles after its eager steps serve, and
    # the packed one planned on the compiled one's
    static = [r.config for r in made if r.config.buckets]
    assert [c.torch_compile for c in static] == [False]
    eager, compiled = read(out, "concurrent-0.6B.json"), read(out, "concurrent-0.6B-compiled.json")
    timed = read(out, "concurrent-0.6B-timed.json")
    packed = read(out, "concurrent-0.6B-packed.json")
    assert packed["compiled"] and packed["measured_step_times"] and packed["packed"]
    assert not any(r["packed"] for r in (eager, compiled, timed))
    assert (eager["torch_compile"], eager["compiled"]) == (False, False)
    assert (compiled["torch_compile"], compiled["compiled"]) == (True, True)
    assert timed["compiled"] and timed["measured_step_times"]
    assert not eager["measured_step_times"] and not compiled["measured_step_times"]
    # the timed row's searches were planned with the measured times, every unpacked search
    # before them with the estimate; the packed row's (the last ones run) packed on them
    unpacked = [m for m, p in zip(planned_by, packed_by, strict=True) if not p]
    assert unpacked[-1] and not unpacked[0] and unpacked == sorted(unpacked)
    assert packed_by[-1] and planned_by[-1] and packed_by == sorted(packed_by)
    for report in (eager, compiled, timed, packed):
        assert report["concurrent_setting"] == load_profile("cuda").reranker.qwen.concurrent
        assert report["candidates"] == 30 and report["dtype"] == "bfloat16"
        assert [level["searches"] for level in report["levels"]] == [1, 2]
    costs = read(out, "step-costs-0.6B.json")
    assert costs["compiled"] and costs["profile"] == "cuda"
    profile = load_profile_file(out / "cuda-timed.toml").reranker.qwen
    assert [list(c) for c in profile.bucket_costs] == costs["bucket_costs"]


@pytest.mark.parametrize("name, device, row", [
    ("bucketed bfloat16 eager", "cuda", None),  # the bot replays graphs on CUDA
    ("bucketed bfloat16 graphs", "cuda", "eager"),
    ("bucketed bfloat16 compiled graphs", "cuda", "compiled"),
    ("bucketed bfloat16 eager", "cpu", "eager"),
    ("bucketed bfloat16 compiled", "cpu", "compiled"),
    ("packed bfloat16 compiled graphs", "cuda", "compiled"),  # packed: served as such
    ("bucketed bfloat16 eager", "mps", "eager"),
    ("prefix bfloat16 bs32", "cuda", None),
])
def test_which_variant_serves_which_concurrent_row(name, device, row):
    plan = {v.name: v for v in _variants(device, "bfloat16", _profile_static("0.6B"), quick=True,
                                         compile_on_cpu=True)}
    assert served_rows(plan[name], device) == row


def test_a_row_that_fails_costs_no_other_row(capsys, caplog, tmp_path, monkeypatch):
    route_compile(monkeypatch, sized_backend([]))
    calls: list[int] = []

    def fails_first(*args, **kwargs):  # the eager row's levels break; the rest must not
        calls.append(1)
        if len(calls) == 1:
            raise RuntimeError("CUDA error: an illegal memory access was encountered")
        return measure_levels(*args, **kwargs)

    monkeypatch.setattr(gpu_rows, "measure_levels", fails_first)
    out = tmp_path / "raw"
    code, result, err = rows(capsys, out, "--step-costs", "1")
    assert code == 1
    assert result["failed"] == ["concurrent-tiny.json"]
    assert err.splitlines()[-1].startswith("not measured: concurrent-tiny.json")
    logged = [r for r in caplog.records if "concurrent-tiny.json not measured" in r.getMessage()]
    assert logged and "illegal memory access" in str(logged[0].exc_info[1])  # with its traceback
    assert {"rerank-tiny.json", "rerank-tiny-6.json", "concurrent-tiny-compiled.json",
            "step-costs-tiny.json", "concurrent-tiny-timed.json"} <= set(result["written"])


def test_a_row_that_cannot_be_written_keeps_its_variants_timings(capsys, tmp_path, monkeypatch):
    route_compile(monkeypatch, sized_backend([]))
    out = tmp_path / "raw"
    (out / "concurrent-tiny.json").mkdir(parents=True)  # measured, but cannot be written
    code, result, _ = rows(capsys, out)
    assert code == 1
    assert result["failed"] == ["concurrent-tiny.json"]
    for name in ("rerank-tiny.json", "rerank-tiny-6.json"):  # the variant's timings stand
        assert "bucketed bfloat16 eager" in [v["name"] for v in read(out, name)["variants"]]
    assert not list(out.glob(".*.partial*"))  # nothing half-written left to pack


def test_the_step_times_are_kept_when_the_profile_cannot_be_written(capsys, tmp_path,
                                                                    monkeypatch):
    route_compile(monkeypatch, sized_backend([]))
    out = tmp_path / "raw"
    (out / "cuda-timed.toml").mkdir(parents=True)  # the profile copy cannot be written
    code, result, err = rows(capsys, out, "--step-costs", "1")
    assert code == 1
    assert result["failed"] == ["cuda-timed.toml"]
    assert err.splitlines()[-1].startswith("not measured: cuda-timed.toml")
    assert read(out, "step-costs-tiny.json")["bucket_costs"]
    assert read(out, "concurrent-tiny-timed.json")["measured_step_times"]


def test_a_variant_that_fails_costs_no_other_variant(capsys, tmp_path, monkeypatch):
    route_compile(monkeypatch, sized_backend([]))
    real = rerank_bench._time_scoring

    def eager_fails(reranker, docs, repeats, device="cpu"):
        if reranker.config.buckets and not reranker.config.torch_compile:
            raise RuntimeError("CUDA out of memory")
        return real(reranker, docs, repeats, device)

    monkeypatch.setattr(rerank_bench, "_time_scoring", eager_fails)
    out = tmp_path / "raw"
    code, result, err = rows(capsys, out)
    assert code == 1
    assert result["failed"] == ["bucketed bfloat16 eager"]
    assert err.splitlines()[-1].startswith("not measured: bucketed bfloat16 eager")
    for name in ("rerank-tiny.json", "rerank-tiny-6.json"):
        assert [v["name"] for v in read(out, name)["variants"]] == [
            "prefix float32 bs8 (reference)", "prefix bfloat16 bs8", "bucketed bfloat16 compiled",
            "packed bfloat16 compiled"]
    assert read(out, "concurrent-tiny-compiled.json")["compiled"]


def test_the_reference_is_timed_once_and_the_others_as_asked(capsys, tmp_path, monkeypatch):
    route_compile(monkeypatch, sized_backend([]))
    timed: list[int] = []
    real = rerank_bench._time_scoring

    def recorded(reranker, docs, repeats, device="cpu"):
        timed.append(repeats)
        return real(reranker, docs, repeats, device)

    monkeypatch.setattr(rerank_bench, "_time_scoring", recorded)
    code, _, err = rows(capsys, tmp_path / "raw", "--repeats", "3")
    assert code == 0, err
    # two counts a variant: the reference (the CPU's is the float32 prefix path at batch 8)
    # once each, the bf16 prefix, eager, compiled and packed variants three times each
    assert timed == [1, 1] + [3] * 8
    timed.clear()
    code, _, err = rows(capsys, tmp_path / "again", "--repeats", "3", "--reference-repeats", "2")
    assert code == 0, err
    assert timed[:2] == [2, 2]


def test_a_compile_that_fails_on_the_eager_reranker_leaves_its_steps_timed(
        capsys, caplog, tmp_path, monkeypatch):
    route_compile(monkeypatch, failing_backend)
    made, closed = tracked_rerankers(monkeypatch)
    out = tmp_path / "raw"
    code, result, err = rows(capsys, out)
    assert result["failed"] == []
    assert code == 0, err  # timed: the compiled variant is the eager steps it kept
    variant = read(out, "rerank-tiny.json")["variants"][-2]
    assert variant["name"] == "bucketed bfloat16 compiled" and not variant["compiled"]
    report = read(out, "concurrent-tiny-compiled.json")
    assert (report["torch_compile"], report["compiled"]) == (True, False)
    assert any("torch.compile of the static steps failed" in r.getMessage()
               for r in caplog.records)
    # every reranker closed exactly once, the one both static variants shared included
    assert [sum(c is r for c in closed) for r in made] == [1] * len(made)
    assert sum(bool(r.config.buckets) for r in made) == 1


def test_without_step_costs_no_profile_is_written(capsys, tmp_path, monkeypatch):
    route_compile(monkeypatch, sized_backend([]))
    out = tmp_path / "raw"
    code, result, err = rows(capsys, out)
    assert code == 0, err
    assert not any(name.startswith(("step-costs", "cuda-")) or name.endswith("-timed.json")
                   for name in result["written"])


@pytest.mark.parametrize("option, value", [("--concurrent", "0"), ("--candidates", "1,x"),
                                           ("--candidates", "30,30"),
                                           ("--step-costs", "-1"), ("--label", "tiny"),
                                           ("--dtype", "int4")])
def test_bad_options_are_one_clear_line(capsys, tmp_path, option, value):
    code = bot.main(["bench", "gpu-rows", "--out", str(tmp_path), "--model-size", "tiny",
                     "--device", "cpu", option, value])
    err = capsys.readouterr().err
    assert code == 2
    assert option in err and "Traceback" not in err


def test_weights_no_later_variant_runs_are_released(monkeypatch):
    # the 8B's float32 reference is 32 GB: the bfloat16 static variants (graphs, compiled)
    # must not share an 80 GB GPU with it once it is timed -- without waiting for a
    # garbage collection (nothing else may keep it alive)
    import weakref

    built: dict[str, weakref.ref] = {}
    real_build = rerank_bench._build_models

    def build_and_watch(*args, **kwargs):
        models = real_build(*args, **kwargs)
        built.update({kind: weakref.ref(model) for kind, model in models.items()})
        return models

    monkeypatch.setattr(rerank_bench, "_build_models", build_and_watch)
    alive: dict[str, list[str]] = {}
    settings = rerank_bench.BenchSettings(model_size="tiny", dtype="bfloat16", quick=True)
    rerank_bench.run_rerank_counts((3,), settings, serve=lambda variant, _: alive.setdefault(
        variant.name, sorted(kind for kind, ref in built.items() if ref() is not None)))
    assert alive["prefix float32 bs8 (reference)"] == ["bfloat16", "float32", "int8"]
    assert alive["bucketed bfloat16 eager"] == ["bfloat16"]  # float32 (and int8, the same) gone


SMOKE = rerank_bench.BenchSettings(device="cpu", dtype="bfloat16", model_size="tiny", quick=True,
                                   compile_budget=120, compile_on_cpu=True)


def test_a_serve_that_raises_leaves_no_reranker_open(monkeypatch):
    route_compile(monkeypatch, sized_backend([]))
    made, closed = tracked_rerankers(monkeypatch)

    def serve(variant, reranker):
        if variant.buckets:  # the eager twin the compiled variant would compile on
            raise OSError("No space left on device")

    with pytest.raises(OSError, match="No space left"):
        rerank_bench.run_rerank_counts((6,), SMOKE, serve=serve)
    assert [sum(c is r for c in closed) for r in made] == [1] * len(made)


def test_a_twin_whose_static_path_was_dropped_is_not_compiled_on(monkeypatch):
    route_compile(monkeypatch, sized_backend([]))
    made, closed = tracked_rerankers(monkeypatch)
    real_together = StaticScorer.score_together

    def serve(variant, reranker):  # a static step fails while the twin serves
        if variant.buckets and not variant.torch_compile:
            monkeypatch.setattr(StaticScorer, "score_together", broken)
            reranker.score("what did we plan?", ["a picnic", "the zoo"])
            monkeypatch.setattr(StaticScorer, "score_together", real_together)
            assert reranker.static_scorer is None  # the bot scores dynamically from now on

    def broken(self, searches):
        raise RuntimeError("CUDA error: an illegal memory access was encountered")

    report, = rerank_bench.run_rerank_counts((6,), SMOKE, serve=serve)
    compiled = report["variants"][-2]
    assert compiled["name"] == "bucketed bfloat16 compiled" and compiled["compiled"]
    # loaded anew, with the compile asked for: not the twin's dynamic path timed as compiled
    assert [r.config.torch_compile for r in made if r.config.buckets] == [False, True]
    assert [sum(c is r for c in closed) for r in made] == [1] * len(made)
