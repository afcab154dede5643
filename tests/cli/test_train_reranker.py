"""``bench train-reranker`` and ``bench retrieval``'s rerank columns, on the tiny bench-mini set.

The model starts from the real bundled MiniLM and trains for one short epoch on the
set's five questions: what is checked is the contract (a cross-encoder folder a
profile loads and scores with, seeded, never written into the repository), not how
well it ranks.
"""

from __future__ import annotations

import contextlib
import io
import json
from pathlib import Path

import pytest

import bot
from benchmarks.train_reranker import (
    REPO_ROOT,
    TrainingCheck,
    TrainingPair,
    TrainingSettings,
    train_cross_encoder,
)
from memory.config import load_profile
from memory.rerank.cross_encoder import CrossEncoderReranker

BENCH_MINI = Path(__file__).resolve().parents[1] / "fixtures" / "bench-mini"
PROFILE = ["--profile", "cpu-fast"]
QUERY = "who can lend me a soldering iron"
TEXTS = ["Priya: I have a soldering iron you can borrow", "Sam: the wifi password is on the fridge"]

pytestmark = [pytest.mark.slow, pytest.mark.usefixtures("single_torch_thread")]


def run_cli(capsys: pytest.CaptureFixture, *argv: object) -> tuple[int, str, str]:
    code = bot.main([str(a) for a in argv])
    out, err = capsys.readouterr()
    return code, out, err


@pytest.fixture(scope="module")
def trained(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, dict, str]:
    """One model trained by the command on bench-mini: its folder, report and stderr."""
    out = tmp_path_factory.mktemp("models") / "ce-mini"
    stdout, stderr = io.StringIO(), io.StringIO()
    with contextlib.redirect_stdout(stdout), contextlib.redirect_stderr(stderr):
        code = bot.main([*PROFILE, "bench", "train-reranker", str(BENCH_MINI), "--out", str(out),
                         "--negatives", "2", "--seed", "3", "--epochs", "6", "--lr", "3e-4"])
    assert code == 0, stderr.getvalue()
    return out, json.loads(stdout.getvalue()), stderr.getvalue()


def scores_with_profile(folder: Path) -> list[float]:
    reranker = CrossEncoderReranker(load_profile(str(folder / "profile.toml")).reranker.cross_encoder)
    try:
        return reranker.score(QUERY, TEXTS)
    finally:
        reranker.close()


def test_trains_a_cross_encoder_folder_a_profile_loads_and_scores_with(
    trained: tuple[Path, dict, str],
) -> None:
    folder, report, err = trained
    assert report["out"] == str(folder) and report["datasets"] == ["bench-mini"]
    # 5 questions, 6 evidence messages, 1-2 hard negatives each from the hybrid head and
    # 2 easy ones each (other questions' evidence)
    assert report["positives"] == 6 and 6 + 5 + 10 <= report["pairs"] <= 6 + 10 + 10
    config = json.loads((folder / "config.json").read_text(encoding="utf-8"))
    assert config["architectures"] == ["BertForSequenceClassification"]
    assert len(config["id2label"]) == 1  # one relevance logit
    profile = load_profile(str(folder / "profile.toml"))
    assert (profile.reranker.backend, profile.reranker.cross_encoder.model) == ("cross-encoder", str(folder))
    assert (profile.reranker.blend, profile.reranker.blend_weight) == (True, 0.7)
    assert (profile.reranker.oversample, profile.reranker.keep_margin) == (2, 0.2)
    scores = scores_with_profile(folder)
    assert len(scores) == 2 and all(0.0 <= s <= 1.0 for s in scores)
    assert "not allow redistributing" in err
    assert "not allow redistributing" in (folder / "NOT-FOR-REDISTRIBUTION.txt").read_text()


def test_the_report_and_training_json_say_how_the_model_separates_its_pairs(
    trained: tuple[Path, dict, str],
) -> None:
    folder, report, err = trained
    check = report["check"]
    assert check["collapsed"] is False and check["spread"] > 0.05 and check["auc"] > 0.75
    assert check["pairs"] == report["pairs"]  # bench-mini has fewer than CHECK_PAIRS
    assert json.loads((folder / "training.json").read_text())["check"] == check
    assert f"check: spread {check['spread']}" in err


def test_a_model_that_does_not_separate_its_pairs_fails_the_command(
    tmp_path: Path, capsys: pytest.CaptureFixture,
) -> None:
    """One short epoch at the default rate leaves the five-question set's model scoring
    every pair alike: the command writes it, then says so and exits 1."""
    out = tmp_path / "flat"
    code, stdout, err = run_cli(capsys, *PROFILE, "bench", "train-reranker", BENCH_MINI,
                                "--out", out, "--negatives", "2", "--seed", "3")
    assert code == 1
    assert "does not tell its own training pairs apart" in err and "another --seed" in err
    assert json.loads(stdout)["check"]["collapsed"] is True
    assert json.loads((out / "training.json").read_text())["check"]["collapsed"] is True


def test_training_check_measures_spread_and_auc() -> None:
    flat = TrainingCheck.of([0.5, 0.5, 0.5, 0.5], [1.0, 0.0, 0.0, 0.0])
    assert (flat.auc, flat.spread, flat.collapsed) == (0.5, 0.0, True)
    apart = TrainingCheck.of([0.9, 0.8, 0.1, 0.3], [1.0, 1.0, 0.0, 0.0])
    assert apart.auc == 1.0 and not apart.collapsed
    inverted = TrainingCheck.of([0.1, 0.9], [1.0, 0.0])
    assert inverted.auc == 0.0 and inverted.spread == pytest.approx(0.4) and inverted.collapsed
    assert TrainingCheck.of([0.2, 0.9], [0.0, 0.0]).auc is None  # no positive in the sample
    assert TrainingCheck.of([], []).record() == {
        "pairs": 0, "auc": None, "spread": 0.0, "collapsed": True}


def test_training_is_seeded(tmp_path: Path) -> None:
    pairs = [TrainingPair(QUERY, TEXTS[0], 1.0), TrainingPair(QUERY, TEXTS[1], 0.0)] * 4
    settings = TrainingSettings(batch_size=4, seed=5)
    first = train_cross_encoder(pairs, tmp_path / "a", settings, show_progress_bar=False)
    again = train_cross_encoder(pairs, tmp_path / "b", settings, show_progress_bar=False)
    other = train_cross_encoder(pairs, tmp_path / "c", TrainingSettings(batch_size=4, seed=6),
                                show_progress_bar=False)
    a, b, c = (_scores(folder) for folder in (first, again, other))
    assert a == pytest.approx(b, abs=1e-6)
    assert a != pytest.approx(c, abs=1e-6)  # the seed matters, so the check above can fail


def _scores(folder: Path) -> list[float]:
    from memory.config import CrossEncoderConfig

    reranker = CrossEncoderReranker(CrossEncoderConfig(model=str(folder)))
    try:
        return reranker.score(QUERY, TEXTS)
    finally:
        reranker.close()


@pytest.mark.parametrize("inside", ["models/ce1", ".", "tests/fixtures/new-model"])
def test_refuses_a_folder_inside_the_repository(
    inside: str, capsys: pytest.CaptureFixture,
) -> None:
    target = REPO_ROOT / inside
    existed = target.exists()
    code, out, err = run_cli(capsys, *PROFILE, "bench", "train-reranker", BENCH_MINI,
                             "--out", target)
    assert code == 2 and out == ""
    assert err.startswith("error: ") and "inside the repository" in err
    assert target.exists() == existed


def test_refuses_a_folder_that_is_not_empty(tmp_path: Path, capsys: pytest.CaptureFixture) -> None:
    (tmp_path / "keep.txt").write_text("mine", encoding="utf-8")
    code, _, err = run_cli(capsys, *PROFILE, "bench", "train-reranker", BENCH_MINI,
                           "--out", tmp_path)
    assert code == 2 and "not an empty folder" in err
    assert [p.name for p in tmp_path.iterdir()] == ["keep.txt"]


def test_bench_retrieval_reports_hybrid_and_rerank_side_by_side(
    trained: tuple[Path, dict, str], tmp_path: Path, capsys: pytest.CaptureFixture,
) -> None:
    folder, _, _ = trained
    cache = tmp_path / "scores.npz"
    args = ["--profile", folder / "profile.toml", "bench", "retrieval", BENCH_MINI,
            "--modes", "hybrid,rerank"]
    code, out, err = run_cli(capsys, *args)
    assert code == 0, err
    report = json.loads(out)
    assert "rerank_skipped" not in report and "rerank_cache" not in report
    modes = report["datasets"]["bench-mini"]["modes"]
    for mode in ("hybrid", "rerank"):
        assert {"recall", "recall@5", "mrr", "ndcg", "p50_ms", "p95_ms"} <= set(modes[mode])
        for category in modes[mode]["by_category"].values():
            assert {"recall", "recall@5", "mrr", "ndcg", "queries"} <= set(category)
    rerank = modes["rerank"]
    assert rerank["rerank_fallbacks"] == 0 and rerank["mean_reranked"] > 0
    assert rerank["rerank_stage_p95_ms"] >= rerank["rerank_stage_p50_ms"] > 0
    assert "rerank_fallbacks" not in modes["hybrid"]
    assert "R@5" in err and "fallbk" in err  # the side-by-side table, for people
    # the score cache gives the same ranking as the reranker itself
    code, out, err = run_cli(capsys, *args, "--rerank-cache", cache)
    assert code == 0, err
    assert cache.is_file()
    cached = json.loads(out)
    assert cached["rerank_cache"] is True
    again = cached["datasets"]["bench-mini"]["modes"]["rerank"]
    assert {k: again[k] for k in ("recall", "mrr", "ndcg")} == {
        k: rerank[k] for k in ("recall", "mrr", "ndcg")}
