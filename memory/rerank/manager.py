"""RerankerManager: the active reranker service, swapped at runtime.

A profile switch loads the new profile's reranker in the background and swaps it
in; searches already running finish on the old one, which is then unloaded.
"""

from __future__ import annotations

import logging
import threading
from collections.abc import Callable
from concurrent.futures import Future

from memory.config import Profile
from memory.rerank.service import RerankerService, RerankerStatus

log = logging.getLogger(__name__)

NO_RERANKER = "the profile has no reranker"


class RerankerManager:
    """Holds the active :class:`RerankerService` and swaps it atomically at runtime.

    Args:
        profile: The profile whose reranker (if any) is active first.
        load: Start loading it in a background thread now.
    """

    def __init__(self, profile: Profile, *, load: bool = True) -> None:
        self._lock = threading.Lock()
        self._service: RerankerService | None = None
        self.profile_name = profile.name
        if profile.reranker.enabled:
            self._service = RerankerService(profile.reranker, llm=profile.llm)
            if load:
                threading.Thread(
                    target=self._load_in_background, args=(self._service,), daemon=True,
                    name="reranker-load",
                ).start()

    @staticmethod
    def _load_in_background(service: RerankerService) -> None:
        status = service.status()
        if not status.loaded:
            log.warning("reranker %s could not be loaded yet: %s", status.name, status.reason)

    def current(self) -> RerankerService | None:
        """The service searches should use right now (``None`` when reranking is off)."""
        with self._lock:
            return self._service

    def status(self) -> RerankerStatus:
        """Load the active reranker if it is not loaded yet, and say whether searches rerank.

        See :meth:`RerankerService.status`; without a reranker the reason says so.
        """
        service = self.current()
        if service is None:
            return RerankerStatus(None, False, NO_RERANKER)
        return service.status()

    def switch(
        self, profile: Profile, on_switched: Callable[[Profile], None] | None = None
    ) -> Future:
        """Load ``profile``'s reranker in the background, then swap it in.

        Searches already running finish on the old service, which is unloaded
        afterwards.  If loading fails the old service stays and the future raises.
        ``on_switched`` runs right after the swap, before the future resolves; if it
        raises, the swap is undone (the old service stays active, the new one is
        unloaded) and the future raises its error, so a caller never waits forever
        and never keeps two models loaded.  ``on_switched`` must therefore have no
        effect when it raises.

        Returns:
            A future that resolves to the new profile's name once it is active.
        """
        future: Future = Future()

        def work() -> None:
            try:
                new = (RerankerService(profile.reranker, llm=profile.llm)
                       if profile.reranker.enabled else None)
                if new is not None:
                    new.load()
            except Exception as exc:
                log.error("switching to profile %s failed: %s", profile.name, exc)
                future.set_exception(exc)
                return
            with self._lock:
                old, self._service = self._service, new
                old_name, self.profile_name = self.profile_name, profile.name
            log.info("reranker profile is now %s", profile.name)
            unload = old
            try:
                if on_switched is not None:
                    on_switched(profile)
            except Exception as exc:
                unload = self._undo_switch(new, old, old_name)
                log.error("switching to profile %s failed after the swap, so it was undone "
                          "(profile %s stays): %s", profile.name, old_name, exc)
                future.set_exception(exc)
            else:
                future.set_result(profile.name)
            finally:
                if unload is not None:
                    unload.close(wait_for_inflight=True)

        threading.Thread(target=work, daemon=True, name="reranker-switch").start()
        return future

    def _undo_switch(
        self, new: RerankerService | None, old: RerankerService | None, old_name: str
    ) -> RerankerService | None:
        """Put ``old`` back if ``new`` is still active; return the service to unload.

        A later switch that already replaced ``new`` unloads it itself, so then the
        one left to unload is ``old``.
        """
        with self._lock:
            if self._service is not new:
                return old
            self._service, self.profile_name = old, old_name
        return new

    def close(self) -> None:
        """Unload the active service."""
        with self._lock:
            service, self._service = self._service, None
        if service is not None:
            service.close(wait_for_inflight=False)
