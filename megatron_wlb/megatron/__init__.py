"""The Megatron-LM adapter: ``apply()`` hooks WLB-LLM into a Megatron-LM training process.

One micro-batch, from the length stream to the kernel: one host record, one copy, one device record::

    packer.pack() -> GlobalBatch     the iteration's MicroBatch pieces (packing/, every rank alike)
    WlbDataIterator._take            this DP rank's share, each micro-batch laid out over the CP group:
                                        ShardLayout (cp/plan.py layout_micro_batch), agreed before the step
    WlbDataIterator.__next__         -> RankMicroBatch (cp/plan.py rank_batch): this rank's rows, tokens,
                                        labels, loss mask, positions and attention metadata, numpy
    upload_micro_batch (cp_hooks.py) -> DeviceBatch (cp/device.py upload): one pinned buffer, one copy
                                        (prefetch.py: on a side stream, a micro-batch ahead), in
                                        WlbPackedSeqParams.wlb
    every layer                      RoPE and WlbCoreAttention (attention.py -> cp/attention.py) read
                                        that DeviceBatch; per-document-te: TE reads its THD fields

No step reads a device tensor back to the host; the only sync is the agreement before every training
step (``agreement.py``: one all-reduce of ``2 + 2 * DP`` int64 over the world: the plan, and each CP
group's layouts of the iteration). At start-up the ranks also agree on their settings, cost model and
datasets (``agreement.check_startup_agreement``; the datasets also against a resumed checkpoint's).

Call ``megatron_wlb.megatron.apply()`` in ``pretrain_gpt.py`` before ``pretrain(...)`` (the patch in
``patches/`` does this), then launch with ``--wlb-*`` flags. ``apply()`` checks the megatron-core
version and replaces, in Megatron's training code (pinned: ``version.PINNED_MEGATRON_TAG``):

- ``parse_args``: our ``--wlb-*`` flags are composed into whichever extra_args_provider is passed;
- ``validate_args``: after Megatron's checks, ``args.validate_wlb_args`` (fail fast, what to change),
  ``variable_seq_lengths`` on, then ``cp_hooks.install(settings)`` (attention, RoPE, the THD pass-through);
- ``build_train_valid_test_data_iterators``: the training iterator becomes a ``WlbDataIterator``
  (document reader -> packer -> this DP rank's THD micro-batches) on every rank, middle pipeline
  stages and TP ranks > 0 included; validation/test get the same over their splits;
- ``get_batch_on_this_tp_rank`` (core < 0.18): for our iterator every rank reads and uploads its own
  (identical) micro-batch instead of receiving a fixed-shape broadcast from TP rank 0, which cannot
  carry variable lengths;
- ``train_step``: first the plan agreement (``agreement.py``): this iteration's plan is made and its
  digest compared over the whole world; a rank that planned otherwise stops every rank, named;
- ``save_checkpoint`` / ``load_checkpoint``: the packer + stream state sidecar (``checkpoint.py``);
- ``training_log``: the per-iteration packing metrics (``wlb_logging.py``);
- Megatron-LM main's own sequence-packing scheduler registry (``main_schedule.py``, where the installed
  Megatron has ``megatron/core/datasets/data_schedule.py``): ``sequence_packing_scheduler = "wlb"`` selects
  our packer in main's ``wrap_data_iterator`` (``runtime().main_scheduler`` says whether it was registered);
- start-up builds (``startup.py``): the dataset-helper ``make`` and core 0.16's ``fused_kernels.load``
  are skipped, saying so, where the machine lacks the toolchain (or the helpers are prebuilt).

Importing this package needs neither torch nor Megatron; ``apply()`` imports them.
"""

from __future__ import annotations

import dataclasses
import functools
import importlib
import os
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

from megatron_wlb.megatron.rebind import rebind, wrapping
from megatron_wlb.megatron.settings import WlbSettings

if TYPE_CHECKING:  # the package imports neither torch nor Megatron until apply()
    from megatron_wlb.costmodel import CostModel
    from megatron_wlb.cp.plan import CPSharding, RankMicroBatch
    from megatron_wlb.data.reader import DocumentReader
    from megatron_wlb.megatron.data import WlbDataIterator

__all__ = ["WlbSettings", "apply", "build_train_iterator", "cp_sharding_from_args", "iterations_for",
           "pinned_tp_rank_batch", "pretrain_gpt_batch", "reader_from_args", "runtime", "stream_tokens_for"]

#: Megatron training-code modules apply() hooks (all present at the pinned commit)
TRAINING_MODULES = ("arguments", "initialize", "training", "checkpointing", "utils", "global_vars")


@dataclass
class Runtime:
    """What apply() installed in this process, and the state its hooks share."""

    installed: bool = False
    #: the entry point gives middle pipeline stages packed-sequence params (launcher, patched pretrain_gpt)
    middle_stage_batches: bool = False
    #: some split uses Megatron's own (unpacked) loader, whose batches legitimately carry no packed params
    megatron_loaders: bool = False
    settings: WlbSettings | None = None
    registry: Any = None
    logger: Any = None
    #: the online cost-model refit (``--wlb-cost-model online``), on every rank
    refit: Any = None
    originals: dict[str, Callable] = field(default_factory=dict)
    #: the plan agreement checks run (``agreement.wrap_train_step``): how many, and their seconds in all
    agreement_checks: int = 0
    agreement_s: float = 0.0
    #: seconds the start-up agreement took (fingerprinting the settings and datasets, and comparing them)
    startup_agreement_s: float = 0.0
    #: Megatron-LM main's own sequence-packing scheduler: whether ``wlb`` was registered there, or why not
    #: (``main_schedule.register``)
    main_scheduler: str = ""

    def agreed(self, seconds: float) -> None:
        self.agreement_checks += 1
        self.agreement_s += seconds


_RUNTIME = Runtime()


def runtime() -> Runtime:
    """This process's hook state (settings once args are validated, iterators, metrics logger)."""
    return _RUNTIME


# -- building the data path from Megatron's args --------------------------------------------------------
def reader_from_args(args: Any, split_name: str = "train") -> DocumentReader:
    """A ``DocumentReader`` for one split: ``--{train,valid,test}-data-path`` (all of it) if given, else
    ``--data-path`` with ``--split``. Megatron's ``--data-cache-path``, when given, also holds the epoch
    orders of large datasets (built once, memory-mapped by the ranks of a node; ``reader.cached_order``)."""
    from megatron_wlb.data.reader import DocumentReader

    mmap = bool(getattr(args, "mmap_bin_files", True))
    seed = int(getattr(args, "seed", 1234))
    cache = getattr(args, "data_cache_path", None) or None
    own = getattr(args, f"{split_name}_data_path", None)
    if own:
        reader = DocumentReader.from_data_path(own, split="1,0,0", split_name="train", seed=seed, mmap=mmap,
                                               order_cache=cache)
    elif not getattr(args, "data_path", None):
        raise ValueError("WLB-LLM reads Megatron indexed datasets: give --data-path [WEIGHT] PREFIX ...")
    else:
        reader = DocumentReader.from_data_path(args.data_path, split=_split(args), split_name=split_name, seed=seed,
                                               mmap=mmap, order_cache=cache)
    vocab = getattr(args, "padded_vocab_size", None)  # the embedding's rows (set by Megatron's tokenizer build)
    if vocab:
        reader.check_vocabulary(int(vocab), "--vocab-size / the tokenizer")
    return reader


def _split(args: Any) -> str:
    from megatron_wlb.data.reader import DEFAULT_SPLIT

    return getattr(args, "split", None) or DEFAULT_SPLIT


def iterations_for(args: Any, split_name: str) -> int:
    """Iterations Megatron runs on a split: train_iters, all evaluations' eval_iters, or one test pass."""
    gbs = int(args.global_batch_size)
    train = int(args.train_iters) if getattr(args, "train_iters", None) else \
        -(-int(getattr(args, "train_samples", 0) or 0) // gbs)
    if split_name == "train":
        return train
    eval_iters = int(getattr(args, "eval_iters", 0) or 0)
    if split_name == "valid":
        interval = int(getattr(args, "eval_interval", 0) or 0) or max(train, 1)
        return (train // interval + 1) * eval_iters
    return eval_iters


def stream_tokens_for(args: Any, config: Any, split_name: str = "train") -> int:
    """Tokens the stream must cover: every iteration on the split plus slack for queues and windows."""
    iters = iterations_for(args, split_name)
    if iters < 1:
        raise ValueError(f"no {split_name} iterations: set --train-iters (or --train-samples) and, for "
                         "evaluation, --eval-iters; the document stream is sized from them")
    slack = config.max_delay + config.window + 2
    return (iters + slack) * config.tokens_per_iteration


def cp_sharding_from_args(args: Any, settings: WlbSettings, cp_rank: int, cost: CostModel | None = None
                          ) -> CPSharding:
    """How this run cuts micro-batches over CP (``cp.plan.CPSharding``) for CP rank ``cp_rank``.

    T is padded to a multiple of CP, so the per-sequence / per-document layouts give every CP rank
    exactly T/CP tokens; under sequence parallelism also of TP, and every rank to a multiple of TP.
    """
    from megatron_wlb.cp.plan import CPSharding

    tp = int(getattr(args, "tensor_model_parallel_size", 1) or 1)
    cp = int(getattr(args, "context_parallel_size", 1) or 1)
    sp = tp if getattr(args, "sequence_parallel", False) and tp > 1 else 1
    return CPSharding(layout=settings.cp_sharding, cp_size=cp, cp_rank=cp_rank, sequence_multiple=cp * sp,
                      rank_multiple=sp, te_attention=settings.cp_sharding == "per-document-te", cost=cost)


def build_train_iterator(args: Any, settings: WlbSettings, dp_rank: int, cp_rank: int = 0, *,
                         on_batch: Callable | None = None, reader: DocumentReader | None = None,
                         split_name: str = "train") -> WlbDataIterator:
    """This rank's ``WlbDataIterator`` for Megatron's ``args`` (pure: same inputs, same plans, any rank).

    ``split_name`` "valid"/"test" builds the evaluation iterators the same way over those splits. With
    ``--wlb-pieces concat-and-cut`` the training split reads Megatron's own GPTDataset samples
    (``gpt_samples``) unless a ``reader`` is given; evaluation keeps the document reader.
    """
    from megatron_wlb.megatron.args import cost_model_from_args, packing_config_from_args
    from megatron_wlb.megatron.data import WlbDataIterator
    from megatron_wlb.packing import make_packer

    config = packing_config_from_args(args, settings)
    megatron_samples = config.pieces == "concat-and-cut" and split_name == "train" and reader is None
    if megatron_samples and config.read_ahead is None:  # no sample before the iteration Megatron's sampler gives it
        config = dataclasses.replace(config, read_ahead=False)
    cost = cost_model_from_args(args, settings)
    packer = make_packer(settings.packer, config, cost)
    sharding = cp_sharding_from_args(args, settings, cp_rank, cost)
    if megatron_samples:
        # Megatron's own GPTDataset samples, from the sample its sampler would give next (a resumed stock
        # job's consumed samples; a resumed balanced one opens its saved position instead)
        from megatron_wlb.megatron.args import StartupError
        from megatron_wlb.megatron.gpt_samples import MegatronSamples, build_train_dataset, eod_problem

        dataset = build_train_dataset(args)
        if not getattr(args, "dataloader_inter_document_masking", False):
            problem = eod_problem(dataset)
            if problem is not None:
                raise StartupError(f"megatron_wlb: {problem}")
        samples = MegatronSamples(dataset)
        return WlbDataIterator(None, samples.stream(int(getattr(args, "consumed_train_samples", 0) or 0)), packer,
                               dp_rank, sharding, on_batch=on_batch, read_piece=samples.piece)
    reader = reader if reader is not None else reader_from_args(args, split_name)
    return WlbDataIterator(reader, reader.stream(stream_tokens_for(args, config, split_name)), packer, dp_rank,
                           sharding, on_batch=on_batch)


def _ranks() -> tuple[int, int]:
    """(data-parallel rank, context-parallel rank) of this process."""
    from megatron.core import parallel_state

    return parallel_state.get_data_parallel_rank(), parallel_state.get_context_parallel_rank()


# -- the hooks ---------------------------------------------------------------------------------------------
def _wrap_parse_args(original: Callable) -> Callable:
    from megatron_wlb.megatron.args import StartupError, asks_for_help, wlb_extra_args_provider, wlb_help

    @wrapping(original)
    def parse_args(extra_args_provider=None, ignore_unknown_args=False):
        import sys

        if asks_for_help(sys.argv[1:]):  # ours only: Megatron's --help crashes on 0.19.2 (upstream)
            print(wlb_help(sys.argv[0]), end="")
            raise SystemExit(0)
        args = original(wlb_extra_args_provider(extra_args_provider), ignore_unknown_args)
        if getattr(args, "yaml_cfg", None) is not None:
            # Megatron's YAML path replaces the parsed args and skips validate_args (and our checks)
            raise StartupError("megatron_wlb: --yaml-cfg is not supported with WLB-LLM (Megatron's YAML path skips "
                               "validate_args, where the --wlb-* flags are checked); pass the settings as flags")
        return args

    return parse_args


def _wrap_validate_args(original: Callable) -> Callable:
    from megatron_wlb.megatron.args import StartupError, rejected_by_megatron, validate_wlb_args

    @wrapping(original)
    def validate_args(args, defaults={}):  # noqa: B006 - Megatron's signature
        from megatron_wlb.megatron.args import refuse_bypassing_flags
        from megatron_wlb.megatron.preflight import check_training_args

        refuse_bypassing_flags(args)  # before Megatron's own checks of those flags, which name no equivalent
        try:
            out = original(args, defaults)
        except StartupError:
            raise
        except (AssertionError, ValueError) as exc:  # Megatron's own flag checks: one line, no traceback
            raise rejected_by_megatron(exc) from None
        settings = validate_wlb_args(args)
        for note in check_training_args(args, middle_stage_batches=_RUNTIME.middle_stage_batches):
            if _is_rank0():
                print(f"> megatron_wlb: {note}", flush=True)
        _RUNTIME.settings = settings
        if int(getattr(args, "pipeline_model_parallel_size", 1) or 1) > 1:
            from megatron_wlb.megatron import p2p

            p2p.install()  # shapes exchanged in the activations' rank order (Megatron #5100)
        from megatron_wlb.megatron import cp_hooks

        cp_hooks.install(settings)
        from megatron_wlb.megatron import timing

        timing.install()  # before the model config copies finalize_model_grads
        return out

    return validate_args


def _wrap_build_iterators(original: Callable, mods: dict[str, Any]) -> Callable:
    @wrapping(original)
    def build_train_valid_test_data_iterators(build_train_valid_test_datasets_provider):
        args = mods["global_vars"].get_args()
        built: list[Any] = []

        def megatron_iterators() -> tuple[Any, Any, Any]:
            """Megatron's own (train, valid, test), built on first need: only a split we do not pack
            (several validation sets, or an evaluation split too small to pack) needs them; every
            rank decides alike, so Megatron's collectives inside stay matched."""
            if not built:
                built.append(original(build_train_valid_test_datasets_provider))
                _RUNTIME.megatron_loaders = True
            return built[0]

        if getattr(args, "skip_train", False) or _RUNTIME.settings is None:
            return megatron_iterators()
        from megatron.core.rerun_state_machine import RerunDataIterator

        from megatron_wlb.megatron.args import cost_model_from_args
        from megatron_wlb.megatron.wlb_logging import WlbMetricsLogger

        settings = _RUNTIME.settings
        if _RUNTIME.logger is None:
            gv = mods["global_vars"]
            _RUNTIME.logger = WlbMetricsLogger(cost_model_from_args(args, settings), int(args.seq_length),
                                               settings.log_interval, print_fn=mods["utils"].print_rank_0,
                                               tb_writer=gv.get_tensorboard_writer, wandb_writer=gv.get_wandb_writer,
                                               stages=int(getattr(args, "pipeline_model_parallel_size", 1) or 1),
                                               virtual_stages=int(getattr(args, "virtual_pipeline_model_parallel_size",
                                                                          None) or 1))
        first = not _RUNTIME.registry.iterators
        iterator = _prefetching(build_train_iterator(args, settings, *_ranks(),
                                                     on_batch=_RUNTIME.logger.on_batch if first else None))
        if first:
            _agree_at_startup(args, settings, iterator)
        _RUNTIME.registry.register(iterator)
        if first:
            _start_recorder(args, settings, iterator.n, _RUNTIME.logger.cost)
        mods["utils"].print_rank_0(f"> megatron_wlb: {settings.packer} packing of a document stream of about "
                                   f"{iterator.stream.requested_tokens} tokens, {iterator.n} micro-batches per DP rank "
                                   f"per iteration, CP sharding {settings.cp_sharding}")
        evals = [_eval_iterator(args, settings, split_name, functools.partial(lambda i: megatron_iterators()[i], index),
                                mods) for index, split_name in ((1, "valid"), (2, "test"))]
        # Megatron decides whether to train / evaluate from its own loaders, which our launcher does not
        # build (its datasets provider returns none): our iterators exist on every rank.
        args.do_train = True
        args.do_valid = bool(getattr(args, "do_valid", False)) or evals[0] is not None
        args.do_test = bool(getattr(args, "do_test", False)) or evals[1] is not None
        return RerunDataIterator(iterator), evals[0], evals[1]

    return build_train_valid_test_data_iterators


def _agree_at_startup(args: Any, settings: WlbSettings, iterator: Any) -> None:
    """Before the first plan: every rank must start with the same settings, cost model and datasets
    (``agreement.check_startup_agreement``, one all-reduce over the world), and, resuming, with the datasets
    the checkpoint trained on (its sidecar's fingerprint). Both stop every rank in one line naming what differs."""
    import torch.distributed as dist

    from megatron_wlb.megatron.agreement import (
        check_startup_agreement,
        dataset_parts,
        resume_data_refusal,
        run_fingerprint,
    )
    from megatron_wlb.megatron.args import StartupError

    start = time.perf_counter()
    fingerprint = run_fingerprint(args, settings, iterator.packer.config, iterator.packer.cost, dataset_parts(args))
    registry = _RUNTIME.registry
    registry.fingerprint = fingerprint.datasets()
    if dist.is_initialized() and dist.get_world_size() > 1:
        try:
            check_startup_agreement(fingerprint)
        except RuntimeError as exc:
            raise StartupError(str(exc)) from None
    refusal = resume_data_refusal(registry.saved_fingerprint, fingerprint, registry.pending_iteration or 0)
    if refusal:
        raise StartupError(refusal)
    _RUNTIME.startup_agreement_s = time.perf_counter() - start


def _start_recorder(args: Any, settings: WlbSettings, n: int, cost: CostModel | None) -> None:
    """Time this rank's training steps from now on (``timing.Recorder``; a trace file with ``--wlb-trace``)."""
    import torch
    from megatron.core import package_info, parallel_state

    from megatron_wlb.megatron import timing
    from megatron_wlb.megatron.cp_hooks import training_device
    from megatron_wlb.provenance import machine

    pp = int(getattr(args, "pipeline_model_parallel_size", 1) or 1)
    vpp = int(getattr(args, "virtual_pipeline_model_parallel_size", None) or 1)
    ids = timing.RankIds(rank=torch.distributed.get_rank(), dp=parallel_state.get_data_parallel_rank(),
                         pp=parallel_state.get_pipeline_model_parallel_rank(),
                         cp=parallel_state.get_context_parallel_rank(),
                         tp=parallel_state.get_tensor_model_parallel_rank(),
                         dp_size=parallel_state.get_data_parallel_world_size(),
                         cp_size=parallel_state.get_context_parallel_world_size(),
                         tp_size=parallel_state.get_tensor_model_parallel_world_size(),
                         layers_per_chunk=max(1, int(args.num_layers) // (pp * vpp)))
    cuda = training_device().type == "cuda"
    layout = {"tp": ids.tp_size, "cp": ids.cp_size, "pp": pp, "dp": ids.dp_size, "vpp": vpp}
    header = {"device": torch.cuda.get_device_name() if cuda else machine(),
              "model": cost.model.to_dict() if cost is not None else None,
              "layout": layout, "n": n,
              "cost_model": cost.describe() if cost is not None else None, "settings": settings.to_dict(),
              "megatron_core": str(package_info.__version__), "torch": torch.__version__}
    registry = _RUNTIME.registry

    def chunk_of(iterator: Any) -> int | None:
        return next((i for i, it in enumerate(registry.iterators) if it is iterator), None)

    thread = os.environ.get("WLB_TRACE_CLOCK", "") == "thread"  # thread CPU seconds: for fitting a cost model
    clock = timing.CudaClock() if cuda else timing.ThreadClock() if thread else timing.CpuClock()
    recorder = timing.Recorder(clock, ids, cost, n, chunk_of,
                               trace=settings.trace, header=header)
    timing.activate(recorder)
    if settings.cost_model == "online" and cost is not None:
        from megatron_wlb.megatron.online import OnlineRefit

        def apply_refit(new: CostModel, state: dict[str, Any]) -> None:
            for it in registry.iterators:
                it.packer.set_cost(new, state)
            recorder.cost = new
            if _RUNTIME.logger is not None:
                _RUNTIME.logger.cost, _RUNTIME.logger.latest = new, None
            fit = state["fit"]
            _print_rank0(f"> megatron_wlb: online cost model refit at iteration {state['iteration'] + 1} from "
                         f"{fit['extra']['points']} measured micro-batches: attention {fit['attn_per_pair']:.4g} "
                         f"s/pair, linear {fit['linear_per_token']:.4g} s/token, overhead {fit['overhead']:.4g} s "
                         f"per layer; bwd/fwd {fit['bwd_attention']:.2f} / {fit['bwd_linear']:.2f}")

        _RUNTIME.refit = OnlineRefit(cost, layout, settings.refit_interval, apply_refit,
                                     lambda: registry.iterators[0].current if registry.iterators else None,
                                     recorder.clock.kind)


def _measure(due: bool) -> Any:
    """Flush this rank's timing (trace rows) and, on a logged iteration, measure over every rank."""
    from megatron_wlb.megatron import timing

    recorder = timing.active()
    if recorder is None:
        return None
    start = time.perf_counter()
    try:
        target = recorder.log_target
        rows = recorder.flush(through=target)
        refit = _RUNTIME.refit
        if refit is not None:
            refit.observe(rows)
            if target >= 0 and refit.due(target):
                state = refit.refit(target, timing.all_reduce)  # before the next plan: every rank alike
                if state is not None:
                    recorder.write({"kind": "refit", "iteration": target, "state": state})
        if not due or target < 0:
            return None
        return recorder.measure(target, timing.all_reduce)
    finally:
        recorder.overhead_s += time.perf_counter() - start


def _eval_iterator(args: Any, settings: WlbSettings, split_name: str, megatron_iterator: Callable[[], Any],
                   mods: dict) -> Any:
    """Our packed iterator over the valid/test split (every rank, like training); None when evaluation is
    off or the split is empty; Megatron's own one (``megatron_iterator()`` builds it) for several
    validation sets or a split too small to pack without pipeline parallelism."""
    from megatron.core.rerun_state_machine import RerunDataIterator

    if getattr(args, "multiple_validation_sets", False) or getattr(args, "full_validation", False):
        return megatron_iterator()
    if iterations_for(args, split_name) < 1 or _split_is_empty(args, split_name):
        return None  # evaluation off, or e.g. --split 98,2,0 has no test split: Megatron builds none either
    try:
        it = build_train_iterator(args, settings, *_ranks(), split_name=split_name)
    except ValueError as exc:  # e.g. a split too small to hold one document
        if int(getattr(args, "pipeline_model_parallel_size", 1)) > 1:
            raise ValueError(f"megatron_wlb: no {split_name} iterator ({exc}); with pipeline parallelism every "
                             "stage needs packed evaluation batches: give the split documents or set "
                             "--eval-iters 0") from exc
        mods["utils"].print_rank_0(f"> megatron_wlb: {split_name} keeps Megatron's loader ({exc})")
        return megatron_iterator()
    return RerunDataIterator(it)


def _split_is_empty(args: Any, split_name: str) -> bool:
    """Whether ``--split`` gives ``split_name`` no share (and no ``--{split}-data-path`` is given)."""
    from megatron_wlb.data.reader import parse_split

    if getattr(args, f"{split_name}_data_path", None) or not getattr(args, "data_path", None):
        return False
    fractions = parse_split(_split(args))
    return fractions[{"train": 0, "valid": 1, "test": 2}[split_name]] == 0


def _unwrap_iterator(data_iterator: Any) -> Any:
    from megatron_wlb.megatron.prefetch import unwrap

    return unwrap(data_iterator)


def _prefetching(iterator: WlbDataIterator) -> Any:
    """The training iterator with its next micro-batch built (and, on CUDA, uploaded) on a thread
    (``prefetch.py``): the same micro-batches in the same order, off the step's critical path."""
    from megatron_wlb.megatron.cp_hooks import stage_upload, training_device
    from megatron_wlb.megatron.prefetch import PrefetchingIterator

    device = training_device()
    return PrefetchingIterator(iterator, stage=functools.partial(stage_upload, device=device)
                               if device.type == "cuda" else None)


def pinned_tp_rank_batch(batch: RankMicroBatch) -> dict[str, Any]:
    """One ``RankMicroBatch``, uploaded, as the pinned ``pretrain_gpt.get_batch`` reads its TP-rank batch.

    The params ride in ``cu_seqlens``, which that ``get_batch`` hands to
    ``get_thd_batch_on_this_cp_rank`` (ours passes them through); ``max_seqlen`` is the host tensor
    its ``dim()`` check reads. Key order: it returns ``(*batch.values(), packed_seq_params)`` after
    popping the metadata keys, i.e. tokens, labels, loss_mask, attention_mask, position_ids.
    """
    import torch

    from megatron_wlb.megatron.cp_hooks import upload_micro_batch

    data, params = upload_micro_batch(batch)
    return {**data, "cu_seqlens": params, "max_seqlen": torch.tensor([params.max_seqlen_q], dtype=torch.int32)}


def pretrain_gpt_batch(data_iterator: Any, keys: list[str]) -> list[Any]:
    """This rank's next micro-batch for a core 0.19 ``pretrain_gpt.get_batch`` (patched: ``patches/core_v0.19.0``),
    as the values of its ``BATCH_KEYS`` in order: tokens, labels, loss_mask and position_ids uploaded once;
    ``cu_seqlens`` holds our ``WlbPackedSeqParams`` (the patched ``forward_step`` passes them to the model);
    attention_mask, cu_seqlens_padded, max_seqlen, hybrid_cp_group and local_cp_size are None. Every rank
    reads its own copy (no TP broadcast), middle pipeline stages included."""
    from megatron_wlb.megatron.cp_hooks import upload_micro_batch

    batch, params = upload_micro_batch(next(data_iterator))
    fields = {**batch, "cu_seqlens": params}
    unknown = sorted(set(keys) - set(fields) - {"attention_mask", "cu_seqlens_padded", "max_seqlen",
                                                 "hybrid_cp_group", "local_cp_size"})
    if unknown:
        raise RuntimeError(f"megatron_wlb: this pretrain_gpt.py's get_batch returns {', '.join(unknown)}, which "
                           "WLB-LLM's micro-batches do not carry; use the patch of its release (patches/) or "
                           "python -m megatron_wlb.megatron.launcher")
    return [fields.get(key) for key in keys]


def _wrap_get_batch_on_this_tp_rank(original: Callable) -> Callable:
    from megatron_wlb.megatron.data import WlbDataIterator

    @wrapping(original)
    def get_batch_on_this_tp_rank(data_iterator, mtp_on_this_rank: bool = False, *args, **kwargs):
        if not isinstance(_unwrap_iterator(data_iterator), WlbDataIterator):
            return original(data_iterator, mtp_on_this_rank, *args, **kwargs)
        return pinned_tp_rank_batch(next(data_iterator))

    return get_batch_on_this_tp_rank


def _first_train_iterator() -> WlbDataIterator | None:
    """The training iterator of this rank's first model chunk (all chunks plan alike), if built."""
    registry = _RUNTIME.registry
    return registry.iterators[0] if registry is not None and registry.iterators else None


def _print_rank0(line: str) -> None:
    if _is_rank0():
        print(line, flush=True)


def _is_rank0() -> bool:
    import torch.distributed as dist

    return not dist.is_initialized() or dist.get_rank() == 0


def training_import_error(module: str, exc: ImportError) -> str:
    """The one-line reason ``megatron.training.<module>`` failed to import, naming the real cause: the training
    code itself missing (a megatron-core wheel before 0.19), or a module or name it imports."""
    from megatron_wlb.megatron.version import PINNED_MEGATRON_COMMIT, PINNED_MEGATRON_TAG, TESTED_RELEASES

    missing = getattr(exc, "name", None) if isinstance(exc, ModuleNotFoundError) else None
    if missing in ("megatron", "megatron.training", f"megatron.training.{module}"):
        return (f"megatron_wlb.megatron.apply() hooks Megatron-LM's training code (megatron.training.{module}), "
                "which is not importable here: pip install --no-deps megatron-core=="
                f"{TESTED_RELEASES[-1]} (its wheel ships megatron/training; earlier wheels do not), or put a "
                f"Megatron-LM checkout at {PINNED_MEGATRON_TAG} ({PINNED_MEGATRON_COMMIT[:12]}) on PYTHONPATH "
                f"(import error: {exc})")
    if missing:
        return (f"megatron.training.{module} failed to import: it needs the module {missing!r}, which is not "
                f"installed: pip install {missing.split('.')[0]} (megatron_wlb's [megatron] extra lists what "
                f"Megatron's training code imports) (import error: {exc})")
    return f"megatron.training.{module} failed to import: {exc}"


def _import_training_modules() -> dict[str, Any]:
    mods = {}
    for name in TRAINING_MODULES:
        try:
            mods[name] = importlib.import_module(f"megatron.training.{name}")
        except ImportError as exc:
            raise RuntimeError(training_import_error(name, exc)) from exc
    return mods


#: why apply() alone cannot serve a core >= 0.18 script's get_batch, and the ways in
ENTRY_POINT_REFUSAL = (
    "megatron_wlb.megatron.apply(): from megatron-core 0.18 on, pretrain_gpt.py's get_batch reads the data "
    "iterator on TP rank 0 only, skips middle pipeline stages and rebuilds PackedSeqParams from cu_seqlens, so "
    "WLB-LLM's packed micro-batches cannot pass through it with apply() alone (its first step would fail). Ways "
    "in: a core_v0.19.0 checkout patched with scripts/apply_patches.sh (its own pretrain_gpt.py, builders and "
    "loss), or python -m megatron_wlb.megatron.launcher; a get_batch of your own that reads the iterator on "
    "every rank (megatron_wlb.megatron.launcher.get_batch) says so with apply(middle_stage_batches=True)")


def apply(*, check_version: bool = True, middle_stage_batches: bool = False) -> Runtime:
    """Install the WLB-LLM hooks into this Megatron-LM process (idempotent); returns the runtime state.

    ``middle_stage_batches``: say True only if the caller's ``get_batch`` gives middle pipeline stages
    (and virtual stages) the micro-batch's packed-sequence params, as ``megatron_wlb.megatron.launcher``
    and the patched ``pretrain_gpt.py`` do; otherwise runs with middle stages are refused at start-up, and
    on megatron-core >= 0.18 apply() itself refuses (``ENTRY_POINT_REFUSAL``: that script's get_batch cannot
    carry our micro-batches unpatched).

    Raises RuntimeError when megatron-core is outside ``version.SUPPORTED_SERIES`` or Megatron's
    training code is not importable.
    """
    from megatron_wlb.megatron.compat import install_python_shims, refuse_spawned_reimport
    from megatron_wlb.megatron.version import check_core_version

    refuse_spawned_reimport()
    install_python_shims()  # before anything imports megatron-core (0.19 needs typing.override)
    if check_version:
        check_core_version()
    from megatron_wlb.megatron.main_schedule import register as register_main_scheduler

    # main's own packing path (data_schedule.wrap_data_iterator) gets sequence_packing_scheduler="wlb";
    # a no-op, saying why, where this Megatron has no data_schedule
    _RUNTIME.main_scheduler = register_main_scheduler()
    _RUNTIME.middle_stage_batches = middle_stage_batches
    if _RUNTIME.installed:
        return _RUNTIME
    from megatron_wlb.megatron.agreement import wrap_train_step
    from megatron_wlb.megatron.checkpoint import DataStateRegistry, wrap_load_checkpoint, wrap_save_checkpoint
    from megatron_wlb.megatron.wlb_logging import wrap_training_log

    mods = _import_training_modules()
    from megatron_wlb.megatron.startup import guard_startup_builds

    guard_startup_builds()  # no toolchain (a bare GPU machine): skip the builds that would fail, saying so
    _RUNTIME.registry = DataStateRegistry()
    get_args = mods["global_vars"].get_args

    def settings_dict():
        return _RUNTIME.settings.to_dict() if _RUNTIME.settings is not None else None

    replacements = {
        "parse_args": (mods["arguments"].parse_args, _wrap_parse_args),
        "validate_args": (mods["arguments"].validate_args, _wrap_validate_args),
        "build_train_valid_test_data_iterators": (mods["training"].build_train_valid_test_data_iterators,
                                                  lambda f: _wrap_build_iterators(f, mods)),
        "save_checkpoint": (mods["checkpointing"].save_checkpoint,
                            lambda f: wrap_save_checkpoint(f, _RUNTIME.registry, get_args, _is_rank0, settings_dict,
                                                           _print_rank0)),
        "load_checkpoint": (mods["checkpointing"].load_checkpoint,
                            lambda f: wrap_load_checkpoint(f, _RUNTIME.registry, get_args, settings_dict,
                                                           _print_rank0)),
        "train_step": (mods["training"].train_step,
                       lambda f: wrap_train_step(f, _first_train_iterator, _RUNTIME.agreed)),
        "training_log": (mods["training"].training_log,
                         lambda f: wrap_training_log(f, lambda: _RUNTIME.logger, _measure)),
    }
    # core < 0.18 (pinned core_v0.16.1): pretrain_gpt.get_batch reads the batch on TP rank 0 and broadcasts
    # it through megatron.training.utils.get_batch_on_this_tp_rank; our iterator is read on every rank.
    # From core_v0.18 that function moved to megatron.core.utils with another signature, and our
    # launcher (megatron_wlb.megatron.launcher) reads the iterator on every rank itself.
    legacy_tp = getattr(mods["utils"], "get_batch_on_this_tp_rank", None)
    if legacy_tp is None and not middle_stage_batches:
        raise RuntimeError(ENTRY_POINT_REFUSAL)
    if legacy_tp is not None:
        replacements["get_batch_on_this_tp_rank"] = (legacy_tp, _wrap_get_batch_on_this_tp_rank)
    for name, (original, wrap) in replacements.items():
        _RUNTIME.originals[name] = original
        rebind(name, original, wrap(original))
    _RUNTIME.installed = True
    return _RUNTIME
