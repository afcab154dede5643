"""Time expressions in queries, and the bounded bonus they give messages in their span."""

from __future__ import annotations

from collections.abc import Callable
from datetime import datetime, timezone

import pytest

from memory.config import SearchConfig
from memory.engine import MemoryEngine
from memory.records import MessageRecord, datetime_to_ms
from memory.search.when import asks_recent, parse_when
from tests.support.builders import GUILD

NOW = datetime(2026, 11, 23, 15, 30, tzinfo=timezone.utc)  # a Monday


def day(month: int, d: int, year: int = 2026) -> datetime:
    return datetime(year, month, d, tzinfo=timezone.utc)


@pytest.mark.parametrize("query, start, end", [
    ("what did we say yesterday", day(11, 22), day(11, 23)),
    ("anything today?", day(11, 23), day(11, 24)),
    ("the plan from last week", day(11, 16), day(11, 23)),
    ("what happened last month", day(10, 1), day(11, 1)),
    ("photos from last year", day(1, 1, 2025), day(1, 1, 2026)),
    ("this month's raid", day(11, 1), None),
    ("what was decided in May", day(5, 1), day(6, 1)),
    ("what was decided in December", day(12, 1, 2025), day(1, 1, 2026)),
    ("in May 2023 they moved", day(5, 1, 2023), day(6, 1, 2023)),
    ("the trip in early june of 2024", day(6, 1, 2024), day(7, 1, 2024)),
    ("Sept 2025 meetup", day(9, 1, 2025), day(10, 1, 2025)),
    ("two weeks ago", day(11, 6), day(11, 13)),  # 9 November, give or take 3 days
    ("3 days ago", day(11, 19), day(11, 22)),
    ("last weekend", day(11, 21), day(11, 23)),
])
def test_time_expressions(query: str, start: datetime, end: datetime | None) -> None:
    span = parse_when(query, NOW)
    assert span is not None and span.start == start
    assert span.end == (end or span.end) and span.end > span.start
    if end is None:
        assert span.end > NOW


@pytest.mark.parametrize("query", [
    "when did the raid move to 9", "what may I bring", "how many weeks does it take",
    "the last of the tomatoes", "", "march of the penguins", "\x00", "a" * 10_000,
    # no calendar holds these: words of the query, never a failed search
    "printer in may 0000", "printer in december 9999", "printer 999999 days ago",
])
def test_no_time_expression_is_guessed(query: str) -> None:
    assert parse_when(query, NOW) is None


def test_a_five_digit_year_is_not_read_as_its_first_four() -> None:
    span = parse_when("in may 10000", NOW)
    assert span is not None and span.start.year == 2026  # "in May"; 10000 is just a word


def test_a_date_no_calendar_holds_still_searches(
    engine: MemoryEngine, make_record: Callable[..., MessageRecord]
) -> None:
    engine.ingest([make_record("the printer jammed again")])
    for query in ("printer in december 9999", "printer 999999 days ago"):
        assert engine.search(query, guild_id=GUILD, mode="keyword").hits


@pytest.mark.parametrize("query, recent", [
    ("what's the latest on the printer", True), ("anything new lately", True),
    ("what did Sam say about routers", False), ("where is the last screw", False),
])
def test_asks_recent(query: str, recent: bool) -> None:
    assert asks_recent(query) is recent


def test_messages_in_the_named_span_get_a_bounded_bonus(
    engine: MemoryEngine, make_record: Callable[..., MessageRecord]
) -> None:
    may = make_record("the garden plot rota is sorted",
                      created_at=datetime_to_ms(day(5, 12)))
    june = make_record("the garden plot rota is sorted",
                       created_at=datetime_to_ms(day(6, 12)))
    engine.ingest([may, june])
    result = engine.search("what about the garden plot rota in May", guild_id=GUILD,
                           mode="keyword", now=NOW)
    assert [h.id for h in result.hits] == [may.id, june.id]
    unit = 1 / (SearchConfig().rrf_k + 1)
    assert result.hits[0].bonus - result.hits[1].bonus == pytest.approx(
        SearchConfig().time_weight * unit, rel=1e-3)
