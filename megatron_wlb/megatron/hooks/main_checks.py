"""Megatron-LM main's (and dev's) own checks of the scheduler name, widened to let ``wlb`` through.

Main after PR #6742 (and dev) give ``--sequence-packing-scheduler`` fixed choices and refuse other names in
``ModelParallelConfig.__post_init__``; main's TransformerConfig requires TransformerEngine >= 2.9 for any
scheduler. ``widen_config_check`` installs the ``hooks.HOOKS`` entries of phase ``main_schedule`` that lift
those checks for ``wlb`` (``main_schedule.register()`` calls it); the factories are here.

Imports Megatron at the top: ``main_schedule.register()`` imports this module only where main's scheduler
registry exists (and the hooks table resolves its factories when it installs them).
"""

from __future__ import annotations

import dataclasses
import inspect
from typing import Any

from megatron.core.model_parallel_config import ModelParallelConfig
from megatron.core.transformer import transformer_config
from megatron.core.transformer.transformer_config import TransformerConfig
from megatron.core.utils import get_te_version, is_te_min_version

from megatron_wlb.megatron.args.flags import compose_providers
from megatron_wlb.megatron.args.megatron_args import MegatronArgs
from megatron_wlb.megatron.args.validation import module_available
from megatron_wlb.megatron.hooks import table as hooks
from megatron_wlb.megatron.hooks.attention import install_core_attention
from megatron_wlb.megatron.hooks.main_names import SCHEDULER_FLAG, SCHEDULER_NAME, TE_MIN_VERSION
from megatron_wlb.megatron.hooks.rebind import original_of, wrapping
from megatron_wlb.megatron.state.process import runtime


def widen_flag_choices(parser: Any) -> Any:
    """An ``extra_args_provider``: add ``wlb`` to the choices of ``--sequence-packing-scheduler`` where the
    parser has that flag with a fixed list (main after #6742: ``['dp_balanced']``; dev: its config's Literal)."""
    action = getattr(parser, "_option_string_actions", {}).get(SCHEDULER_FLAG)
    if action is not None and action.choices is not None and SCHEDULER_NAME not in action.choices:
        action.choices = [*action.choices, SCHEDULER_NAME]
    return parser


def te_problem() -> str:
    """Why main's sequence-packing path cannot run here ("" if it can): its TransformerConfig requires
    TransformerEngine >= ``TE_MIN_VERSION`` for any scheduler."""
    if not module_available("transformer_engine"):
        return "transformer_engine is not installed"
    try:
        return "" if is_te_min_version(TE_MIN_VERSION) else f"TransformerEngine {get_te_version()} is installed"
    except Exception as exc:  # noqa: BLE001 - a broken TE install is "not usable", said in one line
        return f"TransformerEngine does not import ({type(exc).__name__}: {exc})"


def prepare_main_path(args: Any) -> None:
    """After main's flags are parsed with ``--sequence-packing-scheduler wlb`` (main's own path, without
    ``apply()``, under which the flag is refused by ``args.bypass_problems``): with ``--transformer-impl local``
    our core attention serves the THD micro-batches main packs (Megatron's local attention has no THD path;
    ``attention.WlbCoreAttention``, CP 1), so TransformerConfig's TransformerEngine >= 2.9 requirement, which
    guards TE's THD attention, does not apply (``widen_config_check`` lifts it for that case only); with
    TransformerEngine's layers it stands, and without that TE the run exits in one line."""
    a = MegatronArgs.of(args)
    if a.sequence_packing_scheduler != SCHEDULER_NAME or runtime().installed:
        return
    if a.transformer_impl == "local":
        install_core_attention(True)
        return
    why = te_problem()
    if why:
        raise SystemExit(f"megatron_wlb: {SCHEDULER_FLAG} {SCHEDULER_NAME} runs Megatron's own sequence-packing path, "
                         f"whose TransformerConfig requires TransformerEngine >= {TE_MIN_VERSION}, but {why}; install "
                         f"TransformerEngine >= {TE_MIN_VERSION}, use --transformer-impl local (our attention serves "
                         "main's THD micro-batches at CP 1), or train through our data path: python -m "
                         "megatron_wlb.megatron.entry.launcher <Megatron flags> --wlb-packer wlb")


def _checks_the_scheduler(cls: Any) -> bool:
    """Whether ``cls`` defines its own ``__post_init__`` and that one reads ``sequence_packing_scheduler``."""
    post_init = cls.__dict__.get("__post_init__")
    if post_init is None:
        return False
    try:
        return "sequence_packing_scheduler" in inspect.getsource(original_of(post_init))
    except (OSError, TypeError):
        return False


def wrap_transformer_config_check(post_init: Any) -> Any:
    """``TransformerConfig.__post_init__`` where it checks the scheduler (main after #6742: TransformerEngine >=
    ``TE_MIN_VERSION`` for any scheduler; dev: also the name): for ``sequence_packing_scheduler="wlb"`` its checks
    run as for ``dp_balanced``, and with ``transformer_impl="local"`` the TE version query answers yes (only that
    query, only during that call: the one call-scoped swap of a Megatron attribute): no TE kernel runs there, our
    attention serves the THD batches (``prepare_main_path``). None where it does not check the scheduler."""
    module = transformer_config
    if not _checks_the_scheduler(module.TransformerConfig):
        return None

    @wrapping(post_init)
    def __post_init__(self: Any) -> None:
        if getattr(self, "sequence_packing_scheduler", None) != SCHEDULER_NAME:
            post_init(self)
            return
        original: Any = getattr(module, "is_te_min_version", None)
        local = getattr(self, "transformer_impl", None) == "local" and original is not None

        def is_te_min_version(version: str, *args: Any, **kwargs: Any) -> bool:
            return True if str(version) == TE_MIN_VERSION else bool(original(version, *args, **kwargs))

        self.sequence_packing_scheduler = "dp_balanced"
        if local:
            module.is_te_min_version = is_te_min_version
        try:
            post_init(self)
        finally:
            self.sequence_packing_scheduler = SCHEDULER_NAME
            if local:
                module.is_te_min_version = original

    return __post_init__


def wrap_model_parallel_config_check(post_init: Any) -> Any:
    """``ModelParallelConfig.__post_init__`` (main after #6742 and dev refuse any other name than theirs): its checks
    run as for ``dp_balanced``, whose window and variable-length p2p ours share."""

    @wrapping(post_init)
    def __post_init__(self: Any) -> None:
        if getattr(self, "sequence_packing_scheduler", None) != SCHEDULER_NAME:
            post_init(self)
            return
        self.sequence_packing_scheduler = "dp_balanced"
        try:
            post_init(self)
        finally:
            self.sequence_packing_scheduler = SCHEDULER_NAME

    return __post_init__


def widen_parse_args(parse_args: Any) -> Any:
    """``megatron.training.arguments.parse_args`` with ``widen_flag_choices`` composed into its provider, then
    ``prepare_main_path``."""
    @wrapping(parse_args)
    def widened_parse_args(extra_args_provider: Any = None, ignore_unknown_args: bool = False) -> Any:
        args = parse_args(compose_providers(extra_args_provider, widen_flag_choices), ignore_unknown_args)
        prepare_main_path(args)
        return args

    return widened_parse_args


def widen_config_check() -> list[str]:
    """Let ``sequence_packing_scheduler = "wlb"`` through Megatron's own checks (idempotent): the flag's choices
    (``widen_flag_choices`` composed into ``megatron.training.arguments.parse_args``, with ``prepare_main_path``)
    and ``ModelParallelConfig.__post_init__`` / ``TransformerConfig.__post_init__`` (``hooks.HOOKS``). Returns what
    it widened (nothing where this Megatron's config has no ``sequence_packing_scheduler``)."""
    widened = []
    fields = {f.name for f in dataclasses.fields(ModelParallelConfig)}
    if "sequence_packing_scheduler" in fields and ModelParallelConfig.__dict__.get("__post_init__") is not None:
        hooks.install_hook("ModelParallelConfig.__post_init__")
        widened.append("ModelParallelConfig check")
    if _checks_the_scheduler(TransformerConfig):
        hooks.install_hook("TransformerConfig.__post_init__")
        widened.append("TransformerConfig check")
    if "sequence_packing_scheduler" in fields and hooks.current("parse_args (scheduler choices)") is not None:
        hooks.install_hook("parse_args (scheduler choices)")
        widened.append(f"{SCHEDULER_FLAG} choices")
    return widened
