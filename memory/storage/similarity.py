"""The similarity floor, on either engine: how similar random pairs of a guild's
messages are, so that a dense hit below it is known for noise.

It is computed from up to :data:`SAMPLE` stored vectors spread evenly over the
guild's history (the same floor for the same messages), kept in ``meta`` under
``similarity_floor:<guild>`` and computed again when the guild's vectors have grown
by half; ``None`` while fewer than :data:`MIN_VECTORS` are stored.  Both engines'
``VectorIndex.similarity_floor`` call :func:`similarity_floor` with their own vector
count and reader.
"""

from __future__ import annotations

import json
from collections.abc import Callable, Sequence
from typing import Any

import numpy as np

from memory.storage.dialect import Dialect

__all__ = ["MIN_VECTORS", "SAMPLE", "similarity_floor"]

SAMPLE = 400
MIN_VECTORS = 20


def similarity_floor(
    database: Any, meta: Any, dialect: Dialect, *, guild_id: int | None, quantile: float,
    count: int, floats: Callable[[Sequence[int]], dict[int, np.ndarray]],
) -> float | None:
    """The cosine similarity that random pairs of a guild's messages reach at ``quantile``.

    Args:
        database: The engine's database (``read``, ``read_only``).
        meta: Its ``Meta`` (the cache).
        dialect: How its SQL differs from the shared SQL.
        guild_id: The guild, or ``None`` for every guild.
        quantile: Which quantile of the pairs' similarities.
        count: How many vectors the guild has now.
        floats: Reads stored vectors by message id.

    Returns:
        The floor, or ``None`` while fewer than :data:`MIN_VECTORS` vectors are stored.
    """
    key = f"similarity_floor:{guild_id if guild_id is not None else 'all'}"
    if count < MIN_VECTORS:
        return None
    cached = json.loads(meta.get(key) or "{}")
    if cached.get("quantile") == quantile and cached.get("vectors", 0) * 1.5 >= count:
        return float(cached["floor"])
    where, params = ("guild_id = ? AND ", [guild_id]) if guild_id is not None else ("", [])
    # evenly spaced over the guild's history: the same floor for the same messages
    sample = [row[0] for row in database.read(dialect.sql(
        f"SELECT id FROM (SELECT id, row_number() OVER (ORDER BY id) AS n FROM messages "
        f"WHERE {where}embedded = TRUE) s WHERE n % ? = 0 LIMIT {SAMPLE}"),
        [*params, max(1, count // SAMPLE)])]
    found = floats(sample)
    vectors = np.array([found[i] for i in sample if i in found], dtype=np.float32)
    vectors /= np.maximum(np.linalg.norm(vectors, axis=1, keepdims=True), 1e-12)
    pairs = (vectors @ vectors.T)[np.triu_indices(len(vectors), k=1)]
    floor = round(float(np.quantile(pairs, quantile)), 4)
    if not database.read_only:
        meta.set(key, json.dumps({"quantile": quantile, "vectors": count, "floor": floor}))
    return floor
