"""What a Python process needs before it imports Megatron, in one place (``apply()`` and the CPU harness call it).

- ``install_python_shims``: megatron-core >= 0.19 imports ``typing.override`` (Python 3.12); the README's
  install runs it on 3.10/3.11 (``--ignore-requires-python``), where ``typing_extensions.override`` stands in.
- ``refuse_spawned_reimport``: Megatron's ``torch_dist`` checkpoint writer starts a ``multiprocessing``
  manager with the *spawn* method, which re-imports the launching script; a script that trains at module
  level (no ``if __name__ == "__main__":`` guard) would train again in that process instead of writing.
- ``python -m megatron_wlb.megatron.args.compat SCRIPT [ARGS...]``: run one of Megatron's own scripts (e.g. a
  checkout's ``tools/preprocess_data.py``) with the shim, on the README's Python 3.11 install.
- ``spawn_children_import_this_module``: the CPU harness runs a checkout's ``pretrain_gpt.py`` as a script,
  whose module-level imports need the shim; spawned children import this module instead (it installs the
  shim: Megatron's writer processes need nothing from the script).
"""

from __future__ import annotations

import os
import runpy
import sys
import typing
from multiprocessing import spawn

try:  # Python < 3.12: typing.override's stand-in (install_python_shims)
    import typing_extensions
except ImportError:  # pragma: no cover - reported by install_python_shims where it is needed
    typing_extensions = None  # type: ignore[assignment]


def install_python_shims() -> bool:
    """Stand ``typing_extensions.override`` in for ``typing.override`` where Python < 3.12; returns whether
    it installed it (False on Python >= 3.12 or when already there)."""
    if hasattr(typing, "override"):
        return False
    if typing_extensions is None:
        raise RuntimeError(f"megatron-core >= 0.19 needs typing.override (Python 3.12+); on Python "
                           f"{sys.version_info.major}.{sys.version_info.minor} megatron_wlb stands in "
                           "typing_extensions.override: pip install typing_extensions")
    typing.override = typing_extensions.override  # type: ignore[attr-defined]
    return True


#: the name multiprocessing's spawn gives the launching script it re-imports in a child
SPAWNED_MAIN = "__mp_main__"


def refuse_spawned_reimport() -> None:
    """Raise when called while a multiprocessing child (spawn start method) re-imports the launching script,
    i.e. from that script's module-level code: it has no ``__main__`` guard and would train again instead of
    doing the child's work."""
    frame = sys._getframe(1)
    while frame is not None:
        if frame.f_code.co_name == "<module>" and frame.f_globals.get("__name__") == SPAWNED_MAIN:
            script = frame.f_globals.get("__file__") or "the launching script"
            raise RuntimeError(f"megatron_wlb: {script} is being re-imported by a multiprocessing child (spawn; "
                               "e.g. the writer of Megatron's torch_dist checkpoints) and would start training "
                               "again: put its training code under `if __name__ == \"__main__\":`")
        frame = frame.f_back  # type: ignore[assignment]


def spawn_children_import_this_module(script: str) -> None:
    """Spawned children of this process import this module as their ``__main__`` instead of re-running
    ``script`` (a Megatron-LM ``pretrain_gpt.py``: its module-level imports need ``typing.override`` on
    Python < 3.12, which a fresh child lacks, and its work belongs to the parent). Idempotent."""
    original = spawn.get_preparation_data
    if getattr(original, "__wlb_compat__", False):
        return
    script_path = os.path.normpath(os.path.abspath(script))

    def get_preparation_data(name: str) -> dict:
        data = original(name)
        main = data.get("init_main_from_path")
        if main is not None and os.path.normpath(os.path.abspath(main)) == script_path:
            del data["init_main_from_path"]
            data["init_main_from_name"] = __name__
        return data

    get_preparation_data.__wlb_compat__ = True  # type: ignore[attr-defined]
    spawn.get_preparation_data = get_preparation_data


def run_script(argv: list[str]) -> None:
    """Run ``argv[0]`` (a Python script) as ``__main__`` with ``argv[1:]``, after ``install_python_shims``;
    its directory comes first on ``sys.path``, as when Python runs it."""
    if not argv or not os.path.isfile(argv[0]):
        raise SystemExit("usage: python -m megatron_wlb.megatron.args.compat SCRIPT [ARGS...] (e.g. a Megatron-LM "
                         f"checkout's tools/preprocess_data.py){'; no such file: ' + argv[0] if argv else ''}")
    install_python_shims()
    sys.argv = list(argv)
    sys.path.insert(0, os.path.dirname(os.path.abspath(argv[0])))
    runpy.run_path(argv[0], run_name="__main__")


if __name__ == SPAWNED_MAIN:  # a spawned child of a process that ran spawn_children_import_this_module
    install_python_shims()
elif __name__ == "__main__":
    run_script(sys.argv[1:])
