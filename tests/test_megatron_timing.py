"""The step timing of ``megatron_wlb.megatron.state.timing`` without Megatron's loop: the recorder's rows,
the stand-in CUDA events (read only once complete, never synchronised on the critical path), and the
cross-rank measurement over a real gloo world. The loop itself is in test_megatron_train.py
(``assert_trace``: one row per micro-batch per chunk per rank at PP2 x VPP2 and DP2)."""

from __future__ import annotations

import dataclasses

import numpy as np
import pytest

pytest.importorskip("torch")
pytest.importorskip("megatron.core")

from conftest import run_world  # noqa: E402

from megatron_wlb.costmodel import ParallelLayout, build_cost_model  # noqa: E402
from megatron_wlb.costmodel.measured import IterationTotals, imbalance_degree, measure_iteration  # noqa: E402
from megatron_wlb.costmodel.trace import MicroBatchRow, read_trace  # noqa: E402
from megatron_wlb.cp.plan import CPSharding  # noqa: E402
from megatron_wlb.megatron.data.packed import rank_micro_batch  # noqa: E402
from megatron_wlb.megatron.state import timing  # noqa: E402
from megatron_wlb.packing.types import DocPiece, MicroBatch  # noqa: E402

COST = build_cost_model("550m", ParallelLayout(1, 1, 1, 1))


class FakeIterator:
    """What the recorder reads of a ``WlbDataIterator``: the last micro-batch, its position, the iteration."""

    def __init__(self, lengths_per_micro_batch: list[list[int]], iteration: int = 0):
        self.iteration = iteration
        self.batches = [rank_micro_batch(lambda d, o, n: np.arange(n), MicroBatch(
            tuple(DocPiece(i, 0, d, 0) for i, d in enumerate(lengths)), 4096), CPSharding())
            for lengths in lengths_per_micro_batch]
        self.position = 0
        self.last = None

    def advance(self) -> None:
        self.last = self.batches[self.position]
        self.position += 1


class ManualClock(timing.CpuClock):
    """A clock the test moves by hand."""

    def __init__(self) -> None:
        self.now = 0.0

    def stamp(self) -> float:
        return self.now


def _ids(**kw) -> timing.RankIds:
    base = dict(rank=0, dp=0, pp=0, cp=0, tp=0, dp_size=1, cp_size=1, tp_size=1, layers_per_chunk=2)
    return timing.RankIds(**{**base, **kw})


def test_rows_attribute_steps_waits_and_reduction(tmp_path):
    clock = ManualClock()
    it = FakeIterator([[100, 20], [300]])
    rec = timing.Recorder(clock, _ids(), COST, n=2, chunk_of=lambda x: 0 if x is it else None,
                          trace=tmp_path / "t.jsonl", header={"model": None})
    rec.begin_pass()
    clock.now = 0.5
    rec.p2p((0.5, 1.0))                       # waited 0.5 s before the first forward
    clock.now = 1.0
    out0, out1 = object(), object()
    it.advance()
    rec.forward(it, out0, (1.0, 2.0))
    it.advance()
    rec.forward(it, out1, (2.0, 4.0))
    rec.forward(FakeIterator([[5]]), object(), (4.0, 4.5))  # not a training iterator: ignored
    rec.p2p((4.0, 4.25))
    rec.backward(out0, (4.25, 6.0))
    rec.backward(out1, (6.0, 7.0))
    rec.backward(object(), (7.0, 7.5))        # an output never seen forward: ignored
    rec.dp_wait((7.0, 7.75))
    clock.now = 8.0
    rec.end_pass()
    rows = rec.flush()
    mbs, its = rows[:-1], rows[-1]
    assert [(r.micro_batch, r.fwd_s, r.bwd_s, r.wait_fwd_s, r.wait_bwd_s) for r in mbs] == [
        (0, 1.0, 1.75, 0.5, 0.25), (1, 2.0, 1.0, 0.0, 0.0)]
    assert mbs[0].lengths == (100, 20) and mbs[0].tokens == 120 and mbs[0].sum_d2 == 100 ** 2 + 20 ** 2
    assert mbs[0].rank_pairs == 100 * 101 / 2 + 20 * 21 / 2 and mbs[0].rank_tokens == 120
    assert mbs[0].pred_fwd_s > 0 and mbs[1].predicted_s > mbs[0].predicted_s  # 300 tokens, quadratic
    assert (its.wall_s, its.compute_s, its.pp_wait_s, its.dp_wait_s, its.micro_batches) == (8.0, 5.75, 0.75, 0.75, 2)
    rec.close()
    trace = read_trace(tmp_path / "t.jsonl")  # the rank file, found from the run's path
    assert trace.micro_batches == tuple(mbs) and trace.iterations == (its,)
    assert trace.headers[0]["clock"] == "cpu"


class FakeEvent:
    """Stand-in for ``torch.cuda.Event``: completes when the test says so; counts synchronisations."""

    now = 0.0
    completed = 0.0
    synchronized = 0

    def __init__(self, enable_timing: bool = False):
        assert enable_timing
        self.at: float | None = None

    def record(self) -> None:
        self.at = FakeEvent.now

    def query(self) -> bool:
        return self.at is not None and self.at <= FakeEvent.completed

    def synchronize(self) -> None:
        FakeEvent.synchronized += 1
        FakeEvent.completed = max(FakeEvent.completed, self.at or 0.0)

    def elapsed_time(self, end: FakeEvent) -> float:
        assert self.query() and end.query(), "elapsed_time read before both events completed"
        return (end.at - self.at) * 1e3  # milliseconds, as CUDA reports


def _cuda_pass(rec: timing.Recorder, it: FakeIterator, iteration: int, start: float) -> None:
    it.iteration, it.position = iteration, 0
    FakeEvent.now = start
    rec.begin_pass()
    for _ in range(2):
        it.advance()
        a = rec.clock.stamp()
        FakeEvent.now += 1.0
        out = object()
        rec.forward(it, out, (a, rec.clock.stamp()))
        a = rec.clock.stamp()
        FakeEvent.now += 2.0
        rec.backward(out, (a, rec.clock.stamp()))
    FakeEvent.now += 0.5
    rec.end_pass()


def test_cuda_events_are_read_only_once_complete_and_one_iteration_late():
    FakeEvent.now = FakeEvent.completed = 0.0
    FakeEvent.synchronized = 0
    it = FakeIterator([[64], [32]])
    rec = timing.Recorder(timing.CudaClock(FakeEvent), _ids(), COST, n=2, chunk_of=lambda x: 0)
    _cuda_pass(rec, it, 0, 0.0)
    assert rec.flush() == []                   # the GPU has not got there: nothing read, nothing waited for
    assert rec.log_target == -1                # the training log measures one iteration behind on CUDA
    _cuda_pass(rec, it, 1, 10.0)
    FakeEvent.completed = 7.0                  # iteration 0's events done, iteration 1's not
    rows = rec.flush()
    assert {r.iteration for r in rows} == {0} and FakeEvent.synchronized == 0
    assert [(r.fwd_s, r.bwd_s) for r in rows[:-1]] == [(1.0, 2.0), (1.0, 2.0)]
    assert rows[-1].wall_s == pytest.approx(6.5)
    assert rec.log_target == 0 and rec.totals(0) is not None
    # asked for an iteration the GPU has not finished, the flush waits on that iteration only
    rows = rec.flush(through=1)
    assert {r.iteration for r in rows} == {1} and FakeEvent.synchronized == 1


def _row(**kw) -> MicroBatchRow:
    base = dict(iteration=0, rank=0, dp=0, pp=0, cp=0, tp=0, chunk=0, micro_batch=0, layers=1, tokens=10,
                sum_d2=100.0, lengths=(10,), rank_tokens=10, rank_pairs=55.0, rank_runs=1, data_s=0.0,
                pred_fwd_s=1.0, pred_bwd_s=1.0, fwd_s=1.0, bwd_s=1.0, wait_fwd_s=0.0, wait_bwd_s=0.0)
    return MicroBatchRow(**{**base, **kw})


def test_measured_imbalance_sums_stages_and_chunks_per_micro_batch():
    # DP rank 0: micro-batch 0 costs 2 + 2 (two stages), micro-batch 1 costs 6 + 6 -> degree 12 * 2 / 16
    rows = [_row(pp=s, micro_batch=j, fwd_s=f, bwd_s=f) for s in (0, 1) for j, f in ((0, 1.0), (1, 3.0))]
    m = measure_iteration(rows, [], dp=1, n=2, cp_tp=1)
    assert m.imbalance == pytest.approx(12 * 2 / 16) and m.imbalance_planned == pytest.approx(1.0)
    assert m.mape == pytest.approx(np.mean([0.0, 0.0, 2 / 3, 2 / 3]))
    assert m.tokens == 20  # counted once per micro-batch, on the first stage
    assert imbalance_degree(np.zeros((2, 4))) != imbalance_degree(np.zeros((2, 4)))  # NaN: nothing ran


def _world_measure(rank: int, world: int, path: str) -> None:
    from megatron_wlb.costmodel.trace import IterationRow

    rows = [_row(rank=rank, dp=rank, micro_batch=j, fwd_s=1.0 + rank + j, bwd_s=2.0) for j in range(2)]
    summary = IterationRow(iteration=0, rank=rank, dp=rank, pp=0, cp=0, tp=0, wall_s=10.0 + rank, compute_s=7.0,
                           pp_wait_s=0.0, dp_wait_s=1.0 - rank, timing_s=0.0, micro_batches=2)
    rec = timing.Recorder(timing.CpuClock(), _ids(rank=rank, dp=rank, dp_size=world), COST, n=2,
                          chunk_of=lambda x: 0)
    rec._resolved[0] = IterationTotals.of(rows, [summary], world, 2, 1)
    got = rec.measure(0, timing.all_reduce)
    assert rec.measure(5, timing.all_reduce) is None  # an iteration no rank has: None everywhere, no hang
    if rank == 0:
        import pickle

        with open(path, "wb") as f:
            pickle.dump(got, f)


def test_measure_over_a_gloo_world_equals_the_whole_trace(tmp_path):
    import pickle

    from megatron_wlb.costmodel.trace import IterationRow

    run_world(_world_measure, 2, start_method="fork", path=str(tmp_path / "m.pkl"))
    got = pickle.loads((tmp_path / "m.pkl").read_bytes())
    rows = [_row(rank=r, dp=r, micro_batch=j, fwd_s=1.0 + r + j, bwd_s=2.0) for r in (0, 1) for j in range(2)]
    its = [IterationRow(iteration=0, rank=r, dp=r, pp=0, cp=0, tp=0, wall_s=10.0 + r, compute_s=7.0, pp_wait_s=0.0,
                        dp_wait_s=1.0 - r, timing_s=0.0, micro_batches=2) for r in (0, 1)]
    whole = measure_iteration(rows, its, dp=2, n=2, cp_tp=1)
    assert got.mape == pytest.approx(whole.mape) and got == dataclasses.replace(whole, mape=got.mape)
    assert got.wall_s == 11.0 and got.slowest_s == 11.0 and got.idle_fraction == pytest.approx(1 - 14 / 21)
