"""Which members a query names: by name, display name, @mention or a close misspelling.

A search gives a small bonus to messages by a member its query names
(:mod:`memory.search.ranking`).  The names are those the guild's stored messages
were written under; :class:`MemberNames` indexes them (again only when they change,
see :class:`memory.search.members.MemberIndex`) so that a query is matched in time
that grows with the query, not with the member count: a server with thousands of
members who have spoken must not pay per member on every search
(``bench member-names``).

- A name or display name of 3+ characters is found anywhere in the query, in any
  letter case, between non-word characters: where a case-blind regular expression
  ``(?<!\\w)name(?!\\w)`` would find it (:func:`fold` equates the letters that
  ``re.IGNORECASE`` does, tests/search/test_names.py checks every cased code point).
- A display name's first word ("Priya" of "Priya Raman") counts only capitalised,
  as written: "Will" names a member, "will" does not.
- A word of 5+ characters close to a name of 5+ characters (``difflib`` ratio ≥ 0.85,
  the best three) names its member: "kariton" for "karitton".  Each name's letters
  are counted once, in 64 buckets; a name that shares too few letters with the word
  to reach the ratio is skipped without running ``difflib`` (the count bounds the
  ratio from above, so the result is the same as comparing every name).  Names
  longer than 255 characters are only found as written, and above
  :data:`MAX_FUZZY_NAMES` names a guild's misspellings are not looked for.
"""

from __future__ import annotations

import bisect
import difflib
import re
from collections.abc import Iterable, Iterator
from dataclasses import dataclass

import numpy as np

MENTION = re.compile(r"<@!?(\d{15,21})>")
_WORD = re.compile(r"\w+")
CLOSE = 0.85  # difflib ratio for a misspelling
_BUCKETS = 64
MAX_FUZZY_NAMES = 20_000  # names; beyond, misspellings cost a search over ~4 ms


@dataclass(frozen=True)
class MemberNames:
    """How a guild's members can be named in a query."""

    ids: frozenset[int]
    exact: dict[str, frozenset[int]]  # names and display names, folded -> members
    capitalised: dict[str, frozenset[int]]  # "Priya" of "Priya Raman", as written
    lengths: frozenset[int]  # how long the names in exact and capitalised are
    firsts: frozenset[str]  # their first letters, folded
    fuzzy: _CloseNames | None  # None: too many names to look for misspellings

    @classmethod
    def build(cls, members: Iterable[tuple[int, str, str]]) -> MemberNames:
        """Index ``(author_id, name, display_name)`` rows."""
        members = list(members)
        exact: dict[str, set[int]] = {}
        capitalised: dict[str, set[int]] = {}
        close: dict[str, set[int]] = {}
        for author_id, name, display in members:
            for label in {name, display} - {""}:
                if len(label) >= 3:
                    exact.setdefault(fold(label), set()).add(author_id)
                if 5 <= len(label) <= 255:  # no real name is longer (see _letter_counts)
                    close.setdefault(label.lower(), set()).add(author_id)
            first = display.split()[0] if display.split() else ""
            if len(first) >= 3 and first != display:
                capitalised.setdefault(first.capitalize(), set()).add(author_id)
        lengths = {len(label) for label in exact} | {len(label) for label in capitalised}
        firsts = {label[0] for label in exact} | {fold(label[0]) for label in capitalised}
        return cls(
            ids=frozenset(m[0] for m in members),
            exact={label: frozenset(ids) for label, ids in exact.items()},
            capitalised={label: frozenset(ids) for label, ids in capitalised.items()},
            lengths=frozenset(lengths),
            firsts=frozenset(firsts),
            fuzzy=_CloseNames(close) if len(close) <= MAX_FUZZY_NAMES else None,
        )

    def named_in(self, text: str) -> set[int]:
        """The ids of the members ``text`` names."""
        named = {int(m) for m in MENTION.findall(text) if int(m) in self.ids}
        folded = fold(text)  # as long as text: spans line up
        for start, end in _bounded_spans(text, folded, self.lengths, self.firsts):
            named.update(self.exact.get(folded[start:end], ()))
            if self.capitalised:
                named.update(self.capitalised.get(text[start:end], ()))
        if self.fuzzy is not None:
            for word in {w.lower() for w in _WORD.findall(text) if len(w) >= 5}:
                named |= self.fuzzy.close_to(word)
        return named


def fold(text: str) -> str:
    """``text`` with each character replaced by one that stands for its letter case
    class: two strings are equal folded when ``re.IGNORECASE`` would match one by the
    other.  Unlike ``str.casefold`` it keeps the length ("ß" stays one letter)."""
    return text.translate(_FOLDED)


# letters re.IGNORECASE equates that case folding one character at a time keeps apart
_ALSO = {"ı": "i", "İ": "i", "\u1fd3": "\u0390", "\u1fe3": "\u03b0", "\ufb05": "\ufb06"}


def _fold_char(char: str) -> str:
    for form in (char.casefold(), char.lower()):
        if len(form) == 1:
            return _ALSO.get(form, form)
    return _ALSO.get(char, char)


class _FoldTable(dict):
    """``str.translate``'s table for :func:`fold`, filled in as characters turn up."""

    def __missing__(self, code: int) -> str:
        folded = self[code] = _fold_char(chr(code))
        return folded


_FOLDED = _FoldTable()
_NON_WORD = re.compile(r"\W")


def _bounded_spans(
    text: str, folded: str, lengths: frozenset[int], firsts: frozenset[str]
) -> Iterator[tuple[int, int]]:
    """Where ``text`` has a substring of one of ``lengths``, starting with one of
    ``firsts`` (in ``folded``, :func:`fold` of ``text``), with no word character on
    either side of it (the text's ends count as non-word): ``(start, end)`` pairs."""
    if not lengths:
        return
    by_length = sorted(lengths)
    shortest, longest = by_length[0], by_length[-1]
    breaks = [m.start() for m in _NON_WORD.finditer(text)]  # where a non-word character is
    ends = [j for j in breaks if j] + [len(text)]
    is_end = set(ends)
    for start in [0, *(j + 1 for j in breaks)]:
        if start >= len(text) or folded[start] not in firsts:
            continue
        low = bisect.bisect_left(ends, start + shortest)
        high = bisect.bisect_right(ends, start + longest)
        if high - low <= len(by_length):  # try the ends in reach, or each length: fewer
            for end in ends[low:high]:
                if end - start in lengths:
                    yield start, end
        else:
            for length in by_length:
                if start + length in is_end:
                    yield start, start + length


class _CloseNames:
    """Names of 5+ characters, for finding the ones a word misspells."""

    def __init__(self, labels: dict[str, set[int]]) -> None:
        self._ids = {label: frozenset(ids) for label, ids in labels.items()}
        self._labels = list(labels)
        self._lengths = np.array([len(label) for label in self._labels], dtype=np.int32)
        self._counts = _letter_counts(self._labels)

    def close_to(self, word: str) -> frozenset[int]:
        """The members whose names ``word`` is close to (the best three names)."""
        if not self._labels:
            return frozenset()
        # difflib's ratio is 2 M / (len(a) + len(b)) with M letters matched in order,
        # and M is at most the letters the two share, whatever their order
        shared = np.minimum(self._counts, _letter_counts([word])[0]).sum(axis=1, dtype=np.int64)
        bound = 2.0 * shared / (len(word) + self._lengths)
        maybe = [self._labels[i] for i in np.flatnonzero(bound >= CLOSE - 1e-9)]
        found: set[int] = set()
        for label in difflib.get_close_matches(word, maybe, n=3, cutoff=CLOSE):
            found |= self._ids[label]
        return frozenset(found)


def _letter_counts(texts: list[str]) -> np.ndarray:
    """How many of each text's letters fall in each of 64 buckets (by code point), up
    to 255: one row per text.

    Letters sharing a bucket only raise the bound.  A name has at most 255 letters
    (longer ones are left out), so capping a word's counts at 255 changes no minimum.
    """
    cells = [row * _BUCKETS + ord(char) % _BUCKETS
             for row, text in enumerate(texts) for char in text]
    counts = np.bincount(np.array(cells, dtype=np.int64), minlength=len(texts) * _BUCKETS)
    return np.minimum(counts, 255).astype(np.uint8).reshape(len(texts), _BUCKETS)
