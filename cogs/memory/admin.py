"""``/memory-admin …``: what a server's admins decide about its memory.

Hidden from members by default (``default_permissions``) *and* checked when run
(``has_permissions``): an admin can re-grant a command in Discord's integration
settings, and the check still applies.
"""

from __future__ import annotations

from collections.abc import Iterable

import discord
from discord import app_commands
from discord.ext import commands

from cogs.memory.backfill import Backfiller
from cogs.memory.guild_only import guild_id_of, member_of
from cogs.memory.permissions import can_read
from cogs.memory.reconcile import Reconciler
from cogs.memory.runtime import MemoryRuntime
from memory.settings import AUTORESPONSE_MODES, CHANNEL_MODES, GuildSettings

# A place an admin names.  A thread comes as Discord describes it: archived ones are not
# in discord.py's cache, and these commands need only its id and mention (backfill
# fetches it).
Spoken = (discord.TextChannel | discord.VoiceChannel | discord.StageChannel
          | app_commands.AppCommandThread)  # where mentions are answered
Place = Spoken | discord.ForumChannel


def _may_read(interaction: discord.Interaction, place: Place) -> bool:
    """Whether the admin may read ``place`` (a thread as Discord resolved it: their
    permissions there come with it, but they are its parent's, which do not say whether
    the admin is in a private thread: one the cache holds is judged as a search judges it,
    any other only opens to those who may manage threads)."""
    member = member_of(interaction)
    if isinstance(place, app_commands.AppCommandThread):
        cached = member.guild.get_thread(place.id)
        if cached is not None:
            return can_read(member, cached)
        perms = place.permissions
        return (perms.view_channel and perms.read_message_history
                and (place.type is not discord.ChannelType.private_thread or perms.manage_threads))
    return can_read(member, place)


@app_commands.guild_only()
@app_commands.default_permissions(manage_guild=True)
class AdminCommands(
    commands.GroupCog, group_name="memory-admin",
    group_description="Manage what the bot remembers in this server",
):
    """Backfill, reconcile, retention, purges, mention answers and which channels are kept.

    Args:
        runtime: The shared queue (purges and settings changes run in order with writes).
        backfill: Runs ``/memory-admin backfill``.
        reconciler: Runs ``/memory-admin reconcile``.
    """

    channels = app_commands.Group(name="channels", description="Which channels are remembered")

    def __init__(self, runtime: MemoryRuntime, backfill: Backfiller, reconciler: Reconciler) -> None:
        self.runtime = runtime
        self.engine = runtime.engine
        self.backfill = backfill
        self.reconciler = reconciler

    @app_commands.command(name="backfill", description="Read past messages into memory")
    @app_commands.describe(channel="Only this channel and its threads (default: every channel)")
    @app_commands.checks.has_permissions(manage_guild=True)
    async def admin_backfill(
        self, interaction: discord.Interaction,
        channel: Place | None = None,
    ) -> None:
        """Backfill history with a progress message edited in place."""
        await self.backfill.command(interaction, channel)

    @app_commands.command(name="reconcile",
                          description="Forget what was deleted on Discord while the bot was away")
    @app_commands.checks.has_permissions(manage_guild=True)
    async def admin_reconcile(self, interaction: discord.Interaction) -> None:
        """Check stored channels and recent messages against Discord, with progress."""
        await self.reconciler.command(interaction)

    @app_commands.command(name="retention", description="Forget messages older than this many days")
    @app_commands.describe(days="Days to keep messages; 0 keeps them until deleted")
    @app_commands.checks.has_permissions(manage_guild=True)
    async def admin_retention(
        self, interaction: discord.Interaction, days: app_commands.Range[int, 0, 36500]
    ) -> None:
        """Set the retention period; the hourly job (and this command) purges older messages."""
        await interaction.response.defer(ephemeral=True, thinking=True)
        guild_id = guild_id_of(interaction)
        await self.runtime.update_settings(guild_id, retention_days=days or None)
        removed = await self.runtime.forget_older_than(guild_id, days) if days else 0
        text = f"Messages are kept for {days} days" if days else "Messages are kept until deleted"
        await interaction.followup.send(f"{text}; {removed} older messages forgotten now.",
                                        ephemeral=True)

    @app_commands.command(name="purge-channel", description="Forget everything stored from a channel")
    @app_commands.describe(channel="The channel (its threads are forgotten too)")
    @app_commands.checks.has_permissions(manage_guild=True)
    async def admin_purge_channel(
        self, interaction: discord.Interaction,
        channel: Place,
    ) -> None:
        """Delete a channel's and its threads' stored messages (how many only to an
        admin who may read the channel: Manage Server is not View Channel)."""
        await interaction.response.defer(ephemeral=True, thinking=True)
        removed = await self.runtime.forget(self.engine.forget_channels, [channel.id])
        what = (f"{removed} messages" if _may_read(interaction, channel)
                else "everything stored")
        await interaction.followup.send(
            f"Forgot {what} from {channel.mention} and its threads.", ephemeral=True)

    @app_commands.command(name="autoresponse", description="When the bot answers mentions")
    @app_commands.describe(mode="off, mention (everywhere) or channels (only listed ones)",
                           channel="With mode channels: add or remove this channel")
    @app_commands.choices(mode=[app_commands.Choice(name=m, value=m) for m in AUTORESPONSE_MODES])
    @app_commands.checks.has_permissions(manage_guild=True)
    async def admin_autoresponse(
        self, interaction: discord.Interaction, mode: str,
        channel: Spoken | None = None,
    ) -> None:
        """Switch mention answers off, on everywhere, or on in chosen channels."""
        settings = await self.runtime.update_settings(
            guild_id_of(interaction), autoresponse=mode,
            toggle_autoresponse_channel=channel.id if channel else None,
        )
        where = mentions(settings.autoresponse_channels) or "none yet"
        text = {"off": "I will not answer mentions.", "mention": "I answer mentions everywhere.",
                "channels": f"I answer mentions in: {where}."}[settings.autoresponse]
        await interaction.response.send_message(text, ephemeral=True)

    # -- /memory-admin channels … ----------------------------------------------------------

    @channels.command(name="show", description="Which channels are remembered")
    @app_commands.checks.has_permissions(manage_guild=True)
    async def channels_show(self, interaction: discord.Interaction) -> None:
        """Show the channel mode and list."""
        settings = await self.runtime.guild_settings.get(guild_id_of(interaction))
        await interaction.response.send_message(describe_channels(settings), ephemeral=True)

    @channels.command(name="mode", description="Remember all, only listed, or all but listed channels")
    @app_commands.choices(mode=[app_commands.Choice(name=m, value=m) for m in CHANNEL_MODES])
    @app_commands.checks.has_permissions(manage_guild=True)
    async def channels_mode(self, interaction: discord.Interaction, mode: str) -> None:
        """Set how the channel list is read."""
        settings = await self.runtime.update_settings(guild_id_of(interaction), channel_mode=mode)
        await interaction.response.send_message(describe_channels(settings), ephemeral=True)

    @channels.command(name="add", description="Add a channel to the list")
    @app_commands.checks.has_permissions(manage_guild=True)
    async def channels_add(
        self, interaction: discord.Interaction,
        channel: Place,
    ) -> None:
        """Add a channel to the include/exclude list."""
        settings = await self.runtime.update_settings(guild_id_of(interaction), add_channel=channel.id)
        await interaction.response.send_message(describe_channels(settings), ephemeral=True)

    @channels.command(name="remove", description="Remove a channel from the list")
    @app_commands.checks.has_permissions(manage_guild=True)
    async def channels_remove(
        self, interaction: discord.Interaction,
        channel: Place,
    ) -> None:
        """Remove a channel from the include/exclude list."""
        settings = await self.runtime.update_settings(guild_id_of(interaction),
                                                      remove_channel=channel.id)
        await interaction.response.send_message(describe_channels(settings), ephemeral=True)


LISTED_MAX = 40  # channels a reply names: Discord refuses a message over 2,000 characters


def mentions(channel_ids: Iterable[int]) -> str:
    """The channels as mentions, at most :data:`LISTED_MAX` of them and how many more."""
    ids = sorted(channel_ids)
    named = ", ".join(f"<#{c}>" for c in ids[:LISTED_MAX])
    return named + (f" and {len(ids) - LISTED_MAX} more" if len(ids) > LISTED_MAX else "")


def describe_channels(settings: GuildSettings) -> str:
    """The channel mode and list, as an admin reads them."""
    listed = mentions(settings.channels) or "none"
    meaning = {
        "all": "every channel the bot can read is remembered",
        "include": f"only these are remembered: {listed}",
        "exclude": f"every channel except these is remembered: {listed}",
    }[settings.channel_mode]
    note = ("\nStopping a channel keeps what is stored; `/memory-admin purge-channel` forgets it."
            if settings.channel_mode != "all" else "")
    return f"Mode **{settings.channel_mode}**: {meaning}.{note}"
