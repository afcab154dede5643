"""``bot.py migrate-db``: SQLite to PostgreSQL and back, resumed after a kill, verified."""

from __future__ import annotations

import multiprocessing
import os
import signal
import time
from collections.abc import Callable
from dataclasses import replace
from pathlib import Path

import numpy as np
import pytest

from cli.app import main
from memory.errors import DatabaseFileError
from memory.filters import Filters
from memory.records import MessageRecord
from memory.storage import open_storage
from memory.storage import transfer as transfer_module
from memory.storage.contract import PostedAnswer
from tests.support.builders import BASE_MS, CHANNEL, GUILD, HashEmbedder, snowflake
from tests.support.engines import inspect
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
    storage.guilds.mark_missed([(GUILD, CHANNEL, records[-1].id + 7)])  # heard, not stored
    # public answers: one quoting stored messages, one due (it quoted records[3])
    storage.quotes.record([(PostedAnswer(9001, CHANNEL, GUILD), [records[1].id, records[2].id]),
                           (PostedAnswer(9002, CHANNEL, GUILD), [records[3].id])])
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
        assert first.guilds.missed() == second.guilds.missed() != {}
        assert first.quotes.due() == second.quotes.due() != []
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


SECRET = "zanzibarquokka"  # one word, in one message of the member who asks to be forgotten


def _record(i: int, content: str, author: int = 1) -> MessageRecord:
    return MessageRecord(
        id=snowflake(BASE_MS + i * 60_000, i), guild_id=GUILD, channel_id=CHANNEL + i % 2,
        author_id=author, created_at=BASE_MS + i * 60_000, content=content,
        author_name=f"user{author - 1}", author_display_name=f"User {author - 1}",
        guild_name="G", channel_name=f"chan{i % 2}")


def _use(location: str) -> list[int]:
    """What a running bot does to a memory after it was copied: an edit, an older message
    backfilled, a member's forget-me, a single forgotten message, settings, an opt-out,
    more vectors.  Returns the ids forgotten."""
    storage = open_storage(location)
    try:
        edited = _record(10, "message 10 edited: the kayak trip moved to june")
        storage.messages.upsert([replace(edited, edited_at=BASE_MS + 10**8)])
        storage.messages.upsert([_record(-40, "an older message about the pizza oven, backfilled")])
        gone = [snowflake(BASE_MS + i * 60_000, i) for i in (*range(3, 300, 5), 301)]  # author 4
        assert storage.forgetting.forget_member(GUILD, 4) == len(gone) - 1  # 3 went before
        single = snowflake(BASE_MS + 20 * 60_000, 20)
        storage.forgetting.forget_messages([single])
        storage.guilds.update_settings(GUILD, channel_mode="include", retention_days=36_500,
                                       remove_channel=CHANNEL + 5, opt_out=3, opt_in=77)
        embedder = HashEmbedder(32)
        pending = storage.backlog.pending(50)
        storage.backlog.write_vectors(pending, embedder.embed([m.content for m in pending]))
        return sorted({*gone, single})
    finally:
        storage.close()


@pytest.mark.parametrize("direction", ["sqlite-to-postgresql", "postgresql-to-sqlite"])
def test_a_rerun_brings_a_used_copy_up_to_date(
    tmp_path: Path, postgres_url: Callable[..., str], capsys: pytest.CaptureFixture, direction: str
) -> None:
    sqlite, url = str(tmp_path / "memory.sqlite3"), postgres_url()
    source, target = (sqlite, url) if direction == "sqlite-to-postgresql" else (url, sqlite)
    _fill(source)
    storage = open_storage(source)
    storage.messages.upsert([_record(301, f"the {SECRET} is under the third stone", author=4)])
    storage.close()
    code, err = _migrate(capsys, source, target)
    assert code == 0, err
    forgotten = _use(source)
    assert len(forgotten) > 10
    code, err = _migrate(capsys, source, target)
    assert code == 0, err
    assert "every row count and every vector checked equal" in err
    _same_memory(source, target)
    for location in (source, target):
        storage = open_storage(location, read_only=True)
        try:
            look = inspect(storage)
            assert look.message_rows(forgotten) == 0 and look.index_rows(forgotten) == 0
            assert look.tombstones(forgotten) == len(forgotten)
            assert look.author_rows(4) == 0
            assert storage.guilds.settings(GUILD).retention_days == 36_500
            look.check_keyword_index()
            look.check_vector_statistics()
            assert look.orphan_window_vectors() == 0
            assert SECRET.encode() not in look.contents()
        finally:
            storage.close()
    code, err = _migrate(capsys, source, target)  # nothing changed since: still equal
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
    original = transfer_module._sync

    def slowly(*args, **kwargs):  # type: ignore[no-untyped-def]
        time.sleep(0.05)
        return original(*args, **kwargs)

    transfer_module._sync = slowly
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


def test_a_sqlite_path_is_named_resolved_however_it_is_spelled(
    tmp_path: Path, postgres_url: Callable[..., str], capsys: pytest.CaptureFixture,
    monkeypatch: pytest.MonkeyPatch
) -> None:
    from memory.storage.postgres.connection import redact

    (tmp_path / "sub").mkdir()
    monkeypatch.chdir(tmp_path / "sub")
    absolute, url = str(tmp_path / "memory.sqlite3"), postgres_url()
    _fill(absolute, 30)
    code, err = _migrate(capsys, "../memory.sqlite3", url)
    assert code == 0, err
    assert f"everything {absolute} holds" in err and ":///" not in err
    code, err = _migrate(capsys, absolute, url)  # the same file, spelled otherwise
    assert code == 0, err
    copy = open_storage(url)
    assert copy.meta.get(transfer_module.SOURCE_KEY) == absolute
    copy.meta.set(transfer_module.SOURCE_KEY, redact(absolute))  # as an older version kept it
    copy.close()
    code, err = _migrate(capsys, absolute, url)
    assert code == 0, err
    copy = open_storage(url, read_only=True)
    assert copy.meta.get(transfer_module.SOURCE_KEY) == absolute
    copy.close()
