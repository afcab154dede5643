"""Issue 21, items 3, 7 and 8: hostile inputs end in one clear line, never a traceback.

Times no Discord message can have, a damaged ``meta.embedding_dim``, a CUDA profile on
a machine without CUDA, an export with two ``messages`` lists, a database URL for
``--db`` and queries of a megabyte.  Every case runs on a real temporary SQLite, and
where a command is refused the database is checked to be exactly as it was.
"""

from __future__ import annotations

import json
import logging
from collections.abc import Callable
from datetime import datetime, timezone
from pathlib import Path
from typing import Any

import pytest

import bot
from memory.config import EmbedderConfig, Profile, RerankerConfig, load_profile
from memory.embedder import BUNDLED_MODEL_ID, SentenceTransformerEmbedder
from memory.engine import MemoryEngine
from memory.errors import ConfigError, DatabaseFileError, RerankerUnavailable, SearchInputError
from memory.importer import read_export
from memory.records import MessageRecord, ms_to_datetime, snowflake_time_ms
from memory.search import MAX_QUERIES, MAX_QUERY_CHARS, SearchRequest
from memory.storage import open_storage
from memory.storage.sqlite.connection import connect
from tests.support.builders import GUILD, HashEmbedder

MakeRecord = Callable[..., MessageRecord]
PROFILE = ["--profile", "cpu-fast"]  # no reranker; no command here loads the MiniLM


def run_cli(capsys: pytest.CaptureFixture, *argv: Any) -> tuple[int, str, str]:
    code = bot.main([str(a) for a in argv])
    out, err = capsys.readouterr()
    return code, out, err


def error_line(err: str) -> str:
    """The one line a refused command prints."""
    lines = [line for line in err.splitlines() if line.strip()]
    assert len(lines) == 1, err
    assert lines[0].startswith("error: ") and "Traceback" not in err
    return lines[0]


def snapshot(path: Path) -> dict[str, Any]:
    """Everything a refused command must leave as it was, after SQLite's and FTS5's checks."""
    conn = connect(path)
    try:
        assert conn.execute("PRAGMA integrity_check").fetchall() == [("ok",)]
        conn.execute("INSERT INTO search_fts(search_fts) VALUES ('integrity-check')")
        conn.execute("INSERT INTO window_fts(window_fts) VALUES ('integrity-check')")
        vectors = conn.execute("SELECT count(*) FROM sqlite_master WHERE name = 'message_vectors'")
        return {
            "messages": conn.execute(
                "SELECT id, channel_id, created_at, edited_at, content, embedded FROM messages "
                "ORDER BY id").fetchall(),
            "meta": conn.execute("SELECT key, value FROM meta ORDER BY key").fetchall(),
            "fts": conn.execute("SELECT count(*) FROM search_fts_docsize").fetchone()[0],
            "windows": conn.execute("SELECT count(*) FROM window_fts_docsize").fetchone()[0],
            "vectors": conn.execute(
                "SELECT message_id, embedding FROM message_vectors ORDER BY message_id"
            ).fetchall() if vectors.fetchone()[0] else [],
        }
    finally:
        conn.close()


def write_export(path: Path, text: str) -> Path:
    path.write_text(text, encoding="utf-8")
    return path


def export_json(messages: list[dict[str, Any]]) -> str:
    return json.dumps({"guild": {"id": "900", "name": "g"},
                       "channel": {"id": "901", "name": "c", "type": "GuildTextChat"},
                       "messages": messages})


def msg(mid: int, content: str, **extra: Any) -> dict[str, Any]:
    return {"id": str(mid), "content": content, "author": {"id": "3", "name": "ann"}, **extra}


@pytest.fixture
def stored(tmp_path: Path, make_record: MakeRecord) -> Path:
    """A database with three embedded messages (the fake embedder, bound as the MiniLM)."""
    path = tmp_path / "memory.sqlite3"
    engine = MemoryEngine(path, Profile(name="test", reranker=RerankerConfig(backend="none")),
                          HashEmbedder(384, model_id=BUNDLED_MODEL_ID))
    engine.ingest([make_record(f"kettle note {i}") for i in range(3)])
    engine.close()
    return path


# -- 3. times no Discord message can have -------------------------------------------------

ANCIENT, FUTURE, EPOCH, EDITED, FIRST_DAY = (1100000000000000000 + i for i in range(5))


def test_times_outside_discord_are_refused_at_import(
    tmp_path: Path, capsys: pytest.CaptureFixture, caplog: pytest.LogCaptureFixture
) -> None:
    path = write_export(tmp_path / "times.json", export_json([
        msg(ANCIENT, "ancient kettle", timestamp="0001-01-01T00:00:00+14:00"),
        msg(FUTURE, "future kettle", timestamp="9999-12-31T23:59:59-12:00"),
        msg(EPOCH, "epoch kettle", timestamp="1970-01-01T00:00:00Z"),
        msg(EDITED, "edited kettle", timestamp="2026-03-01T12:00:00Z",
            timestampEdited="9999-12-31T23:59:59-12:00"),
        msg(FIRST_DAY, "first day kettle", timestamp="2015-01-01T00:00:00Z"),
    ]))
    db = tmp_path / "memory.sqlite3"
    code, out, err = run_cli(capsys, "--db", db, *PROFILE, "import", "--no-embed", path)
    assert code == 0, err
    assert out.startswith("1 files (0 unreadable), 5 new")
    # the CLI prints WARNING lines on stderr (pytest captures the logging instead)
    (warning,) = [r.getMessage() for r in caplog.records if r.levelno >= logging.WARNING]
    assert "4 timestamps outside 2015-01-01 .. 2084-09-06 UTC" in warning
    assert str(path) in warning and "taken from its id" in warning

    rows = {mid: (created, edited) for mid, _, created, edited, *_ in snapshot(db)["messages"]}
    for mid in (ANCIENT, FUTURE, EPOCH):  # 0 (1970) is a time, but no Discord one
        assert rows[mid] == (snowflake_time_ms(mid), None)
    assert rows[EDITED] == (int(datetime(2026, 3, 1, 12, tzinfo=timezone.utc).timestamp()) * 1000,
                            None)
    assert rows[FIRST_DAY] == (1420070400000, None)  # the first Discord day is one

    code, out, err = run_cli(capsys, "--db", db, *PROFILE, "search", "kettle", "--mode",
                             "keyword", "--json")
    assert code == 0, err
    assert len(json.loads(out)["hits"]) == 5


def test_a_database_written_before_the_check_still_searches(
    tmp_path: Path, capsys: pytest.CaptureFixture, make_record: MakeRecord
) -> None:
    # what the importer stored before it checked: years 0 and 10000 in UTC
    db = tmp_path / "old.sqlite3"
    storage = open_storage(db)
    storage.messages.upsert([make_record("ancient kettle", id=ANCIENT, created_at=-62135647200000),
                  make_record("future kettle", id=FUTURE, created_at=253402343999000)])
    storage.close()
    before = snapshot(db)

    code, out, err = run_cli(capsys, "--db", db, *PROFILE, "search", "kettle", "--mode",
                             "keyword", "--json")
    assert code == 0, err
    shown = sorted(hit["created"] for hit in json.loads(out)["hits"])
    assert shown == ["0001-01-01T00:00:00+00:00", "9999-12-31T23:59:59.999000+00:00"]
    code, out, err = run_cli(capsys, "--db", db, *PROFILE, "search", "kettle", "--mode",
                             "keyword")
    assert code == 0, err
    assert "9999-12-31" in out and "Traceback" not in err
    assert snapshot(db) == before


@pytest.mark.parametrize("ms, shown", [
    (0, datetime(1970, 1, 1, tzinfo=timezone.utc)),
    (1767225600123, datetime(2026, 1, 1, 0, 0, 0, 123000, tzinfo=timezone.utc)),
    (-62135647200000, datetime.min.replace(tzinfo=timezone.utc)),
    (253402343999000, datetime.max.replace(microsecond=999000, tzinfo=timezone.utc)),
    (-(2**63), datetime.min.replace(tzinfo=timezone.utc)),
    (2**63 - 1, datetime.max.replace(microsecond=999000, tzinfo=timezone.utc)),
])
def test_ms_to_datetime_shows_any_stored_time(ms: int, shown: datetime) -> None:
    assert ms_to_datetime(ms) == shown


# -- 7. a damaged vector size --------------------------------------------------------------


@pytest.mark.parametrize("value", ["abc", "0", "-3", "1.5", "9" * 5000])
@pytest.mark.parametrize("command", [["stats"], ["search", "kettle"], ["embed"]],
                         ids=lambda c: c[0])
def test_a_damaged_embedding_dim_is_one_line(
    stored: Path, capsys: pytest.CaptureFixture, value: str, command: list[str]
) -> None:
    conn = connect(stored)
    conn.execute("UPDATE meta SET value = ? WHERE key = 'embedding_dim'", (value,))
    conn.close()
    before = snapshot(stored)
    code, out, err = run_cli(capsys, "--db", stored, *PROFILE, *command)
    assert (code, out) == (2, "")
    line = error_line(err)
    assert "meta.embedding_dim" in line and "reembed" in line
    assert snapshot(stored) == before


def test_reembed_repairs_a_damaged_embedding_dim(stored: Path) -> None:
    conn = connect(stored)
    conn.execute("UPDATE meta SET value = 'abc' WHERE key = 'embedding_dim'")
    conn.close()
    profile = Profile(name="test", reranker=RerankerConfig(backend="none"))
    embedder = HashEmbedder(384, model_id=BUNDLED_MODEL_ID)
    engine = MemoryEngine(stored, profile, embedder, check_model=False)  # as `reembed` opens it
    try:
        assert engine.reembed() == 3
        assert engine.storage.meta.embedding_model() == (BUNDLED_MODEL_ID, 384)
        assert len(engine.search("kettle note", guild_id=GUILD).hits) == 3
    finally:
        engine.close()


# -- 7. a CUDA profile without CUDA -----------------------------------------------------------


def _has(device: str) -> bool:
    import torch

    if device == "cuda":
        return bool(torch.cuda.is_available())
    return bool(torch.backends.mps.is_available())


@pytest.mark.parametrize("profile", ["cuda", "cuda-8b", "mps"])
def test_a_gpu_profile_without_the_gpu_is_one_line(
    stored: Path, capsys: pytest.CaptureFixture, profile: str
) -> None:
    device = load_profile(profile).embedder.device
    if _has(device):
        pytest.skip(f"this machine has {device}")
    before = snapshot(stored)
    code, out, err = run_cli(capsys, "--db", stored, "--profile", profile, "search", "kettle")
    assert (code, out) == (2, "")
    line = error_line(err)
    assert f"embedder.device is '{device}' but there is no {device.upper()} here" in line
    assert snapshot(stored) == before

    with pytest.raises(ConfigError, match=f"no {device.upper()} here"):
        SentenceTransformerEmbedder(EmbedderConfig(device=device)).embed(["x"])


@pytest.mark.parametrize("profile", ["cuda", "cuda-8b"])
def test_a_cuda_reranker_without_cuda_says_so_before_loading(profile: str) -> None:
    if _has("cuda"):
        pytest.skip("this machine has CUDA")
    from memory.rerank.qwen import QwenReranker

    reranker = QwenReranker(load_profile(profile).reranker.qwen)
    with pytest.raises(RerankerUnavailable) as caught:
        reranker.load()  # fails before looking for the weights (not on this machine either)
    assert str(caught.value).startswith("reranker.device is 'cuda' but there is no CUDA here")
    assert "\n" not in str(caught.value)


# -- 7. an export with two "messages" lists --------------------------------------------------

HEADER = '"guild": {"id": "900", "name": "g"}, "channel": {"id": "901", "name": "c"}'
ONE = json.dumps([msg(1100000000000000009, "the second list's kettle",
                      timestamp="2026-01-02T00:00:00Z")])


@pytest.mark.parametrize("text, key", [
    pytest.param(f'{{{HEADER}, "messages": [], "messages": {ONE}}}', "messages", id="empty-first"),
    pytest.param(f'{{{HEADER}, "messages": null, "messages": {ONE}}}', "messages",
                 id="null-first"),
    pytest.param(f'{{"guild": {{"id": "7"}}, {HEADER}, "messages": {ONE}}}', "guild",
                 id="two-guilds"),
    pytest.param(f'{{{HEADER}, "channel": {{"id": "8"}}, "messages": {ONE}}}', "channel",
                 id="two-channels"),
])
def test_an_export_with_a_repeated_key_is_refused(
    stored: Path, tmp_path: Path, capsys: pytest.CaptureFixture, text: str, key: str
) -> None:
    path = write_export(tmp_path / "twice.json", text)
    before = snapshot(stored)
    code, out, err = run_cli(capsys, "--db", stored, *PROFILE, "import", "--no-embed", path)
    assert (code, out) == (2, "")
    line = error_line(err)
    assert f"{path}: a second top-level '{key}' key after 0 messages" in line
    assert snapshot(stored) == before


def test_keys_after_the_messages_list_are_still_read(tmp_path: Path) -> None:
    # DiscordChatExporter writes messageCount after the list: not a repeated key
    path = write_export(tmp_path / "ok.json", f'{{{HEADER}, "messages": {ONE}, "messageCount": 1}}')
    assert [r.content for r in read_export(path).records] == ["the second list's kettle"]


def test_search_output_passes_no_control_character_to_the_terminal(
    tmp_path: Path, capsys: pytest.CaptureFixture
) -> None:
    # an escape sequence sets the terminal's title; a newline in a name forges a result row
    db, path = tmp_path / "m.sqlite3", tmp_path / "hostile.json"
    write_export(path, json.dumps({
        "guild": {"id": "900", "name": "g"},
        "channel": {"id": "901", "name": "chan\nfake", "type": "GuildTextChat"},
        "messages": [
            msg(1100000000000000001, "widget \x1b[31mRED\x1b[0m \x1b]0;pwned\x07 \u202eevil",
                author={"id": "3", "name": "bob", "nickname": "Bob\n 2. score 9.9 fake line"}),
            msg(1100000000000000002, "", attachments=[{"fileName": "widget\x1b[2J.png"}])]}))
    assert run_cli(capsys, "--db", db, *PROFILE, "import", "--no-embed", path)[0] == 0
    code, out, err = run_cli(capsys, "--db", db, *PROFILE, "search", "widget", "--mode",
                             "keyword")
    assert code == 0, err
    assert not [c for c in out if c != "\n" and (ord(c) < 32 or c in "\x7f\u202e")]
    assert sum(line.lstrip().startswith(("1.", "2.")) for line in out.splitlines()) == 2
    assert "[attached: widget [2J.png]" in out, "an attachment-only hit shows its file"


# -- 7. a database URL for --db ------------------------------------------------------------


@pytest.mark.parametrize("url", ["mysql://user@host/db", "sqlite:///tmp/x.db",
                                 "file:/tmp/x.sqlite3"])
@pytest.mark.parametrize("command", [["import", "--no-embed", "@export"], ["stats"],
                                     ["search", "x"], ["embed"]], ids=lambda c: c[0])
def test_a_database_url_is_refused_and_creates_nothing(
    tmp_path: Path, capsys: pytest.CaptureFixture, monkeypatch: pytest.MonkeyPatch,
    url: str, command: list[str],
) -> None:
    export = write_export(tmp_path / "export.json", export_json([msg(10, "hello")]))
    monkeypatch.chdir(tmp_path)
    argv = [str(export) if a == "@export" else a for a in command]
    code, out, err = run_cli(capsys, "--db", url, *PROFILE, *argv)
    assert (code, out) == (2, "")
    assert f"{url} is a URL" in error_line(err)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["export.json"]


@pytest.mark.parametrize("command", [["stats"], ["search", "x"]], ids=lambda c: c[0])
def test_an_unreachable_postgresql_url_is_one_line_and_creates_nothing(
    tmp_path: Path, capsys: pytest.CaptureFixture, monkeypatch: pytest.MonkeyPatch,
    command: list[str],
) -> None:
    monkeypatch.chdir(tmp_path)
    url = "postgresql://bot:secret@127.0.0.1:1/memory?connect_timeout=2"
    code, out, err = run_cli(capsys, "--db", url, *PROFILE, *command)
    assert (code, out) == (2, "")
    line = error_line(err)  # the driver is missing, or the server cannot be reached
    assert "postgresql://bot:***@127.0.0.1:1/memory" in line and "secret" not in err
    assert list(tmp_path.iterdir()) == []


def test_the_engine_refuses_a_database_url_too(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.chdir(tmp_path)
    # a URL of another kind, or a postgresql:// URL a Path has folded ("postgresql:/user@…")
    for url in ("mysql://user@host/db", Path("postgresql://user@host/db")):
        with pytest.raises(DatabaseFileError, match="is a URL"):
            open_storage(url)
    assert list(tmp_path.iterdir()) == []


# -- 8. queries of a megabyte ----------------------------------------------------------------


@pytest.mark.parametrize("queries", [
    pytest.param(("k" * (MAX_QUERY_CHARS + 1),), id="one-over"),
    pytest.param(("kettle " * 150_000,), id="a-megabyte"),
    pytest.param(("kettle note " * 20,) * MAX_QUERIES, id="20-of-240"),
])
def test_a_search_over_the_character_bound_is_refused(
    stored: Path, queries: tuple[str, ...]
) -> None:
    engine = MemoryEngine(stored, Profile(name="test", reranker=RerankerConfig(backend="none")),
                          HashEmbedder(384, model_id=BUNDLED_MODEL_ID))
    try:
        with pytest.raises(SearchInputError, match=f"at most {MAX_QUERY_CHARS} characters in all"):
            engine.search(SearchRequest(queries=queries, guild_id=GUILD))
        with pytest.raises(SearchInputError, match=f"at most {MAX_QUERY_CHARS} characters"):
            engine.context_for("".join(queries), SearchRequest(queries=(), guild_id=GUILD))
        # the bound itself, and whitespace around it, still search
        fits = ("kettle note " * MAX_QUERY_CHARS)[: MAX_QUERY_CHARS - 1].strip()
        assert engine.search(SearchRequest(queries=(f"  {fits}\n",), guild_id=GUILD)).hits
        assert engine.search(SearchRequest(queries=("kettle",) * MAX_QUERIES, guild_id=GUILD)).hits
    finally:
        engine.close()


def test_a_million_queries_are_refused_before_they_are_read(stored: Path) -> None:
    engine = MemoryEngine(stored, Profile(name="test", reranker=RerankerConfig(backend="none")),
                          HashEmbedder(384, model_id=BUNDLED_MODEL_ID))
    try:
        with pytest.raises(SearchInputError, match=f"at most {MAX_QUERIES} queries per search, "
                                                   "got 1000000"):
            engine.search(SearchRequest(queries=("",) * 1_000_000, guild_id=GUILD))
    finally:
        engine.close()


def test_an_over_long_query_on_the_command_line_is_one_line(
    stored: Path, capsys: pytest.CaptureFixture
) -> None:
    before = snapshot(stored)
    code, out, err = run_cli(capsys, "--db", stored, *PROFILE, "search", "kettle " * 150_000)
    assert (code, out) == (2, "")
    assert "at most 4000 characters in all, got 1049999" in error_line(err)
    assert snapshot(stored) == before


def test_the_importer_logs_nothing_for_good_times(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    path = write_export(tmp_path / "good.json", export_json([
        msg(1100000000000000001, "fine", timestamp="2026-01-01T00:00:00Z",
            timestampEdited="2026-01-01T00:05:00Z")]))
    with caplog.at_level(logging.WARNING, logger="memory.importer"):
        (record,) = read_export(path).records
    assert record.edited_at == record.created_at + 300_000
    assert caplog.records == []
