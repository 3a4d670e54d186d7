"""Packing quality: imbalance, unused capacity, delay and packing time, as pure functions.

Latency of a micro-batch is its *forward + backward* time per layer per GPU from the cost model:
``W_a * (1 + bwd_attention) + W_l * (1 + bwd_linear)`` summed over its pieces, plus the fixed
per-micro-batch overhead and what the micro-batch costs as a whole (``SizePrice``: a calibrated
profile's tokens^2 and tokens x pairs terms, 0 for the analytic model), both times
``(1 + bwd_linear)``. We use forward + backward rather than the bare
workload W = W_a + W_l because a training step runs both and the backward of attention costs
relatively more (2.5x vs 2x for GEMMs on H100), which makes long documents weigh more than the
forward alone suggests; the paper's Table 2 uses forward latency, and the two ratios differ by a
few thousandths on the embedded data (both are reported by ``summarize``).

Without a cost model the weight of a piece of ``d`` tokens is ``d**2``: the attention-only
objective of the paper's fixed-length ILP (Eq. 1).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import asdict, dataclass

import numpy as np

from megatron_wlb.costmodel import CostModel
from megatron_wlb.costmodel.shapes import Counts, causal_pairs
from megatron_wlb.packing.pipeline import deal_and_order
from megatron_wlb.packing.types import GlobalBatch, MicroBatch
from megatron_wlb.schedule import simulate_pipeline


def piece_latency(cost: CostModel | None, lengths: np.ndarray | Sequence[int]) -> np.ndarray:
    """Forward + backward seconds per layer per GPU of each piece (``d**2`` without a cost model)."""
    d = np.asarray(lengths, dtype=np.int64)
    if cost is None:
        return d.astype(np.float64) ** 2
    return cost.forward_backward(cost.attention(d), cost.linear(d))


def piece_forward(cost: CostModel | None, lengths: np.ndarray | Sequence[int]) -> np.ndarray:
    """Forward seconds per layer per GPU of each piece, W = W_a + W_l (``d**2`` without a cost model)."""
    d = np.asarray(lengths, dtype=np.int64)
    if cost is None:
        return d.astype(np.float64) ** 2
    return cost.workload(d)


def overhead_seconds(cost: CostModel | None, backward: bool = True) -> float:
    """The fixed seconds of a non-empty micro-batch (``CostModel.microbatch_overhead``), forward
    only or forward + backward (scaled like GEMMs); 0 without a cost model."""
    if cost is None:
        return 0.0
    return cost.microbatch_overhead * ((1.0 + cost.hardware.bwd_linear) if backward else 1.0)


@dataclass(frozen=True)
class SizePrice:
    """Forward + backward seconds per layer of a micro-batch as a whole, beyond the sum of its pieces and the
    fixed overhead: ``tokens_sq * T^2 + tokens_pairs * T * P`` for a micro-batch of ``T`` tokens and ``P``
    causal pairs (the whole micro-batch's; the cost model's ``size_cost`` of its CP rank's share, made
    whole). Zero for an additive cost model. It is superadditive, so adding a piece of ``d`` tokens and
    ``p`` pairs costs at least ``self(d, p)`` more in any micro-batch (``place_greedy``'s bound)."""

    tokens_sq: float = 0.0
    tokens_pairs: float = 0.0

    def __bool__(self) -> bool:
        return self.tokens_sq > 0 or self.tokens_pairs > 0

    def __call__(self, tokens: Counts, pairs: Counts) -> np.ndarray:
        t, p = np.asarray(tokens, dtype=np.float64), np.asarray(pairs, dtype=np.float64)
        return t * (self.tokens_sq * t + self.tokens_pairs * p)

    def marginal(self, tokens: float, pairs: float, d: float, p: float) -> float:
        """What adding a piece of ``d`` tokens and ``p`` pairs adds to a micro-batch of ``tokens`` and ``pairs``."""
        return self.tokens_sq * d * (2.0 * tokens + d) + self.tokens_pairs * (tokens * p + d * pairs + d * p)


def size_price(cost: CostModel | None) -> SizePrice:
    """The cost model's ``SizePrice`` (``CostModel.size_cost`` at a CP rank's share, forward + backward)."""
    if cost is None or not cost.prices_size:
        return SizePrice()
    cp = float(cost.layout.cp)
    scale = (1.0 + cost.hardware.bwd_linear) / (cp * cp)
    sq = float(cost.size_cost(1.0, 0.0)) * scale
    return SizePrice(tokens_sq=sq, tokens_pairs=float(cost.size_cost(1.0, 1.0)) * scale - sq)


def piece_pairs(lengths: np.ndarray | Sequence[int]) -> np.ndarray:
    """Causal (query, key) pairs of whole pieces of these lengths, ``d (d + 1) / 2``."""
    d = np.asarray(lengths, dtype=np.float64)
    return causal_pairs(d, d)


def size_seconds(cost: CostModel | None, tokens: Counts, pairs: Counts, backward: bool = True) -> np.ndarray:
    """What micro-batches of these tokens and pairs cost as a whole (``SizePrice``), forward only or forward +
    backward (scaled like GEMMs); 0 without a cost model or with an additive one."""
    price = size_price(cost)
    out = price(tokens, pairs)
    if not backward and price:
        assert cost is not None
        out = out / (1.0 + cost.hardware.bwd_linear)
    return out


def microbatch_seconds(cost: CostModel | None, latency: np.ndarray, forward: np.ndarray | None = None,
                       tokens: np.ndarray | None = None, pairs: np.ndarray | None = None
                       ) -> tuple[np.ndarray, np.ndarray]:
    """(forward, backward) seconds of micro-batches: the one definition of a micro-batch's cost.

    ``latency``: each micro-batch's summed ``piece_latency`` (0 = empty); ``forward``: its summed
    ``piece_forward`` (needed with a cost model); ``tokens`` / ``pairs``: its tokens and causal pairs (needed
    with a cost model that prices a micro-batch as a whole, ``CostModel.prices_size``). A non-empty
    micro-batch adds ``overhead_seconds`` and ``size_seconds``; without a cost model the ``d**2`` weight is
    split 1 : 2 between forward and backward.
    """
    latency = np.asarray(latency, dtype=np.float64)
    nonempty = latency > 0
    whole = np.zeros_like(latency)
    if cost is not None and cost.prices_size:
        if tokens is None or pairs is None:
            raise ValueError(f"microbatch_seconds needs the micro-batches' tokens and pairs with {cost.describe()}: "
                             "it prices a micro-batch as a whole, not only its pieces")
        whole = size_seconds(cost, tokens, pairs)
    empty_fwd, empty_bwd = (0.0, 0.0) if cost is None else cost.empty_seconds
    total = np.where(nonempty, latency + overhead_seconds(cost, backward=True) + whole, empty_fwd + empty_bwd)
    if cost is None:
        fwd = total / 3.0
    elif forward is None:
        raise ValueError("microbatch_seconds needs the pieces' forward seconds with a cost model")
    else:
        whole_fwd = whole / (1.0 + cost.hardware.bwd_linear)
        fwd = np.where(nonempty, np.asarray(forward, dtype=np.float64) + overhead_seconds(cost, backward=False)
                       + whole_fwd, empty_fwd)
    return fwd, total - fwd


def share_seconds(cost: CostModel | None, attention: Counts, rank_tokens: Counts, rank_pairs: Counts,
                  group_tokens: float) -> tuple[np.ndarray, np.ndarray]:
    """(forward, backward) seconds per layer of CP ranks' shares of one micro-batch, each priced as laid out: the
    one price of a CP rank's work, which the timing trace, the simulator, the adaptive layout chooser and the
    paired harness use.

    ``attention``: each rank's forward attention seconds over its own query runs (``cp.layouts`` prices them,
    ``attention_work``); ``rank_tokens`` / ``rank_pairs``: its query rows and the causal pairs its attention
    computes; ``group_tokens``: the whole micro-batch's tokens over the CP group (``cost.layout.cp`` ranks), whose
    K/V every rank gathers. A rank pays its GEMMs and TP collectives on its own tokens, the group's all-gather
    (``CostModel.cp_comm``), the micro-batch's fixed cost and what the micro-batch costs as a whole at its own share
    (``CostModel.size_cost``); backward as ``microbatch_seconds`` charges it (attention x ``bwd_attention``, the rest
    x ``bwd_linear``). A micro-batch of no tokens costs ``CostModel.empty_seconds``. With every rank an even share
    this is ``microbatch_seconds`` of the micro-batch (CP 1: exactly). Without a cost model: ``2 x pairs`` (the
    ``d**2`` weight), split 1 : 2."""
    attn = np.asarray(attention, dtype=np.float64)
    t = np.asarray(rank_tokens, dtype=np.float64)
    p = np.asarray(rank_pairs, dtype=np.float64)
    if cost is None:
        total = np.broadcast_to(2.0 * p, np.broadcast(attn, t, p).shape).astype(np.float64)
        return total / 3.0, total - total / 3.0
    if group_tokens <= 0:
        fwd, bwd = cost.empty_seconds
        shape = np.broadcast(attn, t, p).shape
        return np.full(shape, fwd), np.full(shape, bwd)
    lin = (cost.linear_compute(t) + cost.tp_comm(t) + cost.cp_comm(float(group_tokens))
           + overhead_seconds(cost, backward=False) + cost.size_cost(t, p))
    if cost.layout.ep > 1 and cost.model.is_moe:
        lin = lin + cost.ep_comm(t)
    hw = cost.hardware
    return attn + lin, hw.bwd_attention * attn + hw.bwd_linear * lin


def microbatch_latency(cost: CostModel | None, mb: MicroBatch, backward: bool = True) -> float:
    """Latency of one micro-batch (0 when empty); forward + backward unless ``backward`` is False."""
    if not mb.pieces:
        empty_fwd, empty_bwd = (0.0, 0.0) if cost is None else cost.empty_seconds
        return empty_fwd + empty_bwd if backward else empty_fwd
    lat = piece_latency(cost, mb.lengths) if backward else piece_forward(cost, mb.lengths)
    whole = size_seconds(cost, float(mb.lengths.sum()), float(piece_pairs(mb.lengths).sum()), backward)
    return float(lat.sum() + overhead_seconds(cost, backward) + whole)


def bins_seconds(cost: CostModel | None, bins: Sequence[Sequence[int]] | Sequence[np.ndarray]
                 ) -> tuple[np.ndarray, np.ndarray]:
    """(forward, backward) seconds of micro-batches given as their pieces' lengths (``microbatch_seconds``)."""
    lat = np.array([piece_latency(cost, b).sum() if len(b) else 0.0 for b in bins], dtype=np.float64)
    forward = None if cost is None else np.array([piece_forward(cost, b).sum() if len(b) else 0.0 for b in bins],
                                                 dtype=np.float64)
    tokens = np.array([float(np.sum(b)) for b in bins], dtype=np.float64)
    pairs = np.array([float(piece_pairs(b).sum()) for b in bins], dtype=np.float64)
    return microbatch_seconds(cost, lat, forward, tokens, pairs)


def batch_latencies(cost: CostModel | None, batch: GlobalBatch, backward: bool = True) -> np.ndarray:
    """Latency of every micro-batch of ``batch``, shape ``(dp, n)``."""
    lat = np.array([microbatch_latency(cost, mb, backward) for mb in batch.micro_batches], dtype=np.float64)
    return lat.reshape(batch.dp, batch.n)


def imbalance_per_rank(latencies: np.ndarray) -> np.ndarray:
    """Paper Table 2 per DP rank: max micro-batch latency x N / sum (1.0 = perfect); NaN if idle."""
    lat = np.atleast_2d(latencies)
    total = lat.sum(axis=1)
    with np.errstate(invalid="ignore", divide="ignore"):
        return np.where(total > 0, lat.max(axis=1) * lat.shape[1] / total, np.nan)


def imbalance_global(latencies: np.ndarray) -> float:
    """Beyond the paper: max / mean over all DP x N micro-batches (DP ranks wait at the grad sync)."""
    lat = np.asarray(latencies, dtype=np.float64).ravel()
    mean = lat.mean() if lat.size else 0.0
    return float(lat.max() / mean) if mean > 0 else float("nan")


def token_delays(batches: Sequence[GlobalBatch]) -> tuple[np.ndarray, np.ndarray]:
    """(delay in iterations, token count) of every emitted piece; delay = emitted - arrival.

    A window packer emits some pieces before their arrival iteration (negative delay: it read
    them ahead); ``summarize`` reports the positive part as delay and the magnitude as reordering.
    """
    delays: list[int] = []
    tokens: list[int] = []
    for b in batches:
        for p in b.pieces():
            delays.append(b.iteration - p.arrival)
            tokens.append(p.length)
    return np.asarray(delays, dtype=np.int64), np.asarray(tokens, dtype=np.int64)


@dataclass(frozen=True)
class PackingMetrics:
    """Summary of a run of global batches (see ``summarize`` for the definitions)."""

    iterations: int
    imbalance: float            # paper Table 2: per DP rank per iteration, mean (fwd + bwd latency)
    imbalance_fwd: float        # the same with forward latency only, as in the paper
    imbalance_max: float        # worst iteration
    imbalance_global: float     # max / mean over all dp x n micro-batches, mean over iterations
    unused_capacity: float      # 1 - tokens / sum of micro-batch capacities
    fill_vs_seq_len: float      # tokens / (dp * n * seq_len * iterations): stream rate kept
    mean_delay: float           # iterations per token, positive part of emitted - arrival
    max_delay: int
    mean_reorder: float         # iterations per token, |emitted - arrival|
    plan_ms_mean: float         # packing time per global batch (window packers: amortised)
    plan_ms_max: float
    plan_cpu_ms_mean: float     # the same in CPU time of the planning thread
    plan_cpu_ms_max: float
    tokens: int
    #: the objective: sum over iterations of the slowest DP rank's pipeline-schedule time (1F1B or
    #: interleaved, from the simulator) / the same with every micro-batch at the iteration's mean
    schedule_ratio: float = float("nan")
    schedule_ratio_max: float = float("nan")   # worst iteration
    min_fill: float = float("nan")             # smallest iteration's tokens / (dp * n * seq_len)
    low_fill_iterations: int = 0               # iterations below half that budget
    #: tokens per iteration / (dp * n * seq_len): 5th, 50th and 95th percentile over the iterations
    fill_p5: float = float("nan")
    fill_p50: float = float("nan")
    fill_p95: float = float("nan")
    #: causal attention (query, key) pairs per token, sum of d (d + 1) / 2 over pieces / tokens: the
    #: attention work the plan's pieces imply (equal for plans of the same pieces)
    pairs_per_token: float = float("nan")
    #: the whole-piece floor: ``schedule_ratio`` of the best balance the iterations' pieces allow while
    #: each stays whole (``whole_piece_floor_time``); what schedule_ratio loses above it is the packer's,
    #: what the floor itself is above 1 belongs to pieces no micro-batch can match (cutting removes it)
    schedule_floor: float = float("nan")

    def to_dict(self) -> dict:
        return asdict(self)


def summarize(batches: Sequence[GlobalBatch], cost: CostModel | None, seq_len: int | None = None,
              stages: int | None = None, virtual_stages: int = 1) -> PackingMetrics:
    """Metrics over ``batches``. Iterations with no tokens at all are left out of the imbalance means.

    ``stages``/``virtual_stages``: the pipeline of the schedule objective (default ``n`` stages, 1F1B).
    """
    if not batches:
        raise ValueError("summarize needs at least one global batch")
    per_rank, per_rank_fwd, glob = [], [], []
    slowest, balanced, floor = [], [], []
    cap = tokens = 0
    for b in batches:
        lat = batch_latencies(cost, b)
        if lat.sum() > 0:
            per_rank.extend(imbalance_per_rank(lat).tolist())
            per_rank_fwd.extend(imbalance_per_rank(batch_latencies(cost, b, backward=False)).tolist())
            glob.append(imbalance_global(lat))
            worst, ideal = slowest_rank_schedule_time(cost, b, stages, virtual_stages)
            slowest.append(worst)
            balanced.append(ideal)
            floor.append(whole_piece_floor_time(cost, b, stages, virtual_stages))
        cap += sum(mb.capacity for mb in b.micro_batches)
        tokens += b.tokens
    pr = np.asarray(per_rank, dtype=np.float64)
    delays, toks = token_delays(batches)
    wsum = max(1, int(toks.sum()))
    plan = np.array([b.plan_seconds for b in batches]) * 1e3
    plan_cpu = np.array([b.plan_cpu_seconds for b in batches]) * 1e3
    first = batches[0]
    fill = float("nan") if seq_len is None else tokens / (first.dp * first.n * seq_len * len(batches))
    fills = np.array([b.tokens for b in batches], dtype=np.float64) / (first.dp * first.n * seq_len) \
        if seq_len is not None else np.array([np.nan])
    ratios = np.asarray(slowest) / np.asarray(balanced) if slowest else np.array([np.nan])
    return PackingMetrics(
        iterations=len(batches),
        imbalance=float(np.nanmean(pr)) if pr.size else float("nan"),
        imbalance_fwd=float(np.nanmean(per_rank_fwd)) if per_rank_fwd else float("nan"),
        imbalance_max=float(np.nanmax(pr)) if pr.size else float("nan"),
        imbalance_global=float(np.mean(glob)) if glob else float("nan"),
        unused_capacity=1.0 - tokens / cap if cap else 0.0,
        fill_vs_seq_len=fill,
        mean_delay=float((np.maximum(delays, 0) * toks).sum() / wsum),
        max_delay=max(0, int(delays.max())) if delays.size else 0,
        mean_reorder=float((np.abs(delays) * toks).sum() / wsum),
        plan_ms_mean=float(plan.mean()),
        plan_ms_max=float(plan.max()),
        plan_cpu_ms_mean=float(plan_cpu.mean()),
        plan_cpu_ms_max=float(plan_cpu.max()),
        tokens=int(tokens),
        schedule_ratio=float(np.sum(slowest) / np.sum(balanced)) if slowest else float("nan"),
        schedule_ratio_max=float(np.max(ratios)),
        min_fill=float(np.min(fills)),
        low_fill_iterations=int(np.sum(fills < 0.5)),
        fill_p5=float(np.percentile(fills, 5)),
        fill_p50=float(np.percentile(fills, 50)),
        fill_p95=float(np.percentile(fills, 95)),
        pairs_per_token=float(sum(float((mb.lengths * (mb.lengths + 1)).sum()) / 2
                                  for b in batches for mb in b.micro_batches) / max(1, tokens)),
        schedule_floor=float(np.sum(floor) / np.sum(balanced)) if slowest else float("nan"),
    )


# -- the objective: the slowest DP rank's pipeline-schedule time ------------------------------------
def microbatch_stage_times(cost: CostModel | None, batch: GlobalBatch) -> tuple[np.ndarray, np.ndarray]:
    """(forward, backward) seconds of every micro-batch of ``batch``, shape ``(dp, n)`` each
    (``microbatch_seconds``; per layer: a stage runs ``layers / pp`` such layers, a common factor
    that cancels in every ratio)."""
    fwd, bwd = bins_seconds(cost, [mb.lengths for mb in batch.micro_batches])
    return fwd.reshape(batch.dp, batch.n), bwd.reshape(batch.dp, batch.n)


def schedule_times(cost: CostModel | None, batch: GlobalBatch, stages: int | None = None,
                   virtual_stages: int = 1) -> np.ndarray:
    """Pipeline-schedule seconds (per layer-stage) of every DP rank, played through the simulator.

    ``stages`` defaults to ``n`` (the paper's N = PP). Uses ``megatron_wlb.schedule``'s
    (interleaved) 1F1B, the same code the iteration simulator runs.
    """
    p = batch.n if stages is None else stages
    fwd, bwd = microbatch_stage_times(cost, batch)
    out = np.empty(batch.dp)
    for r in range(batch.dp):
        f = np.broadcast_to(fwd[r], (p, batch.n))
        b = np.broadcast_to(bwd[r], (p, batch.n))
        out[r] = simulate_pipeline(f, b, virtual_stages=virtual_stages, keep_events=False).makespan
    return out


def balanced_schedule_time(cost: CostModel | None, batch: GlobalBatch, stages: int | None = None,
                           virtual_stages: int = 1) -> float:
    """The schedule time if every micro-batch of the iteration carried the mean work (the ideal)."""
    p = batch.n if stages is None else stages
    fwd, bwd = microbatch_stage_times(cost, batch)
    f = np.full((p, batch.n), float(fwd.mean()))
    b = np.full((p, batch.n), float(bwd.mean()))
    return float(simulate_pipeline(f, b, virtual_stages=virtual_stages, keep_events=False).makespan)


def slowest_rank_schedule_time(cost: CostModel | None, batch: GlobalBatch, stages: int | None = None,
                               virtual_stages: int = 1) -> tuple[float, float]:
    """(slowest DP rank's schedule time, balanced schedule time) of one iteration: what the job
    waits for and its ideal; the Megatron adapter logs their ratio as ``wlb/schedule_ratio``."""
    return float(schedule_times(cost, batch, stages, virtual_stages).max()), \
        balanced_schedule_time(cost, batch, stages, virtual_stages)


def whole_piece_floor_time(cost: CostModel | None, batch: GlobalBatch, stages: int | None = None,
                           virtual_stages: int = 1) -> float:
    """The schedule time of the best balance this iteration's pieces allow while each stays whole.

    Water-filling over the ``dp * n`` micro-batches: a piece heavier than the level sits alone at its
    own latency, the others share the rest evenly (ignoring capacity, so no plan of these pieces is
    better balanced); dealt to ranks and ordered by ``pipeline.deal_and_order``, then played through
    the simulator like ``schedule_times``. Equals the balanced time when no piece outweighs the mean.
    """
    p = batch.n if stages is None else stages
    m = batch.dp * batch.n
    lengths = np.concatenate([mb.lengths for mb in batch.micro_batches]) if m else np.zeros(0, np.int64)
    lat = piece_latency(cost, lengths)
    order = np.argsort(-lat, kind="stable")
    lat = lat[order]
    alone = 0
    while alone < min(m - 1, lat.size) and lat[alone] > float(lat[alone:].sum()) / (m - alone):
        alone += 1

    def water_filled(x: np.ndarray) -> np.ndarray:  # the heaviest ``alone`` pieces alone, the rest shared evenly
        return np.concatenate([x[:alone], np.full(m - alone, float(x[alone:].sum()) / (m - alone))])

    forward = None if cost is None else water_filled(piece_forward(cost, lengths[order]))
    sorted_lengths = lengths[order]
    fwd, bwd = microbatch_seconds(cost, water_filled(lat), forward, water_filled(sorted_lengths.astype(np.float64)),
                                  water_filled(piece_pairs(sorted_lengths)))
    perm = deal_and_order(fwd.tolist(), bwd.tolist(), batch.dp, batch.n, p, virtual_stages)
    fwd, bwd = fwd[perm].reshape(batch.dp, batch.n), bwd[perm].reshape(batch.dp, batch.n)
    return max(simulate_pipeline(np.broadcast_to(fwd[r], (p, batch.n)), np.broadcast_to(bwd[r], (p, batch.n)),
                                 virtual_stages=virtual_stages, keep_events=False).makespan for r in range(batch.dp))
