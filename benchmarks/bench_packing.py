#!/usr/bin/env python
"""Packing benchmarks, one command: ``python benchmarks/bench_packing.py [--iterations K] [--table]``.

The *frontier* (default): for every packer and setting, imbalance and the slowest DP rank's
pipeline-schedule time (1F1B from the simulator, over the schedule with every micro-batch at the
iteration's mean: 1.000 = perfectly balanced) against the mean token delay, on the embedded
WLB-LLM stand-in stream and on real corpora built from files on this machine
(``benchmarks/build_corpora.py``: Python stdlib and site-packages source, C/C++ headers,
documentation, prose), at DP = 1 and DP = 4, with configs/7b_128k.yaml (N = 4, seq_len 128K,
S_max 192K). Writes benchmarks/results/packing_frontier.{md,json} and benchmarks/img/packing_frontier.png.

``--table`` also regenerates the paper's Table 2 comparison (``wlb bench``:
benchmarks/results/packing_bench.{md,json}).

``--solver-cases`` only times the fixed-solver's HiGHS model on windows of many equal pieces (the
issue-22 case: 224 one-token documents into 70 bins) and, for comparison, of distinct lengths (one
piece per group: the per-piece model) at several node limits:
benchmarks/results/packing_solver_cases.{md,json}.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import sys
import time
from pathlib import Path

import numpy as np

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "benchmarks"))

from _results import RESULTS_PAGE, replace_readme_table, write_result  # noqa: E402

from megatron_wlb.cli.common import resolve_lengths, run_packer  # noqa: E402
from megatron_wlb.cli.main import main as wlb_main  # noqa: E402
from megatron_wlb.config import load_config  # noqa: E402
from megatron_wlb.costmodel import build_cost_model  # noqa: E402
from megatron_wlb.packing import make_packer, summarize  # noqa: E402
from megatron_wlb.packing.presets import preset_values  # noqa: E402
from megatron_wlb.provenance import machine  # noqa: E402

CORPORA_DIR = ROOT / "tests" / "data" / "corpora"
STREAMS = ("wlbllm", "stdlib", "pypkgs", "headers", "docs", "prose", "books", "logs", "data")
TABLE_ARGS = ["bench", "--config", "7b_128k", "--iterations", "200", "--solver-iterations", "50",
              "--lengths", "wlbllm,stdlib", "--scale-config", "405b_128k_8k", "--scale-iterations", "200",
              "--out", str(ROOT / "benchmarks" / "results"), "--label", "python benchmarks/bench_packing.py --table"]


def settings(quick: bool) -> list[tuple[str, str, dict]]:
    """(label, packer, PackingConfig overrides) of the frontier."""
    rows: list[tuple[str, str, dict]] = [("original (concat-and-cut)", "original", {})]
    for k in ((1, 4) if quick else (1, 2, 4, 8)):
        rows.append((f"fixed-greedy, window {k}", "fixed-greedy", {"window": k}))
    for k in ((1,) if quick else (1, 4)):
        rows.append((f"fixed-solver, window {k}", "fixed-solver", {"window": k}))
    for d in ((2, 8) if quick else (1, 2, 4, 8, 16)):
        rows.append((f"wlb, max_delay {d}", "wlb", {"max_delay": d}))
    # (the labels key the recorded results, packing_frontier.json, which were run with the old spellings
    # of the same plans: min_fill 0 = fill "read-ahead", fill_target 0 = fill "waiting" at 0.5,
    # group_by_work false = release "oldest", release_when_balanced false = release "grouped";
    # the "release N per rank" row's policy was removed)
    rows.append(("wlb, max_delay 8, placement order (no dealing/ordering)", "wlb", {"schedule_order": False}))
    rows.append(("wlb, max_delay 8, no fill rule (min_fill 0)", "wlb", {"fill": "read-ahead"}))
    rows.append(("wlb, max_delay 8, oldest-R release (no grouping by work)", "wlb", {"release": "oldest"}))
    rows.append(("wlb, max_delay 8, cut policy 'overlong'", "wlb", {"cut": "overlong"}))
    rows.append(("wlb, max_delay 8, cut policy 'any'", "wlb", {"cut": "any"}))
    rows.append(("wlb, max_delay 8, no read-ahead fill (fill_target 0)", "wlb",
                 {"fill": "waiting", "fill_target": 0.5}))
    rows.append(("wlb, max_delay 8, group release only (release_when_balanced off)", "wlb",
                 {"release": "grouped"}))
    rows.append(("wlb, preset paper (Algorithm 1)", "wlb", preset_values("paper")))
    rows.append((CUT_FIXED, "fixed-greedy", {"window": 4, "pieces": "concat-and-cut"}))
    rows.append((CUT_WLB, "wlb", {"pieces": "concat-and-cut"}))
    return rows


#: the rows that train exactly concat-and-cut's pieces (``pieces="concat-and-cut"``: equal work)
CUT_WLB = "balanced concat-and-cut (wlb, concat-and-cut pieces)"
CUT_FIXED = "fixed-greedy, window 4, concat-and-cut pieces"


def stream_lengths(name: str, min_tokens: int) -> tuple[np.ndarray, int]:
    if name in ("wlbllm",):
        source = name
    else:
        path = CORPORA_DIR / f"{name}.npy"
        if not path.exists():
            raise FileNotFoundError(f"{path} is missing: run python benchmarks/build_corpora.py first")
        source = str(path)
    base = resolve_lengths(source).size
    return resolve_lengths(source, min_tokens=min_tokens), base


def frontier(streams: list[str], dps: list[int], iterations: int, quick: bool) -> dict:
    run = load_config("7b_128k")
    tables = []
    for dp in dps:
        packing0 = dataclasses.replace(run.packing, dp=dp)
        layout = dataclasses.replace(run.layout, dp=dp)
        cost = build_cost_model(run.model, layout)
        for stream in streams:
            lengths, docs = stream_lengths(stream, (iterations + 16) * packing0.tokens_per_iteration)
            rows = []
            for label, name, over in settings(quick):
                packing = dataclasses.replace(packing0, **over)
                packer = make_packer(name, packing, cost)
                t0 = time.perf_counter()
                batches = run_packer(packer, lengths, iterations)
                m = summarize(batches, cost, packing.seq_len)
                diagnostics = packer.diagnostics()
                rows.append({"label": label, "packer": name, "overrides": over, "wall_s": time.perf_counter() - t0,
                             "forced_splits": diagnostics.get("forced_splits", 0),
                             "cut_stats": diagnostics.get("cut_stats", {}), **m.to_dict()})
                print(f"dp {dp} {stream:8s} {label:55s} sched {m.schedule_ratio:.3f} imb {m.imbalance:.3f} "
                      f"delay {m.mean_delay:.2f} fill p5 {m.fill_p5:.2f} min {m.min_fill:.2f} "
                      f"plan {m.plan_cpu_ms_mean:.2f} ms", file=sys.stderr, flush=True)
            tables.append({"stream": stream, "dp": dp, "n": packing0.n, "seq_len": packing0.seq_len,
                           "max_seq_len": packing0.capacity_var, "documents": docs,
                           "repeats": int(np.ceil(lengths.size / docs)), "cost_model": cost.describe(),
                           "rows": rows})
    return {"machine": machine(), "command": "python benchmarks/bench_packing.py", "iterations": iterations,
            "tables": tables, "scale": scale(iterations)}


def scale(iterations: int) -> dict:
    """Plan time of the default wlb at the 8K-GPU layout (64 micro-batches per iteration)."""
    run = load_config("405b_128k_8k")
    cost = build_cost_model(run.model, run.layout)
    lengths, _ = stream_lengths("wlbllm", (iterations + 16) * run.packing.tokens_per_iteration)
    packer = make_packer("wlb", run.packing, cost)
    batches = run_packer(packer, lengths, iterations)
    m = summarize(batches, cost, run.packing.seq_len)
    return {"config": run.name, "layout": str(run.layout), "micro_batches": run.packing.micro_batches_per_iteration,
            **m.to_dict()}


SUMMARY_COLUMNS = (("original", "original (concat-and-cut)"), ("fixed-greedy, window 4", "fixed-greedy, window 4"),
                   ("**wlb (default)**", "wlb, max_delay 8"), ("wlb, cut `any`", "wlb, max_delay 8, cut policy 'any'"),
                   ("wlb, no read-ahead", "wlb, max_delay 8, no read-ahead fill (fill_target 0)"),
                   ("wlb, group release only", "wlb, max_delay 8, group release only (release_when_balanced off)"),
                   ("fixed-greedy w4, c&c pieces", CUT_FIXED), ("**balanced c&c**", CUT_WLB))


def _delay_fill(r: dict | None) -> str:
    return "" if r is None else f"{r['mean_delay']:.2f} / {r['fill_p5']:.2f}"


def _ratio(x: float | None) -> str:
    return "" if x is None else f"{x:.3f}"


def summary_table(result: dict) -> str:
    """The README table: slowest-rank 1F1B time / balanced per stream and DP; mean delay and the 5th
    percentile of tokens per iteration / budget of the default wlb and the balanced concat-and-cut."""
    columns = [c for c, _ in SUMMARY_COLUMNS]
    columns.insert(columns.index("**wlb (default)**") + 1, "its whole-document floor")
    head = "| stream | DP | " + " | ".join(columns) + " | wlb delay / fill p5 | balanced c&c delay / fill p5 |"
    lines = [head, "|---|---|" + "---|" * len(columns) + "---|---|"]
    for t in sorted(result["tables"], key=lambda t: (t["dp"], STREAMS.index(t["stream"]) if t["stream"] in STREAMS
                                                      else 99)):
        by = {r["label"]: r for r in t["rows"]}
        cells = []
        for col, label in SUMMARY_COLUMNS:
            r = by.get(label)
            v = "" if r is None else f"{r['schedule_ratio']:.3f}"
            cells.append(f"**{v}**" if col.startswith("**") and v else v)
        default = by.get("wlb, max_delay 8")
        cells.insert([c for c, _ in SUMMARY_COLUMNS].index("**wlb (default)**") + 1,
                     "" if default is None else _ratio(default.get("schedule_floor")))
        tail = f"{_delay_fill(default)} | {_delay_fill(by.get(CUT_WLB))}"
        lines.append(f"| {t['stream']} | {t['dp']} | " + " | ".join(cells) + f" | {tail} |")
    return "\n".join(lines) + "\n"


README_MARK = "<!-- packing-table -->"


def update_readme(result: dict, path: Path) -> None:
    """Replace the summary table right after the results page's ``<!-- packing-table -->`` marker with this run's."""
    replace_readme_table(path, README_MARK, summary_table(result))


PAPER_MARK = "<!-- packing-paper-table -->"
#: the paper's Table 2 (7B, 128K): imbalance and planning overhead per method (``../shared/notes/paper.md``)
PAPER_TABLE2 = {"original": ("1.44", "0"), "greedy": ("1.41 / 1.22 / 1.11 / 1.08", "4–5 ms"),
                "solver": ("1.40 / 1.18 / 1.09", "467 / 1488 / 25313 ms"),
                "wlb": ("1.24 / 1.05 / 1.05 (1/2/3 queues)", "8 / 20 / 23 ms")}


def paper_table(bench: dict) -> str:
    """Our Table 2 beside the paper's, from ``wlb bench``'s recorded run (``packing_bench.json``): the first
    table (7B, 128K, embedded stream, DP 1) and the scale table (the 8K-GPU layout, the last one)."""
    first, scale = bench["tables"][0], bench["tables"][-1]
    rows = {r["label"]: r for r in first["rows"]}
    big = {r["label"]: r for r in scale["rows"]}

    def pick(labels: list[str], key: str, fmt: str) -> str:
        return " / ".join(format(rows[label][key], fmt) for label in labels)

    def plan_range(labels: list[str]) -> str:
        values = [rows[label]["plan_cpu_ms_mean"] for label in labels]
        return f"{min(values):.1f}–{max(values):.1f} ms"

    greedy = [f"Fixed-Len Greedy, window {w}" for w in (1, 2, 4, 8)]
    solver = [f"Fixed-Len Solver, window {w}" for w in (1, 2, 4)]
    hand = [label for label in rows if label.startswith("WLB, hand-picked")]
    default = rows["WLB, auto thresholds, num_queues 2"]
    original, wlb = big["Original"], big["WLB, auto thresholds (default)"]
    paper = big["WLB, preset paper (Algorithm 1)"]
    lines = ["| method | imbalance, ours | paper | plan time, ours | paper | mean delay (iterations / token) |",
             "|---|---|---|---|---|---|",
             f"| Original (concat-and-cut) | {rows['Original']['imbalance']:.3f} | {PAPER_TABLE2['original'][0]} | "
             f"{rows['Original']['plan_cpu_ms_mean']:.2f} ms | {PAPER_TABLE2['original'][1]} | "
             f"{rows['Original']['mean_delay']:.2f} |",
             f"| Fixed-Len Greedy, 1/2/4/8 global batches | {pick(greedy, 'imbalance', '.3f')} | "
             f"{PAPER_TABLE2['greedy'][0]} | {plan_range(greedy)} | {PAPER_TABLE2['greedy'][1]} | "
             f"{pick(greedy, 'mean_delay', '.2f')} |",
             f"| Fixed-Len Solver (HiGHS), 1/2/4 | {pick(solver, 'imbalance', '.3f')} | {PAPER_TABLE2['solver'][0]} | "
             f"{pick(solver, 'plan_cpu_ms_mean', '.1f')} ms | {PAPER_TABLE2['solver'][1]} | "
             f"{pick(solver, 'mean_delay', '.2f')} |",
             f"| **WLB (auto thresholds, default)** | **{default['imbalance']:.3f}** | {PAPER_TABLE2['wlb'][0]} | "
             f"{default['plan_cpu_ms_mean']:.1f} ms (max {default['plan_cpu_ms_max']:.1f}) | "
             f"{PAPER_TABLE2['wlb'][1]} | {default['mean_delay']:.2f} |",
             f"| WLB, hand-picked 1/2/3 queues | {pick(hand, 'imbalance', '.3f')} | | {plan_range(hand)} | | "
             f"{pick(hand, 'mean_delay', '.2f')} |",
             f"| WLB at the 8K-GPU layout ({scale['dp'] * scale['n']} micro-batches) | {wlb['imbalance']:.3f} (global "
             f"{wlb['imbalance_global']:.3f}; original {original['imbalance']:.3f} / "
             f"{original['imbalance_global']:.3f}) | | "
             f"{wlb['plan_cpu_ms_mean']:.1f} ms (max {wlb['plan_cpu_ms_max']:.1f}) | | {wlb['mean_delay']:.2f} |",
             f"| WLB preset `paper` at the 8K-GPU layout | {paper['imbalance']:.3f} (global "
             f"{paper['imbalance_global']:.3f}) | | {paper['plan_cpu_ms_mean']:.1f} ms (max "
             f"{paper['plan_cpu_ms_max']:.1f}) | | {paper['mean_delay']:.2f} |"]
    return "\n".join(lines) + "\n"


def to_markdown(result: dict) -> str:
    lines = ["# Packing frontier: schedule time and imbalance vs delay", "",
             f"Machine: {result['machine']}. Generated by `{result['command']}` "
             f"({result['iterations']} global batches per row; 7B cost model, configs/7b_128k.yaml).", "",
             "schedule = sum over iterations of the slowest DP rank's 1F1B time (simulator, PP = N = 4) / the same "
             "with every micro-batch at the iteration's mean (1.000 = balanced); imbalance = paper Table 2 "
             "(per DP rank); global = max / mean over all DP x N micro-batches; delay = mean iterations per "
             "token; fill = an iteration's tokens / (DP x N x seq_len) (min and percentiles over the "
             "iterations); pairs / token = causal attention (query, key) pairs per token of the plan's pieces "
             "(the attention work; equal for every row that trains concat-and-cut's pieces); whole-piece floor = the "
             "schedule of the best balance the row's own pieces allow while each stays whole (water-filling: a piece "
             "heavier than the level alone, the rest shared evenly; `metrics.whole_piece_floor_time`): a row at its "
             "floor loses nothing to packing, only to pieces no micro-batch can match; plan = ms per "
             "global batch (CPU time).", "", "Summary (schedule = slowest rank's 1F1B time / balanced; "
             "max_delay 8; c&c = concat-and-cut's own pieces, `pieces: concat-and-cut`):", "",
             summary_table(result), "![frontier](../img/packing_frontier.png)", ""]
    for t in result["tables"]:
        lines += [f"## {t['stream']}, DP = {t['dp']} (N = {t['n']}, seq_len {t['seq_len']}, S_max "
                  f"{t['max_seq_len']})", "",
                  f"{t['documents']} documents" + (f", stream repeated up to {t['repeats']}x (seeded shuffles)"
                                                   if t["repeats"] > 1 else "") + ".", "",
                  "| method | schedule | whole-piece floor | worst iter | imbalance | global | mean delay | "
                  "max delay | fill min / p5 / p50 / p95 | pairs / token | plan ms |", "|---" * 11 + "|"]
        for r in t["rows"]:
            lines.append(f"| {r['label']} | {r['schedule_ratio']:.3f} | {_ratio(r.get('schedule_floor'))} | "
                         f"{r['schedule_ratio_max']:.2f} | "
                         f"{r['imbalance']:.3f} | {r['imbalance_global']:.3f} | {r['mean_delay']:.2f} | "
                         f"{r['max_delay']} | {r['min_fill']:.2f} / {r['fill_p5']:.2f} / {r['fill_p50']:.2f} / "
                         f"{r['fill_p95']:.2f} | {r['pairs_per_token']:,.0f} | {r['plan_cpu_ms_mean']:.2f} |")
        lines.append("")
        cuts = [f"- {r['label']}: {r['cut_stats']['cut_points']} cut points, {r['cut_stats']['tokens']} tokens "
                f"affected, mean piece {r['cut_stats']['tokens'] / r['cut_stats']['pieces']:.0f} tokens"
                for r in t["rows"] if r.get("cut_stats", {}).get("pieces")]
        lines += cuts + ([""] if cuts else [])
    sc = result.get("scale")
    if sc:
        lines += [f"## Scale: wlb (default) at {sc['config']} ({sc['layout']}, {sc['micro_batches']} micro-batches "
                  "per iteration, embedded stream)", "",
                  f"plan time {sc['plan_cpu_ms_mean']:.2f} ms CPU per global batch (max {sc['plan_cpu_ms_max']:.1f}); "
                  f"schedule {sc['schedule_ratio']:.3f} (PP = N = 16 here: the objective uses n stages), "
                  f"imbalance {sc['imbalance']:.3f}, global {sc['imbalance_global']:.3f}, mean delay "
                  f"{sc['mean_delay']:.2f}.", ""]
    return "\n".join(lines)


def _on_frontier(label: str) -> bool:
    """The plotted settings: each packer's delay knob (windows, max_delay), not the ablations."""
    return label.startswith(("original", "fixed-greedy, window", "fixed-solver, window")) or \
        (label.startswith("wlb, max_delay") and label.count(",") == 1)


def plot(result: dict, path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    dps = sorted({t["dp"] for t in result["tables"]})
    fig, axes = plt.subplots(1, len(dps), figsize=(6 * len(dps), 4.5), squeeze=False)
    colors = {name: plt.get_cmap("tab10")(i) for i, name in enumerate(STREAMS)}
    styles = {"original": ("s", ":"), "fixed-greedy": ("^", "--"), "fixed-solver": ("v", "-."), "wlb": ("o", "-")}
    for ax, dp in zip(axes[0], dps):
        for t in (t for t in result["tables"] if t["dp"] == dp):
            for fam, (marker, line) in styles.items():
                rows = sorted((r for r in t["rows"] if r["packer"] == fam and _on_frontier(r["label"])),
                              key=lambda r: r["mean_delay"])
                if rows:
                    ax.plot([r["mean_delay"] for r in rows], [r["schedule_ratio"] for r in rows], marker=marker,
                            linestyle=line, color=colors.get(t["stream"], "k"), alpha=0.85,
                            label=f"{t['stream']} {fam}" if dp == dps[-1] else None)
            cut = next((r for r in t["rows"] if r["label"] == CUT_WLB), None)
            if cut is not None:
                ax.plot([cut["mean_delay"]], [cut["schedule_ratio"]], marker="*", markersize=11, linestyle="none",
                        color=colors.get(t["stream"], "k"),
                        label=f"{t['stream']} balanced c&c" if dp == dps[-1] else None)
        ax.set_title(f"DP = {dp}: slowest rank's 1F1B time / balanced")
        ax.set_xlabel("mean delay (iterations per token)")
        ax.set_ylabel("schedule time / balanced")
        ax.set_xscale("symlog", linthresh=0.05)
        ax.grid(alpha=0.3)
    axes[0][-1].legend(fontsize=6, ncol=2)
    fig.tight_layout()
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=110)


#: (label, piece lengths, bins, capacity) of the solver cases: windows of many equal pieces
SOLVER_CASES = (("224 one-token documents, 70 bins", [1] * 224, 70, 4),
                ("2,000 documents of 3 lengths (100/200/300), 70 bins", [300] * 500 + [200] * 700 + [100] * 800,
                 70, 6_000),
                ("224 distinct lengths 224..1, 70 bins (the per-piece model)", list(range(224, 0, -1)), 70, 400))
SOLVER_NODES = (0, 1, 5, 50)


def solver_cases() -> dict:
    """CPU time, model size and HiGHS work of ``solve_assignment`` on the SOLVER_CASES (weights d^2,
    warm-started by greedy with its bins relabelled by first use, as the packer does)."""
    from megatron_wlb.packing import place_greedy, solve_assignment

    rows = []
    for label, lengths, bins, cap in SOLVER_CASES:
        d = np.asarray(lengths, dtype=np.int64)
        w = d.astype(np.float64) ** 2
        greedy = place_greedy(d.tolist(), w.tolist(), [0.0] * bins, [0] * bins, cap)
        relabel: dict[int, int] = {}
        start = np.array([relabel.setdefault(j, len(relabel)) for j in greedy], dtype=np.int64)
        greedy_max = float(np.bincount(start, weights=w, minlength=bins).max())
        for nodes in SOLVER_NODES:
            stats: dict[str, int] = {}
            t0 = time.process_time()
            choice, status, _ = solve_assignment(d, w, bins, cap, start=start, node_limit=nodes, stats=stats)
            cpu = time.process_time() - t0
            best = greedy_max if choice is None else float(np.bincount(choice, weights=w, minlength=bins).max())
            rows.append({"case": label, "pieces": int(d.size), "bins": bins, "solver_nodes": nodes, "status": status,
                         "cpu_s": cpu, "max_over_greedy": best / greedy_max, **stats})
            print(f"{label:50s} nodes {nodes:3d} {status:24s} {cpu:7.3f} s {stats}", file=sys.stderr, flush=True)
    return {"machine": machine(), "command": "python benchmarks/bench_packing.py --solver-cases", "rows": rows}


def solver_cases_markdown(result: dict) -> str:
    lines = ["# fixed-solver: windows of many equal pieces", "",
             f"Machine: {result['machine']}. Generated by `{result['command']}`. Weights d^2, warm start = "
             "greedy; pieces of equal length are one group (an integer count per bin); CPU s = one "
             "`solve_assignment` call (model build, HiGHS, decode).", "",
             "| case | solver_nodes | groups | columns | HiGHS nodes | simplex iterations | status | "
             "max / greedy's | CPU s |", "|---|---|---|---|---|---|---|---|---|"]
    for r in result["rows"]:
        lines.append(f"| {r['case']} | {r['solver_nodes']} | {r['groups']} | {r['columns']:,} | {r['nodes']} | "
                     f"{r['simplex_iterations']:,} | {r['status']} | {r['max_over_greedy']:.4f} | {r['cpu_s']:.3f} |")
    return "\n".join(lines) + "\n"


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--iterations", type=int, default=200)
    ap.add_argument("--streams", default=",".join(STREAMS))
    ap.add_argument("--dp", default="1,4")
    ap.add_argument("--quick", action="store_true", help="fewer settings (smoke test)")
    ap.add_argument("--out", default=str(ROOT / "benchmarks" / "results" / "packing_frontier"))
    ap.add_argument("--plot", default=str(ROOT / "benchmarks" / "img" / "packing_frontier.png"))
    ap.add_argument("--table", action="store_true", help="also regenerate the Table 2 benchmark (wlb bench)")
    ap.add_argument("--render", default=None, help="only re-render the Markdown and plot from this JSON")
    ap.add_argument("--page", action="store_true",
                    help="also write the summary table into benchmarks/results.md (after <!-- packing-table -->; with "
                         "--table also the paper comparison, after <!-- packing-paper-table -->)")
    ap.add_argument("--solver-cases", action="store_true",
                    help="only time the fixed-solver on windows of many equal pieces "
                         "(benchmarks/results/packing_solver_cases)")
    args = ap.parse_args(argv)
    if args.solver_cases:
        write_result(ROOT / "benchmarks" / "results" / "packing_solver_cases", solver_cases(), solver_cases_markdown)
        return 0
    if args.render:
        result = json.loads(Path(args.render).read_text())
    else:
        result = frontier([s for s in args.streams.split(",") if s], [int(d) for d in args.dp.split(",")],
                          args.iterations, args.quick)
    write_result(args.out, result, to_markdown)
    if args.page:
        update_readme(result, RESULTS_PAGE)
    if args.plot:
        plot(result, Path(args.plot))
    if args.table:
        status = wlb_main(TABLE_ARGS)
        if args.page and status == 0:
            bench = json.loads((ROOT / "benchmarks" / "results" / "packing_bench.json").read_text())
            replace_readme_table(RESULTS_PAGE, PAPER_MARK, paper_table(bench))
        return status
    return 0


if __name__ == "__main__":
    sys.exit(main())
