"""Which members a query names: the indexed matcher against the plain definition.

The plain definition (``benchmarks.names.PlainNames``, which ``bench member-names``
times the index against) is a case-blind regular expression per name and display
name, a case-sensitive one per capitalised first name, and ``difflib`` over every
name for misspellings: what the search used before the names were indexed.  The
index must find exactly the same members, for any names and any text.
"""

from __future__ import annotations

import random
import re

import pytest

from benchmarks.names import PlainNames
from memory.search.names import MAX_FUZZY_NAMES, MemberNames, _bounded_spans, fold

MIXED_NAMES = [
    "priya", "Priya Raman", "ollie", "Ollie B", "kariton", "karitton", "user1", "user 1",
    "[AFK] bob", "bob!", "J.R.", "Zoë", "İlker", "Straße", "ΣΊΣΥΦΟΣ", "李小龙", "🍕 lover",
    "xX_gamer_Xx", "a.b", "Will", "Will Turner", "max-power", "o'neil", "   spaced   ",
    "MiXeD CaSe", "émile", "Émile Zola", "ab", "abc", "x" * 40,
]


def _mutate(rng: random.Random, name: str) -> str:
    """The name as a member might type it: recased, misspelt, cut or glued to a word."""
    choice = rng.randrange(6)
    if choice == 0:
        return name.upper()
    if choice == 1:
        return name.lower()
    if choice == 2 and len(name) > 1:  # one letter dropped, doubled or swapped
        i = rng.randrange(len(name) - 1)
        return rng.choice([name[:i] + name[i + 1:], name[:i] + name[i] + name[i:],
                           name[:i] + name[i + 1] + name[i] + name[i + 2:]])
    if choice == 3:
        return name + rng.choice(["s", "_x", "!", "'s", "1"])
    if choice == 4:
        return rng.choice(["re", "x", "@", "(", "_"]) + name
    return name


def _random_guild(rng: random.Random, size: int) -> list[tuple[int, str, str]]:
    members = []
    for author_id in range(1, size + 1):
        made_up = "".join(rng.choice("aeioukrtnmls") for _ in range(rng.randint(3, 10)))
        name = rng.choice([*MIXED_NAMES, made_up])
        display = rng.choice([*MIXED_NAMES, "", name, name.title()])
        members.append((author_id, name, display))
    return members


@pytest.mark.parametrize("seed", range(6))
def test_the_index_finds_exactly_who_the_plain_definition_finds(seed: int) -> None:
    rng = random.Random(seed)
    members = _random_guild(rng, rng.choice([3, 20, 120]))
    names, plain = MemberNames.build(members), PlainNames(members)
    filler = ["what", "did", "say", "about", "the", "printer", "yesterday", "?", ",", "—",
              "\n", "lol", "<@123456789012345678>", "café", "_", "..."]
    for _ in range(300):
        parts = []
        for _ in range(rng.randint(1, 8)):
            if rng.random() < 0.4:
                parts.append(_mutate(rng, rng.choice(rng.choice(members)[1:]) or "x"))
            else:
                parts.append(rng.choice(filler))
        text = rng.choice(["", " "]).join(parts) if rng.random() < 0.2 else " ".join(parts)
        assert names.named_in(text) == plain.named_in(text, fuzzy_limit=None), text


def test_names_in_text() -> None:
    names = MemberNames.build([
        (1, "p.raman", "Priya Raman"), (2, "will.t", "Will Turner"), (3, "karitton", ""),
        (4, "[AFK] bob", ""), (5, "zoë", ""),
    ])
    assert names.named_in("what did PRIYA RAMAN say") == {1}
    assert names.named_in("ask Priya") == {1}  # a capitalised first name will do
    assert names.named_in("ask priya") == set()
    assert names.named_in("Will said") == {2}
    assert names.named_in("it will rain") == set()  # but not a lower-case one
    assert names.named_in("kariton's printer") == {3}  # a close misspelling
    assert names.named_in("said [afk] BOB?") == {4}
    assert names.named_in("said x[AFK] bob") == set()  # glued to the word before it
    assert names.named_in("ZOË!") == {5}
    assert names.named_in("zoëy") == set()  # inside a longer word
    assert names.named_in("<@1> and <@!999999999999999999>") == set()  # not a member id
    assert names.named_in("") == set()


def test_a_mention_names_a_member_by_id() -> None:
    member = 123456789012345678
    names = MemberNames.build([(member, "somebody", "")])
    assert names.named_in("what did <@123456789012345678> say") == {member}
    assert names.named_in("what did <@!123456789012345678> say") == {member}


def test_misspellings_are_found_among_fifteen_thousand_names() -> None:
    # the matcher used to skip misspellings above 5,000 names; now above MAX_FUZZY_NAMES
    rng = random.Random(5)
    members = [(i, "".join(rng.choice("bcdfghjklmnpqrstvwxz") for _ in range(8)), "")
               for i in range(1, 15_000)]
    members.append((15_000, "karitton", ""))
    assert MemberNames.build(members).named_in("what did kariton say") == {15_000}
    members += [(i, f"member{i}", "") for i in range(15_001, 15_001 + MAX_FUZZY_NAMES)]
    names = MemberNames.build(members)
    assert names.fuzzy is None and names.named_in("what did kariton say") == set()
    assert names.named_in("what did karitton say") == {15_000}  # exact names still count


def test_hostile_text_is_matched_without_trouble() -> None:
    names = MemberNames.build([(1, "solder", ""), (2, "x" * 30, "")])
    assert names.named_in("solder iron " * 850) == {1}
    assert names.named_in("x" * 10_240) == set()  # one long word holds no 30-letter name
    assert names.named_in("\x00solder\x00") == {1}


@pytest.mark.parametrize(("text", "lengths", "firsts", "spans"), [
    ("ab cd", {2}, "ac", ["ab", "cd"]),
    ("ab cd", {2}, "c", ["cd"]),
    ("ab cd", {5}, "a", ["ab cd"]),
    ("ab,cd", {3}, "abcd,", []),  # none starts after a word letter or ends before one
    ("ab, cd", {3}, "a ", ["ab,", " cd"]),
    ("a_b c", {3}, "a", ["a_b"]),
    ("AB cd", {2, 5}, "a", ["AB", "AB cd"]),  # firsts are folded
    ("x y z w", {1, 3, 5, 7}, "x", ["x", "x y", "x y z", "x y z w"]),
    ("x y z w", {1, 7}, "xz", ["x", "x y z w", "z"]),  # more ends in reach than lengths
    ("", {1}, "a", []),
])
def test_bounded_spans(text: str, lengths: set[int], firsts: str, spans: list[str]) -> None:
    found = _bounded_spans(text, fold(text), frozenset(lengths), frozenset(firsts))
    assert [text[a:b] for a, b in found] == spans


def _case_partners(char: str) -> set[str]:
    """Characters a case-blind match might equate with ``char``: its cases, their cases,
    and the letters that fold to the same one."""
    partners = {char}
    for _ in range(2):
        partners |= {form for c in partners
                     for form in (c.lower(), c.upper(), c.title(), c.casefold()) if len(form) == 1}
    return partners


def test_fold_equates_exactly_the_letters_a_case_blind_regex_does() -> None:
    cased = [chr(cp) for cp in range(0x110000) if not 0xD800 <= cp <= 0xDFFF
             and (chr(cp).lower() != chr(cp) or chr(cp).upper() != chr(cp)
                  or chr(cp).casefold() != chr(cp))]
    by_fold: dict[str, set[str]] = {}
    for char in cased:
        by_fold.setdefault(fold(char), set()).add(char)
    for char in cased:
        for other in _case_partners(char) | by_fold[fold(char)]:
            regex = re.fullmatch(re.escape(char), other, re.I) is not None
            assert regex == (fold(char) == fold(other)), (char, other)
    assert len(fold("Straße ΣΊΣΥΦΟΣ İlker")) == len("Straße ΣΊΣΥΦΟΣ İlker")
