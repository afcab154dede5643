"""The SQLite keyword index builds its FTS5 MATCH from plain terms: every term quoted,
so no word a member types is ever FTS5 syntax."""

from __future__ import annotations

import pytest

from memory.storage.sqlite.keywords import match_expression
from memory.text import query_terms


@pytest.fixture
def storage_kind() -> str:
    """These tests are about FTS5's query syntax."""
    return "sqlite"


@pytest.mark.parametrize("text, expected", [
    ('solder "iron" AND NEAR(x)', '"solder" OR "iron" OR "near" OR "x"'),
    ("", None),
    ("?!", None),
])
def test_fts_queries_are_quoted_terms(text: str, expected: str | None) -> None:
    assert match_expression(query_terms(text)) == expected


def test_match_expression_escapes_quotes() -> None:
    assert match_expression(['a"b']) == '"a""b"'
    assert match_expression([]) is None
