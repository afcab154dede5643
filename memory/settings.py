"""Per-guild settings: what the bot remembers in a server, for how long, and when it answers.

Admins change these with ``/memory-admin``; members opt out with ``/memory opt-out``.
They live in the database (``guild_settings``, ``channel_rules``, ``member_optouts``)
so every process sharing the file sees the same rules.
"""

from __future__ import annotations

from dataclasses import dataclass, field

CHANNEL_MODES = ("all", "include", "exclude")
AUTORESPONSE_MODES = ("off", "mention", "channels")


@dataclass(frozen=True)
class GuildSettings:
    """One guild's settings.

    ``channel_mode`` says how ``channels`` is read: ``all`` remembers every channel
    (the list is unused), ``include`` only the listed ones, ``exclude`` all but the
    listed ones; a thread follows its parent.  ``retention_days`` of ``None`` keeps
    messages until they are deleted on Discord.  ``autoresponse``: ``off`` never
    answers, ``mention`` answers mentions, ``channels`` answers mentions only in
    ``autoresponse_channels``.
    """

    guild_id: int
    channel_mode: str = "all"
    channels: frozenset[int] = frozenset()
    retention_days: int | None = None
    autoresponse: str = "mention"
    autoresponse_channels: frozenset[int] = frozenset()
    opted_out: frozenset[int] = field(default_factory=frozenset)

    def remembers_channel(self, channel_id: int, parent_id: int | None = None) -> bool:
        """Whether messages in this channel (or thread, by its parent) are stored."""
        if self.channel_mode == "all":
            return True
        listed = channel_id in self.channels or (parent_id is not None and parent_id in self.channels)
        return listed if self.channel_mode == "include" else not listed

    def remembers_author(self, author_id: int) -> bool:
        """Whether this member's messages are stored (they have not opted out)."""
        return author_id not in self.opted_out

    def answers_in(self, channel_id: int, parent_id: int | None = None) -> bool:
        """Whether a mention in this channel gets an answer."""
        if self.autoresponse == "off":
            return False
        if self.autoresponse == "mention":
            return True
        return channel_id in self.autoresponse_channels or (
            parent_id is not None and parent_id in self.autoresponse_channels
        )
