"""Issue 48's paired measurement (benchmarks/bench_paired.py ``dcp``): dynamic CP against fixed-group CP2 in one
process: the paired iterator's switch per step, the group-synchronous replay and the fixed-group prediction."""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import pytest
from conftest import load_script

SLOTS = 4


@dataclass(frozen=True)
class Row:
    dp: int
    cp: int
    micro_batch: int
    fwd_s: float
    bwd_s: float
    tp: int = 0


def test_pool_replay_holds_a_group_for_its_slowest_member():
    bench = load_script("bench_paired")
    # fixed CP2 groups (slots 0-1 and 2-3): each group runs its two micro-batches, each as long as its slower member
    rows = [Row(0, 0, 0, 1.0, 1.0), Row(0, 1, 0, 2.0, 1.0), Row(0, 0, 1, 1.0, 1.0), Row(0, 1, 1, 1.0, 3.0),
            Row(1, 0, 0, 1.0, 1.0), Row(1, 1, 0, 1.0, 1.0), Row(1, 0, 1, 1.0, 1.0), Row(1, 1, 1, 1.0, 1.0)]
    assert bench.replay_pool(rows, 2) == pytest.approx((2 + 1) + (1 + 3))
    # dynamic: step 0 one group of all four (the slowest member 2 + 1), step 1 slot 3 alone (a 10 s micro-batch),
    # slots 0-1 a pair, slot 2 empty
    blocks = {0: [[0, 4], [0, 2]], 1: [[0, 4], [0, 2]], 2: [[0, 4], None], 3: [[0, 4], [3, 1]]}
    rows[7] = Row(1, 1, 1, 5.0, 5.0)
    assert bench.replay_pool(rows, 2, blocks) == pytest.approx(3 + 10)
    # a member that arrives late holds its whole group: slot 3 runs a 10 s micro-batch alone, then the four together
    late = {0: [None, [0, 4]], 1: [None, [0, 4]], 2: [None, [0, 4]], 3: [[3, 1], [0, 4]]}
    rows = [Row(s // 2, s % 2, k, 0.5, 0.5) for s in range(SLOTS) for k in range(2)]
    rows[-2] = Row(1, 1, 0, 5.0, 5.0)
    assert bench.replay_pool(rows, 2, late) == pytest.approx(10 + 1)
    assert bench.imbalance_pool(rows, 2) == pytest.approx(11 / np.mean([2, 2, 2, 11]))


def test_fixed_group_prediction_is_the_slowest_dp_ranks_priced_micro_batches():
    bench = load_script("bench_paired")
    from megatron_wlb.costmodel import ParallelLayout, build_cost_model
    from megatron_wlb.cp.dynamic import group_cost_models
    from megatron_wlb.packing.metrics import piece_latency

    costs = group_cost_models(build_cost_model("7b", ParallelLayout(cp=2, dp=2)), SLOTS)
    cost = costs[2]
    lengths = [[4000, 100], [3000], [500, 500, 500], []]  # DP rank 0: the first two, rank 1: the last two
    over = cost.microbatch_overhead * (1 + cost.hardware.bwd_linear)
    rank = [sum(float(piece_latency(cost, np.array(mb)).sum()) + over for mb in share if mb)
            for share in (lengths[:2], lengths[2:])]
    assert bench.fixed_group_seconds(lengths, 2, cost) == pytest.approx(max(rank)) and rank[0] > rank[1]


def _paired_iterators(tmp_path, n: int, cap: int | None = None):
    """Every slot's paired iterator over a DP2 x CP2 pool: A dynamic CP, B the fixed CP2 groups (adaptive)."""
    from test_issue48_dynamic_runtime import stdlib_pool_inputs

    from megatron_wlb.cp.dynamic_steps import DynamicPool
    from megatron_wlb.cp.plan import CPSharding
    from megatron_wlb.megatron.data.packed import WlbDataIterator
    from megatron_wlb.packing import make_packer

    paired = load_script("paired_train")
    reader, stream, cfg, cost = stdlib_pool_inputs(tmp_path, n, files=16, iterations=40)
    out = []
    for slot in range(SLOTS):
        a = WlbDataIterator(reader, stream, make_packer("wlb", cfg, cost), slot // 2,
                            dynamic=DynamicPool(SLOTS, slot, cap or -(-cfg.capacity_var // 2), cost))
        b = WlbDataIterator(reader, stream, make_packer("wlb", cfg, cost), slot // 2,
                            CPSharding("adaptive", cp_size=2, cp_rank=slot % 2, sequence_multiple=2, cost=cost))
        out.append(paired.PairedDataIterator(a, b))
    return paired, out


def test_the_paired_iterator_switches_between_dynamic_and_fixed_cp_every_step(tmp_path):
    pytest.importorskip("torch")
    paired, its = _paired_iterators(tmp_path, n=4)
    pairs: dict[int, dict[str, tuple]] = {}
    for step in range(8):
        records = [[next(it) for _ in range(it.n)] for it in its]
        method = its[0].method
        assert method == paired.method_of(step) and {it.method for it in its} == {method}
        batch = its[0].current
        pieces = tuple(sorted((p.doc_id, p.offset, p.length) for mb in batch.micro_batches for p in mb.pieces))
        pairs.setdefault(step // 2, {})[method] = pieces
        info = paired.step_record(its[0])
        assert info["lengths"] == [[int(x) for x in mb.lengths] for mb in batch.micro_batches]
        if method == "A":  # each micro-batch on its block's group; the planner's prediction recorded
            assert all(r.block is not None for rec in records for r in rec)
            assert info["plan_slowest_s"] > 0 and len(info["blocks"]) == its[0].n and its[0].layouts == ()
            sizes = {r.block[1] for rec in records for r in rec}
            assert sizes - {1}, sizes  # some micro-batch runs on a group
        else:  # Megatron's fixed CP group, laid out adaptively: CP ranks 0 and 1 of a DP rank hold one plan's halves
            assert all(r.block is None for rec in records for r in rec) and "plan_slowest_s" not in info
            assert its[0].sharding.layout == "adaptive" and len(its[0].layouts) == its[0].n
            for dp in range(2):
                for k in range(its[0].n):
                    a, b = records[2 * dp][k], records[2 * dp + 1][k]
                    assert a.micro_batch == b.micro_batch
                    assert a.rows.size + b.rows.size >= int(np.sum(a.micro_batch.lengths))
    assert all(p["A"] == p["B"] for p in pairs.values()), "both methods of a pair train the same documents"


def test_every_global_batch_is_trained_within_megatrons_micro_batch_count(tmp_path):
    """384 tokens a slot, 2 micro-batches a DP rank: the planner keeps Megatron's count (the count's own cases:
    tests/test_issue48_planner_count.py), so both methods train every global batch, the same documents."""
    pytest.importorskip("torch")
    paired, its = _paired_iterators(tmp_path, n=2, cap=384)
    pairs: dict[int, dict[str, tuple]] = {}
    for step in range(6):
        for it in its:
            for _k in range(it.n):
                next(it)
        batch = its[0].current
        pairs.setdefault(step // 2, {})[its[0].method] = tuple((p.doc_id, p.offset) for mb in batch.micro_batches
                                                               for p in mb.pieces)
        if its[0].method == "A":
            assert its[0].pools["A"].last.steps <= its[0].n
    assert all(p["A"] == p["B"] for p in pairs.values())


def test_the_dynamic_cp_block_is_the_recorded_run():
    import json
    from pathlib import Path

    bench = load_script("bench_paired")
    page = (Path(__file__).resolve().parents[1] / "benchmarks" / "results.md").read_text()
    block = page.split(bench.DYNAMIC_CP_BEGIN, 1)[1].split(bench.DYNAMIC_CP_END, 1)[0]
    result = json.loads(bench.DYNAMIC_CP_OUT.with_suffix(".json").read_text())
    assert block.strip() == bench.readme_summary(result).strip()
    (dcp,) = [c for c in result["comparisons"] if c["name"] == bench.DYNAMIC_CP]
    assert dcp["name"] == bench.DYNAMIC_CP and dcp["pairs"] > 0 and "dcp" in result["prior_prediction"]
