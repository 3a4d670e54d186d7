#!/usr/bin/env python
"""Check the CP attention kernel path against the reference, forward and backward, for every layout.

    python scripts/gpu_kernel_check.py --out OUT.json              # on the GPU: bf16 kernel vs fp32 reference
    python scripts/gpu_kernel_check.py --smoke --out OUT.json      # the CPU, tiny shapes (the kit's dry run)

For each layout, CP size and micro-batch (documents of mixed lengths, some shorter than 2*CP), every
rank's attention runs as in training: ``all_gather_cp_attention`` at CP = 1, and at CP > 1 each rank's
queries against its key segments (``kv_index``) in one varlen kernel call (one GPU plays every rank, as
scripts/gpu_cp_latency.py does). Outputs and dq/dk/dv are compared with ``reference_varlen_attention``
in fp32 on the same inputs; GQA (fewer K/V heads) included, so torch 2.11's path without ``enable_gqa``
(``FlashVarlenGQA``) is checked too. Exit status 1 if any case exceeds the tolerance. The JSON names the
device as ``torch.cuda.get_device_name()`` reports it; it is rewritten after every case (``"partial": true``
until all are done), and at ``--max-seconds`` or the kit's deadline (``WLB_KIT_DEADLINE``) the checks stop
there, ``"stopped_at_deadline": true`` (exit status 0 unless a case done failed).
"""

from __future__ import annotations

import argparse
import platform
import sys
import time
from pathlib import Path

if __package__ in (None, ""):
    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import torch

from megatron_wlb.cp import LAYOUT_NAMES, build_layout
from megatron_wlb.cp.attention import (
    all_gather_cp_attention,
    reference_varlen_attention,
    resolve_backend,
    varlen_attention,
)
from megatron_wlb.cp.device import upload
from megatron_wlb.cp.plan import layout_batch
from megatron_wlb.kit import Deadline, flagged, write_json

MIXES = ([1, 1, 3, 1], [5, 1, 9, 33, 2], [64, 7, 129, 16, 300])


def _grads(fn, inputs: list[torch.Tensor], grad_out: torch.Tensor) -> tuple[torch.Tensor, list[torch.Tensor]]:
    leaves = [t.detach().clone().requires_grad_(True) for t in inputs]
    out = fn(*leaves)
    out.backward(grad_out.to(out.dtype))
    return out.detach().float(), [t.grad.float() for t in leaves]  # type: ignore[union-attr]


def check_case(lengths: list[int], cp: int, layout: str, heads: int, kv_heads: int, dim: int, device: torch.device,
               dtype: torch.dtype, backend: str, seed: int) -> dict:
    lay = build_layout(layout, lengths, cp, tile=4)
    gen = torch.Generator().manual_seed(seed)
    worst = 0.0
    for rank, shard in enumerate(lay.ranks):
        if shard.num_tokens == 0:
            continue
        keys = int(shard.key_lengths.sum()) if cp > 1 else shard.num_tokens
        q = torch.randn(shard.num_tokens, heads, dim, generator=gen)
        k = torch.randn(keys, kv_heads, dim, generator=gen)
        v = torch.randn(keys, kv_heads, dim, generator=gen)
        g = torch.randn(shard.num_tokens, heads, dim, generator=gen)
        cu_q = torch.as_tensor(shard.cu_seqlens_q, dtype=torch.int32)
        cu_k = torch.as_tensor(shard.cu_seqlens_k, dtype=torch.int32)
        if cp == 1:  # the training entry point itself (segments picked from the local K/V)
            meta = upload(layout_batch(lay, rank), device, tokens=False)

            def kernel(q_, k_, v_, meta=meta):
                return all_gather_cp_attention(q_, k_, v_, meta.varlen, meta.gather, None, backend=backend)

            def reference(q_, k_, v_, shard=shard):
                rows = torch.as_tensor(shard.gather_rows(), dtype=torch.long)
                return reference_varlen_attention(q_, k_[rows], v_[rows], shard.cu_seqlens_q, shard.cu_seqlens_k)
        else:
            dev_cu = (cu_q.to(device), cu_k.to(device))

            def kernel(q_, k_, v_, shard=shard, dev_cu=dev_cu):
                return varlen_attention(q_, k_, v_, *dev_cu, shard.max_seqlen_q, shard.max_seqlen_k, backend=backend)

            def reference(q_, k_, v_, cu_q=cu_q, cu_k=cu_k):
                return reference_varlen_attention(q_, k_, v_, cu_q, cu_k)
        got, got_grads = _grads(kernel, [t.to(device, dtype) for t in (q, k, v)], g.to(device))
        want, want_grads = _grads(reference, [q, k, v], g)
        for a, b in zip([got, *got_grads], [want, *want_grads]):
            scale = float(b.abs().max()) or 1.0
            worst = max(worst, float((a.cpu() - b).abs().max()) / scale)
    return {"layout": layout, "used": lay.name, "cp": cp, "lengths": lengths, "max_rel_err": worst}


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--out", required=True)
    p.add_argument("--cps", default="1,2,4,8")
    p.add_argument("--heads", type=int, default=32)
    p.add_argument("--kv-heads", type=int, default=8)
    p.add_argument("--head-dim", type=int, default=128)
    p.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    p.add_argument("--tolerance", type=float, default=2e-2, help="max error relative to the reference's max")
    p.add_argument("--max-seconds", type=float, default=None,
                   help="stop after this many seconds (and at WLB_KIT_DEADLINE), keeping the checks done")
    p.add_argument("--smoke", action="store_true", help="the CPU, tiny shapes, fp64 reference vs fp32 path")
    args = p.parse_args(argv)
    if args.smoke:
        torch.set_num_threads(1)
        args.device, args.cps, args.heads, args.kv_heads, args.head_dim = "cpu", "1,2", 4, 2, 8
    device = torch.device(args.device)
    dtype = torch.bfloat16 if device.type == "cuda" else torch.float32
    backend = resolve_backend("auto", device, dtype)
    out = Path(args.out)
    name = torch.cuda.get_device_name(device) if device.type == "cuda" else f"CPU ({platform.processor() or 'cpu'})"
    start = time.perf_counter()
    deadline = Deadline(args.max_seconds)
    todo = [(mix, cp, layout) for mix in MIXES for cp in map(int, args.cps.split(",")) for layout in LAYOUT_NAMES]
    cases: list[dict] = []

    def write(done: bool) -> dict:
        failed = sum(not c["max_rel_err"] <= args.tolerance for c in cases)
        result = {"device": name, "torch": torch.__version__, "backend": backend, "dtype": str(dtype).split(".")[-1],
                  "heads": args.heads, "kv_heads": args.kv_heads, "head_dim": args.head_dim,
                  "tolerance": args.tolerance, "seconds": time.perf_counter() - start, "cases": cases,
                  "planned": len(todo), "failed": failed, "worst": max((c["max_rel_err"] for c in cases), default=0.0)}
        write_json(out, flagged(result, done=done, deadline=deadline))
        return result

    for i, (mix, cp, layout) in enumerate(todo):
        if deadline.reached(len(cases)):
            print(f"stopped at the deadline after {len(cases)} of {len(todo)} kernel checks", flush=True)
            break
        cases.append(check_case(list(mix), cp, layout, args.heads, args.kv_heads, args.head_dim, device, dtype,
                                backend, seed=i))
        write(done=False)
    result = write(done=not deadline.stopped)
    print(f"{len(cases)} kernel checks on {name} ({backend}, {result['dtype']}): worst relative error "
          f"{result['worst']:.3g}, {result['failed']} over {args.tolerance}; wrote {out}")
    return 1 if result["failed"] else 0


if __name__ == "__main__":
    raise SystemExit(main())
