"""Searching memory for members and for other cogs.

``/search``, the "Find related messages" context menu, the reply to a mention and
:meth:`MemoryCog.context_for` (the coroutine other cogs call) all search through
:meth:`MemoryCog.member_search` or the same allow-lists: only channels the member
can read now (:mod:`cogs.memory.permissions`), and for a reply others will read,
only sources everyone who can read the reply's channel can read.

:class:`MemoryCog` is the memory's face to other cogs, which look it up by its class
name (discord.py's cog name)::

    context = await bot.get_cog("MemoryCog").context_for(message, question)
"""

from __future__ import annotations

import functools
import logging
from dataclasses import replace
from datetime import datetime, timezone

import discord
from discord import app_commands
from discord.ext import commands

import cogs.memory.answers as answers
from cogs.memory.errors import answering
from cogs.memory.guild_only import member_of
from cogs.memory.permissions import (
    StoredThreads,
    age_verified,
    public_reply_sources,
    readable_channel_ids,
)
from cogs.memory.render import render_hits, withheld_note
from cogs.memory.runtime import MemoryRuntime
from memory.context import Context
from memory.errors import SearchInputError, SettingsUnreadable
from memory.records import SearchResult
from memory.search import SearchRequest

log = logging.getLogger(__name__)

MENTION_COOLDOWN_S = 10.0

Place = discord.abc.GuildChannel | discord.Thread


class MemoryCog(commands.Cog):
    """Finds what was said, within what the asking member may read.

    Args:
        runtime: The shared worker threads (searches run on their own capped pool).
    """

    def __init__(self, runtime: MemoryRuntime) -> None:
        self.runtime = runtime
        self.bot = runtime.bot
        self.engine = runtime.engine
        self._mention_cooldown = commands.CooldownMapping.from_cooldown(
            1, MENTION_COOLDOWN_S, commands.BucketType.member
        )
        self.find_related_menu = app_commands.ContextMenu(
            name="Find related messages", callback=self.find_related
        )
        self.find_related_menu.guild_only = True

    async def cog_load(self) -> None:
        """Add the context menu (a cog adds its context menus to the tree itself)."""
        self.bot.tree.add_command(self.find_related_menu)

    async def cog_unload(self) -> None:
        """Remove the context menu."""
        self.bot.tree.remove_command(self.find_related_menu.name, type=self.find_related_menu.type)

    # -- allow-lists -----------------------------------------------------------------------

    async def allowed_channels(
        self, member: discord.Member, reply_channel: Place | None = None, *,
        asked_in: object = None,
    ) -> frozenset[int]:
        """The channel ids a search for ``member`` may look in.

        With ``reply_channel`` (a reply others will read), only sources everyone who
        can read that channel can read too.  ``asked_in``: where the member asked (the
        reply channel by default); age-restricted channels answer only from past the
        age gate (:func:`~cogs.memory.permissions.age_verified`).
        """
        readable, safe = await self._scopes(member, reply_channel, asked_in)
        return readable if safe is None else safe

    async def _scopes(
        self, member: discord.Member, reply_channel: Place | None, asked_in: object = None,
    ) -> tuple[frozenset[int], frozenset[int] | None]:
        """What ``member`` can read, and what a reply in ``reply_channel`` may quote (if any)."""
        threads = await self.runtime.read(self._stored_threads, member.guild.id)
        readable = readable_channel_ids(
            member, threads, age_verified=age_verified(asked_in or reply_channel))
        if reply_channel is None:
            return readable, None
        return readable, public_reply_sources(reply_channel, readable, threads)

    def _stored_threads(self, guild_id: int) -> StoredThreads:
        """The guild's stored threads, indexed (on the read thread: tens of thousands of
        them took 80-180 ms of the event loop)."""
        return StoredThreads.from_rows(self.engine.storage.messages.threads(guild_id))

    async def member_search(
        self, member: discord.Member, request: SearchRequest, *,
        reply_channel: Place | None = None, asked_in: object = None,
    ) -> tuple[SearchResult, int]:
        """Search as ``member`` sees the server; returns the result and how many were withheld.

        With ``reply_channel`` the answer is public: sources not everyone there can read
        are left out, and a second, cheaper search (no reranking) counts how many of
        the member's own top results that withheld.
        """
        readable, public = await self._scopes(member, reply_channel, asked_in)
        safe = readable if public is None else public
        request = replace(request, guild_id=member.guild.id)
        result = await self.runtime.search(replace(request, allowed_channel_ids=safe))
        return result, await self._withheld(request, readable, safe)

    async def _withheld(
        self, request: SearchRequest, readable: frozenset[int], safe: frozenset[int]
    ) -> int:
        """How many of the member's own top hits a public reply leaves out (a cheap search)."""
        if safe == readable:
            return 0
        wider = await self.runtime.search(replace(request, allowed_channel_ids=readable, rerank=False))
        return sum(1 for hit in wider.hits if hit.channel_id not in safe)

    # -- mentions --------------------------------------------------------------------------

    @commands.Cog.listener("on_message")
    async def on_mention(self, message: discord.Message) -> None:
        """Answer a member who mentions the bot in its text, where the guild wants answers."""
        me = self.bot.user
        if message.guild is None or me is None or message.author.id == me.id:
            return
        if message.author.bot or not _mentions_bot(message, me.id):
            return
        try:
            settings = await self.runtime.guild_settings.get(message.guild.id)
        except SettingsUnreadable:  # where it may answer cannot be judged: it does not
            log.warning("mention from %s not answered: settings unreadable", message.author.id)
            return
        channel = message.channel
        parent_id = channel.parent_id if isinstance(channel, discord.Thread) else None
        if not settings.answers_in(channel.id, parent_id):
            return
        if self._mention_cooldown.update_rate_limit(message):
            log.debug("mention from %s ignored: cooldown", message.author.id)
            return
        await self.answer_mention(message)

    async def answer_mention(self, message: discord.Message) -> None:
        """Reply publicly: the chat model's grounded answer, or the list of hits without one.

        Only messages everyone in the reply's channel can read are searched, and the
        reply does not say whether others matched.
        """
        place = _place(message.channel)
        question = answers.question_text(message)
        if not question or not isinstance(message.author, discord.Member) or place is None:
            return
        async with answering(message, "mention reply"):
            # a public reply cannot say anything to the asker alone, so it says nothing
            # of what it left out (that channels the others cannot read hold matches)
            safe = await self.allowed_channels(message.author, place)
            record = functools.partial(self.runtime.retractions.record, message.author.guild.id,
                                       place.id, asked=message.id)
            await answers.answer_mention(message, self.engine, self.runtime.chat,
                                         allowed_channel_ids=safe, question=question,
                                         run=self.runtime.searching, record=record)

    # -- for other cogs ----------------------------------------------------------------------

    async def context_for(
        self,
        message_or_interaction: discord.Message | discord.Interaction,
        query: str | None = None,
        *,
        private: bool = False,
        budget_tokens: int | None = None,
    ) -> Context:
        """Conversations memory holds about a question, for other cogs' answers.

        Limited to what the asking member can read and, unless ``private`` (the
        answer goes only to that member), to what everyone who can read the
        channel it was asked in can read: the answer is assumed to be public there.

        Args:
            message_or_interaction: The question's message (its text is the query
                unless ``query`` is given) or an interaction (pass ``query``).
            query: The question.
            private: The caller will show the answer only to the asking member.
            budget_tokens: Token budget of the quoted history (the profile's by default).

        Raises:
            SearchInputError: Outside a server, no question, or a channel whose
                readers cannot be judged for a public answer.
        """
        source = message_or_interaction
        member = source.author if isinstance(source, discord.Message) else source.user
        if not isinstance(member, discord.Member):
            raise SearchInputError("memory context is only available inside a server")
        place = _place(source.channel)
        if place is None and not private:
            raise SearchInputError("cannot tell who reads this channel; ask with private=True")
        readable, public = await self._scopes(member, None if private else place, place)
        return await answers.fetch_context(
            self.engine, source, query, allowed_channel_ids=readable if public is None else public,
            budget_tokens=budget_tokens, run=self.runtime.searching,
        )

    # -- /search and the context menu ------------------------------------------------------

    @app_commands.command(name="search", description="Search this server's message history")
    @app_commands.describe(
        query="What to look for", channel="Only this channel (and its threads)",
        author="Only messages by this member", after="Only after this day (YYYY-MM-DD)",
        before="Only before this day (YYYY-MM-DD)", limit="How many results (1-10)",
        private="Only you see the answer (default: yes)",
    )
    @app_commands.guild_only()
    @app_commands.checks.cooldown(3, 15.0, key=lambda i: (i.guild_id, i.user.id))
    async def search_command(
        self,
        interaction: discord.Interaction,
        query: app_commands.Range[str, 1, 500],
        # a thread comes as Discord describes it: archived ones are not in discord.py's
        # cache, and only the id is needed (the allow-list judges who may read it)
        channel: discord.TextChannel | app_commands.AppCommandThread | discord.VoiceChannel
        | discord.StageChannel | discord.ForumChannel | None = None,
        author: discord.Member | None = None,
        after: str | None = None,
        before: str | None = None,
        limit: app_commands.Range[int, 1, 10] = 5,
        private: bool = True,
    ) -> None:
        """Run a memory search and show the hits with jump links.

        A public answer (``private:False``) leaves out what not everyone in the
        channel can read; how much it left out is told to the member alone.
        """
        request = SearchRequest(
            queries=(query,), limit=limit,
            channel_ids=(channel.id,) if channel else None,
            author_ids=(author.id,) if author else None,
            after=_parse_day(after, "after"), before=_parse_day(before, "before"),
        )
        place = _place(interaction.channel)
        if place is None or not interaction.app_permissions.view_channel:
            # who reads this channel cannot be judged, or the bot could not take the answer
            # down later (it cannot see the channel): answer only the member
            private = True
        await interaction.response.defer(ephemeral=private, thinking=True)
        result, withheld = await self.member_search(
            member_of(interaction), request, reply_channel=None if private else place,
            asked_in=place,
        )
        answer = await interaction.followup.send(
            embed=render_hits(result, f"🔎 {query}", interaction.guild),
            ephemeral=private, allowed_mentions=discord.AllowedMentions.none(), wait=True,
        )
        if not private and interaction.guild_id is not None and interaction.channel_id is not None:
            # taken down if a message it shows is deleted or edited (cogs.memory.retractions)
            self.runtime.retractions.record(interaction.guild_id, interaction.channel_id,
                                            [answer.id], [hit.id for hit in result.hits],
                                            asked=interaction.id)
        if withheld:  # after the public answer, which takes the deferred response's place
            await interaction.followup.send(withheld_note(withheld), ephemeral=True)

    async def find_related(self, interaction: discord.Interaction, message: discord.Message) -> None:
        """Context menu: messages related to this one, shown only to the member."""
        query = message.content.strip()
        if not query:
            await interaction.response.send_message(
                "That message has no text to search with.", ephemeral=True)
            return
        await interaction.response.defer(ephemeral=True, thinking=True)
        request = SearchRequest(queries=(query[:500],), limit=6)
        result, _ = await self.member_search(member_of(interaction), request,
                                             asked_in=interaction.channel)
        result.hits = [h for h in result.hits if h.id != message.id][:5]
        await interaction.followup.send(
            embed=render_hits(result, "Related messages", interaction.guild), ephemeral=True,
            allowed_mentions=discord.AllowedMentions.none(),
        )


def _parse_day(value: str | None, name: str) -> datetime | None:
    if value is None:
        return None
    try:
        day = datetime.strptime(value.strip(), "%Y-%m-%d")
    except ValueError:
        raise SearchInputError(f"{name} must be a date like 2026-01-31, not {value!r}") from None
    return day.replace(tzinfo=timezone.utc)


def _mentions_bot(message: discord.Message, bot_id: int) -> bool:
    """Whether the text itself mentions the bot (a reply's automatic ping does not count)."""
    return f"<@{bot_id}>" in message.content or f"<@!{bot_id}>" in message.content


def _place(channel: object) -> Place | None:
    """The guild channel or thread a reply goes to, or None when it is not one we can judge."""
    if isinstance(channel, (discord.abc.GuildChannel, discord.Thread)):
        return channel
    return None
