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
    lengths = np.asarray(lengths, dtype=np.int64)
    ends = np.cumsum(lengths)
    starts = ends - lengths
    out = []
    for k in micro_batches:
        lo, hi = k * seq_len, (k + 1) * seq_len
        first = int(np.searchsorted(ends, lo, side="right"))
        last = int(np.searchsorted(ends, hi, side="left"))
        docs = np.arange(first, min(last + 1, lengths.size), dtype=np.int64)
        begin = np.maximum(starts[docs], lo)
        size = np.minimum(ends[docs], hi) - begin
        keep = size > 0
        out.append((docs[keep], (begin - starts[docs])[keep], size[keep]))
    return out


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
        out: list[MicroBatch] = []
        for docs, offsets, sizes in concat_and_cut(lengths, cap, range(self.config.micro_batches_per_iteration)):
            out.append(MicroBatch(tuple(DocPiece(buf[i].doc_id, buf[i].offset + off, size, buf[i].arrival)
                                        for i, off, size in zip(docs.tolist(), offsets.tolist(), sizes.tolist())),
                                  cap))
        # what was not emitted stays at the head: the rest of the last piece cut, then the pieces after it
        used = min(int(lengths.sum()), len(out) * cap)
        ends = np.cumsum(lengths)
        first = int(np.searchsorted(ends, used, side="right"))
        rest = buf[first:]
        if rest:
            head = rest[0]
            taken = used - int(ends[first] - head.length)
            rest[0] = DocPiece(head.doc_id, head.offset + taken, head.length - taken, head.arrival) if taken else head
        self._buffer = rest
        return out

    def _extra_state(self) -> dict[str, Any]:
        return {"buffer": pieces_to_state(self._buffer)}

    def _load_extra_state(self, state: dict[str, Any]) -> None:
        self._buffer = pieces_from_state(state["buffer"])
