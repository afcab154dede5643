"""The one timeout of a rerank: the service's deadline, handed to the backend.

:class:`~memory.rerank.service.RerankerService` owns every call's deadline: it
runs the backend on a worker thread inside :func:`until` and stops waiting when
the deadline passes, whatever the backend does.  A backend that can stop early
reads the deadline here -- the llama-server one gives each request only the time
left and cancels what is queued; the in-process one stops between micro-batches
-- so a search that has given up leaves no work behind.  The deadline travels in
a context variable, so :meth:`~memory.rerank.base.RerankerBackend.score` keeps
its two arguments.
"""

from __future__ import annotations

import time
from collections.abc import Iterator
from contextlib import contextmanager
from contextvars import ContextVar

_DEADLINE: ContextVar[float | None] = ContextVar("rerank_deadline", default=None)


@contextmanager
def until(deadline: float) -> Iterator[None]:
    """Run the block under ``deadline`` (a :func:`time.monotonic` time)."""
    token = _DEADLINE.set(deadline)
    try:
        yield
    finally:
        _DEADLINE.reset(token)


def current() -> float | None:
    """The deadline of the call running in this thread (``None`` outside one)."""
    return _DEADLINE.get()


def within(timeout: float) -> float:
    """When a backend call must end: ``timeout`` from now, or the service's deadline if sooner.

    A backend called directly (a benchmark, a test) keeps its own ``timeout``; one
    called by the service never outlives the service's deadline.
    """
    own = time.monotonic() + timeout
    given = _DEADLINE.get()
    return own if given is None else min(given, own)


def passed() -> bool:
    """Whether the current call's deadline has passed (never, outside one)."""
    given = _DEADLINE.get()
    return given is not None and time.monotonic() >= given
