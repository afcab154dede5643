"""Shared fixtures: real temporary SQLite databases, a deterministic fake embedder,
a record factory, and the bundled MiniLM loaded once per session.

Only models are faked (house style, Tests §13): every test that touches storage goes
through a real database file with sqlite-vec and FTS5 loaded by
``memory.storage.sqlite.connection.connect``.  A test that must look at the SQLite
file itself (what the storage contract does not say) opens its own connection with
:func:`tests.support.sqlite.sql_rows` / ``sql_write``, never a storage object's private connection.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from dataclasses import replace
from pathlib import Path
from typing import Any

import pytest

from memory.config import EmbedderConfig, Profile, RerankerConfig
from memory.engine import MemoryEngine
from memory.records import MessageRecord
from tests.support.builders import (  # noqa: F401  (re-exported: the fixtures' vocabulary)
    BASE_MS,
    CHANNEL,
    GUILD,
    NOW,
    HashEmbedder,
    make_profile,
    record_factory,
    snowflake,
)

# the session's PostgreSQL server and fresh databases on it (tests marked `postgres`), and
# the fixtures of tests that run once per storage engine
pytest_plugins = ["tests.support.postgres", "tests.support.engines"]

@pytest.fixture
def tmp_db(tmp_path: Path) -> Path:
    """Path of a fresh database file (created on first open)."""
    return tmp_path / "memory.sqlite3"


@pytest.fixture
def hash_embedder() -> HashEmbedder:
    """A fresh deterministic fake embedder (128 dims)."""
    return HashEmbedder()


@pytest.fixture
def engine(tmp_db: Path, hash_embedder: HashEmbedder) -> Iterator[MemoryEngine]:
    """An engine on a temporary database with the fake embedder and no reranker."""
    eng = MemoryEngine(tmp_db, Profile(name="test", reranker=RerankerConfig(backend="none")),
                       hash_embedder)
    yield eng
    eng.close()


@pytest.fixture
def make_engine(tmp_db: Path) -> Iterator[Callable[..., MemoryEngine]]:
    """Factory for engines with custom embedder/search settings; all closed at teardown."""
    opened: list[MemoryEngine] = []

    def factory(
        db: Path | None = None,
        embedder: Any = None,
        *,
        context: str = "short",
        check_model: bool = True,
        **search: Any,
    ) -> MemoryEngine:
        profile = replace(make_profile(**search), embedder=EmbedderConfig(context=context))
        eng = MemoryEngine(db or tmp_db, profile,
                           embedder or HashEmbedder(), check_model=check_model)
        opened.append(eng)
        return eng

    yield factory
    for eng in opened:
        eng.close()


@pytest.fixture
def make_record() -> Callable[..., MessageRecord]:
    """Factory for :class:`MessageRecord` (see :func:`record_factory`)."""
    return record_factory()


@pytest.fixture(scope="module")
def single_torch_thread() -> Iterator[None]:
    """Run torch on one thread for the module that uses the real MiniLM.

    On an oversubscribed 2-core machine torch's 2-thread pool spins on its barriers:
    a one-line query took ~700 ms instead of ~20 ms.  One thread gives the same
    vectors and keeps the suite's time predictable; nothing here measures speed.
    """
    import torch

    before = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(before)


@pytest.fixture
def fresh_dynamo() -> Iterator[None]:
    """Compile from scratch, and leave nothing compiled behind: dynamo keeps a function's
    compiled code across tests (and test files), so a backend one test used would answer
    for the backend another test gives."""
    import torch

    torch.compiler.reset()
    yield
    torch.compiler.reset()


@pytest.fixture(scope="session")
def minilm():
    """The real bundled all-MiniLM-L6-v2, loaded once for the whole session."""
    from memory.embedder import SentenceTransformerEmbedder

    embedder = SentenceTransformerEmbedder(EmbedderConfig())
    embedder.embed(["warm up"])
    return embedder


# torch.cuda entry points that need a CUDA build and device (issue 11 static path).
CUDA_ONLY = [
    "CUDAGraph", "graph", "graph_pool_handle", "Stream", "current_stream", "stream",
    "synchronize", "empty_cache", "get_device_name", "set_device",
]


@pytest.fixture
def cuda_forbidden(monkeypatch: pytest.MonkeyPatch) -> None:
    """Every CUDA-only torch entry point the reranker could reach raises if called."""

    def forbidden(name: str) -> type:
        def call(*args: object, **kwargs: object) -> None:
            raise AssertionError(f"torch.cuda.{name} called on a CPU-only run")

        # A class whose construction raises, not a function: a library imported while
        # the guard is up may evaluate `torch.cuda.CUDAGraph | None` (transformers 5.24
        # does), which a function would break with a TypeError.
        return type(name, (), {"__new__": staticmethod(call)})

    import torch

    for name in CUDA_ONLY:
        monkeypatch.setattr(torch.cuda, name, forbidden(name))
