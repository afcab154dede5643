"""``bot.py migrate-db SOURCE TARGET``: move a whole memory between SQLite and PostgreSQL."""

from __future__ import annotations

from pathlib import Path

import click

from cli.output import progress_bar
from cli.params import DATABASE_PATH
from memory.errors import DatabaseFileError
from memory.storage import Storage, open_storage
from memory.storage.postgres.connection import is_postgres_url, redact
from memory.storage.transfer import Endpoint, total_rows, transfer


def endpoint(storage: Storage) -> Endpoint:
    """The transfer end of an open storage, by its engine."""
    if is_postgres_url(storage.database.location):
        from memory.storage.postgres import PostgresStorage
        from memory.storage.postgres.transfer import PostgresEndpoint

        assert isinstance(storage, PostgresStorage)
        return PostgresEndpoint(storage)
    from memory.storage.sqlite import SQLiteStorage
    from memory.storage.sqlite.transfer import SQLiteEndpoint

    assert isinstance(storage, SQLiteStorage)
    return SQLiteEndpoint(storage)


def database_name(location: Path | str) -> str:
    """How ``migrate-db`` names a database, shown and kept in the copy's ``meta``: a
    PostgreSQL URL without its password, an SQLite file by its resolved absolute path
    (so that a re-run finds its copy however the path is spelled)."""
    if is_postgres_url(str(location)):
        return redact(str(location))
    return str(Path(location).expanduser().resolve())


@click.command("migrate-db")
@click.argument("source", type=DATABASE_PATH)
@click.argument("target", type=DATABASE_PATH)
def migrate_db_command(source: Path | str, target: Path | str) -> int:
    """Copy a whole memory from SOURCE to TARGET (an SQLite file or a postgresql:// URL).

    Messages, vectors (not embedded again), windows and window vectors, tombstones,
    settings, opt-outs and cursors.  Killed half-way, run it again: it goes on where it
    stopped.  Run it again after SOURCE changed: TARGET gets every change since (edits,
    new and older messages, forgotten messages and members, settings, opt-outs).  At
    the end every row and every vector are compared; exit 2 if anything differs.
    """
    if not is_postgres_url(source) and not Path(source).exists():
        raise DatabaseFileError(f"{source} does not exist")
    names = [database_name(x) for x in (source, target)]
    if names[0] == names[1]:
        raise DatabaseFileError("SOURCE and TARGET are the same database")
    src = open_storage(source, read_only=True)
    try:
        dst = open_storage(target)
        try:
            origin, goal = endpoint(src), endpoint(dst)
            update, bar = progress_bar(total_rows(origin), "copying", "row")
            try:
                report = transfer(origin, goal, source_name=names[0],
                                  former_names=[redact(str(source))],
                                  progress=lambda _table, n: update(n))
            finally:
                bar.close()
        finally:
            dst.close()
    finally:
        src.close()
    for name, (theirs, ours) in report.counts.items():
        changes = (report.copied.get(name, 0), report.updated.get(name, 0),
                   report.removed.get(name, 0))
        click.echo(f"{name:22} {theirs:>10,} {ours:>10,}   +{changes[0]:,} ~{changes[1]:,} "
                   f"-{changes[2]:,}", err=True)
    if report.differences:
        for line in report.differences:
            click.echo(f"differs: {line}", err=True)
        click.echo(f"error: the copy in {names[1]} differs from {names[0]} (above)", err=True)
        return 2
    click.echo(f"{names[1]} now holds everything {names[0]} holds: every row count and every "
               "vector checked equal", err=True)
    return 0
