"""``bench plan``: the static path's planner timed on the host, with a profile's buckets."""

from __future__ import annotations

import json

import pytest

from tests.cli.test_cli import error_line, run_cli


def test_times_one_a_row_and_packed_plans_for_each_case(capsys: pytest.CaptureFixture) -> None:
    code, out, err = run_cli(capsys, "--profile", "cuda", "bench", "plan", "--candidates",
                             "30,100", "--searches", "1,16", "--repeats", "2")
    assert code == 0, err
    report = json.loads(out)
    assert report["profile"] == "cuda" and report["pack"] is True
    assert report["costs"] == "bucket_costs (ms)"
    assert [(c["candidates"], c["searches"]) for c in report["cases"]] == [
        (30, 1), (30, 16), (100, 1), (100, 16)]
    for case in report["cases"]:
        single, packed = case["one_a_row"], case["packed"]
        assert single["plan_ms"] > 0 and packed["plan_ms"] > 0
        assert single["steps"] >= 1 and packed["steps"] >= 1
        # the packed way takes the one-a-row plan where packing does not pay
        assert packed["planned_cost"] <= single["planned_cost"]
    # 30 chat candidates on the profile's step times: one packed step instead of [32, 96]
    assert report["cases"][0]["packed"]["planned_cost"] < report["cases"][0]["one_a_row"][
        "planned_cost"]


def test_a_profile_without_buckets_is_one_clear_error(capsys: pytest.CaptureFixture) -> None:
    code, out, err = run_cli(capsys, "--profile", "cpu", "bench", "plan", "--repeats", "1")
    assert code == 2 and out == ""
    assert "reranker.buckets is empty" in error_line(err)
