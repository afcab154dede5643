"""What a query's words become in the keyword search, and which lines count as content
(what the SQLite engine makes of those words: tests/storage/test_sqlite_keywords.py)."""

from __future__ import annotations

import pytest

from memory.text import EMBED_CHARS, content_words, embedding_text, query_terms, valid_unicode


@pytest.mark.parametrize("query, terms", [
    ("What filament does Priya use?", ["filament", "priya", "use"]),
    ("hey guys, does anyone remember what Sam said about the router?", ["sam", "router"]),
    ("pls tell me when the raid is", ["raid"]),
    ("who?", ["who"]),  # nothing but stopwords: keep them rather than search for nothing
    ("C++ state-of-the-art", ["c", "state", "art"]),
    ("", []),
])
def test_question_words_and_chat_filler_leave_the_keyword_query(
    query: str, terms: list[str]
) -> None:
    assert query_terms(query) == terms


@pytest.mark.parametrize("text, words", [
    ("looks great", 0), ("noted. very noted.", 0), ("lol", 0), ("ok thx!!", 0), ("", 0),
    ("PETG for almost everything", 3), ("no 0.08 mm layers this time pls", 5),
])
def test_content_words(text: str, words: int) -> None:
    assert content_words(text) == words


@pytest.mark.parametrize("part", ["content", "attachments", "antecedent", "name"])
def test_the_embedded_text_stays_a_few_thousand_characters_whatever_a_message_holds(
    part: str,
) -> None:
    """Issue 31.2: a tokenizer reads all it is given before truncating; a 50 MB message
    took 8 GiB to embed.  Each part is cut to EMBED_CHARS, the message's start kept."""
    huge = "word " * 1_000_000  # 5 MB
    parts = {"display_name": "ann", "content": "the start of it", "attachments": ("a.png",),
             "antecedent_name": "bob", "antecedent_content": "before"}
    if part == "content":
        parts["content"] = "the start of it " + huge
    elif part == "attachments":
        parts["attachments"] = tuple(f"file{i}.png" for i in range(500_000))
    elif part == "antecedent":
        parts["antecedent_content"] = huge
    else:
        parts["display_name"] = huge
    text = embedding_text(**parts)
    assert len(text) <= 4 * EMBED_CHARS
    assert "the start of it" in text


def test_valid_unicode_replaces_only_lone_surrogates_and_nul() -> None:
    assert valid_unicode("a\x00b 🍕") == "a\ufffdb 🍕"
    assert valid_unicode("a\x00b") == "a\ufffdb"
    assert valid_unicode("tab\tand\nnewline é") == "tab\tand\nnewline é"
    assert valid_unicode("a\ud83db\udc00") == "a\ufffdb\ufffd"
    assert valid_unicode("plain ascii") == "plain ascii"
