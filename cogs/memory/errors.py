"""Every member-facing path answers, whatever goes wrong.

Two entry points share one rule (an expected error is told as it is; anything else
gets a short apology with a trace id, and the trace id is logged with the
traceback):

* :class:`ReportingTree` is the bot's command tree: its ``on_error`` answers every
  slash command and context menu of every cog, and interactions for commands the
  bot no longer has (Discord still shows them until the next sync);
* :func:`answering` wraps a listener's reply to a message (the mention reply).
"""

from __future__ import annotations

import logging
import secrets
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager

import discord
from discord import app_commands

from memory.errors import DatabaseFileError, MemoryBotError, StorageBusy

log = logging.getLogger(__name__)

NO_MENTIONS = discord.AllowedMentions.none()


def apology(what: str, error: BaseException) -> str:
    """Log ``error`` with its traceback under a new trace id; the line the member gets."""
    trace = secrets.token_hex(4)
    log.error("%s failed [trace %s]", what, trace, exc_info=error)
    return f"Something went wrong (trace id `{trace}`); the bot's owner can find it in the log."


def engine_error(what: str, error: MemoryBotError) -> str:
    """The line a member gets for an engine error: its own text, except for the
    database's troubles, whose text names files, hosts and drivers (the operator's
    business): those are logged, and the member gets a line without them."""
    if isinstance(error, StorageBusy):
        log.warning("%s: %s", what, error)
        return "The memory database is busy right now; try again in a moment."
    if isinstance(error, DatabaseFileError):
        return apology(what, error)
    return str(error)


def explain(interaction: discord.Interaction, error: app_commands.AppCommandError) -> str:
    """The one line a member gets for a failed command."""
    original = getattr(error, "original", error)
    if isinstance(error, app_commands.CommandOnCooldown):
        return f"Slow down: try again in {error.retry_after:.0f} s."
    if isinstance(error, app_commands.CheckFailure):
        return str(error) or "You can't use this command here."
    if isinstance(error, (app_commands.CommandNotFound, app_commands.CommandSignatureMismatch)):
        return ("This command changed since Discord last heard of it: the bot's owner can "
                "publish the current ones with `/memory-owner sync`.")
    name = interaction.command.qualified_name if interaction.command else "?"
    if isinstance(original, MemoryBotError):
        return engine_error(f"command {name}", original)
    return apology(f"command {name}", original)


async def report_error(interaction: discord.Interaction, error: app_commands.AppCommandError) -> None:
    """Tell the member what went wrong, in one ephemeral line, whatever state the reply is in."""
    text = explain(interaction, error)
    try:
        if interaction.response.is_done():
            await interaction.followup.send(text, ephemeral=True)
        else:
            await interaction.response.send_message(text, ephemeral=True)
    except discord.HTTPException as exc:
        log.warning("could not report an error to the member: %s", exc)


class ReportingTree(app_commands.CommandTree):
    """A command tree whose every failed interaction gets an answer (:func:`report_error`)."""

    async def on_error(
        self, interaction: discord.Interaction, error: app_commands.AppCommandError, /
    ) -> None:
        """Answer the member; unexpected errors are logged with a trace id."""
        await report_error(interaction, error)


@asynccontextmanager
async def answering(message: discord.Message, what: str) -> AsyncIterator[None]:
    """Reply to ``message`` with what went wrong if the block raises (never silence).

    An engine error (:class:`MemoryBotError`) is quoted; anything else is logged
    with a trace id and the reply is a short apology naming it.
    """
    try:
        yield
    except MemoryBotError as exc:
        text = f"Search failed: {engine_error(what, exc)}"
    except Exception as exc:
        text = apology(what, exc)
    else:
        return
    try:
        await message.reply(text, mention_author=False, allowed_mentions=NO_MENTIONS)
    except discord.HTTPException as exc:
        log.warning("could not tell %s that the %s failed: %s", message.author.id, what, exc)
