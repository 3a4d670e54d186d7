"""megatron-wlb as Megatron-LM main's own sequence-packing scheduler (``sequence_packing_scheduler = "wlb"``).

Megatron-LM main (core 0.20.0, ``version.MAIN_COMMIT``) ships a sequence-packing data path of its own,
``megatron/core/datasets/data_schedule.py``: ``wrap_data_iterator(data_iterator, config, num_microbatches)``
gathers the sample lengths of one global batch over the DP group, asks a scheduler picked by
``config.sequence_packing_scheduler`` (a string, upper-cased into ``PackingSchedulerEnum`` and looked up in
``scheduler_map``) to group them, reroutes the samples and packs THD micro-batches. Main's one scheduler,
``dp_balanced`` (``DpBalancedScheduler``), packs next-fit in arrival order and deals round robin to DP.

``register()`` adds ``wlb``: ``WLB`` in main's enum and ``WlbPackingScheduler`` in ``scheduler_map`` (dev keys
``scheduler_map`` by the config's string and has no enum: there ``scheduler_map["wlb"]``), so
``config.sequence_packing_scheduler = "wlb"`` makes main's own ``wrap_data_iterator`` plan with our packer.
Where Megatron-LM checks the name (main after PR #6742: ``--sequence-packing-scheduler`` with fixed choices,
``ModelParallelConfig.__post_init__`` refusing other names; dev alike), ``widen_config_check`` lets ``wlb``
through both; main's TransformerConfig then requires TransformerEngine >= 2.9 for any scheduler, so without it
``--sequence-packing-scheduler wlb`` exits at start-up in one line (``refuse_without_te``). dev constructs
schedulers with ``max_num_seqs=``: ours caps a micro-batch's samples at it; a keyword we do not know is refused
naming it.
``megatron_wlb.megatron.apply()`` calls it; a process that uses main's packing path without the rest of
our hooks calls it alone. Where the installed Megatron has no ``data_schedule`` (0.16, 0.19) it is a no-op
that says why (core 0.19's data_schedule holds only the hybrid-CP scheduler, no registry).

The scheduler subclasses main's ``DpBalancedScheduler`` (a ``BasePackingScheduler``) and replaces only
``get_groups_and_subsamples``: main's ``run()`` (gather, reroute, pack, broadcast) and its required sample keys
stay main's. The grouping is wlb's placement of one whole global batch (``packing.wlb.place_whole_batch``):
variable-length micro-batches up to main's window (``max_seqlen_per_dp_cp_rank * cp_size`` per DP rank, as
``dp_balanced``), balanced over all DP ranks by the cost model's latency, dealt and ordered for 1F1B. Main's
API hands a scheduler one global batch that it must place whole, so wlb's outlier delay across iterations does
not apply here; a sample longer than the window runs alone, as under ``dp_balanced``. The CP layout follows
``dp_balanced``: every CP rank of a DP rank gets that DP rank's sample ids.

The cost model: in a Megatron process whose global args are set (``megatron.training.get_args``), the model
and layout of those args with our settings (``--wlb-cost-profile`` included, ``args.cost_model_from_args``),
and the pipeline of those args; otherwise (no Megatron args, e.g. main's unit tests) the attention-only
``d**2`` weight and one stage. ``WlbPackingScheduler(..., cost=..., stages=...)`` overrides both.

Extending ``PackingSchedulerEnum``: an ``enum.Enum`` cannot gain members through a public API, and writing into
its private member tables depends on the Python version. ``register()`` instead rebinds the module attribute to
a new enum built with the functional API (main's members, same names and values, plus ``WLB``) and keys
``scheduler_map`` by the new members *and* the old ones, so code that imported the old class still finds its
schedulers; ``wrap_data_iterator`` reads the module attribute at call time, so it sees ``WLB``.
"""

from __future__ import annotations

import enum
import importlib
import importlib.util
import inspect
import os
import runpy
import sys
from typing import TYPE_CHECKING, Any

from megatron_wlb.megatron.args.compat import install_python_shims, spawn_children_import_this_module
from megatron_wlb.megatron.args.flags import settings_from_args
from megatron_wlb.megatron.args.megatron_args import MegatronArgs
from megatron_wlb.megatron.args.validation import cost_model_from_args
from megatron_wlb.megatron.hooks import table as hooks
from megatron_wlb.megatron.hooks.main_names import SCHEDULER_NAME
from megatron_wlb.megatron.state.process import runtime
from megatron_wlb.packing.wlb import place_whole_batch

if TYPE_CHECKING:
    from megatron_wlb.costmodel import CostModel

__all__ = ["DATA_SCHEDULE_MODULE", "register", "scheduler_class", "scheduler_cost_model"]

#: main's sequence-packing scheduler module
DATA_SCHEDULE_MODULE = "megatron.core.datasets.data_schedule"

_CLASS: type | None = None


#: what main's registry is made of (core 0.19 has a data_schedule module too, with only the hybrid-CP scheduler);
#: main at the pin keys ``scheduler_map`` by ``PackingSchedulerEnum`` members, dev by strings (no enum)
REGISTRY_NAMES = ("BasePackingScheduler", "DpBalancedScheduler", "scheduler_map", "wrap_data_iterator")
#: the constructor arguments WlbPackingScheduler takes (main's four, dev's ``max_num_seqs``, and our own)
SCHEDULER_ARGUMENTS = ("max_seqlen_per_dp_cp_rank", "cp_size", "dp_size", "microbatch_group_size_per_vp_stage",
                       "max_num_seqs", "cost", "stages", "virtual_stages")


def missing_registry() -> str:
    """Why the installed Megatron has no sequence-packing scheduler registry to join ("" if it has one)."""
    try:
        found = importlib.util.find_spec(DATA_SCHEDULE_MODULE) is not None
    except (ImportError, ValueError):  # no megatron.core at all (or a stand-in module without a spec)
        found = False
    if not found:
        return f"this Megatron has no {DATA_SCHEDULE_MODULE}"
    module = importlib.import_module(DATA_SCHEDULE_MODULE)
    absent = [name for name in REGISTRY_NAMES if not hasattr(module, name)]
    return f"this Megatron's {DATA_SCHEDULE_MODULE} has no {', '.join(absent)}" if absent else ""


def scheduler_cost_model() -> tuple[CostModel | None, int, int]:
    """(cost model, pipeline stages, virtual stages) for a scheduler main constructs: from Megatron's global
    args where they are set (our settings from ``apply()``, else the args' ``--wlb-*`` values), else
    ``(None, 1, 1)`` (the ``d**2`` weight, one stage)."""
    try:
        from megatron.training import global_vars  # lazy: the package imports this module without torch or Megatron
    except ImportError:
        return None, 1, 1
    args = global_vars._GLOBAL_ARGS  # None until Megatron's args are set
    if args is None or not MegatronArgs.of(args).num_attention_heads:
        return None, 1, 1

    a = MegatronArgs.of(args)
    settings = runtime().settings or settings_from_args(args)
    return cost_model_from_args(args, settings), a.pp, a.vpp


def scheduler_class() -> type:
    """``WlbPackingScheduler``, a subclass of main's ``DpBalancedScheduler`` (built once; needs main's
    ``data_schedule``)."""
    global _CLASS
    if _CLASS is not None:
        return _CLASS
    data_schedule = importlib.import_module(DATA_SCHEDULE_MODULE)

    class WlbPackingScheduler(data_schedule.DpBalancedScheduler):  # type: ignore[name-defined]
        """Main's packing pipeline (``run``) with megatron-wlb's balanced placement as the grouping."""

        def __init__(self, max_seqlen_per_dp_cp_rank: int, cp_size: int, dp_size: int,
                     microbatch_group_size_per_vp_stage: int | None, max_num_seqs: int | None = None, *,
                     cost: CostModel | None = None, stages: int | None = None, virtual_stages: int | None = None,
                     **unknown: Any) -> None:
            if unknown:  # a newer Megatron's wrap_data_iterator passes what we would not honour: say so
                raise ValueError(f"megatron_wlb's WlbPackingScheduler does not know the keyword(s) "
                                 f"{', '.join(sorted(unknown))} that this Megatron's wrap_data_iterator passes; it "
                                 f"takes {', '.join(SCHEDULER_ARGUMENTS)} (use sequence_packing_scheduler "
                                 "'dp_balanced', or a megatron-wlb that knows them)")
            if max_num_seqs is not None and (isinstance(max_num_seqs, bool) or int(max_num_seqs) < 1):
                raise ValueError(f"max_num_seqs={max_num_seqs!r}: must be an integer >= 1 or None")
            if _takes(data_schedule.BasePackingScheduler.__init__, "max_num_seqs"):  # dev's base stores it
                super().__init__(max_seqlen_per_dp_cp_rank, cp_size, dp_size, microbatch_group_size_per_vp_stage,
                                 max_num_seqs=max_num_seqs)
            else:
                super().__init__(max_seqlen_per_dp_cp_rank, cp_size, dp_size, microbatch_group_size_per_vp_stage)
            self.max_num_seqs = None if max_num_seqs is None else int(max_num_seqs)
            if cost is None and stages is None:
                cost, found_stages, found_virtual = scheduler_cost_model()
                stages = found_stages
                virtual_stages = virtual_stages or found_virtual
            self.cost = cost
            self.stages = int(stages or 1)
            self.virtual_stages = int(virtual_stages or 1)

        def get_groups_and_subsamples(self, sample_id_seqlens: Any) -> list[list[list[int]]]:
            """Per micro-batch, one list of sample ids per DPxCP rank (rank ``j`` belongs to DP rank
            ``j // cp_size``, as under ``dp_balanced``); every sample exactly once."""
            groups = plan_sample_groups(sample_id_seqlens, self.max_seq_len_all_ranks, self.dp_size, self.cp_size,
                                        self.cost, self.stages, self.virtual_stages,
                                        self.microbatch_group_size_per_vp_stage or 1, max_items=self.max_num_seqs)
            _announce(len(sample_id_seqlens), len(groups))
            return groups

    WlbPackingScheduler.__module__ = __name__
    WlbPackingScheduler.__qualname__ = "WlbPackingScheduler"
    _CLASS = WlbPackingScheduler
    return _CLASS


_ANNOUNCED = False


def _announce(samples: int, micro_batches: int) -> None:
    """Say once per process (global rank 0) that main's packing path plans with our scheduler."""
    global _ANNOUNCED
    if _ANNOUNCED:
        return
    _ANNOUNCED = True
    import torch.distributed as dist  # lazy: the package imports this module without torch or Megatron

    if not dist.is_available() or not dist.is_initialized() or dist.get_rank() == 0:
        print(f"> megatron_wlb: Megatron's sequence-packing path plans with WlbPackingScheduler (first global "
              f"batch: {samples} samples into {micro_batches} micro-batches per DP rank)", flush=True)


def _takes(function: Any, name: str) -> bool:
    """Whether ``function`` names the parameter ``name`` (by its signature, not by the Megatron version)."""
    try:
        params = inspect.signature(function).parameters
    except (TypeError, ValueError):
        return False
    return name in params


def plan_sample_groups(sample_id_seqlens: Any, window: int, dp: int, cp: int, cost: CostModel | None,
                       stages: int = 1, virtual_stages: int = 1, multiple: int = 1,
                       max_items: int | None = None) -> list[list[list[int]]]:
    """``get_groups_and_subsamples``'s answer for ``(sample id, length)`` pairs: ``groups[k][j]`` holds the
    sample ids of micro-batch k on DPxCP rank j (DP rank ``j // cp``), at most ``max_items`` per micro-batch
    (dev's ``max_num_seqs``), torch-free."""
    pairs = [(int(i), int(n)) for i, n in sample_id_seqlens]
    plan = place_whole_batch([n for _, n in pairs], dp, window, cost, stages, virtual_stages, multiple,
                             max_items=max_items)
    n_micro = len(plan[0])
    return [[[pairs[i][0] for i in plan[j // cp][k]] for j in range(dp * cp)] for k in range(n_micro)]


def register() -> str:
    """Make ``wlb`` one of main's sequence-packing schedulers (idempotent). Returns what was done, or why
    nothing was (no ``data_schedule`` in this Megatron); raises if main already has another ``WLB``."""
    why = missing_registry()
    if why:
        return (f"not registered: {why} (Megatron-LM main's own sequence-packing scheduler registry, core 0.20); "
                "our packer runs through our data iterator instead")
    data_schedule = importlib.import_module(DATA_SCHEDULE_MODULE)
    cls = scheduler_class()
    from megatron_wlb.megatron.hooks.main_checks import widen_config_check  # lazy: it imports Megatron (main's, here)

    widen_config_check()
    if not hasattr(data_schedule, "PackingSchedulerEnum"):  # dev: scheduler_map keyed by the config's string
        current = data_schedule.scheduler_map.get(SCHEDULER_NAME)
        if current is cls:
            return f"registered: sequence_packing_scheduler={SCHEDULER_NAME!r} (already)"
        if current is not None:
            raise RuntimeError(f"Megatron's scheduler_map already has {SCHEDULER_NAME!r} (scheduler {current!r}); "
                               "megatron-wlb will not replace it")
        data_schedule.scheduler_map[SCHEDULER_NAME] = cls
        return f"registered: sequence_packing_scheduler={SCHEDULER_NAME!r} ({cls.__qualname__})"
    old = data_schedule.PackingSchedulerEnum
    key = SCHEDULER_NAME.upper()
    if key in old.__members__:
        current = data_schedule.scheduler_map.get(old[key])
        if current is cls:
            return f"registered: sequence_packing_scheduler={SCHEDULER_NAME!r} (already)"
        raise RuntimeError(f"Megatron's PackingSchedulerEnum already has {key} (scheduler {current!r}); "
                           f"megatron-wlb will not replace it")
    hooks.install_hook("PackingSchedulerEnum")  # enum_with_wlb: main's members plus WLB
    return f"registered: sequence_packing_scheduler={SCHEDULER_NAME!r} ({cls.__qualname__})"


def enum_with_wlb(old: Any) -> Any:
    """``PackingSchedulerEnum`` rebuilt with ``WLB`` (``hooks.HOOKS``; an Enum gains no members through a public API):
    main's members, same names and values, plus ``WLB``; ``scheduler_map`` keyed by the new members and the old
    ones, ``WLB`` mapped to ``WlbPackingScheduler``."""
    data_schedule = importlib.import_module(DATA_SCHEDULE_MODULE)
    key = SCHEDULER_NAME.upper()
    members = {m.name: m.value for m in old}
    members[key] = SCHEDULER_NAME
    new = enum.Enum(old.__name__, members, module=old.__module__, qualname=old.__qualname__)  # type: ignore[misc]
    new.__doc__ = old.__doc__
    schedulers = data_schedule.scheduler_map
    for member in old:
        schedulers[new[member.name]] = schedulers[member]  # the old members stay keys too
    schedulers[new[key]] = scheduler_class()
    return new


def run_script(argv: list[str]) -> None:
    """``python -m megatron_wlb.megatron.hooks.main_schedule PRETRAIN_GPT [FLAGS...]`` (under torchrun): a Megatron-LM
    checkout's own ``pretrain_gpt.py`` with ``wlb`` registered before its flags are parsed, so that
    ``--sequence-packing-scheduler wlb`` plans its packing path with our packer (``register()``)."""
    if not argv or not os.path.isfile(argv[0]):
        raise SystemExit("usage: python -m megatron_wlb.megatron.hooks.main_schedule PRETRAIN_GPT [FLAGS...] "
                         f"(a Megatron-LM checkout's pretrain_gpt.py){'; no such file: ' + argv[0] if argv else ''}")

    install_python_shims()
    sys.path.insert(0, os.path.dirname(os.path.abspath(argv[0])))
    message = register()
    if os.environ.get("RANK", "0") == "0":
        print(f"> megatron_wlb: {message}", flush=True)
    spawn_children_import_this_module(argv[0])
    sys.argv = list(argv)
    runpy.run_path(argv[0], run_name="__main__")


if __name__ == "__main__":
    import sys as _sys

    # the package's module, not this __main__ copy: one WlbPackingScheduler class, which a later register()
    # (apply() in the script) finds already registered
    from megatron_wlb.megatron.hooks.main_schedule import run_script as _run_script

    _run_script(_sys.argv[1:])
