"""``fixed-greedy``: fixed-capacity micro-batches balanced greedily over a window of global batches.

The paper's "Fixed-Len Greedy" (Table 2): the documents of ``window`` global batches are read
ahead, then assigned largest workload first to the micro-batch of least workload that still has
room under ``seq_len`` (LPT with a capacity). Documents stay whole (unless the oversize policy split
them), so a window cannot always place every token it read: with the token budget equal to the
capacity there is no slack. What does not fit is carried to the next window and placed *first*
there (it then goes to the emptiest micro-batches), so the smallest documents cannot starve behind
ever-new large ones; and the next window reads that many fewer new tokens, so the backlog stays at
about one window's fragmentation instead of growing (see ``FixedWindowPacker._intake``).

``place_greedy`` is the shared placement loop (also used by ``wlb`` and as the solver's warm start).
"""

from __future__ import annotations

import heapq
from collections.abc import Sequence
from typing import Any

import numpy as np

from megatron_wlb.costmodel import CostModel
from megatron_wlb.packing.base import Packer, StreamSource, pieces_from_state, pieces_to_state, register_packer
from megatron_wlb.packing.metrics import SizePrice, piece_latency, piece_pairs, size_price
from megatron_wlb.packing.types import DocPiece, MicroBatch, PackingConfig, oldest_first_key, sort_largest_first

#: with a size price, the most bins ``place_greedy`` prices exactly per item (the least-priced ones with room): the
#: plan time stays within a few times the additive placement's at the 8K-GPU layout (64 bins, ~2,000 items)
MAX_VISITS = 4


def place_greedy(lengths: Sequence[int], weights: Sequence[float], work: list[float], toks: list[int],
                 cap: int, size: SizePrice | None = None, pairs: list[float] | None = None,
                 max_visits: int | None = MAX_VISITS) -> list[int]:
    """Place items in the given order, each into the bin whose price after it is least, among those with room.

    A bin's price is its ``work`` (the sum of its items' ``weights``) plus, with a ``size`` price (the cost
    model's micro-batch as a whole: ``metrics.SizePrice``), ``size(toks, pairs)``: the item then goes where its
    marginal cost leaves the lowest price, not merely to the bin of least work. ``work``, ``toks`` (and
    ``pairs``, which a non-zero ``size`` needs) are updated in place. Returns the bin of every item, or -1
    for an item that fits nowhere. Bins too full for the current item are parked in a max-heap of free room
    and come back once the items get small enough, so a whole pass costs O((items + bins) log bins): no
    per-token work and no scan of full bins. With ``size``, the bins are visited least-priced first until no
    unvisited bin can beat the best found (a bin's price + weight + the marginal cost at the fewest tokens and
    pairs any bin holds bounds what it can give), or ``max_visits`` bins were priced (None: exact).
    """
    if not size:
        return _place_additive(lengths, weights, work, toks, cap)
    if pairs is None:
        raise ValueError("place_greedy with a size price needs the bins' pairs")
    sq, tp = size.tokens_sq, size.tokens_pairs
    heap = [(w + float(size(toks[j], pairs[j])), j) for j, w in enumerate(work)]
    heapq.heapify(heap)
    parked: list[tuple[int, int]] = []  # (-room, bin)
    out = [-1] * len(lengths)
    push, pop = heapq.heappush, heapq.heappop
    visits = len(work) if max_visits is None else max_visits
    t0, p0 = min(toks, default=0), min(pairs, default=0.0)
    inf = float("inf")
    replace = heapq.heapreplace
    for i, d in enumerate(lengths):
        while parked and -parked[0][0] >= d:
            _, j = pop(parked)
            push(heap, (work[j] + float(size(toks[j], pairs[j])), j))
        p = d * (d + 1) / 2.0
        w = weights[i]
        if not i & 31:  # the fewest tokens and pairs of any bin only grow: a stale minimum still bounds below
            t0, p0 = min(toks, default=0), min(pairs, default=0.0)
        if heap:  # the usual case: the least-priced bin has room and no other can beat it
            price, j = heap[0]
            t = toks[j]
            if t + d <= cap:
                q = pairs[j]
                after = price + w + sq * d * (2.0 * t + d) + tp * (t * p + d * q + d * p)
                n = len(heap)
                runner_up = heap[1][0] if n > 1 else inf
                if n > 2 and heap[2][0] < runner_up:
                    runner_up = heap[2][0]
                if runner_up + w + sq * d * (2.0 * t0 + d) + tp * (t0 * p + d * p0 + d * p) >= after:
                    work[j] += w
                    toks[j] = t + d
                    pairs[j] = q + p
                    replace(heap, (after, j))
                    out[i] = j
                    continue
        floor = w + sq * d * (2.0 * t0 + d) + tp * (t0 * p + d * p0 + d * p)
        best, best_price = -1, 0.0
        seen: list[tuple[float, int]] = []
        while heap and len(seen) < visits and (best < 0 or heap[0][0] + floor < best_price):
            price, j = pop(heap)
            if toks[j] + d > cap:
                push(parked, (toks[j] - cap, j))
                continue
            seen.append((price, j))
            t, q = toks[j], pairs[j]
            after = price + w + sq * d * (2.0 * t + d) + tp * (t * p + d * q + d * p)
            if best < 0 or after < best_price:
                best, best_price = j, after
        for price, j in seen:
            if j == best:
                work[j] += w
                toks[j] += d
                pairs[j] += p
                push(heap, (best_price, j))
            else:
                push(heap, (price, j))
        out[i] = best
    return out


def _place_additive(lengths: Sequence[int], weights: Sequence[float], work: list[float], toks: list[int],
                    cap: int) -> list[int]:
    """``place_greedy`` of an additive price: each item into the bin of least ``work`` with room."""
    heap = [(w, j) for j, w in enumerate(work)]
    heapq.heapify(heap)
    parked: list[tuple[int, int]] = []  # (-room, bin)
    out = [-1] * len(lengths)
    push, pop, replace = heapq.heappush, heapq.heappop, heapq.heapreplace
    for i, d in enumerate(lengths):
        while parked and -parked[0][0] >= d:
            _, j = pop(parked)
            push(heap, (work[j], j))
        while heap:
            w, j = heap[0]
            if toks[j] + d <= cap:
                w += weights[i]
                work[j] = w
                toks[j] += d
                replace(heap, (w, j))
                out[i] = j
                break
            pop(heap)
            push(parked, (toks[j] - cap, j))
    return out


def placement_order(carried: Sequence[DocPiece], new: Sequence[DocPiece]) -> list[DocPiece]:
    """The fixed packers' placement order: carried pieces oldest first, then new ones largest first."""
    return sorted(carried, key=oldest_first_key) + sort_largest_first(new)


class FixedWindowPacker(Packer):
    """Shared engine of the fixed-length packers: read ``window`` budgets, plan that many
    iterations of ``dp * n`` micro-batches of capacity ``seq_len``, emit them one by one."""

    def __init__(self, config: PackingConfig, cost: CostModel | None = None):
        super().__init__(config, cost)
        self._planned: list[list[list[DocPiece]]] = []  # iterations left in the window -> bins -> pieces
        self._carried: list[DocPiece] = []

    def pending(self) -> int:
        return sum(p.length for it in self._planned for b in it for p in b) + sum(p.length for p in self._carried)

    def held(self) -> tuple[DocPiece, ...]:
        return (*(p for it in self._planned for b in it for p in b), *self._carried)

    def _budgets_to_read(self) -> int:
        return 0 if self._planned else self.config.window

    def _intake(self, source: StreamSource, arrival: int | None = None) -> list[DocPiece]:
        """Count the carried backlog against the window's first budget.

        Whole documents cannot fill fixed bins exactly, so a fixed packer emits a little less than
        ``dp * n * seq_len`` tokens per iteration. Reading the full budget anyway would let the
        backlog (and every carried document's delay) grow without bound; instead the window reads
        that much less, and the packer consumes the stream slightly slower than concat-and-cut
        (the "stream rate" metric shows by how much).
        """
        if arrival == self.iteration:
            self._credit += sum(p.length for p in self._carried)
        if self._credit >= self.config.tokens_per_iteration:
            self._credit -= self.config.tokens_per_iteration
            return []
        return super()._intake(source, arrival)

    def _assign(self, carried: list[DocPiece], new: list[DocPiece], bins: int) -> tuple[list[list[DocPiece]],
                                                                                       list[DocPiece]]:
        """Greedy plan: carried pieces first (oldest first), then new ones by workload, descending."""
        pieces = placement_order(carried, new)
        lengths = [p.length for p in pieces]
        weights = self.latency(lengths).tolist() if pieces else []
        where = place_greedy(lengths, weights, [0.0] * bins, [0] * bins, self.config.seq_len, self.size, [0.0] * bins)
        out: list[list[DocPiece]] = [[] for _ in range(bins)]
        left: list[DocPiece] = []
        for p, j in zip(pieces, where):
            (out[j] if j >= 0 else left).append(p)
        return out, left

    def _plan(self, new: list[DocPiece], final: bool) -> list[MicroBatch]:
        m = self.config.micro_batches_per_iteration
        if not self._planned:
            self._start_window(new, self.config.window)
        bins = self._planned.pop(0)
        if final and not any(bins) and self._carried:
            # The stream ended inside a window: the rest of it is empty, so start over at once.
            self._planned = []
            self._start_window([], 1)
            bins = self._planned.pop(0)
        cap = self.config.seq_len
        return [MicroBatch(tuple(b), cap) for b in bins[:m]]

    def _start_window(self, new: list[DocPiece], window: int) -> None:
        m = self.config.micro_batches_per_iteration
        bins, left = self._assign(self._carried, new, window * m)
        self._carried = left
        if window > 1:
            # Bins are interchangeable; an iteration lasts as long as its slowest micro-batch, so
            # the window's bins go to iterations in order of workload (similar bins run together).
            loads = bin_loads(bins, self.cost)
            bins = [bins[j] for j in sorted(range(len(bins)), key=lambda j: (-loads[j], j))]
        self._planned = [bins[k * m:(k + 1) * m] for k in range(window)]

    def _extra_state(self) -> dict[str, Any]:
        return {"planned": [[pieces_to_state(b) for b in it] for it in self._planned],
                "carried": pieces_to_state(self._carried)}

    def _load_extra_state(self, state: dict[str, Any]) -> None:
        self._planned = [[pieces_from_state(b) for b in it] for it in state["planned"]]
        self._carried = pieces_from_state(state["carried"])


@register_packer
class FixedGreedyPacker(FixedWindowPacker):
    name = "fixed-greedy"


def bin_loads(bins: Sequence[Sequence[DocPiece]], cost: CostModel | None) -> np.ndarray:
    """Latency of each bin: its pieces' latencies and, with a size price, the bin as a whole."""
    lengths = [np.array([p.length for p in b], dtype=np.int64) for b in bins]
    size = size_price(cost)
    return np.array([float(piece_latency(cost, d).sum() + size(d.sum(), piece_pairs(d).sum())) if d.size else 0.0
                     for d in lengths])
