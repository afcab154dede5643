"""An OpenAI-compatible chat client for grounded answers.

Works with anything that serves ``POST /v1/chat/completions``: llama.cpp
``llama-server``, vLLM, Ollama, OpenAI.  It is synchronous on purpose (the engine
runs in worker threads; the cog crosses into one), streams Server-Sent Events when
the profile says ``stream = true``, and turns every failure into a typed
:class:`memory.errors.ChatModelError` so the caller can fall back to the plain list
of hits.  One ``timeout_s`` bounds a whole answer: connecting, a 429 retry, and
every streamed chunk.

The prompt it is sent (the retrieved history quoted as untrusted data, citations as
``[n]``) is built by :func:`memory.context.build_messages`; this module only carries it.
"""

from __future__ import annotations

import email.utils
import json
import logging
import os
import re
import threading
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from typing import Any

import httpx

from memory.config import LLMConfig
from memory.errors import (
    ChatModelAuthError,
    ChatModelError,
    ChatModelRateLimited,
    ChatModelRequestError,
    ChatModelResponseError,
    ChatModelServerError,
    ChatModelTimeout,
    ChatModelUnavailable,
    ConfigError,
)
from memory.urls import refuse_url_credentials

log = logging.getLogger(__name__)

ChatMessages = list[dict[str, str]]

_THINK = re.compile(r"<think>.*?(</think>|$)", re.DOTALL)


def visible_text(text: str) -> str:
    """The answer without a reasoning model's ``<think>`` block (unclosed ones too)."""
    return _THINK.sub("", text).strip()


@dataclass(frozen=True)
class ChatAnswer:
    """A finished answer: its text, why it stopped, and the server's token usage."""

    text: str
    finish_reason: str | None = None
    model: str = ""
    usage: dict[str, int] = field(default_factory=dict)
    streamed: bool = False


class ChatClient:
    """Talks to one OpenAI-compatible ``/v1/chat/completions`` endpoint.

    Args:
        config: The profile's ``[llm]`` section.
        http: An ``httpx.Client`` to use (tests and connection reuse); one is made otherwise.
        extra_body: Server-specific request fields merged into every request, e.g.
            ``{"chat_template_kwargs": {"enable_thinking": False}}`` for Qwen3 on
            llama-server or vLLM, or a llama-server ``grammar``.

    Raises:
        ConfigError: ``[llm]`` is off, or its API key variable is unset.
    """

    def __init__(
        self,
        config: LLMConfig,
        *,
        http: httpx.Client | None = None,
        extra_body: dict[str, Any] | None = None,
    ) -> None:
        if not config.enabled:
            raise ConfigError("no chat model: add an [llm] table with base_url and model")
        refuse_url_credentials("llm.base_url", config.base_url)  # httpx logs request URLs
        self.config = config
        self.url = chat_completions_url(config.base_url)
        self._headers = {"Content-Type": "application/json"}
        if config.api_key_env:
            key = os.environ.get(config.api_key_env, "").strip()
            if not key:
                raise ConfigError(
                    f"llm.api_key_env names {config.api_key_env}, which is not set: "
                    "export it or remove api_key_env"
                )
            self._headers["Authorization"] = f"Bearer {key}"
        self._http = http or httpx.Client()
        self.extra_body = dict(extra_body or {})

    def close(self) -> None:
        """Close the HTTP connections."""
        self._http.close()

    def answer(
        self,
        messages: ChatMessages,
        on_delta: Callable[[str], None] | None = None,
        cancel: threading.Event | None = None,
    ) -> ChatAnswer:
        """Ask for an answer; stream it through ``on_delta`` if the profile streams.

        Args:
            messages: From :func:`memory.context.build_messages`.
            on_delta: Called with each piece of text as it arrives (streaming only).
            cancel: Set it to stop waiting (between chunks, or during a 429 wait).

        Returns:
            The full answer.

        Raises:
            ChatModelError: The subclass names the cause (auth, rate limit, server,
                bad request, malformed response, timeout, unreachable).
        """
        if not self.config.stream:
            return self.complete(messages)
        parts: list[str] = []
        finish: dict[str, Any] = {}
        for delta in self.stream(messages, cancel=cancel, meta=finish):
            parts.append(delta)
            if on_delta is not None:
                on_delta(delta)
        return ChatAnswer("".join(parts), finish.get("finish_reason"), finish.get("model", ""),
                          finish.get("usage", {}), streamed=True)

    def complete(self, messages: ChatMessages) -> ChatAnswer:
        """One non-streaming request.

        Raises:
            ChatModelError: As for :meth:`answer`.
        """
        deadline = time.monotonic() + self.config.timeout_s
        response = self._send(self._payload(messages, stream=False), deadline, None)
        try:
            body = self._read(response, deadline)
        finally:
            response.close()
        return _parse_completion(body)

    def stream(
        self,
        messages: ChatMessages,
        *,
        cancel: threading.Event | None = None,
        meta: dict[str, Any] | None = None,
    ) -> Iterator[str]:
        """Yield the answer's text as the server streams it.

        A server that ignores ``stream`` and sends one JSON body yields it whole.
        ``meta`` (if given) receives ``finish_reason``, ``model`` and ``usage``.

        Raises:
            ChatModelError: As for :meth:`answer`; raised mid-iteration for a
                stream that breaks off, carries an error event or is malformed.
        """
        deadline = time.monotonic() + self.config.timeout_s
        meta = {} if meta is None else meta
        response = self._send(self._payload(messages, stream=True), deadline, cancel)
        try:
            if response.headers.get("content-type", "").startswith("application/json"):
                answer = _parse_completion(self._read(response, deadline))
                meta.update(finish_reason=answer.finish_reason, model=answer.model,
                            usage=answer.usage)
                if answer.text:
                    yield answer.text
                return
            yield from _sse_deltas(_lines(response, deadline, cancel), meta)
        finally:
            response.close()

    # -- transport ------------------------------------------------------------------------

    def _payload(self, messages: ChatMessages, *, stream: bool) -> dict[str, Any]:
        return {
            "model": self.config.model,
            "messages": messages,
            "max_tokens": self.config.max_tokens,
            "temperature": self.config.temperature,
            **self.extra_body,
            "stream": stream,
        }

    def _send(
        self, payload: dict[str, Any], deadline: float, cancel: threading.Event | None
    ) -> httpx.Response:
        """POST, honouring one 429 ``Retry-After`` that fits before the deadline."""
        for attempt in (1, 2):
            response = self._post(payload, deadline)
            if response.status_code < 400:
                return response
            body = self._read(response, deadline)
            response.close()
            wait = retry_after(response.headers)
            if response.status_code == 429 and attempt == 1 and wait is not None and (
                time.monotonic() + wait < deadline
            ):
                log.info("chat model rate-limited; retrying in %.1f s as asked", wait)
                if cancel is not None and cancel.wait(wait):
                    raise ChatModelTimeout("the answer was cancelled")
                if cancel is None:
                    time.sleep(wait)
                continue
            raise http_error(response.status_code, body, wait)
        raise AssertionError("unreachable")

    def _post(self, payload: dict[str, Any], deadline: float) -> httpx.Response:
        remaining = deadline - time.monotonic()
        if remaining <= 0:
            raise ChatModelTimeout(f"no answer within {self.config.timeout_s:g} s")
        headers = dict(self._headers)
        if payload["stream"]:
            headers["Accept"] = "text/event-stream"
        request = self._http.build_request(
            "POST", self.url, json=payload, headers=headers, timeout=httpx.Timeout(remaining)
        )
        try:
            return self._http.send(request, stream=True)
        except httpx.TimeoutException as exc:
            raise ChatModelTimeout(
                f"no answer from {self.url} within {self.config.timeout_s:g} s"
            ) from exc
        except httpx.TransportError as exc:
            raise ChatModelUnavailable(
                f"cannot reach the chat model at {self.url} ({type(exc).__name__}: {exc}); "
                "is the server running and llm.base_url right?"
            ) from exc

    def _read(self, response: httpx.Response, deadline: float) -> bytes:
        try:
            body = response.read()
        except httpx.TimeoutException as exc:
            raise ChatModelTimeout(f"no answer within {self.config.timeout_s:g} s") from exc
        except httpx.TransportError as exc:
            raise ChatModelResponseError(f"the response broke off: {exc}") from exc
        if time.monotonic() > deadline:
            raise ChatModelTimeout(f"no answer within {self.config.timeout_s:g} s")
        return body


def chat_completions_url(base_url: str) -> str:
    """The completions endpoint for a base URL given with or without ``/v1``."""
    base = base_url.rstrip("/")
    if base.endswith("/chat/completions"):
        return base
    if not re.search(r"/v\d+$", base):
        base += "/v1"
    return base + "/chat/completions"


def retry_after(headers: httpx.Headers) -> float | None:
    """Seconds a 429/503 asks to wait: ``retry-after-ms``, ``Retry-After`` seconds or date."""
    millis = headers.get("retry-after-ms")
    if millis:
        try:
            return max(0.0, float(millis) / 1000)
        except ValueError:
            pass
    value = headers.get("retry-after")
    if not value:
        return None
    try:
        return max(0.0, float(value))
    except ValueError:
        pass
    try:
        when = email.utils.parsedate_to_datetime(value)
    except (TypeError, ValueError):
        return None
    return max(0.0, when.timestamp() - time.time())


def error_message(body: bytes) -> str:
    """The server's own words from an error body (OpenAI, llama-server, Ollama shapes)."""
    try:
        data = json.loads(body)
    except (ValueError, UnicodeDecodeError):
        return body[:300].decode("utf-8", "replace").strip() or "(empty body)"
    error = data.get("error", data) if isinstance(data, dict) else data
    if isinstance(error, dict):
        return str(error.get("message") or error.get("detail") or error)[:300]
    return str(error)[:300]


def http_error(status: int, body: bytes, wait: float | None = None) -> ChatModelError:
    """The typed error for an HTTP error status, carrying the server's message."""
    said = error_message(body)
    if status in (401, 403):
        return ChatModelAuthError(
            f"the chat model refused the API key ({status}: {said}); check llm.api_key_env",
            status,
        )
    if status == 429:
        hint = f"; it asked to wait {wait:.0f} s" if wait is not None else ""
        return ChatModelRateLimited(f"the chat model is rate-limited ({said}){hint}", 429, wait)
    if status >= 500:
        return ChatModelServerError(f"the chat model server failed ({status}: {said})", status)
    return ChatModelRequestError(f"the chat model rejected the request ({status}: {said})", status)


def _lines(
    response: httpx.Response, deadline: float, cancel: threading.Event | None
) -> Iterator[str]:
    try:
        for line in response.iter_lines():
            if cancel is not None and cancel.is_set():
                raise ChatModelTimeout("the answer was cancelled")
            if time.monotonic() > deadline:
                raise ChatModelTimeout("the streamed answer did not finish in time")
            yield line
    except httpx.TimeoutException as exc:
        raise ChatModelTimeout("the streamed answer stalled past the timeout") from exc
    except httpx.TransportError as exc:
        raise ChatModelResponseError(f"the stream broke off: {exc}") from exc


def _sse_deltas(lines: Iterator[str], meta: dict[str, Any]) -> Iterator[str]:
    """Text deltas from Server-Sent Events lines; raises on a malformed or cut stream."""
    data: list[str] = []
    for line in lines:
        if line.startswith("data:"):
            data.append(line[5:].removeprefix(" "))
            continue
        if line.strip() or not data:
            continue  # comments (": ping"), event:/id: fields, blank keep-alives
        payload, data = "\n".join(data), []
        if payload.strip() == "[DONE]":
            return
        yield from _chunk_text(payload, meta)
    if data:  # the last event had no blank line after it
        payload = "\n".join(data)
        if payload.strip() == "[DONE]":
            return
        yield from _chunk_text(payload, meta)
    if meta.get("finish_reason") is None:
        raise ChatModelResponseError("the stream ended before the answer finished")


def _chunk_text(payload: str, meta: dict[str, Any]) -> Iterator[str]:
    try:
        chunk = json.loads(payload)
    except ValueError:
        raise ChatModelResponseError(f"malformed stream event: {payload[:120]!r}") from None
    if not isinstance(chunk, dict):
        raise ChatModelResponseError(f"malformed stream event: {payload[:120]!r}")
    if "error" in chunk:
        raise ChatModelServerError(f"the chat model failed mid-answer: {error_message(payload.encode())}")
    meta["model"] = chunk.get("model", meta.get("model", ""))
    if isinstance(chunk.get("usage"), dict):
        meta["usage"] = chunk["usage"]
    for choice in chunk.get("choices") or []:
        if not isinstance(choice, dict):
            raise ChatModelResponseError(f"malformed stream choice: {payload[:120]!r}")
        if choice.get("finish_reason"):
            meta["finish_reason"] = choice["finish_reason"]
        content = (choice.get("delta") or {}).get("content")
        if isinstance(content, str) and content:
            yield content


def _parse_completion(body: bytes) -> ChatAnswer:
    try:
        data = json.loads(body)
        choice = data["choices"][0]
        text = choice["message"]["content"]
    except (ValueError, KeyError, IndexError, TypeError):
        raise ChatModelResponseError(
            f"not an OpenAI chat completion: {body[:200].decode('utf-8', 'replace')!r}"
        ) from None
    if not isinstance(text, str):
        raise ChatModelResponseError("the chat completion has no text content")
    return ChatAnswer(text, choice.get("finish_reason"), data.get("model", ""),
                      data.get("usage") or {})
