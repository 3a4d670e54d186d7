"""What a Python process needs before it imports Megatron, in one place (``apply()`` and the CPU harness call it).

- ``install_python_shims``: megatron-core >= 0.19 imports ``typing.override`` (Python 3.12); the README's
  install runs it on 3.10/3.11 (``--ignore-requires-python``), where ``typing_extensions.override`` stands in.
- ``refuse_spawned_reimport``: Megatron's ``torch_dist`` checkpoint writer starts a ``multiprocessing``
  manager with the *spawn* method, which re-imports the launching script; a script that trains at module
  level (no ``if __name__ == "__main__":`` guard) would train again in that process instead of writing.
"""

from __future__ import annotations

import sys


def install_python_shims() -> bool:
    """Stand ``typing_extensions.override`` in for ``typing.override`` where Python < 3.12; returns whether
    it installed it (False on Python >= 3.12 or when already there)."""
    import typing

    if hasattr(typing, "override"):
        return False
    try:
        import typing_extensions
    except ImportError as exc:
        raise RuntimeError(f"megatron-core >= 0.19 needs typing.override (Python 3.12+); on Python "
                           f"{sys.version_info.major}.{sys.version_info.minor} megatron_wlb stands in "
                           "typing_extensions.override: pip install typing_extensions") from exc
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
