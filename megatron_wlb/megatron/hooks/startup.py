"""Megatron start-up steps that need a build toolchain, made safe where there is none.

On the pinned core_v0.16.1, ``initialize_megatron`` always runs two build steps (``_compile_dependencies``):

- ``compile_helpers()`` on rank 0: ``make`` of ``megatron/core/datasets/helpers.cpp`` (g++, pybind11,
  python3-config, Python.h), else ``sys.exit(1)``. WLB-LLM's iterators never use these helpers (only
  Megatron's own dataset loaders do);
- ``fused_kernels.load(args)`` on every rank: at this commit it builds nothing, but it runs
  ``CUDA_HOME/bin/nvcc -V``, a TypeError when torch found no CUDA toolkit (``CUDA_HOME`` None: a GPU
  machine with the torch wheel's CUDA runtime and no toolkit) and a FileNotFoundError without nvcc.

``guard_startup_builds()`` (called by ``apply()``, so by the patched ``pretrain_gpt.py`` and our
launcher, on GPU and CPU alike) skips each step only where it could not succeed or is not needed,
and says so once; where the toolchain is there, Megatron runs its own step unchanged.
"""

from __future__ import annotations

import importlib.util
import os
import runpy
import shutil
import subprocess
import sys
import sysconfig
from collections.abc import Callable

from torch.utils import cpp_extension

from megatron_wlb.megatron.hooks import table as hooks

#: what compile_helpers' Makefile runs: make, $(CXX) (g++ by default), python3-config, python3 -m pybind11
HELPER_TOOLS = ("make", "g++", "python3-config")


def _say(line: str) -> None:
    if os.environ.get("RANK", "0") == "0":
        print(f"> megatron_wlb: {line}", flush=True)


def missing_helper_toolchain(which: Callable[[str], str | None] = shutil.which) -> list[str]:
    """What compiling Megatron's dataset helpers would need and this machine lacks (empty: it can build)."""
    missing = [tool for tool in HELPER_TOOLS if which(tool) is None]
    python3 = which("python3")
    if python3 is None:
        missing.append("python3")
    elif subprocess.run([python3, "-m", "pybind11", "--includes"], capture_output=True).returncode != 0:
        missing.append("pybind11 (for python3)")
    if not os.path.isfile(os.path.join(sysconfig.get_paths()["include"], "Python.h")):
        missing.append("Python.h (the Python development headers)")
    return missing


def guarded_compile_helpers(original: Callable[[], None], which: Callable[[str], str | None] = shutil.which
                            ) -> Callable[[], None]:
    """``megatron.core.datasets.utils.compile_helpers`` made safe (``hooks.HOOKS``): its ``__wlb_guard__`` says
    what it will do: ``"prebuilt"`` (the compiled module is importable: nothing to build), ``"compile"``
    (Megatron's own ``make``, the toolchain is here) or ``"skipped"`` (no toolchain: a no-op that says why)."""
    from megatron.core.datasets import utils  # lazy: Megatron is imported by the time hooks are installed

    makefile = os.path.join(os.path.dirname(os.path.abspath(utils.__file__)), "Makefile")
    if importlib.util.find_spec("megatron.core.datasets.helpers_cpp") is not None:
        mode, note = "prebuilt", ""
    else:
        missing = missing_helper_toolchain(which) if os.path.isfile(makefile) else ["its Makefile"]
        mode = "skipped" if missing else "compile"
        note = (f"Megatron's C++ dataset helpers are not built and cannot be here (missing: {', '.join(missing)}): "
                "skipped. WLB-LLM's iterators do not use them; Megatron's own dataset loaders would (copy a "
                "prebuilt helpers_cpp*.so into megatron/core/datasets/, as scripts/gpu_stage.sh does)")

    def compile_helpers() -> None:
        if mode == "compile":
            original()
        elif note:
            _say(note)

    compile_helpers.__wlb_guard__ = mode  # type: ignore[attr-defined]
    return compile_helpers


def guard_dataset_helpers(which: Callable[[str], str | None] = shutil.which) -> str:
    """Make ``megatron.core.datasets.utils.compile_helpers`` safe (``guarded_compile_helpers``, idempotent);
    returns what it will do: ``"prebuilt"``, ``"compile"`` or ``"skipped"``."""
    hooks.install_hook("compile_helpers", which=which)
    return str(hooks.current("compile_helpers").__wlb_guard__)


def nvcc_runs() -> bool:
    """Whether ``CUDA_HOME/bin/nvcc -V`` (what core 0.16's ``fused_kernels.load`` runs) would succeed."""
    home = cpp_extension.CUDA_HOME
    nvcc = os.path.join(home, "bin", "nvcc") if home else None
    if nvcc is None or not os.access(nvcc, os.X_OK):
        return False
    return subprocess.run([nvcc, "-V"], capture_output=True).returncode == 0


def guarded_fused_kernels_load(original: Callable[..., None], force: bool = False) -> Callable[..., None] | None:
    """Core 0.16's ``megatron.legacy.fused_kernels.load`` made safe (``hooks.HOOKS``): None (Megatron's own is
    kept) where nvcc runs, else a no-op (``force``: always, and silently)."""
    if not force and nvcc_runs():
        return None

    def load(*args: object, **kwargs: object) -> None:
        """core 0.16's fused_kernels.load only reads nvcc's version (it builds no kernel): skipped."""

    load.__wlb_guard__ = "skipped"  # type: ignore[attr-defined]
    if not force:
        _say("no runnable nvcc (CUDA_HOME/bin/nvcc): Megatron's legacy fused_kernels.load, which only reads "
             "nvcc's version at this release and builds nothing, is skipped")
    return load


def guard_fused_kernels(force: bool = False) -> str:
    """Make core 0.16's ``megatron.legacy.fused_kernels.load`` safe; returns ``"absent"`` (no such module:
    core >= 0.17), ``"kept"`` (nvcc runs: Megatron's own) or ``"skipped"`` (a no-op; ``force``: always)."""
    if hooks.current("fused_kernels.load") is None:
        return "absent"
    hooks.install_hook("fused_kernels.load", force=force)
    return "skipped" if hooks.is_installed("fused_kernels.load") else "kept"


def guard_startup_builds() -> dict[str, str]:
    """Both guards; returns what each will do (``{"dataset_helpers": ..., "fused_kernels": ...}``)."""
    if "megatron.core" not in sys.modules:
        import megatron.core  # noqa: F401  (fail here, with Megatron's own import error, if it is missing)
    return {"dataset_helpers": guard_dataset_helpers(), "fused_kernels": guard_fused_kernels()}


__all__ = ["guard_dataset_helpers", "guard_fused_kernels", "guard_startup_builds", "guarded_compile_helpers",
           "guarded_fused_kernels_load", "missing_helper_toolchain", "nvcc_runs"]


def main(argv: list[str] | None = None) -> None:
    """``python -m megatron_wlb.megatron.hooks.startup PRETRAIN_SCRIPT [flags...]``: a Megatron-LM entry script as
    ``__main__`` with only these guards (no WLB-LLM hook): stock Megatron on a machine without a toolchain."""
    argv = list(sys.argv[1:] if argv is None else argv)
    if not argv or not os.path.isfile(argv[0]):
        raise SystemExit("usage: python -m megatron_wlb.megatron.hooks.startup PATH/pretrain_gpt.py [flags...]")
    script = os.path.abspath(argv[0])
    sys.path.insert(0, os.path.dirname(script))
    guard_startup_builds()
    sys.argv = [script, *argv[1:]]
    runpy.run_path(script, run_name="__main__")


if __name__ == "__main__":
    main()
