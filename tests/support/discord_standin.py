"""A stand-in for the few Discord API routes the bot calls, on a real 127.0.0.1 port.

Discord's servers cannot exist in a test, so this aiohttp app answers what
discord.py asks of them: ``/users/@me`` (login), channel message history with
``before``/``after``/``limit`` as Discord pages it (newest first), archived thread
listings, ``/gateway/bot`` plus a gateway websocket that says HELLO and then
closes with a chosen code, one channel or thread by id (404 *Unknown Channel* for
one it does not hold, 403 *Missing Access* for a forbidden one), the bot's
guild list, and edits of the bot's messages (recorded; 404 *Unknown Message* for one
deleted).  It can answer a route with 429 (and the headers
discord.py's rate-limit handling reads) or 500 a given number of times.
"""

from __future__ import annotations

import asyncio
import json
from collections import defaultdict
from typing import Any

from aiohttp import WSCloseCode, WSMsgType, web


def _json(data: Any, status: int = 200, headers: dict[str, str] | None = None) -> web.Response:
    # exactly "application/json": discord.py reads any other content type as text
    return web.Response(body=json.dumps(data).encode(), status=status,
                        headers={"Content-Type": "application/json", **(headers or {})})


class FakeDiscord:
    """Serve channel histories; count and shape requests for tests."""

    def __init__(self, token: str = "good-token") -> None:
        self.token = token
        self.history: dict[int, list[dict[str, Any]]] = defaultdict(list)
        self.archived: dict[int, list[dict[str, Any]]] = defaultdict(list)
        self.channels: dict[int, dict[str, Any]] = {}  # GET /channels/{id}; others are 404
        self.forbidden: set[int] = set()  # channels answering 403 Missing Access
        self.gone: set[int] = set()  # channels whose history answers 404 Unknown Channel
        self.guilds: list[dict[str, Any]] = []  # GET /users/@me/guilds
        self.requests: list[tuple[str, dict[str, str]]] = []
        self.listings: list[str] = []  # the paths of archived-thread listings asked for
        self.rate_limit_next = 0  # answer the next N history requests with 429
        self.stall_after: int | None = None  # history requests served before the rest hang
        self.gateway_close_code: int | None = 4014
        self.identified: list[dict[str, Any]] = []  # the IDENTIFY payloads the gateway received
        self.edits: list[tuple[int, int, dict[str, Any]]] = []  # (channel, message, payload)
        self.deleted: set[int] = set()  # messages whose edit answers 404 Unknown Message
        self.fail_edits = 0  # answer the next N edits 400 Thread is archived (not retried)
        self._released = asyncio.Event()
        self.runner: web.AppRunner | None = None
        self.port = 0

    async def start(self) -> str:
        app = web.Application()
        app.router.add_get("/api/v10/users/@me", self._me)
        app.router.add_get("/api/v10/channels/{cid}/messages", self._messages)
        app.router.add_get("/api/v10/channels/{cid}/messages/{mid}", self._one_message)
        app.router.add_patch("/api/v10/channels/{cid}/messages/{mid}", self._edit_message)
        app.router.add_get("/api/v10/channels/{cid}", self._channel)
        app.router.add_get("/api/v10/users/@me/guilds", self._guilds)
        app.router.add_get("/api/v10/channels/{cid}/threads/archived/public", self._archived)
        app.router.add_get("/api/v10/channels/{cid}/users/@me/threads/archived/private",
                           self._no_threads)
        app.router.add_get("/api/v10/channels/{cid}/threads/archived/private", self._no_threads)
        app.router.add_get("/api/v10/oauth2/applications/@me", self._application)
        app.router.add_get("/api/v10/gateway/bot", self._gateway)
        app.router.add_get("/api/v10/gateway", self._gateway)
        app.router.add_get("/ws", self._websocket)
        self._routes(app)
        self.runner = web.AppRunner(app)
        await self.runner.setup()
        site = web.TCPSite(self.runner, "127.0.0.1", 0)
        await site.start()
        self.port = site._server.sockets[0].getsockname()[1]
        return f"http://127.0.0.1:{self.port}/api/v10"

    def _routes(self, app: web.Application) -> None:
        """Where a subclass adds routes of its own."""

    def release(self) -> None:
        """Let the stalled history requests go on (each answers 404)."""
        self._released.set()

    async def stop(self) -> None:
        self._released.set()
        if self.runner is not None:
            await self.runner.cleanup()

    # -- routes --------------------------------------------------------------------------

    def _authorised(self, request: web.Request) -> bool:
        return request.headers.get("Authorization") == f"Bot {self.token}"

    async def _me(self, request: web.Request) -> web.Response:
        if not self._authorised(request):
            return _json({"message": "401: Unauthorized", "code": 0}, status=401)
        return _json({"id": "1000", "username": "memorybot", "discriminator": "0",
                                  "global_name": None, "avatar": None, "bot": True})

    async def _application(self, request: web.Request) -> web.Response:
        owner = {"id": "1003", "username": "owner", "discriminator": "0", "global_name": None,
                 "avatar": None}
        return _json({"id": "1000", "name": "memorybot", "icon": None, "description": "",
                      "rpc_origins": [], "bot_public": True, "bot_require_code_grant": False,
                      "owner": owner, "team": None, "verify_key": "0" * 64, "flags": 0,
                      "summary": ""})

    async def _messages(self, request: web.Request) -> web.Response:
        self.requests.append((request.path, dict(request.query)))
        refusal = self._refusal(int(request.match_info["cid"]))
        if refusal is not None:
            return refusal
        if self.rate_limit_next > 0:
            self.rate_limit_next -= 1
            return _json(
                {"message": "You are being rate limited.", "retry_after": 0.05, "global": False},
                status=429, headers={"Via": "1.1 google", "Retry-After": "1",
                                     "X-RateLimit-Limit": "5", "X-RateLimit-Remaining": "0",
                                     "X-RateLimit-Reset-After": "0.05",
                                     "X-RateLimit-Bucket": "messages"})
        served = sum(1 for path, _ in self.requests if path.endswith("/messages"))
        if self.stall_after is not None and served > self.stall_after:
            await self._released.wait()  # as good as a crash: the test stops the bot here
            return _json({"message": "gone"}, status=404)
        messages = sorted(self.history[int(request.match_info["cid"])],
                          key=lambda m: int(m["id"]), reverse=True)
        limit = int(request.query.get("limit", 50))
        if "before" in request.query:
            messages = [m for m in messages if int(m["id"]) < int(request.query["before"])][:limit]
        elif "after" in request.query:  # the oldest `limit` after it, newest first
            after = [m for m in messages if int(m["id"]) > int(request.query["after"])]
            messages = after[-limit:]
        else:
            messages = messages[:limit]
        return _json(messages)

    async def _one_message(self, request: web.Request) -> web.Response:
        self.requests.append((request.path, dict(request.query)))
        cid = int(request.match_info["cid"])
        refusal = self._refusal(cid)
        if refusal is not None:
            return refusal
        for message in self.history[cid]:
            if message["id"] == request.match_info["mid"]:
                return _json(message)
        return _json({"message": "Unknown Message", "code": 10008}, status=404)

    async def _edit_message(self, request: web.Request) -> web.Response:
        cid, mid = int(request.match_info["cid"]), int(request.match_info["mid"])
        payload = await request.json()
        self.edits.append((cid, mid, payload))
        refusal = self._refusal(cid)
        if refusal is not None:
            return refusal
        if self.fail_edits > 0:
            self.fail_edits -= 1
            return _json({"message": "Thread is archived", "code": 50083}, status=400)
        if mid in self.deleted:
            return _json({"message": "Unknown Message", "code": 10008}, status=404)
        return _json({"id": str(mid), "channel_id": str(cid), "content": payload.get("content") or "",
                      "author": {"id": "1000", "username": "memorybot", "discriminator": "0",
                                 "global_name": None, "avatar": None, "bot": True},
                      "attachments": [], "embeds": payload.get("embeds") or [], "mentions": [],
                      "mention_roles": [], "pinned": False, "mention_everyone": False,
                      "tts": False, "type": 0, "flags": 0,
                      "timestamp": "2026-01-01T00:00:00+00:00",
                      "edited_timestamp": "2026-01-01T00:00:01+00:00"})

    def _refusal(self, cid: int) -> web.Response | None:
        if cid in self.forbidden:
            return _json({"message": "Missing Access", "code": 50001}, status=403)
        if cid in self.gone:
            return _json({"message": "Unknown Channel", "code": 10003}, status=404)
        return None

    async def _channel(self, request: web.Request) -> web.Response:
        self.requests.append((request.path, dict(request.query)))
        cid = int(request.match_info["cid"])
        refusal = self._refusal(cid)
        if refusal is not None:
            return refusal
        if cid not in self.channels:
            return _json({"message": "Unknown Channel", "code": 10003}, status=404)
        return _json(self.channels[cid])

    async def _guilds(self, request: web.Request) -> web.Response:
        self.requests.append((request.path, dict(request.query)))
        after = int(request.query.get("after", 0))
        limit = int(request.query.get("limit", 200))
        listed = sorted((g for g in self.guilds if int(g["id"]) > after), key=lambda g: int(g["id"]))
        return _json(listed[:limit])

    async def _archived(self, request: web.Request) -> web.Response:
        self.listings.append(request.path)
        threads = self.archived[int(request.match_info["cid"])]
        return _json({"threads": threads, "members": [], "has_more": False})

    async def _no_threads(self, request: web.Request) -> web.Response:
        self.listings.append(request.path)
        return _json({"threads": [], "members": [], "has_more": False})

    async def _gateway(self, request: web.Request) -> web.Response:
        return _json({"url": f"ws://127.0.0.1:{self.port}/ws", "shards": 1,
                                  "session_start_limit": {"total": 1000, "remaining": 999,
                                                          "reset_after": 0,
                                                          "max_concurrency": 1}})

    async def _websocket(self, request: web.Request) -> web.WebSocketResponse:
        ws = web.WebSocketResponse()
        await ws.prepare(request)
        await ws.send_str(json.dumps({"op": 10, "d": {"heartbeat_interval": 45000}}))
        try:
            while True:  # a heartbeat first, then IDENTIFY
                message = await asyncio.wait_for(ws.receive(), 5)
                if message.type != WSMsgType.TEXT:
                    break
                frame = json.loads(message.data)
                if frame.get("op") == 2:
                    self.identified.append(frame["d"])
                    break
        except TimeoutError:
            pass
        await ws.close(code=self.gateway_close_code or WSCloseCode.GOING_AWAY)
        return ws
