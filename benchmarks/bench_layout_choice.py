#!/usr/bin/env python
"""The layout chooser's order against the order Megatron's own loop measures (issue 59, item 4).

    python benchmarks/bench_layout_choice.py --page    # calibration, chooser, 2 interleaved rounds (~13 min, 2 cores)
    python benchmarks/bench_layout_choice.py --quick   # a smoke run of the same code (window 1024, < 2 min)

On this CPU, 2 ranks ("GPUs"), the tiny GPT and the standard library's corpus of ``bench_paired.py``:

1. **Calibrate** (``bench_paired.calibrate``): short traced runs through Megatron's loop (thread clock), one per
   packing and layout the chooser's candidates use (DP2: wlb, the balanced concat-and-cut, stock grouping; CP2:
   per-document and per-sequence; PP2: wlb), fitted together by ``wlb calibrate --from-trace``. TP2 gives no
   trace to the fit: ``wlb calibrate --from-trace`` fits traces of one TP degree (it refuses a mix), so TP2 is
   priced by the TP1 fit rescaled (compute per GPU / TP; a micro-batch profile measured its collectives inside
   its times, so none are added);
2. **Choose**: ``wlb analyze --choose-layout --gpus 2`` on that profile, the same corpus, the same global batch
   and window (the chooser's own command, its ``--json``): every layout (DP2, CP2, PP2, TP2), each with the
   packing and CP sharding it ranks first for it, ranked by predicted tokens per second;
3. **Measure** each layout with those ``--wlb-*`` flags (``bench_paired.train``: our launcher, Megatron's loop,
   gloo, one process and one thread per core, heap kept and touched first), the same global batch and iterations,
   in ``--rounds`` interleaved rounds (round r runs the layouts in order, round r + 1 in reverse order, so the
   machine's drift falls on every layout alike). Per training step: the replay of the measured thread times
   (``bench_paired.replay``: 1F1B per pipeline over every micro-batch's forward and backward, the slowest rank),
   the wall clock around ``train_step`` (slowest rank) and the cost model's replay of the same plans;
4. **Compare**: per layout, seconds per iteration of ``global batch x seq_len`` tokens (sum of the measured steps'
   seconds over their tokens; steps after the first ``WARMUP_STEPS`` of each run), with a 95% bootstrap interval
   over (round, step) drawn jointly for every layout (paired: the same steps of the same stream); each pair's ratio
   with its interval; the measured order; ``top_choice_over_best_measured`` (the measured time of the chooser's
   first choice over the best measured); whether the order agrees where the measured intervals separate two
   layouts. Writes benchmarks/results/layout_choice.{json,md}; ``--page`` writes the results page's block.

4 ranks (``--gpus 4``) runs the same for every layout of 4 ranks; on 2 cores they are oversubscribed (two ranks per
core) and the tiny GPT has 9 layouts of 4, so it does not fit the 15 minutes of the 2-rank check (the results say so).
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import subprocess
import sys
import time
from collections import defaultdict
from pathlib import Path
from typing import Any

import numpy as np

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO / "benchmarks"))

import bench_paired as paired  # noqa: E402
from _results import RESULTS_PAGE, replace_block, write_result  # noqa: E402

from megatron_wlb.provenance import machine  # noqa: E402

#: sequences of seq_len tokens per iteration (Megatron's --global-batch-size at micro-batch size 1), every layout
GLOBAL_BATCH = 4
#: training steps per measured run, and the first ones left out (the heap grows to its high-water mark)
STEPS = 18
WARMUP_STEPS = 3
#: interleaved rounds (round r in order, r + 1 reversed)
ROUNDS = 2
#: training steps of each calibration run (``wlb calibrate --from-trace`` drops the first 2)
CALIBRATION_STEPS = 14
#: GiB per rank given to the chooser: each rank of the tiny GPT peaks at 3-3.5 GB of this machine's memory
GPU_MEMORY = 8.0
#: iterations the chooser simulates per candidate (at most what the corpus holds)
CHOOSER_ITERATIONS = 30
#: the measured ratio a top choice may be off the best (the issue's target)
TOP_TOLERANCE = 1.03
#: the calibration's traced runs (``bench_paired.CALIBRATIONS`` by name, and PP2 for the pipeline's stages); the
#: quick run's: one packing at DP2 and one CP layout
CALIBRATION_NAMES = ("wlb", "balanced", "stock", "cp-document", "cp-sequence")
QUICK_CALIBRATION_NAMES = ("wlb", "cp-sequence")
PP_CALIBRATION = paired.Comparison("pp-wlb", "wlb, PP2", "the same", {"PP": "2"}, GLOBAL_BATCH,
                                   ("--wlb-packer", "wlb", "--wlb-cp-sharding", "per-sequence"), {})
README_BEGIN, README_END = "<!-- layout-choice -->", "<!-- /layout-choice -->"
DEFAULT_OUT = REPO / "benchmarks" / "results" / "layout_choice"
#: the oversubscription of 4 ranks on 2 cores: two ranks share a core, so a run takes about twice as long
OVERSUBSCRIBED = 2.0


def four_ranks_note(model: dict[str, Any], seq_len: int, run_seconds: float | None, rounds: int) -> str:
    """Why the results hold 2 ranks only: the layouts of 4 ranks the chooser enumerates for this model and batch, and
    the time they would take here (this run's mean run, ``OVERSUBSCRIBED`` times, per layout and round)."""
    from megatron_wlb.costmodel import ModelShape
    from megatron_wlb.sim.layout_search import enumerate_layouts

    labels = [c.label for c in enumerate_layouts(ModelShape(**model), seq_len, 4, GLOBAL_BATCH, gpus_per_node=4)]
    took = "an unknown time (runs reused)" if run_seconds is None else \
        f"about {run_seconds * OVERSUBSCRIBED * len(labels) * rounds / 60:.0f} minutes"
    return (f"4 ranks are not in this run: on this machine's 2 cores two ranks share a core (the wall clock then "
            f"measures the sharing), and the {len(labels)} layouts of 4 ranks ({', '.join(labels)}) at {rounds} "
            f"round(s) would take {took} of measuring (this run's mean run x "
            f"{OVERSUBSCRIBED:g} per layout and round), beyond the 15 of this check; `--gpus 4` runs them.")


def layout_env(layout: dict[str, int]) -> dict[str, str]:
    """The launcher's layout variables (``megatron.cpu.layout_from_env``) of a chooser layout (``tp``, ``cp``, ...)."""
    return {k.upper(): str(layout[k]) for k in ("tp", "cp", "pp", "dp") if layout[k] > 1} or {"DP": "1"}


def tiny_gpt_config(model: dict[str, Any], seq_len: int, gpus: int, path: Path) -> Path:
    """A run config (YAML) of the tiny GPT the profile was fitted on, its window and a layout of ``gpus`` ranks (the
    chooser takes the model and window from it; the layouts are its own)."""
    import yaml

    shape = {k: v for k, v in model.items() if k != "name"}
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(yaml.safe_dump({"name": "tiny-gpt-cpu", "model": shape, "seq_len": seq_len,
                                    "layout": {"tp": 1, "cp": 1, "pp": 1, "dp": gpus},
                                    "micro_batches": GLOBAL_BATCH // gpus}, sort_keys=False))
    return path


def choose(data: Path, profile: Path, config: Path, gpus: int, work: Path, log: Any) -> tuple[dict[str, Any], str]:
    """``wlb analyze --choose-layout`` on the profile and corpus: its ``--json`` and the command (relative paths)."""
    out = work / "choice.json"
    args = ["analyze", "--data-prefix", str(data), "--config", str(config), "--choose-layout", "--gpus", str(gpus),
            "--gpu-memory", f"{GPU_MEMORY:g}", "--gpus-per-node", str(gpus), "--global-batch-size", str(GLOBAL_BATCH),
            "--iterations", str(CHOOSER_ITERATIONS), "--cost-profile", str(profile), "--top", "100", "--json", str(out)]
    start = time.perf_counter()
    proc = subprocess.run([sys.executable, "-m", "megatron_wlb", *args], capture_output=True, text=True)
    (work / "choice.txt").write_text(proc.stdout + proc.stderr)
    if proc.returncode != 0:
        raise SystemExit(f"wlb analyze --choose-layout failed (rc {proc.returncode}):\n{proc.stdout}{proc.stderr}")
    log(f"  chooser: {time.perf_counter() - start:.0f} s")

    def shown(a: str) -> str:
        p = Path(a)
        return str(p.relative_to(REPO)) if p.is_absolute() and p.is_relative_to(REPO) else a

    return json.loads(out.read_text()), "wlb " + " ".join(shown(a) for a in args)


def picks(choice: dict[str, Any]) -> list[dict[str, Any]]:
    """Per layout, the candidate the chooser ranks first for it (its candidates come fastest first), in the
    chooser's order of layouts."""
    seen: dict[str, dict[str, Any]] = {}
    for c in choice["candidates"]:
        seen.setdefault(c["label"], c)
    return list(seen.values())


def run_flags(candidate: dict[str, Any]) -> tuple[str, ...]:
    """The candidate's ``--wlb-*`` flags without its cost profile (``bench_paired.train`` passes the profile)."""
    flags = list(candidate["wlb_flags"])
    if "--wlb-cost-profile" in flags:
        i = flags.index("--wlb-cost-profile")
        del flags[i:i + 2]
    return tuple(flags)


def key_of(candidate: dict[str, Any]) -> str:
    """A folder name of a layout: ``dp2``, ``cp2-tp2``, ..."""
    lay = candidate["layout"]
    return "-".join(f"{k}{lay[k]}" for k in ("tp", "cp", "pp", "dp") if lay[k] > 1) or "one"


def measured_steps(out: Path, candidate: dict[str, Any], warmup: int) -> list[dict[str, float]]:
    """One run's steps after ``warmup``: the replay of the measured thread times, the cost model's replay of the
    same plans, the slowest rank's wall and the global batch's tokens (dynamic CP: the group-synchronous replay)."""
    from megatron_wlb.costmodel.trace import read_trace

    lay = candidate["layout"]
    pp, cp = int(lay["pp"]), int(lay["cp"])
    dynamic = candidate["cp_sharding"] == "dynamic"
    walls: dict[int, float] = defaultdict(float)
    tokens: dict[int, int] = {}
    blocks: dict[int, dict[int, Any]] = defaultdict(dict)
    for path in out.glob("rank*.json"):
        for s in json.loads(path.read_text())["steps"]:
            walls[s["step"]] = max(walls[s["step"]], s["wall_s"])
            tokens[s["step"]] = max(tokens.get(s["step"], 0), s["tokens"])
            if "blocks" in s:
                blocks[s["step"]][s["slot"]] = s["blocks"]
    trace = read_trace(out / "trace.jsonl")
    megatron_cp = {r.rank: r.cp for r in trace.iterations}  # a dynamic-CP row's cp is its place in its group
    by_step: dict[int, list[Any]] = defaultdict(list)
    for r in trace.micro_batches:
        by_step[r.iteration].append(dataclasses.replace(r, cp=megatron_cp[r.rank]) if dynamic else r)
    rows = []
    for s in sorted(by_step):
        if s < warmup or s not in walls:
            continue
        if dynamic:  # the planner's groups: a group's micro-batch waits for all its members (bench_paired)
            priced = [dataclasses.replace(r, fwd_s=r.pred_fwd_s, bwd_s=r.pred_bwd_s) for r in by_step[s]]
            replayed = paired.replay_pool(by_step[s], cp, blocks[s])
            predicted = paired.replay_pool(priced, cp, blocks[s])
        else:
            replayed, predicted = paired.replay(by_step[s], pp, False), paired.replay(by_step[s], pp, True)
        rows.append({"step": s, "tokens": tokens[s], "wall_s": walls[s], "replay_s": replayed,
                     "predicted_s": predicted})
    return rows


def bootstrap(per_layout: dict[str, dict[str, np.ndarray]], kind: str, iteration_tokens: int, seed: int = 0,
              draws: int = 4000) -> tuple[dict[str, float], dict[str, np.ndarray]]:
    """Per layout, seconds per iteration (``kind`` seconds summed over the steps, over their tokens, times
    ``iteration_tokens``) and its bootstrap draws, the (round, step) units drawn jointly for every layout."""
    n = len(next(iter(per_layout.values()))["tokens"])
    idx = np.random.default_rng(seed).integers(0, n, size=(draws, n))
    point, dist = {}, {}
    for name, v in per_layout.items():
        point[name] = float(v[kind].sum() / v["tokens"].sum() * iteration_tokens)
        dist[name] = v[kind][idx].sum(axis=1) / v["tokens"][idx].sum(axis=1) * iteration_tokens
    return point, dist


def interval(values: np.ndarray) -> list[float]:
    low, high = np.percentile(values, [2.5, 97.5])
    return [float(low), float(high)]


def order_check(names: list[str], predicted: dict[str, float], point: dict[str, float],
                dist: dict[str, np.ndarray]) -> dict[str, Any]:
    """The measured order, each pair's measured ratio (slower over faster, with its interval), and the pairs the
    intervals separate whose predicted order is the other way round (predicted seconds per iteration)."""
    order = sorted(names, key=lambda n: point[n])
    pairs, wrong = [], []
    for i, fast in enumerate(order):
        for slow in order[i + 1:]:
            ratio = dist[slow] / dist[fast]
            low, high = interval(ratio)
            separated = low > 1.0
            flipped = predicted[slow] < predicted[fast]
            pairs.append({"slower": slow, "faster": fast, "ratio": point[slow] / point[fast], "low": low,
                          "high": high, "separated": separated, "predicted_flipped": flipped})
            if separated and flipped:
                wrong.append(f"{slow} over {fast}")
    return {"order": order, "pairs": pairs, "disagreements": wrong, "agrees": not wrong}


def analyse(candidates: list[dict[str, Any]], runs: dict[str, list[list[dict[str, float]]]], seq_len: int,
            chooser: list[str]) -> dict[str, Any]:
    """Predicted beside measured per layout, the orders, ``top_choice_over_best_measured`` and the checks."""
    iteration_tokens = GLOBAL_BATCH * seq_len
    by_unit = {c["label"]: {(r, row["step"]): row for r, rows in enumerate(runs[c["label"]]) for row in rows}
               for c in candidates}
    common = sorted(set.intersection(*(set(u) for u in by_unit.values())))  # (round, step) every layout measured
    if not common:
        raise SystemExit("no (round, step) measured by every layout: the runs' traces hold no step after the warm-up "
                         f"({WARMUP_STEPS} steps); give more --steps")
    per = {name: {k: np.array([rows[u][k] for u in common], dtype=np.float64)
                  for k in ("tokens", "wall_s", "replay_s", "predicted_s")} for name, rows in by_unit.items()}
    units = len(common)
    replay_point, replay_dist = bootstrap(per, "replay_s", iteration_tokens)
    wall_point, wall_dist = bootstrap(per, "wall_s", iteration_tokens)
    plans_point, _ = bootstrap(per, "predicted_s", iteration_tokens)
    predicted = {c["label"]: iteration_tokens / c["tokens_per_second"] for c in candidates}
    names = [c["label"] for c in candidates]
    layouts = []
    for c in candidates:
        name = c["label"]
        layouts.append({
            "label": name, "layout": c["layout"], "method": c["method"], "packer": c["packer"],
            "cp_sharding": c["cp_sharding"], "run_flags": list(run_flags(c)),
            "predicted_rank": chooser.index(name) + 1,
            "predicted_tokens_per_second": c["tokens_per_second"], "predicted_iteration_s": predicted[name],
            "chooser_iteration_s": c["iteration_seconds"], "bubble_fraction": c["bubble_fraction"],
            "gpu_imbalance": c["gpu_imbalance"], "cp_comm_share": c["cp_comm_share"], "memory_gib": c["memory_gib"],
            "measured_iteration_s": replay_point[name], "measured_interval": interval(replay_dist[name]),
            "measured_tokens_per_second": iteration_tokens / replay_point[name],
            "measured_over_predicted": replay_point[name] / predicted[name],
            "wall_iteration_s": wall_point[name], "wall_interval": interval(wall_dist[name]),
            "plans_predicted_iteration_s": plans_point[name],
            "steps": int(units), "tokens": int(per[name]["tokens"].sum())})
    top = chooser[0]

    def top_over_best(point: dict[str, float], dist: dict[str, np.ndarray]) -> dict[str, Any]:
        best = min(names, key=lambda n: point[n])
        ratio = dist[top] / dist[best]
        return {"best": best, "ratio": point[top] / point[best], "interval": interval(ratio) if top != best
                else [1.0, 1.0]}

    replay_top, wall_top = top_over_best(replay_point, replay_dist), top_over_best(wall_point, wall_dist)
    check = order_check(names, predicted, replay_point, replay_dist)
    wall_check = order_check(names, predicted, wall_point, wall_dist)
    return {"iteration_tokens": iteration_tokens, "layouts": layouts, "predicted_order": chooser,
            "top_choice": top, "measured_order": check["order"], "best_measured": replay_top["best"],
            "top_choice_over_best_measured": replay_top["ratio"],
            "top_choice_over_best_measured_interval": replay_top["interval"],
            "top_within_target": replay_top["ratio"] <= TOP_TOLERANCE,
            "order_agrees_where_separated": check["agrees"], "pairs": check["pairs"],
            "disagreements": check["disagreements"],
            "wall": {"measured_order": wall_check["order"], "best_measured": wall_top["best"],
                     "top_choice_over_best_measured": wall_top["ratio"],
                     "top_choice_over_best_measured_interval": wall_top["interval"],
                     "order_agrees_where_separated": wall_check["agrees"], "pairs": wall_check["pairs"],
                     "disagreements": wall_check["disagreements"]}}


def _s(x: float | None, spec: str = ".3f") -> str:
    return "n/a" if x is None else format(x, spec)


def to_markdown(result: dict[str, Any]) -> str:
    lines = ["# The layout chooser's order against Megatron's measured order", "", *summary_lines(result)]
    lines += ["", "Every pair of layouts, measured (replay): the slower's seconds per iteration over the faster's, "
              "with its paired bootstrap interval; separated = the interval lies above 1.", "",
              "| slower | faster | ratio [95%] | separated | predicted the other way round |", "|---|---|---|---|---|"]
    for p in result["pairs"]:
        lines.append(f"| {p['slower']} | {p['faster']} | {p['ratio']:.3f} [{p['low']:.3f}, {p['high']:.3f}] | "
                     f"{'yes' if p['separated'] else 'no'} | {'yes' if p['predicted_flipped'] else 'no'} |")
    lines += ["", "Each layout's run flags (the chooser's `wlb_flags` for it; the runs add `--wlb-cost-profile` of the "
              "calibration):", ""]
    lines += [f"- {r['label']}: `{' '.join(r['run_flags'])}`" for r in result["layouts"]]
    return "\n".join(lines) + "\n"


def summary_lines(result: dict[str, Any]) -> list[str]:
    """The results page's block: the machine, the command, the table and the verdict."""
    cal = result.get("calibration") or {}
    held = ", ".join(f"{k} {v:.1%}" for k, v in (cal.get("packings") or {}).items())
    quick = " A `--quick` smoke run (window 1024, few steps): not a measurement." if result.get("quick") else ""
    lines = [f"Machine: {result['machine']}; torch {result['torch']}, megatron-core {result['megatron_core']}. "
             f"Generated by `{result['command']}` ({result['minutes']:.1f} min).{quick}", "",
             f"Setup: the tiny GPT (hidden 64, 2 layers, 4 heads), window {result['seq_len']}, global batch "
             f"{result['global_batch']} sequences ({result['iteration_tokens']:,} tokens an iteration) on "
             f"{result['gpus']} ranks; corpus: {result['corpus']['source']}, {result['corpus']['documents']:,} "
             f"documents. Cost model: `wlb calibrate --from-trace` on {len(cal.get('runs', []))} "
             f"{cal.get('steps')}-step traced runs ({', '.join(cal.get('runs', []))}), held-out MAPE per micro-batch "
             f"{_s(cal.get('mape'), '.1%')} ({held or 'n/a'}); TP2 priced by the TP1 fit rescaled (the fit takes "
             "traces of one TP degree). Chooser: `" + result["chooser_command"] + "`. Measured: each layout "
             f"{result['rounds']} interleaved round(s) of {result['steps']} steps through Megatron's loop (the first "
             f"{result['warmup_steps']} of each left out), the chooser's `--wlb-*` flags; replay = the critical path "
             "of the measured thread times (the issue's measure), wall = `train_step`'s clock (slowest rank), plans "
             "= the cost model's replay of the plans that ran. Seconds per iteration of "
             f"{result['iteration_tokens']:,} tokens, 95% bootstrap intervals over the (round, step) units, drawn "
             "jointly for every layout.", "",
             "| layout | chooser's packing, CP sharding | predicted rank | predicted tokens/s | predicted s/it | "
             "measured s/it (replay) [95%] | measured tokens/s | measured / predicted | measured rank | "
             "wall s/it [95%] | plans s/it |",
             "|---|---|---:|---:|---:|---|---:|---:|---:|---|---:|"]
    rank = {name: i + 1 for i, name in enumerate(result["measured_order"])}
    for r in sorted(result["layouts"], key=lambda r: r["predicted_rank"]):
        lo, hi = r["measured_interval"]
        wlo, whi = r["wall_interval"]
        lines.append(f"| {r['label']} | {r['method']}, {r['cp_sharding']} | {r['predicted_rank']} | "
                     f"{r['predicted_tokens_per_second']:,.0f} | {r['predicted_iteration_s']:.3f} | "
                     f"{r['measured_iteration_s']:.3f} [{lo:.3f}, {hi:.3f}] | {r['measured_tokens_per_second']:,.0f} | "
                     f"{r['measured_over_predicted']:.3f} | {rank[r['label']]} | {r['wall_iteration_s']:.3f} "
                     f"[{wlo:.3f}, {whi:.3f}] | {_s(r['plans_predicted_iteration_s'])} |")
    lo, hi = result["top_choice_over_best_measured_interval"]
    wall = result["wall"]
    wlo, whi = wall["top_choice_over_best_measured_interval"]
    separated = [p for p in result["pairs"] if p["separated"]]
    lines += ["", f"- Predicted order: {' > '.join(result['predicted_order'])}; measured (replay): "
              f"{' > '.join(result['measured_order'])}.",
              f"- `top_choice_over_best_measured` = {result['top_choice_over_best_measured']:.3f} [{lo:.3f}, {hi:.3f}] "
              f"(the chooser's first, {result['top_choice']}, over the best measured, {result['best_measured']}): "
              + ("within" if result["top_within_target"] else "**not within**")
              + f" the target of {TOP_TOLERANCE:.2f}.",
              f"- Order where the measured intervals separate two layouts ({len(separated)} of "
              f"{len(result['pairs'])} pairs): " + ("the predicted order agrees." if result[
                  "order_agrees_where_separated"] else "**predicted the other way round: "
                  + "; ".join(result["disagreements"]) + "**."),
              f"- By the wall clock: measured order {' > '.join(wall['measured_order'])}; the chooser's first over the "
              f"best {wall['top_choice_over_best_measured']:.3f} [{wlo:.3f}, {whi:.3f}]; order "
              + ("agrees where separated." if wall["order_agrees_where_separated"] else
                 "the other way round for " + "; ".join(wall["disagreements"]) + "."),
              f"- {result['four_ranks']}"]
    return lines


def readme_summary(result: dict[str, Any]) -> str:
    """The results page's layout-choice block, from ``result``."""
    return "\n".join(summary_lines(result)).strip()


def write_page(result: dict[str, Any], page: Path = RESULTS_PAGE) -> None:
    replace_block(page, README_BEGIN, README_END, readme_summary(result))


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--quick", action="store_true", help="a smoke run: window 1024, short runs, one round")
    ap.add_argument("--gpus", type=int, choices=(2, 4), default=2, help="ranks of every layout (default 2)")
    ap.add_argument("--rounds", type=int, default=None, help=f"interleaved rounds (default {ROUNDS}, quick 1)")
    ap.add_argument("--steps", type=int, default=None, help=f"training steps per measured run (default {STEPS}, "
                                                           "quick 8)")
    ap.add_argument("--work", default=str(REPO / "out" / "layout_choice"), help="run folder (traces, logs)")
    ap.add_argument("--out", default=None, help="results file without suffix (default benchmarks/results/"
                                                "layout_choice; with --gpus 4 layout_choice_4)")
    ap.add_argument("--page", action="store_true", help="also write the results page's layout-choice block")
    ap.add_argument("--reuse", action="store_true", help="reuse the calibration and runs already in --work")
    args = ap.parse_args(argv)
    rounds = args.rounds or (1 if args.quick else ROUNDS)
    steps = args.steps or (8 if args.quick else STEPS)
    if rounds < 1:
        raise SystemExit(f"--rounds {rounds}: give at least 1")
    if steps <= WARMUP_STEPS + 1:
        raise SystemExit(f"--steps {steps}: give more than {WARMUP_STEPS + 1} (the first {WARMUP_STEPS} are left out)")
    out = args.out or str(DEFAULT_OUT if args.gpus == 2 else DEFAULT_OUT.with_name("layout_choice_4"))
    work = Path(args.work)
    seq_len = paired.QUICK_SEQ_LEN if args.quick else paired.SEQ_LEN
    data = work / "corpus" / f"stdlib_files_{seq_len}_text_document"
    corpus = paired.build_corpus(data, seq_len)
    start, machine_name = time.perf_counter(), machine()  # its load average before this run's own

    def log(s: str) -> None:
        print(s, file=sys.stderr, flush=True)

    calibration_steps = 8 if args.quick else CALIBRATION_STEPS
    known = {c.name: c for c in paired.CALIBRATIONS}
    runs = tuple(known[n] for n in QUICK_CALIBRATION_NAMES) if args.quick else \
        (*(known[n] for n in CALIBRATION_NAMES), PP_CALIBRATION)
    run_names = [c.name for c in runs]
    profile = work / "calibration" / "profile.json"
    durations: list[float] = []  # seconds of each measured run (start-up included)
    trained = False  # whether this invocation trained: then its machine and minutes are the result's
    if args.reuse and profile.exists():
        fitted = json.loads(profile.read_text())
    else:
        log("calibration: " + ", ".join(run_names))
        profile, fitted = paired.calibrate(data, work / "calibration", calibration_steps, log, args.quick, runs)
        trained = True
    config = tiny_gpt_config(fitted["model"], seq_len, args.gpus, work / "tiny_gpt.yaml")
    choice, chooser_command = choose(data, profile, config, args.gpus, work, log)
    candidates = picks(choice)
    chooser = [c["label"] for c in candidates]
    log("chooser's order: " + " > ".join(f"{c['label']} ({c['method']}, {c['cp_sharding']}, "
                                          f"{c['tokens_per_second']:,.0f} tokens/s)" for c in candidates))
    measured: dict[str, list[list[dict[str, float]]]] = {c["label"]: [] for c in candidates}
    for r in range(rounds):
        for c in candidates if r % 2 == 0 else candidates[::-1]:
            run = work / "measure" / key_of(c) / f"round{r}"
            comparison = paired.Comparison(c["label"], c["method"], "the same", layout_env(c["layout"]),
                                           GLOBAL_BATCH, run_flags(c), {})
            if not (args.reuse and (run / "train.log").exists()):
                began = time.perf_counter()
                paired.train(comparison, data, run, steps, log, profile, quick=args.quick)
                durations.append(time.perf_counter() - began)
            measured[c["label"]].append(measured_steps(run, c, WARMUP_STEPS))
    import megatron.core
    import torch

    holdout = fitted.get("holdout") or {}
    command = "python benchmarks/bench_layout_choice.py" + (" --quick" if args.quick else "") + \
        (f" --gpus {args.gpus}" if args.gpus != 2 else "") + (f" --rounds {args.rounds}" if args.rounds else "") + \
        (f" --steps {args.steps}" if args.steps else "")
    result = {"machine": machine_name, "command": command, "quick": args.quick, "torch": torch.__version__,
              "megatron_core": megatron.core.__version__, "gpus": args.gpus, "seq_len": seq_len,
              "global_batch": GLOBAL_BATCH, "rounds": rounds, "steps": steps, "warmup_steps": WARMUP_STEPS,
              "corpus": corpus, "chooser_command": chooser_command, "cost_model": choice["cost_model"],
              "calibration": {"steps": calibration_steps, "runs": run_names, "mape": holdout.get("mape"),
                              "packings": holdout.get("packings"), "terms": fitted.get("terms")},
              "four_ranks": four_ranks_note(fitted["model"], seq_len, float(np.mean(durations)) if durations else None,
                                            rounds)
              if args.gpus == 2 else "4 ranks (two a core where the machine has 2: unpinned, the OS shares them).",
              **analyse(candidates, measured, seq_len, chooser)}
    result["minutes"] = (time.perf_counter() - start) / 60
    recorded = Path(out).with_suffix(".json")
    if not (trained or durations) and recorded.exists():  # only re-analysed: the runs' machine and minutes
        before = json.loads(recorded.read_text())
        result["machine"], result["minutes"] = before["machine"], before["minutes"]
    write_result(out, result, to_markdown)
    if args.page:
        write_page(result)
    return 0


if __name__ == "__main__":
    sys.exit(main())
