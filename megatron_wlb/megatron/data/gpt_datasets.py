"""megatron-core's GPT datasets as ``pretrain_gpt.py`` builds them: the ``GPTDatasetConfig`` of a job's args and its
train dataset (``GPTDataset`` or ``BlendedDataset``), for the balanced concat-and-cut intake (``gpt_samples``)
and ``wlb analyze``'s sample orders (``sample_orders``).

Imports megatron-core at the top: callers import this module when they need Megatron's datasets (the package
imports it without Megatron). ``megatron.training`` stays lazy: only a training job has it set
up (Python shims, global args), and ``wlb analyze`` needs megatron-core alone.
"""

from __future__ import annotations

import dataclasses
from typing import Any

from megatron.core.datasets.blended_megatron_dataset_builder import BlendedMegatronDatasetBuilder
from megatron.core.datasets.gpt_dataset import GPTDataset, GPTDatasetConfig
from megatron.core.datasets.utils import get_blend_from_list

from megatron_wlb.megatron.args.megatron_args import MegatronArgs


def gpt_dataset_config(args: Any, tokenizer: Any, blends: tuple[Any, Any] | None = None) -> Any:
    """megatron-core's ``GPTDatasetConfig`` as ``pretrain_gpt.core_gpt_dataset_config_from_args`` builds it
    (the fields this release's config has), with no dense attention mask (we never use it). ``blends``
    (blend, blend per split) replaces the ones ``args``' data paths give."""
    blend, blend_per_split = blends if blends is not None else _blends(args)
    a = MegatronArgs.of(args)
    values: dict[str, Any] = {
        "random_seed": int(a.seed), "sequence_length": int(a.seq_length), "blend": blend,
        "blend_per_split": blend_per_split, "split": a.split,
        "multiple_validation_sets": a.multiple_validation_sets,
        "full_validation": a.full_validation,
        "num_dataset_builder_threads": a.num_dataset_builder_threads,
        "path_to_cache": a.data_cache_path,
        "mmap_bin_files": a.mmap_bin_files, "tokenizer": tokenizer,
        "reset_position_ids": bool(a.reset_position_ids),
        "reset_attention_mask": bool(a.reset_attention_mask),
        "eod_mask_loss": bool(a.eod_mask_loss), "create_attention_mask": False,
        "object_storage_cache_path": a.object_storage_cache_path,
        "mid_level_dataset_surplus": a.mid_level_dataset_surplus,
        "allow_ambiguous_pad_tokens": a.allow_ambiguous_pad_tokens,
        "context_parallel_size": a.context_parallel_size,
        "data_parallel_size": a.data_parallel_size,
        "sequence_parallel_size": a.tp * bool(a.sequence_parallel),
        "inter_document_masking": bool(a.dataloader_inter_document_masking),
        "defer_npy_index_mmap": a.defer_npy_index_mmap,
        "fast_cache_load": a.fast_cache_load,
    }
    keep_none = {"blend", "blend_per_split", "split", "path_to_cache"}
    accepted = {f.name for f in dataclasses.fields(GPTDatasetConfig) if f.init}
    return GPTDatasetConfig(**{k: v for k, v in values.items() if k in accepted and (v is not None or k in keep_none)})


def _blends(args: Any) -> tuple[Any, Any]:
    try:
        from megatron.training.utils import (
            get_blend_and_blend_per_split,  # lazy: megatron.training, a training job's only
        )
    except ImportError:  # pragma: no cover - every supported release has it
        a = MegatronArgs.of(args)
        per_split = [get_blend_from_list(a.data_path_of(s)) for s in ("train", "valid", "test")]
        return get_blend_from_list(a.data_path), (per_split if any(per_split) else None)
    return get_blend_and_blend_per_split(args)


def megatron_num_samples(args: Any) -> tuple[int, Any, Any]:
    """(train, valid, test) samples, as Megatron's ``get_train_valid_test_num_samples`` computes them."""
    try:
        from megatron.training.training import (
            get_train_valid_test_num_samples,  # lazy: megatron.training, a training job's only
        )

        train, valid, test = get_train_valid_test_num_samples()
        return int(train), valid, test
    except (ImportError, AttributeError, AssertionError):
        a = MegatronArgs.of(args)
        gbs = int(a.global_batch_size)
        train = int(a.train_samples) if a.train_samples else int(a.train_iters) * gbs
        eval_iters = int(a.eval_iters or 0)
        return train, eval_iters * gbs, eval_iters * gbs


def build_train_dataset(args: Any, tokenizer: Any = None, num_samples: tuple[int, Any, Any] | None = None) -> Any:
    """Megatron's train dataset of this job (``GPTDataset`` or ``BlendedDataset``), built on every rank."""
    if tokenizer is None:
        from megatron.training import get_tokenizer  # lazy: megatron.training, a training job's only (docstring)

        tokenizer = get_tokenizer()
    sizes = list(num_samples if num_samples is not None else megatron_num_samples(args))
    train, _, _ = BlendedMegatronDatasetBuilder(GPTDataset, sizes, lambda: True,
                                                gpt_dataset_config(args, tokenizer)).build()
    if train is None:
        raise ValueError(f"megatron_wlb: Megatron built no train dataset from --data-path with --split "
                         f"{MegatronArgs.of(args).split!r}: the balanced concat-and-cut trains Megatron's train "
                         "samples; give the train split a share (e.g. --split 98,2,0)")
    return train


__all__ = ["build_train_dataset", "gpt_dataset_config", "megatron_num_samples"]
