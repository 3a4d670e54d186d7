#!/usr/bin/env python
"""Per-rank CP attention latency of each shard layout on real kernels, one GPU.

    python scripts/gpu_cp_latency.py [--efficiency TABLE.json] [--bwd] --out benchmarks/results/cp_gpu_latency
    python scripts/gpu_cp_latency.py --smoke --out /tmp/cp_latency          # CPU, seconds

Micro-batches: the embedded length stream (megatron_wlb/data/dist_wlbllm.json, published by the
DistCA authors as a stand-in for WLB-LLM's data), cut Megatron-style (concat-and-cut) at each
``--seq-lens`` value, evenly spaced through the stream. For every micro-batch, CP size and layout,
each rank's attention (its queries in layout order against its key segments ``kv_index``, one
varlen kernel call with the rank's cu_seqlens, bottom-right causal) runs in turn on the one GPU;
the max over ranks is the CP step's attention time (K/V all-gather and dK/dV reduce-scatter are
not included: they move the same bytes under every layout). Writes OUT.json and OUT.md with the
measured max-over-ranks time per layout (relative to per-sequence), the measured imbalance, and how
well ``RankShard.work`` predicted each rank (Spearman rank correlation). Both are rewritten after every case,
``"partial": true`` until all are done; at ``--max-seconds`` or the kit's deadline (``WLB_KIT_DEADLINE``) the
run stops there, ``"stopped_at_deadline": true``, exit status 0. A partial ``--efficiency`` table (a sweep
stopped early) gives way to the shipped placeholder, which the result names.
"""

from __future__ import annotations

import argparse
import json
import platform
import sys
from pathlib import Path

if __package__ in (None, ""):  # run as a script from a checkout without `pip install -e .`
    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
    sys.path.insert(0, str(Path(__file__).resolve().parent))

import numpy as np
import torch
from gpu_profile_attention import DTYPES, time_call

from megatron_wlb.costmodel import AnalyticCostModel, ParallelLayout, get_model
from megatron_wlb.cp import LAYOUT_NAMES, KernelEfficiency, build_layout
from megatron_wlb.cp.attention import resolve_backend, varlen_attention
from megatron_wlb.cp.sampling import SAMPLE_SOURCE, available, concat_and_cut
from megatron_wlb.data import load_lengths
from megatron_wlb.kit import Deadline, flagged
from megatron_wlb.provenance import markdown_table, write_result


def pick_micro_batches(seq_len: int, count: int) -> list[np.ndarray]:
    """``count`` concat-and-cut micro-batches evenly spaced through the embedded stream."""
    lengths = load_lengths()
    n = available(lengths, seq_len)
    if n < count:
        raise SystemExit(f"the embedded stream holds only {n} micro-batches of {seq_len} tokens")
    return concat_and_cut(lengths, seq_len, indices=np.linspace(0, n - 1, count).round().astype(int))


def spearman(a: np.ndarray, b: np.ndarray) -> float:
    if a.size < 2 or np.all(a == a[0]) or np.all(b == b[0]):
        return float("nan")
    ra = np.argsort(np.argsort(a)).astype(np.float64)
    rb = np.argsort(np.argsort(b)).astype(np.float64)
    return float(np.corrcoef(ra, rb)[0, 1])


def rank_latency(shard, args, device, dtype, backend) -> float:
    """Seconds of one rank's attention (forward, or forward + backward with --bwd)."""
    n, kv = shard.num_tokens, int(shard.key_lengths.sum())
    if n == 0:
        return 0.0
    q = torch.randn(n, args.heads, args.head_dim, device=device, dtype=dtype, requires_grad=args.bwd)
    k = torch.randn(kv, args.kv_heads, args.head_dim, device=device, dtype=dtype, requires_grad=args.bwd)
    v = torch.randn(kv, args.kv_heads, args.head_dim, device=device, dtype=dtype, requires_grad=args.bwd)
    # offsets uploaded once, outside the timed region (a host copy per call would bias small shapes)
    cu_q = torch.as_tensor(shard.cu_seqlens_q, dtype=torch.int32, device=device)
    cu_k = torch.as_tensor(shard.cu_seqlens_k, dtype=torch.int32, device=device)

    def fwd():
        with torch.no_grad():
            varlen_attention(q, k, v, cu_q, cu_k, shard.max_seqlen_q, shard.max_seqlen_k, backend=backend)

    def fwd_bwd():
        out = varlen_attention(q, k, v, cu_q, cu_k, shard.max_seqlen_q, shard.max_seqlen_k, backend=backend)
        out.backward(torch.ones_like(out))
        q.grad = k.grad = v.grad = None

    return time_call(fwd_bwd if args.bwd else fwd, args.warmup, args.iters, device)


def efficiency_table(path: str | None) -> tuple[KernelEfficiency | None, str]:
    """The measured table for adaptive/hybrid and its name; the shipped placeholder without one, or for a
    partial one (a sweep stopped at its deadline)."""
    if path is None:
        return None, "shipped placeholder"
    if json.loads(Path(path).read_text()).get("partial"):
        print(f"{path} is partial (its sweep stopped early): the shipped placeholder table instead", flush=True)
        return None, f"shipped placeholder ({path} is partial)"
    return KernelEfficiency.from_json(path), path


def measure(args) -> dict:
    """Time every case, rewriting OUT.json/.md after each (``"partial": true`` until all are done); at the
    deadline (``--max-seconds``, the kit's ``WLB_KIT_DEADLINE``) stop there, flagged, after >= 1 case."""
    device = torch.device(args.device)
    dtype = DTYPES[args.dtype]
    backend = resolve_backend(args.backend, device)
    eff, eff_name = efficiency_table(args.efficiency)
    shape = get_model(args.model)
    cost = AnalyticCostModel(shape, ParallelLayout(tp=args.tp))
    layouts = args.layouts.split(",")
    for layout in layouts:
        if layout not in LAYOUT_NAMES:
            raise SystemExit(f"unknown layout {layout!r}; valid: {', '.join(LAYOUT_NAMES)}")
    name = torch.cuda.get_device_name(device) if device.type == "cuda" else f"CPU ({platform.processor() or 'cpu'})"
    cases: list[dict] = []
    result = {"device": name, "backend": backend, "torch": torch.__version__, "dtype": args.dtype,
              "heads": args.heads, "kv_heads": args.kv_heads, "head_dim": args.head_dim, "bwd": args.bwd,
              "efficiency_table": eff_name, "cases": cases}
    deadline = Deadline(args.max_seconds)

    def write(done: bool) -> dict:
        full = flagged({**result, "summary": summarize(cases, layouts)}, done=done, deadline=deadline)
        write_result(args.out, full, to_markdown, echo=done or deadline.stopped)
        return full

    for seq_len in [int(x) for x in args.seq_lens.split(",")]:
        mbs = pick_micro_batches(seq_len, args.micro_batches)
        for cp in [int(x) for x in args.cps.split(",")]:
            for i, mb in enumerate(mbs):
                for layout in layouts:
                    if deadline.reached(len(cases)):
                        print(f"stopped at the deadline before seq {seq_len} cp {cp} mb {i} {layout}: "
                              f"{len(cases)} cases measured", flush=True)
                        return write(done=False)
                    lay = build_layout(layout, mb, cp, cost=cost, efficiency=eff, tile=args.tile)
                    lat = [rank_latency(s, args, device, dtype, backend) for s in lay.ranks]
                    cases.append({"seq_len": seq_len, "cp": cp, "micro_batch": i, "layout": layout,
                                  "used": lay.name, "docs": int(mb.size), "rank_seconds": lat,
                                  "rank_estimate": lay.rank_work.tolist(), "rank_tokens": lay.rank_tokens.tolist()})
                    write(done=False)
                print(f"seq {seq_len} cp {cp} mb {i}: " + ", ".join(
                    f"{c['layout']} {max(c['rank_seconds']) * 1e3:.2f} ms" for c in cases[-len(layouts):]),
                    flush=True)
    return write(done=True)


def summarize(cases: list[dict], layouts: list[str]) -> list[dict]:
    rows = []
    keys = sorted({(c["seq_len"], c["cp"]) for c in cases})
    for seq_len, cp in keys:
        sel = [c for c in cases if c["seq_len"] == seq_len and c["cp"] == cp]
        base = sum(max(c["rank_seconds"]) for c in sel if c["layout"] == "per-sequence") or float("nan")
        for name in layouts:
            mine = [c for c in sel if c["layout"] == name]
            if not mine:  # a partial run: not measured yet
                continue
            step = np.array([max(c["rank_seconds"]) for c in mine])
            imb = np.array([max(c["rank_seconds"]) / np.mean(c["rank_seconds"]) if np.mean(c["rank_seconds"]) > 0
                            else 1.0 for c in mine])
            est = np.concatenate([c["rank_estimate"] for c in mine])
            got = np.concatenate([c["rank_seconds"] for c in mine])
            rows.append({"seq_len": seq_len, "cp": cp, "layout": name, "micro_batches": len(mine),
                         "step_ms_mean": float(step.mean() * 1e3), "vs_per_sequence": float(step.sum() / base),
                         "measured_imbalance_mean": float(imb.mean()), "estimate_spearman": spearman(est, got),
                         "used": {u: sum(c["used"] == u for c in mine) for u in sorted({c["used"] for c in mine})}})
    return rows


def to_markdown(r: dict) -> str:
    out = ["# CP attention latency per layout (one GPU, each rank in turn)\n",
           f"Device: {r['device']}, backend {r['backend']}, torch {r['torch']}, {r['dtype']}, "
           f"{r['heads']} q heads / {r['kv_heads']} kv heads x {r['head_dim']}, "
           f"{'forward + backward' if r['bwd'] else 'forward'}; efficiency table: {r['efficiency_table']}. "
           f"Micro-batches: {SAMPLE_SOURCE}. Step = max over ranks; all-gather / reduce-scatter not included.\n"]
    out += markdown_table(
        ["seq", "CP", "layout", "step ms (mean)", "vs per-sequence", "measured imbalance",
         "estimate vs measured (Spearman)", "layouts used"],
        ([x["seq_len"], x["cp"], x["layout"],
          *(f"{x[k]:.3f}" for k in ("step_ms_mean", "vs_per_sequence", "measured_imbalance_mean", "estimate_spearman")),
          ", ".join(f"{k} {v}" for k, v in x["used"].items())] for x in r["summary"]))
    return "\n".join(out) + "\n"


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--out", required=True, help="output path without suffix (writes .json and .md)")
    p.add_argument("--seq-lens", default="65536,131072")
    p.add_argument("--cps", default="2,4,8")
    p.add_argument("--micro-batches", type=int, default=10, help="per sequence length")
    p.add_argument("--layouts", default=",".join(LAYOUT_NAMES))
    p.add_argument("--efficiency", default=None, help="measured kernel-efficiency table for adaptive/hybrid")
    p.add_argument("--model", default="7b", help="model whose attention FLOPs price the estimate")
    p.add_argument("--tp", type=int, default=1)
    p.add_argument("--heads", type=int, default=32, help="query heads on one GPU (7B at TP=1: 32)")
    p.add_argument("--kv-heads", type=int, default=32)
    p.add_argument("--head-dim", type=int, default=128)
    p.add_argument("--tile", type=int, default=128)
    p.add_argument("--dtype", choices=sorted(DTYPES), default="bf16")
    p.add_argument("--backend", default="auto")
    p.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    p.add_argument("--bwd", action="store_true", help="time forward + backward instead of forward")
    p.add_argument("--warmup", type=int, default=2)
    p.add_argument("--iters", type=int, default=5)
    p.add_argument("--max-seconds", type=float, default=None,
                   help="stop after this many seconds (and at WLB_KIT_DEADLINE), keeping what was measured")
    p.add_argument("--smoke", action="store_true", help="tiny CPU-sized run (tests)")
    args = p.parse_args(argv)
    if args.smoke:  # the CPU whatever the machine has: the reference kernel, fp32
        torch.set_num_threads(1)
        args.device, args.backend = "cpu", "auto"
        args.seq_lens, args.cps, args.micro_batches = "256", "2", 2
        args.heads, args.kv_heads, args.head_dim, args.dtype = 2, 1, 8, "fp32"
        args.warmup, args.iters, args.tile = 0, 1, 16
    if args.heads % args.kv_heads:
        raise SystemExit(f"--heads {args.heads} must be a multiple of --kv-heads {args.kv_heads}")
    measure(args)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
