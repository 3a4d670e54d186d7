"""Host cost of the one-plan batch path, per micro-batch, on this machine's CPU.

For micro-batches packed from the embedded length distribution (whole documents up to T tokens) it
times, per CP layout and size:

- ``plan``: ``data.rank_micro_batch`` in the data iterator: the CP layout of every rank, this
  rank's rows of tokens/labels/loss_mask, its RoPE positions (cp/plan.py), on the host;
- ``upload``: ``cp_hooks.upload_micro_batch``: the host -> device copies (here device = CPU, so this
  is the tensor building and the on-device expansion of the all-gather segment index);
- ``per-layer before``: what each attention layer used to redo before the one-plan path
  (``CPAttentionMetadata.from_shard``: segment index and cu_seqlens uploads), now done once per
  micro-batch; ``saved`` is that times the model's layers per pipeline stage, minus one.

    python scripts/bench_batch_path.py [--layers 32] [--reps 5] [--out docs/results/batch_path]

Rank 0 of each CP group is timed (all ranks do the same work). Medians over ``--reps``.
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parent))
from _results import write_result  # noqa: E402


def _micro_batch(lengths: np.ndarray, tokens: int, start: int):
    from megatron_wlb.packing.types import DocPiece, MicroBatch

    pieces, total, i = [], 0, start
    while total + int(lengths[i % lengths.size]) <= tokens or not pieces:
        n = min(int(lengths[i % lengths.size]), tokens)
        pieces.append(DocPiece(i, 0, n, 0))
        total += n
        i += 1
    return MicroBatch(tuple(pieces), capacity=tokens), i


def _median_ms(fn, reps: int) -> float:
    times = []
    for _ in range(reps):
        t0 = time.perf_counter()
        fn()
        times.append((time.perf_counter() - t0) * 1e3)
    return statistics.median(times)


def run(layers: int, reps: int) -> dict:
    import torch

    from megatron_wlb.cli.common import machine
    from megatron_wlb.cp.attention import CPAttentionMetadata
    from megatron_wlb.cp.plan import CPSharding
    from megatron_wlb.data import load_lengths
    from megatron_wlb.megatron.cp_hooks import upload_micro_batch
    from megatron_wlb.megatron.data import rank_micro_batch

    lengths = np.random.default_rng(0).permutation(load_lengths())
    rng = np.random.default_rng(1)
    text = rng.integers(0, 32000, size=262_144, dtype=np.int64)

    def read(doc: int, offset: int, length: int) -> np.ndarray:
        at = (doc * 7919) % (text.size - length)
        return text[at + offset: at + offset + length]

    rows = []
    cpu = torch.device("cpu")
    for tokens in (65_536, 131_072):
        mb, _ = _micro_batch(lengths, tokens, start=1000)
        for cp in (2, 4, 8):
            for layout in ("per-sequence", "per-document", "adaptive", "hybrid"):
                sharding = CPSharding(layout, cp, 0, sequence_multiple=cp)
                batch = rank_micro_batch(read, mb, sharding)
                plan_ms = _median_ms(lambda s=sharding, m=mb: rank_micro_batch(read, m, s), reps)
                upload_ms = _median_ms(lambda b=batch: upload_micro_batch(b, cpu, cp_group=None), reps)
                layer_ms = _median_ms(lambda b=batch: CPAttentionMetadata.from_shard(b.plan.shard, cpu), reps)
                rows.append({"tokens": int(sum(p.length for p in mb.pieces)), "documents": len(mb.pieces),
                             "cp": cp, "layout": layout, "chosen": batch.plan.layout.name,
                             "rank_rows": batch.plan.num_rows, "plan_ms": round(plan_ms, 3),
                             "upload_ms": round(upload_ms, 3), "per_layer_before_ms": round(layer_ms, 3),
                             "saved_ms": round(layer_ms * (layers - 1), 2)})
    return {"machine": f"{machine()}, torch {torch.__version__} ({torch.get_num_threads()} threads)",
            "layers": layers, "reps": reps, "rows": rows}


def to_markdown(result: dict) -> str:
    lines = ["# The one-plan batch path: host cost per micro-batch", "",
             f"`python scripts/bench_batch_path.py --layers {result['layers']} --reps {result['reps']}` on "
             f"{result['machine']}. Medians in ms, rank 0 of the CP group. `plan`: the data iterator's "
             "layout + rows (host); `upload`: the one copy to the device (here the CPU); `per layer before`: "
             "the metadata each attention layer rebuilt before the one-plan path (on a GPU also host -> "
             "device copies and, before them, a device -> host read of cu_seqlens per micro-batch); `saved`: "
             f"that x ({result['layers']} - 1) layers per micro-batch.", "",
             "| T | docs | CP | layout (chosen) | rank rows | plan | upload | per layer before | saved |",
             "|---:|---:|---:|---|---:|---:|---:|---:|---:|"]
    for r in result["rows"]:
        chosen = r["layout"] if r["chosen"] == r["layout"] else f"{r['layout']} ({r['chosen']})"
        lines.append(f"| {r['tokens']:,} | {r['documents']} | {r['cp']} | {chosen} | {r['rank_rows']:,} | "
                     f"{r['plan_ms']:.2f} | {r['upload_ms']:.2f} | {r['per_layer_before_ms']:.2f} | "
                     f"{r['saved_ms']:.1f} |")
    return "\n".join(lines) + "\n"


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--layers", type=int, default=32, help="attention layers per stage (default 32, 7B at PP1)")
    parser.add_argument("--reps", type=int, default=5, help="repetitions per measurement (median; default 5)")
    parser.add_argument("--out", default="docs/results/batch_path", help="output path without suffix")
    args = parser.parse_args(argv)
    if args.layers < 1 or args.reps < 1:
        parser.error(f"--layers {args.layers} and --reps {args.reps} must be >= 1")
    write_result(args.out, run(args.layers, args.reps), to_markdown)


if __name__ == "__main__":
    main()
