"""The background compile of the Qwen reranker's static steps, and the swap when it is done.

With ``reranker.torch_compile`` the eager static steps serve from the moment the
model is loaded, while a thread builds a compiled (and on CUDA captured) scorer;
when it is ready it is swapped in.  Past ``reranker.compile_budget`` seconds the
compile is given up (logged once): the eager steps keep serving, and a result that
comes later is dropped.  A failure changes nothing either.
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable

from memory.rerank.qwen_static import StaticScorer

log = logging.getLogger(__name__)


class BackgroundCompile:
    """One background compile: settled once it is served, failed or given up.

    Args:
        build: Builds the compiled scorer (on the compile thread); ``None`` after a
            failure it has logged.
        swap_in: Serves the compiled scorer; returns ``False`` when it may not any
            more (the model was closed or the static path dropped meanwhile).
        budget: Seconds the compile may take (``reranker.compile_budget``).
    """

    def __init__(
        self, build: Callable[[], StaticScorer | None],
        swap_in: Callable[[StaticScorer], bool], budget: float,
    ) -> None:
        self.budget = budget
        self.settled = threading.Event()
        self.abandoned = False  # under _lock
        self._lock = threading.Lock()
        # Only the thread holds build and swap_in (and through them the model), and
        # only while it runs: a closed reranker's weights must not outlive the compile.
        # A compile cannot be interrupted, and a process that exits under a running
        # inductor compile aborts (SIGABRT, "terminate called without an active
        # exception": the H200 run of scripts/gpu-bench.sh), so closing the reranker
        # waits for it (:meth:`join`) and, should nobody close it, so does Python's exit.
        self.thread = threading.Thread(
            target=self._work, args=(build, swap_in), daemon=False, name="reranker-compile"
        )
        self._timer = threading.Timer(budget, self._give_up)
        self._timer.daemon = True
        self._started = 0.0

    def start(self) -> None:
        """Start the compile thread and the budget's timer."""
        self._started = time.monotonic()
        self._timer.start()
        self.thread.start()

    def wait(self, timeout: float | None = None) -> None:
        """Wait until the compile is served, failed or given up (or ``timeout`` passes)."""
        self.settled.wait(timeout)

    def join(self) -> None:
        """Wait for the compile thread to end (a compile cannot be interrupted)."""
        if self.thread.is_alive():
            log.info("reranker waits for its background compile to end before unloading "
                     "(%.0f s since load; a compile cannot be interrupted)",
                     time.monotonic() - self._started)
        self.thread.join()

    def _work(
        self, build: Callable[[], StaticScorer | None], swap_in: Callable[[StaticScorer], bool]
    ) -> None:
        try:
            fresh = build()
        except Exception:  # compiled()/captured() log their own; anything else lands here
            log.warning("reranker background compile failed; keeping the eager steps",
                        exc_info=True)
            fresh = None
        self._timer.cancel()
        with self._lock:  # settled only once the compiled steps serve (or never will)
            if self.abandoned:
                log.debug("reranker compile finished after its budget; dropped")
                return
            if fresh is not None and swap_in(fresh):
                log.info("reranker compiled static steps serve from now on (%.1f s after load)",
                         time.monotonic() - self._started)
            self.settled.set()

    def _give_up(self) -> None:
        with self._lock:
            if self.settled.is_set():
                return
            self.abandoned = True
            self.settled.set()
        log.warning(
            "reranker torch.compile of the static steps did not finish within "
            "reranker.compile_budget = %g s; keeping the eager steps", self.budget,
        )
