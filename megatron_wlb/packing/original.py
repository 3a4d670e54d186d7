"""``original``: Megatron GPTDataset's concat-and-cut.

Documents are concatenated in arrival order and the token stream is cut every ``seq_len`` tokens,
so a document may be split across micro-batches (and across iterations). Each piece is a document
for attention purposes. Every micro-batch is full except at the very end of the stream, where
Megatron would drop the tail and we emit it (no token is lost).

``concat_and_cut`` is the cut itself, as a pure function over a length stream; the packer and the
CP benchmarks' sampler (``cp/sampling.py``) both use it.
"""

from __future__ import annotations

from collections.abc import Iterable
from typing import Any

import numpy as np

from megatron_wlb.costmodel import CostModel
from megatron_wlb.packing.base import Packer, pieces_from_state, pieces_to_state, register_packer
from megatron_wlb.packing.types import DocPiece, MicroBatch, PackingConfig, piece_lengths


def concat_and_cut(lengths: np.ndarray, seq_len: int, micro_batches: Iterable[int]
                   ) -> list[tuple[np.ndarray, np.ndarray, np.ndarray]]:
    """Megatron's concat-and-cut: documents of ``lengths`` back to back, cut every ``seq_len`` tokens.

    For each micro-batch number k (tokens ``[k * seq_len, (k + 1) * seq_len)`` of the concatenation)
    returns its pieces in order as (document index, offset in the document, piece length) arrays. A
    micro-batch running past the end of the stream is partial (or empty).
    """
    counts, docs, offsets, sizes = concat_and_cut_flat(lengths, seq_len, micro_batches)
    edges = np.cumsum(counts)[:-1]
    return list(zip(np.split(docs, edges), np.split(offsets, edges), np.split(sizes, edges)))


def concat_and_cut_flat(lengths: np.ndarray, seq_len: int, micro_batches: Iterable[int]
                        ) -> tuple[np.ndarray, np.ndarray, np.ndarray, np.ndarray]:
    """``concat_and_cut`` as flat arrays: (pieces per micro-batch, then every piece's document
    index, offset in the document and length, micro-batch after micro-batch)."""
    lengths = np.asarray(lengths, dtype=np.int64)
    ends = np.cumsum(lengths)
    starts = ends - lengths
    lo = np.fromiter(micro_batches, dtype=np.int64) * seq_len
    hi = lo + seq_len
    first = np.searchsorted(ends, lo, side="right")
    last = np.minimum(np.searchsorted(ends, hi, side="left"), lengths.size - 1)
    overlap = np.maximum(last - first + 1, 0)  # documents overlapping each micro-batch (some with 0 tokens)
    window = np.repeat(np.arange(lo.size), overlap)
    docs = np.repeat(first, overlap) + np.arange(int(overlap.sum())) - np.repeat(np.cumsum(overlap) - overlap, overlap)
    begin = np.maximum(starts[docs], lo[window])
    size = np.minimum(ends[docs], hi[window]) - begin
    keep = size > 0
    counts = np.bincount(window[keep], minlength=lo.size)
    return counts, docs[keep], (begin - starts[docs])[keep], size[keep]


def _cut(piece: DocPiece, offset: int, length: int) -> DocPiece:
    """Tokens ``[offset, offset + length)`` of ``piece`` (the piece itself when that is all of it)."""
    if offset == 0 and length == piece.length:
        return piece
    return DocPiece(piece.doc_id, piece.offset + offset, length, piece.arrival)


@register_packer
class OriginalPacker(Packer):
    name = "original"
    cuts_documents = True

    def __init__(self, config: PackingConfig, cost: CostModel | None = None):
        super().__init__(config, cost)
        self._buffer: list[DocPiece] = []

    def pending(self) -> int:
        return sum(p.length for p in self._buffer)

    def _plan(self, new: list[DocPiece], final: bool) -> list[MicroBatch]:
        buf = self._buffer + new
        cap = self.config.seq_len
        lengths = piece_lengths(buf)
        counts, docs, offsets, sizes = concat_and_cut_flat(lengths, cap, range(self.config.micro_batches_per_iteration))
        pieces = [_cut(buf[i], off, size) for i, off, size in zip(docs.tolist(), offsets.tolist(), sizes.tolist())]
        ends = np.cumsum(counts).tolist()
        out = [MicroBatch(tuple(pieces[e - c:e]), cap) for c, e in zip(counts.tolist(), ends)]
        # what was not emitted stays at the head: the rest of the last piece cut, then the pieces after it
        used = min(int(lengths.sum()), len(out) * cap)
        doc_ends = np.cumsum(lengths)
        first = int(np.searchsorted(doc_ends, used, side="right"))
        rest = buf[first:]
        if rest:
            head = rest[0]
            taken = used - int(doc_ends[first] - head.length)
            rest[0] = _cut(head, taken, head.length - taken)
        self._buffer = rest
        return out

    def _extra_state(self) -> dict[str, Any]:
        return {"buffer": pieces_to_state(self._buffer)}

    def _load_extra_state(self, state: dict[str, Any]) -> None:
        self._buffer = pieces_from_state(state["buffer"])
