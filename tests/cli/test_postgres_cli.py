"""The command line on a PostgreSQL database: --db URL, MEMORY_DB, [storage] url."""

from __future__ import annotations

import json
from collections.abc import Callable
from pathlib import Path

import pytest

import bot  # noqa: F401  (importing the entry script adds `bench`, as running it does)
from cli.app import main
from memory.config import load_profile_file
from memory.errors import ConfigError
from memory.storage import open_storage
from tests.support.postgres import PostgresServer

pytestmark = pytest.mark.postgres

EXPORT = Path(__file__).resolve().parents[2] / "data" / "demo-server"


def _profile(tmp_path: Path, url: str) -> Path:
    path = tmp_path / "pg.toml"
    path.write_text(f'[storage]\nurl = "{url}"\n[reranker]\nbackend = "none"\n', encoding="utf-8")
    return path


def test_stats_and_import_run_on_a_url(postgres_url: Callable[..., str],
                                       capsys: pytest.CaptureFixture, tmp_path: Path) -> None:
    url = postgres_url()
    assert main(["--db", url, "import", "--no-embed", str(EXPORT)]) == 0
    capsys.readouterr()
    assert main(["--db", url, "stats"]) == 0
    out = capsys.readouterr().out
    storage = open_storage(url, read_only=True)
    try:
        assert f"messages: {storage.messages.count()}" in " ".join(out.split())
    finally:
        storage.close()
    assert "***" in out or ":@" in url  # the password never shows


def test_the_profile_names_the_database_when_db_is_not_given(
    postgres_url: Callable[..., str], capsys: pytest.CaptureFixture, tmp_path: Path,
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    url = postgres_url()
    monkeypatch.delenv("MEMORY_DB", raising=False)
    monkeypatch.chdir(tmp_path)
    profile = _profile(tmp_path, url)
    assert main(["--profile", str(profile), "import", "--no-embed", str(EXPORT)]) == 0
    storage = open_storage(url, read_only=True)
    try:
        assert storage.messages.count() > 0
    finally:
        storage.close()
    assert not list(tmp_path.glob("*.sqlite3*"))


@pytest.mark.parametrize("url", ["sqlite:///x.db", "data/memory.sqlite3", "mysql://h/db"])
def test_a_storage_url_must_be_postgresql(tmp_path: Path, url: str) -> None:
    with pytest.raises(ConfigError, match="storage.url must be a postgresql:// URL"):
        load_profile_file(_profile(tmp_path, url))


@pytest.mark.slow
def test_bench_search_scale_runs_both_engines_with_a_bulk_index(
    postgres_server: PostgresServer, capsys: pytest.CaptureFixture, tmp_path: Path
) -> None:
    """The 1M-message run's shape, small: word-averaged vectors shared by both engines, the
    HNSW index built once at the end (timed), the database sizes."""
    out_file = tmp_path / "scale.json"
    code = main(["--profile", "cpu-fast", "bench", "search-scale", "--messages", "300",
                 "--queries", "4", "--postgres", postgres_server.url, "--vectors", "word-average",
                 "--bulk-index", "--no-index-sweep", "--json", str(out_file)])
    capsys.readouterr()
    assert code == 0
    result = json.loads(out_file.read_text(encoding="utf-8"))
    assert result["vectors"] == "word-average" and result["postgres_vs_sqlite_hybrid_p50"] > 0
    assert result["searched"] == "side by side, query by query"
    assert result["sqlite"]["queries"] == result["postgres"]["queries"] == 4
    for engine in ("sqlite", "postgres"):
        assert result[engine]["database_mb"] > 0
        assert result[engine]["knn"]["1"]["exact_top10_overlap"] == 1.0  # a small guild: exact
    assert result["postgres"]["hnsw_build_s"] >= 0 and "knn_by_index" not in result["postgres"]
