"""Per-iteration packing metrics, written through Megatron's logger and its tensorboard/wandb writers.

``iteration_metrics`` scores one global batch with ``megatron_wlb.packing.metrics`` (the same
definitions as ``wlb simulate``/``wlb analyze``): the paper's imbalance degree (max micro-batch
latency x N / sum, per DP rank, averaged; and the worst rank), the imbalance across all DP x N
micro-batches, the predicted slowest rank, tokens, unused capacity and the token-weighted delay. Under
``--wlb-cp-sharding dynamic`` the imbalances, the slowest rank and the schedule ratio are the dynamic-CP
plan's own (``cp.dynamic``: each micro-batch priced at its group's CP size, per slot of the stage's DP x CP
pool), not the fixed CP size's. ``WlbMetricsLogger`` keeps the latest iteration's metrics (the data iterator
reports every new global batch to it) and writes them every ``log_interval`` iterations, with the true
throughput since the last line: tokens per second and model TFLOP/s per GPU counted over the packed documents
(``ModelShape.training_flops``), which Megatron's own counters, written for fixed ``seq_length`` samples,
misreport under packing. Named
``wlb_logging`` so it never shadows the stdlib ``logging``.
"""

from __future__ import annotations

import math
import time
from collections.abc import Callable
from dataclasses import asdict, dataclass, replace
from typing import Any

import numpy as np

from megatron_wlb.costmodel.measured import MeasuredIteration
from megatron_wlb.cp.dynamic import DynamicCPPlan
from megatron_wlb.cp.dynamic_steps import slot_step_seconds
from megatron_wlb.megatron.hooks.rebind import wrapping
from megatron_wlb.packing.metrics import imbalance_global, imbalance_per_rank, slowest_rank_schedule_time, summarize
from megatron_wlb.packing.types import GlobalBatch

PREFIX = "wlb"


@dataclass(frozen=True)
class IterationMetrics:
    """Packing quality of one iteration's global plan (latencies are forward + backward per layer)."""
    iteration: int
    imbalance: float          # paper Table 2 degree, mean over DP ranks (1.0 = perfect)
    imbalance_max: float      # the worst DP rank's degree
    imbalance_global: float   # max / mean over all DP x N micro-batches
    schedule_ratio: float     # slowest DP rank's pipeline-schedule time / balanced (what the job waits for)
    tokens: int               # tokens in the global batch
    unused_capacity: float    # 1 - tokens / sum of micro-batch capacities
    mean_delay: float         # iterations per token between arrival and training
    max_delay: int
    plan_ms: float            # time the packer took for this plan
    slowest_s: float = math.nan   # predicted seconds per layer (forward + backward) of the slowest rank
    over_ideal: float = math.nan  # dynamic CP: that over the batch's CP-1 compute spread over DP x CP

    def to_dict(self) -> dict[str, float]:
        return asdict(self)

    def scalars(self) -> dict[str, float]:
        """``wlb/<name>`` -> value for the writers (NaN imbalances of an empty batch are left out)."""
        out = {}
        for k, v in asdict(self).items():
            if k == "iteration" or (isinstance(v, float) and math.isnan(v)):
                continue
            out[f"{PREFIX}/{k}"] = float(v)
        return out


def iteration_metrics(batch: GlobalBatch, cost: Any = None, seq_len: int | None = None, stages: int | None = None,
                      virtual_stages: int = 1, dynamic_plan: DynamicCPPlan | None = None) -> IterationMetrics:
    """Score ``batch`` with ``megatron_wlb.packing.metrics.summarize`` (``d**2`` weights without a cost model);
    ``stages`` / ``virtual_stages``: the run's pipeline, for the schedule ratio. ``dynamic_plan``: the batch's
    dynamic-CP plan, whose predictions replace the fixed CP size's (``dynamic_metrics``)."""
    m = summarize([batch], cost, seq_len, stages=stages, virtual_stages=virtual_stages)
    metrics = IterationMetrics(iteration=batch.iteration, imbalance=m.imbalance, imbalance_max=m.imbalance_max,
                               imbalance_global=m.imbalance_global, schedule_ratio=m.schedule_ratio, tokens=m.tokens,
                               unused_capacity=m.unused_capacity, mean_delay=m.mean_delay, max_delay=m.max_delay,
                               plan_ms=m.plan_ms_mean)
    if dynamic_plan is not None:
        return dynamic_metrics(metrics, dynamic_plan, batch.n)
    if batch.tokens == 0:
        return metrics
    slowest = slowest_rank_schedule_time(cost, batch, stages, virtual_stages)[0]
    return replace(metrics, slowest_s=slowest)


def dynamic_metrics(metrics: IterationMetrics, plan: DynamicCPPlan, steps: int) -> IterationMetrics:
    """``metrics`` with the dynamic-CP ``plan``'s predictions: every slot (rank of the stage's DP x CP pool) runs
    ``steps`` micro-batches (its own, each its share of its group's, then empty ones); the paper's degree per
    slot over them, the global degree over every slot's micro-batches, the slowest slot's seconds (the plan's
    objective: the sum of its micro-batches, also at PP > 1) over the slots' mean and over the ideal."""
    table = slot_step_seconds(plan, steps)
    if not table.size or table.sum() <= 0:
        return metrics
    per_slot = imbalance_per_rank(table)
    return replace(metrics, imbalance=float(np.nanmean(per_slot)), imbalance_max=float(np.nanmax(per_slot)),
                   imbalance_global=imbalance_global(table),
                   schedule_ratio=plan.slowest_seconds / float(plan.rank_seconds.mean()),
                   slowest_s=plan.slowest_seconds, over_ideal=plan.over_ideal)


def format_metrics(m: IterationMetrics) -> str:
    """One log line, in the style of Megatron's ``training_log``."""
    return (f" [wlb] iteration {m.iteration + 1:8d} | imbalance {m.imbalance:.3f} (max {m.imbalance_max:.3f}, "
            f"global {m.imbalance_global:.3f}) | slowest rank / balanced {m.schedule_ratio:.3f} | "
            f"{_slowest(m)}tokens {m.tokens} | unused capacity {m.unused_capacity:.3f} | "
            f"delay {m.mean_delay:.2f} (max {m.max_delay}) | plan {m.plan_ms:.1f} ms")


def _slowest(m: IterationMetrics) -> str:
    if math.isnan(m.slowest_s):
        return ""
    ideal = "" if math.isnan(m.over_ideal) else f", {m.over_ideal:.3f} x ideal"
    return f"slowest rank {m.slowest_s * 1e3:.4g} ms per layer (predicted{ideal}) | "


def format_measured(m: MeasuredIteration) -> str:
    """The measured counterpart of ``format_metrics`` (``costmodel.measured``), one log line."""
    return (f" [wlb] measured iteration {m.iteration + 1:8d} | slowest rank {m.slowest_s * 1e3:.1f} ms "
            f"(wall {m.wall_s * 1e3:.1f} ms) | idle {m.idle_fraction:.3f} | imbalance {m.imbalance:.3f} "
            f"(planned {m.imbalance_planned:.3f}) | cost model MAPE {m.mape:.1%} | tokens {m.tokens}")


class WlbMetricsLogger:
    """Collects the latest plan's metrics and writes them every ``log_interval`` iterations.

    ``print_fn`` is Megatron's ``print_rank_0``; ``tb_writer`` / ``wandb_writer`` are callables that
    return Megatron's writers (``global_vars.get_tensorboard_writer`` / ``get_wandb_writer``), which
    are None on the ranks that do not write.
    """

    def __init__(self, cost: Any = None, seq_len: int | None = None, log_interval: int = 1,
                 print_fn: Callable[[str], None] | None = None,
                 tb_writer: Callable[[], Any] | None = None, wandb_writer: Callable[[], Any] | None = None,
                 stages: int | None = None, virtual_stages: int = 1):
        if log_interval < 1:
            raise ValueError(f"log_interval must be >= 1, got {log_interval}")
        self.cost = cost
        self.seq_len = seq_len
        self.log_interval = log_interval
        self.print_fn = print_fn
        self.tb_writer = tb_writer
        self.wandb_writer = wandb_writer
        self.stages, self.virtual_stages = stages, virtual_stages
        self.latest: IterationMetrics | None = None
        self._batch: GlobalBatch | None = None
        self._dynamic_plan: DynamicCPPlan | None = None
        self._tokens = 0      # planned tokens since the last throughput line
        self._flops = 0.0     # their model FLOPs (forward + backward)
        self._since: float | None = None

    def on_batch(self, batch: GlobalBatch, dynamic_plan: DynamicCPPlan | None = None) -> None:
        """Called by the data iterator with each new plan (scored lazily, only when logged); ``dynamic_plan``:
        with ``--wlb-cp-sharding dynamic``, the batch's dynamic-CP plan (its predictions are logged)."""
        self._batch, self._dynamic_plan = batch, dynamic_plan
        self.latest = None
        lengths = [p.length for p in batch.pieces()]
        self._tokens += sum(lengths)
        if self.cost is not None:
            self._flops += self.cost.model.training_flops(lengths)

    def throughput(self, now: float | None = None) -> tuple[float, float] | None:
        """(tokens per second, model TFLOP/s per GPU) since the previous call; None the first time."""
        now = time.monotonic() if now is None else now
        previous, self._since = self._since, now
        tokens, flops = self._tokens, self._flops
        self._tokens, self._flops = 0, 0.0
        if previous is None or now <= previous:
            return None
        gpus = self.cost.layout.world_size if self.cost is not None else 1
        return tokens / (now - previous), flops / (now - previous) / gpus / 1e12

    def metrics(self) -> IterationMetrics | None:
        if self.latest is None and self._batch is not None:
            self.latest = iteration_metrics(self._batch, self.cost, self.seq_len, self.stages, self.virtual_stages,
                                            self._dynamic_plan)
        return self.latest

    def due(self, iteration: int) -> bool:
        """Whether ``iteration`` (Megatron's, 1-based) is on the log interval."""
        return iteration % self.log_interval == 0

    def log(self, iteration: int, measured: MeasuredIteration | None = None) -> IterationMetrics | None:
        """Write the latest plan's metrics if ``iteration`` (Megatron's, 1-based) is on the interval,
        with what an earlier (``measured.iteration``) or this iteration measured on every rank."""
        if not self.due(iteration):
            return None
        m = self.metrics()
        if m is None:
            return None
        scalars = m.scalars()
        line = format_metrics(m)
        if measured is not None:
            scalars.update(measured.scalars(PREFIX))
            line += "\n" + format_measured(measured)
        rate = self.throughput()
        if rate is not None:
            scalars[f"{PREFIX}/tokens_per_s"], scalars[f"{PREFIX}/model_tflops_per_gpu"] = rate
            line += f" | {rate[0]:.0f} tokens/s, {rate[1]:.3g} model TFLOP/s per GPU"
        if self.print_fn is not None:
            self.print_fn(line)
        tb = self.tb_writer() if self.tb_writer is not None else None
        if tb is not None:
            for key, value in scalars.items():
                tb.add_scalar(key, value, iteration)
        wb = self.wandb_writer() if self.wandb_writer is not None else None
        if wb is not None:
            wb.log(scalars, iteration)
        return m


def wrap_training_log(original: Callable[..., Any], logger_of: Callable[[], WlbMetricsLogger | None],
                      measure: Callable[[bool], MeasuredIteration | None] | None = None) -> Callable[..., Any]:
    """Megatron's ``training_log(loss_dict, total_loss_dict, learning_rate, iteration, ...)``, then ours.

    ``measure(due)`` is called on every rank every iteration (it writes the timing trace) and, when
    ``due`` (a logged iteration), returns what was measured over all ranks: a collective, which is why
    it runs here, where every rank passes, and not inside the rank-0 printing."""

    @wrapping(original)
    def training_log(*args: Any, **kwargs: Any) -> Any:
        out = original(*args, **kwargs)
        iteration = kwargs.get("iteration", args[3] if len(args) > 3 else None)
        logger = logger_of()
        if logger is not None and iteration is not None:
            measured = measure(logger.due(int(iteration))) if measure is not None else None
            logger.log(int(iteration), measured)
        return out

    return training_log
