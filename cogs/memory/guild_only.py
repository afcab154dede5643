"""Every memory command is guild-only: the guild and the member of its interactions."""

from __future__ import annotations

import discord


def guild_id_of(interaction: discord.Interaction) -> int:
    """The guild a guild-only command was used in."""
    assert interaction.guild_id is not None  # every memory command is guild-only
    return interaction.guild_id


def member_of(interaction: discord.Interaction) -> discord.Member:
    """The member who used a guild-only command."""
    assert isinstance(interaction.user, discord.Member)  # guild-only: the user is a member
    return interaction.user
