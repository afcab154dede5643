"""``bench reconcile``: how long reconciling a server with Discord takes, and what it asks.

A server of ``channels`` text channels holds ``messages`` stored messages (spread
evenly, embedded); a share of them was deleted on Discord while the bot was away.
The real bot and memory cogs (state filled from gateway payloads, as in ``bench
discord``) reconcile against a stand-in for Discord's REST API on 127.0.0.1 that
answers at once, so the wall time is the bot's own work: discord.py parsing every
history page, the comparisons and the deletions.  Each request is counted by
route.  What Discord's rate limits would add is computed from the documented
global limit (50 requests a second per bot) and from the reconcile's own pacing
(``reconcile.pause_s`` after every request), whichever is slower.

Each window size runs on its own copy of the same database.
"""

from __future__ import annotations

import asyncio
import bisect
import json
import random
import shutil
import tempfile
import time
from collections import Counter
from collections.abc import Callable, Sequence
from dataclasses import replace
from pathlib import Path
from typing import Any, cast

import discord
import numpy as np
from aiohttp import web

from benchmarks.common import machine_description
from benchmarks.gateway import READ, channel, guild, role, user
from memory.config import Profile, ReconcileConfig
from memory.engine import MemoryEngine
from memory.ingest import store_in_chunks
from memory.records import DISCORD_EPOCH_MS, MessageRecord

GUILD = 8_000
CHANNEL0 = 80_000
AUTHOR = 8_001
DISCORD_GLOBAL_LIMIT = 50  # requests per second per bot (discord.com/developers/docs/topics/rate-limits)


class _RandomEmbedder:
    """Unit vectors from a seeded generator: the bench times deletions, not embedding."""

    model_id = "bench/random-384"
    dimension = 384

    def __init__(self) -> None:
        self._rng = np.random.default_rng(0)

    def embed(self, texts: Sequence[str]) -> np.ndarray:
        vectors = self._rng.standard_normal((len(texts), self.dimension)).astype(np.float32)
        return vectors / np.linalg.norm(vectors, axis=1, keepdims=True)


class _StandIn:
    """Discord's REST API for the routes a reconcile uses, answering at once."""

    def __init__(self, history: dict[int, list[int]]) -> None:
        self.history = history  # channel id -> ids Discord still has, ascending
        self.requests: Counter[str] = Counter()
        self._runner: web.AppRunner | None = None

    async def start(self) -> str:
        app = web.Application()
        app.router.add_get("/api/v10/channels/{cid}/messages", self._messages)
        app.router.add_get("/api/v10/channels/{cid}", self._channel)
        app.router.add_get("/api/v10/users/@me/guilds", self._guilds)
        app.router.add_get("/api/v10/users/@me", self._me)  # the log-in
        self._runner = web.AppRunner(app, access_log=None)
        await self._runner.setup()
        site = web.TCPSite(self._runner, "127.0.0.1", 0)
        await site.start()
        port = self._runner.addresses[0][1]
        return f"http://127.0.0.1:{port}/api/v10"

    async def stop(self) -> None:
        if self._runner is not None:
            await self._runner.cleanup()

    async def _messages(self, request: web.Request) -> web.Response:
        self.requests["GET /channels/{id}/messages"] += 1
        cid = int(request.match_info["cid"])
        ids = self.history.get(cid)
        if ids is None:
            return _json({"message": "Unknown Channel", "code": 10003}, 404)
        limit = int(request.query.get("limit", 50))
        end = bisect.bisect_left(ids, int(request.query["before"])) if "before" in request.query \
            else len(ids)
        page = ids[max(0, end - limit):end][::-1]  # newest first, as Discord pages
        return _json([_message(cid, mid) for mid in page])

    async def _channel(self, request: web.Request) -> web.Response:
        self.requests["GET /channels/{id}"] += 1
        return _json({"message": "Unknown Channel", "code": 10003}, 404)

    async def _me(self, request: web.Request) -> web.Response:
        return _json(user(1, "memorybot", bot=True))

    async def _guilds(self, request: web.Request) -> web.Response:
        self.requests["GET /users/@me/guilds"] += 1
        return _json([{"id": str(GUILD), "name": "Bench server", "icon": None, "owner": False,
                       "permissions": "0", "features": []}])


def _json(data: Any, status: int = 200) -> web.Response:
    return web.Response(body=json.dumps(data).encode(), status=status,
                        headers={"Content-Type": "application/json"})


def _message(cid: int, mid: int) -> dict[str, Any]:
    stamp = discord.utils.snowflake_time(mid).isoformat()
    return {"id": str(mid), "channel_id": str(cid), "guild_id": str(GUILD),
            "author": user(AUTHOR, "member"), "content": f"message {mid}", "timestamp": stamp,
            "edited_timestamp": None, "tts": False, "mention_everyone": False, "mentions": [],
            "mention_roles": [], "attachments": [], "embeds": [], "pinned": False, "type": 0,
            "flags": 0}


def _corpus(channels: int, messages: int) -> dict[int, list[int]]:
    """Message ids per channel, ascending, over the last 30 days."""
    now_ms = int(time.time() * 1000) - 60_000
    span_ms = 30 * 86_400_000
    per_channel: dict[int, list[int]] = {CHANNEL0 + c: [] for c in range(channels)}
    for i in range(messages):
        created = now_ms - span_ms + i * span_ms // messages
        per_channel[CHANNEL0 + i % channels].append(((created - DISCORD_EPOCH_MS) << 22) | i % 4096)
    return per_channel


def _records(per_channel: dict[int, list[int]]) -> list[MessageRecord]:
    return [
        MessageRecord(id=mid, guild_id=GUILD, channel_id=cid, author_id=AUTHOR,
                      created_at=(mid >> 22) + DISCORD_EPOCH_MS, content=f"message {mid}",
                      author_name="member", author_display_name="Member", guild_name="Bench server",
                      channel_name=f"channel-{cid - CHANNEL0}", channel_type="text")
        for cid, ids in per_channel.items() for mid in ids
    ]


def run_reconcile_bench(
    profile: Profile,
    *,
    channels: int = 100,
    messages: int = 100_000,
    deleted_share: float = 0.01,
    gone_channels: int = 0,
    windows: Sequence[int] = (100, 1000),
    progress: Callable[[str], None] = lambda _: None,
) -> dict[str, Any]:
    """Build the server once, reconcile a copy of it per window size; a JSON-ready dict.

    The last ``gone_channels`` channels were deleted while the bot was away: the
    gateway does not list them and Discord answers 404 for them.
    """
    per_channel = _corpus(channels, messages)
    rng = random.Random(0)
    every = [mid for ids in per_channel.values() for mid in ids]
    deleted = set(rng.sample(every, int(len(every) * deleted_share)))
    gone = set(list(per_channel)[channels - gone_channels:])
    on_discord = {cid: [m for m in ids if m not in deleted] for cid, ids in per_channel.items()
                  if cid not in gone}
    pause_s = profile.reconcile.pause_s
    result: dict[str, Any] = {
        "machine": machine_description(), "channels": channels, "messages": messages,
        "deleted_on_discord": len(deleted), "gone_channels": gone_channels, "pause_s": pause_s,
        "discord_global_limit_per_s": DISCORD_GLOBAL_LIMIT, "runs": [],
    }
    with tempfile.TemporaryDirectory(prefix="memory-reconcile-bench-") as tmp:
        base = Path(tmp) / "base.sqlite3"
        progress(f"storing and embedding {messages} messages")
        started = time.perf_counter()
        engine = MemoryEngine(base, profile, _RandomEmbedder(), load_reranker=False)
        store_in_chunks(engine.storage.messages, _records(per_channel))
        engine.embed_pending()
        engine.close()
        result["setup_s"] = round(time.perf_counter() - started, 1)
        for window in windows:
            progress(f"reconciling the newest {window} stored messages of each channel")
            copy = Path(tmp) / f"window-{window}.sqlite3"
            shutil.copy(base, copy)
            run = asyncio.run(_reconcile(copy, profile, window, per_channel, on_discord))
            requests = sum(run["requests"].values())
            run["rate_limited_s"] = round(max(requests / DISCORD_GLOBAL_LIMIT,
                                              requests * pause_s), 1)
            run["total_s"] = round(run["local_s"] + run["rate_limited_s"], 1)
            result["runs"].append(run)
    return result


async def _reconcile(db: Path, profile: Profile, window: int, per_channel: dict[int, list[int]],
                     on_discord: dict[int, list[int]]) -> dict[str, Any]:
    from cogs.memory import MemoryBot

    # the pacing is added by computation: the stand-in answers at once, so wall time is ours
    profile = replace(profile, reconcile=ReconcileConfig(recent_messages=window, pause_s=0.0))
    engine = MemoryEngine(db, profile, _RandomEmbedder(), load_reranker=False)
    stand_in = _StandIn(on_discord)
    original_base = discord.http.Route.BASE
    discord.http.Route.BASE = await stand_in.start()
    bot = MemoryBot(engine)
    try:
        state = bot._connection
        state.user = discord.ClientUser(state=state, data=cast(Any, user(1, "memorybot", bot=True)))
        bot.loop = asyncio.get_running_loop()
        payload = guild(GUILD, "Bench server", owner=1, members=[],
                        roles=[role(GUILD, "@everyone", READ, position=0)],
                        channels=[channel(cid, GUILD, f"channel-{cid - CHANNEL0}")
                                  for cid in on_discord])
        state._add_guild_from_data(cast(Any, payload))
        await bot.load_extension("cogs.memory")
        await bot.http.static_login("bench-token")
        listeners = cast(Any, bot.get_cog("MemoryListeners"))
        before = engine.storage.messages.count()
        started = time.perf_counter()
        done = await listeners.reconciler.at_start_up()
        local_s = time.perf_counter() - started
        await bot.unload_extension("cogs.memory")
        return {
            "recent_messages": window, "local_s": round(local_s, 2),
            "requests": dict(stand_in.requests), "messages_compared": done.messages_checked,
            "messages_forgotten": done.messages_forgotten,
            "channels_forgotten": done.channels_forgotten,
            "stored_after": engine.storage.messages.count(), "stored_before": before,
        }
    finally:
        await bot.http.close()
        await stand_in.stop()
        discord.http.Route.BASE = original_base
        engine.close()
