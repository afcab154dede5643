"""One progress message for a long command (backfill, reconcile), edited in place.

The command spawns its work as a task and hands it to :func:`report_progress`, which
edits the member's ephemeral status message every few seconds while the task runs
and says at the end how it finished, stopped on Discord's refusal, or was cancelled
(the work resumes where it stopped on the next run).
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Callable

import discord

log = logging.getLogger(__name__)

PROGRESS_EVERY_S = 3.0  # how often the status message is edited


async def report_progress(status: discord.WebhookMessage, task: asyncio.Task, line: Callable[[], str],
                          *, doing: str, noun: str, guild_id: int) -> None:
    """Edit ``status`` with ``doing`` and ``line()`` until ``task`` ends, then say how it ended.

    Args:
        status: The ephemeral message to edit.
        task: The running work.
        line: The current progress, as one line.
        doing: What the message says while it runs ("Backfilling…").
        noun: What the end says ("Backfill" finished / stopped).
        guild_id: The guild, for the log.

    Raises:
        asyncio.CancelledError: The command was cancelled (the task is cancelled too).
        Exception: Whatever else the task raised.
    """
    try:
        while not task.done():
            await asyncio.wait({task}, timeout=PROGRESS_EVERY_S)
            if not task.done():
                await edit_status(status, f"{doing} {line()}")
        task.result()
        await edit_status(status, f"{noun} finished: {line()}")
    except discord.HTTPException as exc:
        log.warning("%s of guild %d stopped: %s", noun.lower(), guild_id, exc)
        await edit_status(status, f"{noun} stopped: Discord answered {exc.status}. Run it again to "
                                  f"resume where it stopped. {line()}")
    except asyncio.CancelledError:
        task.cancel()
        await edit_status(status, f"{noun} stopped (it resumes where it was): {line()}")
        raise


async def edit_status(message: discord.WebhookMessage, content: str) -> None:
    """Edit a progress message; a failed edit is logged, never raised."""
    try:
        await message.edit(content=content[:2000])
    except discord.HTTPException as exc:  # e.g. the interaction token expired after 15 min
        log.debug("could not update a progress message: %s", exc)
