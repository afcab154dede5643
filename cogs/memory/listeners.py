"""Capture and forget: the gateway events that change what memory holds.

Every event becomes a write in the runtime's ordered queue: a new or edited message
is stored (or its stored copy updated), a deleted message, channel, thread or guild
is forgotten.  When the bot is ready it starts the hourly retention job and catches
up on what was said, then deleted, while it was away.  Mentions are answered by
:class:`cogs.memory.search.MemoryCog`, which listens to the same messages.
"""

from __future__ import annotations

import logging

import discord
from discord.ext import commands

from cogs.memory.backfill import Backfiller
from cogs.memory.capture import emptied, record_from_message
from cogs.memory.reconcile import Reconciler
from cogs.memory.runtime import MemoryRuntime
from memory.records import datetime_to_ms

log = logging.getLogger(__name__)


class MemoryListeners(commands.Cog):
    """Stores what members say and forgets what Discord deletes.

    Args:
        runtime: The shared write queue and settings cache.
        backfill: Catches up on channels at start-up.
        reconciler: Forgets, at start-up, what was deleted while the bot was away.
    """

    def __init__(self, runtime: MemoryRuntime, backfill: Backfiller, reconciler: Reconciler) -> None:
        self.runtime = runtime
        self.bot = runtime.bot
        self.engine = runtime.engine
        self.backfill = backfill
        self.reconciler = reconciler

    def _is_mine(self, message: discord.Message) -> bool:
        return self.bot.user is not None and message.author.id == self.bot.user.id

    @commands.Cog.listener()
    async def on_message(self, message: discord.Message) -> None:
        """Store a new guild message the guild's settings let the bot remember."""
        if message.guild is None:
            return
        self.runtime.clock.seen(message)  # its snowflake is Discord's clock, which retention trusts
        if self._is_mine(message):
            return
        record = record_from_message(message)
        if record is not None:  # queued at once: the write thread applies the guild's settings
            self.runtime.writes.put(self.runtime.store_messages, [record])

    @commands.Cog.listener()
    async def on_raw_message_edit(self, payload: discord.RawMessageUpdateEvent) -> None:
        """Re-store an edited message (text, FTS and vector are refreshed)."""
        message = payload.message
        if self._is_mine(message):
            return
        record = record_from_message(message)
        if record is None:
            if "content" in payload.data and emptied(message):  # its old text must go too
                when = datetime_to_ms(message.edited_at or discord.utils.utcnow())
                self.runtime.writes.put(self.runtime.forget_emptied, [(message.id, when)])
            return
        # an edit of a stored message is always applied: where a new message would not
        # be stored, the stored copy is updated (or forgotten, if its author opted out)
        if isinstance(message.channel, (discord.abc.GuildChannel, discord.Thread)):
            self.runtime.writes.put(self.runtime.store_edits, [record])
        else:  # a thread not cached (archived): its parent, which settings may exclude,
            # is unknown, so only a stored copy is updated (catch-up and backfill store)
            self.runtime.writes.put(self.runtime.apply_edits, [record])

    @commands.Cog.listener()
    async def on_raw_message_delete(self, payload: discord.RawMessageDeleteEvent) -> None:
        """Forget a deleted message everywhere."""
        self.runtime.writes.put(self.engine.forget_messages, [payload.message_id])

    @commands.Cog.listener()
    async def on_raw_bulk_message_delete(self, payload: discord.RawBulkMessageDeleteEvent) -> None:
        """Forget bulk-deleted messages everywhere."""
        self.runtime.writes.put(self.engine.forget_messages, sorted(payload.message_ids))

    @commands.Cog.listener()
    async def on_guild_channel_delete(self, channel: discord.abc.GuildChannel) -> None:
        """Forget a deleted channel's messages and its threads'."""
        self.runtime.gone.channel(channel.id)  # first: a page fetched before stores none
        self.runtime.writes.put(self.engine.forget_channels, [channel.id])

    @commands.Cog.listener()
    async def on_raw_thread_delete(self, payload: discord.RawThreadDeleteEvent) -> None:
        """Forget a deleted thread's messages."""
        self.runtime.gone.channel(payload.thread_id)
        self.runtime.writes.put(self.engine.forget_channels, [payload.thread_id])

    @commands.Cog.listener()
    async def on_guild_remove(self, guild: discord.Guild) -> None:
        """The bot left (or was removed from) a guild: forget everything from it."""
        self.runtime.guild_settings.drop(guild.id)
        self.runtime.gone.guild(guild.id)
        self.runtime.writes.put(self.runtime.forget_guilds, [guild.id])

    @commands.Cog.listener()
    async def on_guild_join(self, guild: discord.Guild) -> None:
        """The bot joined a guild (perhaps one it left before): remember from now on."""
        self.runtime.writes.put(self.runtime.gone.joined, [guild.id])  # behind what is queued

    @commands.Cog.listener()
    async def on_ready(self) -> None:
        """Start the retention job; catch up on what was said and deleted while the bot was
        away.  Every READY: discord.py dispatches one after each fresh session too."""
        self.runtime.start_retention()
        self.reconciler.start_after_ready(after=self.backfill.catch_up_after_ready())
