"""Measure the llama-server reranker against the in-process one on the same tiny model.

    .venv/bin/python scripts/bench_remote.py [--repeats 5] [--parallel 2] [--threads 2]

Builds the tiny random Qwen3 with the real Qwen vocabulary (tests/qwen_gguf.py),
converts it to causal and rank GGUFs with llama.cpp's converter, starts real
llama-servers on 127.0.0.1 (the binary from scripts/llama-server.sh or
$LLAMA_SERVER), then prints two Markdown tables:

* agreement of each remote path with the in-process backend (max abs diff,
  Spearman, same top 5) over the demo server's 20 questions, 30 of its messages
  each (data/demo-server), including the
  two request shapes the backend used before issue 8, for comparison;
* latency of one ``score`` call for 20 and 50 candidates, remote vs in-process.

Tooling, not engine: this drives :mod:`memory.reranker` from outside and belongs
with the CLI's ``bench`` commands once they move to their own package.
"""

from __future__ import annotations

import argparse
import json
import math
import statistics
import sys
import tempfile
import time
from collections.abc import Callable, Sequence
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

import httpx

from memory.config import RerankerConfig
from memory.reranker.llama_server import (
    RERANK_INSTRUCTION,
    LlamaServerBackend,
    sigmoid,
    yes_probability,
)
from memory.reranker.prompt import DEFAULT_INSTRUCTION, SYSTEM_PROMPT, user_turn
from memory.reranker.qwen import QwenReranker
from tests.llama_server_process import LlamaServer, locate
from tests.qwen_gguf import convert, save_checkpoint

DEMO = ROOT / "data"
CANDIDATES = 30  # documents per query in the agreement table
Scorer = Callable[[str, list[str]], list[float]]


def corpus() -> tuple[list[str], list[str]]:
    """The demo server's questions and its non-empty message texts, in file order."""
    queries = [json.loads(line)["query"] for line in (DEMO / "demo-queries.jsonl").open()]
    messages = []
    for path in sorted((DEMO / "demo-server").glob("*.json")):
        messages += [m["content"] for m in json.loads(path.read_text())["messages"]]
    return queries, [m for m in messages if m.strip()]


def candidates(docs: list[str], n: int, offset: int) -> list[str]:
    """``n`` messages starting at ``offset`` (wrapping), a different slice per query."""
    start = offset % len(docs)
    return (docs[start:] + docs[:start])[:n]


def spearman(a: Sequence[float], b: Sequence[float]) -> float:
    """Spearman's rank correlation (no tie correction; scores are continuous)."""
    ra = {i: r for r, i in enumerate(sorted(range(len(a)), key=lambda i: a[i]))}
    rb = {i: r for r, i in enumerate(sorted(range(len(b)), key=lambda i: b[i]))}
    n = len(a)
    return 1 - 6 * sum((ra[i] - rb[i]) ** 2 for i in range(n)) / (n * (n * n - 1))


def top5(scores: Sequence[float]) -> list[int]:
    return sorted(range(len(scores)), key=lambda i: -scores[i])[:5]


def agreement(name: str, scorer: Scorer, reference: Scorer, queries: list[str],
              docs: list[str]) -> str:
    """One table row: worst diff, worst Spearman and how often the top 5 match."""
    diffs, rhos, same = [], [], 0
    for i, query in enumerate(queries):
        batch = candidates(docs, CANDIDATES, i * CANDIDATES)
        got, want = scorer(query, batch), reference(query, batch)
        diffs.append(max(abs(g - w) for g, w in zip(got, want)))
        rhos.append(spearman(got, want))
        same += top5(got) == top5(want)
    return (f"| {name} | {max(diffs):.4f} | {min(rhos):.3f} | {statistics.median(rhos):.3f} "
            f"| {same}/{len(queries)} |")


def old_chat(url: str) -> Scorer:
    """The chat request as sent before issue 8: an assistant think-block prefill."""
    client = httpx.Client(timeout=60)

    def score(query: str, docs: list[str]) -> list[float]:
        out = []
        for doc in docs:
            body = client.post(url + "/v1/chat/completions", json={
                "messages": [
                    {"role": "system", "content": SYSTEM_PROMPT},
                    {"role": "user", "content": user_turn(DEFAULT_INSTRUCTION, query, doc)},
                    {"role": "assistant", "content": "<think>\n\n</think>\n\n"},
                ],
                "max_tokens": 1, "temperature": 0, "logprobs": True, "top_logprobs": 20,
            }).json()
            top = body["choices"][0].get("logprobs", {}).get("content", [{}])[0]
            try:
                out.append(yes_probability(top.get("top_logprobs", [])))
            except ValueError:
                out.append(0.5)  # the old backend raised here; count it as a coin flip
        return out

    return score


def old_rerank(backend: LlamaServerBackend) -> Scorer:
    """The rerank scores as the old backend returned them: a second sigmoid."""
    return lambda q, d: [sigmoid(s) for s in backend.score(q, d)]


def latency(scorer: Scorer, query: str, docs: list[str], repeats: int) -> float:
    scorer(query, docs)  # warm-up (server prompt cache, torch kernels)
    times = []
    for _ in range(repeats):
        started = time.perf_counter()
        scorer(query, docs)
        times.append(time.perf_counter() - started)
    return statistics.median(times) * 1000


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--parallel", type=int, default=2)
    parser.add_argument("--threads", type=int, default=2)
    args = parser.parse_args()
    found = locate()
    if isinstance(found, str):
        print(found, file=sys.stderr)
        return 1
    from transformers import AutoModelForCausalLM, AutoTokenizer

    folder = Path(tempfile.mkdtemp(prefix="bench-remote-"))
    causal_dir, rerank_dir = save_checkpoint(folder, found.src)
    causal = convert(causal_dir, folder / "causal.gguf", found.src)
    rank = convert(rerank_dir, folder / "rank.gguf", found.src)
    model = AutoModelForCausalLM.from_pretrained(causal_dir).eval()
    tokenizer = AutoTokenizer.from_pretrained(causal_dir)

    def local(instruction: str = DEFAULT_INSTRUCTION) -> QwenReranker:
        config = RerankerConfig(backend="transformers", instruction=instruction)
        return QwenReranker.from_model(model, tokenizer, config)

    options = {"parallel": args.parallel, "threads": args.threads}
    with LlamaServer(found.binary, causal, folder / "causal.log", **options) as cs, \
            LlamaServer(found.binary, rank, folder / "rank.log", extra=("--reranking",),
                        **options) as rs:
        def backend(url: str, endpoint: str) -> LlamaServerBackend:
            return LlamaServerBackend(RerankerConfig(
                backend="llama-server", url=url, endpoint=endpoint, timeout=120.0,
                parallel=args.parallel,
            ))

        remote = {e: backend(cs.url, e) for e in ("completion", "chat")}
        remote["rerank"] = backend(rs.url, "rerank")
        queries, docs = corpus()
        inproc, inproc_llama = local(), local(RERANK_INSTRUCTION)
        print(f"{len(queries)} queries x {CANDIDATES} messages each\n")
        print("| path | max abs diff | min Spearman | median Spearman | same top-5 |")
        print("|---|---|---|---|---|")
        print(agreement("`completion` (default)", remote["completion"].score, inproc.score,
                        queries, docs))
        print(agreement("`chat`, system+user, enable_thinking=false", remote["chat"].score,
                        inproc.score, queries, docs))
        print(agreement("`rerank`, P(yes) as is (vs in-process with llama.cpp's instruction)",
                        remote["rerank"].score, inproc_llama.score, queries, docs))
        print(agreement("before: `chat` with the think-block prefill", old_chat(cs.url),
                        inproc.score, queries, docs))
        print(agreement("before: `rerank` through a second sigmoid",
                        old_rerank(remote["rerank"]), inproc_llama.score, queries, docs))
        print("\n| candidates | in-process | completion | chat | rerank |")
        print("|---|---|---|---|---|")
        query = queries[0]
        for n in (20, 50):
            batch = (docs * math.ceil(n / len(docs)))[:n]
            row = [latency(inproc.score, query, batch, args.repeats)]
            row += [latency(remote[e].score, query, batch, args.repeats)
                    for e in ("completion", "chat", "rerank")]
            print(f"| {n} | " + " | ".join(f"{ms:.0f} ms ({ms / n:.1f}/doc)" for ms in row) + " |")
        for b in remote.values():
            b.close()
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
