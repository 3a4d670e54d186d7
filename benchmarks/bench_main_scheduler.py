#!/usr/bin/env python
"""megatron-wlb against Megatron-LM main's own sequence-packing scheduler, one command:
``python benchmarks/bench_main_scheduler.py [--iterations K] [--page]``.

Main's ``DpBalancedScheduler.get_groups_and_subsamples`` (``sequence_packing_scheduler = "dp_balanced"``, imported
from a Megatron-LM main checkout: the work tree ``$MEGATRON_LM`` names, or a checkout of ``version.MAIN_COMMIT``
from the repository it names, default the machine's mirror) and ours (``"wlb"``,
``megatron_wlb.megatron.main_schedule``) group the same global batches of the same streams as bench_packing.py
(the embedded WLB-LLM stand-in and the corpora of benchmarks/build_corpora.py), at DP 1, 2, 4, 8 with
configs/7b_128k.yaml's model and layout (CP 2, PP 4: main's window ``max_seqlen_per_dp_cp_rank x cp`` = 128K
tokens per DP rank's micro-batch). A global batch is the documents, in arrival order, of DP x 4 x 128K tokens
(bench_packing's intake); documents longer than the window are cut at it beforehand (as the simulator does),
since main's schedulers place samples whole. Every plan is scored with the project's scorer
(``packing.metrics.slowest_rank_schedule_time``: the slowest DP rank's 1F1B time under the 7B cost model, and the
same with every micro-batch at the iteration's mean); writes benchmarks/results/main_scheduler.{json,md} and, with
``--page``, the summary table after the results page's ``<!-- main-scheduler-table -->``.

``--dynamic-cp``: Megatron-LM dev's ``default_dynamic_cp`` (``DefaultDynamicCPScheduler``, imported from a dev
checkout at ``version.DEV_COMMIT``) against ours on the same global batches, PP 1, scored on the DP x CP grid
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

import numpy as np

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "benchmarks"))

from _results import RESULTS_PAGE, replace_readme_table, write_result  # noqa: E402
from bench_packing import STREAMS, stream_lengths  # noqa: E402

from megatron_wlb.config import load_config  # noqa: E402
from megatron_wlb.costmodel import build_cost_model  # noqa: E402
from megatron_wlb.megatron.version import DEV_COMMIT, MAIN_COMMIT  # noqa: E402
from megatron_wlb.packing.metrics import piece_latency, slowest_rank_schedule_time  # noqa: E402
from megatron_wlb.packing.types import DocPiece, GlobalBatch, MicroBatch  # noqa: E402
from megatron_wlb.provenance import machine  # noqa: E402
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
    from megatron_wlb.megatron.compat import install_python_shims

    install_python_shims()
    from megatron.core.datasets import data_schedule

    from megatron_wlb.megatron import main_schedule

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


def rank_groups_critical_path(groups: list, latency: np.ndarray) -> float:
    """Seconds per layer of one global batch's plan on the DP x CP grid: ``groups[k][j]`` holds the sample ids of
    micro-batch k on rank j; a sample held by several ranks runs as one CP group over them, each doing
    ``latency / group size``. Within a micro-batch, ranks joined by shared samples start together (when the
    last of them finished the previous micro-batch); a rank's time is the sum of its shares. Our plans hold
    each DP rank's samples on all of its CP ranks, so there each DP rank is its own chain."""
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
        for i, members in holders.items():
            for j in members:
                work[j] += latency[i] / len(members)
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


def run_dynamic(streams: list[str], dps: list[int], iterations: int) -> dict:
    """dev's ``default_dynamic_cp`` (``DefaultDynamicCPScheduler``, imported from a dev checkout) and ours on the
    same global batches, PP 1 (dev's dynamic CP plans one pipeline stage), scored by
    ``rank_groups_critical_path`` with the cost model's per-GPU latency of each sample at CP 1."""
    run_cfg = load_config(CONFIG)
    window, cp, n = run_cfg.packing.seq_len, run_cfg.layout.cp, run_cfg.packing.n
    with tempfile.TemporaryDirectory() as keep:
        checkout = dev_checkout(Path(keep))
        sys.path.insert(0, str(checkout))
        from megatron_wlb.megatron.compat import install_python_shims

        install_python_shims()
        from megatron.core.datasets import data_schedule

        from megatron_wlb.megatron import main_schedule

        print(main_schedule.register(), file=sys.stderr)
        Dynamic, Wlb = data_schedule.DefaultDynamicCPScheduler, main_schedule.scheduler_class()
        commit = subprocess.run(["git", "-C", str(checkout), "rev-parse", "HEAD"], capture_output=True,
                                text=True).stdout.strip() or "unknown (not a git work tree)"
        rows = []
        for dp in dps:
            plan_cost = build_cost_model(run_cfg.model, dataclasses.replace(run_cfg.layout, dp=dp, pp=1))
            score_cost = build_cost_model(run_cfg.model, dataclasses.replace(run_cfg.layout, dp=dp, pp=1, cp=1))
            budget = dp * n * window
            for stream in streams:
                raw, docs = stream_lengths(stream, (iterations + 2) * budget)
                lengths = split_documents(raw, window)
                schedulers = {"default_dynamic_cp": Dynamic(window // cp, cp, dp, None, min_cp_size=1),
                              "wlb": Wlb(window // cp, cp, dp, None, cost=plan_cost, stages=1)}
                stats = {name: {"time_s": 0.0, "micro_batches": [], "plan_s": 0.0, "refused": 0, "refusal": ""}
                         for name in schedulers}
                ideal, scored = 0.0, 0
                for batch in global_batches(lengths, budget, iterations):
                    latency = piece_latency(score_cost, batch)
                    plans = {}
                    for name, scheduler in schedulers.items():
                        t0 = time.perf_counter()
                        try:
                            groups = scheduler.get_groups_and_subsamples(list(enumerate(batch.tolist())))
                        except (AssertionError, ValueError) as exc:
                            stats[name]["refused"] += 1
                            stats[name]["refusal"] = f"{type(exc).__name__}: {exc}"
                            continue
                        finally:
                            stats[name]["plan_s"] += time.perf_counter() - t0
                        check_grid_plan(groups, batch.size, dp * cp, name)
                        plans[name] = groups
                    if len(plans) < len(schedulers):
                        continue  # scored only where both planned
                    scored += 1
                    ideal += float(latency.sum()) / (dp * cp)
                    for name, groups in plans.items():
                        stats[name]["time_s"] += rank_groups_critical_path(groups, latency)
                        stats[name]["micro_batches"].append(len(groups))
                row: dict = {"stream": stream, "dp": dp, "documents": docs, "global_batches": iterations,
                             "scored_batches": scored, "ideal_s": ideal}
                for name, st in stats.items():
                    row[name] = {"time_s": st["time_s"], "over_ideal": st["time_s"] / ideal if ideal else float("nan"),
                                 "micro_batches": float(np.mean(st["micro_batches"])) if st["micro_batches"] else 0.0,
                                 "plan_ms": 1e3 * st["plan_s"] / iterations, "refused": st["refused"],
                                 "refusal": st["refusal"]}
                row["dynamic_over_wlb"] = row["default_dynamic_cp"]["time_s"] / row["wlb"]["time_s"]
                print(f"dp {dp} {stream:8s} default_dynamic_cp {row['default_dynamic_cp']['over_ideal']:.3f} wlb "
                      f"{row['wlb']['over_ideal']:.3f} time dynamic / wlb {row['dynamic_over_wlb']:.3f}; refused "
                      f"{row['default_dynamic_cp']['refused']} / {row['wlb']['refused']} of {iterations}",
                      file=sys.stderr, flush=True)
                rows.append(row)
    return {"machine": machine(), "command": "python benchmarks/bench_main_scheduler.py --dynamic-cp",
            "config": CONFIG, "megatron_commit": commit, "window": window, "cp": cp, "pp": 1,
            "iterations": iterations, "rows": rows}


def dynamic_readme_table(result: dict) -> str:
    """Per stream and DP size: critical path / ideal of default_dynamic_cp and wlb, and their time ratio."""
    return compact_table(result, "default_dynamic_cp", "over_ideal", "dynamic_over_wlb")


def dynamic_markdown(result: dict) -> str:
    ratios = [r["dynamic_over_wlb"] for r in result["rows"]]
    return "\n".join([
        "# Megatron-LM dev's dynamic-CP scheduler (default_dynamic_cp) vs wlb", "",
        f"Machine: {result['machine']}. Generated by `{result['command']}` ({result['iterations']} global batches "
        f"per row; Megatron-LM dev at {result['megatron_commit']}; {result['config']}'s 7B cost model, CP "
        f"{result['cp']} x DP ranks, PP 1, {result['window'] // result['cp']} tokens per rank).", "",
        "Both answer dev's `get_groups_and_subsamples` for the same global batches (documents in arrival order, "
        "DP x 4 x 128K tokens, longer ones cut at 128K). default_dynamic_cp gives each sample a power-of-two CP "
        "group over the DP x CP ranks (seq_len^2 / cp greedy); wlb keeps each DP rank's CP group and balances the "
        "cost model's latency over DP ranks. Scored alike: each sample costs the cost model's forward + backward "
        "latency per layer at CP 1, split evenly over the ranks that hold it (no communication charged to either); "
        "ranks joined by a shared sample start a micro-batch together; the iteration ends with the last rank "
        "(`rank_groups_critical_path`). over ideal = that time over the batch's total latency / (DP x CP); time "
        "ratio = default_dynamic_cp / wlb (> 1: wlb's iterations are shorter by this model).", "",
        dynamic_readme_table(result),
        f"time default_dynamic_cp / wlb: {min(ratios):.3f} to {max(ratios):.3f} (geo-mean "
        f"{float(np.exp(np.mean(np.log(ratios)))):.3f}); micro-batches per global batch: default_dynamic_cp "
        f"{np.mean([r['default_dynamic_cp']['micro_batches'] for r in result['rows']]):.1f}, wlb "
        f"{np.mean([r['wlb']['micro_batches'] for r in result['rows']]):.1f} (mean over rows).", ""]
        + [f"- {r['stream']}, DP {r['dp']}: {name} refused {r[name]['refused']} ({r[name]['refusal']})"
           for r in result["rows"] for name in ("default_dynamic_cp", "wlb") if r[name]["refused"]] + [""])


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
    ap.add_argument("--dynamic-cp", action="store_true", help="compare Megatron-LM dev's default_dynamic_cp "
                    f"scheduler (a dev checkout, {DEV_COMMIT[:12]}) with wlb instead of main's dp_balanced")
    args = ap.parse_args(argv)
    dynamic = args.dynamic_cp
    out = args.out or str(DYNAMIC_OUT if dynamic else ROOT / "benchmarks" / "results" / "main_scheduler")
    if args.render:
        result = json.loads(Path(args.render).read_text())
    elif dynamic:
        result = run_dynamic(args.streams.split(","), [int(x) for x in args.dp.split(",")], args.iterations)
    else:
        result = run(args.streams.split(","), [int(x) for x in args.dp.split(",")], args.iterations)
    write_result(out, result, dynamic_markdown if dynamic else to_markdown)
    if args.page:
        if dynamic:
            replace_readme_table(RESULTS_PAGE, DYNAMIC_README_MARK, dynamic_readme_table(result))
        else:
            replace_readme_table(RESULTS_PAGE, README_MARK, readme_table(result))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
