"""Starting the bot: a bad token, a missing intent or no network end in one line and exit 2.

discord.py really logs in and opens its gateway connection, against the stand-in
for Discord's API (tests/discord/fake_discord.py) running on its own thread.
"""

from __future__ import annotations

import asyncio
import os
import socket
import subprocess
import sys
import threading
from pathlib import Path

import discord
import pytest
import yarl

import bot
from cli.run import run_bot, run_command
from cogs.memory import MemoryBot
from memory.config import Profile
from memory.engine import MemoryEngine
from tests.support.builders import HashEmbedder
from tests.support.discord_standin import FakeDiscord


@pytest.fixture
def fake_api(monkeypatch):
    fake = FakeDiscord()
    loop = asyncio.new_event_loop()
    started = threading.Event()
    holder = {}

    def serve() -> None:
        asyncio.set_event_loop(loop)
        holder["base"] = loop.run_until_complete(fake.start())
        started.set()
        loop.run_forever()

    thread = threading.Thread(target=serve, daemon=True)
    thread.start()
    started.wait(10)
    monkeypatch.setattr(discord.http.Route, "BASE", holder["base"])
    monkeypatch.setattr(discord.gateway.DiscordWebSocket, "DEFAULT_GATEWAY",
                        yarl.URL(f"ws://127.0.0.1:{fake.port}/ws"))
    yield fake
    asyncio.run_coroutine_threadsafe(fake.stop(), loop).result(10)
    loop.call_soon_threadsafe(loop.stop)
    thread.join(10)


@pytest.fixture
def engine(tmp_path):
    return MemoryEngine(tmp_path / "bot.sqlite3", Profile(name="test"), HashEmbedder(),
                        load_reranker=False)


def test_a_rejected_token_is_one_line_and_exit_2(fake_api, engine, capsys):
    assert run_bot(engine, "wrong-token") == 2
    err = capsys.readouterr().err.strip()
    assert err.startswith("error: Discord rejected the token") and "\n" not in err


def test_a_missing_privileged_intent_is_one_line_and_exit_2(fake_api, engine, capsys):
    fake_api.gateway_close_code = 4014
    assert run_bot(engine, "good-token") == 2
    err = capsys.readouterr().err.strip()
    assert "Message Content intent" in err and "\n" not in err


def test_no_route_to_discord_is_one_line_and_exit_2(engine, capsys, monkeypatch):
    with socket.socket() as s:  # a port nothing listens on
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    monkeypatch.setattr(discord.http.Route, "BASE", f"http://127.0.0.1:{port}/api/v10")
    assert run_bot(engine, "good-token", retry_delays=(0.01,)) == 2
    err = capsys.readouterr().err.strip()
    assert err.startswith("error: cannot reach Discord") and "\n" not in err


def test_the_bot_registers_no_prefix_commands_and_syncs_only_when_asked(engine):
    memory_bot = MemoryBot(engine)
    assert memory_bot.sync is None and memory_bot.help_command is None
    context = run_command.make_context(
        "run", ["--dev-guild", "123", "--owner", "5", "--owner", "6"])
    assert context.params == {"sync": False, "dev_guild": 123, "owner": (5, 6)}


@pytest.mark.parametrize(("given", "expected"), [(None, "PASSIVE"), ("ACTIVE", "ACTIVE")])
def test_torch_threads_sleep_when_idle_unless_told_otherwise(
    given: str | None, expected: str
) -> None:
    """The wait policy must be in the environment before torch (and OpenMP) is imported."""
    script = (
        "import os, sys\n"
        "import bot\n"
        "assert 'torch' not in sys.modules\n"
        "try:\n"
        "    bot.main(['--help'])\n"
        "except SystemExit:\n"
        "    pass\n"
        "import torch\n"
        "print(os.environ.get('OMP_WAIT_POLICY'))\n"
    )
    env = {k: v for k, v in os.environ.items() if k != "OMP_WAIT_POLICY"}
    if given is not None:
        env["OMP_WAIT_POLICY"] = given
    result = subprocess.run([sys.executable, "-c", script], env=env, capture_output=True,
                            text=True, cwd=Path(bot.__file__).parent, timeout=120)
    assert result.returncode == 0, result.stderr
    assert result.stdout.strip().splitlines()[-1] == expected
