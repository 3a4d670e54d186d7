"""Building the data path from Megatron's args: readers, the packed iterators of every split, their batches.

``build_train_iterator`` is the one builder (pure: same inputs, same plans, any rank); the data hook
(``training_hooks``) and the evaluation iterators look it up as ``megatron_wlb.megatron.build_train_iterator``
at call time, so a benchmark may substitute its own (``benchmarks/paired_train.py``).
"""

from __future__ import annotations

import dataclasses
import sys
from collections.abc import Callable
from typing import TYPE_CHECKING, Any

from megatron_wlb.cp.dynamic import DYNAMIC_SHARDING
from megatron_wlb.cp.dynamic_steps import DynamicPool
from megatron_wlb.cp.plan import CPSharding, RankMicroBatch
from megatron_wlb.data.reader import DEFAULT_SPLIT, DocumentReader, OutOfVocabulary, parse_split
from megatron_wlb.data.sft import SftInputError
from megatron_wlb.data.sft_cache import SftCacheError
from megatron_wlb.megatron.args.megatron_args import MegatronArgs
from megatron_wlb.megatron.args.settings import WlbSettings
from megatron_wlb.megatron.args.validation import StartupError, cost_model_from_args, packing_config_from_args
from megatron_wlb.megatron.data.gpt_samples import MegatronSamples, dataset_build_problem, eod_problem
from megatron_wlb.megatron.data.packed import WlbDataIterator
from megatron_wlb.megatron.data.sample_agreement import SampleIdentity
from megatron_wlb.megatron.data.sft import sft_reader
from megatron_wlb.megatron.state.process import print_rank0
from megatron_wlb.packing import make_packer

if TYPE_CHECKING:
    from megatron_wlb.costmodel import CostModel


def reader_from_args(args: Any, split_name: str = "train") -> DocumentReader:
    """A ``DocumentReader`` for one split: ``--{train,valid,test}-data-path`` (all of it) if given, else
    ``--data-path`` with ``--split``. Megatron's ``--data-cache-path``, when given, also holds the epoch
    orders of large datasets (built once, memory-mapped by the ranks of a node; ``reader.cached_order``)."""
    a = MegatronArgs.of(args)
    mmap = True if a.mmap_bin_files is None else bool(a.mmap_bin_files)
    seed = 1234 if a.seed is None else int(a.seed)
    cache = a.data_cache_path or None
    own = a.data_path_of(split_name)
    if own:
        reader = DocumentReader.from_data_path(own, split="1,0,0", split_name="train", seed=seed, mmap=mmap,
                                               order_cache=cache)
    elif not a.data_path:
        raise ValueError("WLB-LLM reads Megatron indexed datasets: give --data-path [WEIGHT] PREFIX ...")
    else:
        reader = DocumentReader.from_data_path(a.data_path, split=split_of(a), split_name=split_name, seed=seed,
                                               mmap=mmap, order_cache=cache)
    if a.padded_vocab_size:  # the embedding's rows (set by Megatron's tokenizer build)
        try:
            reader.check_vocabulary(int(a.padded_vocab_size), "--vocab-size / the tokenizer")
        except OutOfVocabulary as exc:
            raise StartupError(f"megatron_wlb: {exc}") from None
    return reader


def split_of(args: Any) -> str:
    """``--split``, or the reader's default split."""
    return MegatronArgs.of(args).split or DEFAULT_SPLIT


def iterations_for(args: Any, split_name: str) -> int:
    """Iterations Megatron runs on a split: train_iters, all evaluations' eval_iters, or one test pass."""
    a = MegatronArgs.of(args)
    gbs = int(a.global_batch_size)
    train = int(a.train_iters) if a.train_iters else -(-int(a.train_samples or 0) // gbs)
    if split_name == "train":
        return train
    eval_iters = int(a.eval_iters or 0)
    if split_name == "valid":
        interval = int(a.eval_interval or 0) or max(train, 1)
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
    a = MegatronArgs.of(args)
    if settings.cp_sharding == DYNAMIC_SHARDING:  # each micro-batch carries its own group's layout (dynamic_pool)
        return CPSharding()
    return CPSharding(layout=settings.cp_sharding, cp_size=a.cp, cp_rank=cp_rank, sequence_multiple=a.cp * a.sp,
                      rank_multiple=a.sp, te_attention=settings.cp_sharding == "per-document-te", cost=cost)


def dynamic_pool(args: Any, settings: WlbSettings, config: Any, dp_rank: int, cp_rank: int,
                 cost: CostModel) -> DynamicPool | None:
    """With ``--wlb-cp-sharding dynamic``: this rank's slot of its stage's DP x CP pool (slot = dp_rank x CP +
    cp_rank, the order of Megatron's DP x CP group), each slot holding at most a fixed CP rank's share of the
    packer's capacity; else None."""
    if settings.cp_sharding != DYNAMIC_SHARDING:
        return None
    a = MegatronArgs.of(args)
    return DynamicPool(slots=a.dp * a.cp, slot=dp_rank * a.cp + cp_rank,
                       max_tokens_per_rank=-(-config.capacity_var // a.cp), cost=cost, rank_multiple=a.sp)


def build_train_iterator(args: Any, settings: WlbSettings, dp_rank: int, cp_rank: int = 0, *,
                         on_batch: Callable | None = None, reader: DocumentReader | None = None,
                         split_name: str = "train") -> WlbDataIterator:
    """This rank's ``WlbDataIterator`` for Megatron's ``args`` (pure: same inputs, same plans, any rank).

    ``split_name`` "valid"/"test" builds the evaluation iterators the same way over those splits. ``--sft``
    reads Megatron's SFT jsonl as ``SFTDataset``'s samples' conversations (``sft.sft_reader``), with their labels. With
    ``--wlb-pieces concat-and-cut`` the training split reads Megatron's own GPTDataset samples
    (``gpt_samples``) unless a ``reader`` is given; evaluation keeps the document reader.
    """
    a = MegatronArgs.of(args)
    config = iterator_packing_config(args, settings, split_name, reader)
    megatron_samples = config.pieces == "concat-and-cut" and split_name == "train" and reader is None
    cost = cost_model_from_args(args, settings)  # Megatron's own args: the MoE flags are read from them
    packer = make_packer(settings.packer, config, cost)
    sharding = cp_sharding_from_args(args, settings, cp_rank, cost)
    dynamic = dynamic_pool(args, settings, config, dp_rank, cp_rank, cost)
    if megatron_samples:
        # Megatron's own GPTDataset samples, from the sample its sampler would give next (a resumed stock
        # job's consumed samples; a resumed balanced one opens its saved position instead)
        from megatron_wlb.megatron.data.gpt_datasets import build_train_dataset  # lazy: it imports Megatron

        try:
            dataset = build_train_dataset(args)  # Megatron's own helpers read its args namespace
        except (OSError, EOFError, ValueError, RuntimeError) as exc:  # a missing or damaged cache file, an empty
            # train split, or another rank that stopped for one of them (gloo: its connection closed)
            if isinstance(exc, StartupError):
                raise
            raise StartupError(f"megatron_wlb: {dataset_build_problem(args, exc)}") from None
        if not a.dataloader_inter_document_masking:
            problem = eod_problem(dataset)
            if problem is not None:
                raise StartupError(f"megatron_wlb: {problem}")
        samples = MegatronSamples(dataset, vocab_size=a.padded_vocab_size)
        return WlbDataIterator(None, samples.stream(int(a.consumed_train_samples or 0)), packer,
                               dp_rank, sharding, on_batch=on_batch, read_piece=samples.piece,
                               sample_identity=SampleIdentity(dataset, samples.seq_len), dynamic=dynamic)
    if a.sft and reader is None:  # conversations from Megatron's SFT jsonl, each with its own labels and loss mask
        try:  # a refused jsonl, tokenizer or cache is one line on every rank, never a traceback
            reader, read_piece = sft_reader(args, split_name, print_fn=lambda line: print_rank0(f"> {line}"),
                                            samples=settings.sft_samples)
            if a.padded_vocab_size:
                reader.check_vocabulary(int(a.padded_vocab_size), "--vocab-size / the tokenizer")
        except (SftInputError, SftCacheError) as exc:
            raise StartupError(f"megatron_wlb: {exc}") from None
        except ValueError as exc:  # the reader's split and vocabulary checks
            raise StartupError(f"megatron_wlb: {str(exc).splitlines()[0]}") from None
        return WlbDataIterator(reader, reader.stream(stream_tokens_for(args, config, split_name)), packer, dp_rank,
                               sharding, on_batch=on_batch, read_piece=read_piece, dynamic=dynamic)
    reader = reader if reader is not None else reader_from_args(args, split_name)
    return WlbDataIterator(reader, reader.stream(stream_tokens_for(args, config, split_name)), packer, dp_rank,
                           sharding, on_batch=on_batch, dynamic=dynamic)


def iterator_packing_config(args: Any, settings: WlbSettings, split_name: str = "train",
                            reader: DocumentReader | None = None) -> Any:
    """The ``PackingConfig`` ``build_train_iterator`` packs with (what the start-up agreement compares before any
    dataset is built): with Megatron's own samples no sample is read before its iteration by default."""
    config = packing_config_from_args(args, settings)
    megatron_samples = config.pieces == "concat-and-cut" and split_name == "train" and reader is None
    if megatron_samples and config.read_ahead is None:
        config = dataclasses.replace(config, read_ahead=False)
    return config


def the_train_iterator_builder() -> Callable[..., WlbDataIterator]:
    """``megatron_wlb.megatron.build_train_iterator`` as it is now (looked up at call time: a benchmark may
    substitute its own, ``benchmarks/paired_train.py``)."""
    return sys.modules["megatron_wlb.megatron"].build_train_iterator  # the package's attribute, not this module's


def split_is_empty(args: Any, split_name: str) -> bool:
    """Whether ``--split`` gives ``split_name`` no share (and no ``--{split}-data-path`` is given)."""
    a = MegatronArgs.of(args)
    if a.data_path_of(split_name) or not a.data_path:
        return False
    fractions = parse_split(split_of(a))
    return fractions[{"train": 0, "valid": 1, "test": 2}[split_name]] == 0


def pinned_tp_rank_batch(batch: RankMicroBatch) -> dict[str, Any]:
    """One ``RankMicroBatch``, uploaded, as the pinned ``pretrain_gpt.get_batch`` reads its TP-rank batch.

    The params are handed out (``cp_hooks.hand_out``) and taken back by ``get_thd_batch_on_this_cp_rank``,
    to which that ``get_batch`` hands the ``cu_seqlens``; ``max_seqlen`` is the host tensor its ``dim()`` check
    reads. Key order: it returns ``(*batch.values(), packed_seq_params)`` after
    popping the metadata keys, i.e. tokens, labels, loss_mask, attention_mask, position_ids.
    """
    from megatron_wlb.megatron.hooks.cp_hooks import (
        pinned_batch_fields,  # lazy: torch and Megatron, not at package import
    )

    return pinned_batch_fields(batch)


def pretrain_gpt_batch(data_iterator: Any, keys: list[str]) -> list[Any]:
    """This rank's next micro-batch for a core 0.19 ``pretrain_gpt.get_batch`` (patched: ``patches/core_v0.19.0``),
    as the values of its ``BATCH_KEYS`` in order: tokens, labels, loss_mask and position_ids uploaded once;
    ``cu_seqlens`` the record's, with which the patched ``forward_step`` takes back the params handed out
    (``cp_hooks.packed_seq_params_of``), as the pinned 0.16 path's THD hook does; ``max_seqlen`` the host
    tensor; attention_mask, cu_seqlens_padded, hybrid_cp_group and local_cp_size None. Every rank reads its own
    copy (no TP broadcast), middle pipeline stages included."""
    from megatron_wlb.megatron.hooks.cp_hooks import pinned_batch_fields  # lazy: imports torch

    fields = pinned_batch_fields(next(data_iterator))
    unknown = sorted(set(keys) - set(fields) - {"attention_mask", "cu_seqlens_padded", "hybrid_cp_group",
                                                 "local_cp_size"})
    if unknown:
        raise RuntimeError(f"megatron_wlb: this pretrain_gpt.py's get_batch returns {', '.join(unknown)}, which "
                           "WLB-LLM's micro-batches do not carry; use the patch of its release (patches/) or "
                           "python -m megatron_wlb.megatron.entry.launcher")
    return [fields.get(key) for key in keys]


__all__ = ["build_train_iterator", "cp_sharding_from_args", "iterations_for", "iterator_packing_config",
           "pinned_tp_rank_batch", "pretrain_gpt_batch", "reader_from_args", "split_is_empty", "split_of",
           "stream_tokens_for", "the_train_iterator_builder"]
