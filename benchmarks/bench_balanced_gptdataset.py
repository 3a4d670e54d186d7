#!/usr/bin/env python
"""Balance targets of the balanced concat-and-cut in Megatron GPTDataset order, one command:
``python benchmarks/bench_balanced_gptdataset.py [--iterations K] [--streams a,b] [--dp 1,4] [--page]``.

For every frontier stream (``bench_packing.STREAMS``: the embedded stand-in and tests/data/corpora)
megatron-core's own ``GPTDataset`` indices are built over the stream's document lengths
(``megatron_wlb.megatron.data.sample_orders``: seed 1234, split 1,0,0, ``iterations x DP x N`` samples, so
GPTDataset adds the epochs it needs), and its samples, cut at document boundaries, are read in
``MegatronPretrainingSampler`` order. With configs/7b_128k.yaml (N = 4, seq_len 128K, S_max 192K),
at each DP: the concat-and-cut baseline (``original``: each sample one micro-batch) and the balanced
concat-and-cut (``wlb``, ``pieces: concat-and-cut``) with ``read_ahead`` off (the training intake:
no sample trained before the iteration the sampler gives it) and on. The numbers are simulated (the
cost model), not timed. Writes benchmarks/results/balanced_gptdataset.{json,md}.

Targets (issue 30): slowest-DP-rank 1F1B time / balanced <= 1.01 at DP 1 and <= 1.02 at DP 4; tokens
per iteration p5 >= 0.95 of the budget; mean delay <= 0.5 iterations per token, counted from the
iteration GPTDataset's sampler gives each piece.
"""

from __future__ import annotations

import argparse
import dataclasses
import gc
import platform
import sys
import time
import warnings
from importlib import metadata
from pathlib import Path
from typing import Any

import numpy as np

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "benchmarks"))

from _results import record, replace_block  # noqa: E402
from bench_packing import CORPORA_DIR, STREAMS  # noqa: E402

import megatron_wlb  # noqa: E402
from megatron_wlb.config import load_config  # noqa: E402
from megatron_wlb.costmodel import build_cost_model  # noqa: E402
from megatron_wlb.data import load_lengths  # noqa: E402
from megatron_wlb.packing import make_packer, summarize  # noqa: E402
from megatron_wlb.packing.types import GlobalBatch  # noqa: E402
from megatron_wlb.provenance import machine  # noqa: E402

CONFIG = "7b_128k"
SEED = 1234
#: (DP, the schedule target at that DP); fill p5 and mean delay targets hold at every DP
SCHEDULE_TARGET = {1: 1.01, 4: 1.02}
FILL_P5_TARGET = 0.95
DELAY_TARGET = 0.5
#: global batches of samples built beyond those packed (as bench_packing's streams hold 16 more)
SURPLUS = 16
#: (label, packer, PackingConfig overrides) of each row
ROWS: tuple[tuple[str, str, dict[str, Any]], ...] = (("concat-and-cut (GPTDataset samples)", "original", {}),
        ("balanced concat-and-cut, read_ahead off (training default)", "wlb",
         {"pieces": "concat-and-cut", "read_ahead": False}),
        ("balanced concat-and-cut, read_ahead on", "wlb", {"pieces": "concat-and-cut", "read_ahead": True}))


def stream_lengths(name: str) -> np.ndarray:
    """The stream's documents once (GPTDataset repeats them in epochs itself)."""
    if name == "wlbllm":
        return load_lengths("wlbllm")
    path = CORPORA_DIR / f"{name}.npy"
    if not path.exists():
        raise SystemExit(f"corpus {name!r} is not built ({path} is missing): run python benchmarks/build_corpora.py, "
                         f"or name one of {', '.join(STREAMS)}")
    return np.load(path).astype(np.int64)


def gptdataset_delays(batches: list[GlobalBatch], seq_len: int, global_batch: int
                      ) -> tuple[float, int, float, int]:
    """(mean delay, max delay, share of tokens trained early, most iterations early), in iterations per
    token, counted from the iteration Megatron's sampler gives each piece's sample (stream id // seq_len //
    global batch), not from the packer's own arrival (a read-ahead piece arrives when it is read)."""
    delay, tokens = [], []
    for b in batches:
        for p in b.pieces():
            delay.append(b.iteration - (p.doc_id // seq_len) // global_batch)
            tokens.append(p.length)
    d, t = np.asarray(delay, dtype=np.int64), np.asarray(tokens, dtype=np.int64)
    total = max(1, int(t.sum()))
    return (float((np.maximum(d, 0) * t).sum() / total), max(0, int(d.max())) if d.size else 0,
            float(t[d < 0].sum() / total), max(0, -int(d.min())) if d.size else 0)


def versions() -> dict[str, str]:
    def version(dist: str) -> str:
        try:
            return metadata.version(dist)
        except metadata.PackageNotFoundError:
            return "not installed"

    return {"python": platform.python_version(), "numpy": np.__version__, "megatron-core": version("megatron-core"),
            "torch": version("torch"), "megatron_wlb": megatron_wlb.__version__}


def run(streams: list[str], dps: list[int], iterations: int) -> dict:
    from megatron_wlb.megatron.data.sample_orders import gpt_sample_order, sample_stream

    cfg = load_config(CONFIG)
    tables = []
    for dp in dps:
        packing0 = dataclasses.replace(cfg.packing, dp=dp)
        cost = build_cost_model(cfg.model, dataclasses.replace(cfg.layout, dp=dp))
        global_batch = packing0.micro_batches_per_iteration
        for stream in streams:
            lengths = stream_lengths(stream)
            t0 = time.perf_counter()
            with warnings.catch_warnings():
                warnings.simplefilter("ignore")
                # SURPLUS more global batches than are packed: no row runs into the end of the samples
                order, name = gpt_sample_order(lengths, packing0.seq_len, (iterations + SURPLUS) * global_batch, SEED)
            build_s = time.perf_counter() - t0
            epochs = int(order.datasets[0].document_index.size // lengths.size)
            rows = []
            for label, packer_name, over in ROWS:
                packing = dataclasses.replace(packing0, **over)
                packer = make_packer(packer_name, packing, cost)
                t0 = time.perf_counter()
                gc.disable()
                try:
                    batches = []
                    for batch in packer.pack_source(sample_stream(order, name).cursor()):
                        batches.append(batch)
                        if len(batches) >= iterations:
                            break
                finally:
                    gc.enable()
                wall = time.perf_counter() - t0
                m = summarize(batches, cost, packing.seq_len)
                delay, max_delay, early, most_early = gptdataset_delays(batches, packing.seq_len, global_batch)
                rows.append({"label": label, "packer": packer_name, "overrides": over, "wall_s": wall,
                             "schedule_ratio": m.schedule_ratio, "schedule_ratio_max": m.schedule_ratio_max,
                             "imbalance": m.imbalance, "fill_p5": m.fill_p5, "min_fill": m.min_fill,
                             "mean_delay": delay, "max_delay": max_delay, "early_tokens": early,
                             "max_early": most_early,
                             "packer_mean_delay": m.mean_delay, "pairs_per_token": m.pairs_per_token,
                             "plan_cpu_ms_mean": m.plan_cpu_ms_mean, "iterations": m.iterations})
                print(f"dp {dp} {stream:8s} {label:58s} sched {m.schedule_ratio:.4f} fill p5 {m.fill_p5:.3f} "
                      f"delay {delay:.3f} early {early:.3f} ({wall:.1f} s)", file=sys.stderr, flush=True)
            tables.append({"stream": stream, "dp": dp, "n": packing0.n, "seq_len": packing0.seq_len,
                           "max_seq_len": packing0.capacity_var, "documents": int(lengths.size),
                           "tokens": int(lengths.sum()), "epochs": epochs, "samples": len(order),
                           "index_build_s": build_s, "cost_model": cost.describe(), "rows": rows})
    return {"machine": machine(), "versions": versions(), "command": "python benchmarks/bench_balanced_gptdataset.py"
            + ("" if iterations == 200 else f" --iterations {iterations}"), "iterations": iterations, "seed": SEED,
            "split": "1,0,0", "config": CONFIG,
            "targets": {"schedule_ratio": {str(k): v for k, v in SCHEDULE_TARGET.items()},
                        "fill_p5": FILL_P5_TARGET, "mean_delay": DELAY_TARGET},
            "tables": tables}


def meets(row: dict, dp: int) -> bool:
    """Whether a balanced row meets every target (the schedule target of the nearest DP listed)."""
    target = SCHEDULE_TARGET.get(dp, max(SCHEDULE_TARGET.values()))
    return bool(row["schedule_ratio"] <= target and row["fill_p5"] >= FILL_P5_TARGET
                and row["mean_delay"] <= DELAY_TARGET)


def to_markdown(result: dict) -> str:
    v = result["versions"]
    lines = ["# Balanced concat-and-cut in Megatron GPTDataset order: balance targets", "",
             f"Machine: {result['machine']}. Versions: Python {v['python']}, numpy {v['numpy']}, megatron-core "
             f"{v['megatron-core']}, torch {v['torch']}, megatron_wlb {v['megatron_wlb']}. Generated by "
             f"`{result['command']}` ({result['iterations']} global batches per row; configs/{result['config']}.yaml, "
             f"7B cost model; simulated, not timed).", "",
             f"Samples: megatron-core's own GPTDataset indices over each stream's document lengths (seed "
             f"{result['seed']}, split {result['split']}, (iterations + 16) x DP x N samples; GPTDataset repeats the "
             "corpus in epochs as it needs), read in MegatronPretrainingSampler order and cut at document "
             "boundaries (per-document masking). schedule = sum over iterations of the slowest DP rank's 1F1B time "
             "/ the same with every micro-batch at the iteration's mean (1.000 = balanced); fill p5 = 5th "
             "percentile of an iteration's tokens / (DP x N x seq_len); delay = iterations per token past the "
             "iteration the sampler gives the piece's sample, token-weighted (early = share of tokens trained "
             "before it, and by at most how many iterations: read_ahead on only).", "",
             f"Targets: schedule <= {SCHEDULE_TARGET[1]} at DP 1 and <= {SCHEDULE_TARGET[4]} at DP 4, fill p5 >= "
             f"{FILL_P5_TARGET}, mean delay <= {DELAY_TARGET}.", "",
             "| stream | DP | concat-and-cut schedule | read_ahead off: schedule / fill p5 / delay / max delay | "
             "meets | read_ahead on: schedule / fill p5 / delay / early / max early | meets |",
             "|---|---|---|---|---|---|---|"]
    for t in sorted(result["tables"], key=lambda t: (t["dp"], STREAMS.index(t["stream"]) if t["stream"] in STREAMS
                                                      else 99)):
        base, off, on = t["rows"]
        lines.append(f"| {t['stream']} | {t['dp']} | {base['schedule_ratio']:.3f} | {off['schedule_ratio']:.3f} / "
                     f"{off['fill_p5']:.3f} / {off['mean_delay']:.2f} / {off['max_delay']} | "
                     f"{'yes' if meets(off, t['dp']) else '**no**'} | {on['schedule_ratio']:.3f} / "
                     f"{on['fill_p5']:.3f} / {on['mean_delay']:.2f} / {on['early_tokens']:.3f} / {on['max_early']} | "
                     f"{'yes' if meets(on, t['dp']) else '**no**'} |")
    lines += ["", "Streams: " + "; ".join(f"{t['stream']} {t['documents']:,} documents, {t['tokens']:,} tokens, "
                                          f"{t['epochs']} epochs at DP {t['dp']}" for t in result["tables"]) + ".", ""]
    return "\n".join(lines)


README_BEGIN, README_END = "<!-- balanced-gptdataset -->", "<!-- /balanced-gptdataset -->"


def _span(values: list[float], digits: int) -> str:
    lo, hi = f"{min(values):.{digits}f}", f"{max(values):.{digits}f}"
    return lo if lo == hi else f"{lo}-{hi}"


def readme_summary(result: dict) -> str:
    """The the results page's sentences on the balance the training intake (read_ahead off) leaves, from ``result``."""
    def rows(dp: int, k: int) -> list[dict]:
        return [t["rows"][k] for t in result["tables"] if t["dp"] == dp]

    dps = sorted({t["dp"] for t in result["tables"]})
    lo, hi = dps[0], dps[-1]
    off_all = [r for dp in dps for r in rows(dp, 1)]
    on_all = [r for dp in dps for r in rows(dp, 2)]
    short = [r["fill_p5"] for r in rows(lo, 1) if r["fill_p5"] < FILL_P5_TARGET]
    return (f"slowest DP rank's 1F1B time over balanced {_span([r['schedule_ratio'] for r in rows(lo, 1)], 2)} at DP "
            f"{lo} and {_span([r['schedule_ratio'] for r in rows(hi, 1)], 2)} at DP {hi} (concat-and-cut: "
            f"{_span([r['schedule_ratio'] for r in rows(lo, 0)], 2)} and "
            f"{_span([r['schedule_ratio'] for r in rows(hi, 0)], 2)}), mean delay "
            f"{_span([r['mean_delay'] for r in off_all], 2)} iterations, at most "
            f"{max(r['max_delay'] for r in off_all)}. "
            "Because no sample is trained before its iteration (no read-ahead), an iteration whose outliers wait "
            f"is short: the 5th percentile of tokens per iteration is {_span(short, 2) if short else 'never'} of the "
            f"budget on {len(short)} of {len(rows(lo, 1))} streams at DP {lo}, "
            f"{_span([r['fill_p5'] for r in rows(hi, 1)], 2)} at DP {hi}. With `packing.read_ahead: true` the "
            "schedule is "
            f"{_span([r['schedule_ratio'] for r in on_all], 2)} and the fill p5 "
            f"{_span([r['fill_p5'] for r in on_all], 2)}, but up to {max(r['early_tokens'] for r in on_all):.0%} of a "
            "stream's tokens are then trained before the iteration Megatron gives them (at most "
            f"{max(r['max_early'] for r in on_all)} iterations before).")


def update_readme(result: dict, path: Path) -> None:
    """Write ``readme_summary`` between the results page's balanced-gptdataset markers."""
    replace_block(path, README_BEGIN, README_END, readme_summary(result))


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--iterations", type=int, default=200, help="global batches per row (default 200)")
    ap.add_argument("--streams", default=",".join(STREAMS), help=f"comma-separated (default {','.join(STREAMS)})")
    ap.add_argument("--dp", default="1,4", help="data-parallel sizes, comma-separated (default 1,4)")
    ap.add_argument("--out", default=str(ROOT / "benchmarks" / "results" / "balanced_gptdataset"),
                    help="output path without suffix (.json and .md are written)")
    ap.add_argument("--page", action="store_true", help="also write the summary sentences into benchmarks/results.md")
    args = ap.parse_args(argv)
    if args.iterations < 1:
        raise SystemExit(f"--iterations must be >= 1, got {args.iterations}")
    streams = [s for s in args.streams.split(",") if s]
    for s in streams:
        stream_lengths(s)  # a missing corpus fails before any work
    try:
        dps = [int(d) for d in args.dp.split(",") if d]
    except ValueError:
        raise SystemExit(f"--dp must be comma-separated positive integers, got {args.dp!r}") from None
    if not dps or min(dps) < 1:
        raise SystemExit(f"--dp must be comma-separated positive integers, got {args.dp!r}")
    result = run(streams, dps, args.iterations)
    return record(args.out, result, to_markdown, update_readme if args.page else None)


if __name__ == "__main__":
    sys.exit(main())
