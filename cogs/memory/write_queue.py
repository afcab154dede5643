"""The ordered write queue: writes reach the database even when it is busy.

Every store, edit and delete goes through one :class:`WriteQueue`, as the engine
call that applies it and its items (``writes.put(engine.forget_messages, [id])``).
A single task drains it in order, batches what has piled up (consecutive writes of
the same call become one call), and applies the batch in a worker thread.  When the
database is locked (an import or another process is writing) the batch waits and is
tried again with backoff, so a member's message is never dropped for being sent at a
busy moment.  A busy spell that lasts (PostgreSQL down for good reads as busy too) is
said at WARNING, with how many writes wait, after a minute and then every five.

A batch that fails for another reason is tried again a few times, then each of its
items alone, in order: a write the database refuses for good (a bug, a record it
cannot hold) is given up by itself, never with the other members' messages and
deletions that happened to share its batch.  When several items in a row fail too,
the error is the database's, not theirs: the rest of the batch is given up at once
rather than tried item by item for minutes.  What is given up is handed to the
queue's ``given_up`` (the runtime marks new messages for the next catch-up).
"""

from __future__ import annotations

import asyncio
import logging
import random
import time
from collections.abc import Awaitable, Callable, Coroutine
from dataclasses import dataclass, field
from typing import Any

from memory.errors import DiskFullError, StorageBusy
from memory.records import MessageRecord

log = logging.getLogger(__name__)

MAX_BATCH = 200
RETRY_MIN_S, RETRY_MAX_S = 0.05, 5.0
GIVE_UP_AFTER = 8  # tries of a write that fails for a reason other than a busy database
SPLIT_AFTER = 4  # tries of a batch of several items (a passing error) before each is tried alone
SPLIT_TRIES = 2  # tries of each item of a split batch
SYSTEMIC_AFTER = 5  # items of a split batch given up in a row: the rest are given up untried
# A busy database is retried for ever (nothing a member sends is dropped), but a long
# run of busy retries is no passing lock: PostgreSQL down for good reads as pool
# timeouts, i.e. StorageBusy.  Said at WARNING after this long, then this often.
BUSY_WARN_AFTER_S = 60.0
BUSY_WARN_EVERY_S = 300.0
RETRY_GIVEN_UP_S = 600.0  # a deletion or an edit given up goes back into the queue this much later


def is_busy(exc: BaseException) -> bool:
    """Whether ``exc`` says the database could not take the write now (worth retrying
    at once, without counting towards giving up): :class:`~memory.errors.StorageBusy`,
    which both storage engines raise for it."""
    return isinstance(exc, StorageBusy)


Apply = Callable[[list], object]
"""An engine call that takes a list of items: records to store, ids to forget, ..."""


@dataclass
class Write:
    """One queued write: the engine call that applies it, and its items."""

    apply: Apply
    items: list
    done: asyncio.Future | None = field(default=None, repr=False)


class WriteQueue:
    """Applies writes in arrival order, batched, retried while the database is busy.

    Args:
        run: Runs a blocking callable off the event loop (the runtime's write thread).
        given_up: Called on the event loop with the writes given up (each failed for
            good, or untried after a run of failures), so what they carried is not lost.
    """

    def __init__(self, run: Callable[[Callable[[], None]], Awaitable[None]],
                 given_up: Callable[[list[Write]], None] | None = None) -> None:
        self._run = run
        self._given_up = given_up
        self._queue: asyncio.Queue[Write] = asyncio.Queue()
        self._task: asyncio.Task | None = None
        self._applying: list[Write] = []  # the batch on the write thread now
        self.late: list[Write] = []  # put after the queue stopped: never applied

    def start(self) -> None:
        """Start the task that drains the queue (once; the running loop's)."""
        if self._task is None:
            self._task = asyncio.create_task(self._drain(), name="memory-writes")

    @property
    def backlog(self) -> int:
        """How many writes wait in the queue (the batch being applied not counted)."""
        return self._queue.qsize()

    def put(self, apply: Apply, items: list) -> None:
        """Queue ``apply(items)``; it runs soon, in order with the other writes.

        Once the queue has stopped nothing runs it: it is logged at ERROR with its ids
        and kept in :attr:`late`.  (The bot hangs up the gateway before its cogs stop,
        so no listener should get here.)
        """
        if not items:
            return
        write = Write(apply, list(items))
        if self._task is None:
            log.error("a write arrived after the write queue stopped: %s", describe([write]))
            self.late.append(write)
            return
        self._queue.put_nowait(write)

    async def put_and_wait(self, apply: Apply, items: list) -> None:
        """Queue ``apply(items)`` and return once it is committed (raises if it was given up)."""
        future = asyncio.get_running_loop().create_future()
        self._queue.put_nowait(Write(apply, list(items), future))
        await future

    async def run_and_wait(self, fn: Callable[[], object]) -> None:
        """Run ``fn`` on the write thread, in order with the queued writes, and wait for it."""
        await self.put_and_wait(_call_each, [fn])

    async def stop(self, timeout: float = 10.0) -> list[Write]:
        """Apply what is queued (for at most ``timeout`` seconds), then stop.

        Returns:
            The writes not known to be applied when the time ran out: those still
            queued and the batch on the write thread (which may yet commit), in order.
        """
        if self._task is None:
            return []
        try:
            await asyncio.wait_for(self._queue.join(), timeout)
        except TimeoutError:
            log.error("shutting down with %d writes not applied", self._queue.qsize())
        self._task.cancel()
        try:
            await self._task
        except asyncio.CancelledError:
            pass
        self._task = None
        left, self._applying = self._applying, []
        while not self._queue.empty():
            left.append(self._queue.get_nowait())
            self._queue.task_done()
        return left

    async def _drain(self) -> None:
        while True:
            batch = [await self._queue.get()]
            while len(batch) < MAX_BATCH and not self._queue.empty():
                batch.append(self._queue.get_nowait())
            self._applying = batch
            try:
                await self._apply_with_retry(batch)
                self._applying = []
            finally:
                for _ in batch:
                    self._queue.task_done()

    async def _apply_with_retry(self, batch: list[Write]) -> None:
        several = sum(len(write.items) for write in batch) > 1
        failed = await self._attempt(batch, SPLIT_AFTER if several else GIVE_UP_AFTER)
        if failed is None or not several:
            if failed is not None:
                _give_up(batch, GIVE_UP_AFTER, failed)
                self._hand_over(batch)
            _settle(batch, failed)
            return
        log.warning("a batch of %d writes keeps failing (%s); applying its items one by one",
                    len(batch), failed)
        await self._one_by_one(batch, failed)

    async def _one_by_one(self, batch: list[Write], failed: BaseException) -> None:
        """Apply each item of a failing batch alone, in order; the writes not yet
        settled stay in ``_applying`` (what a stop hands back)."""
        in_a_row, untried = 0, []
        for write in batch:
            error = None
            for item in write.items:
                single = Write(write.apply, [item])
                if in_a_row >= SYSTEMIC_AFTER:
                    untried.append(single)
                    error = failed
                    continue
                if (exc := await self._attempt([single], SPLIT_TRIES)) is None:
                    in_a_row = 0
                    continue
                in_a_row += 1
                error = failed = exc
                _give_up([single], SPLIT_TRIES, exc, trace=in_a_row == 1)
                self._hand_over([single])
            _settle([write], error)
            self._applying = [w for w in self._applying if w is not write]
        if untried:
            log.error("%d items in a row failed alike; giving up on the %d after them untried: %s",
                      SYSTEMIC_AFTER, len(untried), describe(untried))
            self._hand_over(untried)

    def _hand_over(self, writes: list[Write]) -> None:
        """Hand writes given up to ``given_up``; its own failure is logged, never raised."""
        if self._given_up is None:
            return
        try:
            self._given_up(writes)
        except Exception:
            log.exception("could not hand over the writes given up: %s", describe(writes))

    async def _attempt(self, batch: list[Write], tries: int) -> BaseException | None:
        """Apply ``batch`` until it commits (``None``) or fails ``tries`` times for a
        reason other than a busy database or a full disk (that error)."""
        delay, failures = RETRY_MIN_S, 0
        busy = _BusySpell()
        while True:
            try:
                await self._run(lambda: apply_in_order(batch))
            except asyncio.CancelledError:
                raise
            except DiskFullError as exc:  # kept and retried until there is room: never dropped
                failures += 1
                if failures == 1 or failures % 20 == 0:
                    log.error("%d writes wait for disk space: %s", len(batch), exc)
            except Exception as exc:
                if not is_busy(exc):
                    failures += 1
                    if failures >= tries:
                        return exc
                    log.warning("writing %d changes failed (%s); retrying", len(batch), exc)
                    busy = _BusySpell()  # another error: no longer one busy spell
                else:
                    busy.retrying(len(batch) + self.backlog, delay, exc)
            else:
                busy.end()
                return None
            await asyncio.sleep(delay * (0.5 + random.random()))
            delay = min(delay * 2, RETRY_MAX_S)


class LaterTries:
    """Deletions and edits the queue gave up on, put back into it every
    :data:`RETRY_GIVEN_UP_S` until they land.

    A new message given up can be read from Discord again by the next catch-up; a
    deletion or an edit cannot be found again (a reconcile reads only recent
    messages), so until it lands the deleted or edited-out text would stay stored.
    What still waits when the bot stops is taken (:meth:`take`) and finished with the
    writes the stop left.

    Args:
        queue: The write queue they go back into.
        spawn: Runs the waiting in the background (cancelled when the runtime stops).
    """

    def __init__(self, queue: WriteQueue,
                 spawn: Callable[[Coroutine[Any, Any, None]], object]) -> None:
        self._queue = queue
        self._spawn = spawn
        self._waiting: list[Write] = []

    def add(self, writes: list[Write]) -> None:
        """Try ``writes`` again later (each alone, as the queue gave them up)."""
        if not writes:
            return
        log.warning("trying again in %.0f s: %s", RETRY_GIVEN_UP_S, describe(writes))
        if not self._waiting:
            self._spawn(self._put_back_later())
        self._waiting.extend(writes)

    def take(self) -> list[Write]:
        """The writes still waiting, no longer to be put back."""
        waiting, self._waiting = self._waiting, []
        return waiting

    async def _put_back_later(self) -> None:
        await asyncio.sleep(RETRY_GIVEN_UP_S)
        for write in self.take():
            self._queue.put(write.apply, write.items)


class _BusySpell:
    """Says how long the database has been busy for a batch: INFO per retry, WARNING
    once it has lasted :data:`BUSY_WARN_AFTER_S` (then every :data:`BUSY_WARN_EVERY_S`),
    and WARNING again when a spell that was warned about ends."""

    def __init__(self) -> None:
        self.since: float | None = None
        self.warned_at: float | None = None

    def retrying(self, waiting: int, delay: float, exc: BaseException) -> None:
        """One more busy retry; ``waiting`` writes (this batch and the queue) wait."""
        now = time.monotonic()
        if self.since is None:
            self.since = now
        lasted = now - self.since
        due = lasted >= BUSY_WARN_AFTER_S and (
            self.warned_at is None or now - self.warned_at >= BUSY_WARN_EVERY_S)
        if not due:
            log.info("database busy; retrying %d writes in %.2f s", waiting, delay)
            return
        self.warned_at = now
        log.warning("database busy for %.0f s (%s): %d writes wait; still retrying, nothing "
                    "is dropped", lasted, exc, waiting)

    def end(self) -> None:
        """The batch was written: the busy spell is over."""
        if self.since is not None and self.warned_at is not None:
            log.warning("database takes writes again after %.0f s busy",
                        time.monotonic() - self.since)
        self.since = self.warned_at = None


def apply_in_order(batch: list[Write]) -> None:
    """Apply a batch in order; consecutive writes of the same call become one call."""
    run: list[Write] = []
    for write in [*batch, None]:
        if run and (write is None or write.apply != run[0].apply):
            run[0].apply([item for w in run for item in w.items])
            run = []
        if write is not None:
            run.append(write)


def describe(writes: list[Write]) -> str:
    """The writes in a log line: each engine call with its items (message ids for records)."""
    parts = []
    for write in writes:
        name = getattr(write.apply, "__name__", repr(write.apply))
        items = [item.id if isinstance(item, MessageRecord) else item for item in write.items]
        parts.append(f"{name}{items}")
    return ", ".join(parts)


def _call_each(calls: list[Callable[[], object]]) -> None:
    for call in calls:
        call()


def _give_up(writes: list[Write], tries: int, exc: BaseException, *, trace: bool = True) -> None:
    log.error("giving up on %d writes after %d tries: %s (%s)", len(writes), tries,
              describe(writes), exc, exc_info=exc if trace else None)


def _settle(batch: list[Write], exc: BaseException | None) -> None:
    for write in batch:
        if write.done is not None and not write.done.done():
            if exc is None:
                write.done.set_result(None)
            else:
                write.done.set_exception(exc)
