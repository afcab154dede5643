"""Measured step times steer the static planner (``reranker.bucket_costs``, issue 33).

The planner's estimate (padded positions plus ``bucket_run_cost`` per run) is replaced
by each bucket's measured step time when the profile has them.  These tests check
the planner finds the cheapest plan under measured prices, that the reranker plans
with the profile's times while its scores stay those of the dynamic path, that the
profile key is checked with clear messages, and that ``bench step-costs`` times the
buckets of a tiny model on this CPU and writes a profile that keeps the original's
comments and loads with the times.  Nothing here asserts a timing.
"""

from __future__ import annotations

import json
import math
import random
import tomllib

import pytest

import bot
from benchmarks.step_costs import model_size_of
from memory.config import ConfigError, load_profile_file
from memory.config.profile import parse_profile
from memory.rerank.qwen_static import Run, plan_runs
from tests.rerank.test_reranker_qwen import DOCS, QUERY
from tests.rerank.test_reranker_static import FP32_TOL
from tests.support.qwen_tiny import wrap

pytestmark = pytest.mark.usefixtures("single_torch_thread")


# -- the planner ---------------------------------------------------------------------


@pytest.mark.parametrize(
    "measured, runs",
    [
        # ten tails of 9: by positions two [8, 16] runs (256) beat one [32, 16] (512)
        pytest.param(None, [Run((8, 16), list(range(8))), Run((8, 16), [8, 9])], id="estimate"),
        pytest.param({(8, 16): 5.0, (32, 16): 6.0}, [Run((32, 16), list(range(10)))],
                     id="launch-bound: one big step"),
        pytest.param({(8, 16): 1.0, (32, 16): 6.0},
                     [Run((8, 16), list(range(8))), Run((8, 16), [8, 9])],
                     id="compute-bound: two small steps"),
    ],
)
def test_measured_times_choose_the_plan(measured, runs):
    assert plan_runs([9] * 10, [(8, 16), (32, 16)], 0, measured) == (runs, [])


def cheapest(lengths: list[int], price: dict) -> float:
    """Every cut of the sorted tails into consecutive runs, every shape for each run."""
    ordered = sorted(lengths)

    def best(start: int) -> float:
        if start == len(ordered):
            return 0.0
        return min((cost + best(end)
                    for end in range(start + 1, len(ordered) + 1)
                    for (batch, length), cost in price.items()
                    if end - start <= batch and ordered[end - 1] <= length), default=math.inf)

    return best(0)


@pytest.mark.parametrize("seed", range(25))
def test_plan_runs_finds_the_fastest_plan_under_measured_times(seed):
    rng = random.Random(seed)
    lengths = [rng.randint(1, 70) for _ in range(rng.randint(1, 9))]
    shapes = sorted({(rng.randint(1, 5), rng.choice([8, 16, 32, 64, 80])) for _ in range(3)},
                    key=lambda s: (s[1], s[0]))
    price = {shape: round(rng.uniform(0.1, 20.0), 3) for shape in shapes}
    runs, overflow = plan_runs(lengths, shapes, 0, price)
    fitting = [n for n in lengths if n <= max(length for _, length in shapes)]
    assert len(overflow) == len(lengths) - len(fitting)
    assert sum(price[run.shape] for run in runs) == pytest.approx(cheapest(fitting, price))


# -- the reranker ----------------------------------------------------------------------


BUCKETS = ((4, 16), (8, 32), (2, 64))


def test_the_reranker_plans_with_the_profiles_times_and_keeps_its_scores(parts, config):
    docs = DOCS * 3
    dynamic = wrap(parts, config, batch_size=8).score(QUERY, docs)
    # a machine where the wide step costs next to nothing and the narrow ones a lot
    costs = ((4, 16, 9.0), (8, 32, 9.0), (2, 64, 0.5))
    timed = wrap(parts, config, buckets=BUCKETS, bucket_costs=costs)
    estimated = wrap(parts, config, buckets=BUCKETS)
    assert timed._static is not None and estimated._static is not None
    assert timed._static.measured == {(b, n): ms for b, n, ms in costs}
    assert estimated._static.measured is None
    for reranker in (timed, estimated):
        scores = reranker.score(QUERY, docs)
        assert max(abs(a - b) for a, b in zip(scores, dynamic, strict=True)) < FP32_TOL
    lengths = [len(t) for t in timed.encode(QUERY, docs).tails]
    for reranker, measured in ((timed, timed._static.measured), (estimated, None)):
        runs, _ = plan_runs(lengths, BUCKETS, config.bucket_run_cost, measured)
        assert reranker._static.stats.tail_steps == len(runs)
        assert reranker._static.stats.tail_positions == sum(r.shape[0] * r.shape[1] for r in runs)
    assert timed._static.stats.tail_positions != estimated._static.stats.tail_positions


# -- the profile key -------------------------------------------------------------------


def profile_with(costs: object, buckets: object = ([4, 16], [8, 32])) -> dict:
    return {"reranker": {"backend": "transformers", "buckets": list(buckets),
                         "bucket_costs": costs}}


def test_bucket_costs_load_as_measured_times():
    profile = parse_profile("p", profile_with([[8, 32, 2], [4, 16, 1.25]]), "p.toml")
    assert profile.reranker.qwen.bucket_costs == ((4, 16, 1.25), (8, 32, 2.0))
    assert profile.reranker.with_keys(bucket_costs=()).qwen.bucket_costs == ()


@pytest.mark.parametrize(
    "costs, buckets, message",
    [
        ([[4, 16, 1.0]], ([4, 16], [8, 32]), "bucket_costs has no time for [8, 32]"),
        ([[4, 16, 1.0], [8, 32, 1.0], [2, 8, 1.0]], ([4, 16], [8, 32]),
         "times [2, 8], which is not in reranker.buckets"),
        ([[4, 16, 1.0]], (), "times [4, 16], which is not in reranker.buckets"),
        ([[4, 16, 0], [8, 32, 1.0]], ([4, 16], [8, 32]), "positive milliseconds"),
        ([[4, 16, -2.0], [8, 32, 1.0]], ([4, 16], [8, 32]), "positive milliseconds"),
        ([[4, 16, "fast"], [8, 32, 1.0]], ([4, 16], [8, 32]), "got 'fast' for [4, 16]"),
        ([[4, 16, True], [8, 32, 1.0]], ([4, 16], [8, 32]), "positive milliseconds"),
        ([[4, 16, math.inf], [8, 32, 1.0]], ([4, 16], [8, 32]), "positive milliseconds"),
        ([[4, 16]], ([4, 16],), "list of [batch, length, milliseconds]"),
        ("fast", ([4, 16],), "list of [batch, length, milliseconds]"),
        ([[4, 16, 1.0], [4, 16, 2.0]], ([4, 16],), "lists the same shape twice"),
    ],
)
def test_bad_bucket_costs_are_one_clear_error(costs, buckets, message):
    with pytest.raises(ConfigError, match="reranker.bucket_costs") as caught:
        parse_profile("p", profile_with(costs, buckets), "p.toml")
    assert message in str(caught.value)
    assert str(caught.value).startswith("p.toml: ")


@pytest.mark.parametrize(
    "model, size",
    [("Qwen/Qwen3-Reranker-0.6B", "0.6B"), ("Qwen/Qwen3-Reranker-8B", "8B"),
     ("/models/qwen3-reranker-4b", "4B"), ("/srv/Qwen3-Reranker-0.6b/", "0.6B")],
)
def test_the_model_size_comes_from_the_model_name(model, size):
    assert model_size_of(model) == size


def test_a_model_name_without_a_size_asks_for_one():
    with pytest.raises(ConfigError, match="--model-size"):
        model_size_of("/models/my-reranker")


# -- bench step-costs ------------------------------------------------------------------


PROFILE = """\
# my CPU box: a few buckets
[embedder]
device = "cpu"

[reranker]
backend = "transformers"
model = "/models/my-reranker"
device = "cpu"
dtype = "float32"
# chat messages are short
buckets = [[4, 48], [16, 48], [4, 128]]
bucket_run_cost = 64  # an old guess
"""


def test_bench_step_costs_times_every_bucket_and_writes_a_profile(tmp_path, capsys, cuda_forbidden):
    source, written, report = tmp_path / "box.toml", tmp_path / "box-timed.toml", tmp_path / "r.json"
    source.write_text(PROFILE, encoding="utf-8")
    code = bot.main(["--profile", str(source), "bench", "step-costs", "--model-size", "tiny",
                     "--repeats", "1", "--write-profile", str(written), "--json", str(report)])
    err = capsys.readouterr().err
    assert code == 0, err
    result = json.loads(report.read_text(encoding="utf-8"))
    assert [(s["batch"], s["length"]) for s in result["steps"]] == [(4, 48), (16, 48), (4, 128)]
    assert all(s["ms"] >= 0 and s["positions"] == s["batch"] * s["length"] for s in result["steps"])
    assert [p["candidates"] for p in result["plans"]] == [30, 100]
    for plan in result["plans"]:
        for name in ("estimate", "measured", "packed"):
            # every candidate placed: chat tails fit the buckets
            assert sum(run[2] for run in plan[name]["runs"]) == plan["candidates"]
        # the measured plan is the cheapest one a row under the measured times, packing
        # (only where it is cheaper) cheaper still or the same plan
        assert plan["measured"]["predicted_ms"] <= plan["estimate"]["predicted_ms"]
        assert plan["packed"]["predicted_ms"] <= plan["measured"]["predicted_ms"]
        assert not plan["measured"]["packed"] and plan["packed_speedup"] > 0
    # the copy keeps the original, comments and all, and adds the times
    text = written.read_text(encoding="utf-8")
    assert text.startswith(PROFILE.rstrip("\n"))
    assert "measured by `bench step-costs`" in text
    loaded = load_profile_file(written).reranker.qwen
    assert [list(c) for c in loaded.bucket_costs] == result["bucket_costs"]
    assert {(b, n) for b, n, _ in loaded.bucket_costs} == set(loaded.buckets)
    assert tomllib.loads(source.read_text(encoding="utf-8")) == tomllib.loads(PROFILE)


def test_measuring_again_replaces_the_times(tmp_path, capsys):
    source = tmp_path / "box.toml"
    source.write_text(PROFILE.replace("[4, 128]]", "[4, 128]]\nbucket_costs = [[4, 48, 1], "
                                      "[16, 48, 2], [4, 128, 3]]"), encoding="utf-8")
    code = bot.main(["--profile", str(source), "bench", "step-costs", "--model-size", "tiny",
                     "--repeats", "1", "--write-profile", str(source)])
    assert code == 0, capsys.readouterr().err
    text = source.read_text(encoding="utf-8")
    assert text.count("bucket_costs") == 1 and "[4, 48, 1]" not in text
    assert len(load_profile_file(source).reranker.qwen.bucket_costs) == 3


@pytest.mark.parametrize(
    "profile, extra, message",
    [
        ("cpu", [], "times the static-shape buckets of a transformers reranker"),
        ("box", [], "cannot tell the Qwen3-Reranker size"),
        ("box", ["--model-size", "huge"], "Invalid value for '--model-size'"),
    ],
)
def test_bench_step_costs_refuses_clearly(tmp_path, capsys, profile, extra, message):
    if profile == "box":
        (tmp_path / "box.toml").write_text(PROFILE, encoding="utf-8")
        profile = str(tmp_path / "box.toml")
    code = bot.main(["--profile", profile, "bench", "step-costs", *extra])
    err = capsys.readouterr().err
    assert code != 0
    assert message in err and "Traceback" not in err


def test_set_gives_a_profile_measured_times_for_one_run():
    from benchmarks.retrieval import with_settings
    from memory.config import load_profile

    cuda = load_profile("cuda").reranker.qwen
    times = [[b, n, float(b * n) / 1000] for b, n in cuda.buckets]
    profile = with_settings(load_profile("cuda"), [f"reranker.bucket_costs={times}"])
    assert [list(c) for c in profile.reranker.qwen.bucket_costs] == times
    # and a later --set on a profile that has them keeps them
    again = with_settings(profile, ["reranker.blend=false"])
    assert again.reranker.qwen.bucket_costs == profile.reranker.qwen.bucket_costs


def test_a_profile_copy_that_would_not_load_is_never_written(tmp_path):
    # the copy is checked before it takes its name: a bucket the profile does not have
    # is refused, and neither the copy nor a half-written file is left behind
    from benchmarks.step_costs import write_profile

    source = tmp_path / "gpu.toml"
    source.write_text('[reranker]\nbackend = "transformers"\nbuckets = [[4, 48]]\n',
                      encoding="utf-8")
    out = tmp_path / "gpu-timed.toml"
    with pytest.raises(ConfigError, match="bucket_costs"):
        write_profile(source, out, [[8, 96, 1.0]], "measured here")
    assert sorted(p.name for p in tmp_path.iterdir()) == ["gpu.toml"]
    write_profile(source, out, [[4, 48, 1.5]], "measured here")
    assert load_profile_file(out).reranker.qwen.bucket_costs == ((4, 48, 1.5),)
