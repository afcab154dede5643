"""Torch's CPU thread count, per thread: one thread for work that runs beside other work.

torch keeps a CPU thread count per thread (with OpenMP), taken from a process-wide
default at the thread's first torch work.  :func:`one_cpu_thread` runs a block on
one thread (the query embedding of a hybrid search, beside the keyword reads);
:func:`settle_cpu_threads` gives a thread the real default before its first torch
work, so a thread that starts inside such a block does not stay on one thread for
good.  Used by the embedder, the searcher and the in-process rerankers; neither
function imports torch (both are no-ops until something else has).
"""

from __future__ import annotations

import sys
import threading
from collections.abc import Iterator
from contextlib import contextmanager

_ONE_THREAD = threading.Lock()
_SETTLED = threading.local()  # .done: this thread has its torch thread count


@contextmanager
def one_cpu_thread() -> Iterator[None]:
    """Run this thread's torch CPU work inside the block on one thread, for work
    running beside it.

    A hybrid search reads its keyword lists on another thread while its query is
    embedded.  On two cores torch's second thread and that reader took turns on one
    core, and a 100k-message search took 34.9 ms p50; with the embedding on one
    thread (alone a little slower than on two: one short query 10.6 vs 9.4 ms), 31.0
    ms (BENCHMARKS.md).  With OpenMP each thread keeps its own count, but
    ``set_num_threads`` also sets the default that a thread takes at its first torch
    work: blocks run one at a time (so each finds and restores the default), and
    :func:`settle_cpu_threads` keeps other threads from starting inside one.  A
    no-op until torch is imported, and with torch's own thread pool instead of
    OpenMP (it cannot be resized once used).
    """
    torch = sys.modules.get("torch")
    if torch is None or not torch.backends.openmp.is_available():
        yield
        return
    with _ONE_THREAD:
        before = torch.get_num_threads()
        _SETTLED.done = True
        torch.set_num_threads(1)
        try:
            yield
        finally:
            torch.set_num_threads(before)


def settle_cpu_threads() -> None:
    """Give this thread torch's default CPU thread count, if it has no count yet.

    torch gives a thread its count at its first torch work, from a default that a
    :func:`one_cpu_thread` block lowers to one while it runs; a thread that began
    inside such a block (an import's first batch, a reranker's first scoring) would
    stay on one thread for good.  Called before torch work by the embedder and the
    reranker; cheap after the first call in a thread.
    """
    if getattr(_SETTLED, "done", False):
        return
    torch = sys.modules.get("torch")
    if torch is None:
        return
    with _ONE_THREAD:  # no block is open: the default is the real one
        torch.get_num_threads()  # this fixes the thread's count
    _SETTLED.done = True
