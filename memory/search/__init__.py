"""Search: what a search asks for, how it reads, and how it scores.

* :mod:`~memory.search.request`: :class:`SearchRequest`, its validation and limits.
* :mod:`~memory.search.searcher`: the :class:`Searcher`, I/O only -- embeds the
  queries, reads the four ranked lists (vector KNN, message keywords, window
  keywords, window vectors) concurrently, reads the rows, calls the reranker.
* :mod:`~memory.search.scope`: the filters a request applies (its channels with
  their threads, cut to the allow-list; the guild's retention period).
* :mod:`~memory.search.neighbours`: the opt-in second pass, I/O only -- reads the
  messages beside the best candidates for the ranking module to fuse in.
* :mod:`~memory.search.ranking`: pure functions that decide the order and every
  score (fusion, multi-query merge, adaptive threshold, bonuses, the rerank
  blend).  "How is a result scored?" is answered there and by the profile's
  ``[search]`` and ``[reranker]`` sections.
* :mod:`~memory.search.members`: the member names a query may name, kept indexed.
* :mod:`~memory.search.names`: how members are named in a query (mentions, names,
  first names, misspellings).
* :mod:`~memory.search.when`: the time spans a query names ("last week", "in May").
"""

from __future__ import annotations

from memory.search.request import MAX_LIMIT, MAX_QUERIES, MAX_QUERY_CHARS, MODES, SearchRequest
from memory.search.searcher import Searcher

__all__ = ["MAX_LIMIT", "MAX_QUERIES", "MAX_QUERY_CHARS", "MODES", "SearchRequest", "Searcher"]
