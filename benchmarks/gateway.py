"""Gateway payloads for a Discord server that exists only in memory.

discord.py builds its guilds, channels, threads, roles and members from these
dictionaries through its own connection-state parsers, exactly as it does from
Discord's gateway.  ``bench discord`` uses them to time the bot without Discord;
the tests build their servers with them too.
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from typing import Any

import discord

# permission sets for roles and overwrites: READ allows reading a channel; as a deny,
# HIDE takes the channel away and NO_HISTORY its history
READ = discord.Permissions(view_channel=True, read_message_history=True, send_messages=True,
                           send_messages_in_threads=True)
VIEW_ONLY = discord.Permissions(view_channel=True, send_messages=True)
HIDE = discord.Permissions(view_channel=True)
NO_HISTORY = discord.Permissions(read_message_history=True)


def user(uid: int, name: str, bot: bool = False) -> dict[str, Any]:
    return {"id": str(uid), "username": name, "global_name": name.title(),
            "discriminator": "0", "avatar": None, "bot": bot}


def member(uid: int, name: str, nick: str | None = None, roles: Iterable[int] = ()) -> dict[str, Any]:
    return {"user": user(uid, name), "nick": nick, "roles": [str(r) for r in roles],
            "joined_at": "2025-01-01T00:00:00+00:00", "deaf": False, "mute": False, "flags": 0}


def role(rid: int, name: str, permissions: discord.Permissions, position: int = 1) -> dict[str, Any]:
    return {"id": str(rid), "name": name, "permissions": str(permissions.value),
            "position": position, "color": 0, "hoist": False, "managed": False,
            "mentionable": False}


NOTHING = discord.Permissions.none()


def overwrite(target: int, *, allow: discord.Permissions = NOTHING,
              deny: discord.Permissions = NOTHING, member: bool = False) -> dict:
    return {"id": str(target), "type": 1 if member else 0,
            "allow": str(allow.value), "deny": str(deny.value)}


def channel(cid: int, guild_id: int, name: str, *, type: int = 0, parent: int | None = None,
            overwrites: Iterable[dict] = (), position: int = 0) -> dict[str, Any]:
    return {"id": str(cid), "type": type, "name": name, "position": position,
            "guild_id": str(guild_id), "parent_id": str(parent) if parent else None,
            "permission_overwrites": list(overwrites), "nsfw": False}


def thread(tid: int, guild_id: int, parent: int, name: str, owner: int, *,
           private: bool = False, archived: bool = False) -> dict[str, Any]:
    return {"id": str(tid), "type": 12 if private else 11, "name": name, "parent_id": str(parent),
            "guild_id": str(guild_id), "owner_id": str(owner), "message_count": 1,
            "member_count": 1, "total_message_sent": 1,
            "thread_metadata": {"archived": archived, "auto_archive_duration": 1440,
                                "archive_timestamp": "2026-01-01T00:00:00+00:00",
                                "locked": False, "invitable": False}}


def guild(gid: int, name: str, *, owner: int, roles: list[dict], members: list[dict],
          channels: list[dict], threads: Sequence[dict] = ()) -> dict[str, Any]:
    return {"id": str(gid), "name": name, "owner_id": str(owner), "roles": roles,
            "emojis": [], "stickers": [], "features": [], "member_count": len(members),
            "members": members, "channels": channels, "threads": list(threads)}


