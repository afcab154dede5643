"""The forward passes of the Qwen3 reranker's static-shape steps.

:class:`StaticForward` is the arithmetic of one head step and one tail step of
:class:`memory.rerank.qwen_static.StaticScorer`, on tensors the scorer keeps static
(:mod:`memory.rerank.qwen_buffers`): masks and positions are built with device ops
only, so a step can be captured as a CUDA graph.  The layers run either through the
base model's public ``forward`` with a cache (:mod:`memory.rerank.kv_cache`) or, once
compiled, through the one shared layer function of :mod:`memory.rerank.qwen_layers`.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch

from memory.rerank import qwen_layers
from memory.rerank.kv_cache import (
    LayerKV,
    cache_argument,
    layer_states,
    new_cache,
    prefix_cache,
)


class StaticForward:
    """Head and tail forward passes on static buffers, ending in P(yes) per row.

    Args:
        base: The transformers base model (``model.model`` of a causal LM), in eval mode.
        answer_rows: float32 ``[2, hidden]``: the lm_head rows of "no" and "yes".
        answer_bias: Their bias, or ``None``.
        slots: Head slots: rows of :attr:`head_len`.
        longest: Positions a step can need (largest head capacity + longest bucket).
        device: The model's device.
        dtype: The model's dtype.
    """

    def __init__(
        self, base: Any, answer_rows: torch.Tensor, answer_bias: torch.Tensor | None,
        slots: int, longest: int, device: torch.device, dtype: torch.dtype,
    ) -> None:
        self.base = base
        self.cache_arg = cache_argument(base)
        self.answer_rows, self.answer_bias = answer_rows, answer_bias
        self.device, self.dtype = device, dtype
        self.positions = torch.arange(longest, device=device)
        self.head_len = torch.ones(slots, dtype=torch.long, device=device)  # per head slot
        self._mask_min = torch.finfo(dtype).min
        # the compiled layer function (StaticScorer.compile); None: the model's own forward
        self.layer_kernel: Callable[..., Any] | None = None
        # laid out now, before any CUDA graph is captured on the model's weights
        self.fused = qwen_layers.fuse_projections(base) if qwen_layers.supports(base) else None

    def head(
        self, ids: torch.Tensor, key_bufs: list[torch.Tensor], value_bufs: list[torch.Tensor]
    ) -> None:
        """Run ``ids`` (one head per row) and write each layer's K/V into rows of the buffers."""
        batch, size = ids.shape
        positions = self.positions[:size][None]
        causal = positions <= positions.T  # [size, size]: right padding cannot reach back
        mask, positions = self._additive(causal), positions.expand(batch, -1)
        if self.layer_kernel is not None:
            states = self._layers(ids, positions, mask, None)[1]
        else:
            cache = new_cache()
            self._forward(ids, positions, mask, cache)
            states = layer_states(cache)
        for (keys, values), key_buf, value_buf in zip(states, key_bufs, value_bufs):
            # row r into slot r; positions past ``size`` keep an earlier head's values,
            # which the tail mask hides
            key_buf[:batch, :, :size].copy_(keys)
            value_buf[:batch, :, :size].copy_(values)

    def tail(
        self, ids: torch.Tensor, starts: torch.Tensor, reads: torch.Tensor,
        row_heads: torch.Tensor, head_keys: list[torch.Tensor], head_values: list[torch.Tensor],
    ) -> torch.Tensor:
        """P(yes) at each flat position in ``reads``, every row on its own head slot.

        A row holds one candidate or several packed back to back: ``starts`` gives,
        for every position, where its candidate begins in the row.  A token sees the
        real tokens of its row's head and its own candidate's tokens up to itself,
        nothing of the candidates beside it, and takes its rotary position from its
        own candidate's start, so each candidate is scored as if it ran alone.
        """
        batch, length = ids.shape
        cap = head_keys[0].shape[2]
        query = self.positions[:length]
        key = self.positions[: cap + length] - cap  # tail keys from 0, head keys below
        head_len = self.head_len[row_heads][:, None, None]  # [batch, 1, 1]: each row's head
        sees_head = key + cap < head_len  # its own head's real tokens, not the padding
        first = starts[:, :, None]  # [batch, length, 1]
        sees_tail = (key >= first) & (key <= query[:, None])  # its own candidate, causal
        mask = self._additive(sees_head | sees_tail)[0, 0][:, None]  # [batch, 1, q, k]
        positions = head_len[:, 0] + query[None] - starts  # [batch, length]
        if self.layer_kernel is not None:
            heads = [(k.index_select(0, row_heads), v.index_select(0, row_heads))
                     for k, v in zip(head_keys, head_values)]
            hidden = self._layers(ids, positions, mask, heads)[0]
        else:
            cache = prefix_cache(list(zip(head_keys, head_values)), batch, row_heads)
            hidden = self._forward(ids, positions, mask, cache)
        last = hidden.reshape(batch * length, -1).index_select(0, reads)
        return self._yes_probability(last)

    def _forward(
        self, ids: torch.Tensor, positions: torch.Tensor, mask: torch.Tensor, cache: Any
    ) -> torch.Tensor:
        """The base model's final (normed) hidden states for ``ids`` on top of ``cache``."""
        out = self.base(
            input_ids=ids, attention_mask=mask, position_ids=positions, use_cache=True,
            **{self.cache_arg: cache},
        )
        return out.last_hidden_state

    def _layers(
        self, ids: torch.Tensor, positions: torch.Tensor, mask: torch.Tensor,
        heads: list[LayerKV] | None,
    ) -> tuple[torch.Tensor, list[LayerKV]]:
        """The compiled path: every layer through the one compiled layer function.

        Returns the final (normed) hidden states and each layer's own keys and values.
        """
        assert self.layer_kernel is not None and self.fused is not None, "see compile()"
        hidden = self.base.embed_tokens(ids)
        cos, sin = self.base.rotary_emb(hidden, positions)
        states: list[LayerKV] = []
        for index, layer in enumerate(self.base.layers):
            head_keys, head_values = heads[index] if heads is not None else (None, None)
            hidden, keys, values = self.layer_kernel(
                layer, self.fused[index], hidden, cos, sin, mask, head_keys, head_values
            )
            states.append((keys, values))
        return self.base.norm(hidden), states

    def _additive(self, allowed: torch.Tensor) -> torch.Tensor:
        """A [1, 1, q, k] additive mask in the model dtype (eager and SDPA accept it)."""
        zero = torch.zeros((), dtype=self.dtype, device=self.device)
        return torch.where(allowed, zero, self._mask_min)[None, None]

    def _yes_probability(self, hidden: torch.Tensor) -> torch.Tensor:
        logits = hidden.to(torch.float32) @ self.answer_rows.T
        if self.answer_bias is not None:
            logits = logits + self.answer_bias
        return torch.log_softmax(logits, dim=-1)[:, 1].exp()
