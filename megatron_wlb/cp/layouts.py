"""Context-parallel shard layouts: which token positions of a packed micro-batch each CP rank owns.

Pure numpy, vectorised over runs of tokens (never a Python loop per token). A micro-batch is its
document lengths in order; a layout assigns every token position to exactly one of ``cp`` ranks.
All-gather CP (Llama-3 style, WLB-LLM Sec. 5) then gathers K/V, and each rank runs varlen attention
for its own *query runs*: maximal stretches of its tokens that are consecutive inside one document.
A query run ``[s, e)`` of a document starting at ``ds`` attends keys ``[ds, e)`` with a
bottom-right-aligned causal mask (``seqlen_k = e - ds``, as flash-attention varlen does).

Layouts (``LAYOUT_NAMES``):

``per-sequence``
    Megatron's default: the whole micro-batch of ``T`` tokens is cut into ``2*cp`` chunks, rank
    ``r`` takes chunks ``r`` and ``2cp-1-r``. When ``T % (2cp) == 0`` this is exactly Megatron's
    split; otherwise the ``T % (2cp)`` leftover tokens grow the chunks by one token each, dealt
    round-robin over ranks (head chunk first), so nothing is padded.
``per-document``
    Every document ``d = e + r`` (``e`` divisible by ``2cp``) is cut into ``2cp`` chunks of ``e/2cp``
    tokens and rank ``r`` takes chunks ``r`` and ``2cp-1-r`` (WLB-LLM Sec. 5.2). The ``r`` leftover
    tokens grow chunks by one token each, dealt round-robin over ranks by ONE counter that runs on
    across the documents of the micro-batch (the head chunk of a rank grows first, its tail chunk
    only when ``r > cp``). Chunks stay contiguous, so no single-token runs appear unless a document
    is shorter than ``2cp``.
``per-document-te``
    TransformerEngine's ``thd_get_partitioned_indices``: every document padded to a multiple of
    ``2cp`` (padding at its end), then the head-tail split per padded document. Positions are in
    the padded micro-batch (``padded_lengths``). For users who keep TE's ring attention.
``adaptive``
    Per micro-batch, whichever of ``per-sequence`` / ``per-document`` has the lower price of its slowest
    rank, each rank's share priced as laid out (``ShardLayout.seconds``: its attention runs, tokens, pairs,
    the all-gather and the micro-batch's fixed and whole-micro-batch costs); ``ShardLayout.name`` is the choice.
``hybrid`` (per-document choice; beyond the paper, whose Sec. 8 leaves it open)
    Short documents whose per-document shards would run the kernel inefficiently (whole cost <
    summed shard cost) are kept whole and placed longest-processing-time first; the long documents
    are split head-tail with per-rank pair sizes that water-fill the ranks to a common level (a
    pair of f*d tokens costs f of the document's attention wherever it sits). The balanced load is
    attention work plus the linear-layer time of a rank's tokens, and tokens per rank are capped at
    ``ceil(T/cp * (1 + token_slack))`` (see ``_runs_hybrid``). Falls back to ``per-document`` when
    that is estimated faster, and, like ``adaptive``, to ``per-sequence`` (then
    ``name == "per-sequence"``).

Equal-count guarantee (tested): for ``per-sequence`` and ``per-document`` the token counts of the
ranks differ by at most one; rank ``k`` holds ``floor(T/cp) + (k < T % cp)`` tokens, so all counts
are equal exactly when ``cp`` divides ``T``. (The round-robin deals ``R = T mod 2cp`` resp.
``R = sum_d (d mod 2cp)`` tokens starting at rank 0, and ``R = T (mod cp)`` in both cases.)
``per-document-te`` gives every rank exactly ``sum(padded_lengths) / cp``. ``hybrid`` promises only
the token cap.

Work estimate (``RankShard.work``): for each query run of ``q`` queries ending at key ``kv``,
``cost.attention_run(q_pad, kv_pad) / efficiency.relative(q_pad, kv_pad)`` with ``q_pad``,
``kv_pad`` rounded up to the kernel tile: tile-padded FLOPs over achieved TFLOP/s from the table,
in the cost model's units (forward seconds, one layer, one GPU). Large shapes have relative
efficiency ~1, so a whole document costs what ``cost.attention_run(d, d)`` says.
"""

from __future__ import annotations

import hashlib
from dataclasses import dataclass, field
from functools import cached_property

import numpy as np

from megatron_wlb.costmodel import AnalyticCostModel, CostModel, ParallelLayout, get_model
from megatron_wlb.costmodel.shapes import causal_pairs
from megatron_wlb.cp.efficiency import KernelEfficiency
from megatron_wlb.data.lengths import validate_lengths
from megatron_wlb.packing.metrics import share_seconds

LAYOUT_NAMES: tuple[str, ...] = ("per-sequence", "per-document", "per-document-te", "adaptive", "hybrid")


def key_pieces(runs: np.ndarray, seg_start: np.ndarray, seg_end: np.ndarray,
               width: int) -> tuple[np.ndarray, np.ndarray]:
    """(first row, length) of the contiguous pieces of an all-gather buffer (rank ``r``'s tokens at rows
    ``r * width`` on) that hold micro-batch positions ``[seg_start[i], seg_end[i])``, in order over i.
    ``runs`` is the layout's runs sorted by position, ``[start, end, owner, offset in the owner's tokens]``
    per row. O(pieces): a piece is the overlap of a segment with one run."""
    if seg_start.size == 0:
        return np.zeros(0, dtype=np.int64), np.zeros(0, dtype=np.int64)
    start, end, owner, local = runs.T
    j_lo = np.searchsorted(start, seg_start, side="right") - 1
    j_hi = np.searchsorted(start, seg_end - 1, side="right") - 1
    count = j_hi - j_lo + 1
    j = expand_runs(j_lo, count)
    seg = np.repeat(np.arange(seg_start.size), count)
    ps = np.maximum(start[j], seg_start[seg])
    pe = np.minimum(end[j], seg_end[seg])
    return owner[j] * width + local[j] + (ps - start[j]), pe - ps


@dataclass(frozen=True, eq=False)
class RankShard:
    """What one CP rank owns, as runs; everything else is derived from them on first use.

    ``query_runs`` ``[n, 3]``: this rank's query runs ``(start, end, document start)`` in its token
    order (a run attends keys ``[document start, end)``); ``owners`` ``[m, 4]``: the whole layout's runs
    sorted by position, ``(start, end, owner rank, offset in the owner's tokens)``, shared by its ranks;
    ``rank_counts``: every rank's token count; ``work``: this rank's estimated attention seconds.

    Derived (O(runs)): ``runs`` (maximal contiguous ``[start, end)`` runs, the ``wlb shard`` contract),
    ``cu_seqlens_q`` / ``cu_seqlens_k`` (int32), ``max_seqlen_*``, ``gather_pieces``. Derived (O(tokens),
    what a training rank needs of its own only): ``token_index`` (its positions in the micro-batch),
    ``position_ids``, ``kv_index``, ``gather_rows`` and ``gather_position`` (where each micro-batch
    position lands in the all-gathered buffer: the inverse of every rank's ``token_index``).
    """

    rank: int
    work: float
    rank_counts: tuple[int, ...]
    query_runs: np.ndarray = field(repr=False)
    owners: np.ndarray = field(repr=False)

    @classmethod
    def _fast(cls, **fields) -> RankShard:
        """Construct without the frozen dataclass's per-field ``object.__setattr__`` (build_layout
        makes cp of these every step); the fields are exactly those of ``__init__``."""
        obj = object.__new__(cls)
        obj.__dict__.update(fields)
        return obj

    @property
    def run_start(self) -> np.ndarray:
        return self.query_runs[:, 0]

    @property
    def run_key_start(self) -> np.ndarray:
        return self.query_runs[:, 2]

    @property
    def query_lengths(self) -> np.ndarray:
        return self.query_runs[:, 1] - self.query_runs[:, 0]

    @property
    def key_lengths(self) -> np.ndarray:
        return self.query_runs[:, 1] - self.query_runs[:, 2]

    @property
    def num_tokens(self) -> int:
        return self.rank_counts[self.rank]

    @cached_property
    def cu_seqlens_q(self) -> np.ndarray:
        return np.concatenate([[0], np.cumsum(self.query_lengths)]).astype(np.int32)

    @cached_property
    def cu_seqlens_k(self) -> np.ndarray:
        return np.concatenate([[0], np.cumsum(self.key_lengths)]).astype(np.int32)

    @property
    def max_seqlen_q(self) -> int:
        return int(self.query_lengths.max()) if self.query_runs.size else 0

    @property
    def max_seqlen_k(self) -> int:
        return int(self.key_lengths.max()) if self.query_runs.size else 0

    @cached_property
    def runs(self) -> np.ndarray:
        """int64 [k, 2]: maximal contiguous ``[start, end)`` runs, in this rank's order."""
        start, end = self.query_runs[:, 0], self.query_runs[:, 1]
        new = np.ones(start.size, dtype=bool)
        new[1:] = start[1:] != end[:-1]
        m_end = np.empty(int(new.sum()), dtype=np.int64)
        m_end[np.cumsum(new) - 1] = end                                  # the last run of each group wins
        return np.stack([start[new], m_end], axis=1).astype(np.int64, copy=False)

    @cached_property
    def token_index(self) -> np.ndarray:
        """int64 [T_r]: positions in the (padded) micro-batch, in this rank's order."""
        return expand_runs(self.run_start, self.query_lengths)

    @cached_property
    def position_ids(self) -> np.ndarray:
        """int64 [T_r]: each token's position within its document."""
        return expand_runs(self.run_start - self.run_key_start, self.query_lengths)

    @cached_property
    def kv_index(self) -> np.ndarray:
        """int64: each query run's key segment ``[doc_start, run_end)``, concatenated in run order."""
        return expand_runs(self.run_key_start, self.key_lengths)

    @cached_property
    def gather_position(self) -> np.ndarray:
        """int64 [T]: where each micro-batch position lands in the (unpadded) all-gathered order."""
        start, end, owner, local = self.owners.T
        offsets = np.concatenate([[0], np.cumsum(self.rank_counts)])[:-1].astype(np.int64)
        return expand_runs(offsets[owner] + local, end - start)                 # runs tile 0..T in order

    def gather_pieces(self, width: int | None = None) -> tuple[np.ndarray, np.ndarray]:
        """(first row, length) runs whose expansion is :meth:`gather_rows`; O(runs), so the O(keys)
        expansion can happen on the accelerator (the device upload does that)."""
        width = max(self.rank_counts) if width is None else int(width)
        return key_pieces(self.owners, self.run_key_start, self.run_start + self.query_lengths, width)

    def gather_rows(self, width: int | None = None) -> np.ndarray:
        """int64, aligned with ``kv_index``: the row of each key in an all-gather buffer whose rank
        blocks are ``width`` rows apart (default ``max(rank_counts)``: every rank padded to the
        largest). Built from runs without searching per position."""
        return expand_runs(*self.gather_pieces(width))


@dataclass(frozen=True, eq=False)
class ShardLayout:
    """A micro-batch's assignment of tokens to CP ranks; ``name`` is the layout used."""

    name: str
    requested: str
    cp: int
    lengths: np.ndarray
    padded_lengths: np.ndarray
    ranks: tuple[RankShard, ...]
    # adaptive: candidate -> its slowest rank's seconds (``share_seconds``); hybrid: candidate -> max rank attention
    # + linear
    estimates: dict = field(default_factory=dict)

    @property
    def rank_work(self) -> np.ndarray:
        return np.array([r.work for r in self.ranks], dtype=np.float64)

    @property
    def rank_tokens(self) -> np.ndarray:
        return np.array([r.num_tokens for r in self.ranks], dtype=np.int64)

    @property
    def rank_pairs(self) -> np.ndarray:
        """Causal (query, key) pairs each rank's attention computes."""
        return np.array([float(causal_pairs(r.query_lengths, r.key_lengths).sum()) for r in self.ranks])

    def seconds(self, cost: CostModel, efficiency: KernelEfficiency | None = None, tile: int = 128
                ) -> tuple[np.ndarray, np.ndarray]:
        """(forward, backward) seconds per layer of every CP rank's share as laid out (``share_seconds``): its own
        query runs priced by ``cost`` (``attention_work``, the kernel as ``build_layout`` would take it), its tokens,
        pairs and the micro-batch's all-gather. What a rank's time is predicted by, wherever it is predicted."""
        eff, tile = kernel_of(cost, efficiency, tile)
        q = np.concatenate([r.query_lengths for r in self.ranks]).astype(np.int64)
        kv = np.concatenate([r.key_lengths for r in self.ranks]).astype(np.int64)
        rank = np.repeat(np.arange(self.cp), [r.query_runs.shape[0] for r in self.ranks])
        work = attention_work(q, kv, cost, eff, tile) if q.size else np.zeros(0)
        return _rank_seconds(rank, q, kv, work, self.cp, int(self.padded_lengths.sum()), cost)

    @property
    def imbalance(self) -> float:
        """max / mean of the ranks' estimated attention work (1.0 for an empty micro-batch)."""
        w = self.rank_work
        mean = w.mean() if w.size else 0.0
        return float(w.max() / mean) if mean > 0 else 1.0

    @property
    def max_work(self) -> float:
        """Estimated CP attention time of the micro-batch: the slowest rank's work."""
        return float(self.rank_work.max()) if self.ranks else 0.0

    def to_json(self) -> dict:
        """The ``wlb shard`` contract line: layout used, padded lengths, per-rank [start, end) runs."""
        return {"layout": self.name,
                "padded_lengths": [int(x) for x in self.padded_lengths],
                "ranks": [r.runs.tolist() for r in self.ranks]}


# ------------------------------------------------------------------------------------------------
# vectorised helpers
# ------------------------------------------------------------------------------------------------

def _exclusive_cumsum(x: np.ndarray) -> np.ndarray:
    out = np.zeros(x.size, dtype=np.int64)
    if x.size > 1:
        np.cumsum(x[:-1], out=out[1:])
    return out


def expand_runs(starts: np.ndarray, lengths: np.ndarray) -> np.ndarray:
    """Concatenate ``arange(s, s + n)`` for each (s, n), without a Python loop."""
    lengths = np.asarray(lengths, dtype=np.int64)
    total = int(lengths.sum())
    if total == 0:
        return np.zeros(0, dtype=np.int64)
    return np.repeat(np.asarray(starts, dtype=np.int64) - _exclusive_cumsum(lengths), lengths) + np.arange(total)


def _head_tail_chunks(unit_start: np.ndarray, unit_len: np.ndarray, cp: int, rr_start: int = 0):
    """Cut each unit into 2cp contiguous chunks; rank r takes chunks r and 2cp-1-r.

    Each unit of length L = e + rem gets chunks of e/2cp tokens; its ``rem`` leftover tokens grow
    chunks by one, dealt round-robin over ranks by one counter that starts at ``rr_start`` and runs
    on across units (a rank's head chunk grows first, its tail chunk if it is dealt a second token).
    Returns (rank, start, end, unit) of the non-empty chunks, unit-major, and the counter's end.
    """
    two = 2 * cp
    base = unit_len // two
    rem = unit_len % two
    first = (rr_start + _exclusive_cumsum(rem)) % cp                  # rank dealt the unit's first token
    k = np.arange(cp)
    dealt = (rem // cp)[:, None] + (((k[None, :] - first[:, None]) % cp) < (rem % cp)[:, None])  # [n, cp]
    head_extra = np.minimum(dealt, 1)
    head = base[:, None] + head_extra
    tail = base[:, None] + (dealt - head_extra)
    rank, start, end, unit = _chunks_from_sizes(unit_start, head, tail)
    return rank, start, end, unit, int((rr_start + rem.sum()) % cp)


def _chunks_from_sizes(unit_start: np.ndarray, head: np.ndarray, tail: np.ndarray):
    """Lay out 2cp chunks per unit: chunk r (r < cp) of ``head[u, r]`` tokens and chunk 2cp-1-r of
    ``tail[u, r]`` tokens belong to rank r. Returns (rank, start, end, unit) of non-empty chunks."""
    n, cp = head.shape
    sizes = np.empty((n, 2 * cp), dtype=np.int64)
    sizes[:, :cp] = head
    sizes[:, cp:] = tail[:, ::-1]                                       # chunk 2cp-1-r belongs to rank r
    ends = np.cumsum(sizes, axis=1) + unit_start[:, None]
    starts = ends - sizes
    k = np.arange(cp)
    rank = np.broadcast_to(np.concatenate([k, k[::-1]]), (n, 2 * cp))
    unit = np.broadcast_to(np.arange(n)[:, None], (n, 2 * cp))
    keep = sizes.ravel() > 0
    return rank.ravel()[keep], starts.ravel()[keep], ends.ravel()[keep], unit.ravel()[keep]


def _split_at_documents(rank, start, end, cu):
    """Split [start, end) ranges that cross document boundaries ``cu`` into per-document pieces."""
    d_lo = np.searchsorted(cu, start, side="right") - 1
    d_hi = np.searchsorted(cu, end - 1, side="right") - 1
    count = d_hi - d_lo + 1
    idx = np.repeat(np.arange(start.size), count)
    doc = np.repeat(d_lo, count) + (np.arange(idx.size) - np.repeat(_exclusive_cumsum(count), count))
    s = np.maximum(start[idx], cu[doc])
    e = np.minimum(end[idx], cu[doc + 1])
    return rank[idx], s, e, doc


def attention_work(q_len: np.ndarray, kv_len: np.ndarray, cost: CostModel, efficiency: KernelEfficiency,
                   tile: int) -> np.ndarray:
    """Estimated forward seconds of query runs: tile-padded cost over the kernel's relative efficiency."""
    q = np.asarray(q_len, dtype=np.int64)
    kv = np.asarray(kv_len, dtype=np.int64)
    if tile > 1:
        q = -(-q // tile) * tile
        kv = -(-kv // tile) * tile
        return cost.attention_run(q, kv) / efficiency.relative_padded(q, kv, tile)
    return cost.attention_run(q, kv) / efficiency.relative(q, kv)


# ------------------------------------------------------------------------------------------------
# layout construction
# ------------------------------------------------------------------------------------------------

@dataclass(frozen=True)
class _Runs:
    """Query runs of all ranks (unsorted): rank, [start, end) in the (padded) micro-batch, document."""

    rank: np.ndarray
    start: np.ndarray
    end: np.ndarray
    doc: np.ndarray


def _runs_per_sequence(cu: np.ndarray, cp: int) -> _Runs:
    total = int(cu[-1])
    base, rem = divmod(total, 2 * cp)
    # the same chunk sizes as _head_tail_chunks for one unit, in plain ints (2cp values)
    dealt = [rem // cp + (k < rem % cp) for k in range(cp)]
    sizes = [base + min(x, 1) for x in dealt] + [base + x - min(x, 1) for x in reversed(dealt)]
    ends = np.cumsum(sizes)
    rank = np.concatenate([np.arange(cp), np.arange(cp)[::-1]])
    keep = ends > ends - sizes
    return _Runs(*_split_at_documents(rank[keep], (ends - sizes)[keep], ends[keep], cu))


def _runs_per_document(cu: np.ndarray, lengths: np.ndarray, cp: int) -> _Runs:
    rank, s, e, doc, _ = _head_tail_chunks(cu[:-1], lengths, cp)
    return _Runs(rank, s, e, doc)


def _rank_seconds(rank: np.ndarray, q: np.ndarray, kv: np.ndarray, work: np.ndarray, cp: int, total: int,
                  cost: CostModel) -> tuple[np.ndarray, np.ndarray]:
    """(forward, backward) seconds per layer of each of ``cp`` ranks, given its query runs (``rank`` of each run, its
    queries ``q``, keys ``kv`` and attention ``work``) of a micro-batch of ``total`` tokens: ``share_seconds`` of each
    rank's attention, tokens and pairs."""
    attention = np.bincount(rank, weights=work, minlength=cp)
    tokens = np.bincount(rank, weights=q, minlength=cp)
    pairs = np.bincount(rank, weights=causal_pairs(q, kv), minlength=cp)
    return share_seconds(cost, attention, tokens, pairs, float(total))


def kernel_of(cost: CostModel, efficiency: KernelEfficiency | None, tile: int) -> tuple[KernelEfficiency, int]:
    """The kernel-efficiency table and tile a layout prices query runs with: as given, else the shipped table; a
    cost model fitted to measured micro-batches holds the kernel's efficiency already (flat table, no tile)."""
    if efficiency is None and cost.measured_runs:
        return KernelEfficiency.flat(), 1
    return (KernelEfficiency.default() if efficiency is None else efficiency), int(tile)


def _step(runs: _Runs, work: np.ndarray, cp: int, per_token: float) -> float:
    """Slowest rank's estimated attention work plus linear time of its tokens."""
    if runs.rank.size == 0:
        return 0.0
    return float(np.bincount(runs.rank, weights=work + per_token * (runs.end - runs.start), minlength=cp).max())


def _water_fill(loads: list[float], pool: float) -> tuple[np.ndarray, float]:
    """Split ``pool`` over ranks with ``loads`` so the lowest ranks rise to a common level.
    Returns (fraction of the pool per rank, level); ranks above the level get nothing."""
    cp = len(loads)
    if pool <= 0:
        return np.zeros(cp), max(loads) if loads else 0.0
    ordered = sorted(loads)
    acc, level = 0.0, 0.0
    for k in range(1, cp + 1):
        acc += ordered[k - 1]
        level = (pool + acc) / k
        if k == cp or level <= ordered[k]:
            break
    frac = np.maximum(level - np.asarray(loads), 0.0)
    return frac / frac.sum(), level


def _shares(frac: np.ndarray, lengths: np.ndarray) -> np.ndarray:
    """Integer per-rank token shares of each document, proportional to ``frac`` (largest remainder)."""
    raw = lengths[:, None] * frac[None, :]
    shares = np.floor(raw).astype(np.int64)
    missing = lengths - shares.sum(axis=1)
    order = np.argsort(shares - raw, axis=1, kind="stable")           # largest remainder first
    place = np.argsort(order, axis=1, kind="stable")                   # each rank's place in that order
    return shares + (place < missing[:, None])


def _runs_hybrid(cu: np.ndarray, lengths: np.ndarray, cp: int, price, per_doc: tuple[_Runs, np.ndarray],
                 threshold: int | None, token_slack: float, per_token: float) -> tuple[_Runs, np.ndarray]:
    """Per-document choice: short documents whole, long ones head-tail split with per-rank sizes.

    Balanced quantity: a rank's estimated attention work plus ``per_token`` seconds for each token it
    holds (its linear layers run on its own tokens), so token balance is traded against attention
    balance explicitly; ``token_slack`` caps tokens per rank at ``ceil(T/cp * (1 + token_slack))``
    as a memory guard.

    1. Whole candidates: documents of at most ``threshold`` tokens (default ``T // cp``) whose
       whole cost is below the summed cost of their per-document shards (tile waste, slow shapes).
    2. Longest-processing-time first: candidates, largest first, go whole to the least loaded rank.
    3. The split documents are a fluid: a head-tail pair of f_r * d tokens of a document of d tokens
       costs f_r of the document's attention wherever it sits (the head and tail chunks' key
       ranges add up to d), so fractions f_r water-fill the ranks up to a common level.
    4. Repair: while the most loaded rank sits above that level and re-splitting its largest whole
       document lowers the planned maximum, re-split it.
    The plan is cut into integer chunk sizes (largest remainder), priced exactly, and kept only if
    it beats per-document on the balanced quantity and honours the token cap; otherwise
    per-document is returned. So ``hybrid`` is never estimated slower than ``per-document``.
    """
    runs, work = per_doc
    n, total = lengths.size, int(cu[-1])
    limit = total // cp if threshold is None else int(threshold)
    key = runs.doc * cp + runs.rank
    split_t = np.bincount(key, weights=runs.end - runs.start, minlength=n * cp).reshape(n, cp)
    split_cost = (np.bincount(key, weights=work, minlength=n * cp).reshape(n, cp) + per_token * split_t).sum(axis=1)
    whole = price(lengths, lengths) + per_token * lengths
    is_cand = (lengths <= limit) & (whole < split_cost)
    if not is_cand.any():
        return per_doc
    cand = np.flatnonzero(is_cand)
    cand = cand[np.argsort(-whole[cand], kind="stable")]
    owner = np.full(n, -1, dtype=np.int64)
    loads = [0.0] * cp
    whole_l = whole.tolist()
    for d in cand.tolist():                        # one step per candidate document (tens)
        r = loads.index(min(loads))
        loads[r] += whole_l[d]
        owner[d] = r
    pool = float(split_cost[owner < 0].sum())
    frac, level = _water_fill(loads, pool)
    for _ in range(int(cand.size)):                # repair an overloaded rank
        top = max(loads)
        if top <= level * (1 + 1e-9):
            break
        r = loads.index(top)
        mine = np.flatnonzero(owner == r)
        d = int(mine[np.argmax(whole[mine])])
        trial = list(loads)
        trial[r] -= whole_l[d]
        t_frac, t_level = _water_fill(trial, pool + float(split_cost[d]))
        if max(max(trial), t_level) >= max(top, level):
            break
        loads, pool, frac, level = trial, pool + float(split_cost[d]), t_frac, t_level
        owner[d] = -1
    kept = np.flatnonzero(owner >= 0)
    if kept.size == 0:
        return per_doc
    split_ids = np.flatnonzero(owner < 0)
    share = _shares(frac, lengths[split_ids])
    rank, s, e, unit = _chunks_from_sizes(cu[split_ids], (share + 1) // 2, share // 2)
    out = _Runs(np.concatenate([rank, owner[kept]]), np.concatenate([s, cu[kept]]),
                np.concatenate([e, cu[kept + 1]]), np.concatenate([split_ids[unit], kept]))
    tokens = np.bincount(out.rank, weights=out.end - out.start, minlength=cp)
    if tokens.max() > np.ceil(total / cp * (1.0 + token_slack)):
        return per_doc
    out_work = price(out.end - out.start, out.end - cu[out.doc])
    if _step(out, out_work, cp, per_token) > _step(runs, work, cp, per_token):
        return per_doc
    return out, out_work


def _assemble(name: str, requested: str, cp: int, lengths: np.ndarray, padded: np.ndarray, cu: np.ndarray,
              runs: _Runs, work: np.ndarray, estimates: dict) -> ShardLayout:
    """Sort the runs into rank order; each rank keeps its slice of them (the rest is derived on use)."""
    order = np.argsort(runs.rank * (int(cu[-1]) + 1) + runs.start)   # (rank, start); keys are unique
    rank, start, end, doc, work = runs.rank[order], runs.start[order], runs.end[order], runs.doc[order], work[order]
    q = end - start
    bounds = np.searchsorted(rank, np.arange(cp + 1))                 # run offsets per rank
    cq = np.concatenate([[0], np.cumsum(q)])
    counts = tuple(int(x) for x in np.diff(cq[bounds]))
    local = cq[:-1] - cq[bounds[rank]]                                # offset within the owner's tokens
    owners = np.stack([start, end, rank, local], axis=1)[np.argsort(start)]
    query_runs = np.stack([start, end, cu[doc]], axis=1)
    b_list, work_list = bounds.tolist(), np.bincount(rank, weights=work, minlength=cp).tolist()
    shards = tuple(RankShard._fast(rank=r, work=work_list[r], rank_counts=counts,
                                   query_runs=query_runs[b_list[r]:b_list[r + 1]], owners=owners)
                   for r in range(cp))
    return ShardLayout(name=name, requested=requested, cp=cp, lengths=lengths, padded_lengths=padded,
                       ranks=shards, estimates=estimates)


def _validate(name: str, lengths, cp, tile) -> tuple[str, np.ndarray]:
    if name not in LAYOUT_NAMES:
        raise ValueError(f"unknown CP layout {name!r}; valid layouts: {', '.join(LAYOUT_NAMES)}")
    if isinstance(cp, bool) or not isinstance(cp, int | np.integer) or cp < 1:
        raise ValueError(f"cp must be a positive integer, got {cp!r}")
    if isinstance(tile, bool) or not isinstance(tile, int | np.integer) or tile < 1:
        raise ValueError(f"tile must be a positive integer (1 = no tile rounding), got {tile!r}")
    return name, validate_lengths(lengths, what="micro-batch document lengths")


def default_cost_model() -> CostModel:
    """The 7B analytic model at TP=1 (used when ``cost`` is None)."""
    return AnalyticCostModel(get_model("7b"), ParallelLayout())


def build_layout(name: str, lengths, cp: int, *, cost: CostModel | None = None,
                 efficiency: KernelEfficiency | None = None, tile: int = 128,
                 hybrid_threshold: int | None = None, token_slack: float = 0.05) -> ShardLayout:
    """Shard one micro-batch (document ``lengths`` in order) over ``cp`` ranks with layout ``name``.

    ``cost`` prices attention (default: 7B analytic at TP=1), ``efficiency`` is the kernel table
    (default: the shipped placeholder), ``tile`` the kernel tile for rounding (1: none).
    ``hybrid_threshold`` (longest document ``hybrid`` may keep whole; default ``T // cp``) and
    ``token_slack`` (``hybrid``'s token cap, ``ceil(T/cp * (1 + token_slack))``) only affect ``hybrid``.
    """
    canonical, lengths = _validate(name, lengths, cp, tile)
    cp = int(cp)
    tile = int(tile)
    if not 0.0 <= token_slack:
        raise ValueError(f"token_slack must be >= 0, got {token_slack!r}")
    cost = default_cost_model() if cost is None else cost
    eff, tile = kernel_of(cost, efficiency, tile)
    cu = np.concatenate([[0], np.cumsum(lengths)]).astype(np.int64)

    def priced(runs: _Runs) -> tuple[_Runs, np.ndarray]:
        return runs, attention_work(runs.end - runs.start, runs.end - cu[runs.doc], cost, eff, tile)

    if canonical == "per-document-te":
        two = 2 * cp
        padded = -(-lengths // two) * two
        pcu = np.concatenate([[0], np.cumsum(padded)]).astype(np.int64)
        rank, s, e, doc, _ = _head_tail_chunks(pcu[:-1], padded, cp)
        runs = _Runs(rank, s, e, doc)
        work = attention_work(e - s, e - pcu[doc], cost, eff, tile)
        return _assemble(canonical, name, cp, lengths, padded, pcu, runs, work, {})
    if canonical == "per-sequence":
        runs, work = priced(_runs_per_sequence(cu, cp))
        return _assemble(canonical, name, cp, lengths, lengths, cu, runs, work, {})
    if canonical == "per-document":
        runs, work = priced(_runs_per_document(cu, lengths, cp))
        return _assemble(canonical, name, cp, lengths, lengths, cu, runs, work, {})
    if canonical == "hybrid":
        fair = max(float(cu[-1]) / cp, 1.0)
        per_token = float(cost.linear_compute(fair)) / fair
        runs, work = _runs_hybrid(cu, lengths, cp, lambda q, kv: attention_work(q, kv, cost, eff, tile),
                                  priced(_runs_per_document(cu, lengths, cp)), hybrid_threshold, token_slack,
                                  per_token)
        seq_runs, seq_work = priced(_runs_per_sequence(cu, cp))
        estimates = {"hybrid": _step(runs, work, cp, per_token), "per-sequence": _step(seq_runs, seq_work, cp,
                                                                                       per_token)}
        if estimates["per-sequence"] < estimates["hybrid"]:
            return _assemble("per-sequence", name, cp, lengths, lengths, cu, seq_runs, seq_work, estimates)
        return _assemble(canonical, name, cp, lengths, lengths, cu, runs, work, estimates)
    # adaptive: price both static layouts rank by rank as laid out, keep the one whose slowest rank is faster.
    candidates = {"per-sequence": priced(_runs_per_sequence(cu, cp)),
                  "per-document": priced(_runs_per_document(cu, lengths, cp))}

    def slowest(r: _Runs, w: np.ndarray) -> float:
        fwd, bwd = _rank_seconds(r.rank, r.end - r.start, r.end - cu[r.doc], w, cp, int(cu[-1]), cost)
        return float((fwd + bwd).max()) if w.size else 0.0

    estimates = {k: slowest(r, w) for k, (r, w) in candidates.items()}
    chosen = min(estimates, key=lambda k: (estimates[k], k != "per-sequence"))
    runs, work = candidates[chosen]
    return _assemble(chosen, name, cp, lengths, lengths, cu, runs, work, estimates)


def layout_digest(layout: ShardLayout) -> int:
    """A 63-bit digest of what every CP rank must agree on: the layout's name, the padded document
    lengths and each rank's ``[start, end)`` runs (which fix its tokens; run-level, so no rank's
    token arrays are materialised). Equal on all ranks that built the same layout."""
    h = hashlib.blake2b(digest_size=8)
    h.update(layout.name.encode())
    h.update(np.ascontiguousarray(layout.padded_lengths, dtype=np.int64).tobytes())
    for shard in layout.ranks:
        h.update(b"|")
        h.update(np.ascontiguousarray(shard.runs, dtype=np.int64).tobytes())
    return int.from_bytes(h.digest(), "little") >> 1
