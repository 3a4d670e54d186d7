"""Placement (step 4) and dealing (step 5): pieces into micro-batches, micro-batches to DP ranks.

Pieces go, largest first, each into the micro-batch of least work with room (``plan.place_pieces``);
forced pieces first, in a pass of their own, and one that fits nowhere whole is cut into the emptiest
micro-batches before any newer piece can take that room (``split_forced``, extension (b)). The
micro-batches are then dealt to DP ranks and ordered for the pipeline schedule (``deal_micro_batches``,
extension (d)). ``place_whole_batch`` is this placement and dealing alone, for one whole global batch
(Megatron-LM main's own sequence-packing scheduler API, ``megatron/hooks/main_schedule.py``).
"""

from __future__ import annotations

from collections.abc import Sequence
from functools import partial

import numpy as np

from megatron_wlb.costmodel import CostModel
from megatron_wlb.data.lengths import validate_lengths
from megatron_wlb.packing.metrics import microbatch_seconds, piece_forward, piece_latency, piece_pairs, size_price
from megatron_wlb.packing.pipeline import deal_and_order, schedule_timer
from megatron_wlb.packing.types import DocPiece, piece_lengths, sort_largest_first
from megatron_wlb.packing.wlb.balance import CLOSE_TOLERANCE
from megatron_wlb.packing.wlb.plan import IterationPlan, place_pieces


def place_iteration(plan: IterationPlan) -> None:
    """Forced pieces first, largest first, in a pass of their own (one that fits nowhere whole is
    ``split_forced``), so the delay bound holds whenever one iteration's intake fits in
    ``dp * n * max_seq_len``; then the candidates, largest first; what fits nowhere waits."""
    plan.forced = sort_largest_first(plan.forced)
    plan.candidates = sort_largest_first(plan.candidates)
    for p in plan.place(plan.forced):
        split_forced(plan, p)
    plan.waiting.extend(plan.place(plan.candidates))


def split_forced(plan: IterationPlan, p: DocPiece) -> None:
    """Last resort for a piece at its delay bound that fits nowhere whole: fill the emptiest micro-batches.
    With ``pieces="concat-and-cut"`` nothing is cut: the piece waits one more iteration (first in line,
    since it stays forced), counted in ``delay_overruns``."""
    if plan.config.pieces == "concat-and-cut":
        plan.waiting.append(p)
        plan.counts.delay_overruns += 1
        return
    bins, work, toks, cap = plan.bins, plan.work, plan.toks, plan.cap
    off, left = p.offset, p.length
    for j in sorted(range(len(bins)), key=lambda j: (toks[j], j)):
        room = cap - toks[j]
        if room <= 0 or left == 0:
            break
        take = min(room, left)
        bins[j].append(DocPiece(p.doc_id, off, take, p.arrival))
        toks[j] += take
        plan.pairs[j] += take * (take + 1) / 2.0
        work[j] += float(plan.latency([take])[0])
        off += take
        left -= take
    plan.counts.forced_splits += 1
    if left:
        plan.waiting.append(DocPiece(p.doc_id, off, left, p.arrival))


def replace_all(plan: IterationPlan, extra: list[DocPiece] | None = None, balanced: bool = False) -> bool:
    """Place the iteration's pieces (and ``extra``) again from empty micro-batches: forced first (the
    delay bound's pass), then the rest, each largest first. Adopted, returning True, only if every piece
    fits, so nothing that was placed waits (a forced piece split to fit stays split), and, with
    ``balanced``, only if the heaviest micro-batch is no heavier than before or within
    ``CLOSE_TOLERANCE`` of the new mean (an extra piece must not unbalance the iteration)."""
    first = set(plan.forced)
    pieces = [p for b in plan.bins for p in b] + list(extra or ())
    m = len(plan.bins)
    new_bins: list[list[DocPiece]] = [[] for _ in range(m)]
    new_work, new_toks, new_pairs = [0.0] * m, [0] * m, [0.0] * m
    left = place_pieces(sort_largest_first([p for p in pieces if p in first]), new_bins, new_work, new_toks,
                        plan.cap, plan.latency, plan.size, new_pairs)
    if not left:
        left = place_pieces(sort_largest_first([p for p in pieces if p not in first]), new_bins, new_work,
                            new_toks, plan.cap, plan.latency, plan.size, new_pairs)
    if left:
        return False
    new_price = [w + float(plan.size(t, q)) for w, t, q in zip(new_work, new_toks, new_pairs)]
    old_price = [plan.price(j) for j in range(m)]
    if balanced and max(new_price) > max(max(old_price), sum(new_price) / m * (1 + CLOSE_TOLERANCE)):
        return False
    plan.bins[:], plan.work[:], plan.toks[:], plan.pairs[:] = new_bins, new_work, new_toks, new_pairs
    return True


def deal_micro_batches(bins: list[list[DocPiece]], work: list[float], cost: CostModel | None, dp: int, n: int,
                       stages: int, virtual_stages: int = 1) -> list[list[DocPiece]]:
    """``dp * n`` placed micro-batches (``work``: each one's summed ``piece_latency``) dealt to DP ranks and
    ordered within each for the pipeline schedule (``pipeline.deal_and_order``, each priced by
    ``metrics.microbatch_seconds``): rank r runs positions ``[r * n, (r + 1) * n)`` of the result."""
    m = len(bins)
    forward = tokens = pairs = None
    if cost is not None:
        counts = [len(b) for b in bins]
        lengths = piece_lengths([p for b in bins for p in b])
        where = np.repeat(np.arange(m), counts)
        forward = np.bincount(where, weights=piece_forward(cost, lengths), minlength=m)
        tokens = np.bincount(where, weights=lengths.astype(np.float64), minlength=m)
        pairs = np.bincount(where, weights=piece_pairs(lengths), minlength=m)
    fwd_arr, bwd_arr = microbatch_seconds(cost, np.asarray(work, dtype=np.float64), forward, tokens, pairs)
    perm = deal_and_order(fwd_arr.tolist(), bwd_arr.tolist(), dp, n, stages, virtual_stages)
    return [bins[i] for i in perm]


def place_whole_batch(lengths: Sequence[int] | np.ndarray, dp: int, window: int, cost: CostModel | None,
                      stages: int = 1, virtual_stages: int = 1, multiple: int = 1,
                      max_factor: float = 2.0, max_items: int | None = None) -> list[list[list[int]]]:
    """wlb's placement of one whole global batch, for a scheduler that must place every item of it now
    (Megatron-LM main's ``data_schedule``: no outlier delay, documents whole).

    For a number ``n`` of micro-batches per DP rank, the items (lengths, by index) go largest first into the
    micro-batch of least work with room under ``window`` (``place_pieces``), over ``dp * n`` variable-length
    micro-batches, which are then dealt to DP ranks and ordered for the pipeline schedule
    (``deal_micro_batches``). ``n`` is free here: from the smallest multiple of ``multiple`` at which every
    item fits up to ``max_factor`` times that, the plan whose slowest DP rank has the shortest (interleaved)
    1F1B time under the cost model wins (fewer micro-batches on a tie): more micro-batches shrink the pipeline
    bubble and give the placement room, each costs the cost model's per-micro-batch overhead. An item longer
    than ``window`` cannot be cut here: it gets a micro-batch of its own. ``max_items`` caps the items of a
    micro-batch (Megatron-LM dev's ``max_num_seqs``): a placement that exceeds it counts as not fitting.

    Returns ``plan[r][k]``: the item indices of DP rank r's k-th micro-batch (ascending), every index exactly
    once, no micro-batch empty.
    """
    d = validate_lengths(lengths, "sample lengths")
    for name, value in (("dp", dp), ("window", window), ("stages", stages), ("virtual_stages", virtual_stages),
                        ("multiple", multiple)):
        if isinstance(value, bool) or not isinstance(value, (int, np.integer)) or value < 1:
            raise ValueError(f"{name}={value!r}: must be an integer >= 1")
    if not max_factor >= 1:
        raise ValueError(f"max_factor={max_factor!r}: must be >= 1")
    if max_items is not None and (isinstance(max_items, bool) or not isinstance(max_items, (int, np.integer))
                                  or max_items < 1):
        raise ValueError(f"max_items={max_items!r}: must be an integer >= 1 or None")
    if d.size == 0:
        raise ValueError("the global batch holds no samples: nothing to place")
    pieces = sort_largest_first([DocPiece(i, 0, int(x), 0) for i, x in enumerate(d.tolist())])
    alone = [p for p in pieces if p.length > window]
    fitting = [p for p in pieces if p.length <= window]
    item_latency = piece_latency(cost, d)
    item_forward = None if cost is None else piece_forward(cost, d)
    weights = [float(item_latency[p.doc_id]) for p in alone]

    size = size_price(cost)

    def place(n: int) -> tuple[list[list[DocPiece]], list[float]] | None:
        m = dp * n
        bins: list[list[DocPiece]] = [[] for _ in range(m)]
        work = [0.0] * m
        toks = [0] * m
        pairs = [0.0] * m
        for j, (p, w) in enumerate(zip(alone, weights)):
            bins[j].append(p)
            work[j] = w
            toks[j] = window
            pairs[j] = p.length * (p.length + 1) / 2.0
        if place_pieces(fitting, bins, work, toks, window, partial(piece_latency, cost), size, pairs):
            return None
        return None if max_items is not None and max(map(len, bins)) > max_items else (bins, work)

    n = max(1, -(-len(alone) // dp), -(-int(d[d <= window].sum()) // (dp * window)))
    n = -(-n // multiple) * multiple
    while True:
        if dp * n > d.size:
            cap = f" of at most {max_items} samples each" if max_items is not None else ""
            raise ValueError(f"{d.size} samples cannot fill dp * n = {dp} x {n} micro-batches{cap} (every "
                             f"micro-batch needs a sample; n is a multiple of {multiple}): give the global batch at "
                             f"least {dp * n} samples")
        placed = place(n)
        if placed is not None:
            break
        n += multiple
    best: tuple[float, list[list[DocPiece]], int] | None = None
    last = min(int(n * max_factor), d.size // dp)
    while n <= last:
        if placed is not None:
            bins, work = placed
            dealt = deal_micro_batches(bins, work, cost, dp, n, stages, virtual_stages) if dp * n > 1 else bins
            time = _slowest_rank_time(dealt, item_latency, item_forward, cost, dp, n, stages, virtual_stages)
            if best is None or time < best[0] * (1 - 1e-9):
                best = (time, dealt, n)
        n += multiple
        placed = place(n) if n <= last else None
    assert best is not None
    _, dealt, n = best
    return [[sorted(p.doc_id for p in b) for b in dealt[r * n:(r + 1) * n]] for r in range(dp)]


def _slowest_rank_time(bins: list[list[DocPiece]], latency: np.ndarray, forward: np.ndarray | None,
                       cost: CostModel | None, dp: int, n: int, stages: int, virtual_stages: int) -> float:
    """The slowest DP rank's (interleaved) 1F1B time of dealt micro-batches (rank r: ``bins[r*n:(r+1)*n]``);
    ``latency`` / ``forward``: every item's ``piece_latency`` / ``piece_forward``, by ``doc_id``."""
    counts = [len(b) for b in bins]
    where = np.repeat(np.arange(len(bins)), counts)
    ids = np.fromiter((p.doc_id for b in bins for p in b), dtype=np.int64, count=int(sum(counts)))
    work = np.bincount(where, weights=latency[ids], minlength=len(bins))
    fwd_work = None if forward is None else np.bincount(where, weights=forward[ids], minlength=len(bins))
    lengths = np.fromiter((p.length for b in bins for p in b), dtype=np.float64, count=ids.size)
    tokens = np.bincount(where, weights=lengths, minlength=len(bins))
    pairs = np.bincount(where, weights=piece_pairs(lengths), minlength=len(bins))
    fwd, bwd = microbatch_seconds(cost, work, fwd_work, tokens, pairs)
    timer = schedule_timer(stages, n, virtual_stages)
    return max(timer.makespan(fwd[r * n:(r + 1) * n].tolist(), bwd[r * n:(r + 1) * n].tolist()) for r in range(dp))
