"""Time expressions in a query: "yesterday", "last week", "in May", "3 days ago".

:func:`parse_when` reads the few forms it can be sure of and returns the time span
they name, relative to the search's ``now``; the search gives messages inside that
span a bounded bonus (never a filter: a guess must not hide the answer).
:func:`asks_recent` tells whether a query wants recent things at all ("latest",
"recently"), the only case where recency ranks results.
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from datetime import datetime, timedelta, timezone

MONTHS = {
    name: number
    for number, names in enumerate(
        [("january", "jan"), ("february", "feb"), ("march", "mar"), ("april", "apr"),
         ("may",), ("june", "jun"), ("july", "jul"), ("august", "aug"),
         ("september", "sep", "sept"), ("october", "oct"), ("november", "nov"),
         ("december", "dec")],
        start=1,
    )
    for name in names
}
_UNITS = {"day": 1, "days": 1, "week": 7, "weeks": 7, "month": 30, "months": 30,
          "year": 365, "years": 365}
_NUMBERS = {"a": 1, "an": 1, "one": 1, "two": 2, "three": 3, "four": 4, "five": 5, "six": 6,
            "seven": 7, "eight": 8, "nine": 9, "ten": 10, "couple": 2, "few": 3}
_MONTH = "|".join(sorted(MONTHS, key=len, reverse=True))
_AGO = re.compile(rf"\b(\d+|{'|'.join(_NUMBERS)})\s+(?:of\s+)?({'|'.join(_UNITS)})\s+ago\b")
_LAST = re.compile(r"\b(last|this|past)\s+(week|month|year|weekend)\b")
_IN_MONTH = re.compile(rf"\b(?:in|during|since|on|from|of)\s+(?:early\s+|late\s+|mid\s+)?({_MONTH})\b"
                       r"(?:\s+(?:of\s+)?(\d{4})\b)?")
_MONTH_YEAR = re.compile(rf"\b({_MONTH})\s+(\d{{4}})\b")
_RECENT = re.compile(
    r"\b(recent|recently|lately|latest|newest|last\s+time|these\s+days|nowadays|"
    r"currently|right\s+now|today|yesterday|this\s+(?:week|month))\b"
)


@dataclass(frozen=True)
class TimeSpan:
    """A span of time a query names: ``start`` inclusive, ``end`` exclusive (UTC)."""

    start: datetime
    end: datetime
    text: str

    def contains_ms(self, ms: int) -> bool:
        """Whether a unix-millisecond time lies in the span."""
        return self.start.timestamp() * 1000 <= ms < self.end.timestamp() * 1000


def asks_recent(query: str) -> bool:
    """Whether the query asks for recent things ("latest", "lately", "today")."""
    return bool(_RECENT.search(query.lower()))


def parse_when(query: str, now: datetime) -> TimeSpan | None:
    """The time span a query names, or ``None`` when it names none this can be sure of.

    Understood: today, yesterday, N days/weeks/months/years ago, last/this/past
    week/month/year/weekend, "in May" (the latest May not after ``now``),
    "in May 2023", "May 2023".  A date no calendar holds ("in May 0000", "999999 days
    ago") names none: it is words of the query, not a reason to fail the search.
    """
    try:
        return _parse(query.lower(), now)
    except (ValueError, OverflowError):
        return None


def _parse(text: str, now: datetime) -> TimeSpan | None:
    now = now.astimezone(timezone.utc)
    midnight = now.replace(hour=0, minute=0, second=0, microsecond=0)
    if re.search(r"\byesterday\b", text):
        return TimeSpan(midnight - timedelta(days=1), midnight, "yesterday")
    if re.search(r"\btoday\b|\btonight\b", text):
        return TimeSpan(midnight, midnight + timedelta(days=1), "today")
    if match := _AGO.search(text):
        count = int(match[1]) if match[1].isdigit() else _NUMBERS[match[1]]
        days = count * _UNITS[match[2]]
        slack = max(1, days // 4)  # "3 weeks ago" is about then, not on the day
        centre = midnight - timedelta(days=days)
        return TimeSpan(centre - timedelta(days=slack), centre + timedelta(days=slack + 1),
                        match[0])
    if match := _LAST.search(text):
        return _last(match[1], match[2], now, midnight, match[0])
    if match := (_IN_MONTH.search(text) or _MONTH_YEAR.search(text)):
        return _month(MONTHS[match[1]], int(match[2]) if match[2] else None, now, match[0])
    return None


def _last(which: str, unit: str, now: datetime, midnight: datetime, text: str) -> TimeSpan:
    if unit == "weekend":
        saturday = midnight - timedelta(days=(midnight.weekday() - 5) % 7 or 7)
        return TimeSpan(saturday, saturday + timedelta(days=2), text)
    if which == "past":
        days = {"week": 7, "month": 31, "year": 366}[unit]
        return TimeSpan(now - timedelta(days=days), now + timedelta(seconds=1), text)
    current = {"week": midnight - timedelta(days=midnight.weekday()),  # this period's start
               "month": midnight.replace(day=1),
               "year": midnight.replace(month=1, day=1)}[unit]
    if which == "this":
        return TimeSpan(current, now + timedelta(seconds=1), text)
    previous = {"week": current - timedelta(days=7),
                "month": (current - timedelta(days=1)).replace(day=1),
                "year": current.replace(year=current.year - 1)}[unit]
    return TimeSpan(previous, current, text)


def _month(month: int, year: int | None, now: datetime, text: str) -> TimeSpan:
    if year is None:
        year = now.year if month <= now.month else now.year - 1
    start = datetime(year, month, 1, tzinfo=timezone.utc)
    end = datetime(year + (month == 12), month % 12 + 1, 1, tzinfo=timezone.utc)
    return TimeSpan(start, end, text)
