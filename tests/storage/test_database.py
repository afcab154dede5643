"""The database through the contract: opened read-only, it searches and refuses writes;
held up by another writer, a write waits, then says it is busy."""

from __future__ import annotations

import threading

import pytest

from memory.errors import DatabaseFileError, StorageBusy
from memory.filters import Filters
from memory.storage import open_storage
from tests.support.builders import HashEmbedder
from tests.support.engines import another_writer


def test_a_read_only_storage_searches_and_refuses_writes(make_engine, make_record) -> None:
    engine = make_engine()
    engine.ingest([make_record("the wifi password is on the fridge")])
    path = engine.storage.database.location
    engine.close()
    storage = open_storage(path, read_only=True)
    try:
        assert storage.database.read_only
        assert storage.stats().messages == 1
        assert storage.keywords.ranked(["wifi"], 5, Filters())
        vector = HashEmbedder().embed(["wifi password"])[0]
        assert [mid for mid, _ in storage.vectors.knn(vector, 5, Filters())] == [
            mid for mid, _ in storage.keywords.ranked(["wifi"], 5, Filters())]
        with pytest.raises(DatabaseFileError, match="read-only"):
            storage.messages.upsert([make_record("a new message")])
        with pytest.raises(DatabaseFileError, match="read-only"):
            storage.forgetting.forget_messages([1])
    finally:
        storage.close()


def test_a_write_held_up_by_another_writer_is_storage_busy_and_runs_again(
    storage, make_record
) -> None:
    """Past its wait, a write says StorageBusy (nothing of it applied); the same call
    succeeds once the other writer lets go.  The bot's write queue retries exactly this."""
    kept = make_record("a line stored before the other writer came")
    storage.messages.upsert([kept])
    late = make_record("a line that has to wait")
    with another_writer(storage, wait_s=0.3):
        with pytest.raises(StorageBusy, match="try again"):
            storage.messages.upsert([late])
        with pytest.raises(StorageBusy):
            storage.forgetting.forget_messages([kept.id])
        assert storage.messages.count() == 1  # reads go on
    assert storage.messages.upsert([late]).inserted == 1
    assert storage.forgetting.forget_messages([kept.id]) == 1
    assert set(storage.messages.hydrate([kept.id, late.id])) == {late.id}


def test_a_write_waits_for_another_writer_that_lets_go_in_time(storage, make_record) -> None:
    late = make_record("a line that waits its turn")
    with another_writer(storage, wait_s=10) as release:
        threading.Timer(0.3, release).start()
        assert storage.messages.upsert([late]).inserted == 1
