"""A public answer never quotes a channel's history to a member added to it without history.

A gated server: ``@everyone`` may do nothing, the member role grants View Channel and
Read Message History, and #staff-room is for the staff role.  A guest is added to
#staff-room by a member overwrite that allows View Channel only (what Discord's "add
members" button does): the guest sees new messages there but may not read its
history.  The bot runs without the members intent, so discord.py keys that overwrite
by a ``discord.Object``, not a ``Member``; the public-answer rule must still see it.
"""

from __future__ import annotations

from collections.abc import AsyncIterator

import discord
import pytest

from cogs.memory.permissions import public_reply_sources, readable_channel_ids
from memory.config import Profile
from memory.engine import MemoryEngine
from tests.support.builders import HashEmbedder
from tests.support.discord_harness import (
    BOT_ID,
    HIDE,
    READ,
    Harness,
    channel,
    guild,
    member,
    overwrite,
    role,
    user,
)

G, MEMBERS, STAFF = 500, 520, 510
ALICE, GUEST, OLGA = 1101, 1106, 1105
GENERAL, STAFF_ROOM = 601, 611
SECRET = "the staff salary sheet is in /hr/pay"


def server() -> dict:
    return guild(
        G, "Gated", owner=9999,
        roles=[role(G, "@everyone", discord.Permissions(send_messages=True), position=0),
               role(MEMBERS, "member", READ), role(STAFF, "staff", discord.Permissions.none())],
        members=[member(ALICE, "alice", roles=[MEMBERS, STAFF]), member(GUEST, "guest")],
        channels=[
            channel(GENERAL, G, "general"),
            channel(STAFF_ROOM, G, "staff-room", overwrites=[
                overwrite(G, deny=HIDE), overwrite(MEMBERS, deny=HIDE),
                overwrite(STAFF, allow=READ), overwrite(GUEST, allow=HIDE, member=True)]),
        ],
    )


@pytest.fixture
async def h(tmp_path) -> AsyncIterator[Harness]:
    engine = MemoryEngine(tmp_path / "m.db", Profile(name="test"), HashEmbedder(),
                          load_reranker=False)
    h = Harness(engine, [server()])
    await h.start()
    await h.listeners.on_message(h.message(f"pineapple: {SECRET}", author=(OLGA, "olga"),
                                           channel=STAFF_ROOM))
    await h.runtime.writes.stop()
    h.runtime.writes.start()
    engine.embed_pending()
    yield h
    await h.close()
    engine.close()


def as_member(h: Harness, uid: int, roles: list[int]) -> discord.Member:
    return discord.Member(data=member(uid, "x", roles=roles), guild=h.guild, state=h.state)


async def test_the_guest_sees_the_staff_room_but_not_its_history(h: Harness) -> None:
    room = h.guild.get_channel(STAFF_ROOM)
    assert isinstance(room, discord.TextChannel)
    assert any(isinstance(target, discord.Object) for target in room.overwrites)
    guest = as_member(h, GUEST, [])
    perms = room.permissions_for(guest)
    assert perms.view_channel and not perms.read_message_history
    assert STAFF_ROOM not in readable_channel_ids(guest)
    assert STAFF_ROOM in readable_channel_ids(as_member(h, ALICE, [MEMBERS, STAFF]))


async def test_a_public_answer_there_does_not_quote_its_history(h: Harness) -> None:
    room = h.guild.get_channel(STAFF_ROOM)
    assert isinstance(room, discord.TextChannel)
    alice = as_member(h, ALICE, [MEMBERS, STAFF])
    assert STAFF_ROOM not in public_reply_sources(room, readable_channel_ids(alice))


async def test_a_mention_reply_there_does_not_quote_its_history(h: Harness) -> None:
    message = h.message(f"<@{BOT_ID}> where is the pineapple", author=(ALICE, "alice"),
                        channel=STAFF_ROOM, roles=[MEMBERS, STAFF],
                        mentions=[user(BOT_ID, "memorybot", bot=True)])
    await h.dispatch("message", message)
    channel_id, payload = h.sent[-1]
    assert channel_id == STAFF_ROOM  # a public reply, which the guest sees arrive
    assert "salary sheet" not in str(payload)


async def test_a_public_slash_search_there_does_not_quote_its_history(h: Harness) -> None:
    await h.slash("search", invoker=member(ALICE, "alice", roles=[MEMBERS, STAFF]),
                  where=STAFF_ROOM, query="pineapple", private=False)
    public = h.adapter.followups[0]
    assert not (public.get("flags") or 0) & 64  # public: the guest sees it
    assert "salary sheet" not in str(public)
    # alice herself may read the staff room: a private search still finds it
    await h.slash("search", invoker=member(ALICE, "alice", roles=[MEMBERS, STAFF]),
                  where=STAFF_ROOM, query="pineapple", private=True)
    assert "salary sheet" in str(h.adapter.followups[-1])
