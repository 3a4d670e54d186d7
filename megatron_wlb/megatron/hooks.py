"""Every Megatron function megatron_wlb replaces at run time, in one table, and the one installer.

``HOOKS`` lists each replacement: where it lives (module + attribute; ``Class.attr`` for a class attribute),
the releases it applies to, why (one line), when it is installed (``phase``) and the factory that builds the
replacement from Megatron's function (``"module:function"``, imported only when the hook is installed; it
may return None: nothing to replace on this machine or release). ``install_hook`` is the only code that
assigns onto a Megatron module or class; every replacement it installs carries ``__wlb_hook__`` (its table
name) and ``__wlb_original__`` (what it replaced), so an installed hook is found again (idempotence) and
undone (``uninstall_hook``). ``tests/test_megatron_hooks.py`` compares, after every phase, each attribute of
Megatron's modules and classes that changed against this table. (The one other write: the
``TransformerConfig.__post_init__`` replacement answers main's TransformerEngine version query for the duration of
that one call, restoring it after.)

Phases: ``main_schedule`` (``main_schedule.register()``, first in ``apply()``), ``apply``, then at
``validate_args`` time ``cp``, ``attention`` (unless TransformerEngine's attention is kept), ``pipeline``
(pipeline parallelism only) and ``timing``; ``cpu`` is the CPU harness's (``cpu_redirects.install_megatron_redirects``).
Releases: core 0.16.1 (``core_v0.16.1``, the pinned checkout), 0.19.2 (the wheel), main (0.20, a checkout).

Importing this module needs neither torch nor Megatron.
"""

from __future__ import annotations

import importlib
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from megatron_wlb.megatron.rebind import WRAPPED_ATTR, rebind

#: attribute of an installed replacement naming its ``HOOKS`` entry
HOOK_ATTR = "__wlb_hook__"
#: attribute of an installed class-attribute replacement whose original was inherited (uninstall deletes it)
INHERITED_ATTR = "__wlb_inherited__"
ALL = "0.16, 0.19, main"


@dataclass(frozen=True)
class Hook:
    """One Megatron function (or class attribute) that megatron_wlb replaces."""

    name: str
    module: str
    attr: str
    releases: str
    why: str
    phase: str
    make: str
    #: True: point every loaded module that holds the original at the replacement (``from x import f`` copies);
    #: False: replace the attribute on its owner only
    everywhere: bool = True
    #: with ``everywhere``: only these modules (empty: all)
    only: tuple[str, ...] = ()


def _training(name: str, module: str, why: str, releases: str = ALL) -> Hook:
    return Hook(name, f"megatron.training.{module}", name, releases, why, "apply",
                f"megatron_wlb.megatron.training_hooks:wrap_{name}")


def _timing(name: str, why: str) -> Hook:
    return Hook(name, "megatron.core.pipeline_parallel.schedules", name, ALL, why, "timing",
                "megatron_wlb.megatron.timing:wrap_pass")


#: the pipeline communicator's methods whose time is waiting (every send/receive of core 0.16 and 0.19)
P2P_METHODS = ("recv_forward", "recv_backward", "send_forward", "send_backward", "send_forward_recv_backward",
               "send_backward_recv_forward", "send_forward_recv_forward", "send_backward_recv_backward",
               "send_forward_backward_recv_forward_backward")
P2P_MODULE = "megatron.core.pipeline_parallel.p2p_communication"
ATTENTION_MODULE = "megatron.core.transformer.attention"

HOOKS: tuple[Hook, ...] = (
    # -- main's own sequence-packing scheduler registry (main_schedule.register; absent in 0.16, 0.19)
    Hook("ModelParallelConfig.__post_init__", "megatron.core.model_parallel_config",
         "ModelParallelConfig.__post_init__",
         "main after #6742, dev", "lets sequence_packing_scheduler='wlb' through the name check",
         "main_schedule", "megatron_wlb.megatron.main_checks:wrap_model_parallel_config_check", everywhere=False),
    Hook("TransformerConfig.__post_init__", "megatron.core.transformer.transformer_config",
         "TransformerConfig.__post_init__", "main after #6742, dev",
         "'wlb' checked as dp_balanced; with local layers the TE >= 2.9 requirement does not apply",
         "main_schedule", "megatron_wlb.megatron.main_checks:wrap_transformer_config_check", everywhere=False),
    Hook("parse_args (scheduler choices)", "megatron.training.arguments", "parse_args", "main after #6742, dev",
         "'wlb' among --sequence-packing-scheduler's choices; our attention for local layers",
         "main_schedule", "megatron_wlb.megatron.main_checks:widen_parse_args"),
    Hook("PackingSchedulerEnum", "megatron.core.datasets.data_schedule", "PackingSchedulerEnum", "main (0.20)",
         "main's enum plus WLB (an Enum gains no members otherwise); scheduler_map keyed by both",
         "main_schedule", "megatron_wlb.megatron.main_schedule:enum_with_wlb", everywhere=False),
    # -- apply(): the start-up builds made safe where the machine lacks the toolchain, then the training loop
    Hook("compile_helpers", "megatron.core.datasets.utils", "compile_helpers", ALL,
         "the dataset-helper make is skipped, saying so, where there is no toolchain (our iterators need no helpers)",
         "apply", "megatron_wlb.megatron.startup:guarded_compile_helpers", everywhere=False),
    Hook("fused_kernels.load", "megatron.legacy.fused_kernels", "load", "0.16 (megatron.legacy)",
         "it only runs nvcc -V (builds nothing): skipped where nvcc cannot run, and by the CPU harness",
         "apply", "megatron_wlb.megatron.startup:guarded_fused_kernels_load", everywhere=False),
    _training("parse_args", "arguments", "our --wlb-* flags composed into whichever extra_args_provider is passed"),
    _training("validate_args", "arguments", "our checks after Megatron's, then the validate-time hooks below"),
    _training("build_train_valid_test_data_iterators", "training",
              "every rank's training (and evaluation) iterator becomes a WlbDataIterator"),
    _training("save_checkpoint", "checkpointing", "the packer and stream state sidecar is saved"),
    _training("load_checkpoint", "checkpointing", "the sidecar is read back (and the data stream resumed)"),
    _training("train_step", "training", "the plan agreement over the world before every step"),
    _training("training_log", "training", "the per-iteration packing metrics"),
    _training("get_batch_on_this_tp_rank", "utils",
              "every rank reads its own micro-batch (no fixed-shape TP broadcast)", "0.16 (gone in >= 0.18)"),
    # -- validate_args: the CP data path and attention
    Hook("get_thd_batch_on_this_cp_rank", "megatron.core.utils", "get_thd_batch_on_this_cp_rank",
         "0.16 (gone in >= 0.18)", "the cu_seqlens our TP-rank hook uploaded give back their record's params", "cp",
         "megatron_wlb.megatron.cp_hooks:wrap_get_thd_batch_on_this_cp_rank"),
    Hook("SelfAttention.__init__", ATTENTION_MODULE, "SelfAttention.__init__", ALL,
         "every SelfAttention built afterwards uses WlbCoreAttention", "attention",
         "megatron_wlb.megatron.attention:wrap_self_attention_init", everywhere=False),
    Hook("apply_rotary_pos_emb", ATTENTION_MODULE, "apply_rotary_pos_emb", ALL,
         "RoPE rotates by the plan's positions (documents restart at 0)", "attention",
         "megatron_wlb.megatron.attention:wlb_apply_rotary_pos_emb", everywhere=False),
    Hook("P2PCommunicator._communicate_shapes", P2P_MODULE, "P2PCommunicator._communicate_shapes", "0.16, 0.19",
         "shapes exchanged in the activations' rank order (Megatron #5100 deadlock)", "pipeline",
         "megatron_wlb.megatron.p2p:ordered_communicate_shapes", everywhere=False),
    # -- validate_args: step timing (timing.py; pass through until a recorder is active)
    Hook("forward_step", "megatron.core.pipeline_parallel.schedules", "forward_step", ALL,
         "each micro-batch's forward timed", "timing", "megatron_wlb.megatron.timing:wrap_forward_step"),
    Hook("backward_step", "megatron.core.pipeline_parallel.schedules", "backward_step", ALL,
         "each micro-batch's backward timed", "timing", "megatron_wlb.megatron.timing:wrap_backward_step"),
    _timing("forward_backward_no_pipelining", "one timed pass per training step (PP 1)"),
    _timing("forward_backward_pipelining_with_interleaving", "one timed pass per training step (virtual stages)"),
    _timing("forward_backward_pipelining_without_interleaving", "one timed pass per training step (PP > 1)"),
    *(Hook(f"P2PCommunicator.{name}", P2P_MODULE, f"P2PCommunicator.{name}", "0.16, 0.19",
           "pipeline waiting timed", "timing", "megatron_wlb.megatron.timing:wrap_p2p", everywhere=False)
      for name in P2P_METHODS),
    Hook("finalize_model_grads", "megatron.core.distributed.finalize_model_grads", "finalize_model_grads", ALL,
         "the data-parallel gradient wait timed", "timing", "megatron_wlb.megatron.timing:wrap_finalize_model_grads"),
    # -- the CPU harness (cpu.py: Megatron's loop on gloo; each is in cpu_redirects.REDIRECTS)
    Hook("_set_cuda_rng_state", "megatron.core.tensor_parallel.random", "_set_cuda_rng_state", ALL,
         "the CPU generator stands in for the CUDA one", "cpu", "megatron_wlb.megatron.cpu_redirects:set_rng_state",
         everywhere=False),
    Hook("_get_cuda_rng_state", "megatron.core.tensor_parallel.random", "_get_cuda_rng_state", ALL,
         "activation recomputation saves and restores the CPU generator", "cpu",
         "megatron_wlb.megatron.cpu_redirects:get_rng_state", everywhere=False),
    Hook("_warmup_jit_function", "megatron.training.initialize", "_warmup_jit_function", ALL,
         "the JIT warm-up leaves the CPU generator (the weights' initializer) as it was", "cpu",
         "megatron_wlb.megatron.cpu_redirects:warmup_keeping_the_cpu_generator", everywhere=False),
    Hook("initialize_megatron", "megatron.training.initialize", "initialize_megatron", ALL,
         "allow_no_cuda=True (pretrain() does not ask)", "cpu",
         "megatron_wlb.megatron.cpu_redirects:initialize_without_cuda",
         only=("megatron.training.initialize", "megatron.training.training")),
    Hook("WrappedTorchNorm.__new__", "megatron.core.transformer.torch_norm", "WrappedTorchNorm.__new__", ALL,
         "the torch norm under --sequence-parallel, its weights marked sequence_parallel as apex's", "cpu",
         "megatron_wlb.megatron.cpu_redirects:sequence_parallel_torch_norm", everywhere=False),
)

BY_NAME: dict[str, Hook] = {hook.name: hook for hook in HOOKS}
PHASES = ("main_schedule", "apply", "cp", "attention", "pipeline", "timing", "cpu")
assert len(BY_NAME) == len(HOOKS) and {h.phase for h in HOOKS} <= set(PHASES)


def _owner(hook: Hook) -> tuple[Any, str] | None:
    """(the module or class holding the hooked attribute, the attribute's name); None where this Megatron has
    no such module or class."""
    try:
        owner: Any = importlib.import_module(hook.module)
    except ImportError:
        return None
    *path, attr = hook.attr.split(".")
    for part in path:
        owner = getattr(owner, part, None)
        if owner is None:
            return None
    return owner, attr


def _factory(hook: Hook) -> Callable[..., Any]:
    module, function = hook.make.split(":")
    return getattr(importlib.import_module(module), function)


def hooks_in(fn: Any) -> list[str]:
    """The names of the hooks stacked in ``fn`` (outermost first), following ``__wlb_original__``."""
    names: list[str] = []
    seen: set[int] = set()
    while fn is not None and id(fn) not in seen:
        seen.add(id(fn))
        name = getattr(fn, HOOK_ATTR, None)
        if isinstance(name, str):
            names.append(name)
        fn = getattr(fn, WRAPPED_ATTR, None)
    return names


def current(name: str) -> Any:
    """What Megatron's attribute of hook ``name`` is now (None where this release has none)."""
    found = _owner(BY_NAME[name])
    return None if found is None else getattr(found[0], found[1], None)


def is_installed(name: str) -> bool:
    return name in hooks_in(current(name))


def install_hook(name: str, **options: Any) -> Any:
    """Install the ``HOOKS`` entry ``name`` (idempotent); returns the original it replaced, or None where it
    is installed already, or this release has no such attribute, or the factory returned None. ``options``
    go to the factory."""
    hook = BY_NAME[name]
    found = _owner(hook)
    if found is None:
        return None
    owner, attr = found
    original = getattr(owner, attr, None)
    if original is None or name in hooks_in(original):
        return None
    replacement = _factory(hook)(original, **options)
    if replacement is None:
        return None
    target = replacement.__func__ if isinstance(replacement, (staticmethod, classmethod)) else replacement
    setattr(target, HOOK_ATTR, name)
    if getattr(target, WRAPPED_ATTR, None) is None:
        setattr(target, WRAPPED_ATTR, original)
    if isinstance(owner, type) and attr not in owner.__dict__:
        setattr(target, INHERITED_ATTR, True)
    if hook.everywhere:
        rebind(attr, original, replacement, only=hook.only)
    else:
        setattr(owner, attr, replacement)
    return original


def install(phase: str) -> dict[str, Any]:
    """Install every hook of ``phase`` in table order; returns {name: original} of those installed now."""
    if phase not in PHASES:
        raise ValueError(f"no hook phase {phase!r} (one of {', '.join(PHASES)})")
    done = {}
    for hook in HOOKS:
        if hook.phase == phase:
            original = install_hook(hook.name)
            if original is not None:
                done[hook.name] = original
    return done


def uninstall_hook(name: str) -> bool:
    """Undo ``install_hook(name)`` where it is the outermost replacement (tests; training never uninstalls)."""
    hook = BY_NAME[name]
    found = _owner(hook)
    if found is None:
        return False
    owner, attr = found
    now = getattr(owner, attr, None)
    if getattr(now, HOOK_ATTR, None) != name:
        return False
    original = getattr(now, WRAPPED_ATTR)
    if hook.everywhere:
        rebind(attr, now, original, only=hook.only)
    elif getattr(now, INHERITED_ATTR, False):
        delattr(owner, attr)
    else:
        setattr(owner, attr, original)
    return True


def uninstall(phase: str) -> None:
    for hook in reversed(HOOKS):
        if hook.phase == phase:
            uninstall_hook(hook.name)


__all__ = ["BY_NAME", "HOOKS", "PHASES", "Hook", "current", "hooks_in", "install", "install_hook", "is_installed",
           "uninstall", "uninstall_hook"]
