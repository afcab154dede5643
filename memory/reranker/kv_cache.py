"""The reranker's one door into transformers' key/value cache, public API only.

Both scoring paths of :mod:`memory.reranker.qwen` run the shared prompt head
(system message, instruction, query) once and score every document on top of its
keys and values.  They reach transformers only through what its cache guide
documents (``docs/source/en/cache_explanation.md``), the same in 4.56 and 5.x:

* a :class:`transformers.DynamicCache`, passed to the base model's ``forward``
  with ``use_cache=True``, which the attention layers fill;
* ``cache.layers[i].keys`` / ``.values``, each ``[batch, kv_heads, length,
  head_dim]`` (the documented storage layout), to read a layer back;
* ``Cache.update(keys, values, layer_idx)``, to pre-fill a cache.

The one thing that differs across the supported range is the ``forward`` argument
that takes the cache: ``past_key_values`` in 4.x, ``cache`` in 5.x (which keeps
``past_key_values`` as a deprecated alias until 5.40).  :func:`cache_argument` reads
it from the signature, so neither name is ever passed where it is deprecated, and a
release that takes neither fails at load with a clear error instead of at a search.
"""

from __future__ import annotations

import inspect
from typing import Any

import torch

from memory.errors import RerankerError, RerankerUnavailable

# One layer's cached (keys, values), each [batch, kv_heads, length, head_dim].
LayerKV = tuple[torch.Tensor, torch.Tensor]

CACHE_ARGUMENTS = ("cache", "past_key_values")  # the current name first


def cache_argument(model: Any) -> str:
    """The name under which ``model.forward`` takes a KV cache.

    Args:
        model: A transformers base model (``Qwen3Model``) or causal LM.

    Raises:
        RerankerUnavailable: ``forward`` takes the cache under neither known name
            (a transformers release this reranker does not know yet).
    """
    params = inspect.signature(model.forward).parameters
    name = next((n for n in CACHE_ARGUMENTS if n in params), None)
    if name is None:
        import transformers

        raise RerankerUnavailable(
            f"{type(model).__name__}.forward in transformers {transformers.__version__} takes "
            f"no KV cache argument ({' or '.join(CACHE_ARGUMENTS)}): install a transformers "
            "release this bot supports (see pyproject.toml) or set reranker.prefix_cache = "
            "false and remove reranker.buckets"
        )
    return name


def new_cache() -> Any:
    """An empty :class:`transformers.DynamicCache`: one full-attention layer per model layer."""
    from transformers import DynamicCache

    return DynamicCache()


def layer_states(cache: Any) -> list[LayerKV]:
    """Each layer's (keys, values) in a cache a forward pass has filled.

    Raises:
        RerankerError: The cache does not have the documented layout.
    """
    layers = getattr(cache, "layers", None)
    if not layers or any(getattr(layer, "keys", None) is None for layer in layers):
        raise RerankerError(
            f"transformers' {type(cache).__name__} no longer holds per-layer keys and "
            "values in cache.layers: this transformers release is not supported"
        )
    return [(layer.keys, layer.values) for layer in layers]


def repeated_cache(head: list[LayerKV], batch: int) -> Any:
    """A fresh cache holding ``head``'s keys/values repeated ``batch`` times.

    ``update`` concatenates into new tensors, so the forward pass that appends to
    this cache never writes into ``head``.
    """
    cache = new_cache()
    for layer, (keys, values) in enumerate(head):
        cache.update(keys.expand(batch, -1, -1, -1), values.expand(batch, -1, -1, -1), layer)
    return cache
