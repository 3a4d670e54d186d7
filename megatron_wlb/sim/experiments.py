"""The paper's experiments as pure functions: configs + a length stream in, tables out.

Every method is a packer plus a CP shard layout; a method's speedup is its throughput (tokens
trained per simulated second) over Plain-4D's on the same first K iterations of the same stream
(all packers read ``dp * n * seq_len`` new tokens per iteration; what a packer still holds back
after K iterations is not counted for it). Paper numbers are printed beside ours where the paper
gives one (``PAPER``); figure-only values are not invented.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Iterable, Iterator, Sequence
from dataclasses import dataclass, field, replace

import numpy as np

from megatron_wlb.config import RunConfig, load_config
from megatron_wlb.costmodel import CostModel, build_cost_model
from megatron_wlb.sim.iteration import LayoutBuilder, RunSummary, simulate_stream

#: ``progress(iterable, desc, total) -> iterable``: a tqdm-like wrapper, or None for silence.
Progress = Callable[[Iterable, str, int], Iterable]

TABLE1_CONFIGS = ("550m_64k", "550m_128k", "7b_64k", "7b_128k", "30b_64k", "30b_128k", "70b_64k", "70b_128k")
CASE_STUDY_CONFIG = "405b_128k_8k"
SWEEP_WINDOWS = (32768, 65536, 98304, 131072, 163840)


@dataclass(frozen=True)
class Method:
    """A packer + CP layout (+ packing overrides) under a display name.

    ``virtual_stages``: run interleaved 1F1B with this many virtual stages instead of the
    config's. ``order``: ``"heavy-first"`` runs each DP rank's micro-batches heaviest first (see
    ``IterationSimulator``). ``s_max_factor``: set ``max_seq_len`` (paper S_max) to this many
    times ``seq_len`` (rounded up to a multiple of 2 x cp) instead of the config's; only the
    variable-length packer uses it.
    """

    name: str
    packer: str
    cp_layout: str
    overrides: tuple[tuple[str, object], ...] = ()
    s_max_factor: float | None = None
    order: str = "packer"
    virtual_stages: int | None = None

    def packing_overrides(self, config: RunConfig) -> dict:
        out = dict(self.overrides)
        if self.s_max_factor is not None and "max_seq_len" not in out:
            unit = 2 * config.layout.cp
            out["max_seq_len"] = int(math.ceil(config.seq_len * self.s_max_factor / unit) * unit)
        return out


PLAIN = Method("Plain-4D", "original", "per-sequence")
FIXED = Method("Fixed-4D", "fixed-greedy", "per-document")
#: WLB-LLM uses each config's ``max_seq_len`` (paper S_max, which the paper does not give); the
#: shipped configs and ``PackingConfig``'s default use 1.5 x seq_len; the report shows the sensitivity.
WLB = Method("WLB-LLM", "wlb", "adaptive")
DYNCP = Method("Megatron dyn-CP", "fixed-greedy", "dynamic-cp")
MAIN_METHODS = (PLAIN, FIXED, WLB, DYNCP)

BREAKDOWN_METHODS = (
    PLAIN,
    Method("+ per-document CP", "original", "per-document"),
    Method("+ adaptive CP", "original", "adaptive"),
    Method("var-len packing + outlier delay", "wlb", "per-sequence"),
    Method("WLB-LLM (all)", "wlb", "adaptive"),
    Method("WLB-LLM + hybrid CP (beyond paper)", "wlb", "hybrid"),
    Method("WLB-LLM + heavy-first order (beyond paper)", "wlb", "adaptive", order="heavy-first"),
    Method("Plain-4D + heavy-first order (beyond paper)", "original", "per-sequence", order="heavy-first"),
    Method("Plain-4D, interleaved 1F1B v=2", "original", "per-sequence", virtual_stages=2),
    Method("WLB-LLM, interleaved 1F1B v=2", "wlb", "adaptive", virtual_stages=2),
    Method("Fixed-4D", "fixed-greedy", "per-document"),
    Method("Megatron dyn-CP", "fixed-greedy", "dynamic-cp"),
)

# Paper numbers (WLB-LLM, OSDI'25); see docs/simulator.md. Keys: (experiment, row).
PAPER: dict[tuple[str, str], float] = {
    ("fig12", "WLB-LLM:avg"): 1.23, ("fig12", "WLB-LLM:64k"): 1.15, ("fig12", "WLB-LLM:128k"): 1.30,
    ("fig12", "Fixed-4D:avg"): 1.03,
    ("fig13", "Plain-4D"): 1.00, ("fig13", "+ per-document CP"): 1.02, ("fig13", "+ adaptive CP"): 1.05,
    ("fig13", "var-len packing + outlier delay"): 1.28, ("fig13", "WLB-LLM (all)"): 1.33,
    ("fig14", "163840"): 1.40,
    ("case", "max/mean"): 1.44,
    ("table2", "original"): 1.44, ("table2", "fixed-greedy"): 1.41, ("table2", "wlb"): 1.05,
}


@dataclass(frozen=True)
class Table:
    """A result table: ``rows`` of cells (str, int or float), rendered by ``to_markdown``."""

    title: str
    columns: tuple[str, ...]
    rows: tuple[tuple, ...]
    notes: tuple[str, ...] = ()

    def to_markdown(self, digits: int = 2) -> str:
        def cell(x) -> str:
            if x is None or (isinstance(x, float) and math.isnan(x)):
                return "-"
            if isinstance(x, float):
                return f"{x:.{digits}f}"
            return str(x)

        lines = [f"| {' | '.join(self.columns)} |", "|" + "---|" * len(self.columns)]
        lines += [f"| {' | '.join(cell(x) for x in row)} |" for row in self.rows]
        lines += [""] + [f"{n}" for n in self.notes] if self.notes else []
        return "\n".join(lines)

    def column(self, name: str) -> list:
        i = self.columns.index(name)
        return [r[i] for r in self.rows]


@dataclass(frozen=True)
class Comparison:
    """Methods simulated on one config: summaries by method name, Plain-4D (the first) as base."""

    config: RunConfig
    cost: CostModel
    runs: dict[str, RunSummary]
    base: str = PLAIN.name
    iterations: int = 0
    extra: dict = field(default_factory=dict)

    def speedup(self, method: str) -> float:
        return self.runs[method].speedup_over(self.runs[self.base])


def _wrap(progress: Progress | None, it: Iterable, desc: str, total: int) -> Iterable:
    return it if progress is None else progress(it, desc, total)


def compare(config: RunConfig, lengths: np.ndarray, iterations: int, methods: Sequence[Method] = MAIN_METHODS,
            *, cost: CostModel | None = None, profile: str | None = None, keep_events: bool = False,
            layout_builder: LayoutBuilder | None = None, split_at_window: bool = True,
            progress: Progress | None = None) -> Comparison:
    """Simulate every method on ``config`` over the first ``iterations`` iterations of ``lengths``.

    With ``split_at_window`` documents longer than the window are cut into window-size pieces
    before packing, for every method alike (a 64K-context job attends at most 64K tokens back).
    """
    if not methods:
        raise ValueError("compare needs at least one method")
    cost = cost or build_cost_model(config.model, config.layout, profile)
    runs: dict[str, RunSummary] = {}
    for m in methods:
        def bar(it: Iterator, _m: Method = m) -> Iterable:
            return _wrap(progress, it, f"{config.name} {_m.name}", iterations)

        cfg = config if m.virtual_stages is None else replace(config, virtual_stages=m.virtual_stages)
        if cfg.virtual_stages > 1 and cfg.micro_batches % cfg.layout.pp:
            raise ValueError(f"{m.name}: interleaved 1F1B needs micro_batches ({cfg.micro_batches}) divisible "
                             f"by pp ({cfg.layout.pp})")
        runs[m.name] = simulate_stream(cfg, cost, m.packer, m.cp_layout, lengths, iterations,
                                       packing_overrides=m.packing_overrides(config), layout_builder=layout_builder,
                                       keep_events=keep_events, progress=bar, order=m.order,
                                       split_at=config.seq_len if split_at_window else None)
    return Comparison(config, cost, runs, base=methods[0].name, iterations=iterations)


def _window(config: RunConfig) -> str:
    return f"{config.seq_len // 1024}k"


def table1(comparisons: Sequence[Comparison]) -> Table:
    """Fig. 12: speedup of every method over Plain-4D per config, with the paper's averages."""
    methods = [m for m in comparisons[0].runs if m != comparisons[0].base]
    rows = []
    for c in comparisons:
        lay = c.config.layout
        rows.append((c.config.name, f"({lay.tp},{lay.cp},{lay.pp},{lay.dp})", lay.world_size,
                     *[c.speedup(m) for m in methods]))

    def mean(select: Callable[[Comparison], bool], method: str) -> float:
        vals = [c.speedup(method) for c in comparisons if select(c)]
        return float(np.exp(np.mean(np.log(vals)))) if vals else float("nan")

    for label, sel in (("avg 64K", lambda c: _window(c.config) == "64k"),
                       ("avg 128K", lambda c: _window(c.config) == "128k"),
                       ("avg all", lambda c: True)):
        rows.append((f"**{label}** (geo-mean)", "", "", *[mean(sel, m) for m in methods]))
    key = {"avg 64K": "64k", "avg 128K": "128k", "avg all": "avg"}
    for label in key:
        rows.append((f"paper {label}", "", "", *[PAPER.get(("fig12", f"{m}:{key[label]}")) for m in methods]))
    cols = ("config", "(TP,CP,PP,DP)", "GPUs", *[f"{m} speedup" for m in methods])
    return Table("Speedup over Plain-4D per Table 1 config (paper Fig. 12)", cols, tuple(rows))


def detail_table(comparisons: Sequence[Comparison]) -> Table:
    """Per config and method: iteration time, bubble, imbalance, layouts chosen, packing time."""
    rows = []
    for c in comparisons:
        for name, run in c.runs.items():
            pm = run.packing_metrics
            rows.append((c.config.name, name, 1e3 * run.mean_time, 100 * run.bubble_fraction, run.pp_imbalance,
                         pm.get("imbalance_fwd", float("nan")), run.gpu_compute_imbalance,
                         pm.get("mean_delay", float("nan")), pm.get("plan_ms_mean", float("nan")),
                         layout_mix(run.layouts)))
    cols = ("config", "method", "iter ms", "bubble %", "PP imbalance (sim)", "imbalance (Table 2 def.)",
            "GPU compute max/mean", "delay (iters/token)", "plan ms", "CP layouts chosen")
    return Table("Per-method detail", cols, tuple(rows))


def layout_mix(layouts: dict[str, int]) -> str:
    total = sum(layouts.values())
    if not total:
        return "-"
    return ", ".join(f"{k} {100 * v / total:.0f}%" for k, v in sorted(layouts.items(), key=lambda kv: -kv[1]))


def breakdown_table(c: Comparison) -> Table:
    """Fig. 13: each optimisation alone and together on one config."""
    rows = [(name, c.speedup(name), PAPER.get(("fig13", name)), 1e3 * run.mean_time, run.pp_imbalance)
            for name, run in c.runs.items()]
    notes = ()
    if any("interleaved" in name for name in c.runs):
        notes = ("Every speedup is over the first row. The interleaved rows run Megatron's interleaved 1F1B "
                 "with 2 virtual stages per PP rank (with N = PP = 4 it warms up every micro-batch first, "
                 "which costs activation memory the simulator does not model); WLB-LLM over Plain-4D, both "
                 "interleaved, is the ratio of those two rows.",)
    return Table(f"Breakdown on {c.config.name} (paper Fig. 13)",
                 ("method", "speedup (ours)", "paper", "iter ms", "PP imbalance"), tuple(rows), notes)


def table2(c: Comparison) -> Table:
    """Paper Table 2's imbalance degree (forward latency) of the packers on one config."""
    seen: dict[str, RunSummary] = {}
    for run in c.runs.values():
        seen.setdefault(run.packer, run)
    rows = [(packer, run.packing_metrics.get("imbalance_fwd"), PAPER.get(("table2", packer)),
             run.packing_metrics.get("plan_ms_mean")) for packer, run in seen.items()]
    return Table(f"Micro-batch imbalance on {c.config.name} (paper Table 2: max fwd latency x N / total)",
                 ("packer", "imbalance (ours)", "paper", "plan ms / iteration"), tuple(rows))


def with_window(config: RunConfig, seq_len: int) -> RunConfig:
    """The same job at another context window (seq_len and the packing budget change together)."""
    if seq_len % (2 * config.layout.cp):
        raise ValueError(f"seq_len={seq_len} must be divisible by 2 x cp = {2 * config.layout.cp}")
    return replace(config, name=f"{config.model.name}_{seq_len // 1024}k", seq_len=seq_len,
                   packing=replace(config.packing, seq_len=seq_len, max_seq_len=None))


def window_sweep(lengths: np.ndarray, iterations: int, *, base: str = "7b_128k",
                 windows: Sequence[int] = SWEEP_WINDOWS, profile: str | None = None,
                 progress: Progress | None = None) -> tuple[Table, list[Comparison]]:
    """Fig. 14: WLB-LLM over Plain-4D for one model and layout as the window grows."""
    cfg = load_config(base)
    comps = [compare(with_window(cfg, w), lengths, iterations, (PLAIN, WLB), profile=profile, progress=progress)
             for w in windows]
    rows = tuple((f"{w // 1024}K", c.speedup(WLB.name), PAPER.get(("fig14", str(w))),
                  1e3 * c.runs[PLAIN.name].mean_time, 1e3 * c.runs[WLB.name].mean_time)
                 for w, c in zip(windows, comps))
    lay = cfg.layout
    return Table(f"WLB-LLM speedup vs context window, {cfg.model.name} on ({lay.tp},{lay.cp},{lay.pp},{lay.dp}) "
                 "(paper Fig. 14)", ("window", "speedup (ours)", "paper", "Plain-4D iter ms", "WLB-LLM iter ms"),
                 rows), comps


def gpu_latency_ratios(run: RunSummary) -> np.ndarray:
    """Per-GPU computation latency (per layer, see ``IterationResult.gpu_layer_compute``) over the
    iteration's mean, for all GPUs of all iterations (TP and PP peers share one value)."""
    out = [g.ravel() / g.mean() for g in (r.gpu_layer_compute for r in run.iterations) if g.mean() > 0]
    return np.concatenate(out) if out else np.zeros(0)


def mb_latency_ratios(run: RunSummary) -> np.ndarray:
    """Computation latency of every (micro-batch, CP rank) over its iteration's mean."""
    out = [m.ravel() / m.mean() for m in (r.mb_rank_compute for r in run.iterations) if m.mean() > 0]
    return np.concatenate(out) if out else np.zeros(0)


def case_study_table(c: Comparison) -> Table:
    """The 8K-GPU case study: per-GPU computation latency over the mean (and per micro-batch)."""
    rows = []
    for name, run in c.runs.items():
        ratios = gpu_latency_ratios(run)
        per_iter = [r.gpu_compute_imbalance for r in run.iterations]
        mb = mb_latency_ratios(run)
        rows.append((name, float(np.mean(per_iter)), float(np.max(per_iter)), float(np.percentile(ratios, 99)),
                     float(np.percentile(ratios, 50)), float(ratios.min()), float(mb.max()),
                     PAPER.get(("case", "max/mean")) if name == PLAIN.name else None,
                     c.speedup(name)))
    lay = c.config.layout
    return Table(f"{c.config.name}: per-GPU computation latency / mean, {lay.world_size} GPUs "
                 f"(TP,CP,PP,DP)=({lay.tp},{lay.cp},{lay.pp},{lay.dp})",
                 ("method", "slowest GPU / mean (avg over iters)", "worst iter", "p99", "median", "fastest",
                  "slowest micro-batch x CP rank / mean", "paper slowest", "speedup"), tuple(rows))
