"""The record of one wlb iteration being planned, and the one operation that fills it.

``IterationPlan`` is everything the policies (``thresholds``, ``release``, ``cut``, ``fill``, ``place``)
read and change while one global batch is planned: the ``dp * n`` micro-batches being filled (``bins``,
their ``work`` in cost-model seconds and ``toks`` in tokens), the pieces at the delay bound
(``forced``), those to place this iteration (``candidates``) and those left for later (``waiting``),
the queue thresholds and the latency per token of ordinary documents (``per_token``), and the packer's
running counts. The packer builds one per iteration, runs the policies over it, and keeps what waits.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import asdict, dataclass, field, fields
from typing import Any

import numpy as np

from megatron_wlb.packing.greedy import place_greedy
from megatron_wlb.packing.metrics import SizePrice
from megatron_wlb.packing.types import DocPiece, PackingConfig

#: the cost model's latency of pieces of these lengths (``Packer.latency``: ``piece_latency`` by table)
Latency = Callable[[Sequence[int] | np.ndarray], np.ndarray]


def place_pieces(pieces: list[DocPiece], bins: list[list[DocPiece]], work: list[float], toks: list[int], cap: int,
                 latency: Latency, size: SizePrice | None = None, pairs: list[float] | None = None) -> list[DocPiece]:
    """Place ``pieces`` in order, each into the micro-batch whose price after it is least, among those with
    room (``place_greedy``; ``bins``, ``work``, ``toks`` and ``pairs`` updated), a piece's work being
    ``latency`` of its length (the cost model's ``piece_latency``) and a micro-batch's price its work plus
    ``size`` of it as a whole; returns the pieces that fit nowhere, in order."""
    if not pieces:
        return []
    lengths = [p.length for p in pieces]
    where = place_greedy(lengths, latency(lengths).tolist(), work, toks, cap, size, pairs)
    unplaced = []
    for p, j in zip(pieces, where):
        if j >= 0:
            bins[j].append(p)
        else:
            unplaced.append(p)
    return unplaced


def release_size(config: PackingConfig) -> int:
    """R, the outliers a queue releases at once: one per micro-batch of the global batch (extension (c))."""
    return config.micro_batches_per_iteration


def reads_ahead(config: PackingConfig) -> bool:
    """Whether the read-ahead fill (h) runs: ``read_ahead_fill`` on, pieces may wait (``max_delay`` > 0) and
    ``read_ahead`` not off (Megatron's own samples are never read ahead of their iteration)."""
    return config.read_ahead_fill > 0 and config.max_delay > 0 and config.read_ahead is not False


def _no_read_ahead(tokens: int, limit: int) -> list[DocPiece]:
    return []


def _zero_cut_stats() -> dict[str, int]:
    return {"cut_points": 0, "tokens": 0, "pieces": 0}


@dataclass
class PlanCounts:
    """What the planner counted over the run (``WlbPacker.diagnostics``, saved with its state)."""

    #: forced pieces that fit nowhere whole and were split over the emptiest micro-batches (b)
    forced_splits: int = 0
    #: pieces the fill rule released early (f)
    fill_releases: int = 0
    #: the cut policy (g): cut points made, tokens of the cut pieces, pieces they became
    cut_stats: dict[str, int] = field(default_factory=_zero_cut_stats)
    #: forced pieces that fit nowhere whole and were not cut (``pieces="concat-and-cut"``)
    delay_overruns: int = 0
    #: tokens read ahead of the budget to fill iterations (h)
    read_ahead_tokens: int = 0
    #: queued outliers released because the iteration could balance them (i)
    balanced_releases: int = 0

    def state(self) -> dict[str, Any]:
        """JSON-ready, in this order (the cut statistics copied)."""
        return asdict(self)

    @classmethod
    def from_state(cls, state: dict[str, Any]) -> PlanCounts:
        counts = cls(cut_stats={k: int(v) for k, v in state["cut_stats"].items()})
        for f in fields(cls):
            if f.name != "cut_stats":
                setattr(counts, f.name, int(state[f.name]))
        return counts


@dataclass(eq=False)
class IterationPlan:
    """The planner's state of one iteration (see the module docstring)."""

    config: PackingConfig
    #: the iteration being planned (pieces read ahead arrive in it)
    iteration: int
    #: the micro-batch capacity (S_max)
    cap: int
    #: the queue thresholds L_1 < ... < L_n of this iteration
    thresholds: tuple[int, ...]
    #: latency per token of the ordinary documents read so far (those below L_1): the cost of balancing
    per_token: float
    latency: Latency
    counts: PlanCounts
    #: documents longer than S_max (the ``cut="overlong"`` scope)
    overlong: set[int] = field(default_factory=set)
    #: read documents worth at least ``tokens`` more, at most ``limit`` (the stream's read-ahead)
    read_ahead: Callable[[int, int], list[DocPiece]] = _no_read_ahead
    #: record pieces read ahead in the length statistics the thresholds come from
    observe: Callable[[list[DocPiece]], None] = lambda pieces: None
    forced: list[DocPiece] = field(default_factory=list)
    candidates: list[DocPiece] = field(default_factory=list)
    waiting: list[DocPiece] = field(default_factory=list)
    #: the cost model's price of a micro-batch as a whole (zero for an additive model)
    size: SizePrice = field(default_factory=SizePrice)
    bins: list[list[DocPiece]] = field(init=False)
    work: list[float] = field(init=False)
    toks: list[int] = field(init=False)
    #: causal pairs of each micro-batch (what ``size`` prices with its tokens)
    pairs: list[float] = field(init=False)

    def __post_init__(self) -> None:
        m = self.m
        self.bins = [[] for _ in range(m)]
        self.work = [0.0] * m
        self.toks = [0] * m
        self.pairs = [0.0] * m

    @property
    def m(self) -> int:
        """Micro-batches of the global batch (``dp * n``)."""
        return self.config.micro_batches_per_iteration

    @property
    def l1(self) -> int:
        """L_1: pieces at least this long are outliers."""
        return self.thresholds[0]

    @property
    def budget(self) -> int:
        """Tokens one iteration reads (``dp * n * seq_len``)."""
        return self.config.tokens_per_iteration

    @property
    def release_size(self) -> int:
        return release_size(self.config)

    @property
    def reads_ahead(self) -> bool:
        return reads_ahead(self.config)

    @property
    def tokens(self) -> int:
        """Tokens placed so far."""
        return sum(self.toks)

    def place(self, pieces: list[DocPiece]) -> list[DocPiece]:
        """``place_pieces`` into this iteration's micro-batches; returns what fits nowhere."""
        return place_pieces(pieces, self.bins, self.work, self.toks, self.cap, self.latency, self.size, self.pairs)

    def price(self, j: int) -> float:
        """Micro-batch ``j``'s price: its pieces' work and ``size`` of it as a whole (what placement balances)."""
        return self.work[j] + float(self.size(self.toks[j], self.pairs[j]))
