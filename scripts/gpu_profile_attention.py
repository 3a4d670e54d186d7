#!/usr/bin/env python
"""Measure achieved attention TFLOP/s over query/key shard shapes: the table behind ``adaptive``.

    python scripts/gpu_profile_attention.py --out benchmarks/results/cp_efficiency_h100.json
    python scripts/gpu_profile_attention.py --smoke --out /tmp/eff.json      # CPU, seconds

For every grid shape (q, kv) with q <= kv, packs ``max(1, tokens // kv)`` query runs of q queries
over kv keys (bottom-right causal, like a CP rank's shards) into ONE varlen kernel call, times the
forward (CUDA events; median of ``--iters`` after ``--warmup``), and records
``runs * causal_pairs(q, kv) * 4 * heads * head_dim / seconds``. Impossible shapes (q > kv) are
written as null. The JSON (``megatron-wlb-attn-efficiency/1``) loads with
``KernelEfficiency.from_json`` and ``wlb shard --kernel-table``. It is rewritten after every shape, marked
``"partial": true`` (its rows so far, the last one cut) until the grid is done; at ``--max-seconds`` or the
kit's deadline (``WLB_KIT_DEADLINE``, scripts/gpu_run.sh) the sweep stops there, ``"stopped_at_deadline": true``,
exit status 0.

Before measuring, the chosen kernel is checked against the reference implementation on a small
case whose query runs are shorter than their key ranges: a kernel with top-left-aligned causal
masking (not what CP needs) fails loudly instead of producing a table.
"""

from __future__ import annotations

import argparse
import platform
import statistics
import sys
import time
from pathlib import Path

if __package__ in (None, ""):  # run as a script from a checkout without `pip install -e .`
    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import numpy as np
import torch

from megatron_wlb.costmodel import causal_pairs
from megatron_wlb.cp.attention import reference_varlen_attention, resolve_backend, varlen_attention
from megatron_wlb.cp.efficiency import EFFICIENCY_FORMAT
from megatron_wlb.kit import Deadline, flagged, write_json

DTYPES = {"bf16": torch.bfloat16, "fp16": torch.float16, "fp32": torch.float32}


def time_call(fn, warmup: int, iters: int, device: torch.device) -> float:
    """Median seconds of ``fn()`` (CUDA events on GPU, perf_counter on CPU)."""
    for _ in range(warmup):
        fn()
    samples = []
    for _ in range(iters):
        if device.type == "cuda":
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            start.record()
            fn()
            end.record()
            torch.cuda.synchronize()
            samples.append(start.elapsed_time(end) / 1e3)
        else:
            t0 = time.perf_counter()
            fn()
            samples.append(time.perf_counter() - t0)
    return statistics.median(samples)


def check_bottom_right(backend: str, device: torch.device, dtype: torch.dtype, heads: int, kv_heads: int,
                       dim: int) -> float:
    """Max abs error of the kernel vs the reference on runs with q < kv; raises if it is wrong."""
    gen = torch.Generator(device="cpu").manual_seed(0)
    cu_q = np.array([0, 3, 3 + 17, 3 + 17 + 1], dtype=np.int32)     # runs of 3, 17 and 1 queries
    cu_k = np.array([0, 40, 40 + 17, 40 + 17 + 9], dtype=np.int32)  # over 40, 17 and 9 keys
    q = torch.randn(int(cu_q[-1]), heads, dim, generator=gen).to(device, dtype)
    k = torch.randn(int(cu_k[-1]), kv_heads, dim, generator=gen).to(device, dtype)
    v = torch.randn(int(cu_k[-1]), kv_heads, dim, generator=gen).to(device, dtype)
    got = varlen_attention(q, k, v, torch.as_tensor(cu_q, device=device), torch.as_tensor(cu_k, device=device), 17, 40,
                           backend=backend).float()
    want = reference_varlen_attention(q.float(), k.float(), v.float(), cu_q, cu_k).float()
    err = float((got - want).abs().max())
    tol = 2e-2 if dtype != torch.float32 else 1e-4
    if not err <= tol:
        raise SystemExit(f"kernel {backend!r} disagrees with bottom-right causal attention (max abs err {err:.3g} "
                         f"> {tol}); its causal mask is probably top-left aligned; do not use it for CP")
    return err


def profile(args, out: Path) -> dict:
    """Measure the grid row by row, rewriting ``out`` after every shape (``"partial": true`` until the grid is
    done); at the deadline (``--max-seconds``, the kit's ``WLB_KIT_DEADLINE``) stop, flagged, after >= 1 shape."""
    device = torch.device(args.device)
    dtype = DTYPES[args.dtype]
    backend = resolve_backend(args.backend, device)
    err = check_bottom_right(backend, device, dtype, args.heads, args.kv_heads, args.head_dim)
    q_lens = [int(x) for x in args.q_lens.split(",")]
    kv_lens = [int(x) for x in args.kv_lens.split(",")]
    name = torch.cuda.get_device_name(device) if device.type == "cuda" else f"CPU ({platform.processor() or 'cpu'})"
    table: list[list[float | None]] = []
    result = {"format": EFFICIENCY_FORMAT, "device": name,
              "source": (f"scripts/gpu_profile_attention.py backend={backend} torch={torch.__version__} "
                         f"dtype={args.dtype} heads={args.heads} kv_heads={args.kv_heads} head_dim={args.head_dim} "
                         f"tokens={args.tokens} warmup={args.warmup} iters={args.iters} "
                         f"bottom_right_check_err={err:.2e}"),
              "tile": args.tile, "q_lens": q_lens, "kv_lens": kv_lens, "tflops": table}
    flops_per_pair = 4.0 * args.heads * args.head_dim
    deadline = Deadline(args.max_seconds)
    measured = 0
    for q_len in q_lens:
        row: list[float | None] = []
        table.append(row)  # a partial table: rows so far, the last one cut where the sweep is
        for kv_len in kv_lens:
            if q_len > kv_len:
                row.append(None)
                continue
            if deadline.reached(measured):
                print(f"stopped at the deadline before q={q_len}, kv={kv_len}: {measured} shapes measured",
                      flush=True)
                write_json(out, flagged(result, done=False, deadline=deadline))
                return result
            runs = max(1, args.tokens // kv_len)
            # offsets uploaded once, outside the timed region (a host copy per call would bias small shapes)
            cu_q = torch.as_tensor(np.arange(runs + 1, dtype=np.int32) * q_len, device=device)
            cu_k = torch.as_tensor(np.arange(runs + 1, dtype=np.int32) * kv_len, device=device)
            q = torch.randn(runs * q_len, args.heads, args.head_dim, device=device, dtype=dtype)
            k = torch.randn(runs * kv_len, args.kv_heads, args.head_dim, device=device, dtype=dtype)
            v = torch.randn_like(k)
            with torch.no_grad():
                seconds = time_call(lambda q=q, k=k, v=v, cu_q=cu_q, cu_k=cu_k, q_len=q_len, kv_len=kv_len:
                                    varlen_attention(q, k, v, cu_q, cu_k, q_len, kv_len, backend=backend),
                                    args.warmup, args.iters, device)
            flops = runs * float(causal_pairs(q_len, kv_len)) * flops_per_pair
            row.append(float(f"{flops / seconds / 1e12:.6g}"))
            measured += 1
            write_json(out, flagged(result, done=False))
            print(f"q={q_len:>7} kv={kv_len:>7} runs={runs:>4} {seconds * 1e3:9.3f} ms {row[-1]:9.4g} TFLOP/s",
                  flush=True)
            del q, k, v
    write_json(out, flagged(result, done=True))
    return result


def main(argv=None) -> int:
    grid = ",".join(str(128 * 2**i) for i in range(11))
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--out", required=True, help="output JSON (megatron-wlb-attn-efficiency/1)")
    p.add_argument("--q-lens", default=grid, help="comma-separated query-run lengths (default 128..128K, x2)")
    p.add_argument("--kv-lens", default=grid, help="comma-separated key lengths (default 128..128K, x2)")
    p.add_argument("--tokens", type=int, default=131072, help="key tokens per kernel call (runs = tokens // kv)")
    p.add_argument("--heads", type=int, default=32, help="query heads on one GPU (7B at TP=1: 32)")
    p.add_argument("--kv-heads", type=int, default=32, help="key/value heads on one GPU")
    p.add_argument("--head-dim", type=int, default=128)
    p.add_argument("--tile", type=int, default=128, help="kernel tile recorded in the table")
    p.add_argument("--dtype", choices=sorted(DTYPES), default="bf16")
    p.add_argument("--backend", default="auto", help="auto | torch-varlen | flash-attn | reference")
    p.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    p.add_argument("--warmup", type=int, default=3)
    p.add_argument("--iters", type=int, default=10)
    p.add_argument("--max-seconds", type=float, default=None,
                   help="stop after this many seconds (and at WLB_KIT_DEADLINE), keeping what was measured")
    p.add_argument("--smoke", action="store_true", help="tiny CPU-sized run (tests): fp32, 2 heads, small grid")
    args = p.parse_args(argv)
    if args.smoke:  # the CPU whatever the machine has: the reference kernel, fp32
        torch.set_num_threads(1)
        args.device, args.backend = "cpu", "auto"
        args.q_lens, args.kv_lens, args.tokens = "4,8,16", "8,16", 32
        args.heads, args.kv_heads, args.head_dim, args.tile = 2, 1, 8, 4
        args.dtype, args.warmup, args.iters = "fp32", 1, 2
    if args.heads % args.kv_heads:
        raise SystemExit(f"--heads {args.heads} must be a multiple of --kv-heads {args.kv_heads}")
    out = Path(args.out)
    result = profile(args, out)
    finite = [v for row in result["tflops"] for v in row if v is not None]
    print(f"wrote {out}: {len(finite)} shapes, {min(finite):.4g}..{max(finite):.4g} TFLOP/s")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
