"""Messages: idempotent upserts and edits across the text, the keyword index and the
vectors; deletes; threads and their parents."""

from __future__ import annotations

import random
import string
from collections.abc import Callable
from dataclasses import replace

import numpy as np

from memory.engine import MemoryEngine
from memory.filters import Filters
from memory.records import MessageRecord
from memory.storage import Storage
from tests.support.builders import CHANNEL, GUILD
from tests.support.inspection import Inspector
from tests.support.storage import keyword_ids, row_counts, stored_vector

MakeRecord = Callable[..., MessageRecord]
Inspect = Callable[[Storage], Inspector]


def test_upsert_is_idempotent(engine: MemoryEngine, make_record: MakeRecord, inspector: Inspect) -> None:
    records = [make_record(f"message number {i} about widgets") for i in range(12)]
    first = engine.ingest(records)
    assert (first.inserted, first.updated, first.unchanged, first.embedded) == (12, 0, 0, 12)
    before = row_counts(engine.storage, inspector)
    assert before == {"messages": 12, "fts": 12, "vectors": 12}
    vector = stored_vector(engine.storage, records[0].id)

    again = engine.ingest(records)
    assert (again.inserted, again.updated, again.unchanged, again.embedded) == (0, 0, 12, 0)
    assert row_counts(engine.storage, inspector) == before
    assert engine.storage.backlog.pending_count() == 0
    inspector(engine.storage).check_keyword_index()
    np.testing.assert_array_equal(stored_vector(engine.storage, records[0].id), vector)


def test_duplicate_ids_within_one_batch(engine: MemoryEngine, make_record: MakeRecord, inspector: Inspect) -> None:
    record = make_record("first version")
    stats = engine.storage.messages.upsert(
        [record, record, replace(record, content="second version")])
    assert (stats.inserted, stats.updated, stats.unchanged) == (1, 1, 1)
    assert engine.storage.messages.hydrate([record.id])[record.id].content == "second version"
    inspector(engine.storage).check_keyword_index()


def test_empty_upsert_and_delete_are_noops(engine: MemoryEngine) -> None:
    assert engine.storage.messages.upsert([]).inserted == 0
    assert engine.forget_messages([]) == 0
    assert engine.forget_messages([123456789]) == 0


def test_edit_updates_text_fts_and_vector(
    engine: MemoryEngine, make_record: MakeRecord, inspector: Inspect
) -> None:
    original = make_record("the meeting is on tuesday in the workshop")
    other = make_record("completely unrelated chatter about gardening")
    engine.ingest([original, other])
    old_vector = stored_vector(engine.storage, original.id)
    assert keyword_ids(engine.storage, "tuesday") == {original.id}

    edited = replace(original, content="the meeting moved to thursday evening",
                     edited_at=original.created_at + 60_000)
    stats = engine.storage.messages.upsert([edited])
    assert (stats.inserted, stats.updated, stats.unchanged) == (0, 1, 0)
    # text and FTS change at once; the stale vector is gone and the message is pending
    assert engine.storage.messages.hydrate([original.id])[original.id].content == edited.content
    assert keyword_ids(engine.storage, "tuesday") == set()
    assert keyword_ids(engine.storage, "thursday") == {original.id}
    assert stored_vector(engine.storage, original.id) is None
    # the next message was embedded with the old text as its context: it goes too
    assert stored_vector(engine.storage, other.id) is None
    assert engine.storage.backlog.pending_count() == 2
    inspector(engine.storage).check_keyword_index()

    pending = engine.storage.backlog.pending(10)
    expected = engine.embedder.embed([engine.embedding_text(p) for p in pending])[0]
    assert "thursday" in engine.embedding_text(pending[0])
    assert engine.embed_pending() == 2
    new_vector = stored_vector(engine.storage, original.id)
    np.testing.assert_allclose(new_vector, expected, atol=1e-6)
    assert not np.allclose(new_vector, old_vector)
    assert row_counts(engine.storage, inspector) == {"messages": 2, "fts": 2, "vectors": 2}


def test_edit_of_timestamp_only_keeps_vector(
    engine: MemoryEngine, make_record: MakeRecord
) -> None:
    record = make_record("same words as before")
    engine.ingest([record])
    vector = stored_vector(engine.storage, record.id)
    stats = engine.storage.messages.upsert([replace(record, edited_at=record.created_at + 1000)])
    assert stats.updated == 1
    assert engine.storage.backlog.pending_count() == 0
    np.testing.assert_array_equal(stored_vector(engine.storage, record.id), vector)


def test_attachment_change_counts_as_an_edit(
    engine: MemoryEngine, make_record: MakeRecord
) -> None:
    record = make_record("look at this")
    engine.ingest([record])
    engine.storage.messages.upsert([replace(record, attachments=("schematic.png",))])
    assert engine.storage.backlog.pending_count() == 1
    assert keyword_ids(engine.storage, "schematic") == {record.id}
    engine.embed_pending()
    hits = engine.storage.vectors.knn(engine.embedder.embed(["look"])[0], 5,
                                      Filters(has_attachment=True))
    assert [mid for mid, _ in hits] == [record.id]


def test_delete_purges_messages_fts_and_vectors(
    engine: MemoryEngine, make_record: MakeRecord, inspector: Inspect
) -> None:
    keep = make_record("the router password is on the fridge")
    gone = [make_record(f"secret plan number {i}") for i in range(3)]
    engine.ingest([keep, *gone])
    assert engine.forget_messages([m.id for m in gone] + [999]) == 3
    assert row_counts(engine.storage, inspector) == {"messages": 1, "fts": 1, "vectors": 1}
    assert keyword_ids(engine.storage, "secret") == set()
    inspector(engine.storage).check_keyword_index()
    vec = engine.embedder.embed(["secret plan number 1"])[0]
    assert [mid for mid, _ in engine.storage.vectors.knn(vec, 10, Filters())] == [keep.id]
    result = engine.search("secret plan", guild_id=GUILD)
    assert all(h.id == keep.id for h in result.hits)


def test_an_emptied_message_takes_back_only_copies_edited_later(
    engine: MemoryEngine, make_record: MakeRecord, inspector: Inspect
) -> None:
    """An edit took out all its text: forgotten everywhere, with no tombstone (it still
    exists on Discord), and only a copy edited after that edit is stored again."""
    said = make_record("the vault code is 0451", edited_at=None)
    engine.ingest([said])
    emptied_at = said.created_at + 60_000
    assert engine.forget_emptied({said.id: emptied_at}) == 1
    assert row_counts(engine.storage, inspector) == {"messages": 0, "fts": 0, "vectors": 0}
    assert inspector(engine.storage).tombstones([said.id]) == 0
    stale = engine.storage.messages.upsert([said, replace(said, edited_at=emptied_at)])
    assert (stale.inserted, stale.tombstoned) == (0, 2), "a page read before the edit, an old export"
    back = replace(said, content="the vault code is now 9999", edited_at=emptied_at + 1)
    assert engine.storage.messages.upsert([back]).inserted == 1
    assert keyword_ids(engine.storage, "9999") == {said.id}
    assert keyword_ids(engine.storage, "0451") == set()


def test_delete_before_embedding(engine: MemoryEngine, make_record: MakeRecord) -> None:
    record = make_record("never embedded")
    engine.storage.messages.upsert([record])
    assert engine.forget_messages([record.id]) == 1
    assert engine.storage.backlog.pending_count() == 0
    assert engine.embed_pending() == 0


def test_thread_parent_is_stored_and_expanded(
    engine: MemoryEngine, make_record: MakeRecord
) -> None:
    thread_id = CHANNEL + 1
    engine.storage.messages.upsert([
        make_record("in the channel"),
        make_record("in the thread", channel_id=thread_id, parent_id=CHANNEL,
                    channel_type="GuildPublicThread", channel_name="a thread"),
    ])
    assert engine.storage.messages.threads(GUILD) == [(thread_id, CHANNEL, "GuildPublicThread")]
    assert set(engine.storage.messages.expand_channels([CHANNEL])) == {CHANNEL, thread_id}
    assert engine.storage.messages.expand_channels([thread_id]) == (thread_id,)
    # a later record without the parent does not erase it
    engine.storage.messages.upsert([make_record("more", channel_id=thread_id)])
    assert engine.storage.messages.threads(GUILD) == [(thread_id, CHANNEL, "GuildPublicThread")]


def test_a_forgotten_channel_or_thread_leaves_its_row_and_name(
    engine: MemoryEngine, make_record: MakeRecord
) -> None:
    side, thread = CHANNEL + 1, CHANNEL + 2
    engine.ingest([
        make_record("in general"),
        make_record("in the side room", channel_id=side, channel_name="side room"),
        make_record("in the thread", channel_id=thread, parent_id=side,
                    channel_type="GuildPublicThread", channel_name="alice's leave"),
    ])
    messages = engine.storage.messages

    assert engine.forget_channels([thread]) == 1  # a thread deleted on Discord
    assert messages.channel_ids_named("alice's leave") == []
    assert messages.threads(GUILD) == []
    assert messages.channel_ids_named("side room") == [side]

    assert engine.forget_channels([side]) == 1  # its channel purged
    assert messages.channel_ids_named("side room") == []
    assert messages.channel_ids_named("general") == [CHANNEL]
    # the channel is written again by its next message
    engine.ingest([make_record("back again", channel_id=side, channel_name="side room")])
    assert messages.channel_ids_named("side room") == [side]


def test_a_channel_name_matches_whatever_its_case_in_any_script(
    engine: MemoryEngine, make_record: MakeRecord
) -> None:
    accented, greek, german = CHANNEL + 1, CHANNEL + 2, CHANNEL + 3
    engine.ingest([
        make_record("bonjour", channel_id=accented, channel_name="général"),
        make_record("γεια", channel_id=greek, channel_name="Συζήτηση"),
        make_record("hallo", channel_id=german, channel_name="straße"),
    ])
    messages = engine.storage.messages

    assert messages.channel_ids_named("GÉNÉRAL") == [accented]
    assert messages.channel_ids_named("ΣΥΖΉΤΗΣΗ") == [greek]
    assert messages.channel_ids_named("STRASSE") == [german]
    assert messages.channel_ids_named("général", guild_id=GUILD) == [accented]
    assert messages.channel_ids_named("général", guild_id=GUILD + 1) == []
    assert messages.channel_ids_named("generál") == []


def test_a_threads_record_names_its_parent_without_changing_what_is_known(
    engine: MemoryEngine, make_record: MakeRecord
) -> None:
    forum, post, text, thread = CHANNEL + 1, CHANNEL + 2, CHANNEL + 3, CHANNEL + 4
    engine.ingest([
        make_record("a forum post", channel_id=post, parent_id=forum, parent_name="help-forum",
                    channel_type="GuildPublicThread", channel_name="printer jams"),
        make_record("in the room", channel_id=text, channel_name="room", channel_type="GuildTextChat"),
        make_record("in its thread", channel_id=thread, parent_id=text, parent_name="room renamed",
                    channel_type="GuildPublicThread", channel_name="side"),
        make_record("unnamed parent", channel_id=thread, parent_id=text, parent_name="",
                    channel_type="GuildPublicThread", channel_name="side"),
    ])
    messages = engine.storage.messages
    assert messages.channel_ids_named("help-forum") == [forum]
    assert messages.expand_channels([forum]) == (forum, post)
    assert messages.channel_ids_named("room renamed") == [text]  # the newer name
    assert messages.channel_ids_named("room") == []
    assert sorted(messages.channels_with_messages(GUILD)) == [
        (post, forum), (text, None), (thread, text)], "a forum holds no messages"
    assert engine.forget_channels([forum]) == 1  # the forum purged: its row goes with its posts
    assert messages.channel_ids_named("help-forum") == []


def test_a_message_of_one_very_long_word_is_stored_and_found(
    engine: MemoryEngine, make_record: MakeRecord
) -> None:
    """A pasted key or a CJK run without punctuation is one token of thousands of bytes:
    PostgreSQL's indexes refused it, and the message was lost."""
    rng = random.Random(7)
    key = "".join(rng.choice(string.ascii_lowercase + string.digits) for _ in range(2900))
    cjk = "".join(chr(rng.randrange(0x4E00, 0x9FFF)) for _ in range(1000))  # 3,000 bytes
    pasted, written = make_record(f"my key is {key} ok"), make_record(cjk)
    assert engine.storage.messages.upsert([pasted, written]).inserted == 2
    assert keyword_ids(engine.storage, key) == {pasted.id}
    assert keyword_ids(engine.storage, cjk) == {written.id}
    # an edit that adds such a word still takes the old text out
    edited = replace(pasted, content=f"new key {key[::-1]}", edited_at=pasted.created_at + 1)
    assert engine.storage.messages.upsert([edited]).updated == 1
    assert engine.storage.messages.hydrate([pasted.id])[pasted.id].content.startswith("new key")


def test_the_newest_stored_message_below_an_id(engine: MemoryEngine, make_record: MakeRecord) -> None:
    side = CHANNEL + 1
    records = [make_record(f"message {i}", channel_id=CHANNEL if i % 2 else side, age_days=5 - i)
               for i in range(5)]
    engine.ingest(records)
    messages = engine.storage.messages
    ids = [r.id for r in records]
    assert messages.latest_id(CHANNEL) == ids[3]
    assert messages.latest_id(CHANNEL, before_id=ids[3]) == ids[1]
    assert messages.latest_id(CHANNEL, before_id=ids[1]) is None
    assert messages.latest_in_guild(GUILD, ids[4]) == ids[3]
    assert messages.latest_in_guild(GUILD, ids[0]) is None
    assert messages.latest_in_guild(GUILD + 1, ids[4] + 1) is None


def test_an_empty_search_says_nothing_of_channels_the_member_cannot_read(
    engine: MemoryEngine, make_record: MakeRecord
) -> None:
    hidden = make_record("the hidden plans", channel_id=CHANNEL + 1)
    engine.ingest([hidden])
    assert engine.storage.messages.has_any(GUILD, [CHANNEL + 1])
    assert not engine.storage.messages.has_any(GUILD, [CHANNEL])
    assert not engine.storage.messages.has_any(GUILD, [])

    # the server holds messages, none where they may read
    result = engine.search("plans", guild_id=GUILD, allowed_channel_ids=(CHANNEL,), mode="keyword")
    assert result.empty_reason == "nothing is stored from the channels you can read"
    result = engine.search("plans", guild_id=GUILD, allowed_channel_ids=(CHANNEL + 1,),
                           mode="keyword")
    assert [h.id for h in result.hits] == [hidden.id]
    result = engine.search("plans", guild_id=GUILD + 1, mode="keyword")
    assert result.empty_reason == "nothing is stored for this server yet"
