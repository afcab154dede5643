"""The second pass of a search: the messages beside its best candidates join the pool.

Reads only, like the searcher that calls it: the seeds' rows, their neighbours in
their own channels, and the rows of the neighbours the pool does not hold yet.
Which candidates are seeds, how a neighbour ranks and what it adds to a score are
decided in :mod:`memory.search.ranking` (:func:`~memory.search.ranking.neighbour_seeds`,
:func:`~memory.search.ranking.neighbour_list`, :func:`~memory.search.ranking.add_neighbours`).
"""

from __future__ import annotations

from memory.config import SearchConfig
from memory.filters import Filters
from memory.records import Trace
from memory.search import ranking
from memory.search.ranking import Candidate
from memory.storage.contract import Messages


def add_beside(
    messages: Messages, pool: list[Candidate], filters: Filters, config: SearchConfig,
    trace: Trace,
) -> list[Candidate]:
    """The pool with the messages beside its best candidates fused in.

    It runs after the threshold: the seeds are candidates that passed it, and what
    it adds is judged by where it sits, not by its own similarity.  A neighbour is
    read from its seed's channel only, and one the pool does not hold yet joins only
    when the search's filters admit it (channel allow-list, author, time,
    attachments): the same rules as the first pass.

    Args:
        messages: The stored messages.
        pool: The candidates that passed the threshold.
        filters: The search's filters.
        config: The profile's ``[search]`` section (``neighbour_seeds`` 0: no pass).
        trace: Counts the neighbour list in ``candidates["neighbour"]``.

    Returns:
        The pool, unchanged when the pass is off or the pool is empty.
    """
    if not config.neighbour_seeds or not pool:
        return pool
    seeds = ranking.neighbour_seeds(pool, config.neighbour_seeds)
    beside = _beside(messages, seeds, filters, config.neighbour_span)
    admitted = _admitted(messages, {c.id for c in pool}, beside, filters)
    ranked = ranking.neighbour_list(
        seeds, {seed: [m for m in mids if m in admitted] for seed, mids in beside.items()}
    )
    trace.candidates["neighbour"] = len(ranked)
    return ranking.add_neighbours(pool, ranked, config)


def _beside(
    messages: Messages, seeds: list[int], filters: Filters, span: int
) -> dict[int, list[int]]:
    """Each seed's neighbours in its own channel (a seed the filters refuse has none)."""
    rows = messages.hydrate(seeds)
    return {
        seed: messages.neighbours(rows[seed].channel_id, seed, span, span)
        for seed in seeds if seed in rows and filters.admits(rows[seed])
    }


def _admitted(
    messages: Messages, known: set[int], beside: dict[int, list[int]], filters: Filters
) -> set[int]:
    """The neighbours that may join: those in the pool, and new ones the filters admit."""
    new = {mid for mids in beside.values() for mid in mids} - known
    return known | {
        mid for mid, row in messages.hydrate(sorted(new)).items() if filters.admits(row)
    }
