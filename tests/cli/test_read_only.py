"""Read-only databases, as a user who really cannot write them.

Root ignores file permissions, so when the suite runs as root the reading CLI runs
as ``nobody`` (through ``setpriv``); otherwise it runs as the current user and the
permissions bind it.  Either way the reader may not write the database file, and
in the read-only-folder cases not its folder either, so SQLite cannot create the
WAL index (``-shm``) a ``mode=ro`` connection needs: the store then reads the file
as an immutable snapshot, unless a write-ahead log holds commits that would be
missed, which is an error naming what to do.
"""

from __future__ import annotations

import functools
import os
import shutil
import subprocess
import sys
import tempfile
from collections.abc import Iterator
from pathlib import Path

import pytest

import bot
from memory.storage.sqlite.connection import connect

ROOT = Path(__file__).resolve().parents[2]
BENCH_MINI = ROOT / "tests" / "fixtures" / "bench-mini"
CHANNEL = "930000000000000010"

pytestmark = pytest.mark.skipif(sys.platform == "win32", reason="POSIX permissions")


def reader_prefix() -> list[str]:
    """The command prefix that runs a process as a user who cannot write our files."""
    if os.geteuid() != 0:
        return []
    setpriv = shutil.which("setpriv")
    if setpriv is None:
        pytest.skip("running as root without setpriv: no unprivileged user to read as")
    prefix = [setpriv, "--reuid=65534", "--regid=65534", "--clear-groups"]
    if not _runs_as(tuple(prefix)):  # e.g. a Python whose shared library is under /root
        pytest.skip(f"user nobody cannot run {sys.executable}: no unprivileged user to read as")
    return prefix


@functools.cache
def _runs_as(prefix: tuple[str, ...]) -> bool:
    """Whether this Python starts at all under ``prefix`` (as the unprivileged user)."""
    probe = subprocess.run([*prefix, sys.executable, "-c", ""], capture_output=True, timeout=60)
    return probe.returncode == 0


def run_as_reader(*argv: str | Path) -> subprocess.CompletedProcess[str]:
    env = {**os.environ, "HF_HUB_OFFLINE": "1", "TRANSFORMERS_OFFLINE": "1",
           "PYTHONPATH": str(ROOT)}
    return subprocess.run(
        [*reader_prefix(), sys.executable, str(ROOT / "bot.py"), *map(str, argv)],
        cwd=ROOT, env=env, capture_output=True, text=True, timeout=300,
    )


@pytest.fixture(scope="module")
def imported(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A database holding the bench-mini export, stored but not embedded (no model needed)."""
    db = tmp_path_factory.mktemp("source") / "memory.sqlite3"
    assert bot.main(["--db", str(db), "--profile", "cpu-fast", "import", "--no-embed",
                     str(BENCH_MINI)]) == 0
    return db


@pytest.fixture
def folder() -> Iterator[Path]:
    """A folder every user can enter (pytest's own temporary folders are private)."""
    path = Path(tempfile.mkdtemp(prefix="memory-read-only-"))
    path.chmod(0o755)
    yield path
    path.chmod(0o755)
    shutil.rmtree(path)


def _seal(db: Path, folder_writable: bool) -> None:
    """Make ``db`` (and its side files) read-only to the reader; its folder too, unless asked."""
    for side in (db, Path(f"{db}-wal"), Path(f"{db}-shm")):
        if side.exists():
            side.chmod(0o444)
    db.parent.chmod(0o777 if folder_writable else 0o555)


def _search(db: Path, text: str) -> subprocess.CompletedProcess[str]:
    return run_as_reader("--db", db, "--profile", "cpu-fast", "search", text, "--mode",
                         "keyword", "--no-rerank")


def _assert_reads(db: Path) -> None:
    stats = run_as_reader("--db", db, "stats")
    assert stats.returncode == 0, stats.stderr
    assert "messages: 10" in stats.stdout
    found = _search(db, "soldering iron")
    assert found.returncode == 0, found.stderr
    assert "Hannah" in found.stdout
    assert "Traceback" not in found.stderr + stats.stderr


@pytest.mark.parametrize("folder_writable", [True, False], ids=["file", "file-and-folder"])
def test_a_read_only_database_is_searched(
    imported: Path, folder: Path, folder_writable: bool
) -> None:
    db = folder / "memory.sqlite3"
    shutil.copy(imported, db)
    _seal(db, folder_writable)
    _assert_reads(db)
    before = db.read_bytes()
    changed = run_as_reader("--db", db, "--profile", "cpu-fast", "import", "--no-embed",
                            BENCH_MINI)
    assert changed.returncode == 2
    (line,) = changed.stderr.splitlines()
    assert line.startswith("error: ") and "read-only" in line
    assert db.read_bytes() == before


def test_a_live_write_ahead_log_is_read_in_a_read_only_folder(imported: Path, folder: Path) -> None:
    """A writer holds the database open with a commit still in its -wal: the reader sees it."""
    db = folder / "memory.sqlite3"
    shutil.copy(imported, db)
    writer = connect(db)
    try:
        writer.execute("PRAGMA wal_autocheckpoint=0")
        # an edit as the store writes one: the message and its row in the keyword index
        writer.execute("BEGIN")
        writer.execute("CREATE TEMP TABLE edited AS SELECT min(id) AS id FROM messages "
                       "WHERE content NOT LIKE '%solder%'")
        for table in ("messages", "search_text"):
            writer.execute(f"UPDATE {table} SET content = 'the kiln key hangs by the fuse box' "
                           "WHERE id = (SELECT id FROM edited)")
        writer.execute("COMMIT")
        assert Path(f"{db}-wal").stat().st_size > 0
        _seal(db, folder_writable=False)
        found = _search(db, "kiln key")
        assert found.returncode == 0, found.stderr
        assert "fuse box" in found.stdout
        _assert_reads(db)
    finally:
        writer.close()


def test_a_write_ahead_log_without_its_index_is_a_clear_error(imported: Path, folder: Path) -> None:
    """A -wal left without its -shm in a folder the reader cannot write: reading the file
    alone would miss the log's commits, so the reader is told what to do instead."""
    db = folder / "memory.sqlite3"
    shutil.copy(imported, db)
    script = (
        "import os, sys; from memory.storage.sqlite.connection import connect; c = connect(sys.argv[1]); "
        "c.execute('PRAGMA wal_autocheckpoint=0'); "
        "c.execute(\"UPDATE messages SET content = 'after the crash'\"); os._exit(0)"
    )
    subprocess.run([sys.executable, "-c", script, str(db)], cwd=ROOT, check=True)
    Path(f"{db}-shm").unlink()
    _seal(db, folder_writable=False)
    for result in (run_as_reader("--db", db, "stats"), _search(db, "crash")):
        assert result.returncode == 2
        (line,) = result.stderr.splitlines()
        assert line.startswith("error: ") and "memory.sqlite3-wal" in line
        assert "write access" in line


def test_a_read_only_file_that_is_not_sqlite_is_one_line(folder: Path) -> None:
    notes = folder / "notes.sqlite3"
    notes.write_text("my notes, not a database\n" * 50)
    _seal(notes, folder_writable=False)
    result = run_as_reader("--db", notes, "stats")
    assert result.returncode == 2
    (line,) = result.stderr.splitlines()
    assert "not a usable SQLite database" in line


@pytest.mark.parametrize("given, needle", [
    ("file", "is not readable"),  # checked with the arguments
    ("folder", "cannot read the file"),  # found inside a folder by the importer
])
def test_an_export_the_user_cannot_read_is_one_line(folder: Path, given: str, needle: str) -> None:
    exports = folder / "exports"
    exports.mkdir(mode=0o755)
    export = exports / "locked.json"
    shutil.copy(next(BENCH_MINI.glob("*.json")), export)
    export.chmod(0)
    folder.chmod(0o777)  # the database may be created; only the export is locked
    result = run_as_reader("--db", folder / "memory.sqlite3", "--profile", "cpu-fast", "import",
                           "--no-embed", export if given == "file" else exports)
    assert result.returncode == 2 and result.stdout == ""
    (line,) = result.stderr.splitlines()
    assert line.startswith("error: ") and needle in line
