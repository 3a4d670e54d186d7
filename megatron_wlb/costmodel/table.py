"""Attention's cost per (query, key) pair as a function of the query run's length: a small table of knot
lengths, interpolated linearly in log2(length) and held constant beyond its ends (pure: no torch).

Why: a cost linear in pairs prices every pair alike, but the hardware does not (the CPU's reference
kernel's per-pair cost rises ~1.6x from 256- to 1,024-token documents as its score matrices leave the
cache; a GPU kernel's tiles are poorly filled by short runs). With ``c(q) = sum_k c_k * phi_k(q)`` (hat
functions ``phi_k`` over the knots), a query run's attention ``pairs * c(q)`` is still linear in the
knot costs ``c_k``: the column of knot ``k`` is ``sum over runs of pairs * phi_k(q)``, so the fit stays a
small non-negative least squares (``fit_table``).

Conditioning: neighbouring knot columns overlap (a run between two knots loads both) and, in packed
micro-batches of near-equal tokens, the per-token and per-micro-batch columns are nearly collinear. The
fit scales its columns to unit norm, adds a penalty on the knot costs' differences relative to the
one-knot (linear-in-pairs) cost (a flat table is the prior, so a knot the data barely sees stays near
its neighbours instead of swinging), adds a small ridge on every scaled column (which splits collinear
columns by the smallest coefficients instead of arbitrarily), merges knots that carry too few of the
pairs, and reports the scaled Gram matrix's condition number with and without the regularisation.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np

#: at most this many knots (a small table: the fit is 2^(knots + 3) supports of exact NNLS)
MAX_KNOTS = 5
#: knots at least this ratio apart (an octave: closer knots are nearly the same column)
KNOT_RATIO = 2.0
#: a knot whose column carries less than this share of all pairs is merged into its neighbour
MIN_KNOT_SHARE = 0.03
#: penalty weight (in fitted points) on each relative difference of neighbouring knot costs
SMOOTHING = 1e-4
#: ridge on every unit-scaled column (bounds the condition number near 1 / RIDGE)
RIDGE = 1e-7


def pair_basis(lengths: np.ndarray | Sequence[float], knots: Sequence[float]) -> np.ndarray:
    """(runs, knots) weights of the hat functions in log2(length): a run at a knot loads it with 1, one
    between two knots loads both (summing to 1), one outside the table loads the nearest end knot."""
    k = np.log2(np.asarray(knots, dtype=np.float64))
    q = np.log2(np.maximum(np.asarray(lengths, dtype=np.float64), 1.0))
    if k.size == 1:
        return np.ones((q.size, 1))
    q = np.clip(q, k[0], k[-1])
    j = np.clip(np.searchsorted(k, q, side="right") - 1, 0, k.size - 2)
    w = (q - k[j]) / (k[j + 1] - k[j])
    out = np.zeros((q.size, k.size))
    rows = np.arange(q.size)
    out[rows, j] = 1.0 - w
    out[rows, j + 1] += w
    return out


def check_knots(knots: Sequence[float], where: str = "attention_table.lengths") -> tuple[float, ...]:
    """The knots as floats; a one-line error unless they are strictly increasing positive numbers."""
    values = tuple(float(x) for x in knots)
    if not values or any(not np.isfinite(v) or v < 1 for v in values) or any(
            a >= b for a, b in zip(values, values[1:])):
        raise ValueError(f"{where} {list(knots)[:8]}: expected strictly increasing lengths >= 1")
    return values


def table_columns(run_lengths: Sequence[Sequence[float]], run_pairs: Sequence[Sequence[float]],
                  knots: Sequence[float]) -> np.ndarray:
    """(points, knots): per point (a micro-batch or a kernel call), the sum over its query runs of the run's
    pairs times its hat weights; ``columns @ costs`` is the points' attention pair cost."""
    out = np.zeros((len(run_lengths), len(knots)))
    for i, (lengths, pairs) in enumerate(zip(run_lengths, run_pairs)):
        if len(lengths):
            out[i] = np.asarray(pairs, dtype=np.float64) @ pair_basis(lengths, knots)
    return out


def choose_knots(lengths: np.ndarray, pairs: np.ndarray, max_knots: int = MAX_KNOTS) -> tuple[float, ...]:
    """Knots spanning the pair-weighted 2nd-98th percentiles of the run lengths, log-spaced at least
    ``KNOT_RATIO`` apart, at most ``max_knots``; then knots carrying under ``MIN_KNOT_SHARE`` of the pairs
    are merged away (an end knot into its neighbour), so each knot is seen by the data."""
    q = np.asarray(lengths, dtype=np.float64)
    w = np.asarray(pairs, dtype=np.float64)
    keep = (q >= 1) & (w > 0)
    q, w = q[keep], w[keep]
    if not q.size:
        raise ValueError("choose_knots: no query run with pairs > 0 to place the table's knots on")
    order = np.argsort(q)
    q, w = q[order], w[order]
    cdf = np.cumsum(w) / w.sum()
    lo = float(q[int(np.searchsorted(cdf, 0.02))])
    hi = float(q[min(int(np.searchsorted(cdf, 0.98)), q.size - 1)])
    count = int(min(max_knots, np.floor(np.log(max(hi / lo, 1.0)) / np.log(KNOT_RATIO) + 1e-9) + 1))
    knots = list(np.unique(np.round(np.geomspace(lo, hi, max(count, 1)))))
    while len(knots) > 1:
        share = w @ pair_basis(q, knots) / w.sum()
        weakest = int(np.argmin(share))
        if share[weakest] >= MIN_KNOT_SHARE:
            break
        del knots[weakest]
    return tuple(float(k) for k in knots)


def nnls_gram(gram: np.ndarray, rhs: np.ndarray, points: float) -> np.ndarray:
    """Non-negative ``c`` minimising ``|A c - 1|^2`` from its normal equations alone (``gram = A^T A``,
    ``rhs = A^T 1``, ``points`` = the rows), so statistics summed over ranks fit as the rows would. Exact
    for the few columns here: the optimum is the unconstrained fit on its own support, so every support
    is tried and the non-negative one with the least residual kept (columns scaled to unit norm first)."""
    g, r = np.asarray(gram, dtype=np.float64), np.asarray(rhs, dtype=np.float64)
    scale = np.sqrt(np.diag(g)).copy()
    scale[scale == 0] = 1.0
    g, r = g / np.outer(scale, scale), r / scale
    best, best_res = np.zeros(r.size), float(points)
    for support in range(1, 2 ** r.size):
        cols = [j for j in range(r.size) if support >> j & 1]
        sub = g[np.ix_(cols, cols)]
        coef, *_ = np.linalg.lstsq(sub, r[cols], rcond=None)
        if np.any(coef < 0):
            continue
        res = float(points - 2.0 * coef @ r[cols] + coef @ sub @ coef)
        if res < best_res:
            best, best_res = np.zeros(r.size), res
            best[cols] = coef
    return best / scale


@dataclass(frozen=True)
class TableFit:
    """Non-negative coefficients of ``[knot columns..., other columns...]`` and the scaled Gram matrix's
    condition number without (``condition``) and with (``condition_regularised``) the regularisation."""

    coef: np.ndarray
    condition: float
    condition_regularised: float
    rel_err: float


def fit_table(x: np.ndarray, y: np.ndarray, knots: int, flat_cost: float,
              smoothing: float = SMOOTHING, ridge: float = RIDGE) -> TableFit:
    """Relative non-negative least squares of ``y ~ x @ coef`` (``x``'s first ``knots`` columns are
    ``table_columns``), penalising ``smoothing * points * sum(((c_k+1 - c_k) / flat_cost) ** 2)`` and
    ``ridge`` on every unit-scaled column (see the module docstring); ``flat_cost``: the one-knot fit's
    per-pair cost, the scale of the knot costs (its absolute value: a zero falls back to the mean)."""
    x, y = np.asarray(x, dtype=np.float64), np.asarray(y, dtype=np.float64)
    if x.ndim != 2 or x.shape[0] != y.size or not 0 < knots <= x.shape[1]:
        raise ValueError(f"fit_table: x of shape {x.shape} for {y.size} points and {knots} knot columns")
    if np.any(~np.isfinite(x)) or np.any(~np.isfinite(y)) or np.any(y <= 0):
        raise ValueError("fit_table: every point needs finite columns and a positive time")
    a = x / y[:, None]
    gram, rhs, n = a.T @ a, a.sum(axis=0), float(y.size)
    scale = np.sqrt(np.diag(gram)).copy()
    scale[scale == 0] = 1.0
    penalty = np.zeros_like(gram)
    if knots > 1:
        if not flat_cost > 0:
            flat_cost = float(np.mean(y) / max(np.mean(x[:, :knots].sum(axis=1)), 1e-300))
        diff = np.diff(np.eye(knots), axis=0)
        penalty[:knots, :knots] = smoothing * n * diff.T @ diff / flat_cost ** 2
    regularised = gram + penalty + ridge * np.diag(scale ** 2)
    coef = nnls_gram(regularised, rhs, n)
    return TableFit(coef=coef, condition=_condition(gram, scale), condition_regularised=_condition(regularised, scale),
                    rel_err=float(np.mean(np.abs(x @ coef - y) / y)))


def _condition(gram: np.ndarray, scale: np.ndarray) -> float:
    """Condition number of the Gram matrix with its columns scaled to unit norm (inf when singular)."""
    g = gram / np.outer(scale, scale)
    s = np.linalg.svd(g, compute_uv=False)
    return float(s[0] / s[-1]) if s[-1] > 0 else float("inf")
