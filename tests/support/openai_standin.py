"""A real aiohttp server on 127.0.0.1 that answers like an OpenAI-compatible API,
including its failures: 401, 429 with Retry-After, 500, broken and malformed streams,
stalls.  The scenario is the first path segment: ``{url}/auth/v1/chat/completions``.

Only the error bodies and stream framing are imitated; the happy path is also tested
against a real llama-server (tests/test_llm_llama.py).
"""

from __future__ import annotations

import asyncio
import json
import threading
from typing import Any

from aiohttp import web

ANSWER = ["The raid ", "moved to 9pm ", "[1]."]


def _chunk(content: str | None = None, finish: str | None = None) -> bytes:
    delta = {} if content is None else {"content": content}
    event = {"id": "chatcmpl-x", "object": "chat.completion.chunk", "model": "standin",
             "choices": [{"index": 0, "delta": delta, "finish_reason": finish}]}
    return f"data: {json.dumps(event)}\n\n".encode()


def _completion(text: str) -> dict[str, Any]:
    return {"id": "chatcmpl-x", "object": "chat.completion", "model": "standin",
            "choices": [{"index": 0, "message": {"role": "assistant", "content": text},
                         "finish_reason": "stop"}],
            "usage": {"prompt_tokens": 10, "completion_tokens": 3, "total_tokens": 13}}


def _error(status: int, message: str, kind: str, **headers: str) -> web.Response:
    body = {"error": {"message": message, "type": kind, "param": None, "code": None}}
    return web.json_response(body, status=status, headers=headers)


class OpenAIStandIn:
    """Run with ``with OpenAIStandIn() as server:``; ``server.requests`` records each call."""

    def __init__(self) -> None:
        self.requests: list[dict[str, Any]] = []
        self.url = ""
        self._loop = asyncio.new_event_loop()
        self._thread = threading.Thread(target=self._loop.run_forever, daemon=True)
        self._runner: web.AppRunner | None = None
        self._counts: dict[str, int] = {}

    def __enter__(self) -> OpenAIStandIn:
        self._thread.start()
        asyncio.run_coroutine_threadsafe(self._start(), self._loop).result(10)
        return self

    def __exit__(self, *exc: object) -> None:
        self._loop.call_soon_threadsafe(self._closing.set)
        asyncio.run_coroutine_threadsafe(self._runner.cleanup(), self._loop).result(10)
        self._loop.call_soon_threadsafe(self._loop.stop)
        self._thread.join(10)

    def base_url(self, scenario: str) -> str:
        return f"{self.url}/{scenario}/v1"

    async def _start(self) -> None:
        self._closing = asyncio.Event()
        app = web.Application()
        app.router.add_post("/{scenario}/v1/chat/completions", self._handle)
        self._runner = web.AppRunner(app)
        await self._runner.setup()
        site = web.TCPSite(self._runner, "127.0.0.1", 0)
        await site.start()
        port = site._server.sockets[0].getsockname()[1]
        self.url = f"http://127.0.0.1:{port}"

    async def _handle(self, request: web.Request) -> web.StreamResponse:
        scenario = request.match_info["scenario"]
        body = await request.json()
        self.requests.append({"scenario": scenario, "headers": dict(request.headers), "json": body})
        count = self._counts[scenario] = self._counts.get(scenario, 0) + 1
        if scenario == "auth":
            return _error(401, "Incorrect API key provided: sk-wrong.", "invalid_request_error")
        if scenario == "ratelimit" and count == 1:
            return _error(429, "Rate limit reached for requests", "requests", **{"Retry-After": "1"})
        if scenario == "ratelimit-long":
            return _error(429, "Rate limit reached for requests", "requests",
                          **{"Retry-After": "120"})
        if scenario == "ratelimit-always":
            return _error(429, "Rate limit reached for requests", "requests", **{"Retry-After": "0"})
        if scenario == "ratelimit-bare":
            return _error(429, "Too many requests", "requests")
        if scenario == "server":
            return _error(500, "The server had an error while processing your request.",
                          "server_error")
        if scenario == "ollama-error":
            return web.json_response({"error": "model 'nope' not found"}, status=404)
        if scenario == "html-502":
            return web.Response(status=502, text="<html>Bad Gateway</html>",
                                content_type="text/html")
        if scenario == "stall":  # until the client gives up and the server closes
            await self._closing.wait()
        if scenario == "badjson":
            return web.Response(text="{not json", content_type="application/json")
        if not body.get("stream") or scenario == "json":
            return web.json_response(_completion("".join(ANSWER)))
        return await self._stream(request, scenario)

    async def _stream(self, request: web.Request, scenario: str) -> web.StreamResponse:
        response = web.StreamResponse(headers={"Content-Type": "text/event-stream"})
        await response.prepare(request)
        await response.write(b": keep-alive\n\n")
        if scenario == "malformed":
            await response.write(_chunk(ANSWER[0]))
            await response.write(b"data: {\"choices\": [{\"delta\": {\"content\": \"x\"\n\n")
            return response
        if scenario == "error-event":
            await response.write(_chunk(ANSWER[0]))
            await response.write(b'data: {"error": {"message": "context overflow", "code": 500}}\n\n')
            return response
        if scenario == "sse-variants":  # legal SSE that a naive line parser gets wrong
            first = _chunk(ANSWER[0]).decode().removeprefix("data: ").strip()
            head, tail = first.split(", ", 1)
            await response.write(f"event: message\nid: 1\ndata:{head},\ndata: {tail}\n\n".encode())
            for part in ANSWER[1:]:
                await response.write(_chunk(part).replace(b"\n\n", b"\r\n\r\n"))
            await response.write(b": comment\n\n" + _chunk(finish="stop") + b"data: [DONE]")
            return response
        if scenario == "slow-stream":
            try:
                while not self._closing.is_set():
                    await response.write(_chunk("tick "))
                    await asyncio.sleep(0.05)
            except ConnectionResetError:  # the client stopped reading
                pass
            return response
        for part in ANSWER:
            await response.write(_chunk(part))
        if scenario == "long":  # past Discord's 2000 characters: the reply comes in parts
            for _ in range(60):
                await response.write(_chunk(" and then the raid moved again, later that night"))
        if scenario == "cut":
            return response  # no finish_reason, no [DONE]
        await response.write(_chunk(finish="stop"))
        if scenario != "no-done":
            await response.write(b"data: [DONE]\n\n")
        return response
