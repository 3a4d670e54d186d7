"""``wlb reproduce``: every experiment of the paper in the simulator, as DIR/report.md + PNGs."""

from __future__ import annotations

import argparse
import time


def add_parser(subparsers) -> None:
    p = subparsers.add_parser("reproduce", help="reproduce the paper's experiments on CPU (report + figures)",
                              description="Simulate Plain-4D, Fixed-4D, WLB-LLM and Megatron's dynamic CP on "
                                          "every Table 1 config, the 7B-128K breakdown, the window sweep and "
                                          "the 8K-GPU case study; write DIR/report.md with tables and figures. "
                                          "About a minute on 2 CPU cores.")
    p.add_argument("--out", default="wlb-reproduce", metavar="DIR", help="output folder (default ./wlb-reproduce)")
    p.add_argument("--iterations", type=int, help="iterations per config and method (default 40)")
    p.add_argument("--profile", metavar="JSON", help="calibrated cost-model profile instead of the analytic model")
    p.add_argument("--configs", nargs="+", metavar="CFG", help="Table 1 configs to run (default: all eight)")
    p.add_argument("--lengths", metavar="FILE", help="another length stream (default: the embedded one)")
    p.set_defaults(func=run)


def run(args: argparse.Namespace) -> int:
    from dataclasses import replace

    from megatron_wlb.cli.simulate import load_stream, tqdm_progress
    from megatron_wlb.sim.experiments import TABLE1_CONFIGS
    from megatron_wlb.sim.report import ReproduceSettings, reproduce

    settings = ReproduceSettings()
    if args.iterations is not None:
        if args.iterations < 1:
            raise ValueError(f"--iterations must be at least 1, got {args.iterations}")
        settings = replace(settings, iterations=args.iterations, breakdown_iterations=args.iterations,
                           sweep_iterations=args.iterations,
                           case_iterations=max(1, min(settings.case_iterations, args.iterations)))
    lengths, source = load_stream(args)
    start = time.perf_counter()
    path = reproduce(args.out, lengths, settings, configs=tuple(args.configs or TABLE1_CONFIGS),
                     profile=args.profile, progress=tqdm_progress, source=source)
    print(f"wrote {path} and its figures in {time.perf_counter() - start:.0f} s")
    return 0
