"""The reranker reaches transformers' KV cache through its public API only (issue 20).

transformers 5.24 calls ``cache.update(keys, values, layer_idx, kwargs=kwargs)`` and
renames the forward argument ``past_key_values`` to ``cache`` (the old name warns
until its removal in 5.40).  These tests run against whichever transformers is
installed (the locked 5.x, or 4.56 with ``PYTHONPATH`` pointing at it), with the
real tiny Qwen3 model of :mod:`tests.support.qwen_tiny`: both scoring paths score without
any deprecation warning, the prefix cache answers both ``update`` calling
conventions, and an unknown forward signature is a clear error at load.
"""

from __future__ import annotations

import inspect
import warnings

import pytest
import torch
import transformers
from transformers import Cache, DynamicCache

from memory.errors import RerankerError, RerankerUnavailable
from memory.rerank.kv_cache import (
    cache_argument,
    layer_states,
    new_cache,
    prefix_cache,
    repeated_cache,
)
from memory.rerank.qwen import load_failure
from tests.rerank.test_reranker_qwen import DOCS, QUERY, assert_close
from tests.support.qwen_tiny import wrap


def head_states(layers: int = 2, length: int = 5) -> list[tuple[torch.Tensor, torch.Tensor]]:
    gen = torch.Generator().manual_seed(0)
    return [(torch.randn(1, 2, length, 4, generator=gen), torch.randn(1, 2, length, 4, generator=gen))
            for _ in range(layers)]


# -- the forward argument ------------------------------------------------------------


def test_cache_argument_is_the_one_the_installed_forward_takes(parts):
    model, _ = parts
    name = cache_argument(model.model)
    parameters = inspect.signature(model.model.forward).parameters
    assert name in parameters
    # 'cache' wherever the forward takes it (5.x after 5.0), so no deprecated name is used
    assert name == ("cache" if "cache" in parameters else "past_key_values"), transformers.__version__


def test_forward_without_a_cache_argument_is_a_clear_error_at_load():
    with pytest.raises(RerankerUnavailable, match=r"Linear\.forward in transformers .* takes no KV "
                       r"cache argument \(cache or past_key_values\)"):
        cache_argument(torch.nn.Linear(2, 2))


@pytest.mark.parametrize("overrides", [
    pytest.param({"prefix_cache": True}, id="prefix-cache"),
    pytest.param({"prefix_cache": True, "buckets": ((4, 16), (8, 64))}, id="static-shapes"),
    pytest.param({"prefix_cache": False}, id="full-prompts"),
])
def test_scoring_raises_no_deprecation_warning(parts, config, overrides):
    # 5.24 warned "`past_key_values` is deprecated and will be removed in version 5.40.0"
    # on every prefix-cache and static pass; now an error here.
    with warnings.catch_warnings():
        for category in (DeprecationWarning, PendingDeprecationWarning, FutureWarning):
            warnings.simplefilter("error", category)
        reranker = wrap(parts, config, **overrides)
        scores = reranker.score(QUERY, DOCS)
    assert len(scores) == len(DOCS) and all(0.0 <= s <= 1.0 for s in scores)


# -- the caches ----------------------------------------------------------------------


@pytest.mark.parametrize("style", ["4.x positional cache_kwargs", "5.x kwargs=", "bare"])
def test_prefix_cache_answers_both_update_conventions_and_keeps_nothing(style):
    head = head_states()
    before = [(k.clone(), v.clone()) for k, v in head]
    cache = prefix_cache(head, batch=3)
    assert isinstance(cache, Cache)  # the model's isinstance checks see a real Cache
    new_k, new_v = torch.ones(3, 2, 4, 4), torch.full((3, 2, 4, 4), 2.0)
    extra = {
        "4.x positional cache_kwargs": ((({"cache_position": torch.arange(5, 9)}),), {}),
        "5.x kwargs=": ((), {"kwargs": {"position_ids": None}}),
        "bare": ((), {}),
    }[style]
    keys, values = cache.update(new_k, new_v, 1, *extra[0], **extra[1])
    assert keys.shape == values.shape == (3, 2, 9, 4)
    for row in range(3):
        assert torch.equal(keys[row, :, :5], head[1][0][0]) and torch.equal(keys[row, :, 5:], new_k[row])
        assert torch.equal(values[row, :, :5], head[1][1][0])
    keys.add_(1.0)  # the pass owns what it got: the head is never written through it
    assert all(torch.equal(k, bk) and torch.equal(v, bv) for (k, v), (bk, bv) in zip(head, before))
    assert len(cache) == 0 and cache.get_seq_length() == 5  # nothing stored, head length reported


def test_repeated_cache_holds_the_head_once_per_row():
    head = head_states()
    cache = repeated_cache(head, batch=4)
    assert isinstance(cache, DynamicCache) and cache.get_seq_length() == 5
    for (keys, values), (head_k, head_v) in zip(layer_states(cache), head):
        assert keys.shape == (4, 2, 5, 4)
        assert torch.equal(keys, head_k.expand(4, -1, -1, -1))
        assert torch.equal(values, head_v.expand(4, -1, -1, -1))
        assert keys.data_ptr() != head_k.data_ptr()  # a copy: appending never touches head


def test_head_pass_fills_a_dynamic_cache_the_reranker_reads_back(parts):
    model, tokenizer = parts
    cache = new_cache()
    ids = torch.tensor([tokenizer("a short head", add_special_tokens=False)["input_ids"]])
    with torch.inference_mode():
        model.model(input_ids=ids, use_cache=True, **{cache_argument(model.model): cache})
    states = layer_states(cache)
    assert len(states) == model.config.num_hidden_layers
    heads, dim = model.config.num_key_value_heads, model.config.head_dim
    assert all(k.shape == v.shape == (1, heads, ids.shape[1], dim) for k, v in states)


def test_a_cache_without_the_documented_layout_is_a_clear_error():
    with pytest.raises(RerankerError, match="no longer holds per-layer keys and values"):
        layer_states(object())


def test_prefix_and_full_prompt_scores_agree_through_the_public_api(parts, config):
    full = wrap(parts, config, prefix_cache=False).score(QUERY, DOCS)
    assert_close(wrap(parts, config, prefix_cache=True).score(QUERY, DOCS), full, tol=1e-5)
    assert_close(wrap(parts, config, buckets=((4, 16), (8, 64))).score(QUERY, DOCS), full, tol=1e-5)


# -- the oldest supported stack ------------------------------------------------------


def test_a_missing_folder_is_named_whatever_the_hub_client_raises(tmp_path):
    # huggingface-hub 0.x (with transformers 4.56) rejects an absolute path as a repo
    # id with a ValueError, not the OSError 1.x raises.
    absent = str(tmp_path / "absent")
    exc = ValueError(f"Repo id must be in the form 'repo_name' or 'namespace/repo_name': '{absent}'.")
    assert "folder" in load_failure(absent, "cpu", exc)
    assert load_failure(absent, "cpu", exc).startswith(f"reranker model folder {absent!r} does not exist")
