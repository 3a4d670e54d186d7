"""The queue thresholds L_1 < ... < L_n (extension (a), ``queue_thresholds="auto"``).

``LengthStats`` keeps a log-spaced histogram of the lengths read so far (documents, tokens and latency
per bin) and the budgets read; ``thresholds`` derives the levels from it: L_1 is the shortest length
whose latency reaches ``outlier_fraction`` of the latency of ``seq_len`` tokens of ordinary documents
(those below L_1, a fixed point), L_2 < ... < L_n split the outliers seen so far into equal-count
quantiles, using no more queues than the outlier rate can fill with R members each within
``max_delay / 2`` iterations. The statistics are saved with the packer, so a restored one derives the
same thresholds.
"""

from __future__ import annotations

from typing import Any

import numpy as np

from megatron_wlb.costmodel import CostModel
from megatron_wlb.packing.metrics import piece_latency
from megatron_wlb.packing.types import DocPiece, PackingConfig, piece_lengths
from megatron_wlb.packing.wlb.plan import Latency

HIST_PER_OCTAVE = 16
HIST_BINS = 48 * HIST_PER_OCTAVE  # lengths up to 2**48 tokens


def hist_bin(lengths: np.ndarray) -> np.ndarray:
    """The histogram bin of each length (``HIST_PER_OCTAVE`` bins per doubling)."""
    return np.minimum((np.log2(lengths) * HIST_PER_OCTAVE).astype(np.int64), HIST_BINS - 1)


class LengthStats:
    """The lengths read so far, as the thresholds need them: documents, tokens and latency per log-length
    bin, and the budgets read; plus L_1's search grid (lengths up to ``capacity`` and their latency)."""

    def __init__(self, cost: CostModel | None, capacity: int):
        self.count = np.zeros(HIST_BINS, dtype=np.int64)     # documents per log-length bin
        self.tokens = np.zeros(HIST_BINS, dtype=np.int64)
        self.work = np.zeros(HIST_BINS, dtype=np.float64)  # latency per bin
        self.budgets = 0
        self.grid = np.unique(np.geomspace(1, capacity, 1024).astype(np.int64))
        self.grid_work = piece_latency(cost, self.grid)

    def observe(self, pieces: list[DocPiece], latency: Latency) -> None:
        """Add pieces read from the stream."""
        lens = piece_lengths(pieces)
        bins = hist_bin(lens)
        self.count += np.bincount(bins, minlength=HIST_BINS)
        self.tokens += np.bincount(bins, weights=lens, minlength=HIST_BINS).astype(np.int64)
        self.work += np.bincount(bins, weights=latency(lens), minlength=HIST_BINS)

    def ordinary_work_per_token(self, limit: int) -> float:
        """Mean latency per token of the documents read so far that are shorter than ``limit``."""
        below = np.arange(HIST_BINS) < hist_bin(np.array([limit]))[0]
        tokens = int(self.tokens[below].sum())
        return float(self.work[below].sum()) / tokens if tokens else 0.0

    def rescale(self, old: CostModel | None, latency: Latency) -> None:
        """Bring the per-bin work (kept in the ``old`` model's seconds) over to ``latency``'s model, each bin
        at its mean length: exact for a bin of one length, and a bin spans a 2**(1/HIST_PER_OCTAVE) ratio."""
        self.grid_work = latency(self.grid)  # L_1's search grid, in the new model's seconds
        used = self.count > 0
        if not used.any():
            return
        mean = np.maximum(1, np.rint(self.tokens[used] / self.count[used])).astype(np.int64)
        before, after = piece_latency(old, mean), latency(mean)
        self.work[used] *= np.where(before > 0, after / np.where(before > 0, before, 1.0), 0.0)

    def state(self) -> dict[str, Any]:
        nz = np.flatnonzero(self.count)
        return {"hist": [[int(b), int(self.count[b]), int(self.tokens[b]), float(self.work[b])] for b in nz],
                "budgets": self.budgets}

    def load(self, state: dict[str, Any]) -> None:
        self.count = np.zeros(HIST_BINS, dtype=np.int64)
        self.tokens = np.zeros(HIST_BINS, dtype=np.int64)
        self.work = np.zeros(HIST_BINS, dtype=np.float64)
        for b, c, t, w in state["hist"]:
            self.count[int(b)], self.tokens[int(b)], self.work[int(b)] = int(c), int(t), float(w)
        self.budgets = int(state["budgets"])


def first_threshold(config: PackingConfig, stats: LengthStats, capacity: int) -> int:
    """L_1: the shortest length whose latency reaches ``outlier_fraction`` x the latency of a micro-batch
    of ``seq_len`` tokens of *ordinary* documents (those below L_1: a fixed point, found from "every
    document is ordinary" downwards, so outliers do not raise their own bar)."""
    l1 = capacity + 1
    for _ in range(8):
        c = stats.ordinary_work_per_token(l1)
        if c <= 0:
            break  # nothing below the current L_1 (every document is long): keep it
        k = int(np.searchsorted(stats.grid_work, float(config.outlier_fraction) * c * config.seq_len, side="left"))
        new = int(stats.grid[k]) if k < stats.grid.size else capacity + 1
        if new >= l1:
            break
        l1 = new
    return l1


def thresholds(config: PackingConfig, stats: LengthStats, capacity: int, release_size: int) -> tuple[int, ...]:
    """The current L_1 < ... < L_n: the configured ones, or derived from ``stats``."""
    th = config.queue_thresholds
    if th != "auto":
        return tuple(th)
    if stats.budgets == 0:
        return (capacity + 1,)
    l1 = first_threshold(config, stats, capacity)
    if l1 > capacity:
        return (capacity + 1,)  # no document can be an outlier: one queue nobody enters
    levels = [l1]
    counts = stats.count.copy()
    counts[:hist_bin(np.array([l1]))[0]] = 0
    total = int(counts.sum())
    # Each queue must gather R outliers well within max_delay, or it would only ever release
    # forced singles: use no more queues than the outlier rate can fill in max_delay / 2.
    rate = total / stats.budgets
    nq = max(1, min(config.num_queues, int(rate * config.max_delay / (2 * release_size))))
    if nq > 1 and total > 0:
        csum = np.cumsum(counts)
        for q in range(1, nq):
            b = int(np.searchsorted(csum, total * q / nq, side="left")) + 1
            edge = int(np.ceil(2.0 ** (b / HIST_PER_OCTAVE)))
            if levels[-1] < edge <= capacity:
                levels.append(edge)
    return tuple(levels)
