"""The static buffers of the Qwen3 reranker's static-shape steps.

A CUDA graph replays on the addresses it was captured with, so every step of
:class:`memory.rerank.qwen_static.StaticScorer` reads and writes tensors allocated
once: per head *capacity* a :class:`HeadSlot` (token ids per head size in, each
layer's keys and values out, one row per search slot), and per (capacity, bucket) a
:class:`TailSlot` (token ids, where each position's candidate starts in its row,
where each candidate's last real token lies, each row's head slot, the scores out).
:class:`StaticBuffers` builds them on first use and keeps them.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import torch

Shape = tuple[int, int]  # (batch, tail length)

SEGMENT_MIN = 16  # a packed row holds at most length // SEGMENT_MIN candidates


def reads_per_row(length: int) -> int:
    """Candidates one row of ``length`` positions may hold when tails are packed."""
    return max(1, length // SEGMENT_MIN)


@dataclass
class HeadSlot:
    """Static buffers of one head capacity: token ids in (per head size), each layer's K/V out."""

    keys: list[torch.Tensor]  # per layer [head slots, kv_heads, cap, head_dim]
    values: list[torch.Tensor]
    ids: dict[Shape, torch.Tensor] = field(default_factory=dict)  # (heads, size) -> long ids
    graphs: dict[Shape, Any] = field(default_factory=dict)  # (heads, size) -> its captured step

    @property
    def capacity(self) -> int:
        """Head positions the tail steps attend over (padding masked)."""
        return int(self.keys[0].shape[2])


@dataclass
class TailSlot:
    """Static buffers of one (head capacity, bucket) step."""

    ids: torch.Tensor  # [batch, length] long
    starts: torch.Tensor  # [batch, length] long: where each position's candidate starts
    reads: torch.Tensor  # [batch * reads_per_row(length)] long: flat last positions
    heads: torch.Tensor  # [batch] long: each row's head slot
    out: torch.Tensor | None = None  # float32 P(yes) per entry of ``reads``, set by the step
    graph: Any = None


class StaticBuffers:
    """Every head and tail buffer of one static scorer, built on first use.

    Args:
        base: The transformers base model (its config and layer count size the K/V).
        slots: Searches one step can hold: head rows per capacity.
        pad_id: Token id new id buffers are filled with (padding is masked).
        device: Where the buffers live (the model's device).
        dtype: The model's dtype, for the keys and values.
    """

    def __init__(
        self, base: Any, slots: int, pad_id: int, device: torch.device, dtype: torch.dtype
    ) -> None:
        self.device, self.dtype = device, dtype
        self.config = base.config
        self.layers = len(base.layers)
        self.slots = slots
        self.pad_id = pad_id
        self.heads: dict[int, HeadSlot] = {}
        self.tails: dict[tuple[int, Shape], TailSlot] = {}

    def head_slot(self, cap: int) -> HeadSlot:
        """The head buffers of capacity ``cap``."""
        slot = self.heads.get(cap)
        if slot is None:
            kv_shape = (self.slots, self.config.num_key_value_heads, cap, _head_dim(self.config))
            slot = HeadSlot(
                keys=[self._zeros(kv_shape) for _ in range(self.layers)],
                values=[self._zeros(kv_shape) for _ in range(self.layers)],
            )
            self.heads[cap] = slot
        return slot

    def tail_slot(self, cap: int, shape: Shape) -> TailSlot:
        """The buffers of the tail step of ``shape`` on heads of capacity ``cap``."""
        slot = self.tails.get((cap, shape))
        if slot is None:
            batch, length = shape
            slot = TailSlot(
                ids=self.full(shape),
                starts=self._indices(shape),
                reads=self._indices((batch * reads_per_row(length),)),
                heads=self._indices((batch,)),
            )
            self.tails[(cap, shape)] = slot
        return slot

    def put(self, buffer: torch.Tensor, values: torch.Tensor) -> None:
        """Copy CPU ``values`` into the static ``buffer`` without waiting for the GPU.

        A plain ``copy_`` from CPU memory waits until every step already queued on the
        GPU has finished, so the GPU then idles while the host prepares the next step.
        From pinned memory with ``non_blocking`` the copy queues behind those steps
        instead (PyTorch keeps the pinned block until the copy has run).
        """
        if buffer.is_cuda:
            buffer.copy_(values.pin_memory(), non_blocking=True)
        else:
            buffer.copy_(values)

    def full(self, shape: Shape) -> torch.Tensor:
        """A static id buffer, all padding."""
        return torch.full(shape, self.pad_id, dtype=torch.long, device=self.device)

    def clear(self) -> None:
        """Drop every buffer (and the graphs captured on them)."""
        self.heads.clear()
        self.tails.clear()

    def _indices(self, shape: tuple[int, ...]) -> torch.Tensor:
        return torch.zeros(shape, dtype=torch.long, device=self.device)

    def _zeros(self, shape: tuple[int, ...]) -> torch.Tensor:
        return torch.zeros(shape, dtype=self.dtype, device=self.device)


def _head_dim(config: Any) -> int:
    return getattr(config, "head_dim", None) or config.hidden_size // config.num_attention_heads
