"""The memory cogs: Discord glue around :class:`memory.engine.MemoryEngine`.

Load the extension ``"cogs.memory"`` on a bot that carries an ``engine``
(:class:`MemoryBot` does); ``setup`` builds one :class:`MemoryRuntime` and adds
the cogs that share it:

==================  ============================================================
``runtime``         :class:`MemoryRuntime` (not a cog): worker threads, the ordered
                    write queue, the embedding and retention loops, the settings cache
                    (``settings_cache``) and Discord's clock (``discord_clock``)
``listeners``       :class:`MemoryListeners`: capture and forget gateway events
``search``          :class:`MemoryCog` (``bot.get_cog("MemoryCog")``): ``/search``, *Find
                    related messages*, mention answers, and ``context_for`` for other cogs
``member``          :class:`MemberCommands`: ``/memory …``
``admin``           :class:`AdminCommands`: ``/memory-admin …`` (``channels`` subgroup)
``owner``           :class:`OwnerCommands`: ``/memory-owner …``, owners only
``backfill``        :class:`Backfiller`: past history, start-up catch-up
``reconcile``       :class:`Reconciler`: forget what was deleted while the bot was away
``bot``             :class:`MemoryBot`: the ``commands.Bot`` that loads this extension
                    (``ShardedMemoryBot`` when the process runs some of the shards)
==================  ============================================================

and their helpers: ``capture`` (messages become records), ``write_queue`` (the
ordered, retrying write queue), ``follow`` (other processes' settings and profile
changes), ``permissions`` (who may read what), ``answers`` (grounded answers),
``render`` (embeds), ``retractions`` (public answers taken down when a message they
quote is deleted or edited), ``errors`` (every failure answered with a trace id),
``guild_only``, ``shards`` (which guilds this process answers for, when the bot's
shards are spread over several processes sharing one database).

Three rules hold everywhere:

* A search made for a member only sees channels that member can read now
  (:mod:`cogs.memory.permissions`), and a reply others will read only quotes sources
  everyone in the reply channel can read.
* Every engine call runs on the runtime's worker threads: writes on one thread
  behind a retrying queue (:mod:`cogs.memory.write_queue`), searches on a small capped pool,
  embedding on its own, so a slow rerank never delays storing a message and the
  event loop never waits on SQLite, torch or HTTP.
* Errors reach the member as one short line, never silence; unexpected ones are
  logged with a trace id the member can quote (:mod:`cogs.memory.errors`: the bot's
  command tree answers failed commands, :func:`cogs.memory.errors.answering` mentions).

Other cogs use the memory through one coroutine::

    context = await bot.get_cog("MemoryCog").context_for(message, question)
"""

from __future__ import annotations

import logging

from discord.ext import commands

from cogs.memory.admin import AdminCommands
from cogs.memory.backfill import Backfiller
from cogs.memory.bot import MemoryBot
from cogs.memory.listeners import MemoryListeners
from cogs.memory.member import MemberCommands
from cogs.memory.owner import OwnerCommands
from cogs.memory.reconcile import Reconciler
from cogs.memory.runtime import MemoryRuntime
from cogs.memory.search import MemoryCog

__all__ = [
    "AdminCommands", "Backfiller", "MemberCommands", "MemoryBot", "MemoryCog", "MemoryListeners",
    "MemoryRuntime", "OwnerCommands", "Reconciler", "setup", "teardown",
]

log = logging.getLogger(__name__)

# the runtime of each bot this extension is loaded on, until teardown stops it
_runtimes: dict[commands.Bot, MemoryRuntime] = {}


async def setup(bot: commands.Bot) -> None:
    """Extension entry point: start a runtime and add the memory cogs that share it.

    Raises:
        RuntimeError: The bot carries no ``engine`` (use :class:`MemoryBot`).
    """
    engine = getattr(bot, "engine", None)
    if engine is None:
        raise RuntimeError("load cogs.memory on a bot that carries an `engine` (see MemoryBot)")
    owner_ids = frozenset(getattr(bot, "owner_ids", None) or ())
    runtime = MemoryRuntime(bot, engine)
    _runtimes[bot] = runtime
    runtime.start()
    backfill = Backfiller(bot, engine, runtime)
    reconciler = Reconciler(bot, engine, runtime)
    search = MemoryCog(runtime)
    for cog in (
        MemoryListeners(runtime, backfill, reconciler),
        search,
        MemberCommands(runtime, search),
        AdminCommands(runtime, backfill, reconciler),
        OwnerCommands(runtime, owner_ids),
    ):
        await bot.add_cog(cog)


async def teardown(bot: commands.Bot) -> None:
    """Extension exit (after discord.py removed the cogs): finish queued writes, stop the runtime."""
    runtime = _runtimes.pop(bot, None)
    if runtime is None:
        return
    try:
        await runtime.stop()
    except Exception:
        log.exception("stopping the memory runtime failed")  # discord.py ignores teardown errors
        raise
