"""``original``: Megatron GPTDataset's concat-and-cut.

Documents are concatenated in arrival order and the token stream is cut every ``seq_len`` tokens,
so a document may be split across micro-batches (and across iterations). Each piece is a document
for attention purposes. Every micro-batch is full except at the very end of the stream, where
Megatron would drop the tail and we emit it (no token is lost).
"""

from __future__ import annotations

from collections import deque
from typing import Any

from megatron_wlb.packing.base import Packer, pieces_from_state, pieces_to_state, register_packer
from megatron_wlb.packing.types import DocPiece, MicroBatch


@register_packer
class OriginalPacker(Packer):
    name = "original"
    cuts_documents = True

    def __init__(self, config, cost=None):
        super().__init__(config, cost)
        self._buffer: deque[DocPiece] = deque()
        self._buffered = 0

    def pending(self) -> int:
        return self._buffered

    def _plan(self, new: list[DocPiece], final: bool) -> list[MicroBatch]:
        self._buffer.extend(new)
        self._buffered += sum(p.length for p in new)
        cap = self.config.seq_len
        out: list[MicroBatch] = []
        buf = self._buffer
        for _ in range(self.config.micro_batches_per_iteration):
            room = cap
            pieces: list[DocPiece] = []
            while room > 0 and buf:
                head = buf[0]
                if head.length <= room:
                    pieces.append(buf.popleft())
                    room -= head.length
                else:  # cut: the first `room` tokens now, the rest stays at the head
                    pieces.append(DocPiece(head.doc_id, head.offset, room, head.arrival))
                    buf[0] = DocPiece(head.doc_id, head.offset + room, head.length - room, head.arrival)
                    room = 0
            self._buffered -= cap - room
            out.append(MicroBatch(tuple(pieces), cap))
        return out

    def _extra_state(self) -> dict[str, Any]:
        return {"buffer": pieces_to_state(self._buffer)}

    def _load_extra_state(self, state: dict[str, Any]) -> None:
        self._buffer = deque(pieces_from_state(state["buffer"]))
        self._buffered = sum(p.length for p in self._buffer)
