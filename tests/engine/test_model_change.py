"""Issue 21, item 5: the embedding model changes under a running process.

A second real embedder, built locally: the bundled all-MiniLM-L6-v2 followed by a
sentence-transformers ``Dense`` layer down to 128 dimensions (random weights) — a
different model and size, as a profile switch to another embedder would bring.
``reembed`` with it runs as a real ``bot.py`` subprocess while this process holds an
engine on the same file with the 384-dimension MiniLM: that engine writes no vector of
the wrong model, says why in one line, and searches by keywords only until it reopens.
"""

from __future__ import annotations

import json
import subprocess
import sys
from dataclasses import replace
from pathlib import Path

import pytest

from memory.config import load_profile
from memory.engine import MemoryEngine
from memory.errors import EmbeddingModelChanged
from memory.search import SearchRequest
from memory.storage.sqlite.connection import connect
from tests.storage.test_sqlite_crash_recovery import GUILD, consistency, export, records

ROOT = Path(__file__).resolve().parents[2]

pytestmark = [pytest.mark.slow, pytest.mark.usefixtures("single_torch_thread")]


@pytest.fixture(scope="module")
def small_profile(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A profile whose embedder is MiniLM + Dense(384 → 128), saved to a folder."""
    from sentence_transformers import SentenceTransformer
    from sentence_transformers.sentence_transformer.modules import Dense, Normalize

    from memory.embedder import resolve_model

    folder = tmp_path_factory.mktemp("minilm-128")
    base = SentenceTransformer(resolve_model("all-MiniLM-L6-v2")[1], device="cpu")
    dense = Dense(in_features=384, out_features=128)
    SentenceTransformer(modules=[*base, dense, Normalize()], device="cpu").save(
        str(folder / "model"))
    profile = folder / "small.toml"
    profile.write_text(f'[embedder]\nmodel = "{folder / "model"}"\ndevice = "cpu"\n\n'
                       '[reranker]\nbackend = "none"\n', encoding="utf-8")
    return profile


def cli(*argv: str, db: Path, profile: str | Path = "cpu-fast") -> subprocess.Popen[str]:
    return subprocess.Popen([sys.executable, "bot.py", "--profile", str(profile), "--db", str(db),
                             *argv], cwd=ROOT, stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                            text=True)


def vector_size(db: Path) -> int:
    conn = connect(db)
    try:
        return int(conn.execute("SELECT value FROM meta WHERE key = 'embedding_dim'").fetchone()[0])
    finally:
        conn.close()


def test_a_running_engine_stops_writing_vectors_and_searches_by_keywords(
    tmp_path: Path, small_profile: Path
) -> None:
    db = tmp_path / "memory.sqlite3"
    source = export(tmp_path / "export.json", 300)
    assert cli("import", str(source), db=db).wait() == 0
    running = MemoryEngine(db, load_profile("cpu-fast"), load_reranker=False)
    request = SearchRequest(queries=["laser cutter"], guild_id=GUILD, limit=5, rerank=False)
    assert running.search(request).trace.keyword_only is None
    newest = records(300)[-1]  # the channel's last message: a live one comes after it
    fresh = replace(newest, id=newest.id + 1, content="a message that just came in")
    running.storage.messages.upsert([fresh])
    pending = running.storage.backlog.pending(10)  # read before the other process re-embeds
    assert [m.id for m in pending] == [fresh.id]

    reembed = cli("reembed", db=db, profile=small_profile)
    _, err = reembed.communicate(timeout=300)
    assert reembed.returncode == 0, err
    assert vector_size(db) == 128

    result = running.search(request)  # keyword search, with the reason
    assert result.hits and "re-embedded with" in (result.trace.keyword_only or "")
    assert "\n" not in (result.trace.keyword_only or "")
    vectors = running.embedder.embed([running.embedding_text(m) for m in pending])
    with pytest.raises(EmbeddingModelChanged, match="re-embedded with .*keywords only"):
        running.storage.backlog.write_vectors(pending, vectors)
    running.close()

    state = consistency(db)
    assert state["integrity"] == "ok"
    assert state["messages"] == state["embedded"] == state["vectors"] == state["search_rows"] == 301
    assert vector_size(db) == 128  # nothing of the 384-dimension model got in


def test_an_engine_whose_model_was_replaced_embeds_nothing_and_a_new_process_is_refused(
    tmp_path: Path, small_profile: Path
) -> None:
    db = tmp_path / "memory.sqlite3"
    first = export(tmp_path / "first.json", 50)
    assert cli("import", str(first), db=db).wait() == 0
    engine = MemoryEngine(db, load_profile("cpu-fast"), load_reranker=False)
    second = export(tmp_path / "second.json", 400)
    doc = json.loads(second.read_text())
    doc["channel"] = {"id": "902", "name": "second", "type": "GuildTextChat"}
    for i, message in enumerate(doc["messages"]):
        message["id"] = str(int(message["id"]) + 10_000_000 + i)
    second.write_text(json.dumps(doc))
    engine.import_exports([second], embed=False)  # stored; its vectors still to come
    assert cli("reembed", db=db, profile=small_profile).wait() == 0

    newest = records(50)[-1]
    late_message = replace(newest, id=newest.id + 1, content="sent after the reembed")
    engine.storage.messages.upsert([late_message])
    with pytest.raises(EmbeddingModelChanged) as caught:  # the engine's own embed pass
        engine.embed_pending()
    assert "\n" not in str(caught.value)
    engine.close()

    late = cli("embed", db=db)  # a new process with the old profile: refused at the door
    _, err = late.communicate(timeout=300)
    lines = [line for line in err.splitlines() if line.strip()]
    assert late.returncode == 2 and len(lines) == 1 and lines[0].startswith("error: "), err
    assert "reembed" in lines[0]
    state = consistency(db)
    assert state["integrity"] == "ok" and state["messages"] == state["search_rows"] == 451
    assert state["vectors"] == state["embedded"] == 450 and vector_size(db) == 128
