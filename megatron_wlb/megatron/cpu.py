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
from dataclasses import dataclass
from typing import Any

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
    import torch

    from megatron_wlb.megatron.compat import install_python_shims, refuse_spawned_reimport

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
    # the same values. TORCHDYNAMO_DISABLE=0 compiles anyway.
    if os.environ.get("TORCHDYNAMO_DISABLE", "1") != "0":
        import torch._dynamo

        torch._dynamo.config.disable = True
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
    """The redirects that live in Megatron's own modules (imported here, after ``install_cpu_redirects``)."""
    import functools

    import torch
    from megatron.core.tensor_parallel import random as tp_random
    from megatron.training import initialize, training

    tp_random._set_cuda_rng_state = lambda new_state, *a, **k: torch.set_rng_state(new_state)
    if hasattr(tp_random, "_get_cuda_rng_state"):  # activation recomputation saves and restores the state
        tp_random._get_cuda_rng_state = lambda *a, **k: torch.get_rng_state()
    warmup = getattr(initialize, "_warmup_jit_function", None)
    if warmup is not None and not getattr(warmup, "__wlb_cpu__", False):
        def warmup_keeping_the_cpu_generator(*args: Any, **kwargs: Any) -> Any:
            state = torch.get_rng_state()
            try:
                return warmup(*args, **kwargs)
            finally:
                torch.set_rng_state(state)

        warmup_keeping_the_cpu_generator.__wlb_cpu__ = True  # type: ignore[attr-defined]
        initialize._warmup_jit_function = warmup_keeping_the_cpu_generator
    install_sequence_parallel_torch_norm()
    from megatron_wlb.megatron.startup import guard_fused_kernels

    guard_fused_kernels(force=True)  # core <= 0.16: initialize calls it; it runs nvcc -V and compiles nothing
    original = initialize.initialize_megatron
    if not getattr(original, "__wlb_cpu__", False):
        patched = functools.wraps(original)(lambda *a, **k: original(*a, **{**k, "allow_no_cuda": True}))
        patched.__wlb_cpu__ = True  # type: ignore[attr-defined]
        for module in (initialize, training):
            if getattr(module, "initialize_megatron", None) is original:
                module.initialize_megatron = patched


#: A tiny GPT (2 layers, hidden 64, RoPE, RMSNorm, SwiGLU, GQA-free) with Megatron's local layer spec and
#: what the CPU needs: no fused CUDA kernels, CPU initialization, fp32, no gradient clipping (CUDA-only
#: multi-tensor kernels). Later flags override these (argparse keeps the last occurrence).
TINY_GPT_ARGS: tuple[str, ...] = (
    "--num-layers", "2", "--hidden-size", "64", "--num-attention-heads", "4", "--ffn-hidden-size", "128",
    "--seq-length", "256", "--max-position-embeddings", "1024", "--micro-batch-size", "1",
    "--global-batch-size", "4", "--train-iters", "4", "--lr", "3e-3", "--min-lr", "3e-4",
    "--lr-decay-style", "constant", "--seed", "1234", "--normalization", "RMSNorm",
    "--position-embedding-type", "rope", "--disable-bias-linear", "--swiglu",
    "--attention-dropout", "0.0", "--hidden-dropout", "0.0", "--no-persist-layer-norm",
    "--no-gradient-accumulation-fusion", "--no-masked-softmax-fusion", "--no-bias-dropout-fusion",
    "--no-bias-swiglu-fusion", "--no-rope-fusion", "--transformer-impl", "local", "--use-cpu-initialization",
    "--tokenizer-type", "NullTokenizer", "--vocab-size", "300", "--split", "98,2,0", "--eval-iters", "0",
    "--eval-interval", "1000", "--clip-grad", "0", "--log-interval", "1", "--calculate-per-token-loss",
    "--distributed-backend", "gloo",
)

#: the end-of-document id of ``TINY_GPT_ARGS``'s NullTokenizer (vocabulary 300: its last id): a corpus for the
#: tiny GPT ends its documents with it, or Megatron's ``--reset-*`` masking finds no document ends
TINY_GPT_EOD = 299

#: the data-path flags whose prefixes the tiny GPT's vocabulary must cover
DATA_PATH_FLAGS = ("--data-path", "--train-data-path", "--valid-data-path", "--test-data-path")


def _flag_values(argv: Sequence[str], flag: str) -> list[list[str]]:
    """The values of every occurrence of ``flag`` (up to the next ``--`` flag)."""
    out = []
    for i, arg in enumerate(argv):
        if arg == flag:
            values = []
            for value in argv[i + 1:]:
                if value.startswith("--"):
                    break
                values.append(value)
            out.append(values)
    return out


def tiny_gpt_vocab_flags(argv: Sequence[str]) -> list[str]:
    """``--vocab-size`` for the tiny GPT from the data in ``argv``: none when its default (300) covers the
    largest token id, else that id + 1; a ``--vocab-size`` given in ``argv`` that does not cover it is
    refused (SystemExit naming the largest id and the flag)."""
    from megatron_wlb.data.reader import IndexedSource, weighted_prefixes

    try:
        # argparse keeps a flag's last occurrence (train_cpu.sh puts its default --data-path first)
        prefixes = sorted({p for flag in DATA_PATH_FLAGS for values in _flag_values(argv, flag)[-1:] if values
                           for p, _ in weighted_prefixes(values)})
        if not prefixes:
            return []
        top, where = max((IndexedSource.open(p).max_token_id(), p) for p in prefixes)
    except ValueError as exc:
        raise SystemExit(f"megatron_wlb.megatron.cpu: {exc}") from None
    given = _flag_values(argv, "--vocab-size")
    if given:
        vocab = given[-1][0] if given[-1] else ""
        if not vocab.isdigit() or top >= int(vocab):
            raise SystemExit(f"megatron_wlb.megatron.cpu: --vocab-size {vocab}: {where} holds token id {top}; give "
                             f"--vocab-size {top + 1} or more (or leave it out: the tiny GPT takes it from the data)")
        return []
    default = int(TINY_GPT_ARGS[TINY_GPT_ARGS.index("--vocab-size") + 1])
    return [] if top < default else ["--vocab-size", str(top + 1)]


#: Environment variables that give the layout, and their defaults.
LAYOUT_VARIABLES = {"TP": 1, "CP": 1, "PP": 1, "VPP": 1, "DP": 1}


def layout_from_env(environ: Any = None) -> tuple[dict[str, int], list[str]]:
    """The layout in ``TP``/``CP``/``PP``/``VPP``/``DP`` (positive integers) and its Megatron flags.

    ``VPP`` is the number of virtual stages per pipeline rank (Megatron's
    ``--num-virtual-stages-per-pipeline-rank``); the world size is TP*CP*PP*DP.
    """
    environ = os.environ if environ is None else environ
    layout = {}
    for name, default in LAYOUT_VARIABLES.items():
        raw = environ.get(name, "") or str(default)
        if not raw.isdigit() or int(raw) < 1:
            raise ValueError(f"{name}={raw!r}: give a positive integer (the {name} size of the layout)")
        layout[name] = int(raw)
    flags = ["--tensor-model-parallel-size", str(layout["TP"]), "--context-parallel-size", str(layout["CP"]),
             "--pipeline-model-parallel-size", str(layout["PP"])]
    if layout["VPP"] > 1:
        if layout["PP"] < 2:
            raise ValueError(f"VPP={layout['VPP']} needs PP >= 2 (virtual stages interleave pipeline stages)")
        flags += ["--num-virtual-stages-per-pipeline-rank", str(layout["VPP"])]
    return layout, flags


def world_size(layout: dict[str, int]) -> int:
    return layout["TP"] * layout["CP"] * layout["PP"] * layout["DP"]


def write_text_corpus(prefix: str, max_bytes: int = 600_000, separator: str = "\n\n") -> tuple[int, int]:
    """Write ``prefix.bin/.idx``: the Python standard library's ``.py`` files as byte-level documents
    (cut at blank lines: functions and paragraphs, each followed by EOD 256); returns (documents,
    tokens). Real text whose document lengths span three orders of magnitude, on every machine with
    Python."""
    import sysconfig
    from pathlib import Path

    from megatron_wlb.data.reader import byte_documents, write_indexed_dataset

    stdlib = Path(sysconfig.get_paths()["stdlib"])
    paths = sorted(str(p) for p in stdlib.glob("*.py"))
    docs = byte_documents(paths, separator=separator, max_bytes=max_bytes)
    os.makedirs(os.path.dirname(os.path.abspath(prefix)), exist_ok=True)
    write_indexed_dataset(prefix, docs)
    return len(docs), int(sum(len(d) for d in docs))


def install_sequence_parallel_torch_norm() -> None:
    """Let Megatron's ``WrappedTorchNorm`` (the local spec's norm without apex) run under sequence
    parallelism: build the torch norm as without SP and mark its parameters ``sequence_parallel``, as
    apex's fused norms do, so ``finalize_model_grads`` sums their gradients over the TP group."""
    from megatron.core.transformer import torch_norm

    wrapped = torch_norm.WrappedTorchNorm
    if getattr(wrapped, "__wlb_sequence_parallel__", False):
        return
    original_new = wrapped.__new__

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

    wrapped.__new__ = staticmethod(__new__)
    wrapped.__wlb_sequence_parallel__ = True


#: ``WLB_PIN_CORES=1``: each rank runs on one core of its own (measurements: no rank shares a core)
PIN_VARIABLE = "WLB_PIN_CORES"

#: glibc malloc settings for timed CPU runs: large tensors come from the heap and freed memory stays there,
#: instead of an mmap, first-touch page faults and an munmap per attention score buffer. Without them the
#: tiny GPT's ranks spent 40% of their thread time in the kernel and the same micro-batch's thread time
#: varied 14-18% between repeats (issue 39's A/A run, 2-core VM). glibc reads them at process start, so a
#: launcher sets them in the workers' environment (``measurement_env``).
MEASUREMENT_MALLOC_ENV = {"MALLOC_MMAP_THRESHOLD_": str(1 << 30), "MALLOC_TRIM_THRESHOLD_": str(1 << 34),
                          "MALLOC_TOP_PAD_": str(1 << 28)}


def measurement_env(layout: dict[str, str], environ: Any = None) -> dict[str, str]:
    """The environment of a timed CPU training run: ``environ`` (default ``os.environ``), the layout
    (TP/CP/PP/DP), one core and one thread per rank, no CUDA, and ``MEASUREMENT_MALLOC_ENV`` where the
    environment does not set those variables itself."""
    base = dict(os.environ if environ is None else environ)
    return {**MEASUREMENT_MALLOC_ENV, **base, **layout, PIN_VARIABLE: "1", "OMP_NUM_THREADS": "1",
            "CUDA_VISIBLE_DEVICES": ""}


def pin_to_core(environ: Any = None) -> int | None:
    """With ``WLB_PIN_CORES=1``, bind this process to core ``LOCAL_RANK`` of the cores it may use, and
    torch to one thread; returns the core (None when not asked). Refuses more ranks than cores."""
    env = os.environ if environ is None else environ
    if env.get(PIN_VARIABLE, "0") in ("", "0"):
        return None
    cores = sorted(os.sched_getaffinity(0))
    rank = int(env.get("LOCAL_RANK", "0"))
    if rank >= len(cores):
        raise SystemExit(f"{PIN_VARIABLE}=1: local rank {rank} but only {len(cores)} cores ({cores}); run at most "
                         f"{len(cores)} ranks per machine to measure, or unset {PIN_VARIABLE}")
    os.sched_setaffinity(0, {cores[rank]})
    os.environ["OMP_NUM_THREADS"] = "1"
    import torch

    torch.set_num_threads(1)
    return cores[rank]


def main(argv: Sequence[str] | None = None) -> None:
    """Entry point: ``--write-corpus PREFIX``, or train: redirects, then the thin launcher or
    ``--pretrain-gpt PATH`` as ``__main__``. ``--tiny-gpt`` puts ``TINY_GPT_ARGS`` and the layout of
    the environment (``layout_from_env``) and a vocabulary covering the data (``tiny_gpt_vocab_flags``)
    before the given flags."""
    argv = list(sys.argv[1:] if argv is None else argv)
    if argv[:1] == ["--write-corpus"]:
        if len(argv) != 2:
            raise SystemExit("usage: python -m megatron_wlb.megatron.cpu --write-corpus PREFIX")
        docs, tokens = write_text_corpus(argv[1])
        print(f"wrote {argv[1]}.bin/.idx: {docs} documents, {tokens} tokens")
        return
    os.environ.setdefault("CUDA_DEVICE_MAX_CONNECTIONS", "1")
    pin_to_core()
    script = None
    if argv[:1] == ["--pretrain-gpt"]:
        if len(argv) < 2:
            raise SystemExit("--pretrain-gpt needs the path of a Megatron-LM checkout's pretrain_gpt.py")
        script, argv = argv[1], argv[2:]
        if not os.path.isfile(script):
            raise SystemExit(f"--pretrain-gpt {script}: no such file (give a Megatron-LM checkout's pretrain_gpt.py)")
    if argv[:1] == ["--tiny-gpt"]:
        try:
            _, layout_flags = layout_from_env()
        except ValueError as exc:
            raise SystemExit(f"megatron_wlb.megatron.cpu: {exc}") from None
        argv = [*TINY_GPT_ARGS, *layout_flags, *tiny_gpt_vocab_flags(argv[1:]), *argv[1:]]
    elif "--distributed-backend" not in argv:
        argv = [*argv, "--distributed-backend", "gloo"]
    install_cpu_redirects()
    if script is not None:
        from megatron_wlb.megatron.args import exit_on_startup_error
        from megatron_wlb.megatron.compat import spawn_children_import_this_module

        sys.path.insert(0, os.path.dirname(os.path.abspath(script)))
        spawn_children_import_this_module(script)  # the torch_dist writer's children must not re-run the script
        install_megatron_redirects()
        from megatron_wlb.megatron import launcher, main_schedule

        # what a main user's launcher does (main_schedule's module runner): "wlb" among the checkout's own
        # sequence-packing schedulers, before its flags are parsed (a no-op, saying why, where it has none)
        main_schedule.register()
        sys.argv = [script, *argv]
        with exit_on_startup_error():
            runpy.run_path(script, run_name="__main__")
        launcher.release_process_groups()
        return
    install_megatron_redirects()
    from megatron_wlb.megatron import launcher

    launcher.main(argv)


if __name__ == "__main__":
    main()
