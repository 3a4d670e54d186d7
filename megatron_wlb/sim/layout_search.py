"""Choosing the 4D layout (``wlb analyze --choose-layout``): every valid TP x CP x PP x DP of a GPU count, each
simulated with the packers and CP shardings that fit its memory, ranked by predicted tokens per second.

- ``enumerate_layouts``: TP within a node and dividing the heads and the KV heads, CP where the sequence divides
  ``2 x CP`` (Megatron asserts it), PP dividing the layers, DP the rest and dividing the global batch (in
  sequences, micro-batch size 1), interleaved 1F1B (VPP) where the config uses it and the layers divide;
- ``search``: for each layout, the methods whose largest packed micro-batch fits the memory (the caller's
  ``MemoryFn``, megatron-core's own accounting in ``cli.choose_layout``) are simulated by ``experiments.compare``
  on the same documents (the one simulator: ``IterationSimulator``); layouts that fit none are kept with the
  memory they need;
- dynamic CP (``--wlb-cp-sharding dynamic``): the simulator plans it at PP 1 only (``sim.dyncp``); there its
  layer time over the same documents on fixed CP groups scales the simulated adaptive iteration.

Pure: no torch, no I/O; the memory accounting is passed in.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass, field, replace

import numpy as np

from megatron_wlb.config import RunConfig
from megatron_wlb.costmodel import CostModel, ModelShape, ParallelLayout, check_expert_layout
from megatron_wlb.cp.dynamic import DYNAMIC_SHARDING
from megatron_wlb.sim.dyncp import simulate_dynamic_stream
from megatron_wlb.sim.experiments import BALANCED_CUT, PLAIN, WLB, Method, compare
from megatron_wlb.sim.iteration import RunSummary, split_documents

#: GPUs of one node: TP stays within a node (its all-reduces need NVLink)
GPUS_PER_NODE = 8
#: the packings tried on every layout, best first when they fit: WLB-LLM, balanced concat-and-cut, the stock
#: concat-and-cut grouping; the first two again at S_max = seq_len where the config's S_max does not fit
SEARCH_METHODS: tuple[Method, ...] = (WLB, BALANCED_CUT, PLAIN)
#: the name of WLB-LLM with dynamic CP groups (PP 1)
DYNAMIC_NAME = "WLB-LLM + dynamic CP"


@dataclass(frozen=True)
class LayoutChoice:
    """One candidate layout: the 4D degrees, the virtual stages (1 = plain 1F1B) and the micro-batches each DP
    rank runs per iteration (global batch / DP)."""

    layout: ParallelLayout
    virtual_stages: int
    micro_batches: int

    @property
    def label(self) -> str:
        lay = self.layout
        text = f"TP{lay.tp} CP{lay.cp} PP{lay.pp} DP{lay.dp}" + (f" EP{lay.ep}" if lay.ep > 1 else "")
        return text + (f" VPP{self.virtual_stages}" if self.virtual_stages > 1 else "")


def divisors(n: int) -> list[int]:
    """The positive divisors of ``n``, ascending."""
    return [d for d in range(1, n + 1) if n % d == 0]


def enumerate_layouts(model: ModelShape, seq_len: int, gpus: int, global_batch: int, *,
                      gpus_per_node: int = GPUS_PER_NODE, virtual_stages: int = 1, ep: int = 1) -> list[LayoutChoice]:
    """Every valid layout of ``gpus`` GPUs (see the module doc), TP x CP x PP x DP = ``gpus``; with
    ``virtual_stages`` > 1 each PP > 1 layout also under interleaved 1F1B where the layers split into
    ``pp x virtual_stages`` chunks and the micro-batches divide by PP (Megatron's interleaved schedule)."""
    out = []
    for tp in divisors(gpus):
        if tp > gpus_per_node or model.num_heads % tp or model.num_kv_heads % tp:
            continue
        for cp in divisors(gpus // tp):
            if seq_len % (2 * cp):
                continue
            for pp in divisors(gpus // (tp * cp)):
                dp = gpus // (tp * cp * pp)
                if model.num_layers % pp or global_batch % dp or (tp * cp * dp) % ep:
                    continue
                layout = ParallelLayout(tp=tp, cp=cp, pp=pp, dp=dp, ep=ep)
                try:
                    check_expert_layout(model, layout)
                except ValueError:
                    continue
                n = global_batch // dp
                out.append(LayoutChoice(layout, 1, n))
                v = virtual_stages
                if v > 1 and pp > 1 and model.num_layers % (pp * v) == 0 and n % pp == 0:
                    out.append(LayoutChoice(layout, v, n))
    return out


def layout_config(config: RunConfig, choice: LayoutChoice) -> RunConfig:
    """``config`` (model, sequence length, packing knobs) on ``choice``'s layout, micro-batches and schedule."""
    lay, v = choice.layout, choice.virtual_stages
    packing = replace(config.packing, dp=lay.dp, n=choice.micro_batches, pipeline_stages=lay.pp, virtual_stages=v)
    return replace(config, name=f"{config.name} {choice.label}", layout=lay, packing=packing, virtual_stages=v)


def micro_batch_tokens(config: RunConfig, method: Method) -> int:
    """The largest micro-batch ``method`` packs on ``config``: S_max for the variable-length packer (``wlb``),
    ``seq_len`` for the fixed-length ones (the stock concat-and-cut cuts exactly seq_len tokens)."""
    if method.packer != "wlb":
        return config.seq_len
    return int(method.packing_overrides(config).get("max_seq_len") or config.packing.capacity_var)


def at_seq_len(method: Method) -> Method:
    """``method`` with S_max = seq_len (``--wlb-max-seq-len`` = ``--seq-length``): what fits a tighter memory."""
    return replace(method, name=f"{method.name}, S_max = seq_len", s_max_factor=1.0)


@dataclass(frozen=True)
class MemoryNeed:
    """Per-GPU memory (GiB) of the most loaded rank: weights + optimizer, and activations."""

    weights_gib: float
    activations_gib: float

    @property
    def total_gib(self) -> float:
        return self.weights_gib + self.activations_gib


#: (the config on a layout, the largest micro-batch's tokens) -> the memory of its most loaded GPU
MemoryFn = Callable[[RunConfig, int], MemoryNeed]
#: (the config on a layout) -> the cost model that prices it
CostFn = Callable[[RunConfig], CostModel]


@dataclass(frozen=True)
class Candidate:
    """One simulated (layout, packing, CP sharding): predicted throughput and why."""

    choice: LayoutChoice
    method: Method
    cp_sharding: str
    tokens_per_second: float
    iteration_seconds: float
    bubble_fraction: float
    pp_imbalance: float
    gpu_imbalance: float
    cp_comm_share: float
    micro_batch_tokens: int
    memory: MemoryNeed
    largest_micro_batch: int
    note: str = ""

    @property
    def packer(self) -> str:
        return self.method.packer

    def to_json(self, gpu_memory: float) -> dict:
        """The candidate as JSON (a figure the simulation does not give, e.g. dynamic CP's bubble: null)."""
        lay = self.choice.layout
        out = {"layout": {"tp": lay.tp, "cp": lay.cp, "pp": lay.pp, "dp": lay.dp, "ep": lay.ep,
                           "virtual_stages": self.choice.virtual_stages, "micro_batches": self.choice.micro_batches},
                "label": self.choice.label, "method": self.method.name, "packer": self.method.packer,
                "cp_sharding": self.cp_sharding, "overrides": dict(self.method.overrides),
                "tokens_per_second": self.tokens_per_second, "iteration_seconds": self.iteration_seconds,
                "bubble_fraction": self.bubble_fraction, "pp_imbalance": self.pp_imbalance,
                "gpu_imbalance": self.gpu_imbalance, "cp_comm_share": self.cp_comm_share,
                "micro_batch_tokens": self.micro_batch_tokens, "largest_micro_batch": self.largest_micro_batch,
                "memory_gib": self.memory.total_gib, "weights_gib": self.memory.weights_gib,
                "activations_gib": self.memory.activations_gib, "headroom_gib": gpu_memory - self.memory.total_gib,
                **({"note": self.note} if self.note else {})}
        return {k: None if isinstance(v, float) and v != v else v for k, v in out.items()}


@dataclass(frozen=True)
class Unfit:
    """A layout no packing fits: the least memory it needs (GiB, at seq_len-token micro-batches)."""

    choice: LayoutChoice
    memory: MemoryNeed


@dataclass
class SearchResult:
    """Candidates ranked by predicted tokens per second (fastest first), and the layouts that do not fit."""

    candidates: list[Candidate]
    unfit: list[Unfit]
    layouts: int
    notes: list[str] = field(default_factory=list)


def cp_comm_share(run: RunSummary, cost: CostModel, config: RunConfig) -> float:
    """The CP all-gathers' share of the iteration time: per DP rank the first stage's micro-batches' K/V
    gathers (forward and backward, its layers), the busiest DP rank's, over the iterations."""
    if config.layout.cp == 1:
        return 0.0
    per_stage = config.model.num_layers / config.layout.pp
    scale = (1.0 + cost.hardware.bwd_linear) * per_stage
    comm = sum(float(np.max(np.sum(np.where(r.mb_tokens > 0, cost.cp_comm(r.mb_tokens.astype(np.float64)), 0.0),
                                   axis=1))) * scale for r in run.iterations)
    total = run.time
    return comm / total if total > 0 else 0.0


def _candidate(choice: LayoutChoice, method: Method, sharding: str, run: RunSummary, cost: CostModel,
               config: RunConfig, tokens: int, memory: MemoryNeed) -> Candidate:
    largest = max(int(r.mb_tokens.max()) for r in run.iterations)
    return Candidate(choice, method, sharding, run.throughput, run.mean_time, run.bubble_fraction, run.pp_imbalance,
                     run.gpu_compute_imbalance, cp_comm_share(run, cost, config), tokens, memory, largest)


def search(config: RunConfig, lengths: np.ndarray, choices: Sequence[LayoutChoice], iterations: int,
           gpu_memory: float, memory: MemoryFn, cost_of: CostFn, *, dynamic: bool = True,
           progress: Callable[[str], None] | None = None) -> SearchResult:
    """Simulate every layout of ``choices`` that fits ``gpu_memory`` GiB with each packing that fits it
    (``SEARCH_METHODS``, at S_max = seq_len where the config's S_max does not fit), on the first ``iterations``
    iterations of ``lengths`` (documents, cut at seq_len for every method alike), and rank them."""
    candidates: list[Candidate] = []
    unfit: list[Unfit] = []
    notes: list[str] = []
    for k, choice in enumerate(choices):
        cfg = layout_config(config, choice)
        methods: list[tuple[Method, int, MemoryNeed]] = []
        least: MemoryNeed | None = None
        for method in SEARCH_METHODS:
            for variant in (method, at_seq_len(method)):
                if variant is not method and micro_batch_tokens(cfg, method) == cfg.seq_len:
                    break  # S_max is seq_len already
                tokens = micro_batch_tokens(cfg, variant)
                need = memory(cfg, tokens)
                if least is None or need.total_gib < least.total_gib:
                    least = need
                if need.total_gib <= gpu_memory:
                    methods.append((variant, tokens, need))
                    break
        if not methods:
            assert least is not None
            unfit.append(Unfit(choice, least))
            if progress is not None:
                progress(f"layout {k + 1}/{len(choices)} {choice.label}: does not fit ({least.total_gib:.1f} GiB "
                         f"> {gpu_memory:g})")
            continue
        cost = cost_of(cfg)
        comparison = compare(cfg, lengths, iterations, [m for m, _, _ in methods], cost=cost)
        found = []
        for method, tokens, need in methods:
            run = comparison.runs[method.name]
            found.append(_candidate(choice, method, method.cp_sharding, run, cost, cfg, tokens, need))
        wlb = next((c for c in found if c.method.name == WLB.name), None)
        if dynamic and wlb is not None and choice.layout.pp == 1 and choice.layout.cp * choice.layout.dp > 1:
            found.append(_dynamic(cfg, cost, lengths, iterations, wlb, comparison.runs[wlb.method.name]))
        candidates.extend(found)
        if progress is not None:
            best = max(found, key=lambda c: c.tokens_per_second)
            progress(f"layout {k + 1}/{len(choices)} {choice.label}: {best.tokens_per_second:,.0f} tokens/s "
                     f"({best.method.name}, {best.cp_sharding})")
    if any(c.choice.layout.pp > 1 for c in candidates) and dynamic:
        notes.append(f"Dynamic CP (--wlb-cp-sharding {DYNAMIC_SHARDING}) is simulated on PP 1 layouts only (the "
                     "simulator's dynamic-CP planner plans one pipeline stage); PP > 1 layouts show fixed CP groups.")
    candidates.sort(key=lambda c: -c.tokens_per_second)
    unfit.sort(key=lambda u: u.memory.total_gib)
    return SearchResult(candidates, unfit, len(choices), notes)


def _dynamic(cfg: RunConfig, cost: CostModel, lengths: np.ndarray, iterations: int, wlb: Candidate,
             run: RunSummary) -> Candidate:
    """WLB-LLM with dynamic CP groups on a PP 1 layout: the planner's layer time over the same documents on fixed
    CP groups (``simulate_dynamic_stream``) scales the simulated adaptive iteration (head and gradient sync alike);
    memory as WLB-LLM's (the planner holds at most seq_len / CP tokens a rank)."""
    dyn = simulate_dynamic_stream(cfg, cost, "wlb", split_documents(lengths, cfg.seq_len), iterations)
    ratio = sum(r.time for r in dyn) / max(1e-12, sum(r.fixed for r in dyn))
    method = replace(WLB, name=DYNAMIC_NAME, cp_sharding=DYNAMIC_SHARDING)
    nan = float("nan")  # the planner's groups: the fixed groups' bubble, imbalance and CP share do not describe them
    return replace(wlb, method=method, cp_sharding=DYNAMIC_SHARDING, tokens_per_second=wlb.tokens_per_second / ratio,
                   iteration_seconds=wlb.iteration_seconds * ratio, bubble_fraction=nan, pp_imbalance=nan,
                   gpu_imbalance=nan, cp_comm_share=nan,
                   note=f"dynamic-CP layer time / fixed groups = {ratio:.3f} (sim.dyncp), applied to the "
                        f"simulated {wlb.method.name} iteration")
