"""Live capture: a Discord message becomes a :class:`~memory.records.MessageRecord`.

The listeners (and the backfill) turn each message into a record here, then hand
it to the runtime's write queue (:mod:`cogs.memory.write_queue`), which stores it
even when the database is busy.  Text comes as valid Unicode: the gateway's JSON may
carry lone surrogates (``"\\ud83d"``), which no database stores.
"""

from __future__ import annotations

import discord

from memory.records import MessageRecord, datetime_to_ms
from memory.text import valid_unicode


def record_from_message(message: discord.Message) -> MessageRecord | None:
    """Convert a guild message to a record; ``None`` for DMs, system and empty messages."""
    if message.guild is None or message.type not in (
        discord.MessageType.default, discord.MessageType.reply
    ):
        return None
    attachments = tuple(valid_unicode(a.filename) for a in message.attachments)
    content = valid_unicode(message.content)
    if not content.strip() and not attachments:
        return None
    channel = message.channel
    parent_id = channel.parent_id if isinstance(channel, discord.Thread) else None
    author = message.author
    reference = message.reference
    return MessageRecord(
        id=message.id,
        guild_id=message.guild.id,
        channel_id=channel.id,
        author_id=author.id,
        created_at=datetime_to_ms(message.created_at),
        edited_at=datetime_to_ms(message.edited_at) if message.edited_at else None,
        content=content,
        author_name=valid_unicode(author.name),
        author_display_name=valid_unicode(author.display_name),
        author_is_bot=author.bot,
        guild_name=valid_unicode(message.guild.name or ""),
        channel_name=valid_unicode(getattr(channel, "name", "") or ""),
        # a channel discord.py does not cache (an archived thread's MESSAGE_UPDATE) has no
        # type: "" tells the store that this event does not know it
        channel_type=str(channel.type) if channel.type is not None else "",
        parent_id=parent_id,
        reply_to_id=(
            reference.message_id
            if reference and reference.guild_id and reference.channel_id == channel.id
            else None
        ),
        attachments=attachments,
    )
