"""What a search asks for, and the limits a request must keep.

:class:`SearchRequest` is the one input of a search; :func:`validate` checks it
before any work starts and returns its queries, cleaned.  The limits are here
beside it so that a caller (the CLI's options, the cog's command) can quote them.
"""

from __future__ import annotations

from dataclasses import dataclass
from datetime import datetime

from memory.errors import SearchInputError
from memory.records import datetime_to_ms
from memory.text import clean, valid_unicode

MAX_QUERIES = 20
# The characters a search's queries hold in all.  No question is longer: a Discord
# message holds at most 4000 (with Nitro), and the embedder reads only the first ~1000
# of each query (256 word pieces).  On two busy cores the worst search allowed (20
# queries of 200 characters) takes 0.5 s; 20 of 4000 took 2.5 s, one pasted megabyte
# 1.6 to 3 s of tokenising and keyword matching (issue 21).
MAX_QUERY_CHARS = 4000
MAX_LIMIT = 100
MODES = ("hybrid", "dense", "keyword")


@dataclass(frozen=True)
class SearchRequest:
    """What to search for and where.

    ``threshold`` set means fixed-threshold mode; otherwise ``adaptive`` decides
    between the adaptive loop and no threshold.  ``bonuses`` turns the bounded
    bonuses (a named member, recency, a time span) on; ``rerank`` lets the reranker
    (if the profile has one) run.

    ``allowed_channel_ids`` is a permission allow-list: when set, only messages in
    those channels and threads can be found, whatever ``channel_ids`` asks for (a
    channel named there is expanded to its threads first, then cut to the list).
    It filters inside the KNN and keyword stages, so a search still fills ``limit``.
    """

    queries: tuple[str, ...]
    guild_id: int | None = None
    channel_ids: tuple[int, ...] | None = None
    author_ids: tuple[int, ...] | None = None
    allowed_channel_ids: tuple[int, ...] | frozenset[int] | None = None
    after: datetime | None = None
    before: datetime | None = None
    has_attachment: bool | None = None
    limit: int = 10
    mode: str = "hybrid"
    threshold: float | None = None
    adaptive: bool = True
    bonuses: bool = True
    rerank: bool = True
    now: datetime | None = None


def validate(request: SearchRequest) -> list[str]:
    """Check a request before any work starts.

    Args:
        request: The search to check.

    Returns:
        Its non-empty queries, stripped, with lone surrogates replaced.

    Raises:
        SearchInputError: No query, more than :data:`MAX_QUERIES` queries or
            :data:`MAX_QUERY_CHARS` characters, a bad limit, mode, threshold or
            date range.
    """
    if isinstance(request.queries, str):
        raise SearchInputError("queries must be a list of strings, not one string")
    if len(request.queries) > MAX_QUERIES:  # before reading them: a million is refused at once
        raise SearchInputError(
            f"at most {MAX_QUERIES} queries per search, got {len(request.queries)}")
    # a query of zero-width or control characters alone is blank too: it matched
    # unrelated messages by their vectors
    queries = [q for q in (valid_unicode(str(q)).strip() for q in request.queries) if clean(q)]
    if not queries:
        raise SearchInputError("give at least one non-empty query")
    total = sum(len(q) for q in queries)
    if total > MAX_QUERY_CHARS:
        raise SearchInputError(
            f"a search's queries may hold at most {MAX_QUERY_CHARS} characters in all, got "
            f"{total}: search with the words that matter")
    _check_options(request)
    return queries


def _check_options(request: SearchRequest) -> None:
    _check_ids(request)
    if not isinstance(request.limit, int) or not 1 <= request.limit <= MAX_LIMIT:
        raise SearchInputError(f"limit must be between 1 and {MAX_LIMIT}")
    if request.mode not in MODES:
        raise SearchInputError(f"mode must be one of {', '.join(MODES)}")
    if request.threshold is not None and not -1.0 <= request.threshold <= 1.0:
        raise SearchInputError("threshold must be between -1 and 1 (cosine similarity)")
    if request.after and request.before and (
        datetime_to_ms(request.after) >= datetime_to_ms(request.before)
    ):
        raise SearchInputError("'after' must be earlier than 'before'")


MAX_ID = 2**63 - 1  # SQLite's INTEGER: every Discord id fits


def _check_ids(request: SearchRequest) -> None:
    """Every id filter holds ids a Discord object can have (the database cannot read others)."""
    fields = {"guild_id": () if request.guild_id is None else (request.guild_id,),
              "channel_ids": request.channel_ids or (), "author_ids": request.author_ids or (),
              "allowed_channel_ids": request.allowed_channel_ids or ()}
    for name, ids in fields.items():
        for value in ids:
            if isinstance(value, bool) or not isinstance(value, int) or not 0 <= value <= MAX_ID:
                raise SearchInputError(f"{name}: {value!r} is not a Discord id")
