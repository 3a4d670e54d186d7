"""Every Megatron function megatron_wlb replaces at run time, in one table, and the one installer.

``HOOKS`` lists each replacement: where it lives (module + attribute; ``Class.attr`` for a class attribute),
the releases it is installed on (``RELEASES``), those whose Megatron must have it (``required``), why (one line),
when it is installed (``phase``) and its factory: ``"module:function"`` of the module that owns the replacement,
imported only when the hook is installed, called with Megatron's original (and the phase's ``options`` for it);
it may return None (nothing to replace on this machine). ``install_hook`` is the only code that assigns onto a
Megatron module or class; every replacement it installs carries ``__wlb_hook__`` (its table name) and
``__wlb_original__`` (what it replaced), so an installed hook is found again (idempotence) and undone
(``uninstall_hook``). A hook required on the running release whose target Megatron lacks (a renamed function)
stops the installation in one line (``MissingHookTarget``), before anything of that phase is installed.
``tests/test_megatron_hooks.py`` checks, on each release, that the installed hooks are the table's and that every
attribute of Megatron's modules and classes that changed is one of them. (The one other write: the
``TransformerConfig.__post_init__`` replacement answers main's TransformerEngine version query for the duration of
that one call, restoring it after.)

Phases: ``main_schedule`` (``main_schedule.register()``, first in ``apply()``), ``apply``, then at
``validate_args`` time ``cp``, ``attention`` (unless TransformerEngine's attention is kept), ``pipeline``
(pipeline parallelism only) and ``timing``; ``cpu`` is the CPU harness's (``cpu_redirects.install_megatron_redirects``).

Importing this module needs neither torch nor Megatron.
"""

from __future__ import annotations

import importlib
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import Any

from megatron_wlb.megatron.args.validation import Refusal
from megatron_wlb.megatron.args.version import SUPPORTED_SERIES, installed_core_version
from megatron_wlb.megatron.hooks.rebind import WRAPPED_ATTR, rebind

#: attribute of an installed replacement naming its ``HOOKS`` entry
HOOK_ATTR = "__wlb_hook__"
#: attribute of an installed class-attribute replacement whose original was inherited (uninstall deletes it)
INHERITED_ATTR = "__wlb_inherited__"
#: the Megatron-LM release of each megatron-core series CI trains (``version.SUPPORTED_SERIES``): the core_v0.16.1
#: checkout, the 0.19 wheel and core_v0.19.0 checkout, and main (0.20) at ``version.MAIN_COMMIT``
SERIES_RELEASES = {(0, 16): "0.16", (0, 19): "0.19", (0, 20): "main"}
#: every release the table knows: those, and the moving branches CI also runs (``version.MOVING_CHECKOUTS``), which
#: are checked at run time as the release their version names (main after #6742: main; dev, 0.19.0: 0.19)
RELEASES = frozenset({*SERIES_RELEASES.values(), "main-6742", "dev"})
#: installed on every release, and required on every series
EVERY = RELEASES
SERIES = frozenset(SERIES_RELEASES.values())


class MissingHookTarget(Refusal, RuntimeError):
    """A hook required on this release found nothing to replace (Megatron renamed or removed it): the entry points
    exit with its one line."""


@dataclass(frozen=True)
class Hook:
    """One Megatron function (or class attribute) that megatron_wlb replaces."""

    name: str
    module: str
    attr: str
    #: the releases it is installed on (``RELEASES``)
    releases: frozenset[str]
    why: str
    phase: str
    #: the factory: ``"module:function"`` of the module that owns the replacement
    make: str
    #: the releases whose Megatron must have the target (of ``SERIES``): installing there without it raises; the
    #: hook is installed wherever else its target is found (a feature only some commits have)
    required: frozenset[str] = SERIES
    #: True: point every loaded module that holds the original at the replacement (``from x import f`` copies);
    #: False: replace the attribute on its owner only
    everywhere: bool = True
    #: with ``everywhere``: only these modules (empty: all)
    only: tuple[str, ...] = ()

    def __post_init__(self) -> None:
        if not self.releases <= RELEASES or not self.required <= self.releases & SERIES:
            raise ValueError(f"hook {self.name!r}: releases {sorted(self.releases)} and required "
                             f"{sorted(self.required)} must be known releases ({', '.join(sorted(RELEASES))}), "
                             "required ones among its series releases")


def _training(name: str, module: str, why: str, make: str, releases: frozenset[str] = EVERY,
              required: frozenset[str] = SERIES) -> Hook:
    return Hook(name, f"megatron.training.{module}", name, releases, why, "apply", make, required)


def _timing(name: str, why: str) -> Hook:
    return Hook(name, "megatron.core.pipeline_parallel.schedules", name, EVERY, why, "timing",
                "megatron_wlb.megatron.state.timing:wrap_pass")


#: the pipeline communicator's methods whose time is waiting (every send/receive, on every release)
P2P_METHODS = ("recv_forward", "recv_backward", "send_forward", "send_backward", "send_forward_recv_backward",
               "send_backward_recv_forward", "send_forward_recv_forward", "send_backward_recv_backward",
               "send_forward_backward_recv_forward_backward")
P2P_MODULE = "megatron.core.pipeline_parallel.p2p_communication"
ATTENTION_MODULE = "megatron.core.transformer.attention"
ROTARY_MODULE = "megatron.core.models.common.embeddings.rotary_pos_embedding"

#: where Megatron checks the scheduler's name (main after #6742, dev): installed where the check is found
CHECKS_THE_NAME = frozenset({"main-6742", "dev"})
#: core 0.16's batch functions, kept on dev (gone from core 0.18 on)
TP_RANK_BATCH = frozenset({"0.16", "dev"})
CORE_016 = frozenset({"0.16"})
NONE: frozenset[str] = frozenset()

HOOKS: tuple[Hook, ...] = (
    # -- main's own sequence-packing scheduler registry (main_schedule.register: installed where main's code asks)
    Hook("ModelParallelConfig.__post_init__", "megatron.core.model_parallel_config",
         "ModelParallelConfig.__post_init__", CHECKS_THE_NAME,
         "lets sequence_packing_scheduler='wlb' through the name check",
         "main_schedule", "megatron_wlb.megatron.hooks.main_checks:wrap_model_parallel_config_check", NONE,
         everywhere=False),
    Hook("TransformerConfig.__post_init__", "megatron.core.transformer.transformer_config",
         "TransformerConfig.__post_init__", CHECKS_THE_NAME,
         "'wlb' checked as dp_balanced; with local layers the TE >= 2.9 requirement does not apply",
         "main_schedule", "megatron_wlb.megatron.hooks.main_checks:wrap_transformer_config_check", NONE,
         everywhere=False),
    Hook("parse_args (scheduler choices)", "megatron.training.arguments", "parse_args", CHECKS_THE_NAME,
         "'wlb' among --sequence-packing-scheduler's choices; our attention for local layers",
         "main_schedule", "megatron_wlb.megatron.hooks.main_checks:widen_parse_args", NONE),
    Hook("PackingSchedulerEnum", "megatron.core.datasets.data_schedule", "PackingSchedulerEnum",
         frozenset({"main", "main-6742"}), "main's enum plus WLB (an Enum gains no members otherwise); scheduler_map "
         "keyed by both", "main_schedule",
         "megatron_wlb.megatron.hooks.main_schedule:enum_with_wlb", NONE, everywhere=False),
    # -- apply(): the start-up builds made safe where the machine lacks the toolchain, then the training loop
    Hook("compile_helpers", "megatron.core.datasets.utils", "compile_helpers", EVERY,
         "the dataset-helper make is skipped, saying so, where there is no toolchain (our iterators need no helpers)",
         "apply", "megatron_wlb.megatron.hooks.startup:guarded_compile_helpers", everywhere=False),
    Hook("fused_kernels.load", "megatron.legacy.fused_kernels", "load", CORE_016,
         "it only runs nvcc -V (builds nothing): skipped where nvcc cannot run, and by the CPU harness",
         "apply", "megatron_wlb.megatron.hooks.startup:guarded_fused_kernels_load", CORE_016, everywhere=False),
    _training("parse_args", "arguments", "our --wlb-* flags composed into whichever extra_args_provider is passed",
              "megatron_wlb.megatron.hooks.training_hooks:wrap_parse_args"),
    _training("validate_args", "arguments", "our checks after Megatron's, then the validate-time hooks below",
              "megatron_wlb.megatron.hooks.training_hooks:wrap_validate_args"),
    _training("build_train_valid_test_data_iterators", "training",
              "every rank's training (and evaluation) iterator becomes a WlbDataIterator",
              "megatron_wlb.megatron.hooks.training_hooks:wrap_build_train_valid_test_data_iterators"),
    _training("save_checkpoint", "checkpointing", "the packer and stream state sidecar is saved",
              "megatron_wlb.megatron.state.checkpoint:wrap_save_checkpoint"),
    _training("load_checkpoint", "checkpointing", "the sidecar is read back (and the data stream resumed)",
              "megatron_wlb.megatron.state.checkpoint:wrap_load_checkpoint"),
    _training("train_step", "training", "the plan agreement over the world before every step",
              "megatron_wlb.megatron.state.agreement:wrap_train_step"),
    _training("training_log", "training", "the per-iteration packing metrics",
              "megatron_wlb.megatron.state.wlb_logging:wrap_training_log"),
    _training("get_batch_on_this_tp_rank", "utils",
              "every rank reads its own micro-batch (no fixed-shape TP broadcast)",
              "megatron_wlb.megatron.hooks.training_hooks:wrap_get_batch_on_this_tp_rank", TP_RANK_BATCH, CORE_016),
    # -- validate_args: the CP data path and attention
    Hook("get_thd_batch_on_this_cp_rank", "megatron.core.utils", "get_thd_batch_on_this_cp_rank", TP_RANK_BATCH,
         "the cu_seqlens our TP-rank hook uploaded give back their record's params", "cp",
         "megatron_wlb.megatron.hooks.cp_hooks:wrap_get_thd_batch_on_this_cp_rank", CORE_016),
    Hook("SelfAttention.__init__", ATTENTION_MODULE, "SelfAttention.__init__", EVERY,
         "every SelfAttention built afterwards uses WlbCoreAttention", "attention",
         "megatron_wlb.megatron.hooks.attention:wrap_self_attention_init", everywhere=False),
    Hook("Attention.forward", ATTENTION_MODULE, "Attention.forward", EVERY,
         "the attention holds its packed-sequence params for the call, where RoPE reads the micro-batch's record",
         "attention", "megatron_wlb.megatron.hooks.rope:wrap_attention_forward", everywhere=False),
    Hook("apply_rotary_pos_emb", ATTENTION_MODULE, "apply_rotary_pos_emb", EVERY,
         "RoPE rotates by the plan's positions (documents restart at 0)", "attention",
         "megatron_wlb.megatron.hooks.rope:wlb_apply_rotary_pos_emb", everywhere=False),
    Hook("RotaryEmbedding.get_rotary_seq_len", ROTARY_MODULE, "RotaryEmbedding.get_rotary_seq_len", EVERY,
         "the rotary table covers the plan's largest position (the params' max_seqlen_* are the kernel's)",
         "attention", "megatron_wlb.megatron.hooks.rope:wrap_get_rotary_seq_len", everywhere=False),
    Hook("P2PCommunicator._communicate_shapes", P2P_MODULE, "P2PCommunicator._communicate_shapes", EVERY,
         "shapes exchanged in the activations' rank order (Megatron #5100 deadlock)", "pipeline",
         "megatron_wlb.megatron.hooks.p2p:ordered_communicate_shapes", everywhere=False),
    # -- validate_args: step timing (timing.py; pass through until a recorder is active)
    Hook("forward_step", "megatron.core.pipeline_parallel.schedules", "forward_step", EVERY,
         "each micro-batch's forward timed", "timing", "megatron_wlb.megatron.state.timing:wrap_forward_step"),
    Hook("backward_step", "megatron.core.pipeline_parallel.schedules", "backward_step", EVERY,
         "each micro-batch's backward timed", "timing", "megatron_wlb.megatron.state.timing:wrap_backward_step"),
    _timing("forward_backward_no_pipelining", "one timed pass per training step (PP 1)"),
    _timing("forward_backward_pipelining_with_interleaving", "one timed pass per training step (virtual stages)"),
    _timing("forward_backward_pipelining_without_interleaving", "one timed pass per training step (PP > 1)"),
    *(Hook(f"P2PCommunicator.{name}", P2P_MODULE, f"P2PCommunicator.{name}", EVERY,
           "pipeline waiting timed", "timing", "megatron_wlb.megatron.state.timing:wrap_p2p", everywhere=False)
      for name in P2P_METHODS),
    Hook("finalize_model_grads", "megatron.core.distributed.finalize_model_grads", "finalize_model_grads", EVERY,
         "the data-parallel gradient wait timed", "timing",
         "megatron_wlb.megatron.state.timing:wrap_finalize_model_grads"),
    # -- the CPU harness (cpu.py: Megatron's loop on gloo; each is in cpu_redirects.REDIRECTS)
    Hook("_set_cuda_rng_state", "megatron.core.tensor_parallel.random", "_set_cuda_rng_state", EVERY,
         "the CPU generator stands in for the CUDA one", "cpu",
         "megatron_wlb.megatron.entry.cpu_redirects:set_rng_state",
         everywhere=False),
    Hook("_get_cuda_rng_state", "megatron.core.tensor_parallel.random", "_get_cuda_rng_state", EVERY,
         "activation recomputation saves and restores the CPU generator", "cpu",
         "megatron_wlb.megatron.entry.cpu_redirects:get_rng_state", everywhere=False),
    Hook("_warmup_jit_function", "megatron.training.initialize", "_warmup_jit_function", EVERY,
         "the JIT warm-up leaves the CPU generator (the weights' initializer) as it was", "cpu",
         "megatron_wlb.megatron.entry.cpu_redirects:warmup_keeping_the_cpu_generator", everywhere=False),
    Hook("initialize_megatron", "megatron.training.initialize", "initialize_megatron", EVERY,
         "allow_no_cuda=True (pretrain() does not ask)", "cpu",
         "megatron_wlb.megatron.entry.cpu_redirects:initialize_without_cuda",
         only=("megatron.training.initialize", "megatron.training.training")),
    Hook("WrappedTorchNorm.__new__", "megatron.core.transformer.torch_norm", "WrappedTorchNorm.__new__", EVERY,
         "the torch norm under --sequence-parallel, its weights marked sequence_parallel as apex's", "cpu",
         "megatron_wlb.megatron.entry.cpu_redirects:sequence_parallel_torch_norm", everywhere=False),
)

BY_NAME: dict[str, Hook] = {hook.name: hook for hook in HOOKS}
PHASES = ("main_schedule", "apply", "cp", "attention", "pipeline", "timing", "cpu")
assert len(BY_NAME) == len(HOOKS) and {h.phase for h in HOOKS} <= set(PHASES)


def _owner(hook: Hook) -> tuple[Any, str] | None:
    """(the module or class holding the hooked attribute, the attribute's name); None where this Megatron has
    no such module or class."""
    found = _find(hook)
    return found if isinstance(found, tuple) else None


def _find(hook: Hook) -> tuple[Any, str] | str:
    """``_owner``, or what this Megatron lacks of the hook's target (e.g. ``module megatron.x (No module named
    'megatron.x')``, ``megatron.x.Class``)."""
    try:
        owner: Any = importlib.import_module(hook.module)
    except ImportError as exc:
        return f"module {hook.module} ({exc})"
    *path, attr = hook.attr.split(".")
    where = hook.module
    for part in path:
        where = f"{where}.{part}"
        owner = getattr(owner, part, None)
        if owner is None:
            return where
    return owner, attr


def _factory(hook: Hook) -> Callable[..., Any]:
    module, function = hook.make.split(":")
    return getattr(importlib.import_module(module), function)


def release(version: str | None = None) -> str | None:
    """The ``SERIES_RELEASES`` name of megatron-core ``version`` (default: the one Python imports); None for a
    series CI does not train (``apply(check_version=False)``: nothing is required there)."""
    parts = (installed_core_version() if version is None else version).split(".")
    try:
        return SERIES_RELEASES.get((int(parts[0]), int(parts[1])))
    except (IndexError, ValueError):
        return None


def missing_target(name: str, on: str | None = None) -> str:
    """The one-line refusal when hook ``name`` is required on release ``on`` (default: this one) and this Megatron
    has nothing to replace; "" when it has, or the hook is not required there."""
    hook = BY_NAME[name]
    on = release() if on is None else on
    if on not in hook.required:
        return ""
    found = _find(hook)
    if isinstance(found, tuple) and getattr(found[0], found[1], None) is not None:
        return ""
    lacking = found if isinstance(found, str) else f"{hook.module}.{hook.attr}"
    series = next(key for key, value in SERIES_RELEASES.items() if value == on)
    return (f"megatron_wlb: hook {name!r} ({hook.why}) is required on Megatron-LM {on}, but this megatron-core "
            f"{installed_core_version()} has no {lacking} (renamed or removed): start-up stops rather than train "
            f"without it; {on} is supported as {SUPPORTED_SERIES[series]}")


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
    go to the factory. Raises ``MissingHookTarget`` where the hook is required on this release and its target
    is missing."""
    refusal = missing_target(name)
    if refusal:
        raise MissingHookTarget(refusal)
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


def install(phase: str, options: Mapping[str, Mapping[str, Any]] | None = None) -> dict[str, Any]:
    """Install every hook of ``phase`` in table order, ``options[name]`` going to hook ``name``'s factory; returns
    {name: original} of those installed now. Raises ``MissingHookTarget`` (nothing of the phase installed) where
    a hook required on this release finds no target."""
    if phase not in PHASES:
        raise ValueError(f"no hook phase {phase!r} (one of {', '.join(PHASES)})")
    names = [hook.name for hook in HOOKS if hook.phase == phase]
    unknown = sorted(set(options or {}) - set(names))
    if unknown:
        raise ValueError(f"options for {', '.join(unknown)}, which phase {phase!r} does not install "
                         f"(it installs {', '.join(names)})")
    this_release = release()
    for name in names:
        refusal = missing_target(name, this_release)
        if refusal:
            raise MissingHookTarget(refusal)
    done = {}
    for name in names:
        original = install_hook(name, **(options or {}).get(name, {}))
        if original is not None:
            done[name] = original
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


__all__ = ["BY_NAME", "HOOKS", "PHASES", "RELEASES", "SERIES_RELEASES", "Hook", "MissingHookTarget", "current",
           "hooks_in", "install", "install_hook", "is_installed", "missing_target", "release", "uninstall",
           "uninstall_hook"]
