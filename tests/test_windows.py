"""Conversational windows in the keyword index: what they hold, that searches use them,
and that they follow every edit and delete (deleted text must not live on in a
neighbour's window) without ever crossing a channel."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import replace
from pathlib import Path

import numpy as np
import pytest

from memory.engine import MemoryEngine
from memory.filters import Filters
from memory.records import MessageRecord
from memory.storage.sqlite.connection import connect
from memory.storage.sqlite.migrations import MIGRATIONS, statements
from memory.storage.sqlite.windows import GAP_MS
from memory.store import MessageStore
from tests.conftest import BASE_MS, CHANNEL, GUILD, NOW

MakeRecord = Callable[..., MessageRecord]
MakeEngine = Callable[..., MemoryEngine]
PRIVATE = CHANNEL + 7


def window(store: MessageStore, message_id: int) -> str:
    rows = store._query("SELECT context FROM search_text WHERE id = ?", (message_id,))
    return rows[0][0] if rows else ""


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
    engine: MemoryEngine, make_record: MakeRecord
) -> None:
    records = conversation(make_record, LINES)
    first = make_record("the budget meeting is on monday", created_at=BASE_MS - 60_000)
    reply = make_record("monday works", created_at=BASE_MS + 10 * 60_000, reply_to_id=first.id)
    engine.ingest([first, *records, reply])
    text = window(engine.store, records[2].id)
    assert "Monica: can I borrow a hundred bucks" in text
    assert "Monica: yes, new clothes" in text and "fine" not in text  # two either side
    assert "Monica: I've got to get back in the game" in text
    assert "budget meeting" in window(engine.store, reply.id)  # the reply target


def test_keyword_search_finds_a_line_by_its_windows_words(
    engine: MemoryEngine, make_record: MakeRecord
) -> None:
    records = conversation(make_record, LINES)
    engine.ingest(records)
    found = engine.store.keyword('"borrow" OR "hundred"', 10, Filters(guild_id=GUILD),
                                 field="window")
    assert records[2].id in {mid for mid, _ in found}
    by_own_words = engine.store.keyword('"borrow"', 10, Filters(guild_id=GUILD))
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
    engine: MemoryEngine, make_record: MakeRecord, how: str
) -> None:
    records = conversation(make_record, LINES)
    secret = records[2]
    engine.ingest(records)
    assert "get back in the game" in window(engine.store, records[1].id)
    if how == "delete":
        engine.delete([secret.id])
    elif how == "edit":
        engine.upsert([MessageRecord(**{**vars(secret), "content": "never mind",
                                        "edited_at": BASE_MS + 3_600_000})])
    elif how == "opt-out":
        engine.update_settings(GUILD, opt_out=secret.author_id)
        engine.forget_member(GUILD, secret.author_id)
    else:
        engine.purge_channels([CHANNEL])
    stored = engine.store._query("SELECT group_concat(context, ' ') FROM search_text")[0][0] or ""
    assert "game" not in stored
    assert engine.store.keyword('"game"', 10, Filters(), field="window") == []
    assert engine.store.keyword('"game"', 10, Filters()) == []
    with engine.store._transaction() as conn:  # the FTS index agrees with its table
        conn.execute("INSERT INTO search_fts(search_fts) VALUES ('integrity-check')")
        conn.execute("INSERT INTO window_fts(window_fts) VALUES ('integrity-check')")


def test_windows_stay_in_their_channel_and_allow_lists_hold(
    engine: MemoryEngine, make_record: MakeRecord
) -> None:
    public = conversation(make_record, LINES)
    # at the same minutes in a private channel: the words a search for "salary" wants
    private = [make_record(f"salary talk {i}", channel_id=PRIVATE, channel_name="officers",
                           created_at=BASE_MS + i * 60_000 + 1) for i in range(3)]
    engine.ingest([*public, *private])
    assert all("salary" not in window(engine.store, r.id) for r in public)
    for mode in ("hybrid", "keyword"):
        result = engine.search("salary talk", guild_id=GUILD, mode=mode,
                               allowed_channel_ids=frozenset({CHANNEL}), adaptive=False)
        assert all(h.channel_id == CHANNEL for h in result.hits), mode
    everything = engine.search("salary talk", guild_id=GUILD, adaptive=False)
    assert everything.hits[0].channel_id == PRIVATE  # found where it may be read


def test_a_long_pause_ends_the_window(engine: MemoryEngine, make_record: MakeRecord) -> None:
    before = make_record("old topic about tomatoes", created_at=BASE_MS)
    after = make_record("new topic about routers", created_at=BASE_MS + GAP_MS + 60_000)
    engine.ingest([before, after])
    assert "tomatoes" not in window(engine.store, after.id)


def test_out_of_order_arrival_gives_the_same_windows(
    make_engine: MakeEngine, make_record: MakeRecord, tmp_path: Path
) -> None:
    records = conversation(make_record, LINES)
    in_order = make_engine(tmp_path / "a.sqlite3")
    in_order.ingest(records)
    shuffled = make_engine(tmp_path / "b.sqlite3")
    for index in (4, 0, 5, 2, 1, 3):  # a backfill walking back, live messages meanwhile
        shuffled.ingest([records[index]])
    assert [window(in_order.store, r.id) for r in records] == [
        window(shuffled.store, r.id) for r in records]


def test_upgrading_an_older_database_indexes_its_messages(
    tmp_path: Path, make_record: MakeRecord
) -> None:
    path = tmp_path / "old.sqlite3"
    conn = connect(path)
    for migration in MIGRATIONS[:5]:  # the schema before windows
        if callable(migration):
            migration(conn)
        else:
            for statement in statements(migration):
                conn.execute(statement)
    conn.execute("PRAGMA user_version = 5")
    records = conversation(make_record, LINES)
    conn.execute("INSERT INTO guilds(id) VALUES (?)", (GUILD,))
    conn.execute("INSERT INTO channels(id, guild_id) VALUES (?, ?)", (CHANNEL, GUILD))
    for r in records:
        conn.execute("INSERT OR IGNORE INTO authors(id, display_name) VALUES (?, ?)",
                     (r.author_id, r.author_display_name))
        conn.execute("INSERT INTO messages(id, guild_id, channel_id, author_id, created_at, "
                     "content) VALUES (?, ?, ?, ?, ?, ?)",
                     (r.id, GUILD, CHANNEL, r.author_id, r.created_at, r.content))
    conn.close()
    store = MessageStore(path)
    try:
        assert store.stats().schema_version == len(MIGRATIONS)
        assert "hundred bucks" in window(store, records[1].id)
        assert {mid for mid, _ in store.keyword('"bucks"', 10, Filters())} == {records[0].id}
    finally:
        store.close()


def test_very_common_terms_leave_the_window_search_only(
    make_engine: MakeEngine, make_record: MakeRecord
) -> None:
    engine = make_engine(window_term_max_df=3)
    engine.ingest([make_record(f"printer news {i}") for i in range(5)]
                  + [make_record("the printer nozzle clogged"), make_record("nozzle swap done")])
    searcher = engine.searcher
    # "printer" is in 6 messages (over 3): only the window search drops it
    assert searcher._window_match(["printer", "nozzle"]) == '"nozzle"'
    assert searcher._window_match(["printer"]) == '"printer"'  # the rarest term always stays
    assert searcher._window_match(["printer", "news"]) == '"news"'  # 5 vs 6: both common, rarest kept
    engine.searcher.config = replace(engine.searcher.config, window_term_max_df=0)
    assert searcher._window_match(["printer", "nozzle"]) == '"printer" OR "nozzle"'
    result = engine.search("printer nozzle", guild_id=GUILD, adaptive=False)
    assert {"window", "keyword"} <= set(result.trace.candidates)


# -- window vectors ---------------------------------------------------------------------


def window_vectors_from_scratch(store: MessageStore) -> dict[int, np.ndarray]:
    """Every window vector as it should be: its embedded members' normalised mean."""
    expected = {}
    for mid, members in store._query(
        "SELECT id, context_ids FROM search_text WHERE contentful"
    ):
        floats = store.vectors.floats(int(m) for m in members.split())
        if floats:
            total = np.sum(list(floats.values()), axis=0)
            expected[mid] = total / np.linalg.norm(total)
    return expected


def assert_window_vectors_fresh(store: MessageStore) -> None:
    expected = window_vectors_from_scratch(store)
    stored = store.window_vectors([row[0] for row in store._query("SELECT id FROM messages")])
    orphans = store._query("SELECT count(*) FROM window_vectors WHERE id NOT IN "
                           "(SELECT id FROM messages)")[0][0]
    assert orphans == 0
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
    engine: MemoryEngine, make_record: MakeRecord, how: str
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
        assert engine.store._query("SELECT count(*) FROM window_vectors")[0][0] == 0
        engine.embed_pending()
    elif how == "delete":
        engine.delete([secret.id])
    elif how.startswith("edit"):
        engine.upsert([edited(secret, "never mind, the car needs fixing")])
        if how == "edit-reembedded":
            engine.embed_pending()
    elif how == "opt-out":
        engine.update_settings(GUILD, opt_out=secret.author_id)
        engine.forget_member(GUILD, secret.author_id)
    elif how == "purge-channel":
        engine.purge_channels([CHANNEL])
    elif how == "reply-target-deleted":
        engine.delete([target.id])
    elif how == "reembed":
        engine.reembed()
    elif how == "becomes-content-free":
        engine.upsert([edited(secret, "lol")])
        engine.embed_pending()
        assert engine.store.window_vectors([secret.id]) == {}
    assert_window_vectors_fresh(engine.store)
    if how in ("ingest", "out-of-order"):
        found = engine.store.window_vectors([r.id for r in everything])
        assert found.keys() == {r.id for r in everything} - {records[1].id, records[5].id}
        # "what for" and "fine" have no content of their own: no window vector


def test_a_deleted_messages_vector_leaves_its_neighbours_window_vectors(
    engine: MemoryEngine, make_record: MakeRecord
) -> None:
    records = conversation(make_record, LINES)
    engine.ingest(records)
    secret, neighbour = records[2], records[3]
    old = engine.store.vectors.floats([secret.id])[secret.id]
    before = engine.store.window_vectors([neighbour.id])[neighbour.id]
    engine.delete([secret.id])
    after = engine.store.window_vectors([neighbour.id])[neighbour.id]
    rest = engine.store.vectors.floats(r.id for r in records if r is not secret)  # its window now
    without = np.sum(list(rest.values()), axis=0)
    np.testing.assert_allclose(after, without / np.linalg.norm(without), atol=2e-3)
    assert float(after @ old) < float(before @ old)  # its direction is gone from the mean


def test_upgrading_computes_the_window_vectors_of_stored_messages(
    engine: MemoryEngine, make_record: MakeRecord
) -> None:
    engine.ingest(conversation(make_record, LINES))
    path = engine.store.path
    with engine.store._transaction() as conn:  # the database as migration 7 left it
        conn.execute("DROP TABLE window_vectors")
        conn.execute("PRAGMA user_version = 7")
    engine.close()
    store = MessageStore(path)
    try:
        assert store.stats().schema_version == len(MIGRATIONS)
        assert len(store.window_vectors([r[0] for r in store._query("SELECT id FROM messages")])) == 4
        assert_window_vectors_fresh(store)
    finally:
        store.close()
