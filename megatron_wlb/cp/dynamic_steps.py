"""Dynamic CP at run time, host side: what each pool slot runs at each step of a ``DynamicCPPlan``.

A plan (``cp.dynamic.plan_dynamic_cp``) gives every slot of a stage's DP x CP pool its micro-batches in run
order, a group's micro-batch at the same index on each member (aligned power-of-two blocks, larger groups
first), so at every step each slot is either one member of a group's micro-batch (sharded per document over
the group, ``per-document`` layout at CP = the group's size) or, once its own are done, runs an empty one (one
padding segment, loss mask zero) so that every slot runs ``plan.steps`` micro-batches. Each member holds its
own shard of the group's tokens, so the per-token loss and token counts summed over the pool count every
token once, as with a fixed CP group.

``aligned_blocks`` is the order in which every rank creates the blocks' process groups at start-up
(``cp.dynamic_groups``). Pure numpy: no torch, no global state.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Sequence
from dataclasses import dataclass

import numpy as np

from megatron_wlb.costmodel import CostModel
from megatron_wlb.cp.dynamic import (
    DYNAMIC_LAYOUT,
    DynamicCPPlan,
    GroupMicroBatch,
    group_cost_models,
    plan_dynamic_cp,
)
from megatron_wlb.cp.plan import CPSharding, Packed, RankMicroBatch, micro_batch_lengths, rank_batch

__all__ = ["DYNAMIC_LAYOUT", "DynamicPool", "aligned_blocks", "packer_placement", "slot_step", "slot_step_seconds",
           "slot_steps", "step_batch"]


def aligned_blocks(ranks: int, largest: int | None = None) -> list[tuple[int, int]]:
    """``(first slot, size)`` of every aligned power-of-two block of size 2 .. ``largest`` (default: the
    largest that fits) in a pool of ``ranks`` slots, sizes ascending, then by first slot: the one order in
    which every rank creates their process groups (size-1 groups need none)."""
    if ranks < 1:
        raise ValueError(f"ranks={ranks}: a pool needs at least one slot")
    top = ranks if largest is None else largest
    out: list[tuple[int, int]] = []
    size = 2
    while size <= min(top, ranks):
        out += [(first, size) for first in range(0, ranks - size + 1, size)]
        size *= 2
    return out


def slot_step(plan: DynamicCPPlan, slot: int, step: int) -> GroupMicroBatch | None:
    """Slot ``slot``'s micro-batch at step ``step`` of ``plan`` (None: its own are done; it runs an empty one)."""
    if not 0 <= slot < plan.ranks:
        raise ValueError(f"slot {slot} is outside the pool of {plan.ranks} slots")
    if not 0 <= step < plan.steps:
        raise ValueError(f"step {step} is outside the plan's {plan.steps} steps")
    mbs = plan.rank_micro_batches[slot]
    return mbs[step] if step < len(mbs) else None


def step_batch(group_batch: GroupMicroBatch | None, slot: int, lengths: np.ndarray,
               packed_of: Callable[[tuple[int, ...], np.ndarray], Packed], *, empty_tokens: int = 1,
               rank_multiple: int = 1) -> RankMicroBatch:
    """Slot ``slot``'s host record of ``group_batch``: the group's documents (``lengths`` indexed by the
    plan's document numbers; ``packed_of(docs, segments)`` their tokens, labels and loss mask concatenated over
    ``segments``, the documents then a padding segment) laid out per document over the group, this slot's shard,
    every slot's rows a multiple of ``rank_multiple`` (TP under sequence parallelism). None: an empty
    micro-batch (padding tokens, loss mask zero), which the slot runs alone. ``block`` names the (first slot,
    size) whose process group runs it."""
    if group_batch is None:  # on the slot's own group (never the run's fixed CP group)
        alone = CPSharding(DYNAMIC_LAYOUT, rank_multiple=rank_multiple)
        empty = rank_batch(micro_batch_lengths([], empty_tokens=empty_tokens), alone)
        return dataclasses.replace(empty, block=(slot, 1))
    if slot not in group_batch.ranks:
        raise ValueError(f"slot {slot} is not a member of the group on slots {group_batch.first_rank} .. "
                         f"{group_batch.first_rank + group_batch.size - 1}")
    doc_lengths = np.asarray(lengths, dtype=np.int64)[list(group_batch.docs)]
    sharding = CPSharding(DYNAMIC_LAYOUT, cp_size=group_batch.size, cp_rank=slot - group_batch.first_rank,
                          rank_multiple=rank_multiple)  # per rank: its rows padded (``local_pad``), no padding segment
    segments = micro_batch_lengths(doc_lengths)
    batch = rank_batch(segments, sharding, packed=packed_of(group_batch.docs, segments))
    return dataclasses.replace(batch, block=(group_batch.first_rank, group_batch.size))


@dataclass(frozen=True)
class DynamicPool:
    """One rank's view of its stage's DP x CP pool: ``slots`` ranks, this rank ``slot``; ``max_tokens_per_rank``
    the memory cap of a slot's share of a micro-batch; ``cost`` the run's cost model (priced per group size);
    ``rank_multiple``: each slot's rows are padded to a multiple of it (TP under sequence parallelism)."""

    slots: int
    slot: int
    max_tokens_per_rank: int
    cost: CostModel
    rank_multiple: int = 1

    def __post_init__(self) -> None:
        if not 0 <= self.slot < self.slots:
            raise ValueError(f"slot {self.slot} is outside the pool of {self.slots} slots")

    def plan(self, micro_batch_lengths: Sequence[Sequence[int] | np.ndarray], n: int, cost: CostModel | None = None
             ) -> DynamicCPPlan:
        """The dynamic-CP plan of one packed global batch (the same on every rank): ``micro_batch_lengths`` its
        micro-batches' piece lengths as packed (DP rank r's micro-batch k at ``r n + k``), ``n`` Megatron's
        micro-batches per iteration (no slot gets more); priced by ``cost`` (the packer's, which an online refit
        replaces and a resumed packer restores) or else the pool's. The planner's pieces are the micro-batches'
        in order."""
        lengths, placement = packer_placement(micro_batch_lengths, n)
        return plan_dynamic_cp(lengths, self.slots, self.max_tokens_per_rank,
                               group_cost_models(self.cost if cost is None else cost, self.slots),
                               max_micro_batches=n, fixed_plan=placement)


def packer_placement(micro_batch_lengths: Sequence[Sequence[int] | np.ndarray], n: int
                     ) -> tuple[np.ndarray, list[list[list[int]]]]:
    """A packed global batch as the planner takes it: every piece's length in order, and the packer's own
    placement (``plan_dynamic_cp``'s ``fixed_plan``: DP rank r's micro-batch k, micro-batch ``r n + k``, as the
    indices of its pieces), a plan within Megatron's count to fall back on."""
    counts = [len(mb) for mb in micro_batch_lengths]
    if n < 1 or len(counts) % n:
        raise ValueError(f"{len(counts)} micro-batches are not DP ranks x n = {n} micro-batches each")
    starts = np.concatenate([[0], np.cumsum(counts, dtype=np.int64)])
    placement = [[list(range(int(starts[r * n + k]), int(starts[r * n + k + 1]))) for k in range(n)]
                 for r in range(len(counts) // n)]
    return np.asarray([x for mb in micro_batch_lengths for x in mb], dtype=np.int64), placement


def slot_steps(plan: DynamicCPPlan, slot: int, steps: int) -> tuple[GroupMicroBatch | None, ...]:
    """Slot ``slot``'s micro-batch at each of ``steps`` steps (Megatron's micro-batches per iteration): its
    own in plan order, then None (empty ones). Raises ValueError, naming both counts, when the plan needs more."""
    if plan.steps > steps:
        raise ValueError(f"the dynamic-CP plan of this global batch needs {plan.steps} micro-batches on its busiest "
                         f"rank, but Megatron runs {steps} per iteration; raise --global-batch-size or lower "
                         "--micro-batch-size (more micro-batches per iteration)")
    mbs = plan.rank_micro_batches[slot]
    return tuple(mbs) + (None,) * (steps - len(mbs))


def slot_step_seconds(plan: DynamicCPPlan, steps: int | None = None) -> np.ndarray:
    """The plan's predicted seconds per layer (forward + backward, this slot's share of its group's micro-batch)
    of every slot at every step, shape ``(plan.ranks, steps)`` (default ``plan.steps``): 0 where a slot runs an
    empty micro-batch (its price ``plan.empty_seconds`` within Megatron's count). Row sums are ``plan.slot_seconds``
    where ``steps`` is the count."""
    width = plan.steps if steps is None else max(int(steps), plan.steps)
    table = np.zeros((plan.ranks, width), dtype=np.float64)
    for slot, mbs in enumerate(plan.rank_micro_batches):
        table[slot, :len(mbs)] = [mb.seconds for mb in mbs]
        table[slot, len(mbs):max(len(mbs), min(width, plan.count))] = plan.empty_seconds
    return table
