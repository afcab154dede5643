"""What the command line prints: result tables, JSON, progress bars."""

from __future__ import annotations

import json
import sys
from collections.abc import Callable
from dataclasses import asdict
from pathlib import Path
from typing import Any

import click

from memory.engine import MemoryEngine
from memory.errors import MemoryBotError
from memory.records import SearchResult, ms_to_datetime
from memory.text import clean


def progress_bar(total: int, desc: str, unit: str = "msg") -> tuple[Callable[[int], None], Any]:
    """A tqdm bar on stderr and its update function (off when stderr is not a terminal,
    so logs and error lines stay clean)."""
    from tqdm import tqdm

    bar = tqdm(total=total, desc=desc, unit=unit, file=sys.stderr, leave=False,
               disable=not sys.stderr.isatty())
    return bar.update, bar


def embed_with_progress(engine: MemoryEngine) -> int:
    """Embed the engine's backlog behind a progress bar; returns messages embedded."""
    update, bar = progress_bar(engine.storage.backlog.pending_count(), "embedding")
    try:
        return engine.embed_pending(progress=update)
    finally:
        bar.close()


def emit_json(data: Any, path: Path | None = None) -> None:
    """Print ``data`` as JSON, and write it to ``path`` too when given.

    Raises:
        MemoryBotError: ``path`` cannot be written.
    """
    text = json.dumps(data, indent=2, ensure_ascii=False, default=str)
    if path:
        try:
            path.write_text(text + "\n", encoding="utf-8")
        except OSError as exc:  # checked before the work began, but the disk may have filled
            raise MemoryBotError(f"cannot write {path} ({exc.strerror or exc})") from exc
    click.echo(text)


def result_to_dict(result: SearchResult) -> dict[str, Any]:
    """A JSON-ready view of a search result."""
    return {
        "hits": [
            {**asdict(h), "jump_url": h.jump_url,
             "created": ms_to_datetime(h.created_at).isoformat()}
            for h in result.hits
        ],
        "trace": asdict(result.trace),
        "empty_reason": result.empty_reason,
    }


def format_result(result: SearchResult, *, debug: bool = False, width: int = 90) -> str:
    """A plain-text table of hits, with the trace when ``debug``."""
    lines = []
    if not result.hits:
        lines.append(f"no results: {result.empty_reason}")
    for rank, h in enumerate(result.hits, start=1):
        sim = f"{h.similarity:.3f}" if h.similarity is not None else "  -  "
        kw = f"{h.keyword_score:5.2f}" if h.keyword_score is not None else "  -  "
        rr = f" rerank {h.rerank_score:.3f}" if h.rerank_score is not None else ""
        when = ms_to_datetime(h.created_at).strftime("%Y-%m-%d")
        # stored text is anyone's: no control or format character reaches the terminal
        # (an escape sequence, a newline forging a result line, a direction override)
        text = clean(h.content)
        if h.attachments:
            text += (" " if text else "") + f"[attached: {clean(', '.join(h.attachments))}]"
        text = text if len(text) <= width else text[: width - 1] + "…"
        lines.append(
            f"{rank:>2}. score {h.score:.4f} sim {sim} bm25 {kw} bonus {h.bonus:+.4f}{rr}  "
            f"#{clean(h.channel_name)} {when} {clean(h.author_name)}\n    {text}"
        )
    t = result.trace
    threshold = f"{t.threshold:.2f} ({t.threshold_mode})" if t.threshold is not None else t.threshold_mode
    if t.threshold_floor is not None:
        threshold += f", floor {t.threshold_floor:.2f}"
    if t.keyword_only:
        lines.append(f"keyword search only: {t.keyword_only}")
    lines.append(
        f"[{t.candidates.get('returned', 0)} results, threshold {threshold}, "
        f"{t.timings_ms.get('total', 0):.1f} ms]"
    )
    if debug:
        lines.extend(_trace_lines(result))
    return "\n".join(lines)


def _trace_lines(result: SearchResult) -> list[str]:
    t = result.trace
    lines = [
        f"candidates per stage: {t.candidates}",
        "timings (ms): " + ", ".join(f"{k} {v:.2f}" for k, v in t.timings_ms.items()),
        f"threshold iterations: {t.threshold_iterations}",
    ]
    if t.reranked:
        lines.append(f"reranker {t.rerank_backend}: before {t.pre_rerank}, after {t.post_rerank}")
    elif t.rerank_fallback:
        lines.append(f"reranker {t.rerank_backend} skipped: {t.rerank_fallback.splitlines()[0]}")
    return lines
