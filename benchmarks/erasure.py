"""``bench secure-delete``: what erasing deleted text from the file costs in write speed.

The same synthetic server is stored, embedded and then partly forgotten twice in
one run, on two fresh databases: once as the store works now (``secure_delete``,
FTS5 ``secure-delete``, the write-ahead log emptied after each forgetting
transaction; :mod:`memory.storage.sqlite.scrub`) and once without any of it, as before.  The
vectors are random (an embedder's speed is not what is measured; writing them is).
Last, the one-time scrub an older database gets on its first open is timed on the
copy written without erasing.
"""

from __future__ import annotations

import random
import tempfile
import time
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import numpy as np

from benchmarks.common import machine_description, percentile
from benchmarks.scale import SCALE_GUILD, synthetic_records
from memory.records import MessageRecord
from memory.storage import Storage, open_storage

DIMENSION = 384  # the bundled MiniLM's
IMPORT_CHUNK = 1000
EMBED_CHUNK = 256
SINGLE_DELETES = 200
EDITS = 200


def run_secure_delete(
    sizes: Sequence[int], *, repeats: int = 2, db_dir: str | Path | None = None
) -> dict[str, Any]:
    """Time import, embedding writes, edits and every kind of forgetting, erasing on and off.

    Off and on take turns ``repeats`` times (a shared machine's noise hits both
    alike); each figure is the median of its runs.
    """
    rows = []
    for size in sizes:
        records = synthetic_records(size)
        runs: dict[str, list[dict[str, Any]]] = {"off": [], "on": []}
        with tempfile.TemporaryDirectory(prefix="memory-erasure-", dir=db_dir) as tmp:
            for turn in range(repeats):
                for mode, erase in (("off", False), ("on", True)):
                    path = Path(tmp) / f"{mode}-{turn}.sqlite3"
                    runs[mode].append(_one_run(path, records, erase))
            scrub_s = _time_scrub(Path(tmp) / "off-0.sqlite3")
        row: dict[str, Any] = {"messages": size, "repeats": repeats}
        row.update({mode: _medians(results) for mode, results in runs.items()})
        row["scrub_once_s"] = scrub_s
        row["on_vs_off"] = {key: round(row["on"][key] / row["off"][key], 2)
                            for key in row["on"] if isinstance(row["on"][key], float)
                            and row["off"][key]}
        rows.append(row)
    return {"machine": machine_description(), "dimension": DIMENSION, "sizes": rows}


def _medians(results: list[dict[str, Any]]) -> dict[str, Any]:
    return {key: (round(float(np.median([r[key] for r in results])), 3)
                  if isinstance(results[0][key], float) else results[0][key])
            for key in results[0]}


def _one_run(path: Path, records: list[MessageRecord], erase: bool) -> dict[str, Any]:
    storage = open_storage(path, erase_deleted=erase)
    try:
        storage.meta.bind_model("bench/random", DIMENSION)
        result: dict[str, Any] = {}
        started = time.perf_counter()
        for start in range(0, len(records), IMPORT_CHUNK):
            storage.messages.upsert(records[start : start + IMPORT_CHUNK])
        result["import_msgs_per_s"] = round(len(records) / (time.perf_counter() - started), 1)
        result["vector_writes_per_s"] = round(_write_vectors(storage), 1)
        result.update(_edits_and_deletes(storage, records))
        result["file_mb"] = round(path.stat().st_size / 1e6, 1)
    finally:
        storage.close()
    return result


def _write_vectors(storage: Storage) -> float:
    """Vectors written per second (random unit vectors, claimed and written as import does)."""
    rng = np.random.default_rng(0)
    done, seconds = 0, 0.0
    while batch := storage.backlog.claim(EMBED_CHUNK, owner="bench"):
        vectors = rng.standard_normal((len(batch), DIMENSION)).astype(np.float32)
        vectors /= np.linalg.norm(vectors, axis=1, keepdims=True)
        started = time.perf_counter()
        storage.backlog.write_vectors(batch, vectors, owner="bench")
        seconds += time.perf_counter() - started
        done += len(batch)
    return done / seconds


def _edits_and_deletes(storage: Storage, records: list[MessageRecord]) -> dict[str, Any]:
    """Per-message edits and deletes (p50/p95 ms), then forget-me, purge-channel, retention.

    The result keys keep the names BENCHMARKS.md records them under (``purge_channel``
    is ``forget_channels``, ``retention_purge`` is ``forget_older_than``).
    """
    rng = random.Random(3)
    picked = rng.sample(records, min(len(records), EDITS + SINGLE_DELETES))
    edit_ms, delete_ms = [], []
    for record in picked[:EDITS]:
        edited = MessageRecord(**{**vars(record), "content": record.content + " (edited)",
                                  "edited_at": record.created_at + 1000})
        started = time.perf_counter()
        storage.messages.upsert([edited])
        edit_ms.append((time.perf_counter() - started) * 1e3)
    for record in picked[EDITS:]:
        started = time.perf_counter()
        storage.forgetting.forget_messages([record.id])
        delete_ms.append((time.perf_counter() - started) * 1e3)
    result: dict[str, Any] = {
        "edit_p50_ms": round(percentile(edit_ms, 50), 2),
        "edit_p95_ms": round(percentile(edit_ms, 95), 2),
        "delete_p50_ms": round(percentile(delete_ms, 50), 2),
        "delete_p95_ms": round(percentile(delete_ms, 95), 2),
    }
    times = sorted(r.created_at for r in records)
    for name, forget in (
        ("forget_me", lambda: storage.forgetting.forget_member(SCALE_GUILD, 7)),
        ("purge_channel", lambda: storage.forgetting.forget_channels([2003])),
        ("retention_purge",
         lambda: storage.forgetting.forget_older_than(SCALE_GUILD, times[len(times) // 4])),
    ):
        started = time.perf_counter()
        removed = forget()
        seconds = time.perf_counter() - started
        result[f"{name}_messages"] = removed
        result[f"{name}_s"] = round(seconds, 3)
        result[f"{name}_msgs_per_s"] = round(removed / seconds, 1) if seconds else 0.0
    return result


def _time_scrub(path: Path) -> float:
    """Seconds the first open of a database written without erasing takes (it scrubs once)."""
    started = time.perf_counter()
    open_storage(path).close()
    return round(time.perf_counter() - started, 2)
