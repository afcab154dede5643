"""The clock retention counts from.

A guild's retention period forgets what is older than "now" less the period, and the
host's clock says what now is — unless it is wrong.  A host clock years ahead (a dead
clock battery, a bad time server) made every stored message look expired: the hourly
pass forgot all of them, and their tombstones then refused the re-import.

Discord's clock is in every message id (a snowflake holds its creation time), so:

* the bot measures it: the newest message seen arriving through the gateway, moved on
  by the monotonic time since (``discord_now_ms``); retention never counts from later
  than that;
* without it (a script, the CLI, a bot that has seen no message yet) the newest time
  Discord vouched for is the creation time of the newest message stored or being
  stored.  A host clock more than :data:`TRUSTED_AHEAD_MS` past it is taken for wrong
  and retention counts from that time instead.  Within that margin the host clock is
  trusted: a guild may well have been quiet for weeks, and its old messages must
  still go.

A host clock behind Discord's only makes retention late, the safe side.
"""

from __future__ import annotations

import time

DAY_MS = 86_400_000
TRUSTED_AHEAD_MS = 3 * 365 * DAY_MS
"""How far past the newest stored message the host clock is believed without a
Discord clock: a memory quiet for longer keeps its old messages until the next one
arrives (the pass says so in the log).  Three years, not one: a bot whose servers fell
silent for over a year must still forget (a clock wrong by decades is what this catches)."""
SKEW_LOGGED_MS = DAY_MS
"""The hourly pass says why it counts from an earlier time than the host clock when
the two differ by at least this much."""


def host_ms() -> int:
    """The host clock, in unix milliseconds."""
    return int(time.time() * 1000)


def retention_now(*vouched: int | None, discord_now_ms: int | None = None) -> int:
    """The time retention counts from (unix ms).

    Args:
        vouched: Creation times of messages stored or being stored (``None`` where
            unknown): Discord's clock at some time in the past.
        discord_now_ms: Discord's clock now, measured from the gateway, if known.

    Returns:
        The host clock, but never later than ``discord_now_ms``, nor, without it,
        later than the newest of ``vouched`` when the host clock runs more than
        :data:`TRUSTED_AHEAD_MS` past it.
    """
    host = host_ms()
    if discord_now_ms is not None:
        return min(host, discord_now_ms)
    known = [v for v in vouched if v is not None]
    if known and host - max(known) > TRUSTED_AHEAD_MS:
        return max(known)
    return host
