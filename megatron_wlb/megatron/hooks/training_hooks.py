"""The replacements of Megatron's training-loop functions (``hooks.HOOKS``, phase ``apply``) that belong to no other
module: each ``wrap_<name>`` builds the replacement of Megatron's ``<name>`` from the original; and what the phase's
factories owned elsewhere (checkpoint, agreement, logging) take from this process (``apply_phase_options``).

Imports torch and Megatron: ``apply()`` imports this module once Megatron's training code is known to import."""

from __future__ import annotations

import functools
import importlib
import sys
import time
from collections.abc import Callable
from typing import Any

import torch.distributed as dist
from megatron.core import parallel_state
from megatron.core.rerun_state_machine import RerunDataIterator

from megatron_wlb.cp.dynamic import DYNAMIC_SHARDING
from megatron_wlb.megatron.args.flags import asks_for_help, wlb_extra_args_provider, wlb_help
from megatron_wlb.megatron.args.megatron_args import MegatronArgs
from megatron_wlb.megatron.args.preflight import check_training_args
from megatron_wlb.megatron.args.settings import WlbSettings
from megatron_wlb.megatron.args.validation import (
    Refusal,
    StartupError,
    cost_model_from_args,
    refuse_bypassing_flags,
    rejected_by_megatron,
    validate_wlb_args,
)
from megatron_wlb.megatron.args.version import (
    TRAINING_MODULES,
    import_training_modules,
    installed_core_version,
    training_import_error,
)
from megatron_wlb.megatron.data.device import training_device
from megatron_wlb.megatron.data.iterators import (
    iterations_for,
    iterator_packing_config,
    pinned_tp_rank_batch,
    split_is_empty,
    the_train_iterator_builder,
)
from megatron_wlb.megatron.data.packed import WlbDataIterator
from megatron_wlb.megatron.data.prefetch import PrefetchingIterator, unwrap
from megatron_wlb.megatron.hooks import cp_hooks, p2p
from megatron_wlb.megatron.hooks.cp_hooks import stage_upload
from megatron_wlb.megatron.hooks.rebind import wrapping
from megatron_wlb.megatron.state import timing
from megatron_wlb.megatron.state.agreement import (
    check_startup_agreement,
    dataset_parts,
    resume_data_refusal,
    run_fingerprint,
)
from megatron_wlb.megatron.state.process import first_train_iterator, is_rank0, print_rank0, runtime
from megatron_wlb.megatron.state.recording import measure, start_recorder
from megatron_wlb.megatron.state.wlb_logging import WlbMetricsLogger


def ranks() -> tuple[int, int]:
    """(data-parallel rank, context-parallel rank) of this process."""
    return parallel_state.get_data_parallel_rank(), parallel_state.get_context_parallel_rank()


def eval_iterator(args: Any, settings: WlbSettings, split_name: str, megatron_iterator: Callable[[], Any],
                  print_rank_0: Callable[[str], Any]) -> Any:
    """Our packed iterator over the valid/test split (every rank, like training); None when evaluation is
    off or the split is empty; Megatron's own one (``megatron_iterator()`` builds it) for several
    validation sets or a split too small to pack without pipeline parallelism."""
    a = MegatronArgs.of(args)
    if a.multiple_validation_sets or a.full_validation:
        return megatron_iterator()
    if iterations_for(a, split_name) < 1 or split_is_empty(a, split_name):
        return None  # evaluation off, or e.g. --split 98,2,0 has no test split: Megatron builds none either
    try:
        it = the_train_iterator_builder()(args, settings, *ranks(), split_name=split_name)
    except ValueError as exc:  # e.g. a split too small to hold one document
        if isinstance(exc, Refusal):  # data this run cannot train (a token id beyond the vocabulary): one line
            raise
        if a.pp > 1:
            raise ValueError(f"megatron_wlb: no {split_name} iterator ({exc}); with pipeline parallelism every "
                             "stage needs packed evaluation batches: give the split documents or set "
                             "--eval-iters 0") from exc
        print_rank_0(f"> megatron_wlb: {split_name} keeps Megatron's loader ({exc})")
        return megatron_iterator()
    return RerunDataIterator(it)


def prefetching(iterator: WlbDataIterator) -> Any:
    """The training iterator with its next micro-batch built (and, on CUDA, uploaded) on a thread
    (``prefetch.py``): the same micro-batches in the same order, off the step's critical path."""
    device = training_device()
    return PrefetchingIterator(iterator, stage=functools.partial(stage_upload, device=device)
                               if device.type == "cuda" else None)


def wrap_parse_args(original: Callable) -> Callable:
    @wrapping(original)
    def parse_args(extra_args_provider=None, ignore_unknown_args=False):
        if asks_for_help(sys.argv[1:]):  # ours only: Megatron's --help crashes on 0.19.2 (upstream)
            print(wlb_help(sys.argv[0]), end="")
            raise SystemExit(0)
        args = original(wlb_extra_args_provider(extra_args_provider), ignore_unknown_args)
        if MegatronArgs.of(args).yaml_cfg is not None:
            # Megatron's YAML path replaces the parsed args and skips validate_args (and our checks)
            raise StartupError("megatron_wlb: --yaml-cfg is not supported with WLB-LLM (Megatron's YAML path skips "
                               "validate_args, where the --wlb-* flags are checked); pass the settings as flags")
        return args

    return parse_args


def wrap_validate_args(original: Callable) -> Callable:
    @wrapping(original)
    def validate_args(args, defaults={}):  # noqa: B006 - Megatron's signature
        refuse_bypassing_flags(args)  # before Megatron's own checks of those flags, which name no equivalent
        try:
            out = original(args, defaults)
        except StartupError:
            raise
        except (AssertionError, ValueError) as exc:  # Megatron's own flag checks: one line, no traceback
            raise rejected_by_megatron(exc) from None
        lacking = MegatronArgs.missing_fields(args)
        if lacking:  # a flag this release dropped or renamed: stop, never read None in its place
            raise StartupError(f"megatron_wlb: Megatron's args lack {', '.join(lacking)} (megatron-core "
                               f"{installed_core_version()}): this release dropped or renamed them; megatron_wlb "
                               "reads them (megatron_args.MegatronArgs), so it cannot run on it")
        settings = validate_wlb_args(args)
        for note in check_training_args(args, middle_stage_batches=runtime().middle_stage_batches):
            if is_rank0():
                print(f"> megatron_wlb: {note}", flush=True)
        runtime().settings = settings
        install_validated_hooks(settings, pipeline=MegatronArgs.of(args).pp > 1)
        return out

    return validate_args


def install_validated_hooks(settings: WlbSettings, *, pipeline: bool) -> None:
    """The hooks that need the validated settings (``hooks.HOOKS`` phases cp, attention, pipeline, timing)."""
    if pipeline:
        p2p.install()  # shapes exchanged in the activations' rank order (Megatron #5100)
    cp_hooks.install(settings)
    timing.install()  # before the model config copies finalize_model_grads


def wrap_build_train_valid_test_data_iterators(original: Callable, mods: dict[str, Any] | None = None) -> Callable:
    mods = import_training_modules() if mods is None else mods

    @wrapping(original)
    def build_train_valid_test_data_iterators(build_train_valid_test_datasets_provider):
        args = mods["global_vars"].get_args()
        a = MegatronArgs.of(args)
        built: list[Any] = []
        rt = runtime()

        def megatron_iterators() -> tuple[Any, Any, Any]:
            """Megatron's own (train, valid, test), built on first need: only a split we do not pack
            (several validation sets, or an evaluation split too small to pack) needs them; every
            rank decides alike, so Megatron's collectives inside stay matched."""
            if not built:
                built.append(original(build_train_valid_test_datasets_provider))
                rt.megatron_loaders = True
            return built[0]

        if a.skip_train or rt.settings is None:
            return megatron_iterators()
        settings = rt.settings
        if rt.logger is None:
            gv = mods["global_vars"]
            rt.logger = WlbMetricsLogger(cost_model_from_args(args, settings), int(a.seq_length),
                                         settings.log_interval, print_fn=mods["utils"].print_rank_0,
                                         tb_writer=gv.get_tensorboard_writer, wandb_writer=gv.get_wandb_writer,
                                         stages=a.pp, virtual_stages=a.vpp)
        first = not rt.registry.iterators
        if first:  # before any dataset is built: a rank with another --seed must be named, not fail in megatron-core
            agree_at_startup(args, settings, iterator_packing_config(args, settings), rt.logger.cost)
            if settings.cp_sharding == DYNAMIC_SHARDING:  # every block's process group, once, on every rank
                cp_hooks.make_dynamic_groups(*ranks(), a.cp)
        iterator = prefetching(the_train_iterator_builder()(args, settings, *ranks(),
                                                            on_batch=rt.logger.on_batch if first else None))
        rt.registry.register(iterator)
        if first:
            start_recorder(a, settings, iterator.n, rt.logger.cost)
        mods["utils"].print_rank_0(f"> megatron_wlb: {settings.packer} packing of a document stream of about "
                                   f"{iterator.stream.requested_tokens} tokens, {iterator.n} micro-batches per DP rank "
                                   f"per iteration, CP sharding {settings.cp_sharding}")
        evals = [eval_iterator(args, settings, split_name, functools.partial(lambda i: megatron_iterators()[i], index),
                               mods["utils"].print_rank_0) for index, split_name in ((1, "valid"), (2, "test"))]
        # Megatron decides whether to train / evaluate from its own loaders, which our launcher does not
        # build (its datasets provider returns none): our iterators exist on every rank.
        now = MegatronArgs.of(args)  # after Megatron's own loaders, if built, set do_valid / do_test
        args.do_train = True
        args.do_valid = bool(now.do_valid) or evals[0] is not None
        args.do_test = bool(now.do_test) or evals[1] is not None
        return RerunDataIterator(iterator), evals[0], evals[1]

    return build_train_valid_test_data_iterators


def agree_at_startup(args: Any, settings: WlbSettings, config: Any, cost: Any) -> None:
    """Before any dataset is built: every rank must start with the same settings, packing ``config``, ``cost``
    model and datasets (``agreement.check_startup_agreement``, one all-reduce over the world), and, resuming,
    with the datasets the checkpoint trained on (its sidecar's fingerprint). Both stop every rank in one line
    naming what differs."""
    start = time.perf_counter()
    a = MegatronArgs.of(args)
    fingerprint = run_fingerprint(a, settings, config, cost, dataset_parts(a))
    registry = runtime().registry
    registry.fingerprint = fingerprint.datasets()
    if dist.is_initialized() and dist.get_world_size() > 1:
        try:
            check_startup_agreement(fingerprint)
        except RuntimeError as exc:
            raise StartupError(str(exc)) from None
    refusal = resume_data_refusal(registry.saved_fingerprint, fingerprint, registry.pending_iteration or 0)
    if refusal:
        raise StartupError(refusal)
    runtime().startup_agreement_s = time.perf_counter() - start


def _settings_dict() -> dict | None:
    settings = runtime().settings
    return settings.to_dict() if settings is not None else None


def _get_args() -> Any:
    return importlib.import_module("megatron.training.global_vars").get_args()


def apply_phase_options() -> dict[str, dict[str, Any]]:
    """What the ``apply``-phase factories owned by other modules take from this process (``hooks.install``'s
    options): the checkpoint sidecar's registry and Megatron's args, the plan agreement's iterator, the logger."""
    rt = runtime()
    return {"save_checkpoint": {"registry": rt.registry, "get_args": _get_args, "is_writer": is_rank0,
                                "settings": _settings_dict, "log": print_rank0},
            "load_checkpoint": {"registry": rt.registry, "get_args": _get_args, "settings": _settings_dict,
                                "log": print_rank0},
            "train_step": {"first_iterator": first_train_iterator, "on_checked": rt.agreed},
            "training_log": {"logger_of": lambda: runtime().logger, "measure": measure}}


def wrap_get_batch_on_this_tp_rank(original: Callable) -> Callable:
    @wrapping(original)
    def get_batch_on_this_tp_rank(data_iterator, mtp_on_this_rank: bool = False, *args, **kwargs):
        if not isinstance(unwrap(data_iterator), WlbDataIterator):
            return original(data_iterator, mtp_on_this_rank, *args, **kwargs)
        return pinned_tp_rank_batch(next(data_iterator))

    return get_batch_on_this_tp_rank


__all__ = ["TRAINING_MODULES", "agree_at_startup", "apply_phase_options", "import_training_modules",
           "install_validated_hooks", "training_import_error"]
