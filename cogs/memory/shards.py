"""Which guilds this process answers for: the shards it runs.

Discord sends each guild's events over one gateway connection, its shard
``(guild_id >> 22) % shard_count``.  A bot spread over several processes
(``bot.py run --shard-count N --shards a,b``) runs some shards in each, and all of
them share one database.  Live events and commands reach only the process running
the guild's shard, and so do the guilds in its cache; whatever walks the *stored*
guilds instead (forgetting the guilds the bot left) must keep to its own with
:meth:`Shards.owns`: the others belong to another process.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

from memory.errors import ConfigError

__all__ = ["Shards", "shard_of"]


def shard_of(guild_id: int, count: int) -> int:
    """The shard Discord sends a guild's events on, out of ``count``."""
    return (guild_id >> 22) % count


@dataclass(frozen=True)
class Shards:
    """The shards one process runs, out of all the bot's shards.

    Attributes:
        count: How many shards the bot has (Discord's ``shard_count``), the same in
            every process.
        ids: The ones this process runs, ascending.

    Raises:
        ConfigError: ``count`` is below 1, ``ids`` is empty, an id is outside
            ``0 .. count - 1``, or an id is given twice.
    """

    count: int = 1
    ids: tuple[int, ...] = (0,)

    def __post_init__(self) -> None:
        if self.count < 1:
            raise ConfigError(f"--shard-count must be 1 or more, not {self.count}")
        if not self.ids:
            raise ConfigError("--shards names no shard: give at least one id")
        outside = sorted({i for i in self.ids if not 0 <= i < self.count})
        if outside:
            raise ConfigError(f"--shards {','.join(map(str, outside))}: with --shard-count "
                              f"{self.count} the ids are 0 to {self.count - 1}")
        twice = sorted({i for i in self.ids if self.ids.count(i) > 1})
        if twice:
            raise ConfigError(f"--shards names shard {','.join(map(str, twice))} twice")
        object.__setattr__(self, "ids", tuple(sorted(self.ids)))

    @classmethod
    def of(cls, bot: Any) -> Shards:
        """The shards a discord.py client runs; all of them when it is not sharded."""
        count = getattr(bot, "shard_count", None)
        if not count:
            return cls()
        ids: Sequence[int] | None = getattr(bot, "shard_ids", None)
        if ids is None:
            shard_id = getattr(bot, "shard_id", None)
            ids = range(count) if shard_id is None else (shard_id,)
        return cls(int(count), tuple(ids))

    @property
    def all(self) -> bool:
        """Whether this process runs every shard (it owns every guild)."""
        return len(self.ids) == self.count

    def owns(self, guild_id: int) -> bool:
        """Whether ``guild_id``'s events come to this process."""
        return self.all or shard_of(guild_id, self.count) in self.ids

    def describe(self) -> str:
        """``"shards 0,2 of 4"``, ``"all 4 shards"`` or ``"one shard"``, for the log."""
        if self.count == 1:
            return "one shard"
        if self.all:
            return f"all {self.count} shards"
        return f"shard{'s' if len(self.ids) > 1 else ''} {','.join(map(str, self.ids))} of {self.count}"
