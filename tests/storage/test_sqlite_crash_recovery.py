"""Issue 21, items 1, 2 and 6: crashes finish on the next run, concurrent imports, and a
message id exported from two channels — on real temporary SQLite files, checked with
SQLite's own integrity check.

Item 1 kills real processes with SIGKILL: a claim on part of the embedding backlog
dies with its process (:mod:`memory.storage.claims`), so the very next plain ``embed``
embeds every message, each once, while two live embedders still share the backlog
without overlap.  The CLI cases run ``bot.py`` with the real bundled MiniLM
(``--profile cpu-fast``).
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import threading
import time
from collections.abc import Sequence
from dataclasses import replace
from pathlib import Path
from typing import Any

import numpy as np
import pytest

from memory.engine import MemoryEngine
from memory.records import MessageRecord
from memory.storage import Storage, claims, open_storage
from memory.storage.sqlite.connection import connect
from tests.support.builders import HashEmbedder, make_profile, snowflake

ROOT = Path(__file__).resolve().parent.parent.parent
GUILD, CHANNEL, OTHER_CHANNEL = 900, 901, 902


def consistency(path: Path) -> dict[str, Any]:
    """Integrity, row counts and both keyword indexes checked against their rows."""
    conn = connect(path)
    try:
        for index in ("search_fts", "window_fts"):  # FTS5's own check against its content
            conn.execute(f"INSERT INTO {index}({index}) VALUES ('integrity-check')")
        return {
            "integrity": conn.execute("PRAGMA integrity_check").fetchone()[0],
            "messages": conn.execute("SELECT count(*) FROM messages").fetchone()[0],
            "embedded": conn.execute("SELECT count(*) FROM messages WHERE embedded = 1").fetchone()[0],
            "vectors": conn.execute("SELECT count(*) FROM message_vectors").fetchone()[0]
            if conn.execute("SELECT count(*) FROM sqlite_master WHERE name = 'message_vectors'"
                            ).fetchone()[0] else 0,
            "search_rows": conn.execute("SELECT count(*) FROM search_text").fetchone()[0],
            "claims": conn.execute("SELECT count(*) FROM embedding_claims").fetchone()[0],
        }
    finally:
        conn.close()


def count(path: Path, sql: str) -> int:
    conn = connect(path)
    try:
        return int(conn.execute(sql).fetchone()[0])
    finally:
        conn.close()


def records(n: int, *, channel: int = CHANNEL, text: str = "note") -> list[MessageRecord]:
    base = 1_700_000_000_000
    return [
        MessageRecord(id=snowflake(base + i * 1000, i % 4096), guild_id=GUILD, channel_id=channel,
                      author_id=7, created_at=base + i * 1000, content=f"{text} {i} about kettles",
                      guild_name="g", channel_name=f"c{channel}", channel_type="GuildTextChat",
                      author_name="ann")
        for i in range(n)
    ]


def export(path: Path, n: int) -> Path:
    """A DiscordChatExporter-shaped file of ``n`` messages."""
    base = 1_700_000_000_000
    messages = [
        {"id": str(snowflake(base + i * 1000, i % 4096)), "type": "Default",
         "timestamp": time.strftime("%Y-%m-%dT%H:%M:%S+00:00", time.gmtime(base / 1000 + i)),
         "content": f"message {i}: the makerspace kettle, the laser cutter and the 3D printer",
         "author": {"id": str(100 + i % 5), "name": f"member{i % 5}"}}
        for i in range(n)
    ]
    path.write_text(json.dumps({"guild": {"id": str(GUILD), "name": "g"},
                                "channel": {"id": str(CHANNEL), "name": "general",
                                            "type": "GuildTextChat"},
                                "messages": messages}), encoding="utf-8")
    return path


class CountingEmbedder(HashEmbedder):
    """The tests' hash embedder, counting how often each text is embedded."""

    def __init__(self) -> None:
        super().__init__()
        self.seen: list[str] = []
        self._lock = threading.Lock()

    def embed(self, texts: Sequence[str]) -> np.ndarray:
        with self._lock:
            self.seen.extend(texts)
        time.sleep(0.01)  # long enough for two embedders to interleave
        return super().embed(texts)


# -- 1. a claim dies with its process ----------------------------------------------------


def test_an_owner_is_dead_only_when_its_process_has_ended() -> None:
    child = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)"])
    try:
        import psutil

        started = int(psutil.Process(child.pid).create_time() * 1000)
        owner = f"{claims.process_owner().split('/')[0]}/{child.pid}/{started}/abc"
        assert not claims.is_dead(owner)
        # the same pid with another start time: a later process reusing a dead one's pid
        assert claims.is_dead(f"{owner.split('/')[0]}/{child.pid}/{started - 5000}/abc")
    finally:
        child.kill()
        child.wait()
    assert claims.is_dead(owner)
    assert not claims.is_dead(claims.process_owner())  # this process
    assert not claims.is_dead(f"another-host/{child.pid}/{started}/abc")  # unknown: expiry decides
    assert not claims.is_dead("0123456789abcdef")  # an older version's owner: expiry decides


CLAIMER = """
import sys, time
from memory.storage import claims, open_storage
storage = open_storage(sys.argv[1])
batch = storage.backlog.claim(int(sys.argv[2]), owner=claims.process_owner())
print(len(batch), flush=True)
time.sleep(600)
"""


def test_a_killed_embedders_claim_is_taken_back_by_the_next_run(tmp_path: Path) -> None:
    path = tmp_path / "memory.sqlite3"
    engine = MemoryEngine(path, make_profile(), CountingEmbedder(), check_model=False)
    engine.storage.messages.upsert(records(600))
    child = subprocess.Popen([sys.executable, "-c", CLAIMER, str(path), "256"], cwd=ROOT,
                             stdout=subprocess.PIPE, text=True)
    try:
        assert child.stdout is not None and child.stdout.readline().strip() == "256"
        embedder = CountingEmbedder()
        live = MemoryEngine(path, make_profile(), embedder, check_model=False)
        assert live.embed_pending() == 600 - 256  # the live claimer's batch is left alone
        child.send_signal(signal.SIGKILL)
        child.wait()
        assert live.embed_pending() == 256  # the very next run: the dead claim is gone
        assert len(embedder.seen) == len(set(embedder.seen)) == 600  # each once
        live.close()
    finally:
        if child.poll() is None:
            child.kill()
            child.wait()
    engine.close()
    state = consistency(path)
    assert state["integrity"] == "ok"
    assert state["messages"] == state["embedded"] == state["vectors"] == 600
    assert state["claims"] == 0


def test_two_live_embedders_share_the_backlog_without_overlap(tmp_path: Path) -> None:
    path = tmp_path / "memory.sqlite3"
    first = MemoryEngine(path, make_profile(), CountingEmbedder(), check_model=False)
    first.storage.messages.upsert(records(3000))
    second = MemoryEngine(path, make_profile(), CountingEmbedder(), check_model=False)
    done: list[int] = []
    threads = [threading.Thread(target=lambda e=e: done.append(e.embed_pending()))
               for e in (first, second)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    seen = first.embedder.seen + second.embedder.seen  # type: ignore[attr-defined]
    assert sum(done) == 3000 and all(done), done  # both worked
    assert len(seen) == len(set(seen)) == 3000
    first.close()
    second.close()
    assert consistency(path)["vectors"] == 3000


def _run(*argv: str, db: Path) -> subprocess.Popen[str]:
    env = {**os.environ, "PYTHONUNBUFFERED": "1", "OMP_NUM_THREADS": "1"}
    return subprocess.Popen([sys.executable, "bot.py", "--profile", "cpu-fast", "--db", str(db),
                             *argv], cwd=ROOT, env=env, stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, text=True)


def _kill_when(process: subprocess.Popen[str], ready: Any, timeout: float = 240) -> None:
    deadline = time.monotonic() + timeout
    while not ready():
        assert process.poll() is None, process.communicate()
        assert time.monotonic() < deadline, "the command never reached the kill point"
        time.sleep(0.05)
    process.send_signal(signal.SIGKILL)
    process.wait()


def _embedded(db: Path) -> int:
    try:
        return count(db, "SELECT count(*) FROM messages WHERE embedded = 1")
    except Exception:  # not created yet
        return 0


def _next_vectors(db: Path) -> int:
    try:
        return count(db, "SELECT count(*) FROM message_vectors_next")
    except Exception:  # not created yet, or swapped in already
        return 0


@pytest.mark.slow
@pytest.mark.parametrize("command", ["embed", "import", "reembed"])
def test_kill_9_then_one_plain_embed_embeds_everything_once(tmp_path: Path, command: str) -> None:
    db, n = tmp_path / "memory.sqlite3", 1000
    source = export(tmp_path / "export.json", n)
    if command == "import":
        process = _run("import", str(source), db=db)
        # killed while embedding: some chunks written, some claimed, the rest pending
        _kill_when(process, lambda: 0 < _embedded(db) < n)
    else:
        setup = _run("import", str(source), *(["--no-embed"] if command == "embed" else []), db=db)
        assert setup.wait() == 0, setup.communicate()
        process = _run(command, db=db)
        if command == "embed":
            _kill_when(process, lambda: 0 < _embedded(db) < n)
        else:  # reembed: the first chunks written to the new table beside the old one
            _kill_when(process, lambda: 0 < _next_vectors(db) < n)
    before = consistency(db)
    assert before["integrity"] == "ok"
    assert before["messages"] == n
    if command == "reembed":  # issue 31.7: the old vectors stay whole until the swap
        assert before["embedded"] == before["vectors"] == n and before["claims"] == 0
    else:
        assert before["claims"] > 0 or before["embedded"] % 256 == 0  # usually a batch was claimed

    finish = _run("embed", db=db)
    out, err = finish.communicate(timeout=300)
    assert finish.returncode == 0, err
    assert out.strip().splitlines()[-1] == f"embedded {n - before['embedded']} messages"
    after = consistency(db)
    assert after["integrity"] == "ok"
    assert after["messages"] == after["embedded"] == after["vectors"] == after["search_rows"] == n
    assert after["claims"] == 0


# -- 2. two imports of the same data at once ------------------------------------------------


def test_two_writers_storing_the_same_messages_at_once_both_succeed(tmp_path: Path) -> None:
    path = tmp_path / "memory.sqlite3"
    open_storage(path).close()
    batch = records(2000)
    storages = [open_storage(path) for _ in range(2)]
    barrier = threading.Barrier(2)
    results: list[Any] = []

    def write(storage: Storage) -> None:
        barrier.wait()
        try:
            results.append(storage.messages.upsert(batch))
        except Exception as exc:  # the failure this test is about
            results.append(exc)

    threads = [threading.Thread(target=write, args=(s,)) for s in storages]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    for storage in storages:
        storage.close()
    assert not [r for r in results if isinstance(r, Exception)], results
    assert sorted((r.inserted, r.unchanged) for r in results) == [(0, 2000), (2000, 0)]
    state = consistency(path)
    assert state["integrity"] == "ok" and state["messages"] == state["search_rows"] == 2000


@pytest.mark.slow
def test_two_imports_of_one_export_at_once_both_exit_0(tmp_path: Path) -> None:
    db = tmp_path / "memory.sqlite3"
    source = export(tmp_path / "export.json", 3000)
    processes = [_run("import", str(source), "--no-embed", db=db) for _ in range(2)]
    outputs = [p.communicate(timeout=300) for p in processes]
    assert [p.returncode for p in processes] == [0, 0], outputs
    assert all("Traceback" not in err for _, err in outputs)
    state = consistency(db)
    assert state["integrity"] == "ok" and state["messages"] == state["search_rows"] == 3000


# -- 6. the same message id in two channels' exports ---------------------------------------


def test_a_message_keeps_the_channel_it_was_first_stored_in(tmp_path: Path) -> None:
    path = tmp_path / "memory.sqlite3"
    engine = MemoryEngine(path, make_profile(), HashEmbedder(), check_model=False)
    first = records(3, text="kettle")
    engine.ingest(first)
    copy = [replace(r, channel_id=OTHER_CHANNEL, content=f"forged {r.id} teapot") for r in first[:2]]
    stats = engine.storage.messages.upsert(copy)
    assert (stats.inserted, stats.updated, stats.misplaced) == (0, 0, 2)
    stored = engine.storage.messages.hydrate([r.id for r in first])
    assert [(stored[r.id].channel_id, stored[r.id].content) for r in first] == [(CHANNEL, r.content) for r in first]
    # both keyword indexes follow the stored rows: the copy's words find nothing
    assert count(path, "SELECT count(*) FROM search_fts WHERE search_fts MATCH 'teapot'") == 0
    assert count(path, "SELECT count(*) FROM window_fts WHERE window_fts MATCH 'teapot'") == 0
    assert count(path, "SELECT count(*) FROM search_fts WHERE search_fts MATCH 'kettle'") == 3
    engine.close()
    state = consistency(path)
    assert state["integrity"] == "ok" and state["messages"] == state["search_rows"] == 3


def test_an_import_says_how_many_were_stored_in_another_channel(tmp_path: Path) -> None:
    db = tmp_path / "memory.sqlite3"
    source = export(tmp_path / "general.json", 5)
    doc = json.loads(source.read_text())
    doc["channel"] = {"id": str(OTHER_CHANNEL), "name": "random", "type": "GuildTextChat"}
    other = tmp_path / "random.json"
    other.write_text(json.dumps(doc))
    first = _run("import", str(source), "--no-embed", db=db)
    assert first.wait() == 0
    second = _run("import", str(other), "--no-embed", db=db)
    out, err = second.communicate(timeout=120)
    assert second.returncode == 0, err
    assert "0 new" in out and "5 with an id already stored in another channel (not stored)" in out
    assert count(db, f"SELECT count(*) FROM messages WHERE channel_id = {OTHER_CHANNEL}") == 0
