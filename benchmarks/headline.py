"""The README's headline numbers, from the results the benchmarks recorded (no number typed by hand).

Simulated: ``wlb reproduce``'s report (``benchmarks/results/reproduce/report.md``, its "avg all" row over the
paper's eight Table 1 configurations). Measured: ``benchmarks/bench_paired.py``'s comparisons
(``benchmarks/results/paired.json``: the baseline's time over ours per unit of priced work, with the 95% interval, and
the cost model's prediction beside it).

    python benchmarks/headline.py --write     # rewrite the README's block between its markers
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
BEGIN, END = "<!-- headline -->", "<!-- /headline -->"
REPORT = ROOT / "benchmarks" / "results" / "reproduce" / "report.md"
PAIRED = ROOT / "benchmarks" / "results" / "paired.json"
#: ``bench_paired.py --dynamic-cp``: the DP2 x CP2 comparisons (the paper's own among them)
PAIRED_CP4 = ROOT / "benchmarks" / "results" / "dynamic_cp_paired.json"

#: (report column, what it compares) of the simulated rows
SIMULATED = (("WLB-LLM / whole-document", "WLB-LLM (wlb packing + adaptive CP) over documents kept whole"),
             ("WLB-LLM / concat-and-cut", "WLB-LLM over Megatron's concat-and-cut"),
             ("Balanced concat-and-cut / concat-and-cut",
              "`--wlb-pieces concat-and-cut` (the same samples, balanced) over concat-and-cut"))
#: bench_paired comparison name -> what it compares (its ratio is B's time over A's per unit of work: above 1,
#: A, ours, is faster)
MEASURED = (("paper", "WLB-LLM as the paper runs it (wlb packing, documents whole, adaptive CP) over stock Megatron "
                      "(GPTDataset samples, per-sequence CP), DP2 x CP2"),
            ("users-cp", "`--wlb-pieces concat-and-cut` with adaptive CP over stock Megatron, DP2 x CP2"),
            ("dcp", "dynamic CP over the same wlb batches on fixed CP2 groups (adaptive), DP2 x CP2"),
            ("aa-cp", "A/A at DP2 x CP2: wlb with adaptive CP over itself, the instrument's own spread"),
            ("users", "`--wlb-pieces concat-and-cut` over stock Megatron, the same GPTDataset samples (DP2)"),
            ("large", "the same, one micro-batch per DP rank (DP2, global batch 2)"),
            ("dp", "wlb over fixed-greedy, documents whole (DP2)"),
            ("pp", "wlb over fixed-greedy, documents whole (PP2)"),
            ("cp", "per-document over per-sequence CP layout (CP2)"),
            ("aa", "A/A: wlb over itself (DP2), the instrument's own spread"))


def report_row(report: str, label: str = "**avg all** (geo-mean)") -> dict[str, str]:
    """The report's first table's row ``label``, as column name -> cell."""
    lines = [line for line in report.splitlines() if line.startswith("|")]
    header = [c.strip() for c in lines[0].strip("|").split("|")]
    for line in lines[2:]:
        cells = [c.strip() for c in line.strip("|").split("|")]
        if cells[0] == label:
            return dict(zip(header, cells))
    raise SystemExit(f"{REPORT}: no row {label!r} in its first table; rerun wlb reproduce")


def cpu_of(result: dict) -> str:
    """The CPU model a results file names (its ``machine``'s first part)."""
    return str(result.get("machine", "an unnamed machine")).split(",")[0]


def headline(report: str, *paired: dict) -> str:
    """The README's headline table (``paired``: bench_paired's results files, each naming its CPU)."""
    row, paper = report_row(report), report_row(report, "paper avg all")
    lines = ["| what | how it was obtained | speedup |", "|---|---|---:|"]
    for column, text in SIMULATED:
        quoted = f" (the paper measured {paper[column]}x on H100s)" if paper.get(column, "-") != "-" else ""
        lines.append(f"| {text} | simulated: `wlb reproduce`, the paper's 8 configurations (geo-mean), analytic "
                     f"H100 cost model{quoted} | **{row[column]}x** |")
    by_name = {c["name"]: (c, cpu_of(result)) for result in paired for c in result["comparisons"]}
    for name, text in MEASURED:
        if name not in by_name:
            continue
        c, cpu = by_name[name]
        r = c["replay"]
        lines.append(f"| {text} | measured: Megatron's loop on 2 cores of an {cpu}, tiny GPT, {c['pairs']} paired "
                     f"steps (`benchmarks/bench_paired.py`; predicted {c['predicted']['ratio']:.3f}) | "
                     f"{r['ratio']:.3f} [{r['low']:.3f}, {r['high']:.3f}] |")
    lines.append("| any of them on a GPU | not measured: no GPU has been lent to this project yet | - |")
    return "\n".join(lines) + "\n"


def current() -> str:
    return headline(REPORT.read_text(), *(json.loads(p.read_text()) for p in (PAIRED_CP4, PAIRED) if p.exists()))


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--write", action="store_true", help="rewrite README.md's headline block")
    args = ap.parse_args(argv)
    table = current()
    if args.write:
        readme = ROOT / "README.md"
        text = readme.read_text()
        if BEGIN not in text or END not in text:
            raise SystemExit(f"{readme}: no {BEGIN} ... {END} block")
        before, rest = text.split(BEGIN, 1)
        readme.write_text(f"{before}{BEGIN}\n{table}{END}{rest.split(END, 1)[1]}")
    print(table, end="")


if __name__ == "__main__":
    main()
