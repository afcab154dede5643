"""Click parameter types for the command line: every bad value is one clear line."""

from __future__ import annotations

import re
import tempfile
from datetime import datetime, timezone
from pathlib import Path
from typing import Any, cast

import click

from memory.errors import DatabaseFileError
from memory.storage import check_location
from memory.storage.postgres.connection import is_postgres_url
from memory.text import valid_unicode

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
        """Return an ``int`` id or the name (undecodable bytes replaced, as in queries)."""
        text = valid_unicode(str(value))
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


class InputPath(click.Path):
    """An existing file or folder to read; an empty string is not the current folder."""

    def __init__(self) -> None:
        super().__init__(path_type=Path)

    def convert(self, value: Any, param: click.Parameter | None, ctx: click.Context | None) -> Any:
        """Return the path, refusing ``""`` (which ``Path`` would read as ``.``)."""
        if not str(value).strip():
            self.fail("an empty path; name a file or folder", param, ctx)
        return super().convert(value, param, ctx)


class DatabasePath(click.Path):
    """The database: an SQLite file, or a ``postgresql://`` URL (kept as text); any other
    URL is refused before it becomes folders."""

    def __init__(self) -> None:
        super().__init__(path_type=Path, dir_okay=False)

    def convert(self, value: Any, param: click.Parameter | None, ctx: click.Context | None) -> Any:
        """Return the path or the PostgreSQL URL, or fail on another URL (checked before
        ``Path`` folds its ``//``) or on ``""`` (which ``Path`` would read as ``.``)."""
        if not str(value).strip():
            self.fail("an empty database path; name an SQLite file or a postgresql:// URL",
                      param, ctx)
        try:
            check_location(value)
        except DatabaseFileError as exc:
            self.fail(str(exc), param, ctx)
        if is_postgres_url(value):
            return str(value)
        return super().convert(value, param, ctx)


class OutputFile(click.Path):
    """A file a command will write at the end: checked before any work starts."""

    def __init__(self) -> None:
        super().__init__(path_type=Path, dir_okay=False, writable=True)

    def convert(self, value: Any, param: click.Parameter | None, ctx: click.Context | None) -> Any:
        """Return the path if its folder exists and may be written, else fail now."""
        path = cast(Path, super().convert(value, param, ctx))  # path_type=Path
        folder = path.resolve().parent
        if not folder.is_dir():
            self.fail(f"cannot write {str(path)!r}: no folder {str(folder)!r}", param, ctx)
        try:  # os.access answers yes to root everywhere, even on /proc
            with tempfile.TemporaryFile(dir=folder):
                pass
        except OSError as exc:
            self.fail(f"cannot write in {str(folder)!r} ({exc.strerror or exc})", param, ctx)
        return path


class CountList(click.ParamType):
    """Comma-separated whole numbers, each from ``low`` to ``high``: ``"20,50"`` → ``[20, 50]``."""

    name = "N,N,..."

    def __init__(self, low: int, high: int) -> None:
        self.low, self.high = low, high

    def convert(self, value: Any, param: click.Parameter | None, ctx: click.Context | None) -> Any:
        """Return the counts as a list of ints."""
        if isinstance(value, list):
            return value
        try:
            counts = [int(part) for part in str(value).split(",") if part.strip()]
        except ValueError:
            self.fail(f"comma-separated whole numbers, got {value!r}", param, ctx)
        if not counts or not all(self.low <= n <= self.high for n in counts):
            self.fail(f"counts from {self.low:,} to {self.high:,}, got {value!r}", param, ctx)
        return counts


class ShardIds(click.ParamType):
    """Comma-separated shard ids: ``"0,2"`` → ``(0, 2)`` (checked against the count later)."""

    name = "ID,ID,..."

    def convert(self, value: Any, param: click.Parameter | None, ctx: click.Context | None) -> Any:
        """Return the ids as a tuple of ints, in the order given."""
        if isinstance(value, tuple):
            return value
        parts = [part.strip() for part in str(value).split(",")]
        if not all(part.isascii() and part.isdigit() for part in parts):
            self.fail(f"comma-separated shard ids (0, 1, ...), got {value!r}", param, ctx)
        return tuple(int(part) for part in parts)


SNOWFLAKE = Snowflake()
SHARD_IDS = ShardIds()
ID_OR_NAME = IdOrName()
ISO_DATE = IsoDate()
PORT = click.IntRange(1, 65535)
LOG_LEVEL = click.Choice(LOG_LEVELS, case_sensitive=False)
INPUT_PATH = InputPath()
DATABASE_PATH = DatabasePath()
OUTPUT_FILE = OutputFile()
