"""Builders every suite shares: ids, records, profiles, and a deterministic embedder.

Only models are faked (house style, Tests §13): :class:`HashEmbedder` stands in for a
sentence embedder; everything else the tests build is real.
"""

from __future__ import annotations

import hashlib
import re
from collections.abc import Callable, Iterator, Sequence
from dataclasses import replace
from datetime import datetime, timezone
from typing import Any

import numpy as np

from memory.config import Profile, RerankerConfig, SearchConfig
from memory.records import DISCORD_EPOCH_MS, MessageRecord

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
