"""Discord's clock, as measured from the gateway.

Retention counts a guild's messages' age from Discord's clock, never from a host
clock that may run ahead of it (:mod:`memory.retention`).  A message arriving from
the gateway carries Discord's time in its snowflake; :class:`DiscordClock` keeps the
newest one seen and moves it on by the monotonic time since, with no wall clock
involved.
"""

from __future__ import annotations

import time

import discord


class DiscordClock:
    """Discord's time now, from the newest message seen on the gateway."""

    def __init__(self) -> None:
        self._newest: tuple[int, float] | None = None  # its time (ms), monotonic then

    def seen(self, message: discord.Message) -> None:
        """Note a message that arrived from the gateway (an edit of an old message
        says nothing new)."""
        created = int(message.created_at.timestamp() * 1000)
        now = self.now_ms()
        if now is None or created > now:
            self._newest = (created, time.monotonic())

    def now_ms(self) -> int | None:
        """Discord's clock now, in unix milliseconds; ``None`` before the first message."""
        if self._newest is None:
            return None
        created, at = self._newest
        return created + int((time.monotonic() - at) * 1000)
