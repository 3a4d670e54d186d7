#!/usr/bin/env python
"""Benchmark the CP shard layouts: estimated per-rank attention imbalance and layout build time.

    python benchmarks/bench_layouts.py [--micro-batches 500] [--cps 4,16] [--seq-len 131072]
                                    [--kernel-table EFF.json] [--out benchmarks/results/cp_layouts]

Micro-batches: the embedded length stream (megatron_wlb/data/dist_wlbllm.json, published by the
DistCA authors as a stand-in for WLB-LLM's 128K-job data) cut Megatron-style: consecutive
documents concatenated until ``--seq-len`` tokens, the last one cut and continued in the next
micro-batch. Work is ``RankShard.work`` (7B, TP=1, analytic; tile 128; kernel-efficiency table:
the shipped placeholder unless ``--kernel-table``). Writes OUT.json and OUT.md.
"""

from __future__ import annotations

import argparse
import os
import platform
import time
from pathlib import Path

import numpy as np

if __package__ in (None, ""):  # run as a script from a checkout without `pip install -e .`
    import sys

    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
    sys.path.insert(0, str(Path(__file__).resolve().parent))

from _results import write_result

from megatron_wlb.cp import KernelEfficiency, build_layout, default_cost_model
from megatron_wlb.cp.sampling import SAMPLE_SOURCE, concat_and_cut
from megatron_wlb.data import load_lengths
from megatron_wlb.provenance import markdown_table

LAYOUTS = ("per-sequence", "per-document", "per-document-te", "adaptive", "hybrid")
FLAT = KernelEfficiency(np.array([1.0, 2.0]), np.array([1.0, 2.0]), np.full((2, 2), 1.0), tile=1)


def _timeit(fn, repeat: int) -> np.ndarray:
    """[repeat, 2]: wall seconds and CPU seconds of this process (the latter excludes time the
    scheduler gave to other processes on a shared machine)."""
    fn()
    out = np.empty((repeat, 2))
    for i in range(repeat):
        t0, c0 = time.perf_counter(), time.process_time()
        fn()
        out[i] = time.perf_counter() - t0, time.process_time() - c0
    return out


def run(args) -> dict:
    eff = KernelEfficiency.from_json(args.kernel_table) if args.kernel_table else None
    mbs = concat_and_cut(load_lengths(), args.seq_len, args.micro_batches)
    docs = np.array([m.size for m in mbs])
    result = {"machine": args.machine, "python": platform.python_version(), "seq_len": args.seq_len,
              "micro_batches": len(mbs), "docs_per_micro_batch": {"mean": float(docs.mean()), "max": int(docs.max())},
              "efficiency_table": args.kernel_table or "shipped placeholder (not measured)", "cp": {}}
    per_token = float(default_cost_model().linear_compute(1.0))   # linear-layer seconds per token (7B, TP=1)
    result["linear_seconds_per_token"] = per_token
    for cp in args.cps:
        rows = {}
        max_work = {}
        max_step = {}
        for name in LAYOUTS:
            lays = [build_layout(name, m, cp, efficiency=eff) for m in mbs]
            imb = np.array([x.imbalance for x in lays])
            tok = np.array([x.rank_tokens.max() / x.rank_tokens.mean() for x in lays])
            max_work[name] = np.array([x.max_work for x in lays])
            max_step[name] = np.array([(x.rank_work + per_token * x.rank_tokens).max() for x in lays])
            used = {}
            for x in lays:
                used[x.name] = used.get(x.name, 0) + 1
            rows[name] = {"imbalance_mean": float(imb.mean()), "imbalance_p50": float(np.median(imb)),
                          "imbalance_p99": float(np.quantile(imb, 0.99)), "imbalance_max": float(imb.max()),
                          "token_imbalance_max": float(tok.max()), "layouts_used": used,
                          "padded_tokens": int(sum(int(x.padded_lengths.sum() - x.lengths.sum()) for x in lays))}
        base = max_work["per-sequence"].sum()
        base_step = max_step["per-sequence"].sum()
        for name in LAYOUTS:
            rows[name]["attention_time_vs_per_sequence"] = float(max_work[name].sum() / base)
            rows[name]["step_time_vs_per_sequence"] = float(max_step[name].sum() / base_step)
            rows[name]["beats_adaptive_fraction"] = float(np.mean(max_step[name] < max_step["adaptive"] * (1 - 1e-9)))
            rows[name]["beats_both_static_fraction"] = float(np.mean(
                max_step[name] < np.minimum(max_step["per-sequence"], max_step["per-document"]) * (1 - 1e-9)))
        flops = np.array([build_layout("per-document", m, cp, tile=1, efficiency=FLAT).imbalance for m in mbs])
        rows["per-document"]["pure_flops_imbalance_mean"] = float(flops.mean())
        rows["per-document"]["pure_flops_imbalance_max"] = float(flops.max())
        result["cp"][str(cp)] = rows

    # build time at 128K with the largest CP: build_layout for all ranks, then one rank's token arrays
    cp = max(args.cps)
    sample = mbs[: args.timing_micro_batches]
    timing = {}
    for name in LAYOUTS:
        build = np.concatenate([_timeit(lambda m=m, name=name: build_layout(name, m, cp, efficiency=eff), 5)
                                for m in sample])

        def one_rank(m, name=name):
            shard = build_layout(name, m, cp, efficiency=eff).ranks[cp // 2]
            shard.token_index, shard.position_ids, shard.gather_pieces()  # noqa: B018

        def expand_rows(m, name=name):
            build_layout(name, m, cp, efficiency=eff).ranks[cp // 2].gather_rows()

        full = np.concatenate([_timeit(lambda m=m: one_rank(m), 3) for m in sample])
        rows = np.concatenate([_timeit(lambda m=m: expand_rows(m), 3) for m in sample])
        timing[name] = {"build_ms_median": float(np.median(build[:, 0]) * 1e3),
                        "build_ms_p90": float(np.quantile(build[:, 0], 0.9) * 1e3),
                        "build_ms_min": float(build[:, 0].min() * 1e3),
                        "build_cpu_ms_median": float(np.median(build[:, 1]) * 1e3),
                        "with_rank_tokens_ms_median": float(np.median(full[:, 0]) * 1e3),
                        "with_rank_tokens_ms_p90": float(np.quantile(full[:, 0], 0.9) * 1e3),
                        "with_rank_tokens_cpu_ms_median": float(np.median(full[:, 1]) * 1e3),
                        "with_host_gather_rows_ms_median": float(np.median(rows[:, 0]) * 1e3)}
    result["timing"] = {"cp": cp, "micro_batches": len(sample), "layouts": timing,
                        "load_average": float(os.getloadavg()[0])}
    return result


def to_markdown(r: dict) -> str:
    docs = r["docs_per_micro_batch"]
    sample = (f"{r['micro_batches']} micro-batches of {r['seq_len']} tokens, {SAMPLE_SOURCE}; {docs['mean']:.1f} "
              f"documents per micro-batch on average (max {docs['max']})")
    out = ["# CP shard layouts: imbalance and build time\n",
           f"Machine: {r['machine']} (Python {r['python']}). {sample}.\n",
           f"Work = estimated forward attention seconds per rank (7B, TP=1, analytic cost model, tile 128, "
           f"kernel-efficiency table: {r['efficiency_table']}). Imbalance = max / mean over the CP ranks. "
           "'attn time' = sum over micro-batches of the slowest rank's attention work, relative to "
           "per-sequence; 'attn+linear' adds each rank's linear-layer time for its own tokens "
           f"({r['linear_seconds_per_token'] * 1e6:.3f} us per token, 7B analytic) before taking the slowest "
           "rank: the CP step time that hybrid balances. 'beats' columns compare attn+linear per micro-batch.\n",
           "Regenerate: `python benchmarks/bench_layouts.py`.\n"]
    for cp, rows in r["cp"].items():
        out.append(f"\n## CP = {cp}\n")
        out += markdown_table(
            ["layout", "imbalance mean", "p50", "p99", "max", "token max/mean", "attn time vs per-seq",
             "attn+linear vs per-seq", "beats adaptive", "beats both static", "padded tokens", "layouts used"],
            ([name, *(f"{x[k]:.4f}" for k in ("imbalance_mean", "imbalance_p50", "imbalance_p99", "imbalance_max",
                                              "token_imbalance_max")),
              f"{x['attention_time_vs_per_sequence']:.3f}", f"{x['step_time_vs_per_sequence']:.3f}",
              f"{100 * x['beats_adaptive_fraction']:.0f}%", f"{100 * x['beats_both_static_fraction']:.0f}%",
              x["padded_tokens"], ", ".join(f"{k} {v}" for k, v in sorted(x["layouts_used"].items()))]
             for name, x in rows.items()))
        pd = rows["per-document"]
        out.append(f"\nper-document with pure FLOPs (tile 1, flat efficiency): imbalance mean "
                   f"{pd['pure_flops_imbalance_mean']:.5f}, max {pd['pure_flops_imbalance_max']:.5f}.\n")
    t = r["timing"]
    out.append(f"\n## Build time, CP = {t['cp']}, {r['seq_len']}-token micro-batches ({t['micro_batches']} "
               "micro-batches x 5 repeats)\n")
    out.append("`build` = `build_layout` for all ranks (every rank's runs and work; a rank's cu_seqlens and max "
               "lengths are derived from its runs on use); `+ rank tokens` additionally materialises the middle "
               "rank's token_index and position_ids and the O(runs) pieces of its K/V gather index (what a "
               "training rank computes on the host each step; the device upload expands the pieces on the GPU). "
               "`build + host gather rows` instead expands that index (O(keys), ~T entries) in numpy, for "
               "reference.\n")
    out.append("Wall-clock medians/p90 include time the shared machine gave to other processes (its load "
               f"average was {t['load_average']:.1f} on 2 cores during the run); the CPU columns are this "
               "process's CPU time.\n")
    out += markdown_table(
        ["layout", "build median ms", "p90", "min", "CPU median", "+ rank tokens median ms", "p90", "CPU median",
         "build + host gather rows median ms"],
        ([name, *(f"{x[k]:.3f}" for k in ("build_ms_median", "build_ms_p90", "build_ms_min", "build_cpu_ms_median",
                                          "with_rank_tokens_ms_median", "with_rank_tokens_ms_p90",
                                          "with_rank_tokens_cpu_ms_median", "with_host_gather_rows_ms_median"))]
         for name, x in t["layouts"].items()))
    return "\n".join(out) + "\n"


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--micro-batches", type=int, default=500)
    p.add_argument("--cps", default="4,16", help="comma-separated CP sizes (default 4,16)")
    p.add_argument("--seq-len", type=int, default=131072)
    p.add_argument("--kernel-table", default=None, help="measured kernel-efficiency table JSON")
    p.add_argument("--timing-micro-batches", type=int, default=100)
    p.add_argument("--machine", default="2-core CPU container (shared)")
    p.add_argument("--out", default="benchmarks/results/cp_layouts", help="output path without suffix")
    args = p.parse_args(argv)
    args.cps = [int(x) for x in args.cps.split(",")]
    write_result(args.out, run(args), to_markdown)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
