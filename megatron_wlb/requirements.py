"""What megatron_wlb needs besides torch and numpy, path by path, and the one-line error for a missing one.

A bare GPU machine (torch, numpy, triton, nothing else, no network) needs exactly these, as wheels for
its Python (``scripts/gpu_stage.sh`` downloads them, ``docs/gpu.md`` says how to run there):

- ``CORE``: the ``wlb`` commands and ``--wlb-config`` (YAML run configs);
- ``MEGATRON``: Megatron-LM's training code (a core_v0.16.1 tree) on top of the core ones. Megatron-core
  declares none of them: its training code imports packaging, six, regex and pydantic (which brings
  pydantic-core, annotated-types, typing-inspection and a typing_extensions new enough for it).

No torch here, no imports at module level: ``require`` imports on demand.
"""

from __future__ import annotations

import importlib
import importlib.util
from types import ModuleType

#: pip requirement of each module the core imports on demand
CORE: dict[str, str] = {"yaml": "pyyaml>=6"}
#: pip requirements of Megatron-LM's training code beyond torch, numpy and triton (pydantic's own included)
MEGATRON: tuple[str, ...] = ("packaging>=24.2", "six", "regex", "pydantic>=2", "pydantic-core", "annotated-types",
                             "typing-inspection", "typing_extensions>=4.16")


class MissingDependency(ImportError):
    """A package megatron_wlb needs for what was asked is not installed (the message says which, and how)."""


def missing_message(module: str, purpose: str) -> str:
    """The one line that says ``module`` is missing for ``purpose`` and how to install it."""
    spec = CORE.get(module, module)
    return (f"{purpose} needs the Python package {spec.split('>')[0]!r}, which is not installed: pip install "
            f"'{spec}' (on a machine without network, the GPU kit's wheels: docs/gpu.md)")


def require(module: str, purpose: str) -> ModuleType:
    """``import module``, or a one-line ``MissingDependency`` naming the pip package and ``purpose``."""
    try:
        return importlib.import_module(module)
    except ImportError:
        raise MissingDependency(missing_message(module, purpose)) from None


def module_available(name: str) -> bool:
    """Whether ``name`` can be imported (without importing it)."""
    try:
        return importlib.util.find_spec(name) is not None
    except (ImportError, ValueError):
        return False


def all_requirements() -> tuple[str, ...]:
    """Every pip requirement a Megatron training run with megatron_wlb needs besides torch and numpy."""
    return (*CORE.values(), *MEGATRON)


if __name__ == "__main__":  # `python -m megatron_wlb.requirements`: one requirement a line (gpu_stage.sh)
    print("\n".join(all_requirements()))
