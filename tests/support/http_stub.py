"""A real HTTP server on 127.0.0.1 whose answers a test scripts, for remote rerankers.

:class:`StubServer` runs :class:`http.server.ThreadingHTTPServer` in a background
thread; every POST is recorded (path, headers, JSON body) and answered by the
test's ``respond`` function, which returns ``(status, body, headers)`` and may sleep
to be slow.  ``stop()`` kills it mid-test (connections are refused afterwards).
"""

from __future__ import annotations

import json
import threading
from collections.abc import Callable
from dataclasses import dataclass, field
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Any

Answer = tuple[int, Any, dict[str, str]]
Respond = Callable[["Request"], Answer]


@dataclass
class Request:
    """One request the server received."""

    path: str
    headers: dict[str, str]
    body: Any


@dataclass
class StubServer:
    """A scripted HTTP server; use as a context manager."""

    respond: Respond
    requests: list[Request] = field(default_factory=list)

    def __enter__(self) -> StubServer:
        stub = self

        class Handler(BaseHTTPRequestHandler):
            def do_POST(self) -> None:
                raw = self.rfile.read(int(self.headers.get("Content-Length") or 0))
                request = Request(self.path, {k.lower(): v for k, v in self.headers.items()},
                                  json.loads(raw or b"null"))
                stub.requests.append(request)
                status, body, headers = stub.respond(request)
                data = body if isinstance(body, bytes) else json.dumps(body).encode()
                try:
                    self.send_response(status)
                    self.send_header("Content-Type", "application/json")
                    self.send_header("Content-Length", str(len(data)))
                    for key, value in headers.items():
                        self.send_header(key, value)
                    self.end_headers()
                    self.wfile.write(data)
                except (BrokenPipeError, ConnectionResetError):
                    pass  # the client gave up first (a timeout test)

            def log_message(self, *args: Any) -> None:
                pass

        self._server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self._server.daemon_threads = True
        self._thread = threading.Thread(target=self._server.serve_forever, daemon=True)
        self._thread.start()
        return self

    @property
    def url(self) -> str:
        """The server's root URL."""
        host, port = self._server.server_address[:2]
        return f"http://{host}:{port}"

    def stop(self) -> None:
        """Stop serving and close the socket: later connections are refused."""
        self._server.shutdown()
        self._server.server_close()

    def __exit__(self, *exc: object) -> None:
        try:
            self.stop()
        except OSError:
            pass
