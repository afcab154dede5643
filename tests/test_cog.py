"""The memory cog with real discord.py objects.

Guilds, channels, members and messages are built from gateway payloads through the
client's connection state; slash commands run from real interaction payloads through
the bot's command tree; responses are captured at the webhook adapter, which is
where discord.py would otherwise talk to Discord's servers.
"""

from __future__ import annotations

import asyncio
from datetime import datetime, timezone
from typing import Any

import discord
import pytest
from discord.webhook.async_ import AsyncWebhookAdapter, async_context

from bot import MemoryBot
from cogs.memory import MemoryCog, record_from_message
from memory.config import Profile
from memory.engine import MemoryEngine
from tests.conftest import HashEmbedder

GUILD_ID, CHANNEL_ID, THREAD_ID = 900, 901, 902
BOT_ID, ALICE_ID, BOB_ID = 1000, 1001, 1002
APP_ID = 1000
_ids = iter(range(1_300_000_000_000_000_000, 1_400_000_000_000_000_000, 1 << 22))


def user(uid: int, name: str, bot: bool = False) -> dict[str, Any]:
    return {"id": str(uid), "username": name, "global_name": name.title(),
            "discriminator": "0", "avatar": None, "bot": bot}


def member(uid: int, name: str, nick: str | None = None) -> dict[str, Any]:
    return {"user": user(uid, name), "nick": nick, "roles": [], "joined_at": "2025-01-01T00:00:00+00:00",
            "deaf": False, "mute": False, "flags": 0, "permissions": "8"}


def guild_payload() -> dict[str, Any]:
    everyone = {"id": str(GUILD_ID), "name": "@everyone", "permissions": "8", "position": 0,
                "color": 0, "hoist": False, "managed": False, "mentionable": False}
    return {
        "id": str(GUILD_ID), "name": "Test Guild", "owner_id": str(ALICE_ID), "roles": [everyone],
        "emojis": [], "stickers": [], "features": [], "member_count": 3,
        "members": [member(ALICE_ID, "alice", "Ali"), member(BOB_ID, "bob")],
        "channels": [
            {"id": str(CHANNEL_ID), "type": 0, "name": "general", "position": 0,
             "guild_id": str(GUILD_ID), "permission_overwrites": []},
        ],
        "threads": [
            {"id": str(THREAD_ID), "type": 11, "name": "a thread", "parent_id": str(CHANNEL_ID),
             "guild_id": str(GUILD_ID), "owner_id": str(ALICE_ID), "message_count": 1,
             "member_count": 2, "total_message_sent": 1,
             "thread_metadata": {"archived": False, "auto_archive_duration": 1440,
                                 "archive_timestamp": "2026-01-01T00:00:00+00:00", "locked": False}},
        ],
    }


def message_payload(content: str, author: int = ALICE_ID, channel: int = CHANNEL_ID,
                    **extra: Any) -> dict[str, Any]:
    mid = next(_ids)
    name = {ALICE_ID: "alice", BOB_ID: "bob", BOT_ID: "memorybot"}[author]
    return {
        "id": str(mid), "channel_id": str(channel), "guild_id": str(GUILD_ID),
        "author": user(author, name, bot=author == BOT_ID),
        "member": {"nick": "Ali" if author == ALICE_ID else None, "roles": [], "joined_at": "2025-01-01T00:00:00+00:00", "deaf": False,
                   "mute": False, "flags": 0},
        "content": content, "timestamp": discord.utils.snowflake_time(mid).isoformat(),
        "edited_timestamp": None, "tts": False, "mention_everyone": False, "mentions": [],
        "mention_roles": [], "attachments": [], "embeds": [], "pinned": False, "type": 0,
        "flags": 0, **extra,
    }


class CaptureAdapter(AsyncWebhookAdapter):
    """Records interaction callbacks and follow-ups instead of sending them."""

    def __init__(self) -> None:
        super().__init__()
        self.callbacks: list[dict[str, Any]] = []
        self.followups: list[dict[str, Any]] = []

    async def create_interaction_response(self, interaction_id, token, *, session,
                                          proxy=None, proxy_auth=None, params):
        self.callbacks.append(params.payload)
        return {"interaction": {"id": str(interaction_id), "type": 2,
                                "response_message_loading": True}}

    async def execute_webhook(self, webhook_id, token, *, session, payload=None,
                              multipart=None, files=None, wait=False, **kwargs):
        self.followups.append(payload)
        if not wait:
            return None
        return message_payload(payload.get("content") or "", author=BOT_ID) | {
            "embeds": payload.get("embeds", []), "webhook_id": str(webhook_id),
        }


class Harness:
    """A MemoryBot with its connection state populated from payloads."""

    def __init__(self, engine: MemoryEngine) -> None:
        self.engine = engine
        self.bot = MemoryBot(engine, sync_commands=False)
        state = self.bot._connection
        state.user = discord.ClientUser(state=state, data=user(BOT_ID, "memorybot", bot=True))
        state.application_id = APP_ID
        self.state = state
        self.guild = state._add_guild_from_data(guild_payload())
        self.adapter = CaptureAdapter()
        self.cog: MemoryCog | None = None

    async def start(self) -> None:
        async_context.set(self.adapter)
        await self.bot.load_extension("cogs.memory")
        self.cog = self.bot.get_cog("MemoryCog")

    def message(self, content: str, **kwargs: Any) -> discord.Message:
        data = message_payload(content, **kwargs)
        channel = self.guild.get_channel_or_thread(int(data["channel_id"]))
        return discord.Message(state=self.state, channel=channel, data=data)

    async def slash(self, command_name: str, invoker: int = ALICE_ID, permissions: str = "8",
                    **options: Any) -> discord.Interaction:
        command = self.bot.tree.get_command(command_name)
        option_types = {p.name: p.type.value for p in command.parameters}
        data = {
            "id": str(next(_ids)), "application_id": str(APP_ID), "type": 2, "token": "tok",
            "version": 1, "guild_id": str(GUILD_ID), "channel_id": str(CHANNEL_ID),
            "channel": {"id": str(CHANNEL_ID), "type": 0, "name": "general",
                        "guild_id": str(GUILD_ID), "position": 0, "permission_overwrites": []},
            "member": member(invoker, "alice") | {"permissions": permissions},
            "app_permissions": "8", "locale": "en-US", "guild_locale": "en-US",
            "entitlements": [], "authorizing_integration_owners": {}, "context": 0,
            "attachment_size_limit": 10_485_760,
            "data": {
                "id": str(next(_ids)), "name": command_name, "type": 1,
                "options": [{"name": k, "type": option_types[k], "value": v}
                            for k, v in options.items()],
            },
        }
        interaction = discord.Interaction(data=data, state=self.state)
        await self.bot.tree._call(interaction)
        return interaction

    async def close(self) -> None:
        await self.bot.unload_extension("cogs.memory")


@pytest.fixture
def harness(tmp_path):
    engine = MemoryEngine(tmp_path / "bot.sqlite3", Profile(name="test"), HashEmbedder(),
                          load_reranker=False)
    yield Harness(engine)
    engine.close()


def run(coro):
    return asyncio.run(coro)


def test_record_from_a_gateway_message(harness):
    msg = harness.message("the wifi password is on the fridge")
    record = record_from_message(msg)
    assert record.guild_id == GUILD_ID and record.channel_id == CHANNEL_ID
    assert record.author_id == ALICE_ID and record.author_display_name == "Ali"
    assert record.created_at == int(msg.created_at.timestamp() * 1000)
    assert record.parent_id is None


def test_thread_messages_record_their_parent(harness):
    record = record_from_message(harness.message("in a thread", channel=THREAD_ID))
    assert record.channel_id == THREAD_ID and record.parent_id == CHANNEL_ID


def test_messages_are_stored_edited_and_deleted(harness):
    async def scenario():
        await harness.start()
        msg = harness.message("the wifi password is hunter2")
        await harness.cog.on_message(msg)
        await asyncio.to_thread(harness.engine.embed_pending)
        found = harness.engine.search("wifi password", guild_id=GUILD_ID)
        assert [h.id for h in found.hits] == [msg.id]

        edited = message_payload("the door code is 4417") | {
            "id": str(msg.id), "edited_timestamp": datetime.now(timezone.utc).isoformat()}
        new = discord.Message(state=harness.state, channel=msg.channel, data=edited)
        await harness.cog.on_raw_message_edit(discord.RawMessageUpdateEvent(edited, new))
        await asyncio.to_thread(harness.engine.embed_pending)
        assert harness.engine.search("door code", guild_id=GUILD_ID).hits[0].content.startswith(
            "the door code")
        assert not harness.engine.search("hunter2", guild_id=GUILD_ID, mode="keyword").hits

        await harness.cog.on_raw_message_delete(discord.RawMessageDeleteEvent(
            {"id": str(msg.id), "channel_id": str(CHANNEL_ID), "guild_id": str(GUILD_ID)}))
        assert harness.engine.store.message_count() == 0
        await harness.close()

    run(scenario())


def test_the_bots_own_messages_and_dms_are_not_stored(harness):
    async def scenario():
        await harness.start()
        await harness.cog.on_message(harness.message("I am the bot", author=BOT_ID))
        assert harness.engine.store.message_count() == 0
        await harness.close()

    run(scenario())


def test_slash_search_defers_then_sends_hits_with_jump_links(harness):
    async def scenario():
        await harness.start()
        for text in ("bring the soldering iron on friday", "pizza tonight?", "the iron is broken"):
            await harness.cog.on_message(harness.message(text, author=BOB_ID))
        await asyncio.to_thread(harness.engine.embed_pending)
        await harness.slash("search", query="soldering iron", limit=2)
        await harness.close()

    run(scenario())
    callback = harness.adapter.callbacks[0]
    assert callback["type"] == 5 and callback["data"]["flags"] == 64  # deferred, ephemeral
    embed = harness.adapter.followups[0]["embeds"][0]
    assert "soldering iron" in embed["title"]
    assert 1 <= len(embed["fields"]) <= 2
    assert "soldering iron" in embed["fields"][0]["value"]
    assert f"https://discord.com/channels/{GUILD_ID}/{CHANNEL_ID}/" in embed["fields"][0]["value"]


def test_slash_search_on_an_empty_memory_says_why(harness):
    async def scenario():
        await harness.start()
        await harness.slash("search", query="anything")
        await harness.close()

    run(scenario())
    embed = harness.adapter.followups[0]["embeds"][0]
    assert "nothing is stored" in embed["description"]


def test_memory_stats_command(harness):
    async def scenario():
        await harness.start()
        await harness.cog.on_message(harness.message("hello there"))
        await harness.slash("memory")
        await harness.close()

    run(scenario())
    content = harness.adapter.followups[0]["content"]
    assert "Messages from this server: **1**" in content


def test_profile_switch_is_persisted(harness):
    async def scenario():
        await harness.start()
        await harness.slash("profile", name="cpu-fast")
        await harness.close()

    run(scenario())
    assert "now **cpu-fast**" in harness.adapter.followups[0]["content"]
    assert harness.engine.store.active_profile == "cpu-fast"


def test_profile_switch_failure_keeps_the_old_profile(harness):
    async def scenario():
        await harness.start()
        await harness.slash("profile", name="no-such-profile")
        await harness.close()

    run(scenario())
    assert "Could not switch" in harness.adapter.followups[0]["content"]
    assert harness.engine.store.active_profile is None


def test_a_mention_is_answered_from_memory(harness):
    sent: list[dict] = []

    async def send_message(channel_id, *, params):  # Discord's REST API is not here
        sent.append(params.payload)
        return message_payload("", author=BOT_ID)

    async def scenario():
        await harness.start()
        await harness.cog.on_message(harness.message("the lockbox code is 4417", author=BOB_ID))
        await asyncio.to_thread(harness.engine.embed_pending)
        msg = harness.message(f"<@{BOT_ID}> what is the lockbox code",
                              mentions=[user(BOT_ID, "memorybot", bot=True)])
        harness.bot.http.send_message = send_message
        await harness.cog.on_message(msg)
        await harness.close()

    run(scenario())
    embed = sent[0]["embeds"][0]
    assert "4417" in embed["fields"][0]["value"]
    assert sent[0]["message_reference"]["message_id"]
