"""Click parameter types for the command line: every bad value is one clear line."""

from __future__ import annotations

import re
from datetime import datetime, timezone
from typing import Any

import click

MAX_SNOWFLAKE = 2**63 - 1  # what SQLite's INTEGER holds
LOG_LEVELS = ("DEBUG", "INFO", "WARNING", "ERROR", "CRITICAL")
_ASCII_DIGITS = re.compile(r"[0-9]+")


def parse_snowflake(text: str) -> int | None:
    """A Discord id written in ASCII digits, or ``None`` if ``text`` is not one.

    Raises:
        ValueError: Digits, but too large for an id.
    """
    if not _ASCII_DIGITS.fullmatch(text):
        return None
    number = int(text)
    if number > MAX_SNOWFLAKE:
        raise ValueError(f"{text} is too large for a Discord id")
    return number


class Snowflake(click.ParamType):
    """A Discord id: ASCII digits, at most 2**63 - 1."""

    name = "id"

    def convert(self, value: Any, param: click.Parameter | None, ctx: click.Context | None) -> int:
        """Return the id, or fail with a one-line usage error."""
        if isinstance(value, int) and not isinstance(value, bool):
            value = str(value)
        try:
            number = parse_snowflake(str(value))
        except ValueError as exc:
            self.fail(str(exc), param, ctx)
        if number is None:
            self.fail(f"{value!r} is not a Discord id (digits 0-9 only)", param, ctx)
        return number


class IdOrName(click.ParamType):
    """A channel or author given by id (ASCII digits) or by name; ids are range-checked."""

    name = "id|name"

    def convert(
        self, value: Any, param: click.Parameter | None, ctx: click.Context | None
    ) -> int | str:
        """Return an ``int`` id or the name as given."""
        text = str(value)
        try:
            number = parse_snowflake(text)
        except ValueError as exc:
            self.fail(str(exc), param, ctx)
        if number is not None:
            return number
        if not text.strip():
            self.fail("give an id or a name", param, ctx)
        return text


class IsoDate(click.ParamType):
    """An ISO 8601 date or date-time; naive means UTC."""

    name = "date"

    def convert(
        self, value: Any, param: click.Parameter | None, ctx: click.Context | None
    ) -> datetime:
        """Return an aware datetime."""
        if isinstance(value, datetime):
            parsed = value
        else:
            try:
                parsed = datetime.fromisoformat(str(value))
            except ValueError:
                self.fail(f"not an ISO 8601 date: {value!r}", param, ctx)
        parsed = parsed if parsed.tzinfo else parsed.replace(tzinfo=timezone.utc)
        try:
            parsed.timestamp()
        except (OverflowError, ValueError, OSError):
            self.fail(f"date out of range: {value!r}", param, ctx)
        return parsed


SNOWFLAKE = Snowflake()
ID_OR_NAME = IdOrName()
ISO_DATE = IsoDate()
PORT = click.IntRange(1, 65535)
LOG_LEVEL = click.Choice(LOG_LEVELS, case_sensitive=False)
