"""Retention holds between the hourly purges: nothing older than a guild's retention
period is stored (live capture, backfill, import) or returned (search, the chat
model's context), whether the purge has run yet or not (issue 19, item 6).

Every test runs on both storage engines (``db_location``, :mod:`tests.support.engines`); what
was never stored is absent from the SQLite file's bytes, and from every row of the
PostgreSQL database."""

from __future__ import annotations

import json
import time
from collections.abc import Callable
from datetime import datetime, timedelta, timezone
from pathlib import Path

import discord
import pytest

import bot
from memory.engine import MemoryEngine
from memory.errors import SettingsError
from memory.records import MessageRecord
from memory.search import SearchRequest
from memory.storage import Storage, open_storage
from tests.discord.test_backfill import ALICE, GENERAL, G, backfill, history, setup  # noqa: F401
from tests.support.builders import GUILD, snowflake
from tests.support.engines import holds_text

DAY_MS = 86_400_000


def days_ago(days: float) -> int:
    """Unix ms ``days`` before the real now (retention is measured from the real clock)."""
    return int(time.time() * 1000) - int(days * DAY_MS)


@pytest.fixture
def tmp_db(db_location: str) -> str:
    """The root ``engine`` fixture's database: one per storage engine."""
    return db_location


@pytest.fixture
def memory_location(db_location: str) -> str:
    """The backfill harness's database (``tests.discord.test_backfill.setup``): one per engine."""
    return db_location


def holds(location: str, text: str) -> bool:
    storage: Storage = open_storage(location, read_only=True)
    try:
        return holds_text(storage, text)
    finally:
        storage.close()


@pytest.fixture
def aged(make_record: Callable[..., MessageRecord]) -> Callable[[str, float], MessageRecord]:
    def factory(content: str, age_days: float, **fields) -> MessageRecord:
        return make_record(content, created_at=days_ago(age_days), **fields)
    return factory


def test_ingest_leaves_out_messages_older_than_retention(
    engine: MemoryEngine, aged: Callable[..., MessageRecord]
) -> None:
    engine.storage.guilds.update_settings(GUILD, retention_days=30)
    records = [aged("fresh pelican notes", 1), aged("late pelican notes", 29),
               aged("stale walrus ninetydaymarker", 90), aged("ancient walrus hundredtwentymarker", 120)]

    stats = engine.ingest(records)

    assert (stats.inserted, stats.expired) == (2, 2)
    assert engine.storage.messages.count() == 2
    assert engine.search("walrus", guild_id=GUILD).hits == []
    assert not holds_text(engine.storage, "ninetydaymarker")
    assert not holds_text(engine.storage, "hundredtwentymarker")
    assert holds_text(engine.storage, "pelican")  # the test reads the right bytes


def test_a_guild_without_retention_keeps_old_messages(
    engine: MemoryEngine, aged: Callable[..., MessageRecord]
) -> None:
    engine.storage.guilds.update_settings(GUILD + 1, retention_days=30)  # another guild's period binds only it
    stats = engine.ingest([aged("old walrus", 400)])
    assert (stats.inserted, stats.expired) == (1, 0)
    assert [h.content for h in engine.search("walrus", guild_id=GUILD).hits] == ["old walrus"]


def test_search_and_context_hide_what_aged_past_retention_before_the_purge(
    engine: MemoryEngine, aged: Callable[..., MessageRecord]
) -> None:
    """Stored while kept, then past the period (here: the period shortened, no purge yet)."""
    old = aged("the walrus fund is in the blue tin", 20)
    reply = aged("thanks, the walrus fund it is", 5, reply_to_id=old.id)
    neighbour = aged("walrus sightings are up this week", 4)
    engine.ingest([old, reply, neighbour])
    assert len(engine.search("walrus", guild_id=GUILD).hits) == 3

    engine.storage.guilds.update_settings(GUILD, retention_days=10)  # what the hourly purge has not seen yet

    for scope in (GUILD, None):
        for mode in ("hybrid", "keyword", "dense"):
            hits = engine.search("walrus blue tin", guild_id=scope, mode=mode).hits
            assert old.id not in {h.id for h in hits}, (scope, mode)
            assert {h.id for h in hits} <= {reply.id, neighbour.id}
    context = engine.context_for("where is the walrus fund?", SearchRequest(queries=("x",), guild_id=GUILD))
    quoted = [line for excerpt in context.excerpts for line in excerpt.lines]
    assert quoted and old.id not in {line.id for line in quoted}
    assert "blue tin" not in context.text
    # a search that asks for the old days explicitly gets nothing older either
    since = datetime.fromtimestamp(days_ago(60) / 1000, tz=timezone.utc)
    assert old.id not in {h.id for h in engine.search("walrus", guild_id=GUILD, after=since).hits}


def test_an_import_of_old_exports_stores_only_what_retention_keeps(
    tmp_path: Path, capsys: pytest.CaptureFixture, db_location: str
) -> None:
    db = db_location
    storage = open_storage(db)
    storage.guilds.update_settings(900, retention_days=30)
    storage.close()
    messages = [
        {"id": str(snowflake(days_ago(age), i)), "content": text,
         "author": {"id": "5", "name": "ann"}}
        for i, (age, text) in enumerate([(2, "recent heron"), (90, "ninety egretmarker"),
                                         (120, "hundred twenty egretmarker")])
    ]
    export = tmp_path / "export.json"
    export.write_text(json.dumps({"guild": {"id": "900", "name": "G"},
                                  "channel": {"id": "901", "name": "chat", "type": "GuildTextChat"},
                                  "messages": messages}))

    code = bot.main(["--db", str(db), "--profile", "cpu-fast", "import", "--no-embed", str(export)])

    out = capsys.readouterr().out
    assert code == 0
    assert "1 new" in out and "2 older than the server's retention period (not stored)" in out
    assert not holds(db, "egretmarker") and holds(db, "heron")


async def test_a_backfill_of_old_history_stores_only_what_retention_keeps(setup):  # noqa: F811
    h, fake = setup
    h.engine.storage.guilds.update_settings(G, retention_days=30)
    fresh = history(h, GENERAL, 3, "fresh")
    old = [
        h.message_payload(f"old backfillmarker {age}", author=(ALICE, "alice"), channel=GENERAL,
                          id=str(discord.utils.time_snowflake(
                              discord.utils.utcnow() - timedelta(days=age))))
        for age in (90, 120)
    ]
    fake.history[GENERAL] = old + fresh

    summary = await backfill(h)

    assert summary.startswith("Backfill finished")
    assert h.engine.storage.messages.count() == 3
    assert not holds_text(h.engine.storage, "backfillmarker")
    assert h.engine.search("backfillmarker", guild_id=G).hits == []


TWENTY_YEARS_S = 20 * 365 * 86_400


def set_host_clock_ahead(monkeypatch: pytest.MonkeyPatch, seconds: float) -> None:
    """The host clock runs ``seconds`` ahead (Discord's clock, in the snowflakes, does not)."""
    real = time.time
    monkeypatch.setattr(time, "time", lambda: real() + seconds)


def test_a_host_clock_far_ahead_expires_nothing_the_period_keeps(
    engine: MemoryEngine, aged: Callable[..., MessageRecord], make_record: Callable[..., MessageRecord],
    monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    """Issue 31, item 5: a clock 20 years ahead expired every message (the hourly pass
    forgot them all, an upsert left every new one out, a search hid everything)."""
    kept = [aged(f"heron note {age}", age) for age in (1, 10, 29)]
    engine.ingest([*kept, aged("walrus fortyfivemarker", 45)])
    engine.storage.guilds.update_settings(GUILD, retention_days=30)
    fresh = make_record("a new heron sighting", created_at=days_ago(0))
    set_host_clock_ahead(monkeypatch, TWENTY_YEARS_S)

    stats = engine.ingest([fresh])
    assert (stats.inserted, stats.expired) == (1, 0)
    assert len(engine.search("heron", guild_id=GUILD, mode="keyword").hits) == 4
    with caplog.at_level("WARNING", logger="memory.engine"):
        removed = engine.forget_expired(GUILD, 30)

    assert removed == 1  # the 45-day-old one, by Discord's clock
    assert engine.storage.messages.count() == 4
    assert not holds_text(engine.storage, "fortyfivemarker")
    assert "not from the host clock" in caplog.text and "7300" in caplog.text


def test_discords_clock_from_the_gateway_moves_retention_on(
    engine: MemoryEngine, aged: Callable[..., MessageRecord], monkeypatch: pytest.MonkeyPatch
) -> None:
    """Nothing stored for over a year and the host clock 20 years ahead: the newest
    stored message alone keeps everything; Discord's clock measured from the gateway
    lets retention count from Discord's now."""
    engine.ingest([aged("heron note", 400), aged("older heron note", 410)])
    discord_now = days_ago(0)
    set_host_clock_ahead(monkeypatch, TWENTY_YEARS_S)
    assert engine.forget_expired(GUILD, 30) == 0  # counted from 400 days ago
    assert engine.forget_expired(GUILD, 30, discord_now_ms=discord_now) == 2
    assert engine.storage.messages.count() == 0


@pytest.mark.parametrize("quiet_days", [40, 400])
def test_a_quiet_guild_still_expires_by_the_host_clock(
    engine: MemoryEngine, aged: Callable[..., MessageRecord], quiet_days: int
) -> None:
    """A host clock weeks, or a year and more, past the newest message is believed: the
    guild was quiet (a bot whose servers fell silent for over a year still forgets)."""
    engine.ingest([aged("heron note", quiet_days), aged("older heron note", quiet_days + 10)])
    assert engine.forget_expired(GUILD, 30) == 2


@pytest.mark.parametrize("days", [0, -5])
def test_a_retention_period_that_is_no_period_forgets_nothing(
    engine: MemoryEngine, aged: Callable[..., MessageRecord], days: int
) -> None:
    """0 means "keep until deleted" to /memory-admin retention, and the settings refuse
    anything below 1: forget_expired(0) or (-5) forgot every message, today's too."""
    engine.ingest([aged("heron note", 0), aged("older heron note", 10)])
    with pytest.raises(SettingsError, match="positive number of days"):
        engine.forget_expired(GUILD, days)
    assert engine.storage.messages.count() == 2


@pytest.mark.parametrize("mode", ["hybrid", "keyword"])
def test_a_page_stays_full_when_most_matches_aged_past_retention(
    engine: MemoryEngine, aged: Callable[..., MessageRecord], mode: str
) -> None:
    """The cutoff is a filter inside the vector and keyword queries, not a cut after them:
    200 closer matches past the period must not crowd the kept ones off the page."""
    expired = [aged(f"walrus fund blue tin ledger {n}", 20 + n / 100) for n in range(200)]
    kept = [aged(f"walrus fund note {n}", 1 + n / 10) for n in range(6)]
    engine.ingest(expired + kept)
    engine.storage.guilds.update_settings(GUILD, retention_days=10)  # no purge has run yet

    result = engine.search("walrus fund blue tin ledger", guild_id=GUILD, mode=mode, limit=5)

    assert len(result.hits) == 5, [h.content for h in result.hits]
    assert {h.id for h in result.hits} <= {r.id for r in kept}
    # neither query brought back an expired row to be dropped later
    assert result.trace.candidates["dense"] <= len(kept)
    assert result.trace.candidates["keyword"] <= len(kept)
