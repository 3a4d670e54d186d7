"""What the job waits for: the slowest DP rank's pipeline-schedule time, and how to lower it.

An iteration ends when the slowest DP rank's pipeline (1F1B, or interleaved 1F1B) has run its
``n`` micro-batches; the ranks then meet at the gradient sync. For a given set of micro-batches
that time depends on which rank runs which micro-batch and in what order, not only on the
contents: in 1F1B a heavy micro-batch costs least in second position and most in last.

- ``ScheduleTimer``: the exact makespan of Megatron's (interleaved) 1F1B order for micro-batches
  whose stage times are the same on every stage (the packer's view: each stage runs
  ``layers / pp`` identical layers), as a precomputed longest-path recurrence over the operation
  DAG of ``megatron_wlb.schedule.op_order``. It equals ``simulate_pipeline`` on such input
  (tested) at a fraction of the cost, which the packer needs in its inner loop.
- ``deal_and_order``: assigns ``dp * n`` micro-batches to DP ranks (n each) and orders them within
  a rank to minimise the slowest rank's makespan; deterministic (ties by index, no wall time).

The reported objective (``metrics.schedule_times``) plays the batch through the simulator itself.
"""

from __future__ import annotations

import itertools
from collections.abc import Sequence
from functools import lru_cache

import numpy as np

from megatron_wlb.schedule import op_order


class ScheduleTimer:
    """Makespan of one pipeline over ``micro_batches`` for per-micro-batch stage times."""

    def __init__(self, stages: int, micro_batches: int, virtual_stages: int = 1):
        p, m, v = stages, micro_batches, virtual_stages
        self.stages, self.micro_batches, self.virtual_stages = p, m, v
        orders = [op_order(s, p, m, v) for s in range(p)]
        key_pos: dict[tuple[str, int, int, int], int] = {}
        topo: list[tuple[str, int, int, int]] = []
        ptr = [0] * p
        total = sum(len(o) for o in orders)
        while len(topo) < total:
            progressed = False
            for s in range(p):
                while ptr[s] < len(orders[s]):
                    kind, c, j = orders[s][ptr[s]]
                    dep = self._dependency(kind, c, s, j, p, v)
                    if dep is not None and dep not in key_pos:
                        break
                    key_pos[(kind, c, s, j)] = len(topo)
                    topo.append((kind, c, s, j))
                    ptr[s] += 1
                    progressed = True
            if not progressed:
                raise RuntimeError("pipeline schedule order deadlocks")  # op_order never does
        last_on_stage = [-1] * p
        ops: list[tuple[int, int, int]] = []
        for kind, c, s, j in topo:
            dep = self._dependency(kind, c, s, j, p, v)
            ops.append((j if kind == "F" else m + j, last_on_stage[s], -1 if dep is None else key_pos[dep]))
            last_on_stage[s] = len(ops) - 1
        self._ops = ops
        self._ends = sorted(i for i in last_on_stage if i >= 0)  # each stage's last operation

    @staticmethod
    def _dependency(kind: str, c: int, s: int, j: int, p: int, v: int) -> tuple[str, int, int, int] | None:
        """The operation whose output this one needs (mirrors ``schedule._ready``)."""
        if kind == "F":
            if s > 0:
                return ("F", c, s - 1, j)
            return ("F", c - 1, p - 1, j) if c > 0 else None
        if s < p - 1:
            return ("B", c, s + 1, j)
        return ("B", c + 1, 0, j) if c < v - 1 else ("F", c, s, j)

    def makespan(self, fwd: Sequence[float], bwd: Sequence[float]) -> float:
        """Seconds until the last operation ends; ``fwd[j]``/``bwd[j]``: micro-batch j's stage time."""
        v = self.virtual_stages
        dur = [x / v for x in fwd] + [x / v for x in bwd] if v > 1 else [*fwd, *bwd]
        end = [0.0] * (len(self._ops) + 1)  # end[-1] stays 0: "no predecessor"
        for k, (d, a, b) in enumerate(self._ops):
            ea, eb = end[a], end[b]
            end[k] = (ea if ea > eb else eb) + dur[d]
        return max(end[i] for i in self._ends)

    def makespans(self, fwd: np.ndarray, bwd: np.ndarray) -> np.ndarray:
        """``makespan`` of many orders at once: row r of ``fwd``/``bwd`` is one order's stage times.
        The same float operations in the same sequence, so each entry equals ``makespan`` of that row
        bit for bit; one numpy step per operation instead of one Python loop per order."""
        v = self.virtual_stages
        dur = np.concatenate([fwd, bwd], axis=1).T
        if v > 1:
            dur = dur / v
        end = np.zeros((len(self._ops) + 1, dur.shape[1]))  # end[-1] stays 0: "no predecessor"
        for k, (d, a, b) in enumerate(self._ops):
            np.add(np.maximum(end[a], end[b]), dur[d], out=end[k])
        return end[self._ends].max(axis=0)


@lru_cache(maxsize=64)
def schedule_timer(stages: int, micro_batches: int, virtual_stages: int = 1) -> ScheduleTimer:
    """A cached ``ScheduleTimer`` (building one replays the op orders once)."""
    return ScheduleTimer(stages, micro_batches, virtual_stages)


def fixed_order(totals: Sequence[float], members: Sequence[int]) -> list[int]:
    """The 1F1B rule: second-heaviest, heaviest, the rest by weight descending, lightest last.

    A heavy micro-batch in position 2 overlaps the warm-up; in the last position it runs alone
    through the cool-down, so the rule keeps the heaviest away from the end.
    """
    desc = sorted(members, key=lambda i: (-totals[i], i))
    if len(desc) < 2:
        return desc
    return [desc[1], desc[0], *desc[2:]]


def _improve_order(order: list[int], fwd: Sequence[float], bwd: Sequence[float], timer: ScheduleTimer,
                   passes: int) -> tuple[list[int], float]:
    """Pairwise-swap hill climbing of one rank's order under the exact timer (first improvement)."""
    def cost(o: list[int]) -> float:
        return timer.makespan([fwd[i] for i in o], [bwd[i] for i in o])

    best = cost(order)
    n = len(order)
    for _ in range(passes):
        improved = False
        for a in range(n - 1):
            for b in range(a + 1, n):
                order[a], order[b] = order[b], order[a]
                c = cost(order)
                if c < best * (1 - 1e-12):
                    best, improved = c, True
                else:
                    order[a], order[b] = order[b], order[a]
        if not improved:
            break
    return order, best


#: swap rounds of the dealing step per DP rank (most of the gain comes in the first few)
SWAP_ROUNDS = 2
#: ranks of at most this many micro-batches try every order (4! = 24 timer calls, ~0.1 ms)
EXHAUSTIVE_MAX_N = 4
#: larger ranks of at most this many get the swap search on top of the fixed rule
SEARCH_MAX_N = 8


def best_order(members: Sequence[int], fwd: Sequence[float], bwd: Sequence[float], timer: ScheduleTimer,
               totals: Sequence[float]) -> list[int]:
    """The order of one rank's micro-batches: exhaustive for small ranks, else the fixed rule
    improved by pairwise swaps; never worse than the given (placement) order."""
    def cost(o: Sequence[int]) -> float:
        return timer.makespan([fwd[i] for i in o], [bwd[i] for i in o])

    members = list(members)
    if len(members) <= EXHAUSTIVE_MAX_N:
        orders = np.asarray(members, dtype=np.int64)[_permutations(len(members))]
        costs = timer.makespans(np.asarray(fwd, dtype=np.float64)[orders],
                                np.asarray(bwd, dtype=np.float64)[orders]).tolist()
        best, best_cost = members, cost(members)
        for k, c in enumerate(costs):  # the first strict improvement over the running best, as before
            if c < best_cost * (1 - 1e-12):
                best, best_cost = orders[k].tolist(), c
        return best
    order = fixed_order(totals, members)
    if len(members) <= SEARCH_MAX_N:
        order, c = _improve_order(order, fwd, bwd, timer, passes=2)
    else:
        c = cost(order)
    return order if c < cost(members) * (1 - 1e-12) else members


@lru_cache(maxsize=8)
def _permutations(n: int) -> np.ndarray:
    """Every order of ``n`` positions, in ``itertools.permutations`` order (rows)."""
    return np.asarray(list(itertools.permutations(range(n))), dtype=np.int64).reshape(-1, n)


def deal_and_order(fwd: Sequence[float], bwd: Sequence[float], dp: int, n: int, stages: int,
                   virtual_stages: int = 1) -> list[int]:
    """Permutation ``perm`` of the ``dp * n`` micro-batches: position ``r * n + k`` runs ``perm[...]``.

    1. Deal (dp > 1): heaviest first, each to the rank of least total work that has fewer than
       ``n`` (LPT with a cardinality bound), so heavy micro-batches spread over the ranks.
    2. Swap (dp > 1): move work from the rank with the largest ``sum + (stages - 1) * max``
       (1F1B's shape: the bubble is paid at the pace of the heaviest micro-batch) to the others
       while that lowers the larger of the two.
    3. Order within each rank (``best_order``): every order for n <= EXHAUSTIVE_MAX_N, else
       ``fixed_order`` then (n <= SEARCH_MAX_N) pairwise swaps, under the exact ``ScheduleTimer``.
    Deterministic: ties break by index, improvements must be strict.
    """
    m = dp * n
    if len(fwd) != m or len(bwd) != m:
        raise ValueError(f"deal_and_order needs dp * n = {m} forward and backward times, got {len(fwd)}, {len(bwd)}")
    totals = [f + b for f, b in zip(fwd, bwd)]
    if dp == 1:
        ranks = [list(range(n))]
    else:
        ranks = _deal(totals, dp, n, stages)
    timer = schedule_timer(stages, n, virtual_stages)
    perm: list[int] = []
    for members in ranks:
        perm.extend(best_order(sorted(members), fwd, bwd, timer, totals))
    return perm


def _deal(totals: Sequence[float], dp: int, n: int, stages: int) -> list[list[int]]:
    sums = [0.0] * dp
    ranks: list[list[int]] = [[] for _ in range(dp)]
    for i in sorted(range(len(totals)), key=lambda i: (-totals[i], i)):
        r = min((r for r in range(dp) if len(ranks[r]) < n), key=lambda r: (sums[r], r))
        ranks[r].append(i)
        sums[r] += totals[i]
    t = np.asarray(totals, dtype=np.float64)
    bubble = stages - 1

    def shape(members: list[int]) -> float:
        w = t[members]
        return float(w.sum() + bubble * w.max())

    for _ in range(SWAP_ROUNDS * dp):
        scores = [shape(rk) for rk in ranks]
        worst = max(range(dp), key=lambda r: (scores[r], -r))
        best_gain, best_move = 0.0, None
        for other in range(dp):
            if other == worst:
                continue
            a_idx = np.asarray(ranks[worst])
            b_idx = np.asarray(ranks[other])
            # new score of both ranks for every swap (a in worst, b in other), vectorised
            wa, wb = t[a_idx], t[b_idx]
            sa, sb = wa.sum(), wb.sum()
            delta = wb[None, :] - wa[:, None]
            max_a_wo = _max_without(wa)
            max_b_wo = _max_without(wb)
            new_a = sa + delta + bubble * np.maximum(max_a_wo[:, None], wb[None, :])
            new_b = sb - delta + bubble * np.maximum(max_b_wo[None, :], wa[:, None])
            new_worst = np.maximum(new_a, new_b)
            k = int(np.argmin(new_worst))  # first minimum: deterministic
            gain = scores[worst] - float(new_worst.flat[k])
            if gain > best_gain * (1 + 1e-12) and gain > 1e-12 * scores[worst]:
                best_gain, best_move = gain, (other, k // len(b_idx), k % len(b_idx))
        if best_move is None:
            break
        other, ia, ib = best_move
        ranks[worst][ia], ranks[other][ib] = ranks[other][ib], ranks[worst][ia]
    return ranks


def _max_without(w: np.ndarray) -> np.ndarray:
    """``out[i] = max(w without element i)`` (0 for a single element)."""
    if w.size == 1:
        return np.zeros(1)
    order = np.argsort(-w, kind="stable")
    top, second = w[order[0]], w[order[1]]
    out = np.full(w.size, top)
    out[order[0]] = second
    return out
