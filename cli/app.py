"""The command line: import, search, stats, embed, reembed, demo, bench, export-onnx and ``run`` (the bot).

``bot.py`` (the ``discord-memory-bot`` command) runs :func:`main`.  Every error a user
can cause (a bad value, a missing file, an engine error) becomes one line, ``error: …``,
on stderr and exit status 2; progress bars live here only.
"""

from __future__ import annotations

import json
import logging
import os
import sys
import tempfile
from collections.abc import Iterable, Sequence
from dataclasses import asdict, replace
from pathlib import Path
from typing import Any

import click

from cli.context import Settings, default_db, open_engine, profile_storage_url, require_db
from cli.migrate import migrate_db_command
from cli.output import (
    embed_with_progress,
    emit_json,
    format_result,
    progress_bar,
    result_to_dict,
)
from cli.params import DATABASE_PATH, ID_OR_NAME, INPUT_PATH, ISO_DATE, LOG_LEVEL, PORT, SNOWFLAKE
from cli.run import run_command
from memory.config import available_profiles
from memory.engine import MemoryEngine
from memory.errors import ImportFormatError, MemoryBotError, SearchInputError
from memory.ingest import ImportSummary
from memory.text import clean

log = logging.getLogger(__name__)

# -- the group -------------------------------------------------------------------------


@click.group(context_settings={"help_option_names": ["-h", "--help"]})
@click.option("--db", type=DATABASE_PATH, default=default_db,
              show_default="data/memory.sqlite3, env MEMORY_DB",
              help="SQLite database file, or a postgresql:// URL (else the profile's "
              "[storage] url).")
@click.option("--profile", envvar="MEMORY_PROFILE",
              help="Hardware profile name or .toml path (default: the one stored in the "
              "database, else cpu); 'auto' picks cuda, mps, else cpu (bfloat16 CPUs) or "
              f"cpu-small; shipped: {', '.join(available_profiles())}.")
@click.option("--log-level", type=LOG_LEVEL, default="WARNING", show_default=True,
              help="Logging level.")
@click.option("--metrics-port", type=PORT, help="Expose Prometheus metrics on this port.")
@click.pass_context
def cli_group(
    ctx: click.Context, db: Path | str, profile: str | None, log_level: str,
    metrics_port: int | None,
) -> None:
    """Discord memory bot: offline tools and the bot itself."""
    if not sys.stderr.isatty():  # model-loading bars (transformers' tqdm) would litter logs
        os.environ.setdefault("TQDM_DISABLE", "1")
    logging.basicConfig(level=log_level.upper(), format="%(levelname)s %(name)s: %(message)s")
    if metrics_port:
        from memory.metrics import serve

        try:
            serve(metrics_port)
        except OSError as exc:
            raise click.BadParameter(
                f"cannot listen on port {metrics_port} ({exc.strerror or exc})",
                param_hint="'--metrics-port'",
            ) from None
    if profile and ctx.get_parameter_source("db") is click.core.ParameterSource.DEFAULT:
        db = profile_storage_url(profile) or db
    ctx.obj = Settings(db=db, profile=profile)


@cli_group.command("import")
@click.argument("paths", nargs=-1, required=True, type=INPUT_PATH)
@click.option("--no-embed", is_flag=True, help="Store only; embed later with `embed`.")
@click.pass_obj
def import_command(settings: Settings, paths: tuple[Path, ...], no_embed: bool) -> int:
    """Import DiscordChatExporter JSON files or folders (searched recursively)."""
    from memory.importer import find_exports

    files = find_exports(list(paths))
    if not files:
        raise ImportFormatError(
            f"no .json files in {', '.join(map(str, paths))}: give DiscordChatExporter JSON "
            "exports (files, or folders that hold them)"
        )
    engine = open_engine(settings, load_reranker=False)
    try:
        on_file, files_bar = progress_bar(len(files), "reading")
        summary = engine.import_exports(files, embed=False, on_file=on_file)
        files_bar.close()
        if summary.errors and len(summary.errors) == summary.files and not summary.read:
            raise MemoryBotError(_unreadable(summary.errors))
        if not no_embed:  # what a damaged file gave before its damage is stored: embed it too
            summary.embedded = embed_with_progress(engine)
    finally:
        engine.close()
    click.echo(_import_line(summary))
    for error in summary.errors:  # a damaged file's bytes may hold terminal escapes
        click.echo(f"  skipped file: {clean(error)}", err=True)
    return 0


def _import_line(summary: ImportSummary) -> str:
    """The one line an import ends with: every message read is counted somewhere."""
    damaged = (f"; {summary.damaged} of them damaged part-way, what came before the damage is "
               "stored" if summary.damaged else "")
    left_out = [
        (summary.expired, "older than the server's retention period (not stored)"),
        (summary.misplaced, "with an id already stored in another channel (not stored)"),
        (summary.tombstoned, "deleted before (not stored again)"),
        (summary.opted_out, "by members who opted out (not stored)"),
        (summary.emptied, "stored copies forgotten (an edit took out all their text)"),
    ]
    return (f"{summary.files} files ({len(summary.errors)} unreadable{damaged}), "
            f"{summary.inserted} new, {summary.updated} updated, {summary.unchanged} unchanged, "
            f"{summary.skipped} skipped, {summary.embedded} embedded"
            + "".join(f", {count} {what}" for count, what in left_out if count))


def _unreadable(errors: list[str]) -> str:
    if len(errors) == 1:
        return errors[0]
    return f"none of the {len(errors)} files could be read; the first: {errors[0]}"


@cli_group.command("search")
@click.argument("queries", nargs=-1, required=True)
@click.option("--guild", type=SNOWFLAKE, help="Guild id (default: every guild).")
@click.option("--channel", "channels", type=ID_OR_NAME, multiple=True,
              help="Channel id or name, any case (repeatable); a channel or forum includes "
              "its threads.")
@click.option("--author", "authors", type=ID_OR_NAME, multiple=True,
              help="Author id, name or display name (repeatable).")
@click.option("--after", type=ISO_DATE, help="Only messages after this date (ISO 8601).")
@click.option("--before", type=ISO_DATE, help="Only messages before this date (ISO 8601).")
@click.option("--has-attachment", is_flag=True, help="Only messages with attachments.")
@click.option("--limit", type=click.IntRange(1, 100), default=10, show_default=True,
              help="Results to return.")
@click.option("--mode", type=click.Choice(("hybrid", "dense", "keyword")), default="hybrid",
              show_default=True, help="Retrieval: hybrid, dense vectors only, or keywords only.")
@click.option("--threshold", type=click.FloatRange(-1.0, 1.0),
              help="Fixed similarity threshold (default adaptive).")
@click.option("--no-rerank", is_flag=True, help="Skip the reranker.")
@click.option("--json", "as_json", is_flag=True, help="Print JSON.")
@click.option("--debug", is_flag=True, help="Print the trace: stages, timings, rerank.")
@click.pass_obj
def search_command(settings: Settings, queries: tuple[str, ...], **options: Any) -> int:
    """Search stored messages with one or more queries (up to 20, fused)."""
    from memory.search import SearchRequest
    from memory.search.request import validate

    require_db(settings.db)
    guild = options["guild"]
    request = SearchRequest(
        queries=queries, guild_id=guild, after=options["after"], before=options["before"],
        has_attachment=True if options["has_attachment"] else None, limit=options["limit"],
        mode=options["mode"], threshold=options["threshold"], rerank=not options["no_rerank"],
    )
    validate(request)  # a blank query is refused before the models load (an 8B: minutes)
    engine = open_engine(settings, load_reranker=False)
    try:
        request = replace(
            request, channel_ids=_channel_ids(engine, guild, options["channels"]),
            author_ids=_author_ids(engine, guild, options["authors"]),
        )
        if request.rerank:
            _say_if_not_reranked(engine)
        result = engine.search(request)
    finally:
        engine.close()
    if options["as_json"]:
        emit_json(result_to_dict(result))
    else:
        click.echo(format_result(result, debug=options["debug"]))
    return 0


def _say_if_not_reranked(engine: MemoryEngine) -> None:
    """Load the reranker now; if it cannot run, say why once (searches keep the hybrid order)."""
    status = engine.reranker_status()
    if status.name is not None and not status.loaded:
        log.info("reranker unavailable, searches keep the hybrid order: %s", status.reason)


def _channel_ids(
    engine: MemoryEngine, guild: int | None, values: Iterable[int | str]
) -> tuple[int, ...] | None:
    ids: list[int] = []
    for value in values:
        if isinstance(value, int):
            ids.append(value)
            continue
        found = engine.storage.messages.channel_ids_named(value.lstrip("#"), guild)
        if not found:
            raise SearchInputError(f"no stored channel is named {value!r}")
        ids.extend(found)
    return tuple(ids) or None


def _author_ids(
    engine: MemoryEngine, guild: int | None, values: Iterable[int | str]
) -> tuple[int, ...] | None:
    values = list(values)
    if not values:
        return None
    members = engine.storage.messages.members(guild)
    ids: list[int] = []
    for value in values:
        text = str(value).lower()
        matches = [m[0] for m in members
                   if m[0] == value or text in (m[1].lower(), m[2].lower())]
        if not matches:
            raise SearchInputError(f"no stored author is called {value!r}")
        ids.extend(matches)
    return tuple(ids)


@cli_group.command("stats")
@click.option("--json", "as_json", is_flag=True, help="Print JSON.")
@click.pass_obj
def stats_command(settings: Settings, as_json: bool) -> int:
    """Show what the database holds."""
    from memory.storage import open_storage

    require_db(settings.db)
    storage = open_storage(settings.db)
    try:
        stats = asdict(storage.stats())
    finally:
        storage.close()
    if as_json:
        emit_json(stats)
    else:
        for key, value in stats.items():
            click.echo(f"{key:>20}: {value}")
    return 0


@cli_group.command("embed")
@click.pass_obj
def embed_command(settings: Settings) -> int:
    """Embed stored messages that have no vector yet."""
    require_db(settings.db)
    engine = open_engine(settings, load_reranker=False)
    try:
        done = embed_with_progress(engine)
    finally:
        engine.close()
    click.echo(f"embedded {done} messages")
    return 0


@cli_group.command("reembed")
@click.pass_obj
def reembed_command(settings: Settings) -> int:
    """Re-embed every message with the profile's embedder."""
    require_db(settings.db)
    engine = open_engine(settings, load_reranker=False, check_model=False)
    try:
        update, bar = progress_bar(engine.storage.messages.count(), "re-embedding")
        done = engine.reembed(progress=update)
        bar.close()
    finally:
        engine.close()
    click.echo(f"re-embedded {done} messages with {engine.embedder.model_id}")
    return 0


@cli_group.command("demo")
@click.option("--keep", is_flag=True, help="Use --db instead of a temporary database.")
@click.pass_obj
def demo_command(settings: Settings, keep: bool) -> int:
    """Import the sample server in data/ and run searches."""
    from cli.demo import run_demo

    if keep:
        return run_demo(settings, settings.db)
    with tempfile.TemporaryDirectory(prefix="memory-demo-") as tmp:
        return run_demo(settings, Path(tmp) / "demo.sqlite3")


@cli_group.command("export-onnx")
@click.argument("model_dir", type=click.Path(exists=True, file_okay=False, path_type=Path))
@click.option("--int8", is_flag=True,
              help="Also write the int8-quantised copy for this CPU "
                   "(onnx/model_qint8_avx512_vnni.onnx on a CPU with VNNI).")
def export_onnx_command(model_dir: Path, int8: bool) -> int:
    """Export a cross-encoder folder to ONNX for `runtime = "onnx"` (needs the [onnx] extra)."""
    from cli.export_onnx import export_cross_encoder

    exported = export_cross_encoder(model_dir, int8=int8)
    for name, diff in zip(exported.files, exported.max_diff):
        click.echo(f"{model_dir / name}  (largest score difference from torch: {diff:.2g})")
    # TOML lines to paste into a profile (a JSON string is a TOML basic string)
    click.echo("use it in a profile:\n[reranker]\nbackend = \"cross-encoder\"\n"
               f"model = {json.dumps(str(model_dir.resolve()))}\nruntime = \"onnx\"\n"
               f"onnx_file = {json.dumps(exported.files[-1])}")
    return 0


cli_group.add_command(run_command)
cli_group.add_command(migrate_db_command)


# -- running it ------------------------------------------------------------------------


def main(argv: Sequence[str] | None = None, *, prog_name: str = "bot.py") -> int:
    """Run the command line and return its exit status.

    Args:
        argv: The arguments (default ``sys.argv[1:]``).
        prog_name: The name usage lines show.

    Returns:
        0 on success, 2 for any error the user can fix (one line on stderr),
        130 when interrupted.
    """
    args = list(sys.argv[1:] if argv is None else argv)
    try:
        result = cli_group.main(args=args, prog_name=prog_name, standalone_mode=False)
    except click.exceptions.NoArgsIsHelpError as exc:
        click.echo(exc.ctx.get_help() if exc.ctx else "", err=True)
        return 2
    except click.ClickException as exc:
        return _error(exc.format_message())
    except MemoryBotError as exc:
        return _error(str(exc))
    except OSError as exc:  # a path too long, a folder this user may not enter, ...
        where = f"{exc.filename}: " if exc.filename else ""
        return _error(f"{where}{exc.strerror or exc}")
    except (KeyboardInterrupt, click.exceptions.Abort):
        click.echo("interrupted; work committed so far is kept", err=True)
        return 130
    return result if isinstance(result, int) else 0


def _error(message: str) -> int:
    click.echo(f"error: {clean(message)}", err=True)  # one line, no terminal escapes
    return 2
