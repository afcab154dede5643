"""A member's names belong to the guild they were given in (issue 30, item 1).

One member, two guilds, a different nickname in each: every read of a message's
author (hydrate, the embedder's text, the keyword index and the windows, member-name
resolution) uses the name of the message's own guild; forget-me, opt-out and
forgetting a guild remove that guild's names and no other's; an older database's one
global name row becomes a row per guild the member has messages in.  Every test runs
on both engines.
"""

from __future__ import annotations

import json
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest

import bot
from cli.app import main
from memory.engine import MemoryEngine
from memory.filters import Filters
from memory.records import MessageRecord, ms_to_datetime
from memory.search.members import MemberIndex
from memory.storage import Storage, open_storage
from memory.storage.postgres import migrations as postgres_migrations
from memory.storage.sqlite import migrations as sqlite_migrations
from memory.storage.sqlite.connection import connect
from tests.support.builders import CHANNEL, GUILD
from tests.support.engines import holds_text, inspect
from tests.support.inspection import Inspector

MakeRecord = Callable[..., MessageRecord]
Inspect = Callable[[Storage], Inspector]

HOME, AWAY, THIRD = GUILD, GUILD + 1, GUILD + 2
HOME_CHANNEL, AWAY_CHANNEL, THIRD_CHANNEL = CHANNEL, CHANNEL + 1, CHANNEL + 2
ALICE, BOB = 4101, 4102
SECRET = "Zephyrine"  # Alice's nickname in HOME only


def alice_in_both(make_record: MakeRecord) -> tuple[MessageRecord, MessageRecord]:
    """Alice's message in AWAY (as "Ally"), then one in HOME (as SECRET): the last
    write of a single global row would be HOME's nickname."""
    away = make_record("the ferry leaves at noon from pier four", guild_id=AWAY,
                       channel_id=AWAY_CHANNEL, author_id=ALICE, author_name="alice",
                       author_display_name="Ally", age_days=2)
    home = make_record("bring the spare oars for the ferry", guild_id=HOME,
                       channel_id=HOME_CHANNEL, author_id=ALICE, author_name="alice",
                       author_display_name=SECRET, age_days=1)
    return away, home


def test_a_nickname_names_messages_only_in_its_own_guild(
    engine: MemoryEngine, make_record: MakeRecord, inspector: Inspect
) -> None:
    away, home = alice_in_both(make_record)
    engine.storage.messages.upsert([away])
    engine.storage.messages.upsert([home])
    messages = engine.storage.messages
    assert messages.hydrate([away.id])[away.id].author_name == "Ally"
    assert messages.hydrate([home.id])[home.id].author_name == SECRET
    # the embedder's text: the pending message is named as in its own guild
    pending = {p.id: p for p in engine.storage.backlog.pending(10)}
    assert pending[away.id].author_name == "Ally" and pending[home.id].author_name == SECRET
    # member-name resolution and the keyword index see only the guild's own name
    assert messages.members(AWAY) == [(ALICE, "alice", "Ally")]
    assert messages.members(HOME) == [(ALICE, "alice", SECRET)]
    assert sorted(messages.members(None)) == [(ALICE, "alice", "Ally"), (ALICE, "alice", SECRET)]
    index = MemberIndex(engine.storage)  # a query naming her nickname boosts her only there
    assert index.named([f"what did {SECRET} say about the ferry"], AWAY) == set()
    assert index.named([f"what did {SECRET} say about the ferry"], HOME) == {ALICE}
    assert index.named(["what did Ally say about the ferry"], AWAY) == {ALICE}
    assert SECRET not in inspector(engine.storage).window_text(away.id)
    assert "Ally" in inspector(engine.storage).window_text(away.id)
    assert not engine.storage.keywords.ranked([SECRET.lower()], 10, Filters(guild_id=AWAY))
    assert engine.storage.keywords.ranked([SECRET.lower()], 10, Filters(guild_id=HOME))
    assert inspector(engine.storage).member_names(ALICE) == {AWAY: ("alice", "Ally"),
                                                             HOME: ("alice", SECRET)}


def test_a_nickname_change_in_one_guild_leaves_the_other_alone(
    engine: MemoryEngine, make_record: MakeRecord, inspector: Inspect
) -> None:
    away, home = alice_in_both(make_record)
    engine.storage.messages.upsert([away, home])
    renamed = make_record("a later line", guild_id=HOME, channel_id=HOME_CHANNEL, author_id=ALICE,
                          author_name="alice", author_display_name="Zee")
    unknown = make_record("an event that knows no names", guild_id=AWAY, channel_id=AWAY_CHANNEL,
                          author_id=ALICE, author_name="", author_display_name="")
    engine.storage.messages.upsert([renamed, unknown])
    assert inspector(engine.storage).member_names(ALICE) == {AWAY: ("alice", "Ally"),
                                                             HOME: ("alice", "Zee")}
    assert engine.storage.messages.hydrate([away.id])[away.id].author_name == "Ally"


def test_forget_me_removes_that_guilds_names_only(
    engine: MemoryEngine, make_record: MakeRecord, inspector: Inspect
) -> None:
    away, home = alice_in_both(make_record)
    engine.storage.messages.upsert([away, home])
    assert engine.forget_member(HOME, ALICE) == 1
    assert inspector(engine.storage).member_names(ALICE) == {AWAY: ("alice", "Ally")}
    assert inspector(engine.storage).author_rows(ALICE) == 1  # her AWAY message needs it
    assert engine.storage.messages.hydrate([away.id])[away.id].author_name == "Ally"
    assert not holds_text(engine.storage, SECRET)
    assert engine.forget_member(AWAY, ALICE) == 1
    assert inspector(engine.storage).member_names(ALICE) == {}
    assert inspector(engine.storage).author_rows(ALICE) == 0


def test_retention_and_deletions_leave_no_thread_title_or_name_behind(
    engine: MemoryEngine, make_record: MakeRecord, inspector: Inspect
) -> None:
    """Only a channel's deletion dropped its row: after retention (or forget-me, or single
    deletions) emptied a thread, the title a member wrote stayed, and so did the names of
    a member with no message left in that guild."""
    title, shared, forum, post = "Alice's treatment questions", CHANNEL + 60, CHANNEL + 61, CHANNEL + 62
    thread = CHANNEL + 50
    in_thread = dict(parent_id=HOME_CHANNEL, channel_type="GuildPublicThread")
    old = make_record("did the second round help", guild_id=HOME, channel_id=thread,
                      channel_name=title, author_id=ALICE, author_display_name=SECRET,
                      age_days=40, **in_thread)
    kept = make_record("still here", guild_id=HOME, channel_id=shared, channel_name="shared",
                       author_id=BOB, age_days=1, **in_thread)
    gone = make_record("gone soon", guild_id=HOME, channel_id=shared, channel_name="shared",
                       author_id=ALICE,
                       author_display_name=SECRET, age_days=1, **in_thread)
    forum_post = make_record("a forum post", guild_id=HOME, channel_id=post, parent_id=forum,
                             parent_name="help-forum", channel_name="printer jams",
                             channel_type="GuildPublicThread", author_id=BOB, age_days=1)
    away, _ = alice_in_both(make_record)
    engine.storage.messages.upsert([old, kept, gone, forum_post, away])
    messages = engine.storage.messages

    assert engine.forget_older_than(HOME, ms_to_datetime(old.created_at + 86_400_000)) == 1
    assert messages.channel_ids_named(title) == [] and not holds_text(engine.storage, title)
    assert HOME in inspector(engine.storage).member_names(ALICE)  # her message in `shared`
    assert engine.forget_messages([gone.id]) == 1
    assert inspector(engine.storage).member_names(ALICE) == {AWAY: ("alice", "Ally")}
    assert not holds_text(engine.storage, SECRET)
    assert messages.channel_ids_named("shared") == [shared], "a thread with messages keeps it"
    assert engine.forget_messages([forum_post.id]) == 1
    assert messages.channel_ids_named("printer jams") == []
    assert messages.channel_ids_named("help-forum") == [forum], "a channel's name stays"


def test_opting_out_removes_that_guilds_names_only(
    engine: MemoryEngine, make_record: MakeRecord, inspector: Inspect
) -> None:
    away, home = alice_in_both(make_record)
    engine.storage.messages.upsert([away, home])
    engine.storage.guilds.update_settings(HOME, opt_out=ALICE)
    assert inspector(engine.storage).member_names(ALICE) == {AWAY: ("alice", "Ally")}
    # what is stored stays until forget-me; it is no longer named
    assert engine.storage.messages.hydrate([home.id])[home.id].author_name == ""
    engine.storage.messages.upsert([make_record("withheld", guild_id=HOME, channel_id=HOME_CHANNEL,
                                                author_id=ALICE, author_display_name=SECRET)])
    assert HOME not in inspector(engine.storage).member_names(ALICE)


def test_forgetting_a_guild_removes_its_members_names(
    engine: MemoryEngine, make_record: MakeRecord, inspector: Inspect
) -> None:
    away, home = alice_in_both(make_record)
    bobs = make_record("only here", guild_id=HOME, channel_id=HOME_CHANNEL, author_id=BOB,
                       author_name="bob", author_display_name="Bobby")
    engine.storage.messages.upsert([away, home, bobs])
    engine.forget_messages([bobs.id])  # his last message there takes his name with it
    assert inspector(engine.storage).member_names(BOB) == {}
    engine.forget_guild(HOME)  # and forgetting the guild takes every name it held
    assert inspector(engine.storage).member_names(ALICE) == {AWAY: ("alice", "Ally")}
    assert inspector(engine.storage).member_names(BOB) == {}
    assert inspector(engine.storage).author_rows(BOB) == 0
    assert inspector(engine.storage).author_rows(ALICE) == 1
    assert engine.storage.messages.hydrate([away.id])[away.id].author_name == "Ally"
    assert not holds_text(engine.storage, SECRET)


# -- an older database: one global row per member -------------------------------------------

_OLD_SCHEMA = {"sqlite": (sqlite_migrations, 10), "postgres": (postgres_migrations, 4)}


def _execute(location: str, kind: str, statements: list[tuple[str, tuple]]) -> None:
    if kind == "sqlite":
        conn = connect(location)
        try:
            for sql, params in statements:
                conn.execute(sql.replace("%s", "?"), params)
        finally:
            conn.close()
        return
    import psycopg

    with psycopg.connect(location, autocommit=True) as conn:
        for sql, params in statements:
            conn.execute(sql, params)


def test_an_older_database_moves_each_name_to_the_guilds_its_member_wrote_in(
    storage_kind: str, make_location: Callable[[str], str], monkeypatch: pytest.MonkeyPatch,
    request: pytest.FixtureRequest,
) -> None:
    module, version = _OLD_SCHEMA[storage_kind]
    location = (make_location("old") if storage_kind == "sqlite"
                else request.getfixturevalue("postgres_url")(migrated=False))
    with monkeypatch.context() as patch:
        patch.setattr(module, "MIGRATIONS", module.MIGRATIONS[:version])
        open_storage(location).close()
    rows: list[tuple[str, tuple[Any, ...]]] = [
        ("INSERT INTO guilds(id, name) VALUES (%s, %s)", (g, f"guild {g}"))
        for g in (HOME, AWAY, THIRD)
    ]
    rows += [("INSERT INTO channels(id, guild_id, name) VALUES (%s, %s, %s)", (c, g, "general"))
             for c, g in ((HOME_CHANNEL, HOME), (AWAY_CHANNEL, AWAY), (THIRD_CHANNEL, THIRD))]
    rows += [("INSERT INTO authors(id, name, display_name) VALUES (%s, %s, %s)", (ALICE, "alice", SECRET)),
             ("INSERT INTO authors(id, name, display_name) VALUES (%s, %s, %s)", (BOB, "bob", "Bobby"))]
    rows += [("INSERT INTO messages(id, guild_id, channel_id, author_id, created_at, content) "
              "VALUES (%s, %s, %s, %s, %s, %s)", (mid, g, c, a, 1_700_000_000_000 + mid, "hello there"))
             for mid, g, c, a in ((1, HOME, HOME_CHANNEL, ALICE), (2, AWAY, AWAY_CHANNEL, ALICE),
                                  (3, HOME, HOME_CHANNEL, ALICE), (4, THIRD, THIRD_CHANNEL, BOB))]
    _execute(location, storage_kind, rows)

    storage = open_storage(location)
    try:
        looked = inspect(storage)
        assert looked.member_names(ALICE) == {HOME: ("alice", SECRET), AWAY: ("alice", SECRET)}
        assert looked.member_names(BOB) == {THIRD: ("bob", "Bobby")}  # no row invented elsewhere
        assert storage.messages.hydrate([2])[2].author_name == SECRET  # what AWAY saw till now
        assert storage.messages.members(THIRD) == [(BOB, "bob", "Bobby")]
        storage.forgetting.forget_member(HOME, ALICE)
        assert looked.member_names(ALICE) == {AWAY: ("alice", SECRET)}
    finally:
        storage.close()


# -- what brings names in, and what carries them to another database ------------------------

def two_exports(folder: Path) -> Path:
    """DiscordChatExporter files of AWAY, then HOME: Alice's nickname in each (a single
    global row would keep HOME's, the last imported)."""
    folder.mkdir()
    for order, (guild_id, channel_id, nickname, mid) in enumerate((
            (AWAY, AWAY_CHANNEL, "Ally", 1_100_000_000_000_000_002),
            (HOME, HOME_CHANNEL, SECRET, 1_100_000_000_000_000_001))):
        doc = {"guild": {"id": str(guild_id), "name": f"guild {guild_id}"},
               "channel": {"id": str(channel_id), "name": "general", "type": "GuildTextChat"},
               "messages": [{"id": str(mid), "content": "the ferry leaves at noon",
                             "timestamp": "2026-01-05T10:00:00+00:00",
                             "author": {"id": str(ALICE), "name": "alice", "nickname": nickname}}]}
        (folder / f"{order}-{guild_id}.json").write_text(json.dumps(doc), encoding="utf-8")
    return folder


def test_an_import_names_each_guild_by_its_own_exports_nickname(
    engine: MemoryEngine, tmp_path: Path
) -> None:
    assert engine.import_exports([two_exports(tmp_path / "exports")], embed=False).errors == []
    assert engine.storage.messages.members(AWAY) == [(ALICE, "alice", "Ally")]
    assert engine.storage.messages.members(HOME) == [(ALICE, "alice", SECRET)]
    shown = engine.storage.messages.hydrate([1_100_000_000_000_000_001, 1_100_000_000_000_000_002])
    assert {mid: m.author_name for mid, m in shown.items()} == {
        1_100_000_000_000_000_001: SECRET, 1_100_000_000_000_000_002: "Ally"}


@pytest.mark.postgres
def test_migrate_db_carries_each_guilds_names(
    tmp_path: Path, make_record: MakeRecord, postgres_url: Callable[..., str],
    capsys: pytest.CaptureFixture,
) -> None:
    source, target = str(tmp_path / "memory.sqlite3"), postgres_url()
    away, home = alice_in_both(make_record)
    storage = open_storage(source)
    storage.messages.upsert([away, home])
    storage.close()
    assert main(["migrate-db", source, target]) == 0, capsys.readouterr().err
    copy = open_storage(target)
    try:
        assert inspect(copy).member_names(ALICE) == {AWAY: ("alice", "Ally"), HOME: ("alice", SECRET)}
        assert copy.messages.hydrate([away.id])[away.id].author_name == "Ally"
    finally:
        copy.close()


def test_cli_search_names_and_resolves_authors_per_guild(
    tmp_db: str, tmp_path: Path, capsys: pytest.CaptureFixture
) -> None:
    base = ["--db", tmp_db, "--profile", "cpu-fast"]
    assert bot.main([*base, "import", "--no-embed", str(two_exports(tmp_path / "exports"))]) == 0
    capsys.readouterr()
    search = [*base, "search", "ferry", "--mode", "keyword", "--no-rerank", "--guild", str(AWAY)]
    assert bot.main([*search, "--json"]) == 0
    hits = json.loads(capsys.readouterr().out)["hits"]
    assert [h["author_name"] for h in hits] == ["Ally"]
    assert bot.main([*search, "--author", SECRET]) != 0  # not a name anyone has in AWAY
    assert f"no stored author is called {SECRET!r}" in capsys.readouterr().err
    assert bot.main([*search, "--author", "Ally", "--json"]) == 0
    assert len(json.loads(capsys.readouterr().out)["hits"]) == 1
