"""What one iteration measured, from its trace rows (``costmodel.trace``): pure, no torch.

The same definitions serve the training log (``wlb/measured_*`` scalars: every rank reduces its own
rows to an ``IterationTotals``, and two small all-reduces, MAX and SUM, combine them, so the cost
does not grow with the number of ranks' rows) and ``benchmarks/bench_measured.py`` (whole traces):

- a micro-batch's *latency* on a DP rank is its forward + backward summed over the pipeline stages
  and model chunks, each (stage, chunk) taking the mean of its CP x TP ranks (they synchronise
  every layer, so each of them measures about the slowest one's time); the paper's imbalance degree
  of a DP rank is ``max latency x N / sum`` (Table 2), averaged over DP ranks, from measured
  seconds and, beside it, from the cost model's predictions (under ``--wlb-cp-sharding dynamic`` the table has
  a row per slot of the DP x CP pool, each the mean of its TP ranks: ``timing.RankIds.table``);
- the *slowest-rank time* is the largest ``wall_s - dp_wait_s`` over ranks: when the slowest
  pipeline finished its own work (every other rank then waits in the gradient reduction);
- the *idle fraction* is ``1 - sum(compute_s) / sum(wall_s)`` over ranks: pipeline bubbles, waits for
  slower pipeline stages and for slower DP ranks, all measured;
- the cost model's error is the mean absolute percentage error of predicted forward + backward per
  micro-batch row (MAPE).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import asdict, dataclass

import numpy as np

from megatron_wlb.costmodel.trace import IterationRow, MicroBatchRow


@dataclass(frozen=True)
class MeasuredIteration:
    """One iteration's measurements over every rank (see the module docstring)."""

    iteration: int
    wall_s: float             # the longest rank's forward-backward pass
    slowest_s: float          # the slowest rank's own pipeline time (wall minus its DP wait)
    idle_fraction: float      # 1 - compute / wall, over all ranks
    imbalance: float          # paper's degree from measured latencies, mean over DP ranks
    imbalance_planned: float  # the same from the cost model's predictions
    mape: float               # cost model's error per micro-batch row (forward + backward)
    tokens: int               # planned tokens of the iteration (every DP rank)

    def scalars(self, prefix: str = "wlb") -> dict[str, float]:
        """``<prefix>/measured_<name>`` -> value (NaNs left out), for Megatron's writers."""
        return {f"{prefix}/measured_{k}": float(v) for k, v in asdict(self).items()
                if k != "iteration" and not (isinstance(v, float) and np.isnan(v))}


@dataclass(frozen=True)
class IterationTotals:
    """Rows of one iteration (one rank's or many) reduced to what combines across ranks.

    ``maxima`` (combine with MAX): wall, own pipeline time. ``sums`` (combine with SUM): compute,
    wall, sum of absolute percentage errors, their count, tokens, then the ``dp x n`` latency table,
    measured then predicted (each row's seconds divided by the CP x TP ranks of its stage).
    """

    iteration: int
    dp: int
    n: int
    maxima: np.ndarray
    sums: np.ndarray

    SCALAR_SUMS = 5

    @classmethod
    def of(cls, rows: Sequence[MicroBatchRow], iterations: Sequence[IterationRow], dp: int, n: int,
           cp_tp: int) -> IterationTotals:
        """Reduce rows of one iteration; ``dp`` / ``n``: DP size and micro-batches per DP rank;
        ``cp_tp``: ranks per (stage, chunk) of a DP rank, CP x TP."""
        numbers = {r.iteration for r in rows} | {r.iteration for r in iterations}
        if len(numbers) != 1:
            raise ValueError(f"IterationTotals takes the rows of one iteration, got iterations {sorted(numbers)}")
        maxima = np.array([max((r.wall_s for r in iterations), default=0.0),
                           max((r.wall_s - r.dp_wait_s for r in iterations), default=0.0)], dtype=np.float64)
        measured = np.zeros(dp * n, dtype=np.float64)
        predicted = np.zeros(dp * n, dtype=np.float64)
        ape, count = 0.0, 0
        for r in rows:
            if not (0 <= r.dp < dp and 0 <= r.micro_batch < n):
                raise ValueError(f"row of DP rank {r.dp}, micro-batch {r.micro_batch} is outside dp {dp} x n {n}")
            measured[r.dp * n + r.micro_batch] += r.measured_s / cp_tp
            predicted[r.dp * n + r.micro_batch] += r.predicted_s / cp_tp
            if r.measured_s > 0:
                ape += abs(r.predicted_s - r.measured_s) / r.measured_s
                count += 1
        # a micro-batch's tokens are counted once: on its DP rank's first stage, chunk 0, CP/TP rank 0
        tokens = sum(r.tokens for r in rows if r.pp == 0 and r.chunk == 0 and r.cp == 0 and r.tp == 0)
        scalars = np.array([sum(r.compute_s for r in iterations), sum(r.wall_s for r in iterations), ape, count,
                            tokens], dtype=np.float64)
        return cls(numbers.pop(), dp, n, maxima, np.concatenate([scalars, measured, predicted]))

    def latencies(self, predicted: bool = False) -> np.ndarray:
        """The ``(dp, n)`` micro-batch latency table, measured or ``predicted``."""
        start = self.SCALAR_SUMS + (self.dp * self.n if predicted else 0)
        return self.sums[start:start + self.dp * self.n].reshape(self.dp, self.n)

    def summary(self) -> MeasuredIteration:
        compute, wall, ape, count, tokens = self.sums[:self.SCALAR_SUMS]
        return MeasuredIteration(
            iteration=self.iteration, wall_s=float(self.maxima[0]), slowest_s=float(self.maxima[1]),
            idle_fraction=float(1.0 - compute / wall) if wall > 0 else float("nan"),
            imbalance=imbalance_degree(self.latencies()),
            imbalance_planned=imbalance_degree(self.latencies(predicted=True)),
            mape=float(ape / count) if count else float("nan"), tokens=int(round(tokens)))


def imbalance_degree(latencies: np.ndarray) -> float:
    """The paper's Table 2 degree, ``max x N / sum`` per DP rank (row), averaged (NaN if nothing ran)."""
    table = np.atleast_2d(np.asarray(latencies, dtype=np.float64))
    totals = table.sum(axis=1)
    ran = totals > 0
    if not ran.any():
        return float("nan")
    return float(np.mean(table[ran].max(axis=1) * table.shape[1] / totals[ran]))


def measure_iteration(rows: Sequence[MicroBatchRow], iterations: Sequence[IterationRow], dp: int, n: int,
                      cp_tp: int) -> MeasuredIteration:
    """One iteration's summary from every rank's rows of it (what the training log's all-reduce gives)."""
    return IterationTotals.of(rows, iterations, dp, n, cp_tp).summary()
