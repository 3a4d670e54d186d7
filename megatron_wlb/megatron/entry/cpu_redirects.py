"""The CUDA redirects of the CPU harness (``cpu.py``): Megatron-LM's own training loop on the CPU (gloo).

Megatron-LM is written for GPUs and calls CUDA unconditionally in a few places even when every tensor
could live on the CPU. ``install_cpu_redirects()`` points exactly those calls at the CPU, and nothing
else; each entry of ``REDIRECTS`` says which Megatron call needs it. Those in Megatron's own modules are
``hooks.HOOKS`` entries of phase ``cpu`` (``install_megatron_redirects``; their factories are here).
"""

from __future__ import annotations

import functools
import os
from dataclasses import dataclass
from typing import Any

import torch
from torch.overrides import TorchFunctionMode

from megatron_wlb.megatron.args.compat import install_python_shims, refuse_spawned_reimport
from megatron_wlb.megatron.hooks import table as hooks
from megatron_wlb.megatron.hooks.startup import guard_fused_kernels

#: What is redirected and why (Megatron calls each unconditionally; none hides a bug of ours).
REDIRECTS: tuple[tuple[str, str], ...] = (
    ("device= arguments of tensor factories and Tensor.to",
     "Megatron allocates with device=torch.cuda.current_device() (p2p buffers, broadcasts, RoPE, "
     "the loss and grad-norm reductions); a torch function mode maps CUDA devices to the CPU, and "
     "random tensors asked for on the device draw from a generator of their own, as on a GPU"),
    ("Tensor.cuda / Module.cuda", "model build and batch code move tensors with .cuda(): identity"),
    ("torch.cuda.current_device / device_count / set_device / synchronize / get_device_properties / "
     "memory queries / Stream / Event / is_current_stream_capturing",
     "initialization (it builds the model-parallel groups only when device_count() > 0), argument "
     "validation (device arch), timers and memory reporting query the CUDA runtime: answered as for "
     "one idle device 0 of arch 0.0"),
    ("torch.cuda RNG (get_rng_state, set_rng_state, manual_seed) and Megatron's _get/_set_cuda_rng_state",
     "the tensor-parallel RNG tracker seeds and forks the CUDA generator (weight init, recomputation): "
     "the CPU generator stands in, so the states are the same functions of --seed as on a GPU"),
    ("the CPU generator's state around initialize's _warmup_jit_function",
     "the JIT warm-up runs dropout on seq_length/CP-sized random device tensors after seeding; on a GPU "
     "that draws from the device generator, here it would move the CPU generator that "
     "--use-cpu-initialization initializes the weights from (and differently for each CP size)"),
    ("megatron.legacy.fused_kernels.load (core 0.16)",
     "initialize calls it unconditionally; it only runs nvcc -V (no CUDA toolkit here) and builds nothing"),
    ("initialize_megatron(allow_no_cuda=True)",
     "initialize asserts torch.cuda.is_available() unless asked not to, and pretrain() does not ask"),
    ("Python 3.11: typing.override (not CUDA; compat.install_python_shims, which apply() also calls)",
     "megatron-core >= 0.19 imports typing.override (3.12); typing_extensions.override stands in"),
    ("WrappedTorchNorm under --sequence-parallel (not CUDA: apex is missing)",
     "apex's and TE's norms mark their weights sequence_parallel, so Megatron sums their gradients over "
     "TP; the local spec's torch fallback refuses SP instead. Here it builds the torch norm and marks it "
     "the same way, so SP runs on the CPU"),
)

_INSTALLED = False


def _is_cuda(device: Any) -> bool:
    if isinstance(device, int) and not isinstance(device, bool):
        return True  # an int device is a CUDA ordinal
    if isinstance(device, str):
        return device.startswith("cuda")
    return isinstance(device, torch.device) and device.type == "cuda"


def _device_mode():
    to = torch.Tensor.to

    class CudaToCpu(TorchFunctionMode):
        """Rewrite CUDA ``device`` arguments to the CPU (factories, ``Tensor.to``)."""

        def __torch_function__(self, func, types, args=(), kwargs=None):
            kwargs = kwargs or {}
            if getattr(func, "__name__", "") == "all_to_all_single":
                # MoE's alltoall dispatcher moves its split sizes to host numpy only off a CUDA device
                # (moe_utils.maybe_move_tensor_to_cpu); on the CPU they stay tensors, which gloo's binding refuses
                kwargs = {k: v.tolist() if k.endswith("split_sizes") and torch.is_tensor(v) else v
                          for k, v in kwargs.items()}
            if "device" in kwargs and _is_cuda(kwargs["device"]):
                kwargs = {**kwargs, "device": "cpu"}
            if func is to and len(args) > 1 and _is_cuda(args[1]):
                args = (args[0], "cpu", *args[2:])
            return func(*args, **kwargs)

    return CudaToCpu()


@dataclass(frozen=True)
class _DeviceProperties:
    """What ``torch.cuda.get_device_properties`` answers for the stand-in device (arch 0.0: pre-Volta)."""

    name: str = "cpu"
    major: int = 0
    minor: int = 0
    total_memory: int = 0
    multi_processor_count: int = 1


_DEVICE_PROPERTIES = _DeviceProperties()


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
    """Install the redirects of ``REDIRECTS`` in this process (idempotent). Call before importing Megatron
    and before anything uses CUDA: on a GPU machine the GPUs are hidden from this process."""
    global _INSTALLED
    if _INSTALLED:
        return

    refuse_spawned_reimport()

    if not torch.cuda.is_initialized():
        # CPU mode on a GPU machine: hide its GPUs from this process (read when CUDA initialises), so
        # the redirects below answer every CUDA query, as on a machine without one.
        os.environ["CUDA_VISIBLE_DEVICES"] = ""
    if torch.cuda.is_available():
        raise RuntimeError("install_cpu_redirects() must run before this process uses CUDA (it already has): "
                           "call it first, or run Megatron on the GPU normally")
    install_python_shims()

    # Not a CUDA redirect: Megatron's jit_fuser wraps small fusions in torch.compile, which on the CPU
    # compiles C++ with inductor in every process at start-up (minutes on 2 cores); eager mode computes
    # the same values. torch.compile hands back the function itself (what a disabled dynamo runs, without
    # importing dynamo and inductor: ~2 s a process). TORCHDYNAMO_DISABLE=0 compiles anyway.
    if os.environ.get("TORCHDYNAMO_DISABLE", "1") != "0":
        torch.compile = _eager_compile
    mode = _device_mode()
    mode.__enter__()  # for the life of the process
    torch.Tensor.cuda = lambda self, *a, **k: self  # type: ignore[method-assign]
    torch.nn.Module.cuda = lambda self, *a, **k: self  # type: ignore[method-assign]
    cuda: Any = torch.cuda  # monkeypatched on purpose: its stubs type the real CUDA API
    cuda.current_device = lambda: 0
    cuda.set_device = lambda *a, **k: None
    cuda.device_count = lambda: 1  # initialize_megatron builds the model-parallel groups only if > 0
    cuda.synchronize = lambda *a, **k: None
    cuda.get_device_name = lambda *a, **k: "cpu"
    cuda.get_device_capability = lambda *a, **k: (0, 0)
    cuda.get_device_properties = lambda *a, **k: _DEVICE_PROPERTIES
    for name in ("memory_allocated", "max_memory_allocated", "memory_reserved", "max_memory_reserved"):
        setattr(cuda, name, lambda *a, **k: 0)
    cuda.reset_peak_memory_stats = lambda *a, **k: None
    cuda.empty_cache = lambda *a, **k: None
    cuda.memory_stats = lambda *a, **k: {}
    cuda.mem_get_info = lambda *a, **k: (0, 0)
    cuda.is_current_stream_capturing = lambda: False  # Megatron-LM dev's p2p asks before each send
    cuda.Stream = _Stream
    cuda.Event = _Stream
    cuda.current_stream = lambda *a, **k: _Stream()
    cuda.default_stream = lambda *a, **k: _Stream()
    cuda.stream = lambda *a, **k: _Stream()
    cuda.get_rng_state = lambda *a, **k: torch.get_rng_state()
    cuda.set_rng_state = lambda state, *a, **k: torch.set_rng_state(state)
    # the tracker seeds "the device generator": the CPU one stands in (not torch.manual_seed, which calls these)
    cuda.manual_seed = lambda seed: torch.default_generator.manual_seed(int(seed))
    cuda.manual_seed_all = lambda seed: torch.default_generator.manual_seed(int(seed))
    _INSTALLED = True


def install_megatron_redirects() -> None:
    """The redirects that live in Megatron's own modules (``hooks.HOOKS``, phase ``cpu``; imported here, after
    ``install_cpu_redirects``)."""
    hooks.install_hook("_set_cuda_rng_state")
    hooks.install_hook("_get_cuda_rng_state")  # activation recomputation saves and restores the state
    hooks.install_hook("_warmup_jit_function")
    hooks.install_hook("WrappedTorchNorm.__new__")
    guard_fused_kernels(force=True)  # core <= 0.16: initialize calls it; it runs nvcc -V and compiles nothing
    hooks.install_hook("initialize_megatron")


def _eager_compile(model: Any = None, **_options: Any) -> Any:
    """``torch.compile`` while compiling is off: the function itself, used bare or with options
    (``@torch.compile``, ``@torch.compile(...)``, ``torch.compile(fn, ...)``)."""
    return model if model is not None else (lambda fn: fn)


# -- the factories of the cpu-phase hooks (hooks.HOOKS)
def set_rng_state(original: Any) -> Any:
    return lambda new_state, *a, **k: torch.set_rng_state(new_state)


def get_rng_state(original: Any) -> Any:
    return lambda *a, **k: torch.get_rng_state()


def warmup_keeping_the_cpu_generator(warmup: Any) -> Any:
    def warmup_keeping_the_cpu_generator(*args: Any, **kwargs: Any) -> Any:
        state = torch.get_rng_state()
        try:
            return warmup(*args, **kwargs)
        finally:
            torch.set_rng_state(state)

    return warmup_keeping_the_cpu_generator


def initialize_without_cuda(original: Any) -> Any:
    return functools.wraps(original)(lambda *a, **k: original(*a, **{**k, "allow_no_cuda": True}))


def sequence_parallel_torch_norm(original_new: Any) -> Any:
    """Let Megatron's ``WrappedTorchNorm`` (the local spec's norm without apex) run under sequence
    parallelism: build the torch norm as without SP and mark its parameters ``sequence_parallel``, as
    apex's fused norms do, so ``finalize_model_grads`` sums their gradients over the TP group."""

    def __new__(cls, config, hidden_size, *args, **kwargs):
        if not getattr(config, "sequence_parallel", False):
            return original_new(cls, config, hidden_size, *args, **kwargs)
        config.sequence_parallel = False
        try:
            norm = original_new(cls, config, hidden_size, *args, **kwargs)
        finally:
            config.sequence_parallel = True
        for param in norm.parameters():
            param.sequence_parallel = True
        return norm

    return staticmethod(__new__)


__all__ = ["REDIRECTS", "install_cpu_redirects", "install_megatron_redirects"]
