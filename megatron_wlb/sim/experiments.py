"""The paper's experiments as pure functions: configs + a length stream in, tables out.

Every method is a packer plus a CP shard layout; a method's speedup is its throughput (tokens
trained per simulated second) over a baseline's on the same first K iterations of the same stream
(all packers read ``dp * n * seq_len`` new tokens per iteration; what a packer still holds back
after K iterations is not counted for it). Paper numbers are printed beside ours where the paper
gives one (``PAPER``); figure-only values are not invented.

Two baselines, both "Plain-4D" (no balancing, per-sequence CP sharding): ``concat-and-cut``
(Megatron GPTDataset, ``packing/original.py``; pieces of cut documents attend only within
themselves) and ``whole-document`` (``packing/whole_document.py``: documents kept whole in arrival order in
fixed-length micro-batches). Every speedup is shown against both. The schedule is the paper's
interleaved 1F1B (``PAPER_VIRTUAL_STAGES`` virtual stages) unless a caller asks otherwise.
"""

from __future__ import annotations

import math
from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field, replace

import numpy as np

from megatron_wlb.config import RunConfig, load_config
from megatron_wlb.costmodel import CostModel, build_cost_model
from megatron_wlb.cp.protocols import LayoutBuilder
from megatron_wlb.data.samples import SampleStream
from megatron_wlb.sim.iteration import Progress, RunSummary, simulate_stream

__all__ = ["Progress"]  # re-exported: the callers of compare() and reproduce() name it from here

TABLE1_CONFIGS = ("550m_64k", "550m_128k", "7b_64k", "7b_128k", "30b_64k", "30b_128k", "70b_64k", "70b_128k")
CASE_STUDY_CONFIG = "405b_128k_8k"
SWEEP_WINDOWS = (32768, 65536, 98304, 131072, 163840)
#: Virtual stages of the interleaved 1F1B schedule the paper trains with (Sec. 6; it does not give
#: v). 2 is the smallest interleaving; the report sweeps 1 (plain 1F1B), 2 and 4. Only the paper's
#: experiments (``wlb reproduce``, the lab's verdict) use it: a command given a config runs the config's
#: ``virtual_stages`` (default 1, Megatron's), or ``--virtual-stages``.
PAPER_VIRTUAL_STAGES = 2
VIRTUAL_STAGE_SWEEP = (1, 2, 4)


@dataclass(frozen=True)
class Method:
    """A packer + CP layout (+ packing overrides) under a display name.

    ``virtual_stages``: run interleaved 1F1B with this many virtual stages instead of the
    config's. ``order``: ``"heavy-first"`` runs each DP rank's micro-batches heaviest first (see
    ``IterationSimulator``). ``s_max_factor``: set ``max_seq_len`` (paper S_max) to this many
    times ``seq_len`` (rounded up to a multiple of 2 x cp) instead of the config's; only the
    variable-length packer uses it. ``on_samples``: None = the method reads documents; a tuple = it
    trains Megatron's GPTDataset samples when ``compare`` is given them (``samples``), with these
    further packing overrides (the concat-and-cut baseline and the balanced concat-and-cut).
    """

    name: str
    packer: str
    cp_sharding: str
    overrides: tuple[tuple[str, object], ...] = ()
    s_max_factor: float | None = None
    order: str = "packer"
    virtual_stages: int | None = None
    on_samples: tuple[tuple[str, object], ...] | None = None

    def packing_overrides(self, config: RunConfig) -> dict:
        out = dict(self.overrides)
        if self.s_max_factor is not None and "max_seq_len" not in out:
            unit = 2 * config.layout.cp
            out["max_seq_len"] = int(math.ceil(config.seq_len * self.s_max_factor / unit) * unit)
        return out


PLAIN = Method("Plain-4D", "original", "per-sequence", on_samples=())
#: The second baseline: documents kept whole (see ``megatron_wlb.packing.whole_document``).
WHOLE = Method("Plain-4D whole-doc", "whole-document", "per-sequence")
BASELINES = (PLAIN, WHOLE)
FIXED = Method("Fixed-4D", "fixed-greedy", "per-document")
#: WLB-LLM uses each config's ``max_seq_len`` (paper S_max, which the paper does not give); the
#: shipped configs and ``PackingConfig``'s default use 1.5 x seq_len; the report shows the sensitivity.
WLB = Method("WLB-LLM", "wlb", "adaptive")
DYNCP = Method("Megatron dyn-CP", "fixed-greedy", "dynamic-cp")
#: Megatron's own pieces (concat-and-cut's cut points), balanced by the wlb packer and the adaptive CP
#: layout: the same data and attention work as PLAIN (``PackingConfig.pieces``; beyond the paper). On
#: GPTDataset's samples it reads no sample before the iteration Megatron's sampler gives it (read_ahead
#: off, as the training intake).
BALANCED_CUT = Method("Balanced concat-and-cut", "wlb", "adaptive", overrides=(("pieces", "concat-and-cut"),),
                      on_samples=(("read_ahead", False),))
MAIN_METHODS = (PLAIN, WHOLE, FIXED, WLB, BALANCED_CUT, DYNCP)
#: Global batches the equal-delay baseline packs together (mean delay about 0.6 iterations per token on
#: the embedded stream, WLB-LLM's default about 0.5: the issue-24 target compares at no more delay).
EQUAL_DELAY_WINDOW = 4
#: The strongest baseline at equal delay: fixed-length greedy packing over ``EQUAL_DELAY_WINDOW`` global
#: batches, with WLB-LLM's own adaptive CP layout so that only the packing differs. ``wlb analyze``
#: shows every method's speedup over it beside the two Plain-4D baselines.
EQUAL_DELAY = Method(f"Fixed-greedy, window {EQUAL_DELAY_WINDOW}", "fixed-greedy", "adaptive",
                     overrides=(("window", EQUAL_DELAY_WINDOW),))
#: ``wlb analyze``'s methods: the main ones and the equal-delay baseline.
ANALYZE_METHODS = (*MAIN_METHODS, EQUAL_DELAY)
#: How the report names each baseline (``Comparison.baselines`` lists those a comparison ran, in this order).
BASELINE_LABELS = {PLAIN.name: "concat-and-cut", WHOLE.name: "whole-document",
                   EQUAL_DELAY.name: f"fixed-greedy, window {EQUAL_DELAY_WINDOW}"}

BREAKDOWN_METHODS = (
    PLAIN,
    WHOLE,
    Method("+ per-document CP", "original", "per-document"),
    Method("+ adaptive CP", "original", "adaptive"),
    Method("var-len packing + outlier delay", "wlb", "per-sequence"),
    Method("WLB-LLM (all)", "wlb", "adaptive"),
    Method("WLB-LLM + hybrid CP (beyond paper)", "wlb", "hybrid"),
    Method("WLB-LLM + heavy-first order (beyond paper)", "wlb", "adaptive", order="heavy-first"),
    Method("Plain-4D + heavy-first order (beyond paper)", "original", "per-sequence", order="heavy-first"),
    Method("Plain-4D, plain 1F1B (v=1)", "original", "per-sequence", virtual_stages=1),
    Method("Plain-4D whole-doc, plain 1F1B (v=1)", "whole-document", "per-sequence", virtual_stages=1),
    Method("WLB-LLM, plain 1F1B (v=1)", "wlb", "adaptive", virtual_stages=1),
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
    ("table2", "original"): 1.44, ("table2", "whole-document"): 1.44, ("table2", "fixed-greedy"): 1.41,
    ("table2", "wlb"): 1.05,
}


@dataclass(frozen=True)
class Table:
    """A result table: ``rows`` of cells (str, int or float), rendered by ``to_markdown``."""

    title: str
    columns: tuple[str, ...]
    rows: tuple[tuple, ...]
    notes: tuple[str, ...] = ()

    def to_markdown(self, digits: int = 2) -> str:
        def cell(x: object) -> str:
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
    virtual_stages: int = 1
    sequence_parallel: bool = True

    def speedup(self, method: str, base: str | None = None) -> float:
        """Throughput of ``method`` over ``base`` (default: the first method)."""
        return self.runs[method].speedup_over(self.runs[base or self.base])

    @property
    def baselines(self) -> list[str]:
        """The baseline methods this comparison ran, in ``BASELINE_LABELS`` order."""
        return [b for b in BASELINE_LABELS if b in self.runs]


def compare(config: RunConfig, lengths: np.ndarray, iterations: int, methods: Sequence[Method] = MAIN_METHODS,
            *, cost: CostModel | None = None, profile: str | None = None, keep_events: bool = False,
            layout_builder: LayoutBuilder | None = None, split_at_window: bool = True,
            virtual_stages: int | None = None, sequence_parallel: bool = True,
            progress: Progress | None = None, samples: SampleStream | None = None) -> Comparison:
    """Simulate every method on ``config`` over the first ``iterations`` iterations of ``lengths``.

    With ``split_at_window`` documents longer than the window are cut into window-size pieces
    before packing, for every method alike (a 64K-context job attends at most 64K tokens back).
    ``virtual_stages`` overrides the config's schedule (a method's own ``virtual_stages`` wins);
    ``sequence_parallel`` sets the PP send size (``CostModel.pp_send``). ``samples``: Megatron's
    GPTDataset samples as a piece stream (``megatron.sample_orders.sample_stream``): the methods with
    ``on_samples`` train them instead of cutting ``lengths`` (the user's real concat-and-cut job).
    """
    if not methods:
        raise ValueError("compare needs at least one method")
    cost = cost or build_cost_model(config.model, config.layout, profile)
    runs: dict[str, RunSummary] = {}
    for m in methods:
        v = m.virtual_stages if m.virtual_stages is not None else virtual_stages
        if (v or config.virtual_stages) > 1 and config.micro_batches % config.layout.pp:
            raise ValueError(f"{m.name}: interleaved 1F1B needs micro_batches ({config.micro_batches}) divisible "
                             f"by pp ({config.layout.pp})")
        cfg = config if v is None else config.with_virtual_stages(v)
        source = samples if m.on_samples is not None else None
        overrides = {**m.packing_overrides(config), **dict(m.on_samples or ())} if source is not None \
            else m.packing_overrides(config)
        runs[m.name] = simulate_stream(cfg, cost, m.packer, m.cp_sharding, lengths, iterations, source=source,
                                       packing_overrides=overrides, layout_builder=layout_builder,
                                       keep_events=keep_events, progress=progress,
                                       progress_desc=f"{config.name} {m.name}", order=m.order,
                                       sequence_parallel=sequence_parallel,
                                       split_at=config.seq_len if split_at_window else None)
    return Comparison(config, cost, runs, base=methods[0].name, iterations=iterations,
                      virtual_stages=config.virtual_stages if virtual_stages is None else virtual_stages,
                      sequence_parallel=sequence_parallel)


def geo_mean(values: Iterable[float]) -> float:
    """Geometric mean (the report's average of speedups); NaN for no values."""
    vals = [float(v) for v in values]
    return float(np.exp(np.mean(np.log(vals)))) if vals else float("nan")


def speedup_columns(comparisons: Sequence[Comparison]) -> list[tuple[str, str, str]]:
    """(column label, method, baseline) for every non-baseline method against every baseline run,
    then whole-document over concat-and-cut when both ran."""
    c0 = comparisons[0]
    bases = c0.baselines or [c0.base]
    methods = [m for m in c0.runs if m not in bases]
    cols = [(f"{m} / {BASELINE_LABELS.get(b, b)}", m, b) for m in methods for b in bases]
    if PLAIN.name in bases and WHOLE.name in bases:
        cols.append((f"{BASELINE_LABELS[WHOLE.name]} / {BASELINE_LABELS[PLAIN.name]}", WHOLE.name, PLAIN.name))
    return cols


def _window(config: RunConfig) -> str:
    return f"{config.seq_len // 1024}k"


AVERAGES = (("avg 64K", "64k"), ("avg 128K", "128k"), ("avg all", "avg"))


def average_speedup(comparisons: Sequence[Comparison], method: str, base: str | None = None,
                    window: str = "avg") -> float:
    """Geometric mean of ``method``'s speedup over ``base`` across the configs of ``window``
    ("64k", "128k" or "avg" for all)."""
    return geo_mean(c.speedup(method, base) for c in comparisons
                    if window == "avg" or _window(c.config) == window)


def table1(comparisons: Sequence[Comparison]) -> Table:
    """Fig. 12: speedup of every method over each baseline per config, with the paper's averages
    (the paper's one Plain-4D number is shown under both baselines)."""
    cols = speedup_columns(comparisons)
    rows = []
    for c in comparisons:
        lay = c.config.layout
        rows.append((c.config.name, f"({lay.tp},{lay.cp},{lay.pp},{lay.dp})", lay.world_size,
                     *[c.speedup(m, b) for _, m, b in cols]))
    for label, key in AVERAGES:
        rows.append((f"**{label}** (geo-mean)", "", "", *[average_speedup(comparisons, m, b, key) for _, m, b in cols]))
    for label, key in AVERAGES:
        rows.append((f"paper {label}", "", "", *[PAPER.get(("fig12", f"{m}:{key}")) if b in BASELINE_LABELS
                                                 and m not in BASELINE_LABELS else None for _, m, b in cols]))
    c0 = comparisons[0]
    notes = (f"Schedule: {schedule_label(c0.virtual_stages)}; PP sends "
             f"{'with' if c0.sequence_parallel else 'without'} sequence parallelism. Column `A / B`: "
             "throughput of A over B.",)
    return Table("Speedup per Table 1 config over both baselines (paper Fig. 12)",
                 ("config", "(TP,CP,PP,DP)", "GPUs", *[label for label, _, _ in cols]), tuple(rows), notes)


def schedule_label(virtual_stages: int) -> str:
    """How the report names a schedule."""
    return "plain 1F1B" if virtual_stages == 1 else f"interleaved 1F1B, v = {virtual_stages} virtual stages"


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
    """Fig. 13: each optimisation alone and together on one config, over each baseline."""
    bases = c.baselines or [c.base]
    rows = [(name, *[c.speedup(name, b) for b in bases], PAPER.get(("fig13", name)), 1e3 * run.mean_time,
             run.pp_imbalance) for name, run in c.runs.items()]
    notes = (f"Schedule: {schedule_label(c.virtual_stages)} unless the row says otherwise (with N = PP = 4 "
             "interleaving warms up every micro-batch first, which costs activation memory the simulator "
             "does not model).",)
    return Table(f"Breakdown on {c.config.name} (paper Fig. 13)",
                 ("method", *[f"speedup / {BASELINE_LABELS.get(b, b)}" for b in bases], "paper", "iter ms",
                  "PP imbalance"), tuple(rows), notes)


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
                 virtual_stages: int | None = PAPER_VIRTUAL_STAGES,
                 progress: Progress | None = None) -> tuple[Table, list[Comparison]]:
    """Fig. 14: WLB-LLM over both baselines for one model and layout as the window grows."""
    cfg = load_config(base)
    comps = [compare(with_window(cfg, w), lengths, iterations, (PLAIN, WHOLE, WLB), profile=profile,
                     virtual_stages=virtual_stages, progress=progress) for w in windows]
    rows = tuple((f"{w // 1024}K", c.speedup(WLB.name, PLAIN.name), c.speedup(WLB.name, WHOLE.name),
                  PAPER.get(("fig14", str(w))), 1e3 * c.runs[PLAIN.name].mean_time,
                  1e3 * c.runs[WHOLE.name].mean_time, 1e3 * c.runs[WLB.name].mean_time)
                 for w, c in zip(windows, comps))
    lay = cfg.layout
    return Table(f"WLB-LLM speedup vs context window, {cfg.model.name} on ({lay.tp},{lay.cp},{lay.pp},{lay.dp}) "
                 "(paper Fig. 14)", ("window", "speedup / concat-and-cut", "speedup / whole-document", "paper",
                                     "concat-and-cut iter ms", "whole-document iter ms", "WLB-LLM iter ms"),
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


def gpu_attention_ratios(run: RunSummary) -> np.ndarray:
    """Like ``gpu_latency_ratios`` for attention seconds alone."""
    out = [g.ravel() / g.mean() for g in (r.gpu_layer_attention for r in run.iterations) if g.mean() > 0]
    return np.concatenate(out) if out else np.zeros(0)


#: The two per-GPU spreads of the 8K-GPU case study, by the name the report gives them.
CASE_METRICS = ("attention + GEMM", "attention only")


def case_study_table(c: Comparison) -> Table:
    """The 8K-GPU case study: per-GPU latency over the iteration's mean, for both metrics (the
    paper's 1.44 does not say which work it counts), and the speedups over each baseline."""
    bases = c.baselines or [c.base]
    rows = []
    for name, run in c.runs.items():
        for metric in CASE_METRICS:
            if metric == CASE_METRICS[0]:
                ratios, per_iter = gpu_latency_ratios(run), [r.gpu_compute_imbalance for r in run.iterations]
            else:
                ratios, per_iter = gpu_attention_ratios(run), [r.gpu_attention_imbalance for r in run.iterations]
            rows.append((name, metric, float(np.mean(per_iter)), float(np.max(per_iter)),
                         float(np.percentile(ratios, 99)), float(np.percentile(ratios, 50)), float(ratios.min()),
                         PAPER.get(("case", "max/mean")) if name in BASELINE_LABELS else None,
                         *[c.speedup(name, b) for b in bases]))
    lay = c.config.layout
    return Table(f"{c.config.name}: per-GPU latency / mean, {lay.world_size} GPUs "
                 f"(TP,CP,PP,DP)=({lay.tp},{lay.cp},{lay.pp},{lay.dp})",
                 ("method", "per-GPU metric", "slowest GPU / mean (avg over iters)", "worst iter", "p99", "median",
                  "fastest", "paper slowest", *[f"speedup / {BASELINE_LABELS.get(b, b)}" for b in bases]), tuple(rows))


# -- schedule sweep and ablation ------------------------------------------------------------------
#: ``(virtual_stages, sequence_parallel) -> one Comparison per config``: the grid of model choices.
Grid = dict[tuple[int, bool], list[Comparison]]


def run_grid(configs: Sequence[RunConfig], lengths: np.ndarray, iterations: int, methods: Sequence[Method], *,
             virtual_stages: int, sequence_parallel: bool = True, profile: str | None = None,
             progress: Progress | None = None) -> list[Comparison]:
    """``compare`` on every config under one schedule and PP send size."""
    return [compare(cfg, lengths, iterations, methods, profile=profile, virtual_stages=virtual_stages,
                    sequence_parallel=sequence_parallel, progress=progress) for cfg in configs]


def schedule_sweep_table(grid: Grid, vs: Sequence[int] = VIRTUAL_STAGE_SWEEP) -> Table:
    """WLB-LLM over both baselines (geo-means over the configs) per number of virtual stages."""
    rows = []
    for v in vs:
        comps = grid[(v, True)]
        row: list = [schedule_label(v)]
        for b in (PLAIN.name, WHOLE.name):
            row += [average_speedup(comps, WLB.name, b, key) for _, key in AVERAGES]
        rows.append(tuple(row))
    rows.append(("paper (interleaved, v not given)", *[PAPER.get(("fig12", f"{WLB.name}:{k}")) for _, k in AVERAGES],
                 *[PAPER.get(("fig12", f"{WLB.name}:{k}")) for _, k in AVERAGES]))
    cols = ("schedule", *[f"/ {BASELINE_LABELS[b]}, {label}" for b in (PLAIN.name, WHOLE.name)
                          for label, _ in AVERAGES])
    return Table("WLB-LLM speedup by pipeline schedule (geo-mean over the Table 1 configs)", cols, tuple(rows))


@dataclass(frozen=True)
class AblationStep:
    """One modelling choice: ``label``, and the grid cell + baseline before and after it."""

    label: str
    before: tuple[int, bool, str]
    after: tuple[int, bool, str]


def ablation_steps(v: int = PAPER_VIRTUAL_STAGES) -> tuple[list[AblationStep], list[AblationStep]]:
    """(cumulative steps from the old model to the paper's setting, one-at-a-time toggles from it)."""
    cut, whole = PLAIN.name, WHOLE.name
    cumulative = [
        AblationStep("PP sends carry the sequence-parallel shard, s/(cp tp) instead of s/cp",
                     (1, False, cut), (1, True, cut)),
        AblationStep(f"interleaved 1F1B with v = {v} instead of plain 1F1B", (1, True, cut), (v, True, cut)),
        AblationStep("whole-document baseline instead of concat-and-cut", (v, True, cut), (v, True, whole)),
    ]
    alone = [
        AblationStep("sequence-parallel PP send size", (v, False, whole), (v, True, whole)),
        AblationStep(f"interleaved 1F1B (v = {v})", (1, True, whole), (v, True, whole)),
        AblationStep("whole-document baseline", (v, True, cut), (v, True, whole)),
    ]
    return cumulative, alone


def _ratio(paper: float | None, ours: float) -> float | None:
    """paper / ours, or None where the paper gives no number."""
    return paper / ours if paper else None


def ablation_tables(grid: Grid, v: int = PAPER_VIRTUAL_STAGES) -> tuple[Table, Table]:
    """How each modelling choice moves WLB-LLM's average speedup: cumulatively from the previous
    model (plain 1F1B, s/cp sends, concat-and-cut) to the paper's setting, and one at a time."""
    def avg(cell: tuple[int, bool, str], key: str = "avg") -> float:
        vs, sp, base = cell
        return average_speedup(grid[(vs, sp)], WLB.name, base, key)

    paper = {k: PAPER.get(("fig12", f"{WLB.name}:{k}")) for _, k in AVERAGES}
    cumulative, alone = ablation_steps(v)
    first = cumulative[0].before
    rows = [("previous model: plain 1F1B, s/cp sends, concat-and-cut", *[avg(first, k) for _, k in AVERAGES], None)]
    for step in cumulative:
        rows.append((f"+ {step.label}", *[avg(step.after, k) for _, k in AVERAGES],
                     avg(step.after) / avg(step.before)))
    last = cumulative[-1].after
    rows.append(("paper", *[paper[k] for _, k in AVERAGES], None))
    rows.append(("remaining gap (paper / ours)", *[_ratio(paper[k], avg(last, k)) for _, k in AVERAGES], None))
    cum = Table("Ablation, cumulative: WLB-LLM speedup (geo-mean over the Table 1 configs) as each modelling "
                "choice is made the paper's way", ("model", *[label for label, _ in AVERAGES], "factor"),
                tuple(rows))
    rows = [(step.label, avg(step.before), avg(step.after), avg(step.after) / avg(step.before)) for step in alone]
    one = Table("Ablation, one at a time: WLB-LLM speedup (avg all) with and without each choice, the others "
                "as in the paper's setting", ("choice", "without it", "with it", "factor"), tuple(rows))
    return cum, one
