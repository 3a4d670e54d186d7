"""Document-level data path for Megatron-LM: indexed datasets -> document stream -> packer -> THD batches.

Megatron's ``GPTDataset`` concatenates documents and cuts them at ``--seq-length``; WLB-LLM packs
whole documents instead. This module reads the same ``PREFIX.bin/.idx`` files
(``megatron.core.datasets.indexed_dataset.IndexedDataset``) at document level:

- ``DocumentReader``: one or more prefixes (a blend, weighted like ``--data-path 0.7 A 0.3 B``), a
  train/valid/test split by document ranges (``--split 969,30,1``), and an epoch-shuffled order from
  a seed. ``stream(tokens)`` returns the first documents of that order (ids and lengths) covering
  ``tokens`` tokens; a longer request returns a longer stream with the same prefix, so a resumed
  run with more iterations replays the same documents.
- Stream ids are global and stable: ``epoch * num_documents + global_doc``, where ``global_doc`` is
  the dataset's offset (datasets in ``--data-path`` order) plus the document's index in its .idx.
- ``build_micro_batch``: one packed micro-batch in THD form (see ``docs/megatron.md``):
  ``tokens``/``labels``/``loss_mask``/``position_ids`` ``[1, T]``, ``cu_seqlens`` int32
  ``[pieces + 1]``, ``max_seqlen``. A piece of d tokens gives d input tokens; ``labels[i]`` is the
  next token of the same piece; the last token of every piece has ``loss_mask`` 0 (label 0).
  Position ids restart at 0 for every piece (also for the later pieces of a split document).
- ``WlbDataIterator``: the per-rank iterator Megatron's training loop pulls micro-batches from. Every
  rank builds the same reader, stream and packer, so every rank computes the same global plan
  without communication; DP rank r yields ``GlobalBatch.for_dp_rank(r)``, i.e. exactly
  ``num_microbatches`` micro-batches per iteration on every TP/CP/PP rank.
"""

from __future__ import annotations

import hashlib
import json
import math
import os
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np

from megatron_wlb.packing.types import GlobalBatch, MicroBatch

SPLIT_NAMES: tuple[str, ...] = ("train", "valid", "test")
STREAM_STATE_VERSION = 1


# -- Megatron's data flags ---------------------------------------------------------------------------
def parse_data_path(data_path: Sequence[str] | str) -> list[tuple[str, float]]:
    """``--data-path`` tokens -> [(prefix, weight)]: ``A B`` (equal weights) or ``0.7 A 0.3 B``
    (``megatron_wlb.data.blend.parse_data_path``, the one parser)."""
    from megatron_wlb.data.blend import parse_data_path as parse

    return [(prefix, 1.0 if weight is None else weight) for prefix, weight in parse(data_path)]


def parse_split(split: str | Sequence[float]) -> tuple[float, float, float]:
    """``"969,30,1"`` (or ``"98/2/0"``) -> normalised train/valid/test fractions."""
    if isinstance(split, str):
        parts = [p for p in split.replace("/", ",").split(",") if p.strip()]
        try:
            values = [float(p) for p in parts]
        except ValueError:
            raise ValueError(f"--split {split!r}: give comma-separated weights such as 969,30,1") from None
    else:
        values = [float(v) for v in split]
    if not 1 <= len(values) <= 3 or not all(math.isfinite(v) and v >= 0 for v in values) or sum(values) <= 0:
        raise ValueError(f"--split {split!r}: give up to three non-negative weights (train,valid,test) "
                         "with a positive sum")
    values += [0.0] * (3 - len(values))
    total = sum(values)
    return (values[0] / total, values[1] / total, values[2] / total)


def split_ranges(num_documents: int, split: str | Sequence[float]) -> list[tuple[int, int]]:
    """Document ranges [begin, end) of train, valid and test (like Megatron's split indices)."""
    fractions = parse_split(split)
    bounds = [0]
    acc = 0.0
    for f in fractions:
        acc += f
        bounds.append(int(round(acc * num_documents)))
    bounds[-1] = num_documents
    for i in range(1, 4):
        bounds[i] = max(bounds[i], bounds[i - 1])
    return [(bounds[i], bounds[i + 1]) for i in range(3)]


# -- reading documents -------------------------------------------------------------------------------
class IndexedSource:
    """Documents of one ``IndexedDataset``: a document spans ``document_indices[i]:[i + 1]`` sequences."""

    def __init__(self, dataset: Any, prefix: str = ""):
        self.dataset = dataset
        self.prefix = prefix or str(getattr(dataset, "path_prefix", ""))
        from megatron_wlb.data.indexed import document_lengths

        doc_idx = np.asarray(dataset.document_indices, dtype=np.int64)
        self.lengths = document_lengths(dataset.sequence_lengths, doc_idx, f"{self.prefix}.idx")
        self.first_sequence = doc_idx[:-1]

    @classmethod
    def open(cls, prefix: str, mmap: bool = True) -> IndexedSource:
        """Open ``prefix.bin/.idx`` with megatron-core's ``IndexedDataset``."""
        from megatron.core.datasets.indexed_dataset import IndexedDataset

        missing = [ext for ext in (".idx", ".bin") if not os.path.isfile(prefix + ext)]
        if missing:
            hint = f" (drop the extension: {prefix[:-4]})" if prefix.endswith((".bin", ".idx")) else ""
            raise ValueError(f"--data-path {prefix}: no {' / '.join(prefix + m for m in missing)}; give the "
                             f"prefix of a Megatron indexed dataset (PREFIX.bin + PREFIX.idx){hint}")
        from megatron_wlb.data.indexed import check_bin_matches_idx

        check_bin_matches_idx(prefix)  # a truncated .bin would feed garbage or fail mid-training, nameless
        return cls(IndexedDataset(prefix, mmap=mmap), prefix)

    @property
    def num_documents(self) -> int:
        return int(self.lengths.size)

    def read(self, doc: int, offset: int, length: int) -> np.ndarray:
        """Tokens ``[offset, offset + length)`` of document ``doc`` (its sequences are contiguous)."""
        if not (0 <= offset and offset + length <= self.lengths[doc]):
            raise ValueError(f"{self.prefix}: tokens [{offset}, {offset + length}) are outside document "
                             f"{doc} of {self.lengths[doc]} tokens")
        out = self.dataset.get(int(self.first_sequence[doc]), offset=int(offset), length=int(length))
        if isinstance(out, tuple):
            out = out[0]
        return np.asarray(out, dtype=np.int64)


@dataclass(frozen=True)
class DocumentStream:
    """The reader's order of documents: stable stream ids and their lengths, in arrival order."""

    doc_ids: np.ndarray
    lengths: np.ndarray

    @property
    def tokens(self) -> int:
        return int(self.lengths.sum())

    def __len__(self) -> int:
        return int(self.doc_ids.size)

    def digest(self, count: int | None = None) -> str:
        """sha256 of the first ``count`` entries (all by default): checks a restored run's stream."""
        count = len(self) if count is None else count
        h = hashlib.sha256()
        h.update(np.ascontiguousarray(self.doc_ids[:count], dtype=np.int64).tobytes())
        h.update(np.ascontiguousarray(self.lengths[:count], dtype=np.int64).tobytes())
        return h.hexdigest()


class DocumentReader:
    """Blend + split + epoch-shuffled order over indexed datasets, at document level.

    ``sources``: ``IndexedSource`` objects (or prefixes, opened with megatron-core) with weights.
    Blending is by tokens: document k of dataset i is scheduled at virtual time
    ``tokens_before_k / weight_i`` (weights normalised), and the stream is all documents in that
    order, so each dataset contributes tokens in proportion to its weight. Within a dataset, the
    documents of the chosen split range are visited in a fresh permutation every epoch
    (``numpy.random.default_rng([seed, dataset, epoch])``), or in file order if ``shuffle`` is off.
    """

    def __init__(self, sources: Sequence[tuple[IndexedSource | str, float]], split: str = "969,30,1",
                 split_name: str = "train", seed: int = 1234, shuffle: bool = True, mmap: bool = True):
        if not sources:
            raise ValueError("DocumentReader needs at least one (source, weight)")
        if split_name not in SPLIT_NAMES:
            raise ValueError(f"split_name={split_name!r}; choose one of {', '.join(SPLIT_NAMES)}")
        self.sources: list[IndexedSource] = []
        weights = []
        for src, w in sources:
            if not w > 0:
                raise ValueError(f"blend weight {w!r} of {src!r} must be positive")
            self.sources.append(IndexedSource.open(src, mmap) if isinstance(src, str) else src)
            weights.append(float(w))
        self.weights = np.asarray(weights) / sum(weights)
        self.split = split
        self.split_name = split_name
        self.seed = int(seed)
        self.shuffle = shuffle
        sizes = [s.num_documents for s in self.sources]
        self.offsets = np.concatenate([[0], np.cumsum(sizes)]).astype(np.int64)
        self.num_documents = int(self.offsets[-1])
        which = SPLIT_NAMES.index(split_name)
        self.ranges = [split_ranges(n, split)[which] for n in sizes]
        for src, (b, e) in zip(self.sources, self.ranges):
            if e <= b:
                raise ValueError(f"{src.prefix}: the {split_name} split of --split {split} holds no documents "
                                 f"(of {src.num_documents}); raise its share or add data")
            if int(src.lengths[b:e].min()) < 1:
                bad = b + int(np.argmin(src.lengths[b:e]))
                raise ValueError(f"{src.prefix}: document {bad} is empty; every document needs at least 1 token")

    @classmethod
    def from_data_path(cls, data_path: Sequence[str] | str, **kwargs: Any) -> DocumentReader:
        return cls(parse_data_path(data_path), **kwargs)

    def describe(self) -> dict[str, Any]:
        """What determines the stream (saved with checkpoints, compared on resume)."""
        return {"prefixes": [s.prefix for s in self.sources], "weights": [float(w) for w in self.weights],
                "documents": [s.num_documents for s in self.sources], "split": list(parse_split(self.split)),
                "split_name": self.split_name, "seed": self.seed, "shuffle": self.shuffle}

    def _epoch_order(self, i: int, epoch: int) -> np.ndarray:
        b, e = self.ranges[i]
        docs = np.arange(b, e, dtype=np.int64)
        if self.shuffle:
            docs = np.random.default_rng([self.seed, i, epoch]).permutation(docs)
        return docs

    def stream(self, tokens: int) -> DocumentStream:
        """The documents scheduled before virtual time ``tokens`` (about that many tokens)."""
        if tokens < 1:
            raise ValueError(f"stream needs a positive token count, got {tokens}")
        keys, ids, lens, which = [], [], [], []
        for i, src in enumerate(self.sources):
            b, e = self.ranges[i]
            epoch_tokens = int(src.lengths[b:e].sum())
            needed = float(self.weights[i]) * tokens  # this dataset's share of the virtual time
            epochs = int(needed // epoch_tokens) + 1
            order = np.concatenate([self._epoch_order(i, ep) for ep in range(epochs)])
            epoch_of = np.repeat(np.arange(epochs, dtype=np.int64), e - b)
            lengths = src.lengths[order]
            before = np.concatenate([[0], np.cumsum(lengths)[:-1]])
            key = before / self.weights[i]
            keep = key < tokens
            keys.append(key[keep])
            ids.append(epoch_of[keep] * self.num_documents + self.offsets[i] + order[keep])
            lens.append(lengths[keep])
            which.append(np.full(int(keep.sum()), i, dtype=np.int64))
        key = np.concatenate(keys)
        order = np.lexsort((np.concatenate(which), key))  # by key, ties by dataset index
        return DocumentStream(np.concatenate(ids)[order].astype(np.int64), np.concatenate(lens)[order].astype(np.int64))

    def locate(self, stream_id: int) -> tuple[int, int, int]:
        """Stream id -> (epoch, dataset index, document index in that dataset's .idx)."""
        epoch, global_doc = divmod(int(stream_id), self.num_documents)
        i = int(np.searchsorted(self.offsets, global_doc, side="right")) - 1
        return epoch, i, global_doc - int(self.offsets[i])

    def read(self, stream_id: int, offset: int, length: int) -> np.ndarray:
        _, i, doc = self.locate(stream_id)
        return self.sources[i].read(doc, offset, length)


# -- THD micro-batches ---------------------------------------------------------------------------------
def build_micro_batch(read: Callable[[int, int, int], np.ndarray], micro_batch: MicroBatch,
                      pad_to_multiple: int = 1, as_torch: bool = True, empty_tokens: int = 1) -> dict[str, Any]:
    """One packed micro-batch in THD form from its pieces (see the module docstring for the convention).

    ``read(doc_id, offset, length)`` returns a piece's tokens. ``pad_to_multiple`` appends one
    padding segment (token 0, loss_mask 0, its own cu_seqlens entry) so that T is a multiple of it
    (sequence parallelism needs T % TP == 0). A micro-batch without pieces (a packer may leave one
    empty, e.g. wlb while its queues fill) becomes one padding segment of ``empty_tokens`` (rounded
    up to ``pad_to_multiple``) with loss_mask 0: every stage still runs exactly N micro-batches and
    the loss is unchanged. ``as_torch=False`` returns numpy arrays.
    """
    if pad_to_multiple < 1 or empty_tokens < 1:
        raise ValueError(f"pad_to_multiple and empty_tokens must be >= 1, got {pad_to_multiple}, {empty_tokens}")
    pieces = micro_batch.pieces
    total = sum(p.length for p in pieces)
    pad = (-total) % pad_to_multiple if total else -(-empty_tokens // pad_to_multiple) * pad_to_multiple
    size = total + pad
    tokens = np.zeros(size, dtype=np.int64)
    labels = np.zeros(size, dtype=np.int64)
    loss_mask = np.zeros(size, dtype=np.float32)
    position_ids = np.zeros(size, dtype=np.int64)
    cu = [0]
    at = 0
    for p in pieces:
        chunk = read(p.doc_id, p.offset, p.length)
        if chunk.size != p.length:
            raise ValueError(f"document {p.doc_id}: read {chunk.size} tokens for a piece of {p.length}")
        tokens[at:at + p.length] = chunk
        labels[at:at + p.length - 1] = chunk[1:]
        loss_mask[at:at + p.length - 1] = 1.0
        position_ids[at:at + p.length] = np.arange(p.length)
        at += p.length
        cu.append(at)
    if pad:
        position_ids[at:] = np.arange(pad)
        cu.append(size)
    cu_seqlens = np.asarray(cu, dtype=np.int32)
    max_seqlen = int(np.diff(cu_seqlens).max()) if len(cu) > 1 else 0
    out: dict[str, Any] = {"tokens": tokens[None], "labels": labels[None], "loss_mask": loss_mask[None],
                           "position_ids": position_ids[None], "cu_seqlens": cu_seqlens, "max_seqlen": max_seqlen}
    if as_torch:
        import torch

        for key in ("tokens", "labels", "loss_mask", "position_ids", "cu_seqlens"):
            out[key] = torch.from_numpy(out[key])
    return out


def plan_digest(batch: GlobalBatch) -> str:
    """sha256 of a global plan (every piece of every micro-batch, in order): equal on all ranks."""
    h = hashlib.sha256()
    h.update(f"{batch.iteration}:{batch.dp}:{batch.n}".encode())
    for mb in batch.micro_batches:
        h.update(b"|")
        h.update(np.asarray([[p.doc_id, p.offset, p.length, p.arrival] for p in mb.pieces],
                            dtype=np.int64).tobytes())
    return h.hexdigest()


class WlbDataIterator(Iterator[dict]):
    """Yields this DP rank's packed micro-batches, ``packer.config.n`` per iteration, in plan order.

    Every rank holds an identical packer fed the identical stream, so the plan of every iteration is
    the same everywhere (``plan_digest``). ``state_dict``/``load_state_dict`` carry the packer's
    state (waiting queues, stream position) and a digest of the stream consumed so far, so a restart
    resumes exactly where the saved run was: no document lost or repeated. ``on_batch`` (optional)
    is called with every new ``GlobalBatch`` (the logging hook uses it).
    """

    def __init__(self, reader: DocumentReader | None, stream: DocumentStream, packer: Any, dp_rank: int,
                 pad_to_multiple: int = 1, as_torch: bool = True,
                 on_batch: Callable[[GlobalBatch], None] | None = None,
                 read: Callable[[int, int, int], np.ndarray] | None = None, empty_tokens: int = 1):
        if read is None and reader is None:
            raise ValueError("WlbDataIterator needs a DocumentReader or a read(doc_id, offset, length) function")
        self.reader = reader
        self.read = read if read is not None else reader.read
        self.stream = stream
        self.packer = packer
        self.dp_rank = int(dp_rank)
        if not 0 <= self.dp_rank < packer.config.dp:
            raise ValueError(f"dp_rank {dp_rank} is outside [0, {packer.config.dp}) of the packer's config")
        self.pad_to_multiple = pad_to_multiple
        self.empty_tokens = empty_tokens
        self.as_torch = as_torch
        self.on_batch = on_batch
        self.current: GlobalBatch | None = None
        self._mine: tuple[MicroBatch, ...] = ()
        self._cursor = 0
        self._batches: Iterator[GlobalBatch] | None = None

    @property
    def n(self) -> int:
        return self.packer.config.n

    def _next_batch(self) -> GlobalBatch:
        if self._batches is None:
            self._batches = self.packer.pack(self.stream.lengths, self.stream.doc_ids)
        batch = next(self._batches)  # StopIteration ends training data
        self.current = batch
        self._mine = batch.for_dp_rank(self.dp_rank)
        self._cursor = 0
        if self.on_batch is not None:
            self.on_batch(batch)
        return batch

    def next_plan(self) -> GlobalBatch:
        """Advance to the next iteration's plan without building its tensors (tests, dry runs)."""
        if self._cursor < len(self._mine):
            raise RuntimeError(f"{len(self._mine) - self._cursor} micro-batches of iteration "
                               f"{self.current.iteration} are still unread")
        batch = self._next_batch()
        self._cursor = len(self._mine)
        return batch

    def __next__(self) -> dict:
        if self._cursor >= len(self._mine):
            self._next_batch()
        mb = self._mine[self._cursor]
        self._cursor += 1
        return build_micro_batch(self.read, mb, self.pad_to_multiple, self.as_torch, self.empty_tokens)

    # -- checkpointing ----------------------------------------------------------------------------
    def state_dict(self) -> dict[str, Any]:
        """JSON-ready state between iterations (raises if an iteration is half consumed)."""
        if self._cursor < len(self._mine):
            raise RuntimeError(f"cannot save the data state mid-iteration: {self._cursor} of {len(self._mine)} "
                               f"micro-batches of iteration {self.current.iteration} were read; save between steps")
        position = int(self.packer.position)
        return {
            "version": STREAM_STATE_VERSION,
            "reader": self.reader.describe() if self.reader is not None else None,
            "stream_position": position,
            "stream_digest": self.stream.digest(position),
            "stream_length": len(self.stream),
            "packer": self.packer.state_dict(),
        }

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Restore the packer and check that this run's stream starts with the saved run's documents."""
        if state.get("version") != STREAM_STATE_VERSION:
            raise ValueError(f"data state version {state.get('version')!r}; this build reads {STREAM_STATE_VERSION}")
        if self.reader is not None and state.get("reader") is not None and \
                _reader_key(state["reader"]) != _reader_key(self.reader.describe()):
            raise ValueError("the checkpoint's data state was saved with other data settings: saved "
                             f"{state['reader']}, now {self.reader.describe()}; resume with the same --data-path, "
                             "--split and --seed")
        position = int(state["stream_position"])
        if position > len(self.stream) or self.stream.digest(position) != state["stream_digest"]:
            raise ValueError(f"this run's document stream does not start with the {position} documents the "
                             "checkpoint consumed; resume with the same data, split, seed and an equal or larger "
                             "--train-iters")
        self.packer.load_state_dict(state["packer"])
        self._batches = None
        self.current = None
        self._mine = ()
        self._cursor = 0


def _reader_key(described: dict[str, Any]) -> dict[str, Any]:
    """What must match on resume: the reader's settings, with file names but not their directories
    (a dataset moved to another mount is the same data; its document counts are compared too)."""
    key = dict(described)
    key["prefixes"] = [os.path.basename(str(p)) for p in described.get("prefixes", [])]
    return key


def dumps_state(state: dict[str, Any]) -> str:
    """Canonical JSON of a data state (identical bytes on every rank holding the same state)."""
    return json.dumps(state, sort_keys=True, separators=(",", ":"))


# -- writing indexed datasets (tests, the GPU smoke run, quick experiments) ----------------------------
BYTE_EOD = 256  # byte-level tokens are 0..255; 256 ends a document (vocabulary of 257)


def byte_documents(paths: Sequence[str], separator: str | None = "\n\n\n", eod: int | None = BYTE_EOD,
                   max_bytes: int | None = None) -> list[np.ndarray]:
    """Byte-level token documents from text files: each file cut at ``separator`` (None: whole files),
    each document followed by ``eod``. Empty chunks are skipped; ``max_bytes`` caps the total read."""
    docs: list[np.ndarray] = []
    budget = max_bytes
    for path in paths:
        with open(path, "rb") as f:
            data = f.read()
        chunks = data.split(separator.encode()) if separator else [data]
        for chunk in chunks:
            if not chunk.strip():
                continue
            if budget is not None:
                if budget <= 0:
                    return docs
                chunk = chunk[:budget]
                budget -= len(chunk)
            arr = np.frombuffer(chunk, dtype=np.uint8).astype(np.int64)
            docs.append(np.append(arr, eod) if eod is not None else arr)
    return docs


def write_indexed_dataset(prefix: str, documents: Sequence[np.ndarray | Sequence[int]],
                          dtype: type = np.uint16) -> str:
    """Write ``prefix.bin/.idx`` with megatron-core's ``IndexedDatasetBuilder``, one sequence per document."""
    import torch
    from megatron.core.datasets.indexed_dataset import IndexedDatasetBuilder, get_bin_path, get_idx_path

    builder = IndexedDatasetBuilder(get_bin_path(prefix), dtype=dtype)
    for doc in documents:
        arr = np.asarray(doc, dtype=np.int64)
        if arr.size == 0:
            raise ValueError("write_indexed_dataset: empty document; every document needs at least 1 token")
        builder.add_item(torch.from_numpy(arr))
        builder.end_document()
    builder.finalize(get_idx_path(prefix))
    return prefix
