"""``fixed-solver``: the paper's fixed-length ILP (Eq. 1) solved by HiGHS, warm-started by greedy.

Per window: ``fixed-greedy`` decides *which* pieces the window takes (carried first, then largest
first, until the fixed-capacity bins are full); then a MILP re-assigns exactly those pieces to the
``window * dp * n`` bins to minimise the largest bin workload under the ``seq_len`` capacity:

    min z  s.t.  sum_j x_ij = 1,  sum_i d_i x_ij <= seq_len,  sum_i w_i x_ij <= z,  x_ij in {0, 1}

where w_i is the piece's forward + backward latency from the cost model (Eq. 1 uses d_i^2; with
no cost model we do too). Bins are identical, so we add the standard symmetry cut "piece i (in
placement order) only uses bins 0..i"; the greedy solution, with its bins relabelled by first use,
satisfies it and is handed to HiGHS as the incumbent. The result is never worse than greedy: a
solver answer is taken only if HiGHS reports a feasible solution that re-checks as a valid
assignment with a maximum no larger than greedy's; otherwise (error, no solution) the greedy plan stands.

Why HiGHS (``highspy``): MIT-licensed, on PyPI with wheels, already a dependency of SciPy's
``milp``; unlike ``scipy.optimize.milp`` its Python API takes a warm start (``setSolution``) and
exposes node limits; single-threaded it is deterministic for a given model and limits, which
the "same plan on every rank" invariant needs. OR-Tools CP-SAT would need the objective scaled to
integers and is nondeterministic with several workers.

Determinism: every rank must compute the same plan, so nothing may depend on wall time (a time
limit makes the answer depend on machine speed and load). The solver stops on a *node limit*
(``PackingConfig.solver_nodes``, default 0: the root node (presolve, LP, cuts, heuristics) only,
see docs/packing.md for the measured trade-off) with one thread and a fixed seed, and a window
whose model has more than ``PackingConfig.solver_max_columns`` binary columns keeps the greedy
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


def solve_assignment(lengths: np.ndarray, weights: np.ndarray, bins: int, cap: int,
                     start: np.ndarray | None = None, node_limit: int = DEFAULT_NODE_LIMIT,
                     seed: int = 0, rel_gap: float = 1e-3) -> tuple[np.ndarray | None, str, float]:
    """Solve Eq. 1 for items in placement order; returns (bin per item or None, HiGHS status, bound).

    ``start`` is a valid assignment satisfying the symmetry cut (item i in bins 0..i); the result,
    when not None, is feasible and its maximum workload is at most ``start``'s.
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
    # Columns: x_(i, j) for j <= min(i, bins - 1), then z.
    nj = np.minimum(np.arange(p), bins - 1) + 1
    col_item = np.repeat(np.arange(p), nj)
    offs = np.concatenate([[0], np.cumsum(nj)])
    col_bin = np.arange(col_item.size) - offs[col_item]
    nx = col_item.size
    # CSC: each x column has 3 entries (assign row i, capacity row p + j, load row p + bins + j).
    rows = np.stack([col_item, p + col_bin, p + bins + col_bin], axis=1).ravel()
    vals = np.stack([np.ones(nx), lengths[col_item].astype(np.float64), w[col_item]], axis=1).ravel()
    rows = np.concatenate([rows, p + bins + np.arange(bins)])
    vals = np.concatenate([vals, -np.ones(bins)])
    starts = np.concatenate([np.arange(nx + 1) * 3, [3 * nx + bins]])
    lp = highspy.HighsLp()
    lp.num_col_ = nx + 1
    lp.num_row_ = p + 2 * bins
    lp.col_cost_ = np.concatenate([np.zeros(nx), [1.0]])
    lp.col_lower_ = np.zeros(nx + 1)
    lp.col_upper_ = np.concatenate([np.ones(nx), [highspy.kHighsInf]])
    lp.row_lower_ = np.concatenate([np.ones(p), np.full(2 * bins, -highspy.kHighsInf)])
    lp.row_upper_ = np.concatenate([np.ones(p), np.full(bins, float(cap)), np.zeros(bins)])
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
        x0 = np.zeros(nx + 1)
        x0[offs[:-1] + np.asarray(start)] = 1.0
        x0[nx] = np.bincount(start, weights=w, minlength=bins).max()
        h.setSolution(nx + 1, np.arange(nx + 1, dtype=np.int32), x0)
    h.run()
    status = h.modelStatusToString(h.getModelStatus())
    info = h.getInfo()
    bound = float(info.mip_dual_bound) * scale
    if info.primal_solution_status != 2:  # 2 = feasible
        return None, status, bound
    x = np.asarray(h.getSolution().col_value[:nx])
    # The bin of item i is the column of its block with the largest value (integral up to tolerance).
    best = np.full(p, -1.0)
    choice = np.zeros(p, dtype=np.int64)
    np.maximum.at(best, col_item, x)
    hit = x >= best[col_item] - 1e-9
    choice[col_item[hit]] = col_bin[hit]
    return choice, status, bound


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
        columns = int(np.minimum(np.arange(lengths.size), bins - 1).sum() + lengths.size)
        if columns > self.config.solver_max_columns:
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
