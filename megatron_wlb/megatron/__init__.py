"""The Megatron-LM adapter: ``apply()`` hooks WLB-LLM into a Megatron-LM training process.

One micro-batch, from the length stream to the kernel: one host record, one copy, one device record::

    packer.pack() -> GlobalBatch     the iteration's MicroBatch pieces (packing/, every rank alike)
    WlbDataIterator._take            this DP rank's share, each micro-batch laid out over the CP group:
                                        ShardLayout (cp/plan.py layout_micro_batch), agreed before the step
    WlbDataIterator.__next__         -> RankMicroBatch (cp/plan.py rank_batch): this rank's rows, tokens,
                                        labels, loss mask, positions and attention metadata, numpy
    upload_micro_batch (cp_hooks.py) -> DeviceBatch (cp/device.py upload): one pinned buffer, one copy
                                        (prefetch.py: on a side stream, a micro-batch ahead): the batch
                                        tensors, and apart from them the kernel's Varlen record, carried
                                        in WlbPackedSeqParams.varlen
    every layer                      WlbCoreAttention (attention.py -> cp/attention.py) reads the params'
                                        Varlen, RoPE the same record through the params its attention
                                        holds (rope.attention_scope); per-document-te: TE's THD fields

No step reads a device tensor back to the host; the only sync is the agreement before every training
step (``agreement.py``: one all-reduce of ``2 + 2 * DP`` int64 over the world: the plan, and each CP
group's layouts of the iteration). At start-up the ranks also agree on their settings, cost model and
datasets (``agreement.check_startup_agreement``; the datasets also against a resumed checkpoint's).

Call ``megatron_wlb.megatron.apply()`` in ``pretrain_gpt.py`` before ``pretrain(...)`` (the patch in
``patches/`` does this), then launch with ``--wlb-*`` flags. ``apply()`` checks the megatron-core version and
installs the Megatron functions we replace: ``hooks.table.HOOKS`` is their one list (where each lives, the releases it
applies to, why, when it is installed and the function that builds it); a hook a release requires that finds
nothing to replace stops start-up in one line.

This module holds the public API only. The rest lives in five sub-packages, by concern (each one's docstring says
what it owns; lowest first, a sub-package imports only those below it, tests/test_import_layers.py): ``args``
(Megatron's args: the typed view, our flags and settings, validation, version checks), ``data`` (the data path:
iterators, GPTDataset and SFT intake, prefetch), ``state`` (the run's state: ``Runtime``, checkpoint sidecar,
agreement, step timing, online refit, metrics), ``hooks`` (the table of the Megatron functions we replace and the
replacements) and ``entry`` (the ways in: launcher, CPU harness). Importing this package needs neither torch nor
Megatron; ``apply()`` imports them.
"""

from __future__ import annotations

from megatron_wlb.megatron.args.compat import install_python_shims, refuse_spawned_reimport
from megatron_wlb.megatron.args.settings import WlbSettings
from megatron_wlb.megatron.args.version import check_core_version, import_training_modules, training_import_error
from megatron_wlb.megatron.data.iterators import (
    build_train_iterator,
    cp_sharding_from_args,
    iterations_for,
    pinned_tp_rank_batch,
    pretrain_gpt_batch,
    reader_from_args,
    stream_tokens_for,
)
from megatron_wlb.megatron.hooks import table as hook_table
from megatron_wlb.megatron.hooks.main_schedule import register as register_main_scheduler
from megatron_wlb.megatron.state.checkpoint import DataStateRegistry
from megatron_wlb.megatron.state.process import Runtime, runtime

__all__ = ["ENTRY_POINT_REFUSAL", "Runtime", "WlbSettings", "apply", "build_train_iterator", "cp_sharding_from_args",
           "iterations_for", "pinned_tp_rank_batch", "pretrain_gpt_batch", "reader_from_args", "runtime",
           "stream_tokens_for", "training_import_error"]

#: why apply() alone cannot serve a core >= 0.18 script's get_batch, and the ways in
ENTRY_POINT_REFUSAL = (
    "megatron_wlb.megatron.apply(): from megatron-core 0.18 on, pretrain_gpt.py's get_batch reads the data "
    "iterator on TP rank 0 only, skips middle pipeline stages and rebuilds PackedSeqParams from cu_seqlens, so "
    "WLB-LLM's packed micro-batches cannot pass through it with apply() alone (its first step would fail). Ways "
    "in: a core_v0.19.0 checkout patched with scripts/apply_patches.sh (its own pretrain_gpt.py, builders and "
    "loss), or python -m megatron_wlb.megatron.entry.launcher; a get_batch of your own that reads the iterator on "
    "every rank (megatron_wlb.megatron.entry.launcher.get_batch) says so with apply(middle_stage_batches=True)")


def apply(*, check_version: bool = True, middle_stage_batches: bool = False) -> Runtime:
    """Install the WLB-LLM hooks into this Megatron-LM process (idempotent); returns the runtime state.

    ``middle_stage_batches``: say True only if the caller's ``get_batch`` gives middle pipeline stages
    (and virtual stages) the micro-batch's packed-sequence params, as ``megatron_wlb.megatron.entry.launcher``
    and the patched ``pretrain_gpt.py`` do; otherwise runs with middle stages are refused at start-up, and
    on megatron-core >= 0.18 apply() itself refuses (``ENTRY_POINT_REFUSAL``: that script's get_batch cannot
    carry our micro-batches unpatched).

    Raises RuntimeError when megatron-core is outside ``version.SUPPORTED_SERIES``, Megatron's training code is
    not importable, or a hook this release requires finds nothing to replace (``hooks.table.MissingHookTarget``).
    """
    refuse_spawned_reimport()
    install_python_shims()  # before anything imports megatron-core (0.19 needs typing.override)
    if check_version:
        check_core_version()
    rt = runtime()
    # main's own packing path (data_schedule.wrap_data_iterator) gets sequence_packing_scheduler="wlb";
    # a no-op, saying why, where this Megatron has no data_schedule
    rt.main_scheduler = register_main_scheduler()
    rt.middle_stage_batches = middle_stage_batches
    if rt.installed:
        return rt
    mods = import_training_modules()
    # core < 0.18 (pinned core_v0.16.1): pretrain_gpt.get_batch reads the batch on TP rank 0 and broadcasts
    # it through megatron.training.utils.get_batch_on_this_tp_rank; our iterator is read on every rank.
    # From core_v0.18 that function moved to megatron.core.utils with another signature, and our
    # launcher (megatron_wlb.megatron.entry.launcher) reads the iterator on every rank itself.
    if not hasattr(mods["utils"], "get_batch_on_this_tp_rank") and not middle_stage_batches:
        raise RuntimeError(ENTRY_POINT_REFUSAL)
    rt.registry = DataStateRegistry()
    # the training loop's hooks, and the start-up builds made safe where the machine lacks the toolchain
    from megatron_wlb.megatron.hooks.training_hooks import apply_phase_options  # imports torch and Megatron

    rt.originals.update(hook_table.install("apply", apply_phase_options()))
    rt.installed = True
    return rt
