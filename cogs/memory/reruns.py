"""Background work that runs again on every READY, one run at a time.

discord.py dispatches ``on_ready`` after the first connection and again after every
fresh session (a RESUME Discord refused, or an outage longer than its resume
window), and Discord replays nothing that was said or deleted meanwhile.  So the
start-up catch-up and reconcile run again then.  A READY while a run is under way
queues one more behind it; a READY while one is already queued adds nothing (the
queued run reads Discord as it is when it starts).
"""

from __future__ import annotations

import asyncio
from collections.abc import Callable, Coroutine
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from cogs.memory.runtime import MemoryRuntime


class Reruns:
    """Runs of one kind of background work, one at a time, at most one queued.

    Args:
        runtime: Whose background work the runs are (stopping it stops them).
        name: The tasks' name.
    """

    def __init__(self, runtime: MemoryRuntime, name: str) -> None:
        self.runtime = runtime
        self.name = name
        self.task: asyncio.Task | None = None  # the newest run, under way or queued
        self._queued = False

    def start(self, work: Callable[[], Coroutine[Any, Any, Any]]) -> asyncio.Task:
        """Run ``work()`` now, or after the run under way; the queued run if one waits."""
        previous = self.task
        busy = previous is not None and not previous.done()
        if busy and self._queued:
            assert previous is not None
            return previous
        self._queued = busy
        self.task = self.runtime.spawn(self._after(previous, work), name=self.name)
        return self.task

    async def _after(self, previous: asyncio.Task | None,
                     work: Callable[[], Coroutine[Any, Any, Any]]) -> Any:
        if previous is not None:
            await asyncio.wait({previous})  # its own failures are its own to log
        self._queued = False
        return await work()
