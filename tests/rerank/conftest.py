"""Fixtures of the tests that score with a tiny local Qwen3 reranker (random weights,
the real Qwen vocabulary): its folder, the loaded model and tokenizer, and its config.
Each test module gets its own (module scope), so no module sees another's changes."""

from __future__ import annotations

import pytest
import torch
from transformers import AutoModelForCausalLM, AutoTokenizer

from memory.config import QwenConfig
from tests.support.qwen_tiny import save_tiny_reranker


@pytest.fixture(scope="module")
def tiny_dir(tmp_path_factory):
    return save_tiny_reranker(tmp_path_factory.mktemp("qwen-tiny"))


@pytest.fixture(scope="module")
def parts(tiny_dir):
    tokenizer = AutoTokenizer.from_pretrained(tiny_dir)
    model = AutoModelForCausalLM.from_pretrained(tiny_dir, dtype=torch.float32).eval()
    return model, tokenizer


@pytest.fixture(scope="module")
def config(tiny_dir):
    return QwenConfig(model=str(tiny_dir), dtype="float32")
