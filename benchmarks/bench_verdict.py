#!/usr/bin/env python
"""What each packing buys on each corpus, one command: ``python benchmarks/bench_verdict.py [--page]``.

For every corpus (the embedded stand-in and the real corpora of ``benchmarks/build_corpora.py``) and
every configuration of the paper's Table 1, the simulator runs concat-and-cut (Megatron's default),
the whole-document baseline, WLB-LLM (documents whole) and the balanced concat-and-cut
(``pieces: concat-and-cut``: concat-and-cut's own pieces, balanced) on the same stream, under the
README headline's schedule (interleaved 1F1B, ``PAPER_VIRTUAL_STAGES``), and reports each
method's simulated throughput over concat-and-cut, the geometric mean per corpus, and
``recommendation()``'s advice. Writes benchmarks/results/verdict.{md,json}; ``--page`` also writes the
per-corpus summary into benchmarks/results.md after ``<!-- verdict-table -->``.
"""

from __future__ import annotations

import argparse
import sys
import time
import warnings
from pathlib import Path
from typing import Any

import numpy as np

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "benchmarks"))

from _results import record, replace_readme_table  # noqa: E402

from megatron_wlb.cli.common import resolve_lengths  # noqa: E402
from megatron_wlb.config import load_config  # noqa: E402
from megatron_wlb.provenance import machine  # noqa: E402
from megatron_wlb.sim.experiments import (  # noqa: E402
    BALANCED_CUT,
    PAPER_VIRTUAL_STAGES,
    PLAIN,
    TABLE1_CONFIGS,
    WHOLE,
    WLB,
    compare,
    geo_mean,
)
from megatron_wlb.sim.report import Verdict, recommendation  # noqa: E402

CORPORA_DIR = ROOT / "tests" / "data" / "corpora"
METHODS = (PLAIN, WHOLE, WLB, BALANCED_CUT)
README_MARK = "<!-- verdict-table -->"


def corpora(names: list[str] | None) -> list[str]:
    """The embedded stream and every built corpus (or ``names``), in a fixed order."""
    built = sorted(p.stem for p in CORPORA_DIR.glob("*.npy"))
    wanted = names if names else ["wlbllm", *built]
    for name in wanted:
        if name != "wlbllm" and name not in built:
            raise SystemExit(f"corpus {name!r} is not built: run python benchmarks/build_corpora.py "
                             f"(built: {', '.join(built) or 'none'})")
    return wanted


def gpt_samples(lengths: np.ndarray, cfg: Any, iterations: int) -> Any:
    """megatron-core's GPTDataset samples of the stream (seed 1234; what the concat-and-cut baseline and the
    balanced concat-and-cut train, as in a real job), or None without megatron-core (said once)."""
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            from megatron_wlb.megatron.data.sample_orders import gpt_sample_order, sample_stream

            count = (iterations + 16) * cfg.packing.micro_batches_per_iteration
            order, name = gpt_sample_order(lengths, cfg.seq_len, count, 1234)
    except ImportError as exc:
        print(f"megatron-core is not importable ({exc}): concat-and-cut follows the stream's order", file=sys.stderr)
        return None
    return sample_stream(order, name)


def run(names: list[str], configs: list[str], iterations: int) -> dict:
    rows = []
    for stream in names:
        source = stream if stream == "wlbllm" else str(CORPORA_DIR / f"{stream}.npy")
        for name in configs:
            cfg = load_config(name)
            lengths = resolve_lengths(source, min_tokens=(iterations + 16) * cfg.packing.tokens_per_iteration)
            t0 = time.perf_counter()
            samples = gpt_samples(lengths, cfg, iterations)
            comp = compare(cfg, lengths, iterations, METHODS, virtual_stages=PAPER_VIRTUAL_STAGES, samples=samples)
            speedups = {m.name: comp.speedup(m.name, PLAIN.name) for m in METHODS[1:]}
            delay = {m.name: comp.runs[m.name].packing_metrics.get("mean_delay", float("nan")) for m in METHODS}
            rows.append({"stream": stream, "config": name, "layout": str(cfg.layout), "speedup": speedups,
                         "mean_delay": delay, "seconds": time.perf_counter() - t0})
            print(f"{stream:8s} {name:10s} " + " ".join(f"{k} {v:.3f}" for k, v in speedups.items()),
                  file=sys.stderr, flush=True)
    return {"machine": machine(), "command": "python benchmarks/bench_verdict.py", "iterations": iterations,
            "virtual_stages": PAPER_VIRTUAL_STAGES, "configs": configs, "rows": rows,
            "advice": {s: advice(rows, s) for s in names}}


def advice(rows: list[dict], stream: str) -> list[str]:
    """``recommendation()`` over the configurations of one corpus (each configuration a sample)."""
    mine = [r for r in rows if r["stream"] == stream]
    per_base = {PLAIN.name: {m: [r["speedup"][m] for r in mine] for m in (WHOLE.name, WLB.name, BALANCED_CUT.name)},
                WHOLE.name: {m: [r["speedup"][m] / r["speedup"][WHOLE.name] for r in mine]
                             for m in (WLB.name, BALANCED_CUT.name)}}
    return recommendation(Verdict(per_base, 0, len(mine)), spread="configuration")


def summary_table(result: dict) -> str:
    """Per corpus: geometric mean [min, max] over the Table 1 configurations of each method's
    simulated throughput over concat-and-cut."""
    head = ("| corpus | whole-document / c&c | WLB-LLM / c&c | **balanced c&c / c&c** | "
            "configs >= 1.1x (balanced c&c) | which to use |")
    lines = [head, "|---|---|---|---|---|---|"]
    for stream in dict.fromkeys(r["stream"] for r in result["rows"]):
        mine = [r for r in result["rows"] if r["stream"] == stream]

        def cell(m: str, rows: list[dict] = mine) -> str:
            vals = [r["speedup"][m] for r in rows]
            return f"{geo_mean(vals):.3f} [{min(vals):.2f}, {max(vals):.2f}]"

        ok = sum(r["speedup"][BALANCED_CUT.name] >= 1.1 for r in mine)
        use = next((line for line in result["advice"][stream] if line.startswith("**Use")), "")
        short = "balanced c&c" if "concat-and-cut`**" in use else "WLB-LLM (documents whole)"
        lines.append(f"| {stream} | {cell(WHOLE.name)} | {cell(WLB.name)} | **{cell(BALANCED_CUT.name)}** | "
                     f"{ok} / {len(mine)} | {short} |")
    return "\n".join(lines) + "\n"


def to_markdown(result: dict) -> str:
    lines = ["# Which packing to use, per corpus: simulated throughput over concat-and-cut", "",
             f"Machine: {result['machine']}. Generated by `{result['command']}` ({result['iterations']} iterations "
             f"per configuration and method; the paper's Table 1 configurations; interleaved 1F1B, v = "
             f"{result['virtual_stages']}; analytic H100 cost model).", "",
             "c&c = concat-and-cut: megatron-core's own GPTDataset samples of the corpus (seed 1234, its document, "
             "sample and shuffle indices, per-document masking), one sample a micro-batch in "
             "MegatronPretrainingSampler order (per-sequence CP); whole-document = documents whole in arrival order "
             "(per-sequence CP); WLB-LLM = wlb packing of whole documents + adaptive CP; balanced c&c = wlb packing "
             "of the same GPTDataset samples' pieces, no sample trained before its iteration (read_ahead off, as "
             "`--wlb-pieces concat-and-cut` trains) + adaptive CP (the same data and attention work as c&c). Cells: "
             "geometric mean [min, max] over the configurations.", "", summary_table(result), ""]
    for stream, sentences in result["advice"].items():
        lines += [f"**{stream}.** " + " ".join(sentences), ""]
    lines += ["## Per configuration", "", "| corpus | config | layout | whole-document | WLB-LLM | balanced c&c | "
              "mean delay WLB-LLM / balanced c&c |", "|---|---|---|---|---|---|---|"]
    for r in result["rows"]:
        s, d = r["speedup"], r["mean_delay"]
        lines.append(f"| {r['stream']} | {r['config']} | {r['layout']} | {s[WHOLE.name]:.3f} | {s[WLB.name]:.3f} | "
                     f"{s[BALANCED_CUT.name]:.3f} | {d[WLB.name]:.2f} / {d[BALANCED_CUT.name]:.2f} |")
    return "\n".join(lines) + "\n"


def update_readme(result: dict, path: Path) -> None:
    """Replace the summary table right after the results page's ``<!-- verdict-table -->`` marker with this run's."""
    replace_readme_table(path, README_MARK, summary_table(result))


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--iterations", type=int, default=60, help="iterations per configuration and method")
    ap.add_argument("--streams", default="", help="comma-separated corpora (default: wlbllm and every built one)")
    ap.add_argument("--configs", default=",".join(TABLE1_CONFIGS))
    ap.add_argument("--out", default=str(ROOT / "benchmarks" / "results" / "verdict"))
    ap.add_argument("--page", action="store_true", help="also write the summary into benchmarks/results.md")
    args = ap.parse_args(argv)
    if args.iterations < 1:
        ap.error(f"--iterations must be >= 1, got {args.iterations}")
    configs = [c for c in args.configs.split(",") if c]
    for c in configs:
        load_config(c)  # an unknown name fails here, before any work
    result = run(corpora([s for s in args.streams.split(",") if s]), configs, args.iterations)
    return record(args.out, result, to_markdown, update_readme if args.page else None)


if __name__ == "__main__":
    sys.exit(main())
