"""Megatron GPTDataset's sample order for a corpus outside a training job (``wlb analyze``, benchmarks).

The balanced concat-and-cut trains the samples megatron-core's ``GPTDataset`` gives, in
``MegatronPretrainingSampler`` order (``megatron_wlb.data.samples``). To simulate it, and its
concat-and-cut baseline, on a user's corpus we build those samples' indices with megatron-core
itself, never with a copy of its index building:

- a ``.bin/.idx`` prefix or a ``--data-path`` blend: ``BlendedMegatronDatasetBuilder(GPTDataset, ...)``
  as ``pretrain_gpt.py`` builds it (its low-level dataset is megatron-core's ``IndexedDataset(prefix)``);
- a bare array of document lengths: ``GPTDataset`` over ``LengthsDataset``, a lengths-only stand-in
  for ``IndexedDataset`` (the index building reads only ``sequence_lengths``, ``document_indices``
  and ``path_prefix``; no token is ever read).

Each returns a ``SampleOrder`` (``gpt_samples.sample_order``): its ``segments`` cut every sample at
document boundaries, and ``sample_stream`` turns it into the piece stream the packers read.
megatron-core and torch are imported here, at the top; callers import this module lazily, so the core stays
importable without them.
"""

from __future__ import annotations

import dataclasses
import tempfile
import types
from collections.abc import Sequence
from typing import Any

import numpy as np
from megatron.core.datasets.blended_megatron_dataset_builder import BlendedMegatronDatasetBuilder
from megatron.core.datasets.gpt_dataset import GPTDataset
from megatron.core.datasets.utils import Split, get_blend_from_list

from megatron_wlb.data.samples import SampleOrder, SampleStream, order_fingerprint
from megatron_wlb.megatron.data.gpt_datasets import gpt_dataset_config
from megatron_wlb.megatron.data.gpt_samples import sample_order

try:
    from megatron.core.tokenizers.text.libraries.null_tokenizer import NullTokenizer
except ImportError:  # pragma: no cover - releases before megatron.core.tokenizers
    from megatron.training.tokenizer.tokenizer import _NullTokenizer as NullTokenizer

#: the split of a corpus that is all training data (Megatron's ``--split``)
TRAIN_ONLY = "1,0,0"
#: vocabulary of the null tokenizer the lengths-only config names (only its EOD/pad ids are read)
NULL_VOCAB = 1 << 17


class LengthsDataset:
    """What ``GPTDataset`` reads of megatron-core's ``IndexedDataset`` to build its indices: one
    sequence per document of ``lengths`` tokens. Reading tokens from it is an error (there are none)."""

    def __init__(self, lengths: np.ndarray | Sequence[int], path_prefix: str = "lengths"):
        d = np.asarray(lengths, dtype=np.int64)
        if d.ndim != 1 or d.size == 0 or int(d.min()) < 1 or int(d.max()) > np.iinfo(np.int32).max:
            raise ValueError(f"document lengths must be a non-empty 1-D array of 1..{np.iinfo(np.int32).max} "
                             f"tokens, got shape {d.shape}" + (f", range {int(d.min())}..{int(d.max())}" if d.size
                                                               else ""))
        self.sequence_lengths = d.astype(np.int32)
        self.document_indices = np.arange(d.size + 1, dtype=np.int64)
        self.path_prefix = path_prefix

    def __len__(self) -> int:
        return int(self.sequence_lengths.size)

    def get(self, idx: int, offset: int = 0, length: int | None = None) -> np.ndarray:
        raise TypeError("a LengthsDataset holds document lengths only, no tokens: build the GPTDataset from a "
                        ".bin/.idx prefix to read samples")


def null_tokenizer(vocab_size: int = NULL_VOCAB) -> Any:
    """megatron-core's ``NullTokenizer`` (the config requires a tokenizer; the indices do not use it)."""
    return NullTokenizer(vocab_size)


def gpt_config(seq_len: int, seed: int, *, blend: tuple[list[str], list[float] | None], split: str = TRAIN_ONLY,
               path_to_cache: str | None = None) -> Any:
    """The ``GPTDatasetConfig`` of a job that masks per document (``--reset-position-ids
    --reset-attention-mask``, what the balanced concat-and-cut requires), no dense mask."""
    if seq_len < 1:
        raise ValueError(f"seq_len must be a positive token count, got {seq_len}")
    job = types.SimpleNamespace(seed=int(seed), seq_length=int(seq_len), split=split, data_cache_path=path_to_cache,
                                reset_position_ids=True, reset_attention_mask=True, eod_mask_loss=False)
    return gpt_dataset_config(job, null_tokenizer(), blends=(blend, None))


def lengths_dataset(lengths: np.ndarray | Sequence[int], seq_len: int, num_samples: int, seed: int, *,
                    split: str = TRAIN_ONLY, path_to_cache: str | None = None, name: str = "lengths") -> Any:
    """megatron-core's ``GPTDataset`` (train split) over documents of ``lengths`` tokens: its
    ``document_index`` / ``sample_index`` / ``shuffle_index`` exactly as for a ``.bin/.idx`` of those
    documents. ``path_to_cache`` None: built in a temporary folder that is removed afterwards."""
    low = LengthsDataset(lengths, name)
    if num_samples < 1:
        raise ValueError(f"num_samples must be >= 1 (iterations x global batch), got {num_samples}")
    with tempfile.TemporaryDirectory(prefix="wlb-gpt-indices-") as tmp:
        config = gpt_config(seq_len, seed, blend=([name], None), split=split, path_to_cache=path_to_cache or tmp)
        beg_end = config.split_matrix[Split.train.value]
        if beg_end is None:
            raise ValueError(f"--split {split!r} gives the train split no documents; give it a share, e.g. "
                             f"{TRAIN_ONLY!r}")
        beg, end = (int(round(x * float(len(low)))) for x in beg_end)  # as BlendedMegatronDatasetBuilder splits
        if end <= beg:
            raise ValueError(f"--split {split!r} leaves the train split none of the {len(low)} documents")
        dataset = GPTDataset(low, name, np.arange(beg, end, dtype=np.int32), int(num_samples), Split.train, config)
        if path_to_cache is None:  # the arrays must outlive the temporary folder
            for attr in ("document_index", "sample_index", "shuffle_index"):
                setattr(dataset, attr, np.array(getattr(dataset, attr)))
    return dataset


def indexed_dataset(data_path: Sequence[str], seq_len: int, num_samples: int, seed: int, *,
                    split: str = TRAIN_ONLY, path_to_cache: str | None = None) -> Any:
    """megatron-core's train dataset of ``--data-path`` (``PREFIX`` or ``W1 P1 W2 P2 ...``), built as
    ``pretrain_gpt.py`` builds it: a ``GPTDataset`` over ``IndexedDataset(prefix)``, or a
    ``BlendedDataset`` of them. ``path_to_cache`` None: a temporary folder (``--data-cache-path`` of the
    stock job shares its cached indices instead)."""
    if num_samples < 1:
        raise ValueError(f"num_samples must be >= 1 (iterations x global batch), got {num_samples}")
    blend = get_blend_from_list(list(data_path))
    if blend is None:
        raise ValueError("--data-path is empty; give PREFIX or W1 PREFIX1 W2 PREFIX2 ...")
    with tempfile.TemporaryDirectory(prefix="wlb-gpt-indices-") as tmp:
        config = gpt_config(seq_len, seed, blend=blend, split=split, path_to_cache=path_to_cache or tmp)
        train, _, _ = BlendedMegatronDatasetBuilder(GPTDataset, [int(num_samples), 0, 0], lambda: True,
                                                    config).build()
        if train is None:
            raise ValueError(f"megatron-core built no train dataset from --data-path {' '.join(data_path)} with "
                             f"--split {split!r}")
        if path_to_cache is None:
            _load_in_memory(train)
    return train


def _load_in_memory(dataset: Any) -> None:
    """Copy a dataset's (memory-mapped) index arrays into memory, so they outlive their cache folder."""
    for d in (list(dataset.datasets) if hasattr(dataset, "dataset_index") else [dataset]):
        for attr in ("document_index", "sample_index", "shuffle_index"):
            setattr(d, attr, np.array(getattr(d, attr)))
    for attr in ("dataset_index", "dataset_sample_index"):
        if getattr(dataset, attr, None) is not None:
            setattr(dataset, attr, np.array(getattr(dataset, attr)))


def gpt_sample_order(corpus: np.ndarray | Sequence[str] | str, seq_len: int, num_samples: int, seed: int, *,
                     split: str = TRAIN_ONLY, path_to_cache: str | None = None) -> tuple[SampleOrder, str]:
    """(megatron-core's sample order of ``corpus``, its fingerprint): ``corpus`` is an array of document
    lengths, a ``.bin/.idx`` prefix, or a ``--data-path`` list (one prefix or a weighted blend).
    Holds at least ``num_samples`` samples (``iterations x global batch``; GPTDataset adds epochs)."""
    if isinstance(corpus, np.ndarray):
        dataset = lengths_dataset(corpus, seq_len, num_samples, seed, split=split, path_to_cache=path_to_cache)
    else:
        paths = [corpus] if isinstance(corpus, str) else list(corpus)
        dataset = indexed_dataset(paths, seq_len, num_samples, seed, split=split, path_to_cache=path_to_cache)
    name = str(getattr(dataset, "unique_description_hash", "")) or order_fingerprint(seq_len, num_samples, seed)
    order = sample_order(dataset)
    # ``sizes`` is a view into the IndexedDataset's memory map, which closes when the dataset is freed
    # (reading it then crashes the process): keep a copy, the dataset is not kept
    return dataclasses.replace(order, datasets=tuple(dataclasses.replace(d, sizes=np.array(d.sizes))
                                                     for d in order.datasets)), name


def sample_stream(order: SampleOrder, fingerprint: str = "", end: int | None = None) -> SampleStream:
    """The pieces of ``order``'s samples ``0 .. end - 1`` (default: every sample built) in training
    order, cut at document boundaries: what the packers read (``packer.pack_source(stream.cursor())``)."""
    stop = len(order) if end is None else min(int(end), len(order))
    return SampleStream(order.segments, order.seq_len, 0, stop, fingerprint)
