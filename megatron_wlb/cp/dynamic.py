"""Dynamic CP: a CP degree and a set of ranks per micro-batch, planned together with the packing.

A pipeline stage's DP x CP ranks are one pool of ``P`` rank slots. Every document of a global batch gets a
power-of-two *group size* ``g`` and runs, sharded per document (head-tail, ``cp.layouts`` ``per-document``),
on an aligned block of ``g`` slots (ranks ``[k g, (k + 1) g)``); documents of one block and size are packed
into micro-batches of at most ``g x max_tokens_per_rank`` tokens (the memory cap, Megatron's
``max_seqlen_per_dp_cp_rank``). A document on ``g`` ranks costs each of them the cost model's forward +
backward latency at CP ``g`` (attention and GEMMs over ``g``, plus the K/V all-gather over ``g`` ranks:
``CostModel.cp_comm`` at that CP size) and every micro-batch its fixed per-call cost, so a larger group is
finer-grained but pays more communication; a document on one rank pays none.

The plan (``plan_dynamic_cp``):

1. ``g_min(d)`` = the smallest power of two with ``d / g <= max_tokens_per_rank`` (memory);
2. candidates for the documents' group sizes: for a granularity ``alpha`` (``ALPHAS``), ``g(d)`` = the smallest
   power of two >= ``g_min(d)`` whose per-rank price is at most ``alpha x`` the ideal (the batch's latency at
   CP 1 over ``P``); and sizes chosen during the placement (``_malleable``): each document, costliest first, at
   the size and block that least raise a lower bound on the final slowest slot (its block's busiest slot after
   it, or all rank-seconds so far and the rest's least over ``P``), ties to the fewest rank-seconds;
3. placement in decreasing per-rank price (or: larger groups first, then price), each document on the aligned
   block of its size whose busiest slot is least loaded (longest-processing-time first). Every slot runs its
   micro-batches in decreasing group size (blocks in a fixed order within a size). Because a block of size
   ``g`` lies inside exactly one aligned block of each larger size, all slots of a block have run the same
   larger-group micro-batches before its own: a group never waits for a member (no synchronisation idle), and
   a slot's time is the sum of its shares;
4. the best few placements by their slowest slot are refined by a local search (``_refine``): a document of the
   slowest slot moves to any block of any size its tokens fit (priced at that size), or swaps with a cheaper
   document of its size, while that lowers the slowest slot (or the number of slots that slow);
5. per block and size, documents are packed (first-fit decreasing) into micro-batches under the cap; the plan
   with the least slowest slot (micro-batch fixed costs included) wins;
6. with ``max_micro_batches`` (Megatron's micro-batches per iteration), a plan over it is brought within it
   (``_within_count``), or the densest plan or the packer's own (``fixed_plan``) is taken; no plan exists when
   the tokens or the documents that need the whole pool alone need more steps (``_check_count``: one line);
   a slot done before the count runs empty micro-batches and pays their measured price (``CostModel.empty_seconds``);
7. with ``fixed_plan``, the packer's own placement on the fixed CP groups is priced the same way, and taken
   (``DynamicCPPlan.fixed``) when the best dynamic plan is not faster: dynamic CP never plans a global batch its
   price says is slower than the fixed groups.

``lower_bound`` bounds any plan from below (the planner's gap is reported against it).

Predicted time = the slowest slot's summed seconds per layer (PP 1). Pure numpy: no torch, no global
state. At PP > 1 the runtime runs the same plan on every stage (each slot's micro-batches in the same order,
Megatron's count kept, empty ones padded) and the objective stays this PP 1 sum: the slot's 1F1B time
(``schedule``), with a group's members waiting for each other at every stage, is not what is minimised.
"""

from __future__ import annotations

import dataclasses
import heapq
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np

from megatron_wlb.costmodel import CostModel
from megatron_wlb.costmodel.model import CalibratedCostModel, build_cost_model
from megatron_wlb.cp.layouts import build_layout

__all__ = ["ALPHAS", "DYNAMIC_SHARDING", "DynamicCPPlan", "GroupMicroBatch", "group_cost_models",
           "lower_bound", "memory_bound", "plan_dynamic_cp"]

#: how a group's micro-batch is cut over its ranks (head-tail per document: balanced causal attention), by the
#: runtime (``cp.dynamic_steps.step_batch``) and in the plan's price
DYNAMIC_LAYOUT = "per-document"
#: the CP sharding value (``cp.sharding`` / ``--wlb-cp-sharding``) that asks for this planner
DYNAMIC_SHARDING = "dynamic"
#: the granularities tried (a document's per-rank price at most alpha x the ideal); inf: only memory decides
ALPHAS: tuple[float, ...] = (float("inf"), 1.0, 0.5, 0.25, 0.125, 1 / 16, 1 / 32, 1 / 64)
#: documents of the slowest slot tried per move / swap of the final placement's local search (costliest first)
_REFINE_TRIES = 32


@dataclass(frozen=True)
class GroupMicroBatch:
    """One micro-batch of a dynamic-CP plan: documents ``docs`` (indices into the global batch) run on ranks
    ``first_rank .. first_rank + size - 1`` as one CP group; ``seconds``: predicted per-rank forward +
    backward seconds per layer (documents and the micro-batch's fixed cost)."""

    first_rank: int
    size: int
    docs: tuple[int, ...]
    tokens: int
    seconds: float

    @property
    def ranks(self) -> range:
        return range(self.first_rank, self.first_rank + self.size)


@dataclass(frozen=True)
class DynamicCPPlan:
    """A global batch over ``ranks`` slots: ``rank_micro_batches[j]`` is slot j's micro-batches in the order it
    runs them (a group's micro-batch appears, the same object, at the same index on each member)."""

    ranks: int
    rank_micro_batches: tuple[tuple[GroupMicroBatch, ...], ...]
    rank_seconds: np.ndarray
    ideal_seconds: float
    alpha: float
    #: Megatron's micro-batches per iteration (0: not known) and the price of an empty one (per layer, forward +
    #: backward, ``CostModel.empty_seconds``): a slot done before the count runs empty ones, and pays for them
    count: int = 0
    empty_seconds: float = 0.0
    #: whether the plan is the packer's own placement on the fixed CP groups (``plan_dynamic_cp``: the dynamic
    #: plans' best was priced slower than it)
    fixed: bool = False

    @property
    def slot_seconds(self) -> np.ndarray:
        """Each slot's predicted seconds per layer: its micro-batches' (``rank_seconds``) and its empty ones'."""
        empties = np.array([max(0, self.count - len(m)) for m in self.rank_micro_batches], dtype=np.float64)
        return self.rank_seconds + empties * self.empty_seconds

    @property
    def slowest_seconds(self) -> float:
        return float(self.slot_seconds.max()) if self.rank_seconds.size else 0.0

    @property
    def over_ideal(self) -> float:
        return self.slowest_seconds / self.ideal_seconds if self.ideal_seconds > 0 else 1.0

    @property
    def steps(self) -> int:
        """Micro-batches of the busiest slot (the others run empty ones after theirs)."""
        return max((len(m) for m in self.rank_micro_batches), default=0)

    @property
    def micro_batches(self) -> list[GroupMicroBatch]:
        """Every micro-batch once, in step order."""
        seen: dict[int, GroupMicroBatch] = {}
        for k in range(self.steps):
            for mbs in self.rank_micro_batches:
                if k < len(mbs):
                    seen.setdefault(id(mbs[k]), mbs[k])
        return list(seen.values())

    def rank_groups(self) -> list[list[list[int]]]:
        """Megatron dev's ``get_groups_and_subsamples`` shape: per step, per slot, the document indices it holds
        (a group's documents on each member; ``[]`` once a slot has run all its micro-batches)."""
        return [[list(mbs[k].docs) if k < len(mbs) else [] for mbs in self.rank_micro_batches]
                for k in range(self.steps)]


def group_cost_models(cost: CostModel, ranks: int) -> dict[int, CostModel]:
    """``cost`` re-laid out for every power-of-two CP group size up to ``ranks`` (the stage's DP x CP slots):
    CP = g and DP = ranks / g, the same model, TP, hardware and (for a calibrated model) fit."""
    out: dict[int, CostModel] = {}
    g = 1
    while g <= ranks:
        layout = dataclasses.replace(cost.layout, cp=g, dp=max(1, ranks // g), pp=1)
        if isinstance(cost, CalibratedCostModel):
            out[g] = CalibratedCostModel(cost.profile, cost.model, layout, cost.hardware, fit=cost.fit)
        else:
            out[g] = build_cost_model(cost.model, layout, hardware=cost.hardware)
        g *= 2
    return out


def _price(cost: CostModel, lengths: np.ndarray) -> np.ndarray:
    """Forward + backward seconds per layer on one rank of a CP group of ``cost.layout.cp`` (comm included)."""
    return cost.forward_backward(cost.attention(lengths), cost.linear(lengths))


def _overhead(cost: CostModel) -> float:
    return cost.microbatch_overhead * (1.0 + cost.hardware.bwd_linear)


def _min_groups(lengths: np.ndarray, max_tokens_per_rank: int, largest: int) -> np.ndarray:
    need = np.maximum(1, -(-lengths // max_tokens_per_rank))
    g = (2 ** np.ceil(np.log2(need))).astype(np.int64)
    if lengths.size and int(g.max()) > largest:
        i = int(np.argmax(g))
        raise ValueError(f"a document of {int(lengths[i])} tokens needs {int(g[i])} ranks at "
                         f"{max_tokens_per_rank} tokens per rank, but the largest group is {largest}: raise the "
                         "tokens per rank or cut documents at the window")
    return g


def memory_bound(lengths: Sequence[int] | np.ndarray, ranks: int, max_tokens_per_rank: int,
                 costs: dict[int, CostModel]) -> float:
    """A lower bound on any plan's slowest slot: every document at its smallest group that fits the memory cap,
    its rank-seconds (communication included) spread perfectly over the ``ranks`` slots. Over the ideal (the
    same at CP 1) it is the communication the memory cap forces."""
    d = np.asarray(lengths, dtype=np.int64).reshape(-1)
    g_min = _min_groups(d, max_tokens_per_rank, max(g for g in costs if g <= ranks))
    return sum(float(_price(costs[int(g)], d[g_min == g]).sum()) * int(g) for g in np.unique(g_min)) / ranks


def lower_bound(lengths: Sequence[int] | np.ndarray, ranks: int, max_tokens_per_rank: int,
                costs: dict[int, CostModel]) -> float:
    """A lower bound on any plan's slowest slot (seconds per layer), tighter than ``memory_bound``: the least
    ``T`` with ``T >= (W(T) + F) / ranks``, where ``W(T)`` sums each document's least rank-seconds over the group
    sizes that fit the memory cap and cost each member at most ``T`` (a slot running it takes that long), and ``F``
    is the fixed cost of the fewest micro-batch shares that hold the tokens (a share holds at most
    ``max_tokens_per_rank``), each at the cheapest group size's fixed cost."""
    d = np.asarray(lengths, dtype=np.int64).reshape(-1)
    if d.size == 0:
        return 0.0
    sizes = sorted(g for g in costs if g <= ranks)
    g_min = _min_groups(d, max_tokens_per_rank, sizes[-1])
    price = np.stack([_price(costs[g], d) for g in sizes])  # sizes x documents
    fits = np.array(sizes)[:, None] >= g_min[None, :]
    price = np.where(fits, price, np.inf)
    work = price * np.array(sizes, dtype=np.float64)[:, None]
    fixed = -(-int(d.sum()) // max_tokens_per_rank) * min(_overhead(costs[g]) for g in sizes)

    def area(t: float) -> float:
        return float(np.where(price <= t, work, np.inf).min(axis=0).sum() + fixed) / ranks

    lo = float(price.min(axis=0).max())  # every document fits under T on some group size
    hi = max(lo, area(float(price[np.isfinite(price)].max())))
    if area(lo) <= lo:
        return lo
    for _ in range(60):  # T - area(T) increases with T: bisect to its root
        mid = 0.5 * (lo + hi)
        lo, hi = (lo, mid) if area(mid) <= mid else (mid, hi)
        if hi - lo <= 1e-12 * hi:
            break
    return hi


def plan_dynamic_cp(lengths: Sequence[int] | np.ndarray, ranks: int, max_tokens_per_rank: int,
                    costs: dict[int, CostModel], alphas: Sequence[float] = ALPHAS, promotions: int = 256, *,
                    max_micro_batches: int | None = None,
                    fixed_plan: Sequence[Sequence[Sequence[int]]] | None = None) -> DynamicCPPlan:
    """The dynamic-CP plan of one global batch (see the module doc): ``lengths`` its documents, ``ranks`` the
    stage's DP x CP slots, ``costs`` the cost model per group size (``group_cost_models``); ``alphas`` the
    granularities of the threshold candidates, ``promotions`` the local search's steps (0: the threshold
    candidates only); ``max_micro_batches``: at most that many micro-batches on any slot (Megatron's micro-batches
    per iteration: global batch / (micro-batch size x DP)); ValueError in one line when no plan is found within it.
    ``fixed_plan[r][k]``: the documents of DP rank r's micro-batch k as the packer placed them on fixed CP groups of
    ``ranks / len(fixed_plan)`` ranks (a plan within the count the search falls back on when it finds none)."""
    d = np.asarray(lengths, dtype=np.int64).reshape(-1)
    if d.size and int(d.min()) < 1:
        raise ValueError(f"document lengths must be >= 1 token, got {int(d.min())}")
    if ranks < 1:
        raise ValueError(f"ranks={ranks}: a stage needs at least one DP x CP rank")
    if max_tokens_per_rank < 1:
        raise ValueError(f"max_tokens_per_rank={max_tokens_per_rank}: must be a positive token count")
    if max_micro_batches is not None and (isinstance(max_micro_batches, bool) or int(max_micro_batches) < 1
                                          or int(max_micro_batches) != max_micro_batches):
        raise ValueError(f"max_micro_batches={max_micro_batches!r}: must be a positive whole number (Megatron's "
                         "micro-batches per iteration) or None")
    sizes = sorted(g for g in costs if g <= ranks)
    if not sizes or sizes[0] != 1 or any(b != 2 * a for a, b in zip(sizes, sizes[1:], strict=False)):
        raise ValueError(f"costs must price the group sizes 1, 2, 4, ... up to at most {ranks}, got {sorted(costs)}")
    largest = sizes[-1]
    prices = {g: _price(costs[g], d) for g in sizes}
    ideal = float(prices[1].sum()) / ranks
    g_min = _min_groups(d, max_tokens_per_rank, largest)
    fixed = None if fixed_plan is None else _fixed_bins(d, fixed_plan, ranks, max_tokens_per_rank)
    if max_micro_batches is not None:
        _check_count(d, ranks, max_tokens_per_rank, largest, int(max_micro_batches))
    candidates: list[tuple[tuple[float, int], float, np.ndarray, np.ndarray, np.ndarray]] = []
    seen: set[bytes] = set()
    for alpha in alphas:
        group = _groups_for(g_min, sizes, prices, alpha * ideal)
        if group.tobytes() in seen:
            continue
        seen.add(group.tobytes())
        price = _doc_prices(prices, group)
        for order in (np.argsort(-price, kind="stable"), np.lexsort((-price, -group))):
            first, load = _lpt(price, group, ranks, order)
            candidates.append((_load_score(load), alpha, group, first, load))
    if promotions:
        group, first, load = _malleable(g_min, sizes, prices, ranks)
        candidates.append((_load_score(load), float("nan"), group, first, load))
    candidates.sort(key=lambda c: c[0])
    best: DynamicCPPlan | None = None
    tried: set[bytes] = set()
    for _, alpha, group, first, load in candidates:
        key = group.tobytes() + first.tobytes()
        if key in tried:
            continue
        tried.add(key)
        group, first = group.copy(), first.copy()
        if promotions:
            _refine(prices, g_min, group, first, load.copy(), promotions)
        bins = _bins(d, group, first, max_tokens_per_rank)
        plan: DynamicCPPlan | None = _build(d, bins, ranks, costs, prices, ideal, alpha)
        if max_micro_batches is not None and plan is not None and plan.steps > max_micro_batches:
            plan = _within_count(d, bins, plan, g_min, ranks, max_tokens_per_rank, costs, prices, ideal,
                                 int(max_micro_batches), fixed)
        if plan is not None:
            plan = _counted(plan, max_micro_batches, costs)
            if best is None or _score(plan) < _score(best):
                best = plan
        if len(tried) >= _FINALISTS:
            break
    if best is None:  # no candidate could be brought within the count: the densest packing
        best = _dense_plan(d, g_min, ranks, max_tokens_per_rank, costs, prices, ideal, int(max_micro_batches or 0))
        assert best is not None  # _dense_plan refuses in one line instead
        best = _counted(best, max_micro_batches, costs)
    if fixed is not None:  # never a plan priced slower than the same documents on the fixed groups
        on_fixed = _counted(dataclasses.replace(_build(d, [b for step in fixed for b in step], ranks, costs, prices,
                                                       ideal, float("nan")), fixed=True), max_micro_batches, costs)
        if on_fixed.steps <= (max_micro_batches or on_fixed.steps) and _score(on_fixed) <= _score(best):
            best = on_fixed
    return best


def _counted(plan: DynamicCPPlan, count: int | None, costs: dict[int, CostModel]) -> DynamicCPPlan:
    """``plan`` with Megatron's count and the price of an empty micro-batch, so its slots pay for their empty ones."""
    return dataclasses.replace(plan, count=int(count or 0), empty_seconds=float(sum(costs[1].empty_seconds)))


def _fixed_bins(d: np.ndarray, fixed_plan: Sequence[Sequence[Sequence[int]]], ranks: int,
                cap: int) -> list[list[tuple[int, int, list[int]]]] | None:
    """``fixed_plan`` checked (every document once: else ValueError) as bins per step: step k's micro-batches, DP
    rank r's on slots ``[r cp, (r + 1) cp)``; None when one of them is over its group's memory (``cap`` a slot)."""
    dp = len(fixed_plan)
    cp = ranks // dp if dp else 0
    if dp < 1 or cp * dp != ranks or cp & (cp - 1):
        raise ValueError(f"fixed_plan has {dp} DP ranks: a pool of {ranks} slots needs a number of DP ranks that "
                         "leaves a power-of-two CP group (ranks / DP)")
    seen = sorted(int(i) for mbs in fixed_plan for mb in mbs for i in mb)
    if seen != list(range(d.size)):
        raise ValueError(f"fixed_plan must hold each of the {d.size} documents once, got {len(seen)} placements")
    steps = max(len(mbs) for mbs in fixed_plan)
    out: list[list[tuple[int, int, list[int]]]] = [[] for _ in range(steps)]
    for r, mbs in enumerate(fixed_plan):
        for k, mb in enumerate(mbs):
            docs = [int(i) for i in mb]
            if int(d[docs].sum()) > cp * cap:  # over the slots' memory: no plan to fall back on
                return None
            if docs:
                out[k].append((cp, r * cp, docs))
    return out


#: placements refined and built in full (the best by their slot loads), the best built plan wins
_FINALISTS = 3


def _check_count(d: np.ndarray, ranks: int, cap: int, largest: int, limit: int) -> None:
    """Refuse (one line) a micro-batch count no plan can meet: a micro-batch share holds at most ``cap`` tokens, so
    some slot runs at least total / (ranks x cap) of them; documents over half the largest group's capacity
    each need a micro-batch of that group to themselves, and a pool has one block of its largest size."""
    by_tokens = -(-int(d.sum()) // (ranks * cap))
    alone = int(np.sum(d > largest * cap // 2))
    need = max(by_tokens, alone)
    if need > limit:
        why = (f"its {int(d.sum())} tokens over {ranks} ranks at {cap} tokens per rank" if by_tokens >= alone else
               f"{alone} documents over {largest * cap // 2} tokens each need the {largest}-rank group alone")
        raise ValueError(f"the dynamic-CP plan of this global batch needs {need} micro-batches on its busiest rank, "
                         f"but Megatron runs {limit} per iteration (max_micro_batches={limit}; no plan does with "
                         f"fewer: {why}); give at least {need} (raise --global-batch-size or lower "
                         "--micro-batch-size), or fewer tokens per global batch")


def _doc_prices(prices: dict[int, np.ndarray], group: np.ndarray) -> np.ndarray:
    """Each document's per-rank price at its group size."""
    out = np.empty(group.size)
    for g, p in prices.items():
        mask = group == g
        out[mask] = p[mask]
    return out


def _groups_for(g_min: np.ndarray, sizes: list[int], prices: dict[int, np.ndarray], limit: float) -> np.ndarray:
    """Each document's group: ``g_min`` doubled while its per-rank price exceeds ``limit`` (up to the largest)."""
    group = g_min.copy()
    if np.isfinite(limit):
        for g in sizes[:-1]:
            group[(group == g) & (prices[g] > limit)] = 2 * g
    return group


class _Slots:
    """Slot loads during a placement: a numpy array (blocks' busiest slot) and a lazy min-heap of single slots,
    so that a document on one rank is placed in O(log ranks)."""

    def __init__(self, ranks: int) -> None:
        self.load = np.zeros(ranks)
        self.heap = [(0.0, j) for j in range(ranks)]
        self.top = 0.0

    def least(self) -> tuple[int, float]:
        while True:
            value, j = self.heap[0]
            if value == self.load[j]:
                return j, value
            heapq.heappop(self.heap)  # stale: ``add`` pushed the slot's current load

    def best_block(self, g: int) -> tuple[int, float]:
        """The aligned block of ``g`` slots whose busiest slot is least loaded: (its first slot, that load)."""
        if g == 1:
            return self.least()
        n = self.load.size // g
        blocks = self.load[: n * g].reshape(n, g).max(axis=1)
        b = int(np.argmin(blocks))
        return b * g, float(blocks[b])

    def add(self, first: int, g: int, seconds: float) -> None:
        if g == 1:
            value = float(self.load[first]) + seconds
            self.load[first] = value
            heapq.heappush(self.heap, (value, first))
            self.top = max(self.top, value)
            return
        self.load[first:first + g] += seconds
        for j in range(first, first + g):
            heapq.heappush(self.heap, (float(self.load[j]), j))
        self.top = max(self.top, float(self.load[first:first + g].max()))


def _lpt(price: np.ndarray, group: np.ndarray, ranks: int, order: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """Step 3 of the module doc: each document in ``order`` on the aligned block of its size whose busiest slot
    is least loaded. Returns (each document's first slot, the slot loads)."""
    slots = _Slots(ranks)
    first = np.zeros(group.size, dtype=np.int64)
    for i in order.tolist():
        g = int(group[i])
        lead, _ = slots.best_block(g)
        slots.add(lead, g, float(price[i]))
        first[i] = lead
    return first, slots.load


def _malleable(g_min: np.ndarray, sizes: list[int], prices: dict[int, np.ndarray],
               ranks: int) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """Group sizes chosen during the placement: documents in decreasing per-rank price at their smallest group,
    each at the (size, block) that least raises a lower bound on the final slowest slot: the larger of the
    block's busiest slot after it and the batch's rank-seconds over the ranks so far (documents placed at their
    sizes, the rest at their smallest); ties go to the least rank-seconds. A document whose smallest group stays
    under that bound keeps it, so only the coarse items that would stick out are spread wider."""
    n = g_min.size
    at_min = _doc_prices(prices, g_min)
    remaining = float((at_min * g_min).sum())
    committed = 0.0
    slots = _Slots(ranks)
    group = g_min.copy()
    first = np.zeros(n, dtype=np.int64)
    for i in np.argsort(-at_min, kind="stable").tolist():
        g0 = int(g_min[i])
        remaining -= float(at_min[i]) * g0
        best: tuple[float, float, int, int] | None = None
        for g in sizes:
            if g < g0:
                continue
            p = float(prices[g][i])
            lead, busiest = slots.best_block(g)
            area = (committed + remaining + p * g) / ranks
            floor = max(slots.top, area)
            key = (max(busiest + p, floor), p * g, lead, g)
            if best is None or key[:2] < best[:2]:
                best = key
            if busiest + p <= floor:  # a wider group only adds rank-seconds
                break
        assert best is not None
        _, w, lead, g = best
        slots.add(lead, g, w / g)
        committed += w
        group[i], first[i] = g, lead
    return group, first, slots.load


def _score(plan: DynamicCPPlan) -> tuple[float, int]:
    """What the search lowers: the slowest slot's seconds (its empty micro-batches included), then how many slots
    take (about) that long."""
    return _load_score(plan.slot_seconds)


def _load_score(load: np.ndarray) -> tuple[float, int]:
    top = float(load.max()) if load.size else 0.0
    return round(top, 12), int(np.sum(load >= top * (1 - 1e-9)))


def _refine(prices: dict[int, np.ndarray], g_min: np.ndarray, group: np.ndarray, first: np.ndarray,
            load: np.ndarray, rounds: int) -> None:
    """Local search on a placement (in place): move a document of the slowest slot to another block of any size
    its tokens fit (its price at that size), or swap it with a cheaper document of its size elsewhere, while that
    lowers the slowest slot (or the number of slots that slow)."""
    ranks = load.size
    price = _doc_prices(prices, group)
    sizes = sorted(prices)
    for _ in range(rounds):
        slow = int(np.argmax(load))
        score = _load_score(load)
        on_slow = np.flatnonzero((first <= slow) & (slow < first + group))
        done = False
        for i in on_slow[np.argsort(-price[on_slow], kind="stable")][:_REFINE_TRIES].tolist():
            g, b0, p = int(group[i]), int(first[i]), float(price[i])
            rest = load.copy()
            rest[b0:b0 + g] -= p
            top_rest = float(rest.max())
            best: tuple[float, int, int] | None = None  # (slowest after, size, first slot)
            for h in sizes:
                if h < g_min[i]:
                    continue
                nb = ranks // h
                block_max = rest[:nb * h].reshape(nb, h).max(axis=1)
                after = np.maximum(block_max + prices[h][i], top_rest)
                if h == g:
                    after[b0 // g] = np.inf
                k = int(np.argmin(after))
                if best is None or after[k] < best[0]:
                    best = (float(after[k]), h, k * h)
            trial = load.copy()
            trial[b0:b0 + g] -= p
            if best is not None:
                _, h, lead = best
                trial[lead:lead + h] += prices[h][i]
                if _load_score(trial) < score:
                    group[i], first[i], price[i] = h, lead, prices[h][i]
                    load[:] = trial
                    done = True
                    break
            nb = ranks // g
            same = np.flatnonzero((group == g) & (first != b0) & (price < p))
            if same.size:
                rest_max = rest[:nb * g].reshape(nb, g).max(axis=1)
                swaps = np.maximum(rest_max[first[same] // g] + p - price[same], rest_max[b0 // g] + price[same])
                j = int(same[int(np.argmin(swaps))])
                bj = int(first[j])
                trial = load.copy()
                trial[bj:bj + g] += p - price[j]
                trial[b0:b0 + g] += price[j] - p
                if _load_score(trial) < score:
                    first[i], first[j] = bj, b0
                    load[:] = trial
                    done = True
                    break
        if not done:
            return


def _bins(d: np.ndarray, group: np.ndarray, first: np.ndarray, cap: int) -> list[tuple[int, int, list[int]]]:
    """Step 4: per block and size, the documents packed first-fit decreasing into micro-batches under the cap:
    ``(size, first slot, documents)``."""
    placed: dict[tuple[int, int], list[int]] = {}
    for i, (g, lead) in enumerate(zip(group.tolist(), first.tolist(), strict=True)):
        placed.setdefault((g, lead), []).append(i)
    return [(g, lead, docs) for (g, lead), ds in placed.items() for docs in _first_fit(ds, d, g * cap)]


def _build(d: np.ndarray, bins: list[tuple[int, int, list[int]]], ranks: int, costs: dict[int, CostModel],
           prices: dict[int, np.ndarray], ideal: float, alpha: float) -> DynamicCPPlan:
    """The plan of ``bins``: every slot runs its micro-batches larger groups first, then by block, then in the
    given order (so a group's micro-batch sits at the same index on every member)."""
    rank_mbs: list[list[GroupMicroBatch]] = [[] for _ in range(ranks)]
    order = sorted(range(len(bins)), key=lambda k: (-bins[k][0], bins[k][1], k))
    for k in order:
        g, lead, docs = bins[k]
        docs = sorted(docs, key=lambda i: -int(d[i]))
        mb = GroupMicroBatch(lead, g, tuple(docs), int(d[docs].sum()), _group_seconds(d[docs], g, costs[g]))
        for j in range(lead, lead + g):
            rank_mbs[j].append(mb)
    seconds = np.array([sum(mb.seconds for mb in mbs) for mbs in rank_mbs])
    return DynamicCPPlan(ranks, tuple(tuple(m) for m in rank_mbs), seconds, ideal, alpha)


def _group_seconds(lengths: np.ndarray, g: int, cost: CostModel) -> float:
    """A built micro-batch's price: its slowest member's share as the runtime lays it out (``per-document`` over the
    group, ``ShardLayout.seconds``), the one price of a CP rank's work; the search itself prices documents apart
    (``_price``), which this refines (a rank's own runs, tokens and pairs, its whole-micro-batch cost)."""
    fwd, bwd = build_layout(DYNAMIC_LAYOUT, lengths, g, cost=cost).seconds(cost)
    return float((fwd + bwd).max())


def _within_count(d: np.ndarray, bins: list[tuple[int, int, list[int]]], plan: DynamicCPPlan, g_min: np.ndarray,
                  ranks: int, cap: int, costs: dict[int, CostModel], prices: dict[int, np.ndarray], ideal: float,
                  limit: int, fixed: list[list[tuple[int, int, list[int]]]] | None = None) -> DynamicCPPlan | None:
    """``plan`` brought within ``limit`` micro-batches per slot, or None: while a slot runs more, one of its
    micro-batches (fewest tokens first) is dissolved, each of its documents (largest first) moved to where it
    least raises the busiest slot of its new block: an existing micro-batch with room (any group size its tokens
    fit) or a new one on a block whose slots all have a step to spare; else the densest plan (``_dense_plan``)
    when it fits, or the packer's ``fixed`` plan (its micro-batches split into halves where they fit). The best by
    the slowest slot."""
    mbs: list[list[Any]] = [[g, lead, list(docs), int(d[docs].sum())] for g, lead, docs in bins]
    load = plan.rank_seconds.copy()
    count = np.array([len(m) for m in plan.rank_micro_batches])
    for _ in range(4 * len(mbs) + 4):
        if int(count.max()) <= limit:
            break
        slot = int(np.argmax(count))
        mine = sorted((k for k, m in enumerate(mbs) if m[2] and m[1] <= slot < m[1] + m[0]),
                      key=lambda k: mbs[k][3])
        for k in mine:
            moved = _dissolve(k, mbs, load, count, d, g_min, ranks, cap, costs, prices, limit, slot)
            if moved is not None:
                mbs, load, count = moved
                break
        else:
            break
    repaired = None
    if int(count.max()) <= limit:
        kept = [(g, lead, docs) for g, lead, docs, _ in mbs if docs]
        repaired = _build(d, kept, ranks, costs, prices, ideal, plan.alpha)
    dense = _dense_plan(d, g_min, ranks, cap, costs, prices, ideal, limit, refuse=False)
    options = [p for p in (repaired, dense) if p is not None]
    if fixed is not None and len(fixed) <= limit:  # as the packer placed it, and with its groups split in halves
        whole = [b for step in fixed for b in step]
        split = [h for size, first, docs in whole for h in _halves(d, g_min, docs, first, size, cap, prices)]
        options += [_build(d, whole, ranks, costs, prices, ideal, float("nan")),
                    _build(d, split, ranks, costs, prices, ideal, float("nan"))]
    return min(options, key=_score) if options else None


def _dissolve(k: int, mbs: list, load: np.ndarray, count: np.ndarray, d: np.ndarray, g_min: np.ndarray, ranks: int,
              cap: int, costs: dict[int, CostModel], prices: dict[int, np.ndarray], limit: int,
              slot: int) -> tuple[list, np.ndarray, np.ndarray] | None:
    """Micro-batch ``k`` emptied into others (see ``_within_count``); None when a document finds no room."""
    mbs = [list(m[:2]) + [list(m[2]), m[3]] for m in mbs]
    load, count = load.copy(), count.copy()
    g, lead, docs, _ = mbs[k]
    load[lead:lead + g] -= float(prices[g][docs].sum()) + _overhead(costs[g])
    count[lead:lead + g] -= 1
    mbs[k][2], mbs[k][3] = [], 0
    for i in sorted(docs, key=lambda i: -int(d[i])):
        n = int(d[i])
        best: tuple[float, int, int, int] | None = None  # (busiest after, micro-batch or -1, size, first slot)
        for t, (h, first, held, tokens) in enumerate(mbs):
            if held and h >= g_min[i] and tokens + n <= h * cap:
                after = float(load[first:first + h].max()) + float(prices[h][i])
                if best is None or after < best[0]:
                    best = (after, t, h, first)
        h = int(g_min[i])
        while h <= ranks:  # aligned blocks of every size from the document's smallest
            nb = ranks // h
            spare = count[:nb * h].reshape(nb, h).max(axis=1) < limit
            if slot // h < nb:
                spare[slot // h] = False  # a block holding the crowded slot gains it nothing
            if spare.any():
                block_max = load[:nb * h].reshape(nb, h).max(axis=1) + float(prices[h][i]) + _overhead(costs[h])
                block_max[~spare] = np.inf
                b = int(np.argmin(block_max))
                if best is None or block_max[b] < best[0]:
                    best = (float(block_max[b]), -1, h, b * h)
            h *= 2
        if best is None:
            return None
        _, t, h, first = best
        if t < 0:
            mbs.append([h, first, [i], n])
            load[first:first + h] += _overhead(costs[h])
            count[first:first + h] += 1
        else:
            mbs[t][2].append(i)
            mbs[t][3] += n
        load[first:first + h] += float(prices[h][i])
    return mbs, load, count


def _dense_plan(d: np.ndarray, g_min: np.ndarray, ranks: int, cap: int, costs: dict[int, CostModel],
                prices: dict[int, np.ndarray], ideal: float, limit: int, refuse: bool = True) -> DynamicCPPlan | None:
    """The densest plan: ``limit`` steps, each the pool's largest aligned blocks (a power-of-two pool: the whole
    pool), the documents packed first-fit decreasing by tokens into those steps' blocks, then each block's
    micro-batch split in two aligned halves (balanced by price) while its documents fit the halves, so less is
    communicated. Any plan within ``limit`` micro-batches per slot has, step by step, disjoint aligned blocks, so
    their union fits one such step. None (or, with ``refuse``, a one-line ValueError) when the packing fails."""
    blocks: list[tuple[int, int]] = []  # (first slot, size): the binary decomposition of the pool
    lead, rest = 0, ranks
    while rest:
        size = 1 << (rest.bit_length() - 1)
        blocks.append((lead, size))
        lead, rest = lead + size, rest - size
    slots = [(step, first, size) for step in range(limit) for first, size in blocks]
    held: list[list[int]] = [[] for _ in slots]
    room = [size * cap for _, _, size in slots]
    for i in sorted(range(d.size), key=lambda i: -int(d[i])):
        n = int(d[i])
        for s, (_, _, size) in enumerate(slots):
            if size >= g_min[i] and n <= room[s]:
                held[s].append(i)
                room[s] -= n
                break
        else:
            worst = max(1, _fewest_steps(d, g_min, blocks, cap))
            if refuse:
                raise ValueError(f"the dynamic-CP plan of this global batch needs {worst} micro-batches on its "
                                 f"busiest rank, but Megatron runs {limit} per iteration (max_micro_batches={limit}; "
                                 f"the densest packing found at {cap} tokens per rank); give at least {worst} (raise "
                                 "--global-batch-size or lower --micro-batch-size)")
            return None
    bins: list[tuple[int, int, list[int]]] = []
    for (_, first, size), docs in zip(slots, held, strict=True):
        if docs:
            bins += _halves(d, g_min, docs, first, size, cap, prices)
    plan = _build(d, bins, ranks, costs, prices, ideal, float("nan"))
    return plan


def _fewest_steps(d: np.ndarray, g_min: np.ndarray, blocks: list[tuple[int, int]], cap: int) -> int:
    """The steps ``_dense_plan``'s packing needs (no limit)."""
    steps = 1
    while True:
        room = [size * cap for _ in range(steps) for _, size in blocks]
        sizes = [size for _ in range(steps) for _, size in blocks]
        ok = True
        for i in sorted(range(d.size), key=lambda i: -int(d[i])):
            for s in range(len(room)):
                if sizes[s] >= g_min[i] and d[i] <= room[s]:
                    room[s] -= int(d[i])
                    break
            else:
                ok = False
                break
        if ok:
            return steps
        steps += 1


def _halves(d: np.ndarray, g_min: np.ndarray, docs: list[int], first: int, size: int, cap: int,
            prices: dict[int, np.ndarray]) -> list[tuple[int, int, list[int]]]:
    """One step's block split recursively into aligned halves while every document fits a half (tokens and
    memory), the halves balanced by price at half the size (largest first to the less loaded half)."""
    half = size // 2
    if size == 1 or any(int(g_min[i]) > half for i in docs):
        return [(size, first, docs)]
    parts: list[list[int]] = [[], []]
    tokens, seconds = [0, 0], [0.0, 0.0]
    for i in sorted(docs, key=lambda i: -float(prices[half][i])):
        order = sorted((0, 1), key=lambda k: seconds[k])
        for k in order:
            if tokens[k] + int(d[i]) <= half * cap:
                parts[k].append(i)
                tokens[k] += int(d[i])
                seconds[k] += float(prices[half][i])
                break
        else:
            return [(size, first, docs)]
    out: list[tuple[int, int, list[int]]] = []
    for k in (0, 1):
        if parts[k]:
            out += _halves(d, g_min, parts[k], first + k * half, half, cap, prices)
    return out


def _first_fit(docs: list[int], lengths: np.ndarray, capacity: int) -> list[list[int]]:
    """``docs`` packed first-fit decreasing by tokens into bins of at most ``capacity`` tokens."""
    bins: list[list[int]] = []
    room: list[int] = []
    for i in sorted(docs, key=lambda i: -int(lengths[i])):
        n = int(lengths[i])
        for k, r in enumerate(room):
            if n <= r:
                bins[k].append(i)
                room[k] -= n
                break
        else:
            bins.append([i])
            room.append(capacity - n)
    return bins
