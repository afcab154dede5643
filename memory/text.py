"""Text shaping: what gets embedded for a message, and the words of a query worth searching for."""

from __future__ import annotations

import re
import unicodedata

# Words that carry no topic.  Questions typed to a bot are full of them ("what did
# she say about ..."), and OR-ing them into BM25 matches half the corpus.
STOPWORDS = frozenset(
    """a about above after again against all am an and any are as at be because been
    before being below between both but by can could did do does doing down during each
    few for from further had has have having he her here hers herself him himself his how
    i if in into is it its itself just me more most my myself no nor not now of off on
    once only or other our ours ourselves out over own same she should so some such than
    that the their theirs them themselves then there these they this those through to too
    under until up very was we were what when where which while who whom why will with
    would you your yours yourself yourselves s t d ll m re ve don didn doesn isn wasn
    aren weren hasn haven hadn won wouldn shouldn couldn""".split()
)

# Words a question typed to a chat bot carries that say nothing about the topic
# ("does anyone remember what she said about ...").  Left out of keyword queries.
QUERY_FILLER = frozenset(
    """anyone anybody someone somebody everyone remember recall know knows tell told
    say says said mention mentioned talk talked talking discuss discussed ask asked
    hey hi hello pls please guys folks thing things stuff lol um uh hmm ever""".split()
)

# Chat lines made of these words alone carry no content ("noted", "lol", "looks
# great"): a member or recency bonus alone must never lift them.
CHAT_FILLER = frozenset(
    """lol lmao rofl haha hahaha hah heh ok okay k kk noted thanks thank thx ty np yes
    yeah yep yup no nope nah nice cool great good looks look sure right true agreed
    hmm oh ah wow omg pls please very really just so same totally exactly indeed
    hi hello hey bye cya gn gm morning night welcome awesome perfect fine""".split()
)

EMBED_CHARS = 4000
"""The most of a message's text (and of its antecedent's, and of its attachment names)
that is embedded.  A Discord message holds at most 4,000 characters; the default model
reads 256 tokens (about 1,000 characters of English), so more never changes a vector,
and a tokenizer reads all it is given before truncating: an imported 50 MB message
took 8 GiB to embed (issue 31, item 2).  Stored text stays whole."""

_TOKEN = re.compile(r"[^\W_]+", re.UNICODE)
_SURROGATE = re.compile("[\ud800-\udfff]")


def valid_unicode(text: str) -> str:
    """``text`` as valid, storable Unicode: each lone surrogate and NUL becomes U+FFFD.

    A Python ``str`` may hold surrogates: JSON escapes such as ``"\\ud83d"`` (which
    discord.py's gateway parser and ``json`` accept), undecodable command-line bytes,
    a broken decoder.  SQLite, tokenizers and UTF-8 JSON refuse them.  A JSON export
    may hold ``"\\u0000"``, which PostgreSQL's text refuses.  Emoji pass unchanged.
    """
    if "\x00" in text:
        text = text.replace("\x00", "\ufffd")
    return text if text.isascii() else _SURROGATE.sub("\ufffd", text)


def clean(text: str) -> str:
    """Remove NUL/control and zero-width characters and collapse whitespace."""
    kept = [
        ch if unicodedata.category(ch) not in ("Cc", "Cf") else " "
        for ch in text
    ]
    return " ".join("".join(kept).split())


def query_terms(text: str, max_terms: int = 32) -> list[str]:
    """Return the distinct lower-case word tokens of ``text`` worth searching for.

    Stopwords are dropped unless nothing else is left.  Tokens follow FTS5's
    ``unicode61`` idea of a word (letters and digits), so ``C++`` gives ``c`` and
    ``state-of-the-art`` gives ``state``, ``of``, ``the``, ``art``.
    """
    tokens = [t.lower() for t in _TOKEN.findall(clean(text))]
    seen: dict[str, None] = {}
    for token in tokens:
        seen.setdefault(token, None)
    terms = [t for t in seen if t not in STOPWORDS and t not in QUERY_FILLER] or list(seen)
    return terms[:max_terms]


def content_words(text: str) -> int:
    """How many words of ``text`` carry content (not stopwords, not chat filler)."""
    # finditer, not findall: a 50 MB message would be a list of millions of words
    return sum(
        1 for match in _TOKEN.finditer(text.lower())
        if match[0] not in STOPWORDS and match[0] not in CHAT_FILLER
    )


def embedding_text(
    display_name: str,
    content: str,
    attachments: tuple[str, ...] | list[str] = (),
    antecedent_name: str | None = None,
    antecedent_content: str | None = None,
) -> str:
    """Compose the text embedded for one message.

    The author's display name goes first (questions name people); attachments are
    named; for short chat lines the antecedent (the message it replies to, or the
    one before it) follows, after the message itself so truncation never cuts the
    message.  Each part is cut to :data:`EMBED_CHARS` first, so the text stays a few
    thousand characters whatever a message holds.
    """
    content = clean(content[:EMBED_CHARS])
    text = f"{display_name[:EMBED_CHARS]}: {content}" if display_name else content
    if attachments:
        text += " [attachments: " + ", ".join(attachments)[:EMBED_CHARS] + "]"
    if antecedent_content:
        text += f" (replying to {antecedent_name}: {clean(antecedent_content[:EMBED_CHARS])})"
    return text


def needs_antecedent(content: str, mode: str, short_words: int) -> bool:
    """Whether a message should be embedded with its antecedent.

    ``mode`` is the profile's ``[embedder] context`` setting (``none``, ``short``,
    ``always``).
    """
    if mode == "always":
        return True
    if mode == "none":
        return False
    return len(content.split()) <= short_words
