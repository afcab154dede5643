"""`bench rerank --concurrent`: many searches reranking at once on one reranker (issue 33).

Nothing here measures speed; the run is checked end to end on this CPU with the tiny
model: every level runs its searches and reports rate and latency, and bad levels
are one clear line.
"""

from __future__ import annotations

import json

import pytest

import bot
from memory.config import load_profile
from tests.rerank.test_reranker_compiled import route_compile, sized_backend

pytestmark = pytest.mark.usefixtures("single_torch_thread")


def test_concurrent_levels_report_rate_and_latency(capsys, tmp_path, cuda_forbidden):
    out = tmp_path / "concurrent.json"
    code = bot.main(["bench", "rerank", "--model-size", "tiny", "--concurrent", "1,3",
                     "--candidates", "5", "--repeats", "2", "--json", str(out)])
    assert code == 0, capsys.readouterr().err
    result = json.loads(out.read_text(encoding="utf-8"))
    assert (result["device"], result["dtype"], result["candidates"]) == ("cpu", "float32", 5)
    assert not result["graphs_live"]  # no CUDA here
    assert result["concurrent_setting"] == 16  # the cuda profile groups searches
    levels = {level["concurrent"]: level for level in result["levels"]}
    assert list(levels) == [1, 3]
    assert [levels[n]["searches"] for n in (1, 3)] == [2, 6]  # every thread's every search
    for level in levels.values():
        assert level["searches_per_s"] > 0 and level["p95_ms"] >= level["p50_ms"] > 0
    assert levels[1]["speedup"] == 1.0
    assert not result["measured_step_times"]  # the shipped cuda profile's estimate
    assert [tuple(b) for b in result["buckets"]] == list(load_profile("cuda").reranker.qwen.buckets)


def test_a_profiles_buckets_and_measured_times_are_the_ones_run(capsys, tmp_path, cuda_forbidden):
    # what scripts/gpu-bench.sh does with the profile `bench step-costs` wrote
    profile = tmp_path / "timed.toml"
    profile.write_text('[reranker]\nbackend = "transformers"\nbuckets = [[4, 48], [16, 48], '
                       '[4, 128]]\nbucket_costs = [[4, 48, 1.0], [16, 48, 1.5], [4, 128, 2.0]]\n'
                       "concurrent = 4\n", encoding="utf-8")
    out = tmp_path / "concurrent.json"
    code = bot.main(["--profile", str(profile), "bench", "rerank", "--model-size", "tiny",
                     "--concurrent", "1,2", "--candidates", "5", "--repeats", "1",
                     "--json", str(out)])
    assert code == 0, capsys.readouterr().err
    result = json.loads(out.read_text(encoding="utf-8"))
    assert result["buckets"] == [[4, 48], [16, 48], [4, 128]]
    assert result["measured_step_times"] and result["concurrent_setting"] == 4
    assert [level["searches"] for level in result["levels"]] == [1, 2]
    assert all(level["executed"]["tail_steps"] > 0 for level in result["levels"])


@pytest.mark.parametrize("asked", [True, False])
def test_compiled_times_the_compiled_steps(capsys, tmp_path, monkeypatch, cuda_forbidden,
                                           fresh_dynamo, asked):
    # a recording backend stands in for inductor (whose real compile the slow smoke run
    # of scripts/gpu-bench.sh does): what matters is that the levels ran compiled steps
    graphs: list[int] = []
    route_compile(monkeypatch, sized_backend(graphs))
    out = tmp_path / "concurrent.json"
    code = bot.main(["bench", "rerank", "--model-size", "tiny", "--concurrent", "1,2",
                     "--candidates", "5", "--repeats", "1", "--json", str(out),
                     *(["--compiled", "--compile-budget", "120"] if asked else [])])
    assert code == 0, capsys.readouterr().err
    result = json.loads(out.read_text(encoding="utf-8"))
    assert result["torch_compile"] is asked and result["compiled"] is asked
    assert bool(graphs) is asked
    assert [level["searches"] for level in result["levels"]] == [1, 2]


@pytest.mark.parametrize("value", ["0", "abc", ",", "1,-4", "2000"])
def test_bad_levels_are_one_clear_line(capsys, value):
    code = bot.main(["bench", "rerank", "--model-size", "tiny", "--concurrent", value])
    err = capsys.readouterr().err
    assert code == 2
    assert "--concurrent" in err and "Traceback" not in err


@pytest.mark.parametrize("flag", ["--compiled", "--one-at-a-time"])
def test_a_concurrent_only_flag_without_concurrent_is_one_clear_line(capsys, flag):
    code = bot.main(["bench", "rerank", "--model-size", "tiny", flag])
    err = capsys.readouterr().err
    assert code == 2
    assert err.strip() == "error: --compiled and --one-at-a-time go with --concurrent N,..."
