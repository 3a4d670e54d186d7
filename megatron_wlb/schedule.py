"""Pipeline schedules played out event by event: 1F1B and interleaved 1F1B (virtual stages).

Input is a table of forward and backward seconds per (virtual chunk, PP stage, micro-batch),
different for every micro-batch when micro-batches have different lengths, and the seconds of a
point-to-point transfer of each micro-batch's activations between two PP ranks. Each PP rank runs
its operations in the fixed order Megatron-LM's schedule gives it; an operation starts when its
rank is free and its input has arrived (the previous stage's forward, the next stage's backward).
That is a longest-path computation over a DAG, so the result does not depend on the order in which
ranks are visited; a schedule whose orders cannot all complete raises instead of hanging.

Closed forms this reproduces (checked in tests/test_sim_schedule.py): with uniform times and no
transfers, 1F1B takes ``(m + p - 1)(t_f + t_b)`` with bubble fraction ``(p - 1) / (m + p - 1)``;
with ``v`` virtual stages the bubble time ``(p - 1)(t_f + t_b)`` shrinks to ``(p - 1)(t_f + t_b) / v``.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

SCHEDULES = ("1f1b", "interleaved")


@dataclass(frozen=True)
class Op:
    """One executed operation: ``kind`` "F" or "B" of ``micro_batch`` in model ``chunk`` on PP ``stage``."""

    stage: int
    chunk: int
    micro_batch: int
    kind: str
    start: float
    end: float


@dataclass(frozen=True)
class PipelineResult:
    """What one pipeline (one DP rank's PP group) did in one iteration.

    ``busy[s]`` is the compute seconds of PP rank ``s``; ``makespan`` the time its last operation
    ends; ``finish[j]`` when micro-batch ``j``'s last backward ends; ``events`` every operation in
    start order (for a Gantt chart).
    """

    makespan: float
    busy: np.ndarray
    finish: np.ndarray
    events: tuple[Op, ...]
    virtual_stages: int

    @property
    def stages(self) -> int:
        return int(self.busy.size)

    @property
    def bubble_fraction(self) -> float:
        """Idle share of the PP ranks' time until the makespan: ``1 - sum(busy) / (p * makespan)``."""
        if self.makespan <= 0:
            return 0.0
        return float(1.0 - self.busy.sum() / (self.busy.size * self.makespan))


def op_order(stage: int, stages: int, micro_batches: int, virtual_stages: int = 1,
             group_size: int | None = None) -> list[tuple[str, int, int]]:
    """Megatron-LM's order of (kind, chunk, micro_batch) on PP rank ``stage``.

    ``virtual_stages == 1`` is 1F1B: ``p - stage - 1`` warm-up forwards, then one forward / one
    backward pairs, then the cool-down backwards. ``virtual_stages > 1`` is interleaved 1F1B
    (``forward_backward_pipelining_with_interleaving``): virtual micro-batch ``k`` belongs to chunk
    ``(k mod (g v)) div g`` and micro-batch ``(k div (g v)) g + k mod g`` with ``g = group_size``
    (default ``p``); warm-up is ``2 (p - stage - 1) + (v - 1) g`` virtual micro-batches, and all of
    them when that covers every one (Megatron's ``all_warmup_microbatches``).
    """
    p, m, v = stages, micro_batches, virtual_stages
    _check_counts(p, m, v)
    order: list[tuple[str, int, int]]
    if v == 1:
        warm = min(p - stage - 1, m)
        order = [("F", 0, j) for j in range(warm)]
        for i in range(m - warm):
            order.append(("F", 0, warm + i))
            order.append(("B", 0, i))
        order.extend(("B", 0, j) for j in range(m - warm, m))
        return order
    g = p if group_size is None else group_size
    if m % g:
        raise ValueError(f"interleaved 1F1B needs micro_batches ({m}) divisible by the group size ({g})")
    total = m * v

    def place(k: int, forward: bool) -> tuple[int, int]:
        chunk = (k % (g * v)) // g
        if not forward:
            chunk = v - 1 - chunk
        return chunk, (k // (g * v)) * g + k % g

    warm = (p - stage - 1) * 2 + (v - 1) * g
    warm = total if warm >= total else warm
    order = []
    for k in range(warm):
        order.append(("F", *place(k, True)))
    for i in range(total - warm):
        order.append(("F", *place(warm + i, True)))
        order.append(("B", *place(i, False)))
    for k in range(total - warm, total):
        order.append(("B", *place(k, False)))
    return order


def _check_counts(p: int, m: int, v: int) -> None:
    for name, value in (("stages", p), ("micro_batches", m), ("virtual_stages", v)):
        if isinstance(value, bool) or not isinstance(value, (int, np.integer)) or value < 1:
            raise ValueError(f"{name} must be a positive integer, got {value!r}")


def _as_table(times: np.ndarray, v: int, what: str) -> np.ndarray:
    arr = np.asarray(times, dtype=np.float64)
    if arr.ndim == 2:
        # (p, m) totals per stage: the stage's layers are split evenly over its v chunks.
        arr = np.broadcast_to(arr / v, (v, *arr.shape))
    if arr.ndim != 3 or arr.shape[0] != v:
        raise ValueError(f"{what} must have shape (stages, micro_batches) or (virtual_stages={v}, stages, "
                         f"micro_batches), got {np.shape(times)}")
    if not np.all(np.isfinite(arr)) or np.any(arr < 0):
        raise ValueError(f"{what} must hold finite non-negative seconds")
    return arr


def simulate_pipeline(fwd: np.ndarray, bwd: np.ndarray, p2p: np.ndarray | float = 0.0,
                      virtual_stages: int = 1, group_size: int | None = None,
                      keep_events: bool = True) -> PipelineResult:
    """Play one iteration of (interleaved) 1F1B over variable per-micro-batch times.

    ``fwd``/``bwd``: seconds of shape ``(p, m)`` (stage totals, split evenly over the virtual
    chunks) or ``(v, p, m)`` per chunk. ``p2p``: seconds to move micro-batch ``j``'s activations
    (or gradients) from one PP rank to the next, scalar or shape ``(m,)``; charged on every edge
    between two different ranks.
    """
    v = int(virtual_stages)
    _check_counts(1, 1, v)
    f = _as_table(fwd, v, "fwd")
    b = _as_table(bwd, v, "bwd")
    if f.shape != b.shape:
        raise ValueError(f"fwd and bwd shapes differ: {f.shape} vs {b.shape}")
    _, p, m = f.shape
    _check_counts(p, m, v)
    comm = np.broadcast_to(np.asarray(p2p, dtype=np.float64), (m,))
    if np.any(comm < 0) or not np.all(np.isfinite(comm)):
        raise ValueError("p2p must hold finite non-negative seconds")

    f_end = np.full((v, p, m), np.nan)
    b_end = np.full((v, p, m), np.nan)
    orders = [op_order(s, p, m, v, group_size) for s in range(p)]
    ptr = [0] * p
    clock = np.zeros(p)
    busy = np.zeros(p)
    events: list[Op] = []
    remaining = sum(len(o) for o in orders)
    while remaining:
        progressed = False
        for s in range(p):
            order = orders[s]
            while ptr[s] < len(order):
                kind, c, j = order[ptr[s]]
                ready = _ready(kind, c, s, j, p, v, f_end, b_end, comm)
                if ready is None:
                    break
                start = max(clock[s], ready)
                dur = f[c, s, j] if kind == "F" else b[c, s, j]
                end = start + dur
                (f_end if kind == "F" else b_end)[c, s, j] = end
                clock[s] = end
                busy[s] += dur
                if keep_events:
                    events.append(Op(s, c, j, kind, float(start), float(end)))
                ptr[s] += 1
                remaining -= 1
                progressed = True
        if not progressed:
            stuck = {s: orders[s][ptr[s]] for s in range(p) if ptr[s] < len(orders[s])}
            raise RuntimeError(f"pipeline schedule deadlocked; next operations per stage: {stuck}")
    finish = b_end[0, 0, :].copy()
    events.sort(key=lambda e: (e.start, e.stage))
    return PipelineResult(makespan=float(clock.max()), busy=busy, finish=finish, events=tuple(events),
                          virtual_stages=v)


def _ready(kind: str, c: int, s: int, j: int, p: int, v: int, f_end: np.ndarray, b_end: np.ndarray,
           comm: np.ndarray) -> float | None:
    """When the input of an operation is available on its rank, or None if not produced yet."""
    if kind == "F":
        if s > 0:
            src, hop = f_end[c, s - 1, j], True
        elif c > 0:
            src, hop = f_end[c - 1, p - 1, j], p > 1
        else:
            return 0.0
    else:
        if s < p - 1:
            src, hop = b_end[c, s + 1, j], True
        elif c < v - 1:
            src, hop = b_end[c + 1, 0, j], p > 1
        else:
            src, hop = f_end[c, s, j], False
    if np.isnan(src):
        return None
    return float(src + (comm[j] if hop else 0.0))


def textbook_1f1b(stages: int, micro_batches: int, t_f: float, t_b: float,
                  virtual_stages: int = 1) -> tuple[float, float]:
    """Closed-form (makespan, bubble fraction) of uniform (interleaved) 1F1B without transfers."""
    p, m, v = stages, micro_batches, virtual_stages
    makespan = m * (t_f + t_b) + (p - 1) * (t_f + t_b) / v
    bubble = (p - 1) / v / (m + (p - 1) / v)
    return makespan, bubble
