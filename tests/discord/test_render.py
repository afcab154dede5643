"""Embeds stay within Discord's limits however much escaping the text needs."""

from __future__ import annotations

import pytest

from cogs.memory.render import FIELD_VALUE, SNIPPET, TITLE, inert, render_hits
from memory.records import Hit, SearchResult, Trace

MARKUP = [
    "why does my_variable_name (and the other_one) break *everything* in [brackets]? " * 4,
    "*" * 300,
    "_" * 1000,
    "@everyone " * 60,
    "[click](https://example.com) <@123> " * 20,
    "a\\" * 200,
]


@pytest.mark.parametrize("text", MARKUP)
@pytest.mark.parametrize("limit", [SNIPPET, TITLE - 4, 40])
def test_inert_text_never_exceeds_its_limit_once_escaped(text, limit):
    out = inert(text, limit)
    assert len(out) <= limit
    assert out.endswith("…") and len(out) > limit // 3, "cut, not emptied"
    assert "@everyone" not in out and "](" not in out


def test_short_text_is_only_escaped():
    assert inert("a *bold* claim") == "a \\*bold\\* claim"


@pytest.mark.parametrize("query", MARKUP)
def test_a_long_query_with_markdown_fits_the_embed_title(query):
    """A 274-character question with a few ``_`` or ``*`` made a 262-character title:
    Discord refused the embed and the member got an error instead of results."""
    hit = Hit(id=1, guild_id=2, channel_id=3, author_id=4, author_name="bob",
              content=query * 3, created_at=1_700_000_000_000)
    embed = render_hits(SearchResult(hits=[hit], trace=Trace()), f"🔎 {query}", None)
    assert embed.title is not None and len(embed.title) <= TITLE
    assert all(len(field.value or "") <= FIELD_VALUE for field in embed.fields)
    assert len(embed) <= 6000
