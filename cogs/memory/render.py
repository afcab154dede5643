"""How search results look in Discord: embeds within Discord's limits, text made inert.

Stored text is shown as data, never as markup: markdown, masked links and
mentions in a remembered message are escaped so a result cannot ping anyone or
disguise a link.
"""

from __future__ import annotations

import re

import discord

from memory.records import Hit, SearchResult

SNIPPET = 300  # characters of a message shown per hit
EMBED_FIELDS = 25  # Discord's limits
FIELD_NAME, FIELD_VALUE, TITLE, FOOTER, EMBED_TOTAL = 256, 1024, 256, 2048, 6000

_MASKED_LINK_CHARS = re.compile(r"([\[\]()<>])")


def inert(text: str, limit: int = SNIPPET) -> str:
    """One line of stored text with markdown, links and mentions disarmed, at most
    ``limit`` characters once disarmed (escaping lengthens it: Discord refuses an embed
    whose title or field is over its limit), never cut inside an escape."""
    text = " ".join(text.split())
    out = _disarmed(text)
    if len(out) <= limit:
        return out
    low, high = 0, min(len(text), limit)  # the longest prefix that fits, by bisection
    while low < high:
        middle = (low + high + 1) // 2
        if len(_disarmed(text[:middle])) < limit:
            low = middle
        else:
            high = middle - 1
    return _disarmed(text[:low]) + "…"


def _disarmed(text: str) -> str:
    text = discord.utils.escape_markdown(text)
    text = _MASKED_LINK_CHARS.sub(r"\\\1", text)
    return discord.utils.escape_mentions(text)


def author_label(hit: Hit, guild: discord.Guild | None) -> str:
    """The author's current server nickname when known, else the stored name."""
    member = guild.get_member(hit.author_id) if guild is not None else None
    return member.display_name if member is not None else (hit.author_name or "unknown")


def hit_field(rank: int, hit: Hit, guild: discord.Guild | None) -> tuple[str, str]:
    """An embed field (name, value) for one hit: who, where, when, what, and a jump link."""
    name = f"{rank}. {author_label(hit, guild)}"[:FIELD_NAME]
    text = inert(hit.content) if hit.content.strip() else "*(attachment only)*"
    when = f"<t:{hit.created_at // 1000}:R>"
    value = f"{text}\n<#{hit.channel_id}> · {when} · [jump]({hit.jump_url})"
    if len(value) > FIELD_VALUE:  # keep the link: cut the text instead
        tail = value[len(text):]
        value = text[: FIELD_VALUE - len(tail) - 1] + "…" + tail
    return name, value


def render_hits(
    result: SearchResult,
    title: str,
    guild: discord.Guild | None,
) -> discord.Embed:
    """An embed listing hits.

    It says nothing of hits a public answer left out: that channels the audience
    cannot read hold matches is itself news to them (:func:`withheld_note` tells
    only the asker).
    """
    embed = discord.Embed(title=inert(title, TITLE - 4), colour=discord.Colour.blurple())
    if not result.hits:
        embed.description = f"Nothing found: {result.empty_reason or 'no match'}."
    total = len(embed.title or "") + len(embed.description or "")
    for rank, hit in enumerate(result.hits[:EMBED_FIELDS], start=1):
        name, value = hit_field(rank, hit, guild)
        if total + len(name) + len(value) > EMBED_TOTAL - FOOTER:
            break
        embed.add_field(name=name, value=value, inline=False)
        total += len(name) + len(value)
    trace = result.trace
    footer = f"{trace.timings_ms.get('total', 0):.0f} ms"
    if trace.reranked:
        footer += f" · reranked by {trace.rerank_backend}"
    embed.set_footer(text=footer[:FOOTER])
    return embed


def withheld_note(withheld: int) -> str:
    """What the asker alone is told (ephemerally) about hits a public answer left out.

    Args:
        withheld: How many of the asker's own top hits the public answer left out.
    """
    plural = "s" if withheld != 1 else ""
    return (f"Only you can see this: {withheld} more result{plural} left out of the public "
            "answer, from channels not everyone there can read. Search again privately (the "
            "default) to see them.")
