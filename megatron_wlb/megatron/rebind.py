"""Rebinding a Megatron function in every module that imported it (``from x import f`` copies)."""

from __future__ import annotations

import sys
from collections.abc import Callable


def rebind(name: str, original: Callable, replacement: Callable, skip: tuple[str, ...] = ()) -> list[str]:
    """Point ``name`` at ``replacement`` in every loaded module whose ``name`` is ``original``.

    Reads each module's ``__dict__`` directly: lazy modules (transformers, six.moves, ...) may raise
    anything from ``__getattr__``, and a binding they would create lazily cannot be ``original``.
    Returns the names of the modules rebound.
    """
    patched = []
    for mod_name, module in list(sys.modules.items()):
        if module is None or mod_name in skip:
            continue
        namespace = getattr(module, "__dict__", None)
        if isinstance(namespace, dict) and namespace.get(name) is original:
            setattr(module, name, replacement)
            patched.append(mod_name)
    return patched
