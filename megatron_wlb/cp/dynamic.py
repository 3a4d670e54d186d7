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
2. for a granularity ``alpha`` (tried: no limit, 1, 1/2, ... 1/64), ``g(d)`` = the smallest power of
   two >= ``g_min(d)`` whose per-rank price is at most ``alpha x`` the ideal (the batch's latency at CP 1
   over ``P``), at most the largest block;
3. place documents in decreasing per-rank price (or: larger groups first, then price; both are tried), each
   on the aligned block of its size whose busiest slot is least loaded (longest-processing-time first).
   Every slot runs its micro-batches in decreasing group size (blocks in a fixed order within a size).
   Because a block of size ``g`` lies inside exactly one aligned block of each larger size, all slots of a
   block have run the same larger-group micro-batches before its own: a group never waits for a member
   (no synchronisation idle), and a slot's time is the sum of its shares;
4. per block and size, documents are packed (first-fit decreasing) into micro-batches under the cap;
5. the ``alpha`` with the least predicted slowest slot wins; then its ``k`` costliest documents are moved one
   size up together (the best ``k`` of 0 .. ``P``), and a local search doubles, one at a time, the group of a
   document on the slowest slot while that shortens it.

Predicted time = the slowest slot's summed seconds per layer (PP 1). Pure numpy: no torch, no global
state. Pipeline parallelism (PP > 1) is not planned here: every stage would need the same groups per
micro-batch and the same micro-batch count per slot (empty micro-batches padded), and the slot's time
becomes its 1F1B schedule instead of a sum (``schedule``).
"""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np

from megatron_wlb.costmodel import CostModel
from megatron_wlb.costmodel.model import CalibratedCostModel, build_cost_model

__all__ = ["ALPHAS", "DYNAMIC_SHARDING", "RUNTIME_MISSING", "DynamicCPPlan", "GroupMicroBatch", "group_cost_models",
           "memory_bound", "plan_dynamic_cp"]

#: the CP sharding value (``cp.sharding`` / ``--wlb-cp-sharding``) that asks for this planner
DYNAMIC_SHARDING = "dynamic"
#: why a training run with pipeline parallelism refuses it (one line): the runtime trains at PP 1 only
RUNTIME_MISSING = (f"--wlb-cp-sharding {DYNAMIC_SHARDING} trains at --pipeline-model-parallel-size 1 only: with "
                   "PP > 1 every stage would need the same CP groups per micro-batch and the same micro-batch count "
                   "per rank (planned and simulated at PP 1 only, not built); train with "
                   "--pipeline-model-parallel-size 1, or with --wlb-cp-sharding adaptive")

#: the granularities tried (a document's per-rank price at most alpha x the ideal); inf: only memory decides
ALPHAS: tuple[float, ...] = (float("inf"), 1.0, 0.5, 0.25, 0.125, 1 / 16, 1 / 32, 1 / 64)
#: documents of the slowest slot tried per promotion step (costliest first, one of each group size and price)
_PROMOTION_TRIES = 6
#: documents of the slowest slot tried per move / swap of the final placement's local search (costliest first)
_REFINE_TRIES = 32
#: moves / swaps of that local search at most
_REFINE_ROUNDS = 256


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

    @property
    def slowest_seconds(self) -> float:
        return float(self.rank_seconds.max()) if self.rank_seconds.size else 0.0

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


def plan_dynamic_cp(lengths: Sequence[int] | np.ndarray, ranks: int, max_tokens_per_rank: int,
                    costs: dict[int, CostModel], alphas: Sequence[float] = ALPHAS,
                    promotions: int = 64) -> DynamicCPPlan:
    """The dynamic-CP plan of one global batch (see the module doc): ``lengths`` its documents, ``ranks`` the
    stage's DP x CP slots, ``costs`` the cost model per group size (``group_cost_models``)."""
    d = np.asarray(lengths, dtype=np.int64).reshape(-1)
    if d.size and int(d.min()) < 1:
        raise ValueError(f"document lengths must be >= 1 token, got {int(d.min())}")
    if ranks < 1:
        raise ValueError(f"ranks={ranks}: a stage needs at least one DP x CP rank")
    if max_tokens_per_rank < 1:
        raise ValueError(f"max_tokens_per_rank={max_tokens_per_rank}: must be a positive token count")
    sizes = sorted(g for g in costs if g <= ranks)
    if not sizes or sizes[0] != 1 or any(b != 2 * a for a, b in zip(sizes, sizes[1:], strict=False)):
        raise ValueError(f"costs must price the group sizes 1, 2, 4, ... up to at most {ranks}, got {sorted(costs)}")
    largest = sizes[-1]
    prices = {g: _price(costs[g], d) for g in sizes}
    ideal = float(prices[1].sum()) / ranks
    g_min = _min_groups(d, max_tokens_per_rank, largest)
    best: DynamicCPPlan | None = None
    best_group, best_order = g_min, True
    for alpha in alphas:
        group = _groups_for(g_min, sizes, prices, alpha * ideal)
        for by_price in (True, False):
            plan = _place(d, group, ranks, max_tokens_per_rank, costs, prices, ideal, alpha, by_price)
            if best is None or _score(plan) < _score(best):
                best, best_group, best_order = plan, group, by_price
    assert best is not None
    # promote the k costliest documents one size up at once (k = 1 .. ranks): identical window-long documents
    # that leave some blocks one item heavier need several promotions together before the slowest slot moves
    start = best_group
    movable = np.flatnonzero(start < largest)
    if promotions and movable.size:
        share = np.array([prices[int(g)][i] for i, g in enumerate(start)])
        order = movable[np.argsort(-share[movable], kind="stable")]
        for k in range(1, min(ranks, order.size) + 1):
            group = start.copy()
            group[order[:k]] *= 2
            plan = _place(d, group, ranks, max_tokens_per_rank, costs, prices, ideal, best.alpha, best_order)
            if _score(plan) < _score(best):
                best, best_group = plan, group
    best, best_group = _promote(best, best_group, d, max_tokens_per_rank, costs, prices, largest, promotions,
                                best_order)
    refined = _place(d, best_group, ranks, max_tokens_per_rank, costs, prices, ideal, best.alpha, best_order,
                     refine=_REFINE_ROUNDS)
    return refined if _score(refined) < _score(best) else best


def _groups_for(g_min: np.ndarray, sizes: list[int], prices: dict[int, np.ndarray], limit: float) -> np.ndarray:
    """Each document's group: ``g_min`` doubled while its per-rank price exceeds ``limit`` (up to the largest)."""
    group = g_min.copy()
    if np.isfinite(limit):
        for g in sizes[:-1]:
            group[(group == g) & (prices[g] > limit)] = 2 * g
    return group


def _promote(plan: DynamicCPPlan, group: np.ndarray, d: np.ndarray, cap: int, costs: dict[int, CostModel],
             prices: dict[int, np.ndarray], largest: int, promotions: int,
             by_price: bool) -> tuple[DynamicCPPlan, np.ndarray]:
    """Local search: while it shortens the slowest slot (or leaves fewer slots that slow), double the group of
    one of that slot's costliest documents (a coarse item the blocks cannot balance becomes finer shares)."""
    for _ in range(promotions):
        slow = int(np.argmax(plan.rank_seconds))
        docs = [i for mb in plan.rank_micro_batches[slow] for i in mb.docs if group[i] < largest]
        distinct = {(int(group[i]), round(float(prices[int(group[i])][i]), 9)): i for i in docs}  # alike: try one
        for i in sorted(distinct.values(), key=lambda i: -float(prices[int(group[i])][i]))[:_PROMOTION_TRIES]:
            trial = group.copy()
            trial[i] *= 2
            candidate = _place(d, trial, plan.ranks, cap, costs, prices, plan.ideal_seconds, plan.alpha, by_price)
            if _score(candidate) < _score(plan):
                plan, group = candidate, trial
                break
        else:
            break
    return plan, group


def _score(plan: DynamicCPPlan) -> tuple[float, int]:
    """What the local search lowers: the slowest slot's seconds, then how many slots take (about) that long."""
    top = plan.slowest_seconds
    return round(top, 12), int(np.sum(plan.rank_seconds >= top * (1 - 1e-9)))


def _place(d: np.ndarray, group: np.ndarray, ranks: int, cap: int, costs: dict[int, CostModel],
           prices: dict[int, np.ndarray], ideal: float, alpha: float, by_price: bool = True,
           refine: int = 0) -> DynamicCPPlan:
    """Steps 3 and 4 of the module doc for the documents' group sizes ``group``: placed costliest first
    (``by_price``) or larger groups first, then costliest; then up to ``refine`` moves or swaps (``_refine``)."""
    price = np.array([prices[int(g)][i] for i, g in enumerate(group)]) if d.size else np.zeros(0)
    load = np.zeros(ranks)
    first = np.zeros(d.size, dtype=np.int64)
    for i in (np.argsort(-price, kind="stable") if by_price else np.lexsort((-price, -group))):
        g = int(group[i])
        blocks = load[: ranks // g * g].reshape(-1, g).max(axis=1)
        b = int(np.argmin(blocks))
        load[b * g:(b + 1) * g] += price[i]
        first[i] = b * g
    if refine:
        _refine(price, group, first, load, refine)
    placed: dict[tuple[int, int], list[int]] = {}  # (group size, first rank) -> documents
    for i in range(d.size):
        placed.setdefault((int(group[i]), int(first[i])), []).append(i)
    rank_mbs: list[list[GroupMicroBatch]] = [[] for _ in range(ranks)]
    for (g, lead), docs in sorted(placed.items(), key=lambda kv: (-kv[0][0], kv[0][1])):
        over = _overhead(costs[g])
        for bin_docs in _first_fit(docs, d, g * cap):
            mb = GroupMicroBatch(lead, g, tuple(bin_docs), int(d[bin_docs].sum()),
                                 float(price[bin_docs].sum()) + over)
            for j in range(lead, lead + g):
                rank_mbs[j].append(mb)
    seconds = np.array([sum(mb.seconds for mb in mbs) for mbs in rank_mbs])
    return DynamicCPPlan(ranks, tuple(tuple(m) for m in rank_mbs), seconds, ideal, alpha)


def _load_score(load: np.ndarray) -> tuple[float, int]:
    top = float(load.max())
    return round(top, 12), int(np.sum(load >= top * (1 - 1e-9)))


def _refine(price: np.ndarray, group: np.ndarray, first: np.ndarray, load: np.ndarray, rounds: int) -> None:
    """Local search on a placement (in place): move a document of the slowest slot to another block of its size,
    or swap it with a cheaper document of the same size elsewhere, while that lowers the slowest slot (or the
    number of slots that slow)."""
    ranks = load.size
    for _ in range(rounds):
        slow = int(np.argmax(load))
        score = _load_score(load)
        on_slow = np.flatnonzero((first <= slow) & (slow < first + group))
        done = False
        for i in on_slow[np.argsort(-price[on_slow], kind="stable")][:_REFINE_TRIES]:
            g, b0, p = int(group[i]), int(first[i]), float(price[i])
            nb = ranks // g
            rest = load.copy()
            rest[b0:b0 + g] -= p
            block_max = rest[:nb * g].reshape(nb, g).max(axis=1)
            moves = np.maximum(block_max + p, rest.max())
            moves[b0 // g] = np.inf
            same = np.flatnonzero((group == g) & (first != b0) & (price < p))
            swaps = np.maximum(block_max[first[same] // g] + p - price[same], block_max[b0 // g] + price[same])
            for kind, values in (("move", moves), ("swap", swaps)):
                if values.size == 0:
                    continue
                k = int(np.argmin(values))
                trial = load.copy()
                trial[b0:b0 + g] -= p
                if kind == "move":
                    trial[k * g:(k + 1) * g] += p
                else:
                    j = int(same[k])
                    bj = int(first[j])
                    trial[bj:bj + g] += p - price[j]
                    trial[b0:b0 + g] += price[j]
                if _load_score(trial) < score:
                    if kind == "move":
                        first[i] = k * g
                    else:
                        first[i], first[j] = bj, b0
                    load[:] = trial
                    done = True
                    break
            if done:
                break
        if not done:
            return


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
