"""Issue 31, item 7: ``reembed`` builds the new vectors beside the old ones and swaps.

While it runs, searches (by a process still on the old model, as the running bot is)
answer from the old vectors exactly as before; a message stored, edited or deleted
meanwhile ends up right in the new table; a run that stops midway leaves the old
table in use and the next run carries on.  The embedder that re-embeds is the
deterministic fake, wrapped so that the test acts between its batches.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import replace
from typing import Any

import numpy as np
import pytest

import memory.embedding
from memory.engine import MemoryEngine
from memory.records import MessageRecord
from memory.storage import Storage
from tests.support.builders import GUILD, HashEmbedder

MakeRecord = Callable[..., MessageRecord]
TOPICS = ["garden tomatoes", "volcano lava", "piano lessons", "bicycle repair", "sourdough bread"]
QUERIES = ["tomatoes in the garden", "lava from a volcano", "fixing a bicycle"]


class Between(HashEmbedder):
    """The new model; runs ``act`` before its ``at``-th batch (after earlier batches were stored)."""

    def __init__(self, at: int, act: Callable[[], None]) -> None:
        super().__init__(64, model_id="test/other-64")
        self._at, self._act = at, act

    def embed(self, texts: Sequence[str]) -> np.ndarray:
        if self.calls + 1 == self._at:
            self._act()
        return super().embed(texts)


@pytest.fixture
def small_batches(monkeypatch: pytest.MonkeyPatch) -> None:
    """Ten messages per re-embedding step, so a test can act between steps."""
    monkeypatch.setattr(memory.embedding, "EMBED_CHUNK", 10)


def notes(make_record: MakeRecord, n: int = 40) -> list[MessageRecord]:
    return [make_record(f"note {i} about {TOPICS[i % len(TOPICS)]}", author_id=i % 3 + 1)
            for i in range(n)]


def dense_ids(engine: MemoryEngine) -> list[list[int]]:
    return [[hit.id for hit in engine.search(q, guild_id=GUILD, mode="dense", limit=10).hits]
            for q in QUERIES]


def next_holds(storage: Storage, message_id: int) -> bool:
    """Whether the table ``reembed`` is building holds a vector for the message."""
    postgres = storage.database.location.startswith("postgres")
    exists = "SELECT to_regclass('message_vectors_next') IS NOT NULL" if postgres else \
        "SELECT count(*) FROM sqlite_master WHERE name = 'message_vectors_next'"
    if not storage.database.read(exists)[0][0]:  # type: ignore[attr-defined]
        return False
    return bool(storage.database.read(  # type: ignore[attr-defined]
        "SELECT count(*) FROM message_vectors_next WHERE message_id = "
        + ("%s" if postgres else "?"), (message_id,))[0][0])


def assert_new_vectors(engine: MemoryEngine, ids: list[int]) -> None:
    """Each message's stored vector is the engine's model's vector of its text now."""
    floats = engine.storage.vectors.floats(ids)
    for message in engine.storage.backlog.messages(ids):
        expected = HashEmbedder(64).embed([engine.embedding_text(message)])[0]
        np.testing.assert_allclose(floats[message.id], expected, atol=1e-6)


@pytest.mark.usefixtures("small_batches")
def test_searches_use_the_old_vectors_until_the_swap_and_changes_meanwhile_land_in_the_new_table(
    make_engine: Callable[..., MemoryEngine], make_record: MakeRecord, tmp_db: str,
) -> None:
    records = notes(make_record)
    bot = make_engine(tmp_db, HashEmbedder(128), context="none")  # the running bot: old model
    bot.ingest(records)
    before = dense_ids(bot)
    late = make_record("late note about volcano lava", author_id=2)
    edited = replace(records[1], content="note 1 now about piano lessons", edited_at=1)
    seen: dict[str, Any] = {}

    def meanwhile() -> None:  # two steps (20 messages) are in the new table
        seen["during"] = dense_ids(bot)
        seen["forgotten_was_staged"] = next_holds(bot.storage, records[0].id)
        bot.storage.forgetting.forget_messages([records[0].id])
        seen["forgotten_left_next"] = not next_holds(bot.storage, records[0].id)
        bot.ingest([late, edited])
        seen["edited_left_next"] = not next_holds(bot.storage, records[1].id)

    new = Between(3, meanwhile)
    other = make_engine(tmp_db, new, check_model=False, context="none")
    other.reembed()

    assert seen["during"] == before  # the old vectors answered, unchanged
    assert seen["forgotten_was_staged"] and seen["forgotten_left_next"]
    assert seen["edited_left_next"]
    storage = other.storage
    assert storage.meta.embedding_model() == ("test/other-64", 64)
    assert storage.backlog.pending_count() == 0
    ids = [r.id for r in records[1:]] + [late.id]
    floats = storage.vectors.floats([records[0].id, *ids])
    assert records[0].id not in floats and set(floats) == set(ids)  # deleted: gone everywhere
    assert storage.vectors.count(GUILD) == len(ids)
    assert_new_vectors(other, ids)


@pytest.mark.usefixtures("small_batches")
def test_a_reembed_that_stops_midway_leaves_the_old_vectors_and_the_next_run_carries_on(
    make_engine: Callable[..., MemoryEngine], make_record: MakeRecord, tmp_db: str,
) -> None:
    bot = make_engine(tmp_db, HashEmbedder(128), context="none")
    records = notes(make_record)
    bot.ingest(records)
    before = dense_ids(bot)

    def crash() -> None:
        raise RuntimeError("killed")

    with pytest.raises(RuntimeError, match="killed"):
        make_engine(tmp_db, Between(3, crash), check_model=False, context="none").reembed()
    assert bot.storage.meta.embedding_model() == ("test/hash-128", 128)
    assert dense_ids(bot) == before  # the old table is whole and in use
    assert bot.storage.backlog.pending_count() == 0

    again = make_engine(tmp_db, HashEmbedder(64, model_id="test/other-64"), check_model=False,
                        context="none")
    assert again.reembed() == 20  # the 20 stored before the crash are kept
    assert again.storage.meta.embedding_model() == ("test/other-64", 64)
    assert again.storage.vectors.count(GUILD) == 40
    assert again.storage.backlog.pending_count() == 0
    assert_new_vectors(again, [r.id for r in records])
