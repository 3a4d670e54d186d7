"""``wlb simulate``: time iterations of one config with one packer and CP layout, print metrics."""

from __future__ import annotations

import argparse
import json
from typing import Any

from megatron_wlb.cli.common import (
    add_stream_args,
    cost_profile,
    load_stream,
    output_file,
    positive,
    tqdm_progress,
    with_virtual_stages,
)
from megatron_wlb.config import cp_sharding_names, load_config
from megatron_wlb.costmodel import build_cost_model
from megatron_wlb.cp.dynamic import DYNAMIC_SHARDING
from megatron_wlb.packing.base import PACKERS
from megatron_wlb.sim.dyncp import simulate_dynamic_stream
from megatron_wlb.sim.experiments import schedule_label
from megatron_wlb.sim.iteration import simulate_stream, split_documents


def add_parser(subparsers: argparse._SubParsersAction) -> None:
    p = subparsers.add_parser("simulate", help="simulate 4D-parallel iterations of one config",
                              description="Pack a length stream with one packer, shard every micro-batch with "
                                          "one CP layout, and play each iteration through the pipeline "
                                          "schedule; prints per-iteration time, bubble and imbalance.")
    p.add_argument("--config", required=True, help="config name (configs/*.yaml stem) or YAML path")
    p.add_argument("--packer", help="original | fixed-greedy | fixed-solver | wlb | whole-document (the baseline "
                                    "of packing/whole_document.py) (default: the config's)")
    p.add_argument("--cp-sharding", help="per-sequence | per-document | per-document-te | adaptive | hybrid | "
                                       "dynamic (ours: a CP group per micro-batch over the DP x CP ranks, PP 1) | "
                                       "dynamic-cp (Megatron's per-document CP sizes inside the group) (default: "
                                       "the config's cp_sharding)")
    p.add_argument("--iterations", type=int, default=20, help="iterations to simulate (default 20)")
    p.add_argument("--virtual-stages", type=int, help="interleaved 1F1B with this many virtual stages")
    p.add_argument("--cost-profile", metavar="JSON",
                   help="cost-model profile measured on a GPU (format megatron-wlb-profile/1)")
    p.add_argument("--no-split", action="store_true",
                   help="keep documents longer than seq_len whole (default: cut them to the window)")
    p.add_argument("--json", metavar="FILE", help="also write the per-iteration metrics as JSON")
    add_stream_args(p)
    p.set_defaults(func=run)


def run(args: argparse.Namespace) -> int:

    # every input is checked before the stream is read and simulated
    positive(args.iterations, "--iterations")
    cfg = with_virtual_stages(load_config(args.config), args.virtual_stages)
    packer = args.packer or cfg.packer
    if packer not in PACKERS:
        raise ValueError(f"--packer {packer}: choose one of {', '.join(PACKERS)}")
    layout = args.cp_sharding or cfg.cp_sharding
    if layout not in (*cp_sharding_names(), "dynamic-cp"):
        raise ValueError(f"--cp-sharding {layout}: choose one of {', '.join((*cp_sharding_names(), 'dynamic-cp'))}")
    profile = cost_profile(args.cost_profile, config=cfg)
    json_out = output_file(args.json, "--json") if args.json else None
    if layout == DYNAMIC_SHARDING and cfg.layout.pp != 1:
        raise ValueError(f"--cp-sharding {DYNAMIC_SHARDING} plans one pipeline stage (PP 1), but {cfg.name} has PP "
                         f"{cfg.layout.pp}: use a config with layout pp: 1")
    lengths, source = load_stream(args)
    cost = build_cost_model(cfg.model, cfg.layout, profile)
    if layout == DYNAMIC_SHARDING:
        return _run_dynamic(cfg, cost, packer, lengths if args.no_split else split_documents(lengths, cfg.seq_len),
                            args.iterations, source, json_out)
    run_ = simulate_stream(cfg, cost, packer, layout, lengths, args.iterations,
                           split_at=None if args.no_split else cfg.seq_len,
                           progress=tqdm_progress)
    print(f"# {cfg.name} {cfg.layout}, {schedule_label(cfg.virtual_stages)}: packer={packer}, cp layout={layout}; "
          f"{cost.describe()}; stream: {source}")
    print(f"{'iter':>4} {'time ms':>10} {'bubble %':>8} {'PP imb':>7} {'pack imb':>8} {'GPU imb':>7} "
          f"{'tokens':>10}  layouts")
    rows: list[dict[str, Any]] = []
    for r in run_.iterations:
        print(f"{r.iteration:>4} {1e3 * r.time:>10.1f} {100 * r.bubble_fraction:>8.1f} {r.pp_imbalance:>7.3f} "
              f"{r.packing_imbalance:>8.3f} {r.gpu_compute_imbalance:>7.3f} {r.tokens:>10}  {r.layouts}")
        rows.append({"iteration": r.iteration, "time_s": r.time, "bubble_fraction": r.bubble_fraction,
                     "pp_imbalance": r.pp_imbalance, "gpu_compute_imbalance": r.gpu_compute_imbalance,
                     "packing_imbalance": r.packing_imbalance,
                     "packing_imbalance_global": r.packing_imbalance_global,
                     "tokens": r.tokens, "dp_sync_s": r.dp_sync, "layouts": r.layouts,
                     "micro_batch_latency_s": r.mb_latency.tolist(), "micro_batch_tokens": r.mb_tokens.tolist(),
                     "pp_rank_busy_s": r.gpu_busy.tolist()})
    print("PP imb: max micro-batch forward (simulated, CP max) x n / total; pack imb: the same from the "
          "packing metrics (cost model, CP shared evenly); GPU imb: slowest GPU's compute / mean")
    print(f"{schedule_label(cfg.virtual_stages)}: mean {1e3 * run_.mean_time:.1f} ms/iteration, "
          f"bubble {100 * run_.bubble_fraction:.1f}%, "
          f"{run_.throughput:,.0f} tokens/s, PP imbalance {run_.pp_imbalance:.3f}, "
          f"GPU compute max/mean {run_.gpu_compute_imbalance:.3f}")
    if json_out is not None:
        with open(json_out, "w") as f:
            json.dump({"config": cfg.name, "packer": packer, "cp_sharding": layout, "cost_model": cost.describe(),
                       "stream": source, "packing_metrics": run_.packing_metrics, "iterations": rows}, f, indent=1)
    return 0


def _run_dynamic(cfg: Any, cost: Any, packer: str, lengths: Any, iterations: int, source: str,
                 json_out: Any) -> int:
    """``--cp-sharding dynamic``: the packer's documents per iteration, planned over the DP x CP ranks."""
    its = simulate_dynamic_stream(cfg, cost, packer, lengths, iterations)
    print(f"# {cfg.name} {cfg.layout}: packer={packer}, cp sharding={DYNAMIC_SHARDING} (a CP group per micro-batch "
          f"over the {cfg.layout.dp * cfg.layout.cp} DP x CP ranks); {cost.describe()}; stream: {source}")
    print(f"{'iter':>4} {'time ms':>10} {'/ideal':>7} {'/bound':>7} {'fixed/':>7} {'tokens':>10} {'steps':>5}  "
          "micro-batches per group size")
    for r in its:
        print(f"{r.iteration:>4} {1e3 * r.time:>10.1f} {r.over_ideal:>7.3f} {r.time / r.bound:>7.3f} "
              f"{r.fixed / r.time:>7.3f} {r.tokens:>10} {r.steps:>5}  {r.group_sizes}")
    total, ideal = sum(r.time for r in its), sum(r.ideal for r in its)
    print("time: the slowest rank's forward + backward, all layers (PP 1, communication charged); ideal: the "
          "documents' compute at CP 1 spread evenly, no communication; bound: a lower bound of any plan (the "
          "communication and micro-batch costs the memory cap forces); fixed/: the packer's own micro-batches on "
          f"each DP rank's fixed CP {cfg.layout.cp} group over this time")
    print(f"mean {1e3 * total / len(its):.1f} ms/iteration, over ideal {total / ideal:.3f}, "
          f"{sum(r.tokens for r in its) / total:,.0f} tokens/s; fixed CP group / dynamic "
          f"{sum(r.fixed for r in its) / total:.3f}")
    if json_out is not None:
        with open(json_out, "w") as f:
            json.dump({"config": cfg.name, "packer": packer, "cp_sharding": DYNAMIC_SHARDING,
                       "cost_model": cost.describe(), "stream": source,
                       "iterations": [{"iteration": r.iteration, "time_s": r.time, "ideal_s": r.ideal,
                                       "bound_s": r.bound, "fixed_group_s": r.fixed, "tokens": r.tokens,
                                       "steps": r.steps,
                                       "group_sizes": r.group_sizes, "plan_s": r.plan_seconds} for r in its]},
                      f, indent=1)
    return 0
