"""Real discord.py objects for tests, built from gateway payloads.

Guilds, roles, channels (with permission overwrites), threads, members and
messages go through the client's own connection-state parsers, exactly as they
would from Discord's gateway.  Slash commands run from interaction payloads
through the bot's command tree.  Only Discord's servers are missing: interaction
responses are captured at the webhook adapter and channel sends at the HTTP
client, the two places discord.py would otherwise make a request.
"""

from __future__ import annotations

import asyncio
import itertools
from collections.abc import Iterable
from datetime import datetime, timedelta, timezone
from typing import Any

import discord
from discord.webhook.async_ import AsyncWebhookAdapter, async_context

from benchmarks.gateway import (  # noqa: F401  (re-exported for the tests)
    HIDE,
    NO_HISTORY,
    READ,
    VIEW_ONLY,
    channel,
    guild,
    member,
    overwrite,
    role,
    thread,
    user,
)
from cogs.memory.bot import memory_bot
from cogs.memory.shards import Shards
from memory.engine import MemoryEngine

BOT_ID = APP_ID = 1000


def next_id() -> int:
    return next(_ids)

# snowflakes from an hour ago onwards, a millisecond apart, so messages are recent
_ids = itertools.count(
    discord.utils.time_snowflake(datetime.now(timezone.utc) - timedelta(hours=1)), 1 << 22)

class CaptureAdapter(AsyncWebhookAdapter):
    """Records interaction callbacks and follow-ups instead of sending them."""

    def __init__(self) -> None:
        super().__init__()
        self.callbacks: list[dict[str, Any]] = []
        self.followups: list[dict[str, Any]] = []
        self.edits: list[dict[str, Any]] = []
        self.posted: list[int] = []  # the ids of the follow-ups' messages, in order

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
        self.posted.append(next_id())
        return {"id": str(self.posted[-1]), "channel_id": "1", "content": payload.get("content") or "",
                "author": user(BOT_ID, "memorybot", bot=True), "attachments": [], "embeds":
                payload.get("embeds", []), "mentions": [], "mention_roles": [], "pinned": False,
                "mention_everyone": False, "tts": False, "type": 0, "flags": 0,
                "timestamp": "2026-01-01T00:00:00+00:00", "edited_timestamp": None,
                "webhook_id": str(webhook_id)}

    async def edit_webhook_message(self, webhook_id, token, message_id, *, session,
                                   payload=None, multipart=None, files=None, **kwargs):
        self.edits.append(payload)
        return await self.execute_webhook(webhook_id, token, session=session,
                                          payload=payload, wait=True)

    def texts(self) -> list[str]:
        """Every text the bot sent through the interaction webhooks."""
        out = []
        for payload in [*self.followups, *self.edits,
                        *(c.get("data", {}) for c in self.callbacks)]:
            out.append(payload.get("content") or "")
            for embed in payload.get("embeds", []) or []:
                out.append(str(embed))
        return out


def archived_thread(thread_id: int, parent_id: int, *, private: bool = False) -> dict[str, Any]:
    """An archived thread as an interaction's ``resolved`` data carries it (discord.py has
    no cache entry for it); :meth:`Harness.slash` puts the invoker's permissions there."""
    return {"id": str(thread_id), "name": f"archived {thread_id}", "type": 12 if private else 11,
            "permissions": "0", "parent_id": str(parent_id), "owner_id": "9999",
            "member_count": 1, "message_count": 1,
            "thread_metadata": {"archived": True, "auto_archive_duration": 1440,
                                "archive_timestamp": "2026-01-01T00:00:00+00:00", "locked": False}}


class Harness:
    """A MemoryBot whose connection state is filled from guild payloads.

    With ``shards`` it is the sharded bot of one process of several (its guilds should
    then be those of its shards, as Discord would send them).  Once started:
    ``search`` (the ``MemoryCog``), ``listeners`` and their ``runtime``.
    """

    def __init__(self, engine: MemoryEngine, guilds: Iterable[dict[str, Any]],
                 owner_ids: Iterable[int] = (), shards: Shards | None = None) -> None:
        self.engine = engine
        self.bot = memory_bot(engine, owner_ids=set(owner_ids) or None, shards=shards)
        state = self.bot._connection
        state.user = discord.ClientUser(state=state, data=user(BOT_ID, "memorybot", bot=True))
        state.application_id = APP_ID
        self.state = state
        self.guilds = [state._add_guild_from_data(g) for g in guilds]
        for g in self.guilds:  # the bot's own member, with every permission
            g._add_member(discord.Member(data=member(BOT_ID, "memorybot") | {"user": user(
                BOT_ID, "memorybot", bot=True), "roles": []}, guild=g, state=state))
        self.adapter = CaptureAdapter()
        self.sent: list[tuple[int, dict[str, Any]]] = []
        self.sent_ids: list[int] = []  # the ids of those messages, in order
        self.search: Any = None  # the memory cogs and their runtime, once started
        self.listeners: Any = None
        self.runtime: Any = None

    @property
    def guild(self) -> discord.Guild:
        return self.guilds[0]

    async def start(self) -> None:
        async_context.set(self.adapter)
        self.bot.loop = asyncio.get_running_loop()  # what login() would set: events dispatch on it

        async def send_message(channel_id, *, params):  # Discord's REST API is not here
            self.sent.append((int(channel_id), params.payload))
            data = self.message_payload("", author=(BOT_ID, "memorybot"),
                                        channel=int(channel_id), bot=True)
            self.sent_ids.append(int(data["id"]))
            return data

        self.bot.http.send_message = send_message
        await self.bot.load_extension("cogs.memory")
        self.search = self.bot.get_cog("MemoryCog")
        self.listeners = self.bot.get_cog("MemoryListeners")
        self.runtime = self.search.runtime

    @property
    def backfill(self) -> Any:
        """The backfiller the memory cogs share."""
        return self.listeners.backfill

    @property
    def reconciler(self) -> Any:
        """The reconciler the memory cogs share."""
        return self.listeners.reconciler

    async def dispatch(self, event: str, *args: Any) -> None:
        """Dispatch a gateway event as discord.py does, and wait until every listener is done."""
        self.bot.dispatch(event, *args)
        for _ in range(50):
            pending = [t for t in asyncio.all_tasks() if t.get_name().startswith("discord.py: ")]
            if not pending:
                return
            await asyncio.gather(*pending)

    async def close(self) -> None:
        await self.bot.unload_extension("cogs.memory")

    def find_guild(self, channel_id: int) -> discord.Guild:
        for g in self.guilds:
            if g.get_channel_or_thread(channel_id) is not None:
                return g
        raise KeyError(channel_id)

    def message_payload(self, content: str, *, author: tuple[int, str], channel: int,  # noqa: F811
                        roles: Iterable[int] = (), bot: bool = False, nick: str | None = None,
                        **extra: Any) -> dict[str, Any]:
        mid = next_id()
        guild_id = self.find_guild(channel).id
        return {
            "id": str(mid), "channel_id": str(channel), "guild_id": str(guild_id),
            "author": user(author[0], author[1], bot=bot),
            "member": {"nick": nick, "roles": [str(r) for r in roles],
                       "joined_at": "2025-01-01T00:00:00+00:00", "deaf": False, "mute": False,
                       "flags": 0},
            "content": content, "timestamp": discord.utils.snowflake_time(mid).isoformat(),
            "edited_timestamp": None, "tts": False, "mention_everyone": False, "mentions": [],
            "mention_roles": [], "attachments": [], "embeds": [], "pinned": False, "type": 0,
            "flags": 0, **extra,
        }

    def message(self, content: str, **kwargs: Any) -> discord.Message:
        """A message as the gateway's MESSAGE_CREATE would build it."""
        data = self.message_payload(content, **kwargs)
        where = self.find_guild(int(data["channel_id"])).get_channel_or_thread(int(data["channel_id"]))
        return discord.Message(state=self.state, channel=where, data=data)

    async def slash(self, command: str, *, invoker: dict[str, Any], where: int,
                    permissions: discord.Permissions | None = None,
                    archived: Iterable[dict[str, Any]] = (),
                    app_permissions: discord.Permissions | None = None,
                    **options: Any) -> discord.Interaction:
        """Run a slash command (``"group sub"`` for subcommands) as ``invoker`` in channel ``where``.

        An option naming a thread not in the cache takes its id, with the thread in
        ``archived`` (:func:`archived_thread`), as the interaction's resolved data.  A
        resolved channel carries the invoker's permissions in it, as Discord sends them.
        ``app_permissions`` are the bot's in ``where`` (default: all).
        """
        home = self.find_guild(where)
        who = discord.Member(data=invoker, guild=home, state=self.state)

        def seen(place: Any) -> str:
            return str(place.permissions_for(who).value) if place is not None else "0"

        names = command.split()
        cmd = self.bot.tree.get_command(names[0])
        for name in names[1:]:
            cmd = cmd.get_command(name)
        types = {p.name: p.type.value for p in cmd.parameters}
        option_list: list[dict[str, Any]] = [
            {"name": k, "type": types[k], "value": str(v.id) if hasattr(v, "id") else v}
            for k, v in options.items()
        ]
        for name in reversed(names[1:]):
            option_list = [{"name": name, "type": 1 if name == names[-1] else 2,
                            "options": option_list}]
        resolved: dict[str, Any] = {}
        for v in options.values():
            if isinstance(v, discord.abc.GuildChannel | discord.Thread):
                resolved.setdefault("channels", {})[str(v.id)] = {
                    "id": str(v.id), "name": v.name, "type": v.type.value,
                    "permissions": seen(v), **({"parent_id": str(v.parent_id),
                                           "thread_metadata": {"archived": False,
                                                               "auto_archive_duration": 1440,
                                                               "archive_timestamp": "2026-01-01T00:00:00+00:00",
                                                               "locked": False}}
                                          if isinstance(v, discord.Thread) else {})}
        for payload in archived:
            parent = home.get_channel(int(payload["parent_id"]))
            resolved.setdefault("channels", {})[payload["id"]] = payload | {
                "permissions": seen(parent)}
        data = {"id": str(next_id()), "name": names[0], "type": 1, "options": option_list,
                **({"resolved": resolved} if resolved else {})}
        return await self._interact(data, invoker, where, permissions, app_permissions)

    async def context_menu(self, name: str, *, invoker: dict[str, Any], where: int,
                           target: discord.Message) -> discord.Interaction:
        """Run a message context menu on ``target`` as ``invoker``."""
        message = self.message_payload(target.content, author=(target.author.id,
                                       target.author.name), channel=target.channel.id)
        message["id"] = str(target.id)
        data = {"id": str(next_id()), "name": name, "type": 3, "target_id": str(target.id),
                "resolved": {"messages": {str(target.id): message}}}
        return await self._interact(data, invoker, where, None)

    async def _interact(self, data: dict[str, Any], invoker: dict[str, Any], where: int,
                        permissions: discord.Permissions | None,
                        app_permissions: discord.Permissions | None = None) -> discord.Interaction:
        home = self.find_guild(where)
        place = home.get_channel_or_thread(where)
        perms = permissions if permissions is not None else place.permissions_for(
            home.get_member(int(invoker["user"]["id"])) or home.default_role)
        payload = {
            "id": str(next_id()), "application_id": str(APP_ID), "type": 2, "token": "tok",
            "version": 1, "guild_id": str(home.id), "channel_id": str(where),
            "channel": {"id": str(where), "type": place.type.value, "name": place.name,
                        "guild_id": str(home.id), "position": 0, "permission_overwrites": []},
            "member": invoker | {"permissions": str(perms.value)},
            "app_permissions": str((app_permissions or discord.Permissions.all()).value),
            "locale": "en-US",
            "guild_locale": "en-US", "entitlements": [], "authorizing_integration_owners": {},
            "context": 0, "attachment_size_limit": 10_485_760, "data": data,
        }
        interaction = discord.Interaction(data=payload, state=self.state)
        await self.bot.tree._call(interaction)
        return interaction
