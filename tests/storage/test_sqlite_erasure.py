"""Forgotten text is gone from the SQLite file and its write-ahead log, not only from
the tables: every way of forgetting, read back as raw bytes (issue 19, item 7)."""

from __future__ import annotations

import json
import time
import uuid
from collections.abc import Callable
from dataclasses import replace
from pathlib import Path

import numpy as np
import pytest

import bot
from memory.engine import MemoryEngine
from memory.filters import Filters
from memory.records import MessageRecord, ms_to_datetime
from memory.storage import open_storage
from memory.storage.sqlite import scrub
from tests.support.builders import CHANNEL, GUILD
from tests.support.sqlite import sql_write

OTHER_CHANNEL = CHANNEL + 1
DAY_MS = 86_400_000


@pytest.fixture
def storage_kind() -> str:
    """These tests read the SQLite file's bytes."""
    return "sqlite"


def file_bytes(path: str | Path) -> dict[str, bytes]:
    """The database file and its write-ahead log, as they are on disk."""
    return {name: Path(f"{path}{suffix}").read_bytes() if Path(f"{path}{suffix}").exists() else b""
            for name, suffix in (("db", ""), ("wal", "-wal"))}


def marker() -> str:
    # lower case (the index folds case), ends in a digit (no stemming), never seen before
    return "zq" + uuid.uuid4().hex[:14] + "7"


def traces(path: str | Path, needles: dict[str, bytes]) -> dict[str, list[str]]:
    """Which needles each file still holds."""
    return {name: [label for label, needle in needles.items() if needle in data]
            for name, data in file_bytes(path).items()}


def now_ms(days_ago: float = 0) -> int:
    return int(time.time() * 1000) - int(days_ago * DAY_MS)


Forget = Callable[[MemoryEngine, MessageRecord], int]

FORGETTING: dict[str, Forget] = {
    "message deleted on Discord": lambda e, r: e.forget_messages([r.id]),
    "forget-me": lambda e, r: e.forget_member(GUILD, r.author_id),
    "purge-channel": lambda e, r: e.forget_channels([OTHER_CHANNEL]),
    "retention purge": lambda e, r: e.forget_older_than(GUILD, ms_to_datetime(now_ms(30))),
    "server left": lambda e, r: e.forget_guild(GUILD),
}


@pytest.mark.parametrize("forget", FORGETTING.values(), ids=FORGETTING.keys())
def test_forgotten_text_and_vectors_leave_the_file_and_the_wal(
    make_engine: Callable[..., MemoryEngine], make_record: Callable[..., MessageRecord],
    tmp_db: str, forget: Forget,
) -> None:
    engine = make_engine(tmp_db)
    secret, attachment = marker(), marker()
    fillers = [make_record(f"filler line {i} about the harbour {uuid.uuid4().hex[:6]}",
                           created_at=now_ms(1) + i, author_id=1) for i in range(200)]
    # forget-me, purge-channel and leaving the server forget 100+ messages: the keyword
    # index is rebuilt; a single delete or the retention purge erase word by word
    theirs = [make_record(f"crew note {i} {uuid.uuid4().hex[:6]}", created_at=now_ms(2) + i,
                          author_id=9, channel_id=OTHER_CHANNEL) for i in range(100)]
    target = make_record(f"the code word is {secret} so keep it", created_at=now_ms(40),
                         author_id=9, channel_id=OTHER_CHANNEL, attachments=(f"{attachment}.png",))
    after = make_record("noted, thanks", created_at=now_ms(40) + 1000, author_id=9,
                        channel_id=OTHER_CHANNEL)  # its window and vector context held the secret
    engine.ingest([*fillers, *theirs, target, after])
    vector = engine.storage.vectors.floats([target.id])[target.id].astype(np.float32).tobytes()
    needles = {"text": secret.encode(), "attachment": attachment.encode(),
               # the index stores a term after the prefix it shares with the one before it
               "index term": secret[-10:].encode(), "vector": vector}
    before = traces(tmp_db, needles)
    assert set(before["db"] + before["wal"]) == set(needles), "the test must see them first"
    assert engine.search(secret, guild_id=GUILD, mode="keyword").hits

    assert forget(engine, target) >= 1

    assert traces(tmp_db, needles) == {"db": [], "wal": []}
    assert engine.search(secret, guild_id=GUILD, mode="keyword").hits == []


@pytest.mark.parametrize("how", ["forget_messages", "forget_member"])
def test_a_large_forget_rebuilds_the_keyword_index(
    make_record: Callable[..., MessageRecord], tmp_db: str, monkeypatch: pytest.MonkeyPatch,
    how: str,
) -> None:
    """Forget-me of a prolific member erased word by word (about 11 ms a message), where
    every other large forget rebuilds the index (2,000 of 8,000: 15.3 s against 2.5 s)."""
    rebuilt: list[bool] = []
    real = scrub._rebuilt_after

    def spy(conn: object) -> object:
        rebuilt.append(True)
        return real(conn)

    monkeypatch.setattr(scrub, "_rebuilt_after", spy)
    storage = open_storage(tmp_db)
    try:
        records = [make_record(f"line {i} about boats", author_id=9 if i % 3 == 0 else 1)
                   for i in range(300)]
        storage.messages.upsert(records)
        theirs = [r.id for r in records if r.author_id == 9]
        removed = (storage.forgetting.forget_messages(theirs) if how == "forget_messages"
                   else storage.forgetting.forget_member(GUILD, 9))
        assert (removed, rebuilt) == (100, [True])
        assert not storage.keywords.ranked(["boats"], 500, Filters(author_ids=(9,)))
    finally:
        storage.close()


@pytest.mark.parametrize("deleted", ["thread", "channel"])
def test_a_deleted_channels_and_its_threads_names_leave_the_file(
    engine: MemoryEngine, make_record: Callable[..., MessageRecord], tmp_db: str, deleted: str,
) -> None:
    room, title = marker(), marker()  # a thread's title is text a member wrote
    thread = OTHER_CHANNEL + 1
    engine.ingest([make_record(f"filler {i}", created_at=now_ms(1) + i) for i in range(5)])
    engine.ingest([
        make_record("in the room", channel_id=OTHER_CHANNEL, channel_name=f"room {room}",
                    created_at=now_ms(1) + 10),
        make_record("in the thread", channel_id=thread, parent_id=OTHER_CHANNEL,
                    channel_type="GuildPublicThread", channel_name=f"leave {title}",
                    created_at=now_ms(1) + 11),
    ])
    needles = {"thread title": title.encode()}
    if deleted == "channel":
        needles["channel name"] = room.encode()
    found = traces(tmp_db, needles)
    assert set(found["db"] + found["wal"]) == set(needles), "the test must see them first"

    engine.forget_channels([thread if deleted == "thread" else OTHER_CHANNEL])

    assert traces(tmp_db, needles) == {"db": [], "wal": []}


def test_text_removed_by_an_edit_leaves_the_file(
    engine: MemoryEngine, make_record: Callable[..., MessageRecord], tmp_db: str,
) -> None:
    secret = marker()
    original = make_record(f"my password is {secret}", created_at=now_ms(1))
    engine.ingest([original, make_record("filler about the harbour", created_at=now_ms(1) + 1)])
    needles = {"text": secret.encode(), "index term": secret[-10:].encode()}
    found = traces(tmp_db, needles)
    assert set(found["db"] + found["wal"]) == set(needles)

    engine.ingest([replace(original, content="my password is (removed)",
                           edited_at=original.created_at + 60_000)])

    assert traces(tmp_db, needles) == {"db": [], "wal": []}
    assert engine.search("removed", guild_id=GUILD, mode="keyword").hits


def test_a_file_written_before_secure_delete_is_scrubbed_once(
    make_engine: Callable[..., MemoryEngine], make_record: Callable[..., MessageRecord],
    tmp_db: str,
) -> None:
    """Text forgotten by an older version lingers in free space; the next open removes it."""
    engine = make_engine(tmp_db)
    secret = marker()
    keep = make_record("the harbour opens at nine", created_at=now_ms(1))
    gone = make_record(f"the code word is {secret}", created_at=now_ms(1) + 1)
    engine.ingest([keep, gone])
    engine.close()
    # as an older version wrote it: keyword index in its default mode, never scrubbed,
    # and the delete itself without secure_delete (what erase_deleted=False leaves out)
    sql_write(tmp_db, *(f"INSERT INTO {table}({table}, rank) VALUES ('secure-delete', 0)"
                        for table in ("search_fts", "window_fts")),
              "DELETE FROM meta WHERE key = 'deleted_text_scrubbed'")
    older = open_storage(tmp_db, erase_deleted=False)
    older.forgetting.forget_messages([gone.id])
    older.close()
    assert secret.encode() in file_bytes(tmp_db)["db"], "an older version leaves it behind"

    reopened = open_storage(tmp_db)
    try:
        assert secret.encode() not in b"".join(file_bytes(tmp_db).values())
        assert secret[-10:].encode() not in b"".join(file_bytes(tmp_db).values())
        assert reopened.messages.count() == 1
        assert reopened.meta.get("deleted_text_scrubbed") == "1"
    finally:
        reopened.close()


def test_bench_secure_delete_runs(tmp_path: Path, capsys: pytest.CaptureFixture) -> None:
    out_file = tmp_path / "erasure.json"
    code = bot.main(["bench", "secure-delete", "--messages", "300", "--repeats", "1",
                     "--db-dir", str(tmp_path), "--json", str(out_file)])
    assert code == 0, capsys.readouterr().err
    result = json.loads(out_file.read_text(encoding="utf-8"))
    (row,) = result["sizes"]
    assert row["messages"] == 300 and row["repeats"] == 1
    for mode in ("off", "on"):
        assert row[mode]["import_msgs_per_s"] > 0 and row[mode]["delete_p50_ms"] > 0
        assert row[mode]["forget_me_messages"] > 0
    assert row["off"]["purge_channel_messages"] == row["on"]["purge_channel_messages"] > 0
    assert row["scrub_once_s"] >= 0 and "delete_p50_ms" in row["on_vs_off"]
    assert list(tmp_path.iterdir()) == [out_file]  # the databases were removed
