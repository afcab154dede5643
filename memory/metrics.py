"""Prometheus metrics for search and reranking.

All metrics live on one registry owned by this module so tests and the CLI can read
or expose them without touching the process-wide default registry.
"""

from __future__ import annotations

import logging

from prometheus_client import CollectorRegistry, Counter, Histogram, start_http_server

log = logging.getLogger(__name__)

REGISTRY = CollectorRegistry(auto_describe=True)

RERANK_CALLS = Counter(
    "memory_rerank_calls", "Rerank calls by backend and outcome.",
    ["backend", "status"], registry=REGISTRY,
)
RERANK_CANDIDATES = Histogram(
    "memory_rerank_candidates", "Candidates sent to the reranker per call.",
    buckets=(1, 5, 10, 20, 30, 50, 100, 200), registry=REGISTRY,
)
RERANK_LATENCY = Histogram(
    "memory_rerank_seconds", "Wall time of one rerank call.", ["backend"],
    buckets=(0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30), registry=REGISTRY,
)
RERANK_SERVER_ERRORS = Counter(
    "memory_rerank_server_errors", "Errors talking to a remote reranker, by kind.",
    ["kind"], registry=REGISTRY,
)
SEARCH_LATENCY = Histogram(
    "memory_search_seconds", "Wall time of one search, by stage.", ["stage"],
    buckets=(0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 5), registry=REGISTRY,
)
ADAPTIVE_ITERATIONS = Histogram(
    "memory_adaptive_threshold_iterations", "Threshold steps tried per search.",
    buckets=(1, 2, 3, 4, 5, 6, 7, 8, 9), registry=REGISTRY,
)
FINAL_THRESHOLD = Histogram(
    "memory_final_threshold", "Similarity threshold a search ended with.",
    buckets=(0.3, 0.35, 0.4, 0.45, 0.5, 0.55, 0.6, 0.65, 0.7, 0.75), registry=REGISTRY,
)
RESULT_COUNT = Histogram(
    "memory_search_results", "Results returned per search.",
    buckets=(0, 1, 3, 5, 10, 20, 50), registry=REGISTRY,
)


def serve(port: int, addr: str = "127.0.0.1") -> None:
    """Expose the metrics over HTTP at ``http://addr:port/metrics`` (background thread)."""
    start_http_server(port, addr=addr, registry=REGISTRY)
    log.info("metrics on http://%s:%d/metrics", addr, port)
