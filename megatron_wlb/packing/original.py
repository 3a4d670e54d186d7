"""``original``: Megatron GPTDataset's concat-and-cut.

Documents are concatenated in arrival order and the token stream is cut every ``seq_len`` tokens,
so a document may be split across micro-batches (and across iterations). Each piece is a document
for attention purposes. Every micro-batch is full except at the very end of the stream, where
Megatron would drop the tail and we emit it (no token is lost).

The cut itself is ``data.cut.concat_and_cut``, a pure function over a length stream.
"""

from __future__ import annotations

from typing import Any

import numpy as np

from megatron_wlb.costmodel import CostModel
from megatron_wlb.data.cut import concat_and_cut_flat
from megatron_wlb.packing.base import Packer, pieces_from_state, pieces_to_state, register_packer
from megatron_wlb.packing.types import DocPiece, MicroBatch, PackingConfig, piece_lengths


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

    def held(self) -> tuple[DocPiece, ...]:
        return tuple(self._buffer)

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
