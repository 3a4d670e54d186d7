"""Plan agreement: every rank of the world trains the same global plan, checked every iteration.

Every rank builds its own reader and packer and relies on determinism to plan the same global
batch (``data.plan_digest``). A rank reading other data (a stale node-local copy of the corpus,
another preprocessing run) or other settings would train another plan silently: documents trained
twice, others skipped, or a hang inside a collective. ``check_plan_agreement`` compares a 62-bit
key of the plan over the whole world with one all-reduce (MIN of ``[key, -key]``: the smallest and
the largest key at once); only when they differ does it gather the plans and raise, on every rank,
one message naming the ranks of each plan and the first document that differs.

``wrap_train_step`` runs the check before Megatron's ``train_step``, where every rank is in step:
inside the pipeline schedule a world collective could deadlock against the stages' send/receive
pairs. The iterator plans the iteration there (``WlbDataIterator.prepare``), so the micro-batches
the schedule then reads are the ones agreed on.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Sequence
from typing import Any

from megatron_wlb.megatron.rebind import wrapping
from megatron_wlb.packing.types import GlobalBatch

#: keys are the first 62 bits of the plan's sha256: ``-key`` and the "no plan" key fit an int64
KEY_BITS = 62
NO_PLAN_KEY = (1 << KEY_BITS)  # a rank whose stream has ended (larger than every plan's key)

Piece = tuple[int, int, int, int]  # (micro-batch index, document id, offset, length)


def plan_key(batch: GlobalBatch | None) -> int:
    """The plan's agreement key: 62 bits of ``plan_digest`` (``NO_PLAN_KEY`` for no plan)."""
    from megatron_wlb.megatron.data import plan_digest

    if batch is None:
        return NO_PLAN_KEY
    return int(plan_digest(batch)[:16], 16) >> (64 - KEY_BITS)


def plan_pieces(batch: GlobalBatch | None) -> list[Piece]:
    """The plan as a flat list of (micro-batch, document, offset, length), in plan order."""
    if batch is None:
        return []
    return [(m, p.doc_id, p.offset, p.length) for m, mb in enumerate(batch.micro_batches) for p in mb.pieces]


def describe_disagreement(plans: Sequence[tuple[int, int, list[Piece]]]) -> str:
    """One line: which ranks planned what, and the first piece where each other plan leaves the
    first rank's. ``plans``: (iteration or -1 for none, key, pieces) per rank, rank order."""
    groups: dict[int, list[int]] = {}
    for rank, (_, key, _) in enumerate(plans):
        groups.setdefault(key, []).append(rank)
    ordered = sorted(groups.values(), key=lambda ranks: ranks[0])
    reference = ordered[0][0]
    ref_iteration, _, ref_pieces = plans[reference]

    def where(rank: int, at: int) -> str:
        iteration, _, pieces = plans[rank]
        if iteration < 0:
            return f"no plan (its stream ended) on rank {rank}"
        if at >= len(pieces):
            return f"no piece there on rank {rank} (its plan ends)"
        m, doc, offset, length = pieces[at]
        return f"document {doc} (offset {offset}, {length} tokens, micro-batch {m}) on rank {rank}"

    def ranks_text(ranks: list[int]) -> str:
        return f"rank{'s' if len(ranks) > 1 else ''} {_ranges(ranks)}"

    parts = []
    for ranks in ordered[1:]:
        other = ranks[0]
        iteration, _, pieces = plans[other]
        at = next((i for i, (a, b) in enumerate(zip(ref_pieces, pieces)) if a != b),
                  min(len(ref_pieces), len(pieces)))
        if iteration != ref_iteration:
            parts.append(f"{ranks_text(ranks)} planned iteration {iteration}, {ranks_text(ordered[0])} "
                         f"iteration {ref_iteration}")
        else:
            parts.append(f"{ranks_text(ranks)} vs {ranks_text(ordered[0])}, first difference at piece {at}: "
                         f"{where(other, at)} vs {where(reference, at)}")
    iteration_text = f"iteration {ref_iteration}" if ref_iteration >= 0 else "the next iteration"
    return (f"megatron_wlb: the ranks planned {len(ordered)} different global batches for {iteration_text}: "
            f"{'; '.join(parts)}. Every rank must read the same data (the same --data-path files, not copies "
            "that differ), --split, --seed and --wlb-* settings")


def _ranges(ranks: list[int]) -> str:
    """``[0, 1, 2, 5]`` -> ``"0-2,5"``."""
    out: list[str] = []
    start = prev = ranks[0]
    for r in [*ranks[1:], None]:
        if r is not None and r == prev + 1:
            prev = r
            continue
        out.append(str(start) if start == prev else f"{start}-{prev}")
        if r is not None:
            start = prev = r
    return ",".join(out)


def check_plan_agreement(batch: GlobalBatch | None, group: Any = None, device: Any = None) -> float:
    """Raise RuntimeError on every rank of ``group`` (default: the world) unless all planned ``batch``
    alike; returns the seconds the check took. One all-reduce of two int64 on the agreeing path."""
    import torch
    import torch.distributed as dist

    start = time.perf_counter()
    if device is None:
        from megatron_wlb.megatron.cp_hooks import training_device

        device = training_device()
    key = plan_key(batch)
    both = torch.tensor([key, -key], dtype=torch.int64, device=device)
    dist.all_reduce(both, op=dist.ReduceOp.MIN, group=group)
    lowest, highest = both.tolist()
    if lowest != key or -highest != key:
        mine = (batch.iteration if batch is not None else -1, key, plan_pieces(batch))
        every: list[Any] = [None] * dist.get_world_size(group)
        dist.all_gather_object(every, mine, group=group)
        raise RuntimeError(describe_disagreement(every))
    return time.perf_counter() - start


def wrap_train_step(original: Callable, first_iterator: Callable[[], Any],
                    on_checked: Callable[[float], None] = lambda seconds: None) -> Callable:
    """Megatron's ``train_step``, after planning this iteration (``first_iterator()``: the first
    training ``WlbDataIterator`` of this rank, or None) and checking the plan over the world."""

    @wrapping(original)
    def train_step(*args, **kwargs):
        iterator = first_iterator()
        if iterator is not None:
            on_checked(check_plan_agreement(iterator.prepare()))
        return original(*args, **kwargs)

    return train_step


__all__ = ["check_plan_agreement", "describe_disagreement", "plan_key", "plan_pieces", "wrap_train_step"]
