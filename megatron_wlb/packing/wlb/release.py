"""Which waiting outliers go out this iteration (steps 2-3 and extensions (e), (i)).

Outliers wait in queues by level (L_k <= d < L_{k+1}). ``release_outliers`` sorts the iteration's
pieces: ordinary ones are placed now; a queue holding at least R outliers releases R of them (the R
oldest, or with ``group_by_work`` (``release`` "balanced", "grouped") the R of similar work that the
ordinary documents can balance, ``similar_group``); a queue whose oldest member hit the delay bound goes
out with it (its ``companions``), or, with a cut policy, the forced outlier is cut instead; with
``release_when_balanced`` ("balanced", "oldest") any queued outlier the iteration can still balance goes out too
(``balanced_release``). The rest keep waiting.
"""

from __future__ import annotations

import numpy as np

from megatron_wlb.packing.types import DocPiece, oldest_first_key, piece_lengths, shortest_first_key
from megatron_wlb.packing.wlb.balance import closable, deal_outliers, stays_balanced
from megatron_wlb.packing.wlb.cut import cut, may_cut
from megatron_wlb.packing.wlb.plan import IterationPlan


def companions(queue: list[DocPiece], k: int, anchor: int) -> list[DocPiece]:
    """The ``k`` members closest in length to a forced outlier of ``anchor`` tokens (older first on ties)."""
    return sorted(queue, key=lambda p: (abs(p.length - anchor), *oldest_first_key(p)))[:k]


def similar_group(plan: IterationPlan, queue: list[DocPiece]) -> list[DocPiece]:
    """R queue members of similar work that the ordinary documents can balance, or none (wait).

    Candidates are the windows of R consecutive members by length, those holding the oldest member
    first, then by length spread; the first ``closable`` one is released. A group that never closes goes
    out when its oldest member reaches the delay bound (with its nearest companions).
    """
    r = plan.release_size
    by_len = sorted(queue, key=shortest_first_key)
    oldest = queue[0]
    windows = range(len(by_len) - r + 1)
    spread = [by_len[s + r - 1].length - by_len[s].length for s in windows]
    has_oldest = [oldest in by_len[s:s + r] for s in windows]
    order = sorted(windows, key=lambda s: (not has_oldest[s], spread[s], s))
    if plan.per_token <= 0:
        return by_len[order[0]:order[0] + r]
    for s in order:
        group = by_len[s:s + r]
        if closable(plan, [p.length for p in group]):
            return group
    return []


def _queue_release(plan: IterationPlan, queue: list[DocPiece], forced_q: list[DocPiece],
                   to_cut: set[DocPiece]) -> list[DocPiece]:
    """What one queue (oldest first) releases; forced outliers the cut policy cuts join ``to_cut``."""
    cfg = plan.config
    r = plan.release_size
    if forced_q:
        # A queue whose oldest member hit the delay bound goes out with it (its members nearest in
        # length), so the forced outlier does not run alone against short micro-batches; with a cut
        # policy, a forced outlier whose group the ordinary documents cannot balance is cut instead
        # and its would-be companions wait.
        anchor = max(p.length for p in forced_q)
        chosen = companions(queue, r - len(forced_q), anchor)
        if cfg.cut_policy != "none" and not closable(plan, [p.length for p in forced_q + chosen]):
            cuttable = [p for p in forced_q if may_cut(plan, p)]
            if cuttable:
                to_cut.update(cuttable)
                kept = [p for p in forced_q if p not in to_cut]
                chosen = companions(queue, r - len(kept), max(p.length for p in kept)) if kept else []
        return chosen
    if len(queue) >= r:
        return similar_group(plan, queue) if cfg.group_by_work else queue[:r]
    return []


def release_outliers(plan: IterationPlan, rest: list[DocPiece]) -> None:
    """Sort ``rest`` (the pool's pieces below the delay bound) into ``plan.candidates`` (ordinary pieces
    and released outliers) and ``plan.waiting``; forced outliers the cut policy cuts are replaced by
    their pieces in ``plan.forced``."""
    l1, th = plan.l1, plan.thresholds
    outliers: list[DocPiece] = []
    for p in rest:
        (plan.candidates if p.length < l1 else outliers).append(p)
    edges = np.asarray(th)
    levels = (np.searchsorted(edges, piece_lengths(outliers), side="right") - 1).tolist()
    forced_out = [p for p in plan.forced if p.length >= l1]
    forced_levels = (np.searchsorted(edges, piece_lengths(forced_out), side="right") - 1).tolist()
    to_cut: set[DocPiece] = set()
    for q in range(len(th)):
        queue = sorted((p for p, lv in zip(outliers, levels) if lv == q), key=oldest_first_key)
        forced_q = [p for p, lv in zip(forced_out, forced_levels) if lv == q]
        chosen = _queue_release(plan, queue, forced_q, to_cut)
        picked = set(chosen)
        plan.candidates.extend(chosen)
        plan.waiting.extend(p for p in queue if p not in picked)
    if to_cut:
        plan.forced = [piece for p in plan.forced for piece in (cut(plan, p) if p in to_cut else [p])]
    if plan.waiting and plan.config.release_when_balanced:
        paid = balanced_release(plan, plan.forced + plan.candidates)
        if paid:
            picked = set(paid)
            plan.waiting = [p for p in plan.waiting if p not in picked]
            plan.candidates.extend(paid)


def balanced_release(plan: IterationPlan, placed: list[DocPiece]) -> list[DocPiece]:
    """(i) Delay only when it pays: the queued outliers (oldest first) that this iteration can take and
    still balance (``stays_balanced``, with the iteration's outliers ``placed`` dealt by ``deal_outliers``
    and each new one to the least loaded micro-batch: O(micro-batches) per candidate). The ordinary
    tokens are those in hand, or, with the read-ahead fill (h), what it fills to (``read_ahead_fill`` x the
    budget) less the outliers. An outlier that no iteration could balance waits for a group, as before."""
    l1 = plan.l1
    queued = sorted((p for p in plan.waiting if p.length >= l1), key=oldest_first_key)
    if not queued or plan.per_token <= 0:
        return []
    cfg = plan.config
    m, cap = plan.m, plan.cap
    read_ahead = plan.reads_ahead
    big = [p.length for p in placed if p.length >= l1]
    in_hand = sum(p.length for p in placed if p.length < l1)
    bw, bt = deal_outliers(big, plan.latency, m)
    outlier_tokens = sum(big)
    weights = plan.latency([p.length for p in queued]).tolist()
    out: list[DocPiece] = []
    for p, x in zip(queued, weights):
        j = int(np.argmin(bw))
        if bt[j] + p.length > cap:
            continue
        tokens = outlier_tokens + p.length
        fill = int(cfg.read_ahead_fill * plan.budget)
        ordinary = max(in_hand, fill - tokens) if read_ahead else in_hand
        if tokens + in_hand > cap * m:
            continue
        bw[j] += x
        bt[j] += p.length
        if stays_balanced(bw, bt, plan.per_token, ordinary, cap):
            out.append(p)
            outlier_tokens = tokens
        else:
            bw[j] -= x
            bt[j] -= p.length
    plan.counts.balanced_releases += len(out)
    return out
