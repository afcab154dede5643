"""The database through the contract: opened read-only, it searches and refuses writes."""

from __future__ import annotations

import pytest

from memory.errors import DatabaseFileError
from memory.filters import Filters
from memory.storage import open_storage
from tests.support.builders import HashEmbedder


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
