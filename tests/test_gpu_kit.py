"""The staged GPU kit, checked on the CPU (issue 20): scripts/gpu_stage.sh assembles it (under 40 MB) from this
work tree and the pinned Megatron-LM, and scripts/gpu_run.sh --cpu-dry-run runs every step of its three parts
in a fresh venv holding only torch (with the triton a CUDA torch brings) and numpy: no megatron-core, no
pyyaml, no pydantic, no compiler use, no git, nothing of this repository installed."""

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
    subprocess.run([str(python), "-m", "pip", "install", "-q", *pins], check=True, timeout=1200)
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


def test_stage_is_small_and_complete(kit: Path):
    manifest = json.loads((kit / "MANIFEST.json").read_text())
    assert manifest["bytes"] <= 40 * 1024 * 1024
    assert (kit / "megatron-lm" / manifest["dataset_helper"]).is_file()
    assert "_wlb.apply(middle_stage_batches=True)" in (kit / "megatron-lm" / "pretrain_gpt.py").read_text()
    assert not (kit / "megatron-lm" / ".git").exists()
    names = {w.split("-")[0].lower() for w in manifest["wheels"]}
    assert {"pyyaml", "packaging", "six", "regex", "pydantic", "pydantic_core", "typing_extensions"} <= names


def test_dry_run_of_every_part_in_a_bare_venv(kit: Path, tmp_path: Path):
    python = _bare_venv(tmp_path / "venv")
    listed = subprocess.run([str(python), "-m", "pip", "list", "--format", "freeze"], capture_output=True, text=True)
    assert "megatron" not in listed.stdout.lower() and "yaml" not in listed.stdout.lower()
    env = {k: v for k, v in os.environ.items() if k not in ("PYTHONPATH", "VIRTUAL_ENV")}
    env.update(PATH=f"{python.parent}:{env['PATH']}", PYTHON=str(python))
    res = subprocess.run([str(kit / "run.sh"), "--cpu-dry-run", "--out", str(tmp_path / "results")], env=env,
                         capture_output=True, text=True, timeout=1800, cwd=tmp_path)
    assert res.returncode == 0, res.stdout[-3000:] + res.stderr[-3000:]
    results = tmp_path / "results"
    for name in ("env", "kernel_check", "profile", "efficiency", "cp_latency", "train"):
        assert (results / f"{name}.json").is_file(), name
    assert json.loads((results / "kernel_check.json").read_text())["failed"] == 0
    train = json.loads((results / "train.json").read_text())
    assert set(train["runs"]) == {"train_wlb", "train_stock"}
    assert train["runs"]["train_wlb"]["wlb_lines"] > 0 and train["runs"]["train_stock"]["wlb_lines"] == 0
    assert "dry run" in json.loads((results / "env.json").read_text())["device"]
