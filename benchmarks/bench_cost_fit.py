#!/usr/bin/env python
"""The cost model's held-out error on measured micro-batches: one cost per (query, key) pair (the fit
before the attention table) vs per-pair cost as a table over query-run lengths (``costmodel.table``).

    python benchmarks/bench_cost_fit.py                  # two short DP2 runs (~3 min on 2 cores), then the fits
    python benchmarks/bench_cost_fit.py --quick          # 40 iterations each (~1 min): the code path
    python benchmarks/bench_cost_fit.py --trace T.jsonl  # fit existing traces instead (repeatable)
    python benchmarks/bench_cost_fit.py --across --from out/paired   # across packings and corpora (issue 46)

``--across``: which whole-micro-batch terms (``costmodel.fit.TERMS``: tokens^2, tokens x pairs) generalise. The
paired benchmark's calibration traces (one short DP2 run per packing on the standard library; ``--from`` its
``--work`` folder, or run here) are fitted leaving one packing out at a time, and all of them predict two runs
(wlb, fixed-greedy) on a second corpus, C/C++ headers; each term set's held-out MAPE per packing and corpus is
written to ``benchmarks/results/costmodel_across.{json,md}`` with the terms ``wlb calibrate`` keeps.

The runs are ``benchmarks/bench_measured.py``'s calibration run (Megatron's loop on this CPU, the tiny GPT,
DP2, wlb with the analytic model, ``WLB_PIN_CORES=1``), traced twice: on the monotonic clock (what
``--wlb-trace`` records by default: wall seconds of each step) and on the thread clock
(``WLB_TRACE_CLOCK=thread``: the thread's CPU seconds, without preemption and steal). Each trace is fitted
as ``wlb calibrate --from-trace`` does (iterations from ``--skip-iters``; iterations i with i % 5 == 4 held
out) and the mean absolute percentage error (MAPE) of forward + backward on the held-out rows is reported
for the linear-in-pairs fit and for the table at 2..5 knots, with each fit's condition number.
Writes ``OUT.json`` and ``OUT.md`` (default ``benchmarks/results/costmodel_fit``), naming the machine.
"""

from __future__ import annotations

import argparse
import os
import sys
import time
from pathlib import Path
from typing import Any

import numpy as np

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO / "benchmarks"))

from _results import write_result  # noqa: E402

from megatron_wlb.costmodel import PROFILE_FORMAT, ModelShape, fit_profile, holdout_every, holdout_mape  # noqa: E402
from megatron_wlb.costmodel.fit import select_points  # noqa: E402
from megatron_wlb.costmodel.table import MAX_KNOTS, choose_knots  # noqa: E402
from megatron_wlb.costmodel.trace import profile_points, read_trace, trace_setup  # noqa: E402
from megatron_wlb.provenance import machine  # noqa: E402

NOTE = ("Both runs use `measurement_env` (one core and one thread per rank, glibc's heap kept): before it, the "
        "ranks spent ~40% of their thread time in the kernel faulting in attention buffers, the same micro-batch "
        "varied 10-40% between repeats, and these fits read 11.6% (thread) and 23.1% (wall) held out. The tiny GPT "
        "(hidden 64, 2 layers, seq 1,024) spends much of a micro-batch in per-token, per-document and fixed "
        "costs, so the table over query-run lengths changes the error little here. Conditioning: packed "
        "micro-batches of near-equal tokens make the per-token and per-micro-batch columns nearly collinear, and "
        "neighbouring knots overlap; the fit scales its columns to unit norm, penalises differences of "
        "neighbouring knot costs relative to the one-cost fit, adds a 1e-7 ridge, and merges knots under 3% of "
        "the pairs (`costmodel.table`); the condition numbers above are of the scaled normal equations without "
        "and with that regularisation.")


def within_iteration(profile: dict[str, Any], every: int) -> dict[str, Any]:
    """The error that balancing meets: every ``every``-th micro-batch of each iteration (rotating) is left
    out of the fit, and predicted times that iteration's speed, the median measured / predicted of its
    other micro-batches. The packer compares micro-batches of one iteration with each other, so a speed
    shared by the whole iteration (the machine's drift) does not unbalance a plan; the spread of those
    speeds is reported as what no cost model can predict."""
    from megatron_wlb.costmodel.fit import select_points, table_of

    section = profile["micro_batches"]
    iteration = np.asarray(section["iteration"], dtype=np.int64)
    position = np.zeros(iteration.size, dtype=np.int64)
    seen: dict[int, int] = {}
    for i, g in enumerate(iteration.tolist()):
        position[i] = seen.get(g, 0)
        seen[g] = position[i] + 1
    held = (position + iteration) % every == every - 1
    fit = fit_profile({**profile, "micro_batches": select_points(section, ~held)})
    f, b = fit.predict(section["pairs"], section["tokens"], section.get("head_tokens", 0.0),
                       section.get("runs", section.get("documents", 1.0)), table_of(section, fit))
    predicted = f + b
    measured = np.asarray(section["fwd_s"], dtype=np.float64) + np.asarray(section["bwd_s"], dtype=np.float64)
    speed = {g: float(np.median(measured[(iteration == g) & ~held] / predicted[(iteration == g) & ~held]))
             for g in np.unique(iteration) if ((iteration == g) & ~held).any()}
    rows = [i for i in np.flatnonzero(held) if int(iteration[i]) in speed]
    errors = [abs(predicted[i] * speed[int(iteration[i])] - measured[i]) / measured[i] for i in rows]
    speeds = np.asarray(list(speed.values()))
    return {"mape": float(np.mean(errors)), "held_out": len(rows),
            "speed_p10_p90": [float(x) for x in np.percentile(speeds / np.median(speeds), [10, 90])]}


def fits(trace_path: str, warmup: int, every: int) -> dict[str, Any]:
    """Held-out MAPE of the linear-in-pairs fit and of the table at 2..MAX_KNOTS knots on one trace."""
    trace = read_trace(trace_path)
    setup = trace_setup(trace)
    clock = str(trace.headers[0].get("clock", "cpu"))
    points = profile_points(trace.after_warmup(warmup).micro_batches, setup["layout"], clock)
    model = ModelShape(**setup["model"])
    profile = {"format": PROFILE_FORMAT, "device": setup["device"], "model": model.to_dict(),
               "tp": int(setup["layout"].get("tp", 1)), "micro_batches": points}
    mask, split = holdout_every(np.asarray(points["iteration"], dtype=np.int64), every)
    lengths, pairs = (np.concatenate([np.asarray(r, dtype=np.float64) for r in points[k]])
                      for k in ("run_lengths", "run_pairs"))
    linear = fit_profile(profile)
    out: dict[str, Any] = {
        "trace": trace_path, "clock": clock, "device": setup["device"], "layout": setup["layout"],
        "rows": len(points["fwd_s"]), "held_out": int(mask.sum()), "split": split,
        "linear_in_pairs": {"mape": holdout_mape(profile, mask)["mape"], "per_pair_fwd_s": linear.attn_per_pair},
        "tables": []}
    for k in range(2, MAX_KNOTS + 1):
        knots = choose_knots(lengths, pairs, k)
        if len(knots) < 2 or any(t["knots"] == list(knots) for t in out["tables"]):
            continue
        with_table = {**profile, "attention_table": {"lengths": list(knots)}}
        fit = fit_profile(with_table)
        out["tables"].append({"max_knots": k, "knots": list(knots), "per_pair_fwd_s": list(fit.pair_costs),
                              "mape": holdout_mape(with_table, mask)["mape"],
                              "condition": fit.extra["table"]["condition"],
                              "condition_regularised": fit.extra["table"]["condition_regularised"]})
    default = choose_knots(lengths, pairs, MAX_KNOTS)
    out["table"] = next(t for t in out["tables"] if t["knots"] == list(default)) if len(default) > 1 else None
    out["within_iteration"] = within_iteration({**profile, "attention_table": {"lengths": list(default)}}
                                               if len(default) > 1 else profile, every)
    return out


def to_markdown(result: dict[str, Any]) -> str:
    lines = ["# Cost model: held-out error, one cost per pair vs a per-pair table over query-run lengths", "",
             f"Machine: {result['machine']}; torch {result['torch']}; {result['command']}.", "",
             "Per-micro-batch MAPE of forward + backward on held-out iterations (i % 5 == 4), fitted on the "
             "others (`wlb calibrate --from-trace`'s fit).", "",
             "| trace clock | rows (held out) | one cost per pair | table (default knots) | knots | "
             "forward s/pair at the knots | condition (scaled, regularised) |",
             "|---|---|---|---|---|---|---|"]
    for t in result["traces"]:
        tab = t["table"]
        if tab is None:
            lines.append(f"| {t['clock']} | {t['rows']} ({t['held_out']}) | {t['linear_in_pairs']['mape']:.1%} | - | "
                         "- | - | - |")
            continue
        costs = ", ".join(f"{c:.3g}" for c in tab["per_pair_fwd_s"])
        lines.append(f"| {t['clock']} | {t['rows']} ({t['held_out']}) | {t['linear_in_pairs']['mape']:.1%} | "
                     f"{tab['mape']:.1%} | {', '.join(f'{k:g}' for k in tab['knots'])} | {costs} | "
                     f"{tab['condition']:.2g} ({tab['condition_regularised']:.2g}) |")
    lines += ["", "Every knot count tried:", ""]
    for t in result["traces"]:
        tries = "; ".join(f"{len(x['knots'])} knots {x['mape']:.1%}" for x in t["tables"])
        lines.append(f"- {t['clock']}: one cost per pair {t['linear_in_pairs']['mape']:.1%}; {tries}")
    lines += ["", "Within an iteration (what balancing meets: every 5th micro-batch of each iteration left out, "
              "predicted times its iteration's speed from the others):", ""]
    for t in result["traces"]:
        w = t["within_iteration"]
        lines.append(f"- {t['clock']}: MAPE {w['mape']:.1%} on {w['held_out']} micro-batches; the iterations' "
                     f"speeds span {w['speed_p10_p90'][0]:.2f}-{w['speed_p10_p90'][1]:.2f}x their median (p10-p90)")
    lines += ["", NOTE, ""]
    return "\n".join(lines)


# -- across packings and corpora (issue 46): which whole-micro-batch terms generalise -----------------------
#: the term sets compared: the sum of the documents (base) and each whole-micro-batch term beside it
TERM_SETS = (("base (documents only)", ()), ("+ tokens^2", ("tokens_sq",)), ("+ tokens x pairs", ("tokens_pairs",)),
             ("+ both", ("tokens_sq", "tokens_pairs")))
#: the second corpus: C/C++ headers, byte-level (another shape of documents than the standard library's code)
HEADER_GLOBS = ("/usr/include/**/*.h", "/usr/include/**/*.hpp")


def labelled_points(traces: list[str], warmup: int) -> tuple[dict[str, Any], dict[str, Any]]:
    """(profile with every trace's points labelled by packing, setup) of traces of one model and layout."""
    from megatron_wlb.costmodel.trace import trace_packing

    points: dict[str, list[Any]] = {}
    setup: dict[str, Any] = {}
    for path in traces:
        trace = read_trace(path)
        setup = trace_setup(trace)
        mine = profile_points(trace.after_warmup(warmup).micro_batches, setup["layout"],
                              str(trace.headers[0].get("clock", "cpu")))
        mine["packing"] = [trace_packing(trace)] * len(mine["fwd_s"])
        for key, values in mine.items():
            points.setdefault(key, []).extend(values)
    model = ModelShape(**setup["model"])
    return {"format": PROFILE_FORMAT, "device": setup["device"], "model": model.to_dict(),
            "tp": int(setup["layout"].get("tp", 1)), "micro_batches": points}, setup


def across(fitted: list[str], other: list[str], warmup: int) -> dict[str, Any]:
    """Held-out MAPE of each term set: every packing of ``fitted`` (one corpus) predicted by a fit of the others,
    and every packing of ``other`` (another corpus) predicted by a fit of all of ``fitted``; and the terms
    ``wlb calibrate --from-trace`` keeps (``fit.select_terms``) on ``fitted``."""
    from megatron_wlb.costmodel.fit import BASE_TERMS, held_out_errors, select_terms

    profile, _ = labelled_points(fitted, warmup)
    mb = profile["micro_batches"]
    lengths, pairs = (np.concatenate([np.asarray(r, dtype=np.float64) for r in mb[k]])
                      for k in ("run_lengths", "run_pairs"))
    knots = choose_knots(lengths, pairs, MAX_KNOTS)
    if len(knots) > 1:  # the attention table, as ``wlb calibrate --from-trace`` fits it
        profile["attention_table"] = {"lengths": list(knots)}
    rows: list[dict[str, Any]] = []
    for name, extra in TERM_SETS:
        terms = [*BASE_TERMS, *extra]
        row: dict[str, Any] = {"terms": name, "packings": held_out_errors({**profile, "terms": terms})["groups"],
                               "other_corpus": {}}
        if other:
            test, _ = labelled_points(other, warmup)
            for label in sorted(set(test["micro_batches"]["packing"])):
                mask = np.array([x == label for x in test["micro_batches"]["packing"]])
                row["other_corpus"][label] = holdout_mape({**profile, "terms": terms},
                                                          select_points(test["micro_batches"], mask))["mape"]
        every = list(row["packings"].values()) + list(row["other_corpus"].values())
        row["mean"], row["max"] = float(np.mean(every)), float(np.max(every))
        rows.append(row)
    kept, report = select_terms(profile)
    return {"fitted": fitted, "other": other, "rows": rows, "selected": list(kept), "selection": report,
            "knots": list(knots)}


def across_markdown(result: dict[str, Any]) -> str:
    rows = result["rows"]
    packings = list(rows[0]["packings"])
    others = list(rows[0]["other_corpus"])
    lines = ["# Cost model across packings and corpora: which whole-micro-batch terms generalise", "",
             f"Machine: {result['machine']}; torch {result['torch']}; `{result['command']}`.", "",
             "Mean absolute percentage error of forward + backward per micro-batch (thread clock). Standard library "
             "columns: each packing's micro-batches predicted by a fit of the other packings' (leave one packing "
             "out); header columns: a fit of every standard-library packing predicting another corpus (C/C++ "
             "headers, byte-level, the same model and layout). Attention's per-pair cost is a table over query-run "
             f"lengths (knots {', '.join(f'{k:g}' for k in result['knots'])}), as `wlb calibrate` fits it.", "",
             "| terms | " + " | ".join(f"stdlib: {p}" for p in packings) + "".join(f" | headers: {o}" for o in others)
             + " | mean | max |", "|---|" + "---|" * (len(packings) + len(others) + 2)]
    for r in rows:
        cells = [f"{r['packings'][p]:.1%}" for p in packings] + [f"{r['other_corpus'][o]:.1%}" for o in others]
        lines.append(f"| {r['terms']} | " + " | ".join(cells) + f" | {r['mean']:.1%} | {r['max']:.1%} |")
    sel = result["selection"]
    steps = "; ".join(", ".join(f"+{t} {m:.1%}" for t, m in step["tried"].items())
                      + f" ({'kept ' + step['kept'] if step['kept'] else 'none kept'})" for step in sel["steps"])
    lines += ["", f"`wlb calibrate --from-trace` on the standard-library traces keeps {', '.join(result['selected'])}: "
              f"held out by packing, the base terms {sel['base']['mape']:.1%}; {steps}.", ""]
    return "\n".join(lines)


def run_across(args: argparse.Namespace) -> int:
    """``--across``: the paired benchmark's per-packing calibration traces (``--from WORK``, or run here) and
    two runs on a second corpus."""
    import bench_paired as bp
    import torch

    work = Path(args.from_work) if args.from_work else args.work
    data = work / "corpus" / "stdlib_files_text_document"
    bp.build_corpus(data)
    steps = 8 if args.quick else bp.CALIBRATION_STEPS
    fitted = []
    for c in bp.CALIBRATIONS:
        trace = work / bp.CALIBRATION / c.name / "trace.jsonl"
        if not (trace.with_name("trace-rank00000.jsonl")).exists():
            bp.train(c, data, trace.parent, steps, print)
        fitted.append(str(trace))
    headers = args.work / "corpus" / "headers_text_document"
    build_header_corpus(headers)
    other = []
    for c in bp.CALIBRATIONS[:2]:  # wlb and fixed-greedy on the other corpus
        out = args.work / "headers" / c.name
        if not (out / "trace-rank00000.jsonl").exists():
            bp.train(c, headers, out, steps, print)
        other.append(str(out / "trace.jsonl"))
    command = "python benchmarks/bench_cost_fit.py --across" + (" --quick" if args.quick else "") + \
        (f" --from {args.from_work}" if args.from_work else "")
    result = {"machine": machine(), "torch": torch.__version__, "command": command,
              **across(fitted, other, args.warmup)}
    write_result(args.out_across, result, across_markdown)
    return 0


def build_header_corpus(prefix: Path) -> None:
    """PREFIX.bin/.idx: C/C++ headers under /usr/include whole, byte-level, each ended with the tokenizer's EOD,
    those up to the window (as ``bench_paired.build_corpus`` does with the standard library)."""
    import glob

    import bench_paired as bp

    from megatron_wlb.data.reader import byte_documents, write_indexed_dataset

    if prefix.with_suffix(".idx").exists():
        return
    paths = sorted({p for g in HEADER_GLOBS for p in glob.glob(g, recursive=True)})[:4000]
    docs = [d for d in byte_documents(paths, separator=None, eod=bp.EOD) if 0 < d.size <= bp.SEQ_LEN]
    if len(docs) < 200:
        raise SystemExit(f"only {len(docs)} headers under /usr/include: the second corpus needs >= 200")
    prefix.parent.mkdir(parents=True, exist_ok=True)
    write_indexed_dataset(str(prefix), docs)


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--trace", action="append", default=None, help="fit this trace (repeatable) instead of running")
    p.add_argument("--iterations", type=int, default=None, help="training iterations per run (default 160)")
    p.add_argument("--quick", action="store_true", help="40 iterations per run")
    p.add_argument("--warmup", type=int, default=2, help="iterations dropped from the start (default 2)")
    p.add_argument("--work", type=Path, default=Path("/tmp/wlb_bench_cost_fit"), help="runs' folder")
    p.add_argument("--out", default=str(REPO / "benchmarks" / "results" / "costmodel_fit"), help="OUT(.json/.md)")
    p.add_argument("--across", action="store_true",
                   help="the held-out error across packings and corpora of each whole-micro-batch term (issue 46)")
    p.add_argument("--from", dest="from_work", default=None,
                   help="--across: the paired benchmark's --work folder, whose calibration traces to reuse")
    p.add_argument("--out-across", default=str(REPO / "benchmarks" / "results" / "costmodel_across"),
                   help="--across: OUT(.json/.md)")
    args = p.parse_args()
    if args.across:
        return run_across(args)
    import torch

    traces = args.trace
    command = "python benchmarks/bench_cost_fit.py" + (" --quick" if args.quick else "")
    if traces is None:
        import bench_measured as bm

        iters = args.iterations or (40 if args.quick else 160)
        prefix = args.work / "corpus" / "stdlib_paragraphs"
        bm.build_corpus(prefix)
        run = bm.Run("DP2 wlb (analytic H100 model)", "calibration", {"DP": "2"}, ("--wlb-packer", "wlb"),
                     calibrated=False)
        traces = []
        for clock in ("monotonic", "thread"):
            os.environ["WLB_TRACE_CLOCK"] = clock  # read by the traced processes
            start = time.perf_counter()
            traces.append(str(bm.train(run, prefix, args.work / clock, iters, None, print)))
            print(f"{clock} run: {time.perf_counter() - start:.0f} s", file=sys.stderr)
        os.environ.pop("WLB_TRACE_CLOCK")
        command += f" ({iters} iterations per run)"
    else:
        command += "".join(f" --trace {t}" for t in traces)
    result = {"machine": machine(), "torch": torch.__version__, "command": command,
              "traces": [fits(t, args.warmup, 5) for t in traces],
              "note": NOTE}
    write_result(args.out, result, to_markdown)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
