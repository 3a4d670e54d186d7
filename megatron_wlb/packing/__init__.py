"""PP-level packing: documents into micro-batches, streaming, one global batch per iteration.

Packers (``make_packer(name, config, cost)``): ``original`` (Megatron's concat-and-cut),
``fixed-greedy`` and ``fixed-solver`` (the paper's fixed-length baselines, over a window of global
batches), ``whole-document`` (documents whole, arrival order, fixed length: the baseline without any
balancing), ``wlb`` (paper Algorithm 1: variable length with outlier delay, plus automatic
thresholds, a delay bound and global DP x N balance). ``metrics`` scores plans.
"""

from megatron_wlb.costmodel import CostModel
from megatron_wlb.packing import greedy, original, solver, whole_document, wlb  # noqa: F401  (register the packers)
from megatron_wlb.packing.base import PACKERS, Packer, register_packer
from megatron_wlb.packing.greedy import FixedGreedyPacker, place_greedy
from megatron_wlb.packing.metrics import (
    PackingMetrics,
    batch_latencies,
    imbalance_global,
    imbalance_per_rank,
    microbatch_latency,
    piece_latency,
    summarize,
)
from megatron_wlb.packing.original import OriginalPacker
from megatron_wlb.packing.solver import FixedSolverPacker, solve_assignment
from megatron_wlb.packing.types import DocPiece, GlobalBatch, MicroBatch, PackingConfig
from megatron_wlb.packing.whole_document import WholeDocumentPacker
from megatron_wlb.packing.wlb import WlbPacker

__all__ = [
    "PACKERS", "DocPiece", "FixedGreedyPacker", "FixedSolverPacker", "GlobalBatch", "MicroBatch", "OriginalPacker",
    "Packer", "PackingConfig", "PackingMetrics", "WholeDocumentPacker", "WlbPacker", "batch_latencies",
    "imbalance_global",
    "imbalance_per_rank", "make_packer", "microbatch_latency", "piece_latency", "place_greedy", "register_packer",
    "solve_assignment", "summarize",
]


def make_packer(name: str, config: PackingConfig, cost: CostModel | None = None) -> Packer:
    """Build a registered packer by name (``original``, ``fixed-greedy``, ``fixed-solver``, ``whole-document``,
    ``wlb``)."""
    if name not in PACKERS:
        raise ValueError(f"unknown packer {name!r}; choose one of {', '.join(sorted(PACKERS))}")
    return PACKERS[name](config, cost)
