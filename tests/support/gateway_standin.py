"""A stand-in for Discord's gateway and the REST routes a running bot uses, on 127.0.0.1.

:class:`FakeDiscord` answers the REST API and closes every gateway connection
after IDENTIFY; :class:`FakeGateway` keeps them open and speaks enough of the
gateway protocol for real bot processes to run against it, each with its own
shards: HELLO, heartbeats answered with HEARTBEAT_ACK, IDENTIFY with a shard,
READY listing the guilds of that shard, one GUILD_CREATE per guild, and then
whatever the test dispatches (MESSAGE_CREATE, MESSAGE_DELETE, GUILD_DELETE,
INTERACTION_CREATE), each on the connection of the guild's shard, in order.  A
RESUME is refused (INVALID_SESSION), so a reconnecting shard identifies afresh.

Interaction replies come back over REST (the callback, follow-ups, edits of the
original response) and are kept by interaction token (:meth:`FakeGateway.replies`).
The server runs on an event loop of its own thread (:func:`serve_in_thread`);
the test calls :meth:`FakeGateway.dispatch` and the other ``*_threadsafe``-style
helpers from its own thread.
"""

from __future__ import annotations

import asyncio
import itertools
import json
import threading
from collections import defaultdict
from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any

from aiohttp import WSMsgType, web

from benchmarks.gateway import member, user
from cogs.memory.shards import shard_of
from tests.support.discord_standin import FakeDiscord, _json

BOT_ID = APP_ID = 1000
HELLO, HEARTBEAT, IDENTIFY, RESUME, INVALID_SESSION, HEARTBEAT_ACK = 10, 1, 2, 6, 9, 11


class FakeGateway(FakeDiscord):
    """Discord for several bot processes: a gateway per shard and the REST API.

    Args:
        shard_count: How many shards the bot has (what each IDENTIFY must say).
        guilds: GUILD_CREATE payloads of the guilds the bot is in (builders in
            :mod:`benchmarks.gateway`); the bot's own member is added to each.
    """

    def __init__(self, shard_count: int, guilds: list[dict[str, Any]]) -> None:
        super().__init__()
        self.gateway_close_code = None
        self.shard_count = shard_count
        self.guild_payloads: dict[int, dict[str, Any]] = {}
        for payload in guilds:
            self.add_guild(payload)
        self._shards: dict[int, web.WebSocketResponse] = {}  # shard id -> its open connection
        self._sequence: dict[int, itertools.count] = {}
        self._sending: dict[int, asyncio.Lock] = defaultdict(asyncio.Lock)
        self._replies: dict[str, list[str]] = defaultdict(list)
        self._message_ids = itertools.count(1 << 40)
        self._later: set[asyncio.Task] = set()
        self.loop: asyncio.AbstractEventLoop | None = None

    def add_guild(self, payload: dict[str, Any]) -> None:
        """The bot is in this guild (it is in the guild list and its shard's READY)."""
        bot = member(BOT_ID, "memorybot") | {"user": user(BOT_ID, "memorybot", bot=True),
                                             "roles": []}
        payload = payload | {"members": [*payload["members"], bot], "unavailable": False,
                             "joined_at": "2025-01-01T00:00:00+00:00", "large": False}
        self.guild_payloads[int(payload["id"])] = payload
        self._list_guilds()

    def _list_guilds(self) -> None:
        self.guilds = [{"id": g["id"], "name": g["name"], "icon": None, "owner": False,
                        "permissions": "0", "features": []}
                       for _, g in sorted(self.guild_payloads.items())]

    # -- the server ------------------------------------------------------------------------

    async def start(self) -> str:
        """Serve on a free port; returns the REST API's base URL."""
        self.loop = asyncio.get_running_loop()
        return await super().start()

    def _routes(self, app: web.Application) -> None:
        app.router.add_post("/api/v10/interactions/{iid}/{token}/callback", self._callback)
        app.router.add_post("/api/v10/webhooks/{app}/{token}", self._followup)
        app.router.add_patch("/api/v10/webhooks/{app}/{token}/messages/{mid}", self._edit)

    async def _websocket(self, request: web.Request) -> web.WebSocketResponse:
        ws = web.WebSocketResponse()
        await ws.prepare(request)
        await ws.send_str(json.dumps({"op": HELLO, "d": {"heartbeat_interval": 41250}}))
        shard: int | None = None
        try:
            async for message in ws:
                if message.type != WSMsgType.TEXT:
                    break
                frame = json.loads(message.data)
                if frame["op"] == HEARTBEAT:
                    # a moment later, as over a network: discord.py times the beat after
                    # sending it, and an ACK faster than that reads as a 41 s "lag" warning
                    acking = asyncio.create_task(self._ack(ws))
                    self._later.add(acking)
                    acking.add_done_callback(self._later.discard)
                elif frame["op"] == IDENTIFY:
                    self.identified.append(frame["d"])
                    shard = frame["d"].get("shard", [0, 1])[0]
                    await self._connect(shard, ws)
                elif frame["op"] == RESUME:
                    await ws.send_str(json.dumps({"op": INVALID_SESSION, "d": False}))
        finally:
            if shard is not None and self._shards.get(shard) is ws:
                del self._shards[shard]
        return ws

    async def _ack(self, ws: web.WebSocketResponse) -> None:
        await asyncio.sleep(0.05)
        if not ws.closed:
            await ws.send_str(json.dumps({"op": HEARTBEAT_ACK}))

    async def _connect(self, shard: int, ws: web.WebSocketResponse) -> None:
        """READY for ``shard``, then its guilds, one GUILD_CREATE each."""
        self._shards[shard] = ws
        self._sequence[shard] = itertools.count(1)
        mine = [g for gid, g in sorted(self.guild_payloads.items())
                if shard_of(gid, self.shard_count) == shard]
        ready = {"v": 10, "user": user(BOT_ID, "memorybot", bot=True),
                 "guilds": [{"id": g["id"], "unavailable": True} for g in mine],
                 "session_id": f"session-{shard}", "shard": [shard, self.shard_count],
                 "resume_gateway_url": f"ws://127.0.0.1:{self.port}/ws",
                 "application": {"id": str(APP_ID), "flags": 0}}
        await self._send(shard, "READY", ready)
        for payload in mine:
            await self._send(shard, "GUILD_CREATE", payload)

    async def _send(self, shard: int, event: str, data: dict[str, Any]) -> None:
        async with self._sending[shard]:  # one frame at a time, in the order asked
            ws = self._shards[shard]
            await ws.send_str(json.dumps({"op": 0, "t": event, "s": next(self._sequence[shard]),
                                          "d": data}))

    # -- interaction replies ---------------------------------------------------------------

    async def _callback(self, request: web.Request) -> web.Response:
        body = await request.json()
        self._replies[request.match_info["token"]].append(
            (body.get("data") or {}).get("content") or "")
        interaction = {"id": request.match_info["iid"], "type": 2,
                       "response_message_loading": body.get("type") == 5}
        return _json({"interaction": interaction})

    async def _followup(self, request: web.Request) -> web.Response:
        body = await request.json()
        self._replies[request.match_info["token"]].append(body.get("content") or "")
        # discord.py reads the message back for every follow-up, whatever `wait` says
        return _json(self._message(body, request.match_info["app"]))

    async def _edit(self, request: web.Request) -> web.Response:
        body = await request.json()
        self._replies[request.match_info["token"]].append(body.get("content") or "")
        return _json(self._message(body, request.match_info["app"]))

    def _message(self, body: dict[str, Any], app: str) -> dict[str, Any]:
        return {"id": str(next(self._message_ids)), "channel_id": "1",
                "content": body.get("content") or "", "author": user(BOT_ID, "memorybot", bot=True),
                "attachments": [], "embeds": body.get("embeds", []), "mentions": [],
                "mention_roles": [], "pinned": False, "mention_everyone": False, "tts": False,
                "type": 0, "flags": 0, "timestamp": "2026-01-01T00:00:00+00:00",
                "edited_timestamp": None, "webhook_id": app}

    # -- what the test calls, from its own thread --------------------------------------------

    def _call(self, coroutine: Any) -> Any:
        assert self.loop is not None, "serve it first (serve_in_thread)"
        return asyncio.run_coroutine_threadsafe(coroutine, self.loop).result(30)

    def connected(self) -> set[int]:
        """The shards that have an open, identified connection."""
        return set(self._call(self._connected()))

    async def _connected(self) -> list[int]:
        return list(self._shards)

    def dispatch(self, guild_id: int, event: str, data: dict[str, Any]) -> None:
        """Send a dispatch on the connection of ``guild_id``'s shard (after those sent before)."""
        self._call(self._send(shard_of(guild_id, self.shard_count), event, data))

    def remove_guild(self, guild_id: int) -> None:
        """The bot was removed from a guild: GUILD_DELETE, and it leaves the guild list."""
        self.guild_payloads.pop(guild_id, None)
        self._list_guilds()
        self.dispatch(guild_id, "GUILD_DELETE", {"id": str(guild_id)})

    def replies(self, token: str) -> list[str]:
        """What the bot answered an interaction (callback content, follow-ups, edits)."""
        return list(self._call(self._replies_of(token)))

    async def _replies_of(self, token: str) -> list[str]:
        return list(self._replies.get(token, ()))


@contextmanager
def serve_in_thread(fake: FakeDiscord) -> Iterator[str]:
    """Run ``fake`` on an event loop of its own thread; yields the REST base URL."""
    loop = asyncio.new_event_loop()
    started = threading.Event()
    base: dict[str, str] = {}

    def run() -> None:
        asyncio.set_event_loop(loop)
        base["url"] = loop.run_until_complete(fake.start())
        started.set()
        loop.run_forever()

    thread = threading.Thread(target=run, daemon=True, name="fake-discord")
    thread.start()
    if not started.wait(10):
        raise RuntimeError("the Discord stand-in did not start")
    try:
        yield base["url"]
    finally:
        asyncio.run_coroutine_threadsafe(fake.stop(), loop).result(10)
        loop.call_soon_threadsafe(loop.stop)
        thread.join(10)
