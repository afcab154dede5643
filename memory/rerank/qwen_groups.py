"""Searches scored together: a queue, one leader at a time, and an event per search.

With ``reranker.concurrent`` above 1, many searches call the Qwen reranker at once
(:class:`memory.rerank.service.RerankerService`).  :class:`SearchGroups` queues
them; the first to queue while nobody leads becomes the leader and scores what is
queued at that moment, itself at least, through a callback that shares the static
steps between them; searches that arrive meanwhile form the next group.  No search
waits for company, and none waits on the scoring lock: each waits on its own event.
"""

from __future__ import annotations

import threading
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Generic, TypeVar

Request = TypeVar("Request")


@dataclass
class Waiting(Generic[Request]):
    """One search queued to be scored together with others (``reranker.concurrent``)."""

    encoded: Request
    done: threading.Event = field(default_factory=threading.Event)
    wake: threading.Event = field(default_factory=threading.Event)  # done, or lead now
    scores: list[float] = field(default_factory=list)
    error: BaseException | None = None


class SearchGroups(Generic[Request]):
    """A queue of searches and the lead that scores them, one group at a time.

    Args:
        lock: The scoring lock; the leader holds it while a group is scored.
        size: Searches one group holds at most (``reranker.concurrent``).
        score_group: Scores a group: sets each member's ``scores`` or ``error``.
    """

    def __init__(
        self, lock: threading.RLock, size: int,
        score_group: Callable[[list[Waiting[Request]]], None],
    ) -> None:
        self.lock = lock
        self.size = size
        self.score_group = score_group
        self.waiting: list[Waiting[Request]] = []  # searches to score together; under _queue_lock
        self._queue_lock = threading.Lock()
        self._leading = False  # whether a search is scoring the queue; under _queue_lock

    @property
    def idle(self) -> bool:
        """Whether no search is queued or being scored (read without the lock: a hint)."""
        return not self._leading and not self.waiting

    def score(self, encoded: Request) -> list[float]:
        """Queue this search; one searching thread at a time scores every queued one together.

        No search waits for company: the leader (the first to queue while nobody
        leads) scores what is queued at that moment, itself at least, and searches
        that arrive meanwhile go into the next group together.  The others wait on
        their own event, not on the scoring lock, so they are free to return the
        moment their group is done.  A leader whose own search is done hands the lead
        to the first search still queued.

        Raises:
            Exception: Whatever ``score_group`` handed this search.
        """
        waiting = Waiting(encoded)
        with self._queue_lock:
            self.waiting.append(waiting)
            leads = not self._leading
            self._leading = True
        if not leads:
            waiting.wake.wait()  # our group is done, or the last leader handed us the lead
            leads = not waiting.done.is_set()
        if leads:
            try:
                while not waiting.done.is_set():
                    self._score_next_group()
            finally:
                self._hand_off_lead()
        if waiting.error is not None:
            raise waiting.error
        return waiting.scores

    def _score_next_group(self) -> None:
        """Take up to ``size`` queued searches and score them; the leader calls this."""
        with self.lock:
            with self._queue_lock:
                group = self.waiting[: self.size]
                del self.waiting[: self.size]
            if group:
                try:
                    self.score_group(group)
                finally:
                    for waiting in group:
                        waiting.done.set()
                        waiting.wake.set()

    def _hand_off_lead(self) -> None:
        """Wake the first queued search as the next leader, or leave nobody leading."""
        with self._queue_lock:
            if self.waiting:
                self.waiting[0].wake.set()
            else:
                self._leading = False
