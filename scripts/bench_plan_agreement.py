"""Per-iteration cost of the plan agreement (``megatron_wlb.megatron.agreement``) on CPU gloo worlds.

Each rank plans a real global batch (the wlb packer, ``--config``'s packing, dp = the world) and calls
``check_plan_agreement`` on it ``--calls`` times: the digest of the plan plus one all-reduce of two
int64 over the world. Recorded per world size: the median and 90th percentile seconds of a call, over
every rank, and the digest alone.

    flock /work/bench.lock python scripts/bench_plan_agreement.py --out docs/results/plan_agreement
"""

from __future__ import annotations

import argparse
import os
import sys
import tempfile
import time
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parent))
from _results import write_result  # noqa: E402


def rank_main(rank: int, world: int, store: str, config_name: str, calls: int, queue) -> None:
    import dataclasses

    import torch
    import torch.distributed as dist

    from megatron_wlb.config import load_config
    from megatron_wlb.megatron.agreement import check_plan_agreement, plan_key
    from megatron_wlb.packing import make_packer

    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"file://{store}", rank=rank, world_size=world)
    config = dataclasses.replace(load_config(config_name).packing, dp=world)
    lengths = np.random.default_rng(0).lognormal(np.log(1600), 1.0, size=200_000).clip(1, 60_000).astype(np.int64)
    batch = next(make_packer("wlb", config).pack(lengths))
    cpu = torch.device("cpu")
    for _ in range(10):
        check_plan_agreement(batch, device=cpu)
    seconds = [check_plan_agreement(batch, device=cpu) for _ in range(calls)]
    t = time.perf_counter()
    for _ in range(calls):
        plan_key(batch)
    digest = (time.perf_counter() - t) / calls
    queue.put((rank, seconds, digest, sum(len(mb.pieces) for mb in batch.micro_batches)))
    dist.destroy_process_group()


def measure(world: int, config: str, calls: int) -> dict:
    import torch.multiprocessing as mp

    ctx = mp.get_context("spawn")
    queue = ctx.Queue()
    with tempfile.TemporaryDirectory() as tmp:
        procs = [ctx.Process(target=rank_main, args=(r, world, os.path.join(tmp, "store"), config, calls, queue))
                 for r in range(world)]
        for p in procs:
            p.start()
        results = [queue.get(timeout=600) for _ in range(world)]
        for p in procs:
            p.join()
    every = np.concatenate([np.asarray(s) for _, s, _, _ in results])
    return {"world": world, "calls": calls, "median_ms": float(np.median(every) * 1e3),
            "p90_ms": float(np.percentile(every, 90) * 1e3),
            "digest_ms": float(np.mean([d for _, _, d, _ in results]) * 1e3),
            "pieces": results[0][3]}


def to_markdown(result: dict) -> str:
    lines = [f"Plan agreement per iteration ({result['config']} wlb plan, gloo on the CPU); {result['machine']}.", "",
             "| ranks | pieces in the plan | digest | check (digest + all-reduce), median | 90th percentile |",
             "|---:|---:|---:|---:|---:|"]
    for row in result["rows"]:
        lines.append(f"| {row['world']} | {row['pieces']} | {row['digest_ms']:.3f} ms | {row['median_ms']:.3f} ms | "
                     f"{row['p90_ms']:.3f} ms |")
    return "\n".join(lines) + "\n"


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--worlds", default="2,4", help="world sizes, comma-separated")
    p.add_argument("--config", default="550m_64k")
    p.add_argument("--calls", type=int, default=200)
    p.add_argument("--out", default="docs/results/plan_agreement")
    args = p.parse_args(argv)
    from megatron_wlb.cli.common import machine

    rows = [measure(int(w), args.config, args.calls) for w in args.worlds.split(",")]
    write_result(args.out, {"config": args.config, "machine": machine(), "rows": rows}, to_markdown)


if __name__ == "__main__":
    main()
