"""``/memory-owner …``: bot-wide settings, for the bot's owners only.

Hidden from non-admins by default and refused at run time to anyone but the bot's
owners, whatever their server permissions: these commands change the bot for every
server.
"""

from __future__ import annotations

import logging

import discord
from discord import app_commands
from discord.ext import commands

from cogs.memory.render import inert
from cogs.memory.runtime import MemoryRuntime
from memory.config import available_profiles, load_profile

log = logging.getLogger(__name__)


@app_commands.guild_only()
@app_commands.default_permissions(administrator=True)
class OwnerCommands(
    commands.GroupCog, group_name="memory-owner",
    group_description="Bot-wide settings (bot owner only)",
):
    """Switch the hardware profile and publish the slash commands.

    Args:
        runtime: The shared runtime (its engine switches profile; its chat client follows).
        owner_ids: Users allowed these commands besides the application's owners.
    """

    def __init__(self, runtime: MemoryRuntime, owner_ids: frozenset[int] = frozenset()) -> None:
        self.runtime = runtime
        self.bot = runtime.bot
        self.engine = runtime.engine
        self.owner_ids = frozenset(owner_ids)

    async def _is_owner(self, user: discord.abc.User) -> bool:
        if user.id in self.owner_ids:
            return True
        try:
            return await self.bot.is_owner(user)
        except discord.HTTPException:
            return False

    async def interaction_check(self, interaction: discord.Interaction) -> bool:
        """Every command here is refused at run time to anyone but the bot's owners."""
        if not await self._is_owner(interaction.user):
            raise app_commands.CheckFailure("Only the bot's owner can change bot-wide settings.")
        return True

    @app_commands.command(name="profile", description="Switch the hardware profile for every server")
    @app_commands.describe(name="Profile to load")
    async def owner_profile(self, interaction: discord.Interaction, name: str) -> None:
        """Load a profile's reranker in the background and swap it in.

        The choice is stored; every other bot process on the database loads the same
        profile within seconds (:meth:`MemoryRuntime.follow_profile`).
        """
        await interaction.response.defer(ephemeral=True, thinking=True)
        try:
            profile = await self.runtime.read(load_profile, name)
            await self.runtime.switch_profile(profile)  # stored: the other processes follow
        except Exception as exc:  # the old profile stays active; say why
            log.warning("profile switch to %s failed: %s", name, exc)
            await interaction.followup.send(f"Could not switch to **{inert(name, 100)}**: {exc}",
                                            ephemeral=True)
            return
        await interaction.followup.send(f"Hardware profile is now **{name}**.", ephemeral=True)

    @owner_profile.autocomplete("name")
    async def _profile_names(
        self, interaction: discord.Interaction, current: str
    ) -> list[app_commands.Choice[str]]:
        names = [p for p in available_profiles() if current.lower() in p.lower()]
        return [app_commands.Choice(name=p, value=p) for p in names[:25]]

    @app_commands.command(name="sync", description="Publish the bot's slash commands to Discord")
    @app_commands.describe(here="Only to this server (instant) instead of everywhere")
    async def owner_sync(self, interaction: discord.Interaction, here: bool = False) -> None:
        """Sync the command tree globally or to this guild."""
        await interaction.response.defer(ephemeral=True, thinking=True)
        guild = interaction.guild if here else None
        if guild is not None:
            self.bot.tree.copy_global_to(guild=guild)
        synced = await self.bot.tree.sync(guild=guild)
        await interaction.followup.send(f"Synced {len(synced)} commands.", ephemeral=True)
