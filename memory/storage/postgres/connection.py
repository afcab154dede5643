"""The one place that talks to the PostgreSQL driver: URLs, the pool, errors.

The engine is synchronous and runs in worker threads (searches on a small pool,
writes on the bot's write queue, embedding on its own thread), so it uses psycopg 3's
synchronous API and :mod:`psycopg_pool`'s thread-safe ``ConnectionPool``; asyncpg
speaks asyncio only and would need an event loop in every thread.  The ``pgvector``
package teaches psycopg the ``vector`` type, so vectors travel as binary float32
arrays both ways.

psycopg, psycopg-pool and pgvector are the ``[postgres]`` extra: a SQLite-only
install never imports them.
"""

from __future__ import annotations

import logging
import re
import uuid
from collections.abc import Iterable, Iterator
from contextlib import contextmanager
from types import ModuleType
from typing import Any
from urllib.parse import parse_qsl, urlencode, urlsplit, urlunsplit

from memory.errors import DatabaseFileError, DiskFullError, StorageBusy
from memory.storage.dialect import Dialect

log = logging.getLogger(__name__)


def id_array(ids: Iterable[int]) -> list[int]:
    """The ``bigint[]`` parameter of ``= ANY(%s::bigint[])``: the ids, distinct and ascending."""
    return sorted({int(i) for i in ids})


DIALECT = Dialect(name="postgres", placeholder="%s", one_of_ids="= ANY(?::bigint[])",
                  id_param=id_array)
"""How PostgreSQL spells what the engine-neutral SQL leaves open (:mod:`memory.storage.dialect`)."""

URL_SCHEMES = ("postgresql", "postgres")
_SCHEME = re.compile(r"^([A-Za-z][A-Za-z0-9+.-]+):")


def is_postgres_url(location: object) -> bool:
    """Whether ``location`` is a ``postgresql://`` (or ``postgres://``) URL."""
    match = _SCHEME.match(str(location))
    return match is not None and match.group(1).lower() in URL_SCHEMES


_SECRET_PARAMETERS = {"password", "sslpassword"}  # libpq's connection parameters that hold one


def redact(url: str) -> str:
    """``url`` without its password, in the user part or a query parameter (what logs,
    errors and ``stats`` show); one that cannot be parsed shows only its scheme."""
    try:
        parts = urlsplit(url)
        parts.port  # noqa: B018  (parses the port: "host:x" raises here)
    except ValueError:
        return f"{url.split(':', 1)[0]}://… (unreadable URL)"
    if parts.password is not None:
        netloc = parts.netloc.rsplit("@", 1)
        user = netloc[0].split(":", 1)[0]
        parts = parts._replace(netloc=f"{user}:***@{netloc[1]}")
    if parts.query:
        pairs = parse_qsl(parts.query, keep_blank_values=True)
        if any(key.lower() in _SECRET_PARAMETERS for key, _ in pairs):
            parts = parts._replace(query=urlencode(
                [(key, "***" if key.lower() in _SECRET_PARAMETERS else value) for key, value in pairs],
                safe="/*"))
    # assembled by hand: urlunsplit drops the "//" of a URL with an empty host part
    return (f"{parts.scheme}://{parts.netloc}{parts.path}" + (f"?{parts.query}" if parts.query else "")
            + (f"#{parts.fragment}" if parts.fragment else ""))


def driver(url: str = "") -> ModuleType:
    """The psycopg module, with a clear error when the ``[postgres]`` extra is missing.

    Raises:
        DatabaseFileError: psycopg, psycopg-pool or pgvector is not installed.
    """
    try:
        import pgvector.psycopg  # noqa: F401
        import psycopg
        import psycopg_pool  # noqa: F401
    except ImportError as exc:
        raise DatabaseFileError(
            f"{redact(url) if url else 'a postgresql:// database'} needs the PostgreSQL driver "
            f"({exc.name} is missing): "
            "pip install '.[postgres]' in the repository (psycopg, psycopg-pool, pgvector)"
        ) from None
    return psycopg


def connect(url: str, **kwargs: Any) -> Any:
    """One autocommit connection of its own (migrations, a claim owner's session).

    Raises:
        DatabaseFileError: The server cannot be reached or refuses the login.
    """
    psycopg = driver(url)
    try:
        return psycopg.connect(url, autocommit=True, **kwargs)
    except psycopg.OperationalError as exc:
        raise DatabaseFileError(
            f"cannot connect to {redact(url)}: {one_line(exc)}; check the URL, that the "
            "server runs, and the role's password"
        ) from exc
    except psycopg.ProgrammingError as exc:  # libpq cannot read it: an unknown option, ...
        reason = one_line(exc).replace(url, redact(url))  # libpq quotes the URL, password too
        raise DatabaseFileError(f"{redact(url)} is not a usable PostgreSQL URL: {reason}") from None


def register_vector(conn: Any) -> None:
    """Teach ``conn`` the ``vector`` type (binary numpy in and out), once it exists."""
    from pgvector.psycopg import register_vector as register

    try:
        register(conn)
    except Exception as exc:  # psycopg.ProgrammingError: the extension is not created yet
        log.debug("vector type not registered yet: %s", exc)


def open_pool(url: str, *, max_size: int, read_only: bool) -> Any:
    """A thread-safe pool of autocommit connections with the vector type registered.

    Raises:
        DatabaseFileError: The server cannot be reached.
    """
    driver(url)
    from psycopg_pool import ConnectionPool

    def configure(conn: Any) -> None:
        register_vector(conn)
        # filters are applied inside the HNSW walk, which goes on until enough rows
        # pass them (pgvector 0.8); results are re-sorted by exact distance after it
        conn.execute("SET hnsw.iterative_scan = relaxed_order")
        # a keyword ranking over many hits is costed high enough to be JIT-compiled, which
        # takes longer than running it (measured: bench search-scale)
        conn.execute("SET jit = off")
        if read_only:
            conn.execute("SET default_transaction_read_only = on")

    pool = ConnectionPool(
        url, min_size=1, max_size=max_size, open=False, configure=configure,
        kwargs={"autocommit": True}, name="memory",
    )
    try:
        pool.open(wait=True, timeout=30)
    except Exception as exc:  # psycopg_pool.PoolTimeout: no connection came
        pool.close()
        raise DatabaseFileError(
            f"cannot connect to {redact(url)} ({one_line(exc)}); check the URL and that "
            "the server runs"
        ) from exc
    return pool


def one_line(exc: BaseException) -> str:
    """The first line of a driver error (PostgreSQL adds DETAIL/HINT lines)."""
    return str(exc).strip().splitlines()[0] if str(exc).strip() else type(exc).__name__


def as_disk_full(exc: BaseException, url: str) -> DiskFullError | None:
    """The one-line error for a write the server refused for lack of space, else ``None``.

    PostgreSQL says ``could not extend file ... No space left on device`` (SQLSTATE
    53100, ``disk_full``) and rolls the transaction back.  A file at the server's
    file-size limit (EFBIG) reads ``could not extend file ...: File too large`` with an
    internal-error SQLSTATE, and is the same case.
    """
    text = str(exc)
    if getattr(exc, "sqlstate", None) not in ("53100", "53000") and not (
        "No space left" in text or "could not extend file" in text or "File too large" in text
    ):
        return None
    return DiskFullError(
        f"could not write {redact(url)} ({one_line(exc)}): the server's disk is full (or a "
        "file there is at a size limit); the "
        "interrupted write was rolled back and everything stored before it is intact; "
        "free some space on the server and run it again"
    )


RETRYABLE_STATES = {
    "40001": "a serialization failure",
    "40P01": "a deadlock, resolved against this transaction",
    "55P03": "a lock wait longer than lock_timeout",
    "57P01": "the server ended the session (shutdown)",
    "57P02": "the server ended the session (crash shutdown)",
    "57P03": "the server is starting up",
}
"""SQLSTATEs after which the same transaction can simply run again (class ``08``,
connection exceptions, too)."""


def as_busy(exc: BaseException, url: str) -> StorageBusy | None:
    """The retryable error for a write the server could not take now, else ``None``.

    Retryable: the SQLSTATEs of :data:`RETRYABLE_STATES` and class ``08``, and a
    driver ``OperationalError`` with no SQLSTATE at all, which is how psycopg reports
    a connection lost mid-statement and how its pool reports that no connection came
    in time.
    """
    psycopg = driver(url)
    if not isinstance(exc, psycopg.Error):
        return None
    state = getattr(exc, "sqlstate", None)
    if state in RETRYABLE_STATES:
        why = RETRYABLE_STATES[state]
    elif state is not None and state.startswith("08"):
        why = "the connection failed"
    elif state is None and isinstance(exc, psycopg.OperationalError):
        why = "the connection was lost or none came in time"
    else:
        return None
    return StorageBusy(f"{redact(url)} could not take the write now ({why}: {one_line(exc)}); "
                       "nothing of it was applied, try again")


@contextmanager
def scratch_database(server_url: str) -> Iterator[str]:
    """A new, empty database on ``server_url``'s server for as long as the block runs.

    For benchmarks and tools that need a throw-away database next to the real one; the
    role needs ``CREATEDB``.  It is dropped at the end, whatever happens.

    Yields:
        The new database's URL.
    """
    name = f"memory_scratch_{uuid.uuid4().hex[:12]}"
    admin = connect(server_url)
    try:
        admin.execute(f"CREATE DATABASE {name}")
        yield urlunsplit(urlsplit(server_url)._replace(path=f"/{name}"))
    finally:
        admin.execute(f"DROP DATABASE IF EXISTS {name} WITH (FORCE)")
        admin.close()
