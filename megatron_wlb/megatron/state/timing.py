"""Per-micro-batch timing inside Megatron's training loop: the measured side of the cost model.

``install(recorder)`` wraps, in ``megatron.core.pipeline_parallel.schedules`` and
``megatron.training.training`` (module globals, so every schedule picks them up):

- the three ``forward_backward_*`` schedule functions: one *pass* per training step
  (``forward_only`` passes, i.e. evaluation, are not recorded);
- ``forward_step`` / ``backward_step``: each micro-batch's forward and backward per model chunk; the
  micro-batch is the one our ``WlbDataIterator`` just yielded to that chunk, its backward is found by
  the identity of the output the schedule hands back;
- ``P2PCommunicator``'s send/receive methods: pipeline waits, charged to the next step;
- ``finalize_model_grads``: the DP gradient reduction (a rank that finished early waits here).

Timestamps come from a ``Clock``: ``CpuClock`` reads a monotonic clock (``ThreadClock``, with
``WLB_TRACE_CLOCK=thread``: the thread's CPU time); ``CudaClock`` records CUDA
events on the current stream and reads them only once they have completed (``query()``), so nothing
synchronises on the critical path. ``Recorder.flush()`` (called from ``training_log`` every
iteration) turns completed passes into ``costmodel.trace`` rows, writes them to this rank's trace file
(``--wlb-trace PATH``), and returns them; ``Recorder.measure()`` reduces one iteration over all ranks
with two small all-reduces (``costmodel.measured.IterationTotals``) into the ``wlb/measured_*`` scalars.

Overhead: two clock reads per step and per pipeline call, one dict entry per micro-batch in flight,
one JSON line per micro-batch at flush; measured in ``benchmarks/bench_measured.py``.
"""

from __future__ import annotations

import json
import time
from collections.abc import Callable
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import IO, Any

import numpy as np
import torch
import torch.distributed as dist

from megatron_wlb.costmodel import CostModel, causal_pairs
from megatron_wlb.costmodel.measured import IterationTotals, MeasuredIteration
from megatron_wlb.costmodel.trace import (
    TRACE_FORMAT,
    IterationRow,
    MicroBatchRow,
    row_to_json,
    trace_path_for_rank,
)
from megatron_wlb.cp.dynamic import group_cost_models
from megatron_wlb.cp.plan import RankMicroBatch
from megatron_wlb.megatron.data.device import training_device
from megatron_wlb.megatron.hooks import table as hooks
from megatron_wlb.megatron.hooks.rebind import wrapping
from megatron_wlb.megatron.state.clocks import Clock as Clock
from megatron_wlb.megatron.state.clocks import CpuClock as CpuClock
from megatron_wlb.megatron.state.clocks import CudaClock as CudaClock
from megatron_wlb.megatron.state.clocks import ThreadClock as ThreadClock

Span = tuple[Any, Any]


@dataclass
class _Step:
    """One micro-batch on one chunk: its row as planned (times still 0) and the stamps measuring it."""
    row: MicroBatchRow
    fwd: Span
    wait_fwd: list[Span]
    bwd: Span | None = None
    wait_bwd: list[Span] = field(default_factory=list)


@dataclass
class _Pass:
    """One rank's forward-backward pass (one training step)."""
    start: Any
    steps: list[_Step] = field(default_factory=list)
    p2p: list[Span] = field(default_factory=list)
    dp: list[Span] = field(default_factory=list)
    end: Any = None
    timing_s: float = 0.0  # host seconds the timing itself took since the previous pass


@dataclass(frozen=True)
class RankIds:
    """This process's place in the 4D layout, and the sizes the measurement needs."""
    rank: int
    dp: int
    pp: int
    cp: int
    tp: int
    dp_size: int
    cp_size: int
    tp_size: int
    layers_per_chunk: int
    #: ``--wlb-cp-sharding dynamic``: the measured latency table has a row per slot of the DP x CP pool
    dynamic: bool = False

    @property
    def table(self) -> tuple[int, int, int]:
        """(this rank's row, rows, ranks per row and stage) of the measured ``(rows, n)`` latency table: per DP
        rank over its CP x TP ranks, or under dynamic CP per pool slot (``dp x CP + cp``) over its TP ranks."""
        if self.dynamic:
            return self.dp * self.cp_size + self.cp, self.dp_size * self.cp_size, self.tp_size
        return self.dp, self.dp_size, self.cp_size * self.tp_size


def rank_share(batch: RankMicroBatch) -> tuple[int, float, int]:
    """(query rows, causal (query, key) pairs, query runs) this CP rank's attention computes for ``batch``."""
    q = np.diff(batch.cu_seqlens_q)
    k = np.diff(batch.cu_seqlens_k)
    return int(q.sum()), float(causal_pairs(q, k).sum()) if q.size else 0.0, int((q > 0).sum())


class Recorder:
    """Times this rank's steps (see the module docstring); ``chunk_of(iterator)`` names the model chunk
    whose ``WlbDataIterator`` an iterator is (None: not a training iterator, not recorded)."""

    def __init__(self, clock: Clock, ids: RankIds, cost: CostModel | None, n: int,
                 chunk_of: Callable[[Any], int | None], trace: str | Path | None = None,
                 header: dict[str, Any] | None = None):
        self.clock, self.ids, self.cost, self.n = clock, ids, cost, n
        self.chunk_of = chunk_of
        self._pass: _Pass | None = None
        self._passes: list[_Pass] = []
        self._in_flight: dict[int, tuple[Any, _Step]] = {}
        self._p2p_since: list[Span] = []
        self._resolved: dict[int, IterationTotals] = {}
        self._group_costs: dict[int, CostModel] = {}  # dynamic CP: the cost model per group size (``_cost_of``)
        self._group_costs_of: CostModel | None = None  # ... of this model
        self.latest = -1  # plan iteration of the newest recorded pass
        self.overhead_s = 0.0  # host seconds of timing work not yet charged to a pass
        self._file: IO[str] | None = None
        self.path = trace_path_for_rank(trace, ids.rank) if trace is not None else None
        if self.path is not None:
            self.path.parent.mkdir(parents=True, exist_ok=True)
            self._file = open(self.path, "w")
            head = {"kind": "header", "format": TRACE_FORMAT, "rank": ids.rank, "clock": clock.kind,
                    **(header or {})}
            self._file.write(json.dumps(head, separators=(",", ":")) + "\n")
            self._file.flush()

    # -- what the hooks call ---------------------------------------------------------------------
    def begin_pass(self) -> None:
        self._pass = _Pass(self.clock.stamp())
        self._p2p_since = []

    def end_pass(self) -> None:
        if self._pass is None:
            return
        self._pass.end = self.clock.stamp()
        self._pass.timing_s, self.overhead_s = self.overhead_s, 0.0
        if self._pass.steps:
            self._passes.append(self._pass)
            self.latest = self._pass.steps[0].row.iteration
        self._pass = None
        self._in_flight.clear()

    def p2p(self, span: Span) -> None:
        if self._pass is not None:
            self._pass.p2p.append(span)
            self._p2p_since.append(span)

    def dp_wait(self, span: Span) -> None:
        if self._pass is not None:
            self._pass.dp.append(span)

    def forward(self, iterator: Any, output: Any, span: Span) -> None:
        """A forward step ran on ``iterator``'s chunk and returned ``output`` (its backward's key)."""
        if self._pass is None:
            return
        inner = getattr(iterator, "iterable", iterator)  # Megatron's RerunDataIterator wraps ours
        chunk = self.chunk_of(inner)
        batch = getattr(inner, "last", None)
        if chunk is None or not isinstance(batch, RankMicroBatch):
            return
        lengths = tuple(p.length for p in batch.micro_batch.pieces) if batch.micro_batch is not None else ()
        pred_fwd = pred_bwd = 0.0
        cost = self._cost_of(batch)
        layers = self.ids.layers_per_chunk
        if cost is not None and lengths:  # this rank's share as laid out
            fwd, bwd = batch.layout.seconds(cost)
            pred_fwd, pred_bwd = float(fwd[batch.rank]) * layers, float(bwd[batch.rank]) * layers
        elif cost is not None:  # a micro-batch of no document (a dynamic-CP slot done before Megatron's count)
            pred_fwd, pred_bwd = (x * layers for x in cost.empty_seconds)
        rank_tokens, rank_pairs, rank_runs = rank_share(batch)
        d = np.asarray(lengths, dtype=np.float64)
        ids = self.ids
        # dynamic CP: the CP rank within the micro-batch's own group (its tokens are then counted once)
        cp = ids.cp if batch.block is None else ids.dp * ids.cp_size + ids.cp - batch.block[0]
        row = MicroBatchRow(
            iteration=inner.iteration, rank=ids.rank, dp=ids.dp, pp=ids.pp, cp=cp, tp=ids.tp, chunk=chunk,
            micro_batch=inner.position - 1, layers=ids.layers_per_chunk, tokens=int(d.sum()),
            sum_d2=float((d * d).sum()), lengths=lengths, rank_tokens=rank_tokens, rank_pairs=rank_pairs,
            rank_runs=rank_runs, pred_fwd_s=pred_fwd, pred_bwd_s=pred_bwd, fwd_s=0.0, bwd_s=0.0,
            data_s=float(getattr(inner, "last_seconds", 0.0)), wait_fwd_s=0.0, wait_bwd_s=0.0,
            group=ids.cp_size if batch.block is None else batch.block[1],
            run_q=tuple(int(x) for x in np.diff(batch.cu_seqlens_q)),
            run_kv=tuple(int(x) for x in np.diff(batch.cu_seqlens_k)))
        step = _Step(row, span, self._p2p_since)
        self._p2p_since = []
        self._pass.steps.append(step)
        self._in_flight[id(output)] = (output, step)  # the reference keeps the id unique until backward

    def _cost_of(self, batch: RankMicroBatch) -> CostModel | None:
        """The cost model that prices ``batch``: the run's, or under dynamic CP (``batch.block``) the run's at
        the CP size of the micro-batch's group over the stage's DP x CP pool, as its plan priced it."""
        if batch.block is None or self.cost is None:
            return self.cost
        if self._group_costs_of is not self.cost:  # first use, or an online refit replaced the model
            self._group_costs = group_cost_models(self.cost, self.ids.dp_size * self.ids.cp_size)
            self._group_costs_of = self.cost
        return self._group_costs[batch.block[1]]

    def backward(self, output: Any, span: Span) -> None:
        found = self._in_flight.pop(id(output), None)
        if found is None:
            return
        step = found[1]
        step.bwd, step.wait_bwd = span, self._p2p_since
        self._p2p_since = []

    # -- reading the stamps ------------------------------------------------------------------------
    @property
    def log_target(self) -> int:
        """The plan iteration the training log measures now: the newest, ``clock.lag`` behind."""
        return self.latest - self.clock.lag

    def flush(self, through: int | None = None) -> list[MicroBatchRow | IterationRow]:
        """Rows of every pass whose stamps have completed (and of every pass up to plan iteration
        ``through``, waiting for its last stamp), oldest first; written to the trace file."""
        out: list[MicroBatchRow | IterationRow] = []
        while self._passes:
            head = self._passes[0]
            if not self.clock.ready(head.end):
                if through is None or head.steps[0].row.iteration > through:
                    break
                self.clock.wait(head.end)
            out.extend(self._rows(self._passes.pop(0)))
        if self._file is not None and out:
            self._file.write("".join(row_to_json(r) + "\n" for r in out))
            self._file.flush()
        return out

    def _seconds(self, spans: list[Span]) -> float:
        return sum(self.clock.seconds(a, b) for a, b in spans)

    def _rows(self, p: _Pass) -> list[MicroBatchRow | IterationRow]:
        ids, s = self.ids, self.clock.seconds
        rows = [replace(st.row, fwd_s=s(*st.fwd), bwd_s=s(*st.bwd) if st.bwd is not None else 0.0,
                        wait_fwd_s=self._seconds(st.wait_fwd), wait_bwd_s=self._seconds(st.wait_bwd))
                for st in p.steps]
        iteration = p.steps[0].row.iteration
        summary = IterationRow(iteration=iteration, rank=ids.rank, dp=ids.dp, pp=ids.pp, cp=ids.cp, tp=ids.tp,
                               wall_s=s(p.start, p.end), compute_s=sum(r.fwd_s + r.bwd_s for r in rows),
                               pp_wait_s=self._seconds(p.p2p), dp_wait_s=self._seconds(p.dp),
                               timing_s=p.timing_s, micro_batches=len({st.row.micro_batch for st in p.steps}))
        row, table_rows, per_row = ids.table
        self._resolved[iteration] = IterationTotals.of([replace(r, dp=row) for r in rows], [summary], table_rows,
                                                       self.n, per_row)
        for old in [k for k in self._resolved if k < iteration - 8]:
            del self._resolved[old]
        return [*rows, summary]

    def totals(self, iteration: int) -> IterationTotals | None:
        """This rank's reduced rows of ``iteration`` (plan iteration, 0-based), if flushed."""
        return self._resolved.get(iteration)

    def measure(self, iteration: int, all_reduce: Callable[[np.ndarray, str], np.ndarray]) -> MeasuredIteration | None:
        """``iteration`` over every rank: ``all_reduce(vector, "max"|"sum")`` combines the ranks' totals
        (every rank must call this for the same iteration). None if this rank has not flushed it."""
        mine = self._resolved.get(iteration)
        # every rank takes part in the reductions, even one without the iteration (it then adds nothing)
        table_rows = self.ids.table[1]
        size = IterationTotals.SCALAR_SUMS + 2 * table_rows * self.n
        maxima = mine.maxima if mine is not None else np.zeros(2)
        sums = mine.sums if mine is not None else np.zeros(size)
        have = all_reduce(np.array([1.0 if mine is not None else 0.0]), "min")
        maxima, sums = all_reduce(maxima, "max"), all_reduce(sums, "sum")
        if have[0] < 1.0:
            return None
        return IterationTotals(iteration, table_rows, self.n, maxima, sums).summary()

    def write(self, row: dict[str, Any]) -> None:
        """Add a row of another kind (the online refit's ``refit`` rows) to the trace file, if any."""
        if self._file is not None:
            self._file.write(json.dumps(row, separators=(",", ":")) + "\n")
            self._file.flush()

    def close(self) -> None:
        if self._file is not None:
            self._file.close()
            self._file = None


# -- hooks ---------------------------------------------------------------------------------------------
#: the recorder the installed wrappers report to (one per process; None: the wrappers pass through)
_ACTIVE: list[Recorder | None] = [None]


def activate(recorder: Recorder | None) -> None:
    """Make the installed wrappers report to ``recorder`` (None: stop recording)."""
    previous = _ACTIVE[0]
    if previous is not None and previous is not recorder:
        previous.close()
    _ACTIVE[0] = recorder


def active() -> Recorder | None:
    return _ACTIVE[0]


def _timed(original: Callable[..., Any], on_done: Callable[[Recorder, tuple, dict, Any, Span], None]
           ) -> Callable[..., Any]:
    """``original``, timed on the active recorder's clock and reported through ``on_done``."""

    @wrapping(original)
    def timed(*args: Any, **kwargs: Any) -> Any:
        recorder = _ACTIVE[0]
        if recorder is None:
            return original(*args, **kwargs)
        t0 = time.perf_counter()
        start = recorder.clock.stamp()
        t1 = time.perf_counter()
        out = original(*args, **kwargs)
        t2 = time.perf_counter()
        on_done(recorder, args, kwargs, out, (start, recorder.clock.stamp()))
        recorder.overhead_s += (t1 - t0) + (time.perf_counter() - t2)
        return out

    return timed


def wrap_pass(original: Callable[..., Any]) -> Callable[..., Any]:
    """A schedule function: one pass per training step (evaluation's forward-only passes are skipped)."""

    @wrapping(original)
    def forward_backward(*args: Any, **kwargs: Any) -> Any:
        recorder = _ACTIVE[0]
        if recorder is None or kwargs.get("forward_only", False):
            return original(*args, **kwargs)
        recorder.begin_pass()
        try:
            return original(*args, **kwargs)
        finally:
            recorder.end_pass()

    return forward_backward


def _forward_done(recorder: Recorder, args: tuple, kwargs: dict, out: Any, span: Span) -> None:
    recorder.forward(kwargs.get("data_iterator", args[1] if len(args) > 1 else None), out[0], span)


def _backward_done(recorder: Recorder, args: tuple, kwargs: dict, out: Any, span: Span) -> None:
    recorder.backward(kwargs.get("output_tensor", args[1] if len(args) > 1 else None), span)


def all_reduce(values: np.ndarray, op: str) -> np.ndarray:
    """``values`` combined over every rank ("max", "min" or "sum"), on the training device, float64: a new
    array every call (the caller's is never written, so the MIN and MAX of one array stay two results)."""
    if not dist.is_initialized():
        return np.array(values, dtype=np.float64)  # a copy, as on the distributed path
    ops = {"max": dist.ReduceOp.MAX, "min": dist.ReduceOp.MIN, "sum": dist.ReduceOp.SUM}
    # torch.tensor copies (torch.as_tensor would share the caller's float64 array on a CPU device)
    tensor = torch.tensor(np.asarray(values, dtype=np.float64), device=training_device())
    dist.all_reduce(tensor, op=ops[op])
    return tensor.cpu().numpy()


def wrap_forward_step(original: Callable[..., Any]) -> Callable[..., Any]:
    return _timed(original, _forward_done)


def wrap_backward_step(original: Callable[..., Any]) -> Callable[..., Any]:
    return _timed(original, _backward_done)


def wrap_p2p(original: Callable[..., Any]) -> Callable[..., Any]:
    return _timed(original, lambda rec, a, k, o, span: rec.p2p(span))


def wrap_finalize_model_grads(original: Callable[..., Any]) -> Callable[..., Any]:
    return _timed(original, lambda rec, a, k, o, span: rec.dp_wait(span))


def install() -> None:
    """Wrap the schedule, step, pipeline and gradient-reduction functions (``hooks.HOOKS``, phase ``timing``;
    idempotent). Call before Megatron sets up the model (``validate_args`` time): ``training`` copies
    ``finalize_model_grads`` into the model config there. Until ``activate`` names a recorder the wrappers only
    pass through."""
    hooks.install("timing")
