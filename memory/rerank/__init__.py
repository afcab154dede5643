"""Rerank: a second stage that re-scores the head of a search's candidates.

* :mod:`~memory.rerank.base`: the protocols -- a backend only scores
  (``name / load() / score(query, texts) / close()``); a search hands off to a
  :class:`~memory.rerank.base.Reranker` that returns ``(index, score)`` pairs.
* :mod:`~memory.rerank.service`: ranking, the deadline, metrics and fallback,
  written once over any backend; :mod:`~memory.rerank.deadline` is the one timeout.
* :mod:`~memory.rerank.manager`: the active service, swapped on a profile switch;
  :mod:`~memory.rerank.backends`: which backend a profile names.
* Backends: :mod:`~memory.rerank.qwen` (in-process Qwen3-Reranker) and
  :mod:`~memory.rerank.llama_server` (a llama.cpp server), with the parsers of
  what scoring servers answer in :mod:`~memory.rerank.score_parsing`.

How a reranker's score becomes a hit's score (the blend, the minimum score) is
decided in :mod:`memory.search.ranking`.
"""
