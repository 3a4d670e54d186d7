"""Dynamic CP at run time, process groups: one per aligned power-of-two block of a DP x CP pool, made once.

``torch.distributed.new_group`` is collective over the whole world, so every rank creates the groups of every
pool (one pool per stage and TP rank) in one order (pools sorted; per pool its single slots, then
``cp.dynamic_steps.aligned_blocks``) and keeps its own pool's: ``{(first slot, size): group}``. A single slot
gets a group of its own too, so that a CP 1 micro-batch never reaches a collective of the default group.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import torch.distributed as dist

from megatron_wlb.cp.dynamic_steps import aligned_blocks

__all__ = ["block_groups", "group_of"]


def block_groups(pools: Sequence[Sequence[int]], rank: int | None = None,
                 largest: int | None = None) -> dict[tuple[int, int], Any]:
    """Create the process group of every aligned block (size 1 .. ``largest``) of every pool in ``pools``
    (global ranks per slot; the same list on every rank) and return this rank's pool's: ``(first slot,
    size) -> group``. Every rank of the world must call it with the same ``pools``."""
    me = dist.get_rank() if rank is None else rank
    ordered = sorted(tuple(int(r) for r in pool) for pool in pools)
    sizes = {len(pool) for pool in ordered}
    if len(sizes) > 1:
        raise ValueError(f"pools of different sizes {sorted(sizes)}: every stage's DP x CP pool has one size")
    flat = [r for pool in ordered for r in pool]
    if len(flat) != len(set(flat)):
        raise ValueError(f"a rank is in two pools: {ordered}")
    mine: dict[tuple[int, int], Any] = {}
    for pool in ordered:
        for first, size in [(slot, 1) for slot in range(len(pool))] + aligned_blocks(len(pool), largest):
            members = list(pool[first:first + size])
            group = dist.new_group(ranks=members)
            if me in members:
                mine[(first, size)] = group
    return mine


def group_of(groups: dict[tuple[int, int], Any], first: int, size: int) -> Any:
    """The process group of block ``(first, size)``."""
    if (first, size) not in groups:
        raise KeyError(f"no process group for the block of {size} slots from slot {first}; made: {sorted(groups)}")
    return groups[(first, size)]
