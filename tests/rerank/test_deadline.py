"""The rerank's one timeout: the service owns the deadline and hands it to the backend.

Local backends (no ``concurrent``) run one call at a time on the service's single
worker; a concurrent one (a remote server) gets a worker per call.  Either way the
caller stops waiting at the deadline, and a backend that reads the deadline stops
too, so a search that gave up leaves no work behind.
"""

from __future__ import annotations

import threading
import time

import pytest

from memory.config import RerankerConfig
from memory.errors import RerankerError
from memory.rerank import deadline
from memory.rerank.service import RerankerService

SLACK = 2.0  # wall-clock slack on a shared machine: these tests check bounds, not speed


class Stepper:
    """A backend that scores in steps of ``step`` seconds, one per text.

    With ``stops`` it checks the deadline between steps, as the in-process model
    does between micro-batches; without, it runs to the end like a model that
    cannot be interrupted.  It records how many calls ran at once.
    """

    name = "stepper"

    def __init__(self, step: float, *, stops: bool = True, concurrent: bool = False) -> None:
        self.step = step
        self.stops = stops
        self.concurrent = concurrent
        self.started: list[str] = []
        self.finished: list[str] = []
        self.deadlines: list[float | None] = []
        self.running = 0
        self.most_at_once = 0
        self._lock = threading.Lock()

    def load(self) -> None:
        pass

    def score(self, query, texts):
        with self._lock:
            self.running += 1
            self.most_at_once = max(self.most_at_once, self.running)
            self.started.append(query)
            self.deadlines.append(deadline.current())
        try:
            for _ in texts:
                if self.stops and deadline.passed():
                    raise RerankerError("stopped at the deadline")
                time.sleep(self.step)
            self.finished.append(query)
            return [0.5] * len(texts)
        finally:
            with self._lock:
                self.running -= 1

    def close(self) -> None:
        pass


def service_for(backend: Stepper, timeout: float) -> RerankerService:
    return RerankerService(RerankerConfig(backend="transformers", timeout=timeout),
                           backend=backend)


def test_within_keeps_the_backends_own_timeout_outside_a_service_call() -> None:
    assert deadline.current() is None and not deadline.passed()
    before = time.monotonic()
    assert before + 5.0 <= deadline.within(5.0) <= time.monotonic() + 5.0
    with deadline.until(before + 1.0):
        assert deadline.current() == before + 1.0
        assert deadline.within(5.0) == before + 1.0, "the service's deadline is sooner"
        assert deadline.within(0.5) <= before + 1.0
    assert deadline.current() is None


def test_the_backend_receives_the_services_deadline() -> None:
    backend = Stepper(0.0)
    service = service_for(backend, timeout=3.0)
    started = time.monotonic()
    assert service.score("q", ["a"]) == [0.5]
    (given,) = backend.deadlines
    assert given is not None and started + 3.0 <= given <= time.monotonic() + 3.0
    service.close()


def test_a_local_backend_that_reads_the_deadline_stops_and_frees_the_worker() -> None:
    backend = Stepper(0.1)
    service = service_for(backend, timeout=0.5)
    started = time.monotonic()
    with pytest.raises(RerankerError, match="did not answer within 0.5 s"):
        service.score("slow", ["doc"] * 50)  # 5 s of work
    assert time.monotonic() - started < 0.5 + SLACK
    # the worker is free again at the next step, not after the remaining 4.5 s
    assert service.score("next", ["doc"]) == [0.5]
    assert time.monotonic() - started < 0.5 + SLACK
    assert backend.finished == ["next"]
    service.close()


def test_a_call_still_queued_at_the_deadline_never_runs() -> None:
    backend = Stepper(0.3, stops=False)  # cannot be interrupted
    service = service_for(backend, timeout=0.5)
    failures: list[BaseException] = []

    def hold_the_worker() -> None:
        try:
            service.score("first", ["doc"] * 5)
        except RerankerError as exc:
            failures.append(exc)

    first = threading.Thread(target=hold_the_worker)
    first.start()
    time.sleep(0.1)  # "first" holds the one worker for 1.5 s
    with pytest.raises(RerankerError, match="within 0.5 s"):
        service.score("second", ["doc"])
    first.join(10)
    time.sleep(0.3)
    assert len(failures) == 1, "the first call timed out too"
    assert backend.started == ["first"], "the queued call was cancelled, not run late"
    service.close()


@pytest.mark.parametrize("concurrent, most", [(False, 1), (True, 3)])
def test_local_backends_score_one_call_at_a_time_remote_ones_many(concurrent, most) -> None:
    backend = Stepper(0.2, concurrent=concurrent)
    service = service_for(backend, timeout=5.0)
    threads = [threading.Thread(target=service.score, args=(f"q{i}", ["doc"])) for i in range(3)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(10)
    assert backend.most_at_once == most and len(backend.finished) == 3
    service.close()


def test_a_closed_service_refuses_calls() -> None:
    service = service_for(Stepper(0.0), timeout=1.0)
    service.close()
    with pytest.raises(RerankerError, match="closed"):
        service.score("q", ["a"])
    assert service.rank_for_search("q", ["a"]).fallback
