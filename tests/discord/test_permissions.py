"""The permission matrix: a member never finds a message from a channel they cannot read.

One server is built from gateway payloads with roles, role and member overwrites,
a private category whose channels sync to it, a channel members may view but not
read the history of, one whose history only staff may read, a voice channel whose
text chat only staff may join (Discord asks for Connect there), an age-restricted
channel, public, private and archived threads, and a second server; and a gated server
whose staff channel a guest was added to with View Channel only.
Every channel holds a message with the same word; each member then searches by
every route (the engine allow-list, ``/search`` private and public, ``channel:``,
the context menu, a mention reply), and every cell is checked against a table
written by hand from Discord's rules, not computed by the code under test.  The
memory is a database of each storage engine (``db_location``).
"""

from __future__ import annotations

from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from pathlib import Path

import discord
import pytest

from cogs.memory.permissions import (
    StoredThread,
    StoredThreads,
    everyone_can_read,
    public_reply_sources,
    readable_channel_ids,
)
from memory.config import Profile
from memory.engine import MemoryEngine
from memory.search import SearchRequest
from tests.support.builders import HashEmbedder
from tests.support.discord_harness import (
    BOT_ID,
    HIDE,
    NO_HISTORY,
    READ,
    Harness,
    archived_thread,
    channel,
    guild,
    member,
    overwrite,
    role,
    thread,
    user,
)

G, G2 = 500, 800
STAFF, MODS = 510, 511
ALICE, BOB, CAROL, EVE, OTHER = 1101, 1102, 1103, 1104, 1105
PUBLIC_CAT, GENERAL, NO_BOB = 600, 601, 630
STAFF_CAT, STAFF_ONLY, STAFF_LOG, ANNOUNCE = 610, 611, 612, 620
STAFF_VOICE, ADULTS, HELP_DESK = 640, 641, 642
PUBLIC_THREAD, PRIVATE_THREAD, ARCHIVED_STAFF_THREAD, ARCHIVED_PRIVATE = 701, 702, 703, 704
ELSEWHERE = 801
CONNECT = discord.Permissions(connect=True)
WORD = "pineapple"

ROLES = {ALICE: [STAFF], BOB: [], CAROL: [MODS], EVE: [STAFF]}
NAMES = {ALICE: "alice", BOB: "bob", CAROL: "carol", EVE: "eve", OTHER: "olga"}

# Who can read what, by Discord's rules (see the module docstring for the layout).
READABLE = {
    ALICE: {GENERAL, NO_BOB, STAFF_ONLY, STAFF_LOG, PUBLIC_THREAD, PRIVATE_THREAD,
            ARCHIVED_STAFF_THREAD, STAFF_VOICE, ADULTS, HELP_DESK},
    BOB: {GENERAL, PUBLIC_THREAD, ADULTS},
    CAROL: {GENERAL, NO_BOB, PUBLIC_THREAD, PRIVATE_THREAD, ARCHIVED_PRIVATE, ADULTS},
    EVE: {GENERAL, NO_BOB, STAFF_ONLY, STAFF_LOG, PUBLIC_THREAD, ARCHIVED_STAFF_THREAD,
          STAFF_VOICE, ADULTS, HELP_DESK},
}
# Asked outside an age-restricted channel (in a server that is not), nobody is past
# Discord's age gate: the age-restricted channel is left out of every search.
SEARCHABLE = {uid: channels - {ADULTS} for uid, channels in READABLE.items()}
# What a public reply in #general may quote: channels every member can read (not the
# age-restricted one: Discord keeps it from members under 18).
PUBLIC_IN_GENERAL = {GENERAL, PUBLIC_THREAD}
# In #staff-only: staff channels synced to the same category, and the world-readable ones.
PUBLIC_IN_STAFF_ONLY = {STAFF_ONLY, ARCHIVED_STAFF_THREAD, GENERAL, PUBLIC_THREAD}


def everyone_role(gid: int) -> dict:
    return role(gid, "@everyone", READ, position=0)


def server() -> dict:
    staff_only = [overwrite(G, deny=HIDE), overwrite(STAFF, allow=READ)]
    return guild(
        G, "Main", owner=9999,
        roles=[everyone_role(G), role(STAFF, "staff", discord.Permissions.none()),
               role(MODS, "mods", discord.Permissions(manage_threads=True))],
        members=[member(uid, NAMES[uid], roles=ROLES[uid]) for uid in ROLES],
        channels=[
            channel(PUBLIC_CAT, G, "public", type=4),
            channel(GENERAL, G, "general", parent=PUBLIC_CAT),
            channel(NO_BOB, G, "no-bob", parent=PUBLIC_CAT,
                    overwrites=[overwrite(BOB, deny=HIDE, member=True)]),
            channel(STAFF_CAT, G, "staff", type=4, overwrites=staff_only),
            channel(STAFF_ONLY, G, "staff-only", parent=STAFF_CAT, overwrites=staff_only),
            channel(STAFF_LOG, G, "staff-log", parent=STAFF_CAT, overwrites=staff_only),
            channel(ANNOUNCE, G, "announcements", overwrites=[overwrite(G, deny=NO_HISTORY)]),
            # everyone sees the voice room; its text chat needs Connect, which only staff have
            channel(STAFF_VOICE, G, "staff-voice", type=2,
                    overwrites=[overwrite(STAFF, allow=CONNECT)]) | {"bitrate": 64000,
                                                                     "user_limit": 0},
            channel(ADULTS, G, "after-dark") | {"nsfw": True},
            # everyone may view and post; only staff may read the history
            channel(HELP_DESK, G, "help-desk", overwrites=[overwrite(G, deny=NO_HISTORY),
                                                          overwrite(STAFF, allow=NO_HISTORY)]),
        ],
        threads=[
            thread(PUBLIC_THREAD, G, GENERAL, "open thread", owner=BOB),
            thread(PRIVATE_THREAD, G, GENERAL, "secret thread", owner=9999, private=True),
        ],
    )


def other_server() -> dict:
    return guild(G2, "Elsewhere", owner=OTHER, roles=[everyone_role(G2)],
                 members=[member(OTHER, "olga"), member(ALICE, "alice")],
                 channels=[channel(ELSEWHERE, G2, "other")])


@pytest.fixture
async def harness(db_location):
    """The world on a database of each storage engine: the allow-list applies inside both
    engines' vector and keyword stages."""
    engine = MemoryEngine(db_location, Profile(name="test"), HashEmbedder(), load_reranker=False)
    h = Harness(engine, [server(), other_server()])
    await h.start()
    # alice takes part in the private thread (THREAD_MEMBERS_UPDATE from the gateway)
    h.state.parse_thread_members_update({
        "id": str(PRIVATE_THREAD), "guild_id": str(G), "member_count": 1,
        "added_members": [{"id": str(PRIVATE_THREAD), "user_id": str(ALICE), "flags": 0,
                           "join_timestamp": "2026-01-01T00:00:00+00:00"}],
        "removed_member_ids": [],
    })
    await _fill(h)
    yield h
    await h.close()
    engine.close()


async def _fill(h: Harness) -> None:
    """One message with WORD in every channel and thread, incl. archived ones the cache lacks."""
    for place in (GENERAL, NO_BOB, STAFF_ONLY, STAFF_LOG, ANNOUNCE, PUBLIC_THREAD, PRIVATE_THREAD,
                  ELSEWHERE, STAFF_VOICE, ADULTS, HELP_DESK):
        await h.listeners.on_message(h.message(f"{WORD} note in channel {place}",
                                         author=(OTHER, "olga"), channel=place))
    await h.runtime.writes.stop()
    h.runtime.writes.start()
    # archived threads known only from the database (an earlier capture or an import)
    from memory.records import MessageRecord
    h.engine.storage.messages.upsert([
        MessageRecord(id=tid * 10, guild_id=G, channel_id=tid, author_id=OTHER,
                      created_at=1_700_000_000_000, content=f"{WORD} note in channel {tid}",
                      parent_id=parent, channel_type=kind, channel_name=f"archived {tid}")
        for tid, parent, kind in ((ARCHIVED_STAFF_THREAD, STAFF_ONLY, "public_thread"),
                                  (ARCHIVED_PRIVATE, GENERAL, "GuildPrivateThread"))
    ])
    h.engine.embed_pending()


def as_member(h: Harness, uid: int) -> discord.Member:
    """The member as an interaction or message payload brings them (roles as of now)."""
    return discord.Member(data=member(uid, NAMES[uid], roles=ROLES[uid]), guild=h.guild,
                          state=h.state)


def stored_threads(h: Harness) -> list[StoredThread]:
    return [StoredThread(*row) for row in h.engine.storage.messages.threads(G)]


@pytest.mark.parametrize("uid", list(READABLE))
def test_readable_channels_match_discords_rules(harness, uid):
    readable = readable_channel_ids(as_member(harness, uid), stored_threads(harness))
    assert readable == SEARCHABLE[uid]
    past_the_gate = readable_channel_ids(as_member(harness, uid), stored_threads(harness),
                                         age_verified=True)
    assert past_the_gate == READABLE[uid]


@pytest.mark.parametrize("uid", list(READABLE))
async def test_a_search_finds_exactly_what_the_member_can_read(harness, uid):
    result, withheld = await harness.search.member_search(
        as_member(harness, uid), SearchRequest(queries=(WORD,), limit=50))
    assert {hit.channel_id for hit in result.hits} == SEARCHABLE[uid]
    assert withheld == 0
    # asked inside the age-restricted channel: past the gate
    result, _ = await harness.search.member_search(
        as_member(harness, uid), SearchRequest(queries=(WORD,), limit=50),
        asked_in=harness.guild.get_channel(ADULTS))
    assert {hit.channel_id for hit in result.hits} == READABLE[uid]


@pytest.mark.parametrize("uid", list(READABLE))
@pytest.mark.parametrize("asked", [STAFF_ONLY, GENERAL, ANNOUNCE, ELSEWHERE, ARCHIVED_PRIVATE])
async def test_naming_a_channel_never_widens_the_search(harness, uid, asked):
    result, _ = await harness.search.member_search(
        as_member(harness, uid), SearchRequest(queries=(WORD,), limit=50, channel_ids=(asked,)))
    found = {hit.channel_id for hit in result.hits}
    assert found <= READABLE[uid]
    if asked == GENERAL:  # its threads come along, but only the ones this member may read
        assert found == {GENERAL, PUBLIC_THREAD, PRIVATE_THREAD, ARCHIVED_PRIVATE} & READABLE[uid]


@pytest.mark.parametrize("uid", list(READABLE))
async def test_a_public_answer_in_general_quotes_only_what_everyone_there_reads(harness, uid):
    general = harness.guild.get_channel(GENERAL)
    result, withheld = await harness.search.member_search(
        as_member(harness, uid), SearchRequest(queries=(WORD,), limit=50), reply_channel=general)
    assert {hit.channel_id for hit in result.hits} == PUBLIC_IN_GENERAL & READABLE[uid]
    assert withheld == len(SEARCHABLE[uid] - PUBLIC_IN_GENERAL)


async def test_a_public_answer_in_a_private_category_may_quote_that_category(harness):
    staff_only = harness.guild.get_channel(STAFF_ONLY)
    result, withheld = await harness.search.member_search(
        as_member(harness, ALICE), SearchRequest(queries=(WORD,), limit=50),
        reply_channel=staff_only)
    assert {hit.channel_id for hit in result.hits} == PUBLIC_IN_STAFF_ONLY
    assert withheld == len(SEARCHABLE[ALICE] - PUBLIC_IN_STAFF_ONLY)


@pytest.mark.parametrize(("where", "quoted"), [
    # staff may read the voice room's chat, and nobody who sees it is refused its history
    (STAFF_VOICE, {STAFF_VOICE} | PUBLIC_IN_GENERAL),
    # bob sees new messages in #help-desk but may not read its history: not even the
    # channel itself may be quoted there
    (HELP_DESK, PUBLIC_IN_GENERAL),
])
async def test_a_public_answer_quotes_its_own_channel_only_where_its_readers_may(
    harness, where, quoted
):
    result, _ = await harness.search.member_search(
        as_member(harness, ALICE), SearchRequest(queries=(WORD,), limit=50),
        reply_channel=harness.guild.get_channel(where))
    assert {hit.channel_id for hit in result.hits} == quoted


def test_world_readable_channels(harness):
    g = harness.guild
    assert everyone_can_read(g.get_channel(GENERAL))
    assert everyone_can_read(g.get_thread(PUBLIC_THREAD))
    for cid in (NO_BOB, STAFF_ONLY, ANNOUNCE, STAFF_VOICE, ADULTS, HELP_DESK):
        assert not everyone_can_read(g.get_channel(cid)), cid
    assert not everyone_can_read(g.get_thread(PRIVATE_THREAD))
    # a reply inside the private thread may quote the thread itself and its parent
    sources = public_reply_sources(g.get_thread(PRIVATE_THREAD), READABLE[ALICE],
                                   stored_threads(harness))
    assert sources == {PRIVATE_THREAD, GENERAL, PUBLIC_THREAD}


async def test_a_member_who_loses_a_role_loses_its_channels_at_once(harness):
    h = harness
    before, _ = await h.search.member_search(as_member(h, EVE), SearchRequest(queries=(WORD,), limit=50))
    assert STAFF_ONLY in {hit.channel_id for hit in before.hits}
    # the staff role is removed: the next interaction or message carries her new roles
    eve_now = discord.Member(data=member(EVE, "eve", roles=[]), guild=h.guild, state=h.state)
    after, _ = await h.search.member_search(eve_now, SearchRequest(queries=(WORD,), limit=50))
    assert {hit.channel_id for hit in after.hits} == {GENERAL, NO_BOB, PUBLIC_THREAD}


async def test_leaving_a_private_thread_hides_it(harness):
    h = harness
    h.state.parse_thread_members_update({
        "id": str(PRIVATE_THREAD), "guild_id": str(G), "member_count": 0,
        "added_members": [], "removed_member_ids": [str(ALICE)]})
    result, _ = await h.search.member_search(as_member(h, ALICE), SearchRequest(queries=(WORD,), limit=50))
    assert PRIVATE_THREAD not in {hit.channel_id for hit in result.hits}


async def test_an_overwrite_added_later_applies_to_the_next_search(harness):
    h = harness
    h.state.parse_channel_update(channel(GENERAL, G, "general", parent=PUBLIC_CAT,
                                         overwrites=[overwrite(BOB, deny=HIDE, member=True)]))
    result, _ = await h.search.member_search(as_member(h, BOB), SearchRequest(queries=(WORD,), limit=50),
                                             asked_in=h.guild.get_channel(ADULTS))
    # no general, and its public thread went with it
    assert {hit.channel_id for hit in result.hits} == {ADULTS}


# -- every route a member has --------------------------------------------------------------

def _quoted(texts: list[str]) -> set[int]:
    """Channel ids whose WORD message text appears in what the bot sent."""
    found = set()
    blob = "\n".join(texts)
    for cid in (GENERAL, NO_BOB, STAFF_ONLY, STAFF_LOG, ANNOUNCE, PUBLIC_THREAD, PRIVATE_THREAD,
                ARCHIVED_STAFF_THREAD, ARCHIVED_PRIVATE, ELSEWHERE, STAFF_VOICE, ADULTS, HELP_DESK):
        if f"channel {cid}" in blob:
            found.add(cid)
    return found


def _invoker(uid: int) -> dict:
    return member(uid, NAMES[uid], roles=ROLES[uid])


@pytest.mark.parametrize("uid", list(READABLE))
async def test_slash_search_private_and_public(harness, uid):
    h = harness
    await h.slash("search", invoker=_invoker(uid), where=GENERAL, query=WORD, limit=10)
    assert _quoted(h.adapter.texts()) == SEARCHABLE[uid]
    h.adapter.followups.clear()
    await h.slash("search", invoker=_invoker(uid), where=GENERAL, query=WORD, limit=10,
                  private=False)
    public, *to_the_asker = h.adapter.followups
    assert "flags" not in public or not public["flags"] & 64  # really public
    assert _quoted([str(public["embeds"])]) == PUBLIC_IN_GENERAL & READABLE[uid]
    # issue 30.3: the public answer says nothing of what it left out (that channels the
    # audience cannot read hold matches is news to them); the asker alone is told
    assert "more result" not in str(public) and "withheld" not in str(public)
    hidden = len(SEARCHABLE[uid] - PUBLIC_IN_GENERAL)
    assert [(n["flags"], f"{hidden} more result" in n["content"]) for n in to_the_asker] == (
        [(64, True)] if hidden else [])
    assert _quoted([str(n) for n in to_the_asker]) == set()


@pytest.mark.parametrize("uid", [BOB, CAROL])
async def test_slash_search_naming_a_hidden_channel_shows_nothing(harness, uid):
    h = harness
    await h.slash("search", invoker=_invoker(uid), where=GENERAL, query=WORD,
                  channel=h.guild.get_channel(STAFF_ONLY), private=False)
    assert _quoted(h.adapter.texts()) == set()


@pytest.mark.parametrize("uid", list(READABLE))
async def test_mention_reply_quotes_only_public_sources(harness, uid):
    h = harness
    msg = h.message(f"<@{BOT_ID}> where is the {WORD}", author=(uid, NAMES[uid]), channel=GENERAL,
                    roles=ROLES[uid], mentions=[user(BOT_ID, "memorybot", bot=True)])
    await h.dispatch("message", msg)
    channel_id, payload = h.sent[-1]
    assert channel_id == GENERAL
    assert _quoted([str(payload["embeds"])]) == PUBLIC_IN_GENERAL & READABLE[uid]
    assert payload["allowed_mentions"] == {"parse": [], "replied_user": False}
    # nor what it left out: a reply cannot tell the asker alone (issue 30.3)
    assert "more result" not in str(payload) and "withheld" not in str(payload)
    assert [cid for cid, _ in h.sent] == [GENERAL]


async def test_the_context_menu_is_private_and_permission_safe(harness):
    h = harness
    target = h.message(f"{WORD} question", author=(BOB, "bob"), channel=GENERAL)
    results = await _run_context_menu(h, BOB, target)
    assert _quoted(results) <= SEARCHABLE[BOB]
    assert h.adapter.callbacks[0]["data"]["flags"] == 64


async def _run_context_menu(h: Harness, uid: int, target: discord.Message) -> list[str]:
    await h.context_menu("Find related messages", invoker=_invoker(uid), where=GENERAL,
                         target=target)
    return h.adapter.texts()


@pytest.mark.parametrize("uid", list(READABLE))
async def test_memory_stats_count_only_readable_channels(harness, uid):
    await harness.slash("memory stats", invoker=_invoker(uid), where=GENERAL)
    first_line = harness.adapter.followups[-1]["content"].split("\n")[0]
    n = len(SEARCHABLE[uid])
    assert f"**{n}** in {n} channels" in first_line
    await harness.slash("memory stats", invoker=_invoker(uid), where=ADULTS)
    n = len(READABLE[uid])  # asked past the age gate
    assert f"**{n}** in {n} channels" in harness.adapter.followups[-1]["content"]


GATED_MEMBER, GUEST = 520, 1106


def gated_server(*, everyone_allows_history: bool = False, guest: bool = False) -> dict:
    """@everyone may do nothing; a "member" role grants view and history, staff get a
    channel of their own (or history comes from the staff channel's @everyone overwrite).
    With ``guest``, a member with no role is added to the staff channel by a member
    overwrite that allows View Channel only (Discord's "add members"): they see new
    messages there but may not read its history.  Without the members intent discord.py
    keys that overwrite by a ``discord.Object``, not a ``Member``."""
    history = NO_HISTORY if everyone_allows_history else discord.Permissions.none()
    staff = [overwrite(G, deny=HIDE, allow=history), overwrite(GATED_MEMBER, deny=HIDE),
             overwrite(STAFF, allow=HIDE if everyone_allows_history else READ)]
    if guest:
        staff.append(overwrite(GUEST, allow=HIDE, member=True))
    return guild(
        G, "Gated", owner=9999,
        roles=[role(G, "@everyone", discord.Permissions(send_messages=True), position=0),
               role(GATED_MEMBER, "member", READ), role(STAFF, "staff", discord.Permissions.none())],
        members=[member(ALICE, "alice", roles=[GATED_MEMBER, STAFF]),
                 *([member(GUEST, "guest")] if guest else [])],
        channels=[channel(GENERAL, G, "general"),
                  channel(STAFF_ONLY, G, "staff", overwrites=staff)])


@asynccontextmanager
async def gated_harness(tmp_path: Path, **options: bool) -> AsyncIterator[Harness]:
    """The gated server, with one message with WORD in its staff channel."""
    engine = MemoryEngine(tmp_path / "gated.sqlite3", Profile(name="test"), HashEmbedder(),
                          load_reranker=False)
    h = Harness(engine, [gated_server(**options)])
    await h.start()
    try:
        await h.listeners.on_message(h.message(f"{WORD}: the salary sheet is in /hr/pay",
                                               author=(OTHER, "olga"), channel=STAFF_ONLY))
        await h.runtime.writes.stop()
        h.runtime.writes.start()
        engine.embed_pending()
        yield h
    finally:
        await h.close()
        engine.close()


def gated_alice(h: Harness) -> discord.Member:
    return discord.Member(data=member(ALICE, "alice", roles=[GATED_MEMBER, STAFF]),
                          guild=h.guild, state=h.state)


@pytest.mark.parametrize("everyone_allows_history", [False, True])
async def test_a_gated_server_still_quotes_the_answers_channel(tmp_path, everyone_allows_history):
    """Everyone who sees a public answer in the staff channel may read its history, so
    it is quoted."""
    async with gated_harness(tmp_path, everyone_allows_history=everyone_allows_history) as h:
        readable = readable_channel_ids(gated_alice(h))
        assert readable == {GENERAL, STAFF_ONLY}
        assert public_reply_sources(h.guild.get_channel(GENERAL), readable) == {GENERAL}
        assert public_reply_sources(h.guild.get_channel(STAFF_ONLY), readable) == {STAFF_ONLY}


async def test_a_guest_without_history_keeps_the_channel_out_of_public_answers(tmp_path):
    """A public answer in the staff channel is seen by the guest, who may not read its
    history: by no route does it quote that channel."""
    async with gated_harness(tmp_path, guest=True) as h:
        room = h.guild.get_channel(STAFF_ONLY)
        assert room is not None
        assert any(isinstance(target, discord.Object) for target in room.overwrites)
        guest = discord.Member(data=member(GUEST, "guest"), guild=h.guild, state=h.state)
        perms = room.permissions_for(guest)
        assert perms.view_channel and not perms.read_message_history
        assert readable_channel_ids(guest) == set()
        readable = readable_channel_ids(gated_alice(h))
        assert readable == {GENERAL, STAFF_ONLY}
        assert public_reply_sources(room, readable) == set()

        mention = h.message(f"<@{BOT_ID}> where is the {WORD}", author=(ALICE, "alice"),
                            channel=STAFF_ONLY, roles=[GATED_MEMBER, STAFF],
                            mentions=[user(BOT_ID, "memorybot", bot=True)])
        await h.dispatch("message", mention)
        channel_id, payload = h.sent[-1]
        assert channel_id == STAFF_ONLY  # a public reply, which the guest sees arrive
        assert "salary sheet" not in str(payload)

        invoker = member(ALICE, "alice", roles=[GATED_MEMBER, STAFF])
        await h.slash("search", invoker=invoker, where=STAFF_ONLY, query=WORD, private=False)
        public = h.adapter.followups[0]
        assert not (public.get("flags") or 0) & 64  # public: the guest sees it
        assert "salary sheet" not in str(public)
        # alice herself may read the staff channel: her private search finds it
        await h.slash("search", invoker=invoker, where=STAFF_ONLY, query=WORD, private=True)
        assert "salary sheet" in str(h.adapter.followups[-1])


# -- Discord's age gate -----------------------------------------------------------------------

async def test_an_age_restricted_channel_answers_only_past_the_age_gate(harness):
    """Discord shows an age-restricted channel to no member under 18, whatever their
    permissions; the bot cannot know an age, so it quotes one only to a request made
    inside an age-restricted channel (or in an age-restricted server)."""
    h = harness
    await h.slash("search", invoker=_invoker(BOB), where=GENERAL, query=WORD, limit=10)
    assert ADULTS not in _quoted(h.adapter.texts())
    target = h.message(f"{WORD} question", author=(BOB, "bob"), channel=GENERAL)
    assert ADULTS not in _quoted(await _run_context_menu(h, BOB, target))
    h.adapter.followups.clear()
    await h.slash("search", invoker=_invoker(BOB), where=ADULTS, query=WORD, limit=10)
    assert ADULTS in _quoted(h.adapter.texts())
    # the whole server age-restricted (Discord's NSFW level 3): every member passed the gate
    h.state.parse_guild_update(server() | {"nsfw_level": 3})
    h.adapter.followups.clear()
    await h.slash("search", invoker=_invoker(BOB), where=GENERAL, query=WORD, limit=10)
    assert _quoted(h.adapter.texts()) == READABLE[BOB]


# -- a member in timeout may not connect: no voice chat is every member's ---------------------

async def test_a_public_answer_quotes_no_voice_chat_a_timed_out_reader_cannot_read(harness):
    """discord.py's timeout rule (as Discord's) takes Connect away, and without it a voice
    chat is closed: a room open to everyone is still no source for a public answer in
    another channel, where a member in timeout reads it."""
    h = harness
    lounge = 650
    h.state.parse_channel_create(channel(lounge, G, "lounge", type=2, overwrites=[
        overwrite(G, allow=CONNECT)]) | {"bitrate": 64000, "user_limit": 0, "guild_id": str(G)})
    await h.listeners.on_message(h.message(f"{WORD} note in channel {lounge}",
                                           author=(OTHER, "olga"), channel=lounge))
    await h.runtime.writes.stop()
    h.runtime.writes.start()
    h.engine.embed_pending()
    timed_out = discord.Member(data=member(BOB, "bob", roles=ROLES[BOB])
                               | {"communication_disabled_until": "2999-01-01T00:00:00+00:00"},
                               guild=h.guild, state=h.state)
    assert lounge not in await h.search.allowed_channels(timed_out)
    assert lounge in await h.search.allowed_channels(as_member(h, ALICE))
    assert not everyone_can_read(h.guild.get_channel(lounge))
    quoted = await h.search.allowed_channels(as_member(h, ALICE), h.guild.get_channel(GENERAL))
    assert lounge not in quoted
    inside = await h.search.allowed_channels(as_member(h, ALICE), h.guild.get_channel(lounge))
    assert lounge in inside  # a reply inside the room may quote it


# -- Manage Server is not View Channel ----------------------------------------------------------

async def test_purge_channel_tells_counts_only_to_an_admin_who_may_read_it(harness):
    h = harness
    await h.slash("memory-admin purge-channel", invoker=_invoker(BOB), where=GENERAL,
                  permissions=discord.Permissions(manage_guild=True),
                  channel=h.guild.get_channel(STAFF_ONLY))
    assert h.adapter.followups[-1]["content"] == (
        f"Forgot everything stored from <#{STAFF_ONLY}> and its threads.")
    await h.slash("memory-admin purge-channel", invoker=_invoker(ALICE), where=GENERAL,
                  permissions=discord.Permissions(manage_guild=True),
                  channel=h.guild.get_channel(STAFF_LOG))
    assert h.adapter.followups[-1]["content"] == (
        f"Forgot 1 messages from <#{STAFF_LOG}> and its threads.")


@pytest.mark.parametrize(("uid", "thread_id", "told"), [
    (BOB, PRIVATE_THREAD, False), (BOB, ARCHIVED_PRIVATE, False),  # not in it, no Manage Threads
    (ALICE, PRIVATE_THREAD, True), (CAROL, ARCHIVED_PRIVATE, True),  # a member; a thread manager
])
async def test_purge_channel_tells_a_private_threads_count_only_to_who_may_read_it(
    harness, uid, thread_id, told
):
    """Discord's resolved permissions for a thread are its parent's: they do not say whether
    the admin is in a private thread, so they alone cannot open its count."""
    h = harness
    # the thread as Discord resolves it, with the admin's permissions in its parent
    await h.slash("memory-admin purge-channel", invoker=_invoker(uid), where=GENERAL,
                  permissions=discord.Permissions(manage_guild=True),
                  channel=discord.Object(thread_id),
                  archived=[archived_thread(thread_id, GENERAL, private=True)])
    what = "1 messages" if told else "everything stored"
    assert h.adapter.followups[-1]["content"] == (
        f"Forgot {what} from <#{thread_id}> and its threads.")


# -- stored threads, indexed by parent ----------------------------------------------------

def _one_by_one(member_: discord.Member, threads: list[StoredThread], age_verified: bool,
                cached_readable: frozenset[int]) -> set[int]:
    """The rule of the module docstring, thread by thread: an uncached stored thread is
    readable where its parent is (a private or untyped one only with Manage Threads)."""
    g = member_.guild
    out = set()
    for stored in threads:
        parent = g.get_channel(stored.parent_id or 0)
        if g.get_thread(stored.id) is not None or parent is None:
            continue
        if isinstance(parent, discord.CategoryChannel):
            continue
        if not age_verified and parent.is_nsfw():
            continue
        perms = parent.permissions_for(member_)
        if perms.view_channel and perms.read_message_history and (
                not stored.private or perms.manage_threads):
            out.add(stored.id)
    return out | cached_readable


def _many_stored_threads() -> list[StoredThread]:
    """Threads under every channel (and none), of every stored type, some the cache holds."""
    kinds = ["public_thread", "private_thread", "GuildPublicThread", "GuildPrivateThread",
             "news_thread", "", "None"]
    parents = [GENERAL, NO_BOB, STAFF_ONLY, STAFF_LOG, ANNOUNCE, STAFF_VOICE, ADULTS, HELP_DESK,
               PUBLIC_CAT, STAFF_CAT, ELSEWHERE, None, 0]
    threads = [StoredThread(9000 + i * len(kinds) + k, parent, kind)
               for i, parent in enumerate(parents) for k, kind in enumerate(kinds)]
    # the cached threads stored too (the cache judges them), and an id stored twice
    return [*threads, StoredThread(PUBLIC_THREAD, GENERAL, "public_thread"),
            StoredThread(PRIVATE_THREAD, GENERAL, "public_thread"),
            StoredThread(9000, STAFF_ONLY, "private_thread")]


@pytest.mark.parametrize("uid", list(READABLE))
def test_stored_threads_by_parent_are_judged_as_one_by_one(harness, uid):
    who = as_member(harness, uid)
    threads = _many_stored_threads()
    for gate in (False, True):
        cached_only = readable_channel_ids(who, (), age_verified=gate)
        expected = _one_by_one(who, threads, gate, cached_only)
        assert readable_channel_ids(who, threads, age_verified=gate) == expected
        assert readable_channel_ids(who, StoredThreads(threads), age_verified=gate) == expected
    # a public reply: a stored public thread whose parent everyone reads (or the reply's
    # own channel) may be quoted; a private, untyped or parentless one never
    readable = readable_channel_ids(who, threads, age_verified=True)
    g = harness.guild
    for place in (g.get_channel(GENERAL), g.get_channel(STAFF_ONLY), g.get_thread(PRIVATE_THREAD)):
        quoted = public_reply_sources(place, readable, StoredThreads(threads))
        assert quoted == public_reply_sources(place, readable, threads)
        stored = {t.id: t for t in threads if g.get_thread(t.id) is None}
        for tid in readable & set(stored) - {place.id}:
            parent = stored[tid].parent_id
            assert (tid in quoted) == (not stored[tid].private and parent is not None and (
                (parent == getattr(place, "parent_id", None) and not place.is_private())
                or parent == place.id or everyone_can_read(g.get_channel(parent)))), tid


async def test_the_search_indexes_stored_threads_off_the_event_loop(harness, monkeypatch):
    import sys
    import threading

    # the bot's extension is imported afresh for each bot: its own module's class
    indexed = sys.modules[type(harness.search).__module__].StoredThreads
    built_on = []
    index = indexed.from_rows

    def recorded(rows):
        built_on.append(threading.current_thread())
        return index(rows)

    monkeypatch.setattr(indexed, "from_rows", staticmethod(recorded))
    readable = await harness.search.allowed_channels(as_member(harness, ALICE))
    assert readable == SEARCHABLE[ALICE]
    assert built_on and threading.main_thread() not in built_on
