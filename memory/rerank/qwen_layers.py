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

Each query, key and value projection is its own small matmul, as are the MLP's gate
and up projections: five kernels a layer where two do, on steps whose time is mostly
a fixed floor of kernel latencies (issue 33: ~2.3 ms for the 0.6B's 28 layers).
:func:`fuse_projections` therefore lays each layer's q/k/v weights out as one tensor
and its gate/up weights as another, and makes the modules' own weights views of them:
the compiled step multiplies once by each, while the model's forward reads the same
memory as before (no second copy; the 8B's would be 9 GB).
"""

from __future__ import annotations

import weakref
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

_PARTS = ("input_layernorm", "post_attention_layernorm", "mlp", "self_attn")
_ATTENTION = ("q_proj", "k_proj", "v_proj", "o_proj", "q_norm", "k_norm")
_MLP = ("gate_proj", "up_proj", "down_proj", "act_fn")

Fused = tuple[torch.Tensor, torch.Tensor]  # one layer's q/k/v weights, its gate/up weights

# layer module -> its fused weights: a model is laid out once, as CUDA graphs captured
# on its weights would read freed memory if they moved again
_FUSED: weakref.WeakKeyDictionary[Any, Fused] = weakref.WeakKeyDictionary()


def supports(base: Any) -> bool:
    """Whether ``base`` (a transformers base model) has Qwen3's layer structure."""
    layers = getattr(base, "layers", None)
    if not layers or not all(hasattr(base, n) for n in ("embed_tokens", "rotary_emb", "norm")):
        return False
    layer = layers[0]
    attention: Any = getattr(layer, "self_attn", None)
    mlp: Any = getattr(layer, "mlp", None)
    has_parts = all(hasattr(layer, n) for n in _PARTS)
    has_attention = has_parts and all(hasattr(attention, n) for n in _ATTENTION)
    if not has_attention or not all(hasattr(mlp, n) for n in _MLP):
        return False
    # the projections fuse_projections joins carry no bias (Qwen3's have none)
    return all(getattr(p, "bias", None) is None for group in _groups(layer) for p in group)


def fuse_projections(base: Any) -> list[Fused]:
    """Each layer's q/k/v and gate/up weights as one tensor each; see the module docs.

    The modules' weights become views of the fused tensors (same values, dtype,
    device and ``requires_grad``; one layer's weights at a time are copied).  A model
    laid out before, by this process, is not touched again.  On CUDA the allocator's
    cache is emptied afterwards: the old weights' blocks are smaller than the fused
    ones and would otherwise stay reserved.  ``base`` must pass :func:`supports`.

    Returns:
        Per layer, its fused ``(q/k/v, gate/up)`` weights.
    """
    moved = False
    for layer in base.layers:
        if not _laid_out(layer):
            _lay_out(layer)
            moved = True
    fused = [_FUSED[layer] for layer in base.layers]
    if moved and fused[0][0].is_cuda:
        torch.cuda.empty_cache()
    return fused


def _groups(layer: Any) -> tuple[list[Any], list[Any]]:
    attention, mlp = layer.self_attn, layer.mlp
    return [attention.q_proj, attention.k_proj, attention.v_proj], [mlp.gate_proj, mlp.up_proj]


def _laid_out(layer: Any) -> bool:
    """Whether ``layer``'s weights are still the views :func:`_lay_out` made."""
    known = _FUSED.get(layer)
    return known is not None and all(
        _views(fused, modules) for fused, modules in zip(known, _groups(layer), strict=True)
    )


def _lay_out(layer: Any) -> None:
    """Fuse ``layer``'s weights and make its modules' weights views of them."""
    groups = _groups(layer)
    with torch.no_grad():
        fused = tuple(torch.cat([m.weight for m in modules]) for modules in groups)
        for weights, modules in zip(fused, groups, strict=True):
            start = 0
            for module in modules:
                rows, grad = module.weight.shape[0], module.weight.requires_grad
                module.weight = nn.Parameter(weights[start : start + rows], requires_grad=grad)
                start += rows
    _FUSED[layer] = (fused[0], fused[1])


def _views(fused: torch.Tensor, modules: list[Any]) -> bool:
    """Whether ``modules``' weights are still, in order, the rows of ``fused``."""
    start = 0
    for module in modules:
        if module.weight.data_ptr() != fused[start:].data_ptr():
            return False
        start += module.weight.shape[0]
    return start == fused.shape[0]


def layer_step(
    layer: Any, fused: Fused, hidden: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor,
    mask: torch.Tensor, head_keys: torch.Tensor | None, head_values: torch.Tensor | None,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """One Qwen3 decoder layer over ``hidden`` ``[batch, length, hidden]``.

    Args:
        layer: A ``Qwen3DecoderLayer`` (or one with the same submodules).
        fused: Its q/k/v and gate/up weights from :func:`fuse_projections`.
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
    attention, mlp = layer.self_attn, layer.mlp
    batch, length, _ = hidden.shape
    x = layer.input_layernorm(hidden)
    kv_size = attention.k_proj.weight.shape[0]
    q, k, v = F.linear(x, fused[0]).split(
        [attention.q_proj.weight.shape[0], kv_size, kv_size], dim=-1
    )
    query = _heads(attention.q_norm, q, batch, length, attention.head_dim)
    keys = _heads(attention.k_norm, k, batch, length, attention.head_dim)
    values = v.reshape(batch, length, -1, attention.head_dim).transpose(1, 2)
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
    gate, up = F.linear(layer.post_attention_layernorm(hidden), fused[1]).split(
        [mlp.gate_proj.weight.shape[0], mlp.up_proj.weight.shape[0]], dim=-1
    )
    hidden = hidden + mlp.down_proj(mlp.act_fn(gate) * up)
    return hidden, keys, values


def _heads(norm: Any, projected: torch.Tensor, batch: int, length: int, dim: int) -> torch.Tensor:
    return norm(projected.reshape(batch, length, -1, dim)).transpose(1, 2)


def _rotate(states: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """Rotary position embedding, as transformers' ``apply_rotary_pos_emb`` (half split)."""
    cos, sin = cos[:, None], sin[:, None]
    half = states.shape[-1] // 2
    rotated = torch.cat([-states[..., half:], states[..., :half]], dim=-1)
    return states * cos + rotated * sin
