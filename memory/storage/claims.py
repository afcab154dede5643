"""Who holds a claim on part of the embedding backlog, and whether they still run.

Concurrent embedders (the bot, an ``embed`` or ``import`` next to it) share the
backlog by claiming batches (:meth:`memory.storage.contract.Backlog.claim`).  A claim must
die with the process that made it: a killed embedder's batch goes back to the
backlog at once, so the very next run finishes it, instead of waiting for the claim
to time out.

A claim's owner names its process: host, pid and the process's start time (a pid
can be reused by a later process; pid and start time together cannot), plus a
random suffix so that two embedders in one process never share a claim.  On this
host a dead owner is seen at once; an owner on another host (a database on a shared
disk) is only known dead when its claim expires.  A server database does the same
with the session that holds a row lock (PostgreSQL: ``FOR UPDATE SKIP LOCKED``).
"""

from __future__ import annotations

import os
import socket
import uuid

import psutil

_HOST = socket.gethostname()


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
