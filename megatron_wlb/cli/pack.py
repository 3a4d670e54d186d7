"""``wlb pack``: run one packer over a length stream, print its metrics, optionally write the plan.

    wlb pack --lengths FILE|wlbllm|stdlib | --data-prefix PREFIX  --config NAME|YAML [--packer P]
             [--iterations K] [--out plan.jsonl] [--wlb-* knob overrides]

``--out`` writes one JSON line per global batch: ``{"iteration": i, "micro_batches": [[[doc_id,
offset, length], ...], ...]}`` (micro-batch ``r * n + k`` is DP rank r's k-th).
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import sys

import numpy as np

from megatron_wlb.cli.common import cost_profile, output_file, show_progress
from megatron_wlb.config import PACKER_NAMES, RunConfig, load_config
from megatron_wlb.costmodel import CostModel, build_cost_model
from megatron_wlb.data import load_lengths
from megatron_wlb.packing import GlobalBatch, make_packer, summarize
from megatron_wlb.packing.base import Packer


def add_packing_options(p: argparse.ArgumentParser) -> None:
    """Options shared by ``pack`` and ``bench`` that override the config's packing settings."""
    p.add_argument("--config", default="7b_128k", help="shipped config name or a YAML path (default 7b_128k)")
    p.add_argument("--profile", default=None, help="calibrated cost-model profile JSON (default: analytic)")


#: a length-stream name that stands for an indexed dataset (``--data-prefix``)
DATA_PREFIX_SCHEME = "prefix:"
#: a length-stream name that stands for a Megatron ``--data-path`` blend (shuffled as Megatron does)
DATA_PATH_SCHEME = "data-path:"


def add_parser(subparsers) -> None:
    p = subparsers.add_parser("pack", help="pack a length stream into global batches and print packing metrics",
                              description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    stream = p.add_mutually_exclusive_group()
    stream.add_argument("--lengths", default="wlbllm",
                        help="length file (.json/.npy/.txt), 'wlbllm' (embedded) or 'stdlib' (default wlbllm)")
    stream.add_argument("--data-prefix", metavar="PREFIX", default=None,
                        help="a Megatron indexed dataset: document lengths read from PREFIX.idx")
    stream.add_argument("--data-path", nargs="+", metavar="W_OR_PREFIX", default=None,
                        help="a Megatron --data-path: 'PREFIX ...' or 'W1 PREFIX1 W2 PREFIX2 ...', each dataset "
                             "shuffled as Megatron's GPTDataset (seed 1234) and blended by weight")
    add_packing_options(p)
    p.add_argument("--packer", choices=PACKER_NAMES, default=None, help="packer (default: the config's)")
    p.add_argument("--iterations", type=int, default=None, help="stop after K global batches (default: all)")
    p.add_argument("--out", default=None, help="write the plan as JSON lines")
    add_knob_options(p)
    p.add_argument("--json", action="store_true", help="print the metrics as JSON")
    p.set_defaults(func=run)


def resolve_lengths(source: str, min_tokens: int = 0, seed: int = 0) -> np.ndarray:
    """Lengths from a file, 'wlbllm', 'stdlib', ``prefix:PREFIX`` (an indexed dataset) or
    ``data-path:W1 P1 W2 P2`` (a blend); repeated
    (a seeded shuffle per extra pass) until they hold at least ``min_tokens`` tokens, so short
    streams can fill long benchmarks."""
    from megatron_wlb.data import stdlib_lengths

    if source == "stdlib":
        base = stdlib_lengths()
    elif source.startswith(DATA_PREFIX_SCHEME):
        from megatron_wlb.data.indexed import read_idx_lengths

        base = read_idx_lengths(source[len(DATA_PREFIX_SCHEME):])
    elif source.startswith(DATA_PATH_SCHEME):
        from megatron_wlb.data.blend import read_blend

        base, _, _ = read_blend(source[len(DATA_PATH_SCHEME):].split())
    else:
        base = load_lengths(source)
    if base.size == 0:
        raise ValueError(f"length stream {source!r} is empty")
    parts, total = [base], int(base.sum())
    rng = np.random.default_rng(seed)
    while total < min_tokens:
        parts.append(base[rng.permutation(base.size)])
        total += int(base.sum())
    return np.concatenate(parts)


def add_knob_options(p: argparse.ArgumentParser) -> None:
    """One ``--<knob>`` option per PackingConfig knob (generated: a new field gets its option), each
    overriding the config's ``packing.<knob>``."""
    from megatron_wlb.config import PACKING_KNOBS

    g = p.add_argument_group("packer settings (override the config's packing section)")
    for name, knob in PACKING_KNOBS.items():
        flags = [knob.flag("--")] + (["--thresholds"] if name == "queue_thresholds" else [])
        g.add_argument(*flags, dest=f"knob_{name}", default=None, metavar=None if knob.choices else "V",
                       choices=[str(c) for c in knob.choices] if knob.choices else None,
                       help=(knob.help.replace("`", "") + ("" if knob.choices else f" ({knob.expects})"))
                       .replace("%", "%%"))


def overrides(args: argparse.Namespace) -> dict:
    """The packer settings given on the command line, parsed and checked by their type."""
    from megatron_wlb.config import PACKING_KNOBS

    out = {}
    for name, knob in PACKING_KNOBS.items():
        value = getattr(args, f"knob_{name}", None)
        if value is not None:
            out[name] = knob.parse(value, knob.flag("--"))
    return out


def run_packer(packer: Packer, lengths: np.ndarray, iterations: int | None, progress: str | None = None,
               out=None) -> list[GlobalBatch]:
    """Pack ``lengths`` (up to ``iterations`` global batches), with a tqdm bar on stderr.

    Python's cyclic garbage collector is paused while packing: plans hold no reference cycles
    (refcounting frees them), but every plan is kept here for the metrics, and a full collection
    over those ~10^5..10^6 live objects would add a 100+ ms pause to whichever batch it hits, an
    artefact of keeping the whole run in memory that a training loop does not have.
    """
    import gc

    from tqdm import tqdm

    batches: list[GlobalBatch] = []
    bar = tqdm(total=iterations, desc=progress, file=sys.stderr, disable=progress is None or not show_progress(),
               leave=False)
    was_enabled = gc.isenabled()
    gc.disable()
    try:
        for batch in packer.pack(lengths):
            batches.append(batch)
            if out is not None:
                out.write(json.dumps({"iteration": batch.iteration, "micro_batches": [
                    [[p.doc_id, p.offset, p.length] for p in mb.pieces] for mb in batch.micro_batches]}) + "\n")
            bar.update(1)
            if iterations is not None and len(batches) >= iterations:
                break
    finally:
        if was_enabled:
            gc.enable()
        bar.close()
    return batches


def build(args: argparse.Namespace) -> tuple[RunConfig, CostModel]:
    config = load_config(args.config)
    cost = build_cost_model(config.model, config.layout, profile=cost_profile(getattr(args, "profile", None)))
    return config, cost


def run(args: argparse.Namespace) -> int:
    if args.iterations is not None and args.iterations < 1:
        raise ValueError(f"--iterations={args.iterations}: must be a positive number of global batches")
    config, cost = build(args)
    packing = dataclasses.replace(config.packing, **overrides(args))
    name = args.packer or config.packer
    packer = make_packer(name, packing, cost)
    source = (DATA_PREFIX_SCHEME + args.data_prefix if args.data_prefix else
              DATA_PATH_SCHEME + " ".join(args.data_path) if args.data_path else args.lengths)
    out = output_file(args.out) if args.out else None
    lengths = resolve_lengths(source)
    if out is not None:
        with open(out, "w") as f:
            batches = run_packer(packer, lengths, args.iterations, progress=name, out=f)
    else:
        batches = run_packer(packer, lengths, args.iterations, progress=name)
    metrics = summarize(batches, cost, packing.seq_len, stages=packing.stages, virtual_stages=packing.virtual_stages)
    report = {"packer": name, "config": config.name, "lengths": source, "documents_read": packer.position,
              "dropped": len(packer.dropped), **metrics.to_dict()}
    report.update(packer.diagnostics())
    if args.json:
        print(json.dumps(report, indent=1))
    else:
        for key, value in report.items():
            print(f"{key:>18}: {round(value, 4) if isinstance(value, float) else value}")
    return 0
