"""The command line: every command has help text and runs against a temporary database;
engine errors are one line on stderr and exit status 2.

The end-to-end commands use ``--profile cpu-fast``: the real bundled MiniLM and no
reranker.  Each CLI call builds its own engine, so the number of calls that embed is
kept small (after the first, loading the model again takes a fraction of a second).
"""

from __future__ import annotations

import argparse
import json
import re
import shutil
from pathlib import Path

import pytest

import bot
from memory.embedder import BUNDLED_MODEL_ID

FIXTURES = Path(__file__).resolve().parent / "fixtures"
BENCH_MINI = FIXTURES / "bench-mini"  # 3 files, 11 messages (1 system), 5 labelled queries
MINI_GUILD = 930000000000000001
PROFILE = ["--profile", "cpu-fast"]

pytestmark = pytest.mark.usefixtures("single_torch_thread")

COMMANDS = [
    [], ["import"], ["search"], ["stats"], ["embed"], ["reembed"], ["demo"], ["run"],
    ["bench"], ["bench", "retrieval"], ["bench", "search-scale"], ["bench", "rerank"],
]


def run_cli(capsys: pytest.CaptureFixture, *argv: str) -> tuple[int, str, str]:
    code = bot.main([str(a) for a in argv])
    out, err = capsys.readouterr()
    return code, out, err


def error_line(err: str) -> str:
    """The one line a failing command must print (progress bars aside)."""
    lines = [line for line in err.splitlines() if line.strip()]
    assert len(lines) == 1, err
    assert lines[0].startswith("error: ")
    return lines[0]


# -- help ------------------------------------------------------------------------------


@pytest.mark.parametrize("command", COMMANDS, ids=lambda c: " ".join(c) or "bot.py")
def test_every_command_prints_help(capsys: pytest.CaptureFixture, command: list[str]) -> None:
    parser = bot.build_parser()
    with pytest.raises(SystemExit) as excinfo:
        parser.parse_args([*command, "--help"])
    assert excinfo.value.code == 0
    out = capsys.readouterr().out
    assert out.startswith("usage: bot.py")
    assert len(out.splitlines()) > 3


def _subcommands(parser: argparse.ArgumentParser, prefix: tuple[str, ...] = ()):
    for action in parser._actions:
        if isinstance(action, argparse._SubParsersAction):
            helps = {a.dest: a.help for a in action._choices_actions}
            for name, sub in action.choices.items():
                yield (*prefix, name), helps.get(name), sub
                yield from _subcommands(sub, (*prefix, name))


def test_every_command_has_help_text() -> None:
    found = list(_subcommands(bot.build_parser()))
    names = {" ".join(path) for path, _, _ in found}
    assert {" ".join(c) for c in COMMANDS if c} == names  # the table above is complete
    for path, text, _ in found:
        assert text, f"{' '.join(path)} has no help text"


def test_every_option_has_help_text() -> None:
    missing = [
        f"{' '.join(path)} {action.option_strings[0]}"
        for path, _, sub in _subcommands(bot.build_parser())
        for action in sub._actions
        if action.option_strings and action.dest != "help" and not action.help
    ]
    assert missing == []


# -- end to end against a temporary database ----------------------------------------------


def test_import_search_stats_embed_reembed(
    tmp_path: Path, capsys: pytest.CaptureFixture
) -> None:
    db = tmp_path / "cli.sqlite3"
    base = ["--db", db, *PROFILE]

    code, out, err = run_cli(capsys, *base, "import", BENCH_MINI)
    assert code == 0, err
    assert re.search(r"^3 files \(0 unreadable\), 10 new, 0 updated, 0 unchanged, "
                     r"1 skipped, 10 embedded$", out, re.M), out

    code, out, err = run_cli(capsys, *base, "search", "who can lend me a soldering iron",
                             "--json", "--limit", "3")
    assert code == 0, err
    result = json.loads(out)
    assert set(result) == {"hits", "trace", "empty_reason"}
    assert 1 <= len(result["hits"]) <= 3
    top = result["hits"][0]
    assert top["id"] == 1400000000000000001
    assert top["author_name"] == "Hannah"
    assert top["jump_url"] == (
        f"https://discord.com/channels/{MINI_GUILD}/930000000000000010/1400000000000000001")
    assert top["created"] == "2026-09-01T16:00:00+00:00"
    assert {"similarity", "keyword_score", "fused", "boost", "score"} <= set(top)
    assert {"candidates", "timings_ms", "threshold", "threshold_mode"} <= set(result["trace"])

    # a table, filtered by channel name: the parent channel includes its thread
    code, out, err = run_cli(capsys, *base, "search", "repair cafe", "--mode", "keyword",
                             "--channel", "#general", "--author", "priyak", "--debug")
    assert code == 0, err
    assert "repair cafe is moved to Saturday" in out
    assert "#repair cafe" in out and "Priya" in out
    assert "candidates per stage" in out

    code, out, err = run_cli(capsys, *base, "stats", "--json")
    assert code == 0, err
    stats = json.loads(out)
    assert stats["messages"] == 10 and stats["channels"] == 2 and stats["authors"] == 3
    assert stats["pending_embeddings"] == 0
    assert (stats["embedding_model"], stats["embedding_dim"]) == (BUNDLED_MODEL_ID, 384)
    assert stats["path"] == str(db)

    code, out, _ = run_cli(capsys, *base, "stats")
    assert code == 0 and re.search(r"messages: 10$", out, re.M)

    code, out, _ = run_cli(capsys, *base, "embed")
    assert (code, out.strip()) == (0, "embedded 0 messages")

    extra = tmp_path / "extra"
    extra.mkdir()
    shutil.copy(BENCH_MINI / "Bench Mini - general [930000000000000010].json", extra / "a.json")
    (extra / "a.json").write_text(
        (extra / "a.json").read_text(encoding="utf-8").replace(
            "anyone up for pizza after the build night?", "pizza after build night? yes"),
        encoding="utf-8",
    )
    code, out, err = run_cli(capsys, *base, "import", "--no-embed", extra)
    assert code == 0, err
    assert "0 new, 1 updated, 4 unchanged, 0 skipped, 0 embedded" in out

    code, out, _ = run_cli(capsys, *base, "embed")
    # the edited message, and the next one, whose vector had the old text as context
    assert (code, out.strip()) == (0, "embedded 2 messages")

    code, out, err = run_cli(capsys, *base, "reembed")
    assert code == 0, err
    assert out.strip() == f"re-embedded 10 messages with {BUNDLED_MODEL_ID}"

    code, out, _ = run_cli(capsys, *base, "stats", "--json")
    assert json.loads(out)["pending_embeddings"] == 0


def test_import_with_some_bad_files(tmp_path: Path, capsys: pytest.CaptureFixture) -> None:
    folder = tmp_path / "exports"
    folder.mkdir()
    (folder / "broken.json").write_text("{ not json", encoding="utf-8")
    db = tmp_path / "cli.sqlite3"
    code, out, err = run_cli(capsys, "--db", db, *PROFILE, "import", "--no-embed", folder,
                             BENCH_MINI)
    assert code == 0
    assert out.startswith("4 files (1 unreadable), 10 new")
    assert "broken.json" in err

    code, out, err = run_cli(capsys, "--db", db, *PROFILE, "import", "--no-embed", folder)
    assert code == 1  # nothing at all could be read
    assert "broken.json" in err


# -- errors -------------------------------------------------------------------------------


@pytest.fixture
def empty_db(tmp_path: Path) -> Path:
    from memory.store import MessageStore

    path = tmp_path / "empty.sqlite3"
    MessageStore(path).close()
    return path


@pytest.mark.parametrize(
    "argv, needle",
    [
        pytest.param(["--profile", "quantum", "search", "x"], "unknown profile 'quantum'",
                     id="bad-profile"),
        pytest.param([*PROFILE, "import", "/no/such/export"], "no such file", id="import-missing"),
        pytest.param([*PROFILE, "search", "x", "--limit", "0"], "limit", id="bad-limit"),
        pytest.param([*PROFILE, "search", "   "], "non-empty query", id="blank-query"),
        pytest.param([*PROFILE, "search", *["q"] * 21], "at most 20", id="too-many-queries"),
        pytest.param([*PROFILE, "search", "x", "--after", "2026-02-01", "--before", "2026-01-01"],
                     "earlier", id="after-not-before-before"),
        pytest.param([*PROFILE, "search", "x", "--author", "nobody"], "nobody", id="no-author"),
        pytest.param([*PROFILE, "search", "x", "--channel", "#nowhere"], "nowhere",
                     id="no-channel"),
        pytest.param([*PROFILE, "bench", "retrieval", str(BENCH_MINI), "--modes", "dense,magic"],
                     "magic", id="bench-unknown-mode"),
        pytest.param([*PROFILE, "bench", "search-scale", "--messages", "5"], "at least 100",
                     id="scale-too-small"),
    ],
)
def test_errors_are_one_line_and_exit_2(
    capsys: pytest.CaptureFixture, empty_db: Path, argv: list[str], needle: str
) -> None:
    code, out, err = run_cli(capsys, "--db", empty_db, *argv)
    assert code == 2
    assert needle in error_line(err)


def test_stats_on_a_missing_database(tmp_path: Path, capsys: pytest.CaptureFixture) -> None:
    missing = tmp_path / "missing.sqlite3"
    code, _, err = run_cli(capsys, "--db", missing, "stats")
    assert code == 2
    assert "does not exist" in error_line(err)
    assert not missing.exists()


def test_not_a_database_is_one_line(tmp_path: Path, capsys: pytest.CaptureFixture) -> None:
    notes = tmp_path / "notes.txt"
    notes.write_text("not a database at all\n" * 100)
    code, _, err = run_cli(capsys, "--db", notes, "stats")
    assert code == 2
    assert "not a usable SQLite database" in error_line(err)


def test_search_on_a_missing_database(tmp_path: Path, capsys: pytest.CaptureFixture) -> None:
    missing = tmp_path / "missing.sqlite3"
    code, _, err = run_cli(capsys, "--db", missing, *PROFILE, "search", "anything")
    assert code == 2
    assert "does not exist" in error_line(err)
    assert not missing.exists()


def test_run_without_a_token(
    tmp_path: Path, capsys: pytest.CaptureFixture, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.delenv("DISCORD_TOKEN", raising=False)
    code, _, err = run_cli(capsys, "--db", tmp_path / "bot.sqlite3", *PROFILE, "run")
    assert code == 2
    assert "DISCORD_TOKEN" in error_line(err)


def test_argparse_errors_exit_2(capsys: pytest.CaptureFixture) -> None:
    with pytest.raises(SystemExit) as excinfo:
        bot.main(["search", "x", "--after", "last tuesday"])
    assert excinfo.value.code == 2
    assert "not an ISO 8601 date" in capsys.readouterr().err


# -- benchmarks and the demo ------------------------------------------------------------------


def test_bench_retrieval_json(tmp_path: Path, capsys: pytest.CaptureFixture) -> None:
    out_file = tmp_path / "retrieval.json"
    code, out, err = run_cli(capsys, *PROFILE, "bench", "retrieval", BENCH_MINI,
                             "--modes", "dense,keyword,hybrid", "--json", out_file)
    assert code == 0, err
    result = json.loads(out_file.read_text(encoding="utf-8"))
    assert json.loads(out) == result
    assert {"messages", "queries", "k", "scope", "modes", "profile"} <= set(result)
    assert (result["messages"], result["queries"], result["k"], result["scope"]) == (
        10, 5, 10, "guild")
    assert result["profile"] == "cpu-fast"
    assert set(result["modes"]) == {"dense", "keyword", "hybrid"}
    for mode, metrics in result["modes"].items():
        assert {"recall", "hit", "mrr", "ndcg", "mean_returned", "p50_ms", "p95_ms"} <= set(
            metrics), mode
        assert all(0.0 <= metrics[m] <= 1.0 for m in ("recall", "hit", "mrr", "ndcg")), mode
    # sanity on a set this easy: every query's evidence is in the hybrid top 10
    assert result["modes"]["hybrid"]["hit"] == 1.0


def test_bench_search_scale_runs(tmp_path: Path, capsys: pytest.CaptureFixture) -> None:
    out_file = tmp_path / "scale.json"
    code, out, err = run_cli(capsys, *PROFILE, "bench", "search-scale", "--messages", "300",
                             "--queries", "5", "--json", out_file)
    assert code == 0, err
    result = json.loads(out_file.read_text(encoding="utf-8"))
    assert (result["messages"], result["queries"]) == (300, 5)
    assert {"machine", "import_msgs_per_s", "raw_encoder_msgs_per_s", "import_vs_encoder",
            "search", "adaptive_vs_fixed_p50"} <= set(result)
    assert set(result["search"]) == {"fixed", "adaptive", "hybrid"}
    for timings in result["search"].values():
        assert set(timings) == {"p50_ms", "p95_ms"}
        assert timings["p95_ms"] >= timings["p50_ms"] > 0
    # the vector stage per rescore setting; 300 messages: 16 x 50 fetches them all
    assert list(result["knn"]) == ["1", "2", "4", "8", "16"]
    for measured in result["knn"].values():
        assert measured["p95_ms"] >= measured["p50_ms"] > 0
        assert 0 <= measured["exact_top10_overlap"] <= 1
    assert result["knn"]["16"]["exact_top10_overlap"] == 1.0
    assert result["knn"]["16"]["exact_top50_overlap"] == 1.0


def test_demo_runs_on_a_temporary_database(tmp_path: Path, capsys: pytest.CaptureFixture) -> None:
    db = tmp_path / "never-created.sqlite3"
    code, out, err = run_cli(capsys, "--db", db, *PROFILE, "demo")
    assert code == 0, err
    assert "imported 5 channel exports" in out
    assert ">>> search:" in out
    assert "recall@5" in out
    assert not db.exists()  # without --keep the demo never touches --db
