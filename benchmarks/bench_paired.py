#!/usr/bin/env python
"""Paired runs at equal work: two methods in one Megatron process, alternating ABBA, wall and replay.

    python benchmarks/bench_paired.py --page   # calibration + the paired runs (~20 min on 2 cores) + page block
    python benchmarks/bench_paired.py --quick    # a short smoke run of the same code, window 1024 (slow lane)
    python benchmarks/bench_paired.py --dynamic-cp --reuse --page   # the DP2 x CP2 comparisons (paper, users-cp,
                                                                    # aa-cp, dcp), the calibration of --page reused

First the calibration: one short traced run per packing (wlb, fixed-greedy, whole documents, the balanced
concat-and-cut and stock Megatron's grouping at DP2) and per CP layout (wlb at CP2 sharded per document and per
sequence, and dynamic CP over DP2 x CP2: groups of 1, 2 and 4 and their empty micro-batches), analytic model, thread
clock, so the fit sees every micro-batch size, composition and CP share the comparisons produce, fitted together by
``wlb calibrate --from-trace`` (which prices each CP rank's share as laid out, fits the all-gather and the empty
micro-batch, chooses its terms by the held-out ratio error between packings and layouts, and reports it with the
noise floor of the repeated micro-batches: each global batch is trained twice). Every comparison balances and
predicts with that profile. Each comparison is then one training run of
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
- ``paper``  DP2 x CP2 (4 ranks, ``--dynamic-cp``): WLB-LLM as the paper runs it (wlb packing, documents whole,
             adaptive CP) against stock Megatron (GPTDataset's samples, one a micro-batch as its sampler deals
             them, sharded per sequence); B reads its own pieces (the paired iterator keeps each method's reader);
- ``users-cp`` DP2 x CP2: the balanced concat-and-cut with adaptive CP against the same stock run;
- ``aa-cp``  DP2 x CP2: wlb with adaptive CP against itself (4 ranks on 2 cores: the instrument checked where it
             is least sure).
- ``dcp``    DP2 x CP2 (4 ranks), global batch 8 (``--dynamic-cp``: not in a plain run; its own results file and
             block): ``--wlb-cp-sharding dynamic`` (each global batch's documents planned over the 4 ranks as one
             pool, a power-of-two group per micro-batch, ``cp.dynamic``) against the same wlb global batch on the
             fixed CP2 groups, sharded ``adaptive``. Both in one process: the dynamic runtime makes every block's
             process group at start-up, and a micro-batch without a block runs on Megatron's CP group, so the
             paired iterator switches method per step like the others. Differences from the other comparisons:
             replay is group-synchronous (``replay_pool``: a group's micro-batch starts when all its members
             are free and holds them for its slowest member, as its collectives do) for both sides; predicted is
             the planner's own slowest slot (``DynamicCPPlan.slowest_seconds``, recorded per step) against the
             same documents priced on the fixed groups (``fixed_group_seconds``, as the simulator prices them),
             both with the planner's cost models; work is the global batch's documents. The planner keeps
             Megatron's micro-batch count per slot (``max_micro_batches``), so no global batch is passed
             over. Before training, ``prior_prediction`` says what the cost model
             predicts for the corpus. 4 ranks on 2 cores are oversubscribed (unpinned; two ranks share a core):
             wall is disturbed by the sharing and by gloo's waits; the replay of thread CPU times is the robust
             number.

Writes benchmarks/results/paired.{json,md}; ``--page`` also writes the results page's paired block.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
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

from _results import RESULTS_PAGE, replace_block, write_result  # noqa: E402

from megatron_wlb.megatron.entry.cpu import PIN_VARIABLE, TINY_GPT_EOD, measurement_env  # noqa: E402
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
    #: dynamic CP on one side: the step's DP x CP ranks are one pool (``replay_pool``, ``predict_pool``)
    pool: bool = False


BALANCED = ("--wlb-packer", "wlb", "--wlb-pieces", "concat-and-cut", "--wlb-cp-sharding", "per-sequence")
#: stock Megatron as B: GPTDataset's samples, one a micro-batch (dealt as Megatron's sampler deals them), sharded
#: per sequence over CP
STOCK = {"packer": "original", "pieces": "concat-and-cut", "cp_sharding": "per-sequence"}
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
    Comparison("dcp", "dynamic CP", "fixed-group CP2, adaptive", {"DP": "2", "CP": "2"}, 8,
               ("--wlb-packer", "wlb", "--wlb-cp-sharding", "dynamic"), {"cp_sharding": "adaptive"}, pool=True),
    Comparison("paper", "WLB-LLM (wlb packing, documents whole, adaptive CP)", "stock Megatron (GPTDataset samples, "
               "per-sequence CP)", {"DP": "2", "CP": "2"}, 8, ("--wlb-packer", "wlb", "--wlb-cp-sharding", "adaptive"),
               STOCK, megatron_deal=True),
    Comparison("users-cp", "balanced concat-and-cut, adaptive CP", "stock Megatron (per-sequence CP)",
               {"DP": "2", "CP": "2"}, 8, (*BALANCED[:4], "--wlb-cp-sharding", "adaptive"), STOCK, megatron_deal=True),
    Comparison("aa-cp", "wlb, adaptive CP", "wlb, adaptive CP (the same)", {"DP": "2", "CP": "2"}, 8,
               ("--wlb-packer", "wlb", "--wlb-cp-sharding", "adaptive"), {}),
)
#: the comparisons a plain run makes (2 ranks each; the DP2 x CP2 ones have their own results file and block)
DEFAULT_COMPARISONS = ("users", "dp", "pp", "cp", "aa", "large")
#: ``--dynamic-cp``: the DP2 x CP2 comparisons (4 ranks each, dynamic CP among them), results file and page block
FOUR_RANK_COMPARISONS = ("paper", "users-cp", "aa-cp", "dcp")
DYNAMIC_CP = "dcp"
DYNAMIC_CP_OUT = REPO / "benchmarks" / "results" / "dynamic_cp_paired"
DYNAMIC_CP_BEGIN, DYNAMIC_CP_END = "<!-- paired-dcp -->", "<!-- /paired-dcp -->"


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


#: global batches the prior prediction of ``dcp`` plans (``prior_prediction``)
PRIOR_BATCHES = 200


def prior_prediction(corpus: Path, profile: Path, model: dict[str, Any], seq_len: int, c: Comparison,
                     batches: int = PRIOR_BATCHES) -> dict[str, Any]:
    """Before ``dcp`` trains: what the cost model predicts for this corpus. The corpus's documents in a shuffled
    order (seed 0), the wlb packer at its defaults (the run's window, DP and micro-batches), each global batch
    planned by the dynamic-CP planner over the DP x CP slots (the runtime's memory cap, ``iterators.dynamic_pool``)
    and priced on fixed CP groups as packed (``fixed_group_seconds``): the geometric mean of fixed over dynamic
    (equal work: the same documents), and how often the planner uses each group size."""
    from megatron_wlb.costmodel import CalibratedCostModel, ModelShape, ParallelLayout
    from megatron_wlb.cp.dynamic import group_cost_models
    from megatron_wlb.cp.dynamic_steps import DynamicPool
    from megatron_wlb.data.reader import IndexedSource
    from megatron_wlb.packing import make_packer
    from megatron_wlb.packing.types import PackingConfig

    dp, cp = int(c.layout.get("DP", "1")), int(c.layout.get("CP", "1"))
    source = IndexedSource.open(str(corpus))
    lengths = np.asarray(source.lengths, dtype=np.int64)
    lengths = lengths[np.random.default_rng(0).permutation(lengths.size)]
    cost = CalibratedCostModel.from_json(profile, ModelShape(**model), ParallelLayout(dp=dp, cp=cp))
    costs = group_cost_models(cost, dp * cp)
    config = PackingConfig(seq_len=seq_len, n=c.global_batch // dp, dp=dp)
    cap = -(-config.capacity_var // cp)
    pool = DynamicPool(dp * cp, 0, cap, cost)  # the runtime's planner (any slot plans the same)
    ratios, sizes = [], defaultdict(int)
    for batch in make_packer("wlb", config, cost).pack(np.tile(lengths, 1 + batches * c.global_batch * seq_len
                                                                  // max(1, int(lengths.sum())))):
        per_mb = [[int(x) for x in mb.lengths] for mb in batch.micro_batches]
        plan = pool.plan(per_mb, config.n)
        ratios.append(fixed_group_seconds(per_mb, dp, costs[cp]) / plan.slowest_seconds)
        for mb in plan.micro_batches:
            sizes[mb.size] += 1
        if len(ratios) >= batches:
            break
    mean, lo, hi = geo_interval(np.asarray(ratios))
    return {"batches": len(ratios), "ratio": mean, "low": lo, "high": hi, "max_tokens_per_rank": cap,
            "group_sizes": dict(sorted(sizes.items()))}


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
    # CP layouts and their communication: CP2 sharded per document and per sequence, and dynamic CP's groups of 1,
    # 2 and 4 (with its empty micro-batches) over DP2 x CP2
    Comparison("cp-document", "wlb, CP2 per-document", "the same", {"CP": "2"}, 2,
               ("--wlb-packer", "wlb", "--wlb-cp-sharding", "per-document"), {}),
    Comparison("cp-sequence", "wlb, CP2 per-sequence", "the same", {"CP": "2"}, 2,
               ("--wlb-packer", "wlb", "--wlb-cp-sharding", "per-sequence"), {}),
    Comparison("cp-dynamic", "wlb, dynamic CP over DP2 x CP2", "the same", {"DP": "2", "CP": "2"}, 8,
               ("--wlb-packer", "wlb", "--wlb-cp-sharding", "dynamic"), {}),
)
CALIBRATION = "calibration"


#: the quick run's calibration: two packings of unlike micro-batches (the code path of the held-out packing) and
#: one CP layout (the path of a fit over several layouts with CP communication)
QUICK_CALIBRATIONS = ("wlb", "stock", "cp-sequence")


def calibrate(data: Path, out: Path, steps: int, log: Any, quick: bool = False,
              runs: tuple[Comparison, ...] | None = None) -> tuple[Path, dict[str, Any]]:
    """The cost profile of this machine: one traced run per packing (``CALIBRATIONS``, or ``runs``; analytic model,
    thread clock) fitted together by ``wlb calibrate --from-trace``, which reports each packing's held-out error.
    Every comparison balances and predicts with it."""
    traces = []
    for c in CALIBRATIONS if runs is None else runs:
        if quick and runs is None and c.name not in QUICK_CALIBRATIONS:
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
    if ranks > len(os.sched_getaffinity(0)):  # more ranks than cores (dcp's 4 on 2): unpinned, the OS shares the cores
        env[PIN_VARIABLE] = "0"
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


def replay_pool(rows: list[Any], cp: int, blocks: dict[int, list[Any]] | None = None) -> float:
    """One training step's critical path on a stage's DP x CP pool (PP 1), from the measured thread times: slot
    ``dp x cp + cp rank`` runs its micro-batches in order; one of a group (``blocks[slot][k]``: ``[first slot,
    size]``, None alone; no ``blocks``: the fixed CP groups) starts when all its members are free and holds them
    for its slowest member's forward plus its slowest member's backward (the group's collectives hold the others)."""
    fwd: dict[tuple[int, int], float] = defaultdict(float)
    bwd: dict[tuple[int, int], float] = defaultdict(float)
    for r in rows:
        if r.tp == 0:
            fwd[(r.dp * cp + r.cp, r.micro_batch)] += r.fwd_s
            bwd[(r.dp * cp + r.cp, r.micro_batch)] += r.bwd_s
    if not fwd:
        return 0.0
    slots = 1 + max(slot for slot, _ in fwd)
    steps = 1 + max(k for _, k in fwd)
    free = np.zeros(slots)
    for k in range(steps):
        started: set[tuple[int, int]] = set()
        for slot in range(slots):
            group = blocks[slot][k] if blocks is not None and k < len(blocks[slot]) else None
            if blocks is None:
                group = (slot // cp * cp, cp)
            first, size = (slot, 1) if group is None else (int(group[0]), int(group[1]))
            if (first, size) in started:
                continue
            started.add((first, size))
            members = range(first, first + size)
            duration = max(fwd.get((m, k), 0.0) for m in members) + max(bwd.get((m, k), 0.0) for m in members)
            free[first:first + size] = free[first:first + size].max() + duration
    return float(free.max())


def fixed_group_seconds(lengths: list[list[int]], dp: int, cost: Any) -> float:
    """The cost model's slowest DP rank of a global batch (``lengths``: each micro-batch's pieces, DP rank r
    the r-th contiguous share) on fixed CP groups, seconds per layer: per rank the sum of its micro-batches'
    pieces priced at the group's CP size plus each micro-batch's fixed cost (``cost``: the planner's cost model
    at that CP size), as ``sim.dyncp.simulate_dynamic_stream`` prices its ``fixed``."""
    from megatron_wlb.packing.metrics import piece_latency

    overhead = cost.microbatch_overhead * (1.0 + cost.hardware.bwd_linear)
    n = len(lengths) // dp
    return max(sum(float(piece_latency(cost, np.asarray(mb, dtype=np.int64)).sum()) + overhead
                   for mb in lengths[r * n:(r + 1) * n] if mb) for r in range(dp))


def imbalance_pool(rows: list[Any], cp: int) -> float:
    """Measured compute of the slowest DP x CP slot over the mean slot (thread seconds)."""
    per: dict[int, float] = defaultdict(float)
    for r in rows:
        if r.tp == 0:
            per[r.dp * cp + r.cp] += r.fwd_s + r.bwd_s
    values = np.array(list(per.values()))
    return float(values.max() / values.mean()) if values.size > 1 and values.mean() > 0 else float("nan")


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
    from megatron_wlb.cp.dynamic import group_cost_models
    from megatron_wlb.cp.dynamic_steps import DynamicPool
    from megatron_wlb.packing.metrics import piece_latency

    sys.path.insert(0, str(REPO / "benchmarks"))
    from paired_train import method_of

    walls: dict[int, float] = defaultdict(float)
    tokens: dict[int, int] = {}
    records: dict[int, dict[str, Any]] = {}  # step -> rank 0's record (the global batch, the planner's prediction)
    blocks: dict[int, dict[int, list[Any]]] = defaultdict(dict)  # step -> slot -> its micro-batches' groups
    for path in out.glob("rank*.json"):
        for s in json.loads(path.read_text())["steps"]:
            walls[s["step"]] = max(walls[s["step"]], s["wall_s"])
            tokens[s["step"]] = max(tokens.get(s["step"], 0), s["tokens"])
            if path.name == "rank0.json":
                records[s["step"]] = s
            if "blocks" in s:
                blocks[s["step"]][s["slot"]] = s["blocks"]
    trace = read_trace(out / "trace.jsonl")
    cost = CalibratedCostModel.from_json(profile, ModelShape(**trace.headers[0]["model"]), ParallelLayout())
    by_step: dict[int, list[Any]] = defaultdict(list)
    # the pool's slots are Megatron's DP x CP ranks: a dynamic-CP micro-batch row's cp is the rank's place in its
    # group, so the pool comparisons read each rank's Megatron CP rank from its iteration rows, which keep it
    megatron_cp = {r.rank: r.cp for r in trace.iterations}
    for r in trace.micro_batches:
        by_step[r.iteration].append(dataclasses.replace(r, cp=megatron_cp[r.rank]) if c.pool else r)
    pp = int(c.layout.get("PP", "1"))
    dp, cp = int(c.layout.get("DP", "1")), int(c.layout.get("CP", "1"))
    shape = ModelShape(**trace.headers[0]["model"])
    pool_cost = CalibratedCostModel.from_json(profile, shape, ParallelLayout(dp=dp, cp=cp))
    pool_costs = group_cost_models(pool_cost, dp * cp) if c.pool else {}
    replanned: list[float] = []
    plans: dict[int, Any] = {}  # A's steps: the plan, replanned from the recorded lengths

    def measured_of(s: int) -> float:
        if not c.pool:
            return replay(by_step[s], pp, False)
        return replay_pool(by_step[s], cp, blocks[s] if method_of(s) == "A" else None)

    def predicted_of(s: int) -> float:
        if not c.pool:
            return replay(by_step[s], pp, True)
        lengths = records[s]["lengths"]
        if method_of(s) == "B":
            return fixed_group_seconds(lengths, dp, pool_costs[cp])
        plans[s] = DynamicPool(dp * cp, 0, records[s]["max_tokens_per_rank"], pool_cost).plan(lengths,
                                                                                             c.global_batch // dp)
        replanned.append(abs(plans[s].slowest_seconds / records[s]["plan_slowest_s"] - 1))
        return float(records[s]["plan_slowest_s"])

    def work_of(s: int) -> float:
        if not c.pool:
            return step_work(by_step[s], cost)
        return float(piece_latency(cost, np.asarray([x for mb in records[s]["lengths"] for x in mb])).sum())
    pairs = sorted({s // 2 for s in walls if s // 2 >= WARMUP_PAIRS and {2 * (s // 2), 2 * (s // 2) + 1} <= set(walls)
                    and {2 * (s // 2), 2 * (s // 2) + 1} <= set(by_step)})
    kinds: dict[str, list[float]] = {"wall": [], "replay": [], "predicted": [], "replay_per_token": []}
    per_method: dict[str, dict[str, list[float]]] = {m: {"imbalance": [], "idle_s": [], "work": [], "tokens": []}
                                                    for m in ("a", "b")}
    for k in pairs:
        steps = {method_of(s): s for s in (2 * k, 2 * k + 1)}
        a, b = steps["A"], steps["B"]
        work = {s: work_of(s) for s in (a, b)}
        measured = {s: measured_of(s) for s in (a, b)}
        kinds["wall"].append((walls[b] / work[b]) / (walls[a] / work[a]))
        kinds["replay"].append((measured[b] / work[b]) / (measured[a] / work[a]))
        kinds["predicted"].append((predicted_of(b) / work[b]) / (predicted_of(a) / work[a]))
        kinds["replay_per_token"].append((measured[b] / max(1, tokens[b])) / (measured[a] / max(1, tokens[a])))
        for m, s in (("a", a), ("b", b)):
            per_method[m]["imbalance"].append(imbalance_pool(by_step[s], cp) if c.pool else imbalance(by_step[s]))
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
    if c.pool:
        sizes: dict[int, int] = defaultdict(int)  # micro-batches per group size of A's steps (each group once)
        for k in pairs:
            a_step = 2 * k if method_of(2 * k) == "A" else 2 * k + 1
            for slot, groups in blocks[a_step].items():
                for g in groups:
                    if g is not None and g[0] == slot:
                        sizes[int(g[1])] += 1
        result["a_group_sizes"] = dict(sorted(sizes.items()))
        result["planner_replanned_max_rel_diff"] = max(replanned, default=None)
        result.update(pool_breakdown(c, pairs, by_step, blocks, records, plans, pool_costs, shape.num_layers))
    for kind, values in kinds.items():
        if values:
            mean, lo, hi = geo_interval(np.asarray(values))
            result[kind] = {"ratio": mean, "low": lo, "high": hi, "half_width": (hi - lo) / 2 / mean}
    if kinds["replay"]:
        residual = np.log(np.asarray(kinds["replay"])) - np.log(np.asarray(kinds["predicted"]))
        mean, lo, hi = geo_interval(np.exp(residual))
        result["replay_over_predicted"] = {"ratio": mean, "low": lo, "high": hi}
    return result


def pool_breakdown(c: Comparison, pairs: list[int], by_step: dict[int, list[Any]], blocks: dict[int, dict[int, Any]],
                   records: dict[int, dict[str, Any]], plans: dict[int, Any], costs: dict[int, Any],
                   layers: int) -> dict[str, Any]:
    """Where a dynamic-CP measurement departs from its prediction: the replay ratio without the groups' waits
    (each slot's own summed times) and without A's empty micro-batches too; and per group size, the measured
    thread seconds of a slot's micro-batches over the planner's price of them (B: the fixed groups' price), and
    what an empty micro-batch takes (priced 0)."""
    from paired_train import method_of

    from megatron_wlb.packing.metrics import piece_latency

    cp, dp = int(c.layout["CP"]), int(c.layout["DP"])

    def slot_sums(rows: list[Any], keep: Any = None) -> float:
        per: dict[int, float] = defaultdict(float)
        for r in rows:
            if r.tp == 0 and (keep is None or keep(r)):
                per[r.dp * cp + r.cp] += r.fwd_s + r.bwd_s
        return max(per.values(), default=0.0)

    unsynced: list[float] = []
    no_empty: list[float] = []
    measured: dict[str, float] = defaultdict(float)
    priced: dict[str, float] = defaultdict(float)
    empty: list[float] = []
    over = costs[cp].microbatch_overhead * (1.0 + costs[cp].hardware.bwd_linear)
    empty_price = float(sum(costs[cp].empty_seconds)) * layers
    for k in pairs:
        a, b = (2 * k, 2 * k + 1) if method_of(2 * k) == "A" else (2 * k + 1, 2 * k)
        groups = blocks[a]

        def filled(r: Any, groups: dict[int, Any] = groups) -> bool:
            return groups[r.dp * cp + r.cp][r.micro_batch] is not None

        unsynced.append(slot_sums(by_step[b]) / slot_sums(by_step[a]))
        no_empty.append(slot_sums(by_step[b]) / slot_sums(by_step[a], filled))
        for r in by_step[a]:
            mbs = plans[a].rank_micro_batches[r.dp * cp + r.cp]
            if r.micro_batch >= len(mbs):
                empty.append(r.fwd_s + r.bwd_s)
                continue
            measured[f"A{mbs[r.micro_batch].size}"] += r.fwd_s + r.bwd_s
            priced[f"A{mbs[r.micro_batch].size}"] += mbs[r.micro_batch].seconds * layers
        n = len(records[b]["lengths"]) // dp
        for r in by_step[b]:
            mb = records[b]["lengths"][r.dp * n + r.micro_batch]
            measured[f"B{cp}"] += r.fwd_s + r.bwd_s
            priced[f"B{cp}"] += (float(piece_latency(costs[cp], np.asarray(mb, dtype=np.int64)).sum()) + over) * layers
    return {"replay_without_group_waits": geo_interval(np.asarray(unsynced))[0] if unsynced else None,
            "replay_without_group_waits_or_empty": geo_interval(np.asarray(no_empty))[0] if no_empty else None,
            "measured_over_priced_by_group": {g: measured[g] / priced[g] for g in sorted(measured) if priced[g] > 0},
            "empty_micro_batches": {"count": len(empty), "mean_s": float(np.mean(empty)) if empty else None,
                                    "priced_s": empty_price}}


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
        selection = cal.get("term_selection") or {}
        floor = (selection.get("noise_floor") or {}).get("mape")
        biases = ", ".join(f"{k} {v:.3f}" for k, v in (selection.get("biases") or {}).items())
        ratio = selection.get("ratio_error")
        lines += [f"Cost model: `wlb calibrate --from-trace` on {len(held) or 1} {cal['steps']}-step runs of this "
                  "machine (thread clock), one per packing or CP layout (DP2; CP2 per-document and per-sequence; "
                  "dynamic CP over DP2 x CP2); held out by packing and layout (each predicted by a fit of the "
                  f"others), per micro-batch: {per or 'n/a'}; held-out iterations {cal['mape']:.1%}; the machine's "
                  "noise floor (repeated identical micro-batches) "
                  + (f"{floor:.1%}" if floor is not None else "n/a")
                  + (f"; held-out slowest-rank bias (predicted over measured per iteration) {biases}, so a "
                     f"predicted ratio between two of them is off by {ratio:.1%} (root mean square)"
                     if biases and ratio is not None else "")
                  + f". Terms kept (by that ratio error): {', '.join(cal.get('terms', [])) or 'n/a'}"
                  + (" (each candidate: " + ", ".join(f"{k} {v}" for k, v in selection["resolved"].items()) + ")"
                     if selection.get("resolved") else "")
                  + (f" (beyond the documents: {', '.join(whole)})" if whole else " (additive)")
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
    lines += pool_notes(result)
    return "\n".join(lines) + "\n"


def _sizes(counts: dict) -> str:
    """``{group size: micro-batches}`` as written (keys are strings once read back from JSON)."""
    return ", ".join(f"{k}: {v}" for k, v in counts.items())


def pool_notes(result: dict) -> list[str]:
    """What a dynamic-CP row (``Comparison.pool``) needs said beside the table."""
    out: list[str] = []
    prior = result.get("prior_prediction") or {}
    for r in result["comparisons"]:
        if "a_group_sizes" not in r:
            continue
        name, p = r["name"], prior.get(r["name"])
        out += ["", f"`{name}` ({r['a']} over the 4 slots of DP2 x CP2 against {r['b']}, global batch "
                f"{r['global_batch']}):"]
        if p:
            out.append(f"- predicted before training, for this corpus: B over A {p['ratio']:.3f} [{p['low']:.3f}, "
                       f"{p['high']:.3f}] over {p['batches']} wlb global batches of the shuffled corpus (planner "
                       f"at {p['max_tokens_per_rank']} tokens per slot; micro-batches by group size "
                       f"{_sizes(p['group_sizes'])}).")
        out += [f"- trained: {r['pairs']} pairs, every global batch (the planner keeps Megatron's micro-batch "
                "count); A's micro-batches by group size "
                f"{_sizes(r['a_group_sizes'])}; the planner's recorded prediction replanned from the recorded lengths "
                f"within {r['planner_replanned_max_rel_diff'] or 0:.1e}.",
                "- where the replay departs from the prediction: measured thread seconds over the cost model's price, "
                "summed per group size (A1/A2/A4: dynamic CP's micro-batches on 1, 2, 4 slots; B2: the fixed CP2 "
                "groups'): " + ", ".join(f"{g} {v:.3f}" for g, v in r["measured_over_priced_by_group"].items())
                + f"; {r['empty_micro_batches']['count']} empty micro-batches of A (a slot done before its "
                f"Megatron count) took {r['empty_micro_batches']['mean_s'] or 0:.4f} s each, priced "
                f"{r['empty_micro_batches'].get('priced_s', 0.0):.4f}; the replay "
                f"ratio without the groups' waits {r['replay_without_group_waits']:.3f}, and without A's empty "
                f"micro-batches too {r['replay_without_group_waits_or_empty']:.3f}.",
                "- replay is group-synchronous for both (a group's micro-batch starts when all its members are free "
                "and holds them for its slowest member); predicted is the planner's own slowest slot against the "
                "same documents priced on the fixed CP2 groups, both with the planner's cost models (this profile's "
                "terms: a CP group is priced by its shares, with whatever CP communication and micro-batch cost the "
                "profile has); imbalance: slowest of the 4 slots over their mean.",
                "- 4 ranks on 2 cores (unpinned, two ranks share a core): wall is disturbed by the sharing and by "
                "gloo's waits; the replay of thread CPU times is the robust number."]
    return out


def readme_summary(result: dict) -> str:
    """The the results page's paired block, from ``result``."""
    return to_markdown(result).split("\n", 2)[2].strip()


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--quick", action="store_true", help="a short smoke run (few steps)")
    ap.add_argument("--steps", type=int, default=None, help="training steps per comparison (even; default "
                                                            f"{DEFAULT_STEPS}, quick 12)")
    ap.add_argument("--comparisons", default=",".join(DEFAULT_COMPARISONS),
                    help=f"of {', '.join(c.name for c in COMPARISONS)}")
    ap.add_argument("--dynamic-cp", action="store_true",
                    help=f"the DP2 x CP2 comparisons ({', '.join(FOUR_RANK_COMPARISONS)}), into "
                         f"{DYNAMIC_CP_OUT.relative_to(REPO)}.{{json,md}} and their own results-page block")
    ap.add_argument("--work", default=str(REPO / "out" / "paired"), help="run folder (traces, logs)")
    ap.add_argument("--out", default=None, help="results file without suffix (default benchmarks/results/paired, "
                                                "with --dynamic-cp benchmarks/results/dynamic_cp_paired)")
    ap.add_argument("--page", action="store_true", help="also write the results page's paired block")
    ap.add_argument("--reuse", action="store_true", help="analyse the runs already in --work again (no training)")
    args = ap.parse_args(argv)
    steps = args.steps or (12 if args.quick else DEFAULT_STEPS)
    if steps < 2 * (WARMUP_PAIRS + 1) or steps % 2:
        raise SystemExit(f"--steps must be even and >= {2 * (WARMUP_PAIRS + 1)}, got {steps}")
    names = list(FOUR_RANK_COMPARISONS) if args.dynamic_cp else [n for n in args.comparisons.split(",") if n]
    args.out = args.out or str(DYNAMIC_CP_OUT if args.dynamic_cp else REPO / "benchmarks" / "results" / "paired")
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
    trained = False  # whether this invocation trained (the calibration or a comparison): then it names this machine
    if args.reuse and profile.exists():
        fitted = json.loads(profile.read_text())
    else:
        profile, fitted = calibrate(data, work / CALIBRATION, calibration_steps, log, args.quick)
        trained = True
    results = []
    prior = None
    for name in names:
        c = known[name]
        if c.pool:  # said before it is measured
            prior = {name: prior_prediction(data, profile, fitted["model"], seq_len, c)}
            log(f"  {name}: predicted before training (fixed over dynamic, {prior[name]['batches']} global batches of "
                f"the corpus): {prior[name]['ratio']:.3f} [{prior[name]['low']:.3f}, {prior[name]['high']:.3f}]")
        if not (args.reuse and (work / name / "train.log").exists()):
            train(c, data, work / name, steps, log, profile, quick=args.quick)
            trained = True
        results.append(analyse(c, work / name, profile))
    minutes = (time.perf_counter() - start) / 60
    if not trained and Path(args.out).with_suffix(".json").exists():  # only re-analysed: the training's machine, time
        before = json.loads(Path(args.out).with_suffix(".json").read_text())
        machine_name, minutes = before["machine"], before["minutes"]
    else:
        machine_name = machine()
    import megatron.core
    import torch

    holdout = fitted.get("holdout") or {}
    command = "python benchmarks/bench_paired.py" + (" --dynamic-cp" if args.dynamic_cp else "") + \
        (" --quick" if args.quick else "") + (f" --steps {steps}" if args.steps else "") + \
        (f" --comparisons {','.join(names)}" if not args.dynamic_cp and names != list(DEFAULT_COMPARISONS) else "")
    result = {"machine": machine_name, "command": command,
              "torch": torch.__version__, "megatron_core": megatron.core.__version__,
              "steps": steps, "corpus": corpus, "minutes": minutes,
              "calibration": {"steps": calibration_steps, "mape": holdout.get("mape"),
                              "packings": holdout.get("packings"), "terms": fitted.get("terms"),
                              "term_selection": fitted.get("term_selection")}
              if holdout.get("mape") else None,
              "comparisons": results}
    if prior:
        result["prior_prediction"] = prior
    write_result(args.out, result, to_markdown)
    if args.page:
        begin, end = (DYNAMIC_CP_BEGIN, DYNAMIC_CP_END) if args.dynamic_cp else (README_BEGIN, README_END)
        replace_block(RESULTS_PAGE, begin, end, readme_summary(result))
    return 0


if __name__ == "__main__":
    sys.exit(main())
