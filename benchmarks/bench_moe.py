#!/usr/bin/env python
"""What balancing buys MoE jobs beside their dense counterparts, per corpus, one command:
``python benchmarks/bench_moe.py [--docs]``.

For every corpus (the embedded stand-in and the corpora of ``benchmarks/build_corpora.py``: nine) and every
shipped MoE configuration (Mixtral-8x7B-like and Qwen3-30B-A3B-like, 64K and 128K), the simulator runs
concat-and-cut (Megatron's own GPTDataset samples), WLB-LLM (documents whole) and the balanced
concat-and-cut on the same stream, for the MoE job and for the dense job of equal active parameters
(``RunConfig.dense_counterpart``: the same backbone and layout, a dense FFN of the active size, no EP),
under the README headline's schedule, and reports each one's simulated throughput over concat-and-cut
beside the attention share per concat-and-cut micro-batch (``sim.moe.attention_shares``), the
geometric mean per corpus. Writes benchmarks/results/moe_verdict.{md,json}; ``--docs`` also writes the
per-corpus summary into docs/simulator.md after ``<!-- moe-verdict-table -->``.
"""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "benchmarks"))

from _results import replace_readme_table, write_result  # noqa: E402
from bench_verdict import corpora, gpt_samples  # noqa: E402

from megatron_wlb.cli.common import resolve_lengths  # noqa: E402
from megatron_wlb.config import load_config  # noqa: E402
from megatron_wlb.provenance import machine  # noqa: E402
from megatron_wlb.sim.experiments import BALANCED_CUT, PAPER_VIRTUAL_STAGES, PLAIN, WLB, compare, geo_mean  # noqa: E402,I001
from megatron_wlb.sim.moe import attention_shares, share_summary  # noqa: E402

MOE_CONFIGS = ("mixtral8x7b_64k", "mixtral8x7b_128k", "qwen3_30b_a3b_64k", "qwen3_30b_a3b_128k")
METHODS = (PLAIN, WLB, BALANCED_CUT)
DOCS_MARK = "<!-- moe-verdict-table -->"
DOCS = ROOT / "docs" / "simulator.md"


def run(names: list[str], configs: list[str], iterations: int) -> dict:
    rows = []
    for stream in names:
        source = stream if stream == "wlbllm" else str(ROOT / "tests" / "data" / "corpora" / f"{stream}.npy")
        for name in configs:
            moe = load_config(name)
            lengths = resolve_lengths(source, min_tokens=(iterations + 16) * moe.packing.tokens_per_iteration)
            samples = gpt_samples(lengths, moe, iterations)
            row: dict = {"stream": stream, "config": name, "layout": str(moe.layout)}
            t0 = time.perf_counter()
            for kind, cfg in (("moe", moe), ("dense", moe.dense_counterpart())):
                comp = compare(cfg, lengths, iterations, METHODS, virtual_stages=PAPER_VIRTUAL_STAGES,
                               samples=samples)
                shares = attention_shares(comp.cost, lengths, cfg.seq_len,
                                          iterations * cfg.packing.micro_batches_per_iteration)
                row[kind] = {"model": cfg.model.name, "layout": str(cfg.layout),
                             "speedup": {m.name: comp.speedup(m.name, PLAIN.name) for m in METHODS[1:]},
                             "attention_share": share_summary(shares)}
            row["seconds"] = time.perf_counter() - t0
            rows.append(row)
            print(f"{stream:8s} {name:18s} " + " ".join(
                f"{k} WLB {row[k]['speedup'][WLB.name]:.3f} bal {row[k]['speedup'][BALANCED_CUT.name]:.3f} "
                f"attn {row[k]['attention_share']['mean']:.3f}" for k in ("moe", "dense")), file=sys.stderr, flush=True)
    return {"machine": machine(), "command": "python benchmarks/bench_moe.py", "iterations": iterations,
            "virtual_stages": PAPER_VIRTUAL_STAGES, "configs": configs, "rows": rows}


def corpus_means(result: dict, stream: str) -> dict[str, float]:
    """Geometric means over the configurations of one corpus: ``{"<moe|dense> <method>": speedup}`` and the
    arithmetic ``"<moe|dense> attention"`` share."""
    mine = [r for r in result["rows"] if r["stream"] == stream]
    out = {}
    for kind in ("moe", "dense"):
        for m in (WLB.name, BALANCED_CUT.name):
            out[f"{kind} {m}"] = geo_mean(r[kind]["speedup"][m] for r in mine)
        out[f"{kind} attention"] = sum(r[kind]["attention_share"]["mean"] for r in mine) / len(mine)
    return out


def summary_table(result: dict) -> str:
    """Per corpus: geometric mean over the MoE configurations of the simulated throughput over
    concat-and-cut, MoE beside its dense counterpart, and the mean attention share per micro-batch."""
    lines = ["| corpus | WLB-LLM / c&c, MoE (dense) | balanced c&c / c&c, MoE (dense) | "
             "attention share per micro-batch, MoE (dense) |", "|---|---|---|---|"]
    for stream in dict.fromkeys(r["stream"] for r in result["rows"]):
        g = corpus_means(result, stream)
        lines.append(f"| {stream} | {g['moe ' + WLB.name]:.3f} ({g['dense ' + WLB.name]:.3f}) | "
                     f"{g['moe ' + BALANCED_CUT.name]:.3f} ({g['dense ' + BALANCED_CUT.name]:.3f}) | "
                     f"{g['moe attention']:.3f} ({g['dense attention']:.3f}) |")
    return "\n".join(lines) + "\n"


def to_markdown(result: dict) -> str:
    lines = ["# MoE jobs beside the dense jobs of equal active parameters: simulated throughput over "
             "concat-and-cut", "",
             f"Machine: {result['machine']}. Generated by `{result['command']}` ({result['iterations']} iterations "
             f"per configuration and method; interleaved 1F1B, v = {result['virtual_stages']}; analytic H100 cost "
             "model, MoE layers priced with their router, top-k experts and the EP all-to-alls).", "",
             "Dense = the same backbone (hidden, layers, heads, vocabulary) and layout with a dense FFN of the MoE's "
             "active MLP parameters and no expert parallelism: equal FLOPs per token, so what differs is what the MoE "
             "adds per token (EP all-to-alls, the router). Attention share: causal attention's forward + backward "
             "seconds over the whole micro-batch's, on Megatron's concat-and-cut micro-batches. Cells: geometric "
             "mean over the configurations (the share: arithmetic mean).", "", summary_table(result), "",
             "## Per configuration", "",
             "| corpus | config | layout | WLB-LLM MoE / dense | balanced c&c MoE / dense | attention share MoE / "
             "dense |", "|---|---|---|---|---|---|"]
    for r in result["rows"]:
        m, d = r["moe"], r["dense"]
        lines.append(f"| {r['stream']} | {r['config']} | {r['layout']} | {m['speedup'][WLB.name]:.3f} / "
                     f"{d['speedup'][WLB.name]:.3f} | {m['speedup'][BALANCED_CUT.name]:.3f} / "
                     f"{d['speedup'][BALANCED_CUT.name]:.3f} | {m['attention_share']['mean']:.3f} / "
                     f"{d['attention_share']['mean']:.3f} |")
    return "\n".join(lines) + "\n"


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--iterations", type=int, default=16, help="iterations per configuration and method")
    ap.add_argument("--streams", default="", help="comma-separated corpora (default: wlbllm and every built one)")
    ap.add_argument("--configs", default=",".join(MOE_CONFIGS))
    ap.add_argument("--out", default=str(ROOT / "benchmarks" / "results" / "moe_verdict"))
    ap.add_argument("--docs", action="store_true", help=f"also write the summary into {DOCS.relative_to(ROOT)}")
    args = ap.parse_args(argv)
    if args.iterations < 1:
        ap.error(f"--iterations must be >= 1, got {args.iterations}")
    configs = [c for c in args.configs.split(",") if c]
    for c in configs:
        if not load_config(c).model.is_moe:  # an unknown name fails here too, before any work
            ap.error(f"--configs {c}: not an MoE configuration (no num_experts)")
    result = run(corpora([s for s in args.streams.split(",") if s]), configs, args.iterations)
    write_result(args.out, result, to_markdown)
    if args.docs:
        replace_readme_table(DOCS, DOCS_MARK, summary_table(result))
    return 0


if __name__ == "__main__":
    sys.exit(main())
