# use_job_python PYTHON: build Megatron's dataset helpers for the interpreter that runs the job.
#
# Megatron compiles megatron/core/datasets/helpers.cpp with `make` (at start-up, rank 0), whose Makefile runs
# `python3 -m pybind11 --includes` and `python3-config --extension-suffix`: whichever python3 the PATH finds,
# from the checkout's folder, where pyenv's shims read the checkout's .python-version (a 3.12 checkout in a
# 3.11 job builds helpers_cpp.cpython-312*.so, and the job fails: No module named '...helpers_cpp'). This puts
# PYTHON's own folder (a venv's bin) and its installation's bin (which holds python3-config) first on PATH,
# and under pyenv sets PYENV_VERSION to PYTHON's installation, so every python3 the build finds is PYTHON's.
#
# The one place of this logic: sourced by scripts/compare_loss.sh, scripts/train_cpu.sh and
# scripts/launch_local.sh; inlined into scripts/slurm/*.sbatch by scripts/slurm/make_sbatch.py (SLURM runs a
# copy of the script, which cannot source a file beside it); the tests use it through tests/conftest.py.
use_job_python() {
    local settings
    settings=$("$1" -c '
import os, shlex, sys, sysconfig
bins = [os.path.dirname(sys.executable), sysconfig.get_config_var("BINDIR") or ""]
bins = [b for b in dict.fromkeys(bins) if b]
print("export PATH=" + shlex.quote(os.pathsep.join(bins)) + "\"${PATH:+:$PATH}\"")
versions = os.path.dirname(sys.base_prefix)  # pyenv: $PYENV_ROOT/versions/<name>, with $PYENV_ROOT/shims
if os.path.basename(versions) == "versions" and os.path.isdir(os.path.join(os.path.dirname(versions), "shims")):
    print("export PYENV_VERSION=" + shlex.quote(os.path.basename(sys.base_prefix)))
if not any(os.path.isfile(os.path.join(b, "python3-config")) for b in bins):
    print("echo " + shlex.quote(f"warning: no python3-config beside {sys.executable}: Megatron builds its dataset "
                                "helpers with the next one on PATH (install this Python\x27s development files)")
          + " >&2")
') || { echo "error: cannot run the job's Python interpreter '$1' (set PYTHON to one)" >&2; return 1; }
    eval "$settings"
}
