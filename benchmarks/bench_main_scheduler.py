#!/usr/bin/env python
"""megatron-wlb against Megatron-LM main's own sequence-packing scheduler, one command:
``python benchmarks/bench_main_scheduler.py [--iterations K] [--page]``.

Main's ``DpBalancedScheduler.get_groups_and_subsamples`` (``sequence_packing_scheduler = "dp_balanced"``, imported
from a Megatron-LM main checkout: the work tree ``$MEGATRON_LM`` names, or a checkout of ``version.MAIN_COMMIT``
from the repository it names, default the machine's mirror) and ours (``"wlb"``,
``megatron_wlb.megatron.hooks.main_schedule``) group the same global batches of the same streams as bench_packing.py
(the embedded WLB-LLM stand-in and the corpora of benchmarks/build_corpora.py), at DP 1, 2, 4, 8 with
configs/7b_128k.yaml's model and layout (CP 2, PP 4: main's window ``max_seqlen_per_dp_cp_rank x cp`` = 128K
tokens per DP rank's micro-batch). A global batch is the documents, in arrival order, of DP x 4 x 128K tokens
(bench_packing's intake); documents longer than the window are cut at it beforehand (as the simulator does),
since main's schedulers place samples whole. Every plan is scored with the project's scorer
(``packing.metrics.slowest_rank_schedule_time``: the slowest DP rank's 1F1B time under the 7B cost model, and the
same with every micro-batch at the iteration's mean); writes benchmarks/results/main_scheduler.{json,md} and, with
``--page``, the summary table after the results page's ``<!-- main-scheduler-table -->``.

``--dynamic-cp``: Megatron-LM dev's ``default_dynamic_cp`` (``DefaultDynamicCPScheduler``, imported from a dev
checkout at ``version.DEV_COMMIT``), our fixed-group wlb and our dynamic-CP planner (``cp.dynamic``) on the same
global batches, PP 1, scored on the DP x CP grid with every group's CP communication charged
(``rank_groups_critical_path``); writes benchmarks/results/dynamic_cp_scheduler.{json,md} (results page: after
``<!-- dynamic-cp-scheduler-table -->``).
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import numpy as np

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "benchmarks"))

from _results import RESULTS_PAGE, replace_readme_table, write_result  # noqa: E402
from bench_packing import STREAMS, stream_lengths  # noqa: E402

from megatron_wlb.config import load_config  # noqa: E402
from megatron_wlb.costmodel import build_cost_model  # noqa: E402
from megatron_wlb.cp.dynamic import group_cost_models, lower_bound, memory_bound, plan_dynamic_cp  # noqa: E402
from megatron_wlb.megatron.args.version import DEV_COMMIT, MAIN_COMMIT  # noqa: E402
from megatron_wlb.packing.metrics import overhead_seconds, piece_latency, slowest_rank_schedule_time  # noqa: E402
from megatron_wlb.packing.types import DocPiece, GlobalBatch, MicroBatch  # noqa: E402
from megatron_wlb.provenance import machine  # noqa: E402
from megatron_wlb.sim.dyncp import simulate_dynamic_stream  # noqa: E402
from megatron_wlb.sim.iteration import split_documents  # noqa: E402

DEFAULT_MIRROR = "/work/.mirror/NVIDIA+Megatron-LM/repo"
README_MARK = "<!-- main-scheduler-table -->"
CONFIG = "7b_128k"


def main_checkout(keep: Path) -> Path:
    """A Megatron-LM main work tree: ``$MEGATRON_LM`` if it is one, else ``MAIN_COMMIT`` checked out from the
    repository it names (default: the mirror) under ``keep``."""
    source = os.environ.get("MEGATRON_LM") or DEFAULT_MIRROR
    if (Path(source) / "megatron" / "core" / "datasets" / "data_schedule.py").exists():
        return Path(source)
    dest = keep / "Megatron-LM-main"
    subprocess.run(["git", "clone", "-q", "--shared", "--no-checkout", source, str(dest)], check=True)
    subprocess.run(["git", "-C", str(dest), "checkout", "-q", "--detach", MAIN_COMMIT], check=True)
    return dest


def import_schedulers(checkout: Path) -> tuple[type, type, str]:
    """(main's DpBalancedScheduler, our WlbPackingScheduler, the checkout's commit)."""
    sys.path.insert(0, str(checkout))
    from megatron_wlb.megatron.args.compat import install_python_shims

    install_python_shims()
    from megatron.core.datasets import data_schedule

    from megatron_wlb.megatron.hooks import main_schedule

    print(main_schedule.register(), file=sys.stderr)
    commit = subprocess.run(["git", "-C", str(checkout), "rev-parse", "HEAD"], capture_output=True,
                            text=True).stdout.strip() or "unknown (not a git work tree)"
    return data_schedule.DpBalancedScheduler, main_schedule.scheduler_class(), commit


def global_batches(lengths: np.ndarray, budget: int, count: int) -> list[np.ndarray]:
    """``count`` consecutive global batches: documents in arrival order until ``budget`` tokens (the document
    crossing the budget included)."""
    ends = np.cumsum(lengths)
    out, start, used = [], 0, 0
    for _ in range(count):
        stop = int(np.searchsorted(ends, used + budget, side="left")) + 1
        if stop > lengths.size:
            raise ValueError(f"the stream ran out after {len(out)} global batches")
        out.append(lengths[start:stop])
        used, start = int(ends[stop - 1]), stop
    return out


def as_global_batch(groups: list, lengths: np.ndarray, dp: int, cp: int, window: int) -> GlobalBatch:
    """Main's answer (per micro-batch, sample ids per DPxCP rank) as our GlobalBatch, DP rank r's micro-batches
    in the order main runs them."""
    n = len(groups)
    mbs = tuple(MicroBatch(tuple(DocPiece(int(i), 0, int(lengths[i]), 0) for i in groups[k][r * cp]), window)
                for r in range(dp) for k in range(n))
    return GlobalBatch(0, mbs, dp, n)


def check_plan(groups: list, size: int, dp: int, cp: int, name: str) -> None:
    placed = sorted(int(i) for mb in groups for r in range(dp) for i in mb[r * cp])
    if placed != list(range(size)) or any(len(mb) != dp * cp for mb in groups):
        raise AssertionError(f"{name}: the plan does not place every sample exactly once over DP x CP ranks")


def run(streams: list[str], dps: list[int], iterations: int) -> dict:
    run_cfg = load_config(CONFIG)
    window, cp, pp, n = run_cfg.packing.seq_len, run_cfg.layout.cp, run_cfg.layout.pp, run_cfg.packing.n
    with tempfile.TemporaryDirectory() as keep:
        checkout = main_checkout(Path(keep))
        DpBalanced, Wlb, commit = import_schedulers(checkout)
        tables = []
        for dp in dps:
            layout = dataclasses.replace(run_cfg.layout, dp=dp)
            cost = build_cost_model(run_cfg.model, layout)
            budget = dp * n * window
            for stream in streams:
                raw, docs = stream_lengths(stream, (iterations + 2) * budget)
                lengths = split_documents(raw, window)
                row: dict = {"stream": stream, "dp": dp, "documents": docs, "global_batches": iterations}
                schedulers = {"dp_balanced": DpBalanced(window // cp, cp, dp, None),
                              "wlb": Wlb(window // cp, cp, dp, None, cost=cost, stages=pp)}
                stats = {name: {"slowest_s": 0.0, "balanced_s": 0.0, "micro_batches": [], "plan_s": 0.0,
                                "refused": 0, "refusal": ""} for name in schedulers}
                scored = 0
                for batch in global_batches(lengths, budget, iterations):
                    plans = {}
                    for name, scheduler in schedulers.items():
                        t0 = time.perf_counter()
                        try:
                            groups = scheduler.get_groups_and_subsamples(list(enumerate(batch.tolist())))
                        except (AssertionError, ValueError) as exc:  # main's empty-micro-batch limit: both refuse
                            stats[name]["refused"] += 1
                            stats[name]["refusal"] = f"{type(exc).__name__}: {exc}"
                            continue
                        finally:
                            stats[name]["plan_s"] += time.perf_counter() - t0
                        check_plan(groups, batch.size, dp, cp, name)
                        plans[name] = groups
                    if len(plans) < len(schedulers):
                        continue  # scored only where both planned: the same batches for both
                    scored += 1
                    for name, groups in plans.items():
                        worst, ideal = slowest_rank_schedule_time(cost, as_global_batch(groups, batch, dp, cp, window),
                                                                  stages=pp)
                        stats[name]["slowest_s"] += worst
                        stats[name]["balanced_s"] += ideal
                        stats[name]["micro_batches"].append(len(groups))
                row["scored_batches"] = scored
                for name, st in stats.items():
                    row[name] = {"slowest_s": st["slowest_s"], "balanced_s": st["balanced_s"],
                                 "schedule_ratio": st["slowest_s"] / st["balanced_s"],
                                 "micro_batches_per_rank": float(np.mean(st["micro_batches"])),
                                 "plan_ms": 1e3 * st["plan_s"] / iterations, "refused": st["refused"],
                                 "refusal": st["refusal"]}
                row["dp_balanced_over_wlb"] = row["dp_balanced"]["slowest_s"] / row["wlb"]["slowest_s"]
                print(f"dp {dp} {stream:8s} dp_balanced {row['dp_balanced']['schedule_ratio']:.3f} "
                      f"({row['dp_balanced']['micro_batches_per_rank']:.1f} mb) wlb {row['wlb']['schedule_ratio']:.3f} "
                      f"({row['wlb']['micro_batches_per_rank']:.1f} mb) time dp_balanced / wlb "
                      f"{row['dp_balanced_over_wlb']:.3f}; refused {row['dp_balanced']['refused']} / "
                      f"{row['wlb']['refused']} of {iterations}", file=sys.stderr, flush=True)
                tables.append(row)
    return {"machine": machine(), "command": "python benchmarks/bench_main_scheduler.py", "config": CONFIG,
            "megatron_commit": commit, "window": window, "cp": cp, "pp": pp, "iterations": iterations,
            "rows": tables}


def summary_table(result: dict) -> str:
    lines = ["| stream | DP | dp_balanced: slowest rank / balanced | micro-batches per rank | "
             "**wlb**: slowest rank / balanced | micro-batches per rank | iteration time dp_balanced / wlb | "
             "global batches refused (dp_balanced / wlb) |",
             "|---|---|---|---|---|---|---|---|"]
    for r in sorted(result["rows"], key=lambda r: (r["dp"], STREAMS.index(r["stream"]) if r["stream"] in STREAMS
                                                    else 99)):
        a, b = r["dp_balanced"], r["wlb"]
        lines.append(f"| {r['stream']} | {r['dp']} | {a['schedule_ratio']:.3f} | {a['micro_batches_per_rank']:.1f} | "
                     f"**{b['schedule_ratio']:.3f}** | {b['micro_batches_per_rank']:.1f} | "
                     f"{r['dp_balanced_over_wlb']:.3f} | {a['refused']} / {b['refused']} |")
    return "\n".join(lines) + "\n"


def compact_table(result: dict, peer: str, metric: str, ratio: str) -> str:
    """Per stream and DP size: ``metric`` of ``peer`` and of wlb, and their iteration-time ratio ``ratio``."""
    dps = sorted({r["dp"] for r in result["rows"]})
    by = {(r["stream"], r["dp"]): r for r in result["rows"]}
    streams = sorted({r["stream"] for r in result["rows"]}, key=lambda s: STREAMS.index(s) if s in STREAMS else 99)
    lines = ["| stream | " + " | ".join(f"DP {dp}: {peer} / **wlb** (time ratio)" for dp in dps) + " |",
             "|---|" + "---|" * len(dps)]
    for stream in streams:
        cells = []
        for dp in dps:
            r = by.get((stream, dp))
            cells.append("" if r is None else f"{r[peer][metric]:.2f} / **{r['wlb'][metric]:.2f}** ({r[ratio]:.2f}x)")
        lines.append(f"| {stream} | " + " | ".join(cells) + " |")
    return "\n".join(lines) + "\n"


def readme_table(result: dict) -> str:
    """The results page's compact table: per stream and DP size, slowest rank / balanced of dp_balanced and wlb,
    and the iteration-time ratio dp_balanced / wlb."""
    return compact_table(result, "dp_balanced", "schedule_ratio", "dp_balanced_over_wlb")


def to_markdown(result: dict) -> str:
    ratios = [r["dp_balanced_over_wlb"] for r in result["rows"]]
    return "\n".join([
        "# Megatron-LM main's sequence-packing schedulers: dp_balanced vs wlb", "",
        f"Machine: {result['machine']}. Generated by `{result['command']}` ({result['iterations']} global batches "
        f"per row; Megatron-LM main at {result['megatron_commit']}; {result['config']}'s 7B cost model, CP "
        f"{result['cp']}, PP {result['pp']}, window {result['window']} tokens per DP rank's micro-batch).", "",
        "Both schedulers answer main's `get_groups_and_subsamples` for the same global batches (documents in "
        "arrival order, DP x 4 x 128K tokens each, longer documents cut at the window beforehand). slowest rank / "
        "balanced = sum over global batches of the slowest DP rank's 1F1B time over the same with every "
        "micro-batch at the batch's mean (`packing.metrics.slowest_rank_schedule_time`; each plan against its own "
        "ideal, so it also shows the bubble of fewer micro-batches); iteration time dp_balanced / wlb = the ratio "
        "of the summed slowest-rank 1F1B times (> 1: wlb's iterations are shorter by the cost model). Main packs "
        "samples whole and needs every DP rank to run the same number of non-empty micro-batches, so a global batch "
        "of fewer samples than that takes (a long document cut into window-sized pieces) cannot be planned: "
        "dp_balanced asserts, wlb refuses with a ValueError; rows are scored over the batches both planned.", "",
        summary_table(result),
        f"iteration time dp_balanced / wlb: {min(ratios):.3f} to {max(ratios):.3f} (geo-mean "
        f"{float(np.exp(np.mean(np.log(ratios)))):.3f}). Plan time per global batch: dp_balanced "
        f"{np.mean([r['dp_balanced']['plan_ms'] for r in result['rows']]):.1f} ms, wlb "
        f"{np.mean([r['wlb']['plan_ms'] for r in result['rows']]):.1f} ms (mean over rows, one CPU thread).", ""]
        + [f"- {r['stream']}, DP {r['dp']}: {name} refused {r[name]['refused']} ({r[name]['refusal']})"
           for r in result["rows"] for name in ("dp_balanced", "wlb") if r[name]["refused"]] + [""])


# -- dev's dynamic context parallelism (``--dynamic-cp``) --------------------------------------------------------
DYNAMIC_OUT = ROOT / "benchmarks" / "results" / "dynamic_cp_scheduler"
DYNAMIC_README_MARK = "<!-- dynamic-cp-scheduler-table -->"
INTAKE_README_MARK = "<!-- dynamic-cp-intake-table -->"


def dev_checkout(keep: Path) -> Path:
    """A Megatron-LM dev work tree: ``$MEGATRON_LM`` if it is one holding dev's dynamic-CP scheduler, else
    ``DEV_COMMIT`` checked out from the repository it names (default: the mirror) under ``keep``."""
    source = os.environ.get("MEGATRON_LM") or DEFAULT_MIRROR
    schedule = Path(source) / "megatron" / "core" / "datasets" / "data_schedule.py"
    if schedule.exists() and "DefaultDynamicCPScheduler" in schedule.read_text():
        return Path(source)
    dest = keep / "Megatron-LM-dev"
    subprocess.run(["git", "clone", "-q", "--shared", "--no-checkout", source, str(dest)], check=True)
    subprocess.run(["git", "-C", str(dest), "checkout", "-q", "--detach", DEV_COMMIT], check=True)
    return dest


def rank_groups_critical_path(groups: list, prices: dict[int, np.ndarray], overheads: dict[int, float]) -> float:
    """Seconds per layer of one global batch's plan on the DP x CP grid: ``groups[k][j]`` holds the sample ids of
    micro-batch k on rank j; a sample held by ``g`` ranks runs as one CP group over them, each paying
    ``prices[g][sample]`` (the cost model's forward + backward latency at CP ``g``: its share of the compute plus
    the K/V all-gather over ``g`` ranks), and a rank holding anything in a micro-batch pays ``overheads[g]`` (the
    micro-batch's fixed cost and collective latencies at its largest group). Within a micro-batch, ranks joined by
    shared samples start together (when the last of them finished the previous micro-batch); a rank's time is
    the sum of its shares."""
    ranks = len(groups[0])
    finish = np.zeros(ranks)
    for micro_batch in groups:
        holders: dict[int, list[int]] = {}
        for j, ids in enumerate(micro_batch):
            for i in ids:
                holders.setdefault(int(i), []).append(j)
        parent = list(range(ranks))
        for members in holders.values():
            for j in members[1:]:
                parent[_root(parent, j)] = _root(parent, members[0])
        start: dict[int, float] = {}
        for j in range(ranks):
            r = _root(parent, j)
            start[r] = max(start.get(r, 0.0), float(finish[j]))
        work = np.zeros(ranks)
        widest = np.zeros(ranks, dtype=np.int64)
        for i, members in holders.items():
            for j in members:
                work[j] += prices[len(members)][i]
                widest[j] = max(widest[j], len(members))
        work += np.array([overheads[int(g)] if g else 0.0 for g in widest])
        finish = np.array([start[_root(parent, j)] + work[j] for j in range(ranks)])
    return float(finish.max())


def _root(parent: list[int], x: int) -> int:
    """Union-find root of ``x`` (path halving)."""
    while parent[x] != x:
        parent[x] = parent[parent[x]]
        x = parent[x]
    return x


def check_grid_plan(groups: list, size: int, ranks: int, name: str) -> None:
    placed = {int(i) for mb in groups for ids in mb for i in ids}
    if placed != set(range(size)) or any(len(mb) != ranks for mb in groups):
        raise AssertionError(f"{name}: the plan does not place every sample over the {ranks} DP x CP ranks")


#: the planners of ``--dynamic-cp``: dev's, our fixed-group wlb (adaptive sharding inside each DP rank's CP group),
#: and our joint dynamic-CP planner (``cp.dynamic``)
DYNAMIC_PLANNERS = ("default_dynamic_cp", "wlb", "dynamic")


def run_dynamic(streams: list[str], dps: list[int], iterations: int, intake_iterations: int = 0) -> dict:
    """dev's ``default_dynamic_cp`` (``DefaultDynamicCPScheduler``, imported from a dev checkout), our fixed-group
    wlb and our dynamic-CP planner (``cp.dynamic.plan_dynamic_cp``) on the same global batches, PP 1 (dev's
    dynamic CP plans one pipeline stage), scored by ``rank_groups_critical_path`` with each sample priced at the
    CP size of the group that runs it (communication charged to all three). With ``intake_iterations``, also
    ours with wlb's intake (``sim.dyncp.simulate_dynamic_stream``: the wlb packer, outlier delay included, picks
    each iteration's documents, the planner places them), beside those micro-batches on fixed CP groups."""
    run_cfg = load_config(CONFIG)
    window, cp, n = run_cfg.packing.seq_len, run_cfg.layout.cp, run_cfg.packing.n
    with tempfile.TemporaryDirectory() as keep:
        checkout = dev_checkout(Path(keep))
        sys.path.insert(0, str(checkout))
        from megatron_wlb.megatron.args.compat import install_python_shims

        install_python_shims()
        from megatron.core.datasets import data_schedule

        from megatron_wlb.megatron.hooks import main_schedule

        print(main_schedule.register(), file=sys.stderr)
        Dynamic, Wlb = data_schedule.DefaultDynamicCPScheduler, main_schedule.scheduler_class()
        commit = subprocess.run(["git", "-C", str(checkout), "rev-parse", "HEAD"], capture_output=True,
                                text=True).stdout.strip() or "unknown (not a git work tree)"
        rows = []
        for dp in dps:
            plan_cost = build_cost_model(run_cfg.model, dataclasses.replace(run_cfg.layout, dp=dp, pp=1))
            costs = group_cost_models(plan_cost, dp * cp)
            overheads = {g: overhead_seconds(c) for g, c in costs.items()}
            budget = dp * n * window
            for stream in streams:
                raw, docs = stream_lengths(stream, (iterations + 2) * budget)
                lengths = split_documents(raw, window)
                schedulers = {"default_dynamic_cp": Dynamic(window // cp, cp, dp, None, min_cp_size=1),
                              "wlb": Wlb(window // cp, cp, dp, None, cost=plan_cost, stages=1)}
                stats = {name: {"time_s": 0.0, "micro_batches": [], "plan_s": 0.0, "refused": 0, "refusal": ""}
                         for name in DYNAMIC_PLANNERS}
                ideal, bound, least, scored = 0.0, 0.0, 0.0, 0
                for batch in global_batches(lengths, budget, iterations):
                    prices = {g: piece_latency(c, batch) for g, c in costs.items()}
                    plans = {}
                    for name in DYNAMIC_PLANNERS:
                        t0 = time.perf_counter()
                        try:
                            if name == "dynamic":
                                ours = plan_dynamic_cp(batch, dp * cp, window // cp, costs)
                                groups = ours.rank_groups()
                            else:
                                groups = schedulers[name].get_groups_and_subsamples(list(enumerate(batch.tolist())))
                        except (AssertionError, ValueError) as exc:
                            stats[name]["refused"] += 1
                            stats[name]["refusal"] = f"{type(exc).__name__}: {exc}"
                            continue
                        finally:
                            stats[name]["plan_s"] += time.perf_counter() - t0
                        check_grid_plan(groups, batch.size, dp * cp, name)
                        plans[name] = groups
                    if len(plans) < len(DYNAMIC_PLANNERS):
                        continue  # scored only where all planned
                    scored += 1
                    ideal += float(prices[1].sum()) / (dp * cp)
                    bound += memory_bound(batch, dp * cp, window // cp, costs)
                    least += lower_bound(batch, dp * cp, window // cp, costs)
                    for name, groups in plans.items():
                        took = rank_groups_critical_path(groups, prices, overheads)
                        # the planner prices its micro-batches as laid out (each rank's share), the grid scorer every
                        # scheduler's documents apart, the same for all: they agree within the kernel table's few %
                        if name == "dynamic" and not np.isclose(took, ours.slowest_seconds, rtol=0.03):
                            raise AssertionError(f"dynamic: the planner predicted {ours.slowest_seconds} s, the grid "
                                                 f"scorer says {took} s")
                        stats[name]["time_s"] += took
                        stats[name]["micro_batches"].append(len(groups))
                row: dict = {"stream": stream, "dp": dp, "documents": docs, "global_batches": iterations,
                             "scored_batches": scored, "ideal_s": ideal,
                             "memory_bound_over_ideal": bound / ideal if ideal else float("nan"),
                             "lower_bound_over_ideal": least / ideal if ideal else float("nan")}
                for name, st in stats.items():
                    row[name] = {"time_s": st["time_s"], "over_ideal": st["time_s"] / ideal if ideal else float("nan"),
                                 "micro_batches": float(np.mean(st["micro_batches"])) if st["micro_batches"] else 0.0,
                                 "plan_ms": 1e3 * st["plan_s"] / iterations, "refused": st["refused"],
                                 "refusal": st["refusal"]}
                if intake_iterations:
                    row["wlb_intake"] = wlb_intake(run_cfg, plan_cost, lengths, dp, intake_iterations)
                row["dynamic_over_wlb"] = row["default_dynamic_cp"]["time_s"] / row["wlb"]["time_s"]
                row["dev_over_ours"] = row["default_dynamic_cp"]["time_s"] / row["dynamic"]["time_s"]
                row["wlb_over_ours"] = row["wlb"]["time_s"] / row["dynamic"]["time_s"]
                print(f"dp {dp} {stream:8s} over ideal: dev {row['default_dynamic_cp']['over_ideal']:.3f}"
                      f" wlb {row['wlb']['over_ideal']:.3f} dynamic {row['dynamic']['over_ideal']:.3f}; time dev / "
                      f"dynamic {row['dev_over_ours']:.3f}; refused {[row[k]['refused'] for k in DYNAMIC_PLANNERS]} of "
                      f"{iterations}", file=sys.stderr, flush=True)
                rows.append(row)
    return {"machine": machine(), "command": "python benchmarks/bench_main_scheduler.py --dynamic-cp",
            "config": CONFIG, "megatron_commit": commit, "window": window, "cp": cp, "pp": 1,
            "iterations": iterations, "intake_iterations": intake_iterations, "communication_charged": True,
            "rows": rows}


def wlb_intake(run_cfg: Any, cost: Any, lengths: np.ndarray, dp: int, iterations: int) -> dict:
    """Our dynamic CP with wlb's intake at PP 1 and ``dp``: over ideal, the memory bound over ideal, and the
    packer's own micro-batches on fixed CP groups over ours (``sim.dyncp.simulate_dynamic_stream``)."""
    cfg = dataclasses.replace(run_cfg, layout=dataclasses.replace(run_cfg.layout, dp=dp, pp=1),
                              packing=dataclasses.replace(run_cfg.packing, dp=dp, pipeline_stages=1))
    its = simulate_dynamic_stream(cfg, cost, "wlb", lengths, iterations)
    took, ideal = sum(r.time for r in its), sum(r.ideal for r in its)
    return {"iterations": len(its), "over_ideal": took / ideal, "bound_over_ideal": sum(r.bound for r in its) / ideal,
            "fixed_over_dynamic": sum(r.fixed for r in its) / took}


def intake_table(result: dict) -> str:
    """Per stream and DP size: ours with wlb's intake, over ideal (bound), and fixed CP groups / ours."""
    dps = sorted({r["dp"] for r in result["rows"] if "wlb_intake" in r})
    by = {(r["stream"], r["dp"]): r["wlb_intake"] for r in result["rows"] if "wlb_intake" in r}
    lines = ["| stream | " + " | ".join(f"DP {dp}: **dynamic** (bound), fixed / dynamic" for dp in dps) + " |",
             "|---|" + "---|" * len(dps)]
    for stream in [s for s in STREAMS if any(k[0] == s for k in by)]:
        cells = [f"**{w['over_ideal']:.2f}** ({w['bound_over_ideal']:.2f}), {w['fixed_over_dynamic']:.2f}x"
                 if (w := by.get((stream, dp))) else "" for dp in dps]
        lines.append(f"| {stream} | " + " | ".join(cells) + " |")
    geo = [f"**{_geo([by[k]['over_ideal'] for k in by if k[1] == dp]):.3f}** "
           f"({_geo([by[k]['bound_over_ideal'] for k in by if k[1] == dp]):.3f}), "
           f"{_geo([by[k]['fixed_over_dynamic'] for k in by if k[1] == dp]):.2f}x" for dp in dps]
    lines.append("| geo-mean | " + " | ".join(geo) + " |")
    return "\n".join(lines) + "\n"


def dynamic_readme_table(result: dict) -> str:
    """Per stream and DP size: time over ideal of default_dynamic_cp, fixed-group wlb and our dynamic CP, then
    the geometric mean over the streams per DP size."""
    dps = sorted({r["dp"] for r in result["rows"]})
    present = [s for s in STREAMS if any(r["stream"] == s for r in result["rows"])]
    by = {(r["stream"], r["dp"]): r for r in result["rows"]}
    head = " | ".join(f"DP {dp}: default_dynamic_cp / wlb / **dynamic** (bound)" for dp in dps)
    lines = [f"| stream | {head} |",
             "|---|" + "---|" * len(dps)]
    for stream in present:
        cells = []
        for dp in dps:
            r = by.get((stream, dp))
            cells.append("" if r is None else " / ".join(f"{r[k]['over_ideal']:.2f}" for k in DYNAMIC_PLANNERS[:2])
                         + f" / **{r['dynamic']['over_ideal']:.2f}** ({r['lower_bound_over_ideal']:.2f})")
        lines.append(f"| {stream} | " + " | ".join(cells) + " |")
    cells = []
    for dp in dps:
        rows = [r for r in result["rows"] if r["dp"] == dp]
        cells.append(" / ".join(f"{_geo([r[k]['over_ideal'] for r in rows]):.3f}" for k in DYNAMIC_PLANNERS[:2])
                     + f" / **{_geo([r['dynamic']['over_ideal'] for r in rows]):.3f}** "
                     f"({_geo([r['lower_bound_over_ideal'] for r in rows]):.3f})")
    lines.append("| geo-mean | " + " | ".join(cells) + " |")
    return "\n".join(lines) + "\n"


def _geo(values: list[float]) -> float:
    return float(np.exp(np.mean(np.log(values)))) if values else float("nan")


def dynamic_markdown(result: dict) -> str:
    dev = [r["dev_over_ours"] for r in result["rows"]]
    fixed = [r["wlb_over_ours"] for r in result["rows"]]
    ours = [r["dynamic"]["over_ideal"] for r in result["rows"]]
    gap = [r["dynamic"]["over_ideal"] / r.get("lower_bound_over_ideal", r["memory_bound_over_ideal"])
           for r in result["rows"]]
    return "\n".join([
        "# Dynamic CP: Megatron-LM dev's default_dynamic_cp, fixed-group wlb, and our dynamic-CP planner", "",
        f"Machine: {result['machine']}. Generated by `{result['command']}` ({result['iterations']} global batches "
        f"per row; Megatron-LM dev at {result['megatron_commit']}; {result['config']}'s 7B cost model, CP "
        f"{result['cp']} x DP ranks, PP 1, {result['window'] // result['cp']} tokens per rank).", "",
        "All three plan the same global batches (documents in arrival order, DP x 4 x 128K tokens, longer ones cut "
        "at 128K) over the DP x CP ranks. default_dynamic_cp (dev's `get_groups_and_subsamples`) gives each sample "
        "a power-of-two CP group (seq_len^2 / cp greedy); wlb keeps each DP rank's CP group and balances the cost "
        "model's latency over DP ranks; dynamic (`megatron_wlb.cp.dynamic.plan_dynamic_cp`, `--wlb-cp-sharding "
        "dynamic`) picks each micro-batch's group size and ranks together with the packing, pricing each group's "
        "CP all-gather. Scored alike (`rank_groups_critical_path`): a sample held by g ranks costs each of them the "
        "cost model's forward + backward latency per layer at CP g (its 1/g of the compute plus the K/V all-gather "
        "over g ranks: communication charged to all three), plus the micro-batch's fixed cost; ranks joined by a "
        "shared sample start a micro-batch together; the iteration ends with the last rank. over ideal = that time "
        "over the batch's latency at CP 1 (compute only, no CP communication) / (DP x CP). The planner's own "
        "prediction equals the scorer's time on every batch (checked). bound = a lower bound for any plan under "
        "the memory cap (`cp.dynamic.lower_bound`): the least T for which the documents' rank-seconds, each at the "
        f"cheapest group size its tokens fit ({result['window'] // result['cp']} per rank) whose per-rank price is "
        "at most T, plus the fixed cost of the fewest micro-batch shares that hold the tokens, spread perfectly over "
        "the ranks, fit in T (a rank running a document takes at least its price); over the ideal it is the CP "
        "communication and fixed costs any plan pays. The older `memory_bound` (every document at its smallest "
        "group, no fixed cost) is in the JSON.", "",
        dynamic_readme_table(result),
        f"dynamic over ideal: {min(ours):.3f} to {max(ours):.3f} (over its lower bound: "
        f"{min(gap):.3f} to {max(gap):.3f}, geo-mean {_geo(gap):.3f}); time default_dynamic_cp / dynamic: "
        f"{min(dev):.3f} to {max(dev):.3f} (geo-mean {_geo(dev):.3f}); time wlb / dynamic: {min(fixed):.3f} to "
        f"{max(fixed):.3f} "
        f"(geo-mean {_geo(fixed):.3f}); micro-batch steps per global batch: "
        + ", ".join(f"{k} {np.mean([r[k]['micro_batches'] for r in result['rows']]):.1f}" for k in DYNAMIC_PLANNERS)
        + "; plan time per global batch: "
        + ", ".join(f"{k} {np.mean([r[k]['plan_ms'] for r in result['rows']]):.1f} ms" for k in DYNAMIC_PLANNERS)
        + " (mean over rows, one CPU thread); dynamic's per DP size: "
        + ", ".join(f"DP {dp} {np.mean([r['dynamic']['plan_ms'] for r in result['rows'] if r['dp'] == dp]):.1f} ms"
                    for dp in sorted({r["dp"] for r in result["rows"]})) + ".", ""]
        + [f"- {r['stream']}, DP {r['dp']}: {name} refused {r[name]['refused']} ({r[name]['refusal']})"
           for r in result["rows"] for name in DYNAMIC_PLANNERS if r[name]["refused"]] + [""]
        + ([f"## Dynamic CP with wlb's intake ({result['intake_iterations']} iterations per row)", "",
            "Dev's API hands a scheduler fixed global batches; planned with the packing, the wlb packer (its queues "
            "and outlier delay) picks each iteration's documents (DP x 4 x 128K tokens of the same stream, cut at "
            "128K) and the dynamic-CP planner places them (`sim.dyncp.simulate_dynamic_stream`, what `wlb simulate "
            "--cp-sharding dynamic` runs). Cells: over ideal, same definition (bound), and the packer's own "
            "micro-batches on each DP rank's fixed CP 2 group, priced alike, over ours.", "",
            intake_table(result)] if result.get("intake_iterations") else []))


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--iterations", type=int, default=50, help="global batches per stream and DP size")
    ap.add_argument("--render", default=None,
                    help="only re-render the Markdown (and the results page table) from this JSON")
    ap.add_argument("--streams", default=",".join(STREAMS))
    ap.add_argument("--dp", default="1,2,4,8")
    ap.add_argument("--out", default=None, help="results path without extension (default benchmarks/results/"
                    "main_scheduler, or dynamic_cp_scheduler with --dynamic-cp)")
    ap.add_argument("--page", action="store_true", help=f"also write the summary table after {README_MARK} "
                    f"(with --dynamic-cp: {DYNAMIC_README_MARK}) in the results page")
    ap.add_argument("--intake-iterations", type=int, default=20, help="with --dynamic-cp: iterations per row of "
                    "ours with wlb's intake (0: skip)")
    ap.add_argument("--dynamic-cp", action="store_true", help="compare Megatron-LM dev's default_dynamic_cp "
                    f"scheduler (a dev checkout, {DEV_COMMIT[:12]}) with wlb instead of main's dp_balanced")
    args = ap.parse_args(argv)
    dynamic = args.dynamic_cp
    out = args.out or str(DYNAMIC_OUT if dynamic else ROOT / "benchmarks" / "results" / "main_scheduler")
    if args.render:
        result = json.loads(Path(args.render).read_text())
    elif dynamic:
        result = run_dynamic(args.streams.split(","), [int(x) for x in args.dp.split(",")], args.iterations,
                             args.intake_iterations)
    else:
        result = run(args.streams.split(","), [int(x) for x in args.dp.split(",")], args.iterations)
    write_result(out, result, dynamic_markdown if dynamic else to_markdown)
    if args.page:
        if dynamic:
            replace_readme_table(RESULTS_PAGE, DYNAMIC_README_MARK, dynamic_readme_table(result))
            if result.get("intake_iterations"):
                replace_readme_table(RESULTS_PAGE, INTAKE_README_MARK, intake_table(result))
        else:
            replace_readme_table(RESULTS_PAGE, README_MARK, readme_table(result))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
