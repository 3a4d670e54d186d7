#!/usr/bin/env python
"""Measured, not simulated: what the method buys in Megatron's own training loop, on equal work.

    python benchmarks/bench_measured.py                 # the full benchmark (~25 min on 2 cores)
    python benchmarks/bench_measured.py --quick         # a ~3-minute smoke run of the same code
    python benchmarks/bench_measured.py --page benchmarks/results.md   # also writes the results page's measured table

Megatron's training loop through our launcher on this machine's CPU (gloo; ``WLB_PIN_CORES=1``: one
process per core, one thread each), a tiny GPT in which attention matters (hidden 64, 4 heads, 2
layers, seq 1024, byte-level vocabulary), on a real heavy-tailed corpus: the Python standard
library's ``.py`` files cut at blank lines (paragraphs: functions, classes, docstrings), documents of
at most ``seq_len`` tokens so that every packer keeps every document whole. Every run writes the
timing trace (``--wlb-trace``); every number below comes from it (``costmodel.trace``,
``costmodel.measured``), not from Megatron's log.

1. Calibration: a wlb run at DP2 with the analytic (H100) model; ``wlb calibrate --from-trace`` fits
   the profile and reports its MAPE on held-out iterations. Every later wlb / fixed run balances it.
2. Experiments, each a set of runs on the same stream, repeated in interleaved order (A B C A B C):
   ``cp``    CP2, wlb plans (identical for all three, checked), per-sequence vs per-document vs adaptive;
   ``pp``    PP2, wlb vs fixed-greedy vs whole-document (all keep documents whole);
   ``dp``    DP2, the same three;
   ``users`` DP2, concat-and-cut (``original``, what Megatron users run) vs the balanced concat-and-cut
             (``--wlb-pieces concat-and-cut``: the same pieces, equal work) vs wlb vs wlb with ``cut any``;
   ``online`` DP2, wlb with ``--wlb-cost-model online`` started from the analytic model.
3. Per run: time per token (sum of iteration walls / trained tokens), the median iteration with a
   bootstrap 95% interval, the measured idle share and imbalance, the work per token (attention pairs
   and model FLOPs per token), and the simulator's prediction for the same plans with the calibrated
   profile (``sim.iteration.IterationSimulator`` over the micro-batches the trace recorded).

Writes ``OUT/measured.json`` and ``OUT/measured.md`` (default ``benchmarks/results/measured``).
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time
from collections import defaultdict
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO / "benchmarks"))

from _results import write_result  # noqa: E402

from megatron_wlb.costmodel import ModelShape, ParallelLayout, build_cost_model  # noqa: E402
from megatron_wlb.costmodel.measured import IterationTotals  # noqa: E402
from megatron_wlb.costmodel.trace import Trace, read_trace  # noqa: E402
from megatron_wlb.megatron.entry.cpu import TINY_GPT_EOD, measurement_env  # noqa: E402
from megatron_wlb.provenance import machine  # noqa: E402

SEQ_LEN = 1024
#: the tiny GPT (on top of megatron_wlb.megatron.entry.cpu.TINY_GPT_ARGS)
MODEL_FLAGS = ("--num-layers", "2", "--hidden-size", "64", "--num-attention-heads", "4", "--ffn-hidden-size", "256",
               "--seq-length", str(SEQ_LEN), "--max-position-embeddings", str(2 * SEQ_LEN), "--vocab-size", "300",
               "--global-batch-size", "8", "--log-interval", "10", "--split", "100,0,0",
               "--reset-attention-mask", "--reset-position-ids")  # per-document masking: what the balanced intake needs
MARKERS = ("<!-- measured-table -->", "<!-- /measured-table -->")
#: the packers that keep every document whole (the PP- and DP-level comparison on equal documents)
WHOLE_DOCUMENT_PACKERS = ("wlb", "fixed-greedy", "whole-document")
COEFFICIENTS = ("attn_per_pair", "linear_per_token", "attn_per_run", "overhead")


@dataclass(frozen=True)
class Run:
    """One training run: a name, its layout (environment TP/CP/PP/DP), its --wlb-* flags and the research knobs
    of its settings file (``--wlb-config``: YAML sections, e.g. ``{"packing": {"cut": "any"}}``)."""

    name: str
    experiment: str
    layout: dict[str, str]
    flags: tuple[str, ...]
    calibrated: bool = True  # balances the calibrated profile (not the analytic model)
    settings: dict[str, dict[str, Any]] | None = None

    @property
    def ranks(self) -> int:
        return int(np.prod([int(v) for v in self.layout.values()]))


def experiments(which: list[str]) -> list[list[Run]]:
    """The groups of runs compared on equal work, each group run interleaved."""
    groups: dict[str, list[Run]] = {
        "cp": [Run(f"CP2 {s}", "cp", {"CP": "2"}, ("--wlb-packer", "wlb", "--wlb-cp-sharding", s))
               for s in ("per-sequence", "per-document", "adaptive")],
        "pp": [Run(f"PP2 {p}", "pp", {"PP": "2"}, ("--wlb-packer", p)) for p in WHOLE_DOCUMENT_PACKERS],
        "dp": [Run(f"DP2 {p}", "dp", {"DP": "2"}, ("--wlb-packer", p)) for p in WHOLE_DOCUMENT_PACKERS],
        "users": [Run("DP2 original", "users", {"DP": "2"}, ("--wlb-packer", "original"), calibrated=False),
                  Run("DP2 balanced concat-and-cut", "users", {"DP": "2"},
                      ("--wlb-packer", "wlb", "--wlb-pieces", "concat-and-cut")),
                  Run("DP2 wlb", "users", {"DP": "2"}, ("--wlb-packer", "wlb")),
                  Run("DP2 wlb cut any", "users", {"DP": "2"}, ("--wlb-packer", "wlb"),
                      settings={"packing": {"cut": "any"}})],
        "online": [Run("DP2 wlb online (from H100 model)", "online", {"DP": "2"},
                       ("--wlb-packer", "wlb", "--wlb-cost-model", "online"),
                       calibrated=False, settings={"cost": {"refit_interval": 10}})],
    }
    unknown = sorted(set(which) - set(groups))
    if unknown:
        raise SystemExit(f"--experiments {','.join(unknown)}: unknown; valid: {', '.join(groups)}")
    return [groups[w] for w in which]


# -- the corpus -------------------------------------------------------------------------------------------
def build_corpus(prefix: Path, seq_len: int = SEQ_LEN) -> dict[str, Any]:
    """PREFIX.bin/.idx: the standard library's .py files cut at blank lines, byte-level, documents of at most
    ``seq_len`` tokens (longer ones are left out of the corpus, counted: every packer then keeps every
    document whole). Reuses an existing corpus."""
    import sysconfig

    from megatron_wlb.data.reader import byte_documents, write_indexed_dataset

    paths = sorted(str(p) for p in Path(sysconfig.get_paths()["stdlib"]).glob("*.py"))
    docs = byte_documents(paths, separator="\n\n", eod=TINY_GPT_EOD)  # the tokenizer's EOD: --reset-* cuts there
    kept = [d for d in docs if d.size <= seq_len]
    if not prefix.with_suffix(".idx").exists():
        prefix.parent.mkdir(parents=True, exist_ok=True)
        write_indexed_dataset(str(prefix), kept)
    lengths = np.array([d.size for d in kept])
    long = lengths >= seq_len // 2
    return {"source": f"{len(paths)} stdlib .py files cut at blank lines, byte-level (+EOD {TINY_GPT_EOD})",
            "documents": int(lengths.size), "left_out_longer_than_seq_len": len(docs) - len(kept),
            "tokens": int(lengths.sum()), "median": float(np.median(lengths)), "p90": float(np.percentile(lengths, 90)),
            "max": int(lengths.max()), "share_of_documents_over_half_seq": float(long.mean()),
            "share_of_tokens_over_half_seq": float(lengths[long].sum() / lengths.sum())}


# -- running ----------------------------------------------------------------------------------------------
def train(run: Run, data: Path, out: Path, iters: int, profile: Path | None, log: Any,
          reuse: bool = False) -> Path:
    """One training run with the trace on; returns the trace path. ``reuse``: a finished earlier run's
    trace in ``out`` is analysed again instead (``--reuse-traces``)."""
    out.mkdir(parents=True, exist_ok=True)
    trace = out / "trace.jsonl"
    if reuse and (out / "train.log").exists():
        log(f"  {run.name}: reusing {out / 'train.log'}'s trace")
        return trace
    env = measurement_env(run.layout)
    flags = [*MODEL_FLAGS, "--train-iters", str(iters), *run.flags, "--wlb-trace", str(trace)]
    if run.settings:
        settings_file = out / "settings.yaml"  # JSON is YAML: a settings file of the run's research knobs
        settings_file.write_text(json.dumps(run.settings) + "\n")
        flags += ["--wlb-config", str(settings_file)]
    if run.calibrated and profile is not None:
        flags += ["--wlb-cost-profile", str(profile)]
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nnodes", "1", "--nproc-per-node",
           str(run.ranks), "-m", "megatron_wlb.megatron.entry.cpu", "--tiny-gpt", "--data-path", str(data), *flags]
    start = time.perf_counter()
    proc = subprocess.run(cmd, env=env, cwd=out, capture_output=True, text=True)
    seconds = time.perf_counter() - start
    text = proc.stdout + proc.stderr
    (out / "train.log").write_text(text)
    if proc.returncode != 0:
        raise SystemExit(f"{run.name}: training failed (rc {proc.returncode}), log {out / 'train.log'}:\n"
                         f"{text[-3000:]}")
    log(f"  {run.name}: {iters} iterations in {seconds:.0f} s")
    return trace


def calibrate(trace: Path, out: Path, log: Any) -> dict[str, Any]:
    """``wlb calibrate --from-trace``: the profile every calibrated run balances, and its held-out MAPE."""
    cmd = [sys.executable, "-m", "megatron_wlb", "calibrate", "--from-trace", str(trace), "--out", str(out)]
    proc = subprocess.run(cmd, capture_output=True, text=True)
    if proc.returncode != 0:
        raise SystemExit(f"wlb calibrate --from-trace failed:\n{proc.stdout}{proc.stderr}")
    profile = json.loads(out.read_text())
    log("  " + proc.stdout.strip().replace("\n", "\n  "))
    return profile


# -- analysis (pure) --------------------------------------------------------------------------------------
@dataclass
class RunResult:
    """What one run measured over its measured iterations (and what the simulator predicts for them)."""

    name: str
    experiment: str
    repeat: int
    iteration_wall_s: list[float]
    iteration_tokens: list[int]
    idle: list[float]
    imbalance: list[float]
    imbalance_planned: list[float]
    mape: list[float]
    predicted_wall_s: list[float]
    pairs_per_token: float
    flops_per_token: float
    timing_s: list[float] = field(default_factory=list)
    plans: list[str] = field(default_factory=list)
    refits: list[dict[str, Any]] = field(default_factory=list)

    @property
    def seconds_per_token(self) -> float:
        return float(np.sum(self.iteration_wall_s) / np.sum(self.iteration_tokens))

    @property
    def predicted_seconds_per_token(self) -> float:
        return float(np.sum(self.predicted_wall_s) / np.sum(self.iteration_tokens))


def iterations_of(trace: Trace, warmup: int) -> dict[int, tuple[list[Any], list[Any]]]:
    """Plan iteration -> (its micro-batch rows, its iteration rows), from ``warmup`` on."""
    out: dict[int, tuple[list[Any], list[Any]]] = defaultdict(lambda: ([], []))
    for r in trace.micro_batches:
        if r.iteration >= warmup:
            out[r.iteration][0].append(r)
    for it in trace.iterations:
        if it.iteration >= warmup:
            out[it.iteration][1].append(it)
    return dict(sorted(out.items()))


def plan_of(rows: list[Any], dp: int, n: int) -> list[list[int]]:
    """The iteration's micro-batches (document lengths), DP rank by DP rank, as the trace recorded them."""
    mbs: list[list[int]] = [[] for _ in range(dp * n)]
    for r in rows:
        if r.pp == 0 and r.chunk == 0 and r.cp == 0 and r.tp == 0:
            mbs[r.dp * n + r.micro_batch] = list(r.lengths)
    return mbs


def simulator_for(header: dict[str, Any], profile: dict[str, Any] | None, cp_layout: str) -> Any:
    """The simulator of the traced run's layout, pricing micro-batches with the calibrated profile."""
    from megatron_wlb.config import CpConfig, RunConfig
    from megatron_wlb.costmodel import CalibratedCostModel
    from megatron_wlb.packing.types import PackingConfig
    from megatron_wlb.sim.iteration import IterationSimulator

    model = ModelShape(**header["model"])
    lay = header["layout"]
    layout = ParallelLayout(tp=lay["tp"], cp=lay["cp"], pp=lay["pp"], dp=lay["dp"])
    cost = CalibratedCostModel(profile, model, layout) if profile is not None else build_cost_model(model, layout)
    n = int(header["n"])
    packing = PackingConfig(seq_len=SEQ_LEN, n=n, dp=lay["dp"])
    config = RunConfig(name="measured", model=model, layout=layout, seq_len=SEQ_LEN, packer="wlb", packing=packing,
                       cp=CpConfig(cp_layout), virtual_stages=int(lay.get("vpp", 1) or 1))
    return IterationSimulator(config, cost, cp_layout, dp_sync=False), n


def analyse(run: Run, repeat: int, trace_path: Path, warmup: int, profile: dict[str, Any] | None) -> RunResult:
    """Reduce one run's trace (``costmodel.measured``) and predict the same plans with the simulator."""
    from megatron_wlb.megatron.data.packed import plan_digest
    from megatron_wlb.packing.types import DocPiece, GlobalBatch, MicroBatch

    trace = read_trace(trace_path)
    header = trace.headers[0]
    lay = header["layout"]
    dp, cp, tp = int(lay["dp"]), int(lay["cp"]), int(lay["tp"])
    cp_layout = header["settings"]["cp_sharding"] if cp > 1 else "per-sequence"
    sim, n = simulator_for(header, profile, cp_layout)
    model = ModelShape(**header["model"])
    res = RunResult(run.name, run.experiment, repeat, [], [], [], [], [], [], [], 0.0, 0.0)
    pairs = tokens = flops = 0.0
    for it, (rows, its) in iterations_of(trace, warmup).items():
        if not its or not rows:
            continue
        m = IterationTotals.of(rows, its, dp, n, cp * tp).summary()
        res.iteration_wall_s.append(m.wall_s)
        res.iteration_tokens.append(m.tokens)
        res.idle.append(m.idle_fraction)
        res.imbalance.append(m.imbalance)
        res.imbalance_planned.append(m.imbalance_planned)
        res.mape.append(m.mape)
        res.timing_s.append(max(r.timing_s for r in its))
        mbs = plan_of(rows, dp, n)
        batch = GlobalBatch(it, tuple(MicroBatch(tuple(DocPiece(j, 0, d, it) for j, d in enumerate(mb)), 2 * SEQ_LEN)
                                      for mb in mbs), dp, n)
        res.predicted_wall_s.append(float(sim.simulate(batch).time))
        res.plans.append(plan_digest(batch))
        d = np.asarray([x for mb in mbs for x in mb], dtype=np.float64)
        pairs += float((d * (d + 1) / 2).sum())
        tokens += float(d.sum())
        flops += model.training_flops(d)
    res.pairs_per_token, res.flops_per_token = pairs / tokens, flops / tokens
    res.refits = [r for r in trace.refits if r.get("rank", 0) == 0] or list(trace.refits[:1])
    return res


def bootstrap_median(values: list[float], seed: int = 0, draws: int = 2000) -> tuple[float, float, float]:
    """(median, 2.5th, 97.5th percentile of the bootstrap median), seeded."""
    v = np.asarray(values, dtype=np.float64)
    rng = np.random.default_rng(seed)
    meds = np.median(rng.choice(v, size=(draws, v.size), replace=True), axis=1)
    return float(np.median(v)), float(np.percentile(meds, 2.5)), float(np.percentile(meds, 97.5))


def bootstrap_rate(walls: list[float], tokens: list[int], seed: int = 0, draws: int = 2000) -> tuple[float, ...]:
    """(tokens per second, 95% interval) over iterations resampled with replacement."""
    w, t = np.asarray(walls), np.asarray(tokens, dtype=np.float64)
    rng = np.random.default_rng(seed)
    idx = rng.integers(0, w.size, size=(draws, w.size))
    rates = t[idx].sum(axis=1) / w[idx].sum(axis=1)
    return float(t.sum() / w.sum()), float(np.percentile(rates, 2.5)), float(np.percentile(rates, 97.5))


def summarise(results: list[RunResult]) -> list[dict[str, Any]]:
    """One row per method: pooled over its repeats."""
    by: dict[tuple[str, str], list[RunResult]] = defaultdict(list)
    for r in results:
        by[(r.experiment, r.name)].append(r)
    rows = []
    for (_, name), rs in by.items():
        walls = [w for r in rs for w in r.iteration_wall_s]
        toks = [t for r in rs for t in r.iteration_tokens]
        pred = [p for r in rs for p in r.predicted_wall_s]
        rate = bootstrap_rate(walls, toks)
        med = bootstrap_median(walls)
        rows.append({
            "method": name, "experiment": rs[0].experiment, "repeats": len(rs), "iterations": len(walls),
            "tokens_per_s": rate[0], "tokens_per_s_ci": rate[1:], "per_repeat_tokens_per_s":
                [1.0 / r.seconds_per_token for r in rs],
            "iteration_ms_median": med[0] * 1e3, "iteration_ms_ci": (med[1] * 1e3, med[2] * 1e3),
            "tokens_per_iteration": float(np.mean(toks)),
            "idle": float(np.median([x for r in rs for x in r.idle])),
            "imbalance": float(np.median([x for r in rs for x in r.imbalance])),
            "imbalance_planned": float(np.median([x for r in rs for x in r.imbalance_planned])),
            "mape": float(np.median([x for r in rs for x in r.mape])),
            "predicted_tokens_per_s": float(np.sum(toks) / np.sum(pred)),
            "pairs_per_token": float(np.mean([r.pairs_per_token for r in rs])),
            "gflops_per_token": float(np.mean([r.flops_per_token for r in rs])) / 1e9,
            "same_plans_across_repeats": len({tuple(r.plans) for r in rs}) == 1,
            "timing_overhead": float(np.sum([x for r in rs for x in r.timing_s]) / np.sum(walls)),
            "refits": [r.refits[-1] for r in rs if r.refits],
        })
    return rows


def ratios(rows: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """Within each experiment: every method's measured and predicted throughput over its first method's."""
    out = []
    by: dict[str, list[dict[str, Any]]] = defaultdict(list)
    for r in rows:
        by[r["experiment"]].append(r)
    for exp, rs in by.items():
        base = rs[0]
        for r in rs[1:]:
            measured = r["tokens_per_s"] / base["tokens_per_s"]
            predicted = r["predicted_tokens_per_s"] / base["predicted_tokens_per_s"]
            out.append({"experiment": exp, "method": r["method"], "over": base["method"], "measured": measured,
                        "predicted": predicted, "prediction_error": predicted / measured - 1.0})
    return out


def online_against_calibrated(results: list[RunResult], profile: dict[str, Any], calib_trace: Path,
                              warmup: int) -> dict[str, Any] | None:
    """The online refit's last model against the calibrated one: both predict every measured micro-batch of
    the calibration run (per layer), and the mean relative difference of the two predictions says whether
    the refit reached the calibrated model, whatever their (ill-conditioned) individual coefficients."""
    from megatron_wlb.costmodel import ProfileFit, fit_profile
    from megatron_wlb.costmodel.trace import profile_points, read_trace

    refits = [r for r in results if r.experiment == "online" and r.refits]
    if not refits:
        return None
    trace = read_trace(calib_trace)
    points = profile_points(trace.after_warmup(warmup).micro_batches, trace.headers[0]["layout"])
    calibrated = fit_profile(profile)
    args = tuple(np.asarray(points[k], dtype=float) for k in ("pairs", "tokens", "head_tokens", "runs"))
    ref_f, ref_b = calibrated.predict(*args)
    measured = np.asarray(points["fwd_s"]) + np.asarray(points["bwd_s"])
    calibrated_mape = float(np.mean(np.abs(ref_f + ref_b - measured) / measured))
    out: dict[str, Any] = {"calibrated_mape_on_calibration_run": calibrated_mape, "refits": []}
    for r in refits:
        fit = ProfileFit(**r.refits[-1]["state"]["fit"])
        f, b = fit.predict(*args)
        out["refits"].append({
            "repeat": r.repeat, "iteration": r.refits[-1]["iteration"] + 1,
            "difference_to_calibrated": float(np.mean(np.abs(f + b - ref_f - ref_b) / (ref_f + ref_b))),
            "mape_on_calibration_run": float(np.mean(np.abs(f + b - measured) / measured)),
            "coefficients": {k: getattr(fit, k) for k in COEFFICIENTS},
        })
    out["calibrated_coefficients"] = {k: getattr(calibrated, k) for k in COEFFICIENTS}
    return out


# -- output -----------------------------------------------------------------------------------------------
def markdown(result: dict[str, Any]) -> str:
    """The results page of this benchmark, and (first table) benchmarks/results.md's summary."""
    lines = [table(result), "", "Ratios (tokens/s of each method over the first of its experiment; simulator "
             "with the calibrated profile on the same plans beside the measurement):", "",
             "| experiment | method | over | measured | predicted | prediction error |", "|---|---|---|---|---|---|"]
    for r in result["ratios"]:
        lines.append(f"| {r['experiment']} | {r['method']} | {r['over']} | {r['measured']:.3f} | {r['predicted']:.3f} "
                     f"| {r['prediction_error']:+.1%} |")
    return "\n".join(lines)


def table(result: dict[str, Any]) -> str:
    cal = result["calibration"]
    head = (f"Measured on {result['machine']}, torch {result['torch']}, megatron-core {result['megatron_core']}: "
            f"Megatron's training loop through the launcher, gloo, one process per core; tiny GPT (hidden 64, 4 heads, "
            f"2 layers, seq {SEQ_LEN}); corpus {result['corpus']['documents']:,} documents (median "
            f"{result['corpus']['median']:.0f} tokens, {result['corpus']['share_of_documents_over_half_seq']:.0%} of "
            f"documents over {SEQ_LEN // 2} tokens hold {result['corpus']['share_of_tokens_over_half_seq']:.0%} of the "
            f"tokens); {result['iterations']} iterations per run, the first {result['warmup']} not measured, "
            f"{result['repeats']} interleaved repeats. Calibrated profile: `wlb calibrate --from-trace`, held-out MAPE "
            f"{cal['holdout_mape']:.1%}. Command: `{result['command']}` ({result['wall_minutes']:.0f} min).")
    rows = ["| experiment | method | tokens/s (95% CI) | tokens/s per repeat | predicted tokens/s | ms / iteration "
            "(median, 95% CI) | tokens / iteration | idle | imbalance measured / planned | cost-model MAPE | attention "
            "pairs / token |", "|---|---|---|---|---|---|---|---|---|---|---|"]
    for r in result["methods"]:
        lo, hi = r["tokens_per_s_ci"]
        mlo, mhi = r["iteration_ms_ci"]
        reps = " / ".join(f"{x:,.0f}" for x in r["per_repeat_tokens_per_s"])
        rows.append(f"| {r['experiment']} | {r['method']} | {r['tokens_per_s']:,.0f} ({lo:,.0f}-{hi:,.0f}) | {reps} | "
                    f"{r['predicted_tokens_per_s']:,.0f} | {r['iteration_ms_median']:.0f} ({mlo:.0f}-{mhi:.0f}) | "
                    f"{r['tokens_per_iteration']:,.0f} | {r['idle']:.3f} | {r['imbalance']:.3f} / "
                    f"{r['imbalance_planned']:.3f} | {r['mape']:.1%} | {r['pairs_per_token']:.0f} |")
    return head + "\n\n" + "\n".join(rows)


def write_readme(path: Path, text: str) -> None:
    content = path.read_text()
    begin, end = MARKERS
    if begin not in content or end not in content:
        raise SystemExit(f"{path}: no {begin} ... {end} block to write the measured table into")
    pre, rest = content.split(begin, 1)
    _, post = rest.split(end, 1)
    path.write_text(pre + begin + "\n" + text + "\n" + end + post)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--out", type=Path, default=REPO / "benchmarks" / "results" / "measured")
    ap.add_argument("--work", type=Path, default=REPO / "out" / "bench_measured", help="corpus and traces")
    ap.add_argument("--quick", action="store_true", help="short runs, one repeat: a smoke test of the code")
    ap.add_argument("--iterations", type=int, default=None, help="iterations per run (default 56; quick 10)")
    ap.add_argument("--warmup", type=int, default=None, help="iterations not measured (default 6; quick 3)")
    ap.add_argument("--repeats", type=int, default=None, help="interleaved repeats (default 2; quick 1)")
    ap.add_argument("--experiments", default="cp,pp,dp,users,online")
    ap.add_argument("--page", type=Path, default=None,
                    help="write the summary table into this page (benchmarks/results.md)")
    ap.add_argument("--reuse-traces", action="store_true",
                    help="analyse the traces an earlier run left in --work again instead of training (same flags)")
    args = ap.parse_args(argv)
    iters = args.iterations or (10 if args.quick else 56)
    warmup = args.warmup if args.warmup is not None else (3 if args.quick else 6)
    repeats = args.repeats or (1 if args.quick else 2)
    if not 0 <= warmup < iters - 1:
        raise SystemExit(f"--warmup {warmup}: must leave at least 2 of the {iters} iterations measured")
    if len(os.sched_getaffinity(0)) < 2:
        raise SystemExit("bench_measured needs 2 cores (its runs have 2 ranks, one per core)")
    started = time.perf_counter()

    def log(line: str) -> None:
        elapsed = time.perf_counter() - started
        print(f"[{elapsed / 60:5.1f} min] {line}", file=sys.stderr, flush=True)

    import torch
    from megatron.core import package_info

    corpus_prefix = args.work / "corpus" / "stdlib_paragraphs"
    corpus = build_corpus(corpus_prefix)
    log(f"corpus {corpus['documents']:,} documents, {corpus['tokens']:,} tokens, median {corpus['median']:.0f}")
    log("calibration run (wlb, DP2, analytic H100 cost model)")
    calib_run = Run("DP2 wlb (analytic H100 model)", "calibration", {"DP": "2"}, ("--wlb-packer", "wlb"),
                    calibrated=False)
    calib_trace = train(calib_run, corpus_prefix, args.work / "calibration", iters, None, log, args.reuse_traces)
    profile_path = args.work / "calibrated_profile.json"
    profile = calibrate(calib_trace, profile_path, log)
    results = [analyse(calib_run, 0, calib_trace, warmup, profile)]
    groups = experiments(args.experiments.split(","))
    total = sum(len(g) for g in groups) * repeats
    done = 0
    for group in groups:
        log(f"experiment {group[0].experiment}: {', '.join(r.name for r in group)} x {repeats}")
        for rep in range(repeats):
            for run in group:
                trace = train(run, corpus_prefix, args.work / run.experiment / f"{run.name}-{rep}".replace(" ", "_"),
                              iters, profile_path, log, args.reuse_traces)
                results.append(analyse(run, rep, trace, warmup, profile))
                done += 1
                eta = (time.perf_counter() - started) / (done + 1) * (total - done) / 60
                log(f"  {done}/{total} runs; ETA {eta:.0f} min")
    methods = summarise(results)
    online = online_against_calibrated(results, profile, calib_trace, warmup)
    cp_plans = {tuple(r.plans) for r in results if r.experiment == "cp"}
    result = {
        "machine": machine(), "torch": torch.__version__, "megatron_core": str(package_info.__version__),
        "command": "python benchmarks/bench_measured.py" + (" --quick" if args.quick else ""),
        "iterations": iters, "warmup": warmup, "repeats": repeats, "corpus": corpus,
        "calibration": {"profile": profile_path.name, "holdout_mape": profile["holdout"]["mape"],
                        "holdout": profile["holdout"], "fit": profile.get("source")},
        "cp_same_plans": len(cp_plans) <= 1, "methods": methods, "ratios": ratios(methods), "online": online,
        "wall_minutes": (time.perf_counter() - started) / 60,
    }
    write_result(args.out / "measured", result,
                 lambda r: "# Measured in Megatron's training loop\n\n" + markdown(r) + "\n")
    if args.page is not None:
        write_readme(args.page, table(result))
    log(f"wrote {args.out / 'measured.json'} and measured.md")
    return 0


if __name__ == "__main__":
    sys.exit(main())
