"""The balanced concat-and-cut intake: Megatron's own GPTDataset samples, regrouped for balance.

With ``--wlb-pieces concat-and-cut`` the training iterator does not read documents itself: it builds
megatron-core's ``GPTDataset`` (a ``BlendedDataset`` for a blend) with ``BlendedMegatronDatasetBuilder``
from the same ``GPTDatasetConfig`` fields, train-sample count, split, blend and ``--data-cache-path``
as ``pretrain_gpt.py`` (so the cached ``.npy`` indices are shared with the stock job), and reads the
samples ``MegatronPretrainingSampler`` would give: iteration i gets training positions
``[i * global_batch, (i + 1) * global_batch)``. Each sample is cut into pieces where Megatron's own
sample restarts its position ids (after every EOD token with ``--reset-position-ids``; at every
document with ``--dataloader-inter-document-masking``), and each piece's tokens, labels and loss mask
are Megatron's own (``dataset[j]``: the label of a window's last input is its ``seq_length + 1``-th
token; ``--eod-mask-loss`` as Megatron applies it). The packer only regroups the pieces into
variable-length micro-batches, deals them to DP ranks and orders them, with its bounded delay.

Megatron's own datasets are built by ``gpt_datasets`` (it imports Megatron); the package imports this module
without it.
"""

from __future__ import annotations

import glob
import os
from collections import OrderedDict
from typing import Any

import numpy as np

from megatron_wlb.cp.plan import Packed
from megatron_wlb.data.blend import parse_data_path
from megatron_wlb.data.reader import too_large_token
from megatron_wlb.data.samples import SAMPLE_CHUNK, GptIndices, SampleOrder, SampleStream, piece_sample
from megatron_wlb.megatron.args.megatron_args import MegatronArgs
from megatron_wlb.megatron.args.validation import MASKING_FLAGS

#: samples whose arrays the piece reader keeps (a micro-batch's pieces come from many samples)
SAMPLE_CACHE = 256
#: tokens a cursor cuts at a time when it reads samples to find their pieces
SEGMENT_TOKENS = 1 << 22

#: documents per indexed dataset whose last token ``eod_problem`` reads (evenly spaced, first and last included)
EOD_CHECK_DOCUMENTS = 64


def eod_problem(dataset: Any) -> str | None:
    """Why Megatron's ``--reset-*`` masking would find no document end in ``dataset``, or None.

    Those flags cut a sample where a token equals the tokenizer's EOD id; a corpus whose documents end
    with another id trains every window as one document, without a word, and there is nothing to
    balance. Reads the last token of up to ``EOD_CHECK_DOCUMENTS`` documents of each indexed dataset and
    compares it with the EOD id of the tokenizer the dataset was built with: fewer than half ending with it
    is refused (one hit among many misses is a coincidence, not an end-of-document marker)."""
    parts = list(dataset.datasets) if hasattr(dataset, "dataset_index") else [dataset]
    for part in parts:
        indexed, eod = part.dataset, int(part.config.tokenizer.eod)
        lengths = np.asarray(indexed.sequence_lengths)
        picks = np.unique(np.linspace(0, lengths.size - 1, min(EOD_CHECK_DOCUMENTS, lengths.size)).astype(np.int64))
        last = [int(indexed.get(int(i), offset=int(lengths[i]) - 1, length=1)[0]) for i in picks if lengths[i] > 0]
        ending = sum(x == eod for x in last)
        if last and ending * 2 < len(last):  # most documents would run into the next: not a few odd ones
            others = sorted({x for x in last if x != eod})
            return (f"--reset-attention-mask --reset-position-ids cut documents at the tokenizer's EOD id {eod}, "
                    f"but {'none' if not ending else f'only {ending}'} of {len(last)} sampled documents of "
                    f"{indexed.path_prefix} ends with it (the others' last ids: "
                    f"{', '.join(map(str, others[:4]))}): most windows would train as one document; "
                    f"write the corpus with EOD {eod}, use the tokenizer it was written for, or mask with "
                    "--dataloader-inter-document-masking (documents from the .idx)")
    return None


def index_cache_folders(args: Any) -> list[str]:
    """Where megatron-core keeps this job's GPTDataset / BlendedDataset index files: ``--data-cache-path``, else
    a ``cache/GPTDataset_indices`` folder beside each dataset."""
    a = MegatronArgs.of(args)
    if a.data_cache_path:
        return [str(a.data_cache_path)]
    return [os.path.join(prefix, "cache", "GPTDataset_indices") for prefix, _ in parse_data_path(a.data_path or [])]


def dataset_build_problem(args: Any, exc: BaseException) -> str:
    """One line on why megatron-core could not build (or load) this job's train dataset (``build_train_dataset``
    raised ``exc``): a rank that found no index file where rank 0 built them, a damaged cached ``.npy``, an
    empty train split, or megatron-core's own message."""
    text = " ".join(str(exc).split())
    if text.startswith("megatron_wlb: "):
        return text[len("megatron_wlb: "):]
    folders = index_cache_folders(args)
    rank = os.environ.get("RANK", "0")
    if isinstance(exc, RuntimeError) and ("closed by peer" in text or "DistBackendError" in type(exc).__name__):
        return (f"rank {rank}: another rank stopped while megatron-core built the train dataset (its own line says "
                f"why; {type(exc).__name__}: {text[:160]})")
    if isinstance(exc, FileNotFoundError) and str(exc.filename or "").endswith((".npy", ".txt")):
        return (f"rank {rank} found no GPTDataset index file {exc.filename}: megatron-core builds the indices on "
                "rank 0 into --data-cache-path and the other ranks read them there, so every rank must name the same "
                f"(shared) --data-cache-path (this rank: {', '.join(folders)}) and describe the same dataset "
                "(--data-path, --split, --seed, --seq-length, --train-iters / --train-samples, tokenizer)")
    damaged = []
    for folder in folders:
        for path in sorted(glob.glob(os.path.join(folder, "*.npy"))):
            try:
                np.load(path, mmap_mode="r", allow_pickle=False)
            except (OSError, ValueError, EOFError) as bad:
                damaged.append(f"{path} ({' '.join(str(bad).split())[:80]})")
    if damaged:
        return (f"megatron-core cannot read its GPTDataset index cache: {'; '.join(damaged)} (a copy or write cut "
                "short?); remove the damaged files and rank 0 rebuilds them at the next start")
    paths = " ".join(MegatronArgs.of(args).data_path or [])
    return f"megatron-core could not build the train dataset of --data-path {paths} ({type(exc).__name__}: {text})"


def _loaded(dataset: Any) -> Any:
    """``dataset`` with its index arrays loaded (``--defer-npy-index-mmap`` loads them on first read)."""
    if getattr(dataset, "shuffle_index", None) is None and len(dataset):
        dataset._query_document_sample_shuffle_indices(0)
    return dataset


def sample_order(dataset: Any) -> SampleOrder:
    """megatron-core's index arrays of ``dataset`` (a ``GPTDataset`` or a ``BlendedDataset`` of them).
    The arrays are views of the dataset's memory maps, which close when it is freed: keep ``dataset``
    alive while the order is read (``MegatronSamples`` does; ``sample_orders`` copies the lengths)."""
    parts = list(dataset.datasets) if hasattr(dataset, "dataset_index") else [dataset]
    indices = tuple(GptIndices(d.document_index, d.sample_index, d.shuffle_index, d.dataset.sequence_lengths)
                    for d in map(_loaded, parts))
    seq_len = int(parts[0].config.sequence_length)
    if hasattr(dataset, "dataset_index"):
        if dataset.dataset_index is None and len(dataset):
            dataset[0]  # loads the deferred blend indices
        return SampleOrder(indices, seq_len, dataset.dataset_index, dataset.dataset_sample_index)
    return SampleOrder(indices, seq_len)


class MegatronSamples:
    """Megatron's train samples read through ``dataset[j]``: how each is cut into pieces (where its
    position ids restart) and each piece's tokens, labels and loss mask, Megatron's own."""

    def __init__(self, dataset: Any, cache: int = SAMPLE_CACHE, vocab_size: int | None = None):
        self.dataset = dataset
        #: the model's vocabulary: a piece holding a token id at or beyond it is refused when read (one line)
        self.vocab_size = int(vocab_size) if vocab_size else None
        self.seq_len = int((dataset.datasets[0] if hasattr(dataset, "dataset_index") else dataset)
                           .config.sequence_length)
        self.cache = int(cache)
        self._samples: OrderedDict[int, tuple[np.ndarray, ...]] = OrderedDict()

    def __len__(self) -> int:
        return len(self.dataset)

    def sample(self, position: int) -> tuple[np.ndarray, ...]:
        """(tokens, labels, loss_mask, position_ids) of the sample at training ``position``."""
        held = self._samples.get(position)
        if held is not None:
            self._samples.move_to_end(position)
            return held
        item = self.dataset[int(position)]
        held = tuple(np.asarray(item[k].numpy() if hasattr(item[k], "numpy") else item[k])
                     for k in ("tokens", "labels", "loss_mask", "position_ids"))
        self._samples[position] = held
        if len(self._samples) > self.cache:
            self._samples.popitem(last=False)
        return held

    def segments(self, positions: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        """``SegmentFn``: each sample's pieces start where its position ids restart at 0."""
        counts, lengths = [], []
        for j in np.asarray(positions, dtype=np.int64).tolist():
            item = self.dataset[int(j)]
            pos = np.asarray(item["position_ids"])
            starts = np.flatnonzero(pos == 0)
            if not starts.size or starts[0] != 0:
                raise ValueError(f"Megatron's sample {j} does not start at position 0; its position ids cannot "
                                 "be regrouped per document (check " + MASKING_FLAGS + ")")
            counts.append(starts.size)
            lengths.append(np.diff(np.append(starts, pos.size)))
        return np.asarray(counts, dtype=np.int64), np.concatenate(lengths) if lengths else np.zeros(0, np.int64)

    def piece(self, stream_id: int, offset: int, length: int) -> Packed:
        """Tokens, labels and loss mask of ``length`` tokens from ``offset`` of the piece ``stream_id``."""
        j, start = piece_sample(stream_id, self.seq_len)
        tokens, labels, loss_mask, positions = self.sample(j)
        a, b = start + offset, start + offset + length
        if b > tokens.size:
            raise ValueError(f"piece {stream_id} ({length} tokens at {a}) runs past sample {j} of {tokens.size}")
        if positions[a] != offset or not np.array_equal(positions[a:b], np.arange(offset, offset + length)):
            raise ValueError(f"piece {stream_id} of sample {j}: Megatron's position ids do not run 0, 1, ... "
                             "over it (its document boundaries moved)")
        if self.vocab_size is not None and b > a:
            top = max(int(tokens[a:b].max()), int(labels[a:b].max()))
            if top >= self.vocab_size:
                raise too_large_token(f"Megatron's sample {j} (piece {stream_id})", top, self.vocab_size,
                                      "--vocab-size / the tokenizer")
        return tokens[a:b].astype(np.int64), labels[a:b].astype(np.int64), loss_mask[a:b].astype(np.float32)

    def stream(self, first_sample: int, fingerprint: str | None = None) -> SampleStream:
        """Megatron's samples from training position ``first_sample`` (a resumed job's consumed samples).
        Under ``--dataloader-inter-document-masking`` alone the pieces are the documents of megatron-core's
        index arrays (``SampleOrder.segments``: no token is read to plan); under the ``--reset-*`` flags
        the boundaries are EOD tokens, so planning reads each sample (``segments``)."""
        name = fingerprint if fingerprint is not None else str(getattr(self.dataset, "unique_description_hash", ""))
        config = (self.dataset.datasets[0] if hasattr(self.dataset, "dataset_index") else self.dataset).config
        if getattr(config, "inter_document_masking", False) and not (config.reset_position_ids
                                                                     or config.reset_attention_mask):
            return SampleStream(sample_order(self.dataset).segments, self.seq_len, int(first_sample), len(self),
                                name)
        return SampleStream(self.segments, self.seq_len, int(first_sample), len(self), name,
                            chunk=max(1, min(SAMPLE_CHUNK, SEGMENT_TOKENS // self.seq_len)))
