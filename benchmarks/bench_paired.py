#!/usr/bin/env python
"""Paired runs at equal work: two methods in one Megatron process, alternating ABBA, wall and replay.

    python benchmarks/bench_paired.py --page   # calibration + the paired runs (~20 min on 2 cores) + page block
    python benchmarks/bench_paired.py --quick    # a short smoke run of the same code, window 1024 (slow lane)

First the calibration: one short traced run per packing (wlb, fixed-greedy, whole documents, the balanced
concat-and-cut and stock Megatron's grouping, analytic model, thread clock), so the fit sees every
micro-batch size and composition the comparisons produce, fitted together by ``wlb calibrate --from-trace``
(which chooses the whole-micro-batch terms by the error of each packing held out, and reports it). Every
comparison balances and predicts with that profile. Each comparison is then one training run of
``benchmarks/paired_train.py`` (Megatron's own loop through our launcher, gloo, ``measurement_env``: one process
per core, one thread each, glibc's heap kept): training steps 2k and 2k + 1 train global batch k with
method A and method B, in ABBA order, so the machine's drift cancels within each pair. Per pair, B's time
per unit of work over A's is taken three ways (work: ``step_work``, the documents' price under the profile,
without what a micro-batch costs as a whole, so it is the same for the same documents in any packing; per
token beside it):

- **wall**: ``perf_counter`` around Megatron's ``train_step``, the slowest rank's;
- **replay**: the iteration's critical path replayed from the measured forward and backward thread
  CPU times of every micro-batch (``WLB_TRACE_CLOCK=thread`` trace) through the schedule that ran
  (1F1B per pipeline, the slowest DP rank): preemption and steal drop out, every duration is real;
- **predicted**: the same replay with the cost model's times for the same micro-batches (what the
  packer balanced), the simulator's prediction for these plans.

A ratio is the geometric mean of the per-pair ratios with a bootstrap 95% interval over pairs (the
first ``WARMUP_PAIRS`` pairs are dropped). The comparisons (the CPU configuration of issue 39: seq
4096, the standard library's whole ``.py`` files up to the window, a tiny GPT (hidden 64, 2 layers) in
which attention is most of a step):

- ``users``  DP2: the balanced concat-and-cut (``--wlb-pieces concat-and-cut``) against stock Megatron's
             grouping of the same GPTDataset samples (``original``: one sample a micro-batch, dealt as
             ``MegatronPretrainingSampler`` deals them);
- ``dp`` / ``pp``  DP2 and PP2: wlb against fixed-greedy, documents whole (both read the same stream);
- ``cp``     CP2: the same wlb plans sharded per-document against per-sequence;
- ``aa``     DP2: wlb against itself, the instrument checked (its interval must hold 1);
- ``large``  DP2, one micro-batch per rank: the balanced concat-and-cut against stock grouping, where the
             prediction is large (each rank's one sample is all it runs, so the stock imbalance is a
             sample's).

Writes benchmarks/results/paired.{json,md}; ``--page`` also writes the results page's paired block.
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import time
from collections import defaultdict
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO / "benchmarks"))

from _results import RESULTS_PAGE, write_result  # noqa: E402

from megatron_wlb.megatron.cpu import TINY_GPT_EOD, measurement_env  # noqa: E402
from megatron_wlb.provenance import machine  # noqa: E402

SEQ_LEN = 4096
EOD = TINY_GPT_EOD
#: the quick run's window and heap (``--quick``, the suite's smoke run): the same code at a sixteenth of the
#: attention work per micro-batch (Megatron's local attention is quadratic in the window)
QUICK_SEQ_LEN = 1024
QUICK_PREFAULT_MB = 256


def model_flags(seq_len: int) -> tuple[str, ...]:
    """The tiny GPT's flags (on top of ``TINY_GPT_ARGS``) at a window of ``seq_len`` tokens."""
    return ("--num-layers", "2", "--hidden-size", "64", "--num-attention-heads", "4", "--ffn-hidden-size", "256",
            "--seq-length", str(seq_len), "--max-position-embeddings", str(2 * seq_len), "--vocab-size", "300",
            "--log-interval", "1000", "--split", "100,0,0", "--reset-attention-mask", "--reset-position-ids")


#: pairs dropped at the start: the heap grows to its high-water mark over the first steps (page faults)
WARMUP_PAIRS = 3
#: training steps of each packing's calibration run (``CALIBRATIONS``; 5 packings: ~88 micro-batch rows each after the
#: warm-up ``wlb calibrate --from-trace`` drops)
CALIBRATION_STEPS = 24
#: MiB of heap each rank touches before training (``paired_train.prefault``): about a rank's peak (3.0-3.5 GB measured)
PREFAULT_MB = 3072
#: training steps of each comparison (``--steps``): 6 comparisons and the calibration within ~20 minutes on 2 cores
DEFAULT_STEPS = 70
README_BEGIN, README_END = "<!-- paired -->", "<!-- /paired -->"


@dataclass(frozen=True)
class Comparison:
    """One paired run: A is the run's flags, B the WlbSettings fields that differ (``paired_train``)."""

    name: str
    a: str
    b: str
    layout: dict[str, str]
    global_batch: int
    flags: tuple[str, ...]
    b_fields: dict[str, Any]
    megatron_deal: bool = False


BALANCED = ("--wlb-packer", "wlb", "--wlb-pieces", "concat-and-cut", "--wlb-cp-sharding", "per-sequence")
COMPARISONS = (
    Comparison("users", "balanced concat-and-cut", "stock Megatron grouping", {"DP": "2"}, 4, BALANCED,
               {"packer": "original"}, megatron_deal=True),
    Comparison("dp", "wlb", "fixed-greedy", {"DP": "2"}, 4, ("--wlb-packer", "wlb", "--wlb-cp-sharding",
                                                            "per-sequence"), {"packer": "fixed-greedy"}),
    Comparison("pp", "wlb", "fixed-greedy", {"PP": "2"}, 4, ("--wlb-packer", "wlb", "--wlb-cp-sharding",
                                                            "per-sequence"), {"packer": "fixed-greedy"}),
    Comparison("cp", "per-document", "per-sequence", {"CP": "2"}, 2,
               ("--wlb-packer", "wlb", "--wlb-cp-sharding", "per-document"), {"cp_sharding": "per-sequence"}),
    Comparison("aa", "wlb", "wlb (the same)", {"DP": "2"}, 4, ("--wlb-packer", "wlb", "--wlb-cp-sharding",
                                                             "per-sequence"), {}),
    Comparison("large", "balanced concat-and-cut", "stock Megatron grouping", {"DP": "2"}, 2, BALANCED,
               {"packer": "original"}, megatron_deal=True),
)


def build_corpus(prefix: Path, seq_len: int = SEQ_LEN) -> dict[str, Any]:
    """PREFIX.bin/.idx: the standard library's .py files whole, byte-level, each ended with the tokenizer's
    EOD, those up to the window (longer ones left out, counted): a heavy tail of lengths up to the window.
    Reuses an existing corpus."""
    import sysconfig

    from megatron_wlb.data.reader import byte_documents, write_indexed_dataset

    paths = sorted(str(p) for p in Path(sysconfig.get_paths()["stdlib"]).rglob("*.py")
                   if "site-packages" not in p.parts and "test" not in p.parts)
    every = byte_documents(paths, separator=None, eod=EOD)
    docs = [d for d in every if d.size <= seq_len]
    if not prefix.with_suffix(".idx").exists():
        prefix.parent.mkdir(parents=True, exist_ok=True)
        write_indexed_dataset(str(prefix), docs)
    lengths = np.array([d.size for d in docs])
    return {"source": f"{len(paths)} stdlib .py files (every package but tests) whole, byte-level (+EOD {EOD}), "
                      f"those of at most {seq_len} tokens ({len(every) - len(docs)} longer ones left out)",
            "documents": int(lengths.size), "tokens": int(lengths.sum()), "median": float(np.median(lengths)),
            "p90": float(np.percentile(lengths, 90)), "left_out": len(every) - len(docs)}


#: the calibration: one short run per packing (A and B the same), each traced; fitted together
CALIBRATIONS = (
    Comparison("wlb", "wlb", "wlb", {"DP": "2"}, 4, ("--wlb-packer", "wlb", "--wlb-cp-sharding", "per-sequence"), {}),
    Comparison("fixed-greedy", "fixed-greedy", "fixed-greedy", {"DP": "2"}, 4,
               ("--wlb-packer", "fixed-greedy", "--wlb-cp-sharding", "per-sequence"), {}),
    Comparison("whole-document", "whole-document", "whole-document", {"DP": "2"}, 4,
               ("--wlb-packer", "whole-document", "--wlb-cp-sharding", "per-sequence"), {}),
    Comparison("balanced", "balanced concat-and-cut", "balanced concat-and-cut", {"DP": "2"}, 4, BALANCED, {}),
    Comparison("stock", "stock grouping", "stock grouping", {"DP": "2"}, 4,
               ("--wlb-packer", "original", "--wlb-pieces", "concat-and-cut", "--wlb-cp-sharding", "per-sequence"),
               {}),
)
CALIBRATION = "calibration"


#: the quick run's calibration: two packings of unlike micro-batches (the code path of the held-out packing)
QUICK_CALIBRATIONS = ("wlb", "stock")


def calibrate(data: Path, out: Path, steps: int, log: Any, quick: bool = False) -> tuple[Path, dict[str, Any]]:
    """The cost profile of this machine: one traced run per packing (``CALIBRATIONS``, analytic model, thread
    clock) fitted together by ``wlb calibrate --from-trace``, which reports each packing's held-out error.
    Every comparison balances and predicts with it."""
    traces = []
    for c in CALIBRATIONS:
        if quick and c.name not in QUICK_CALIBRATIONS:
            continue
        train(c, data, out / c.name, steps, log, quick=quick)
        traces.append(str(out / c.name / "trace.jsonl"))
    profile = out / "profile.json"
    cmd = [sys.executable, "-m", "megatron_wlb", "calibrate", "--from-trace", *traces, "--out", str(profile)]
    proc = subprocess.run(cmd, capture_output=True, text=True)
    if proc.returncode != 0:
        raise SystemExit(f"wlb calibrate --from-trace failed:\n{proc.stdout}{proc.stderr}")
    log("  " + proc.stdout.strip().replace("\n", "\n  "))
    return profile, json.loads(profile.read_text())


def train(c: Comparison, data: Path, out: Path, steps: int, log: Any, profile: Path | None = None,
          quick: bool = False) -> None:
    """One paired training run of ``steps`` training steps (``steps / 2`` pairs), balancing ``profile``
    (``quick``: the quick run's window and heap)."""
    out.mkdir(parents=True, exist_ok=True)
    env = {**measurement_env(c.layout), "WLB_TRACE_CLOCK": "thread", "WLB_PAIRED_OUT": str(out),
           "WLB_PREFAULT_MB": str(QUICK_PREFAULT_MB if quick else PREFAULT_MB),
           "WLB_PAIRED_B": json.dumps(c.b_fields), "WLB_PAIRED_B_DEAL": "megatron" if c.megatron_deal else ""}
    ranks = int(np.prod([int(v) for v in c.layout.values()]))
    flags = [*model_flags(QUICK_SEQ_LEN if quick else SEQ_LEN), "--global-batch-size", str(c.global_batch),
             "--train-iters", str(steps), *c.flags, "--wlb-trace", str(out / "trace.jsonl")]
    if profile is not None:
        flags += ["--wlb-cost-profile", str(profile)]
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nnodes", "1", "--nproc-per-node",
           str(ranks), str(REPO / "benchmarks" / "paired_train.py"), "--tiny-gpt", "--data-path", str(data), *flags]
    start = time.perf_counter()
    proc = subprocess.run(cmd, env=env, cwd=out, capture_output=True, text=True)
    (out / "train.log").write_text(proc.stdout + proc.stderr)
    if proc.returncode != 0:
        raise SystemExit(f"{c.name}: training failed (rc {proc.returncode}), log {out / 'train.log'}:\n"
                         f"{(proc.stdout + proc.stderr)[-3000:]}")
    log(f"  {c.name}: {steps} steps in {time.perf_counter() - start:.0f} s")


def replay(rows: list[Any], pp: int, predicted: bool) -> float:
    """One training step's critical path from its micro-batch rows: per DP (and CP) rank, 1F1B over the PP
    stages' forward and backward times (measured thread seconds, or the cost model's), then the slowest."""
    from megatron_wlb.schedule import simulate_pipeline

    groups: dict[tuple[int, int], list[Any]] = defaultdict(list)
    for r in rows:
        if r.tp == 0:
            groups[(r.dp, r.cp)].append(r)
    worst = 0.0
    for group in groups.values():
        m = 1 + max(r.micro_batch for r in group)
        fwd, bwd = np.zeros((pp, m)), np.zeros((pp, m))
        for r in group:
            fwd[r.pp, r.micro_batch] += r.pred_fwd_s if predicted else r.fwd_s
            bwd[r.pp, r.micro_batch] += r.pred_bwd_s if predicted else r.bwd_s
        worst = max(worst, simulate_pipeline(fwd, bwd, keep_events=False).makespan)
    return worst


def imbalance(rows: list[Any]) -> float:
    """Measured compute of the slowest DP rank over the mean DP rank (thread seconds); NaN with one DP rank."""
    per: dict[int, float] = defaultdict(float)
    for r in rows:
        if r.tp == 0 and r.cp == 0:
            per[r.dp] += r.fwd_s + r.bwd_s
    values = np.array(list(per.values()))
    return float(values.max() / values.mean()) if values.size > 1 and values.mean() > 0 else float("nan")


def geo_interval(ratios: np.ndarray, seed: int = 0, draws: int = 4000) -> tuple[float, float, float]:
    """Geometric mean of ``ratios`` and its bootstrap 95% interval over the pairs."""
    logs = np.log(ratios)
    rng = np.random.default_rng(seed)
    means = logs[rng.integers(0, logs.size, size=(draws, logs.size))].mean(axis=1)
    low, high = np.percentile(means, [2.5, 97.5])
    return float(np.exp(logs.mean())), float(np.exp(low)), float(np.exp(high))


def step_work(rows: list[Any], cost: Any) -> float:
    """The step's work: the cost model's price of every document of the step (each micro-batch counted once:
    its first stage and chunk, CP and TP rank 0), without what a micro-batch costs as a whole. A document
    costs the same in any packing, so over the same documents both methods do equal work; per step it weighs
    each token by what its document's attention costs (a long document's token costs more), which a token
    count does not."""
    from megatron_wlb.packing.metrics import piece_latency

    lengths = [d for r in rows if r.pp == 0 and r.chunk == 0 and r.cp == 0 and r.tp == 0 for d in r.lengths]
    return float(piece_latency(cost, np.asarray(lengths, dtype=np.int64)).sum())


def idle(rows: list[Any], critical_path: float) -> float:
    """Replayed idle seconds of the step: every rank waits from its own measured busy time to the step's
    ``critical_path`` (``replay``): pipeline bubbles and DP/CP imbalance together."""
    busy = [r.fwd_s + r.bwd_s for r in rows if r.tp == 0]
    ranks = len({(r.dp, r.cp, r.pp) for r in rows if r.tp == 0})
    return critical_path * ranks - float(sum(busy))


def analyse(c: Comparison, out: Path, profile: Path) -> dict[str, Any]:
    """Per-pair ratios of B's time per unit of work over A's (``step_work`` under ``profile``; per token
    beside it) from the run's step walls and trace."""
    from megatron_wlb.costmodel import CalibratedCostModel, ModelShape, ParallelLayout
    from megatron_wlb.costmodel.trace import read_trace

    sys.path.insert(0, str(REPO / "benchmarks"))
    from paired_train import method_of

    walls: dict[int, float] = defaultdict(float)
    tokens: dict[int, int] = {}
    for path in out.glob("rank*.json"):
        for s in json.loads(path.read_text())["steps"]:
            walls[s["step"]] = max(walls[s["step"]], s["wall_s"])
            tokens[s["step"]] = max(tokens.get(s["step"], 0), s["tokens"])
    trace = read_trace(out / "trace.jsonl")
    cost = CalibratedCostModel.from_json(profile, ModelShape(**trace.headers[0]["model"]), ParallelLayout())
    by_step: dict[int, list[Any]] = defaultdict(list)
    for r in trace.micro_batches:
        by_step[r.iteration].append(r)
    pp = int(c.layout.get("PP", "1"))
    pairs = sorted({s // 2 for s in walls if s // 2 >= WARMUP_PAIRS and {2 * (s // 2), 2 * (s // 2) + 1} <= set(walls)
                    and {2 * (s // 2), 2 * (s // 2) + 1} <= set(by_step)})
    kinds: dict[str, list[float]] = {"wall": [], "replay": [], "predicted": [], "replay_per_token": []}
    per_method: dict[str, dict[str, list[float]]] = {m: {"imbalance": [], "idle_s": [], "work": [], "tokens": []}
                                                    for m in ("a", "b")}
    for k in pairs:
        steps = {method_of(s): s for s in (2 * k, 2 * k + 1)}
        a, b = steps["A"], steps["B"]
        work = {s: step_work(by_step[s], cost) for s in (a, b)}
        measured = {s: replay(by_step[s], pp, False) for s in (a, b)}
        kinds["wall"].append((walls[b] / work[b]) / (walls[a] / work[a]))
        kinds["replay"].append((measured[b] / work[b]) / (measured[a] / work[a]))
        kinds["predicted"].append((replay(by_step[b], pp, True) / work[b]) / (replay(by_step[a], pp, True) / work[a]))
        kinds["replay_per_token"].append((measured[b] / max(1, tokens[b])) / (measured[a] / max(1, tokens[a])))
        for m, s in (("a", a), ("b", b)):
            per_method[m]["imbalance"].append(imbalance(by_step[s]))
            per_method[m]["idle_s"].append(idle(by_step[s], measured[s]))
            per_method[m]["work"].append(work[s])
            per_method[m]["tokens"].append(tokens[s])
    result: dict[str, Any] = {"name": c.name, "a": c.a, "b": c.b, "layout": c.layout, "global_batch": c.global_batch,
                              "pairs": len(pairs), "flags": list(c.flags), "b_fields": c.b_fields,
                              "measured_imbalance": {m: _mean_or_none(v["imbalance"]) for m, v in per_method.items()},
                              "replayed_idle_s": {m: _mean_or_none(v["idle_s"]) for m, v in per_method.items()},
                              "work_total": {m: float(np.sum(v["work"])) for m, v in per_method.items()},
                              "tokens_total": {m: int(np.sum(v["tokens"])) for m, v in per_method.items()},
                              "seconds_per_step": float(np.median(list(walls.values()))) if walls else None}
    for kind, values in kinds.items():
        if values:
            mean, lo, hi = geo_interval(np.asarray(values))
            result[kind] = {"ratio": mean, "low": lo, "high": hi, "half_width": (hi - lo) / 2 / mean}
    if kinds["replay"]:
        residual = np.log(np.asarray(kinds["replay"])) - np.log(np.asarray(kinds["predicted"]))
        mean, lo, hi = geo_interval(np.exp(residual))
        result["replay_over_predicted"] = {"ratio": mean, "low": lo, "high": hi}
    return result


def _mean_or_none(values: list[float]) -> float | None:
    return float(np.mean(values)) if values and not np.isnan(values).any() else None


def to_markdown(result: dict) -> str:
    cal = result.get("calibration") or {}
    lines = ["# Paired runs at equal work: B's time over A's per unit of work, wall / replay / predicted", "",
             f"Machine: {result['machine']}; torch {result.get('torch', '?')}, megatron-core "
             f"{result.get('megatron_core', '?')}. Generated by `{result['command']}` ({result['steps']} training "
             f"steps per comparison, the first {WARMUP_PAIRS} pairs dropped; {result['minutes']:.1f} min of benchmark "
             "including the calibration run).", "",
             f"Corpus: {result['corpus']['source']}; {result['corpus']['documents']:,} documents, median "
             f"{result['corpus']['median']:.0f}, p90 {result['corpus']['p90']:.0f} tokens.", ""]
    if cal:
        held = cal.get("packings") or {}
        per = ", ".join(f"{k} {v:.1%}" for k, v in held.items())
        whole = [t for t in cal.get("terms", []) if t not in ("pairs", "tokens", "runs", "micro_batch")]
        lines += [f"Cost model: `wlb calibrate --from-trace` on {len(held) or 1} {cal['steps']}-step DP2 runs of this "
                  f"machine (thread clock), one per packing; held out by packing (each predicted by a fit of the "
                  f"others): {per or 'n/a'}; held-out iterations {cal['mape']:.1%}. Terms kept: "
                  f"{', '.join(cal.get('terms', [])) or 'n/a'}"
                  + (f" (the micro-batch priced as a whole: {', '.join(whole)})" if whole else " (additive)")
                  + "; every comparison balances and predicts with it.", ""]
    lines += ["A ratio above 1 means A is faster. Each is the geometric mean over pairs of B's time per unit of work "
              "over A's (work: the cost model's price of the step's documents, without what a micro-batch costs as "
              "a whole, so equal for the same documents in any packing), with its bootstrap 95% interval; replay = "
              "the critical path from measured thread times; predicted = the same from the cost model (its whole-"
              "micro-batch terms included); replay / predicted: how far the measurement is from the prediction; "
              "per token = replay per token instead of per unit of work. Idle = replayed rank-seconds waiting per "
              "step (bubbles and imbalance). `aa` is A against itself: the instrument's own spread.", "",
              "| comparison | layout | A | B | pairs | wall | replay | predicted | replay / predicted | "
              "replay per token | DP imbalance A / B | idle s/step A / B |",
              "|---|---|---|---|---|---|---|---|---|---|---|---|"]
    for r in result["comparisons"]:
        def cell(kind: str, r: dict = r) -> str:
            x = r.get(kind)
            return "n/a" if not x else f"{x['ratio']:.3f} [{x['low']:.3f}, {x['high']:.3f}]"

        def pair(key: str, r: dict = r) -> str:
            return " / ".join("n/a" if v is None else f"{v:.3f}" for v in (r[key]["a"], r[key]["b"]))

        lines.append(f"| {r['name']} | {', '.join(f'{k}{v}' for k, v in r['layout'].items())} | {r['a']} | {r['b']} | "
                     f"{r['pairs']} | {cell('wall')} | {cell('replay')} | {cell('predicted')} | "
                     f"{cell('replay_over_predicted')} | {cell('replay_per_token')} | {pair('measured_imbalance')} | "
                     f"{pair('replayed_idle_s')} |")
    return "\n".join(lines) + "\n"


def readme_summary(result: dict) -> str:
    """The the results page's paired block, from ``result``."""
    return to_markdown(result).split("\n", 2)[2].strip()


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--quick", action="store_true", help="a short smoke run (few steps)")
    ap.add_argument("--steps", type=int, default=None, help="training steps per comparison (even; default "
                                                            f"{DEFAULT_STEPS}, quick 12)")
    ap.add_argument("--comparisons", default=",".join(c.name for c in COMPARISONS))
    ap.add_argument("--work", default=str(REPO / "out" / "paired"), help="run folder (traces, logs)")
    ap.add_argument("--out", default=str(REPO / "benchmarks" / "results" / "paired"))
    ap.add_argument("--page", action="store_true", help="also write the results page's paired block")
    ap.add_argument("--reuse", action="store_true", help="analyse the runs already in --work again (no training)")
    args = ap.parse_args(argv)
    steps = args.steps or (12 if args.quick else DEFAULT_STEPS)
    if steps < 2 * (WARMUP_PAIRS + 1) or steps % 2:
        raise SystemExit(f"--steps must be even and >= {2 * (WARMUP_PAIRS + 1)}, got {steps}")
    names = [n for n in args.comparisons.split(",") if n]
    known = {c.name: c for c in COMPARISONS}
    unknown = sorted(set(names) - set(known))
    if unknown:
        raise SystemExit(f"--comparisons {','.join(unknown)}: unknown; valid: {', '.join(known)}")
    work = Path(args.work)
    seq_len = QUICK_SEQ_LEN if args.quick else SEQ_LEN
    data = work / "corpus" / ("stdlib_files_text_document" if seq_len == SEQ_LEN else
                              f"stdlib_files_{seq_len}_text_document")
    corpus = build_corpus(data, seq_len)
    start = time.perf_counter()

    def log(s: str) -> None:
        print(s, file=sys.stderr, flush=True)

    profile = work / CALIBRATION / "profile.json"
    calibration_steps = 8 if args.quick else CALIBRATION_STEPS
    if args.reuse and profile.exists():
        fitted = json.loads(profile.read_text())
    else:
        profile, fitted = calibrate(data, work / CALIBRATION, calibration_steps, log, args.quick)
    results = []
    for name in names:
        c = known[name]
        if not (args.reuse and (work / name / "train.log").exists()):
            train(c, data, work / name, steps, log, profile, quick=args.quick)
        results.append(analyse(c, work / name, profile))
    minutes = (time.perf_counter() - start) / 60
    if args.reuse and Path(args.out).with_suffix(".json").exists():  # the training's machine and time, not this one's
        before = json.loads(Path(args.out).with_suffix(".json").read_text())
        machine_name, minutes = before["machine"], before["minutes"]
    else:
        machine_name = machine()
    import megatron.core
    import torch

    holdout = fitted.get("holdout") or {}
    command = "python benchmarks/bench_paired.py" + (" --quick" if args.quick else "")
    result = {"machine": machine_name, "command": command,
              "torch": torch.__version__, "megatron_core": megatron.core.__version__,
              "steps": steps, "corpus": corpus, "minutes": minutes,
              "calibration": {"steps": calibration_steps, "mape": holdout.get("mape"),
                              "packings": holdout.get("packings"), "terms": fitted.get("terms"),
                              "term_selection": fitted.get("term_selection")}
              if holdout.get("mape") else None,
              "comparisons": results}
    write_result(args.out, result, to_markdown)
    if args.page:
        readme = RESULTS_PAGE
        text = readme.read_text()
        a, b = text.find(README_BEGIN), text.find(README_END)
        if a < 0 or b < a:
            raise SystemExit(f"{readme}: no {README_BEGIN} ... {README_END} block")
        readme.write_text(text[:a + len(README_BEGIN)] + "\n" + readme_summary(result) + "\n" + text[b:])
    return 0


if __name__ == "__main__":
    sys.exit(main())
