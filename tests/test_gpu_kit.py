"""The staged GPU kit, checked on the CPU (issue 20): scripts/gpu_stage.sh assembles it (under 40 MB) from this
work tree and the pinned Megatron-LM, and scripts/gpu_run.sh --cpu-dry-run runs every step of its three parts
in a fresh venv holding only torch (with the triton a CUDA torch brings) and numpy: no megatron-core, no
pyyaml, no pydantic, no compiler use, no git, nothing of this repository installed. Issue 45: in one call
within a budget (--all --budget), and, given a budget of a few seconds, every part stopped at its share keeps
what it measured, flagged (the budget's arithmetic itself: tests/test_kit_budget.py)."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import conftest
import pytest

ROOT = Path(__file__).resolve().parents[1]
pytestmark = [pytest.mark.slow,
              pytest.mark.skipif(conftest.pinned_megatron_source()[0] is None,
                                 reason=conftest.pinned_megatron_source()[1])]


def _bare_venv(path: Path) -> Path:
    """A plain venv (no system site-packages) with torch==2.13.0, its triton and numpy only."""
    subprocess.run([sys.executable, "-m", "venv", str(path)], check=True)
    python = path / "bin" / "python"
    import importlib.metadata as md

    pins = [f"torch=={md.version('torch').split('+')[0]}", "numpy"]
    try:
        pins.append(f"triton=={md.version('triton')}")
    except md.PackageNotFoundError:
        pass
    # --no-compile: byte-compiling all of torch at install costs ~20 s of CPU; the dry runs compile what they import
    subprocess.run([str(python), "-m", "pip", "install", "-q", "--no-compile", *pins], check=True, timeout=1200)
    return python


@pytest.fixture(scope="module")
def kit(tmp_path_factory) -> Path:
    source, _ = conftest.pinned_megatron_source()
    out = tmp_path_factory.mktemp("kit") / "kit"
    # the wheels and the dataset helper for this interpreter's version: the bare venv below runs it
    env = {**os.environ, "MEGATRON_LM": str(source), "PYTHONPATH": str(ROOT), "TARGET_PYTHON": sys.executable}
    res = subprocess.run(["bash", str(ROOT / "scripts" / "gpu_stage.sh"), str(out)], env=env, capture_output=True,
                         text=True, timeout=1200)
    assert res.returncode == 0, res.stdout[-2000:] + res.stderr[-3000:]
    return out


@pytest.fixture(scope="module")
def bare_python(tmp_path_factory) -> Path:
    return _bare_venv(tmp_path_factory.mktemp("venv") / "venv")


def _dry_run(kit: Path, python: Path, out: Path, *args: str) -> subprocess.CompletedProcess:
    """KIT/run.sh --cpu-dry-run ARGS with the bare venv's python, results in ``out``."""
    env = {k: v for k, v in os.environ.items() if k not in ("PYTHONPATH", "VIRTUAL_ENV", "ITERS")}
    env.update(PATH=f"{python.parent}:{env['PATH']}", PYTHON=str(python))
    return subprocess.run([str(kit / "run.sh"), "--cpu-dry-run", *args, "--out", str(out)], env=env,
                          capture_output=True, text=True, timeout=1800, cwd=out.parent)


def test_stage_is_small_and_complete(kit: Path):
    manifest = json.loads((kit / "MANIFEST.json").read_text())
    # gpu_stage.sh refuses a kit over MAX_MB=40: well within the 64 MiB a device call may carry
    assert manifest["bytes"] <= 40 * 1024 * 1024 < 64 * 2**20
    assert (kit / "megatron-lm" / manifest["dataset_helper"]).is_file()
    assert "_wlb.apply(middle_stage_batches=True)" in (kit / "megatron-lm" / "pretrain_gpt.py").read_text()
    assert not (kit / "megatron-lm" / ".git").exists()
    names = {w.split("-")[0].lower() for w in manifest["wheels"]}
    assert {"pyyaml", "packaging", "six", "regex", "pydantic", "pydantic_core", "typing_extensions"} <= names


def test_dry_run_of_every_part_in_a_bare_venv(kit: Path, bare_python: Path, tmp_path: Path):
    listed = subprocess.run([str(bare_python), "-m", "pip", "list", "--format", "freeze"], capture_output=True,
                            text=True)
    assert "megatron" not in listed.stdout.lower() and "yaml" not in listed.stdout.lower()
    results = tmp_path / "results"
    res = _dry_run(kit, bare_python, results, "--all", "--budget", "540")
    assert res.returncode == 0, res.stdout[-3000:] + res.stderr[-3000:]
    for name in ("env", "kernel_check", "profile", "calibrate", "efficiency", "cp_latency", "train", "budget"):
        assert (results / f"{name}.json").is_file(), name
    assert json.loads((results / "kernel_check.json").read_text())["failed"] == 0
    train = json.loads((results / "train.json").read_text())
    assert set(train["runs"]) == {"train_wlb", "train_stock"}
    assert train["runs"]["train_wlb"]["wlb_lines"] > 0 and train["runs"]["train_stock"]["wlb_lines"] == 0
    assert len(train["runs"]["train_wlb"]["losses"]) == 2  # the dry run's iterations, from part 3's share
    assert "dry run" in json.loads((results / "env.json").read_text())["device"]
    for name in ("kernel_check", "calibrate", "efficiency", "cp_latency", "train"):  # every part complete
        data = json.loads((results / f"{name}.json").read_text())
        assert not data["partial"] and not data["stopped_at_deadline"], name
    budget = json.loads((results / "budget.json").read_text())
    parts = [budget["parts"][p] for p in ("1", "2", "3")]
    assert not budget["partial"] and budget["used_s"] <= 540 and not any(p["stopped_at_deadline"] for p in parts)
    assert all(p["start_s"] + p["share_s"] <= 540 and p["used_s"] <= p["share_s"] for p in parts)


def test_dry_run_with_a_tiny_budget_keeps_what_each_part_measured(kit: Path, bare_python: Path, tmp_path: Path):
    """A budget of 3 s: each measuring script measures one point past its deadline and stops there, exit 0;
    calibrate and the training runs are stopped by `timeout`; every part still runs, each result flagged."""
    results = tmp_path / "results"
    res = _dry_run(kit, bare_python, results, "--all", "--budget", "3")
    assert res.returncode == 0, res.stdout[-3000:] + res.stderr[-3000:]
    budget = json.loads((results / "budget.json").read_text())
    assert not budget["partial"] and all(budget["parts"][p]["stopped_at_deadline"] for p in ("1", "2", "3"))
    assert sum(budget["parts"][p]["share_s"] for p in ("1", "2", "3")) <= 3
    for name in ("kernel_check", "calibrate", "efficiency", "cp_latency", "train"):
        data = json.loads((results / f"{name}.json").read_text())
        assert data["partial"] and data["stopped_at_deadline"], name
    assert len(json.loads((results / "kernel_check.json").read_text())["cases"]) == 1
    assert len(json.loads((results / "cp_latency.json").read_text())["cases"]) == 1
    assert json.loads((results / "efficiency.json").read_text())["tflops"][0][0] > 0
    assert not (results / "profile.json").exists()
