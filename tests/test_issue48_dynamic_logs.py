"""Issue 48: under ``--wlb-cp-sharding dynamic`` the per-step log and the timing trace report the dynamic-CP plan's
own predictions, not the fixed CP size's, and the plan is priced by the packer's cost model (the one an online
refit replaces), not a copy the pool was built with.

Four data iterators, one per slot of a DP2 x CP2 pool, plan mixed-length global batches (pieces too long for one
slot run on a group of 2 or 4, short ones alone). The metrics logger (``wlb_logging``) logs, for each iteration,
the plan's slowest slot seconds, its ratio to the slots' mean and to the ideal, and the paper's degree per slot
over its micro-batch seconds, all equal to the plan recomputed here; they differ from what the fixed CP 2 pricing
gives. The timing recorder (``timing.Recorder``) predicts each slot's micro-batch at its group's CP size: forward +
backward = the plan's seconds of that slot at that step, times the chunk's layers; a row's ``cp`` is the rank's
place in that group, so the measured tokens count each micro-batch once, and the measured latency table has a row
per slot: its predicted imbalance is the log's.
"""

from __future__ import annotations

import os
import sysconfig

import numpy as np
import pytest

from megatron_wlb.costmodel import ParallelLayout, build_cost_model
from megatron_wlb.costmodel.measured import IterationTotals
from megatron_wlb.cp.dynamic_steps import DynamicPool, slot_step_seconds
from megatron_wlb.data.reader import DocumentReader, byte_documents, write_indexed_dataset
from megatron_wlb.megatron.data.packed import WlbDataIterator
from megatron_wlb.megatron.state.wlb_logging import WlbMetricsLogger, iteration_metrics
from megatron_wlb.packing import make_packer
from megatron_wlb.packing.types import PackingConfig

SLOTS, CP, DP = 4, 2, 2
SEQ_LEN, N = 512, 8  # 8 micro-batches a slot: room for plans that mix group sizes
CAP = SEQ_LEN * 3 // 2 // CP  # a slot's share of the packer's capacity (1.5 x --seq-length) at CP 2
COST = build_cost_model("7b", ParallelLayout(tp=1, cp=CP, dp=DP))
#: the pool's own model, which the packer's (``COST``: the run's, or its online refit) overrides
POOL_COST = build_cost_model("550m", ParallelLayout(tp=1, cp=CP, dp=DP))


def _iterators(tmp_path, on_batch):
    root = sysconfig.get_paths()["stdlib"]
    files = sorted(os.path.join(root, f) for f in os.listdir(root) if f.endswith(".py"))[:12]
    prefix = write_indexed_dataset(str(tmp_path / "a_text_document"), byte_documents(files))
    reader = DocumentReader([(prefix, 1.0)], split="1,0,0", seed=3)
    cfg = PackingConfig(seq_len=SEQ_LEN, n=N, dp=DP)
    stream = reader.stream(6 * cfg.tokens_per_iteration)
    return [WlbDataIterator(reader, stream, make_packer("original", cfg, COST), slot // CP,
                            on_batch=on_batch if slot == 0 else None,
                            dynamic=DynamicPool(SLOTS, slot, CAP, POOL_COST)) for slot in range(SLOTS)]


def _plan_of(batch, cost=COST):
    return DynamicPool(SLOTS, 0, CAP, cost).plan([mb.lengths for mb in batch.micro_batches], N)


class _Writer:
    def __init__(self):
        self.scalars: dict[str, float] = {}

    def add_scalar(self, key, value, iteration):
        self.scalars[key] = value


def test_the_log_reports_the_dynamic_plans_prediction(tmp_path):
    lines: list[str] = []
    writer = _Writer()
    logger = WlbMetricsLogger(COST, SEQ_LEN, print_fn=lines.append, tb_writer=lambda: writer, stages=1)
    its = _iterators(tmp_path, logger.on_batch)
    for iteration in (1, 2):
        for it in its:
            for _ in range(it.n):
                next(it)
        batch = its[0].current
        plan = _plan_of(batch)
        assert {mb.size for mb in plan.micro_batches} >= {1, 2}  # groups of several sizes: a real dynamic plan
        pool_plan = _plan_of(batch, POOL_COST)  # what the pool's own model would plan (not what runs)
        assert pool_plan.slowest_seconds != pytest.approx(plan.slowest_seconds, rel=1e-3)
        m = logger.log(iteration)
        assert m is not None and m.iteration == batch.iteration
        # the plan's own numbers, recomputed from its micro-batches (each slot's share of its group's)
        per_slot = np.array([sum(mb.seconds for mb in mbs) for mbs in plan.rank_micro_batches])
        assert m.slowest_s == pytest.approx(per_slot.max(), rel=1e-12)
        assert m.schedule_ratio == pytest.approx(per_slot.max() / per_slot.mean(), rel=1e-12)
        assert m.over_ideal == pytest.approx(per_slot.max() / plan.ideal_seconds, rel=1e-12)
        table = np.zeros((SLOTS, N))
        for slot, mbs in enumerate(plan.rank_micro_batches):
            for step, mb in enumerate(mbs):
                table[slot, step] = mb.seconds
        degrees = table.max(axis=1) * N / table.sum(axis=1)
        assert m.imbalance == pytest.approx(degrees.mean(), rel=1e-12)
        assert m.imbalance_max == pytest.approx(degrees.max(), rel=1e-12)
        assert m.imbalance_global == pytest.approx(table.max() / table.mean(), rel=1e-12)
        assert np.allclose(slot_step_seconds(plan, N), table, rtol=1e-12, atol=0)
        # what is written: the same numbers
        assert writer.scalars["wlb/slowest_s"] == m.slowest_s and writer.scalars["wlb/over_ideal"] == m.over_ideal
        assert writer.scalars["wlb/imbalance"] == m.imbalance
        assert f"slowest rank {m.slowest_s * 1e3:.4g} ms per layer (predicted, {m.over_ideal:.3f} x ideal)" in lines[-1]
        # ... which is not what the fixed CP 2 pricing of the packer's micro-batches says
        fixed = iteration_metrics(batch, COST, SEQ_LEN, stages=1)
        assert np.isnan(fixed.over_ideal) and fixed.slowest_s > 0
        assert fixed.slowest_s != pytest.approx(m.slowest_s, rel=1e-3)
        assert fixed.imbalance != pytest.approx(m.imbalance, rel=1e-3)


def test_the_trace_prices_each_micro_batch_at_its_groups_cp_size(tmp_path):
    from megatron_wlb.megatron.state.timing import CpuClock, RankIds, Recorder

    layers = 3
    its = _iterators(tmp_path, None)
    rows_of, totals = [], []
    for slot, it in enumerate(its):
        ids = RankIds(rank=slot, dp=slot // CP, pp=0, cp=slot % CP, tp=0, dp_size=DP, cp_size=CP, tp_size=1,
                      layers_per_chunk=layers, dynamic=True)
        recorder = Recorder(CpuClock(), ids, COST, N, lambda i, it=it: 0 if i is it else None)
        recorder.begin_pass()
        for _ in range(it.n):
            next(it)
            out = object()
            clock = recorder.clock
            recorder.forward(it, (out,)[0], (clock.stamp(), clock.stamp()))
            recorder.backward(out, (clock.stamp(), clock.stamp()))
        recorder.end_pass()
        rows_of.append([r for r in recorder.flush() if hasattr(r, "pred_fwd_s")])
        totals.append(recorder.totals(it.current.iteration))
    table = slot_step_seconds(_plan_of(its[0].current), N)
    fixed_differs = False
    for slot, rows in enumerate(rows_of):
        assert [r.micro_batch for r in rows] == list(range(N))
        for r in rows:
            # each member's share as laid out; the plan prices a group's micro-batch by its slowest member (issue 61)
            assert r.predicted_s <= layers * table[slot, r.micro_batch] * (1 + 1e-12), (slot, r)
            assert r.predicted_s == pytest.approx(layers * table[slot, r.micro_batch], rel=0.01), (slot, r)
            if r.lengths:
                from megatron_wlb.packing.metrics import bins_seconds

                fwd, bwd = bins_seconds(COST, [np.asarray(r.lengths)])
                fixed_differs |= abs(layers * float(fwd[0] + bwd[0]) - r.predicted_s) > 1e-6 * r.predicted_s
    assert fixed_differs, "the fixed CP 2 pricing would have given the same numbers: the test shows nothing"
    # a row's cp is the rank's place in its micro-batch's group: the measured tokens count every micro-batch once
    rows = [r for slot_rows in rows_of for r in slot_rows]
    assert sum(r.tokens for r in rows if r.cp == 0) == its[0].current.tokens
    assert any(r.cp == 1 for r in rows) and any(r.cp == 0 and r.rank % CP == 1 and r.lengths for r in rows)
    # the measured side's predicted latency table (what every rank's all-reduce sums): a row per slot, the plan's
    measured = IterationTotals(totals[0].iteration, SLOTS, N, totals[0].maxima, sum(t.sums for t in totals))
    latencies = measured.latencies(predicted=True)
    assert np.allclose(latencies, layers * table, rtol=0.01, atol=0)
    assert np.all(latencies <= layers * table * (1 + 1e-12))
    summary = measured.summary()
    degrees = latencies.max(axis=1) * N / latencies.sum(axis=1)
    assert summary.imbalance_planned == pytest.approx(degrees.mean(), rel=1e-12)  # the log's ``imbalance``
    assert summary.tokens == its[0].current.tokens
