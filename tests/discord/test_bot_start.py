"""Start-up failures: passing ones are tried again with back-off, every one ends in one line.

discord.py really logs in against a stand-in for Discord's API on 127.0.0.1
(tests/support/discord_standin.py) whose login route answers a chosen list of statuses first.
Reaching the gateway is visible as the stand-in's close code 4014 (the Message
Content intent refused), which comes only after a successful login.
"""

from __future__ import annotations

import asyncio
import logging
import socket
import threading
import time
from collections.abc import Iterator

import discord
import pytest
import yarl
from aiohttp import web

from cli.run import run_bot
from memory.config import Profile
from memory.engine import MemoryEngine
from tests.support.builders import HashEmbedder
from tests.support.discord_standin import FakeDiscord, _json


class FlakyDiscord(FakeDiscord):
    """Answers the first logins with the given statuses, then as Discord would."""

    def __init__(self, statuses: list[int]) -> None:
        super().__init__()
        self.statuses = list(statuses)
        self.logins: list[float] = []

    async def _me(self, request: web.Request) -> web.Response:
        self.logins.append(time.monotonic())
        if self.statuses:
            status = self.statuses.pop(0)
            return _json({"message": f"{status}: upstream trouble", "code": 0}, status=status)
        return await super()._me(request)


@pytest.fixture
def serve(monkeypatch) -> Iterator:
    """Start a FlakyDiscord on its own thread and point discord.py at it."""
    running: list[tuple[FakeDiscord, asyncio.AbstractEventLoop, threading.Thread]] = []

    def start(fake: FakeDiscord) -> FakeDiscord:
        loop = asyncio.new_event_loop()
        started = threading.Event()
        base = {}

        def run() -> None:
            asyncio.set_event_loop(loop)
            base["url"] = loop.run_until_complete(fake.start())
            started.set()
            loop.run_forever()

        thread = threading.Thread(target=run, daemon=True)
        thread.start()
        assert started.wait(10)
        monkeypatch.setattr(discord.http.Route, "BASE", base["url"])
        monkeypatch.setattr(discord.gateway.DiscordWebSocket, "DEFAULT_GATEWAY",
                            yarl.URL(f"ws://127.0.0.1:{fake.port}/ws"))
        running.append((fake, loop, thread))
        return fake

    yield start
    for fake, loop, thread in running:
        asyncio.run_coroutine_threadsafe(fake.stop(), loop).result(10)
        loop.call_soon_threadsafe(loop.stop)
        thread.join(10)


@pytest.fixture
def engine(tmp_path):
    return MemoryEngine(tmp_path / "bot.sqlite3", Profile(name="test"), HashEmbedder(),
                        load_reranker=False)


def one_error_line(capsys: pytest.CaptureFixture) -> str:
    err = capsys.readouterr().err.strip()
    assert err.startswith("error: ") and "\n" not in err, err
    return err


@pytest.mark.parametrize(("statuses", "retried"), [
    ([503], 1),
    ([503, 503, 503], 3),
    ([502, 503], 1),  # discord.py itself tries a 502 again a second later; then our back-off
])
def test_discord_failing_at_login_is_tried_again_with_back_off(serve, engine, capsys, caplog,
                                                              statuses, retried):
    fake = serve(FlakyDiscord(statuses))
    with caplog.at_level(logging.WARNING, logger="bot"):
        assert run_bot(engine, "good-token", retry_delays=(0.2, 0.3, 0.4)) == 2
    assert "Message Content intent" in one_error_line(capsys)  # logged in, reached the gateway
    assert len(fake.logins) == len(statuses) + 1
    said = [r.getMessage() for r in caplog.records if r.name == "bot"]
    assert len(said) == retried
    assert all("Discord answered 503 Service Unavailable" in line for line in said)
    assert "trying again in 0.2 s (try 2 of 4; 0.9 s of waiting left before giving up)" in said[0]


def test_discord_failing_every_time_gives_up_after_the_back_off(serve, engine, capsys, caplog):
    fake = serve(FlakyDiscord([503] * 100))
    delays = (0.2, 0.4)
    with caplog.at_level(logging.WARNING, logger="bot"):
        assert run_bot(engine, "good-token", retry_delays=delays) == 2
    err = one_error_line(capsys)
    assert err.startswith("error: Discord's API is failing (Discord answered 503")
    assert len(fake.logins) == 3
    gaps = [b - a for a, b in zip(fake.logins, fake.logins[1:])]
    assert gaps[0] >= 0.2 and gaps[1] >= 0.4  # backed off as long as it said
    said = [r.getMessage() for r in caplog.records if r.name == "bot"]
    assert said == [
        "starting failed (Discord answered 503 Service Unavailable); trying again in 0.2 s "
        "(try 2 of 3; 0.6 s of waiting left before giving up)",
        "starting failed (Discord answered 503 Service Unavailable); trying again in 0.4 s "
        "(try 3 of 3; 0.4 s of waiting left before giving up)"]


def test_a_rejected_token_is_not_tried_again(serve, engine, capsys):
    fake = serve(FlakyDiscord([401]))
    assert run_bot(engine, "good-token", retry_delays=(0.2, 0.2)) == 2
    assert one_error_line(capsys).startswith("error: Discord rejected the token")
    assert len(fake.logins) == 1


def test_a_refused_request_is_one_line(serve, engine, capsys):
    """A 4xx that is not about the token (here 403) is not retried and names the status."""
    fake = serve(FlakyDiscord([403]))
    assert run_bot(engine, "good-token", retry_delays=(0.2,)) == 2
    assert one_error_line(capsys).startswith("error: Discord refused a start-up request (403")
    assert len(fake.logins) == 1


def test_a_network_error_then_discord_is_tried_again(serve, engine, capsys, monkeypatch, caplog):
    """Nothing listens at first; Discord's stand-in comes up during the back-off."""
    fake = FlakyDiscord([])
    ready = threading.Event()

    def late_start() -> None:
        time.sleep(0.3)
        serve(fake)
        ready.set()

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    monkeypatch.setattr(discord.http.Route, "BASE", f"http://127.0.0.1:{port}/api/v10")
    threading.Thread(target=late_start, daemon=True).start()
    with caplog.at_level(logging.WARNING, logger="bot"):
        assert run_bot(engine, "good-token", retry_delays=(1.0, 1.0)) == 2
    assert ready.is_set() and len(fake.logins) == 1
    assert "Message Content intent" in one_error_line(capsys)
    assert "Cannot connect to host" in caplog.records[0].getMessage()


@pytest.mark.parametrize(("code", "says"), [
    (4004, "error: Discord rejected the token"),
    (4013, "error: Discord closed the gateway connection (code 4013)"),
])
def test_the_gateway_refusing_the_bot_is_one_line(serve, engine, capsys, code, says):
    fake = serve(FlakyDiscord([]))
    fake.gateway_close_code = code
    assert run_bot(engine, "good-token", retry_delays=(0.2,)) == 2
    assert one_error_line(capsys).startswith(says)
    assert len(fake.logins) == 1


def test_a_failure_after_login_is_one_line(serve, engine, capsys):
    """Publishing commands (``run --dev-guild``) to a guild Discord does not know: a 404."""
    fake = serve(FlakyDiscord([]))
    assert run_bot(engine, "good-token", sync=123, retry_delays=(0.2,)) == 2
    assert one_error_line(capsys).startswith("error: Discord refused a start-up request (404")
    assert len(fake.logins) == 1
