"""Host cost of the one-plan batch path, per micro-batch, on this machine's CPU.

For micro-batches packed from the embedded length distribution (whole documents up to T tokens) it
times, per CP layout and size:

- ``plan``: ``data.rank_micro_batch`` in the data iterator: the CP layout of every rank, this
  rank's rows of tokens/labels/loss_mask, its RoPE positions (cp/plan.py), on the host;
- ``upload``: ``cp_hooks.upload_micro_batch``: the one host -> device copy (``cp.device.upload``; here
  device = CPU, so this is the buffer building and the on-device expansion of the all-gather segment index);
- ``per-layer before``: what each attention layer used to redo before the one-plan path (the
  attention metadata: segment index and cu_seqlens, now ``upload(batch, tokens=False)``), done once
  per micro-batch; ``saved`` is that times the model's layers per pipeline stage, minus one.

    python benchmarks/bench_batch_path.py [--layers 32] [--reps 5] [--out benchmarks/results/batch_path]

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

from megatron_wlb.provenance import markdown_table  # noqa: E402


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


def run(layers: int, reps: int, step_ms: float = 100.0) -> dict:
    import torch

    from megatron_wlb.cp.device import upload
    from megatron_wlb.cp.plan import CPSharding
    from megatron_wlb.data import load_lengths
    from megatron_wlb.megatron.data.packed import rank_micro_batch
    from megatron_wlb.megatron.hooks.cp_hooks import upload_micro_batch
    from megatron_wlb.provenance import machine

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
                layer_ms = _median_ms(lambda b=batch: upload(b, cpu, tokens=False), reps)
                rows.append({"tokens": int(sum(p.length for p in mb.pieces)), "documents": len(mb.pieces),
                             "cp": cp, "layout": layout, "chosen": batch.layout.name,
                             "rank_rows": batch.num_rows, "plan_ms": round(plan_ms, 3),
                             "upload_ms": round(upload_ms, 3), "per_layer_before_ms": round(layer_ms, 3),
                             "saved_ms": round(layer_ms * (layers - 1), 2)})
    return {"machine": f"{machine()}, torch {torch.__version__} ({torch.get_num_threads()} threads)",
            "layers": layers, "reps": reps, "rows": rows, "critical": critical_path(lengths, read, step_ms)}


def critical_path(lengths: np.ndarray, read, step_ms: float, iterations: int = 3, n: int = 8) -> list[dict]:
    """Host ms per micro-batch that ``next()`` of the training iterator keeps on the critical path, plain
    (pack + plan + rows, every micro-batch) and with ``PrefetchingIterator`` (the next micro-batch of an
    iteration built on a thread while the step runs: a ``step_ms`` sleep, the host idle as while the GPU
    computes). The first micro-batch of an iteration (its packing) stays on the critical path in both."""
    import tempfile

    from megatron_wlb.cp.plan import CPSharding
    from megatron_wlb.data.indexed import write_index
    from megatron_wlb.data.reader import DocumentReader
    from megatron_wlb.megatron.data.packed import WlbDataIterator
    from megatron_wlb.megatron.data.prefetch import PrefetchingIterator
    from megatron_wlb.packing import make_packer
    from megatron_wlb.packing.types import PackingConfig

    out = []
    for tokens, cp in ((131_072, 8), (131_072, 16)):
        cfg = PackingConfig(seq_len=tokens, n=n, dp=1, max_seq_len=tokens * 3 // 2, max_delay=2)
        docs = lengths[np.cumsum(lengths) <= (iterations + 3) * cfg.tokens_per_iteration]
        # the stream comes from a reader over a synthetic index of these lengths (tokens from ``read``)
        prefix = Path(tempfile.mkdtemp()) / "lengths"
        write_index(prefix, docs.astype(np.int32))
        with open(f"{prefix}.bin", "wb") as f:
            f.truncate(2 * int(docs.sum()))
        stream = DocumentReader([(str(prefix), 1.0)], split="1,0,0", seed=0).stream(int(docs.sum()))
        row: dict = {"tokens": tokens, "cp": cp, "n": n, "step_ms": step_ms}
        for name in ("plain", "prefetch"):
            it = WlbDataIterator(None, stream, make_packer("wlb", cfg), 0,
                                 sharding=CPSharding("adaptive", cp, 0, sequence_multiple=cp), read=read)
            source = PrefetchingIterator(it) if name == "prefetch" else it
            first, rest = [], []
            for _ in range(iterations * n):
                t0 = time.perf_counter()
                next(source)
                (first if it.position == 1 else rest).append((time.perf_counter() - t0) * 1e3)
                time.sleep(step_ms / 1e3)  # the step: the GPU computes, the host waits
            row[f"{name}_first_ms"] = round(statistics.median(first), 3)
            row[f"{name}_rest_ms"] = round(statistics.median(rest), 3)
            row[f"{name}_per_micro_batch_ms"] = round((sum(first) + sum(rest)) / (iterations * n), 3)
            if isinstance(source, PrefetchingIterator):
                source.close()
        out.append(row)
    return out


def to_markdown(result: dict) -> str:
    lines = ["# The one-plan batch path: host cost per micro-batch", "",
             f"`python benchmarks/bench_batch_path.py --layers {result['layers']} --reps {result['reps']}` on "
             f"{result['machine']}. Medians in ms, rank 0 of the CP group. `plan`: the data iterator's "
             "layout + rows (host); `upload`: the one copy to the device (here the CPU); `per layer before`: "
             "the metadata each attention layer rebuilt before the one-plan path (on a GPU also host -> "
             "device copies and, before them, a device -> host read of cu_seqlens per micro-batch); `saved`: "
             f"that x ({result['layers']} - 1) layers per micro-batch.", ""]
    lines += markdown_table(
        ["T", "docs", "CP", "layout (chosen)", "rank rows", "plan", "upload", "per layer before", "saved"],
        ([f"{r['tokens']:,}", r["documents"], r["cp"],
          r["layout"] if r["chosen"] == r["layout"] else f"{r['layout']} ({r['chosen']})", f"{r['rank_rows']:,}",
          f"{r['plan_ms']:.2f}", f"{r['upload_ms']:.2f}", f"{r['per_layer_before_ms']:.2f}", f"{r['saved_ms']:.1f}"]
         for r in result["rows"]), "rrrlrrrrr")
    lines += ["", "## What stays on the critical path (the training iterator's `next()`)", "",
              "Host ms per micro-batch that `next()` takes while the step waits, 128K-token micro-batches, "
              f"`adaptive` CP sharding, {result['critical'][0]['n']} micro-batches per iteration, a step of "
              f"{result['critical'][0]['step_ms']:.0f} ms simulated by the host sleeping (as while the GPU "
              "computes). `first`: the first micro-batch of an iteration (packs the iteration: stays on the "
              "critical path); `rest`: the others (prefetched on a thread); `per micro-batch`: the mean. The "
              "upload is not in these numbers: on a GPU the prefetch thread also sends it from pinned memory on "
              "a side stream (the CPU has none).", ""]
    lines += markdown_table(
        ["T", "CP", "plain first", "plain rest", "plain per mb", "prefetch first", "prefetch rest", "prefetch per mb"],
        ([f"{r['tokens']:,}", r["cp"], *(f"{r[f'{k}_{m}_ms']:.2f}" for k in ("plain", "prefetch")
                                           for m in ("first", "rest", "per_micro_batch"))] for r in result["critical"]),
        "r" * 8)
    return "\n".join(lines) + "\n"


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--layers", type=int, default=32, help="attention layers per stage (default 32, 7B at PP1)")
    parser.add_argument("--reps", type=int, default=5, help="repetitions per measurement (median; default 5)")
    parser.add_argument("--step-ms", type=float, default=100.0, help="simulated step per micro-batch (default 100)")
    parser.add_argument("--out", default="benchmarks/results/batch_path", help="output path without suffix")
    args = parser.parse_args(argv)
    if args.layers < 1 or args.reps < 1 or args.step_ms < 0:
        parser.error(f"--layers {args.layers} and --reps {args.reps} must be >= 1, --step-ms >= 0")
    write_result(args.out, run(args.layers, args.reps, args.step_ms), to_markdown)


if __name__ == "__main__":
    main()
