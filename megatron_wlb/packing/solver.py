"""``fixed-solver``: the paper's fixed-length ILP (Eq. 1) solved by HiGHS, warm-started by greedy.

Per window: ``fixed-greedy`` decides *which* pieces the window takes (carried first, then largest
first, until the fixed-capacity bins are full); then a MILP re-assigns exactly those pieces to the
``window * dp * n`` bins to minimise the largest bin workload under the ``seq_len`` capacity:

    min z  s.t.  sum_j x_ij = 1,  sum_i d_i x_ij <= seq_len,  sum_i w_i x_ij <= z,  x_ij in {0, 1}

where w_i is the piece's forward + backward latency from the cost model (Eq. 1 uses d_i^2; with
no cost model we do too). Pieces of equal length have equal weight and are interchangeable, so
they form one group g with an integer column y_gj in [0, count_g] (its pieces in bin j) and the
row sum_j y_gj = count_g: a window of 224 one-token pieces into 70 bins is 70 columns, not 13K
binaries whose symmetric solutions the search would otherwise wander through (25-60 s a node).
When every length is distinct each group is one piece and this *is* the per-piece model above.
Bins are identical, so we add the standard symmetry cut "piece i (in placement order) only uses
bins 0..i", for a group "bins 0..(position of its last piece)"; the greedy solution, with its
bins relabelled by first use, satisfies it and is handed to HiGHS as the incumbent. Decoding
keeps each piece in its greedy bin while the solver's count for its group there allows, the rest
take the free places in placement order. The result is never worse than greedy: a solver answer
is taken only if HiGHS reports a feasible solution that re-checks as a valid assignment with a
maximum no larger than greedy's; otherwise (error, no solution) the greedy plan stands.

Why HiGHS (``highspy``): MIT-licensed, on PyPI with wheels, already a dependency of SciPy's
``milp``; unlike ``scipy.optimize.milp`` its Python API takes a warm start (``setSolution``) and
exposes node limits; single-threaded it is deterministic for a given model and limits, which
the "same plan on every rank" invariant needs. OR-Tools CP-SAT would need the objective scaled to
integers and is nondeterministic with several workers.

Determinism: every rank must compute the same plan, so nothing may depend on wall time (a time
limit makes the answer depend on machine speed and load). The solver stops on a *node limit*
(``PackingConfig.solver_nodes``, default 0: the root node (presolve, LP, cuts, heuristics) only,
see docs/packing.md for the measured trade-off) with one thread and a fixed seed, and a window
whose model has more than ``PackingConfig.solver_max_columns`` integer columns keeps the greedy
plan (counted in ``skipped_windows``): HiGHS honours no deterministic work limit inside the root
node (a 62K-column window ran 124 s with a simplex iteration limit of 2,000), so the model size
is the bound.
"""

from __future__ import annotations

from typing import Any

import numpy as np

from megatron_wlb.costmodel import CostModel
from megatron_wlb.packing.base import register_packer
from megatron_wlb.packing.greedy import FixedWindowPacker, placement_order
from megatron_wlb.packing.metrics import piece_latency
from megatron_wlb.packing.types import DocPiece, PackingConfig

DEFAULT_NODE_LIMIT: int = PackingConfig.solver_nodes  # the one default, in PackingConfig


def length_groups(lengths: np.ndarray) -> tuple[np.ndarray, np.ndarray, np.ndarray, np.ndarray]:
    """Pieces of equal length, in order of first appearance: (group per item, count per group, first and
    last item position per group). Equal lengths mean equal weights, so such pieces are interchangeable."""
    lengths = np.asarray(lengths, dtype=np.int64)
    uniq, first, inverse = np.unique(lengths, return_index=True, return_inverse=True)
    rank = np.empty(uniq.size, dtype=np.int64)
    rank[np.argsort(first, kind="stable")] = np.arange(uniq.size)
    group = rank[inverse]
    last = np.zeros(uniq.size, dtype=np.int64)
    np.maximum.at(last, group, np.arange(lengths.size))
    return group, np.bincount(group, minlength=uniq.size), np.sort(first), last


def model_columns(lengths: np.ndarray, bins: int) -> int:
    """Integer columns of the aggregated model: group g (last item at position e) may use bins 0..e."""
    if np.asarray(lengths).size == 0:
        return 0
    _, _, _, last = length_groups(lengths)
    return int(np.minimum(last + 1, bins).sum())


def solve_assignment(lengths: np.ndarray, weights: np.ndarray, bins: int, cap: int,
                     start: np.ndarray | None = None, node_limit: int = DEFAULT_NODE_LIMIT,
                     seed: int = 0, rel_gap: float = 1e-3,
                     stats: dict[str, int] | None = None) -> tuple[np.ndarray | None, str, float]:
    """Solve Eq. 1 for items in placement order; returns (bin per item or None, HiGHS status, bound).

    Items of equal length are one group with an integer count per bin (see the module docstring).
    ``start`` is a valid assignment satisfying the symmetry cut (item i in bins 0..i); the result,
    when not None, is feasible and its maximum workload is at most ``start``'s; it keeps every item
    in its ``start`` bin where the solver's counts allow. ``stats``, when given, receives the model's
    size and HiGHS's node and simplex iteration counts.
    """
    try:  # only this packer needs HiGHS: the rest of the package imports without it
        import highspy
    except ImportError as exc:
        raise ImportError("the fixed-solver packer needs the HiGHS MILP solver: pip install highspy") from exc
    lengths = np.asarray(lengths, dtype=np.int64)
    p = lengths.size
    if p == 0:
        return np.zeros(0, dtype=np.int64), "empty", 0.0
    w = np.asarray(weights, dtype=np.float64)
    scale = w.sum() / bins if w.sum() > 0 else 1.0
    w = w / scale
    group, count, first, last = length_groups(lengths)
    ng = count.size
    g_len, g_w = lengths[first], w[first]
    # Columns: y_(g, j) = pieces of group g in bin j, for j <= min(last_g, bins - 1), then z.
    nj = np.minimum(last, bins - 1) + 1
    col_group = np.repeat(np.arange(ng), nj)
    offs = np.concatenate([[0], np.cumsum(nj)])
    col_bin = np.arange(col_group.size) - offs[col_group]
    nx = col_group.size
    # CSC: each y column has 3 entries (count row g, capacity row ng + j, load row ng + bins + j).
    rows = np.stack([col_group, ng + col_bin, ng + bins + col_bin], axis=1).ravel()
    vals = np.stack([np.ones(nx), g_len[col_group].astype(np.float64), g_w[col_group]], axis=1).ravel()
    rows = np.concatenate([rows, ng + bins + np.arange(bins)])
    vals = np.concatenate([vals, -np.ones(bins)])
    starts = np.concatenate([np.arange(nx + 1) * 3, [3 * nx + bins]])
    upper = np.minimum(count, cap // g_len).astype(np.float64)
    lp = highspy.HighsLp()
    lp.num_col_ = nx + 1
    lp.num_row_ = ng + 2 * bins
    lp.col_cost_ = np.concatenate([np.zeros(nx), [1.0]])
    lp.col_lower_ = np.zeros(nx + 1)
    lp.col_upper_ = np.concatenate([upper[col_group], [highspy.kHighsInf]])
    lp.row_lower_ = np.concatenate([count.astype(np.float64), np.full(2 * bins, -highspy.kHighsInf)])
    lp.row_upper_ = np.concatenate([count.astype(np.float64), np.full(bins, float(cap)), np.zeros(bins)])
    lp.a_matrix_.format_ = highspy.MatrixFormat.kColwise
    lp.a_matrix_.start_ = starts.astype(np.int32)
    lp.a_matrix_.index_ = rows.astype(np.int32)
    lp.a_matrix_.value_ = vals
    lp.integrality_ = [highspy.HighsVarType.kInteger] * nx + [highspy.HighsVarType.kContinuous]
    h = highspy.Highs()
    h.setOptionValue("output_flag", False)
    h.setOptionValue("threads", 1)
    h.setOptionValue("random_seed", int(seed))
    h.setOptionValue("mip_max_nodes", int(node_limit))
    h.setOptionValue("mip_rel_gap", float(rel_gap))
    h.passModel(lp)
    if start is not None:
        start = np.asarray(start, dtype=np.int64)
        y0 = np.zeros(nx + 1)
        np.add.at(y0, offs[group] + start, 1.0)
        y0[nx] = np.bincount(start, weights=w, minlength=bins).max()
        h.setSolution(nx + 1, np.arange(nx + 1, dtype=np.int32), y0)
    h.run()
    status = h.modelStatusToString(h.getModelStatus())
    info = h.getInfo()
    if stats is not None:
        stats.update(groups=int(ng), columns=int(nx), nodes=int(info.mip_node_count),
                     simplex_iterations=int(info.simplex_iteration_count))
    bound = float(info.mip_dual_bound) * scale
    if info.primal_solution_status != 2:  # 2 = feasible
        return None, status, bound
    y = np.rint(np.asarray(h.getSolution().col_value[:nx])).astype(np.int64)
    counts = np.zeros((ng, bins), dtype=np.int64)
    counts[col_group, col_bin] = y
    if (counts < 0).any() or not np.array_equal(counts.sum(axis=1), count):
        return None, status, bound
    return decode_counts(group, counts, start), status, bound


def decode_counts(group: np.ndarray, counts: np.ndarray, start: np.ndarray | None) -> np.ndarray:
    """Bin per item from pieces per (group, bin): an item stays in its ``start`` bin while that bin
    has room for its group, the others take the free places in placement order."""
    free = counts.copy()
    choice = np.full(group.size, -1, dtype=np.int64)
    if start is not None:
        for i, (g, j) in enumerate(zip(group.tolist(), start.tolist())):
            if free[g, j] > 0:
                free[g, j] -= 1
                choice[i] = j
    for i in np.flatnonzero(choice < 0).tolist():
        g = group[i]
        j = int(np.flatnonzero(free[g])[0])
        free[g, j] -= 1
        choice[i] = j
    return choice


@register_packer
class FixedSolverPacker(FixedWindowPacker):
    name = "fixed-solver"

    def __init__(self, config: PackingConfig, cost: CostModel | None = None):
        super().__init__(config, cost)
        self.solver_status: dict[str, int] = {}   # diagnostics: HiGHS status per window
        self.skipped_windows = 0                  # windows over solver_max_columns (greedy plan kept)
        self.node_limit = int(config.solver_nodes)

    def diagnostics(self) -> dict[str, Any]:
        """HiGHS status per solved window and the windows over the column cap (greedy plan kept)."""
        return {"solver_status": dict(self.solver_status), "skipped_windows": self.skipped_windows}

    def _assign(self, carried: list[DocPiece], new: list[DocPiece], bins: int
                ) -> tuple[list[list[DocPiece]], list[DocPiece]]:
        greedy_bins, left = super()._assign(carried, new, bins)
        # Placement order of the greedy pass, bins relabelled by first use (symmetry cut holds).
        order = placement_order(carried, new)
        where: dict[DocPiece, int] = {}
        for j, b in enumerate(greedy_bins):
            for piece in b:
                where[piece] = j
        placed = [piece for piece in order if piece in where]
        if len(placed) <= bins:  # at most one piece per bin: greedy is optimal
            return greedy_bins, left
        relabel: dict[int, int] = {}
        start = np.array([relabel.setdefault(where[piece], len(relabel)) for piece in placed], dtype=np.int64)
        lengths = np.array([piece.length for piece in placed], dtype=np.int64)
        weights = piece_latency(self.cost, lengths)
        greedy_max = np.bincount(start, weights=weights, minlength=bins).max()
        lower = max(weights.max(), weights.sum() / bins)
        if greedy_max <= lower * (1 + 1e-3):
            return greedy_bins, left
        if model_columns(lengths, bins) > self.config.solver_max_columns:
            self.skipped_windows += 1
            return greedy_bins, left
        choice, status, _ = solve_assignment(
            lengths, weights, bins, self.config.seq_len, start=start,
            node_limit=self.node_limit, seed=self.config.seed)
        self.solver_status[status] = self.solver_status.get(status, 0) + 1
        if choice is None:
            return greedy_bins, left
        tokens = np.bincount(choice, weights=lengths, minlength=bins)
        loads = np.bincount(choice, weights=weights, minlength=bins)
        if tokens.max() > self.config.seq_len or choice.min() < 0 or choice.max() >= bins or \
                loads.max() > greedy_max * (1 + 1e-12):
            return greedy_bins, left
        out: list[list[DocPiece]] = [[] for _ in range(bins)]
        for piece, j in zip(placed, choice.tolist()):
            out[j].append(piece)
        return out, left
