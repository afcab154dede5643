"""Issue 21, item 4: a full disk is one clear line, exit 2, and nothing lost.

The disk fills through ``RLIMIT_FSIZE``, set in a child process only: a file may not
grow past the limit, so SQLite's write fails exactly as on a full disk (``write()``
returns EFBIG; SIGXFSZ is ignored so that the process lives to say so).  A small
tmpfs in a user namespace would give ENOSPC instead; both reach the same handling
(:func:`memory.storage.sqlite.connection.as_disk_full`), and a file-size limit needs no
privileges.  After each failure the limit is lifted and the same command finishes the
work.
"""

from __future__ import annotations

import resource
import signal
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest

from tests.storage.test_sqlite_crash_recovery import consistency, export

ROOT = Path(__file__).resolve().parent.parent.parent

pytestmark = pytest.mark.slow


def limited(max_bytes: int | None) -> Any:
    def apply() -> None:
        signal.signal(signal.SIGXFSZ, signal.SIG_IGN)
        if max_bytes is not None:
            resource.setrlimit(resource.RLIMIT_FSIZE, (max_bytes, max_bytes))
    return apply


def bot(*argv: str, db: Path, max_bytes: int | None = None) -> subprocess.CompletedProcess[str]:
    return subprocess.run([sys.executable, "bot.py", "--profile", "cpu-fast", "--db", str(db),
                           *argv], cwd=ROOT, capture_output=True, text=True, timeout=600,
                          preexec_fn=limited(max_bytes))


def one_line(result: subprocess.CompletedProcess[str]) -> str:
    lines = [line for line in result.stderr.splitlines() if line.strip()]
    assert result.returncode == 2, result.stderr
    assert len(lines) == 1 and "Traceback" not in result.stderr, result.stderr
    assert lines[0].startswith("error: could not write ")
    assert "rolled back and everything stored before it is intact" in lines[0]
    return lines[0]


def files_size(db: Path) -> int:
    return max((p.stat().st_size for p in db.parent.glob(db.name + "*")), default=0)


@pytest.fixture
def stored(tmp_path: Path) -> Path:
    """A database of 300 embedded messages."""
    db = tmp_path / "memory.sqlite3"
    result = bot("import", str(export(tmp_path / "first.json", 300)), db=db)
    assert result.returncode == 0, result.stderr
    return db


def test_a_full_disk_on_first_open_is_one_line(tmp_path: Path) -> None:
    db, source = tmp_path / "memory.sqlite3", export(tmp_path / "first.json", 20)
    one_line(bot("import", str(source), db=db, max_bytes=16_384))
    assert bot("import", str(source), db=db).returncode == 0  # room again: created, migrated
    state = consistency(db)
    assert state["integrity"] == "ok" and state["messages"] == state["vectors"] == 20


@pytest.mark.parametrize("command", ["import", "embed", "reembed"])
def test_a_full_disk_mid_command_keeps_the_data_and_the_next_run_finishes(
    tmp_path: Path, stored: Path, command: str
) -> None:
    more = export(tmp_path / "more.json", 1500)
    if command == "embed":  # a backlog to embed: stored without vectors
        assert bot("import", str(more), "--no-embed", db=stored).returncode == 0
    before = consistency(stored)
    argv = {"import": ["import", str(more)], "embed": ["embed"], "reembed": ["reembed"]}[command]
    one_line(bot(*argv, db=stored, max_bytes=files_size(stored) + 64_000))
    during = consistency(stored)
    assert during["integrity"] == "ok"
    # what was committed before the disk filled stays; nothing half-written
    assert during["messages"] >= before["messages"]
    assert during["embedded"] == during["vectors"]
    assert during["search_rows"] == during["messages"]

    assert bot(*argv, db=stored).returncode == 0  # room again: the same command finishes
    if command != "import":
        assert bot("embed", db=stored).returncode == 0
    after = consistency(stored)
    assert after["integrity"] == "ok"
    total = 300 if command == "reembed" else 1500  # the first 300 ids are in both exports
    assert after["messages"] == after["embedded"] == after["vectors"] == after["search_rows"] == total


QUEUE_SCRIPT = """
import asyncio, resource, signal, sys
from memory.config import Profile
from memory.engine import MemoryEngine
from cogs.memory.write_queue import WriteQueue
from tests.support.builders import record_factory, HashEmbedder

signal.signal(signal.SIGXFSZ, signal.SIG_IGN)
engine = MemoryEngine(sys.argv[1], Profile(name="test"), HashEmbedder(), load_reranker=False)
make = record_factory()
engine.storage.messages.upsert([make("before the disk filled")])
size = max(p.stat().st_size for p in __import__("pathlib").Path(sys.argv[1]).parent.glob("*"))




async def main():
    loop = asyncio.get_running_loop()
    queue = WriteQueue(lambda fn: loop.run_in_executor(None, fn))
    queue.start()
    resource.setrlimit(resource.RLIMIT_FSIZE, (size + 4096, resource.RLIM_INFINITY))
    for i in range(40):  # members keep talking while the disk is full
        queue.put(engine.storage.messages.upsert, [make(f"message {i} " + "words " * 200)])
        await asyncio.sleep(0.02)
    await asyncio.sleep(1.5)
    print("stored while full:", engine.storage.messages.count(), flush=True)
    resource.setrlimit(resource.RLIMIT_FSIZE, (resource.RLIM_INFINITY, resource.RLIM_INFINITY))
    await queue.stop(timeout=60)
    print("stored after:", engine.storage.messages.count(), flush=True)

asyncio.run(main())
engine.close()
"""


def test_the_bots_write_queue_keeps_messages_until_the_disk_has_room(tmp_path: Path) -> None:
    db = tmp_path / "memory.sqlite3"
    result = subprocess.run([sys.executable, "-c", QUEUE_SCRIPT, str(db)], cwd=ROOT,
                            capture_output=True, text=True, timeout=300)
    assert result.returncode == 0, result.stderr
    while_full, after = (int(line.split(":")[1]) for line in result.stdout.splitlines())
    assert while_full < 41  # the disk really was full for some of them
    assert after == 41  # and none was dropped
    assert "writes wait for disk space: could not write" in result.stderr
    assert "giving up" not in result.stderr
    state = consistency(db)
    assert state["integrity"] == "ok" and state["messages"] == state["search_rows"] == 41


REEMBED_SCRIPT = """
import resource, signal, sys
from memory.config import Profile
from memory.engine import MemoryEngine
from memory.errors import DiskFullError
from tests.support.builders import record_factory, HashEmbedder

signal.signal(signal.SIGXFSZ, signal.SIG_IGN)
db, phase = sys.argv[1], sys.argv[2]
# vectors larger than SQLite's page cache, so that dropping them writes while vec0 runs
old = MemoryEngine(db, Profile(name="test"), HashEmbedder(1024), load_reranker=False)
make = record_factory()
old.ingest([make(f"note {i} about the garden") for i in range(800)])
old.close()
new = MemoryEngine(db, Profile(name="test"), HashEmbedder(64, model_id="test/other-64"),
                   load_reranker=False, check_model=False)

def full():  # the write-ahead log may not grow past 64 KB: the next big write fails
    new.storage.database.read("PRAGMA wal_checkpoint(TRUNCATE)")
    resource.setrlimit(resource.RLIMIT_FSIZE, (65_536, resource.RLIM_INFINITY))

if phase == "swap":
    finish = new.storage.rebuild.finish
    def finish_when_full(*args):
        full()
        return finish(*args)
    new.storage.rebuild.finish = finish_when_full
else:
    full()
try:
    new.reembed()
    print("finished")
except DiskFullError as exc:
    print(exc)
"""


@pytest.mark.parametrize("phase", ["start", "swap"])
def test_a_full_disk_when_reembed_starts_or_swaps_is_one_line_and_keeps_the_old_vectors(
    tmp_path: Path, phase: str
) -> None:
    """Issue 31, item 1: vec0's own DROP said only "SQL logic error" (a traceback)."""
    from memory.config import Profile
    from memory.engine import MemoryEngine
    from memory.storage.sqlite.connection import connect
    from tests.support.builders import HashEmbedder

    db = tmp_path / "memory.sqlite3"
    result = subprocess.run([sys.executable, "-c", REEMBED_SCRIPT, str(db), phase], cwd=ROOT,
                            capture_output=True, text=True, timeout=300)
    assert result.returncode == 0 and "Traceback" not in result.stderr, result.stderr
    assert result.stdout.startswith("could not write "), result.stdout
    assert "rolled back and everything stored before it is intact" in result.stdout
    state = consistency(db)
    assert state["integrity"] == "ok" and state["messages"] == state["embedded"] == 800
    assert state["vectors"] == 800  # the old vectors are all there, and still bound
    conn = connect(db)
    try:
        assert conn.execute("SELECT value FROM meta WHERE key = 'embedding_model'").fetchone() == (
            "test/hash-1024",)
    finally:
        conn.close()

    engine = MemoryEngine(db, Profile(name="test"), HashEmbedder(64, model_id="test/other-64"),
                          load_reranker=False, check_model=False)
    try:  # room again: the same command finishes
        engine.reembed()
        assert engine.storage.meta.embedding_model() == ("test/other-64", 64)
    finally:
        engine.close()
    state = consistency(db)
    assert state["integrity"] == "ok" and state["vectors"] == state["embedded"] == 800
