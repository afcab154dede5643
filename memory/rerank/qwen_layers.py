"""One Qwen3 decoder layer as a plain function, for compiling the static steps once.

``torch.compile`` of a whole model forward traces all its layers into one graph
(28 for the 0.6B, 36 for the 8B), and inductor's time grows with it: on an H100 the
compiled static steps did not finish in 200 s (issue 33).  Compiling the decoder
layer instead does not help as is: the attention layer hands its ``layer_idx`` to
the cache, dynamo specialises on that integer, and every layer compiles again.

:func:`layer_step` is the layer without the cache: it takes the layer module (whose
weights dynamo treats as inputs, so all layers share one compiled graph), the
hidden states, the rotary ``cos``/``sin``, an additive mask and, for a tail step,
the keys and values of each row's head to put in front.  It returns the new hidden
states and the layer's own keys and values, which the head step stores.  It uses
only the layer's public submodules (norms, projections, MLP) and
``torch.nn.functional.scaled_dot_product_attention``, and computes what
transformers' Qwen3 layer computes; :func:`supports` says whether a model has that
structure.
"""

from __future__ import annotations

from typing import Any

import torch
import torch.nn.functional as F

_PARTS = ("input_layernorm", "post_attention_layernorm", "mlp", "self_attn")
_ATTENTION = ("q_proj", "k_proj", "v_proj", "o_proj", "q_norm", "k_norm")


def supports(base: Any) -> bool:
    """Whether ``base`` (a transformers base model) has Qwen3's layer structure."""
    layers = getattr(base, "layers", None)
    if not layers or not all(hasattr(base, n) for n in ("embed_tokens", "rotary_emb", "norm")):
        return False
    layer = layers[0]
    attention = getattr(layer, "self_attn", None)
    return all(hasattr(layer, n) for n in _PARTS) and all(
        hasattr(attention, n) for n in _ATTENTION
    )


def layer_step(
    layer: Any, hidden: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor,
    mask: torch.Tensor, head_keys: torch.Tensor | None, head_values: torch.Tensor | None,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """One Qwen3 decoder layer over ``hidden`` ``[batch, length, hidden]``.

    Args:
        layer: A ``Qwen3DecoderLayer`` (or one with the same submodules).
        hidden: The layer's input hidden states.
        cos: Rotary cosines ``[batch, length, head_dim]`` (the model's ``rotary_emb``).
        sin: Rotary sines, the same shape.
        mask: Additive attention mask ``[batch or 1, 1, length, keys]``.
        head_keys: ``[batch, kv_heads, head, head_dim]`` keys in front of this step's
            own, or ``None`` (the head step itself).
        head_values: Their values.

    Returns:
        The output hidden states, and this step's own keys and values
        ``[batch, kv_heads, length, head_dim]`` (after the key norm and rotary).
    """
    attention = layer.self_attn
    batch, length, _ = hidden.shape
    x = layer.input_layernorm(hidden)
    query = _heads(attention.q_norm, attention.q_proj(x), batch, length, attention.head_dim)
    keys = _heads(attention.k_norm, attention.k_proj(x), batch, length, attention.head_dim)
    values = attention.v_proj(x).view(batch, length, -1, attention.head_dim).transpose(1, 2)
    query, keys = _rotate(query, cos, sin), _rotate(keys, cos, sin)
    all_keys, all_values = keys, values
    if head_keys is not None and head_values is not None:
        all_keys = torch.cat([head_keys, keys], dim=2)
        all_values = torch.cat([head_values, values], dim=2)
    groups = query.shape[1] // keys.shape[1]
    out = F.scaled_dot_product_attention(
        query, all_keys.repeat_interleave(groups, dim=1),
        all_values.repeat_interleave(groups, dim=1), attn_mask=mask, scale=attention.scaling,
    )
    hidden = hidden + attention.o_proj(out.transpose(1, 2).reshape(batch, length, -1))
    hidden = hidden + layer.mlp(layer.post_attention_layernorm(hidden))
    return hidden, keys, values


def _heads(norm: Any, projected: torch.Tensor, batch: int, length: int, dim: int) -> torch.Tensor:
    return norm(projected.view(batch, length, -1, dim)).transpose(1, 2)


def _rotate(states: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """Rotary position embedding, as transformers' ``apply_rotary_pos_emb`` (half split)."""
    cos, sin = cos[:, None], sin[:, None]
    half = states.shape[-1] // 2
    rotated = torch.cat([-states[..., half:], states[..., :half]], dim=-1)
    return states * cos + rotated * sin
