"""``wlb analyze``: what WLB-LLM buys on your own data and layout, before spending a cluster on it.

The corpus is read whole (``--lengths``, ``--data-prefix`` or a ``--data-path`` blend as Megatron
takes it), shuffled as Megatron's GPTDataset shuffles documents (numpy ``RandomState`` seeded with
``--seed`` + k for ordering k), and every method runs the same iterations of each ordering; the
verdict is the mean and range over ``--shuffles`` orderings, so it does not hinge on the file order.
"""

from __future__ import annotations

import argparse
import json
import sys
import time

from megatron_wlb.cli.common import add_stream_args, load_stream, tqdm_progress, with_virtual_stages
from megatron_wlb.data.blend import DEFAULT_SEED

#: Orderings per verdict. With k i.i.d. orderings each, two corpora of the same documents in
#: different file orders give disjoint [min, max] ranges with probability 2 (k!)^2 / (2k)!:
#: 10% for k = 3, under 1% for k = 5.
DEFAULT_SHUFFLES = 5


def add_parser(subparsers: argparse._SubParsersAction) -> None:
    p = subparsers.add_parser("analyze", help="compare Plain-4D / Fixed-4D / WLB-LLM on your data and layout",
                              description="Simulate the two Plain-4D baselines, Fixed-4D, WLB-LLM and Megatron's "
                                          "dynamic CP on your documents (shuffled as Megatron does, several "
                                          "seeds) and run config; print the verdict (mean and range over the "
                                          "shuffles) and write DIR/report.md with figures.")
    group = add_stream_args(p)
    group.add_argument("--data-path", nargs="+", metavar="W_OR_PREFIX",
                       help="Megatron-style blend: 'PREFIX' or 'W1 PREFIX1 W2 PREFIX2 ...' (weights are "
                            "normalised; without weights the datasets are concatenated)")
    p.add_argument("--config", required=True, help="config name (configs/*.yaml stem) or YAML path")
    p.add_argument("--profile", metavar="JSON",
                   help="cost-model profile measured on a GPU (format megatron-wlb-profile/1)")
    p.add_argument("--out", default="wlb-analyze", metavar="DIR", help="output folder (default ./wlb-analyze)")
    p.add_argument("--iterations", type=int,
                   help="iterations per ordering and method (default: every full iteration the corpus gives)")
    p.add_argument("--shuffles", type=int, default=DEFAULT_SHUFFLES,
                   help=f"seeded document orderings to average over (default {DEFAULT_SHUFFLES})")
    p.add_argument("--seed", type=int, default=DEFAULT_SEED, help=f"first shuffle seed (default {DEFAULT_SEED})")
    p.add_argument("--no-shuffle", action="store_true",
                   help="keep the corpus in file order (one ordering; the verdict then depends on that order)")
    p.add_argument("--virtual-stages", type=int, help="interleaved 1F1B with this many virtual stages "
                                                      "(default: the config's)")
    p.add_argument("--json", metavar="FILE", help="also write the verdict as JSON")
    p.set_defaults(func=run)


def run(args: argparse.Namespace) -> int:
    from megatron_wlb.config import load_config
    from megatron_wlb.data import load_lengths
    from megatron_wlb.sim.iteration import split_documents
    from megatron_wlb.sim.report import analyze, recommendation

    if args.iterations is not None and args.iterations < 1:
        raise ValueError(f"--iterations must be at least 1, got {args.iterations}")
    if args.shuffles < 1:
        raise ValueError(f"--shuffles must be at least 1, got {args.shuffles}")
    cfg = with_virtual_stages(load_config(args.config), args.virtual_stages)
    notes: list[str] = []
    seeds = [args.seed + k for k in range(1 if args.no_shuffle else args.shuffles)]
    if args.data_path:
        from megatron_wlb.data.blend import read_blend

        streams = []
        for seed in seeds:
            stream, desc, unused = read_blend(args.data_path, None if args.no_shuffle else seed)
            streams.append(stream)
        source = f"blend {desc}"
        if unused:
            notes.append(f"The blend ends when its first dataset runs out (no document repeats), so {unused:,} "
                         "documents of the others are not read.")
    else:
        lengths, source = load_stream(args)
        from megatron_wlb.data.blend import shuffle_documents

        streams = [lengths] if args.no_shuffle else [shuffle_documents(lengths, seed) for seed in seeds]
    order = ("file order (not shuffled)" if args.no_shuffle else
             f"{len(seeds)} shuffles as Megatron's GPTDataset orders documents (numpy RandomState, seeds "
             f"{seeds[0]}..{seeds[-1]})")
    notes.append(f"Document order: {order}.")
    longer = int((streams[0] > cfg.seq_len).sum())
    if longer:
        notes.append(f"{longer:,} documents longer than seq_len = {cfg.seq_len} are cut into windows of at most "
                     "seq_len tokens for every method alike.")
    tokens = int(split_documents(streams[0], cfg.seq_len).sum())
    per_iteration = cfg.packing.tokens_per_iteration
    available = tokens // per_iteration
    if available < 1:
        raise ValueError(f"the corpus holds {tokens:,} tokens, less than one iteration of {cfg.name} "
                         f"({per_iteration:,} tokens); use a larger corpus or a smaller config")
    iterations = available if args.iterations is None else min(args.iterations, available)
    if args.iterations is None:
        notes.append(f"The whole corpus: {iterations} full iterations of {per_iteration:,} tokens "
                     f"({tokens:,} tokens).")
    elif args.iterations > available:
        warning = (f"--iterations {args.iterations} asked for more than the corpus holds: it gives "
                   f"{available} full iterations of {per_iteration:,} tokens, so {available} were run.")
        print(f"wlb analyze: warning: {warning}", file=sys.stderr)
        notes.append(f"**Warning:** {warning}")
    else:
        notes.append(f"A sample: the first {iterations} of the {available} full iterations the corpus gives, "
                     "in each ordering.")
    start = time.perf_counter()
    path, table, verdict = analyze(args.out, cfg, streams, iterations, profile=args.profile,
                                   progress=tqdm_progress, source=source, reference=load_lengths(), notes=notes)
    print(table.to_markdown(digits=3))
    for line in recommendation(verdict):
        print(f"\n{line}")
    print(f"\n{verdict.iterations} iterations x {verdict.shuffles} orderings per method; "
          f"wrote {path} and its figures in {time.perf_counter() - start:.0f} s")
    if args.json:
        with open(args.json, "w") as f:
            json.dump({**verdict.to_json(), "recommendation": recommendation(verdict)}, f, indent=1)
    return 0
