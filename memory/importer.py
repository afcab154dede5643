"""Read DiscordChatExporter JSON exports into :class:`MessageRecord` objects.

Tolerant by design: optional fields may be missing, partitioned exports
(``... [part 2].json``) are just more files, and thread exports record their parent
channel (DiscordChatExporter puts a thread's parent in ``categoryId``).
"""

from __future__ import annotations

import json
import logging
from collections.abc import Iterator
from dataclasses import dataclass
from datetime import datetime
from pathlib import Path
from typing import Any

from memory.errors import ImportFormatError
from memory.records import MessageRecord, datetime_to_ms, snowflake_time_ms

log = logging.getLogger(__name__)

_MAX_ID = 2**63 - 1  # SQLite INTEGER
THREAD_TYPES = {"GuildPublicThread", "GuildPrivateThread", "GuildNewsThread"}
# System notices carry no conversation worth remembering.
SKIPPED_TYPES = {
    "RecipientAdd", "RecipientRemove", "Call", "ChannelNameChange", "ChannelIconChange",
    "ChannelPinnedMessage", "GuildMemberJoin", "ThreadCreated", "GuildBoost",
    "GuildBoostTier1", "GuildBoostTier2", "GuildBoostTier3", "ChannelFollowAdd",
}


@dataclass
class ExportFile:
    """One parsed export: its records and how many messages were skipped."""

    path: Path
    guild_name: str
    channel_name: str
    records: list[MessageRecord]
    skipped: int


def find_exports(paths: list[str | Path]) -> list[Path]:
    """Expand files and folders (recursively) into a sorted list of ``.json`` files.

    Raises:
        ImportFormatError: A path does not exist.
    """
    found: list[Path] = []
    for raw in paths:
        path = Path(raw)
        if path.is_dir():
            found.extend(sorted(p for p in path.rglob("*.json") if p.is_file()))
        elif path.is_file():
            found.append(path)
        else:
            raise ImportFormatError(f"{path}: no such file or folder")
    return list(dict.fromkeys(found))


def read_export(path: str | Path) -> ExportFile:
    """Parse one DiscordChatExporter JSON file.

    Raises:
        ImportFormatError: The file is not JSON or lacks ``guild``/``channel``/``messages``.
    """
    path = Path(path)
    try:
        data = json.loads(path.read_text(encoding="utf-8-sig"))
    except (OSError, UnicodeDecodeError, json.JSONDecodeError, RecursionError) as exc:
        raise ImportFormatError(f"{path}: not a readable JSON export ({exc})") from None
    if not isinstance(data, dict) or not isinstance(data.get("messages"), list):
        raise ImportFormatError(f"{path}: not a DiscordChatExporter export (no messages list)")
    guild, channel = data.get("guild"), data.get("channel")
    guild = guild if isinstance(guild, dict) else {}
    channel = channel if isinstance(channel, dict) else {}
    guild_id, channel_id = _snowflake(guild.get("id")), _snowflake(channel.get("id"))
    if guild_id is None or channel_id is None:
        raise ImportFormatError(f"{path}: export lacks a valid guild.id or channel.id")
    context = _ChannelContext(
        guild_id=guild_id,
        guild_name=_text(guild.get("name")),
        channel_id=channel_id,
        channel_name=_text(channel.get("name")),
        channel_type=_text(channel.get("type")),
        parent_id=_parent_id(channel),
    )
    records, skipped = [], 0
    for raw in data["messages"]:
        record = _record(raw, context)
        if record is None:
            skipped += 1
        else:
            records.append(record)
    return ExportFile(path, context.guild_name, context.channel_name, records, skipped)


@dataclass(frozen=True)
class _ChannelContext:
    guild_id: int
    guild_name: str
    channel_id: int
    channel_name: str
    channel_type: str
    parent_id: int | None


def _parent_id(channel: dict[str, Any]) -> int | None:
    if _text(channel.get("type")) not in THREAD_TYPES:
        return None
    return _snowflake(channel.get("parentId") or channel.get("categoryId"))


def _record(raw: Any, ctx: _ChannelContext) -> MessageRecord | None:
    """Build a record from one exported message, or ``None`` if it is unusable."""
    if not isinstance(raw, dict) or _text(raw.get("type", "Default")) in SKIPPED_TYPES:
        return None
    message_id = _snowflake(raw.get("id"))
    if message_id is None:
        return None
    content = _text(raw.get("content"))
    attachments = tuple(
        _text(a.get("fileName") or a.get("url")) or "attachment"
        for a in _list(raw.get("attachments"))
        if isinstance(a, dict)
    )
    if not content.strip() and not attachments:
        return None
    author = raw.get("author") if isinstance(raw.get("author"), dict) else {}
    reference = raw.get("reference") if isinstance(raw.get("reference"), dict) else {}
    return MessageRecord(
        id=message_id,
        guild_id=ctx.guild_id,
        channel_id=ctx.channel_id,
        author_id=_snowflake(author.get("id")) or 0,
        created_at=_time_ms(raw.get("timestamp")) or snowflake_time_ms(message_id),
        edited_at=_time_ms(raw.get("timestampEdited")),
        content=content,
        author_name=_text(author.get("name")),
        author_display_name=_text(author.get("nickname")) or _text(author.get("name")),
        author_is_bot=author.get("isBot") is True,
        guild_name=ctx.guild_name,
        channel_name=ctx.channel_name,
        channel_type=ctx.channel_type,
        parent_id=ctx.parent_id,
        reply_to_id=_snowflake(reference.get("messageId")),
        attachments=attachments,
    )


def _snowflake(value: Any) -> int | None:
    """An id as SQLite can store it (0 <= id < 2**63), or ``None`` for anything else."""
    if isinstance(value, bool) or not isinstance(value, (int, str)):
        return None
    try:
        number = int(value)
    except ValueError:
        return None
    return number if 0 <= number <= _MAX_ID else None


def _text(value: Any) -> str:
    """A string field as valid Unicode: ``""`` for non-strings, lone surrogates replaced.

    ``json`` accepts escapes such as ``"\\ud800"`` that SQLite cannot store.
    """
    if not isinstance(value, str):
        return ""
    return value.encode("utf-8", "surrogatepass").decode("utf-8", "replace")


def _list(value: Any) -> list:
    return value if isinstance(value, list) else []


def _time_ms(value: Any) -> int | None:
    if not isinstance(value, str) or not value:
        return None
    try:
        return datetime_to_ms(datetime.fromisoformat(value.replace("Z", "+00:00")))
    except (ValueError, OverflowError):
        log.debug("unparseable timestamp %r", value)
        return None


def iter_exports(paths: list[str | Path]) -> Iterator[ExportFile | ImportFormatError]:
    """Yield each export found under ``paths``; a bad file yields its error instead."""
    for path in find_exports(paths):
        try:
            yield read_export(path)
        except ImportFormatError as exc:
            log.info("%s", exc)  # the caller reports it (the summary lists every bad file)
            yield exc
