"""Live capture: a Discord message becomes a :class:`~memory.records.MessageRecord`.

The listeners (and the backfill) turn each message into a record here, then hand
it to the runtime's write queue (:mod:`cogs.memory.write_queue`), which stores it
even when the database is busy.  Text comes as valid Unicode: the gateway's JSON may
carry lone surrogates (``"\\ud83d"``), which no database stores.

:class:`Gone` remembers what Discord deleted while the bot runs, so that a page of
history fetched before the deletion cannot store its messages again after it.
"""

from __future__ import annotations

import discord

from memory.records import MessageRecord, datetime_to_ms, forwarded_text, poll_text
from memory.text import valid_unicode


def record_from_message(message: discord.Message) -> MessageRecord | None:
    """Convert a guild message to a record; ``None`` for DMs, system and empty messages.

    A forward is stored as the forwarder's message in the channel it was forwarded to
    (whoever may read that channel sees it there on Discord too), its text marked
    :data:`~memory.records.FORWARDED`.
    """
    if message.guild is None or message.type not in (
        discord.MessageType.default, discord.MessageType.reply
    ):
        return None
    content, attachments = _text(message)
    if not content.strip() and not attachments:
        return None
    channel = message.channel
    parent_id = channel.parent_id if isinstance(channel, discord.Thread) else None
    parent = channel.parent if isinstance(channel, discord.Thread) else None
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
        parent_name=valid_unicode(parent.name) if parent is not None else "",
        reply_to_id=(
            reference.message_id
            if reference and reference.type is discord.MessageReferenceType.default
            and reference.guild_id and reference.channel_id == channel.id
            else None
        ),
        attachments=attachments,
    )


def emptied(message: discord.Message) -> bool:
    """Whether an edited guild message of a kind that is stored holds nothing to store
    any more: an edit took out all its text (a sticker, say, is left)."""
    return (message.guild is not None
            and message.type in (discord.MessageType.default, discord.MessageType.reply)
            and record_from_message(message) is None)


def _text(message: discord.Message) -> tuple[str, tuple[str, ...]]:
    """The message's text and attachment names; a forward's are the forwarded message's,
    a poll's its question and answers."""
    own = (valid_unicode(message.content),
           tuple(valid_unicode(a.filename) for a in message.attachments))
    if message.poll is not None and message.poll.question:
        answers = [valid_unicode(a.text or (a.emoji.name if a.emoji else ""))
                   for a in message.poll.answers]  # an answer may be an emoji alone
        poll = poll_text(valid_unicode(message.poll.question), answers)
        return "\n".join(t for t in (own[0], poll) if t.strip()), own[1]
    reference = message.reference
    if (reference is not None and reference.type is discord.MessageReferenceType.forward
            and message.message_snapshots):
        snapshot = message.message_snapshots[0]  # Discord forwards one message at a time
        attachments = tuple(valid_unicode(a.filename) for a in snapshot.attachments)
        return forwarded_text(valid_unicode(snapshot.content), attachments), attachments
    return own


class Gone:
    """Channels, threads and guilds deleted on Discord (or left) since the bot started.

    Forgetting a channel tombstones the messages stored at that moment; a backfill or
    catch-up page fetched before the deletion may reach the write queue after it.  Such
    a page is stored through :meth:`present`, on the write thread, so the records of a
    gone place are left out, and no backfill position is saved for it (the listeners
    mark a place gone before they queue its forgetting).  A guild the bot joins again is
    present again, in queue order; a channel id never is.
    """

    def __init__(self) -> None:
        self._channels: set[int] = set()
        self._guilds: set[int] = set()

    def channel(self, channel_id: int) -> None:
        """A channel or thread was deleted (a channel's threads go with it)."""
        self._channels.add(channel_id)

    def guild(self, guild_id: int) -> None:
        """The bot left (or was removed from) a guild."""
        self._guilds.add(guild_id)

    def joined(self, guild_ids: list[int]) -> None:
        """The bot joined these guilds (again): their messages may be stored.  Queued
        as a write, so a page fetched before the bot left and still queued is not."""
        self._guilds.difference_update(guild_ids)

    def holds(self, guild_id: int, channel_id: int, parent_id: int | None = None) -> bool:
        """Whether this channel (or thread of ``parent_id``) of this guild is gone."""
        return (guild_id in self._guilds or channel_id in self._channels
                or parent_id in self._channels)

    def present(self, records: list[MessageRecord]) -> list[MessageRecord]:
        """``records`` less those of gone guilds, channels and channels' threads."""
        return [r for r in records if not self.holds(r.guild_id, r.channel_id, r.parent_id)]
