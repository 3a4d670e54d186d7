"""The user scripts build Megatron's dataset helpers for the interpreter that runs the job (issue 58 item 2).

Megatron's ``make`` in megatron/core/datasets runs ``python3 -m pybind11`` and ``python3-config
--extension-suffix``, found on PATH from the checkout, where pyenv's shims read the checkout's .python-version
(core_v0.19.0 ships one: 3.12). ``use_job_python`` (scripts/lib/job_python.sh, the one place) puts the job's
interpreter first; these tests build the real helpers of a core_v0.19.0 checkout with it, under a real pyenv
version that differs from this interpreter's where the machine has one, and under a simulated wrong ``python3``
shim everywhere.
"""

from __future__ import annotations

import os
import re
import subprocess
import sys
import sysconfig
from pathlib import Path

import pytest
from conftest import job_python_env, megatron_checkout

ROOT = Path(__file__).resolve().parents[1]
EXT_SUFFIX = sysconfig.get_config_var("EXT_SUFFIX")
PYENV_VERSIONS = Path(os.environ.get("PYENV_ROOT", Path.home() / ".pyenv")) / "versions"


def _other_pyenv_version() -> str | None:
    """A pyenv-installed Python of another minor version than this one, with its python3-config, or None."""
    mine = f"{sys.version_info.major}.{sys.version_info.minor}"
    if not PYENV_VERSIONS.is_dir() or not (PYENV_VERSIONS.parent / "shims" / "python3-config").exists():
        return None
    return next((v.name for v in sorted(PYENV_VERSIONS.iterdir()) if re.fullmatch(r"3\.\d+\.\d+", v.name)
                 and not v.name.startswith(mine + ".") and (v / "bin" / "python3-config").exists()), None)


@pytest.fixture(scope="module")
def checkout_019(tmp_path_factory) -> Path:
    return megatron_checkout(tmp_path_factory.mktemp("mlm019") / "Megatron-LM", "core_v0.19.0")


def _wrong_shims(bindir: Path) -> Path:
    """A ``python3`` and ``python3-config`` that belong to no interpreter here (what another Python's shims give)."""
    bindir.mkdir()
    (bindir / "python3").write_text("#!/bin/sh\necho 'the wrong python3' >&2; exit 3\n")
    (bindir / "python3-config").write_text("#!/bin/sh\necho .cpython-30-wrong.so\n")
    for tool in ("python3", "python3-config"):
        (bindir / tool).chmod(0o755)
    return bindir


def _suffix_make_would_use(datasets: Path, env: dict[str, str]) -> str:
    return subprocess.run(["python3-config", "--extension-suffix"], cwd=datasets, env=env, capture_output=True,
                          text=True).stdout.strip()


@pytest.mark.parametrize("trap", ["pyenv", "shim"])
def test_helpers_are_built_for_the_running_interpreter(checkout_019, tmp_path, trap):
    """A checkout whose python3 (pyenv's .python-version, or a shim first on PATH) is another Python: without
    use_job_python, ``make`` would build for that one (the trap is checked to be real); with it, Megatron's own
    ``make`` builds helpers_cpp for this interpreter, which imports it."""
    datasets = checkout_019 / "megatron" / "core" / "datasets"
    for built in datasets.glob("helpers_cpp*"):
        built.unlink()
    env = {k: v for k, v in os.environ.items() if k != "PYENV_VERSION"}
    # what compare_loss.sh did before: the interpreter's own folder first. A venv's bin has no python3-config, so
    # the next one on PATH answers. A bare installation's bin (CI runs pyenv's 3.11 itself, and pyenv's shim put
    # that bin first on this process's PATH) has its own, which would hide the trap: there the user's PATH is
    # taken without it (pyenv's shims first).
    own = os.path.dirname(sys.executable)
    if os.path.isfile(os.path.join(own, "python3-config")):
        env["PATH"] = os.pathsep.join(p for p in env["PATH"].split(os.pathsep)
                                      if not p or os.path.realpath(p) != os.path.realpath(own))
    else:
        env["PATH"] = f"{own}{os.pathsep}{env['PATH']}"
    if trap == "pyenv":
        other = _other_pyenv_version()
        if other is None:
            pytest.skip(f"no pyenv Python of another minor version than {sys.version_info[:2]} under {PYENV_VERSIONS}")
        (checkout_019 / ".python-version").write_text(other + "\n")
    else:
        env["PATH"] = f"{_wrong_shims(tmp_path / 'shims')}{os.pathsep}{env['PATH']}"
    assert _suffix_make_would_use(datasets, env) != EXT_SUFFIX  # the trap springs without use_job_python
    fixed = job_python_env(env)
    assert _suffix_make_would_use(datasets, fixed) == EXT_SUFFIX
    make = subprocess.run(["make", "-C", str(datasets)], env=fixed, capture_output=True, text=True, timeout=300)
    assert make.returncode == 0, make.stdout + make.stderr
    assert [p.name for p in datasets.glob("helpers_cpp*")] == [f"helpers_cpp{EXT_SUFFIX}"]
    load = subprocess.run([sys.executable, "-c", "from megatron.core.datasets import helpers_cpp; "
                           "print(helpers_cpp.__file__)"], cwd=tmp_path, capture_output=True, text=True,
                          env={**fixed, "PYTHONPATH": str(checkout_019)}, timeout=120)
    assert load.returncode == 0 and load.stdout.strip() == str(datasets / f"helpers_cpp{EXT_SUFFIX}"), load.stderr
    subprocess.run(["git", "-C", str(checkout_019), "checkout", "-q", "--", ".python-version"], check=True)


def test_every_script_that_starts_megatron_uses_the_one_function():
    """The user scripts source scripts/lib/job_python.sh and call use_job_python before they launch; the SLURM
    scripts carry it inlined, word for word (make_sbatch.py --check keeps them current)."""
    scripts = ROOT / "scripts"
    launches = {"compare_loss.sh": 'env -u WLB_ENABLE "${launch[@]}"', "train_cpu.sh": "exec \"$PYTHON\" -m torch",
                "launch_local.sh": "cmd=(torchrun"}
    for name, launch in launches.items():
        text = (scripts / name).read_text()
        assert "lib/job_python.sh" in text and 0 < text.find('use_job_python "$PYTHON"') < text.index(launch), name
    function = (scripts / "lib" / "job_python.sh").read_text()
    function = function[function.index("use_job_python() {"):]
    sbatches = sorted((scripts / "slurm").glob("*.sbatch"))
    assert sbatches
    for sbatch in sbatches:
        text = sbatch.read_text()
        assert function in text and text.index('use_job_python "$PYTHON"') < text.index("\nlaunch "), sbatch.name
