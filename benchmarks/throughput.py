"""``bench write-throughput``: messages stored and vectors written per second by 1, 2, 4
processes sharing one database.

Each process plays a bot process (a shard): it stores its own guild's messages in
batches as an import does, then claims and writes vectors for the shared backlog
until none is left.  The vectors are random (the encoder's cost is measured by
``bench search-scale``; this measures the database), so the rates are the storage
engine's ceiling.  On SQLite the processes share one file and take turns at its one
write lock; on PostgreSQL they write side by side.
"""

from __future__ import annotations

import multiprocessing
import time
from collections.abc import Callable
from dataclasses import replace
from functools import partial
from pathlib import Path
from typing import Any, TypeVar

import numpy as np

from benchmarks.common import machine_description, scratch_location
from benchmarks.scale import synthetic_records
from memory.errors import StorageBusy
from memory.storage import open_storage
from memory.storage.postgres.connection import connect, is_postgres_url

T = TypeVar("T")
BATCH = 1000
DIM = 384


def _retrying(write: Callable[[], T]) -> T:
    """Run a write again while the database says it cannot take it now
    (:class:`~memory.errors.StorageBusy`), as the bot's write queue does
    (``cogs.memory.capture``)."""
    while True:
        try:
            return write()
        except StorageBusy:
            time.sleep(0.05)


def _store(location: str, guild: int, messages: int, start: float) -> float:
    # a guild (and channels) of its own, ids apart; the 40 authors are members of every guild
    records = [replace(r, guild_id=guild, id=r.id + guild, channel_id=r.channel_id + 100 * guild)
               for r in synthetic_records(messages, seed=guild)]
    storage = open_storage(location)
    try:
        time.sleep(max(0.0, start - time.time()))
        began = time.perf_counter()
        for i in range(0, len(records), BATCH):
            chunk = records[i:i + BATCH]
            _retrying(partial(storage.messages.upsert, chunk))
        return time.perf_counter() - began
    finally:
        storage.close()


def _embed(location: str, worker: int, start: float) -> tuple[int, float]:
    storage = open_storage(location)
    rng = np.random.default_rng(worker)
    done = 0
    try:
        storage.meta.bind_model("bench/random", DIM)
        time.sleep(max(0.0, start - time.time()))
        began = time.perf_counter()
        owner = f"bench-{worker}"
        while batch := _retrying(lambda: storage.backlog.claim(256, owner=owner)):
            vectors = rng.normal(size=(len(batch), DIM))
            _retrying(partial(storage.backlog.write_vectors, batch, vectors, owner=owner))
            done += len(batch)
        return done, time.perf_counter() - began
    finally:
        storage.backlog.release(f"bench-{worker}")
        storage.close()


def run_write_throughput(messages: int, processes: list[int],
                         postgres: str | None = None) -> dict[str, Any]:
    """Per process count: stored and embedded messages per second, all processes together.

    Each process stores ``messages`` of its own guild (so ``n`` processes store
    ``n × messages``), then all embed the shared backlog.
    """
    ctx = multiprocessing.get_context("spawn")
    report: dict[str, Any] = {"machine": machine_description(),
                              "engine": "postgres" if postgres else "sqlite",
                              "messages_per_process": messages, "runs": {}}
    for count in processes:
        with scratch_location(postgres, name="throughput") as location:
            open_storage(location).close()  # created and migrated before the clock starts
            with ctx.Pool(count) as pool:
                start = time.time() + 5.0
                stored = pool.starmap(_store, [(location, 7000 + i, messages, start)
                                               for i in range(count)])
                start = time.time() + 5.0
                embedded = pool.starmap(_embed, [(location, i, start) for i in range(count)])
            sizes = _sizes(location)
        total = count * messages
        report["runs"][str(count)] = {
            "store_msgs_per_s": round(total / max(stored), 1),
            "vectors_per_s": round(sum(n for n, _ in embedded) / max(s for _, s in embedded), 1),
            "bytes_per_message": {name: round(size / total) for name, size in sizes.items()},
        }
    return report


def _sizes(location: str) -> dict[str, int]:
    """What the database takes on disk, in all and per part (a measurement, not a storage
    read: sizes are no part of the contract)."""
    if not is_postgres_url(location):
        files = [Path(location), Path(f"{location}-wal")]
        return {"database": sum(f.stat().st_size for f in files if f.exists())}
    conn = connect(location)
    try:
        parts = dict(conn.execute(
            "SELECT c.relname, pg_total_relation_size(c.oid) FROM pg_class c JOIN pg_namespace n "
            "ON n.oid = c.relnamespace WHERE n.nspname = current_schema() AND c.relkind = 'r'"
        ).fetchall())
        hnsw = conn.execute("SELECT coalesce(sum(pg_relation_size(indexrelid)), 0) FROM pg_index i "
                            "JOIN pg_class c ON c.oid = i.indexrelid "
                            "WHERE c.relname LIKE 'message_vectors_hnsw_%%'", ()).fetchone()[0]
        database = conn.execute("SELECT pg_database_size(current_database())").fetchone()[0]
    finally:
        conn.close()
    big = {name: int(size) for name, size in parts.items() if size > 1 << 20}
    return {"database": int(database), "hnsw_index": int(hnsw), **big}
