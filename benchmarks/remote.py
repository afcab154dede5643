"""``bench remote``: the llama-server reranker against the in-process one, same weights.

Builds the tiny random Qwen3 with the real Qwen vocabulary
(:mod:`benchmarks.qwen_gguf`), converts it to a causal and a rank GGUF with the
``convert_hf_to_gguf.py`` of the llama.cpp source the binary was built from, starts
two real ``llama-server`` processes on 127.0.0.1 (:mod:`benchmarks.llama_cpp`) and
measures, side by side in one run:

* agreement of each remote path with the in-process backend (max abs diff, worst
  and median Spearman, same top 5) over the demo server's questions, a different
  slice of its messages for each; the request shapes the backend sent before
  issue 8 (chat with a think-block prefill, rerank through a second sigmoid) are
  measured too, for comparison;
* the latency of one ``score`` call for 20 and 50 candidates, remote vs in-process
  (median of ``repeats`` after a warm-up call), and so the overhead per request.

On the tiny model the compute is negligible, so the latency is the cost of the
requests themselves (HTTP, JSON, tokenizing, the server's scheduling); a real
0.6B-8B model adds its compute on top on either side.
"""

from __future__ import annotations

import json
import logging
import math
import statistics
import tempfile
import time
from collections.abc import Callable, Iterator, Sequence
from contextlib import ExitStack, contextmanager
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

import httpx

from benchmarks.common import machine_description
from benchmarks.llama_cpp import LlamaCpp, LlamaServer, locate
from benchmarks.qwen_gguf import convert, save_checkpoint
from cli.demo import demo_dir, demo_queries
from cli.scoring import load_queries
from memory.config import LlamaServerConfig, QwenConfig
from memory.errors import RerankerUnavailable
from memory.rerank.llama_server import RERANK_INSTRUCTION, LlamaServerBackend
from memory.rerank.prompt import DEFAULT_INSTRUCTION, SYSTEM_PROMPT, user_turn
from memory.rerank.qwen import QwenReranker
from memory.rerank.score_parsing import sigmoid, yes_probability

log = logging.getLogger(__name__)

Scorer = Callable[[str, list[str]], list[float]]
ProgressFn = Callable[[str], None]
LATENCY_SIZES = (20, 50)
ENDPOINTS = ("completion", "chat", "rerank")


@dataclass(frozen=True)
class Agreement:
    """How one remote path's scores compare with the in-process ones.

    Attributes:
        path: What was asked, and of which server.
        max_abs_diff: The largest |remote - in-process| over every document.
        min_spearman: The worst query's rank correlation.
        median_spearman: The median query's rank correlation.
        same_top5: Queries whose top five documents are the same, in the same order.
        queries: Queries measured.
    """

    path: str
    max_abs_diff: float
    min_spearman: float
    median_spearman: float
    same_top5: int
    queries: int


@dataclass(frozen=True)
class Latency:
    """Median milliseconds of one ``score`` call for ``candidates`` documents."""

    candidates: int
    in_process_ms: float
    completion_ms: float
    chat_ms: float
    rerank_ms: float


@dataclass(frozen=True)
class Models:
    """The tiny model, in-process and as GGUF files."""

    llama: LlamaCpp
    folder: Path
    causal: Path
    rank: Path
    model: Any
    tokenizer: Any

    def in_process(self, instruction: str = DEFAULT_INSTRUCTION) -> QwenReranker:
        """The in-process backend on the same weights."""
        config = QwenConfig(instruction=instruction)
        return QwenReranker.from_model(self.model, self.tokenizer, config)


def run_remote_bench(
    *,
    queries: int = 20,
    candidates: int = 30,
    repeats: int = 5,
    sizes: Sequence[int] = LATENCY_SIZES,
    parallel: int = 2,
    threads: int = 2,
    with_agreement: bool = True,
    progress: ProgressFn | None = None,
) -> dict[str, Any]:
    """Measure agreement and latency of the remote paths; see the module docstring.

    Args:
        queries: Demo questions in the agreement table (at most 20).
        candidates: Messages scored per question.
        repeats: Timed calls per latency cell (the median is kept).
        sizes: Candidate counts of the latency rows.
        parallel: The servers' ``--parallel`` and the backend's ``parallel``.
        threads: The servers' ``--threads``.
        with_agreement: Measure the agreement table (most of the run's time).
        progress: Called with a short stage name as the run goes.

    Returns:
        ``{"agreement": [...], "latency": [...], "machine": str, "settings": {...}}``,
        JSON-ready.

    Raises:
        RerankerUnavailable: No llama-server binary or llama.cpp source was found.
    """
    note = progress or (lambda stage: None)
    found = locate()
    if isinstance(found, str):
        raise RerankerUnavailable(found)
    questions, messages = demo_corpus()
    questions = questions[:queries]
    with tempfile.TemporaryDirectory(prefix="bench-remote-") as tmp:
        note("building and converting the tiny model")
        models = build_models(found, Path(tmp))
        with _servers(models, parallel, threads) as remote:
            agreement = []
            if with_agreement:
                note("agreement")
                agreement = _agreement_rows(models, remote, questions, messages, candidates)
            note("latency")
            latency = [
                _latency_row(models, remote, questions[0], messages, n, repeats) for n in sizes
            ]
    return {
        "agreement": [asdict(a) for a in agreement],
        "latency": [asdict(r) for r in latency],
        "machine": machine_description(),
        "settings": {"queries": len(questions), "candidates": candidates, "repeats": repeats,
                     "parallel": parallel, "threads": threads, "binary": str(found.binary)},
    }


def demo_corpus() -> tuple[list[str], list[str]]:
    """The demo server's questions and its non-empty message texts, in file order."""
    questions = [query.text for query in load_queries(demo_queries())]
    messages: list[str] = []
    for path in sorted(demo_dir().glob("*.json")):
        messages += [m["content"] for m in json.loads(path.read_text("utf-8"))["messages"]]
    return questions, [m for m in messages if m.strip()]


def build_models(llama: LlamaCpp, folder: Path) -> Models:
    """Build the tiny model, convert it both ways and load it in-process."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    causal_dir, rerank_dir = save_checkpoint(folder, llama.src)
    causal = convert(causal_dir, folder / "causal.gguf", llama.src)
    rank = convert(rerank_dir, folder / "rank.gguf", llama.src)
    model = AutoModelForCausalLM.from_pretrained(causal_dir).eval()
    tokenizer = AutoTokenizer.from_pretrained(causal_dir)
    return Models(llama, folder, causal, rank, model, tokenizer)


@contextmanager
def _servers(models: Models, parallel: int, threads: int) -> Iterator[dict[str, Any]]:
    """Both servers and a backend per endpoint; the causal server's URL under "url"."""
    options: dict[str, Any] = {"parallel": parallel, "threads": threads}
    with ExitStack() as stack:
        causal = stack.enter_context(
            LlamaServer(models.llama.binary, models.causal, models.folder / "causal.log", **options)
        )
        rank = stack.enter_context(LlamaServer(
            models.llama.binary, models.rank, models.folder / "rank.log",
            extra=("--reranking",), **options,
        ))
        backends: dict[str, Any] = {}
        for endpoint in ENDPOINTS:
            url = rank.url if endpoint == "rerank" else causal.url
            config = LlamaServerConfig(url=url, endpoint=endpoint, parallel=parallel,
                                       instruction=RERANK_INSTRUCTION if endpoint == "rerank"
                                       else DEFAULT_INSTRUCTION)
            backends[endpoint] = stack.enter_context(LlamaServerBackend(config, timeout=120.0))
        backends["url"] = causal.url
        yield backends


def _agreement_rows(
    models: Models, remote: dict[str, Any], questions: list[str], messages: list[str],
    candidates: int,
) -> list[Agreement]:
    reference = models.in_process().score
    llama_reference = models.in_process(RERANK_INSTRUCTION).score
    rerank = remote["rerank"].score
    shapes: list[tuple[str, Scorer, Scorer]] = [
        ("completion (default)", remote["completion"].score, reference),
        ("chat: system + user, enable_thinking false", remote["chat"].score, reference),
        ("rerank: P(yes) as returned, vs in-process with llama.cpp's instruction",
         rerank, llama_reference),
        ("before issue 8: chat with a think-block prefill", _old_chat(remote["url"]), reference),
        ("before issue 8: rerank through a second sigmoid",
         lambda q, d: [sigmoid(s) for s in rerank(q, d)], llama_reference),
    ]
    return [
        agreement(name, scorer, truth, questions, messages, candidates)
        for name, scorer, truth in shapes
    ]


def agreement(
    name: str, scorer: Scorer, reference: Scorer, questions: list[str], messages: list[str],
    candidates: int,
) -> Agreement:
    """Score every question's slice both ways and summarise how they differ."""
    diffs, rhos, same = [], [], 0
    for i, question in enumerate(questions):
        batch = _slice(messages, candidates, i * candidates)
        got, want = scorer(question, batch), reference(question, batch)
        diffs.append(max(abs(g - w) for g, w in zip(got, want, strict=True)))
        rhos.append(spearman(got, want))
        same += top(got, 5) == top(want, 5)
    return Agreement(name, max(diffs), min(rhos), statistics.median(rhos), same, len(questions))


def _slice(messages: list[str], n: int, offset: int) -> list[str]:
    """``n`` messages from ``offset`` on, wrapping around: a different slice per question."""
    start = offset % len(messages)
    return (messages[start:] + messages[:start])[:n]


def spearman(a: Sequence[float], b: Sequence[float]) -> float:
    """Spearman's rank correlation (ties share their average rank)."""
    ra, rb = _ranks(a), _ranks(b)
    ma, mb = statistics.fmean(ra), statistics.fmean(rb)
    cov = sum((x - ma) * (y - mb) for x, y in zip(ra, rb, strict=True))
    var = math.sqrt(sum((x - ma) ** 2 for x in ra) * sum((y - mb) ** 2 for y in rb))
    return cov / var if var else 1.0


def _ranks(values: Sequence[float]) -> list[float]:
    order = sorted(range(len(values)), key=lambda i: values[i])
    ranks = [0.0] * len(values)
    i = 0
    while i < len(order):
        j = i
        while j + 1 < len(order) and values[order[j + 1]] == values[order[i]]:
            j += 1
        for k in range(i, j + 1):
            ranks[order[k]] = (i + j) / 2
        i = j + 1
    return ranks


def top(scores: Sequence[float], k: int) -> list[int]:
    """Indices of the ``k`` highest scores, best first."""
    return sorted(range(len(scores)), key=lambda i: -scores[i])[:k]


def _old_chat(url: str) -> Scorer:
    """The chat request as the backend sent it before issue 8: a think-block prefill."""

    def score(query: str, docs: list[str]) -> list[float]:
        out = []
        with httpx.Client(timeout=120.0, trust_env=False) as client:
            for doc in docs:
                body = client.post(url + "/v1/chat/completions", json={
                    "messages": [
                        {"role": "system", "content": SYSTEM_PROMPT},
                        {"role": "user", "content": user_turn(DEFAULT_INSTRUCTION, query, doc)},
                        {"role": "assistant", "content": "<think>\n\n</think>\n\n"},
                    ],
                    "max_tokens": 1, "temperature": 0, "logprobs": True, "top_logprobs": 20,
                }).json()
                content = (body["choices"][0].get("logprobs") or {}).get("content") or [{}]
                try:
                    out.append(yes_probability(content[0].get("top_logprobs", [])))
                except ValueError:
                    out.append(0.5)  # the old backend raised here; count it as a coin flip
        return out

    return score


def _latency_row(
    models: Models, remote: dict[str, Any], question: str, messages: list[str], n: int,
    repeats: int,
) -> Latency:
    batch = (messages * math.ceil(n / len(messages)))[:n]
    scorers = [models.in_process().score, *(remote[e].score for e in ENDPOINTS)]
    return Latency(n, *latencies_ms(scorers, question, batch, repeats))


def latencies_ms(
    scorers: Sequence[Scorer], query: str, docs: list[str], repeats: int
) -> list[float]:
    """Median milliseconds of each scorer's call, timed in turns.

    Each scorer is called once to warm up (server prompt cache, torch kernels); then
    every round times each scorer once, so load from other processes on a shared
    machine falls on all of them alike and the ratios stay fair.
    """
    for scorer in scorers:
        scorer(query, docs)
    times: list[list[float]] = [[] for _ in scorers]
    for _ in range(repeats):
        for scorer, spent in zip(scorers, times, strict=True):
            started = time.perf_counter()
            scorer(query, docs)
            spent.append((time.perf_counter() - started) * 1000)
    return [statistics.median(spent) for spent in times]
