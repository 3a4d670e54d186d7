#!/usr/bin/env python
"""What the all-gather CP attention keeps in memory for backward, per layer, on a real plan.

    python benchmarks/bench_attention_memory.py [--config 7b_128k] [--layout adaptive] [--iterations 100]
                                             [--out benchmarks/results/attention_memory]

Each CP rank materialises, for every query run, its document's keys ``[doc_start, run_end)`` out of
the gathered K/V (``AllGatherKV``) and the kernel keeps those K/V segments for backward: per layer and
micro-batch in flight, ``sum(RankShard.key_lengths)`` rows of ``2 x Hkv/TP x head_dim`` values.
This script packs the config's plan (its packer on the embedded length stream), builds the layout
of every micro-batch, and reports those rows against the rank's own tokens and the micro-batch's
tokens, and the bytes they cost at the first pipeline stage (layers per stage x PP micro-batches in
flight under 1F1B, bf16). Writes OUT.json and OUT.md.
"""

from __future__ import annotations

import argparse
import platform
import sys
from pathlib import Path

import numpy as np

if __package__ in (None, ""):
    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
    sys.path.insert(0, str(Path(__file__).resolve().parent))

from _results import write_result

from megatron_wlb.config import load_config
from megatron_wlb.costmodel import build_cost_model
from megatron_wlb.cp import build_layout
from megatron_wlb.data import load_lengths
from megatron_wlb.packing import make_packer

GIB = 1024 ** 3


def run(args) -> dict:
    cfg = load_config(args.config)
    cost = build_cost_model(cfg.model, cfg.layout)
    packer = make_packer(cfg.packer, cfg.packing, cost)
    lengths = load_lengths()
    cp, tp, pp = cfg.layout.cp, cfg.layout.tp, cfg.layout.pp
    bytes_per_row = 2 * max(1, cfg.model.num_kv_heads // tp) * cfg.model.head_dim * 2  # K and V, bf16
    own_ratio, batch_ratio, rows_max, tokens = [], [], [], []
    for i, batch in enumerate(packer.pack(lengths)):
        if i >= args.iterations:
            break
        for mb in batch.micro_batches:
            if not mb.pieces:
                continue
            layout = build_layout(args.layout, mb.lengths, cp, cost=cost)
            kept = np.array([int(np.sum(s.key_lengths)) for s in layout.ranks], dtype=np.int64)
            own = np.array([s.num_tokens for s in layout.ranks], dtype=np.int64)
            own_ratio.extend((kept / np.maximum(own, 1)).tolist())
            batch_ratio.append(float(kept.max() / mb.tokens))
            rows_max.append(int(kept.max()))
            tokens.append(mb.tokens)
    own_ratio_a, batch_ratio_a = np.asarray(own_ratio), np.asarray(batch_ratio)
    layers_per_stage = cfg.model.num_layers // pp
    worst = max(rows_max) * bytes_per_row
    return {
        "config": args.config, "layout": args.layout, "packer": cfg.packer, "machine": args.machine,
        "python": platform.python_version(), "iterations": args.iterations, "micro_batches": len(tokens),
        "tp": tp, "cp": cp, "pp": pp, "s_max": cfg.packing.capacity_var, "largest_micro_batch_tokens": int(max(tokens)),
        "kept_rows_over_own_tokens": {"median": float(np.median(own_ratio_a)),
                                      "p99": float(np.percentile(own_ratio_a, 99)),
                                      "max": float(own_ratio_a.max())},
        "kept_rows_over_micro_batch_tokens": {"median": float(np.median(batch_ratio_a)),
                                              "max": float(batch_ratio_a.max())},
        "bytes_per_row": bytes_per_row, "layers_per_stage": layers_per_stage,
        "worst_layer_gib": worst / GIB,
        "stage0_gib_worst": worst * layers_per_stage * pp / GIB,
        "stage0_gib_typical": float(np.median(rows_max)) * bytes_per_row * layers_per_stage * pp / GIB,
    }


def markdown(r: dict) -> str:
    o, b = r["kept_rows_over_own_tokens"], r["kept_rows_over_micro_batch_tokens"]
    return "\n".join([
        f"# Attention memory kept for backward: {r['config']}, {r['layout']} layout ({r['packer']} plan)",
        "",
        f"{r['micro_batches']} micro-batches of {r['iterations']} iterations, TP{r['tp']} CP{r['cp']} PP{r['pp']}, "
        f"S_max {r['s_max']}, largest micro-batch {r['largest_micro_batch_tokens']} tokens; {r['machine']}; "
        "`python benchmarks/bench_attention_memory.py`.",
        "",
        "| measure | median | p99 | max |",
        "|---|---|---|---|",
        f"| K/V rows kept per rank / the rank's own tokens | {o['median']:.2f} | {o['p99']:.2f} | {o['max']:.2f} |",
        f"| K/V rows kept by the busiest rank / the micro-batch's tokens | {b['median']:.2f} | | {b['max']:.2f} |",
        "",
        f"Per layer and micro-batch in flight: up to {r['worst_layer_gib']:.3f} GiB "
        f"({r['bytes_per_row']} bytes per kept row: K and V, bf16, Hkv/TP heads). At the first pipeline stage "
        f"({r['layers_per_stage']} layers x {r['pp']} micro-batches in flight under 1F1B): "
        f"{r['stage0_gib_typical']:.2f} GiB for a median micro-batch, {r['stage0_gib_worst']:.2f} GiB worst case.",
        "",
    ])


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--config", default="7b_128k")
    parser.add_argument("--layout", default="adaptive")
    parser.add_argument("--iterations", type=int, default=100)
    parser.add_argument("--machine", default="2-core x86-64 CPU container")
    parser.add_argument("--out", default="benchmarks/results/attention_memory")
    args = parser.parse_args()
    result = run(args)
    write_result(args.out, result, markdown)


if __name__ == "__main__":
    main()
