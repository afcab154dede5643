"""Dynamic-shape scoring for the Qwen3 reranker: micro-batches fitted to their tails.

The path every model can take (and the one the static path falls back to): the
candidates are sorted by length and cut into micro-batches of ``batch_size``, each
right-padded to its own longest tail, so padding never precedes a real token.  With
``prefix_cache`` the shared head runs once and every micro-batch runs only its
document and suffix tokens on top of the head's keys and values
(:mod:`memory.rerank.kv_cache`).  Only the two lm_head rows of "no" and "yes" are
applied to the last real position of each row, in float32.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import torch

from memory.errors import RerankerError
from memory.rerank import deadline
from memory.rerank.kv_cache import LayerKV, layer_states, new_cache, repeated_cache


@dataclass
class DynamicScorer:
    """Scores tails with shapes fitted to each micro-batch.

    Args:
        model: The loaded causal LM; its base model (``model.model``) runs.
        device: The device the model is on.
        answer_rows: float32 ``[2, hidden]``: the lm_head rows of "no" and "yes".
        answer_bias: Their bias, or ``None``.
        pad_id: Token id used for padding (any valid id: padding is masked).
        cache_arg: forward's KV cache argument (:func:`kv_cache.cache_argument`);
            only read with ``prefix_cache``.
        batch_size: Candidates per micro-batch.
        prefix_cache: Whether the head runs once and the micro-batches on its cache.
    """

    model: Any
    device: str
    answer_rows: torch.Tensor
    answer_bias: torch.Tensor | None
    pad_id: int
    cache_arg: str
    batch_size: int
    prefix_cache: bool

    @torch.inference_mode()
    def score(
        self, head: list[int], tails: Sequence[list[int]], indices: Sequence[int]
    ) -> list[float]:
        """Score the tails at ``indices`` after ``head``, micro-batch by micro-batch.

        Returns a list over all tails; entries not in ``indices`` stay 0.0.  Without
        autograd whoever calls (a group's overflow rows ran with it on, keeping every
        activation alive until the scores were read).

        Raises:
            RerankerError: The service's deadline passed between micro-batches.
        """
        head_kv = self.head_kv(head) if self.prefix_cache else None
        scores = [0.0] * len(tails)
        lengths = [len(tails[i]) for i in indices]
        for local in micro_batches(lengths, self.batch_size):
            stop_if_late()
            chunk = [indices[j] for j in local]
            # with the head's cache a row is its tail alone; without, the whole prompt
            batch = [tails[i] if head_kv is not None else head + tails[i] for i in chunk]
            for i, value in zip(chunk, self.score_batch(batch, head_kv), strict=True):
                scores[i] = value
        return scores

    def head_kv(self, head: list[int]) -> list[LayerKV]:
        """Run the shared head once and return each layer's keys and values."""
        cache = new_cache()
        ids = torch.tensor([head], device=self.device)
        self.model.model(input_ids=ids, use_cache=True, **{self.cache_arg: cache})
        return layer_states(cache)

    def score_batch(self, batch: list[list[int]], head_kv: list[LayerKV] | None) -> list[float]:
        """Score right-padded sequences, on top of the head cache when given."""
        lengths = torch.tensor([len(s) for s in batch], device=self.device)
        width = int(lengths.max())
        ids = torch.full((len(batch), width), self.pad_id, dtype=torch.long)
        for row, seq in enumerate(batch):
            ids[row, : len(seq)] = torch.tensor(seq, dtype=torch.long)
        ids = ids.to(self.device)
        mask = (torch.arange(width, device=self.device) < lengths[:, None]).long()
        kwargs: dict[str, Any] = {}
        if head_kv is not None:
            offset = head_kv[0][0].shape[-2]
            kwargs[self.cache_arg] = repeated_cache(head_kv, len(batch))
            kwargs["position_ids"] = (
                torch.arange(offset, offset + width, device=self.device).expand(len(batch), -1)
            )
            kwargs["use_cache"] = True
            mask = torch.cat([mask.new_ones(len(batch), offset), mask], dim=1)
        out = self.model.model(input_ids=ids, attention_mask=mask, **kwargs)
        rows = torch.arange(len(batch), device=self.device)
        last = out.last_hidden_state[rows, lengths - 1]
        return self.yes_probability(last)

    def yes_probability(self, hidden: torch.Tensor) -> list[float]:
        """P(yes) over {no, yes} from final hidden states, computed in float32."""
        logits = hidden.to(torch.float32) @ self.answer_rows.T
        if self.answer_bias is not None:
            logits = logits + self.answer_bias
        return torch.log_softmax(logits, dim=-1)[:, 1].exp().tolist()


def stop_if_late() -> None:
    """Stop between micro-batches once the service's deadline has passed.

    The search has stopped waiting by then; the next search's candidates should
    not queue behind batches nobody reads (:mod:`memory.rerank.deadline`).

    Raises:
        RerankerError: The deadline has passed.
    """
    if deadline.passed():
        raise RerankerError("the reranker's deadline passed before every batch was scored")


def micro_batches(lengths: Sequence[int], batch_size: int) -> list[list[int]]:
    """Split indices into micro-batches of similar length, shortest first.

    Sorting by length keeps the padding of each right-padded batch small.
    """
    order = sorted(range(len(lengths)), key=lambda i: lengths[i])
    return [order[start : start + batch_size] for start in range(0, len(order), batch_size)]
