"""The reranker's one door into transformers' key/value cache, public API only.

Both scoring paths of :mod:`memory.rerank.qwen` run the shared prompt head
(system message, instruction, query) once and score every document on top of its
keys and values.  They reach transformers only through what its cache guide
documents (``docs/source/en/cache_explanation.md``), the same in 4.56 and 5.x:

* a :class:`transformers.DynamicCache`, passed to the base model's ``forward``
  with ``use_cache=True``, which the attention layers fill (the head pass);
* ``cache.layers[i].keys`` / ``.values``, each ``[batch, kv_heads, length,
  head_dim]`` (the documented storage layout), to read a layer back;
* ``Cache.update(keys, values, layer_idx)``, to pre-fill a cache (the dynamic
  prefix path, whose 2D mask transformers sizes from the cache);
* for passes with a prepared 4D mask (the static path), a ``DynamicCache``
  subclass overriding ``Cache``'s documented ``update(key_states, value_states,
  layer_idx, ...)``: it answers with the head in front of the new keys and values
  and keeps nothing, so a pass holds one layer's concatenation at a time, not
  every layer's until the pass ends.

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
    """A ``DynamicCache`` holding ``head``'s keys/values repeated ``batch`` times.

    For passes with a 2D padding mask: transformers sizes the mask it builds from
    the cache, so the cache must really hold the head.  ``update`` concatenates into
    new tensors, so the pass that appends to this cache never writes into ``head``.
    """
    cache = new_cache()
    for layer, (keys, values) in enumerate(head):
        cache.update(keys.expand(batch, -1, -1, -1), values.expand(batch, -1, -1, -1), layer)
    return cache


def prefix_cache(head: list[LayerKV], batch: int, rows: torch.Tensor | None = None) -> Any:
    """A cache that puts ``head`` (repeated ``batch`` times) in front of every layer's keys.

    Only for passes given a prepared 4D attention mask (which transformers uses as
    is, never asking the cache for mask sizes).  It stores nothing, so a pass holds
    one layer's concatenated keys and values at a time: for the largest static
    buckets, keeping every layer's until the pass ends would cost gigabytes.

    Args:
        head: Each layer's (keys, values) of the shared head, batch size 1; or, with
            ``rows``, of several heads (one per slot).
        batch: Rows of the pass that runs on top of it.
        rows: ``[batch]`` long: the head slot each row puts in front of its own keys.
    """
    return prefix_cache_class()(head, batch, rows)


_PREFIX_CACHE_CLASS: list[type] = []


def prefix_cache_class() -> type:
    """The class :func:`prefix_cache` builds, made on first use.

    Call it once outside a ``torch.compile``'d function: inside, it is then a plain
    global lookup (dynamo does not honour a ``functools.cache`` wrapper, and warns).
    """
    if not _PREFIX_CACHE_CLASS:
        _PREFIX_CACHE_CLASS.append(_make_prefix_cache_class())
    return _PREFIX_CACHE_CLASS[0]


def _make_prefix_cache_class() -> type:
    # Built on first use: importing transformers is the reranker backend's business.
    from transformers import DynamicCache

    class PrefixCache(DynamicCache):
        """A read-only ``DynamicCache`` holding a fixed prefix.

        ``update`` is ``Cache``'s documented method; extra positional and keyword
        arguments (``cache_kwargs`` in 4.x, ``kwargs=`` in 5.x) are accepted and not
        needed.  The returned tensors are new (``torch.cat``), so the pass never
        writes into ``head``, and nothing is stored: a scoring pass never reads its
        own keys back.
        """

        def __init__(self, head: list[LayerKV], batch: int, rows: torch.Tensor | None) -> None:
            super().__init__()
            self.head, self.batch, self.rows = head, batch, rows

        def _front(self, states: torch.Tensor) -> torch.Tensor:
            if self.rows is None:
                return states.expand(self.batch, -1, -1, -1)
            return states.index_select(0, self.rows)  # each row its own head

        def update(
            self, key_states: torch.Tensor, value_states: torch.Tensor, layer_idx: int,
            *args: Any, **kwargs: Any,
        ) -> tuple[torch.Tensor, torch.Tensor]:
            keys, values = self.head[layer_idx]
            return (
                torch.cat([self._front(keys), key_states], dim=-2),
                torch.cat([self._front(values), value_states], dim=-2),
            )

        def get_seq_length(self, layer_idx: int | None = 0) -> int:
            return int(self.head[0][0].shape[-2])

    return PrefixCache
