"""Megatron indexed datasets at document level: blend, split, epoch shuffle and stable stream ids.

Megatron's ``GPTDataset`` concatenates documents and cuts them at ``--seq-length``; WLB-LLM packs
whole documents instead. This module reads the same ``PREFIX.bin/.idx`` files at document level,
with neither torch nor megatron-core (``indexed.read_index`` parses the index):

- ``DocumentReader``: one or more prefixes (a blend, weighted like ``--data-path 0.7 A 0.3 B``), a
  train/valid/test split by document ranges (``--split 969,30,1``), and an epoch-shuffled order from
  a seed. ``stream(tokens)`` returns the first documents of that order (ids and lengths) covering
  ``tokens`` tokens; a longer request returns a longer stream with the same prefix, so a resumed
  run with more iterations replays the same documents.
- Stream ids are global and stable: ``epoch * num_documents + global_doc``, where ``global_doc`` is
  the dataset's offset (datasets in ``--data-path`` order) plus the document's index in its .idx.
- ``write_indexed_dataset`` writes such files with megatron-core's own builder (tests, smoke runs).
"""

from __future__ import annotations

import hashlib
import math
import os
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np

from megatron_wlb.data.blend import interleave, parse_data_path, start_times
from megatron_wlb.data.indexed import check_bin_matches_idx, document_lengths, read_index

#: Megatron's default ``--split`` (train, valid, test weights)
DEFAULT_SPLIT = "969,30,1"
SPLIT_NAMES: tuple[str, ...] = ("train", "valid", "test")
#: tokens read at a time when scanning a .bin for its largest token id
SCAN_CHUNK_TOKENS = 1 << 24


# -- Megatron's data flags ---------------------------------------------------------------------------
def weighted_prefixes(data_path: Sequence[str] | str) -> list[tuple[str, float]]:
    """``--data-path`` tokens -> [(prefix, weight)]: ``A B`` (equal weights) or ``0.7 A 0.3 B``
    (``blend.parse_data_path``, the one parser, with unweighted prefixes weighing 1)."""
    return [(prefix, 1.0 if weight is None else weight) for prefix, weight in parse_data_path(data_path)]


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
    """Documents of one indexed dataset: lengths from ``PREFIX.idx`` (``indexed.read_index``, the one
    parser) and tokens straight from ``PREFIX.bin`` (memory-mapped), where a document's sequences lie
    back to back from its first sequence's pointer."""

    def __init__(self, prefix: str, lengths: np.ndarray, starts: np.ndarray, tokens: np.ndarray):
        self.prefix = prefix
        self.lengths = lengths
        self.starts = starts          # token offset of each document in ``tokens``
        self.tokens = tokens
        self._max_token_id: int | None = None

    @classmethod
    def open(cls, prefix: str, mmap: bool = True) -> IndexedSource:
        """Open ``prefix.bin/.idx`` (checked to belong together: a truncated .bin fails here, named)."""
        missing = [ext for ext in (".idx", ".bin") if not os.path.isfile(prefix + ext)]
        if missing:
            hint = f" (drop the extension: {prefix[:-4]})" if prefix.endswith((".bin", ".idx")) else ""
            raise ValueError(f"--data-path {prefix}: no {' / '.join(prefix + m for m in missing)}; give the "
                             f"prefix of a Megatron indexed dataset (PREFIX.bin + PREFIX.idx){hint}")
        check_bin_matches_idx(prefix)
        index = read_index(prefix)
        lengths = document_lengths(index.sequence_lengths, index.document_indices, f"{prefix}.idx")
        bin_path = prefix + ".bin"
        tokens = np.memmap(bin_path, dtype=index.dtype, mode="r") if mmap else np.fromfile(bin_path, index.dtype)
        pointers = np.append(index.sequence_pointers, os.path.getsize(bin_path))
        starts = pointers[index.document_indices[:-1]] // index.dtype.itemsize
        return cls(prefix, lengths, starts.astype(np.int64), tokens)

    @property
    def num_documents(self) -> int:
        return int(self.lengths.size)

    def max_token_id(self) -> int:
        """The largest token id in ``PREFIX.bin`` (-1 if empty): one chunked pass over the file, so memory
        stays constant whatever its size; remembered for this source."""
        if self._max_token_id is None:
            tokens = self.tokens
            top = -1
            for at in range(0, int(tokens.size), SCAN_CHUNK_TOKENS):
                top = max(top, int(np.max(tokens[at:at + SCAN_CHUNK_TOKENS])))
            self._max_token_id = top
        return self._max_token_id

    def read(self, doc: int, offset: int, length: int) -> np.ndarray:
        """Tokens ``[offset, offset + length)`` of document ``doc`` (its sequences are contiguous)."""
        if not (0 <= offset and offset + length <= self.lengths[doc]):
            raise ValueError(f"{self.prefix}: tokens [{offset}, {offset + length}) are outside document "
                             f"{doc} of {self.lengths[doc]} tokens")
        start = int(self.starts[doc]) + int(offset)
        return np.asarray(self.tokens[start:start + int(length)], dtype=np.int64)


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

    def __init__(self, sources: Sequence[tuple[IndexedSource | str, float]], split: str = DEFAULT_SPLIT,
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
        return cls(weighted_prefixes(data_path), **kwargs)

    def max_token_id(self) -> int:
        """The largest token id in any of the blended datasets (each scanned once)."""
        return max(src.max_token_id() for src in self.sources)

    def check_vocabulary(self, vocab_size: int, flag: str = "--vocab-size") -> None:
        """Refuse data whose token ids the model's embedding (``vocab_size`` rows) cannot look up, naming
        the dataset, its largest id and the vocabulary; ``flag`` is what sets it."""
        for src in self.sources:
            if np.issubdtype(src.tokens.dtype, np.integer) and np.iinfo(src.tokens.dtype).max < vocab_size:
                continue  # the file's dtype cannot hold an id outside the vocabulary: nothing to scan
            top = src.max_token_id()
            if top >= vocab_size:
                raise ValueError(f"{src.prefix}: token id {top} is outside the model's vocabulary of {vocab_size} "
                                 f"(ids 0..{vocab_size - 1}): set {flag} to at least {top + 1} (or the tokenizer "
                                 "the data was made with)")

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
        keys, ids, lens = [], [], []
        for i, src in enumerate(self.sources):
            b, e = self.ranges[i]
            epoch_tokens = int(src.lengths[b:e].sum())
            needed = float(self.weights[i]) * tokens  # this dataset's share of the virtual time
            epochs = int(needed // epoch_tokens) + 1
            order = np.concatenate([self._epoch_order(i, ep) for ep in range(epochs)])
            epoch_of = np.repeat(np.arange(epochs, dtype=np.int64), e - b)
            lengths = src.lengths[order]
            key = start_times(lengths, float(self.weights[i]))
            keep = key < tokens
            keys.append(key[keep])
            ids.append(epoch_of[keep] * self.num_documents + self.offsets[i] + order[keep])
            lens.append(lengths[keep])
        which, position = interleave(keys)
        picked = np.concatenate([[0], np.cumsum([k.size for k in keys])])[which] + position
        return DocumentStream(np.concatenate(ids)[picked].astype(np.int64),
                              np.concatenate(lens)[picked].astype(np.int64))

    def locate(self, stream_id: int) -> tuple[int, int, int]:
        """Stream id -> (epoch, dataset index, document index in that dataset's .idx)."""
        epoch, global_doc = divmod(int(stream_id), self.num_documents)
        i = int(np.searchsorted(self.offsets, global_doc, side="right")) - 1
        return epoch, i, global_doc - int(self.offsets[i])

    def read(self, stream_id: int, offset: int, length: int) -> np.ndarray:
        _, i, doc = self.locate(stream_id)
        return self.sources[i].read(doc, offset, length)


# -- writing indexed datasets (tests, smoke runs, quick experiments) -------------------------------------
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
