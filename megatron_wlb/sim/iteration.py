"""One 4D-parallel training iteration: a packer's global batch turned into time.

For every micro-batch and every PP stage the cost model gives forward and backward seconds:

- the CP step of one layer takes the max over the CP ranks of (the shard layout's attention work
  on that rank + GEMMs of that rank's tokens, divided over TP) plus the TP all-reduces and the CP
  K/V all-gather, plus the fixed per-micro-batch launch/collective latency; the CP ranks meet at
  every layer's all-gather, so the slowest rank sets the pace of each layer;
- a stage runs its layers (``num_layers / pp``, spread as evenly as integers allow), the last
  stage also the LM head; backward is ``hardware.bwd_attention`` x attention plus
  ``hardware.bwd_linear`` x GEMMs plus the same communication;
- PP point-to-point moves ``tokens / (cp x tp) x hidden`` bf16 values per GPU between
  neighbouring stages under sequence parallelism (the paper's setting, the default), ``tokens /
  cp x hidden`` without it (``CostModel.pp_send``);
- under interleaved 1F1B (``config.virtual_stages`` = v > 1) each PP rank's layers are split over
  its v model chunks as evenly as integers allow, the LM head on the last chunk of the last rank.

Each DP rank plays its micro-batches through the pipeline schedule (``schedule.py``); the
iteration ends with the gradient all-reduce over the DP x CP group and lasts as long as the
slowest DP rank plus that sync. Nothing here assumes fixed-length micro-batches.
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Iterable, Iterator
from dataclasses import dataclass, field, replace
from functools import partial
from typing import Protocol, TypeVar

import numpy as np

from megatron_wlb.config import RunConfig
from megatron_wlb.costmodel import CostModel
from megatron_wlb.cp.layouts import build_layout
from megatron_wlb.cp.protocols import Layout, LayoutBuilder
from megatron_wlb.data.samples import SampleStream
from megatron_wlb.packing import make_packer
from megatron_wlb.packing.metrics import (
    batch_latencies,
    imbalance_global,
    imbalance_per_rank,
    share_seconds,
    summarize,
)
from megatron_wlb.packing.types import GlobalBatch, MicroBatch
from megatron_wlb.schedule import PipelineResult, simulate_pipeline
from megatron_wlb.sim.dyncp import dynamic_cp_layout

ORDERS = ("packer", "heavy-first")

_T = TypeVar("_T")


class Progress(Protocol):
    """The one progress-callback type: ``progress(items, desc, total)`` yields ``items`` unchanged
    while showing progress (a tqdm-like bar; ``cli.common.tqdm_progress``). ``total`` may be None."""

    def __call__(self, items: Iterable[_T], desc: str, total: int | None) -> Iterable[_T]: ...


def default_layout_builder(name: str, lengths: np.ndarray, cp: int, cost: CostModel,
                           seq_len: int | None = None) -> Layout:
    """The CP shard layouts of ``megatron_wlb.cp.layouts``, plus ``dynamic-cp`` (``sim.dyncp``,
    with ``max_seqlen_per_rank = seq_len / cp``)."""
    if name == "dynamic-cp":
        per_rank = None if seq_len is None else max(1, seq_len // cp)
        return dynamic_cp_layout(lengths, cp, cost, max_seqlen_per_rank=per_rank)
    return build_layout(name, lengths, cp, cost=cost)


@dataclass(frozen=True)
class MicroBatchCost:
    """Per-layer seconds of one micro-batch on its TP x CP group (forward and backward).

    ``rank_fwd``/``rank_bwd``: per CP rank, including communication; ``rank_compute``: per CP rank,
    attention + GEMM seconds only (forward + backward), what a profiler would call computation;
    ``rank_attention``: the attention part of it alone.
    """

    tokens: int
    layout: str
    fwd: float
    bwd: float
    rank_fwd: np.ndarray
    rank_bwd: np.ndarray
    rank_compute: np.ndarray
    head_fwd: float
    head_bwd: float
    p2p: float
    rank_attention: np.ndarray


@dataclass(frozen=True)
class IterationResult:
    """Time and balance of one iteration.

    ``time``: seconds of the iteration (slowest DP rank's pipeline + gradient sync).
    ``pipeline_time[d]``: makespan of DP rank ``d``'s pipeline. ``bubble_fraction``: idle share of
    all GPUs until ``time``. ``mb_fwd[d, j]`` / ``mb_latency[d, j]``: forward / forward+backward
    seconds of micro-batch ``j`` of DP rank ``d`` summed over the PP stages (its work, no waiting).
    ``gpu_busy[d, s]``: compute+communication seconds of the PP rank (the CP group's slowest pace).
    ``gpu_compute[d, s, r]``: attention + GEMM seconds of the GPU at (DP d, PP s, CP r), the same
    for its TP peers. ``mb_rank_compute[d, j, r]``: attention + GEMM seconds per layer of
    micro-batch ``j`` on CP rank ``r`` (forward + backward). ``layouts``: how many micro-batches
    each CP layout was chosen for. ``mb_rank_attention[d, j, r]``: the attention part of
    ``mb_rank_compute``. ``packing_imbalance`` / ``packing_imbalance_global``: the packing
    metrics of ``megatron_wlb.packing.metrics`` for this batch (paper Table 2's degree on the cost
    model's forward latency, worst DP rank; max / mean over all micro-batches).
    """

    iteration: int
    time: float
    pipeline_time: np.ndarray
    dp_sync: float
    bubble_fraction: float
    mb_fwd: np.ndarray
    mb_latency: np.ndarray
    mb_tokens: np.ndarray
    gpu_busy: np.ndarray
    gpu_compute: np.ndarray
    mb_rank_compute: np.ndarray
    tokens: int
    layouts: dict[str, int]
    plan_seconds: float
    packing_imbalance: float = float("nan")
    packing_imbalance_global: float = float("nan")
    mb_rank_attention: np.ndarray | None = field(default=None, repr=False)
    pipelines: tuple[PipelineResult, ...] = field(default=(), repr=False)
    #: pieces (and their tokens) that arrived in an earlier iteration and were held back by the packer
    #: (released outliers): an iteration that holds them trains more tokens and takes longer
    delayed_pieces: int = 0
    delayed_tokens: int = 0

    @property
    def pp_imbalance(self) -> float:
        """Paper Table 2's degree: max micro-batch forward latency x micro-batches / total, per DP rank, max."""
        tot = self.mb_fwd.sum(axis=1)
        n = self.mb_fwd.shape[1]
        with np.errstate(invalid="ignore", divide="ignore"):
            deg = np.where(tot > 0, self.mb_fwd.max(axis=1) * n / tot, 1.0)
        return float(deg.max())

    @property
    def gpu_layer_compute(self) -> np.ndarray:
        """Per-layer computation seconds of each (DP rank, CP rank) over the iteration, shape
        ``(dp, cp)``: every PP stage of a DP rank runs the same micro-batches, so this is the
        per-GPU latency with the uneven layer split and the LM head taken out."""
        return self.mb_rank_compute.sum(axis=1)

    @property
    def gpu_compute_imbalance(self) -> float:
        """Slowest GPU's computation latency (per layer) over the mean over all GPUs."""
        g = self.gpu_layer_compute
        mean = g.mean()
        return float(g.max() / mean) if mean > 0 else 1.0

    @property
    def gpu_layer_attention(self) -> np.ndarray:
        """Like ``gpu_layer_compute`` but attention seconds only, shape ``(dp, cp)``."""
        if self.mb_rank_attention is None:
            raise ValueError("this iteration was simulated without per-rank attention seconds")
        return self.mb_rank_attention.sum(axis=1)

    @property
    def gpu_attention_imbalance(self) -> float:
        """Slowest GPU's attention latency (per layer) over the mean over all GPUs."""
        g = self.gpu_layer_attention
        mean = g.mean()
        return float(g.max() / mean) if mean > 0 else 1.0


def stage_layers(num_layers: int, pp: int) -> np.ndarray:
    """Layers per PP stage, as even as integers allow (the first stages take the remainder)."""
    if pp > num_layers:
        raise ValueError(f"pp={pp} stages cannot share {num_layers} layers (every stage needs one)")
    counts = np.full(pp, num_layers // pp, dtype=np.int64)
    counts[: num_layers % pp] += 1
    return counts


class IterationSimulator:
    """Simulate iterations of ``config`` with ``cost`` and the CP layout ``cp_sharding``.

    Layouts are cached per distinct tuple of document lengths (micro-batches repeat often under
    fixed packing and always across the stages of one pipeline). ``layout_builder`` defaults to
    ``megatron_wlb.cp.layouts.build_layout``; tests pass synthetic ones. ``order``: run each DP
    rank's micro-batches as the packer emitted them (``"packer"``) or heaviest first
    (``"heavy-first"``, beyond the paper: under 1F1B the first micro-batch's forward and the last
    one's backward lie on the critical path, so a heavy micro-batch costs least at the front).
    ``sequence_parallel``: PP sends carry the sequence-parallel shard (``CostModel.pp_send``).
    """

    def __init__(self, config: RunConfig, cost: CostModel, cp_sharding: str,
                 layout_builder: LayoutBuilder | None = None, keep_events: bool = False,
                 dp_sync: bool = True, order: str = "packer", sequence_parallel: bool = True):
        if order not in ORDERS:
            raise ValueError(f"order={order!r}; choose one of {', '.join(ORDERS)}")
        self.order = order
        if (cost.layout.tp, cost.layout.cp) != (config.layout.tp, config.layout.cp):
            raise ValueError(f"cost model layout {cost.layout} does not match config layout {config.layout}")
        self.config = config
        self.cost = cost
        self.cp_sharding = cp_sharding
        self.layout_builder = layout_builder or partial(default_layout_builder, seq_len=config.seq_len)
        self.keep_events = keep_events
        self.layers = stage_layers(config.model.num_layers, config.layout.pp)
        self._cache: dict[tuple[int, ...], MicroBatchCost] = {}
        self.dp_sync_seconds = self._dp_sync() if dp_sync else 0.0
        self.sequence_parallel = bool(sequence_parallel)
        model = config.model
        self._head_ratio = 2.0 * model.hidden * model.vocab / model.linear_flops_per_token()

    # -- per micro-batch --------------------------------------------------------------------------
    def microbatch_cost(self, lengths: np.ndarray) -> MicroBatchCost:
        """Per-layer costs of a micro-batch holding documents of ``lengths`` (cached)."""
        key = tuple(int(x) for x in lengths)
        hit = self._cache.get(key)
        if hit is not None:
            return hit
        value = self._compute_cost(np.asarray(key, dtype=np.int64))
        self._cache[key] = value
        return value

    def _compute_cost(self, lengths: np.ndarray) -> MicroBatchCost:
        cp = self.config.layout.cp
        cost = self.cost
        tokens = int(lengths.sum())
        if tokens == 0:
            zeros = np.zeros(cp)
            return MicroBatchCost(0, "empty", 0.0, 0.0, zeros, zeros, zeros, 0.0, 0.0, 0.0, zeros)
        layout = self.layout_builder(self.cp_sharding, lengths, cp, cost)
        attn = np.asarray(layout.rank_work, dtype=np.float64)
        rank_tokens = np.asarray(layout.rank_tokens, dtype=np.float64)
        if attn.shape != (cp,) or rank_tokens.shape != (cp,):
            raise ValueError(f"layout {self.cp_sharding!r} returned rank_work {attn.shape} / rank_tokens "
                             f"{rank_tokens.shape}; expected ({cp},)")
        rank_pairs = np.asarray(layout.rank_pairs, dtype=np.float64)
        hw = cost.hardware
        gemm = np.asarray(cost.linear_compute(rank_tokens), dtype=np.float64)
        # each rank's share as laid out: the one price of a CP rank's work (``packing.metrics.share_seconds``)
        rank_fwd, rank_bwd = share_seconds(cost, attn, rank_tokens, rank_pairs, float(tokens))
        compute = cost.forward_backward(attn, gemm)
        head = float(cost.linear_compute(tokens / cp)) * self._head_ratio
        p2p = float(cost.pp_send(tokens, self.sequence_parallel))
        return MicroBatchCost(tokens, layout.name, float(rank_fwd.max()),
                              float(rank_bwd.max()), rank_fwd, rank_bwd, compute, head,
                              head * hw.bwd_linear, p2p, (1.0 + hw.bwd_attention) * attn)

    def _dp_sync(self) -> float:
        """Ring all-reduce of bf16 gradients over the DP x CP group, not overlapped with backward (an MoE
        model's routed experts: their 1 / (tp x ep) share over the expert-DP group, cp x dp / ep GPUs)."""
        lay = self.config.layout
        group = lay.dp * lay.cp
        if group <= 1:
            return 0.0
        model = self.config.model
        gbps = self.cost.hardware.link_gbps(lay.world_size // lay.pp)
        if model.is_moe:  # routed experts: 1 / (tp x ep) of them per GPU, reduced over the expert-DP group
            experts = float(model.expert_parameters())
            dense_bytes = 2.0 * (model.parameters() - experts) / (lay.tp * lay.pp)
            expert_bytes = 2.0 * experts / (lay.tp * lay.ep * lay.pp)
            expert_group = max(1.0, lay.cp * lay.dp / lay.ep)  # expert TP x EP x expert DP = tp x cp x dp
            seconds = 2.0 * (group - 1) / group * dense_bytes / (gbps * 1e9)
            if expert_group > 1:
                seconds += 2.0 * (expert_group - 1) / expert_group * expert_bytes / (gbps * 1e9)
            return seconds + self.cost.hardware.collective_latency_s
        grad_bytes = 2.0 * model.parameters() / (lay.tp * lay.pp)
        return 2.0 * (group - 1) / group * grad_bytes / (gbps * 1e9) + self.cost.hardware.collective_latency_s

    # -- per iteration ----------------------------------------------------------------------------
    def chunk_tables(self, micro_batches: Iterable[MicroBatch], virtual_stages: int
                     ) -> tuple[np.ndarray, np.ndarray, np.ndarray, list[MicroBatchCost]]:
        """(fwd [v, p, m], bwd [v, p, m], p2p [m], costs): per model chunk of interleaved 1F1B, each
        PP rank's layers split over its ``virtual_stages`` chunks, the LM head on the very last chunk."""
        v = int(virtual_stages)
        costs = [self.microbatch_cost(mb.lengths) for mb in micro_batches]
        per_chunk = np.stack([stage_layers(int(n), v) if n >= v else np.bincount(np.arange(int(n)), minlength=v)
                              for n in self.layers], axis=1).astype(np.float64)  # [v, p]
        f = np.array([c.fwd for c in costs])
        b = np.array([c.bwd for c in costs])
        fwd = per_chunk[:, :, None] * f[None, None, :]
        bwd = per_chunk[:, :, None] * b[None, None, :]
        fwd[-1, -1] += np.array([c.head_fwd for c in costs])
        bwd[-1, -1] += np.array([c.head_bwd for c in costs])
        return fwd, bwd, np.array([c.p2p for c in costs]), costs

    def stage_tables(self, micro_batches: Iterable[MicroBatch]) -> tuple[np.ndarray, np.ndarray, np.ndarray,
                                                                        list[MicroBatchCost]]:
        """(fwd [p, m], bwd [p, m], p2p [m], costs) for one DP rank's micro-batches."""
        costs = [self.microbatch_cost(mb.lengths) for mb in micro_batches]
        layers = self.layers.astype(np.float64)[:, None]
        fwd = layers * np.array([c.fwd for c in costs])[None, :]
        bwd = layers * np.array([c.bwd for c in costs])[None, :]
        fwd[-1] += np.array([c.head_fwd for c in costs])
        bwd[-1] += np.array([c.head_bwd for c in costs])
        p2p = np.array([c.p2p for c in costs])
        return fwd, bwd, p2p, costs

    def simulate(self, batch: GlobalBatch) -> IterationResult:
        """Time one global batch (``batch.dp`` pipelines, then the gradient sync)."""
        lay = self.config.layout
        if batch.dp != lay.dp:
            raise ValueError(f"global batch has dp={batch.dp}, config {self.config.name} has dp={lay.dp}")
        p, cp = lay.pp, lay.cp
        n = batch.n
        pipe_time = np.zeros(lay.dp)
        busy = np.zeros((lay.dp, p))
        compute = np.zeros((lay.dp, p, cp))
        mb_rank = np.zeros((lay.dp, n, cp))
        mb_attn = np.zeros((lay.dp, n, cp))
        mb_fwd = np.zeros((lay.dp, n))
        mb_lat = np.zeros((lay.dp, n))
        mb_tok = np.zeros((lay.dp, n), dtype=np.int64)
        layouts: Counter[str] = Counter()
        pipes = []
        for d in range(lay.dp):
            mbs = batch.for_dp_rank(d)
            if self.order == "heavy-first":
                work = [self.microbatch_cost(mb.lengths) for mb in mbs]
                rank = sorted(range(len(mbs)), key=lambda j: -(work[j].fwd + work[j].bwd))
                mbs = tuple(mbs[j] for j in rank)
            v = self.config.virtual_stages
            if v > 1:
                fwd, bwd, p2p, costs = self.chunk_tables(mbs, v)
            else:
                fwd, bwd, p2p, costs = self.stage_tables(mbs)
            res = simulate_pipeline(fwd, bwd, p2p, virtual_stages=v, keep_events=self.keep_events)
            if v > 1:
                fwd, bwd = fwd.sum(axis=0), bwd.sum(axis=0)
            pipe_time[d] = res.makespan
            busy[d] = res.busy
            rc = np.stack([c.rank_compute for c in costs])  # [m, cp]
            mb_rank[d] = rc
            mb_attn[d] = np.stack([c.rank_attention for c in costs])
            compute[d] = self.layers[:, None] * rc.sum(axis=0)[None, :]
            compute[d, -1] += sum(c.head_fwd + c.head_bwd for c in costs)
            mb_fwd[d] = fwd.sum(axis=0)
            mb_lat[d] = (fwd + bwd).sum(axis=0)
            mb_tok[d] = [c.tokens for c in costs]
            layouts.update(c.layout for c in costs if c.tokens)
            if self.keep_events:
                pipes.append(res)
        lat = batch_latencies(self.cost, batch, backward=False)
        per_rank = imbalance_per_rank(lat)
        pack_imb = float(np.nanmax(per_rank)) if np.any(np.isfinite(per_rank)) else float("nan")
        time = float(pipe_time.max() + self.dp_sync_seconds)
        delayed = [p.length for p in batch.pieces() if p.arrival < batch.iteration]
        bubble = 1.0 - busy.sum() / (lay.dp * p * time) if time > 0 else 0.0
        return IterationResult(
            iteration=batch.iteration, time=time, pipeline_time=pipe_time, dp_sync=self.dp_sync_seconds,
            bubble_fraction=float(bubble), mb_fwd=mb_fwd, mb_latency=mb_lat, mb_tokens=mb_tok,
            gpu_busy=busy, gpu_compute=compute, mb_rank_compute=mb_rank, tokens=batch.tokens, layouts=dict(layouts),
            plan_seconds=batch.plan_seconds, packing_imbalance=pack_imb,
            packing_imbalance_global=imbalance_global(lat), mb_rank_attention=mb_attn, pipelines=tuple(pipes),
            delayed_pieces=len(delayed), delayed_tokens=int(sum(delayed)))


@dataclass(frozen=True)
class RunSummary:
    """A method (packer + CP layout) simulated over the first iterations of a stream."""

    config: str
    packer: str
    cp_sharding: str
    iterations: tuple[IterationResult, ...]
    packing_metrics: dict = field(default_factory=dict)

    @property
    def time(self) -> float:
        return float(sum(r.time for r in self.iterations))

    @property
    def tokens(self) -> int:
        return int(sum(r.tokens for r in self.iterations))

    @property
    def throughput(self) -> float:
        """Tokens trained per second (the tokens a packer holds back are not counted until trained)."""
        return self.tokens / self.time if self.time > 0 else 0.0

    @property
    def mean_time(self) -> float:
        return self.time / max(1, len(self.iterations))

    @property
    def bubble_fraction(self) -> float:
        t = np.array([r.time for r in self.iterations])
        b = np.array([r.bubble_fraction for r in self.iterations])
        return float((t * b).sum() / t.sum()) if t.sum() > 0 else 0.0

    @property
    def pp_imbalance(self) -> float:
        return float(np.mean([r.pp_imbalance for r in self.iterations]))

    @property
    def gpu_compute_imbalance(self) -> float:
        return float(np.mean([r.gpu_compute_imbalance for r in self.iterations]))

    @property
    def layouts(self) -> dict[str, int]:
        total: Counter[str] = Counter()
        for r in self.iterations:
            total.update(r.layouts)
        return dict(total)

    @property
    def plan_ms(self) -> float:
        return 1e3 * float(np.mean([r.plan_seconds for r in self.iterations]))

    def speedup_over(self, base: RunSummary) -> float:
        """Throughput ratio (tokens per second) of this method over ``base``."""
        return self.throughput / base.throughput if base.throughput > 0 else float("nan")


def simulate_stream(config: RunConfig, cost: CostModel, packer: str, cp_sharding: str, lengths: np.ndarray,
                    iterations: int, *, packing_overrides: dict | None = None,
                    layout_builder: LayoutBuilder | None = None, keep_events: bool = False,
                    split_at: int | None = None, order: str = "packer", sequence_parallel: bool = True,
                    progress: Progress | None = None, progress_desc: str | None = None,
                    source: SampleStream | None = None) -> RunSummary:
    """Pack ``lengths`` with ``packer`` and simulate its first ``iterations`` global batches.

    Every packer reads ``dp * n * seq_len`` new tokens per iteration, so the first K iterations of
    two methods cover the same documents up to what a packer holds back at the end. ``split_at``
    cuts documents longer than that into pieces of at most that many tokens before packing (see
    ``split_documents``), so every method trains the same attention spans. ``progress`` shows the
    iterations under ``progress_desc`` (default: config, packer and layout names). ``source``: pack
    Megatron's GPTDataset samples (their pieces in training order) instead of ``lengths``; they are
    already cut at ``seq_len``, so ``split_at`` does not apply.
    """
    if iterations < 1:
        raise ValueError(f"iterations must be at least 1, got {iterations}")
    if split_at is not None and source is None:
        lengths = split_documents(lengths, split_at)
    # Not ``config.with_packer``: it knows only the packers a config file may name, and the
    # simulator also runs the whole-document baseline (``packing/whole_document.py``).
    cfg = replace(config, packing=replace(config.packing, **(packing_overrides or {})))
    pk = make_packer(packer, cfg.packing, cost)
    sim = IterationSimulator(cfg, cost, cp_sharding, layout_builder=layout_builder, keep_events=keep_events,
                             order=order, sequence_parallel=sequence_parallel)
    stream = pk.pack(lengths) if source is None else pk.pack_source(source.cursor())
    batches: Iterable[GlobalBatch] = _take(stream, iterations)
    if progress is not None:
        batches = progress(batches, progress_desc or f"{config.name} {packer}+{cp_sharding}", iterations)
    results = []
    packed = []
    for batch in batches:
        results.append(sim.simulate(batch))
        packed.append(batch)
    if not results:
        raise ValueError("the length stream produced no global batch")
    return RunSummary(config.name, packer, cp_sharding, tuple(results), packing_summary(packed, cost, cfg.seq_len))


def split_documents(lengths: np.ndarray, window: int) -> np.ndarray:
    """Cut every document longer than ``window`` into ``window``-token pieces plus a remainder, in
    order (a context window of ``window`` tokens: no token attends further back than that)."""
    d = np.asarray(lengths, dtype=np.int64)
    if window < 1:
        raise ValueError(f"window must be a positive token count, got {window}")
    if d.size == 0 or d.max() <= window:
        return d
    full = d // window
    rest = d % window
    count = full + (rest > 0)
    out = np.full(int(count.sum()), window, dtype=np.int64)
    last = np.cumsum(count) - 1
    out[last[rest > 0]] = rest[rest > 0]
    return out


def _take(it: Iterator[GlobalBatch], k: int) -> Iterator[GlobalBatch]:
    for i, batch in enumerate(it):
        if i >= k:
            return
        yield batch


def packing_summary(batches: list[GlobalBatch], cost: CostModel, seq_len: int | None = None) -> dict:
    """``megatron_wlb.packing.metrics.summarize`` of the batches (imbalance, delay, packing time)."""
    return summarize(batches, cost, seq_len=seq_len).to_dict()
