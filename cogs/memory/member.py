"""``/memory …``: what a member can see and control about their own memory."""

from __future__ import annotations

from typing import TYPE_CHECKING
from urllib.parse import urlsplit

import discord
from discord import app_commands
from discord.ext import commands

from cogs.memory.guild_only import guild_id_of, member_of
from cogs.memory.render import inert
from cogs.memory.runtime import MemoryRuntime
from cogs.memory.search import MemoryCog
from memory.config import LLMConfig

if TYPE_CHECKING:
    from memory.rerank.service import RerankerService

PRIVACY_NOTICE = """\
**What this bot remembers**
• The text, attachment names, author, channel and time of messages in this server's \
channels it can read (admins choose which channels with `/memory-admin channels`); \
a poll's question and answers; a forward's text, marked as forwarded.
• Nothing from DMs. Nothing from members who used `/memory opt-out`.

**Who can find it**
• A search only ever shows messages from channels *you* can read right now.
• Public answers only quote channels everyone in that channel can read.

**How it goes away**
• Deleting a message on Discord deletes it here (text, search index and vectors).
• Editing a stored message updates it here, even in a channel no longer remembered; \
after `/memory opt-out` an edit deletes the stored copy instead (storing the new text \
would store you again, keeping the old one would keep what you took back).
• `/memory forget-me` deletes all your messages and your name from this server's memory, \
including ones still being saved, and stops storing you (a backfill or import too) until \
`/memory opt-in`.
• `/memory opt-out` stops storing your new messages; `/memory opt-in` resumes.
• The bot's public answers that quote a message are taken down when it is deleted, \
edited or forgotten.
• Deleted channels and threads are forgotten; when the bot leaves, the server is forgotten \
(except who opted out: invited back, it still does not store them).
• Admins may set a retention period (`/memory-admin retention`): older messages are never \
stored or shown, and are deleted within the hour. Admins may also purge channels."""


@app_commands.guild_only()
class MemberCommands(
    commands.GroupCog, group_name="memory",
    group_description="What the bot remembers about you and this server",
):
    """``/memory stats``, ``forget-me``, ``opt-out``, ``opt-in`` and ``privacy``.

    Args:
        runtime: The shared queue (forgetting and settings changes run in order with writes).
        search: Whose allow-list says which channels the member's counts cover.
    """

    def __init__(self, runtime: MemoryRuntime, search: MemoryCog) -> None:
        self.runtime = runtime
        self.engine = runtime.engine
        self.search = search

    @app_commands.command(name="stats", description="How much the bot remembers from this server")
    async def memory_stats(self, interaction: discord.Interaction) -> None:
        """Counts for this guild's channels the member can read, theirs, the backlog, the profile."""
        await interaction.response.defer(ephemeral=True, thinking=True)
        guild_id = guild_id_of(interaction)
        readable = await self.search.allowed_channels(member_of(interaction),
                                                      asked_in=interaction.channel)
        stats = await self.runtime.read(self.engine.storage.messages.guild_stats, guild_id,
                                        interaction.user.id, readable)
        settings = await self.runtime.guild_settings.get(guild_id)
        lines = [
            f"Messages you can search here: **{stats.messages}** in {stats.channels} channels and threads",
            f"Your messages: **{stats.member_messages}**"
            + ("" if settings.remembers_author(interaction.user.id)
               else " (you opted out: new ones are not stored)"),
            f"Waiting to be embedded: {stats.pending}",
            f"Channels remembered: {settings.channel_mode}"
            + (f" ({len(settings.channels)} listed)" if settings.channel_mode != "all" else ""),
            f"Retention: {f'{settings.retention_days} days' if settings.retention_days else 'until deleted'}",
            f"Hardware profile: {self.engine.rerankers.profile_name}",
        ]
        await interaction.followup.send("\n".join(lines), ephemeral=True)

    @app_commands.command(name="forget-me", description="Delete all your messages from this server's memory")
    async def forget_me(self, interaction: discord.Interaction) -> None:
        """Delete every stored message by the member in this guild."""
        await interaction.response.defer(ephemeral=True, thinking=True)
        guild_id = guild_id_of(interaction)
        removed = await self.runtime.forget(self.engine.forget_member, guild_id, interaction.user.id)
        self.runtime.guild_settings.drop(guild_id)  # the member is opted out now
        await interaction.followup.send(
            f"Deleted {removed} of your messages from my memory of this server. Your new "
            "messages here are not stored either until you use `/memory opt-in`.", ephemeral=True)

    @app_commands.command(name="opt-out", description="Stop storing your messages in this server")
    async def opt_out(self, interaction: discord.Interaction) -> None:
        """Stop storing the member's messages (what is stored stays until forget-me)."""
        await self.runtime.update_settings(guild_id_of(interaction), opt_out=interaction.user.id)
        await interaction.response.send_message(
            "Your new messages here will not be stored. `/memory forget-me` deletes the ones "
            "already stored; `/memory opt-in` starts storing again.", ephemeral=True)

    @app_commands.command(name="opt-in", description="Store your messages in this server again")
    async def opt_in(self, interaction: discord.Interaction) -> None:
        """Undo opt-out."""
        await self.runtime.update_settings(guild_id_of(interaction), opt_in=interaction.user.id)
        await interaction.response.send_message("Your new messages here will be stored again.",
                                                ephemeral=True)

    @app_commands.command(name="privacy", description="What the bot stores and how to remove it")
    async def privacy(self, interaction: discord.Interaction) -> None:
        """The privacy notice, then (in a second message: one holds 2,000 characters) every
        server the active profile sends text to."""
        await interaction.response.send_message(PRIVACY_NOTICE, ephemeral=True)
        remote = remote_parts(self.engine.profile.llm, self.runtime.chat is not None,
                              self.engine.rerankers.current())
        if remote:
            await interaction.followup.send(
                "**Servers that receive message text**\n" + "\n".join(remote) + "\n"
                + HOSTED_COPIES, ephemeral=True)


HOSTED_COPIES = (
    "• Deleting a message, `/memory forget-me` and retention delete the bot's own copies; "
    "they cannot reach what such a service has already kept (its logs, caches or training "
    "data: ask its operator).")


def remote_parts(llm: LLMConfig, answers: bool, reranker: RerankerService | None) -> list[str]:
    """One line per server the profile sends message text to, and what each receives.

    A server is named even on this machine's own address (it may be a tunnel).

    Args:
        llm: The profile's ``[llm]`` section (the chat model, and the ``llm`` reranker's judge).
        answers: Whether mention answers are written by that chat model.
        reranker: The active reranker, if any.
    """
    lines = []
    model = f"`{inert(llm.model, 60)}` at `{inert(urlsplit(llm.base_url).hostname or '?', 80)}`"
    if answers:
        lines.append(f"• Mention answers are written by a chat model ({model}): each question "
                     "and the messages quoted to answer it, with their authors' names, channel "
                     "names and times, are sent to it.")
    host = reranker.remote_host if reranker is not None else None
    if reranker is not None and host is not None:
        judge = reranker.name == "llm"
        by = (f"a chat model judging relevance ({model})" if judge else
              f"a remote service (`{inert(reranker.name, 40)}` at `{inert(host, 80)}`)")
        lines.append(f"• Searches are reranked by {by}: each search's question and its "
                     "candidate messages are sent to it, with their authors' names.")
    return lines
