"""Megatron-LM's dynamic (hybrid) context parallelism, as far as this simulator can express it.

Megatron's ``--hybrid-context-parallel`` / ``--dynamic-context-parallel`` gives every sample its
own CP size, the next power of two of ``L / max_seqlen_per_rank`` (capped at the CP group), and its
``BalancedCPScheduler`` places samples on ranks so that the workload ``L^2 / cp`` is balanced. We
model it inside one micro-batch's CP group:

- every document ``d`` gets ``cp_d = min(cp, 2^ceil(log2(ceil(d / max_seqlen_per_rank))))`` ranks,
  an aligned block of the group (ranks ``[k cp_d, (k+1) cp_d)``);
- documents go in decreasing ``d^2 / cp_d`` to the block whose busiest rank has the least such
  load (longest-processing-time first), as the scheduler's greedy does;
- the block shards the document per-document head-tail (``cp.layouts`` ``per-document`` over
  ``cp_d`` ranks) and each rank gets that layout's attention estimate and tokens; a document on one
  rank costs ``cp.layouts.attention_work(d, d)`` (tile-padded, kernel-efficiency-corrected, the
  same estimate every other layout uses).

Approximations, stated in the report: the pool is one micro-batch's CP group, not DP x CP; the K/V
all-gather is still charged for the whole micro-batch (documents on one rank need none); token
counts per rank are not capped by memory; Megatron's feature has no PP support, we run it under PP.

``simulate_dynamic_stream`` runs ours, ``--wlb-cp-sharding dynamic`` (``cp.dynamic``): the packer chooses each
iteration's documents (wlb's queues and outlier delay included), and the dynamic-CP planner gives them groups,
ranks and micro-batches over the stage's DP x CP ranks; PP 1 only (the planner plans one pipeline stage).
"""

from __future__ import annotations

import time
from collections import Counter
from dataclasses import dataclass

import numpy as np

from megatron_wlb.config import RunConfig
from megatron_wlb.costmodel import CostModel
from megatron_wlb.cp.dynamic import DYNAMIC_SHARDING, group_cost_models, lower_bound, plan_dynamic_cp
from megatron_wlb.cp.efficiency import KernelEfficiency
from megatron_wlb.cp.layouts import attention_work, build_layout
from megatron_wlb.packing import make_packer
from megatron_wlb.packing.metrics import piece_latency
from megatron_wlb.packing.types import piece_lengths


@dataclass(frozen=True)
class DynamicCPLayout:
    """Per-rank attention seconds, tokens and causal pairs of one micro-batch under dynamic CP sizes."""

    name: str
    rank_work: np.ndarray
    rank_tokens: np.ndarray
    doc_cp: np.ndarray
    rank_pairs: np.ndarray

    @property
    def imbalance(self) -> float:
        mean = self.rank_work.mean()
        return float(self.rank_work.max() / mean) if mean > 0 else 1.0


def doc_cp_sizes(lengths: np.ndarray, cp: int, max_seqlen_per_rank: int) -> np.ndarray:
    """CP size per document: next power of two of ceil(d / max_seqlen_per_rank), at most ``cp``."""
    if max_seqlen_per_rank < 1:
        raise ValueError(f"max_seqlen_per_rank must be a positive token count, got {max_seqlen_per_rank}")
    if cp < 1 or cp & (cp - 1):
        raise ValueError(f"dynamic CP needs a power-of-two CP group, got cp={cp}")
    need = np.ceil(np.asarray(lengths, dtype=np.float64) / max_seqlen_per_rank)
    size = 2 ** np.ceil(np.log2(np.maximum(need, 1.0)))
    return np.minimum(size, cp).astype(np.int64)


def dynamic_cp_layout(lengths: np.ndarray, cp: int, cost: CostModel,
                      max_seqlen_per_rank: int | None = None, tile: int = 128) -> DynamicCPLayout:
    """Place the documents of one micro-batch on ``cp`` ranks with a CP size each (see module doc).

    ``max_seqlen_per_rank`` defaults to ``ceil(sum(lengths) / cp)``, one rank's even share.
    """
    d = np.asarray(lengths, dtype=np.int64)
    if d.ndim != 1 or (d.size and d.min() < 1):
        raise ValueError("lengths must be a 1-D array of positive token counts")
    if max_seqlen_per_rank is None:
        max_seqlen_per_rank = max(1, -(-int(d.sum()) // cp))
    sizes = doc_cp_sizes(d, cp, max_seqlen_per_rank)
    whole = attention_work(d, d, cost, KernelEfficiency.default(), tile)
    score = d.astype(np.float64) ** 2 / sizes
    load = np.zeros(cp)
    work = np.zeros(cp)
    tokens = np.zeros(cp)
    pairs = np.zeros(cp)
    for i in np.argsort(-score, kind="stable"):
        k = int(sizes[i])
        blocks = load.reshape(-1, k).max(axis=1)
        b = int(np.argmin(blocks))
        sl = slice(b * k, (b + 1) * k)
        load[sl] += score[i]
        if k == 1:
            work[sl] += whole[i]
            tokens[sl] += d[i]
            pairs[sl] += d[i] * (d[i] + 1) / 2.0
        else:
            shard = build_layout("per-document", d[i:i + 1], k, cost=cost, tile=tile)
            work[sl] += shard.rank_work
            tokens[sl] += shard.rank_tokens
            pairs[sl] += shard.rank_pairs
    return DynamicCPLayout("dynamic-cp", work, tokens, sizes, pairs)


@dataclass(frozen=True)
class DynamicIteration:
    """One iteration under ``--wlb-cp-sharding dynamic``: seconds of all layers (forward + backward) on the
    slowest DP x CP rank, the ideal (the documents' compute at CP 1 spread evenly, no communication), the
    lower bound of any plan (``cp.dynamic.lower_bound``), ``fixed``: the same documents as the packer placed them,
    each DP rank's micro-batches on its fixed CP group, priced alike (PP 1: a rank's time is the sum), tokens,
    micro-batch steps, micro-batches per group size, and the planner's wall time."""

    iteration: int
    time: float
    ideal: float
    bound: float
    fixed: float
    tokens: int
    steps: int
    group_sizes: dict[int, int]
    plan_seconds: float

    @property
    def over_ideal(self) -> float:
        return self.time / self.ideal if self.ideal > 0 else 1.0


def simulate_dynamic_stream(config: RunConfig, cost: CostModel, packer: str, lengths: np.ndarray,
                            iterations: int) -> list[DynamicIteration]:
    """``packer`` chooses each iteration's documents of ``lengths`` (already cut at the window), and
    ``cp.dynamic.plan_dynamic_cp`` plans them over the ``dp x cp`` ranks of the one pipeline stage, at most
    ``seq_len / cp`` tokens per rank (the memory a fixed CP group gives a rank)."""
    lay = config.layout
    if lay.pp != 1:
        raise ValueError(f"--cp-sharding {DYNAMIC_SHARDING} plans one pipeline stage (PP 1), but {config.name} has "
                         f"PP {lay.pp}: use a config with layout pp: 1")
    if iterations < 1:
        raise ValueError(f"iterations must be at least 1, got {iterations}")
    ranks, per_rank = lay.dp * lay.cp, max(1, config.seq_len // lay.cp)
    costs = group_cost_models(cost, ranks)
    fixed_cost, layers = costs[lay.cp], config.model.num_layers
    overhead = fixed_cost.microbatch_overhead * (1.0 + fixed_cost.hardware.bwd_linear)
    out = []
    for batch in make_packer(packer, config.packing, cost).pack(lengths):
        docs = piece_lengths([p for mb in batch.micro_batches for p in mb.pieces])
        fixed = max(sum(float(piece_latency(fixed_cost, mb.lengths).sum()) + overhead
                        for mb in batch.for_dp_rank(r) if mb.pieces) for r in range(batch.dp))
        t0 = time.perf_counter()
        plan = plan_dynamic_cp(docs, ranks, per_rank, costs)
        took = time.perf_counter() - t0
        sizes = Counter(mb.size for mb in plan.micro_batches)
        out.append(DynamicIteration(batch.iteration, layers * plan.slowest_seconds, layers * plan.ideal_seconds,
                                    layers * lower_bound(docs, ranks, per_rank, costs), layers * fixed,
                                    int(docs.sum()),
                                    plan.steps, dict(sorted(sizes.items())), took))
        if len(out) >= iterations:
            break
    if not out:
        raise ValueError("the length stream produced no global batch")
    return out
