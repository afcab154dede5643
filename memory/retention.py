"""The clock retention counts from.

A guild's retention period forgets what is older than "now" less the period, and the
host's clock says what now is — unless it is wrong.  A host clock years ahead (a dead
clock battery, a bad time server) made every stored message look expired: the hourly
pass forgot all of them, and their tombstones then refused the re-import.

So retention never counts from later than the newest time Discord vouched for: the
creation time (from its snowflake, Discord's clock) of the newest message stored, of
the messages being stored, or of the newest message the bot saw arrive through the
gateway.  A host clock behind Discord's only makes retention late, the safe side.
The cost: a memory that received nothing for a while keeps its messages that much
longer, until the next message moves the clock on (the pass logs why).
"""

from __future__ import annotations

import time

DAY_MS = 86_400_000
SKEW_LOGGED_MS = DAY_MS
"""The hourly pass says why it counts from an earlier time when the host clock runs at
least this far ahead of the newest time Discord vouched for."""


def host_ms() -> int:
    """The host clock, in unix milliseconds."""
    return int(time.time() * 1000)


def retention_now(*vouched: int | None) -> int:
    """The time retention counts from: the host clock, but never later than the newest
    of the times Discord vouched for (``None`` where unknown).

    Args:
        vouched: Creation times (unix ms) of messages stored, being stored or seen.

    Returns:
        Unix milliseconds; the host clock when no time is vouched for (nothing stored).
    """
    host = host_ms()
    known = [v for v in vouched if v is not None]
    return min(host, max(known)) if known else host
