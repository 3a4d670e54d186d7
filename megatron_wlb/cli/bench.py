"""``wlb bench``: the packing benchmark table (the paper's Table 2 and our extensions).

    wlb bench [--config 7b_128k] [--iterations 200] [--lengths wlbllm,stdlib] [--scale-config 405b_128k_8k]
              [--out DIR]

For every length stream it runs original, fixed-greedy (windows 1/2/4/8), fixed-solver (windows
1/2/4, iterations capped by ``--solver-iterations``), wlb with hand-picked thresholds (1/2/3
queues), wlb with auto thresholds (1/2/3 queues), wlb at S_max = 1, 1.25, 1.5 x seq_len and
with max_delay 4; then wlb and the baselines at ``--scale-config`` (the 8K-GPU layout). Writes
``DIR/packing_bench.md`` and ``.json`` (machine named). Streams shorter than the iterations need
are repeated, each extra pass in a seeded random order (said in the table).

``--data-prefix`` / ``--data-path`` corpora are read as wlb's training reader reads them (checked,
memory-mapped, streamed through a moving window; see ``wlb pack --help``): a corpus that holds the
iterations' tokens is never materialised.

``stdlib`` is a second, real distribution: the token lengths (bytes / 4) of the ``.py`` files of
the running interpreter's standard library, collected at benchmark time.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import sys
import time
from typing import Any

from megatron_wlb.cli.common import (
    DATA_PREFIX_SCHEME,
    METRIC_LEGEND,
    LengthStream,
    add_cache_arg,
    cost_profile,
    data_path_stream,
    open_stream,
    output_dir,
    positive,
    run_packer,
)
from megatron_wlb.config import load_config
from megatron_wlb.costmodel import build_cost_model
from megatron_wlb.packing import make_packer, summarize
from megatron_wlb.packing.presets import preset_values
from megatron_wlb.provenance import machine
from megatron_wlb.sim.experiments import schedule_label


def add_parser(subparsers: argparse._SubParsersAction) -> None:
    p = subparsers.add_parser("bench", help="benchmark the packers (imbalance, delay, packing time)",
                              description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter,
                              epilog=columns_legend().replace("%", "%%"))
    p.add_argument("--config", default="7b_128k", help="config for the main table (default 7b_128k)")
    p.add_argument("--iterations", type=int, default=200, help="global batches per row (default 200)")
    p.add_argument("--lengths", default="wlbllm", help="comma-separated streams: wlbllm, stdlib or files")
    p.add_argument("--data-prefix", metavar="PREFIX", action="append", default=[],
                   help="also benchmark this Megatron indexed dataset PREFIX.idx/.bin (file order); repeatable")
    p.add_argument("--data-path", nargs="+", metavar="W_OR_PREFIX", action="append", default=[],
                   help="also benchmark this Megatron --data-path blend ('W1 PREFIX1 W2 PREFIX2 ...'); repeatable")
    p.add_argument("--cost-profile", default=None, help="calibrated cost-model profile JSON (default: analytic)")
    add_cache_arg(p)
    p.add_argument("--out", default=None, help="directory for packing_bench.md / .json (default: print only)")
    lab = p.add_argument_group("lab: what the benchmark covers and records")
    lab.add_argument("--solver-iterations", type=int, default=50, help="cap for the fixed-solver rows (default 50)")
    lab.add_argument("--scale-config", default=None, help="also time wlb on this layout (e.g. 405b_128k_8k)")
    lab.add_argument("--scale-iterations", type=int, default=100, help="global batches at --scale-config")
    lab.add_argument("--quick", action="store_true", help="fewer rows (for smoke tests)")
    lab.add_argument("--label", default=None, help="command line to record in the output (default: wlb bench ...)")
    p.set_defaults(func=run)


#: a benchmark row: (label, packer name, PackingConfig overrides)
BenchRow = tuple[str, str, dict[str, Any]]


def rows_for(seq_len: int, quick: bool) -> list[BenchRow]:
    """(label, packer, packing overrides) of the main table."""
    rows: list[BenchRow] = [("Original", "original", {})]
    for k in ((1, 4) if quick else (1, 2, 4, 8)):
        rows.append((f"Fixed-Len Greedy, window {k}", "fixed-greedy", {"window": k}))
    for k in ((1,) if quick else (1, 2, 4)):
        rows.append((f"Fixed-Len Solver, window {k}", "fixed-solver", {"window": k}))
        rows.append((f"Fixed-Len Greedy, window {k} (same iterations as the solver row)", "fixed-greedy@solver",
                     {"window": k}))
    hand = {1: (seq_len // 2,), 2: (3 * seq_len // 8, 3 * seq_len // 4),
            3: (seq_len // 4, seq_len // 2, 3 * seq_len // 4)}
    for q in ((1,) if quick else (1, 2, 3)):
        rows.append((f"WLB, hand-picked {q} queue(s) {list(hand[q])}", "wlb",
                     {"queue_thresholds": hand[q], "num_queues": q}))
    for q in ((2,) if quick else (1, 2, 3)):
        rows.append((f"WLB, auto thresholds, num_queues {q}", "wlb", {"num_queues": q}))
    if not quick:
        for f in (1.0, 1.25):
            rows.append((f"WLB, auto, S_max = {f} x seq_len", "wlb", {"max_seq_len": int(seq_len * f)}))
        rows.append(("WLB, auto, max_delay 4", "wlb", {"max_delay": 4}))
    return rows


def bench_one(config_name: str, stream: str, rows: list[BenchRow], iterations: int, solver_iterations: int,
              profile: str | None, base: LengthStream | None = None) -> dict[str, Any]:
    """One table: every row on ``stream`` (``base`` when the caller has opened it; each row reads its own
    pass, lazily for a corpus that holds the iterations' tokens)."""
    config = load_config(config_name)
    cost = build_cost_model(config.model, config.layout, profile=profile)
    need = (iterations + 8) * config.packing.tokens_per_iteration
    base = open_stream(stream) if base is None else base
    repeats = max(1, -(-need // max(1, base.tokens)))  # passes of the stream the rows read (ceil)
    rows_out: list[dict[str, Any]] = []
    out = {"config": config.name, "layout": str(config.layout), "n": config.packing.n, "dp": config.packing.dp,
           "seq_len": config.seq_len, "stream": stream, "documents": base.documents,
           "stream_repeats": int(repeats), "cost_model": cost.describe(),
           "schedule": schedule_label(config.packing.virtual_stages), "rows": rows_out}
    for label, packer_name, over in rows:
        packing = dataclasses.replace(config.packing, **over)
        capped = packer_name.endswith("@solver") or packer_name == "fixed-solver"
        packer_name = packer_name.removesuffix("@solver")
        packer = make_packer(packer_name, packing, cost)
        its = min(iterations, solver_iterations) if capped else iterations
        t0 = time.perf_counter()
        batches = run_packer(packer, base.source(min_tokens=need), its, progress=f"{stream} {label}")
        wall = time.perf_counter() - t0
        m = summarize(batches, cost, packing.seq_len, stages=packing.stages, virtual_stages=packing.virtual_stages)
        row = {"label": label, "packer": packer_name, "overrides": {k: list(v) if isinstance(v, tuple) else v
                                                                      for k, v in over.items()},
               "capacity": packer.capacity, "wall_s": wall, **m.to_dict(), **packer.diagnostics()}
        rows_out.append(row)
    return out


#: (column of the table, metric key of ``METRIC_LEGEND``), after the method and iteration columns
COLUMNS = (("imbalance (fwd+bwd)", "imbalance"), ("imbalance (fwd)", "imbalance_fwd"), ("worst iter", "imbalance_max"),
           ("global DPxN", "imbalance_global"), ("slowest rank / balanced", "schedule_ratio"), ("min fill", "min_fill"),
           ("mean delay", "mean_delay"), ("max delay", "max_delay"), ("unused cap.", "unused_capacity"),
           ("stream rate", "fill_vs_seq_len"), ("ms / batch (mean)", "plan_ms_mean"), ("ms (max)", "plan_ms_max"),
           ("CPU ms (mean)", "plan_cpu_ms_mean"), ("CPU ms (max)", "plan_cpu_ms_max"))
#: digits each column is printed with (integers as they are)
DIGITS = {"imbalance_max": 2, "min_fill": 2, "plan_ms_mean": 2, "plan_ms_max": 1, "plan_cpu_ms_mean": 2,
          "plan_cpu_ms_max": 1}


def columns_legend() -> str:
    """What every column means, with its unit (from ``METRIC_LEGEND``, the one legend of the metrics)."""
    parts = []
    for column, key in COLUMNS:
        unit, meaning = METRIC_LEGEND[key]
        parts.append(f"{column} [{unit}] = {meaning}")
    return ("Columns (budget = DP x N x seq_len tokens per iteration): " + "; ".join(parts) + ". Fixed-solver rows "
            "are capped at the solver iteration count shown.")


def to_markdown(result: dict[str, Any]) -> str:
    lines = ["# Packing benchmark", "", f"Machine: {result['machine']}. Generated by `{result['command']}`.", ""]
    for table in result["tables"]:
        schedule = table.get("schedule", "plain 1F1B")
        lines += [f"## {table['stream']} on {table['config']} ({table['layout']}, N = {table['n']} per DP rank, "
                  f"seq_len {table['seq_len']}, {schedule})", "",
                  f"{table['documents']} documents in the stream"
                  + (f", repeated {table['stream_repeats']}x (extra passes shuffled, seed 0)"
                     if table['stream_repeats'] > 1 else "") + f"; cost model {table['cost_model']}; slowest rank "
                  f"/ balanced under {schedule} (the config's schedule).", "",
                  "| method | iters | " + " | ".join(c for c, _ in COLUMNS) + " |",
                  "|" + "---|" * (2 + len(COLUMNS))]
        for r in table["rows"]:
            cells = [str(r[k]) if isinstance(r[k], int) else f"{r[k]:.{DIGITS.get(k, 3)}f}" for _, k in COLUMNS]
            lines.append(f"| {r['label']} | {r['iterations']} | " + " | ".join(cells) + " |")
        lines.append("")
        notes = [f"- {r['label']}: final auto thresholds {r['thresholds']}"
                 for r in table["rows"] if "thresholds" in r and "queue_thresholds" not in r["overrides"]]
        notes += [f"- {r['label']}: HiGHS status per window {r['solver_status']}, "
                  f"{r['skipped_windows']} windows over the column cap (greedy plan kept)"
                  for r in table["rows"] if "solver_status" in r]
        lines += notes + [""]
    lines += [columns_legend(), ""]
    return "\n".join(lines)


def run(args: argparse.Namespace) -> int:
    positive(args.iterations, "--iterations")
    positive(args.solver_iterations, "--solver-iterations")
    positive(args.scale_iterations, "--scale-iterations")
    out = output_dir(args.out) if args.out else None
    config = load_config(args.config)
    # --cost-profile, else each config's own cost.profile; a bad name or profile fails now, before any table
    profile = cost_profile(args.cost_profile, config=config)
    scale_profile = cost_profile(args.cost_profile, config=load_config(args.scale_config)) if args.scale_config \
        else None
    host = machine()
    tables = []
    streams = [s.strip() for s in args.lengths.split(",") if s.strip()]
    streams += [DATA_PREFIX_SCHEME + prefix for prefix in args.data_prefix]
    streams += [data_path_stream(tokens) for tokens in args.data_path]
    # every stream is opened and checked (a bad one refused) before the first row runs
    bases = {stream: open_stream(stream, args.data_cache_path) for stream in streams}
    for stream in streams:
        tables.append(bench_one(args.config, stream, rows_for(config.seq_len, args.quick), args.iterations,
                                args.solver_iterations, profile, base=bases[stream]))
    if args.scale_config:
        rows: list[BenchRow] = [
            ("Original", "original", {}), ("Fixed-Len Greedy, window 1", "fixed-greedy", {"window": 1}),
            ("WLB, auto thresholds (default)", "wlb", {}),
            ("WLB, preset paper (Algorithm 1)", "wlb", preset_values("paper"))]
        tables.append(bench_one(args.scale_config, "wlbllm", rows, args.scale_iterations, args.solver_iterations,
                                scale_profile))
    result = {"machine": host, "command": args.label or "wlb " + " ".join(sys.argv[1:]), "tables": tables}
    md = to_markdown(result)
    if out is not None:
        (out / "packing_bench.json").write_text(json.dumps(result, indent=1))
        (out / "packing_bench.md").write_text(md)
        print(f"wrote {out / 'packing_bench.md'} and {out / 'packing_bench.json'}", file=sys.stderr)
    print(md)
    return 0
