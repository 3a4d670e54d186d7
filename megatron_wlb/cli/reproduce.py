"""``wlb reproduce``: every experiment of the paper in the simulator, as DIR/report.md + PNGs.

``--page benchmarks/results.md`` also rewrites that page's block between ``<!-- reproduce-table -->`` and
``<!-- /reproduce-table -->`` with the generated table and summary, and copies the speedup figure to
``img/reproduce_speedups.png`` beside it, so the page's numbers come from this one command.
"""

from __future__ import annotations

import argparse
import shutil
import time
from dataclasses import replace
from pathlib import Path

from megatron_wlb.cli.common import cost_profile, load_stream, output_dir, tqdm_progress, with_virtual_stages
from megatron_wlb.config import load_config
from megatron_wlb.sim.experiments import CASE_STUDY_CONFIG, TABLE1_CONFIGS
from megatron_wlb.sim.report import ReproduceSettings, reproduce

README_BEGIN = "<!-- reproduce-table -->"
README_END = "<!-- /reproduce-table -->"
README_FIGURE = "img/reproduce_speedups.png"


def add_parser(subparsers: argparse._SubParsersAction) -> None:
    p = subparsers.add_parser("reproduce", help="reproduce the paper's experiments on CPU (report + figures)",
                              description="Simulate both Plain-4D baselines (concat-and-cut, whole-document), "
                                          "Fixed-4D, WLB-LLM and Megatron's dynamic CP on every Table 1 config "
                                          "under interleaved 1F1B, with a schedule sweep and an ablation, the "
                                          "7B-128K breakdown, the window sweep and the 8K-GPU case study; write "
                                          "DIR/report.md with tables and figures. About a minute on 2 CPU cores.")
    p.add_argument("--out", default="wlb-reproduce", metavar="DIR", help="output folder (default ./wlb-reproduce)")
    p.add_argument("--iterations", type=int, help="iterations per config and method (default 100)")
    p.add_argument("--virtual-stages", type=int, metavar="V",
                   help="virtual stages of the main tables' interleaved 1F1B (default 2; 1 = plain 1F1B)")
    p.add_argument("--cost-profile", metavar="JSON", help="calibrated cost-model profile instead of the analytic model")
    p.add_argument("--configs", nargs="+", metavar="CFG", help="Table 1 configs to run (default: all eight)")
    p.add_argument("--lengths", metavar="FILE", help="another length stream (default: the embedded one)")
    p.add_argument("--page", metavar="PAGE",
                   help=f"also rewrite PAGE's block between {README_BEGIN} markers and {README_FIGURE} beside it "
                        "(the results page: benchmarks/results.md)")
    p.set_defaults(func=run)


def splice_readme(text: str, block: str) -> str:
    """``text`` with everything between the reproduce-table markers replaced by ``block``."""
    start, end = text.find(README_BEGIN), text.find(README_END)
    if start < 0 or end < start:
        raise ValueError(f"the page has no {README_BEGIN} ... {README_END} block to rewrite")
    return text[:start + len(README_BEGIN)] + "\n" + block.strip("\n") + "\n" + text[end:]


def run(args: argparse.Namespace) -> int:

    settings = ReproduceSettings()
    if args.iterations is not None:
        if args.iterations < 1:
            raise ValueError(f"--iterations must be at least 1, got {args.iterations}")
        settings = replace(settings, iterations=args.iterations, breakdown_iterations=args.iterations,
                           sweep_iterations=args.iterations,
                           case_iterations=max(1, min(settings.case_iterations, args.iterations)))
    if args.virtual_stages is not None:
        if args.virtual_stages < 1:
            raise ValueError(f"--virtual-stages must be at least 1, got {args.virtual_stages}")
        settings = replace(settings, virtual_stages=args.virtual_stages)
    readme = Path(args.page) if args.page else None
    if readme is not None and not readme.exists():
        raise FileNotFoundError(f"--page {readme} does not exist")
    configs = tuple(args.configs or TABLE1_CONFIGS)
    for name in (*configs, CASE_STUDY_CONFIG):  # a bad name or schedule fails now, not after minutes
        with_virtual_stages(load_config(name), settings.virtual_stages)
    profile = cost_profile(args.cost_profile)
    out = output_dir(args.out)
    lengths, source = load_stream(args)
    start = time.perf_counter()
    path = reproduce(out, lengths, settings, configs=configs, profile=profile, progress=tqdm_progress,
                     source=source)
    print(f"wrote {path} and its figures in {time.perf_counter() - start:.0f} s")
    if readme is not None:
        readme.write_text(splice_readme(readme.read_text(), (path.parent / "readme.md").read_text()))
        figure = readme.parent / README_FIGURE
        figure.parent.mkdir(parents=True, exist_ok=True)
        shutil.copyfile(path.parent / "speedups.png", figure)
        print(f"rewrote the reproduce block of {readme} and {figure}")
    return 0
