"""The storage suite runs once per storage engine.

Every fixture here is parametrised by ``storage_kind`` (:mod:`tests.support.engines`): a test
that takes ``storage``, ``engine``, ``make_engine``, ``tmp_db`` or ``make_location``
runs against each engine, through the contract (:mod:`memory.storage.contract`) only.
Where a test must look under the contract (how many rows the keyword index holds,
what a window's stored text is), it asks the engine's :class:`Inspector`
(``inspector``), which each engine implements in its own terms.

A module that tests one engine's own files and SQL (``test_sqlite_*.py``) overrides
``storage_kind`` with that engine alone.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator

import pytest

from memory.engine import MemoryEngine
from memory.records import MessageRecord
from memory.storage import Storage, open_storage
from tests.support.builders import CHANNEL


@pytest.fixture
def tmp_db(make_location: Callable[[str], str]) -> str:
    """The test's database location (the root fixtures ``engine`` and ``make_engine`` use it)."""
    return make_location("memory")


@pytest.fixture
def storage(tmp_db: str) -> Iterator[Storage]:
    """A storage on a fresh database of this engine, closed at teardown."""
    opened = open_storage(tmp_db)
    yield opened
    opened.close()


@pytest.fixture
def crowded(
    engine: MemoryEngine, make_record: Callable[..., MessageRecord]
) -> tuple[MemoryEngine, list[int]]:
    """200 messages: 190 close to "raspberry cluster" by others, 10 far ones by author 99."""
    close = [
        make_record(f"raspberry cluster kubernetes node {i} rebuilt", author_id=1 + i % 5,
                    channel_id=CHANNEL + i % 3)
        for i in range(190)
    ]
    far = [
        make_record(f"tomato seedlings compost watering schedule {i}", author_id=99,
                    channel_id=CHANNEL + 2, attachments=("photo.jpg",) if i % 2 else ())
        for i in range(10)
    ]
    engine.ingest(close + far)
    return engine, [r.id for r in far]
