"""``bench member-names``: finding the members a query names, as a server grows.

Every search with bonuses on checks its text for member names
(:mod:`memory.search.names`).  This times that index against the plain definition it
replaced (a case-blind regular expression per name and display name, and
``difflib`` over every name for misspellings, patterns compiled once), side by
side in one run on synthetic members, and counts the queries on which the two
disagree.
"""

from __future__ import annotations

import difflib
import random
import re
import time
from collections.abc import Sequence
from typing import Any

from benchmarks.common import machine_description, percentile
from benchmarks.scale import _vocabulary, _words
from memory.search.names import MemberNames

PLAIN_FUZZY_LIMIT = 5000  # the plain definition skipped misspellings above this many names


class PlainNames:
    """The plain definition: one pattern per name, ``difflib`` over every name."""

    def __init__(self, members: Sequence[tuple[int, str, str]]) -> None:
        self.ids = {m[0] for m in members}
        self.patterns: list[tuple[int, re.Pattern]] = []
        self.fuzzy: dict[str, set[int]] = {}
        for author_id, name, display in members:
            for label in {name, display} - {""}:
                if len(label) >= 3:
                    self.patterns.append(
                        (author_id, re.compile(rf"(?<!\w){re.escape(label)}(?!\w)", re.I)))
                if len(label) >= 5:
                    self.fuzzy.setdefault(label.lower(), set()).add(author_id)
            first = display.split()[0] if display.split() else ""
            if len(first) >= 3 and first != display:
                self.patterns.append(
                    (author_id, re.compile(rf"(?<!\w){re.escape(first.capitalize())}(?!\w)")))

    def named_in(self, text: str, fuzzy_limit: int | None = PLAIN_FUZZY_LIMIT) -> set[int]:
        """Who ``text`` names; misspellings only up to ``fuzzy_limit`` names (None: always)."""
        named = {int(m) for m in re.findall(r"<@!?(\d{15,21})>", text) if int(m) in self.ids}
        named |= {author_id for author_id, pattern in self.patterns if pattern.search(text)}
        if fuzzy_limit is None or len(self.fuzzy) <= fuzzy_limit:
            for token in {t.lower() for t in re.findall(r"\w+", text) if len(t) >= 5}:
                for label in difflib.get_close_matches(token, self.fuzzy, n=3, cutoff=0.85):
                    named |= self.fuzzy[label]
        return named


def synthetic_members(count: int, seed: int = 0) -> list[tuple[int, str, str]]:
    """``(id, name, display name)`` rows: a word and two digits, two capitalised words."""
    rng = random.Random(seed)
    words, _ = _vocabulary()
    return [
        (author_id, f"{rng.choice(words)}{rng.randint(0, 99):02d}",
         f"{rng.choice(words).capitalize()} {rng.choice(words).capitalize()}")
        for author_id in range(1, count + 1)
    ]


def synthetic_queries(members: Sequence[tuple[int, str, str]], count: int, seed: int = 0
                      ) -> list[str]:
    """Chat questions; half name a member, as written, in lower case or misspelt."""
    rng = random.Random(seed)
    queries = []
    for _ in range(count):
        words = _words(rng, rng.randint(3, 8))
        if rng.random() < 0.5:
            _, name, display = rng.choice(members)
            label = rng.choice([name, display, display.split()[0]])
            if rng.random() < 0.3 and len(label) > 5:  # one letter dropped
                cut = rng.randrange(len(label))
                label = label[:cut] + label[cut + 1:]
            words.insert(rng.randrange(len(words) + 1), rng.choice([label, label.lower()]))
        queries.append("what did " + " ".join(words) + " say")
    return queries


def run_member_names(sizes: Sequence[int], queries: int = 200, plain_max: int = 5000
                     ) -> dict[str, Any]:
    """Index build and per-query time, index against the plain definition."""
    rows = []
    for size in sizes:
        members = synthetic_members(size)
        texts = synthetic_queries(members, queries)
        started = time.perf_counter()
        index = MemberNames.build(members)
        row: dict[str, Any] = {"members": size,
                               "index_build_ms": round((time.perf_counter() - started) * 1e3, 1)}
        plain = None
        if size <= plain_max:
            started = time.perf_counter()
            plain = PlainNames(members)
            row["plain_build_ms"] = round((time.perf_counter() - started) * 1e3, 1)
        # agreement is checked against the definition with the index's own limit
        limit = None if index.fuzzy is not None else 0
        index_ms, plain_ms, differ = [], [], 0
        for text in texts:
            started = time.perf_counter()
            found = index.named_in(text)
            index_ms.append((time.perf_counter() - started) * 1e3)
            if plain is not None:
                started = time.perf_counter()
                plain.named_in(text)
                plain_ms.append((time.perf_counter() - started) * 1e3)
                differ += found != plain.named_in(text, fuzzy_limit=limit)
        row["index_p50_ms"] = round(percentile(index_ms, 50), 3)
        row["index_p95_ms"] = round(percentile(index_ms, 95), 3)
        if plain is not None:
            row["plain_p50_ms"] = round(percentile(plain_ms, 50), 3)
            row["plain_p95_ms"] = round(percentile(plain_ms, 95), 3)
            row["queries_that_differ"] = differ
        rows.append(row)
    return {"machine": machine_description(), "queries": queries, "sizes": rows}
