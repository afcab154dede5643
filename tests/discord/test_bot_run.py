"""Starting the bot: a bad token, a missing intent or no network end in one line and exit 2.

discord.py really logs in and opens its gateway connection, against the stand-in
for Discord's API (tests/support/discord_standin.py) running on its own thread.
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
from cogs.memory.shards import Shards
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
    assert context.params == {"sync": False, "dev_guild": 123, "owner": (5, 6),
                              "shard_count": None, "shard_ids": None}
    context = run_command.make_context("run", ["--shard-count", "4", "--shards", "3, 1"])
    assert context.params["shard_count"] == 4 and context.params["shard_ids"] == (3, 1)


def test_an_unsharded_start_identifies_without_a_shard(fake_api, engine, capsys):
    assert run_bot(engine, "good-token") == 2  # the stand-in refuses the intent after IDENTIFY
    assert [identify.get("shard") for identify in fake_api.identified] == [None]


@pytest.mark.parametrize(("code", "says"), [
    (4014, "error: Discord refused the Message Content intent"),
    (4004, "error: Discord rejected the token"),
])
def test_a_process_of_a_sharded_bot_identifies_its_shards_only(fake_api, engine, capsys, code,
                                                               says):
    """``run --shard-count 4 --shards 2``: one connection, for shard 2 of 4; failures are
    the same one line as unsharded."""
    fake_api.gateway_close_code = code
    assert run_bot(engine, "good-token", shards=Shards(4, (2,)), retry_delays=(0.01,)) == 2
    assert [identify["shard"] for identify in fake_api.identified] == [[2, 4]]
    err = capsys.readouterr().err.strip()
    assert err.startswith(says) and "\n" not in err


@pytest.mark.parametrize(("options", "says"), [
    (["--shard-count", "4"], "give --shard-count and --shards together"),
    (["--shards", "0,1"], "give --shard-count and --shards together"),
    (["--shard-count", "2", "--shards", "0,2"], "--shards 2: with --shard-count 2 the ids are 0 to 1"),
    (["--shard-count", "4", "--shards", "1,1"], "--shards names shard 1 twice"),
    (["--shard-count", "0", "--shards", "0"], "--shard-count must be 1 or more"),
    (["--shard-count", "4", "--shards", "one"], "comma-separated shard ids"),
    (["--shard-count", "4", "--shards", "-1"], "comma-separated shard ids"),
    (["--shard-count", "4", "--shards", "0,,1"], "comma-separated shard ids"),
    (["--shard-count", "4", "--shards", "\u00b2"], "comma-separated shard ids"),  # a digit to isdigit(), not to int()
])
def test_shard_options_that_do_not_fit_are_one_line_and_exit_2(tmp_path, capsys, monkeypatch,
                                                               options, says):
    monkeypatch.delenv("DISCORD_TOKEN", raising=False)  # refused before the token is needed
    code = bot.main(["--db", str(tmp_path / "bot.sqlite3"), "run", *options])
    err = capsys.readouterr().err.strip()
    assert code == 2 and err.startswith("error: ") and "\n" not in err
    assert says in err
    assert not (tmp_path / "bot.sqlite3").exists(), "refused before anything opened"


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
