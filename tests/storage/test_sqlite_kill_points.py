"""Issue 21, item 1's "done when": ``kill -9`` during ``embed``, ``import`` or ``reembed``
at any point, and the next plain runs finish the work — every message stored once and
embedded once, nothing lost, SQLite's integrity check ok.

:func:`tests.storage.test_sqlite_crash_recovery.test_kill_9_then_one_plain_embed_embeds_everything_once`
kills each command once, while it embeds, with the real MiniLM.  Here each command is
killed at several moments of its life, chosen by what its database shows:

* ``import`` while it stores (inside one of its storing transactions, and between two),
  once it has stored everything and claimed its first batch, and while it embeds;
* ``embed`` with a batch claimed and nothing written, between two batches, and inside
  the transaction that writes a batch's vectors;
* ``reembed`` (to another model) once its new vector table exists and is empty,
  half-way through filling it, and inside the transaction that swaps it in (issue 31,
  item 7: it no longer drops the vectors first, so the moments before are gone).

How a moment is caught, without sleeping as synchronisation: the command is frozen
(SIGSTOP, then its state is ``stopped``), and while it cannot move, this process asks
SQLite whether it is inside a write transaction (``BEGIN IMMEDIATE`` on another
connection with no busy timeout is refused exactly then) and reads the committed
counts.  At the first frozen moment that matches the case it gets SIGKILL; otherwise
it continues (SIGCONT).  A moment a few milliseconds long (the drop-and-requeue
transaction) can fall between two looks: the case then starts again from its copy, a
few times at most.

After the kill and the plain run that finishes the work, the database must equal one
that a single uninterrupted run made: the same windows, the same vector of every
message and window, the same per-guild vector statistics.

The commands run as real ``bot.py`` processes.  Their embedders are two tiny
sentence-transformers models built here — a ``StaticEmbedding`` over MiniLM's own
tokenizer with seeded random weights, 16 and 32 dimensions — so each case embeds
thousands of messages in seconds through the same code path as any other model.
"""

from __future__ import annotations

import os
import re
import shutil
import signal
import subprocess
import sys
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import psutil
import pytest

from memory.storage.sqlite.connection import connect
from tests.storage.test_sqlite_crash_recovery import consistency, export
from tests.support.inspection import SQLiteInspector
from tests.support.sqlite import sql_rows

ROOT = Path(__file__).resolve().parents[2]
N = 3000  # 12 embedding batches; two or three storing transactions

pytestmark = [pytest.mark.slow, pytest.mark.usefixtures("single_torch_thread")]

State = dict[str, int]


@dataclass(frozen=True)
class KillPoint:
    """When to kill a command: inside one of its write transactions or between two, at
    the first frozen moment whose committed counts satisfy ``ready``."""

    command: str
    inside_write: bool
    ready: Callable[[State], bool]


KILL_POINTS = {
    "import-inside-a-storing-transaction": KillPoint(
        "import", True, lambda s: 0 < s["messages"] < N),
    "import-between-storing-transactions": KillPoint(
        "import", False, lambda s: 0 < s["messages"] < N),
    "import-all-stored-first-batch-claimed": KillPoint(
        "import", False, lambda s: s["messages"] == N and s["claims"] > 0 and s["embedded"] == 0),
    "import-embedding": KillPoint("import", False, lambda s: 0 < s["embedded"] < N),
    "embed-batch-claimed-nothing-written": KillPoint(
        "embed", False, lambda s: s["claims"] > 0 and s["embedded"] == 0),
    "embed-between-batches": KillPoint("embed", False, lambda s: 0 < s["embedded"] < N),
    "embed-inside-a-vector-write": KillPoint(  # claims > 0: not inside the next claim
        "embed", True, lambda s: s["claims"] > 0 and 0 < s["embedded"] < N),
    "reembed-new-table-empty": KillPoint("reembed", False, lambda s: s["next"] == 0),
    "reembed-new-table-half-full": KillPoint("reembed", False, lambda s: 0 < s["next"] < N),
    "reembed-inside-the-swap": KillPoint("reembed", True, lambda s: s["next"] == N),
}


@pytest.fixture(scope="module")
def profiles(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    """Two profiles, ``old`` (16 dims) and ``new`` (32 dims), each with a tiny static model."""
    import torch
    from sentence_transformers import SentenceTransformer
    from sentence_transformers.sentence_transformer.modules import Normalize, StaticEmbedding
    from tokenizers import Tokenizer

    from memory.embedder import resolve_model

    tokenizer = Tokenizer.from_file(str(Path(resolve_model("all-MiniLM-L6-v2")[1]) /
                                        "tokenizer.json"))
    folder = tmp_path_factory.mktemp("static-models")
    made = {}
    for seed, (name, dimension) in enumerate((("old", 16), ("new", 32))):
        torch.manual_seed(seed)
        model = SentenceTransformer(
            modules=[StaticEmbedding(tokenizer, embedding_dim=dimension), Normalize()],
            device="cpu")
        model.save(str(folder / name))
        made[name] = folder / f"{name}.toml"
        made[name].write_text(f'[embedder]\nmodel = "{folder / name}"\ndevice = "cpu"\n\n'
                              '[reranker]\nbackend = "none"\n', encoding="utf-8")
    return made


def cli(*argv: str, db: Path, profile: Path) -> subprocess.Popen[str]:
    env = {**os.environ, "PYTHONUNBUFFERED": "1", "OMP_NUM_THREADS": "1"}
    return subprocess.Popen([sys.executable, "bot.py", "--profile", str(profile), "--db", str(db),
                             *argv], cwd=ROOT, env=env, stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, text=True)


def finish(*argv: str, db: Path, profile: Path) -> tuple[int, str, str]:
    process = cli(*argv, db=db, profile=profile)
    out, err = process.communicate(timeout=300)
    return process.returncode, out, err


class Observer:
    """This test's own connection to the command's database, and no busy timeout."""

    def __init__(self, db: Path) -> None:
        self.conn = connect(db)
        self.conn.execute("PRAGMA busy_timeout = 0")

    def in_write_transaction(self) -> bool:
        """Whether another connection holds SQLite's write lock (is inside a write transaction)."""
        try:
            self.conn.execute("BEGIN IMMEDIATE")
        except Exception as exc:
            if "locked" in str(exc) or "busy" in str(exc):
                return True
            raise
        self.conn.execute("ROLLBACK")
        return False

    def state(self) -> State:
        """The committed counts (one read transaction)."""
        self.conn.execute("BEGIN")
        try:
            has_vectors = self.conn.execute(
                "SELECT count(*) FROM sqlite_master WHERE name = 'message_vectors'").fetchone()[0]
            return {
                "messages": self.conn.execute("SELECT count(*) FROM messages").fetchone()[0],
                "embedded": self.conn.execute(
                    "SELECT count(*) FROM messages WHERE embedded = 1").fetchone()[0],
                "vectors": self.conn.execute(
                    "SELECT count(*) FROM message_vectors").fetchone()[0] if has_vectors else 0,
                "claims": self.conn.execute("SELECT count(*) FROM embedding_claims").fetchone()[0],
                "next": next_vectors(self.conn),
            }
        finally:
            self.conn.execute("ROLLBACK")

    def close(self) -> None:
        self.conn.close()


def next_vectors(conn: Any) -> int:
    """Rows in the vector table ``reembed`` is building; -1 when there is none."""
    if not conn.execute(
            "SELECT count(*) FROM sqlite_master WHERE name = 'message_vectors_next'").fetchone()[0]:
        return -1
    return int(conn.execute("SELECT count(*) FROM message_vectors_next").fetchone()[0])


def kill_at(process: subprocess.Popen[str], observer: Observer,
            point: KillPoint) -> State | None:
    """Freeze ``process`` again and again; SIGKILL it at the first moment that fits ``point``.

    Returns:
        The committed counts at that moment, or ``None`` if the command ended first
        (it ran past a short moment between two looks).
    """
    frozen = psutil.Process(process.pid)
    while True:
        process.send_signal(signal.SIGSTOP)
        while frozen.status() != psutil.STATUS_STOPPED:
            if process.poll() is not None:
                _, err = process.communicate()
                assert process.returncode == 0, err
                return None
        try:
            inside = observer.in_write_transaction()
            state = observer.state() if inside == point.inside_write else {}
        except Exception as exc:  # it was frozen holding a lock that reads need too
            assert "locked" in str(exc) or "busy" in str(exc), exc
            inside, state = None, {}
        if inside == point.inside_write and point.ready(state):
            process.send_signal(signal.SIGKILL)
            process.wait()
            return state
        process.send_signal(signal.SIGCONT)
        time.sleep(0.002)  # let it run between two looks (the sampling period)


@pytest.fixture(scope="module")
def starts(tmp_path_factory: pytest.TempPathFactory, profiles: dict[str, Path]) -> dict[str, Path]:
    """The database each command starts from (copied per case), and the export.

    ``import`` starts from an empty database (opened once, as by an earlier run: the
    observer needs the file), ``embed`` from the export stored but not embedded, and
    ``reembed`` from the export embedded with the ``old`` model.  ``old`` and ``new``:
    the export stored and embedded by one uninterrupted run of each model, what every
    case must end up equal to.
    """
    from memory.config import load_profile
    from memory.engine import MemoryEngine

    folder = tmp_path_factory.mktemp("starts")
    made = {"export": export(folder / "export.json", N)}
    for name, stored, embedded in (("import", False, False), ("embed", True, False),
                                   ("reembed", True, True), ("new", True, True)):
        made[name] = folder / f"{name}.sqlite3"
        engine = MemoryEngine(made[name], load_profile(str(profiles[name if name == "new"
                                                                    else "old"])),
                              load_reranker=False)
        if stored:
            engine.import_exports([made["export"]], embed=embedded)
        engine.close()
        assert not Path(f"{made[name]}-wal").exists()  # all in the file: one copy is whole
    made["old"] = made["reembed"]
    return made


def fingerprint(db: Path) -> dict[str, Any]:
    """What a finished run leaves: the windows' text, every vector and window vector."""
    inspect = SQLiteInspector(str(db))
    inspect.check_vector_statistics()
    return {
        "windows": sql_rows(db, "SELECT id, context, context_ids FROM search_text ORDER BY id"),
        "vectors": inspect.every_vector(),
        "window_vectors": {mid: np.frombuffer(blob, np.float16) for mid, blob in sql_rows(
            db, "SELECT id, vector FROM window_vectors")},
    }


def assert_same(finished: dict[str, Any], reference: dict[str, Any]) -> None:
    assert finished["windows"] == reference["windows"]
    for key, tolerance in (("vectors", 1e-6), ("window_vectors", 2e-3)):
        assert finished[key].keys() == reference[key].keys(), key
        for mid, vector in reference[key].items():
            np.testing.assert_allclose(finished[key][mid].astype(np.float32),
                                       vector.astype(np.float32), atol=tolerance)


def run_and_kill(point: KillPoint, db: Path, start: Path, argv: tuple[str, ...],
                 profile: Path, attempts: int = 3) -> State:
    """Start the command on a copy of ``start`` and kill it at ``point`` (a few tries)."""
    for _ in range(attempts):
        for leftover in (Path(f"{db}-wal"), Path(f"{db}-shm")):  # a killed try's
            leftover.unlink(missing_ok=True)
        shutil.copyfile(start, db)
        process = cli(*argv, db=db, profile=profile)
        observer = Observer(db)
        try:
            state = kill_at(process, observer, point)
        finally:
            observer.close()
            if process.poll() is None:
                process.kill()
                process.wait()
        if state is not None:
            return state
    raise AssertionError(f"{argv[0]} ran past the kill point {attempts} times")


def model(db: Path) -> tuple[str, int]:
    conn = connect(db)
    try:
        rows = dict(conn.execute("SELECT key, value FROM meta WHERE key LIKE 'embedding_%'"))
    finally:
        conn.close()
    return Path(rows["embedding_model"]).name, int(rows["embedding_dim"])


@pytest.mark.parametrize("name", list(KILL_POINTS))
def test_kill_9_at_any_point_then_a_plain_run_finishes_the_work(
    tmp_path: Path, profiles: dict[str, Path], starts: dict[str, Path], name: str
) -> None:
    point = KILL_POINTS[name]
    db, source = tmp_path / "memory.sqlite3", starts["export"]
    profile = profiles["new" if point.command == "reembed" else "old"]
    argv = {"import": ("import", str(source)), "embed": ("embed",), "reembed": ("reembed",)}
    at_kill = run_and_kill(point, db, starts[point.command], argv[point.command], profile)

    killed = consistency(db)
    assert killed["integrity"] == "ok"
    # what is committed is what the frozen process showed, and nothing of it is half-done
    assert {k: killed[k] for k in at_kill if k != "next"} == {
        k: v for k, v in at_kill.items() if k != "next"}
    assert killed["embedded"] == killed["vectors"] and killed["search_rows"] == killed["messages"]
    stored, embedded = killed["messages"], killed["embedded"]

    if point.command == "import":  # the same import again: stores the rest, embeds the backlog
        code, out, err = finish("import", str(source), db=db, profile=profile)
        assert code == 0, err
        assert f"{N - stored} new, 0 updated, {stored} unchanged, 0 skipped, " \
               f"{N - embedded} embedded" in out, out
    elif point.command == "reembed":  # the old model is bound and whole, searched until the swap
        assert model(db) == ("old", 16) and embedded == N
        code, _, err = finish("embed", db=db, profile=profile)  # refused in one line, data kept
        assert code == 2 and "reembed" in err and len(err.strip().splitlines()) == 1, err
        assert consistency(db) == killed
        code, out, err = finish("reembed", db=db, profile=profile)  # carries on where it stopped
        left = N - max(at_kill["next"], 0)
        assert code == 0 and re.fullmatch(rf"re-embedded {left} messages with .*new", out.strip()), err
    else:
        code, out, err = finish("embed", db=db, profile=profile)
        assert code == 0, err
        assert out.strip().splitlines()[-1] == f"embedded {N - embedded} messages"

    after = consistency(db)
    assert after["integrity"] == "ok"
    assert after["messages"] == after["embedded"] == after["vectors"] == after["search_rows"] == N
    assert after["claims"] == 0
    reference = "new" if point.command == "reembed" else "old"
    assert model(db) == ((reference, 32 if reference == "new" else 16))
    assert_same(fingerprint(db), fingerprint(starts[reference]))  # as if never interrupted
