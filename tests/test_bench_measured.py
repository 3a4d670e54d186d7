"""benchmarks/bench_measured.py: its analysis on synthetic traces (fast), and a short end-to-end run of
Megatron's loop through it (slow)."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO / "benchmarks"))

import bench_measured as bm  # noqa: E402

from megatron_wlb.costmodel import get_model  # noqa: E402
from megatron_wlb.costmodel.trace import TRACE_FORMAT, IterationRow, MicroBatchRow, row_to_json  # noqa: E402

MODEL = get_model("550m")


def write_trace(path: Path, walls: list[float], plans: list[list[list[int]]], dp: int = 2, n: int = 2) -> Path:
    """A DP trace: iteration i's micro-batches ``plans[i]`` (dp * n lists of lengths), each rank's wall ``walls[i]``."""
    for rank in range(dp):
        lines = [json.dumps({"kind": "header", "format": TRACE_FORMAT, "rank": rank, "clock": "cpu",
                             "model": MODEL.to_dict(), "layout": {"tp": 1, "cp": 1, "pp": 1, "dp": dp, "vpp": 1},
                             "n": n, "settings": {"cp_sharding": "adaptive"}})]
        for it, (wall, plan) in enumerate(zip(walls, plans)):
            for j in range(n):
                lengths = plan[rank * n + j]
                d = np.asarray(lengths, dtype=float)
                lines.append(row_to_json(MicroBatchRow(
                    iteration=it, rank=rank, dp=rank, pp=0, cp=0, tp=0, chunk=0, micro_batch=j, layers=2,
                    tokens=int(d.sum()), sum_d2=float((d * d).sum()), lengths=tuple(lengths), rank_tokens=int(d.sum()),
                    rank_pairs=float((d * (d + 1) / 2).sum()), rank_runs=len(lengths), pred_fwd_s=0.1, pred_bwd_s=0.2,
                    fwd_s=wall / (3 * n), bwd_s=2 * wall / (3 * n), data_s=0.0, wait_fwd_s=0.0, wait_bwd_s=0.0)))
            lines.append(row_to_json(IterationRow(it, rank, rank, 0, 0, 0, wall, wall * 0.9, 0.0, 0.1 * wall, 0.0, n)))
        (path.parent / f"{path.stem}-rank{rank:05d}{path.suffix}").write_text("\n".join(lines) + "\n")
    return path


def test_analyse_measures_the_trace_and_predicts_the_same_plans(tmp_path):
    rng = np.random.default_rng(0)
    plans = [[[int(x) for x in rng.integers(50, 900, size=3)] for _ in range(4)] for _ in range(6)]
    walls = [1.0, 0.5, 0.4, 0.6, 0.5, 0.45]
    trace = write_trace(tmp_path / "t.jsonl", walls, plans)
    run = bm.Run("DP2 wlb", "dp", {"DP": "2"}, ("--wlb-packer", "wlb"))
    res = bm.analyse(run, 0, trace, warmup=2, profile=None)
    assert res.iteration_wall_s == walls[2:]  # warm-up left out, wall = the longest rank's
    assert res.iteration_tokens == [int(sum(sum(mb) for mb in plan)) for plan in plans[2:]]
    assert len(res.predicted_wall_s) == 4 and all(p > 0 for p in res.predicted_wall_s)
    lengths = np.array([x for plan in plans[2:] for mb in plan for x in mb], dtype=float)
    assert res.pairs_per_token == pytest.approx((lengths * (lengths + 1) / 2).sum() / lengths.sum())
    assert res.idle == pytest.approx([0.1] * 4)
    assert len(set(res.plans)) == 4  # one digest per iteration, from the traced micro-batches
    # a second run of other walls but the same plans: the same digests; ratios put it over the first
    slower = bm.analyse(bm.Run("DP2 other", "dp", {"DP": "2"}, ()), 0,
                        write_trace(tmp_path / "u.jsonl", [2 * w for w in walls], plans), 2, None)
    assert slower.plans == res.plans
    rows = bm.summarise([res, slower])
    (ratio,) = bm.ratios(rows)
    assert ratio["measured"] == pytest.approx(0.5) and ratio["predicted"] == pytest.approx(1.0)


def test_bootstrap_intervals_hold_the_estimate():
    walls = list(np.random.default_rng(1).uniform(0.4, 0.6, size=60))
    med, lo, hi = bm.bootstrap_median(walls)
    assert lo <= med <= hi and hi - lo < 0.1
    rate, lo, hi = bm.bootstrap_rate(walls, [1000] * 60)
    assert lo <= rate <= hi and rate == pytest.approx(1000 * 60 / sum(walls))
    assert bm.bootstrap_median(walls) == (med, *bm.bootstrap_median(walls)[1:])  # seeded


def test_unknown_experiment_is_refused_in_one_line():
    with pytest.raises(SystemExit, match="--experiments nope: unknown; valid: cp, pp, dp, users, online"):
        bm.experiments(["nope"])


@pytest.mark.slow
def test_quick_run_end_to_end(tmp_path):
    """Megatron's loop on this CPU: calibration run, --from-trace, three DP2 runs, the results written."""
    if len(os.sched_getaffinity(0)) < 2:
        pytest.skip("needs 2 cores (one per rank)")
    readme = tmp_path / "README.md"
    readme.write_text("x\n<!-- measured-table -->\nSTALE TABLE\n<!-- /measured-table -->\ny\n")
    cmd = [sys.executable, str(REPO / "benchmarks" / "bench_measured.py"), "--quick", "--iterations", "6",
           "--warmup", "2",
           "--experiments", "dp", "--out", str(tmp_path / "out"), "--work", str(tmp_path / "work"), "--page",
           str(readme)]
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stderr[-4000:]
    result = json.loads((tmp_path / "out" / "measured.json").read_text())
    names = [m["method"] for m in result["methods"]]
    assert names == ["DP2 wlb (analytic H100 model)", "DP2 wlb", "DP2 fixed-greedy", "DP2 whole-document"]
    assert all(m["iterations"] == 4 and m["tokens_per_s"] > 0 and m["predicted_tokens_per_s"] > 0
               for m in result["methods"])
    assert 0 <= result["calibration"]["holdout_mape"] < 5
    text = readme.read_text()
    assert "STALE TABLE" not in text and "| dp | DP2 fixed-greedy |" in text and text.endswith("y\n")
