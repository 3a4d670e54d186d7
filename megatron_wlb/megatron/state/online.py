"""``--wlb-cost-model online``: the packer's cost model refitted from the run's own measured steps.

Every rank adds the micro-batch rows its ``timing.Recorder`` flushed (after ``WARMUP`` iterations,
whose first steps pay one-off costs) to its ``costmodel.fit.RefitStats``. Every ``refit_interval``
iterations one SUM all-reduce combines the ranks' statistics, every rank solves the same normal
equations, and two more small all-reduces (MIN and MAX of the rounded coefficients and of the plan
digest of the iteration just trained) prove that every rank holds the same coefficients and trained the
same plan; then each training iterator's packer balances the new model from its next plan on. The
refitted model travels in the packer's state (``Packer.set_cost``), so a resumed run plans with it.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Sequence
from typing import Any

import numpy as np

from megatron_wlb.costmodel import CalibratedCostModel, CostModel, ModelShape
from megatron_wlb.costmodel.fit import BASE_TERMS, RefitStats
from megatron_wlb.costmodel.refit import cost_model_from_state, cost_state, rounded
from megatron_wlb.costmodel.trace import MicroBatchRow, profile_points
from megatron_wlb.megatron.data.packed import plan_digest
from megatron_wlb.megatron.state.process import print_rank0, runtime
from megatron_wlb.packing.types import GlobalBatch

#: iterations whose steps the refit leaves out (start-up: allocation, first-call costs)
WARMUP = 2
AllReduce = Callable[[np.ndarray, str], np.ndarray]


def digest_number(batch: GlobalBatch | None) -> float:
    """The plan digest as a float that survives a float64 all-reduce exactly (its first 48 bits)."""
    return -1.0 if batch is None else float(int(plan_digest(batch)[:12], 16))


class OnlineRefit:
    """Refits ``base`` (the configured cost model) every ``interval`` iterations; ``apply(cost, state)``
    hands the new model to the packers (and the metrics)."""

    def __init__(self, base: CostModel, layout: dict[str, int], interval: int,
                 apply: Callable[[CostModel, dict[str, Any]], None], plan: Callable[[], GlobalBatch | None],
                 clock: str = "cpu"):
        self.base, self.layout, self.interval, self.clock = base, layout, interval, clock
        self.model: ModelShape = base.model
        self.apply, self.plan = apply, plan
        self.stats = RefitStats.empty()
        self.refits = 0
        #: the terms refitted: those the configured profile kept (its whole-micro-batch terms), else the base terms
        self.terms = (base.fit.terms or BASE_TERMS) if isinstance(base, CalibratedCostModel) else BASE_TERMS

    def observe(self, rows: Sequence[Any]) -> None:
        """Add this rank's flushed micro-batch rows (other rows and warm-up iterations are skipped)."""
        mine = [r for r in rows if isinstance(r, MicroBatchRow) and r.iteration >= WARMUP]
        if mine:
            self.stats = self.stats + RefitStats.of(profile_points(mine, self.layout, self.clock), self.model)

    def due(self, iteration: int) -> bool:
        """Whether the log of plan ``iteration`` (0-based) refits."""
        return iteration >= WARMUP and (iteration + 1) % self.interval == 0

    def refit(self, iteration: int, all_reduce: AllReduce) -> dict[str, Any] | None:
        """Combine every rank's statistics, fit, check agreement, apply; returns the refit's state (None
        while the ranks together have fewer points than the fit needs). Every rank must call it."""
        total = RefitStats.from_vector(all_reduce(self.stats.vector(), "sum"))
        if total.points < 3:
            return None
        fit = rounded(total.fit(self.model, self.terms))
        if isinstance(self.base, CalibratedCostModel):  # an empty micro-batch's price: measured by the profile only
            fit = dataclasses.replace(fit, empty_fwd=self.base.fit.empty_fwd, empty_bwd=self.base.fit.empty_bwd)
        check = np.array([fit.attn_per_pair, fit.linear_per_token, fit.overhead, fit.bwd_attention, fit.bwd_linear,
                          fit.per_token_sq, fit.per_token_pair, fit.cp_call, fit.cp_kv_token,
                          digest_number(self.plan())])
        low, high = all_reduce(check, "min"), all_reduce(check, "max")
        if not np.array_equal(low, high):
            what = "refitted coefficients" if not np.array_equal(low[:-1], high[:-1]) else "plan digests"
            raise RuntimeError(f"megatron_wlb: the ranks disagree on the {what} at iteration {iteration + 1} "
                               f"(min {low.tolist()}, max {high.tolist()}): every rank must read the same data "
                               "with the same settings")
        state = cost_state(fit, iteration)
        self.apply(cost_model_from_state(state, self.base), state)
        self.refits += 1
        return state


def start_online_refit(cost: CostModel, layout: dict[str, int], interval: int, recorder: Any) -> OnlineRefit:
    """The process's ``OnlineRefit`` (``runtime().refit``): every refit hands the new model to every training
    iterator's packer, to ``recorder`` (its trace rows' predictions) and to the metrics logger, and says so."""
    registry = runtime().registry

    def apply_refit(new: CostModel, state: dict[str, Any]) -> None:
        for it in registry.iterators:
            it.packer.set_cost(new, state)
        recorder.cost = new
        logger = runtime().logger
        if logger is not None:
            logger.cost, logger.latest = new, None
        fit = state["fit"]
        from_mean = fit["extra"].get("ratio_from_mean") or []
        print_rank0(f"> megatron_wlb: online cost model refit at iteration {state['iteration'] + 1} from "
                    f"{fit['extra']['points']} measured micro-batches: attention {fit['attn_per_pair']:.4g} "
                    f"s/pair, linear {fit['linear_per_token']:.4g} s/token, overhead {fit['overhead']:.4g} s "
                    f"per layer; bwd/fwd {fit['bwd_attention']:.2f} / {fit['bwd_linear']:.2f}"
                    + (f" ({', '.join(from_mean)}: the mean measured ratio, the rows do not determine the "
                       "coefficients)" if from_mean else ""))

    return OnlineRefit(cost, layout, interval, apply_refit,
                       lambda: registry.iterators[0].current if registry.iterators else None, recorder.clock.kind)
