"""scripts/gpu_stage.sh picks a target interpreter that runs (``"$py" -c ''``), not merely one ``command -v``
finds: a pyenv shim of a Python that is not installed is on PATH but fails ("command not found")."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
SCRIPT = ROOT / "scripts" / "gpu_stage.sh"


def _bin(tmp_path: Path, *, broken_312: bool) -> Path:
    """A PATH directory: python3 (this interpreter) and python3.12, a failing shim or this interpreter too."""
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir()
    (bin_dir / "python3").symlink_to(sys.executable)
    if broken_312:
        shim = bin_dir / "python3.12"
        shim.write_text('#!/bin/sh\necho "pyenv: python3.12: command not found" >&2\nexit 127\n')
        shim.chmod(0o755)
    else:
        (bin_dir / "python3.12").symlink_to(sys.executable)
    return bin_dir


def _which(bin_dir: Path, **env: str) -> subprocess.CompletedProcess:
    full = {k: v for k, v in os.environ.items() if k != "TARGET_PYTHON"}
    full.update(PATH=f"{bin_dir}{os.pathsep}/usr/bin{os.pathsep}/bin", **env)
    return subprocess.run(["bash", str(SCRIPT), "--which-python"], env=full, capture_output=True, text=True,
                          timeout=60)


def test_a_python312_shim_that_fails_is_skipped_saying_so(tmp_path):
    bin_dir = _bin(tmp_path, broken_312=True)
    res = _which(bin_dir)
    assert res.returncode == 0, res.stderr
    assert res.stdout.startswith(f"gpu_stage.sh: target Python: python3 ({bin_dir}/python3, "), res.stdout
    assert f"python3.12 is on PATH ({bin_dir}/python3.12) but does not run" in res.stdout


def test_a_python312_that_runs_is_taken(tmp_path):
    bin_dir = _bin(tmp_path, broken_312=False)
    res = _which(bin_dir)
    assert res.returncode == 0, res.stderr
    assert res.stdout.startswith(f"gpu_stage.sh: target Python: python3.12 ({bin_dir}/python3.12, "), res.stdout
    assert "does not run" not in res.stdout


def test_a_target_python_that_fails_is_one_line_error(tmp_path):
    bin_dir = _bin(tmp_path, broken_312=True)
    res = _which(bin_dir, TARGET_PYTHON=str(bin_dir / "python3.12"))
    assert res.returncode == 1 and res.stdout == ""
    assert res.stderr.count("\n") == 1 and "TARGET_PYTHON=" in res.stderr and "does not run" in res.stderr
