"""``bot.py migrate-db``: SQLite to PostgreSQL and back, resumed after a kill, verified."""

from __future__ import annotations

import multiprocessing
import os
import signal
import time
from collections.abc import Callable
from pathlib import Path

import numpy as np
import pytest

from cli.app import main
from memory.errors import DatabaseFileError
from memory.filters import Filters
from memory.storage import open_storage
from memory.storage import transfer as transfer_module
from tests.support.builders import BASE_MS, CHANNEL, GUILD, HashEmbedder, snowflake
from tests.support.postgres import PostgresServer

pytestmark = pytest.mark.postgres


def _fill(location: str, count: int = 300) -> None:
    """Messages in two channels, replies, settings, opt-outs, cursors, tombstones, vectors."""
    from memory.records import MessageRecord

    storage = open_storage(location)
    records = [MessageRecord(
        id=snowflake(BASE_MS + i * 60_000, i), guild_id=GUILD, channel_id=CHANNEL + i % 2,
        author_id=1 + i % 5, created_at=BASE_MS + i * 60_000,
        content=f"message {i} about the {['kayak', 'pizza', 'oven', 'café'][i % 4]} trip",
        author_name=f"user{i % 5}", author_display_name=f"User {i % 5}", guild_name="G",
        channel_name=f"chan{i % 2}", attachments=("map.png",) if i % 17 == 0 else (),
        reply_to_id=snowflake(BASE_MS + (i - 2) * 60_000, i - 2) if i % 9 == 0 and i > 2 else None)
        for i in range(count)]
    storage.messages.upsert(records)
    storage.guilds.update_settings(GUILD, channel_mode="exclude", add_channel=CHANNEL + 5,
                                   opt_out=77, toggle_autoresponse_channel=CHANNEL)
    storage.guilds.save_backfill_cursor(GUILD, CHANNEL, 12345)
    storage.guilds.begin_reconcile_run(GUILD, 99)
    storage.guilds.save_reconcile_cursor(GUILD, CHANNEL, 99, 555)
    storage.forgetting.forget_messages([records[3].id, 424242])
    storage.meta.active_profile = "cpu"
    embedder = HashEmbedder(32)
    storage.meta.bind_model(embedder.model_id, 32)
    pending = storage.backlog.pending(10_000)[: count * 2 // 3]  # a third stays pending
    storage.backlog.write_vectors(pending, embedder.embed([m.content for m in pending]))
    storage.close()


def _migrate(capsys: pytest.CaptureFixture, source: str, target: str) -> tuple[int, str]:
    code = main(["migrate-db", source, target])
    return code, capsys.readouterr().err


def _same_memory(a: str, b: str) -> None:
    first, second = open_storage(a, read_only=True), open_storage(b, read_only=True)
    try:
        assert first.stats().messages == second.stats().messages
        assert first.backlog.pending_count() == second.backlog.pending_count()
        assert first.guilds.settings(GUILD) == second.guilds.settings(GUILD)
        assert first.guilds.backfill_cursor(CHANNEL) == second.guilds.backfill_cursor(CHANNEL)
        assert first.guilds.reconcile_cursor(CHANNEL) == second.guilds.reconcile_cursor(CHANNEL)
        assert first.meta.active_profile == second.meta.active_profile
        for term in ("kayak", "cafe", "map", "user3"):
            assert ([m for m, _ in first.keywords.ranked([term], 20, Filters(guild_id=GUILD))]
                    == [m for m, _ in second.keywords.ranked([term], 20, Filters(guild_id=GUILD))])
        ids = sorted(first.messages.hydrate([m for m, _ in first.keywords.ranked(
            ["message"], 500, Filters())]))
        assert first.messages.hydrate(ids) == second.messages.hydrate(ids)
        one, two = first.vectors.floats(ids), second.vectors.floats(ids)
        assert one.keys() == two.keys() and all(np.array_equal(one[i], two[i]) for i in one)
        query = HashEmbedder(32).embed(["pizza trip"])[0]
        # the same neighbours (near-ties may swap places: compare their similarities)
        near = [[s for _, s in storage.vectors.knn(query, 10, Filters(guild_id=GUILD), rescore=64)]
                for storage in (first, second)]
        np.testing.assert_allclose(near[0], near[1], atol=1e-5)
    finally:
        first.close()
        second.close()


def test_a_memory_moves_to_postgresql_and_back_unchanged(
    tmp_path: Path, postgres_url: Callable[..., str], capsys: pytest.CaptureFixture
) -> None:
    sqlite = str(tmp_path / "memory.sqlite3")
    _fill(sqlite)
    url = postgres_url()
    code, err = _migrate(capsys, sqlite, url)
    assert code == 0, err
    assert "every row count and every vector checked equal" in err
    _same_memory(sqlite, url)
    back = str(tmp_path / "back.sqlite3")
    code, err = _migrate(capsys, url, back)
    assert code == 0, err
    _same_memory(sqlite, back)
    code, err = _migrate(capsys, sqlite, url)  # again: nothing twice, still equal
    assert code == 0, err


def test_a_target_with_other_messages_is_refused(
    tmp_path: Path, postgres_url: Callable[..., str], capsys: pytest.CaptureFixture
) -> None:
    sqlite, url = str(tmp_path / "memory.sqlite3"), postgres_url()
    _fill(sqlite, 30)
    _fill(url, 10)
    code, err = _migrate(capsys, sqlite, url)
    assert code == 2 and "not copied from this source" in err


def _slow_migrate(source: str, target: str) -> None:
    transfer_module.PAGE = 20  # many small pages: the kill lands in the middle
    original = transfer_module._copy

    def slowly(*args, **kwargs):  # type: ignore[no-untyped-def]
        time.sleep(0.05)
        return original(*args, **kwargs)

    transfer_module._copy = slowly
    main(["migrate-db", source, target])


def _copied(url: str) -> int:
    """Messages the target holds so far (0 before the copy has migrated it)."""
    try:
        storage = open_storage(url, read_only=True)
    except DatabaseFileError:
        return 0
    try:
        return storage.messages.count()
    finally:
        storage.close()


@pytest.mark.slow
def test_a_killed_migration_resumes_and_ends_equal(
    tmp_path: Path, postgres_server: PostgresServer, capsys: pytest.CaptureFixture
) -> None:
    sqlite = str(tmp_path / "memory.sqlite3")
    _fill(sqlite, 600)
    url = postgres_server.fresh(migrated=False)
    child = multiprocessing.get_context("spawn").Process(target=_slow_migrate, args=(sqlite, url))
    child.start()
    deadline = time.time() + 60
    while _copied(url) < 200 and time.time() < deadline:
        time.sleep(0.05)
    os.kill(child.pid, signal.SIGKILL)
    child.join()
    partial = open_storage(url, read_only=True)
    copied = partial.messages.count()
    partial.close()
    assert 0 < copied < 600
    code, err = _migrate(capsys, sqlite, url)
    assert code == 0, err
    _same_memory(sqlite, url)
