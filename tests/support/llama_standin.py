"""A real HTTP server that speaks llama-server's reranking formats, for tests.

:class:`FakeLlamaServer` runs an ``aiohttp.web`` app on 127.0.0.1 (a free port) in a
background thread with its own event loop.  It answers ``GET /health``,
``POST /completion`` (``completion_probabilities[0].top_logprobs`` and ``content``),
``POST /v1/chat/completions`` (``logprobs.content[0].top_logprobs`` and
``message.content``), ``POST /v1/rerank`` (P(yes) per document, as llama.cpp gives
for a Qwen3 rank GGUF) and ``POST /tokenize`` / ``/detokenize`` in llama-server's
formats, with scores that are deterministic functions of the request:
:func:`relevance` is the share of query words found in the document.  Like the real
server it rejects a prompt longer than its context (``n_ctx`` tokens; here one token
per UTF-8 byte) with HTTP 400.  ``mode`` switches it into a failure mode, ``delay``
makes scoring requests slow, and every scoring request is recorded.

The real server is what the backend must be right against: tests/rerank/test_llama_server_real.py
checks the same backend against a real ``llama-server``.

Usage::

    with FakeLlamaServer() as server:
        server.mode = "loading"
        ... LlamaServerBackend(LlamaServerConfig(url=server.url)) ...
"""

from __future__ import annotations

import asyncio
import math
import re
import threading
from collections.abc import Callable
from dataclasses import dataclass
from types import TracebackType
from typing import Any

from aiohttp import web

MODEL = "Qwen3-Reranker-8B-Q8_0.gguf"
# How each mode changes the answers (all but "ok" are failure or edge modes).
MODES = {
    "ok": "normal answers",
    "loading": "503 'Loading model' on every endpoint, /health included",
    "error": "500 server_error on scoring endpoints",
    "bad_request": "400 invalid_request_error on scoring endpoints",
    "malformed": "200 with a truncated JSON body",
    "missing_fields": "200 with valid JSON lacking choices/results",
    "drop": "close the connection without answering, every time",
    "drop_once": "close the connection without answering once, then 'ok'",
    "odd_tokens": "answer tokens as ' Yes'/'YES'/'NO'/' no', split across duplicates",
    "missing_no": "top_logprobs without any 'no' token",
    "no_logprobs": "no logprobs at all, only the generated text yes/no",
    "bad_text": "no logprobs, and the generated text is 'maybe'",
    "echo_think": "no logprobs, and the text echoes an empty think block before the answer",
    "poison": "HTTP 500 for every request with a document containing POISON, normal otherwise",
    "rerank_short": "/v1/rerank leaves out the result of the last-ranked document",
}
# The model's mass on the two answers; the rest is spread over filler tokens.
ANSWER_MASS = 0.98
FILLERS = ["maybe", " The", "\n", "yes.", "No,", "<think>", " I", "Y", "n", "ok"] + [
    f"tok{i}" for i in range(10)
]
_WORDS = re.compile(r"\w+")
_USER_TURN = re.compile(r"<Query>: (?P<query>.*?)\n<Document>: (?P<doc>.*)\Z", re.DOTALL)
_PROMPT = re.compile(
    r"<Query>: (?P<query>.*?)\n<Document>: (?P<doc>.*)<\|im_end\|>\n<\|im_start\|>assistant\n"
    r"<think>\n\n</think>\n\n\Z",
    re.DOTALL,
)
THINK = "<think>\n\n</think>\n\n"


def relevance(query: str, document: str) -> float:
    """Return the fake model's P(yes): smoothed share of query words in the document.

    ``(hits + 0.5) / (words + 1)``, strictly inside (0, 1); 0.5 for an empty query.
    """
    words = set(_WORDS.findall(query.lower()))
    hits = len(words & set(_WORDS.findall(document.lower())))
    return (hits + 0.5) / (len(words) + 1)


@dataclass(frozen=True)
class RecordedRequest:
    """One scoring request as received: its path and decoded JSON body."""

    path: str
    body: Any


def _answer_tokens(p: float, mode: str) -> list[tuple[str, float]]:
    """Return (token, probability) pairs for the answers in ``mode``."""
    yes, no = ANSWER_MASS * p, ANSWER_MASS * (1.0 - p)
    if mode == "odd_tokens":
        return [(" Yes", 0.7 * yes), ("YES", 0.3 * yes), ("NO", 0.6 * no), (" no", 0.4 * no)]
    if mode == "missing_no":
        return [("yes", yes)]
    return [("yes", yes), ("no", no)]


def top_logprobs(p: float, mode: str, n: int) -> list[dict[str, Any]]:
    """Return llama-server's ``top_logprobs`` list for yes-probability ``p``."""
    answers = _answer_tokens(p, mode)
    fillers = FILLERS[: max(0, 20 - len(answers))]
    filler_p = (1.0 - ANSWER_MASS) / len(fillers)
    pairs = sorted(answers + [(t, filler_p) for t in fillers], key=lambda tp: -tp[1])
    return [
        {"id": 1000 + i, "token": t, "bytes": list(t.encode()), "logprob": math.log(prob)}
        for i, (t, prob) in enumerate(pairs[:n])
    ]


def _request_text(body: Any) -> str:
    """All the text a scoring request asks the model to read, for length checks."""
    if "prompt" in body:
        prompt = body["prompt"]
        return prompt if isinstance(prompt, str) else "x" * len(prompt)
    if "messages" in body:
        return "".join(m["content"] for m in body["messages"])
    return max((body["query"] + d for d in body["documents"]), key=len, default="")


def _documents(body: Any) -> list[str]:
    """The document texts of a scoring request (one, or all of a rerank batch)."""
    if "documents" in body:
        return [str(d) for d in body["documents"]]
    return [_request_text(body)]


def _error_body(code: int, message: str, kind: str) -> web.Response:
    return web.json_response({"error": {"code": code, "message": message, "type": kind}}, status=code)


class FakeLlamaServer:
    """llama-server stand-in on 127.0.0.1; see the module docstring.

    Attributes:
        url: ``http://127.0.0.1:PORT`` once started.
        delay: Seconds every scoring request sleeps before answering.
        n_ctx: Longest prompt accepted, in tokens (one token per UTF-8 byte).
        requests: Scoring requests received, in arrival order.
        health_checks: How many ``GET /health`` requests arrived.
        tokenize_calls: How many ``POST /tokenize`` requests arrived.
        in_flight: Scoring requests being handled right now.
        max_in_flight: The most scoring requests ever handled at once.
    """

    def __init__(self, *, delay: float = 0.0, n_ctx: int = 4096) -> None:
        self.url = ""
        self.delay = delay
        self.n_ctx = n_ctx
        self.requests: list[RecordedRequest] = []
        self.health_checks = 0
        self.tokenize_calls = 0
        self.in_flight = 0
        self.max_in_flight = 0
        self._mode = "ok"
        self._loop: asyncio.AbstractEventLoop | None = None
        self._thread: threading.Thread | None = None
        self._runner: web.AppRunner | None = None

    @property
    def mode(self) -> str:
        """The current behaviour, one of :data:`MODES`."""
        return self._mode

    @mode.setter
    def mode(self, value: str) -> None:
        if value not in MODES:
            raise ValueError(f"unknown mode {value!r} (known: {', '.join(MODES)})")
        self._mode = value

    def bodies(self, path: str) -> list[Any]:
        """Return the JSON bodies of the scoring requests received on ``path``."""
        return [r.body for r in self.requests if r.path == path]

    # -- lifecycle

    def start(self) -> FakeLlamaServer:
        """Start the server thread and bind a free port; returns ``self``."""
        loop = asyncio.new_event_loop()
        thread = threading.Thread(target=loop.run_forever, name="fake-llama-server", daemon=True)
        thread.start()
        self._loop, self._thread = loop, thread
        self.url = asyncio.run_coroutine_threadsafe(self._serve(), loop).result(10)
        return self

    def stop(self) -> None:
        """Stop serving and end the thread; safe to call twice."""
        loop, thread, self._loop = self._loop, self._thread, None
        if loop is None or thread is None:
            return
        if self._runner is not None:
            asyncio.run_coroutine_threadsafe(self._runner.cleanup(), loop).result(10)
        loop.call_soon_threadsafe(loop.stop)
        thread.join(10)
        loop.close()

    def __enter__(self) -> FakeLlamaServer:
        return self.start()

    def __exit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        self.stop()

    async def _serve(self) -> str:
        app = web.Application()
        app.router.add_get("/health", self._health)
        app.router.add_post("/completion", self._completion)
        app.router.add_post("/v1/chat/completions", self._chat)
        app.router.add_post("/tokenize", self._tokenize)
        app.router.add_post("/detokenize", self._detokenize)
        app.router.add_post("/v1/rerank", self._rerank)
        # handler_cancellation: a client that gives up cancels the (slow) handler.
        self._runner = web.AppRunner(
            app, access_log=None, handler_cancellation=True, shutdown_timeout=0.5
        )
        await self._runner.setup()
        await web.TCPSite(self._runner, "127.0.0.1", 0).start()
        host, port = self._runner.addresses[0][:2]
        return f"http://{host}:{port}"

    # -- handlers

    async def _health(self, request: web.Request) -> web.Response:
        self.health_checks += 1
        if self._mode == "loading":
            return _error_body(503, "Loading model", "unavailable_error")
        return web.json_response({"status": "ok"})

    async def _tokenize(self, request: web.Request) -> web.Response:
        body = await request.json()
        self.tokenize_calls += 1
        return web.json_response({"tokens": list(body["content"].encode("utf-8"))})

    async def _detokenize(self, request: web.Request) -> web.Response:
        body = await request.json()
        return web.json_response({"content": bytes(body["tokens"]).decode("utf-8", "replace")})

    async def _completion(self, request: web.Request) -> web.StreamResponse:
        return await self._scoring(request, self._completion_answer)

    async def _chat(self, request: web.Request) -> web.StreamResponse:
        return await self._scoring(request, self._chat_answer)

    async def _rerank(self, request: web.Request) -> web.StreamResponse:
        return await self._scoring(request, self._rerank_answer)

    async def _scoring(
        self, request: web.Request, answer: Callable[[Any], Any]
    ) -> web.StreamResponse:
        """Record, count in-flight, sleep ``delay``, then fail or answer per mode."""
        body = await request.json()
        self.requests.append(RecordedRequest(request.path, body))
        self.in_flight += 1
        self.max_in_flight = max(self.max_in_flight, self.in_flight)
        try:
            if self.delay:
                await asyncio.sleep(self.delay)
            failure = self._failure(request) or self._refusal(body)
            return failure if failure is not None else web.json_response(answer(body))
        finally:
            self.in_flight -= 1

    def _failure(self, request: web.Request) -> web.StreamResponse | None:
        mode = self._mode
        if mode in ("drop", "drop_once"):
            if mode == "drop_once":
                self._mode = "ok"
            assert request.transport is not None
            request.transport.close()  # no status line, no headers: a dropped connection
            return web.Response()  # never reaches the (closed) socket
        if mode == "loading":
            return _error_body(503, "Loading model", "unavailable_error")
        if mode == "error":
            return _error_body(500, "fake internal error", "server_error")
        if mode == "bad_request":
            return _error_body(400, "fake bad request", "invalid_request_error")
        if mode == "malformed":
            return web.Response(text='{"choices": [{"index": 0, "mess', content_type="application/json")
        return None

    def _refusal(self, body: Any) -> web.Response | None:
        """The real server's answers to a prompt it will not run: too long, or POISON."""
        text = _request_text(body)
        if len(text.encode("utf-8")) > self.n_ctx:
            return _error_body(
                400, f"request exceeds the available context size ({self.n_ctx} tokens)",
                "exceed_context_size_error",
            )
        if self._mode == "poison" and any("POISON" in t for t in _documents(body)):
            return _error_body(500, "fake failure on this document", "server_error")
        return None

    def _generated(self, p: float) -> str | None:
        """The generated text, or None when the answer carries logprobs."""
        answer = "yes" if p >= 0.5 else "no"
        if self._mode == "bad_text":
            return "maybe"
        if self._mode == "echo_think":
            return THINK + answer
        return answer if self._mode == "no_logprobs" else None

    def _completion_answer(self, body: Any) -> dict[str, Any]:
        if self._mode == "missing_fields":
            return {"index": 0, "model": MODEL}
        prompt = body["prompt"]
        if isinstance(prompt, list):  # token ids: one per byte here
            prompt = bytes(prompt).decode("utf-8", "replace")
        match = _PROMPT.search(prompt)
        assert match is not None, "the prompt does not follow the Qwen3-Reranker layout"
        p = relevance(match["query"], match["doc"])
        text = self._generated(p)
        answer: dict[str, Any] = {"index": 0, "content": text or ("yes" if p >= 0.5 else "no"),
                                  "model": MODEL, "stop": True, "tokens_predicted": 1}
        if text is None:
            top = top_logprobs(p, self._mode, int(body.get("n_probs", 0)))
            answer["completion_probabilities"] = [{**top[0], "top_logprobs": top}]
        return answer

    def _chat_answer(self, body: Any) -> dict[str, Any]:
        if self._mode == "missing_fields":
            return {"object": "chat.completion", "model": MODEL}
        messages = body["messages"]
        assert [m["role"] for m in messages] == ["system", "user"], "no assistant prefill"
        match = _USER_TURN.search(messages[1]["content"])
        assert match is not None, "the user turn does not follow the Qwen3-Reranker layout"
        p = relevance(match["query"], match["doc"])
        text = self._generated(p)
        choice: dict[str, Any] = {
            "finish_reason": "length",
            "index": 0,
            "message": {"role": "assistant", "content": text or ("yes" if p >= 0.5 else "no")},
        }
        if text is None:
            top = top_logprobs(p, self._mode, int(body.get("top_logprobs", 20)))
            choice["logprobs"] = {"content": [{**top[0], "top_logprobs": top}]}
        return {
            "choices": [choice],
            "created": 1_700_000_000,
            "model": MODEL,
            "system_fingerprint": "b6000-fake",
            "object": "chat.completion",
            "usage": {"completion_tokens": 1, "prompt_tokens": 100, "total_tokens": 101},
            "id": "chatcmpl-fake",
        }

    def _rerank_answer(self, body: Any) -> dict[str, Any]:
        if self._mode == "missing_fields":
            return {"object": "list", "model": MODEL}
        docs = body["documents"]
        results = [
            {"index": i, "relevance_score": relevance(body["query"], doc)}
            for i, doc in enumerate(docs)
        ]
        results.sort(key=lambda r: -r["relevance_score"])  # llama-server sorts by score
        results = results[: int(body.get("top_n", len(docs)))]
        if self._mode == "rerank_short":
            results = results[:-1]
        tokens = 10 * len(docs)
        return {
            "model": MODEL,
            "object": "list",
            "usage": {"prompt_tokens": tokens, "total_tokens": tokens},
            "results": results,
        }

