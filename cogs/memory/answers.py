"""Grounded answers on Discord: the glue between a mention and the chat model.

Small functions the search cog (:mod:`cogs.memory.search`) calls from its mention reply,
and the helper behind its public ``await cog.context_for(...)``:

* :func:`fetch_context` turns a message or an interaction into a context from the
  engine (in a worker thread), inside the caller's channel allow-list;
* :func:`answer_mention` replies to a mention: it streams the chat model's answer
  into one reply (edits at most about once a second), renders ``[n]`` citations as
  jump links, never pings anyone, fits Discord's 2000 characters, and falls back to
  the plain list of hits when there is no ``[llm]``, the model fails or times out;
Whether a message gets an answer at all (the per-guild ``off`` / ``mention`` /
``channels`` switch, cooldowns) is the search cog's decision (``GuildSettings.answers_in``).
Nothing here imports the cogs or their runtime; the engine and chat client come in as
arguments.
"""

from __future__ import annotations

import asyncio
import functools
import logging
import re
import threading
import time
from collections.abc import Awaitable, Callable, Collection
from typing import TYPE_CHECKING, Any

import discord

from cogs.memory.errors import engine_error
from cogs.memory.render import render_hits
from memory.config import Profile
from memory.context import Context, build_messages
from memory.errors import (
    ChatModelError,
    ChatModelTimeout,
    ConfigError,
    MemoryBotError,
    SearchInputError,
)
from memory.llm import ChatAnswer, ChatClient, visible_text
from memory.records import SearchResult
from memory.search import SearchRequest

if TYPE_CHECKING:
    from memory.engine import MemoryEngine

log = logging.getLogger(__name__)

MESSAGE_LIMIT = 2000
MAX_PARTS = 3  # an answer longer than this many messages is trimmed
EDIT_INTERVAL_S = 1.0
CONTEXT_LIMIT = 5  # hits searched for; each grows into an excerpt
FALLBACK_HITS = 3  # hits listed when there is no model answer, as the plain mention reply
PLACEHOLDER = "…"
NO_MENTIONS = discord.AllowedMentions.none()
_CITATION = re.compile(r"\[(\d{1,3}(?:\s*,\s*\d{1,3})*)\]")

# Told which messages the reply posted (ids) and which stored messages they show
# (``Retractions.record`` with the guild and channel bound: taken down if one goes).
Recorder = Callable[[list[int], list[int]], None]
# Runs a blocking engine call off the event loop: ``asyncio.to_thread`` by default; the
# search cog passes the runtime's bounded search pool (``MemoryRuntime.searching``).
Runner = Callable[..., Awaitable[Any]]
_MASKED_LINK = re.compile(r"\]\s*\(")
MAX_QUERY_CHARS = 500


# -- context for the cog and for other cogs -------------------------------------------------


def question_text(message: discord.Message) -> str:
    """The message's text without mentions of bots (this one's), whitespace collapsed."""
    text = message.content
    for user in message.mentions:
        if user.bot:
            text = text.replace(f"<@{user.id}>", " ").replace(f"<@!{user.id}>", " ")
    return " ".join(text.split())


async def fetch_context(
    engine: MemoryEngine,
    message_or_interaction: discord.Message | discord.Interaction,
    query: str | None = None,
    *,
    allowed_channel_ids: Collection[int] | None,
    budget_tokens: int | None = None,
    limit: int = CONTEXT_LIMIT,
    run: Runner = asyncio.to_thread,
) -> Context:
    """Retrieve conversations about a message's (or a given) question, off the event loop.

    Args:
        engine: The memory engine.
        message_or_interaction: Where the question comes from; its guild is the scope.
        query: The question; by default a message's text without the bot's mention
            (an interaction has no text of its own: pass ``query``).
        allowed_channel_ids: Channels and threads whose messages may be shown
            (the asking member's readable channels, narrowed to what everyone in the
            reply channel can read for a public reply); ``None`` means no restriction.
        budget_tokens: Token budget of the quoted history (the profile's by default).
        limit: Hits to search for; each grows into an excerpt of neighbours.
        run: How to run the engine call off the loop (``run(fn, *args)``).

    Returns:
        The context: numbered lines with jump URLs, in time order, and the trace.

    Raises:
        SearchInputError: Outside a guild, or no question.
    """
    source = message_or_interaction
    guild_id = source.guild.id if source.guild is not None else None
    if guild_id is None:
        raise SearchInputError("memory context is only available inside a server")
    exclude: tuple[int, ...] = ()
    if isinstance(source, discord.Message):
        query = query if query is not None else question_text(source)
        exclude = (source.id,)  # the question was just stored; it is not its own answer
    if not query or not query.strip():
        raise SearchInputError("give a question to look up")
    query = query.strip()[:MAX_QUERY_CHARS]
    allowed = None if allowed_channel_ids is None else tuple(sorted(allowed_channel_ids))
    scope = SearchRequest(queries=(query,), guild_id=guild_id, limit=limit,
                          allowed_channel_ids=allowed)
    call = functools.partial(engine.context_for, exclude_ids=exclude)
    return await run(call, query, scope, budget_tokens)


# -- rendering ---------------------------------------------------------------------------


def render_answer(text: str, context: Context) -> str:
    """The model's answer for Discord: reasoning removed, mentions defused, the model's
    own masked links disarmed (quoted chat could talk it into a disguised link), and
    each ``[n]`` citation a jump link (numbers no line has stay plain text)."""
    text = discord.utils.escape_mentions(visible_text(text))
    text = _MASKED_LINK.sub(r"]\\(", text)

    def link(match: re.Match) -> str:
        parts = []
        for number in (int(p) for p in match.group(1).split(",")):
            line = context.source(number)
            parts.append(f"[[{number}]](<{line.jump_url}>)" if line else f"[{number}]")
        return "".join(parts)

    return _CITATION.sub(link, text)


def split_message(text: str, limit: int = MESSAGE_LIMIT, max_parts: int = MAX_PARTS) -> list[str]:
    """Split text into Discord-sized parts at line breaks, else spaces (links stay whole).

    Past ``max_parts`` the last part is trimmed with an ellipsis.
    """
    parts: list[str] = []
    rest = text.strip()
    while rest:
        if len(rest) <= limit:
            parts.append(rest)
            break
        cut = rest.rfind("\n", 0, limit)
        if cut < limit // 2:
            cut = rest.rfind(" ", 0, limit)
        if cut <= 0:
            cut = limit
        parts.append(rest[:cut].rstrip())
        rest = rest[cut:].strip()
    if len(parts) > max_parts:
        parts = parts[:max_parts]
        parts[-1] = trim(parts[-1] + " …", limit)
    return parts


def trim(text: str, limit: int = MESSAGE_LIMIT) -> str:
    """Cut text to ``limit`` characters with an ellipsis, at a space when one is near."""
    if len(text) <= limit:
        return text
    cut = text.rfind(" ", limit - 200, limit - 1)
    return text[: cut if cut > 0 else limit - 1].rstrip() + "…"


def hits_embed(context: Context, guild: discord.Guild | None, *,
               note: str | None = None) -> discord.Embed:
    """The fallback reply: the hits as the plain mention reply lists them, plus ``note``."""
    result = SearchResult(context.hits[:FALLBACK_HITS], context.trace, context.empty_reason)
    embed = render_hits(result, "Here is what I remember", guild)
    if note:
        embed.set_footer(text=f"{note} · {embed.footer.text}"[:2048])
    return embed


# -- streaming into one reply --------------------------------------------------------------


class EditThrottle:
    """Lets an edit through at most once per ``interval`` seconds (Discord rate limits)."""

    def __init__(self, interval: float = EDIT_INTERVAL_S,
                 clock: Callable[[], float] = time.monotonic) -> None:
        self.interval = interval
        self.clock = clock
        self._last: float | None = None

    def ready(self) -> bool:
        """True (and the clock restarts) when an edit may be sent now."""
        now = self.clock()
        if self._last is not None and now - self._last < self.interval:
            return False
        self._last = now
        return True


async def stream_answer(
    reply: discord.Message,
    client: ChatClient,
    messages: list[dict[str, str]],
    context: Context,
    *,
    throttle: EditThrottle | None = None,
) -> ChatAnswer:
    """Run the chat model in a worker thread and edit ``reply`` as text arrives.

    Raises:
        ChatModelError: The model failed, or gave nothing within its timeout
            (plus a little slack for the thread hand-over).
    """
    loop = asyncio.get_running_loop()
    queue: asyncio.Queue[tuple[str, Any]] = asyncio.Queue()
    cancel = threading.Event()

    def put(kind: str, value: Any) -> None:
        if not loop.is_closed():  # the reply may have given up and its loop ended
            loop.call_soon_threadsafe(queue.put_nowait, (kind, value))

    def work() -> None:
        try:
            put("done", client.answer(messages, lambda d: put("delta", d), cancel))
        except BaseException as exc:  # handed to the event loop, raised there
            put("error", exc)

    worker = loop.run_in_executor(None, work)
    throttle = throttle or EditThrottle()
    deadline = loop.time() + client.config.timeout_s + 2.0
    text, shown = "", PLACEHOLDER
    try:
        while True:
            try:
                kind, value = await asyncio.wait_for(queue.get(), deadline - loop.time())
            except TimeoutError:
                raise ChatModelTimeout(f"no answer within {client.config.timeout_s:g} s") from None
            if kind == "error":
                raise value
            if kind == "done":
                return value
            text += value
            preview = trim(render_answer(text, context)) or PLACEHOLDER
            if preview != shown and throttle.ready():
                await _edit(reply, content=preview)
                shown = preview
    finally:
        cancel.set()
        worker.add_done_callback(lambda f: f.exception())  # never "exception was never retrieved"


async def _edit(message: discord.Message, **fields: Any) -> bool:
    try:
        await message.edit(allowed_mentions=NO_MENTIONS, **fields)
    except discord.HTTPException as exc:
        log.warning("could not edit the answer %s: %s", message.id, exc)
        return False
    return True


# -- the mention reply -------------------------------------------------------------------


async def answer_mention(
    message: discord.Message,
    engine: MemoryEngine,
    client: ChatClient | None,
    *,
    allowed_channel_ids: Collection[int] | None,
    question: str | None = None,
    bot_name: str | None = None,
    throttle: EditThrottle | None = None,
    run: Runner = asyncio.to_thread,
    record: Recorder | None = None,
) -> discord.Message | None:
    """Reply to a message with a grounded answer, or with the list of hits.

    The reply never pings (``allowed_mentions`` none, mentions escaped).  With a
    chat client it first posts a placeholder, edits it as the answer streams in,
    and finally shows the answer with ``[n]`` as jump links, split over up to
    three messages.  Without a client, with nothing retrieved, or on any failure
    or timeout of the model, the reply is the list of hits (never silence).

    ``record`` is told the messages posted and the stored messages they show: the
    hits listed, or for the model's answer every line it was given (it may quote or
    paraphrase any of them).

    Returns:
        The reply, or ``None`` when there was no question to answer.
    """
    me = message.guild.me if message.guild is not None else None
    question = question if question is not None else question_text(message)
    if not question:
        return None
    try:
        context = await fetch_context(engine, message, question,
                                    allowed_channel_ids=allowed_channel_ids, run=run)
    except MemoryBotError as exc:  # said in the channel: a database's text stays in the log
        return await _reply(message, content=f"Search failed: {engine_error('mention reply', exc)}")
    listed = [hit.id for hit in context.hits[:FALLBACK_HITS]]
    if client is None or not context:
        reply = await _reply(message, embed=hits_embed(context, message.guild))
        _record(record, [reply], listed)
        return reply
    name = bot_name or (me.display_name if me is not None else "MemoryBot")
    messages = build_messages(question, context, bot=name)
    reply = await _reply(message, content=PLACEHOLDER)
    try:
        answer = await stream_answer(reply, client, messages, context, throttle=throttle)
        parts = split_message(render_answer(answer.text, context))
        if not parts:
            raise ChatModelError("the chat model returned an empty answer")
    except Exception as exc:  # any failure, ours or not: the hits, and the reason logged
        kind = getattr(exc, "kind", type(exc).__name__)
        log.warning("chat answer failed (%s): %s; replying with the hits", kind, exc)
        note = f"The chat model could not answer ({kind}); these are the matches"
        replaced = await _edit(reply, content=None,
                               embed=hits_embed(context, message.guild, note=note))
        # not replaced: the reply still shows what the model streamed from every line
        _record(record, [reply], listed if replaced else [line.id for line in context.lines])
        return reply
    await _edit(reply, content=parts[0])
    posted = [reply]
    try:
        for part in parts[1:]:
            posted.append(await message.channel.send(part, allowed_mentions=NO_MENTIONS))
    finally:  # what was posted is recorded, even when a later part failed
        _record(record, posted, [line.id for line in context.lines])
    return reply


def _record(record: Recorder | None, posted: list[discord.Message], quoted: list[int]) -> None:
    if record is not None and quoted:
        record([m.id for m in posted], quoted)


async def _reply(message: discord.Message, **fields: Any) -> discord.Message:
    return await message.reply(mention_author=False, allowed_mentions=NO_MENTIONS, **fields)


def make_chat_client(profile: Profile) -> ChatClient | None:
    """The chat client for a profile's ``[llm]``, or ``None`` when there is none.

    A broken ``[llm]`` (an unset API-key variable) is logged and treated as none,
    so mentions still get the list of hits.
    """
    if not profile.llm.enabled:
        return None
    try:
        return ChatClient(profile.llm)
    except ConfigError as exc:
        log.error("chat model disabled: %s", exc)
        return None
