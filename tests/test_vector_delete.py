"""Deleting vectors by primary-key lookups (few ids) or one scan (many) leaves the same state."""

from __future__ import annotations

import numpy as np
import pytest

from memory.storage.sqlite import vectors


@pytest.mark.parametrize("point_lookups_max", [0, 1000])
def test_deleted_vectors_and_their_code_counts_go_either_way(
    engine, make_record, monkeypatch, point_lookups_max
):
    monkeypatch.setattr(vectors, "POINT_LOOKUPS_MAX", point_lookups_max)
    records = [make_record(f"note {i} about tomatoes") for i in range(30)]
    engine.ingest(records)
    store = engine.store
    kept = records[10:]
    removed = engine.delete([r.id for r in records[:10]] + [123456789])  # one never stored
    assert removed == 10
    left = {row[0] for row in store._query("SELECT message_id FROM message_vectors")}
    assert left <= {r.id for r in kept}, "no deleted message keeps a vector"
    assert len(left) >= len(kept) - 2, "only neighbours that quoted them wait to be re-embedded"
    # the code counts are those of the vectors that are left
    (count, ones), = store._query("SELECT vectors, ones FROM code_stats")
    floats = store.vectors.floats(sorted(left))
    expected = sum((np.asarray(v) > 0).astype(np.int64) for v in floats.values())
    assert count == len(left)
    assert np.array_equal(np.frombuffer(ones, dtype=np.int64), expected)
