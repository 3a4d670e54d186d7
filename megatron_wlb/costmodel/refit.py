"""The online cost model: W(d) refitted from a run's own measured micro-batches, as statistics that add
across ranks (pure: no torch).

A fit of measured micro-batches (``fit_profile`` on a profile's ``micro_batches`` section) is a
non-negative relative least-squares fit of ``fwd = a*pairs + b*tokens + c`` (and the same for the
backward). Its normal equations are all it needs: ``RefitStats`` holds them, one fixed-size vector
per rank that a SUM all-reduce combines, so every rank solves the same system from the same numbers
and computes the same coefficients, whatever the number of ranks or rows. ``cost_state`` /
``cost_model_from_state`` carry a refitted model through a checkpoint.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass, fields, replace
from typing import Any

import numpy as np

from megatron_wlb.costmodel.model import CalibratedCostModel, CostModel, ProfileFit, head_ratio, nnls_gram
from megatron_wlb.costmodel.shapes import ModelShape

COLUMNS = 4  # causal pairs, tokens (the LM head's at its price in layers), query runs, 1 per micro-batch
REFIT_FORMAT = "megatron-wlb-refit/1"


def design(points: dict[str, Any], model: ModelShape) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """(x, forward, backward) of a ``micro_batches`` section (``costmodel.trace.profile_points``): columns
    ``COLUMNS``; a section without ``runs`` (or ``head_tokens``) has that column 0, and its coefficient 0."""
    p, t, f, b = (np.asarray(points[k], dtype=np.float64) for k in ("pairs", "tokens", "fwd_s", "bwd_s"))
    head = np.asarray(points.get("head_tokens", np.zeros_like(t)), dtype=np.float64)
    runs = np.asarray(points.get("runs", np.zeros_like(t)), dtype=np.float64)
    x = np.stack([p, t + head_ratio(model) * head, runs, np.ones_like(t)], axis=1)
    return x, f, b


@dataclass(frozen=True)
class RefitStats:
    """Normal equations of the relative least-squares fits (rows of ``x / y``, target 1) of forward and
    backward, and the sum of backward / forward ratios; ``vector()`` / ``from_vector`` for a SUM all-reduce."""

    gram_fwd: np.ndarray
    rhs_fwd: np.ndarray
    gram_bwd: np.ndarray
    rhs_bwd: np.ndarray
    points: float
    ratio_sum: float

    SIZE = 2 * (COLUMNS * COLUMNS + COLUMNS) + 2

    @classmethod
    def empty(cls) -> RefitStats:
        return cls.from_vector(np.zeros(cls.SIZE))

    @classmethod
    def of(cls, points: dict[str, Any], model: ModelShape) -> RefitStats:
        """The statistics of measured micro-batches (points with positive times only)."""
        x, f, b = design(points, model)
        keep = (f > 0) & (b > 0)
        x, f, b = x[keep], f[keep], b[keep]
        af, ab = x / f[:, None], x / b[:, None]
        return cls(af.T @ af, af.sum(axis=0), ab.T @ ab, ab.sum(axis=0), float(f.size), float((b / f).sum()))

    def vector(self) -> np.ndarray:
        return np.concatenate([self.gram_fwd.ravel(), self.rhs_fwd, self.gram_bwd.ravel(), self.rhs_bwd,
                               [self.points, self.ratio_sum]])

    @classmethod
    def from_vector(cls, v: np.ndarray) -> RefitStats:
        v = np.asarray(v, dtype=np.float64)
        if v.shape != (cls.SIZE,):
            raise ValueError(f"refit statistics: expected {cls.SIZE} numbers, got shape {v.shape}")
        g = COLUMNS * COLUMNS
        k = g + COLUMNS
        return cls(v[:g].reshape(COLUMNS, COLUMNS), v[g:k], v[k:k + g].reshape(COLUMNS, COLUMNS),
                   v[k + g:2 * k], float(v[-2]), float(v[-1]))

    def __add__(self, other: RefitStats) -> RefitStats:
        return RefitStats.from_vector(self.vector() + other.vector())

    def fit(self, model: ModelShape) -> ProfileFit:
        """The micro-batch fit (``fit_profile`` fits a profile's ``micro_batches`` section with it):
        forward and backward each ``a*pairs + b*tokens + r*runs + c``, non-negative. bwd_attention = a_b /
        a_f and bwd_linear = b_b / b_f (the mean measured ratio where a coefficient is 0). The cost model
        charges the per-run and per-micro-batch constants forward and x bwd_attention / bwd_linear backward,
        so they are set to (r_f + r_b) / (1 + bwd_attention) and (c_f + c_b) / (1 + bwd_linear): the
        forward + backward the packer balances is the fitted one exactly, only its split is approximate."""
        if self.points < 3:
            raise ValueError(f"a micro-batch fit needs >= 3 measured micro-batches, got {self.points:g}")
        cf = nnls_gram(self.gram_fwd, self.rhs_fwd, self.points)
        cb = nnls_gram(self.gram_bwd, self.rhs_bwd, self.points)
        mean_ratio = self.ratio_sum / self.points
        guarded = [name for name, i in (("bwd_attention", 0), ("bwd_linear", 1)) if not (cf[i] > 0 and cb[i] > 0)]
        bwd_attention = float(cb[0] / cf[0]) if "bwd_attention" not in guarded else mean_ratio
        bwd_linear = float(cb[1] / cf[1]) if "bwd_linear" not in guarded else mean_ratio
        return ProfileFit(attn_per_pair=float(cf[0]), attn_per_query=0.0, linear_per_token=float(cf[1]),
                          overhead=float((cf[3] + cb[3]) / (1.0 + bwd_linear)), attn_rel_err=float("nan"),
                          linear_rel_err=float("nan"), bwd_attention=bwd_attention, bwd_linear=bwd_linear,
                          form="micro_batches", head_ratio=head_ratio(model),
                          attn_per_run=float((cf[2] + cb[2]) / (1.0 + bwd_attention)),
                          extra={"fwd": cf.tolist(), "bwd": cb.tolist(), "points": int(self.points),
                                 "ratio_from_mean": guarded})


def rounded(fit: ProfileFit, digits: int = 9) -> ProfileFit:
    """``fit`` with its coefficients rounded to ``digits`` significant digits: what a checkpoint's JSON
    holds exactly, so a resumed run plans with the very numbers the saved one used."""
    def r(x: float) -> float:
        return float(f"{x:.{digits}g}")

    floats: dict[str, Any] = {f.name: r(getattr(fit, f.name)) for f in fields(fit)
                              if isinstance(getattr(fit, f.name), float)}
    return replace(fit, **floats)


def cost_state(fit: ProfileFit, iteration: int) -> dict[str, Any]:
    """JSON-ready state of a refitted cost model (saved in the packer's state)."""
    state = asdict(fit)
    state["extra"] = dict(fit.extra)
    return {"format": REFIT_FORMAT, "iteration": int(iteration), "fit": state}


def cost_model_from_state(state: dict[str, Any], base: CostModel) -> CostModel:
    """The refitted cost model of ``state`` over ``base``'s model shape, layout and hardware."""
    if not isinstance(state, dict) or state.get("format") != REFIT_FORMAT:
        raise ValueError(f"refitted cost model state {str(state)[:80]!r}: expected format {REFIT_FORMAT!r}")
    return CalibratedCostModel.from_fit(ProfileFit(**state["fit"]), base.model, base.layout, base.hardware,
                                        source=f"online refit at iteration {state['iteration']}")
