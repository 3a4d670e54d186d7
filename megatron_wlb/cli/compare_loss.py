"""``wlb compare-loss``: is the balanced run's loss curve stock Megatron's? Two Megatron logs in, a verdict out.

    wlb compare-loss --stock STOCK.log --balanced BALANCED.log [--plot curves.png] [--json out.json]
                     [--rtol 1e-5] [--require-equal]

Each log is what Megatron printed (``--log-interval 1``: one ``iteration N/M | ... lm loss: ... | grad norm: ...``
line per step; ``scripts/compare_loss.sh`` trains both runs and calls this). The verdict is one line:
``equal`` when every iteration both logs share has its ``lm loss`` and grad norm within ``--rtol`` relative of
stock's (or within the log's own print precision: Megatron prints the grad norm to three decimals), else
``differ``, naming the first iteration that differs, the sum of the losses over the run and the mean of the
last five iterations of each. With ``--wlb-max-delay 0`` the balanced mode trains each iteration exactly the
tokens of its own global batch, so its curve is stock's to float tolerance; with a delay > 0 a piece may wait
for a later iteration and the curves differ step by step (docs/megatron.md, "The same loss curve").
"""

from __future__ import annotations

import argparse
import json
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

_ITERATION = re.compile(r"\biteration\s+(\d+)/\s*\d+\s*\|")
_LOSS = re.compile(r"\blm loss: ([-+0-9.eE]+|nan|inf)")
_GRAD_NORM = re.compile(r"\bgrad norm: ([-+0-9.eE]+|nan|inf)")


def _resolution(text: str) -> float:
    """Half a unit in the last printed place of ``text`` (``1.753`` -> 5e-4, ``5.767912E+00`` -> 5e-7)."""
    mantissa, _, exponent = text.lower().partition("e")
    decimals = len(mantissa.partition(".")[2])
    return 0.5 * 10.0 ** (int(exponent or 0) - decimals)


@dataclass(frozen=True)
class Step:
    """One logged iteration: its lm loss and grad norm, and how precisely the log printed each."""

    loss: float
    loss_resolution: float
    grad_norm: float | None
    grad_norm_resolution: float


def read_megatron_log(path: str | Path) -> dict[int, Step]:
    """Every iteration line with an ``lm loss`` in Megatron's log ``path``: iteration -> ``Step``. A line printed
    twice (several ranks, ``--tee``) counts once; the same iteration with other values is refused."""
    steps: dict[int, Step] = {}
    for line in Path(path).read_text(errors="replace").splitlines():
        at, loss = _ITERATION.search(line), _LOSS.search(line)
        if not at or not loss:
            continue
        norm = _GRAD_NORM.search(line)
        step = Step(float(loss.group(1)), _resolution(loss.group(1)),
                    float(norm.group(1)) if norm else None, _resolution(norm.group(1)) if norm else 0.0)
        seen = steps.setdefault(int(at.group(1)), step)
        if seen != step:
            raise ValueError(f"{path}: iteration {at.group(1)} is logged twice with different values "
                             f"(lm loss {seen.loss} and {step.loss}): give the log of one run")
    if not steps:
        raise ValueError(f"{path}: no Megatron iteration line with an 'lm loss' (train with --log-interval 1 and "
                         "give the log of the last pipeline stage's rank, or all ranks' output)")
    return steps


@dataclass(frozen=True)
class LossComparison:
    """How far a balanced run's curve is from stock's over the iterations both logged."""

    iterations: int
    equal: bool
    rtol: float
    max_loss_rel: float  # largest |balanced - stock| / |stock| of the lm loss
    max_grad_norm_rel: float | None  # the same of the grad norm (None: a log printed none)
    first_different: int | None  # the first iteration whose loss or grad norm is outside the tolerance
    stock_loss_sum: float
    balanced_loss_sum: float
    stock_tail_mean: float  # mean lm loss of the last TAIL iterations
    balanced_tail_mean: float
    only_in_one: int  # iterations logged by one run only (not compared)

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
                    f"(largest difference: lm loss {self.max_loss_rel:.1e}{norm}){unmatched}")
        return (f"differ: from iteration {self.first_different} (largest relative difference: lm loss "
                f"{self.max_loss_rel:.1e}{norm}); {sums}{unmatched}")


def _percent(value: float, reference: float) -> str:
    return f"{(value - reference) / abs(reference) * 100:+.3f}%" if reference else "n/a"


def _close(a: float, b: float, resolution: float, rtol: float) -> bool:
    """``b`` within ``rtol`` of ``a``, or within what the logs' printed digits can tell apart."""
    return abs(b - a) <= max(rtol * abs(a), resolution)


def compare_curves(stock: dict[int, Step], balanced: dict[int, Step], rtol: float = DEFAULT_RTOL) -> LossComparison:
    """Compare the iterations both runs logged (``read_megatron_log``)."""
    common = sorted(set(stock) & set(balanced))
    if not common:
        raise ValueError(f"the two logs share no iteration (stock logged {min(stock)}-{max(stock)}, balanced "
                         f"{min(balanced)}-{max(balanced)})")
    loss_rel, norm_rel, first = 0.0, None, None
    for it in common:
        s, b = stock[it], balanced[it]
        ok = _close(s.loss, b.loss, s.loss_resolution + b.loss_resolution, rtol)
        loss_rel = max(loss_rel, abs(b.loss - s.loss) / abs(s.loss) if s.loss else abs(b.loss))
        if s.grad_norm is not None and b.grad_norm is not None:
            ok &= _close(s.grad_norm, b.grad_norm, s.grad_norm_resolution + b.grad_norm_resolution, rtol)
            rel = abs(b.grad_norm - s.grad_norm) / abs(s.grad_norm) if s.grad_norm else abs(b.grad_norm)
            norm_rel = max(norm_rel or 0.0, rel)
        if not ok and first is None:
            first = it
    tail = common[-TAIL:]
    return LossComparison(
        iterations=len(common), equal=first is None, rtol=rtol, max_loss_rel=loss_rel, max_grad_norm_rel=norm_rel,
        first_different=first, stock_loss_sum=sum(stock[i].loss for i in common),
        balanced_loss_sum=sum(balanced[i].loss for i in common),
        stock_tail_mean=sum(stock[i].loss for i in tail) / len(tail),
        balanced_tail_mean=sum(balanced[i].loss for i in tail) / len(tail),
        only_in_one=len(set(stock) ^ set(balanced)))


def plot_curves(stock: dict[int, Step], balanced: dict[int, Step], comparison: LossComparison, path: Path,
                balanced_label: str = "balanced (--wlb-pieces concat-and-cut)") -> Path:
    """Both lm-loss curves (top) and the balanced run's relative difference from stock (bottom), one PNG."""
    plt = _plt()
    common = sorted(set(stock) & set(balanced))
    fig, (top, bottom) = plt.subplots(2, 1, figsize=(7, 5), sharex=True, height_ratios=(3, 1.4))
    top.plot(sorted(stock), [stock[i].loss for i in sorted(stock)], color="#8c8c8c", lw=3.5, alpha=0.7,
             label="stock Megatron")
    top.plot(sorted(balanced), [balanced[i].loss for i in sorted(balanced)], color="#9b59b6", lw=1.3, marker=".",
             label=balanced_label)
    top.set_ylabel("lm loss")
    top.legend(loc="upper right")
    top.set_title(comparison.verdict().split(" (")[0], fontsize=10)
    rel = [(balanced[i].loss - stock[i].loss) / abs(stock[i].loss) if stock[i].loss else 0.0 for i in common]
    bottom.axhspan(-comparison.rtol, comparison.rtol, color="#6dbf74", alpha=0.3, label=f"±{comparison.rtol:g}")
    bottom.plot(common, rel, color="#9b59b6", marker=".", lw=1)
    bottom.axhline(0, color="black", lw=0.5)
    bottom.set_ylabel("(balanced - stock)\n/ stock", fontsize=8)
    bottom.set_xlabel("iteration")
    bottom.xaxis.get_major_locator().set_params(integer=True)
    bottom.legend(loc="upper right", fontsize=8)
    if max(abs(r) for r in rel) <= comparison.rtol:
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
