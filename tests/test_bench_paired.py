"""benchmarks/bench_paired.py and benchmarks/paired_train.py: the ABBA order, Megatron's deal, the replay, and a
short paired run through Megatron's loop (slow lane)."""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import pytest
from conftest import load_script

ROOT = Path(__file__).resolve().parents[1]


def test_pairs_alternate_abba():
    paired = load_script("paired_train")
    assert "".join(paired.method_of(s) for s in range(8)) == "ABBAABBA"


def test_megatron_deal_gives_rank_r_every_dp_th_micro_batch():
    pytest.importorskip("torch")
    paired = load_script("paired_train")
    from megatron_wlb.packing.types import DocPiece, GlobalBatch, MicroBatch

    mbs = tuple(MicroBatch((DocPiece(j, 0, 1, 0),), 8) for j in range(6))
    dealt = paired.megatron_deal(GlobalBatch(0, mbs, 2, 3))
    # WlbDataIterator gives DP rank r the contiguous share [r*n, (r+1)*n): rank 0 samples 0, 2, 4
    assert [mb.pieces[0].doc_id for mb in dealt.micro_batches] == [0, 2, 4, 1, 3, 5]


@dataclass(frozen=True)
class Row:
    dp: int
    pp: int
    cp: int
    tp: int
    micro_batch: int
    fwd_s: float
    bwd_s: float
    pred_fwd_s: float
    pred_bwd_s: float
    lengths: tuple[int, ...] = (100,)
    chunk: int = 0


def test_replay_is_the_slowest_pipelines_critical_path():
    bench = load_script("bench_paired")
    from megatron_wlb.schedule import simulate_pipeline

    # DP2 without PP: the slower rank's compute
    rows = [Row(0, 0, 0, 0, j, 1.0, 2.0, 0.1, 0.2) for j in range(2)] + \
        [Row(1, 0, 0, 0, j, 2.0, 2.0, 0.1, 0.1) for j in range(2)]
    assert bench.replay(rows, 1, False) == pytest.approx(8.0)
    assert bench.replay(rows, 1, True) == pytest.approx(0.6)
    assert bench.imbalance(rows) == pytest.approx(8.0 / 7.0)
    # PP2: 1F1B over the two stages' times
    fwd = np.array([[1.0, 3.0], [2.0, 1.0]])
    bwd = 2 * fwd
    rows = [Row(0, s, 0, 0, j, fwd[s, j], bwd[s, j], 0, 0) for s in range(2) for j in range(2)]
    assert bench.replay(rows, 2, False) == pytest.approx(simulate_pipeline(fwd, bwd).makespan)


def test_work_and_idle_of_a_step():
    bench = load_script("bench_paired")
    from megatron_wlb.costmodel import AnalyticCostModel, ModelShape, ParallelLayout
    from megatron_wlb.packing.metrics import piece_latency

    cost = AnalyticCostModel(ModelShape("t", hidden=64, num_layers=2, num_heads=4, num_kv_heads=4, ffn_hidden=256,
                                        vocab=300), ParallelLayout())
    # DP2: rank 0 busy 3 + 3, rank 1 busy 4; the critical path is 6, so rank 1 idles 2
    rows = [Row(0, 0, 0, 0, j, 1.0, 2.0, 0.1, 0.2, (100, 50 * j + 10)) for j in range(2)] + \
        [Row(1, 0, 0, 0, 0, 2.0, 2.0, 0.3, 0.1, (300,))]
    rows.append(Row(1, 0, 0, 1, 0, 9.0, 9.0, 9.0, 9.0, (999,)))  # a TP rank > 0 repeats its work: not counted
    rows.append(Row(1, 1, 0, 0, 0, 9.0, 9.0, 9.0, 9.0, (300,)))  # a later PP stage runs the same documents: not counted
    # the work is the documents' price (not the micro-batches' as a whole): the same documents, the same work
    documents = np.array([100, 10, 100, 60, 300])
    assert bench.step_work(rows, cost) == pytest.approx(float(piece_latency(cost, documents).sum()))
    assert bench.idle(rows[:3], bench.replay(rows[:3], 1, False)) == pytest.approx(2 * 6.0 - 10.0)


def test_the_interval_holds_the_geometric_mean():
    bench = load_script("bench_paired")
    ratios = np.exp(np.random.default_rng(0).normal(0.05, 0.02, 200))
    mean, low, high = bench.geo_interval(ratios)
    assert low < mean < high and mean == pytest.approx(float(np.exp(np.log(ratios).mean())))
    assert high - low < 0.02


@pytest.mark.slow
def test_a_short_paired_run_through_megatrons_loop(tmp_path):
    pytest.importorskip("torch")
    bench = load_script("bench_paired")
    assert bench.main(["--quick", "--steps", "10", "--comparisons", "users", "--work", str(tmp_path / "work"),
                       "--out", str(tmp_path / "paired")]) == 0
    result = json.loads((tmp_path / "paired.json").read_text())
    (users,) = result["comparisons"]
    assert users["pairs"] == 10 // 2 - bench.WARMUP_PAIRS
    for kind in ("replay", "predicted", "replay_per_token"):  # thread CPU times and the model: a neighbour's load
        assert 0.3 < users[kind]["low"] <= users[kind]["ratio"] <= users[kind]["high"] < 3  # does not move them
    # wall time does move with a busy neighbour (the suite's other xdist worker): a well-formed interval only
    assert 0 < users["wall"]["low"] <= users["wall"]["ratio"] <= users["wall"]["high"] < float("inf")
    assert 0 < result["calibration"]["mape"] < 1 and result["calibration"]["steps"] == 8
    # held out by packing and layout (the quick calibration: two packings and CP2 per-sequence)
    assert set(result["calibration"]["packings"]) == {"wlb", "original, concat-and-cut", "wlb, per-sequence"}
    assert (tmp_path / "work" / "calibration" / "profile.json").exists()
    assert all(users["replayed_idle_s"][m] >= 0 and users["work_total"][m] > 0 for m in ("a", "b"))
    steps = json.loads((tmp_path / "work" / "users" / "rank0.json").read_text())["steps"]
    assert "".join(s["method"] for s in steps) == "ABBAABBAAB"
    assert len({s["tokens"] for s in steps[:2]}) >= 1 and all(s["tokens"] > 0 for s in steps)
