"""Who may read what: the allow-lists every member-facing search is limited to.

A search on behalf of a member may only find messages in channels and threads
that member can read *now* (view channel + read message history; for a voice or
stage channel's text chat also connect; for a private thread: a current member of
it, or someone who can manage threads in its parent).  An age-restricted channel
(and its threads) Discord shows to no one under 18, whatever their permissions, and
the bot cannot know a member's age: it answers only requests made past the age gate,
inside an age-restricted channel or in an age-restricted server (:func:`age_verified`).
A reply that others will read (a mention reply, ``/search private:False``) is further
limited to sources that everyone who can read the reply channel can also read: its
own channel only where nobody who sees new messages there is refused its history,
never an age-restricted channel elsewhere, and no voice or stage chat but its own.

Everything is computed from discord.py's cache at request time; the engine gets
the result as ``SearchRequest.allowed_channel_ids`` and filters inside its KNN
and keyword stages.  Threads the cache does not hold (archived ones) are judged
from what the database knows of them (:class:`StoredThread`): a public thread is
readable where its parent is; an uncached private thread only by members who can
manage threads there, because its participants cannot be known without asking
Discord.  A thread whose type the database does not know (an event that did not
say) is judged like a private one: "unknown" is never "public".

Stored threads come as :class:`StoredThreads`, indexed by parent on a worker thread
(a guild may hold tens of thousands): on the event loop the allow-lists then cost one
step per channel and cached thread, and set operations for the stored ones (judging
20,000 stored threads one by one took 80-180 ms of the loop on a 2-core CPU).

Thread membership is what discord.py's cache knows (``THREAD_MEMBERS_UPDATE``,
``THREAD_LIST_SYNC``).  A private thread's creator is a member only until they
leave or are removed, so ``owner_id`` grants nothing: where the cache does not
list a member, only Manage Threads in the parent opens the thread.
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass

import discord

# how a public thread's type is stored: by live capture, and by DiscordChatExporter; any
# other stored type of a thread (private, "", or "None" written by older versions) is
# judged as private
_PUBLIC_THREAD_TYPES = frozenset({
    str(discord.ChannelType.public_thread), str(discord.ChannelType.news_thread),
    "GuildPublicThread", "GuildNewsThread",
})


@dataclass(frozen=True)
class StoredThread:
    """A thread the database holds messages from: its id, parent channel and type."""

    id: int
    parent_id: int | None
    type: str

    @property
    def private(self) -> bool:
        """Whether only members and thread managers may read it (also when its type is unknown)."""
        return self.type not in _PUBLIC_THREAD_TYPES


_NONE: frozenset[int] = frozenset()


class StoredThreads:
    """The threads a database holds messages from, indexed by parent channel.

    Build it off the event loop (:meth:`from_rows` on a worker thread); the
    allow-lists then judge all of a parent's stored threads at once.

    Args:
        threads: The stored threads (an id listed twice is judged as each entry says
            for a member's allow-list, as its last entry says for a public reply).
    """

    def __init__(self, threads: Iterable[StoredThread] = ()) -> None:
        public: dict[int, set[int]] = {}
        private: dict[int, set[int]] = {}
        latest: dict[int, StoredThread] = {}
        for stored in threads:
            kind = private if stored.private else public
            kind.setdefault(stored.parent_id or 0, set()).add(stored.id)
            latest[stored.id] = stored
        # every entry, by parent (0: none known), for the member's allow-list
        self.public = {parent: frozenset(ids) for parent, ids in public.items()}
        self.private = {parent: frozenset(ids) for parent, ids in private.items()}
        # the last entry of each id, for a public reply: every id, and the public ones
        # whose parent is known, by parent
        self.ids = frozenset(latest)
        quotable: dict[int, set[int]] = {}
        for stored in latest.values():
            if not stored.private and stored.parent_id is not None:
                quotable.setdefault(stored.parent_id, set()).add(stored.id)
        self.quotable = {parent: frozenset(ids) for parent, ids in quotable.items()}

    @classmethod
    def from_rows(cls, rows: Iterable[tuple[int, int | None, str]]) -> StoredThreads:
        """From ``(thread_id, parent_id, type)`` rows, as the storage's ``threads()`` gives."""
        return cls(StoredThread(*row) for row in rows)

    @classmethod
    def of(cls, threads: StoredThreads | Iterable[StoredThread]) -> StoredThreads:
        """``threads`` indexed (as given when they already are)."""
        return threads if isinstance(threads, StoredThreads) else cls(threads)


_VOCAL = (discord.VoiceChannel, discord.StageChannel)  # text chat needs connect too


def _reads(perms: discord.Permissions, channel: object = None) -> bool:
    """Whether ``perms`` (in ``channel``) open its history: a voice or stage channel's
    text chat is closed to those who may not connect, whatever else they may do."""
    if isinstance(channel, _VOCAL) and not perms.connect:
        return False
    return perms.view_channel and perms.read_message_history


def can_read(member: discord.Member, channel: discord.abc.GuildChannel | discord.Thread) -> bool:
    """Whether ``member`` can read ``channel``'s history right now."""
    if isinstance(channel, discord.Thread):
        parent = channel.parent
        if parent is None:
            return False  # parent not cached: nothing to judge by, so no
        perms = channel.permissions_for(member)
        if not _reads(perms):
            return False
        if channel.is_private():
            # the creator (owner_id) is a member only until they leave or are removed,
            # which THREAD_MEMBERS_UPDATE tells the cache: membership alone decides
            return perms.manage_threads or any(m.id == member.id for m in channel.members)
        return True
    if isinstance(channel, discord.CategoryChannel):
        return False
    return _reads(channel.permissions_for(member), channel)


def age_verified(place: object) -> bool:
    """Whether a request made in ``place`` comes from past Discord's age gate: the
    channel (for a thread, its parent) is age-restricted, or the whole server is."""
    guild = getattr(place, "guild", None)
    if not isinstance(guild, discord.Guild):
        return False
    if guild.nsfw_level is discord.NSFWLevel.age_restricted:
        return True
    return _age_restricted(place)


def _age_restricted(channel: object) -> bool:
    is_nsfw = getattr(channel, "is_nsfw", None)  # a thread's follows its parent
    return bool(is_nsfw()) if callable(is_nsfw) else False


def readable_channel_ids(
    member: discord.Member, stored_threads: StoredThreads | Iterable[StoredThread] = (), *,
    age_verified: bool = False,
) -> frozenset[int]:
    """Ids of every channel and thread in ``member``'s guild they can read now.

    Args:
        member: The member a search serves (with their current roles).
        stored_threads: Threads the database has messages from, so archived ones
            the cache does not hold are judged too.
        age_verified: The request comes from past the age gate (:func:`age_verified`);
            otherwise age-restricted channels and their threads are left out.
    """
    guild = member.guild
    readable: set[int] = set()
    parent_perms: dict[int, discord.Permissions] = {}
    for channel in guild.channels:
        if isinstance(channel, discord.CategoryChannel):
            continue
        if not age_verified and _age_restricted(channel):
            continue  # its threads, cached or stored, find no parent permissions either
        perms = channel.permissions_for(member)
        parent_perms[channel.id] = perms
        if _reads(perms, channel):
            readable.add(channel.id)
    cached: set[int] = set()
    for thread in guild.threads:
        cached.add(thread.id)
        if (age_verified or not _age_restricted(thread)) and can_read(member, thread):
            readable.add(thread.id)
    # a stored thread the cache holds was judged above; the others by their parent: a
    # public one where the parent is readable, a private one only with Manage Threads
    stored = StoredThreads.of(stored_threads)
    for parent_id, parent in parent_perms.items():
        if not _reads(parent):
            continue
        readable |= stored.public.get(parent_id, _NONE) - cached
        if parent.manage_threads:
            readable |= stored.private.get(parent_id, _NONE) - cached
    return frozenset(readable)


def everyone_can_read(channel: discord.abc.GuildChannel | discord.Thread | None) -> bool:
    """Whether every member of the guild can read ``channel``.

    True when ``@everyone`` may view it and read its history and no role or member
    overwrite takes any of it away; for a public thread, when that holds for its
    parent.  An age-restricted channel is never everyone's: Discord keeps it from
    members under 18.  Nor is a voice or stage channel's chat: a member in timeout may
    not connect, and without Connect its chat is closed (a reply inside it may still
    quote it, :func:`public_reply_sources`).
    """
    if channel is None:
        return False
    if isinstance(channel, discord.Thread):
        return not channel.is_private() and everyone_can_read(channel.parent)
    if isinstance(channel, discord.CategoryChannel):
        return False
    if getattr(channel, "nsfw", False) or isinstance(channel, _VOCAL):
        return False
    if not _reads(channel.permissions_for(channel.guild.default_role), channel):
        return False
    return not _denies(channel, _READING)


_HISTORY = discord.Permissions(read_message_history=True).value
_READING = discord.Permissions(view_channel=True, read_message_history=True).value


def _history_for_all_who_see(channel: discord.abc.GuildChannel) -> bool:
    """Whether everyone who sees new messages in ``channel`` may also read its history.

    True when no overwrite denies Read Message History and either ``@everyone`` has it
    there (from the guild or its overwrite) or every role and member overwrite that
    may open the channel's view brings history with it (a gated server, where a
    "member" role grants both).  When unsure, False: the answer then quotes only what
    every member can read.
    """
    if _denies(channel, _HISTORY):
        return False
    overwrites = channel.overwrites

    def gives(target: discord.Role | discord.Member | discord.Object,
              perms: discord.Permissions, name: str) -> bool:
        allowed = overwrites.get(target)
        return (perms.administrator or getattr(perms, name)
                or (allowed is not None and getattr(allowed, name) is True))

    for role in channel.guild.roles:  # @everyone first
        if gives(role, role.permissions, "read_message_history"):
            if role.is_default():
                return True  # every member has it
            continue
        if gives(role, role.permissions, "view_channel"):
            return False  # this role may open the view without history
    # a member overwrite that opens the view without history; without the members
    # intent discord.py keys it by a discord.Object, not a Member: any non-role key
    empty = discord.Permissions.none()
    return not any(not isinstance(target, discord.Role) and gives(target, empty, "view_channel")
                   and not gives(target, empty, "read_message_history")
                   for target in overwrites)


def _denies(channel: discord.abc.GuildChannel, bits: int) -> bool:
    """Whether any role or member overwrite in ``channel`` denies one of ``bits``."""
    raw = getattr(channel, "_overwrites", None)
    if raw is not None:  # discord.py's raw overwrite list: 0.2 µs instead of 40 µs for .overwrites
        return any(entry.deny & bits for entry in raw)
    return any(deny.value & bits for _, deny in (o.pair() for o in channel.overwrites.values()))


def public_reply_sources(
    reply_channel: discord.abc.GuildChannel | discord.Thread,
    candidates: Iterable[int],
    stored_threads: StoredThreads | Iterable[StoredThread] = (),
) -> frozenset[int]:
    """The ``candidates`` a reply posted in ``reply_channel`` may quote.

    A source qualifies when everyone who can read the reply channel can read it
    too: the reply channel itself; its parent, when the reply is in a thread;
    public threads of the same channel; and channels (and their public threads)
    every member of the guild can read.  The first three only where everyone who
    sees the reply may read the channel's history (a member who may view a channel
    but not its history still sees the reply arrive).  Pass the asking member's
    readable ids as ``candidates``, so the answer is also limited to what they may see.
    """
    guild = reply_channel.guild
    home: int | None = reply_channel.id
    family = {reply_channel.id}  # sources whose readers include everyone who reads the reply
    channel: discord.abc.GuildChannel | None = None  # whose history rules the reply's readers have
    if isinstance(reply_channel, discord.Thread):
        channel = reply_channel.parent
        if reply_channel.parent_id is not None:
            family.add(reply_channel.parent_id)
            if not reply_channel.is_private():
                home = reply_channel.parent_id  # public threads share their parent's readers
    else:
        channel = reply_channel
    if channel is None or not _history_for_all_who_see(channel):
        family, home = set(), None  # only what everyone in the guild may read
    stored = StoredThreads.of(stored_threads)
    world: dict[int, bool] = {}

    def world_readable(channel_id: int) -> bool:
        if channel_id not in world:
            world[channel_id] = everyone_can_read(guild.get_channel(channel_id))
        return world[channel_id]

    def quotable_thread(private: bool, parent_id: int | None) -> bool:
        return (not private and parent_id is not None
                and (parent_id == home or world_readable(parent_id)))

    wanted = set(candidates)
    safe = wanted & family
    rest = wanted - family
    cached: set[int] = set()
    for thread in guild.threads:  # judged by what the cache says of them
        cached.add(thread.id)
        if thread.id in rest and quotable_thread(thread.is_private(), thread.parent_id):
            safe.add(thread.id)
    rest -= cached
    for parent_id, ids in stored.quotable.items():  # stored public threads, by parent
        found = ids & rest
        if found and quotable_thread(False, parent_id):
            safe |= found
    for source in rest - stored.ids:  # channels
        if world_readable(source):
            safe.add(source)
    return frozenset(safe)
