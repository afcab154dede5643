"""Read DiscordChatExporter JSON exports into :class:`MessageRecord` objects.

Tolerant by design: optional fields may be missing, partitioned exports
(``... [part 2].json``) are just more files, and thread exports record their parent
channel (DiscordChatExporter puts a thread's parent in ``categoryId``).
"""

from __future__ import annotations

import codecs
import io
import itertools
import logging
from collections.abc import Iterator, Sequence
from contextlib import contextmanager
from dataclasses import dataclass
from datetime import datetime
from pathlib import Path
from typing import Any, BinaryIO

import ijson

from memory.errors import ImportFormatError
from memory.records import (
    DISCORD_EPOCH_MS,
    MessageRecord,
    datetime_to_ms,
    forwarded_text,
    snowflake_time_ms,
)
from memory.text import valid_unicode

log = logging.getLogger(__name__)

_MAX_ID = 2**63 - 1  # SQLite INTEGER
# A message's time is one a Discord message id can carry: from Discord's epoch
# (2015-01-01) to the time the largest id SQLite stores encodes (2084-09-06).  Anything
# else (0001-01-01, 9999-12-31 in UTC, 1970-01-01) is no Discord time, and a year
# outside 1..9999 in UTC would not even read back as a datetime.
_TIME_RANGE_MS = (DISCORD_EPOCH_MS, snowflake_time_ms(_MAX_ID))
THREAD_TYPES = {"GuildPublicThread", "GuildPrivateThread", "GuildNewsThread"}
# DiscordChatExporter's direct-message channels (exported under a "guild" of id 0)
PRIVATE_CHAT_TYPES = {"DirectTextChat", "DirectGroupTextChat"}
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


class ExportStream:
    """One export read as a stream: the header now, the messages one at a time.

    Memory stays flat however large the file: only the message being converted is
    held.  ``skipped`` counts unusable messages among those read so far.
    """

    def __init__(self, path: str | Path) -> None:
        """Read the export's header (guild and channel).

        Raises:
            ImportFormatError: The file is not JSON or lacks ``guild``/``channel``/``messages``.
        """
        self.path = Path(path)
        self.skipped = 0
        self.emptied: dict[int, int] = {}  # messages an edit left empty: id -> edit time
        self._times = _TimeCheck()
        guild, channel = _read_header(self.path)
        guild_id, channel_id = _snowflake(guild.get("id")), _snowflake(channel.get("id"))
        if guild_id is None or channel_id is None:
            raise ImportFormatError(f"{self.path}: export lacks a valid guild.id or channel.id")
        if guild_id == 0 or _text(channel.get("type")) in PRIVATE_CHAT_TYPES:
            # the bot remembers servers' channels only, as live capture does
            raise ImportFormatError(f"{self.path}: a direct-message export; only server "
                                    "channels are remembered")
        self.context = _ChannelContext(
            guild_id=guild_id,
            guild_name=_text(guild.get("name")),
            channel_id=channel_id,
            channel_name=_text(channel.get("name")),
            channel_type=_text(channel.get("type")),
            parent_id=_parent_id(channel),
            # a thread's parent is its "category" (a forum's name is stored only so)
            parent_name=_text(channel.get("category")) if _parent_id(channel) is not None else "",
        )

    def records(self) -> Iterator[MessageRecord]:
        """Yield the usable messages in file order.

        Raises:
            ImportFormatError: The file is damaged after the header (records already
                yielded stay valid).
        """
        read = 0
        for backend in _BACKENDS:
            try:
                for raw in itertools.islice(self._messages(backend), read, None):
                    read += 1
                    record = _record(raw, self.context, self._times)
                    if record is None:
                        self.skipped += 1
                        if (emptying := _emptying_edit(raw)) is not None:
                            self.emptied[emptying[0]] = emptying[1]
                    else:
                        yield record
                self._times.report(self.path)
                return
            except UnicodeDecodeError:
                # yajl rejects escaped lone surrogates ("\udfff") that Python's JSON
                # accepts (and _text repairs): go on from here with the slower parser
                log.info("%s: lone surrogates; reading on with the Python parser", self.path)
            except _PARSE_ERRORS as exc:
                raise ImportFormatError(
                    f"{self.path}: not a readable JSON export after {read} messages "
                    f"({_reason(exc)})"
                ) from None
            except _RepeatedKey as exc:
                raise ImportFormatError(
                    f"{self.path}: a second top-level {exc.key!r} key after {read} messages "
                    "(an export has one, and JSON readers disagree about which counts): "
                    "re-export the channel"
                ) from None
        raise ImportFormatError(f"{self.path}: not valid UTF-8 after {read} messages")

    def _messages(self, backend: Any) -> Iterator[Any]:
        """The items of the ``messages`` list; then the rest of the file is read for a second.

        JSON parsers disagree about a repeated key (Python's keeps the last, a
        stream reader meets the first), so an export with two is refused, not guessed.
        """
        with _open_json(self.path) as handle:
            events = backend.basic_parse(handle, use_float=True)
            seen: set[str] = set()
            for key, event, value in _top_level(events):
                if key in seen and key in _ONCE:
                    raise _RepeatedKey(key)
                seen.add(key)
                if key == "messages" and event == "start_array":
                    yield from _array_items(events)
                else:
                    _skip(event, events)


def find_exports(paths: Sequence[str | Path]) -> list[Path]:
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
        elif path.exists():
            raise ImportFormatError(f"{path}: not a file or folder")
        else:
            raise ImportFormatError(f"{path}: no such file or folder")
    return list(dict.fromkeys(found))



def read_export(path: str | Path) -> ExportFile:
    """Parse one DiscordChatExporter JSON file completely (see :class:`ExportStream`).

    Raises:
        ImportFormatError: The file is not JSON or lacks ``guild``/``channel``/``messages``.
    """
    stream = ExportStream(path)
    records = list(stream.records())
    ctx = stream.context
    return ExportFile(stream.path, ctx.guild_name, ctx.channel_name, records, stream.skipped)


# keys an export has once; a second one is refused (see ExportStream._messages)
_ONCE = frozenset(("guild", "channel", "messages"))


class _RepeatedKey(Exception):
    def __init__(self, key: str) -> None:
        super().__init__(key)
        self.key = key


_PARSE_ERRORS = (ijson.JSONError, UnicodeDecodeError, ValueError, RecursionError, OSError)
# the C parser when it is built (it is in the wheels), then the pure-Python one
_BACKENDS = tuple(dict.fromkeys((ijson, ijson.get_backend("python"))))
_BOM = b"\xef\xbb\xbf"


def _reason(exc: BaseException) -> str:
    """An exception's message on one line (yajl's are bytes quoting the text, with newlines)."""
    message = exc.args[0] if len(exc.args) == 1 else exc
    if isinstance(message, bytes):
        message = message.decode("utf-8", "replace")
    return " ".join(str(message).split())


@contextmanager
def _open_json(path: Path) -> Iterator[BinaryIO]:
    """The file in binary, past a UTF-8 byte order mark if it has one, each byte that is
    not UTF-8 read as U+FFFD (:class:`_ValidUtf8`)."""
    try:
        handle = path.open("rb")
    except OSError as exc:
        raise ImportFormatError(f"{path}: cannot read the file ({exc})") from None
    with handle:
        if handle.read(3) != _BOM:
            handle.seek(0)
        valid = _ValidUtf8(handle)
        yield io.BufferedReader(valid)
        if valid.replaced:
            log.warning("%s: bytes that are not UTF-8 were read as U+FFFD (a file saved in "
                        "another encoding, in part?)", path)


class _ValidUtf8(io.RawIOBase):
    """A binary file as valid UTF-8: a byte that is not (one character of a message
    saved in Latin-1, say) becomes U+FFFD, costing that character, where a strict
    reader gave up on the rest of the file."""

    def __init__(self, raw: BinaryIO) -> None:
        super().__init__()
        self._raw = raw
        self._decoder = codecs.getincrementaldecoder("utf-8")("replace")
        self._pending = b""
        self.replaced = False  # whether any byte was replaced

    def readable(self) -> bool:
        return True

    def readinto(self, buffer: Any) -> int:
        while not self._pending:
            chunk = self._raw.read(1 << 16)
            text = self._decoder.decode(chunk, final=not chunk)
            self.replaced |= text.count("\ufffd") > chunk.count(b"\xef\xbf\xbd")
            self._pending = text.encode("utf-8")
            if not chunk:
                break
        count = min(len(buffer), len(self._pending))
        buffer[:count] = self._pending[:count]
        self._pending = self._pending[count:]
        return count


def _read_header(path: Path) -> tuple[dict[str, Any], dict[str, Any]]:
    """The export's ``guild`` and ``channel`` objects, checking that ``messages`` is a list.

    Reads only up to the start of ``messages`` when the header comes first (as
    DiscordChatExporter writes it); otherwise skips over the messages, building nothing.
    """
    for backend in _BACKENDS:
        try:
            with _open_json(path) as handle:
                found, has_messages = _scan_header(backend.basic_parse(handle, use_float=True))
            break
        except UnicodeDecodeError:
            continue  # lone surrogates: the Python parser accepts them (see records())
        except _PARSE_ERRORS as exc:
            raise ImportFormatError(f"{path}: not a readable JSON export ({_reason(exc)})") from None
    else:
        raise ImportFormatError(f"{path}: not a readable JSON export (not valid UTF-8)")
    if not has_messages:
        raise ImportFormatError(f"{path}: not a DiscordChatExporter export (no messages list)")
    guild, channel = found.get("guild"), found.get("channel")
    return (guild if isinstance(guild, dict) else {}), (channel if isinstance(channel, dict) else {})


Events = Iterator[tuple[str, Any]]


def _scan_header(events: Events) -> tuple[dict[str, Any], bool]:
    found: dict[str, Any] = {}
    has_messages = False
    for key, event, value in _top_level(events):
        if key in ("guild", "channel") and key not in found:
            found[key] = _value(event, value, events)
            continue
        if key == "messages" and event == "start_array":
            has_messages = True
            if len(found) == 2:
                break
        _skip(event, events)
    return found, has_messages


def _top_level(events: Events) -> Iterator[tuple[str, str, Any]]:
    """Yield ``(key, event, value)`` for the first event of each top-level value.

    The consumer must consume the rest of a container value (:func:`_value`,
    :func:`_skip`, :func:`_array_items`) before asking for the next.  Works on
    ``basic_parse`` events, which carry no path: a path per event costs time
    quadratic in the nesting depth on hostile input.
    """
    first = next(events, None)
    if first is None or first[0] != "start_map":
        return  # not an object at the top: no messages list
    for event, value in events:
        if event == "end_map":
            return
        key = value  # a map_key
        event, value = next(events)
        yield key, event, value


def _value(event: str, value: Any, events: Events) -> Any:
    """The whole value that starts with ``(event, value)``, built from ``events``."""
    if event not in ("start_map", "start_array"):
        return value
    builder = ijson.ObjectBuilder()
    builder.event(event, value)
    depth = 1
    for inner_event, inner_value in events:
        builder.event(inner_event, inner_value)
        depth += inner_event in ("start_map", "start_array")
        depth -= inner_event in ("end_map", "end_array")
        if depth == 0:
            break
    return builder.value


def _skip(event: str, events: Events) -> None:
    """Consume the rest of the value that started with ``event``."""
    depth = int(event in ("start_map", "start_array"))
    while depth:
        inner_event, _ = next(events)
        depth += inner_event in ("start_map", "start_array")
        depth -= inner_event in ("end_map", "end_array")


def _array_items(events: Events) -> Iterator[Any]:
    """Yield each item of the array whose ``start_array`` was just consumed."""
    for event, value in events:
        if event == "end_array":
            return
        yield _value(event, value, events)


@dataclass(frozen=True)
class _ChannelContext:
    guild_id: int
    guild_name: str
    channel_id: int
    channel_name: str
    channel_type: str
    parent_id: int | None
    parent_name: str


def _parent_id(channel: dict[str, Any]) -> int | None:
    if _text(channel.get("type")) not in THREAD_TYPES:
        return None
    return _snowflake(channel.get("parentId") or channel.get("categoryId"))


class _TimeCheck:
    """Reads an export's times, refusing those outside :data:`_TIME_RANGE_MS`, and counts them."""

    def __init__(self) -> None:
        self.refused = 0

    def __call__(self, value: Any) -> int | None:
        """The time in unix milliseconds, or ``None`` when missing, unreadable or refused."""
        ms = _time_ms(value)
        if ms is None or _TIME_RANGE_MS[0] <= ms <= _TIME_RANGE_MS[1]:
            return ms
        self.refused += 1
        return None

    def report(self, path: Path) -> None:
        """Say once per file how many times were refused and what was used instead."""
        if self.refused:
            log.warning(
                "%s: %d timestamps outside 2015-01-01 .. 2084-09-06 UTC (no Discord message "
                "has one) were refused: a message's creation time was taken from its id, an "
                "edit time was dropped", path, self.refused,
            )


def _record(raw: Any, ctx: _ChannelContext, times: _TimeCheck) -> MessageRecord | None:
    """Build a record from one exported message, or ``None`` if it is unusable."""
    if not isinstance(raw, dict) or _text(raw.get("type", "Default")) in SKIPPED_TYPES:
        return None
    message_id = _snowflake(raw.get("id"))
    if message_id is None:
        return None
    content, attachments = _content(raw)
    if not content.strip() and not attachments:
        return None
    author: dict[str, Any] = raw["author"] if isinstance(raw.get("author"), dict) else {}
    reference: dict[str, Any] = (
        raw["reference"] if isinstance(raw.get("reference"), dict) else {}
    )
    created_at = times(raw.get("timestamp"))  # 0 (1970) is a time, refused by its range
    return MessageRecord(
        id=message_id,
        guild_id=ctx.guild_id,
        channel_id=ctx.channel_id,
        author_id=_snowflake(author.get("id")) or 0,
        created_at=snowflake_time_ms(message_id) if created_at is None else created_at,
        edited_at=times(raw.get("timestampEdited")),
        content=content,
        author_name=_text(author.get("name")),
        author_display_name=_text(author.get("nickname")) or _text(author.get("name")),
        author_is_bot=author.get("isBot") is True,
        guild_name=ctx.guild_name,
        channel_name=ctx.channel_name,
        channel_type=ctx.channel_type,
        parent_id=ctx.parent_id,
        parent_name=ctx.parent_name,
        reply_to_id=_same_channel_reply(reference, ctx),
        attachments=attachments,
    )


def _emptying_edit(raw: Any) -> tuple[int, int] | None:
    """``(id, edit time)`` of a message an edit left with nothing to store (its text
    taken out, a sticker left): live capture forgets the stored copy, and so does an
    import (:meth:`.Forgetting.forget_emptied`)."""
    if not isinstance(raw, dict) or _text(raw.get("type", "Default")) in SKIPPED_TYPES:
        return None
    message_id, edited = _snowflake(raw.get("id")), _time_ms(raw.get("timestampEdited"))
    if message_id is None or edited is None:
        return None
    content, attachments = _content(raw)
    return None if content.strip() or attachments else (message_id, edited)


def _content(raw: dict[str, Any]) -> tuple[str, tuple[str, ...]]:
    """The message's text and attachment names.  A forward has none of its own: its
    are the forwarded message's (``forwardedMessage``, as DiscordChatExporter writes
    it), marked as live capture marks them (:func:`~memory.records.forwarded_text`)."""
    content, attachments = _text(raw.get("content")), _attachment_names(raw)
    forwarded = raw.get("forwardedMessage")
    if not content.strip() and not attachments and isinstance(forwarded, dict):
        attachments = _attachment_names(forwarded)
        content = forwarded_text(_text(forwarded.get("content")), attachments)
    return content, attachments


def _attachment_names(message: dict[str, Any]) -> tuple[str, ...]:
    return tuple(
        _text(a.get("fileName") or a.get("url")) or "attachment"
        for a in _list(message.get("attachments"))
        if isinstance(a, dict)
    )


def _same_channel_reply(reference: dict[str, Any], ctx: _ChannelContext) -> int | None:
    """The replied-to message's id when it is in this channel, else ``None``.

    A reply to another channel (a forwarded or cross-posted reference) must not
    carry that channel's text into this one's index, as live capture does not.
    An export without ``channelId`` leaves the check to the store, which embeds a
    reply with its target only when both are in the same channel.
    """
    if reference.get("type") == "Forward":  # the forwarded message, not a reply
        return None
    target = _snowflake(reference.get("messageId"))
    channel = reference.get("channelId")
    if target is None or (channel is not None and _snowflake(channel) != ctx.channel_id):
        return None
    return target


def _snowflake(value: Any) -> int | None:
    """An id as SQLite can store it (0 <= id < 2**63), or ``None`` for anything else.

    A string id is ASCII digits only, as the CLI's ids: ``int()`` also reads ``"1_0"``
    as 10, and spaces, signs and other scripts' digits, so an odd id became another.
    """
    if isinstance(value, bool) or not isinstance(value, (int, str)):
        return None
    if isinstance(value, str) and not (value.isascii() and value.isdigit()):
        return None
    number = int(value)
    return number if 0 <= number <= _MAX_ID else None


def _text(value: Any) -> str:
    """A string field as valid Unicode: ``""`` for non-strings, lone surrogates replaced.

    ``json`` accepts escapes such as ``"\\ud800"`` that SQLite cannot store.
    """
    return valid_unicode(value) if isinstance(value, str) else ""


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


def iter_exports(paths: Sequence[str | Path]) -> Iterator[ExportStream | ImportFormatError]:
    """Yield a stream for each export found under ``paths``; a bad file yields its error."""
    for path in find_exports(paths):
        try:
            yield ExportStream(path)
        except ImportFormatError as exc:
            log.info("%s", exc)  # the caller reports it (the summary lists every bad file)
            yield exc
