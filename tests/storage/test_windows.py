"""Conversational windows in the keyword index: what they hold, that searches use them,
and that they follow every edit and delete (deleted text must not live on in a
neighbour's window) without ever crossing a channel."""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import replace

import numpy as np
import pytest

from memory.engine import MemoryEngine
from memory.filters import Filters
from memory.records import MessageRecord
from memory.storage import Storage
from memory.text import EMBED_CHARS
from tests.support.builders import BASE_MS, CHANNEL, GUILD, NOW
from tests.support.inspection import Inspector

MakeRecord = Callable[..., MessageRecord]
MakeEngine = Callable[..., MemoryEngine]
Inspect = Callable[[Storage], Inspector]
PRIVATE = CHANNEL + 7
GAP_MS = 2 * 3_600_000  # a conversation pause longer than this ends a window (the contract)


def conversation(make_record: MakeRecord, lines: list[str], **fields) -> list[MessageRecord]:
    """One message a minute in #general, by alternating authors."""
    return [
        make_record(text, created_at=BASE_MS + i * 60_000, author_id=1 + i % 2,
                    author_display_name=("Monica", "Rachel")[i % 2], **fields)
        for i, text in enumerate(lines)
    ]


LINES = ["can I borrow a hundred bucks", "what for", "I've got to get back in the game",
         "the dating scene?", "yes, new clothes", "fine"]


def test_a_window_holds_its_neighbours_and_its_reply_target(
    engine: MemoryEngine, make_record: MakeRecord, inspector: Inspect
) -> None:
    records = conversation(make_record, LINES)
    first = make_record("the budget meeting is on monday", created_at=BASE_MS - 60_000)
    reply = make_record("monday works", created_at=BASE_MS + 10 * 60_000, reply_to_id=first.id)
    engine.ingest([first, *records, reply])
    text = inspector(engine.storage).window_text(records[2].id)
    assert "Monica: can I borrow a hundred bucks" in text
    assert "Monica: yes, new clothes" in text and "fine" not in text  # two either side
    assert "Monica: I've got to get back in the game" in text
    assert "budget meeting" in inspector(engine.storage).window_text(reply.id)  # the reply target


def test_keyword_search_finds_a_line_by_its_windows_words(
    engine: MemoryEngine, make_record: MakeRecord
) -> None:
    records = conversation(make_record, LINES)
    engine.ingest(records)
    found = engine.storage.keywords.ranked(["borrow", "hundred"], 10, Filters(guild_id=GUILD),
                                 field="window")
    assert records[2].id in {mid for mid, _ in found}
    by_own_words = engine.storage.keywords.ranked(["borrow"], 10, Filters(guild_id=GUILD))
    assert [mid for mid, _ in by_own_words] == [records[0].id]
    result = engine.search("why did Monica want to borrow a hundred bucks", guild_id=GUILD,
                           adaptive=False, now=NOW)
    assert records[2].id in [h.id for h in result.hits]
    assert result.trace.candidates["window"] > 0
    literal = engine.search("borrow hundred bucks", guild_id=GUILD, mode="keyword")
    assert [h.id for h in literal.hits] == [records[0].id]  # keyword mode: own words only


def test_author_names_are_searchable(engine: MemoryEngine, make_record: MakeRecord) -> None:
    jts = make_record("my wifi drops every hour", author_id=5, author_name="JTS000ID_",
                      author_display_name="")
    engine.ingest([jts, make_record("wifi is fine here")])
    result = engine.search("What is JTS000ID_ looking for ?", guild_id=GUILD, mode="keyword")
    assert result.hits[0].id == jts.id


@pytest.mark.parametrize("how", ["delete", "edit", "opt-out", "purge-channel"])
def test_gone_text_leaves_every_window(
    engine: MemoryEngine, make_record: MakeRecord, how: str, inspector: Inspect
) -> None:
    records = conversation(make_record, LINES)
    secret = records[2]
    engine.ingest(records)
    assert "get back in the game" in inspector(engine.storage).window_text(records[1].id)
    if how == "delete":
        engine.forget_messages([secret.id])
    elif how == "edit":
        engine.storage.messages.upsert([MessageRecord(**{**vars(secret), "content": "never mind",
                                        "edited_at": BASE_MS + 3_600_000})])
    elif how == "opt-out":
        engine.storage.guilds.update_settings(GUILD, opt_out=secret.author_id)
        engine.forget_member(GUILD, secret.author_id)
    else:
        engine.forget_channels([CHANNEL])
    assert "game" not in inspector(engine.storage).all_window_text()
    assert engine.storage.keywords.ranked(["game"], 10, Filters(), field="window") == []
    assert engine.storage.keywords.ranked(["game"], 10, Filters()) == []
    inspector(engine.storage).check_keyword_index()  # the index agrees with its table


def test_windows_stay_in_their_channel_and_allow_lists_hold(
    engine: MemoryEngine, make_record: MakeRecord, inspector: Inspect
) -> None:
    public = conversation(make_record, LINES)
    # at the same minutes in a private channel: the words a search for "salary" wants
    private = [make_record(f"salary talk {i}", channel_id=PRIVATE, channel_name="officers",
                           created_at=BASE_MS + i * 60_000 + 1) for i in range(3)]
    engine.ingest([*public, *private])
    assert all("salary" not in inspector(engine.storage).window_text(r.id) for r in public)
    for mode in ("hybrid", "keyword"):
        result = engine.search("salary talk", guild_id=GUILD, mode=mode,
                               allowed_channel_ids=frozenset({CHANNEL}), adaptive=False)
        assert all(h.channel_id == CHANNEL for h in result.hits), mode
    everything = engine.search("salary talk", guild_id=GUILD, adaptive=False)
    assert everything.hits[0].channel_id == PRIVATE  # found where it may be read


def test_a_long_pause_ends_the_window(
    engine: MemoryEngine, make_record: MakeRecord, inspector: Inspect
) -> None:
    before = make_record("old topic about tomatoes", created_at=BASE_MS)
    after = make_record("new topic about routers", created_at=BASE_MS + GAP_MS + 60_000)
    engine.ingest([before, after])
    assert "tomatoes" not in inspector(engine.storage).window_text(after.id)


def test_out_of_order_arrival_gives_the_same_windows(
    make_engine: MakeEngine, make_record: MakeRecord, make_location: Callable[[str], str],
    inspector: Inspect,
) -> None:
    records = conversation(make_record, LINES)
    in_order = make_engine(make_location("a"))
    in_order.ingest(records)
    shuffled = make_engine(make_location("b"))
    for index in (4, 0, 5, 2, 1, 3):  # a backfill walking back, live messages meanwhile
        shuffled.ingest([records[index]])
    assert [inspector(in_order.storage).window_text(r.id) for r in records] == [
        inspector(shuffled.storage).window_text(r.id) for r in records]


def test_very_common_terms_leave_the_window_search_only(
    make_engine: MakeEngine, make_record: MakeRecord
) -> None:
    engine = make_engine(window_term_max_df=3)
    engine.ingest([make_record(f"printer news {i}") for i in range(5)]
                  + [make_record("the printer nozzle clogged"), make_record("nozzle swap done")])
    searcher = engine.searcher
    # "printer" is in 6 messages (over 3): only the window search drops it
    assert searcher._window_terms(["printer", "nozzle"]) == ["nozzle"]
    assert searcher._window_terms(["printer"]) == ["printer"]  # the rarest term always stays
    assert searcher._window_terms(["printer", "news"]) == ["news"]  # 5 vs 6: both common, rarest kept
    engine.searcher.config = replace(engine.searcher.config, window_term_max_df=0)
    assert searcher._window_terms(["printer", "nozzle"]) == ["printer", "nozzle"]
    result = engine.search("printer nozzle", guild_id=GUILD, adaptive=False)
    assert {"window", "keyword"} <= set(result.trace.candidates)


# -- window vectors ---------------------------------------------------------------------


def window_vectors_from_scratch(storage: Storage, inspect: Inspector) -> dict[int, np.ndarray]:
    """Every window vector as it should be: its embedded members' normalised mean."""
    expected = {}
    for mid, members in inspect.window_members().items():
        floats = storage.vectors.floats(members)
        if floats:
            total = np.sum(list(floats.values()), axis=0)
            expected[mid] = total / np.linalg.norm(total)
    return expected


def assert_window_vectors_fresh(storage: Storage, inspect: Inspector, ids: Sequence[int]) -> None:
    """The stored window vectors of ``ids`` (every message the test stored) are exactly
    the ones a recount gives, and none is left of a message that is gone."""
    expected = window_vectors_from_scratch(storage, inspect)
    stored = storage.vectors.window_vectors(list(ids))
    assert inspect.orphan_window_vectors() == 0
    assert stored.keys() == expected.keys()
    for mid, vector in expected.items():
        np.testing.assert_allclose(stored[mid], vector, atol=2e-3)  # stored as float16


def edited(record: MessageRecord, content: str) -> MessageRecord:
    return MessageRecord(**{**vars(record), "content": content,
                            "edited_at": BASE_MS + 3_600_000})


@pytest.mark.parametrize("how", [
    "ingest", "store-then-embed", "delete", "edit-pending", "edit-reembedded", "opt-out",
    "purge-channel", "reply-target-deleted", "out-of-order", "reembed", "becomes-content-free",
])
def test_window_vectors_follow_every_change(
    engine: MemoryEngine, make_record: MakeRecord, how: str, inspector: Inspect
) -> None:
    records = conversation(make_record, LINES)
    target = make_record("the budget meeting is on monday", created_at=BASE_MS - 3 * GAP_MS)
    reply = make_record("monday works for the budget", reply_to_id=target.id,
                        created_at=BASE_MS + 30 * 60_000)
    everything = [target, *records, reply]
    if how == "out-of-order":
        for index in (5, 0, 7, 2, 1, 3, 6, 4):
            engine.ingest([everything[index]])
    else:
        engine.ingest(everything, embed=how != "store-then-embed")
    secret = records[2]
    if how == "store-then-embed":
        assert inspector(engine.storage).window_vector_rows() == 0
        engine.embed_pending()
    elif how == "delete":
        engine.forget_messages([secret.id])
    elif how.startswith("edit"):
        engine.storage.messages.upsert([edited(secret, "never mind, the car needs fixing")])
        if how == "edit-reembedded":
            engine.embed_pending()
    elif how == "opt-out":
        engine.storage.guilds.update_settings(GUILD, opt_out=secret.author_id)
        engine.forget_member(GUILD, secret.author_id)
    elif how == "purge-channel":
        engine.forget_channels([CHANNEL])
    elif how == "reply-target-deleted":
        engine.forget_messages([target.id])
    elif how == "reembed":
        engine.reembed()
    elif how == "becomes-content-free":
        engine.storage.messages.upsert([edited(secret, "lol")])
        engine.embed_pending()
        assert engine.storage.vectors.window_vectors([secret.id]) == {}
    assert_window_vectors_fresh(engine.storage, inspector(engine.storage),
                                [r.id for r in everything])
    if how in ("ingest", "out-of-order"):
        found = engine.storage.vectors.window_vectors([r.id for r in everything])
        assert found.keys() == {r.id for r in everything} - {records[1].id, records[5].id}
        # "what for" and "fine" have no content of their own: no window vector


def test_a_deleted_messages_vector_leaves_its_neighbours_window_vectors(
    engine: MemoryEngine, make_record: MakeRecord
) -> None:
    records = conversation(make_record, LINES)
    engine.ingest(records)
    secret, neighbour = records[2], records[3]
    old = engine.storage.vectors.floats([secret.id])[secret.id]
    before = engine.storage.vectors.window_vectors([neighbour.id])[neighbour.id]
    engine.forget_messages([secret.id])
    after = engine.storage.vectors.window_vectors([neighbour.id])[neighbour.id]
    rest = engine.storage.vectors.floats(r.id for r in records if r is not secret)  # its window now
    without = np.sum(list(rest.values()), axis=0)
    np.testing.assert_allclose(after, without / np.linalg.norm(without), atol=2e-3)
    assert float(after @ old) < float(before @ old)  # its direction is gone from the mean


def test_a_huge_message_gives_its_neighbours_windows_only_its_start(
    engine: MemoryEngine, make_record: MakeRecord, inspector: Callable[[Storage], Inspector]
) -> None:
    """Issue 31.2: an imported 50 MB message was indexed again in each of the up to five
    windows that hold it (486 MB of database for one message).  Windows hold its first
    EMBED_CHARS characters; its own keyword entry keeps all of it."""
    huge, after = conversation(make_record, [
        "start of a long paste " + "filler " * 400_000 + "zanzibar", "thanks for the paste"])
    engine.storage.messages.upsert([huge, after])
    window = inspector(engine.storage).window_text(after.id)
    assert "start of a long paste" in window and "zanzibar" not in window
    assert len(window) < 2 * EMBED_CHARS
    hits = engine.search("zanzibar", guild_id=GUILD, mode="keyword").hits
    assert [h.id for h in hits] == [huge.id]
