"""Static-shape scoring for the Qwen3 reranker: fixed buckets, the head once, CUDA graphs.

Eager PyTorch on a GPU is launch-bound for a reranker: one forward pass of the
0.6B model costs about the same whatever its shape, because the time goes into
launching some 400 small kernels.  A CUDA graph replays all of them in one launch,
but only for the tensor shapes and addresses it was captured with.  This module
therefore runs every search through a few fixed shapes:

* the *head* (system prompt, instruction, query) is right-padded to the next
  multiple of :data:`HEAD_STEP` tokens (a 93-token head runs as 96, not 128) and run
  once per query, writing each layer's keys and values into the static buffers of
  a power-of-two *capacity* (64, 128, ... up to ``max_length``);
* the *tails* (document + suffix) are sorted by length and packed into the
  profile's ``[batch, length]`` buckets, right-padded in both directions (extra
  tokens after a tail, extra rows after the last candidate), and run against the
  head's cache.  With ``pack`` a row may hold several tails back to back
  (:func:`plan_packed`), wherever that plans cheaper: each tail's tokens see only
  the head and its own earlier tokens, and count their positions from its start.

Several searches can be scored together (:meth:`StaticScorer.score_together`): their
heads run as the rows of one head step (:func:`head_batches`: 1, 4 or 16 heads per
step with 16 slots), each row writing its own *head slot* of the same buffers, and
one tail step holds rows of several searches, each row attending only to its own
head (a per-row mask and a per-row gather of the head's keys and values).  A bot in
many servers has many searches at once; this fills one replay with them instead of
queueing them.  :class:`StepStats` counts what ran (steps, rows, padded positions),
for the benchmark and the tests.

Padding cannot change a score: the attention mask lets a tail token see only the
``head_len`` real head positions and its own tail's positions up to itself (right
padding sits after every real token, so a causal mask already hides it, and a packed
row's neighbours are masked as well), and each tail's score is read at its own last
real position, not at the bucket's end.

With ``torch_compile`` the steps run their layers through one compiled function
shared by every layer (:func:`memory.rerank.qwen_layers.layer_step`: inductor fuses
RMSNorm, RoPE, SiLU-mul; the weights are its inputs and the shapes dynamic, so a
model compiles a handful of graphs whatever its depth and buckets), and every shape
is run once at load, so no search compiles; any failure there leaves the eager steps
in place.  :func:`memory.rerank.qwen.static_scorer` does this in the background,
serving the eager steps (or their graphs) meanwhile.

On CUDA with ``cuda_graphs`` every (heads, head size) and every (head capacity, bucket)
step is captured once, at
load time, into one shared memory pool; a search only copies token ids into the
static input buffers and replays.  Elsewhere the very same step functions run
eagerly, which is how the path is tested on CPU.

:class:`StaticScorer` plans and runs the steps; the static tensors they read and
write are :class:`memory.rerank.qwen_buffers.StaticBuffers`, and the forward passes
themselves :class:`memory.rerank.qwen_steps.StaticForward`.
"""

from __future__ import annotations

import bisect
import itertools
import logging
import math
import time
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from functools import partial
from typing import Any

import torch

from memory.rerank import qwen_layers
from memory.rerank.kv_cache import prefix_cache_class
from memory.rerank.qwen_buffers import HeadSlot, Shape, StaticBuffers, TailSlot, reads_per_row
from memory.rerank.qwen_steps import StaticForward

log = logging.getLogger(__name__)

# a search's tails, or a function returning them (see StaticScorer.score_together)
Tails = Sequence[list[int]] | Callable[[], Sequence[list[int]]]

HEAD_MIN = 64  # smallest head capacity; the official prompt head alone is ~60 tokens
HEAD_STEP = 32  # head sizes between capacities: the head step pads to a multiple of this


@dataclass(frozen=True)
class Run:
    """One forward pass of the static path: which candidates go into which shape.

    Attributes:
        shape: The bucket, ``(batch, length)``.
        indices: Candidate indices, row by row.
        per_row: How many of ``indices`` each row holds, when several candidates are
            packed into a row (:func:`plan_packed`); empty: one candidate a row.
    """

    shape: Shape
    indices: list[int]
    per_row: tuple[int, ...] = ()

    def rows(self) -> list[list[int]]:
        """The candidate indices of each row, in row order."""
        if not self.per_row:
            return [[i] for i in self.indices]
        rows, start = [], 0
        for count in self.per_row:
            rows.append(self.indices[start : start + count])
            start += count
        return rows


def head_capacities(max_length: int) -> tuple[int, ...]:
    """Head buffer sizes: powers of two from :data:`HEAD_MIN` up to ``max_length``."""
    caps = [HEAD_MIN]
    while caps[-1] < max_length:
        caps.append(caps[-1] * 2)
    return tuple(caps)


def head_sizes(max_length: int) -> tuple[int, ...]:
    """Padded head lengths the head step runs: multiples of :data:`HEAD_STEP`.

    They start at :data:`HEAD_MIN` and end at the largest capacity, so a head is
    padded by fewer than ``HEAD_STEP`` tokens instead of up to doubling; each size
    writes into the keys and values of the smallest capacity holding it, which the
    tail steps read (attention over a few masked head positions costs little next
    to running them through every layer).
    """
    return tuple(range(HEAD_MIN, head_capacities(max_length)[-1] + 1, HEAD_STEP))


def head_size(length: int, max_length: int) -> tuple[int, int]:
    """``(size, capacity)`` a head of ``length`` tokens runs as; it must fit (see ``fits``)."""
    size = next(s for s in head_sizes(max_length) if s >= length)
    return size, next(c for c in head_capacities(max_length) if c >= size)


def head_batches(slots: int) -> tuple[int, ...]:
    """Heads one head step runs together: powers of four up to ``slots``, and ``slots``.

    A group of ``n`` searches runs its heads in the smallest of these holding ``n``
    (the extra rows are padding, written into slots no tail reads), so 16 searches
    take one head step instead of 16, and one search alone still runs one row.
    """
    sizes = {slots}
    size = 1
    while size < slots:
        sizes.add(size)
        size *= 4
    return tuple(sorted(sizes))


@dataclass
class StepStats:
    """What the static path ran: steps, rows and token positions (padding included).

    Counted on every call, eager or replayed, so the benchmark can print what a group
    of searches executes and the tests can assert it (never a timing).

    Attributes:
        groups: Calls of :meth:`StaticScorer.score_together` groups (one per shared plan).
        searches: Searches scored.
        head_steps: Head steps run (forward passes or replays).
        head_rows: Real heads in them.
        head_positions: Token positions the head steps computed (batch x padded size).
        tail_steps: Tail steps run.
        tail_rows: Candidates scored in them (one a row, unless packed: then
            ``rows_per_tail_step`` in the summary counts candidates, not rows).
        tail_positions: Token positions the tail steps computed (batch x length).
        tail_tokens: Real tail tokens in them.
    """

    groups: int = 0
    searches: int = 0
    head_steps: int = 0
    head_rows: int = 0
    head_positions: int = 0
    tail_steps: int = 0
    tail_rows: int = 0
    tail_positions: int = 0
    tail_tokens: int = 0

    def reset(self) -> None:
        """Set every counter back to zero."""
        for name in self.__dataclass_fields__:
            setattr(self, name, 0)

    def summary(self) -> dict[str, float]:
        """The counters, plus per-search steps, rows per tail step and the padding share."""
        out: dict[str, float] = dict(self.__dict__)
        per = max(1, self.searches)
        out["searches_per_group"] = round(self.searches / max(1, self.groups), 2)
        out["steps_per_search"] = round((self.head_steps + self.tail_steps) / per, 2)
        out["rows_per_tail_step"] = round(self.tail_rows / max(1, self.tail_steps), 1)
        out["tail_padding"] = round(1 - self.tail_tokens / max(1, self.tail_positions), 3)
        return out


def plan_runs(
    lengths: Sequence[int], buckets: Sequence[Shape], run_cost: int = 512,
    measured: Mapping[Shape, float] | None = None,
) -> tuple[list[Run], list[int]]:
    """Pack candidates into bucket shapes at the least cost.

    Without ``measured``, a run of shape ``(batch, length)`` costs ``batch * length``
    token positions (padding included: a static shape computes all of them) plus
    ``run_cost``, the fixed price of one more forward pass or graph replay in token
    positions.  With ``measured`` (``reranker.bucket_costs``: each bucket's step time
    on this machine), a run costs its shape's measured time, which already holds
    both.  With the candidates sorted by tail length, the cheapest plan cuts them
    into consecutive runs, and each run may as well take every following candidate
    its shape holds; a dynamic programme over the start of each run then finds the
    cheapest plan in O(candidates x buckets x log candidates).

    Args:
        lengths: Tail length of each candidate.
        buckets: The profile's ``(batch, length)`` shapes.
        run_cost: Token positions one more run is worth (``reranker.bucket_run_cost``).
        measured: Each bucket's step time (any unit), replacing the token estimate.

    Returns:
        The runs, shortest tails first, and the indices of candidates longer than
        every bucket (which the caller scores on the dynamic path).
    """
    by_length = _ByLength(lengths, buckets, run_cost, measured)
    return by_length.alone(0), by_length.overflow


class _ByLength:
    """The candidates in order of tail length, with the cheapest one-a-row plan of
    every suffix of those within some bucket (one dynamic programme for both plans)."""

    def __init__(self, lengths: Sequence[int], buckets: Sequence[Shape], run_cost: int,
                 measured: Mapping[Shape, float] | None) -> None:
        order = sorted(range(len(lengths)), key=lambda i: lengths[i])
        self.ordered = [lengths[i] for i in order]
        longest = max((length for _, length in buckets), default=0)
        self.fits = bisect.bisect_right(self.ordered, longest)
        self.fitting, self.overflow = order[:self.fits], order[self.fits:]
        self.price = _prices(buckets, run_cost, measured)
        self.steps = _suffix_plans(self.ordered[:self.fits], buckets, self.price)

    def alone(self, start: int) -> list[Run]:
        """The cheapest plan, one a row, for the fitting tails from ``start`` on."""
        return _suffix_runs(self.fitting, self.steps, start)

    def cost(self, runs: Sequence[Run]) -> float:
        """What ``runs`` cost at this plan's prices."""
        return sum(self.price[run.shape] for run in runs)


def _suffix_plans(ordered: Sequence[int], buckets: Sequence[Shape],
                  price: Mapping[Shape, float]) -> list[tuple[Shape, int]]:
    """The cheapest plan of every suffix of ``ordered`` (tail lengths, ascending, each
    within some bucket), as ``step[i]``: the first run's shape and how many it takes.

    A dynamic programme from the end; one pass gives every suffix, which
    :func:`plan_packed` needs for the tails it plans one a row.
    """
    count = len(ordered)
    # each bucket with its price and where the tails it cannot hold begin
    shapes = [((batch, length), batch, price[(batch, length)],
               bisect.bisect_right(ordered, length)) for batch, length in buckets]
    cost = [0.0] * (count + 1)  # cost[i]: cheapest plan for ordered[i:]
    step: list[tuple[Shape, int]] = [((0, 0), 0)] * count
    for i in range(count - 1, -1, -1):
        best, first = -1.0, ((0, 0), 0)
        for shape, batch, value, end in shapes:
            if end <= i:  # ordered[i] is longer than this shape
                continue
            take = batch if end - i > batch else end - i
            total = value + cost[i + take]
            if best < 0 or total < best:
                best, first = total, (shape, take)
        cost[i], step[i] = best, first
    return step


def _suffix_runs(order: Sequence[int], step: Sequence[tuple[Shape, int]], start: int) -> list[Run]:
    """The runs of the plan :func:`_suffix_plans` found for ``order[start:]``."""
    runs, i = [], start
    while i < len(order):
        shape, take = step[i]
        runs.append(Run(shape, list(order[i : i + take])))
        i += take
    return runs


def plan_packed(
    lengths: Sequence[int], buckets: Sequence[Shape], run_cost: int = 512,
    measured: Mapping[Shape, float] | None = None, owners: Sequence[int] | None = None,
) -> tuple[list[Run], list[int]]:
    """Pack candidates back to back into rows, then the rows into bucket shapes.

    A chat message and its suffix are 20-80 tokens, so one candidate a row leaves a
    ``[32, 96]`` step more than half padding.  Here a row holds as many candidates
    as fit (at most ``reads_per_row(length)``), each attending only to itself and its
    row's head (:meth:`memory.rerank.qwen_steps.StaticForward.tail`).  For every
    bucket length, the tails it holds are packed into rows of that length, first fit
    by decreasing length, never two ``owners``' (searches') tails in one row, as a row
    attends to one head, and the rows go into that length's shapes at the least cost
    (the prices of :func:`plan_runs`); longer tails, if any, take :func:`plan_runs`'
    cheapest plan, one a row (one long message must not stretch every row).  The
    cheapest length wins.

    Returns:
        The runs (:attr:`Run.per_row` set on the packed ones) and, as
        :func:`plan_runs`, the indices of candidates longer than every bucket,
        shortest first.
    """
    by_length = _ByLength(lengths, buckets, run_cost, measured)
    return _packed(by_length, lengths, buckets, owners), by_length.overflow


def _packed(by_length: _ByLength, lengths: Sequence[int], buckets: Sequence[Shape],
            owners: Sequence[int] | None) -> list[Run]:
    """:func:`plan_packed`'s runs."""
    fits, ordered = by_length.fits, by_length.ordered
    # longest first, ties by index: the tails a row length holds are a suffix of it
    decreasing = sorted(by_length.fitting, key=lambda i: (-lengths[i], i))
    owned = list(owners) if owners is not None else [0] * len(lengths)
    tokens = list(itertools.accumulate(ordered[:fits], initial=0))
    # the longest rows first: they mostly plan cheapest, which lets the bound below
    # skip more of the rest; a tie goes to the shorter rows
    best: tuple[float, int, list[Run]] = (math.inf, 0, [])
    for size in sorted({length for _, length in buckets}, reverse=True):
        held = bisect.bisect_right(ordered, size, 0, fits)
        if not held:
            continue
        alone = by_length.alone(held)  # the longer tails, one a row
        if _least_packing(tokens[held], held, size, buckets, by_length.price) \
                + by_length.cost(alone) > best[0]:
            continue  # cannot beat the best so far: not worth packing
        rows = _pack_rows(decreasing[fits - held:], lengths, owned, size)
        cost, batches = _cover(len(rows), [b for b, n in buckets if n == size], size,
                               by_length.price)
        cost += by_length.cost(alone)
        if (cost, size) < best[:2]:
            best = (cost, size, _packed_runs(rows, batches, size) + alone)
    return best[2]


def _least_packing(tokens: int, tails: int, size: int, buckets: Sequence[Shape],
                   price: Mapping[Shape, float]) -> float:
    """A floor under what ``tails`` tails of ``tokens`` tokens in all cost packed into
    rows of ``size``: their fewest possible rows, each at the cheapest price a row."""
    fewest = max(-(-tokens // size), -(-tails // reads_per_row(size)))
    return fewest * min(price[(b, n)] / b for b, n in buckets if n == size)


def _packed_runs(rows: list[list[int]], batches: list[int], size: int) -> list[Run]:
    """``rows`` into steps of ``batches`` rows of ``size`` positions, in order."""
    runs, start = [], 0
    for batch in batches:
        chunk = rows[start : start + batch]
        start += len(chunk)
        if chunk:  # a free step (a measured time of 0) may be left over
            runs.append(Run((batch, size), [i for row in chunk for i in row],
                            tuple(len(row) for row in chunk)))
    return runs


def cheapest_plan(
    lengths: Sequence[int], buckets: Sequence[Shape], run_cost: int = 512,
    measured: Mapping[Shape, float] | None = None, pack: bool = False,
    owners: Sequence[int] | None = None,
) -> tuple[list[Run], list[int]]:
    """:func:`plan_runs`, and with ``pack`` also :func:`plan_packed`, whichever costs less."""
    by_length = _ByLength(lengths, buckets, run_cost, measured)
    single = by_length.alone(0)
    if pack:
        packed = _packed(by_length, lengths, buckets, owners)
        if by_length.cost(packed) < by_length.cost(single):
            return packed, by_length.overflow
    return single, by_length.overflow


def plan_cost(
    runs: Sequence[Run], buckets: Sequence[Shape], run_cost: int = 512,
    measured: Mapping[Shape, float] | None = None,
) -> float:
    """What ``runs`` cost at the prices :func:`plan_runs` and :func:`plan_packed` minimise."""
    price = _prices(buckets, run_cost, measured)
    return sum(price[run.shape] for run in runs)


def _prices(
    buckets: Sequence[Shape], run_cost: int, measured: Mapping[Shape, float] | None
) -> dict[Shape, float]:
    return {shape: measured[shape] if measured else shape[0] * shape[1] + run_cost
            for shape in buckets}


def _pack_rows(
    decreasing: Sequence[int], lengths: Sequence[int], owners: Sequence[int], size: int
) -> list[list[int]]:
    """First fit into rows of ``size`` positions, one owner a row, taking the tails in
    the order given (``decreasing``: longest first)."""
    room = reads_per_row(size)
    shortest = min((lengths[i] for i in decreasing), default=0)
    rows: list[list[int]] = []
    used: list[int] = []
    by_owner: dict[int, list[int]] = {}  # owner -> its rows with room left (indices into ``rows``)
    for i in decreasing:
        length = lengths[i]
        mine = by_owner.setdefault(owners[i], [])
        for row in mine:
            if used[row] + length <= size:
                break
        else:
            row = len(rows)
            mine.append(row)
            rows.append([])
            used.append(0)
        rows[row].append(i)
        used[row] += length
        if len(rows[row]) == room or used[row] + shortest > size:
            mine.remove(row)  # full: no later tail can join it
    return rows


def _cover(
    count: int, batches: Sequence[int], size: int, price: Mapping[Shape, float]
) -> tuple[float, list[int]]:
    """The cheapest steps (their batch sizes, largest first) holding ``count`` rows."""
    cost = [0.0] + [math.inf] * count
    pick = [0] * (count + 1)
    for held in range(1, count + 1):
        for batch in batches:
            total = price[(batch, size)] + cost[max(0, held - batch)]
            if total < cost[held]:
                cost[held], pick[held] = total, batch
    steps, held = [], count
    while held > 0:
        steps.append(pick[held])
        held = max(0, held - pick[held])
    return cost[count], sorted(steps, reverse=True)


def step_groups(head_lengths: Sequence[int], max_length: int, slots: int) -> list[list[int]]:
    """Which searches share steps: those whose heads have one capacity, ``slots`` at a
    time (indices into ``head_lengths``, in order)."""
    by_cap: dict[int, list[int]] = {}
    for index, length in enumerate(head_lengths):
        by_cap.setdefault(head_size(length, max_length)[1], []).append(index)
    return [members[start : start + slots]
            for members in by_cap.values() for start in range(0, len(members), slots)]


@dataclass
class StaticScorer:
    """Scores candidates through fixed (head capacity, bucket) shapes.

    Both steps call the base model's public ``forward`` with a prepared 4D attention
    mask (which transformers uses as given), explicit position ids and a
    cache (:mod:`memory.rerank.kv_cache`): the head step fills a ``DynamicCache``
    and copies its keys and values into the static head buffers; a tail step runs on
    a prefix cache that puts them in front of its own, repeated over its batch.

    Args:
        model: A loaded ``Qwen3ForCausalLM`` (or any causal LM whose ``model`` is a
            transformers base model with full attention), in eval mode.
        answer_rows: float32 ``[2, hidden]``: the lm_head rows of "no" and "yes".
        answer_bias: Their bias, or ``None``.
        pad_id: Token id used for padding (any valid id: padding is masked).
        buckets: ``(batch, length)`` shapes for the tails.
        max_length: The profile's ``max_length``; bounds the head capacities.
        slots: Searches one step can hold (``reranker.concurrent``): head buffers
            per capacity.
        run_cost: Token positions one more run is worth (``reranker.bucket_run_cost``).
        measured: Each bucket's measured step time (``reranker.bucket_costs``), which
            the plans then minimise instead; ``None``: padded positions and run cost.
        pack: Several candidates a row where that plans cheaper (``reranker.pack``,
            :func:`plan_packed`); the steps and their graphs are the same either way.
    """

    model: Any
    answer_rows: torch.Tensor
    answer_bias: torch.Tensor | None
    pad_id: int
    buckets: tuple[Shape, ...]
    max_length: int
    slots: int = 1
    run_cost: int = 512
    measured: dict[Shape, float] | None = None
    pack: bool = False
    graphs: bool = False
    compiled: bool = False
    stats: StepStats = field(default_factory=StepStats)

    def __post_init__(self) -> None:
        param = next(self.model.parameters())
        self.device, self.dtype = param.device, param.dtype
        self.base = self.model.model
        self.capacities = head_capacities(self.max_length)
        longest = self.capacities[-1] + max(length for _, length in self.buckets)
        self.forward = StaticForward(self.base, self.answer_rows, self.answer_bias,
                                     self.slots, longest, self.device, self.dtype)
        self.buffers = StaticBuffers(self.base, self.slots, self.pad_id, self.device, self.dtype)
        self.head_batches = head_batches(self.slots)
        prefix_cache_class()  # built here, outside any compiled step

    @property
    def heads(self) -> dict[int, HeadSlot]:
        """The head buffers built so far, by capacity."""
        return self.buffers.heads

    @property
    def tails(self) -> dict[tuple[int, Shape], TailSlot]:
        """The tail buffers built so far, by (head capacity, bucket)."""
        return self.buffers.tails

    # -- public --------------------------------------------------------------------

    def fits(self, head_len: int) -> bool:
        """Whether a head of ``head_len`` tokens fits the largest head buffer."""
        return head_len <= self.capacities[-1]

    def plan(
        self, lengths: Sequence[int], owners: Sequence[int] | None = None
    ) -> tuple[list[Run], list[int]]:
        """:func:`cheapest_plan` for tails of ``lengths`` with this scorer's settings.

        ``owners``: each tail's search, when several are planned together.
        """
        return cheapest_plan(lengths, self.buckets, self.run_cost, self.measured,
                             self.pack, owners)

    @torch.inference_mode()
    def score(
        self, head: list[int], tails: Sequence[list[int]], runs: list[Run]
    ) -> dict[int, float]:
        """P(yes) of the candidates in ``runs`` (from :meth:`plan`), by index.

        Raises:
            RuntimeError: A forward pass or graph replay failed.
        """
        self.stats.groups += 1
        self.stats.searches += 1
        rows = list(tails)
        return self._score_rows([head], lambda: (rows, [0] * len(rows), (runs, [])))[0]

    @torch.inference_mode()
    def score_together(
        self, searches: Sequence[tuple[list[int], Tails]]
    ) -> list[tuple[dict[int, float], list[int]]]:
        """Score several searches' ``(head, tails)`` in shared steps.

        Searches whose heads share a capacity run together, at most ``slots`` at a
        time: their heads as the rows of one head step, each into a slot of its own,
        then every tail of every search in one plan (:meth:`plan`), each row
        attending only to its own head.  Tails given as a function are asked for once
        the head step is queued (a GPU runs it while they are tokenized).

        Returns:
            Per search, in order: P(yes) by tail index, and the indices of tails
            longer than every bucket (for the caller's dynamic path).

        Raises:
            RuntimeError: A forward pass or graph replay failed.
        """
        results: list[tuple[dict[int, float], list[int]]] = [({}, []) for _ in searches]
        heads = [len(head) for head, _ in searches]
        for group in step_groups(heads, self.max_length, self.slots):
            self._score_group([searches[i] for i in group], [results[i] for i in group])
        return results

    def _score_group(
        self, searches: list[tuple[list[int], Tails]],
        results: list[tuple[dict[int, float], list[int]]],
    ) -> None:
        """One group of at most ``slots`` searches with heads of one capacity."""
        self.stats.groups += 1
        self.stats.searches += len(searches)
        owners: list[tuple[int, int]] = []  # (search, tail index) of each row

        def rows_and_plan() -> tuple[list[list[int]], list[int], tuple[list[Run], list[int]]]:
            rows = _rows(searches, owners)
            row_heads = [search for search, _ in owners]
            return rows, row_heads, self.plan([len(r) for r in rows], row_heads)

        found, overflow = self._score_rows([head for head, _ in searches], rows_and_plan)
        for row, value in found.items():
            search, i = owners[row]
            results[search][0][i] = value
        for row in overflow:
            search, i = owners[row]
            results[search][1].append(i)

    def _score_rows(
        self, heads: list[list[int]],
        rows_and_plan: Callable[[], tuple[list[list[int]], list[int], tuple[list[Run], list[int]]]],
    ) -> tuple[dict[int, float], list[int]]:
        """Heads into slots 0..n-1 (one step), then the rows, their head slots and runs
        from ``rows_and_plan``, asked for once the head step is queued (a GPU runs it
        meanwhile); returns the scores by row and the rows no bucket holds."""
        cap = max(head_size(len(head), self.max_length)[1] for head in heads)
        head_slot = self.buffers.head_slot(cap)
        self._heads_step(head_slot, heads)
        rows, row_heads, (runs, overflow) = rows_and_plan()
        found: list[torch.Tensor] = []
        for run in runs:
            members = run.rows()
            out = self._tail_step(head_slot, run.shape, [[rows[i] for i in row] for row in members],
                                  [row_heads[row[0]] for row in members])
            # a copy: the next replay of this shape's graph overwrites its output
            found.append(out[: len(run.indices)].clone())
        # the one wait for the GPU: every step was queued without reading a result
        values = torch.cat(found).tolist() if found else []
        return dict(zip([i for run in runs for i in run.indices], values, strict=True)), overflow

    def _heads_step(self, head_slot: HeadSlot, heads: list[list[int]]) -> None:
        """Run ``heads`` (at most ``slots``) as the rows of one head step, slot = row."""
        size = max(head_size(len(head), self.max_length)[0] for head in heads)
        batch = next(b for b in self.head_batches if b >= len(heads))
        lengths = [len(head) for head in heads] + [1] * (batch - len(heads))
        put = self.buffers.put
        put(self.forward.head_len[:batch], torch.tensor(lengths))
        ids = head_slot.ids.setdefault((batch, size), self.buffers.full((batch, size)))
        put(ids, _padded(heads, batch, size, self.pad_id))
        self._step(head_slot.graphs.get((batch, size)),
                   partial(self._run_head, head_slot, batch, size))
        self.stats.head_steps += 1
        self.stats.head_rows += len(heads)
        self.stats.head_positions += batch * size

    def _tail_step(
        self, head_slot: HeadSlot, shape: Shape, rows: list[list[list[int]]], owners: list[int]
    ) -> torch.Tensor:
        """One tail step of ``shape``: each row's candidates back to back, on its owner's head."""
        slot = self.buffers.tail_slot(head_slot.capacity, shape)
        batch, length = shape
        padding = [0] * (batch - len(rows))
        starts, reads = _layout(rows, batch, length)
        put = self.buffers.put
        put(slot.ids, _padded([[t for tail in row for t in tail] for row in rows],
                              batch, length, self.pad_id))
        put(slot.starts, starts)
        put(slot.reads, reads)
        put(slot.heads, torch.tensor(owners + padding))
        out = self._step(slot.graph, partial(self._run_tail, head_slot, slot), slot)
        self.stats.tail_steps += 1
        self.stats.tail_rows += sum(len(row) for row in rows)
        self.stats.tail_positions += batch * length
        self.stats.tail_tokens += sum(len(tail) for row in rows for tail in row)
        return out

    @torch.inference_mode()
    def compile(self, backend: Any = "inductor") -> float:
        """Compile the head and tail steps and run every shape once; before :meth:`capture`.

        One function is compiled, a decoder layer (:mod:`memory.rerank.qwen_layers`),
        with dynamic shapes: every layer, head size and bucket shares its graphs (a
        few: head or tail step, a batch of one), so the count does not grow with the
        model's depth or the profile's buckets.  Running each shape here does
        whatever specialising is left, at load rather than on a search.

        Args:
            backend: ``torch.compile``'s backend (``inductor``; tests pass others).

        Returns:
            Seconds spent.

        Raises:
            RuntimeError: The model is not a Qwen3 (no shared layer function for it).
            Exception: Whatever compilation raised (the caller keeps the eager steps
                after :meth:`uncompile`).
        """
        started = time.perf_counter()
        if self.forward.fused is None:  # qwen_layers.supports said no when it was built
            raise RuntimeError(
                f"{type(self.base).__name__} does not have Qwen3's decoder layers (their "
                "projections without bias): the compiled static steps are for Qwen3-Reranker "
                "models"
            )
        self.forward.layer_kernel = torch.compile(qwen_layers.layer_step, dynamic=True, backend=backend)
        for batch, size in self._head_shapes():
            self._run_head(self.buffers.head_slot(head_size(size, self.max_length)[1]), batch, size)
        for cap in self.capacities:
            for shape in self.buckets:
                self._run_tail(self.buffers.head_slot(cap), self.buffers.tail_slot(cap, shape))
        self.compiled = True
        return time.perf_counter() - started

    def uncompile(self) -> None:
        """Go back to the eager step functions (after a failed :meth:`compile`)."""
        self.forward.layer_kernel = None
        self.compiled = False

    @torch.inference_mode()
    def capture(self) -> float:
        """Capture every (heads, head size) and (head capacity, bucket) step as a CUDA graph; CUDA only.

        Warms each step up twice on a side stream (cuBLAS handles, attention kernel
        choice), then captures it into one memory pool shared by all graphs, which
        is safe because graphs replay one at a time under the reranker's lock and
        each output is copied, on the same stream, before the next replay (the
        scores are read once, after the last step: see ``_score_rows``).

        Returns:
            Seconds spent.

        Raises:
            RuntimeError: Capture failed (the caller falls back to eager).
        """
        started = time.perf_counter()
        pool = torch.cuda.graph_pool_handle()
        for batch, size in self._head_shapes():
            head_slot = self.buffers.head_slot(head_size(size, self.max_length)[1])
            head_slot.ids.setdefault((batch, size), self.buffers.full((batch, size)))
            head_slot.graphs[(batch, size)], _ = _captured_graph(
                pool, partial(self._run_head, head_slot, batch, size), self.device
            )
        for cap in self.capacities:
            head_slot = self.buffers.head_slot(cap)
            for shape in self.buckets:
                slot = self.buffers.tail_slot(cap, shape)
                step = partial(self._run_tail, head_slot, slot)
                slot.graph, slot.out = _captured_graph(pool, step, self.device)
        torch.cuda.synchronize(self.device)
        self.graphs = True
        return time.perf_counter() - started

    def release(self) -> None:
        """Drop every buffer and graph (after a failed capture); eager steps rebuild them."""
        self.buffers.clear()
        self.graphs = False

    # -- steps -----------------------------------------------------------------------

    def _step(self, graph: Any, run: Callable[[], Any], slot: TailSlot | None = None) -> Any:
        if graph is None:
            return run()
        graph.replay()
        return slot.out if slot is not None else None

    def _head_shapes(self) -> list[Shape]:
        """Every ``(heads, padded size)`` a head step runs."""
        return [(batch, size) for size in head_sizes(self.max_length)
                for batch in self.head_batches]

    def _run_head(self, slot: HeadSlot, batch: int = 1, size: int | None = None) -> None:
        """The head step of ``batch`` heads padded to ``size``: K/V into slots 0..batch-1."""
        size = size or slot.capacity
        ids = slot.ids.setdefault((batch, size), self.buffers.full((batch, size)))
        self.forward.head(ids, slot.keys, slot.values)

    def _run_tail(self, head: HeadSlot, slot: TailSlot) -> torch.Tensor:
        return self.forward.tail(slot.ids, slot.starts, slot.reads, slot.heads,
                                 head.keys, head.values)


def _rows(searches: Sequence[tuple[list[int], Tails]], owners: list[tuple[int, int]]
          ) -> list[list[int]]:
    """Every search's tails in order (a function given for them is called now); appends
    each row's (search, tail index) to ``owners``."""
    rows: list[list[int]] = []
    for search, (_, tails) in enumerate(searches):
        tails = tails() if callable(tails) else tails
        rows += tails
        owners.extend((search, i) for i in range(len(tails)))
    return rows


def _captured_graph(pool: Any, run: Callable[[], Any], device: torch.device) -> tuple[Any, Any]:
    """Warm ``run`` up twice on a side stream, then capture it into ``pool``: (graph, output)."""
    stream = torch.cuda.Stream(device)
    stream.wait_stream(torch.cuda.current_stream(device))
    with torch.cuda.stream(stream):
        for _ in range(2):
            run()
    torch.cuda.current_stream(device).wait_stream(stream)
    graph = torch.cuda.CUDAGraph()
    # thread_local: a search embedding on the same GPU from another thread while a
    # profile switch captures here must not invalidate the capture (or fail).
    with torch.cuda.graph(graph, pool=pool, capture_error_mode="thread_local"):
        out = run()
    return graph, out


def _layout(
    rows: list[list[list[int]]], batch: int, length: int
) -> tuple[torch.Tensor, torch.Tensor]:
    """CPU ``starts`` ``[batch, length]`` and ``reads`` for rows of back-to-back tails.

    Every position gets the start of its tail (the padding after a row's last tail
    starts a tail of its own, so nothing real sees it); ``reads`` lists each tail's
    last position, flat and row by row, then zeros up to the slot's capacity.
    """
    firsts: list[int] = []  # each stretch of positions sharing a start: the start
    sizes: list[int] = []  # and its length (tails, and each row's padding after them)
    reads: list[int] = []
    for index, row in enumerate(rows):
        at = 0
        for tail in row:
            firsts.append(at)
            sizes.append(len(tail))
            at += len(tail)
            reads.append(index * length + at - 1)
        firsts.append(at)
        sizes.append(length - at)
    firsts.append(0)
    sizes.append(length * (batch - len(rows)))  # the rows no candidate fills
    room = batch * reads_per_row(length)
    if len(reads) > room or len(rows) > batch:
        raise ValueError(f"a [{batch}, {length}] step holds at most {batch} rows and {room} "
                         f"candidates, got {len(rows)} rows and {len(reads)} candidates")
    reads += [0] * (room - len(reads))
    starts = torch.repeat_interleave(torch.tensor(firsts), torch.tensor(sizes))
    return starts.view(batch, length), torch.tensor(reads)


def _padded(rows: Sequence[list[int]], batch: int, length: int, pad_id: int) -> torch.Tensor:
    """A CPU [batch, length] id tensor: rows right-padded, missing rows all padding."""
    padded = [list(seq) + [pad_id] * (length - len(seq)) for seq in rows]
    padded += [[pad_id] * length] * (batch - len(rows))
    return torch.tensor(padded, dtype=torch.long)  # one conversion, not one per row
