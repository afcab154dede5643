"""``run``: connect to Discord and serve until stopped.

The bot itself is :class:`cogs.memory.MemoryBot`; this is the process around it:
the models load first, passing start-up failures are tried again with back-off,
Ctrl-C and SIGTERM shut it down cleanly, and whatever stops it for good is one
``error:`` line and exit status 2.  ``--shard-count N --shards a,b`` makes it one
of several processes sharing one database, each running some of the bot's shards
(:mod:`cogs.memory.shards`).
"""

from __future__ import annotations

import asyncio
import functools
import logging
import os
import signal
import sys
from collections.abc import Callable, Coroutine, Sequence
from typing import Any

import aiohttp
import click
import discord

from cli.context import Settings, open_engine
from cli.params import SHARD_IDS, SNOWFLAKE
from cogs.memory import MemoryBot
from cogs.memory.bot import memory_bot
from cogs.memory.shards import Shards
from memory.engine import MemoryEngine
from memory.errors import ConfigError, MemoryBotError

# the name these lines have always had in the log (they were written by bot.py)
log = logging.getLogger("bot")

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
    shards: Shards | None = None,
) -> int:
    """Connect to Discord and serve until stopped (Ctrl-C or SIGTERM).

    The models load before the connection opens, so the event loop never waits on
    them.  A start-up that fails for a passing reason (Discord answers 5xx, no
    route, a timeout) is tried again after each of ``retry_delays`` seconds, saying
    so in the log; any failure that remains (those, a rejected token, a missing
    privileged intent, anything unexpected) ends in one ``error:`` line on stderr
    and exit code 2.  Shutdown finishes queued writes and closes the database.

    Args:
        engine: The memory engine (closed when this returns).
        token: The bot token.
        sync: Publish slash commands: ``"global"``, a guild id, or ``None``.
        owner_ids: Users allowed the owner commands (``None``: the application's owner).
        retry_delays: Pauses between start-up attempts that failed for a passing reason.
        shards: The shards this process runs (``None``: the bot is not sharded).

    Returns:
        The process exit code.
    """
    if shards is not None:
        log.info("running %s: this process answers for their servers only", shards.describe())
    log.info("loading models before connecting")
    engine.preload()
    new_bot = functools.partial(memory_bot, engine, shards=shards, sync=sync,
                                owner_ids=owner_ids, owns_engine=False)
    problem = _run_until_stopped(_serve(new_bot, token, retry_delays), engine)
    if problem is not None:
        print(f"error: {problem}", file=sys.stderr)
        return 2
    return 0


async def _serve(new_bot: Callable[[], MemoryBot], token: str,
                 retry_delays: Sequence[float]) -> None:
    """Serve in the running event loop (where the stop signal's event must be made)."""
    await _Serving(new_bot, token, retry_delays).serve()


def _run_until_stopped(serving: Coroutine[Any, Any, None], engine: MemoryEngine) -> str | None:
    """Run ``serving`` in a new event loop, then close the engine.

    Returns:
        Why the bot stopped for good, as the one line to show; ``None`` for a clean
        stop (a signal, Ctrl-C, or the connection closed by the bot itself).
    """
    try:
        asyncio.run(serving)
    except KeyboardInterrupt:
        pass
    except Exception as exc:  # every failure is one line; the traceback only at DEBUG
        log.debug("the bot stopped on an error", exc_info=True)
        return _startup_problem(exc)
    finally:
        engine.close()
    return None


class _Serving:
    """One run of the bot: start-up attempts with pauses between them, until stopped.

    A fresh bot is made for every attempt (a failed login leaves half-set-up state);
    SIGTERM and SIGINT close the latest one, or end a pause between attempts.

    Args:
        new_bot: Makes the bot for one attempt.
        token: The bot token.
        retry_delays: Pauses after attempts that failed for a passing reason.
    """

    def __init__(self, new_bot: Callable[[], MemoryBot], token: str,
                 retry_delays: Sequence[float]) -> None:
        self.new_bot = new_bot
        self.token = token
        self.retry_delays = retry_delays
        self.stop = asyncio.Event()
        self.bots: list[MemoryBot] = []
        self.closing: set[asyncio.Task] = set()  # close() tasks, kept until they are done

    async def serve(self) -> None:
        """Start the bot and serve; after a passing failure pause, then try again.

        Raises:
            Exception: What stopped the last attempt, or a failure that is not passing.
        """
        self._handle_signals()
        for attempt, pause in enumerate([*self.retry_delays, None], start=1):
            if await self._attempt(attempt, pause) or pause is None:
                return
            if await self._stopped_within(pause):
                return

    def _handle_signals(self) -> None:
        loop = asyncio.get_running_loop()
        for sig in (signal.SIGTERM, signal.SIGINT):
            try:
                loop.add_signal_handler(sig, self._on_signal)
            except (NotImplementedError, RuntimeError):  # e.g. Windows, or not the main thread
                pass

    def _on_signal(self) -> None:
        self.stop.set()
        if self.bots:
            self.closing.add(asyncio.ensure_future(self.bots[-1].close()))

    async def _attempt(self, attempt: int, pause: float | None) -> bool:
        """Run one bot until it ends: ``True`` when serving is over, ``False`` to try again.

        Raises:
            Exception: A failure that is not passing, or any failure of the last attempt.
        """
        bot = self.new_bot()
        self.bots.append(bot)
        try:
            async with bot:  # a fresh bot each time: a failed login leaves half-set-up state
                await bot.start(self.token)
            return True
        except Exception as exc:
            if self.stop.is_set():  # closed mid-(re)connect: what it raises is the close's doing
                log.debug("the connection ended while stopping: %r", exc)
                return True
            if pause is None or not isinstance(exc, TRANSIENT):
                raise
            delays = self.retry_delays
            log.warning("starting failed (%s); trying again in %g s (try %d of %d; "
                        "%g s of waiting left before giving up)", _describe(exc), pause,
                        attempt + 1, len(delays) + 1, sum(delays[attempt - 1:]))
            return False

    async def _stopped_within(self, pause: float) -> bool:
        """Wait ``pause`` seconds; ``True`` when a signal stopped the bot meanwhile."""
        try:
            await asyncio.wait_for(self.stop.wait(), pause)
            return True
        except TimeoutError:
            return False


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
@click.option("--shard-count", type=int, metavar="N",
              help="How many shards the bot has in all, the same in every process "
              "(with --shards).")
@click.option("--shards", "shard_ids", type=SHARD_IDS,
              help="The shards this process runs, e.g. 0,1 (with --shard-count); the other "
              "processes run the rest on the same database.")
@click.pass_obj
def run_command(settings: Settings, sync: bool, dev_guild: int | None, owner: tuple[int, ...],
                shard_count: int | None, shard_ids: tuple[int, ...] | None) -> int:
    """Connect to Discord and run the bot ($DISCORD_TOKEN)."""
    shards = _shards(shard_count, shard_ids)
    token = os.environ.get("DISCORD_TOKEN")
    if not token:
        raise ConfigError("set DISCORD_TOKEN to the bot token from the Discord developer portal")
    target: str | int | None = "global" if sync else dev_guild
    return run_bot(open_engine(settings), token, sync=target, owner_ids=set(owner) or None,
                   shards=shards)


def _shards(count: int | None, ids: tuple[int, ...] | None) -> Shards | None:
    """The shards ``--shard-count`` and ``--shards`` name, or ``None`` when neither is given.

    Raises:
        ConfigError: Only one of them is given, or the ids do not fit the count.
    """
    if count is None and ids is None:
        return None
    if count is None or ids is None:
        raise ConfigError("give --shard-count and --shards together (e.g. --shard-count 4 "
                          "--shards 0,1), or neither to run the bot unsharded")
    return Shards(count, ids)
