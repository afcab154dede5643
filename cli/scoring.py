"""Labelled questions and how a ranking is scored against them.

The demo scores its questions with these (``data/demo-server/queries.jsonl``), and so
does ``bench retrieval`` on the dev sets; the format is the one in
``shared/datasets/README.md``: one JSON object per line with the query, its guild and
channel, and the ids of the messages that answer it.
"""

from __future__ import annotations

import json
import math
from dataclasses import dataclass
from pathlib import Path

from memory.errors import ImportFormatError


@dataclass(frozen=True)
class Query:
    """One benchmark query with its evidence message ids."""

    id: str
    text: str
    guild_id: int
    channel_id: int
    relevant: frozenset[int]
    category: str = "all"


def load_queries(path: str | Path) -> list[Query]:
    """Read ``queries.jsonl`` (format: shared/datasets/README.md).

    Raises:
        ImportFormatError: The file is missing, or a line is not a labelled query.
    """
    path = Path(path)
    try:
        text = path.read_text(encoding="utf-8")
    except (OSError, UnicodeDecodeError) as exc:
        raise ImportFormatError(f"{path}: cannot read the queries ({exc})") from None
    queries = []
    for number, line in enumerate(text.splitlines(), start=1):
        if line.strip():
            try:
                queries.append(_query(json.loads(line)))
            except (ValueError, TypeError, KeyError) as exc:
                raise ImportFormatError(
                    f"{path}:{number}: not a labelled query ({type(exc).__name__}: {exc})"
                ) from None
    return queries


def _query(raw: dict) -> Query:
    return Query(
        id=str(raw["id"]), text=str(raw["query"]), guild_id=int(raw["guild_id"]),
        channel_id=int(raw["channel_id"]), relevant=frozenset(int(i) for i in raw["relevant"]),
        category=str(raw.get("category") or "all"),
    )


def score_ranking(ranked: list[int], relevant: frozenset[int], k: int) -> dict[str, float]:
    """Recall, hit, MRR and binary-gain nDCG at ``k`` for one query."""
    top = ranked[:k]
    found = [i for i, mid in enumerate(top) if mid in relevant]
    dcg = sum(1.0 / math.log2(i + 2) for i in found)
    ideal = sum(1.0 / math.log2(i + 2) for i in range(min(len(relevant), k)))
    return {
        "recall": len(found) / len(relevant) if relevant else 0.0,
        "hit": 1.0 if found else 0.0,
        "mrr": 1.0 / (found[0] + 1) if found else 0.0,
        "ndcg": dcg / ideal if ideal else 0.0,
    }


