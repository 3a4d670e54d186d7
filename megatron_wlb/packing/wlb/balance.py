"""The one balance test: can these outliers go into this iteration and the iteration stay balanced?

Outliers are dealt to the ``dp * n`` micro-batches (one each, or heaviest first to the least loaded);
the iteration's ordinary tokens (``per_token`` latency each) are then spread to even the work. It stays
balanced (``stays_balanced``) when the heaviest micro-batch's outliers are within ``CLOSE_TOLERANCE``
of the balanced mean and every micro-batch has the room its ordinary share needs. The release rule (e),
the cut policy (g) and the balanced release (i) all ask this one question.
"""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np

from megatron_wlb.packing.wlb.plan import IterationPlan, Latency

#: a group of outliers is closable when its heaviest member stays within this of the balanced mean
CLOSE_TOLERANCE = 0.02


def stays_balanced(work: np.ndarray, tokens: np.ndarray, per_token: float, ordinary: int, cap: int) -> bool:
    """Whether micro-batches holding outliers of ``work`` seconds and ``tokens`` tokens, plus ``ordinary``
    tokens of ordinary documents spread to even the work, are balanced: the heaviest within
    ``CLOSE_TOLERANCE`` of the mean, and every micro-batch with room (``cap``) for its ordinary share."""
    mean = (float(work.sum()) + per_token * ordinary) / work.size
    return bool(work.max() <= mean * (1 + CLOSE_TOLERANCE) and
                np.all(mean - work <= per_token * (cap - tokens) + 1e-12 * mean))


def deal_outliers(lengths: Sequence[int] | np.ndarray, latency: Latency, m: int) -> tuple[np.ndarray, np.ndarray]:
    """Outliers of ``lengths`` dealt heaviest first, each to the least loaded of ``m`` micro-batches:
    (work, tokens) per micro-batch."""
    lens = np.sort(np.asarray(lengths, dtype=np.int64))[::-1]
    work = np.zeros(m)
    tokens = np.zeros(m, dtype=np.int64)
    for d, x in zip(lens.tolist(), latency(lens).tolist()):
        j = int(np.argmin(work))
        work[j] += x
        tokens[j] += d
    return work, tokens


def closable(plan: IterationPlan, lengths: list[int]) -> bool:
    """Whether outliers of ``lengths``, one per micro-batch, can be balanced by the iteration's ordinary
    tokens (the budget minus theirs)."""
    m = plan.m
    k = len(lengths)
    if k > m:
        return False
    if plan.per_token <= 0 or k == 0:
        return True
    d = np.zeros(m, dtype=np.int64)
    d[:k] = lengths
    w = np.zeros(m)
    w[:k] = plan.latency(d[:k])
    return stays_balanced(w, d, plan.per_token, max(0, plan.budget - int(d.sum())), plan.cap)


def balanceable(plan: IterationPlan, lengths: list[int], ordinary: int) -> bool:
    """Whether outliers of ``lengths`` (any number, ``deal_outliers``) and ``ordinary`` tokens of ordinary
    documents can be balanced. With one outlier per micro-batch and ``ordinary`` = the budget minus the
    outliers this is ``closable``."""
    if plan.per_token <= 0 or not lengths:
        return True
    work, tokens = deal_outliers(lengths, plan.latency, plan.m)
    if int(tokens.max()) > plan.cap:
        return False
    return stays_balanced(work, tokens, plan.per_token, ordinary, plan.cap)
