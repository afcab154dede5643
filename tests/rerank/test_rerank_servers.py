"""The rerank-api backend against two real servers started here on 127.0.0.1.

* llama.cpp's ``llama-server --reranking`` serving a tiny random Qwen3 converted to a
  rank-pooled GGUF by llama.cpp's own converter (benchmarks/qwen_gguf.py): the ``jina``
  dialect (``/v1/rerank``) and the ``tei`` one (``/rerank``, which llama-server also
  speaks) must give the in-process Qwen3-Reranker's scores on the same weights.
* Infinity (``infinity-emb`` in its own environment, scripts/infinity.sh) serving the
  tiny local BERT cross-encoder: the ``infinity`` dialect must give the in-process
  cross-encoder backend's scores.

Each skips with the reason when its server is not installed.
"""

from __future__ import annotations

import os
import subprocess
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from benchmarks.llama_cpp import LlamaServer, locate
from benchmarks.qwen_gguf import convert, save_checkpoint
from benchmarks.remote import spearman
from benchmarks.rerank_backends import save_random_cross_encoder
from memory.config import CrossEncoderConfig, QwenConfig, RerankApiConfig, RerankerConfig
from memory.rerank.cross_encoder import CrossEncoderReranker
from memory.rerank.llama_server import RERANK_INSTRUCTION
from memory.rerank.qwen import QwenReranker
from memory.rerank.rerank_api import RerankApiBackend
from memory.rerank.service import RerankerService
from tests.support.infinity import INFINITY_ROOT, SERVED_NAME, infinity_server
from tests.support.infinity import missing_reason as infinity_missing
from tests.support.rerank import falling, rerank_texts
from tests.support.servers import free_port, serving

pytestmark = pytest.mark.slow

QUERY = "when is the pizza night at the repair cafe"
DOCS = [
    "pizza night is on friday at 8pm, bring your own toppings",
    "the repair cafe opens saturday morning, bring broken toasters",
    "my cat sleeps all day on the radiator",
    "does anyone know when the raid starts on saturday",
    "🍕🍕🍕 pizza party tonight 🎉",
    "Die Pizza war gestern kalt, aber das Repair-Café war super",
    "ok",
    "remember to bring snacks to the meetup next week",
]
SCRIPT = Path(__file__).resolve().parents[2] / "scripts" / "infinity.sh"
MAX_DIFF = 1e-3  # torch on both sides (Infinity)
# llama.cpp's f32 kernels against torch's: up to 0.0045 on /v1/rerank over 600 pairs
# (BENCHMARKS.md, "Agreement — bench remote"); the backend itself adds nothing to it.
LLAMA_MAX_DIFF = 0.005


def api(url: str, dialect: str, **settings: Any) -> RerankApiBackend:
    config = RerankerConfig.from_table({"backend": "rerank-api", "url": url,
                                        "dialect": dialect, "model": "tiny",
                                        "timeout": 60.0, **settings})
    return RerankApiBackend(config.rerank_api, config.timeout)


# ------------------------------------------------------------------ llama-server


@pytest.fixture(scope="module")
def qwen_rank(tmp_path_factory: pytest.TempPathFactory) -> Iterator[tuple[str, list[float]]]:
    """A llama-server --reranking URL and the in-process scores of the same weights."""
    found = locate()
    if isinstance(found, str):
        pytest.skip(found)
    from transformers import AutoModelForCausalLM, AutoTokenizer

    folder = tmp_path_factory.mktemp("qwen-rank")
    causal_dir, rerank_dir = save_checkpoint(folder, found.src)
    rank = convert(rerank_dir, folder / "tiny-rank-f32.gguf", found.src)
    model = AutoModelForCausalLM.from_pretrained(causal_dir).eval()
    tokenizer = AutoTokenizer.from_pretrained(causal_dir)
    config = QwenConfig(instruction=RERANK_INSTRUCTION)
    reference = QwenReranker.from_model(model, tokenizer, config).score(QUERY, DOCS)
    server = LlamaServer(found.binary, rank, folder / "rank.log", extra=("--reranking",)).start()
    try:
        yield server.url, reference
    finally:
        server.stop()


@pytest.mark.llama
@pytest.mark.parametrize("dialect", ["jina", "tei"])
def test_llama_server_agrees_with_the_in_process_model(qwen_rank, dialect):
    url, reference = qwen_rank
    scores = api(url, dialect).score(QUERY, DOCS)
    assert max(abs(a - b) for a, b in zip(scores, reference)) <= LLAMA_MAX_DIFF, (scores, reference)
    assert spearman(scores, reference) >= 0.99
    assert max(reference) - min(reference) > 0.05, "the tiny model must spread its scores"


@pytest.mark.llama
def test_llama_server_split_requests_give_the_same_scores(qwen_rank):
    url, _ = qwen_rank
    backend = api(url, "jina", max_documents=3)
    whole = api(url, "jina").score(QUERY, DOCS)
    # llama.cpp batches a request's documents together: other batches, other roundings
    assert backend.score(QUERY, DOCS) == pytest.approx(whole, abs=LLAMA_MAX_DIFF)
    assert backend.requests_sent == 3


@pytest.mark.llama
def test_a_killed_llama_server_falls_back_within_the_deadline(tmp_path):
    found = locate()
    if isinstance(found, str):
        pytest.skip(found)
    _, rerank_dir = save_checkpoint(tmp_path, found.src, seed=1)
    rank = convert(rerank_dir, tmp_path / "rank.gguf", found.src)
    server = LlamaServer(found.binary, rank, tmp_path / "rank.log", extra=("--reranking",)).start()
    try:
        config = RerankerConfig(backend="rerank-api", timeout=30.0, oversample=1,
                                rerank_api=RerankApiConfig(url=server.url, dialect="jina"))
        service = RerankerService(config)
        _, outcome = rerank_texts(service, QUERY, DOCS, falling(len(DOCS), 0.05))
        assert outcome.fallback is None
    finally:
        server.stop()  # a failed assertion must not leave the server running
    started = time.monotonic()
    ranked, outcome = rerank_texts(service, QUERY, DOCS, falling(len(DOCS), 0.05))
    assert time.monotonic() - started < 3.0
    assert [h.id for h in ranked] == list(range(1, len(DOCS) + 1))
    assert "cannot reach the rerank API" in outcome.fallback
    service.close()


# --------------------------------------------------------------------- Infinity


@pytest.fixture(scope="module")
def tiny_cross_encoder(tmp_path_factory: pytest.TempPathFactory) -> Path:
    shape = dict(hidden_size=32, num_hidden_layers=2, num_attention_heads=2, intermediate_size=64,
                 max_position_embeddings=512, initializer_range=0.5, num_labels=1)
    return save_random_cross_encoder(tmp_path_factory.mktemp("infinity") / "tiny-ce", shape)


@pytest.fixture(scope="module")
def infinity(tiny_cross_encoder: Path) -> Iterator[str]:
    reason = infinity_missing()
    if reason:
        pytest.skip(reason)
    with infinity_server(tiny_cross_encoder) as url:
        yield url


@pytest.mark.infinity
def test_infinity_agrees_with_the_in_process_cross_encoder(infinity, tiny_cross_encoder):
    local = CrossEncoderReranker(CrossEncoderConfig(model=str(tiny_cross_encoder)))
    local.load()
    reference = local.score(QUERY, DOCS)
    scores = api(infinity, "infinity", model=SERVED_NAME).score(QUERY, DOCS)
    assert max(abs(a - b) for a, b in zip(scores, reference)) <= MAX_DIFF, (scores, reference)
    assert max(reference) - min(reference) > 0.01


@pytest.mark.infinity
def test_infinity_through_the_service_reranks_and_splits(infinity, tiny_cross_encoder):
    config = RerankerConfig(backend="rerank-api", oversample=1, timeout=30.0,
                            rerank_api=RerankApiConfig(url=infinity, dialect="infinity",
                                                       model=SERVED_NAME, max_documents=3))
    service = RerankerService(config)
    service.load()
    ranked, outcome = rerank_texts(service, QUERY, DOCS, falling(len(DOCS), 0.05))
    assert outcome.fallback is None and service.name == "rerank-api"
    assert sorted(h.id for h in ranked) == list(range(1, len(DOCS) + 1))
    assert service.backend.requests_sent == 3
    service.close()


@pytest.mark.infinity
def test_the_script_serves_a_model_without_leaving_a_cache_where_it_starts(
    tiny_cross_encoder: Path, tmp_path: Path,
) -> None:
    """Issue 34.5: ``infinity_emb`` writes ``.infinity_cache/`` into the folder it starts in
    (the checkout, for a user following the docs); ``scripts/infinity.sh serve`` keeps it in
    the install folder."""
    if subprocess.run(["bash", str(SCRIPT), "--path"], capture_output=True).returncode != 0:
        pytest.skip("Infinity is not installed: run `bash scripts/infinity.sh` (a few minutes)")
    started_in = tmp_path / "checkout"
    started_in.mkdir()
    port = free_port()
    env = {k: v for k, v in os.environ.items() if k not in ("INFINITY_HOME", "HF_HOME")}
    args = ["bash", str(SCRIPT), "serve", str(tiny_cross_encoder), "--served-model-name", SERVED_NAME,
            "--host", "127.0.0.1", "--port", str(port), "--engine", "torch", "--device", "cpu",
            "--no-bettertransformer", "--no-model-warmup"]
    with serving("infinity.sh serve", args, f"http://127.0.0.1:{port}", tmp_path / "infinity.log",
                 startup_s=180.0, poll_s=0.5, stop_s=15, env=dict(env, HF_HUB_OFFLINE="1"),
                 cwd=started_in) as url:
        scores = api(url, "infinity", model=SERVED_NAME).score(QUERY, DOCS[:2])
    assert len(scores) == 2
    assert list(started_in.iterdir()) == []
    assert (INFINITY_ROOT / ".infinity_cache").is_dir()
