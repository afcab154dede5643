"""``bench retrieval``: recall, hit, MRR and nDCG per retrieval mode on labelled export sets.

Every mode is scored side by side in one run on one machine, on every dataset given
(the dev sets are judged together: a change that helps one and hurts another is no
gain).  ``rerank`` is listed only when a reranker actually ran (a missing model falls
back to the hybrid order, and numbers equal to hybrid's would mislead).  A run can
change profile settings (``--set search.window_weight=0``) for ablations, keep the
embedder's vectors in a cache between runs, and be compared with another run.
"""

from __future__ import annotations

import dataclasses
import hashlib
import logging
import time
import tomllib
from collections import defaultdict
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

import numpy as np

from benchmarks.common import percentile, scratch_location
from cli.scoring import Query, load_queries, score_ranking
from memory.config import Profile, parse_profile
from memory.embedder import Embedder, SentenceTransformerEmbedder
from memory.engine import MemoryEngine
from memory.errors import ConfigError
from memory.search import SearchRequest

log = logging.getLogger(__name__)

Progress = Callable[[int], None]

# name -> request fields; "hybrid" is the full default pipeline without reranking.
RETRIEVAL_MODES: dict[str, dict[str, Any]] = {
    "dense": {"mode": "dense", "adaptive": False, "bonuses": False, "rerank": False},
    "keyword": {"mode": "keyword", "adaptive": False, "bonuses": False, "rerank": False},
    "fixed": {"mode": "dense", "threshold": 0.6, "bonuses": False, "rerank": False},
    "adaptive": {"mode": "dense", "adaptive": True, "bonuses": False, "rerank": False},
    "hybrid": {"mode": "hybrid", "rerank": False},
    "rerank": {"mode": "hybrid", "rerank": True},
}


def default_modes(profile: Profile) -> list[str]:
    """Every retrieval mode; ``rerank`` only when the profile has a reranker."""
    return [m for m in RETRIEVAL_MODES if m != "rerank" or profile.reranker.enabled]


def with_settings(profile: Profile, settings: Sequence[str]) -> Profile:
    """The profile with ``section.key=value`` settings applied, validated like a TOML file.

    Raises:
        ConfigError: A setting is not ``section.key=value``, or the profile rejects it.
    """
    tables: dict[str, dict[str, Any]] = {
        name: dataclasses.asdict(getattr(profile, name)) for name in ("embedder", "search", "llm")
    }
    tables["reranker"] = profile.reranker.table()  # the file's flat [reranker] keys
    for setting in settings:
        name, sep, raw = setting.partition("=")
        section, dot, key = name.strip().partition(".")
        if not sep or not dot or section not in tables or key not in tables[section]:
            raise ConfigError(
                f"--set {setting!r}: expected section.key=value with a known key "
                "(e.g. search.rrf_k=30)"
            )
        try:
            value = tomllib.loads(f"v = {raw.strip()}")["v"]
        except tomllib.TOMLDecodeError:
            value = raw.strip()
        tables[section][key] = value
    for key in ("buckets", "bucket_costs"):  # tuples in the config, lists in a profile file
        tables["reranker"][key] = [list(b) for b in tables["reranker"].get(key, ())]
    return parse_profile(profile.name, tables, f"{profile.source} with --set")


class CachedEmbedder:
    """An embedder that remembers every vector it computed in an ``.npz`` file.

    Retrieval runs embed the same texts again and again; with the cache an ablation
    run costs its searches only.  Keys are hashes of the model id and the text.
    """

    def __init__(self, inner: Embedder, path: Path) -> None:
        self.inner = inner
        self.path = path
        self._vectors: dict[bytes, np.ndarray] = {}
        self._dirty = False
        if path.exists():
            with np.load(path) as data:
                self._vectors = dict(zip((bytes(k) for k in data["keys"]), data["vectors"]))

    @property
    def model_id(self) -> str:
        """The wrapped model's id."""
        return self.inner.model_id

    @property
    def dimension(self) -> int:
        """The wrapped model's vector size."""
        return self.inner.dimension

    def embed(self, texts: Sequence[str]) -> np.ndarray:
        """Vectors for ``texts``: from the cache, or computed once and remembered."""
        keys = [self._key(t) for t in texts]
        todo = {k: t for k, t in zip(keys, texts) if k not in self._vectors}
        missing = list(todo)
        if missing:
            computed = self.inner.embed([todo[k] for k in missing])
            self._vectors.update(zip(missing, computed))
            self._dirty = True
        if not keys:
            return np.zeros((0, self.dimension), dtype=np.float32)
        return np.stack([self._vectors[k] for k in keys]).astype(np.float32)

    def save(self) -> None:
        """Write the cache if anything new was computed."""
        if self._dirty:
            keys = np.array(list(self._vectors), dtype="S20")
            self.path.parent.mkdir(parents=True, exist_ok=True)
            with open(self.path, "wb") as out:
                np.savez(out, keys=keys, vectors=np.stack(list(self._vectors.values())))
            self._dirty = False

    def _key(self, text: str) -> bytes:
        return hashlib.sha1(f"{self.inner.model_id}\n{text}".encode("utf-8", "replace")).digest()


class CachedScores:
    """A reranker backend that remembers every score it computed in an ``.npz`` file.

    Tuning the rerank stage (oversample, cap, blend, ``min_score``) asks the same
    (query, message) pairs again and again; with the cache a run costs its searches
    only.  Keys are hashes of the model, the query and the text.  Latencies measured
    with it are not the reranker's: the report says ``rerank_cache``.
    """

    def __init__(self, path: Path) -> None:
        self.path = path
        self.inner: Any = None
        self._scores: dict[bytes, float] = {}
        self._dirty = False
        if path.exists():
            with np.load(path) as data:
                self._scores = dict(zip((bytes(k) for k in data["keys"]),
                                        data["scores"].tolist()))

    def wrap(self, engine: MemoryEngine) -> None:
        """Put the cache in front of ``engine``'s loaded reranker backend."""
        service = engine.rerankers.current()
        if service is not None and not isinstance(service.backend, CachedScores):
            self.inner = service.backend
            service.backend = self  # type: ignore[assignment]

    @property
    def name(self) -> str:
        """The wrapped backend's name."""
        return str(self.inner.name)

    def load(self) -> None:
        """Load the wrapped backend."""
        self.inner.load()

    def score(self, query: str, texts: Sequence[str]) -> list[float]:
        """Scores for ``texts``: from the cache, or computed once and remembered."""
        keys = [self._key(query, t) for t in texts]
        todo = [i for i, key in enumerate(keys) if key not in self._scores]
        if todo:
            fresh = self.inner.score(query, [texts[i] for i in todo])
            self._scores.update((keys[i], float(v)) for i, v in zip(todo, fresh))
            self._dirty = True
        return [self._scores[key] for key in keys]

    def close(self) -> None:
        """Close the wrapped backend."""
        self.inner.close()

    def save(self) -> None:
        """Write the cache if anything new was computed."""
        if self._dirty:
            self.path.parent.mkdir(parents=True, exist_ok=True)
            with open(self.path, "wb") as out:
                np.savez(out, keys=np.array(list(self._scores), dtype="S20"),
                         scores=np.array(list(self._scores.values()), dtype=np.float64))
            self._dirty = False

    def _key(self, query: str, text: str) -> bytes:
        model = getattr(getattr(self.inner, "config", None), "model", self.name)
        return hashlib.sha1(f"{model}\n{query}\n{text}".encode("utf-8", "replace")).digest()


def run_retrieval_bench(
    datasets: Sequence[str | Path],
    profile: Profile,
    *,
    queries_path: str | Path | None = None,
    k: int = 10,
    scope: str = "guild",
    modes: list[str] | None = None,
    embedder: Embedder | None = None,
    progress: Progress | None = None,
    postgres: str | None = None,
    rerank_cache: CachedScores | None = None,
) -> dict[str, Any]:
    """Import each dataset into a temporary database and score every mode on its queries.

    The database is a temporary SQLite file, or with ``postgres`` (a server URL) a
    throw-away database on that server.  ``rerank_cache`` remembers the reranker's
    scores between runs (its timings are then not the reranker's).

    ``rerank`` is dropped (and ``rerank_skipped`` says why) when the profile's
    reranker cannot be loaded; its searches would only repeat hybrid's.

    Returns:
        ``{"k", "scope", "datasets": {name: {"messages", "queries", "modes": {mode:
        metrics}}}, "mean_recall": {mode: mean over datasets}}``; metrics are
        recall/hit/mrr/ndcg at k, mean_returned, p50_ms, p95_ms and recall per
        question category (``by_category``).

    Raises:
        ImportFormatError: A dataset or its queries file is missing or malformed.
    """
    modes = list(modes or default_modes(profile))
    embedder = embedder or SentenceTransformerEmbedder(profile.embedder)
    report: dict[str, Any] = {"k": k, "scope": scope, "datasets": {},
                              "engine": "postgres" if postgres else "sqlite"}
    for data in datasets:
        queries = load_queries(queries_path or Path(data) / "queries.jsonl")
        with scratch_location(postgres) as location:
            engine = MemoryEngine(location, profile, embedder, load_reranker=False)
            try:
                if "rerank" in modes and (reason := _reranker_missing(engine)):
                    modes.remove("rerank")
                    report["rerank_skipped"] = reason
                if "rerank_skipped" in report and progress:
                    progress(len(queries))  # the searches it will not run are done too
                if "rerank" in modes and rerank_cache is not None:
                    rerank_cache.wrap(engine)
                    report["rerank_cache"] = True
                messages = engine.import_exports([data]).inserted
                results = {
                    mode: _run_mode(engine, queries, mode, k, scope, progress) for mode in modes
                }
            finally:
                engine.close()
        report["datasets"][Path(data).name] = {
            "messages": messages, "queries": len(queries), "modes": results,
        }
    report["mean_recall"] = {
        mode: round(sum(d["modes"][mode]["recall"] for d in report["datasets"].values())
                    / max(1, len(report["datasets"])), 4)
        for mode in modes
    }
    return report


def _reranker_missing(engine: MemoryEngine) -> str | None:
    """Why the engine's reranker cannot run (``None`` when it loaded)."""
    status = engine.reranker_status()
    if status.loaded:
        return None
    reason = status.reason or "the reranker did not load"
    if status.name is not None:
        log.warning("rerank mode skipped: %s", reason)
    return reason.splitlines()[0]


def _run_mode(
    engine: MemoryEngine, queries: list[Query], mode: str, k: int, scope: str,
    progress: Progress | None,
) -> dict[str, Any]:
    fields = RETRIEVAL_MODES[mode]
    scores: list[dict[str, float]] = []
    returned, fallbacks, reranked = 0, 0, 0
    latencies: list[float] = []
    stage_ms: list[float] = []
    for query in queries:
        request = SearchRequest(
            queries=(query.text,), guild_id=query.guild_id, limit=k,
            channel_ids=(query.channel_id,) if scope == "channel" else None, **fields,
        )
        started = time.perf_counter()
        result = engine.search(request)
        latencies.append((time.perf_counter() - started) * 1000)
        returned += len(result.hits)
        fallbacks += bool(result.trace.rerank_fallback)
        if result.trace.reranked:
            reranked += result.trace.candidates.get("rerank", 0)
            stage_ms.append(result.trace.timings_ms.get("rerank", 0.0))
        scores.append(_query_scores([h.id for h in result.hits], query.relevant, k))
        if progress:
            progress(1)
    n = max(1, len(queries))
    summary: dict[str, Any] = _means(scores)
    summary.update(
        mean_returned=round(returned / n, 3),
        p50_ms=round(percentile(latencies, 50), 2),
        p95_ms=round(percentile(latencies, 95), 2),
        by_category=_by_category(queries, scores),
    )
    if fields.get("rerank"):
        summary.update(
            rerank_fallbacks=fallbacks,
            mean_reranked=round(reranked / n, 2),
            rerank_stage_p50_ms=round(percentile(stage_ms, 50), 2),
            rerank_stage_p95_ms=round(percentile(stage_ms, 95), 2),
        )
    return summary


SCORES = ("recall", "recall@5", "hit", "mrr", "ndcg")


def _query_scores(ranked: list[int], relevant: frozenset[int], k: int) -> dict[str, float]:
    """One query's scores at ``k``, with its recall at 5 as ``recall@5``."""
    scores = score_ranking(ranked, relevant, k)
    scores["recall@5"] = score_ranking(ranked, relevant, min(5, k))["recall"]
    return scores


def _means(scores: list[dict[str, float]]) -> dict[str, Any]:
    n = max(1, len(scores))
    return {name: round(sum(s[name] for s in scores) / n, 4) for name in SCORES}


def _by_category(queries: list[Query], scores: list[dict[str, float]]) -> dict[str, Any]:
    """Mean scores and query count per question category, categories sorted."""
    groups: dict[str, list[dict[str, float]]] = defaultdict(list)
    for query, score in zip(queries, scores):
        groups[query.category].append(score)
    return {
        category: {**_means(v), "queries": len(v)} for category, v in sorted(groups.items())
    }


def recall_table(report: dict[str, Any]) -> str:
    """Recall per dataset (rows) and mode (columns), as aligned text."""
    datasets = report["datasets"]
    modes = list(report["mean_recall"])
    width = max([len("mean"), *(len(name) for name in datasets)])
    lines = [" " * width + "".join(f"{m:>10}" for m in modes)]
    for name, data in datasets.items():
        lines.append(f"{name:<{width}}" + "".join(
            f"{data['modes'][m]['recall']:>10.3f}" for m in modes))
    lines.append(f"{'mean':<{width}}" + "".join(
        f"{report['mean_recall'][m]:>10.3f}" for m in modes))
    return "\n".join(lines)


def rerank_table(report: dict[str, Any]) -> str:
    """``hybrid`` and ``rerank`` side by side per dataset and category, as aligned text.

    Empty when the report has no ``rerank`` mode.
    """
    if "rerank" not in report["mean_recall"] or "hybrid" not in report["mean_recall"]:
        return ""
    lines = [f"{'dataset / category':<28}{'mode':>8}{'R@5':>8}{'R@10':>8}{'MRR':>8}"
             f"{'nDCG':>8}{'p50 ms':>9}{'p95 ms':>9}{'fallbk':>8}"]
    for name, data in report["datasets"].items():
        for mode in ("hybrid", "rerank"):
            m = data["modes"][mode]
            lines.append(f"{name:<28}{mode:>8}{m['recall@5']:>8.3f}{m['recall']:>8.3f}"
                         f"{m['mrr']:>8.3f}{m['ndcg']:>8.3f}{m['p50_ms']:>9.1f}"
                         f"{m['p95_ms']:>9.1f}{m.get('rerank_fallbacks', 0):>8}")
        for category in data["modes"]["hybrid"]["by_category"]:
            for mode in ("hybrid", "rerank"):
                c = data["modes"][mode]["by_category"][category]
                label = f"  {category} ({c['queries']})"
                lines.append(f"{label:<28}{mode:>8}{c['recall@5']:>8.3f}{c['recall']:>8.3f}"
                             f"{c['mrr']:>8.3f}{c['ndcg']:>8.3f}")
    return "\n".join(lines)


def compare_reports(before: dict[str, Any], after: dict[str, Any]) -> str:
    """Recall of two runs side by side per dataset, mode and category, with the change.

    Raises:
        ConfigError: A file is not a ``bench retrieval`` report.
    """
    for report in (before, after):
        if not isinstance(report, dict) or not isinstance(report.get("datasets"), dict):
            raise ConfigError("--compare takes two JSON reports written by `bench retrieval --json`")
    lines = [f"{'dataset / mode / category':<44}{'before':>9}{'after':>9}{'change':>9}"]
    for name, data in after["datasets"].items():
        old = before["datasets"].get(name)
        if old is None:
            continue
        for mode, metrics in data["modes"].items():
            old_metrics = old["modes"].get(mode)
            if old_metrics is None:
                continue
            rows = [(f"{name} / {mode}", old_metrics["recall"], metrics["recall"])]
            for category, cat in metrics.get("by_category", {}).items():
                old_cat = old_metrics.get("by_category", {}).get(category)
                if old_cat:
                    rows.append((f"    {category} ({cat['queries']})", old_cat["recall"],
                                 cat["recall"]))
            lines += [f"{label:<44}{a:>9.3f}{b:>9.3f}{b - a:>+9.3f}" for label, a, b in rows]
    return "\n".join(lines)
