"""What a query's words become in the keyword search, and which lines count as content
(what the SQLite engine makes of those words: tests/storage/test_sqlite_keywords.py)."""

from __future__ import annotations

import pytest

from memory.text import content_words, query_terms


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
