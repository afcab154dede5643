"""The bot: a small ``commands.Bot`` that receives its engine and loads the memory cogs.

:func:`memory_bot` makes one: a :class:`MemoryBot` (one gateway connection, as
always), or, given the shards this process runs, a :class:`ShardedMemoryBot`
(discord.py's ``AutoShardedBot`` with ``shard_count`` and ``shard_ids``).  Sharding
is opt-in rather than the one class for both: without a shard count discord.py's
``AutoShardedBot`` asks Discord how many shards to open and opens them all in this
process, which is not what a bot run without sharding options has ever done (and a
second process doing the same would run the same shards twice).
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Sequence

import discord
from discord.ext import commands

from cogs.memory.errors import ReportingTree
from cogs.memory.shards import Shards
from memory.engine import MemoryEngine

log = logging.getLogger(__name__)


class MemoryBot(commands.Bot):
    """A Discord bot that remembers its channels.

    Only slash commands, context menus and listeners: prefix commands are off, so a
    mention is never parsed as one.

    Args:
        engine: The memory engine the cogs store into and search.
        extensions: Cog modules to load at start-up.
        sync: Publish slash commands in ``setup_hook``: ``"global"`` everywhere (Discord
            takes up to an hour), a guild id to that guild only (instant, for
            development), ``None`` not at all (the default: they persist on Discord).
        owner_ids: Users allowed the bot-wide owner commands; ``None`` asks Discord
            who owns the application.
        owns_engine: Close the engine when the bot closes (``cli.run.run_bot`` keeps it
            open across login attempts and closes it itself).
    """

    def __init__(
        self,
        engine: MemoryEngine,
        *,
        extensions: Sequence[str] = ("cogs.memory",),
        sync: str | int | None = None,
        owner_ids: set[int] | None = None,
        owns_engine: bool = True,
        **options,
    ) -> None:
        intents = discord.Intents.default()
        intents.message_content = True  # privileged: enable it in the developer portal
        intents.members = False
        if owner_ids:
            options["owner_ids"] = set(owner_ids)
        super().__init__(
            command_prefix=commands.when_mentioned, intents=intents, help_command=None,
            tree_cls=ReportingTree, **options
        )
        self.engine = engine
        self.initial_extensions = tuple(extensions)
        self.sync = sync
        self.owns_engine = owns_engine
        self._stopping: asyncio.Future[None] | None = None

    async def setup_hook(self) -> None:
        """Load the cogs; publish slash commands only when asked to."""
        for extension in self.initial_extensions:
            await self.load_extension(extension)
        if self.sync == "global":
            synced = await self.tree.sync()
            log.info("synced %d application commands globally", len(synced))
        elif self.sync is not None:
            guild = discord.Object(int(self.sync))
            self.tree.copy_global_to(guild=guild)
            synced = await self.tree.sync(guild=guild)
            log.info("synced %d application commands to guild %s", len(synced), self.sync)

    async def process_commands(self, message: discord.Message) -> None:
        """No prefix commands: mentions are answered by the memory cogs instead."""

    async def close(self) -> None:
        """Close the Discord connection, then unload the cogs (queued writes commit),
        then close the engine (when it is the bot's).

        A second call (discord.py's ``connect`` makes one when the connection drops
        without reconnecting) waits for the first, so the engine never closes under a
        runtime still stopping.
        """
        if self._stopping is None:
            self._stopping = asyncio.ensure_future(self._close())
        await asyncio.shield(self._stopping)

    async def _close(self) -> None:
        try:
            await self.hang_up()
            await super().close()
        finally:
            if self.owns_engine:  # off the loop: it waits for an engine call in progress
                await asyncio.to_thread(self.engine.close)

    async def __aexit__(self, *exc_info: object) -> None:
        """Leaving ``async with bot`` waits for the whole close, cogs and engine included.

        discord.py's own ``__aexit__`` awaits only the connection's close once one has
        begun.  A SIGTERM during a reconnect begins :meth:`close` and ends ``start``, so
        the context was left while the cogs were still stopping, and the process could
        exit before the chunk being embedded was written.
        """
        await self.close()

    async def hang_up(self) -> None:
        """Close the gateway connection (and the HTTP session), leaving the cogs loaded.

        discord.py's own ``Bot.close`` unloads the extensions first and closes the
        connection last, so an event arriving in between reaches no listener: a message
        sent as the bot stops would be neither stored nor known.  Hung up first, every
        event that arrived was heard by the memory cogs, which queue it before they stop;
        the bot's close then finds the connection closed already.
        """
        await discord.Client.close(self)


class ShardedMemoryBot(MemoryBot, commands.AutoShardedBot):
    """A :class:`MemoryBot` that runs some of the bot's shards, on discord.py's
    ``AutoShardedBot``: one gateway connection per shard, one cache for them all.

    Each guild's events arrive in the process that runs its shard; every process
    shares the one database (:mod:`cogs.memory.shards`).

    Args:
        engine: The memory engine.
        shards: The shards to connect (``shard_count`` and ``shard_ids``).
        **options: As for :class:`MemoryBot`.
    """

    def __init__(self, engine: MemoryEngine, *, shards: Shards, **options) -> None:
        super().__init__(engine, shard_count=shards.count, shard_ids=list(shards.ids), **options)

    async def hang_up(self) -> None:
        """Close every shard's gateway connection (see :meth:`MemoryBot.hang_up`)."""
        await discord.AutoShardedClient.close(self)


def memory_bot(engine: MemoryEngine, *, shards: Shards | None = None, **options) -> MemoryBot:
    """A :class:`MemoryBot`, or a :class:`ShardedMemoryBot` running ``shards`` when given.

    Args:
        engine: The memory engine.
        shards: The shards this process runs; ``None`` runs the bot unsharded.
        **options: As for :class:`MemoryBot`.
    """
    if shards is None:
        return MemoryBot(engine, **options)
    return ShardedMemoryBot(engine, shards=shards, **options)
