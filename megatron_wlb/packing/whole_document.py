"""``whole-document``: the baseline that keeps documents whole, in arrival order, in fixed-length micro-batches.

The paper's "Original" packing (Table 2, imbalance 1.44) is not spelled out. Megatron's GPTDataset
concatenates documents and cuts the stream every ``seq_len`` tokens (``packing/original.py``,
"concat-and-cut"); its pieces attend only within themselves, so it computes less attention per
token than any method that keeps documents whole. The paper's fixed-length greedy packer, which
keeps documents whole, improves on its Original only slightly (1.44 -> 1.41), which fits an
Original that keeps documents whole too. This packer is that reading: documents are
neither cut nor reordered by workload. Each iteration it reads ``dp * n * seq_len`` tokens; every
document, in arrival order (those waiting from the previous iteration first), goes into the first
micro-batch of the iteration that still has room under ``seq_len`` (arrival-order first-fit); what
fits nowhere waits for the next iteration, first in line, and that iteration reads as many fewer
new tokens so the backlog stays bounded. Documents longer than ``seq_len`` follow the config's
oversize policy (the simulator cuts them at the window for every method beforehand).
"""

from __future__ import annotations

from typing import Any

from megatron_wlb.costmodel import CostModel
from megatron_wlb.packing.base import Packer, StreamSource, pieces_from_state, pieces_to_state, register_packer
from megatron_wlb.packing.types import DocPiece, MicroBatch, PackingConfig


@register_packer
class WholeDocumentPacker(Packer):
    """Arrival-order first-fit of whole documents into ``dp * n`` micro-batches of ``seq_len``."""

    name = "whole-document"

    def __init__(self, config: PackingConfig, cost: CostModel | None = None):
        super().__init__(config, cost)
        self._carried: list[DocPiece] = []

    def pending(self) -> int:
        return sum(p.length for p in self._carried)

    def held(self) -> tuple[DocPiece, ...]:
        return tuple(self._carried)

    def _intake(self, source: StreamSource, arrival: int | None = None) -> list[DocPiece]:
        """Count the waiting documents against this iteration's budget (see ``FixedWindowPacker``)."""
        self._credit += self.pending()
        if self._credit >= self.config.tokens_per_iteration:
            self._credit -= self.config.tokens_per_iteration
            return []
        return super()._intake(source, arrival)

    def _plan(self, new: list[DocPiece], final: bool) -> list[MicroBatch]:
        cap = self.config.seq_len
        bins: list[list[DocPiece]] = [[] for _ in range(self.config.micro_batches_per_iteration)]
        room = [cap] * len(bins)
        left: list[DocPiece] = []
        first_open = 0
        for piece in self._carried + new:
            while first_open < len(bins) and room[first_open] == 0:
                first_open += 1
            for j in range(first_open, len(bins)):
                if piece.length <= room[j]:
                    bins[j].append(piece)
                    room[j] -= piece.length
                    break
            else:
                left.append(piece)
        self._carried = left
        return [MicroBatch(tuple(b), cap) for b in bins]

    def _extra_state(self) -> dict[str, Any]:
        return {"carried": pieces_to_state(self._carried)}

    def _load_extra_state(self, state: dict[str, Any]) -> None:
        self._carried = pieces_from_state(state["carried"])
