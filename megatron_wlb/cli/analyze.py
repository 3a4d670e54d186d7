"""``wlb analyze``: what WLB-LLM buys on your own data and layout, before spending a cluster on it."""

from __future__ import annotations

import argparse
import time


def add_parser(subparsers) -> None:
    p = subparsers.add_parser("analyze", help="compare Plain-4D / Fixed-4D / WLB-LLM on your data and layout",
                              description="Simulate Plain-4D, Fixed-4D, WLB-LLM and Megatron's dynamic CP on "
                                          "your document lengths and run config; print the table and write "
                                          "DIR/report.md with the same figures as wlb reproduce.")
    from megatron_wlb.cli.simulate import add_stream_args

    add_stream_args(p, required=True)
    p.add_argument("--config", required=True, help="config name (configs/*.yaml stem) or YAML path")
    p.add_argument("--profile", metavar="JSON",
                   help="cost-model profile measured on a GPU (format megatron-wlb-profile/1)")
    p.add_argument("--out", default="wlb-analyze", metavar="DIR", help="output folder (default ./wlb-analyze)")
    p.add_argument("--iterations", type=int, default=40, help="iterations per method (default 40)")
    p.set_defaults(func=run)


def run(args: argparse.Namespace) -> int:
    from megatron_wlb.cli.simulate import load_stream, tqdm_progress
    from megatron_wlb.config import load_config
    from megatron_wlb.sim.report import analyze

    if args.iterations < 1:
        raise ValueError(f"--iterations must be at least 1, got {args.iterations}")
    cfg = load_config(args.config)
    lengths, source = load_stream(args)
    start = time.perf_counter()
    path, table = analyze(args.out, cfg, lengths, args.iterations, profile=args.profile, progress=tqdm_progress,
                          source=source)
    print(table.to_markdown())
    print(f"\nwrote {path} and its figures in {time.perf_counter() - start:.0f} s")
    return 0
