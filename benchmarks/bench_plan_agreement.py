"""Cost of the agreements (``megatron_wlb.megatron.state.agreement``): per iteration on CPU gloo worlds, and at
start-up per dataset size.

Per iteration: the world is DP x CP2 (CP groups of two ranks). Each rank plans a real global batch (the wlb
packer, ``--config``'s packing, dp = world / 2), lays its DP rank's micro-batches out over CP (adaptive) and
digests the layouts, then calls ``check_plan_agreement`` ``--calls`` times: the plan's digest plus one
all-reduce of ``2 + 2 * dp`` int64 over the world. Recorded per world size: the median and 90th percentile
seconds of a call over every rank, the digest alone, and the layouts (once per iteration, with the plan).

At start-up: the fingerprint of one dataset of 1e6 .. ``--docs`` documents (a synthetic ``.idx`` written whole,
a sparse ``.bin``): the whole ``.idx``'s sha256 and the sampled ``.bin``'s, seconds (best of 3).

    flock /work/bench.lock python benchmarks/bench_plan_agreement.py --page
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
from _results import RESULTS_PAGE, write_result  # noqa: E402

from megatron_wlb.provenance import markdown_table  # noqa: E402

README_MARKER = "<!-- agreement-table -->"
README_END = "<!-- /agreement-table -->"
CP = 2


def rank_main(rank: int, world: int, store: str, config_name: str, calls: int, queue) -> None:
    import dataclasses

    import torch
    import torch.distributed as dist

    from megatron_wlb.config import load_config
    from megatron_wlb.cp.layouts import layout_digest
    from megatron_wlb.cp.plan import CPSharding
    from megatron_wlb.megatron.data.packed import plan_micro_batch
    from megatron_wlb.megatron.state.agreement import check_plan_agreement, plan_key
    from megatron_wlb.packing import make_packer

    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"file://{store}", rank=rank, world_size=world)
    dp, dp_rank = world // CP, rank // CP
    config = dataclasses.replace(load_config(config_name).packing, dp=dp)
    lengths = np.random.default_rng(0).lognormal(np.log(1600), 1.0, size=200_000).clip(1, 60_000).astype(np.int64)
    batch = next(make_packer("wlb", config).pack(lengths))
    sharding = CPSharding("adaptive", CP, rank % CP, sequence_multiple=CP)
    mine = batch.micro_batches[dp_rank * config.n:(dp_rank + 1) * config.n]
    def lay_out() -> list[tuple[str, int]]:
        return [(p.layout.name, layout_digest(p.layout)) for p in (plan_micro_batch(mb, sharding) for mb in mine)]

    layouts = lay_out()  # the first builds the layouts' pricing tables (once per process)
    layout_s = float(np.median([_timed(lay_out) for _ in range(20)]))
    cpu = torch.device("cpu")

    def check() -> float:
        return check_plan_agreement(batch, device=cpu, dp_rank=dp_rank, dp_size=dp, layouts=layouts)

    for _ in range(10):
        check()
    seconds = [check() for _ in range(calls)]
    t = time.perf_counter()
    for _ in range(calls):
        plan_key(batch)
    digest = (time.perf_counter() - t) / calls
    queue.put((rank, seconds, digest, sum(len(mb.pieces) for mb in batch.micro_batches), layout_s, len(mine)))
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
    every = np.concatenate([np.asarray(r[1]) for r in results])
    return {"world": world, "dp": world // CP, "cp": CP, "calls": calls, "median_ms": float(np.median(every) * 1e3),
            "p90_ms": float(np.percentile(every, 90) * 1e3),
            "digest_ms": float(np.mean([r[2] for r in results]) * 1e3),
            "pieces": results[0][3], "layouts_ms": float(np.median([r[4] for r in results]) * 1e3),
            "micro_batches_per_rank": results[0][5]}


def fingerprint_seconds(documents: int, directory: str) -> dict:
    """Best-of-3 seconds of ``dataset_fingerprint`` on a synthetic dataset of ``documents`` documents (its .idx
    written whole, its .bin sparse: sampling reads holes as zeros, at the same cost as data in page cache)."""
    from megatron_wlb.data.fingerprint import dataset_fingerprint
    from megatron_wlb.data.indexed import write_index

    prefix = os.path.join(directory, f"d{documents}")
    lengths = np.full(documents, 1000, dtype=np.int32)
    write_index(prefix, lengths, dtype=np.uint16)
    with open(f"{prefix}.bin", "wb") as f:
        f.truncate(int(lengths.sum(dtype=np.int64)) * 2)
    best = min(_timed(dataset_fingerprint, prefix) for _ in range(3))
    idx_bytes = os.path.getsize(f"{prefix}.idx")
    for ext in (".idx", ".bin"):
        os.unlink(prefix + ext)
    return {"documents": documents, "idx_mib": idx_bytes / 2**20, "seconds": best}


def _timed(fn, *args) -> float:
    t = time.perf_counter()
    fn(*args)
    return time.perf_counter() - t


def readme_table(result: dict) -> str:
    """The the results page's table: per-iteration rows, then the start-up fingerprint rows."""
    return "\n".join(markdown_table(
        ["ranks (DP x CP)", "pieces in the plan", "digest", "layouts of a DP rank's micro-batches",
         "check (digest + all-reduce), median", "90th percentile"],
        ([f"{row['world']} ({row['dp']} x {row['cp']})", row["pieces"], f"{row['digest_ms']:.3f} ms",
          f"{row['layouts_ms']:.1f} ms ({row['micro_batches_per_rank']})", f"{row['median_ms']:.3f} ms",
          f"{row['p90_ms']:.3f} ms"] for row in result["rows"]), "r" * 6)) + "\n"


def startup_table(result: dict) -> str:
    return "\n".join(markdown_table(
        ["documents", ".idx", "fingerprint (whole .idx + sampled .bin)"],
        ([f"{row['documents']:.0e}", f"{row['idx_mib']:.0f} MiB", f"{row['seconds']:.2f} s"]
         for row in result["startup"]), "rrr")) + "\n"


def readme_block(result: dict) -> str:
    """What the README holds between its agreement markers."""
    return (readme_table(result) + "\nAt start-up, the fingerprint of one dataset (per rank, once):\n\n"
            + startup_table(result))


def to_markdown(result: dict) -> str:
    return (f"Agreement per iteration ({result['config']} wlb plan, gloo on the CPU; layouts: adaptive over CP2, "
            f"once per iteration with the plan); {result['machine']}.\n\n{readme_table(result)}\n"
            f"Start-up fingerprint of one dataset, per rank:\n\n{startup_table(result)}")


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--worlds", default="2,4", help="world sizes, comma-separated")
    p.add_argument("--config", default="550m_64k")
    p.add_argument("--calls", type=int, default=200)
    p.add_argument("--docs", type=float, default=1e8, help="largest dataset of the start-up rows (documents)")
    p.add_argument("--out", default="benchmarks/results/plan_agreement")
    p.add_argument("--page", action="store_true", help="also write the results page's table")
    args = p.parse_args(argv)
    from megatron_wlb.provenance import machine

    worlds = [int(w) for w in args.worlds.split(",")]
    if any(w % CP for w in worlds):
        raise SystemExit(f"--worlds {args.worlds}: each world is DP x CP{CP}, so a multiple of {CP}")
    rows = [measure(w, args.config, args.calls) for w in worlds]
    sizes = [n for n in (10**6, 10**7, 10**8, 10**9) if n <= args.docs]
    with tempfile.TemporaryDirectory() as tmp:
        startup = []
        for n in sizes:
            startup.append(fingerprint_seconds(n, tmp))
            print(f"fingerprint at {n:.0e} documents: {startup[-1]['seconds']:.2f} s", flush=True)
    result = {"config": args.config, "machine": machine(), "rows": rows, "startup": startup}
    write_result(args.out, result, to_markdown)
    if args.page:
        readme = RESULTS_PAGE
        before, rest = readme.read_text().split(README_MARKER + "\n", 1)
        after = rest.split(README_END, 1)[1]
        readme.write_text(f"{before}{README_MARKER}\n{readme_block(result)}{README_END}{after}")


if __name__ == "__main__":
    main()
