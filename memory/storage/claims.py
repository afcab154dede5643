"""Who holds a claim on part of the embedding backlog, and whether they still run.

Concurrent embedders (the bot, an ``embed`` or ``import`` next to it) share the
backlog by claiming batches (:meth:`memory.storage.contract.Backlog.claim`).  A claim must
die with the process that made it: a killed embedder's batch goes back to the
backlog at once, so the very next run finishes it, instead of waiting for the claim
to time out.

A claim's owner names its process: host, pid and the process's start time (a pid
can be reused by a later process; pid and start time together cannot), plus a
random suffix so that two embedders in one process never share a claim.  On this
host a dead owner is seen at once (:func:`is_dead`).

The host name alone cannot prove an owner on *another* host dead, and a container
re-created after ``kill -9`` (a pod rescheduled, the database on a volume) comes
back with a new name.  So an owner also holds a lock for as long as it runs
(:class:`OwnerLocks`): one byte of a file beside the database, locked with an
open-file-description lock that the kernel drops when the process ends, however it
ends.  Whoever can see that file (any container on the host, a shared disk whose
file system carries locks) knows at once that an owner whose byte is free has
ended; only where no lock can be taken (no ``F_OFD_SETLK``, a folder this process
cannot write) does a claim wait to expire.  PostgreSQL does the same with a
session-level advisory lock (:mod:`memory.storage.postgres.backlog`).
"""

from __future__ import annotations

import hashlib
import logging
import os
import socket
import struct
import threading
import uuid

import psutil

try:
    import fcntl
except ImportError:  # not a POSIX system: claims end when they expire
    fcntl = None  # type: ignore[assignment]

log = logging.getLogger(__name__)

_HOST = socket.gethostname()
_OFD = fcntl is not None and hasattr(fcntl, "F_OFD_SETLK")
_FLOCK = "hhqqixxxx"  # struct flock: type, whence, start, len, pid (and padding)


def _started_ms(pid: int) -> int:
    return int(psutil.Process(pid).create_time() * 1000)


def process_owner() -> str:
    """A new owner name for this process: ``host/pid/start_ms/random``."""
    pid = os.getpid()
    return f"{_HOST}/{pid}/{_started_ms(pid)}/{uuid.uuid4().hex[:12]}"


def is_dead(owner: str) -> bool:
    """Whether ``owner``'s process has certainly ended.

    ``False`` when it runs, when it runs on another host, or when the name is not
    one :func:`process_owner` made (claims made by older versions): those claims
    end when they expire.
    """
    parts = owner.split("/")
    if len(parts) != 4 or parts[0] != _HOST or not parts[1].isdigit() or not parts[2].isdigit():
        return False
    pid, started = int(parts[1]), int(parts[2])
    try:
        # create_time is a float of seconds: allow for rounding either way
        return abs(_started_ms(pid) - started) > 10
    except psutil.NoSuchProcess:
        return True
    except psutil.AccessDenied:  # another user's process with this pid: alive
        return False


def _slot(owner: str) -> int:
    """The byte of the lock file an owner locks (below 2**62: any off_t holds it)."""
    return int.from_bytes(hashlib.blake2b(owner.encode(), digest_size=8).digest(), "big") >> 2


def _lock(fd: int, command: int, kind: int, start: int, length: int = 1) -> int:
    """One ``fcntl`` record-lock call; returns the lock type the kernel reports."""
    assert fcntl is not None
    answer = fcntl.fcntl(fd, command, struct.pack(_FLOCK, kind, os.SEEK_SET, start, length, 0))
    return int(struct.unpack(_FLOCK, answer)[0])


class OwnerLocks:
    """The locks that show which claim owners of one SQLite database still run.

    An owner locks its byte of ``<database>-claims`` (:meth:`hold`) before it claims;
    the kernel releases it when the owner :meth:`release` s or its process ends.
    Open-file-description locks (Linux ``F_OFD_SETLK``) belong to this object's file
    descriptor, not to the process, so a second storage handle in the same process
    sees this one's owners as alive, and closing a descriptor touches no other lock.

    Args:
        database: The database file's path (``:memory:`` has no claims to share).
    """

    def __init__(self, database: str) -> None:
        self._path = None if database == ":memory:" or not _OFD else f"{database}-claims"
        self._fd: int | None = None
        self._held: set[str] = set()
        self._guard = threading.Lock()

    def hold(self, owner: str) -> None:
        """Lock ``owner``'s byte for as long as it claims (once per owner)."""
        with self._guard:
            if self._path is None or owner in self._held:
                return
            try:
                if self._fd is None:
                    self._fd = os.open(self._path, os.O_RDWR | os.O_CREAT, 0o600)
                _lock(self._fd, fcntl.F_OFD_SETLK, fcntl.F_WRLCK, _slot(owner))
            except OSError as exc:  # its claims still end when they expire
                log.warning("could not lock %s for embedder %s (%s): if it is killed, its "
                            "claims wait for their time-to-live", self._path, owner, exc)
                return
            self._held.add(owner)

    def release(self, owner: str) -> None:
        """Unlock ``owner``'s byte; with no owner left, close the file (and remove it
        when no other process holds a byte of it)."""
        with self._guard:
            if owner not in self._held or self._fd is None:
                return
            self._held.discard(owner)
            _lock(self._fd, fcntl.F_OFD_SETLK, fcntl.F_UNLCK, _slot(owner))
            if not self._held:
                self._close()

    def close(self) -> None:
        """Release every owner's lock, as their process ending would."""
        with self._guard:
            if self._fd is not None:
                self._held.clear()
                self._close()

    def _close(self) -> None:
        assert self._fd is not None and self._path is not None
        try:  # length 0: the whole file; a lock another process holds keeps it
            if _lock(self._fd, fcntl.F_OFD_GETLK, fcntl.F_WRLCK, 0, 0) == fcntl.F_UNLCK:
                os.unlink(self._path)
        except OSError as exc:
            log.debug("left %s in place (%s)", self._path, exc)
        os.close(self._fd)
        self._fd = None

    def ended(self, owners: list[str]) -> set[str]:
        """Those of ``owners`` that certainly hold no lock, so their process has ended.

        Empty where locks cannot be seen (no lock support, a file this process
        cannot open): those claims end when they expire.
        """
        others = [owner for owner in owners if owner not in self._held]
        if self._path is None or not others:
            return set()
        try:
            fd = os.open(self._path, os.O_RDWR)
        except FileNotFoundError:  # nobody has held a lock since the last one ended
            return set(others)
        except OSError as exc:
            log.debug("cannot read the claim locks in %s (%s)", self._path, exc)
            return set()
        try:
            return {owner for owner in others if _lock(
                fd, fcntl.F_OFD_GETLK, fcntl.F_WRLCK, _slot(owner)) == fcntl.F_UNLCK}
        finally:
            os.close(fd)
