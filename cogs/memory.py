"""The memory cog: Discord glue around :class:`memory.engine.MemoryEngine`.

It stores every guild message as it arrives (edits and deletes too), embeds the
backlog every few seconds, answers ``/search``, ``/memory`` and the admin-only
``/profile``, and replies to mentions with what it remembers.  Every engine call
crosses into a worker thread once, here, so the event loop never waits on SQLite,
torch or HTTP.
"""

from __future__ import annotations

import asyncio
import logging
from typing import TYPE_CHECKING

import discord
from discord import app_commands
from discord.ext import commands, tasks

from memory.config import available_profiles, load_profile
from memory.errors import MemoryBotError
from memory.records import Hit, MessageRecord, SearchResult, datetime_to_ms
from memory.search import SearchRequest

if TYPE_CHECKING:
    from memory.engine import MemoryEngine

log = logging.getLogger(__name__)

EMBED_INTERVAL_S = 5.0
SNIPPET = 300


def record_from_message(message: discord.Message) -> MessageRecord | None:
    """Convert a guild message to a record; ``None`` for DMs and empty messages."""
    if message.guild is None:
        return None
    attachments = tuple(a.filename for a in message.attachments)
    if not message.content.strip() and not attachments:
        return None
    channel = message.channel
    parent_id = getattr(channel, "parent_id", None) if isinstance(channel, discord.Thread) else None
    author = message.author
    reference = message.reference
    return MessageRecord(
        id=message.id,
        guild_id=message.guild.id,
        channel_id=channel.id,
        author_id=author.id,
        created_at=datetime_to_ms(message.created_at),
        edited_at=datetime_to_ms(message.edited_at) if message.edited_at else None,
        content=message.content,
        author_name=author.name,
        author_display_name=author.display_name,
        author_is_bot=author.bot,
        guild_name=message.guild.name,
        channel_name=getattr(channel, "name", "") or "",
        channel_type=str(channel.type),
        parent_id=parent_id,
        reply_to_id=reference.message_id if reference and reference.guild_id else None,
        attachments=attachments,
    )


def render_hits(result: SearchResult, title: str) -> discord.Embed:
    """An embed listing hits with author, date, snippet and a jump link."""
    embed = discord.Embed(title=title[:256], colour=discord.Colour.blurple())
    if not result.hits:
        embed.description = f"Nothing found: {result.empty_reason}."
        return embed
    for rank, hit in enumerate(result.hits, start=1):
        embed.add_field(name=_field_name(rank, hit), value=_field_value(hit), inline=False)
    trace = result.trace
    footer = f"{trace.timings_ms.get('total', 0):.0f} ms"
    if trace.threshold is not None:
        footer += f" · threshold {trace.threshold:.2f}"
    if trace.reranked:
        footer += f" · reranked by {trace.rerank_backend}"
    embed.set_footer(text=footer)
    return embed


def _field_name(rank: int, hit: Hit) -> str:
    return f"{rank}. {hit.author_name} · {hit.created:%Y-%m-%d}"[:256]


def _field_value(hit: Hit) -> str:
    text = " ".join(hit.content.split()) or "(attachment only)"
    if len(text) > SNIPPET:
        text = text[: SNIPPET - 1] + "…"
    return f"{discord.utils.escape_mentions(text)}\n[jump]({hit.jump_url})"[:1024]


class MemoryCog(commands.Cog):
    """Remembers guild messages and answers questions about them."""

    def __init__(self, bot: commands.Bot, engine: MemoryEngine) -> None:
        self.bot = bot
        self.engine = engine

    async def cog_load(self) -> None:
        """Start embedding the backlog in the background."""
        self.embed_backlog.start()

    async def cog_unload(self) -> None:
        """Stop the background loop after one last pass."""
        self.embed_backlog.cancel()
        await asyncio.to_thread(self.engine.embed_pending)

    @tasks.loop(seconds=EMBED_INTERVAL_S)
    async def embed_backlog(self) -> None:
        """Embed stored-but-unembedded messages in one batch, off the event loop."""
        try:
            await asyncio.to_thread(self.engine.embed_pending)
        except MemoryBotError as exc:
            log.error("embedding the backlog failed: %s", exc)

    # -- listeners -----------------------------------------------------------------------

    @commands.Cog.listener()
    async def on_message(self, message: discord.Message) -> None:
        """Store the message; answer from memory when the bot is mentioned."""
        if self.bot.user is not None and message.author.id == self.bot.user.id:
            return
        record = record_from_message(message)
        if record is not None:
            await asyncio.to_thread(self.engine.upsert, [record])
        if self.bot.user is not None and self.bot.user in message.mentions and message.guild:
            await self.autorespond(message)

    @commands.Cog.listener()
    async def on_raw_message_edit(self, payload: discord.RawMessageUpdateEvent) -> None:
        """Re-store an edited message (text, FTS and vector are refreshed)."""
        record = record_from_message(payload.message)
        if record is not None:
            await asyncio.to_thread(self.engine.upsert, [record])

    @commands.Cog.listener()
    async def on_raw_message_delete(self, payload: discord.RawMessageDeleteEvent) -> None:
        """Forget a deleted message everywhere."""
        await asyncio.to_thread(self.engine.delete, [payload.message_id])

    @commands.Cog.listener()
    async def on_raw_bulk_message_delete(self, payload: discord.RawBulkMessageDeleteEvent) -> None:
        """Forget bulk-deleted messages everywhere."""
        await asyncio.to_thread(self.engine.delete, list(payload.message_ids))

    async def autorespond(self, message: discord.Message) -> None:
        """Reply with the messages memory retrieves for the mention's text."""
        text = message.content
        for user in message.mentions:
            text = text.replace(user.mention, "").replace(f"<@!{user.id}>", "")
        if not text.strip():
            return
        if message.guild is None:
            return
        request = SearchRequest(queries=(text,), guild_id=message.guild.id, limit=4)
        result = await self._search(request)
        if isinstance(result, str):
            await message.reply(result, mention_author=False)
            return
        # the question itself was just stored; it is not an answer to itself
        result.hits = [h for h in result.hits if h.id != message.id][:3]
        await message.reply(
            embed=render_hits(result, "Here is what I remember"), mention_author=False
        )

    async def _search(self, request: SearchRequest) -> SearchResult | str:
        try:
            return await asyncio.to_thread(self.engine.search, request)
        except MemoryBotError as exc:
            return f"Search failed: {exc}"

    # -- slash commands ------------------------------------------------------------------

    @app_commands.command(name="search", description="Search this server's message history")
    @app_commands.describe(
        query="What to look for", channel="Only this channel (and its threads)",
        author="Only messages by this member", limit="How many results (1-10)",
        private="Only you see the answer",
    )
    @app_commands.guild_only()
    async def search(
        self,
        interaction: discord.Interaction,
        query: app_commands.Range[str, 1, 500],
        channel: discord.TextChannel | discord.Thread | None = None,
        author: discord.User | None = None,
        limit: app_commands.Range[int, 1, 10] = 5,
        private: bool = True,
    ) -> None:
        """Run a memory search and show the hits with jump links."""
        await interaction.response.defer(ephemeral=private, thinking=True)
        request = SearchRequest(
            queries=(query,), guild_id=interaction.guild_id, limit=limit,
            channel_ids=(channel.id,) if channel else None,
            author_ids=(author.id,) if author else None,
        )
        result = await self._search(request)
        if isinstance(result, str):
            await interaction.followup.send(result, ephemeral=True)
            return
        await interaction.followup.send(embed=render_hits(result, f"🔎 {query}"), ephemeral=private)

    @app_commands.command(name="memory", description="What the bot remembers")
    @app_commands.guild_only()
    async def memory_stats(self, interaction: discord.Interaction) -> None:
        """Show stored message counts, the backlog and the active profile."""
        await interaction.response.defer(ephemeral=True, thinking=True)
        stats = await asyncio.to_thread(self.engine.store.stats)
        count = await asyncio.to_thread(self.engine.store.message_count, interaction.guild_id)
        lines = [
            f"Messages from this server: **{count}** (all servers: {stats.messages})",
            f"Waiting to be embedded: {stats.pending_embeddings}",
            f"Embedder: {stats.embedding_model}",
            f"Hardware profile: {self.engine.rerankers.profile_name}",
        ]
        await interaction.followup.send("\n".join(lines), ephemeral=True)

    @app_commands.command(name="profile", description="Switch the hardware profile (admins)")
    @app_commands.describe(name="Profile to load")
    @app_commands.choices(
        name=[app_commands.Choice(name=p, value=p) for p in available_profiles()][:25]
    )
    @app_commands.default_permissions(manage_guild=True)
    @app_commands.guild_only()
    async def profile(self, interaction: discord.Interaction, name: str) -> None:
        """Load a profile's reranker in the background and swap it in."""
        await interaction.response.defer(ephemeral=True, thinking=True)
        try:
            profile = await asyncio.to_thread(load_profile, name)
            future = self.engine.switch_profile(profile)
            await asyncio.wrap_future(future)
        except Exception as exc:  # the old profile stays active; say why
            log.warning("profile switch to %s failed: %s", name, exc)
            await interaction.followup.send(f"Could not switch to **{name}**: {exc}", ephemeral=True)
            return
        await interaction.followup.send(f"Hardware profile is now **{name}**.", ephemeral=True)


async def setup(bot: commands.Bot) -> None:
    """Extension entry point: the bot must carry an ``engine`` attribute."""
    await bot.add_cog(MemoryCog(bot, bot.engine))  # type: ignore[attr-defined]
