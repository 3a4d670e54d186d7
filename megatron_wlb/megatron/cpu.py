"""Megatron-LM's own training loop on CPU (gloo): the CUDA redirects and the entry point.

Megatron-LM is written for GPUs and calls CUDA unconditionally in a few places even when every tensor
could live on the CPU. ``install_cpu_redirects()`` points exactly those calls at the CPU, and nothing
else; each entry of ``REDIRECTS`` says which Megatron call needs it. The training step itself
(model, optimizer, pipeline schedules, our hooks) runs unchanged, on gloo process groups.

    torchrun --nproc-per-node 4 -m megatron_wlb.megatron.cpu [--pretrain-gpt PATH] <Megatron + --wlb-* flags>

Without ``--pretrain-gpt`` the thin launcher ``megatron_wlb.megatron.launcher`` runs (Megatron's
``pretrain`` from the installed megatron-core wheel, which ships ``megatron/training`` from 0.19 on);
with it, a Megatron-LM checkout's ``pretrain_gpt.py`` runs as ``__main__`` (the pinned, patched one).
``scripts/train_cpu.sh`` wraps this with a layout from environment variables.
"""

from __future__ import annotations

import os
import runpy
import sys
from collections.abc import Sequence
from typing import Any

#: What is redirected and why (Megatron calls each unconditionally; none hides a bug of ours).
REDIRECTS: tuple[tuple[str, str], ...] = (
    ("device= arguments of tensor factories and Tensor.to",
     "Megatron allocates with device=torch.cuda.current_device() (p2p buffers, broadcasts, RoPE, "
     "the loss and grad-norm reductions); a torch function mode maps CUDA devices to the CPU"),
    ("Tensor.cuda / Module.cuda", "model build and batch code move tensors with .cuda(): identity"),
    ("torch.cuda.current_device / set_device / synchronize / memory queries / Stream / Event",
     "initialization, timers and memory reporting query the CUDA runtime: answered as for one "
     "idle device 0"),
    ("torch.cuda RNG state (get_rng_state, set_rng_state, manual_seed)",
     "the tensor-parallel RNG tracker forks the CUDA generator: the CPU generator stands in"),
    ("initialize_megatron(allow_no_cuda=True)",
     "initialize asserts torch.cuda.is_available() unless asked not to, and pretrain() does not ask"),
    ("Python 3.11: typing.override", "megatron-core >= 0.19 imports typing.override (3.12); "
     "typing_extensions.override stands in"),
)

_INSTALLED = False


def _is_cuda(device: Any) -> bool:
    import torch

    if isinstance(device, int) and not isinstance(device, bool):
        return True  # an int device is a CUDA ordinal
    if isinstance(device, str):
        return device.startswith("cuda")
    return isinstance(device, torch.device) and device.type == "cuda"


def _device_mode():
    import torch
    from torch.overrides import TorchFunctionMode

    to = torch.Tensor.to

    class CudaToCpu(TorchFunctionMode):
        """Rewrite CUDA ``device`` arguments to the CPU (factories, ``Tensor.to``)."""

        def __torch_function__(self, func, types, args=(), kwargs=None):
            kwargs = kwargs or {}
            if "device" in kwargs and _is_cuda(kwargs["device"]):
                kwargs = {**kwargs, "device": "cpu"}
            if func is to and len(args) > 1 and _is_cuda(args[1]):
                args = (args[0], "cpu", *args[2:])
            return func(*args, **kwargs)

    return CudaToCpu()


class _Stream:
    """Stand-in for torch.cuda.Stream/Event on the CPU: everything is already synchronous."""

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        pass

    def __enter__(self):
        return self

    def __exit__(self, *exc: Any) -> None:
        return None

    def wait_stream(self, *args: Any) -> None:
        pass

    def wait_event(self, *args: Any) -> None:
        pass

    def record_event(self, *args: Any) -> _Stream:
        return _Stream()

    def record(self, *args: Any) -> None:
        pass

    def synchronize(self) -> None:
        pass

    def query(self) -> bool:
        return True

    def elapsed_time(self, other: Any) -> float:
        return 0.0


def install_cpu_redirects() -> None:
    """Install the redirects of ``REDIRECTS`` in this process (idempotent). Call before importing Megatron."""
    global _INSTALLED
    if _INSTALLED:
        return
    import typing

    import torch

    if torch.cuda.is_available():
        raise RuntimeError("install_cpu_redirects() is for machines without CUDA; this one has a GPU: "
                           "run Megatron normally")
    if not hasattr(typing, "override"):
        import typing_extensions

        typing.override = typing_extensions.override  # type: ignore[attr-defined]

    mode = _device_mode()
    mode.__enter__()  # for the life of the process
    torch.Tensor.cuda = lambda self, *a, **k: self  # type: ignore[method-assign]
    torch.nn.Module.cuda = lambda self, *a, **k: self  # type: ignore[method-assign]
    cuda = torch.cuda
    cuda.current_device = lambda: 0
    cuda.set_device = lambda *a, **k: None
    cuda.synchronize = lambda *a, **k: None
    cuda.device_count = lambda: 1
    cuda.get_device_name = lambda *a, **k: "cpu"
    cuda.get_device_capability = lambda *a, **k: (0, 0)
    for name in ("memory_allocated", "max_memory_allocated", "memory_reserved", "max_memory_reserved"):
        setattr(cuda, name, lambda *a, **k: 0)
    cuda.reset_peak_memory_stats = lambda *a, **k: None
    cuda.empty_cache = lambda *a, **k: None
    cuda.memory_stats = lambda *a, **k: {}
    cuda.mem_get_info = lambda *a, **k: (0, 0)
    cuda.Stream = _Stream  # type: ignore[misc]
    cuda.Event = _Stream  # type: ignore[misc]
    cuda.current_stream = lambda *a, **k: _Stream()
    cuda.default_stream = lambda *a, **k: _Stream()
    cuda.stream = lambda *a, **k: _Stream()
    cuda.get_rng_state = lambda *a, **k: torch.get_rng_state()
    cuda.set_rng_state = lambda state, *a, **k: torch.set_rng_state(state)
    cuda.manual_seed = lambda seed: None  # the CPU generator is seeded by torch.manual_seed
    cuda.manual_seed_all = lambda seed: None
    _INSTALLED = True


def install_megatron_redirects() -> None:
    """The redirects that live in Megatron's own modules (imported here, after ``install_cpu_redirects``)."""
    import functools

    import torch
    from megatron.core.tensor_parallel import random as tp_random
    from megatron.training import initialize, training

    tp_random._set_cuda_rng_state = lambda new_state, *a, **k: torch.set_rng_state(new_state)
    original = initialize.initialize_megatron
    if not getattr(original, "__wlb_cpu__", False):
        patched = functools.wraps(original)(lambda *a, **k: original(*a, **{**k, "allow_no_cuda": True}))
        patched.__wlb_cpu__ = True  # type: ignore[attr-defined]
        for module in (initialize, training):
            if getattr(module, "initialize_megatron", None) is original:
                module.initialize_megatron = patched


def main(argv: Sequence[str] | None = None) -> None:
    """Entry point: redirects, then the thin launcher or ``--pretrain-gpt PATH`` as ``__main__``."""
    argv = list(sys.argv[1:] if argv is None else argv)
    os.environ.setdefault("CUDA_DEVICE_MAX_CONNECTIONS", "1")
    script = None
    if argv[:1] == ["--pretrain-gpt"]:
        if len(argv) < 2:
            raise SystemExit("--pretrain-gpt needs the path of a Megatron-LM checkout's pretrain_gpt.py")
        script, argv = argv[1], argv[2:]
        if not os.path.isfile(script):
            raise SystemExit(f"--pretrain-gpt {script}: no such file (give a Megatron-LM checkout's pretrain_gpt.py)")
    install_cpu_redirects()
    if "--distributed-backend" not in argv:
        argv = [*argv, "--distributed-backend", "gloo"]
    if script is not None:
        sys.path.insert(0, os.path.dirname(os.path.abspath(script)))
        install_megatron_redirects()
        sys.argv = [script, *argv]
        runpy.run_path(script, run_name="__main__")
        return
    install_megatron_redirects()
    from megatron_wlb.megatron import launcher

    launcher.main(argv)


if __name__ == "__main__":
    main()
