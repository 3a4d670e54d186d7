"""``wlb``: variable-length packing with outlier delay (paper Algorithm 1), plus extensions.

Per iteration, over all ``dp * n`` micro-batches of capacity ``max_seq_len`` (paper S_max):

1. New pieces join the waiting pool. A piece is an *outlier* if its length is at least L_1; the
   outliers wait in ``n_q`` queues by level (L_k <= d < L_{k+1}).
2. A queue holding at least R pieces releases R of them (one per micro-batch: they are the
   largest items of the iteration, so the placement below puts them into distinct, empty
   micro-batches). R = dp * n, see extension (c); ``release="rank"`` makes it n. The paper takes
   the R oldest (``group_by_work=False``); by default a group of similar work, see (e).
3. Pieces that have waited ``max_delay`` iterations are *forced*: placed before everything else,
   in a pass of their own. A queue whose oldest member is forced releases the members nearest to
   it in length with it (up to R in all; ``flush_on_force``, default True), so a forced outlier
   does not run alone; with a cut policy (g) it may be cut instead.
4. The released outliers and the other pieces, by length descending, each go to the micro-batch of
   least workload among those with room for it (the paper: least workload if it fits, else least
   length if it fits; ours picks the least-loaded of all that fit, a superset of both choices);
   what fits nowhere waits for the next iteration.
5. The micro-batches are dealt to DP ranks and ordered within each rank for the pipeline
   schedule (d).

Extensions beyond the paper (docs/packing.md has the measurements):

(a) ``queue_thresholds="auto"`` (default): L_1 is the shortest length whose latency reaches
    ``PackingConfig.outlier_fraction`` (default 0.7) of the latency of ``seq_len`` tokens of
    *ordinary* documents (those below L_1: a fixed point, so outliers do not raise their own
    bar); L_2 < ... < L_n split the outlier lengths seen so far into equal-count quantiles (so
    every queue fills at the same rate), using no more queues than the outlier rate can fill
    with R members each within max_delay / 2 iterations. The statistics (a log-spaced length
    histogram with token and latency sums per bin, the budget count) live in ``state_dict``, so a
    restored packer derives the same thresholds.
(b) ``max_delay``: a hard bound on waiting. Forced pieces are placed first, in their own pass; a
    forced piece that fits in no micro-batch whole is cut into pieces that fill the micro-batches
    with most room (counted in ``forced_splits``) before newer pieces can take that room, so the
    bound holds whenever an iteration can absorb one iteration's intake (the budget plus the
    overshoot of the document crossing it), i.e. whenever no document is longer than
    ``dp * n * (max_seq_len - seq_len)`` (256K tokens at 7b_128k); otherwise it is best effort.
(c) Global balance: the placement balances all ``dp * n`` micro-batches of the global batch
    together (DP ranks wait for each other at the gradient sync), and a queue releases ``dp * n``
    outliers at a time, one per micro-batch of the global batch: an outlier in one DP rank's
    micro-batch would otherwise set the pace for every rank.
(d) ``schedule_order``: ``packing.pipeline.deal_and_order`` assigns the micro-batches to DP ranks
    and orders them within a rank to minimise the slowest rank's (interleaved) 1F1B time; contents
    and delays are unchanged.
(e) ``group_by_work``: a queue releases R members of similar length (preferring groups with its
    oldest) only when the iteration's ordinary documents can balance them (``_closable``); else
    it waits, within the delay bound.
(f) ``min_fill``: while pieces wait, every iteration holds at least ``min_fill`` x the token
    budget unless no waiting piece fits: the intake reads that much even while repaying an
    overshoot, and waiting pieces are released early, shortest first. With the read-ahead fill (h)
    on, the guard tops up to ``fill_target`` instead, from the waiting pieces, when the read-ahead
    stopped for lack of room for the outliers it would queue, and then places the whole iteration
    again so the released pieces are balanced with the rest (``_fill_guard``).
(g) ``cut_policy`` (opt-in): a forced outlier whose group cannot be balanced is cut into the
    fewest pieces that can ("overlong": only pieces of documents longer than S_max; "any"), and
    so are the outliers the fill rule (f) releases early into an iteration whose ordinary
    documents cannot balance them (``_cut_early``); counted in ``cut_stats``.
(h) ``fill_target``: full iterations. While the iteration holds less than ``fill_target`` x the
    token budget, ordinary documents are read ahead from the stream (arriving now: no delay;
    credited against later budgets) and placed; outliers read on the way are queued, within what
    one iteration can take, so the delay bound holds (``_read_ahead_fill``).
(i) ``release_when_balanced``: delay only when it pays. A queued outlier goes out as soon as the
    iteration can still be balanced with it, not only in a group of R (``_balanced_release``).

``place_whole_batch`` is the placement (4) and dealing (5) alone, for one whole global batch that must be
placed now with documents whole (Megatron-LM main's own sequence-packing scheduler API,
``megatron/main_schedule.py``): no delay, and the number of micro-batches chosen by the 1F1B objective.

With ``PackingConfig.pieces="concat-and-cut"`` the pieces are Megatron's concat-and-cut pieces
(the base class's intake) and are never cut further (``delay_overruns`` counts forced pieces that
had to wait whole).
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from functools import partial
from typing import Any

import numpy as np

from megatron_wlb.costmodel import CostModel
from megatron_wlb.packing.base import Packer, pieces_from_state, pieces_to_state, register_packer, validate_lengths
from megatron_wlb.packing.greedy import place_greedy
from megatron_wlb.packing.metrics import microbatch_seconds, piece_forward, piece_latency
from megatron_wlb.packing.pipeline import deal_and_order, schedule_timer
from megatron_wlb.packing.types import (
    DocPiece,
    MicroBatch,
    PackingConfig,
    oldest_first_key,
    piece_lengths,
    shortest_first_key,
    sort_largest_first,
)

HIST_PER_OCTAVE = 16
HIST_BINS = 48 * HIST_PER_OCTAVE  # lengths up to 2**48 tokens
#: a group of outliers is closable when its heaviest member stays within this of the balanced mean
CLOSE_TOLERANCE = 0.02


def place_pieces(pieces: list[DocPiece], bins: list[list[DocPiece]], work: list[float], toks: list[int], cap: int,
                 latency: Callable[[list[int]], np.ndarray]) -> list[DocPiece]:
    """Place ``pieces`` in order, each into the micro-batch of least work with room (``place_greedy``;
    ``bins``, ``work`` and ``toks`` updated), a piece's work being ``latency`` of its length (the cost
    model's ``piece_latency``); returns the pieces that fit nowhere, in order."""
    if not pieces:
        return []
    lengths = [p.length for p in pieces]
    where = place_greedy(lengths, latency(lengths).tolist(), work, toks, cap)
    unplaced = []
    for p, j in zip(pieces, where):
        if j >= 0:
            bins[j].append(p)
        else:
            unplaced.append(p)
    return unplaced


def deal_micro_batches(bins: list[list[DocPiece]], work: list[float], cost: CostModel | None, dp: int, n: int,
                       stages: int, virtual_stages: int = 1) -> list[list[DocPiece]]:
    """``dp * n`` placed micro-batches (``work``: each one's summed ``piece_latency``) dealt to DP ranks and
    ordered within each for the pipeline schedule (``pipeline.deal_and_order``): rank r runs positions
    ``[r * n, (r + 1) * n)`` of the result."""
    m = len(bins)
    forward = None
    if cost is not None:
        counts = [len(b) for b in bins]
        lengths = piece_lengths([p for b in bins for p in b])
        forward = np.bincount(np.repeat(np.arange(m), counts), weights=piece_forward(cost, lengths), minlength=m)
    fwd_arr, bwd_arr = microbatch_seconds(cost, np.asarray(work, dtype=np.float64), forward)
    perm = deal_and_order(fwd_arr.tolist(), bwd_arr.tolist(), dp, n, stages, virtual_stages)
    return [bins[i] for i in perm]


def place_whole_batch(lengths: Sequence[int] | np.ndarray, dp: int, window: int, cost: CostModel | None,
                      stages: int = 1, virtual_stages: int = 1, multiple: int = 1,
                      max_factor: float = 2.0, max_items: int | None = None) -> list[list[list[int]]]:
    """wlb's placement of one whole global batch, for a scheduler that must place every item of it now
    (Megatron-LM main's ``data_schedule``: no outlier delay, documents whole).

    For a number ``n`` of micro-batches per DP rank, the items (lengths, by index) go largest first into the
    micro-batch of least work with room under ``window`` (``place_pieces``), over ``dp * n`` variable-length
    micro-batches, which are then dealt to DP ranks and ordered for the pipeline schedule
    (``deal_micro_batches``). ``n`` is free here: from the smallest multiple of ``multiple`` at which every
    item fits up to ``max_factor`` times that, the plan whose slowest DP rank has the shortest (interleaved)
    1F1B time under the cost model wins (fewer micro-batches on a tie): more micro-batches shrink the pipeline
    bubble and give the placement room, each costs the cost model's per-micro-batch overhead. An item longer
    than ``window`` cannot be cut here: it gets a micro-batch of its own. ``max_items`` caps the items of a
    micro-batch (Megatron-LM dev's ``max_num_seqs``): a placement that exceeds it counts as not fitting.

    Returns ``plan[r][k]``: the item indices of DP rank r's k-th micro-batch (ascending), every index exactly
    once, no micro-batch empty.
    """
    d = validate_lengths(lengths, "sample lengths")
    for name, value in (("dp", dp), ("window", window), ("stages", stages), ("virtual_stages", virtual_stages),
                        ("multiple", multiple)):
        if isinstance(value, bool) or not isinstance(value, (int, np.integer)) or value < 1:
            raise ValueError(f"{name}={value!r}: must be an integer >= 1")
    if not max_factor >= 1:
        raise ValueError(f"max_factor={max_factor!r}: must be >= 1")
    if max_items is not None and (isinstance(max_items, bool) or not isinstance(max_items, (int, np.integer))
                                  or max_items < 1):
        raise ValueError(f"max_items={max_items!r}: must be an integer >= 1 or None")
    if d.size == 0:
        raise ValueError("the global batch holds no samples: nothing to place")
    pieces = sort_largest_first([DocPiece(i, 0, int(x), 0) for i, x in enumerate(d.tolist())])
    alone = [p for p in pieces if p.length > window]
    fitting = [p for p in pieces if p.length <= window]
    item_latency = piece_latency(cost, d)
    item_forward = None if cost is None else piece_forward(cost, d)
    weights = [float(item_latency[p.doc_id]) for p in alone]

    def place(n: int) -> tuple[list[list[DocPiece]], list[float]] | None:
        m = dp * n
        bins: list[list[DocPiece]] = [[] for _ in range(m)]
        work = [0.0] * m
        toks = [0] * m
        for j, (p, w) in enumerate(zip(alone, weights)):
            bins[j].append(p)
            work[j] = w
            toks[j] = window
        if place_pieces(fitting, bins, work, toks, window, partial(piece_latency, cost)):
            return None
        return None if max_items is not None and max(map(len, bins)) > max_items else (bins, work)

    n = max(1, -(-len(alone) // dp), -(-int(d[d <= window].sum()) // (dp * window)))
    n = -(-n // multiple) * multiple
    while True:
        if dp * n > d.size:
            cap = f" of at most {max_items} samples each" if max_items is not None else ""
            raise ValueError(f"{d.size} samples cannot fill dp * n = {dp} x {n} micro-batches{cap} (every "
                             f"micro-batch needs a sample; n is a multiple of {multiple}): give the global batch at "
                             f"least {dp * n} samples")
        placed = place(n)
        if placed is not None:
            break
        n += multiple
    best: tuple[float, list[list[DocPiece]], int] | None = None
    last = min(int(n * max_factor), d.size // dp)
    while n <= last:
        if placed is not None:
            bins, work = placed
            dealt = deal_micro_batches(bins, work, cost, dp, n, stages, virtual_stages) if dp * n > 1 else bins
            time = _slowest_rank_time(dealt, item_latency, item_forward, cost, dp, n, stages, virtual_stages)
            if best is None or time < best[0] * (1 - 1e-9):
                best = (time, dealt, n)
        n += multiple
        placed = place(n) if n <= last else None
    assert best is not None
    _, dealt, n = best
    return [[sorted(p.doc_id for p in b) for b in dealt[r * n:(r + 1) * n]] for r in range(dp)]


def _slowest_rank_time(bins: list[list[DocPiece]], latency: np.ndarray, forward: np.ndarray | None,
                       cost: CostModel | None, dp: int, n: int, stages: int, virtual_stages: int) -> float:
    """The slowest DP rank's (interleaved) 1F1B time of dealt micro-batches (rank r: ``bins[r*n:(r+1)*n]``);
    ``latency`` / ``forward``: every item's ``piece_latency`` / ``piece_forward``, by ``doc_id``."""
    counts = [len(b) for b in bins]
    where = np.repeat(np.arange(len(bins)), counts)
    ids = np.fromiter((p.doc_id for b in bins for p in b), dtype=np.int64, count=int(sum(counts)))
    work = np.bincount(where, weights=latency[ids], minlength=len(bins))
    fwd_work = None if forward is None else np.bincount(where, weights=forward[ids], minlength=len(bins))
    fwd, bwd = microbatch_seconds(cost, work, fwd_work)
    timer = schedule_timer(stages, n, virtual_stages)
    return max(timer.makespan(fwd[r * n:(r + 1) * n].tolist(), bwd[r * n:(r + 1) * n].tolist()) for r in range(dp))


def _hist_bin(lengths: np.ndarray) -> np.ndarray:
    return np.minimum((np.log2(lengths) * HIST_PER_OCTAVE).astype(np.int64), HIST_BINS - 1)


@register_packer
class WlbPacker(Packer):
    name = "wlb"

    def __init__(self, config: PackingConfig, cost: CostModel | None = None):
        super().__init__(config, cost)
        self._waiting: list[DocPiece] = []
        self._hist = np.zeros(HIST_BINS, dtype=np.int64)     # documents per log-length bin
        self._hist_tokens = np.zeros(HIST_BINS, dtype=np.int64)
        self._hist_work = np.zeros(HIST_BINS, dtype=np.float64)  # latency per bin
        self._budgets = 0
        self.forced_splits = 0
        self.fill_releases = 0  # pieces the fill guard released early (no near-empty iterations)
        self.balanced_releases = 0  # queued outliers released because the iteration could balance them (i)
        self.read_ahead_tokens = 0  # tokens read ahead of the budget to fill iterations (h)
        self.delay_overruns = 0  # forced pieces that fit nowhere whole and were not cut (concat-and-cut pieces)
        #: the cut policy's count: cut points made, tokens of the cut pieces, pieces they became
        self.cut_stats = {"cut_points": 0, "tokens": 0, "pieces": 0}
        self._overlong_docs: set[int] = set()  # documents longer than S_max (split by oversize)
        self.outlier_fraction = float(config.outlier_fraction)
        problem = config.queue_threshold_problem()
        if problem:
            raise ValueError(f"queue_thresholds={list(config.queue_thresholds)}: {problem}")
        self.flush_on_force = config.flush_on_force
        self.release_size = config.micro_batches_per_iteration if config.release == "global" else config.n
        cap = self.capacity
        self._grid = np.unique(np.geomspace(1, cap, 1024).astype(np.int64))
        self._grid_w = piece_latency(cost, self._grid)

    @property
    def capacity(self) -> int:
        return self.config.capacity_var

    def _apply_oversize(self, lengths: np.ndarray, ids: np.ndarray, arrival: int) -> list[DocPiece]:
        pieces = super()._apply_oversize(lengths, ids, arrival)
        if self.config.cut_policy == "overlong" and lengths.size and int(lengths.max()) > self.capacity:
            self._overlong_docs.update(int(i) for i, n in zip(ids.tolist(), lengths.tolist()) if n > self.capacity)
        return pieces

    def _min_intake(self) -> int:
        """The fill rule's intake side: after a huge document the intake is in debt; still read
        enough that the iteration can reach ``min_fill`` x the token budget with what waits."""
        return max(0, int(self.config.min_fill * self.config.tokens_per_iteration) - self.pending())

    def pending(self) -> int:
        return sum(p.length for p in self._waiting)

    @property
    def waiting(self) -> tuple[DocPiece, ...]:
        """Pieces read but not yet emitted (carried pieces and queued outliers)."""
        return tuple(self._waiting)

    def diagnostics(self) -> dict[str, Any]:
        """The current thresholds (``thresholds()``), forced splits, early releases and cuts."""
        return {"thresholds": list(self.thresholds()), "forced_splits": self.forced_splits,
                "fill_releases": self.fill_releases, "cut_stats": dict(self.cut_stats),
                "delay_overruns": self.delay_overruns, "read_ahead_tokens": self.read_ahead_tokens,
                "balanced_releases": self.balanced_releases}

    # -- thresholds ------------------------------------------------------------------------------
    def thresholds(self) -> tuple[int, ...]:
        """The current L_1 < ... < L_n (the configured ones, or derived from the stream so far)."""
        th = self.config.queue_thresholds
        if th != "auto":
            return tuple(th)
        cap = self.capacity
        if self._budgets == 0:
            return (cap + 1,)
        l1 = self._first_threshold()
        if l1 > cap:
            return (cap + 1,)  # no document can be an outlier: one queue nobody enters
        levels = [l1]
        counts = self._hist.copy()
        counts[:_hist_bin(np.array([l1]))[0]] = 0
        total = int(counts.sum())
        # Each queue must gather R outliers well within max_delay, or it would only ever release
        # forced singles: use no more queues than the outlier rate can fill in max_delay / 2.
        rate = total / self._budgets
        nq = max(1, min(self.config.num_queues, int(rate * self.config.max_delay / (2 * self.release_size))))
        if nq > 1:
            if total > 0:
                csum = np.cumsum(counts)
                for q in range(1, nq):
                    b = int(np.searchsorted(csum, total * q / nq, side="left")) + 1
                    edge = int(np.ceil(2.0 ** (b / HIST_PER_OCTAVE)))
                    if levels[-1] < edge <= cap:
                        levels.append(edge)
        return tuple(levels)

    def _cost_changed(self, old: CostModel | None) -> None:
        """Rescale the per-bin work (kept in the old model's seconds) to the new cost model, each bin at
        its mean length: exact for a bin of one length, and a bin spans a 2**(1/HIST_PER_OCTAVE) ratio."""
        self._grid_w = self.latency(self._grid)  # L_1's search grid, in the new model's seconds
        used = self._hist > 0
        if not used.any():
            return
        mean = np.maximum(1, np.rint(self._hist_tokens[used] / self._hist[used])).astype(np.int64)
        before, after = piece_latency(old, mean), self.latency(mean)
        self._hist_work[used] *= np.where(before > 0, after / np.where(before > 0, before, 1.0), 0.0)

    def _ordinary_work_per_token(self, limit: int) -> float:
        """Mean latency per token of the documents read so far that are shorter than ``limit``."""
        below = np.arange(HIST_BINS) < _hist_bin(np.array([limit]))[0]
        tokens = int(self._hist_tokens[below].sum())
        return float(self._hist_work[below].sum()) / tokens if tokens else 0.0

    def _first_threshold(self) -> int:
        """L_1: the shortest length whose latency reaches ``outlier_fraction`` x the latency of a
        micro-batch of ``seq_len`` tokens of *ordinary* documents (those below L_1: a fixed point,
        found from "every document is ordinary" downwards, so outliers do not raise their own bar)."""
        cap = self.capacity
        l1 = cap + 1
        for _ in range(8):
            c = self._ordinary_work_per_token(l1)
            if c <= 0:
                break  # nothing below the current L_1 (every document is long): keep it
            k = int(np.searchsorted(self._grid_w, self.outlier_fraction * c * self.config.seq_len, side="left"))
            new = int(self._grid[k]) if k < self._grid.size else cap + 1
            if new >= l1:
                break
            l1 = new
        return l1

    # -- planning --------------------------------------------------------------------------------
    @property
    def reads_ahead(self) -> bool:
        """Whether the read-ahead fill (h) runs: ``fill_target`` on, pieces may wait (``max_delay`` > 0) and
        ``read_ahead`` not off (Megatron's own samples are never read ahead of their iteration)."""
        cfg = self.config
        return cfg.fill_target > 0 and cfg.max_delay > 0 and cfg.read_ahead is not False

    def _plan(self, new: list[DocPiece], final: bool) -> list[MicroBatch]:
        cfg = self.config
        m = cfg.micro_batches_per_iteration
        r = self.release_size
        cap = self.capacity
        it = self.iteration
        if new:
            self._observe(new)
            self._budgets += 1
        th = self.thresholds()
        pool = self._waiting + new
        oldest = it - cfg.max_delay  # arrival at or before this: forced
        forced = [p for p in pool if p.arrival <= oldest]
        rest = [p for p in pool if p.arrival > oldest] if forced else pool
        l1 = th[0]
        candidates: list[DocPiece]
        waiting: list[DocPiece] = []
        if final:
            candidates = rest
        else:
            candidates = []
            outliers: list[DocPiece] = []
            for p in rest:
                (candidates if p.length < l1 else outliers).append(p)
            per_token = self._ordinary_work_per_token(l1)
            edges = np.asarray(th)
            levels = (np.searchsorted(edges, piece_lengths(outliers), side="right") - 1).tolist()
            forced_out = [p for p in forced if p.length >= l1]
            forced_levels = (np.searchsorted(edges, piece_lengths(forced_out), side="right") - 1).tolist()
            to_cut: set[DocPiece] = set()
            for q in range(len(th)):
                queue = sorted((p for p, lv in zip(outliers, levels) if lv == q), key=oldest_first_key)
                forced_q = [p for p, lv in zip(forced_out, forced_levels) if lv == q]
                if forced_q:
                    # A queue whose oldest member hit the delay bound goes out with it (its members
                    # nearest in length), so the forced outlier does not run alone against short
                    # micro-batches; with a cut policy, a forced outlier whose group the ordinary
                    # documents cannot balance is cut instead and its would-be companions wait.
                    anchor = max(p.length for p in forced_q)
                    chosen = self._companions(queue, r - len(forced_q), anchor) if self.flush_on_force else []
                    if cfg.cut_policy != "none" and not self._closable(
                            [p.length for p in forced_q + chosen], per_token):
                        cuttable = [p for p in forced_q if self._may_cut(p)]
                        if cuttable:
                            to_cut.update(cuttable)
                            kept = [p for p in forced_q if p not in to_cut]
                            chosen = self._companions(queue, r - len(kept), max(p.length for p in kept)) \
                                if kept and self.flush_on_force else []
                elif len(queue) >= r:
                    chosen = self._similar_group(queue, r, per_token) if cfg.group_by_work else queue[:r]
                else:
                    chosen = []
                picked = set(chosen)
                candidates.extend(chosen)
                waiting.extend(p for p in queue if p not in picked)
            if to_cut:
                forced = [piece for p in forced for piece in (self._cut(p, l1, per_token) if p in to_cut else [p])]
            if waiting and cfg.release_when_balanced:
                paid = self._balanced_release(waiting, forced + candidates, l1, per_token)
                if paid:
                    picked = set(paid)
                    waiting = [p for p in waiting if p not in picked]
                    candidates.extend(paid)
        if not final and waiting and cfg.min_fill > 0 and cfg.fill_target < cfg.min_fill:
            # No near-empty iterations: top the iteration up from the waiting pieces before
            # placing, so long waiting pieces still find empty micro-batches (unless the read-ahead
            # fill (h) tops it up with ordinary documents instead).
            have = sum(p.length for p in forced) + sum(p.length for p in candidates)
            early = self._early_release(waiting, cfg.min_fill * cfg.tokens_per_iteration - have)
            if early:
                picked = set(early)
                waiting = [p for p in waiting if p not in picked]
                self.fill_releases += len(early)
                if cfg.cut_policy != "none":
                    early = self._cut_early(early, forced + candidates, l1, per_token)
                candidates.extend(early)
        read_ahead = not final and self.reads_ahead
        if read_ahead:
            # (h) the ordinary documents a full iteration needs are read before the placement, so they are
            # placed with the rest, largest first (read after it, a long one could only land on top of an
            # already balanced micro-batch)
            have = sum(p.length for p in forced) + sum(p.length for p in candidates)
            candidates.extend(self._read_ahead_ordinary(cfg.fill_target * cfg.tokens_per_iteration - have,
                                                        waiting, l1))
        # Forced pieces first, in a pass of their own: one that fits nowhere whole is cut into the
        # micro-batches with most room *before* any newer piece can take that room, so the delay
        # bound holds whenever one iteration's intake fits in dp * n * max_seq_len.
        forced = sort_largest_first(forced)
        candidates = sort_largest_first(candidates)
        work = [0.0] * m
        toks = [0] * m
        bins: list[list[DocPiece]] = [[] for _ in range(m)]
        for p in self._place(forced, bins, work, toks, cap):
            self._split_forced(p, bins, work, toks, cap, waiting)
        waiting.extend(self._place(candidates, bins, work, toks, cap))
        if read_ahead:
            self._read_ahead_fill(bins, work, toks, cap, waiting, l1)
        if not final and waiting and cfg.min_fill > 0:
            # without the read-ahead, the waiting pieces are all there is to fill the iteration with
            self._fill_guard(bins, work, toks, cap, waiting, forced,
                             full=read_ahead or (cfg.read_ahead is False and cfg.fill_target > 0))
        waiting.sort(key=oldest_first_key)
        self._waiting = waiting
        if self._overlong_docs:
            self._overlong_docs &= {p.doc_id for p in waiting}
        if self.config.schedule_order and m > 1:
            bins = self._deal(bins, work)
        return [MicroBatch(tuple(b), cap) for b in bins]

    def _balanced_release(self, waiting: list[DocPiece], placed: list[DocPiece], l1: int,
                          per_token: float) -> list[DocPiece]:
        """(i) Delay only when it pays: the queued outliers (oldest first) that this iteration can take
        and still balance: the iteration's outliers dealt heaviest first to the least loaded
        micro-batch, and each new one to the least loaded, the heaviest stays within
        ``CLOSE_TOLERANCE`` of the balanced mean and every micro-batch has the room its ordinary share
        needs (``_balanceable``'s test, kept incrementally: O(micro-batches) per candidate). The
        ordinary tokens are those in hand, or, with the read-ahead fill (h), what it fills to
        (``fill_target`` x the budget) less the outliers. An outlier that no iteration could balance
        waits for a group, as before."""
        queued = sorted((p for p in waiting if p.length >= l1), key=oldest_first_key)
        if not queued or per_token <= 0:
            return []
        cfg = self.config
        m, cap, budget = cfg.micro_batches_per_iteration, self.capacity, cfg.tokens_per_iteration
        read_ahead = self.reads_ahead
        big = np.sort(np.asarray([p.length for p in placed if p.length >= l1], dtype=np.int64))[::-1]
        in_hand = sum(p.length for p in placed if p.length < l1)
        bw, bt = np.zeros(m), np.zeros(m, dtype=np.int64)
        for d, x in zip(big.tolist(), self.latency(big).tolist()):
            j = int(np.argmin(bw))
            bw[j] += x
            bt[j] += d
        outlier_tokens = int(big.sum())
        weights = self.latency([p.length for p in queued]).tolist()
        out: list[DocPiece] = []
        for p, x in zip(queued, weights):
            j = int(np.argmin(bw))
            if bt[j] + p.length > cap:
                continue
            tokens = outlier_tokens + p.length
            fill = int(cfg.fill_target * budget)
            ordinary = max(in_hand, fill - tokens) if read_ahead else in_hand
            if tokens + in_hand > cap * m:
                continue
            bw[j] += x
            bt[j] += p.length
            mean = (float(bw.sum()) + per_token * ordinary) / m
            if bw.max() <= mean * (1 + CLOSE_TOLERANCE) and \
                    np.all(mean - bw <= per_token * (cap - bt) + 1e-12 * mean):
                out.append(p)
                outlier_tokens = tokens
            else:
                bw[j] -= x
                bt[j] -= p.length
        self.balanced_releases += len(out)
        return out

    def _observe(self, pieces: list[DocPiece]) -> None:
        """Add pieces read from the stream to the length histogram the auto thresholds come from."""
        lens = piece_lengths(pieces)
        bins_ = _hist_bin(lens)
        self._hist += np.bincount(bins_, minlength=HIST_BINS)
        self._hist_tokens += np.bincount(bins_, weights=lens, minlength=HIST_BINS).astype(np.int64)
        self._hist_work += np.bincount(bins_, weights=self.latency(lens), minlength=HIST_BINS)

    def _place(self, pieces: list[DocPiece], bins: list[list[DocPiece]], work: list[float], toks: list[int],
               cap: int) -> list[DocPiece]:
        """``place_pieces`` priced by this packer's latency table."""
        return place_pieces(pieces, bins, work, toks, cap, self.latency)

    def _read_ahead_ordinary(self, tokens: float, waiting: list[DocPiece], l1: int) -> list[DocPiece]:
        """Full iterations (h): read documents ahead from the stream until their ordinary pieces (below
        ``L_1``) hold ``tokens`` and return those to be placed; outliers read on the way join ``waiting``.
        They arrive now (no delay); the tokens read are credited against later budgets, so the stream
        rate is unchanged. The delay bound (b) holds as before: what this iteration's arrivals may leave
        waiting (all it reads, at worst) is kept within what one iteration holds (``dp * n *
        max_seq_len``), so the iteration that forces them can take them."""
        room = self.capacity * self.config.micro_batches_per_iteration - \
            sum(p.length for p in waiting if p.arrival == self.iteration)
        ordinary: list[DocPiece] = []
        got = 0
        while got < tokens and room > 0:
            new = self._read_ahead(int(tokens - got), room)
            if not new:
                break
            self._observe(new)
            read = sum(p.length for p in new)
            self.read_ahead_tokens += read
            room -= read
            for p in new:
                if p.length >= l1:
                    waiting.append(p)
                else:
                    ordinary.append(p)
                    got += p.length
        return ordinary

    def _read_ahead_fill(self, bins: list[list[DocPiece]], work: list[float], toks: list[int], cap: int,
                         waiting: list[DocPiece], l1: int) -> None:
        """(h) after the placement: while the iteration is still short of ``fill_target`` x the token
        budget (ordinary pieces read before it did not all fit, or outliers came with them), read more
        ordinary documents and place them, least-loaded micro-batch first, until the target, the end of
        the stream, or a piece that fits nowhere (it waits)."""
        need = self.config.fill_target * self.config.tokens_per_iteration
        while (have := sum(toks)) < need:
            ordinary = sort_largest_first(self._read_ahead_ordinary(need - have, waiting, l1))
            if not ordinary:
                return
            unplaced = self._place(ordinary, bins, work, toks, cap)
            if unplaced:
                waiting.extend(unplaced)
                return

    def _closable(self, lengths: list[int], per_token: float) -> bool:
        """Whether outliers of ``lengths``, one per micro-batch, can be balanced by the iteration's
        ordinary tokens (the budget minus theirs, ``per_token`` latency each): spread to even the
        work, the heaviest stays within ``CLOSE_TOLERANCE`` (2%) of the mean and every micro-batch has
        the room its share needs."""
        m = self.config.micro_batches_per_iteration
        k = len(lengths)
        if k > m:
            return False
        if per_token <= 0 or k == 0:
            return True
        d = np.zeros(m, dtype=np.int64)
        d[:k] = lengths
        w = np.zeros(m)
        w[:k] = self.latency(d[:k])
        ordinary = max(0, self.config.tokens_per_iteration - int(d.sum()))
        mean = (float(w.sum()) + per_token * ordinary) / m
        return bool(w.max() <= mean * (1 + CLOSE_TOLERANCE) and
                    np.all(mean - w <= per_token * (self.capacity - d) + 1e-12 * mean))

    def _similar_group(self, queue: list[DocPiece], r: int, per_token: float) -> list[DocPiece]:
        """R queue members of similar work that the ordinary documents can balance, or none (wait).

        Candidates are the windows of R consecutive members by length, those holding the oldest
        member first, then by length spread; the first ``_closable`` one is released. A group
        that never closes goes out when its oldest member reaches the delay bound (with its
        nearest companions).
        """
        by_len = sorted(queue, key=shortest_first_key)
        oldest = queue[0]
        windows = range(len(by_len) - r + 1)
        spread = [by_len[s + r - 1].length - by_len[s].length for s in windows]
        has_oldest = [oldest in by_len[s:s + r] for s in windows]
        order = sorted(windows, key=lambda s: (not has_oldest[s], spread[s], s))
        if self.release_size != self.config.micro_batches_per_iteration or per_token <= 0:
            return by_len[order[0]:order[0] + r]
        for s in order:
            group = by_len[s:s + r]
            if self._closable([p.length for p in group], per_token):
                return group
        return []

    def _may_cut(self, p: DocPiece) -> bool:
        """The cut policy's scope: ``any`` piece, or (``overlong``) pieces of documents over S_max."""
        return self.config.cut_policy == "any" or (self.config.cut_policy == "overlong" and
                                                  p.doc_id in self._overlong_docs)

    def _cut(self, p: DocPiece, l1: int, per_token: float) -> list[DocPiece]:
        """The opt-in cut: ``p`` into the fewest equal pieces that the ordinary documents can
        balance (``_closable``), or that are ordinary (below L_1). Counted in ``cut_stats``."""
        k = 2
        while True:
            size = -(-p.length // k)
            if size < l1 or size <= 1 or self._closable([size] * k, per_token):
                break
            k += 1
        return self._cut_into(p, k)

    def _cut_into(self, p: DocPiece, k: int) -> list[DocPiece]:
        """``p`` as ``k`` contiguous pieces of near-equal length (``p`` itself for k = 1); the cut
        points, tokens and pieces are counted in ``cut_stats``. Never more pieces than tokens: a
        piece of one token (an outlier when L_1 = 1) stays whole rather than giving an empty piece."""
        k = min(k, p.length)
        if k <= 1:
            return [p]
        sizes = [p.length // k + (1 if i < p.length % k else 0) for i in range(k)]
        out, off = [], p.offset
        for size in sizes:
            out.append(DocPiece(p.doc_id, off, size, p.arrival))
            off += size
        self.cut_stats["cut_points"] += k - 1
        self.cut_stats["tokens"] += p.length
        self.cut_stats["pieces"] += k
        return out

    def _balanceable(self, lengths: list[int], per_token: float, ordinary: int) -> bool:
        """Whether outlier pieces of ``lengths`` (any number; dealt heaviest first to the least
        loaded micro-batch) and ``ordinary`` tokens of ordinary documents (``per_token`` latency
        each) can be balanced: the heaviest micro-batch's outliers stay within ``CLOSE_TOLERANCE``
        of the mean and every micro-batch has the room its ordinary share needs. With one outlier
        per micro-batch and ``ordinary`` = the budget minus the outliers this is ``_closable``."""
        m = self.config.micro_batches_per_iteration
        if per_token <= 0 or not lengths:
            return True
        order = np.argsort(-np.asarray(lengths, dtype=np.int64), kind="stable")
        lens = np.asarray(lengths, dtype=np.int64)[order]
        w = self.latency(lens)
        bw = np.zeros(m)
        bt = np.zeros(m, dtype=np.int64)
        for d, x in zip(lens.tolist(), w.tolist()):
            j = int(np.argmin(bw))
            bw[j] += x
            bt[j] += d
        if int(bt.max()) > self.capacity:
            return False
        mean = (float(bw.sum()) + per_token * ordinary) / m
        return bool(bw.max() <= mean * (1 + CLOSE_TOLERANCE) and
                    np.all(mean - bw <= per_token * (self.capacity - bt) + 1e-12 * mean))

    def _cut_early(self, early: list[DocPiece], others: list[DocPiece], l1: int,
                   per_token: float) -> list[DocPiece]:
        """The cut policy on the fill rule's early releases (f, g): when the iteration (``others``
        plus ``early``) holds outliers its ordinary documents cannot balance (``_balanceable``),
        cut the released outliers the policy may cut, heaviest piece first, one more piece at a
        time, into the fewest pieces that can be balanced (or until they are ordinary, below
        L_1). Nothing is cut when even that would not balance the iteration. Counted in
        ``cut_stats``."""
        cuttable = [p for p in early if p.length >= l1 and self._may_cut(p)]
        if not cuttable:
            return early
        chosen = set(cuttable)
        pieces = others + early
        fixed = [p.length for p in pieces if p.length >= l1 and p not in chosen]
        ordinary = sum(p.length for p in pieces if p.length < l1)

        def balanced(ks: list[int]) -> bool:
            big, small = list(fixed), ordinary
            for p, k in zip(cuttable, ks):
                sizes = [p.length // k + (1 if i < p.length % k else 0) for i in range(k)]
                for x in sizes:
                    if x >= l1:
                        big.append(x)
                    else:
                        small += x
            return self._balanceable(big, per_token, small)

        ks = [1] * len(cuttable)
        if balanced(ks):
            return early
        floor = [max(1, -(-p.length // max(1, l1 - 1))) for p in cuttable]  # pieces below L_1
        while not balanced(ks):
            i = max((i for i in range(len(cuttable)) if ks[i] < floor[i]),
                    key=lambda i: (-(-cuttable[i].length // ks[i]), -i), default=-1)
            if i < 0:
                break
            ks[i] += 1
        cut = {p: k for p, k in zip(cuttable, ks) if k > 1}
        return [q for p in early for q in (self._cut_into(p, cut[p]) if p in cut else [p])]

    @staticmethod
    def _companions(queue: list[DocPiece], k: int, anchor: int) -> list[DocPiece]:
        """The ``k`` members closest in length to a forced outlier of ``anchor`` tokens (older first on ties)."""
        return sorted(queue, key=lambda p: (abs(p.length - anchor), *oldest_first_key(p)))[:k]

    def _early_release(self, waiting: list[DocPiece], need: float) -> list[DocPiece]:
        """Waiting pieces worth at least ``need`` tokens, shortest first (they are the easiest to
        balance against the few ordinary documents of an under-filled iteration); pieces of one
        document go out together."""
        out: list[DocPiece] = []
        if need <= 0:
            return out
        docs: dict[int, list[DocPiece]] = {}
        for p in sorted(waiting, key=shortest_first_key):
            docs.setdefault(p.doc_id, []).append(p)
        got = 0
        for doc_pieces in docs.values():
            if got >= need:
                break
            out.extend(doc_pieces)
            got += sum(p.length for p in doc_pieces)
        return out

    def _fill_guard(self, bins: list[list[DocPiece]], work: list[float], toks: list[int], cap: int,
                    waiting: list[DocPiece], forced: list[DocPiece], full: bool) -> None:
        """No near-empty iterations: while pieces wait, place waiting ones (oldest first, all the
        waiting pieces of a document together) until the iteration holds ``min_fill`` x the token
        budget, or ``fill_target`` x when ``full`` (the read-ahead fill (h) is on and ran out of room
        for the outliers it would queue), or nothing more fits. The iteration is then placed again from
        scratch, forced pieces first, the rest largest first, so the released pieces are balanced with
        the others rather than stacked on already balanced micro-batches (kept only if every piece fits
        again). ``bins``, ``work``, ``toks`` and ``waiting`` are updated in place."""
        cfg = self.config
        need = max(cfg.min_fill, cfg.fill_target if full else 0.0) * cfg.tokens_per_iteration
        if sum(toks) >= need:
            return
        waiting.sort(key=oldest_first_key)
        docs: dict[int, list[DocPiece]] = {}
        for p in waiting:
            docs.setdefault(p.doc_id, []).append(p)
        placed: set[DocPiece] = set()
        for doc_pieces in docs.values():
            if sum(toks) >= need:
                break
            unplaced = self._place(doc_pieces, bins, work, toks, cap)
            if unplaced and full and self._replace_all(bins, work, toks, cap, forced, unplaced, balanced=True):
                unplaced = []  # fits once the iteration is placed again with it
            placed.update(p for p in doc_pieces if p not in unplaced)
        self.fill_releases += len(placed)
        waiting[:] = [p for p in waiting if p not in placed]
        if placed and full:
            self._replace_all(bins, work, toks, cap, forced)

    def _replace_all(self, bins: list[list[DocPiece]], work: list[float], toks: list[int], cap: int,
                     forced: list[DocPiece], extra: list[DocPiece] | None = None, balanced: bool = False) -> bool:
        """Place the iteration's pieces (and ``extra``) again from empty micro-batches: forced first
        (the delay bound's pass), then the rest, each largest first. Adopted, returning True, only if
        every piece fits, so nothing that was placed waits (a forced piece split to fit stays split),
        and, with ``balanced``, only if the heaviest micro-batch is no heavier than before or within
        ``CLOSE_TOLERANCE`` of the new mean (an extra piece must not unbalance the iteration)."""
        first = set(forced)
        pieces = [p for b in bins for p in b] + list(extra or ())
        m = len(bins)
        new_bins: list[list[DocPiece]] = [[] for _ in range(m)]
        new_work, new_toks = [0.0] * m, [0] * m
        left = self._place(sort_largest_first([p for p in pieces if p in first]), new_bins, new_work, new_toks, cap)
        if not left:
            left = self._place(sort_largest_first([p for p in pieces if p not in first]), new_bins, new_work,
                               new_toks, cap)
        if left:
            return False
        if balanced and max(new_work) > max(max(work), sum(new_work) / m * (1 + CLOSE_TOLERANCE)):
            return False
        bins[:], work[:], toks[:] = new_bins, new_work, new_toks
        return True

    def _deal(self, bins: list[list[DocPiece]], work: list[float]) -> list[list[DocPiece]]:
        """Deal the micro-batches to DP ranks and order them for the pipeline schedule (d)."""
        cfg = self.config
        return deal_micro_batches(bins, work, self.cost, cfg.dp, cfg.n, cfg.stages, cfg.virtual_stages)

    def _split_forced(self, p: DocPiece, bins: list[list[DocPiece]], work: list[float], toks: list[int],
                      cap: int, waiting: list[DocPiece]) -> None:
        """Last resort for a piece at its delay bound that fits nowhere whole: fill the emptiest bins.
        With ``pieces="concat-and-cut"`` nothing is cut: the piece waits one more iteration (first in
        line, since it stays forced), counted in ``delay_overruns``."""
        if self.config.pieces == "concat-and-cut":
            waiting.append(p)
            self.delay_overruns += 1
            return
        off, left = p.offset, p.length
        for j in sorted(range(len(bins)), key=lambda j: (toks[j], j)):
            room = cap - toks[j]
            if room <= 0 or left == 0:
                break
            take = min(room, left)
            bins[j].append(DocPiece(p.doc_id, off, take, p.arrival))
            toks[j] += take
            work[j] += float(self.latency([take])[0])
            off += take
            left -= take
        self.forced_splits += 1
        if left:
            waiting.append(DocPiece(p.doc_id, off, left, p.arrival))

    # -- state -----------------------------------------------------------------------------------
    def _extra_state(self) -> dict[str, Any]:
        nz = np.flatnonzero(self._hist)
        return {"waiting": pieces_to_state(self._waiting),
                "hist": [[int(b), int(self._hist[b]), int(self._hist_tokens[b]), float(self._hist_work[b])]
                         for b in nz],
                "budgets": self._budgets, "forced_splits": self.forced_splits,
                "fill_releases": self.fill_releases, "cut_stats": dict(self.cut_stats),
                "delay_overruns": self.delay_overruns, "read_ahead_tokens": self.read_ahead_tokens,
                "balanced_releases": self.balanced_releases, "overlong_docs": sorted(self._overlong_docs)}

    def _load_extra_state(self, state: dict[str, Any]) -> None:
        self._waiting = pieces_from_state(state["waiting"])
        self._hist = np.zeros(HIST_BINS, dtype=np.int64)
        self._hist_tokens = np.zeros(HIST_BINS, dtype=np.int64)
        self._hist_work = np.zeros(HIST_BINS, dtype=np.float64)
        for b, c, t, w in state["hist"]:
            self._hist[int(b)], self._hist_tokens[int(b)], self._hist_work[int(b)] = int(c), int(t), float(w)
        self._budgets = int(state["budgets"])
        self.forced_splits = int(state["forced_splits"])
        self.fill_releases = int(state["fill_releases"])
        self.delay_overruns = int(state["delay_overruns"])
        self.read_ahead_tokens = int(state["read_ahead_tokens"])
        self.balanced_releases = int(state["balanced_releases"])
        self.cut_stats = {k: int(v) for k, v in state["cut_stats"].items()}
        self._overlong_docs = {int(d) for d in state["overlong_docs"]}
