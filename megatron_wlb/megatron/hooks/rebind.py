"""Rebinding a Megatron function in every module that imported it (``from x import f`` copies)."""

from __future__ import annotations

import sys
from collections.abc import Callable
from typing import Any, TypeVar

F = TypeVar("F", bound=Callable[..., Any])
#: attribute of a wrapper that names the function it wraps (what uninstall/idempotence checks read)
WRAPPED_ATTR = "__wlb_original__"


def wrapping(original: Callable[..., Any]) -> Callable[[F], F]:
    """Decorator: mark the decorated wrapper as wrapping ``original`` (``original_of`` reads it back)."""

    def mark(wrapper: F) -> F:
        setattr(wrapper, WRAPPED_ATTR, original)
        return wrapper

    return mark


def original_of(fn: Any) -> Any:
    """The function ``fn`` wraps (``wrapping``), or ``fn`` itself if it wraps none."""
    return getattr(fn, WRAPPED_ATTR, fn)


def is_wrapper(fn: Any) -> bool:
    return hasattr(fn, WRAPPED_ATTR)


def rebind(name: str, original: Any, replacement: Any, skip: tuple[str, ...] = (),
           only: tuple[str, ...] = ()) -> list[str]:
    """Point ``name`` at ``replacement`` in every loaded module whose ``name`` is ``original`` (of ``only``, if
    given; none of ``skip``). ``hooks.install_hook`` is its one caller that changes Megatron's modules.

    Reads each module's ``__dict__`` directly: lazy modules (transformers, six.moves, ...) may raise
    anything from ``__getattr__``, and a binding they would create lazily cannot be ``original``.
    Returns the names of the modules rebound.
    """
    patched = []
    for mod_name, module in list(sys.modules.items()):
        if module is None or mod_name in skip or (only and mod_name not in only):
            continue
        namespace = getattr(module, "__dict__", None)
        if isinstance(namespace, dict) and namespace.get(name) is original:
            setattr(module, name, replacement)
            patched.append(mod_name)
    return patched
