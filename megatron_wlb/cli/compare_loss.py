"""``wlb compare-loss``: is the balanced run's loss curve stock Megatron's? Two Megatron logs in, a verdict out.

    wlb compare-loss --stock STOCK.log --balanced BALANCED.log [--plot curves.png] [--json out.json]
                     [--rtol 1e-5] [--require-equal]

Each log is what Megatron printed (``--log-interval 1``: one ``iteration N/M | ... lm loss: ... | grad norm: ...``
line per step; ``scripts/compare_loss.sh`` trains both runs and calls this). The verdict is one line:
``equal`` when every iteration either log holds is in both, trained in both (a finite ``lm loss``, not skipped
or NaN) and has its ``lm loss`` and grad norm within ``--rtol`` relative of stock's (or within the log's own print
precision: Megatron prints the grad norm to three decimals), and both runs have the same ``--train-iters`` and
reached it; else ``differ``, naming the first iteration that differs and why, the sum of the losses over the
run and the mean of the last five iterations of each. With ``--wlb-max-delay 0`` the balanced mode trains each
iteration exactly the tokens of its own global batch, so its curve is stock's to float tolerance; with a delay > 0
a piece may wait for a later iteration and the curves differ step by step (docs/megatron.md, "The same loss curve").
"""

from __future__ import annotations

import argparse
import json
import math
import re
import sys
from dataclasses import asdict, dataclass
from pathlib import Path

from megatron_wlb.cli.common import input_file, output_file
from megatron_wlb.sim.report import DPI, _plt  # matplotlib is imported by _plt(), for the figure only

#: relative tolerance of an equal curve: float32 sums of the same terms in another order
DEFAULT_RTOL = 1e-5
#: the last iterations whose mean loss the verdict compares (the end of the curve, less noisy than one step)
TAIL = 5

_ITERATION = re.compile(r"\biteration\s+(\d+)/\s*(\d+)\s*\|")
#: a printed number: Megatron writes ``{:.6E}`` (``INF``, ``NAN``) for the loss and ``{:.3f}`` (``inf``) for the norm
_NUMBER = r"([-+]?(?:[0-9.]+(?:[eE][-+]?\d+)?|nan|inf))"
_LOSS = re.compile(r"\blm loss: " + _NUMBER, re.IGNORECASE)
_GRAD_NORM = re.compile(r"\bgrad norm: " + _NUMBER, re.IGNORECASE)
_SKIPPED = re.compile(r"\bnumber of skipped iterations:\s*(\d+)")
_NAN = re.compile(r"\bnumber of nan iterations:\s*(\d+)")


def _resolution(text: str) -> float:
    """Half a unit in the last printed place of ``text`` (``1.753`` -> 5e-4, ``5.767912E+00`` -> 5e-7)."""
    mantissa, _, exponent = text.lower().partition("e")
    decimals = len(mantissa.partition(".")[2])
    return 0.5 * 10.0 ** (int(exponent or 0) - decimals) if mantissa[-1:].isdigit() else 0.0


@dataclass(frozen=True)
class Step:
    """One logged iteration: its lm loss and grad norm, and how precisely the log printed each; the run's
    ``--train-iters`` (the ``/M`` of the line) and the iterations Megatron counted skipped or NaN in it."""

    loss: float | None  # None: the line has no lm loss (Megatron prints none for a NaN loss)
    loss_resolution: float
    grad_norm: float | None
    grad_norm_resolution: float
    train_iters: int = 0  # 0: unknown
    skipped: int = 0
    nan: int = 0

    def trouble(self) -> str | None:
        """Why this iteration is not a trained step to compare (None if it is one)."""
        if self.loss is None:
            return "no lm loss (Megatron prints none for a NaN loss)"
        if not math.isfinite(self.loss):
            return f"lm loss {self.loss}"
        if self.skipped:
            return f"skipped {self.skipped} iteration(s) (Megatron's number of skipped iterations)"
        if self.nan:
            return f"{self.nan} NaN iteration(s) (Megatron's number of nan iterations)"
        if self.grad_norm is not None and not math.isfinite(self.grad_norm):
            return f"grad norm {self.grad_norm}"
        return None


def read_megatron_log(path: str | Path) -> dict[int, Step]:
    """Every Megatron iteration line of the log ``path`` (``iteration N/M | ...``): iteration -> ``Step``, a line
    without an ``lm loss`` included (its loss None). A line printed twice (several ranks, ``--tee``) counts once;
    the same iteration with other values is refused."""
    steps: dict[int, Step] = {}
    for line in Path(path).read_text(errors="replace").splitlines():
        at = _ITERATION.search(line)
        if not at:
            continue
        loss, norm = _LOSS.search(line), _GRAD_NORM.search(line)
        skipped, nan = _SKIPPED.search(line), _NAN.search(line)
        step = Step(float(loss.group(1)) if loss else None, _resolution(loss.group(1)) if loss else 0.0,
                    float(norm.group(1)) if norm else None, _resolution(norm.group(1)) if norm else 0.0,
                    int(at.group(2)), int(skipped.group(1)) if skipped else 0, int(nan.group(1)) if nan else 0)
        seen = steps.setdefault(int(at.group(1)), step)
        if repr(seen) != repr(step):  # repr: a NaN equals itself
            raise ValueError(f"{path}: iteration {at.group(1)} is logged twice with different values "
                             f"(lm loss {seen.loss} and {step.loss}): give the log of one run")
    if not any(s.loss is not None for s in steps.values()):
        raise ValueError(f"{path}: no Megatron iteration line with an 'lm loss' (train with --log-interval 1 and "
                         "give the log of the last pipeline stage's rank, or all ranks' output)")
    return steps


@dataclass(frozen=True)
class LossComparison:
    """How far a balanced run's curve is from stock's, iteration by iteration over every iteration either logged."""

    iterations: int  # iterations both logged with a finite loss (the ones compared by value)
    equal: bool
    rtol: float
    max_loss_rel: float  # largest |balanced - stock| / |stock| of the lm loss
    max_grad_norm_rel: float | None  # the same of the grad norm (None: a log printed none)
    first_different: int | None  # the first iteration that differs: a value outside the tolerance, or a `reason`
    stock_loss_sum: float
    balanced_loss_sum: float
    stock_tail_mean: float  # mean lm loss of the last TAIL iterations
    balanced_tail_mean: float
    only_in_one: int  # iterations logged by one run only
    #: why the curves differ when it is not a value outside the tolerance (a missing, NaN, INF or skipped
    #: iteration, another --train-iters, a run that stopped early); None otherwise
    reason: str | None = None

    def verdict(self) -> str:
        """The one-line verdict."""
        sums = (f"loss summed over {self.iterations} iterations: stock {self.stock_loss_sum:.6g}, balanced "
                f"{self.balanced_loss_sum:.6g} ({_percent(self.balanced_loss_sum, self.stock_loss_sum)}); "
                f"last {min(TAIL, self.iterations)} iterations' mean: stock {self.stock_tail_mean:.6g}, balanced "
                f"{self.balanced_tail_mean:.6g} ({_percent(self.balanced_tail_mean, self.stock_tail_mean)})")
        unmatched = f"; {self.only_in_one} iterations logged by one run only" if self.only_in_one else ""
        norm = ("" if self.max_grad_norm_rel is None else
                f", grad norm {self.max_grad_norm_rel:.1e}")
        if self.equal:
            return (f"equal: all {self.iterations} iterations within {self.rtol:g} relative of stock Megatron "
                    f"(largest difference: lm loss {self.max_loss_rel:.1e}{norm})")
        where = f"from iteration {self.first_different}" if self.first_different is not None else "the runs"
        why = f": {self.reason}" if self.reason else ""
        return (f"differ: {where}{why} (largest relative difference: lm loss {self.max_loss_rel:.1e}{norm}); "
                f"{sums}{unmatched}")


def _percent(value: float, reference: float) -> str:
    return f"{(value - reference) / abs(reference) * 100:+.3f}%" if reference else "n/a"


def _close(a: float, b: float, resolution: float, rtol: float) -> bool:
    """``b`` within ``rtol`` of ``a``, or within what the logs' printed digits can tell apart."""
    return abs(b - a) <= max(rtol * abs(a), resolution)


def _missing(side: str, steps: dict[int, Step], iteration: int) -> str:
    """Why ``iteration`` is not in the ``side`` log: the run stopped before it, or its line is missing."""
    last, total = max(steps), max(s.train_iters for s in steps.values())
    if last < iteration <= total:
        return f"the {side} run stopped at iteration {last} of {total}"
    return f"missing from the {side} log"


def _run_difference(stock: dict[int, Step], balanced: dict[int, Step]) -> str | None:
    """Why the two runs are not the same training as a whole: another ``--train-iters``, or a run whose log ends
    before its last iteration (stopped early, crashed); None if neither."""
    totals = {side: {s.train_iters for s in steps.values()} for side, steps in (("stock", stock),
                                                                                ("balanced", balanced))}
    if totals["stock"] != totals["balanced"]:
        return (f"the logs are of another --train-iters (stock {', '.join(map(str, sorted(totals['stock'])))}, "
                f"balanced {', '.join(map(str, sorted(totals['balanced'])))})")
    for side, steps in (("stock", stock), ("balanced", balanced)):
        last, total = max(steps), max(totals[side])
        if last < total:
            return f"the {side} run stopped at iteration {last} of {total}"
    return None


def compare_curves(stock: dict[int, Step], balanced: dict[int, Step], rtol: float = DEFAULT_RTOL) -> LossComparison:
    """Compare two runs (``read_megatron_log``) iteration by iteration over every iteration either logged: equal
    only when each is logged by both, trained (a finite loss, not skipped) and within the tolerance, and neither
    run stopped before its ``--train-iters``."""
    every = sorted(set(stock) | set(balanced))
    loss_rel, norm_rel, first, reason = 0.0, None, None, None
    compared: list[int] = []
    for it in every:
        s, b = stock.get(it), balanced.get(it)
        why = (_missing("stock", stock, it) if s is None else _missing("balanced", balanced, it) if b is None else
               next((f"the {side} run: {t}" for side, t in (("stock", s.trouble()), ("balanced", b.trouble())) if t),
                    None))
        if why is not None or s is None or b is None or s.loss is None or b.loss is None:
            if first is None:
                first, reason = it, why
            continue
        compared.append(it)
        ok = _close(s.loss, b.loss, s.loss_resolution + b.loss_resolution, rtol)
        loss_rel = max(loss_rel, abs(b.loss - s.loss) / abs(s.loss) if s.loss else abs(b.loss))
        if s.grad_norm is not None and b.grad_norm is not None:
            ok &= _close(s.grad_norm, b.grad_norm, s.grad_norm_resolution + b.grad_norm_resolution, rtol)
            rel = abs(b.grad_norm - s.grad_norm) / abs(s.grad_norm) if s.grad_norm else abs(b.grad_norm)
            norm_rel = max(norm_rel or 0.0, rel)
        if not ok and first is None:
            first = it
    run_reason = _run_difference(stock, balanced)
    if run_reason is not None and (reason is None or "--train-iters" in run_reason):
        reason = run_reason  # another --train-iters is the cause of every iteration that differs
    tail = compared[-TAIL:]

    def total(steps: dict[int, Step], its: list[int]) -> float:
        return sum(float(steps[i].loss or 0.0) for i in its)

    return LossComparison(
        iterations=len(compared), equal=first is None and reason is None, rtol=rtol, max_loss_rel=loss_rel,
        max_grad_norm_rel=norm_rel, first_different=first, stock_loss_sum=total(stock, compared),
        balanced_loss_sum=total(balanced, compared),
        stock_tail_mean=total(stock, tail) / len(tail) if tail else math.nan,
        balanced_tail_mean=total(balanced, tail) / len(tail) if tail else math.nan,
        only_in_one=len(set(stock) ^ set(balanced)), reason=reason)


def plot_curves(stock: dict[int, Step], balanced: dict[int, Step], comparison: LossComparison, path: Path,
                balanced_label: str = "balanced (--wlb-pieces concat-and-cut)") -> Path:
    """Both lm-loss curves (top) and the balanced run's relative difference from stock (bottom), one PNG."""
    plt = _plt()
    def trained(steps: dict[int, Step]) -> list[int]:
        return sorted(i for i, s in steps.items() if s.loss is not None and math.isfinite(s.loss))

    common = sorted(set(trained(stock)) & set(trained(balanced)))
    fig, (top, bottom) = plt.subplots(2, 1, figsize=(7, 5), sharex=True, height_ratios=(3, 1.4))
    top.plot(trained(stock), [stock[i].loss for i in trained(stock)], color="#8c8c8c", lw=3.5, alpha=0.7,
             label="stock Megatron")
    top.plot(trained(balanced), [balanced[i].loss for i in trained(balanced)], color="#9b59b6", lw=1.3, marker=".",
             label=balanced_label)
    top.set_ylabel("lm loss")
    top.legend(loc="upper right")
    top.set_title(comparison.verdict().split(" (")[0], fontsize=10)
    loss = {i: (float(stock[i].loss or 0.0), float(balanced[i].loss or 0.0)) for i in common}
    rel = [(b - s) / abs(s) if s else 0.0 for s, b in loss.values()]
    bottom.axhspan(-comparison.rtol, comparison.rtol, color="#6dbf74", alpha=0.3, label=f"±{comparison.rtol:g}")
    bottom.plot(common, rel, color="#9b59b6", marker=".", lw=1)
    bottom.axhline(0, color="black", lw=0.5)
    bottom.set_ylabel("(balanced - stock)\n/ stock", fontsize=8)
    bottom.set_xlabel("iteration")
    bottom.xaxis.get_major_locator().set_params(integer=True)
    bottom.legend(loc="upper right", fontsize=8)
    if max((abs(r) for r in rel), default=0.0) <= comparison.rtol:
        bottom.set_ylim(-3 * comparison.rtol, 3 * comparison.rtol)
    fig.tight_layout()
    fig.savefig(path, dpi=DPI)
    plt.close(fig)
    return path


def add_parser(subparsers: argparse._SubParsersAction) -> None:
    p = subparsers.add_parser("compare-loss", help="compare a balanced run's loss curve with stock Megatron's (logs)",
                              description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--stock", required=True, metavar="LOG", help="stock Megatron's log (no --wlb-* flag)")
    p.add_argument("--balanced", required=True, metavar="LOG", help="the balanced run's log (--wlb-pieces "
                   "concat-and-cut)")
    p.add_argument("--rtol", type=float, default=DEFAULT_RTOL, help=f"relative tolerance (default {DEFAULT_RTOL:g})")
    p.add_argument("--plot", default=None, metavar="PNG", help="write both curves to this PNG")
    p.add_argument("--json", default=None, metavar="OUT", help="write the comparison as JSON")
    p.add_argument("--label", default="balanced (--wlb-pieces concat-and-cut)", help="the balanced curve's legend")
    p.add_argument("--require-equal", action="store_true", help="exit with status 1 when the curves differ")
    p.set_defaults(func=run)


def run(args: argparse.Namespace) -> int:
    if not args.rtol > 0:
        raise ValueError(f"--rtol {args.rtol}: give a positive relative tolerance (e.g. {DEFAULT_RTOL:g})")
    stock = read_megatron_log(input_file(args.stock, "--stock"))
    balanced = read_megatron_log(input_file(args.balanced, "--balanced"))
    comparison = compare_curves(stock, balanced, args.rtol)
    if args.plot:
        plot_curves(stock, balanced, comparison, output_file(args.plot, "--plot"), args.label)
    if args.json:
        output_file(args.json, "--json").write_text(json.dumps(
            {**asdict(comparison), "verdict": comparison.verdict(),
             "stock": {i: [s.loss, s.grad_norm] for i, s in sorted(stock.items())},
             "balanced": {i: [s.loss, s.grad_norm] for i, s in sorted(balanced.items())}}, indent=1) + "\n")
    print(comparison.verdict())
    sys.stdout.flush()
    return 1 if args.require_equal and not comparison.equal else 0
