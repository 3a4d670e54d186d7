"""Issue 48 (3): ``dynamic`` is a CP sharding value of the config, ``--wlb-cp-sharding`` and ``wlb simulate``;
a training run takes it at any PP; dev's ``--dynamic-context-parallel`` names it."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from test_megatron_args import BASE, parse

from megatron_wlb.cli.main import main
from megatron_wlb.config import cp_sharding_names, load_config
from megatron_wlb.megatron.args.settings import WlbSettings
from megatron_wlb.megatron.args.validation import bypass_problems, validate_wlb_args


def _config(tmp_path: Path, pp: int) -> str:
    path = tmp_path / f"dyn_pp{pp}.yaml"
    path.write_text(f"model: 550m\nseq_len: 16384\nlayout: {{tp: 1, cp: 2, pp: {pp}, dp: 2}}\nmicro_batches: 2\n"
                    "cp: {sharding: dynamic}\n")
    return str(path)


def test_dynamic_is_a_cp_sharding_of_settings_and_yaml(tmp_path: Path) -> None:
    assert "dynamic" in cp_sharding_names()
    assert WlbSettings(cp_sharding="dynamic").cp_sharding == "dynamic"
    assert load_config(_config(tmp_path, 1)).cp_sharding == "dynamic"
    with pytest.raises(ValueError, match="dynamicc.*choose one of .*adaptive, hybrid, dynamic"):
        WlbSettings(cp_sharding="dynamicc")


def test_training_with_dynamic_at_pp2_is_accepted_with_per_micro_batch_shapes() -> None:
    """PP > 1 trains (``test_issue48_dynamic_pipeline``): the stages exchange each micro-batch's shape."""
    pp1 = parse(BASE + ["--wlb-cp-sharding", "dynamic", "--pipeline-model-parallel-size", "1"])
    validate_wlb_args(pp1, te_available=False, highspy_available=True, check_files=False)  # PP 1 trains
    args = parse(BASE + ["--wlb-cp-sharding", "dynamic"])  # BASE is PP 2
    assert validate_wlb_args(args, te_available=False, highspy_available=True, check_files=False).cp_sharding == \
        "dynamic"
    assert args.variable_seq_lengths


def test_devs_dynamic_context_parallel_stays_refused_naming_dynamic() -> None:
    args = parse(BASE)
    args.dynamic_context_parallel = True
    (problem,) = bypass_problems(args)
    assert problem.startswith("--dynamic-context-parallel") and "--wlb-cp-sharding dynamic" in problem


def test_wlb_simulate_plans_dynamic_at_pp1_and_refuses_pp2(tmp_path: Path, capsys: pytest.CaptureFixture) -> None:
    out = tmp_path / "sim.json"
    assert main(["simulate", "--config", _config(tmp_path, 1), "--iterations", "2", "--json", str(out)]) == 0
    rows = json.loads(out.read_text())["iterations"]
    assert len(rows) == 2 and all(r["time_s"] >= r["bound_s"] * (1 - 1e-9) and r["bound_s"] >= r["ideal_s"] * (1 - 1e-9)
                                  for r in rows)
    assert "over ideal" in capsys.readouterr().out
    assert main(["simulate", "--config", _config(tmp_path, 2), "--iterations", "1"]) != 0
    assert "plans one pipeline stage (PP 1)" in capsys.readouterr().err


def test_wlb_analyze_reports_dynamic_cp_at_pp1(tmp_path: Path, capsys: pytest.CaptureFixture) -> None:
    import numpy as np

    rng = np.random.default_rng(48)
    np.save(tmp_path / "lengths.npy", np.minimum(rng.lognormal(7.5, 1.6, size=3000).astype(np.int64) + 1, 40000))
    out, verdict = tmp_path / "out", tmp_path / "v.json"
    assert main(["analyze", "--config", _config(tmp_path, 1), "--lengths", str(tmp_path / "lengths.npy"),
                 "--iterations", "2", "--shuffles", "2", "--out", str(out), "--json", str(verdict)]) == 0
    assert "Dynamic CP (--wlb-cp-sharding dynamic, PP 1" in capsys.readouterr().out
    dynamic = json.loads(verdict.read_text())["dynamic_cp"]
    assert dynamic["simulated"] and len(dynamic["over_ideal"]) == 2 and min(dynamic["over_ideal"]) >= 1.0
    assert "## Dynamic CP" in (out / "report.md").read_text()
