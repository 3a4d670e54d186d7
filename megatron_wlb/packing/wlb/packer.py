"""``WlbPacker``: the driver. Per iteration it builds an ``IterationPlan`` and runs the policies over it."""

from __future__ import annotations

from typing import Any

import numpy as np

from megatron_wlb.costmodel import CostModel
from megatron_wlb.packing.base import Packer, pieces_from_state, pieces_to_state, register_packer
from megatron_wlb.packing.types import DocPiece, MicroBatch, PackingConfig, oldest_first_key
from megatron_wlb.packing.wlb import fill, place, release
from megatron_wlb.packing.wlb.plan import IterationPlan, PlanCounts, reads_ahead, release_size
from megatron_wlb.packing.wlb.thresholds import LengthStats, thresholds


@register_packer
class WlbPacker(Packer):
    name = "wlb"

    def __init__(self, config: PackingConfig, cost: CostModel | None = None):
        super().__init__(config, cost)
        problem = config.queue_threshold_problem()
        if problem:
            raise ValueError(f"queue_thresholds={list(config.queue_thresholds)}: {problem}")
        self._waiting: list[DocPiece] = []
        self.stats = LengthStats(cost, self.capacity)
        self.counts = PlanCounts()
        self._overlong_docs: set[int] = set()  # documents longer than S_max (split by oversize)

    @property
    def capacity(self) -> int:
        return self.config.capacity_var

    # -- what the packer counted -----------------------------------------------------------------------
    @property
    def forced_splits(self) -> int:
        return self.counts.forced_splits

    @property
    def fill_releases(self) -> int:
        return self.counts.fill_releases

    @property
    def balanced_releases(self) -> int:
        return self.counts.balanced_releases

    @property
    def read_ahead_tokens(self) -> int:
        return self.counts.read_ahead_tokens

    @property
    def delay_overruns(self) -> int:
        return self.counts.delay_overruns

    @property
    def cut_stats(self) -> dict[str, int]:
        return self.counts.cut_stats

    def diagnostics(self) -> dict[str, Any]:
        """The current thresholds (``thresholds()``), forced splits, early releases and cuts."""
        return {"thresholds": list(self.thresholds()), **self.counts.state()}

    # -- the stream ------------------------------------------------------------------------------------
    def _apply_oversize(self, lengths: np.ndarray, ids: np.ndarray, arrival: int) -> list[DocPiece]:
        pieces = super()._apply_oversize(lengths, ids, arrival)
        if self.config.cut_policy == "overlong" and lengths.size and int(lengths.max()) > self.capacity:
            self._overlong_docs.update(int(i) for i, n in zip(ids.tolist(), lengths.tolist()) if n > self.capacity)
        return pieces

    def _min_intake(self) -> int:
        """The fill rule's intake side: after a huge document the intake is in debt; still read
        enough that the iteration can reach ``intake_fill`` x the token budget with what waits."""
        return max(0, int(self.config.intake_fill * self.config.tokens_per_iteration) - self.pending())

    def pending(self) -> int:
        return sum(p.length for p in self._waiting)

    def held(self) -> tuple[DocPiece, ...]:
        return tuple(self._waiting)

    @property
    def waiting(self) -> tuple[DocPiece, ...]:
        """Pieces read but not yet emitted (carried pieces and queued outliers)."""
        return tuple(self._waiting)

    def thresholds(self) -> tuple[int, ...]:
        """The current L_1 < ... < L_n (the configured ones, or derived from the stream so far)."""
        return thresholds(self.config, self.stats, self.capacity, release_size(self.config))

    def _cost_changed(self, old: CostModel | None) -> None:
        self.stats.rescale(old, self.latency)

    @property
    def reads_ahead(self) -> bool:
        """Whether the read-ahead fill (h) runs (``plan.reads_ahead``)."""
        return reads_ahead(self.config)

    # -- planning --------------------------------------------------------------------------------------
    def _plan(self, new: list[DocPiece], final: bool) -> list[MicroBatch]:
        cfg = self.config
        if new:
            self.stats.observe(new, self.latency)
            self.stats.budgets += 1
        th = self.thresholds()
        pool = self._waiting + new
        oldest = self.iteration - cfg.max_delay  # arrival at or before this: forced
        plan = IterationPlan(cfg, self.iteration, self.capacity, th, self.stats.ordinary_work_per_token(th[0]),
                             self.latency, self.counts, self._overlong_docs, self._read_ahead,
                             lambda pieces: self.stats.observe(pieces, self.latency),
                             forced=[p for p in pool if p.arrival <= oldest], size=self.size)
        rest = [p for p in pool if p.arrival > oldest] if plan.forced else pool
        read_ahead = not final and plan.reads_ahead
        if final:
            plan.candidates = rest
        else:
            release.release_outliers(plan, rest)
            if plan.waiting and cfg.waiting_fill > 0 and cfg.read_ahead_fill < cfg.waiting_fill:
                fill.release_early(plan)  # (f), unless the read-ahead fill (h) tops up with ordinary documents
            if read_ahead:
                fill.read_ahead_before(plan)
        place.place_iteration(plan)
        if read_ahead:
            fill.read_ahead_fill(plan)
        if not final and plan.waiting and cfg.waiting_fill > 0:
            # without the read-ahead, the waiting pieces are all there is to fill the iteration with
            fill.fill_guard(plan, full=read_ahead or (cfg.read_ahead is False and cfg.read_ahead_fill > 0))
        plan.waiting.sort(key=oldest_first_key)
        self._waiting = plan.waiting
        if self._overlong_docs:
            self._overlong_docs &= {p.doc_id for p in plan.waiting}
        bins = plan.bins
        if cfg.schedule_order and plan.m > 1:
            bins = place.deal_micro_batches(bins, plan.work, self.cost, cfg.dp, cfg.n, cfg.stages,
                                            cfg.virtual_stages)
        return [MicroBatch(tuple(b), plan.cap) for b in bins]

    # -- state -----------------------------------------------------------------------------------------
    def _extra_state(self) -> dict[str, Any]:
        return {"waiting": pieces_to_state(self._waiting), **self.stats.state(), **self.counts.state(),
                "overlong_docs": sorted(self._overlong_docs)}

    def _load_extra_state(self, state: dict[str, Any]) -> None:
        self._waiting = pieces_from_state(state["waiting"])
        self.stats.load(state)
        self.counts = PlanCounts.from_state(state)
        self._overlong_docs = {int(d) for d in state["overlong_docs"]}
