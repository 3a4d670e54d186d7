"""The CP scripts run end to end on CPU: GPU scripts in --smoke mode, the layout benchmark tiny."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import numpy as np

from megatron_wlb.cp import KernelEfficiency, build_layout
from megatron_wlb.cp.sampling import available, concat_and_cut

ROOT = Path(__file__).resolve().parents[1]


def _run(script: str, *args: str) -> str:
    folder = ROOT / "benchmarks" if (ROOT / "benchmarks" / script).exists() else ROOT / "scripts"
    proc = subprocess.run([sys.executable, str(folder / script), *args], capture_output=True, text=True,
                          timeout=240, cwd=ROOT)
    assert proc.returncode == 0, proc.stderr[-3000:]
    return proc.stdout


def test_profile_attention_smoke_writes_a_loadable_table(tmp_path):
    out = tmp_path / "eff.json"
    _run("gpu_profile_attention.py", "--smoke", "--out", str(out))
    table = KernelEfficiency.from_json(out)
    data = json.loads(out.read_text())
    assert data["q_lens"] == [4, 8, 16] and data["kv_lens"] == [8, 16]
    assert data["tflops"][2][0] is None                    # q=16 > kv=8 is impossible
    assert np.all(table.table > 0) and "bottom_right_check_err" in data["source"]
    lay = build_layout("adaptive", [5, 9, 30], 2, efficiency=table, tile=table.tile)
    assert lay.name in ("per-sequence", "per-document")


def test_cp_latency_smoke_measures_every_rank(tmp_path):
    out = tmp_path / "lat"
    _run("gpu_cp_latency.py", "--smoke", "--out", str(out))
    result = json.loads(out.with_suffix(".json").read_text())
    assert result["backend"] == "reference"
    layouts = {c["layout"] for c in result["cases"]}
    assert layouts == {"per-sequence", "per-document", "per-document-te", "adaptive", "hybrid"}
    for case in result["cases"]:
        assert len(case["rank_seconds"]) == case["cp"] == 2
        assert all(s > 0 for s, t in zip(case["rank_seconds"], case["rank_tokens"]) if t)
    assert {(r["seq_len"], r["cp"]) for r in result["summary"]} == {(256, 2)}
    assert "| per-document |" in out.with_suffix(".md").read_text()


def test_bench_layouts_tiny(tmp_path):
    out = tmp_path / "bench"
    _run("bench_layouts.py", "--micro-batches", "6", "--cps", "2,4", "--seq-len", "16384",
         "--timing-micro-batches", "1", "--out", str(out))
    result = json.loads(out.with_suffix(".json").read_text())
    assert set(result["cp"]) == {"2", "4"}
    for rows in result["cp"].values():
        assert rows["per-sequence"]["attention_time_vs_per_sequence"] == 1.0
        assert rows["per-document"]["pure_flops_imbalance_mean"] < 1.01
        assert rows["per-document-te"]["padded_tokens"] > 0 and rows["per-document"]["padded_tokens"] == 0
    assert set(result["timing"]["layouts"]) == set(result["cp"]["2"])


def test_concat_and_cut_keeps_every_token():
    lengths = np.array([5, 3, 10, 2, 7])
    mbs = concat_and_cut(lengths, 4, count=available(lengths, 4))
    assert [m.tolist() for m in mbs] == [[4], [1, 3], [4], [4], [2, 2], [4]]   # 27 tokens: 6 full ones
    assert [m.tolist() for m in concat_and_cut(lengths, 4, indices=[4, 1])] == [[2, 2], [1, 3]]
    assert sum(int(m.sum()) for m in mbs) == 4 * 6


def test_kernel_efficiency_state_is_declared():
    """The frozen table's derived state is declared fields (not set behind the dataclass's back),
    kept out of equality and repr; the per-tile cache fills on first use and gives the same answer."""
    import dataclasses

    eff = KernelEfficiency.default()
    names = {f.name for f in dataclasses.fields(KernelEfficiency)}
    assert {"log_q_lens", "log_kv_lens", "tile_grids"} <= names
    assert not any(f.compare or f.repr for f in dataclasses.fields(KernelEfficiency) if f.name in
                   ("log_q_lens", "log_kv_lens", "tile_grids"))
    fresh = dataclasses.replace(eff)
    assert fresh.tile_grids == {} and fresh.tile_grids is not eff.tile_grids
    q, kv = np.array([256, 1024]), np.array([1024, 4096])
    looked_up = fresh.relative_padded(q, kv, 128)
    assert 128 in fresh.tile_grids
    assert np.allclose(looked_up, fresh.relative(q, kv))
    assert "tile_grids" not in repr(fresh)


def test_batch_path_benchmark_times_every_layout(tmp_path):
    """benchmarks/bench_batch_path.py: one row per (T, CP, layout), each rank's rows about T / CP."""
    import importlib.util

    import pytest

    pytest.importorskip("megatron.core")
    spec = importlib.util.spec_from_file_location("bench_batch_path", ROOT / "benchmarks" / "bench_batch_path.py")
    bench = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(bench)  # in this process: torch and megatron.core are imported once per session
    bench.main(["--layers", "2", "--reps", "1", "--step-ms", "60", "--out", str(tmp_path / "bp")])
    result = json.loads((tmp_path / "bp.json").read_text())
    assert len(result["rows"]) == 2 * 3 * 4 and (tmp_path / "bp.md").read_text().startswith("# The one-plan")
    for row in result["rows"]:
        assert row["plan_ms"] > 0 and row["upload_ms"] > 0 and row["saved_ms"] >= 0
        if row["chosen"] != "hybrid":  # the equal-count layouts: exactly T / CP rows (T padded to CP)
            assert row["rank_rows"] == -(-row["tokens"] // row["cp"])
    # the prefetching iterator takes the micro-batches after an iteration's first off the critical path
    for row in result["critical"]:
        assert row["prefetch_rest_ms"] < row["plain_rest_ms"], row
    assert "What stays on the critical path" in (tmp_path / "bp.md").read_text()


def _run_as_on_a_gpu_machine(script: str, *args: str) -> subprocess.CompletedProcess:
    """The script with torch saying CUDA is available (as on the GPU machine, where the varlen kernels refuse
    fp32): --smoke must stay on the CPU."""
    prelude = ("import runpy, sys, torch; torch.cuda.is_available = lambda: True; "
               f"sys.argv = [{script!r}, *sys.argv[1:]]; runpy.run_path({script!r}, run_name='__main__')")
    return subprocess.run([sys.executable, "-c", prelude, *args], capture_output=True, text=True, timeout=240,
                          cwd=ROOT)


def test_smoke_runs_on_the_cpu_where_cuda_is_available(tmp_path):
    """issue 20, item 5: --smoke switched to fp32 but kept the CUDA device."""
    res = _run_as_on_a_gpu_machine(str(ROOT / "scripts" / "gpu_profile_attention.py"), "--smoke", "--out",
                                   str(tmp_path / "eff.json"))
    assert res.returncode == 0, res.stderr[-2000:]
    assert json.loads((tmp_path / "eff.json").read_text())["device"].startswith("CPU")
    res = _run_as_on_a_gpu_machine(str(ROOT / "scripts" / "gpu_cp_latency.py"), "--smoke", "--out",
                                   str(tmp_path / "lat"))
    assert res.returncode == 0, res.stderr[-2000:]
    assert json.loads((tmp_path / "lat.json").read_text())["backend"] == "reference"


def test_cpu_redirects_hide_the_gpus_of_a_gpu_machine():
    """issue 20, item 5: install_cpu_redirects() raised on a machine with CUDA; now it hides the GPUs from the
    process (CUDA_VISIBLE_DEVICES="" before CUDA initialises), and refuses only once CUDA is in use. The
    stand-in is_available answers as the CUDA runtime would: devices unless CUDA_VISIBLE_DEVICES is empty."""
    code = ("import os, torch; torch.cuda.is_available = lambda: os.environ.get('CUDA_VISIBLE_DEVICES') != ''; "
            "torch.cuda.is_initialized = lambda: {init}; from megatron_wlb.megatron.entry import cpu; "
            "cpu.install_cpu_redirects(); print('visible=' + repr(os.environ['CUDA_VISIBLE_DEVICES']))")
    env = {k: v for k, v in __import__("os").environ.items() if k != "CUDA_VISIBLE_DEVICES"}
    res = subprocess.run([sys.executable, "-c", code.format(init=False)], capture_output=True, text=True, env=env,
                         timeout=120)
    assert res.returncode == 0 and "visible=''" in res.stdout, res.stderr[-2000:]
    res = subprocess.run([sys.executable, "-c", code.format(init=True)], capture_output=True, text=True, env=env,
                         timeout=120)
    assert res.returncode != 0 and "before this process uses CUDA" in res.stderr


def test_timed_kernel_calls_get_offsets_already_on_the_device(tmp_path, monkeypatch):
    """issue 20, item 8: the calibration scripts and `wlb calibrate` copied cu_seqlens from numpy to the device
    inside every timed call; the offsets must arrive as int32 device tensors, uploaded before."""
    import importlib.util

    import torch

    import megatron_wlb.cp.attention as attention
    from megatron_wlb.cli.main import main as wlb_main

    kinds: list[str] = []
    real = attention.varlen_attention

    def recording(q, k, v, cu_q, cu_k, *args, **kwargs):
        kinds.append("tensor" if isinstance(cu_q, torch.Tensor) and isinstance(cu_k, torch.Tensor)
                     and cu_q.dtype == torch.int32 and cu_q.device == q.device else type(cu_q).__name__)
        return real(q, k, v, cu_q, cu_k, *args, **kwargs)

    sys.path.insert(0, str(ROOT / "scripts"))
    try:
        for script, args in (("gpu_profile_attention", ["--out", str(tmp_path / "e.json")]),
                             ("gpu_cp_latency", ["--out", str(tmp_path / "lat")])):
            spec = importlib.util.spec_from_file_location(script, ROOT / "scripts" / f"{script}.py")
            module = importlib.util.module_from_spec(spec)
            spec.loader.exec_module(module)
            monkeypatch.setattr(module, "varlen_attention", recording)
            kinds.clear()
            assert module.main(["--smoke", *args]) == 0
            assert kinds and set(kinds) == {"tensor"}, (script, kinds)
    finally:
        sys.path.remove(str(ROOT / "scripts"))
    monkeypatch.setattr(attention, "varlen_attention", recording)
    kinds.clear()
    assert wlb_main(["calibrate", "--smoke", "--out", str(tmp_path / "p.json")]) == 0
    assert kinds and set(kinds) == {"tensor"}, kinds
