"""Entry point: the offline CLI (``python bot.py --help``) and the Discord bot (``run``).

The bot is a small ``commands.Bot`` subclass that receives its engine as an argument
and loads the memory cog in ``setup_hook``; the engine lives in ``memory/``, the
Discord glue in ``cogs/`` and the command line in ``cli/``.
"""

from __future__ import annotations

import asyncio
import logging
import os
import signal
import sys
from collections.abc import Sequence
from pathlib import Path

import aiohttp
import click
import discord
from discord.ext import commands

from cli.app import main as cli_main
from cli.context import Settings, open_engine
from cli.params import SNOWFLAKE
from cogs.memory.errors import ReportingTree
from memory.engine import MemoryEngine
from memory.errors import ConfigError, MemoryBotError

log = logging.getLogger("bot")


class MemoryBot(commands.Bot):
    """A Discord bot that remembers its channels.

    Only slash commands, context menus and listeners: prefix commands are off, so a
    mention is never parsed as one.

    Args:
        engine: The memory engine the cog stores into and searches.
        extensions: Cog modules to load at start-up.
        sync: Publish slash commands in ``setup_hook``: ``"global"`` everywhere (Discord
            takes up to an hour), a guild id to that guild only (instant, for
            development), ``None`` not at all (the default: they persist on Discord).
        owner_ids: Users allowed the bot-wide owner commands; ``None`` asks Discord
            who owns the application.
        owns_engine: Close the engine when the bot closes (``run_bot`` keeps it open
            across login attempts and closes it itself).
    """

    def __init__(
        self,
        engine: MemoryEngine,
        *,
        extensions: Sequence[str] = ("cogs.memory",),
        sync: str | int | None = None,
        owner_ids: set[int] | None = None,
        owns_engine: bool = True,
        **options,
    ) -> None:
        intents = discord.Intents.default()
        intents.message_content = True  # privileged: enable it in the developer portal
        intents.members = False
        if owner_ids:
            options["owner_ids"] = set(owner_ids)
        super().__init__(
            command_prefix=commands.when_mentioned, intents=intents, help_command=None,
            tree_cls=ReportingTree, **options
        )
        self.engine = engine
        self.initial_extensions = tuple(extensions)
        self.sync = sync
        self.owns_engine = owns_engine

    async def setup_hook(self) -> None:
        """Load the cogs; publish slash commands only when asked to."""
        for extension in self.initial_extensions:
            await self.load_extension(extension)
        if self.sync == "global":
            synced = await self.tree.sync()
            log.info("synced %d application commands globally", len(synced))
        elif self.sync is not None:
            guild = discord.Object(int(self.sync))
            self.tree.copy_global_to(guild=guild)
            synced = await self.tree.sync(guild=guild)
            log.info("synced %d application commands to guild %s", len(synced), self.sync)

    async def process_commands(self, message: discord.Message) -> None:
        """No prefix commands: mentions are answered by the memory cog instead."""

    async def close(self) -> None:
        """Close the Discord connection, then the engine (when it is the bot's)."""
        try:
            await super().close()
        finally:
            if self.owns_engine:
                self.engine.close()


# Pauses between start-up attempts that failed for a passing reason: 112 s in all.
STARTUP_RETRY_S = (2.0, 5.0, 15.0, 30.0, 60.0)
# Passing reasons: Discord's 5xx, no route or a reset connection, a timeout (an OSError).
TRANSIENT = (discord.DiscordServerError, discord.GatewayNotFound, aiohttp.ClientError, OSError)


def run_bot(
    engine: MemoryEngine,
    token: str,
    *,
    sync: str | int | None = None,
    owner_ids: set[int] | None = None,
    retry_delays: Sequence[float] = STARTUP_RETRY_S,
) -> int:
    """Connect to Discord and serve until stopped (Ctrl-C or SIGTERM).

    The models load before the connection opens, so the event loop never waits on
    them.  A start-up that fails for a passing reason (Discord answers 5xx, no
    route, a timeout) is tried again after each of ``retry_delays`` seconds, saying
    so in the log; any failure that remains (those, a rejected token, a missing
    privileged intent, anything unexpected) ends in one ``error:`` line on stderr
    and exit code 2.  Shutdown finishes queued writes and closes the database.

    Returns:
        The process exit code.
    """
    log.info("loading models before connecting")
    engine.preload()

    async def serve() -> None:
        stop = asyncio.Event()
        bots: list[MemoryBot] = []
        closing: set[asyncio.Task] = set()

        def on_signal() -> None:
            stop.set()
            if bots:
                closing.add(asyncio.ensure_future(bots[-1].close()))

        loop = asyncio.get_running_loop()
        for sig in (signal.SIGTERM, signal.SIGINT):
            try:
                loop.add_signal_handler(sig, on_signal)
            except (NotImplementedError, RuntimeError):  # e.g. Windows, or not the main thread
                pass
        for attempt, pause in enumerate([*retry_delays, None], start=1):
            bot = MemoryBot(engine, sync=sync, owner_ids=owner_ids, owns_engine=False)
            bots.append(bot)
            try:
                async with bot:  # a fresh bot each time: a failed login leaves half-set-up state
                    await bot.start(token)
                return
            except TRANSIENT as exc:
                if pause is None or stop.is_set():
                    raise
                log.warning("starting failed (%s); trying again in %g s (try %d of %d; "
                            "%g s of waiting left before giving up)", _describe(exc), pause,
                            attempt + 1, len(retry_delays) + 1, sum(retry_delays[attempt - 1:]))
            try:
                await asyncio.wait_for(stop.wait(), pause)
                return  # stopped while waiting
            except TimeoutError:
                pass

    problem = None
    try:
        asyncio.run(serve())
    except KeyboardInterrupt:
        pass
    except Exception as exc:  # every failure is one line; the traceback only at DEBUG
        log.debug("the bot stopped on an error", exc_info=True)
        problem = _startup_problem(exc)
    finally:
        engine.close()
    if problem is not None:
        print(f"error: {problem}", file=sys.stderr)
        return 2
    return 0


def _describe(exc: BaseException) -> str:
    """A short phrase for a transient error: Discord's status, or the network error."""
    if isinstance(exc, discord.HTTPException):
        return f"Discord answered {exc.status} {exc.response.reason}"
    return str(exc) or type(exc).__name__


def _startup_problem(exc: Exception) -> str:
    """The one line that tells the operator why the bot stopped, and what to do."""
    if isinstance(exc, discord.LoginFailure) or (
        isinstance(exc, discord.ConnectionClosed) and exc.code == 4004
    ):
        return "Discord rejected the token: check DISCORD_TOKEN (Bot tab of the developer portal)"
    if isinstance(exc, discord.PrivilegedIntentsRequired):
        return ("Discord refused the Message Content intent: enable it under Bot → Privileged "
                "Gateway Intents in the developer portal")
    if isinstance(exc, discord.DiscordServerError):
        return (f"Discord's API is failing ({_describe(exc)}); it usually recovers: see "
                "https://discordstatus.com and start the bot again later")
    if isinstance(exc, TRANSIENT):
        return f"cannot reach Discord ({_describe(exc)}); check the network and try again"
    if isinstance(exc, discord.HTTPException):
        return f"Discord refused a start-up request ({exc.status}: {exc.text or exc.response.reason})"
    if isinstance(exc, discord.ConnectionClosed):
        return f"Discord closed the gateway connection (code {exc.code}); try again later"
    if isinstance(exc, MemoryBotError):
        return str(exc)
    return (f"the bot stopped on an unexpected {type(exc).__name__}: {exc} "
            "(run with --log-level DEBUG for the traceback)")


@click.command("run")
@click.option("--sync", is_flag=True,
              help="Publish slash commands globally at start-up (after an upgrade).")
@click.option("--dev-guild", type=SNOWFLAKE, metavar="ID",
              help="Publish slash commands to this guild only (instant; for development).")
@click.option("--owner", type=SNOWFLAKE, multiple=True, metavar="USER_ID",
              help="A user allowed the owner commands (repeatable; default: the app's owner).")
@click.pass_obj
def run_command(settings: Settings, sync: bool, dev_guild: int | None, owner: tuple[int, ...]) -> int:
    """Connect to Discord and run the bot ($DISCORD_TOKEN)."""
    token = os.environ.get("DISCORD_TOKEN")
    if not token:
        raise ConfigError("set DISCORD_TOKEN to the bot token from the Discord developer portal")
    target: str | int | None = "global" if sync else dev_guild
    return run_bot(open_engine(settings), token, sync=target, owner_ids=set(owner) or None)


def main(argv: Sequence[str] | None = None) -> int:
    """Run the command line (the offline tools plus ``run``); returns the exit status."""
    idle_threads_sleep()
    prog = "bot.py" if argv is not None or sys.argv[0].endswith(".py") else Path(sys.argv[0]).name
    return cli_main(argv, commands=[run_command], prog_name=prog)


def idle_threads_sleep() -> None:
    """Let torch's idle OpenMP workers sleep at once instead of spinning.

    By default each worker spins for about 10 ms of CPU after every parallel region
    (a query's embedding), taking a core from the SQLite work that follows: the
    vector KNN right after an embedding ran 14 ms instead of 9 on a 2-core machine
    (BENCHMARKS.md).  OpenMP reads the policy when torch is first imported, which
    the engine does lazily, after this; a value set in the environment wins.
    """
    os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")


if __name__ == "__main__":
    sys.exit(main())
