"""Public answers taken down once a message they quote is gone.

A public answer (``/search private:False``, a mention reply and its extra parts)
shows stored messages' text to everyone in its channel.  After posting one, the cog
calls :meth:`Retractions.record`: the answer and the ids it quotes go through the
ordered write queue, behind any deletion queued before.  When a quoted message is
later forgotten (deleted on Discord, forget-me, a purge, retention, its channel
deleted) or its text edited, the storage makes the answer *due* in the same
transaction (:class:`memory.storage.contract.Quotes`), and :meth:`Retractions.retract_loop`
replaces it on Discord with :data:`NOTE`, embeds removed.

An answer that no longer exists, or whose channel is gone or closed to the bot (404,
403), is done: there is nothing left to edit.  Any other failure is tried again later,
that answer waiting longer each time.  Each process takes down only its own guilds'
answers (those in its cache: its shards').
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Awaitable, Callable, Iterable, Sequence
from typing import Any

import discord
from discord.ext import tasks

from cogs.memory.write_queue import WriteQueue
from memory.errors import MemoryBotError
from memory.records import snowflake_time_ms
from memory.storage.contract import PostedAnswer, Quotes

log = logging.getLogger(__name__)

NOTE = "This answer quoted a message that has since been deleted or edited, so it was taken down."
RETRACT_INTERVAL_S = 10.0
RETRACT_BACKOFF_MAX_S = 300.0  # the loop, after a failure of its own
RETRY_MIN_S, RETRY_MAX_S = 30.0, 3600.0  # one answer whose edit failed
DUE_PAGE = 100


class Retractions:
    """Records what public answers quote and takes down the answers due.

    Args:
        bot: The client whose messages are edited.
        quotes: The storage noun.
        writes: The ordered write queue (records and "done" marks go through it).
        read: Runs a quick read off the event loop (the runtime's read threads).
    """

    def __init__(self, bot: discord.Client, quotes: Quotes, writes: WriteQueue,
                 read: Callable[..., Awaitable[Any]]) -> None:
        self.bot = bot
        self.quotes = quotes
        self.writes = writes
        self._read = read
        self._failures = 0
        self._retry_at: dict[int, tuple[float, float]] = {}  # answer id -> (when, wait)

    def record(self, guild_id: int, channel_id: int, answer_ids: Sequence[int],
               quoted_ids: Iterable[int], *, asked: int) -> None:
        """Queue the answers (the bot's messages in ``channel_id``) and what they quote.

        ``asked`` is the question's snowflake (the mention, the interaction): a quoted
        message edited since may be shown with its old text, and that edit, applied
        before the answer is recorded, finds nothing to take down, so the answer is due
        at once.
        """
        quoted = sorted(set(quoted_ids))
        if quoted:
            since = snowflake_time_ms(asked)
            self.writes.put(self.record_now, [
                (PostedAnswer(answer_id, channel_id, guild_id), quoted, since)
                for answer_id in answer_ids])

    def record_now(self, answers: list[tuple[PostedAnswer, Sequence[int], int]]) -> None:
        """Record answers (on the write thread); one already due is logged."""
        for since in sorted({asked for _, _, asked in answers}):
            if due := self.quotes.record([(answer, quoted) for answer, quoted, asked in answers
                                          if asked == since], edited_since=since):
                log.info("answers %s quoted a message gone or edited before they were "
                         "recorded: due", due)

    @tasks.loop(seconds=RETRACT_INTERVAL_S)
    async def retract_loop(self) -> None:
        """Take down the answers due; any failure is logged and retried later."""
        try:
            await self.retract_due()
            self._failures = 0
        except Exception as exc:
            self._failures += 1
            pause = min(RETRACT_INTERVAL_S * 2 ** self._failures, RETRACT_BACKOFF_MAX_S)
            log.error("taking down answers failed (%s); trying again in %.0f s", exc, pause,
                      exc_info=not isinstance(exc, MemoryBotError))
            await asyncio.sleep(pause)

    async def retract_due(self) -> int:
        """Edit every due answer of this process's guilds to :data:`NOTE`; how many are done."""
        guild_ids = [guild.id for guild in self.bot.guilds]
        if not guild_ids:
            return 0
        now, done = time.monotonic(), []
        waiting = {answer_id for answer_id, (when, _) in self._retry_at.items() if when > now}
        # read past those waiting to be tried again (the oldest, in archived threads, say):
        # a page of them alone would hold back every answer due after them
        due = await self._read(self.quotes.due, DUE_PAGE + len(waiting), guild_ids)
        for answer in due:
            if answer.answer_id not in waiting and await self._take_down(answer):
                done.append(answer.answer_id)
        if done:
            await self.writes.put_and_wait(self.quotes.retracted, done)
            for answer_id in done:
                self._retry_at.pop(answer_id, None)
        return len(done)

    async def _take_down(self, answer: PostedAnswer) -> bool:
        """Edit one answer; ``True`` when it is done with (edited, or nothing to edit)."""
        channel = self.bot.get_partial_messageable(answer.channel_id, guild_id=answer.guild_id)
        try:
            await channel.get_partial_message(answer.answer_id).edit(
                content=NOTE, embeds=[], allowed_mentions=discord.AllowedMentions.none())
        except (discord.NotFound, discord.Forbidden) as exc:
            # 404 Unknown Message/Channel: nothing left to show; 403: the bot can no longer
            # reach it, and never will by trying again
            log.warning("answer %s in channel %s cannot be taken down (%s): dropped",
                        answer.answer_id, answer.channel_id, exc)
            return True
        except Exception as exc:  # Discord's 5xx, an archived thread, a lost connection
            wait = min(self._retry_at.get(answer.answer_id, (0.0, RETRY_MIN_S / 2))[1] * 2,
                       RETRY_MAX_S)
            self._retry_at[answer.answer_id] = (time.monotonic() + wait, wait)
            log.warning("could not take down answer %s in channel %s (%s); trying again in "
                        "%.0f s", answer.answer_id, answer.channel_id, exc, wait)
            return False
        log.info("took down answer %s in channel %s", answer.answer_id, answer.channel_id)
        return True
