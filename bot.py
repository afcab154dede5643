"""Entry point: the offline CLI (``python bot.py --help``) and the Discord bot (``run``).

The bot is a small ``commands.Bot`` subclass that receives its engine as an argument
and loads the memory cog in ``setup_hook``; the engine lives in ``memory/``, the
Discord glue in ``cogs/`` and the command line in ``cli/``.
"""

from __future__ import annotations

import logging
import os
import sys
from collections.abc import Sequence
from pathlib import Path

import click
import discord
from discord.ext import commands

from cli.app import main as cli_main
from cli.context import Settings, open_engine
from memory.engine import MemoryEngine
from memory.errors import ConfigError

log = logging.getLogger("bot")


class MemoryBot(commands.Bot):
    """A Discord bot that remembers its channels.

    Args:
        engine: The memory engine the cog stores into and searches.
        extensions: Cog modules to load at start-up.
        sync_commands: Push slash commands to Discord in ``setup_hook``.
    """

    def __init__(
        self,
        engine: MemoryEngine,
        *,
        extensions: Sequence[str] = ("cogs.memory",),
        sync_commands: bool = True,
        **options,
    ) -> None:
        intents = discord.Intents.default()
        intents.message_content = True  # privileged: enable it in the developer portal
        intents.members = False
        super().__init__(command_prefix=commands.when_mentioned, intents=intents, **options)
        self.engine = engine
        self.initial_extensions = tuple(extensions)
        self.sync_commands = sync_commands

    async def setup_hook(self) -> None:
        """Load the cogs and register slash commands."""
        for extension in self.initial_extensions:
            await self.load_extension(extension)
        if self.sync_commands:
            synced = await self.tree.sync()
            log.info("synced %d application commands", len(synced))

    async def close(self) -> None:
        """Close the Discord connection, then the engine."""
        await super().close()
        self.engine.close()


@click.command("run")
@click.pass_obj
def run_command(settings: Settings) -> int:
    """Connect to Discord and run the bot ($DISCORD_TOKEN)."""
    token = os.environ.get("DISCORD_TOKEN")
    if not token:
        raise ConfigError("set DISCORD_TOKEN to the bot token from the Discord developer portal")
    bot = MemoryBot(open_engine(settings))
    bot.run(token, log_handler=None)
    return 0


def main(argv: Sequence[str] | None = None) -> int:
    """Run the command line (the offline tools plus ``run``); returns the exit status."""
    prog = "bot.py" if argv is not None or sys.argv[0].endswith(".py") else Path(sys.argv[0]).name
    return cli_main(argv, commands=[run_command], prog_name=prog)


if __name__ == "__main__":
    sys.exit(main())
