"""Importing DiscordChatExporter JSON: the demo server, tolerant parsing of minimal and
odd exports, bad files reported per file, and idempotent re-imports."""

from __future__ import annotations

import json
import logging
from datetime import datetime, timezone
from pathlib import Path
from typing import Any

import pytest

from memory.config import Profile, RerankerConfig
from memory.engine import MemoryEngine
from memory.errors import ImportFormatError
from memory.importer import find_exports, read_export
from memory.ingest import store_in_chunks
from memory.records import datetime_to_ms, snowflake_time_ms
from tests.support.builders import HashEmbedder
from tests.support.sqlite import sql_rows

DEMO = Path(__file__).resolve().parents[2] / "data" / "demo-server"
DEMO_GUILD = 820703368577024001
EVENTS = 820703867699200017
REPAIR_THREAD = 1562134932619264018
DEMO_MESSAGES = 295  # every message in the five demo files has text


def export(
    path: Path,
    messages: list[Any],
    *,
    guild: Any = None,
    channel: Any = None,
) -> Path:
    """Write a DiscordChatExporter-shaped file (only what the test gives)."""
    doc = {
        "guild": guild if guild is not None else {"id": "900", "name": "Tiny guild"},
        "channel": channel if channel is not None else {"id": "901", "name": "chat",
                                                         "type": "GuildTextChat"},
        "messages": messages,
    }
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(doc, ensure_ascii=False), encoding="utf-8")
    return path


def msg(mid: int | str, content: str = "hello", **extra: Any) -> dict[str, Any]:
    return {"id": str(mid), "content": content, **extra}


def db_rows(engine: MemoryEngine, sql: str, params: tuple = ()) -> list[tuple]:
    """Rows read from the engine's SQLite file on a connection of its own."""
    return sql_rows(engine.storage.database.location, sql, params)


# -- the demo server ------------------------------------------------------------------


@pytest.fixture
def demo(engine: MemoryEngine) -> MemoryEngine:
    summary = engine.import_exports([DEMO])
    assert summary.errors == []
    return engine


def test_demo_import_summary(engine: MemoryEngine) -> None:
    summary = engine.import_exports([DEMO])
    assert summary.files == 5
    assert summary.inserted == DEMO_MESSAGES
    assert (summary.updated, summary.unchanged, summary.skipped) == (0, 0, 0)
    assert summary.embedded == DEMO_MESSAGES
    stats = engine.storage.stats()
    assert (stats.guilds, stats.channels, stats.messages) == (1, 5, DEMO_MESSAGES)
    assert stats.pending_embeddings == 0


def test_demo_thread_parent(demo: MemoryEngine) -> None:
    assert db_rows(demo, "SELECT parent_id, type, name FROM channels WHERE id = ?",
                   (REPAIR_THREAD,)) == [(EVENTS, "GuildPublicThread", "Repair Café – November")]
    # ordinary channels have no parent even though the export names a category
    assert db_rows(demo, "SELECT count(*) FROM channels WHERE parent_id IS NOT NULL") == [(1,)]
    assert set(demo.storage.messages.expand_channels([EVENTS])) == {EVENTS, REPAIR_THREAD}


def test_demo_replies_attachments_and_edits(demo: MemoryEngine) -> None:
    rows = demo.storage.messages.hydrate([1540301969686528247, 1548297177137152151, 1566013984342016267])
    assert rows[1540301969686528247].reply_to_id == 1540299507630080246
    assert rows[1548297177137152151].attachments == ("print-settings.pdf",)
    assert rows[1566013984342016267].attachments == ("halloween-group.jpg",)
    assert db_rows(demo, "SELECT count(*) FROM messages WHERE reply_to_id IS NOT NULL") == [(37,)]
    assert db_rows(demo, "SELECT count(*) FROM messages WHERE attachments != ''") == [(8,)]
    edited = db_rows(demo, "SELECT created_at, edited_at FROM messages WHERE id = ?",
                     (1562133347172352262,))
    assert edited == [(
        datetime_to_ms(datetime.fromisoformat("2026-10-20T18:00:13+02:00")),
        datetime_to_ms(datetime.fromisoformat("2026-10-27T18:08:13+01:00")),
    )]
    assert db_rows(demo, "SELECT count(*) FROM messages WHERE edited_at IS NOT NULL") == [(3,)]


def test_demo_authors_and_nicknames(demo: MemoryEngine) -> None:
    authors = {row[1]: row for row in demo.storage.messages.members(DEMO_GUILD)}
    assert authors["hannahwoods"] == (467669090304000009, "hannahwoods", "Hannah")
    assert len(authors) == len({row[0] for row in authors.values()})


def test_reimporting_the_demo_changes_nothing(demo: MemoryEngine) -> None:
    before = demo.storage.stats()
    again = demo.import_exports([DEMO])
    assert (again.inserted, again.updated, again.unchanged) == (0, 0, DEMO_MESSAGES)
    assert again.embedded == 0
    assert demo.storage.stats() == before


# -- tolerant parsing ----------------------------------------------------------------


def test_minimal_export_with_missing_optional_fields(tmp_path: Path) -> None:
    path = export(tmp_path / "min.json", [
        {"id": "1100000000000000000", "content": "just an id and text"},
        {"id": "1100000000000000001", "content": "no nickname",
         "author": {"id": "77", "name": "plainname"}},
        {"id": "1100000000000000002", "content": "zulu time", "timestamp": "2026-03-01T12:00:00Z",
         "timestampEdited": "2026-03-01T12:05:00.1234567Z"},
        {"id": "1100000000000000003", "content": "naive time", "timestamp": "2026-03-01T12:00:00"},
        {"id": "1100000000000000004", "content": "bad time", "timestamp": "last tuesday"},
        {"id": "1100000000000000005", "content": "reply without a target",
         "reference": {"channelId": "901"}},
    ], guild={"id": "900"}, channel={"id": "901"})
    parsed = read_export(path)
    assert parsed.skipped == 0
    by_id = {r.id: r for r in parsed.records}
    bare = by_id[1100000000000000000]
    assert (bare.author_id, bare.author_name, bare.author_display_name) == (0, "", "")
    assert bare.created_at == snowflake_time_ms(bare.id)
    assert (bare.edited_at, bare.reply_to_id, bare.attachments, bare.parent_id) == (
        None, None, (), None)
    assert (bare.guild_name, bare.channel_name, bare.channel_type) == ("", "", "")
    named = by_id[1100000000000000001]
    assert (named.author_id, named.author_name, named.author_display_name) == (
        77, "plainname", "plainname")
    zulu = by_id[1100000000000000002]
    utc_noon = datetime_to_ms(datetime(2026, 3, 1, 12, tzinfo=timezone.utc))
    assert zulu.created_at == utc_noon
    assert zulu.edited_at == utc_noon + 300_123
    assert by_id[1100000000000000003].created_at == utc_noon
    assert by_id[1100000000000000004].created_at == snowflake_time_ms(1100000000000000004)
    assert by_id[1100000000000000005].reply_to_id is None


@pytest.mark.parametrize(
    "raw",
    [
        pytest.param({"id": "5", "type": "GuildMemberJoin", "content": "joined"}, id="join"),
        pytest.param({"id": "5", "type": "ChannelPinnedMessage", "content": "pinned"}, id="pin"),
        pytest.param({"id": "5", "type": "ThreadCreated", "content": "thread"}, id="thread"),
        pytest.param({"id": "5", "content": ""}, id="empty"),
        pytest.param({"id": "5", "content": "  \n\t "}, id="whitespace"),
        pytest.param({"id": "5"}, id="no-content"),
        pytest.param({"id": "5", "content": 42}, id="content-not-text"),
        pytest.param({"content": "no id"}, id="no-id"),
        pytest.param({"id": "abc", "content": "bad id"}, id="bad-id"),
        pytest.param({"id": "-5", "content": "negative id"}, id="negative-id"),
        pytest.param({"id": str(2**70), "content": "huge id"}, id="huge-id"),
        pytest.param({"id": True, "content": "bool id"}, id="bool-id"),
        pytest.param("not a message", id="string"),
        pytest.param(None, id="null"),
        pytest.param([1, 2], id="list"),
    ],
)
def test_unusable_messages_are_skipped(tmp_path: Path, raw: Any) -> None:
    path = export(tmp_path / "x.json", [raw, msg(1100000000000000009, "keep me")])
    parsed = read_export(path)
    assert [r.content for r in parsed.records] == ["keep me"]
    assert parsed.skipped == 1


def test_attachment_only_message_is_kept(tmp_path: Path) -> None:
    path = export(tmp_path / "x.json", [
        msg(10, "", attachments=[{"fileName": "scan.pdf"}, {"url": "https://x/y.png"}, {}]),
    ])
    (record,) = read_export(path).records
    assert record.attachments == ("scan.pdf", "https://x/y.png", "attachment")


def test_a_forward_is_imported_as_live_capture_stores_it(tmp_path: Path) -> None:
    reference = {"type": "Forward", "messageId": "9", "channelId": "901", "guildId": "900"}
    path = export(tmp_path / "x.json", [
        msg(10, "", reference=reference, forwardedMessage={
            "content": "the launch moved to june", "attachments": [{"fileName": "plan.pdf"}]}),
        msg(11, "", reference=reference, forwardedMessage={"content": 7, "embeds": [{}]}),
    ], guild={"id": "900"}, channel={"id": "901"})
    (record,) = read_export(path).records  # a forward of nothing storable is skipped
    assert record.content == "[forwarded] the launch moved to june"
    assert record.attachments == ("plan.pdf",)
    assert record.reply_to_id is None, "a forward is not a reply to what it forwards"


@pytest.mark.parametrize(
    "extra, check",
    [
        pytest.param({"attachments": 5}, lambda r: r.attachments == (), id="attachments-int"),
        pytest.param({"attachments": "a.png"}, lambda r: r.attachments == (), id="attachments-str"),
        pytest.param({"attachments": ["a.png", None]}, lambda r: r.attachments == (),
                     id="attachments-not-dicts"),
        pytest.param({"reference": "123"}, lambda r: r.reply_to_id is None, id="reference-str"),
        pytest.param({"reference": {"messageId": "x"}}, lambda r: r.reply_to_id is None,
                     id="reference-bad-id"),
        pytest.param({"forwardedMessage": "x"}, lambda r: r.id == 10, id="forward-str"),
        pytest.param({"forwardedMessage": {"content": "not this"}}, lambda r: r.id == 10,
                     id="forward-with-text-of-its-own"),
        pytest.param({"author": "bob"}, lambda r: r.author_id == 0, id="author-str"),
        pytest.param({"author": {"id": str(2**64), "name": "big"}},
                     lambda r: r.author_id == 0 and r.author_name == "big", id="author-huge-id"),
        pytest.param({"author": {"id": "3", "name": 5, "nickname": ["x"]}},
                     lambda r: (r.author_name, r.author_display_name) == ("", ""),
                     id="author-names-not-text"),
        pytest.param({"author": {"id": "3", "name": "n", "isBot": "false"}},
                     lambda r: r.author_is_bot is False, id="isbot-str"),
        pytest.param({"type": ["Default"]}, lambda r: r.id == 10, id="type-not-text"),
        pytest.param({"timestamp": 12345}, lambda r: r.created_at == snowflake_time_ms(10),
                     id="timestamp-int"),
        pytest.param({"timestampEdited": {"when": "now"}}, lambda r: r.edited_at is None,
                     id="edited-dict"),
    ],
)
def test_odd_field_shapes_are_tolerated(tmp_path: Path, extra: dict, check) -> None:
    path = export(tmp_path / "x.json", [msg(10, "still here", **extra)])
    (record,) = read_export(path).records
    assert record.content == "still here"
    assert check(record)


def test_lone_surrogates_are_replaced_and_storable(tmp_path: Path, engine: MemoryEngine) -> None:
    # json allows "\ud800" escapes that are not valid Unicode; SQLite cannot store them
    path = tmp_path / "x.json"
    path.write_text(
        '{"guild": {"id": "900", "name": "g\\udc80"}, "channel": {"id": "901"},'
        ' "messages": [{"id": "10", "content": "bad \\ud800 text",'
        ' "author": {"id": "3", "name": "n\\udfff"}}]}',
        encoding="utf-8",
    )
    summary = engine.import_exports([path])
    assert (summary.inserted, summary.errors) == (1, [])
    content = engine.storage.messages.hydrate([10])[10].content
    assert content.startswith("bad ") and content.endswith(" text")
    content.encode("utf-8")  # valid Unicode now
    assert len(engine.search("bad text", guild_id=900, mode="keyword").hits) == 1


def test_a_nul_character_is_stored_as_a_replacement(tmp_path: Path, db_location: str) -> None:
    # JSON may escape U+0000; PostgreSQL's text refuses it, and the import stopped there
    path = export(tmp_path / "x.json",
                  [msg(10 + i, f"message {i}" + ("\x00" if i == 3 else "")) for i in range(10)])
    engine = MemoryEngine(db_location, Profile(name="test", reranker=RerankerConfig(backend="none")),
                          HashEmbedder())
    try:
        summary = engine.import_exports([path])
        assert (summary.inserted, summary.errors) == (10, [])
        assert engine.storage.messages.hydrate([13])[13].content == "message 3\ufffd"
    finally:
        engine.close()


def test_thread_export_records_parent(tmp_path: Path) -> None:
    thread = {"id": "950", "type": "GuildPublicThread", "categoryId": "901", "name": "t"}
    private = {"id": "951", "type": "GuildPrivateThread", "parentId": "902", "categoryId": "1"}
    orphan = {"id": "952", "type": "GuildPublicThread"}
    text = {"id": "953", "type": "GuildTextChat", "categoryId": "901"}
    parents = [
        read_export(export(tmp_path / f"{c['id']}.json", [msg(10)], channel=c)).records[0].parent_id
        for c in (thread, private, orphan, text)
    ]
    assert parents == [901, 902, None, None]


def test_a_thread_export_alone_names_its_parent(tmp_path: Path, engine: MemoryEngine) -> None:
    """A forum holds no messages of its own: its name comes from its posts' exports."""
    post = {"id": "950", "type": "GuildPublicThread", "categoryId": "901",
            "category": "help-forum", "name": "printer jams"}
    text = {"id": "953", "type": "GuildTextChat", "categoryId": "800", "category": "Chat",
            "name": "general"}
    engine.import_exports([export(tmp_path / "post.json", [msg(10)], channel=post),
                           export(tmp_path / "text.json", [msg(11)], channel=text)])
    messages = engine.storage.messages
    assert messages.channel_ids_named("help-forum") == [901]
    assert messages.expand_channels([901]) == (901, 950)
    assert messages.channel_ids_named("Chat") == [], "a text channel's category is no channel"


def test_partitioned_exports_are_all_imported(tmp_path: Path, engine: MemoryEngine) -> None:
    folder = tmp_path / "exports"
    export(folder / "Tiny guild - chat [901].json", [msg(1000 + i, f"part one {i}")
                                                     for i in range(3)])
    export(folder / "Tiny guild - chat [901] [part 2].json", [msg(1003, "part two"),
                                                              msg(1002, "part one 2")])
    export(folder / "nested" / "Tiny guild - chat [901] [part 3].json", [msg(1004, "three")])
    (folder / "notes.txt").write_text("not an export")
    assert len(find_exports([folder])) == 3
    summary = engine.import_exports([folder])
    assert (summary.files, summary.inserted, summary.unchanged, summary.errors) == (3, 5, 1, [])
    assert engine.storage.messages.count() == 5


def test_same_file_given_twice_is_read_once(tmp_path: Path) -> None:
    path = export(tmp_path / "a.json", [msg(10)])
    assert find_exports([path, tmp_path, path]) == [path]


# -- bad files --------------------------------------------------------------------------


@pytest.mark.parametrize(
    "content, message",
    [
        pytest.param("{ not json", "not a readable JSON export", id="syntax"),
        pytest.param("", "not a readable JSON export", id="empty-file"),
        pytest.param(b"\xff\xfe\x00garbage", "not a readable JSON export", id="binary"),
        pytest.param("[" * 100_000 + "]" * 100_000, "no messages list",
                     id="nested-too-deep"),
        pytest.param("[]", "no messages list", id="list"),
        pytest.param('"just a string"', "no messages list", id="string"),
        pytest.param('{"messages": {}}', "no messages list", id="messages-dict"),
        pytest.param('{"messages": []}', "guild.id or channel.id", id="no-guild"),
        pytest.param('{"guild": {"id": "x"}, "channel": {"id": "2"}, "messages": []}',
                     "guild.id or channel.id", id="bad-guild-id"),
        pytest.param('{"guild": "900", "channel": {"id": "2"}, "messages": []}',
                     "guild.id or channel.id", id="guild-not-object"),
        pytest.param(f'{{"guild": {{"id": "900"}}, "channel": {{"id": "{2**64}"}}, "messages": []}}',
                     "guild.id or channel.id", id="huge-channel-id"),
    ],
)
def test_malformed_file_is_an_import_format_error(
    tmp_path: Path, content: str | bytes, message: str
) -> None:
    path = tmp_path / "broken.json"
    if isinstance(content, bytes):
        path.write_bytes(content)
    else:
        path.write_text(content, encoding="utf-8")
    with pytest.raises(ImportFormatError) as excinfo:
        read_export(path)
    assert str(path) in str(excinfo.value)
    assert message in str(excinfo.value)


def test_an_edit_that_took_out_all_the_text_forgets_the_stored_copy(
    tmp_path: Path, engine: MemoryEngine
) -> None:
    # the same message in an older export and in a newer one, edited down to a sticker
    sticker = {"stickers": [{"id": "7", "name": "wave"}]}
    older = export(tmp_path / "old.json", [msg(10, "my phone number is 555-0199", **sticker)])
    newer = export(tmp_path / "new.json", [msg(10, "", timestampEdited="2026-03-01T12:00:00Z",
                                               **sticker)])
    engine.import_exports([older])
    summary = engine.import_exports([newer])
    assert summary.emptied == 1 and engine.storage.messages.count() == 0
    assert not engine.search("phone number", mode="keyword").hits
    again = engine.import_exports([older])  # the old export once more: it stays out
    assert again.inserted == 0 and engine.storage.messages.count() == 0


def test_a_byte_that_is_not_utf8_costs_one_character_not_the_rest(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    # message 3 saved in Latin-1: a strict reader gave up on messages 3 to 9
    path = export(tmp_path / "mixed.json", [msg(10 + i, f"message {i} at the cafe")
                                            for i in range(10)])
    raw = path.read_bytes()
    path.write_bytes(raw.replace(b"message 3 at the cafe", "message 3 at the café".encode(
        "latin-1")))
    with caplog.at_level(logging.WARNING, logger="memory.importer"):
        records = list(read_export(path).records)
    assert [r.content for r in records][2:5] == [
        "message 2 at the cafe", "message 3 at the caf\ufffd", "message 4 at the cafe"]
    assert len(records) == 10 and "not UTF-8" in caplog.text


@pytest.mark.parametrize("guild, kind", [
    ({"id": "0", "name": "Direct Messages"}, "DirectTextChat"),
    ({"id": "0", "name": "Direct Messages"}, "DirectGroupTextChat"),
    ({"id": "900", "name": "odd"}, "DirectTextChat"),
])
def test_a_direct_message_export_is_refused(tmp_path: Path, guild: dict, kind: str) -> None:
    # live capture never stores a DM: neither does an import
    path = export(tmp_path / "dm.json", [msg(10, "private dm about passwords")], guild=guild,
                  channel={"id": "9001", "name": "alice", "type": kind})
    with pytest.raises(ImportFormatError, match="direct-message export"):
        read_export(path)


def test_bad_files_are_reported_while_the_others_import(
    tmp_path: Path, engine: MemoryEngine
) -> None:
    folder = tmp_path / "mixed"
    export(folder / "good-a.json", [msg(10, "alpha"), msg(11, "beta")])
    (folder / "broken.json").write_text("{ nope", encoding="utf-8")
    (folder / "wrong-shape.json").write_text('{"hello": "world"}', encoding="utf-8")
    export(folder / "good-b.json", [msg(12, "gamma")], channel={"id": "902"})
    summary = engine.import_exports([folder])
    assert summary.files == 4
    assert summary.inserted == 3
    assert len(summary.errors) == 2
    assert any("broken.json" in e for e in summary.errors)
    assert any("wrong-shape.json" in e for e in summary.errors)
    assert engine.storage.messages.count() == 3
    assert engine.storage.backlog.pending_count() == 0


def test_missing_path_is_an_import_format_error(tmp_path: Path, engine: MemoryEngine) -> None:
    with pytest.raises(ImportFormatError, match="no such file"):
        engine.import_exports([tmp_path / "nope"])


def test_import_without_embedding_leaves_a_backlog(tmp_path: Path, engine: MemoryEngine) -> None:
    export(tmp_path / "a.json", [msg(10, "alpha"), msg(11, "beta")])
    summary = engine.import_exports([tmp_path], embed=False)
    assert (summary.inserted, summary.embedded) == (2, 0)
    assert engine.storage.backlog.pending_count() == 2
    assert engine.embed_pending() == 2


def test_a_long_import_commits_in_many_short_transactions(
    engine: MemoryEngine, make_record
) -> None:
    """Each transaction holds about ``seconds`` of work, so a live writer gets its turn."""
    records = [make_record(f"message number {i}") for i in range(3000)]
    before = engine.storage.database.generation
    # the smallest chunks
    stats = store_in_chunks(engine.storage.messages, iter(records), seconds=1e-6)
    assert stats.inserted == 3000
    assert engine.storage.database.generation - before >= 3000 // 500  # at least one commit per chunk
    assert engine.storage.messages.count() == 3000


def test_a_file_damaged_part_way_keeps_what_came_before(
    tmp_path: Path, engine: MemoryEngine
) -> None:
    path = export(tmp_path / "cut.json", [msg(10 + i) for i in range(5)])
    text = path.read_text(encoding="utf-8")
    cut = text.index('"id": "14"') if '"id": "14"' in text else text.rindex("{")
    path.write_text(text[:cut], encoding="utf-8")
    summary = engine.import_exports([path], embed=False)
    assert summary.inserted == engine.storage.messages.count() >= 1
    (error,) = summary.errors
    assert "cut.json" in error and "after" in error


def test_an_id_is_ascii_digits_or_no_id(tmp_path: Path) -> None:
    """int() read "1_0" as 10 (guild 10 was stored), and took spaces, signs and Arabic-Indic
    digits: an odd id became another message's or server's."""
    odd = ["1_0", " 123 ", "+5", "١٢٣", "12.0"]
    path = export(tmp_path / "odd.json", [msg(m) for m in odd] + [msg(77)])
    parsed = read_export(path)
    assert [r.id for r in parsed.records] == [77] and parsed.skipped == len(odd)
    for guild_id in ("1_0", "٩٠٠"):
        with pytest.raises(ImportFormatError, match="valid guild.id"):
            read_export(export(tmp_path / "g.json", [msg(1)], guild={"id": guild_id}))
