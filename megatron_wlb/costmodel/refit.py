"""The online cost model: W(d) refitted from a run's own measured micro-batches, as statistics that add
across ranks (pure: no torch).

A fit of measured micro-batches (``fit_profile`` on a profile's ``micro_batches`` section) is a
non-negative relative least-squares fit of ``fwd = a*pairs + b*tokens + c`` (and the same for the
backward). Its normal equations are all it needs: ``fit.RefitStats`` holds them, one fixed-size vector
per rank that a SUM all-reduce combines, so every rank solves the same system from the same numbers
and computes the same coefficients, whatever the number of ranks or rows. Here: ``cost_state`` /
``cost_model_from_state`` carry a refitted model through a checkpoint (the fitting is ``fit.py``'s).
"""

from __future__ import annotations

from dataclasses import asdict, fields, replace
from typing import Any

from megatron_wlb.costmodel.fit import ProfileFit
from megatron_wlb.costmodel.model import CalibratedCostModel, CostModel

REFIT_FORMAT = "megatron-wlb-refit/1"


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
