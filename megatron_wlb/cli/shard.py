"""``wlb shard``: shard micro-batches over context-parallel ranks and write who owns which tokens.

    wlb shard --micro-batches FILE --cp C --cp-sharding NAME [--kernel-table JSON | --cost-profile JSON] --out OUT.jsonl

FILE holds one micro-batch per line, a JSON list of its document lengths in order (blank lines are
skipped), or is a plan written by ``wlb pack --out`` (one global batch per line, each micro-batch's
pieces ``[doc_id, offset, length]``; every micro-batch of every line is sharded, in order).
OUT gets one JSON object per micro-batch (a contract other tools read)::

    {"layout": <layout used; for adaptive the one chosen>,
     "padded_lengths": <document lengths after padding; the input unless per-document-te>,
     "ranks": [[[start, end], ...], ...]}     # per CP rank: its runs of token positions, in the
                                               # (padded) micro-batch's coordinates, in rank order

``--kernel-table`` is a kernel-efficiency table (``megatron-wlb-attn-efficiency/1``, written by
``wlb calibrate`` or scripts/gpu_profile_attention.py); ``--cost-profile`` a cost-model profile
(``megatron-wlb-profile/1``, written by ``wlb calibrate``), as everywhere else. A summary
table (per-rank tokens, estimated attention work, imbalance = max / mean) goes to stdout.
"""

from __future__ import annotations

import argparse
import json
import sys
from collections.abc import Iterable
from pathlib import Path

import numpy as np

from megatron_wlb.cli.common import input_file, output_file, positive, read_json_object
from megatron_wlb.costmodel import PROFILE_FORMAT, CostModel, ParallelLayout, build_cost_model, get_model
from megatron_wlb.cp.efficiency import EFFICIENCY_FORMAT, KernelEfficiency
from megatron_wlb.cp.layouts import LAYOUT_NAMES, ShardLayout, build_layout
from megatron_wlb.packing.types import MAX_MICRO_BATCH_TOKENS


def add_parser(subparsers: argparse._SubParsersAction) -> None:
    p = subparsers.add_parser("shard", help="shard micro-batches over CP ranks (per-sequence, per-document, ...)",
                              description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--micro-batches", required=True, help="file with one JSON list of document lengths per line")
    p.add_argument("--cp", type=int, required=True, help="context-parallel size")
    p.add_argument("--cp-sharding", required=True, choices=LAYOUT_NAMES,
                   help="CP layout (the config's cp_sharding, --wlb-cp-sharding)")
    p.add_argument("--out", required=True, help="output JSON-lines file (one line per micro-batch)")
    prices = p.add_mutually_exclusive_group()
    prices.add_argument("--kernel-table", default=None, metavar="JSON",
                        help="kernel-efficiency table (megatron-wlb-attn-efficiency/1; default: the shipped "
                             "placeholder)")
    prices.add_argument("--cost-profile", default=None, metavar="JSON",
                        help="cost-model profile (megatron-wlb-profile/1; default: the analytic cost model)")
    p.add_argument("--model", default="7b", help="model shape that prices attention (default 7b)")
    p.add_argument("--tp", type=int, default=1, help="tensor-parallel size that prices attention (default 1)")
    p.add_argument("--tile", type=int, default=128, help="attention kernel tile for rounding (default 128)")
    p.add_argument("--show", type=int, default=20, help="micro-batches listed in the summary (default 20)")
    p.set_defaults(func=run)


#: more CP ranks than this is not a context-parallel group (and would allocate per-rank arrays for nothing)
MAX_CP = 65536


def _lengths_of(row: object, where: str) -> list[list[int]]:
    """The micro-batches of one line: a list of lengths, or a ``wlb pack --out`` global batch."""
    if isinstance(row, dict) and isinstance(row.get("micro_batches"), list):
        out = []
        for k, mb in enumerate(row["micro_batches"]):
            if not isinstance(mb, list) or not all(isinstance(p, list) and len(p) == 3 for p in mb):
                raise ValueError(f"{where}: micro-batch {k} of the plan is not a list of [doc_id, offset, length]")
            out.append([p[2] for p in mb])
        return out
    if isinstance(row, list):
        return [row]
    raise ValueError(f"{where}: expected a JSON list of document lengths or a `wlb pack --out` plan line, "
                     f"got a {type(row).__name__}")


def read_micro_batches(path: str | Path) -> list[list[int]]:
    """Micro-batches (lists of positive integer lengths) from FILE; errors name the line."""
    path = input_file(path, "--micro-batches")
    out = []
    try:
        text = path.read_text()
    except UnicodeDecodeError:
        raise ValueError(f"--micro-batches {path}: not a text file of JSON lines") from None
    for lineno, line in enumerate(text.splitlines(), 1):
        if not line.strip():
            continue
        where = f"{path}:{lineno}"
        try:
            row = json.loads(line)
        except json.JSONDecodeError as exc:
            raise ValueError(f"{where}: not valid JSON ({exc.msg})") from None
        for mb in _lengths_of(row, where):
            if not all(isinstance(x, int) and not isinstance(x, bool) for x in mb):
                raise ValueError(f"{where}: expected a JSON list of integer document lengths, got {line[:60]!r}")
            if any(x < 1 for x in mb):
                raise ValueError(f"{where}: document lengths must be >= 1, got {min(mb)}")
            if sum(mb) > MAX_MICRO_BATCH_TOKENS:
                raise ValueError(f"{where}: the micro-batch holds {sum(mb)} tokens; attention kernels index tokens "
                                 f"with int32, so a micro-batch holds at most {MAX_MICRO_BATCH_TOKENS} (2**31 - 1)")
            out.append(mb)
    return out


def _load_prices(kernel_table: str | None, profile: str | None, model: str,
                 tp: int) -> tuple[CostModel, KernelEfficiency | None]:
    """(cost model, efficiency table or None) from ``--kernel-table`` or ``--cost-profile``, each checked
    for its format (a file of the other format is named as such)."""
    formats = {EFFICIENCY_FORMAT: ("--kernel-table", "kernel-efficiency table"),
               PROFILE_FORMAT: ("--cost-profile", "cost-model profile")}
    for path, want in ((kernel_table, EFFICIENCY_FORMAT), (profile, PROFILE_FORMAT)):
        if path is None:
            continue
        flag, what = formats[want]
        fmt = read_json_object(path, flag).get("format")
        if fmt != want:
            other = f" (a {formats[fmt][1]}: give it as {formats[fmt][0]})" if fmt in formats else ""
            raise ValueError(f"{flag} {path}: format {fmt!r}, expected {want!r} (a {what}){other}")
    if kernel_table is not None:
        return build_cost_model(get_model(model), ParallelLayout(tp=tp)), KernelEfficiency.from_json(kernel_table)
    return build_cost_model(get_model(model), ParallelLayout(tp=tp), profile=profile), None


def _fmt_list(values: Iterable[float], fmt: str, limit: int = 8) -> str:
    vals = [format(v, fmt) for v in values]
    if len(vals) > limit:
        return " ".join(vals[:limit // 2]) + " ... " + " ".join(vals[-limit // 2:])
    return " ".join(vals)


def summarize(layouts: list[ShardLayout], show: int) -> str:
    lines = [f"{'mb':>4}  {'layout':<16} {'tokens per rank':<40} {'est. attention us per rank':<48} imbalance"]
    for i, lay in enumerate(layouts[:show]):
        lines.append(f"{i:>4}  {lay.name:<16} {_fmt_list(lay.rank_tokens, 'd'):<40} "
                     f"{_fmt_list(lay.rank_work * 1e6, '.0f'):<48} {lay.imbalance:.3f}")
    if len(layouts) > show:
        lines.append(f"  ... {len(layouts) - show} more")
    if layouts:
        imb = np.array([lay.imbalance for lay in layouts])
        step = sum(lay.max_work for lay in layouts)
        used: dict[str, int] = {}
        for lay in layouts:
            used[lay.name] = used.get(lay.name, 0) + 1
        lines.append(f"{len(layouts)} micro-batches: imbalance mean {imb.mean():.3f} max {imb.max():.3f}; "
                     f"sum of max-rank attention {step * 1e3:.3f} ms/layer; layouts used "
                     + ", ".join(f"{k} x{v}" for k, v in sorted(used.items())))
    return "\n".join(lines)


def run(args: argparse.Namespace) -> int:
    positive(args.cp, "--cp", MAX_CP)
    positive(args.tp, "--tp")
    positive(args.tile, "--tile")
    if args.show < 0:
        raise ValueError(f"--show {args.show}: must be >= 0")
    out = output_file(args.out)
    micro_batches = read_micro_batches(args.micro_batches)
    heads = get_model(args.model).num_heads
    if heads % args.tp:
        raise ValueError(f"--tp {args.tp} does not divide the {heads} attention heads of --model {args.model}")
    cost, efficiency = _load_prices(args.kernel_table, args.cost_profile, args.model, args.tp)
    layouts = [build_layout(args.cp_sharding, mb, args.cp, cost=cost, efficiency=efficiency, tile=args.tile)
               for mb in micro_batches]
    with out.open("w") as f:
        for lay in layouts:
            f.write(json.dumps(lay.to_json(), separators=(",", ":")) + "\n")
    print(summarize(layouts, args.show))
    print(f"wrote {len(layouts)} lines to {out}", file=sys.stderr)
    return 0
