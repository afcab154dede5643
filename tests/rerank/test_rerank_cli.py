"""The new rerankers end to end through the command line (``bot.py search``, ``bench``).

The database is a real temporary SQLite file imported from tests/fixtures/bench-mini;
the rerank API is a scripted server on 127.0.0.1 and the cross-encoder a tiny local one.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest

import bot
from benchmarks.rerank_backends import save_random_cross_encoder
from tests.support.http_stub import Request, StubServer
from tests.support.rerank import save_plain_bert

BENCH_MINI = Path(__file__).resolve().parent.parent / "fixtures" / "bench-mini"
TINY = dict(hidden_size=32, num_hidden_layers=2, num_attention_heads=2, intermediate_size=64,
            max_position_embeddings=512, num_labels=1)


def run_cli(capsys: pytest.CaptureFixture, *argv: object) -> tuple[int, str, str]:
    code = bot.main([str(a) for a in argv])
    out, err = capsys.readouterr()
    return code, out, err


@pytest.fixture
def db(tmp_path: Path, capsys: pytest.CaptureFixture) -> Path:
    path = tmp_path / "cli.sqlite3"
    code, _, err = run_cli(capsys, "--db", path, "--profile", "cpu-fast", "import", BENCH_MINI)
    assert code == 0, err
    return path


def cohere(request: Request):
    """Cohere v2's documented answer; the last document is judged the best."""
    docs = request.body["documents"]
    results = [{"index": i, "relevance_score": round((i + 1) / len(docs), 4)}
               for i in reversed(range(len(docs)))]
    return 200, {"id": "x", "results": results, "meta": {"billed_units": {"search_units": 1}}}, {}


def test_search_reranks_through_a_rerank_api_profile(db, tmp_path, capsys, monkeypatch):
    monkeypatch.setenv("COHERE_TEST_KEY", "sk-cli-test")
    with StubServer(cohere) as api:
        profile = tmp_path / "cohere.toml"
        profile.write_text(f'[reranker]\nbackend = "rerank-api"\ndialect = "cohere"\n'
                           f'url = "{api.url}"\nmodel = "rerank-v3.5"\n'
                           'api_key_env = "COHERE_TEST_KEY"\n', "utf-8")
        code, out, err = run_cli(capsys, "--db", db, "--profile", profile, "search",
                                 "who can lend me a soldering iron", "--debug")
    assert code == 0, err
    assert len(api.requests) == 1 and api.requests[0].path == "/v2/rerank"
    assert "rerank-api" in out and "sk-cli-test" not in out + err


def test_search_with_a_missing_key_keeps_the_hybrid_order_and_says_why(db, tmp_path, capsys,
                                                                       monkeypatch):
    monkeypatch.delenv("COHERE_TEST_KEY", raising=False)
    profile = tmp_path / "cohere.toml"
    profile.write_text('[reranker]\nbackend = "rerank-api"\ndialect = "cohere"\n'
                       'url = "http://127.0.0.1:9"\napi_key_env = "COHERE_TEST_KEY"\n', "utf-8")
    code, out, err = run_cli(capsys, "--db", db, "--profile", profile, "search",
                             "who can lend me a soldering iron", "--debug")
    assert code == 0, err
    assert "Hannah" in out and "Traceback" not in err
    assert "COHERE_TEST_KEY, which is not set" in out


def test_search_with_a_local_cross_encoder_profile(db, tmp_path, capsys):
    model = save_random_cross_encoder(tmp_path / "ce", TINY)
    profile = tmp_path / "small.toml"
    profile.write_text(f'[reranker]\nbackend = "cross-encoder"\nmodel = "{model}"\n', "utf-8")
    code, out, err = run_cli(capsys, "--db", db, "--profile", profile, "search",
                             "who can lend me a soldering iron", "--debug")
    assert code == 0, err
    assert "cross-encoder" in out and "skipped" not in out


def test_bench_rerank_backends_compares_on_the_same_candidates(tmp_path, capsys):
    report = tmp_path / "backends.json"
    code, _, err = run_cli(capsys, "--profile", "cpu-fast", "bench", "rerank", "--backends",
                           "cross-encoder,cross-encoder-onnx,profile", "--candidates", "4",
                           "--json", report)
    assert code == 0, err
    result = json.loads(report.read_text())
    runs = {r["name"]: r for r in result["backends"]}
    assert len(runs["cross-encoder"]["scores"]) == 4 and runs["cross-encoder"]["warm_s"] > 0
    # a backend that cannot run is reported, not fatal
    assert runs["profile"]["error"] == "ValueError: profile cpu-fast has no reranker"
    assert runs["cross-encoder-onnx"]["error"] is None
    (pair,) = result["agreement"]  # the same weights on torch and on onnxruntime
    assert pair["max_abs_diff"] <= 1e-3 and set(result["speedups"]) == {
        "cross-encoder", "cross-encoder-onnx"}


def test_export_onnx_writes_files_the_onnx_profile_reads(db, tmp_path, capsys):
    model = save_random_cross_encoder(tmp_path / "ce", TINY)
    code, out, err = run_cli(capsys, "export-onnx", model, "--int8")
    assert code == 0, err
    assert "onnx/model.onnx" in out and "onnx/model_qint8_" in out
    assert (model / "onnx" / "model.onnx").is_file()
    # the lines it prints for the profile are pasted into one as they are
    profile = tmp_path / "onnx.toml"
    profile.write_text(out[out.index("[reranker]"):], "utf-8")
    code, out, err = run_cli(capsys, "--db", db, "--profile", profile, "search",
                             "who can lend me a soldering iron", "--debug")
    assert code == 0, err
    assert "cross-encoder-onnx" in out and "skipped" not in out


def test_export_onnx_of_a_folder_without_a_model_is_one_line(tmp_path, capsys):
    code, _, err = run_cli(capsys, "export-onnx", tmp_path)
    assert code == 2
    assert err.startswith("error: ") and "not a cross-encoder folder" in err
    assert err.count("\n") == 1


def test_export_onnx_with_a_file_in_the_way_is_one_line(tmp_path, capsys):
    """A plain file named ``onnx`` where the folder goes: the cause and the path, no
    traceback."""
    model = save_random_cross_encoder(tmp_path / "ce", TINY)
    (model / "onnx").write_text("not a folder", "utf-8")
    capsys.readouterr()  # the model's save progress
    code, _, err = run_cli(capsys, "export-onnx", model)
    assert code == 2 and "Traceback" not in err
    *progress, line = err.rstrip("\n").split("\n")  # after transformers' loading bar
    assert all("Loading weights" in bar for bar in progress)
    assert line.startswith("error: exporting ")
    assert str(model / "onnx" / "model.onnx") in line and "FileExistsError" in line


def test_export_onnx_refuses_an_encoder_without_a_classifier_head(tmp_path, capsys):
    """transformers would add a random head to a plain BertModel folder, and the check
    would then compare random scores with themselves and say "use it"."""
    model = save_plain_bert(tmp_path / "plain")
    capsys.readouterr()  # the model's save progress
    code, out, err = run_cli(capsys, "export-onnx", model)
    assert code == 2 and "use it" not in out and "Traceback" not in err
    *_, line = err.rstrip("\n").split("\n")
    assert line.startswith("error: ") and "is not a cross-encoder" in line
    assert not (model / "onnx").exists()
