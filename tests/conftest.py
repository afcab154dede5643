"""Shared fixtures: real temporary SQLite databases, a deterministic fake embedder,
a record factory, and the bundled MiniLM loaded once per session.

Only models are faked (house style, Tests §13): every test that touches storage goes
through a real database file with sqlite-vec and FTS5 loaded by
``memory.storage.sqlite.connection.connect``.  A test that must look at the SQLite
file itself (what the storage contract does not say) opens its own connection with
:func:`sql_rows` / :func:`sql_write`, never a storage object's private connection.
"""

from __future__ import annotations

import hashlib
import re
from collections.abc import Callable, Iterator, Sequence
from dataclasses import replace
from datetime import datetime, timezone
from pathlib import Path
from typing import Any

import numpy as np
import pytest

from memory.config import EmbedderConfig, Profile, RerankerConfig, SearchConfig
from memory.engine import MemoryEngine
from memory.records import DISCORD_EPOCH_MS, MessageRecord
from memory.storage.sqlite.connection import connect

# the session's PostgreSQL server and fresh databases on it (tests marked `postgres`), and
# the fixtures of tests that run once per storage engine
pytest_plugins = ["tests.postgres_server", "tests.engines"]

GUILD = 111_111_111_111_111_111
CHANNEL = 222_222_222_222_222_222
# 2026-01-01T00:00:00Z: a fixed "now" so recency bonuses are reproducible.
BASE_MS = 1_767_225_600_000
NOW = datetime(2026, 1, 1, tzinfo=timezone.utc)

_WORD = re.compile(r"[^\W_]+", re.UNICODE)


class HashEmbedder:
    """A deterministic stand-in for a sentence embedder.

    Each text becomes a signed, hashed bag of its lower-cased words (weight 1) and the
    character trigrams of those words (weight 0.5) in ``dimension`` dims, L2-normalised.
    Texts that share words are close; unrelated texts are near-orthogonal.  Hashing
    uses ``hashlib`` so vectors are identical across runs (``hash()`` is salted).
    """

    def __init__(self, dimension: int = 128, model_id: str | None = None) -> None:
        self.dimension = dimension
        self.model_id = model_id or f"test/hash-{dimension}"
        self.calls = 0

    def _features(self, text: str) -> Iterator[tuple[str, float]]:
        for word in _WORD.findall(text.lower()):
            yield "w:" + word, 1.0
            padded = f"#{word}#"
            for i in range(len(padded) - 2):
                yield "t:" + padded[i : i + 3], 0.5

    def _vector(self, text: str) -> np.ndarray:
        vec = np.zeros(self.dimension, dtype=np.float64)
        for feature, weight in self._features(text):
            digest = hashlib.blake2b(
                feature.encode("utf-8", "surrogatepass"), digest_size=8
            ).digest()
            value = int.from_bytes(digest, "little")
            sign = 1.0 if value & 1 else -1.0
            vec[(value >> 1) % self.dimension] += sign * weight
        norm = np.linalg.norm(vec)
        if norm == 0.0:  # no words at all: a fixed unit vector, never NaN
            vec[0], norm = 1.0, 1.0
        return (vec / norm).astype(np.float32)

    def embed(self, texts: Sequence[str]) -> np.ndarray:
        """Return an ``(len(texts), dimension)`` float32 array of unit vectors."""
        self.calls += 1
        if not texts:
            return np.zeros((0, self.dimension), dtype=np.float32)
        return np.stack([self._vector(t) for t in texts])


def snowflake(created_ms: int, sequence: int = 0) -> int:
    """A Discord snowflake whose timestamp part is ``created_ms``."""
    return ((created_ms - DISCORD_EPOCH_MS) << 22) | (sequence & 0x3FFFFF)


def make_profile(**search: Any) -> Profile:
    """The test profile: defaults, no reranker, optional ``[search]`` overrides."""
    return Profile(
        name="test",
        search=replace(SearchConfig(), **search),
        reranker=RerankerConfig(backend="none"),
    )


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


def sql_rows(location: str | Path, sql: str, params: Sequence[Any] = ()) -> list[tuple]:
    """Rows of one read of the SQLite file at ``location``, on a connection of its own."""
    conn = connect(location, read_only=True)
    try:
        return conn.execute(sql, params).fetchall()
    finally:
        conn.close()


def sql_write(location: str | Path, *statements: str) -> None:
    """Run ``statements`` on the SQLite file at ``location`` in one transaction of their own
    (what another process, or an older version of the bot, would have written)."""
    conn = connect(location)
    try:
        conn.execute("BEGIN IMMEDIATE")
        for statement in statements:
            conn.execute(statement)
        conn.execute("COMMIT")
    finally:
        conn.close()


def record_factory() -> Callable[..., MessageRecord]:
    """Return a factory for :class:`MessageRecord` with sensible defaults.

    ``age_days`` (before :data:`NOW`, default 1) or ``created_at`` set the time; the
    id is a snowflake of that time plus a per-factory sequence, so ids are unique.
    Any other keyword overrides the field of that name.
    """
    counter = iter(range(1, 1 << 22))

    def factory(content: str = "hello world", **fields: Any) -> MessageRecord:
        age_days = fields.pop("age_days", 1.0)
        created = fields.pop("created_at", None)
        if created is None:
            created = BASE_MS - int(age_days * 86_400_000)
        author_id = fields.pop("author_id", 1)
        defaults: dict[str, Any] = {
            "id": snowflake(created, next(counter)),
            "guild_id": GUILD,
            "channel_id": CHANNEL,
            "author_id": author_id,
            "created_at": created,
            "content": content,
            "author_name": f"user{author_id}",
            "author_display_name": f"User{author_id}",
            "guild_name": "Test guild",
            "channel_name": "general",
        }
        defaults.update(fields)
        return MessageRecord(**defaults)

    return factory


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

    def forbidden(name: str) -> Callable[..., None]:
        def call(*args: object, **kwargs: object) -> None:
            raise AssertionError(f"torch.cuda.{name} called on a CPU-only run")

        return call

    import torch

    for name in CUDA_ONLY:
        monkeypatch.setattr(torch.cuda, name, forbidden(name))
