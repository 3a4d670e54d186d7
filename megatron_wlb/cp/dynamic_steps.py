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

from collections.abc import Callable

import numpy as np

from megatron_wlb.cp.dynamic import DynamicCPPlan, GroupMicroBatch
from megatron_wlb.cp.plan import CPSharding, Packed, RankMicroBatch, micro_batch_lengths, rank_batch

__all__ = ["DYNAMIC_LAYOUT", "aligned_blocks", "slot_step", "step_batch"]

#: how a group's micro-batch is cut over its ranks (head-tail per document: balanced causal attention)
DYNAMIC_LAYOUT = "per-document"


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
               packed_of: Callable[[tuple[int, ...]], Packed], *, empty_tokens: int = 1) -> RankMicroBatch:
    """Slot ``slot``'s host record of ``group_batch``: the group's documents (``lengths`` indexed by the
    plan's document numbers; ``packed_of(docs)`` their tokens, labels and loss mask concatenated) laid out
    per document over the group, this slot's shard. None: an empty micro-batch (``empty_tokens`` padding
    tokens, loss mask zero), which every slot runs at CP 1."""
    if group_batch is None:
        return rank_batch(micro_batch_lengths([], empty_tokens=empty_tokens), CPSharding(DYNAMIC_LAYOUT))
    if slot not in group_batch.ranks:
        raise ValueError(f"slot {slot} is not a member of the group on slots {group_batch.first_rank} .. "
                         f"{group_batch.first_rank + group_batch.size - 1}")
    doc_lengths = np.asarray(lengths, dtype=np.int64)[list(group_batch.docs)]
    sharding = CPSharding(DYNAMIC_LAYOUT, cp_size=group_batch.size, cp_rank=slot - group_batch.first_rank)
    return rank_batch(micro_batch_lengths(doc_lengths), sharding, packed=packed_of(group_batch.docs))
