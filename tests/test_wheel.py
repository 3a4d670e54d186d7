"""What a user installs is what we test: build the wheel, check it holds every data file the package
reads, and run the CLI from the unpacked wheel outside the source tree (no editable install, no
checkout on sys.path). .ci/run goes further: a fresh venv, ``pip install`` of the wheel, and the
commands run from there."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import zipfile
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]


def tracked_tree(dest: Path) -> Path:
    """A copy of the files git tracks (what a fresh clone has: no stale build/, no untracked data)."""
    res = subprocess.run(["git", "ls-files", "-z"], cwd=ROOT, capture_output=True)
    if res.returncode != 0:
        return ROOT  # not a git checkout (an sdist): build from the tree as it is
    for name in res.stdout.decode().split("\0"):
        if name and (ROOT / name).is_file():
            (dest / name).parent.mkdir(parents=True, exist_ok=True)
            shutil.copy2(ROOT / name, dest / name)
    return dest


@pytest.fixture(scope="module")
def wheel(tmp_path_factory) -> Path:
    out = tmp_path_factory.mktemp("dist")
    src = tracked_tree(tmp_path_factory.mktemp("src"))
    res = subprocess.run([sys.executable, "-m", "pip", "wheel", "--no-deps", "--no-build-isolation", "-q",
                          "-w", str(out), str(src)], capture_output=True, text=True, cwd=out)
    if res.returncode != 0 and "No module named" in res.stderr:
        pytest.skip(f"cannot build wheels here: {res.stderr.strip().splitlines()[-1]}")
    assert res.returncode == 0, res.stderr
    (whl,) = out.glob("megatron_wlb-*.whl")
    return whl


def package_data_files() -> list[str]:
    """Every non-Python file of the package in the source tree (what the code may read at run time), named as
    in the wheel: the top-level configs/ is installed as megatron_wlb/configs/ (setup.py's package_dir)."""
    pkg = ROOT / "megatron_wlb"
    files = [str(p.relative_to(ROOT)) for p in pkg.rglob("*")
             if p.is_file() and p.suffix not in (".py", ".pyc") and "__pycache__" not in p.parts]
    files += [f"megatron_wlb/configs/{p.name}" for p in (ROOT / "configs").iterdir() if p.is_file()]
    return sorted(files)


def test_the_configs_have_one_copy_at_the_top_level():
    """The design card's layout: configs/ at the top of the checkout; no second copy inside the package."""
    assert sorted(p.name for p in (ROOT / "configs").glob("*.yaml"))
    assert not (ROOT / "megatron_wlb" / "configs").exists()


def test_wheel_holds_every_data_file_and_the_license(wheel: Path):
    names = set(zipfile.ZipFile(wheel).namelist())
    data = package_data_files()
    assert any(f.endswith("configs/7b_128k.yaml") for f in data)
    assert any(f.endswith("cp/data/default_efficiency.json") for f in data)
    missing = [f for f in data if f not in names]
    assert not missing, f"not in the wheel (add them to setup.py package_data): {missing}"
    assert any(n.endswith(".dist-info/licenses/LICENSE") or n.endswith(".dist-info/LICENSE") for n in names)
    entry = next(n for n in names if n.endswith("entry_points.txt"))
    assert "wlb = megatron_wlb.cli.main:main" in zipfile.ZipFile(wheel).read(entry).decode()


def test_cli_runs_from_the_unpacked_wheel_outside_the_tree(wheel: Path, tmp_path: Path):
    site = tmp_path / "site"
    zipfile.ZipFile(wheel).extractall(site)
    work = tmp_path / "work"
    work.mkdir()
    env = {k: v for k, v in os.environ.items() if k != "PYTHONPATH"}
    env["PYTHONPATH"] = str(site)

    def wlb(*args: str) -> subprocess.CompletedProcess:
        return subprocess.run([sys.executable, "-m", "megatron_wlb", *args], capture_output=True, text=True,
                              cwd=work, env=env, timeout=300)

    where = subprocess.run([sys.executable, "-c", "import megatron_wlb; print(megatron_wlb.__file__)"],
                           capture_output=True, text=True, cwd=work, env=env)
    assert where.stdout.startswith(str(site)), where.stdout + where.stderr
    version = wlb("--version")
    assert version.returncode == 0 and version.stdout.startswith("megatron-wlb ")
    (work / "mb.jsonl").write_text("[100, 2000, 30000]\n[65536]\n")
    res = wlb("shard", "--micro-batches", "mb.jsonl", "--cp", "2", "--cp-sharding", "adaptive", "--out", "o.jsonl")
    assert res.returncode == 0, res.stderr
    lines = (work / "o.jsonl").read_text().splitlines()
    assert len(lines) == 2 and json.loads(lines[1])["padded_lengths"] == [65536]
    res = wlb("pack", "--config", "550m_64k", "--iterations", "2", "--json")
    assert res.returncode == 0, res.stderr
    assert json.loads(res.stdout)["config"] == "550m_64k"
