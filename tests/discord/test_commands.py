"""What the bot publishes to Discord, and the checks each command makes when it runs.

The published payloads (names, descriptions, options, choices, default permissions,
guild-only) are compared with ``tests/fixtures/published-commands.json``: a change
there reaches every server at the next ``/memory-owner sync``, so it is made on
purpose.  After an intended change, rewrite the file with
``UPDATE_PUBLISHED_COMMANDS=1 pytest tests/discord/test_commands.py`` and review the diff.
"""

from __future__ import annotations

import json
import os
from pathlib import Path
from typing import Any

import discord
import pytest

from memory.config import Profile
from memory.engine import MemoryEngine
from tests.support.builders import HashEmbedder
from tests.support.discord_harness import READ, Harness, channel, guild, member, role

PUBLISHED = Path(__file__).resolve().parents[1] / "fixtures" / "published-commands.json"
G, GENERAL = 910, 911
ADMIN, OWNER = 1011, 1012


def server() -> dict:
    return guild(G, "Test Guild", owner=ADMIN, roles=[role(G, "@everyone", READ, position=0)],
                 members=[member(ADMIN, "admin"), member(OWNER, "owner")],
                 channels=[channel(GENERAL, G, "general")])


@pytest.fixture
async def harness(tmp_path):
    engine = MemoryEngine(tmp_path / "bot.sqlite3", Profile(name="test"), HashEmbedder(),
                          load_reranker=False)
    h = Harness(engine, [server()], owner_ids=[OWNER])
    await h.start()
    yield h
    await h.close()
    engine.close()


def published(tree: discord.app_commands.CommandTree) -> list[dict[str, Any]]:
    """The payloads a global sync sends, in a stable order."""
    payloads = [command.to_dict(tree) for command in tree.get_commands()]
    return sorted(payloads, key=lambda p: (p["type"], p["name"]))


async def test_the_published_commands_are_the_ones_on_record(harness):
    payloads = published(harness.bot.tree)
    if os.environ.get("UPDATE_PUBLISHED_COMMANDS"):
        PUBLISHED.write_text(json.dumps(payloads, indent=1, sort_keys=True) + "\n", encoding="utf-8")
    assert payloads == json.loads(PUBLISHED.read_text(encoding="utf-8"))


async def test_unloading_the_extension_removes_every_command_and_cog(harness):
    await harness.close()
    assert harness.bot.tree.get_commands() == [] and harness.bot.cogs == {}
    await harness.start()  # the fixture unloads it again


ADMIN_COMMANDS = [
    ("memory-admin backfill", {}),
    ("memory-admin reconcile", {}),
    ("memory-admin retention", {"days": 30}),
    ("memory-admin purge-channel", {"channel": GENERAL}),
    ("memory-admin autoresponse", {"mode": "off"}),
    ("memory-admin channels show", {}),
    ("memory-admin channels mode", {"mode": "include"}),
    ("memory-admin channels add", {"channel": GENERAL}),
    ("memory-admin channels remove", {"channel": GENERAL}),
]


@pytest.mark.parametrize(("command", "options"), ADMIN_COMMANDS, ids=[c for c, _ in ADMIN_COMMANDS])
async def test_every_admin_command_checks_manage_server_when_it_runs(harness, command, options):
    """Hidden by default_permissions, which a server admin can re-grant: the check still holds."""
    h = harness
    values = {k: h.guild.get_channel(v) if k == "channel" else v for k, v in options.items()}
    await h.slash(command, invoker=member(ADMIN, "admin"), where=GENERAL,
                  permissions=discord.Permissions(send_messages=True), **values)
    reply = h.adapter.callbacks[-1]["data"]
    assert reply["flags"] == 64 and "Manage Server" in reply["content"]
    settings = h.engine.storage.guilds.settings(G)
    assert settings.channel_mode == "all" and settings.autoresponse != "off"


@pytest.mark.parametrize(("command", "options"), [
    ("memory-owner profile", {"name": "cpu-fast"}),
    ("memory-owner sync", {}),
])
async def test_owner_commands_are_refused_to_a_server_administrator(harness, command, options):
    h = harness
    await h.slash(command, invoker=member(ADMIN, "admin"), where=GENERAL,
                  permissions=discord.Permissions.all(), **options)
    reply = h.adapter.callbacks[-1]["data"]
    assert reply["flags"] == 64 and "Only the bot's owner" in reply["content"]
    assert h.engine.storage.meta.active_profile is None
