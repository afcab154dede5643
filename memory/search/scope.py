"""Where one search may look: a request's :class:`~memory.filters.Filters`.

The searcher turns its request into filters here before any list is read: the
channels asked for grow by their stored threads, the permission allow-list cuts
them, and the guild's retention period moves the time bound.  The storage then
applies the filters inside its KNN and keyword queries (not after their top-k),
and the second pass (:mod:`memory.search.neighbours`) checks them on each row.
"""

from __future__ import annotations

from memory.filters import Filters
from memory.records import datetime_to_ms
from memory.search.request import SearchRequest
from memory.storage.contract import Storage


def filters_for(storage: Storage, request: SearchRequest) -> Filters:
    """The filters a search of ``request`` applies.

    Args:
        storage: Where the stored threads and the guild's retention period are read.
        request: The search.

    Returns:
        The filters; ``channel_ids`` is empty when the allow-list admits none of the
        channels asked for (the searcher then answers without searching).
    """
    return Filters(
        guild_id=request.guild_id,
        channel_ids=_channels(storage, request),
        author_ids=request.author_ids,
        after_ms=_after_ms(storage, request),
        before_ms=datetime_to_ms(request.before) if request.before else None,
        has_attachment=request.has_attachment,
    )


def _channels(storage: Storage, request: SearchRequest) -> tuple[int, ...] | None:
    """The channels asked for with their threads, cut to the allow-list (``None``: all)."""
    channels = request.channel_ids
    if channels:
        channels = storage.messages.expand_channels(channels)
    if request.allowed_channel_ids is not None:
        allowed = frozenset(request.allowed_channel_ids)
        channels = tuple(sorted(allowed)) if channels is None else tuple(
            c for c in channels if c in allowed
        )
    return channels


def _after_ms(storage: Storage, request: SearchRequest) -> int | None:
    """The lower time bound: the request's, raised to the guild's retention cutoff."""
    after_ms = datetime_to_ms(request.after) if request.after else None
    if request.guild_id is not None:
        # past the guild's retention period nothing is returned, purged yet or not;
        # as a filter inside the KNN and keyword queries, not after their top-k
        cutoff = storage.guilds.retention_cutoffs([request.guild_id]).get(request.guild_id)
        if cutoff is not None:
            after_ms = max(cutoff - 1, after_ms if after_ms is not None else cutoff - 1)
    return after_ms
