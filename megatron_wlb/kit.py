"""The GPU kit's time budget (``scripts/gpu_run.sh --budget``): one call runs every part within a budget.

Each part gets a share of the time left (``PART_WEIGHTS`` over the parts not yet run, so what an earlier part
leaves unused passes to the later ones), and each sized step of a part a share of the part's time left
(``STEPS``). A step that honours a deadline (``WLB_KIT_DEADLINE``, read by ``Deadline``) stops at it, writing
what it measured flagged ``"partial"`` and ``"stopped_at_deadline"``; the others run under ``timeout`` and
their logs are summarised. ``OUT/budget.json`` records each part's and step's share, start, time used and
whether it stopped at its deadline. It imports only the standard library (and ``provenance``): the kit runs it
before unpacking its wheels.

    python -m megatron_wlb.kit start OUT BUDGET PARTS      # PARTS: 1,2,3 (the order they run in)
    python -m megatron_wlb.kit part OUT PART               # a part begins
    python -m megatron_wlb.kit step OUT PART NAME          # prints the step's hard limit (s, 0: none), deadline
    python -m megatron_wlb.kit done OUT PART NAME RC       # prints ok | stopped | failed; exit 1 when failed
    python -m megatron_wlb.kit end OUT PART
    python -m megatron_wlb.kit iterations OUT [--dry]      # part 3's training iterations, from its share
    python -m megatron_wlb.kit summarize-calibrate OUT     # OUT/calibrate.log -> OUT/calibrate.json
    python -m megatron_wlb.kit summarize-train OUT [--dry] # OUT/train_{wlb,stock}.log -> OUT/train.json
"""

from __future__ import annotations

import json
import math
import os
import re
import sys
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from megatron_wlb.provenance import replace_text

BUDGET_FORMAT = "megatron-wlb-kit-budget/1"
#: the deadline (Unix seconds) a step's measuring script stops at, set by gpu_run.sh for that step only
DEADLINE_ENV = "WLB_KIT_DEADLINE"
#: each part's weight in the budget: part 1's correctness checks, part 2's sweeps, part 3's training runs
PART_WEIGHTS = {1: 0.20, 2: 0.45, 3: 0.35}
#: the time kept back from the parts for the unsized steps' tail (summaries) and a hard limit's grace
RESERVE_FRACTION, RESERVE_MAX_S = 0.05, 30.0
#: seconds past its deadline a deadline-honouring step may run before ``timeout`` stops it (a point in flight)
GRACE_S = 20


@dataclass(frozen=True)
class Step:
    """A sized step: its weight in its part and, for one that stops at its deadline itself, the result file in
    OUT that says whether it did (``timeout`` stops one without at its share)."""

    weight: float
    result: str | None = None


#: each part's sized steps in the order they run (the others, such as env and the summaries, take no share)
STEPS: dict[int, dict[str, Step]] = {
    1: {"kernel_check": Step(1.0, "kernel_check.json")},
    2: {"calibrate": Step(0.40), "profile_attention": Step(0.20, "efficiency.json"),
        "cp_latency": Step(0.40, "cp_latency.json")},
    3: {"train_wlb": Step(0.5), "train_stock": Step(0.5)},
}


@dataclass(frozen=True)
class IterationCost:
    """How part 3 sizes its training runs: ``startup_s`` before the first iteration, ``per_iteration_s`` each,
    at least ``fewest`` and at most ``most`` iterations."""

    startup_s: float
    per_iteration_s: float
    fewest: int
    most: int


#: a GPU's (the kit's tiny GPT: 4 layers, hidden 256, 8 micro-batches of 2048 tokens) and the CPU dry run's
ITERATION_COST = {False: IterationCost(60.0, 0.4, 10, 400), True: IterationCost(30.0, 5.0, 1, 2)}


def reserve(budget: float) -> float:
    """Seconds of ``budget`` kept back from the parts."""
    return min(RESERVE_MAX_S, RESERVE_FRACTION * budget)


def share(seconds_left: float, weights: Sequence[float]) -> float:
    """The first of ``weights``' share of ``seconds_left`` (the rest are those still to run; none below 0)."""
    return max(0.0, seconds_left) * weights[0] / sum(weights)


def iterations(seconds: float, dry: bool = False) -> int:
    """Part 3's training iterations for a run of ``seconds`` (startup included)."""
    cost = ITERATION_COST[dry]
    fit = math.floor((seconds - cost.startup_s) / cost.per_iteration_s)
    return min(cost.most, max(cost.fewest, fit))


class Deadline:
    """When a measuring script stops: ``max_seconds`` from now or the kit's deadline (``WLB_KIT_DEADLINE``),
    whichever comes first; never, without either. It stops between points, after at least one."""

    def __init__(self, max_seconds: float | None = None, clock: Callable[[], float] = time.time) -> None:
        self.clock = clock
        ends = []
        if os.environ.get(DEADLINE_ENV):
            try:
                ends.append(float(os.environ[DEADLINE_ENV]))
            except ValueError:
                raise ValueError(f"{DEADLINE_ENV}={os.environ[DEADLINE_ENV]!r}: give Unix seconds") from None
        if max_seconds is not None:
            ends.append(clock() + max_seconds)
        self.at = min(ends) if ends else None
        self.stopped = False

    def reached(self, measured: int) -> bool:
        """Whether to stop now, with ``measured`` points done (never before the first); remembered."""
        self.stopped = self.stopped or (measured > 0 and self.at is not None and self.clock() >= self.at)
        return self.stopped


def write_json(path: str | Path, data: dict[str, Any]) -> None:
    """Write ``data`` as JSON, replacing the file whole (``provenance.replace_text``), its folder created."""
    Path(path).parent.mkdir(parents=True, exist_ok=True)
    replace_text(path, json.dumps(data, indent=1) + "\n")


def flagged(result: dict[str, Any], *, done: bool, deadline: Deadline | None = None) -> dict[str, Any]:
    """``result`` with ``"partial"`` (true until complete) and ``"stopped_at_deadline"``."""
    return {**result, "partial": not done, "stopped_at_deadline": bool(deadline and deadline.stopped)}


class Budget:
    """``OUT/budget.json``: the run's budget, each part's and step's share, start, time used and stop."""

    def __init__(self, out: str | Path, clock: Callable[[], float] = time.time) -> None:
        self.path = Path(out) / "budget.json"
        self.clock = clock
        self.data: dict[str, Any] = json.loads(self.path.read_text()) if self.path.exists() else {}

    @classmethod
    def start(cls, out: str | Path, budget: float, parts: Sequence[int],
              clock: Callable[[], float] = time.time) -> Budget:
        """A new run of ``parts`` (in that order) within ``budget`` seconds from now."""
        if not budget > 0:
            raise ValueError(f"--budget {budget}: give a positive number of seconds")
        bad = [p for p in parts if p not in PART_WEIGHTS]
        if bad or not parts or len(set(parts)) != len(parts):
            raise ValueError(f"parts {list(parts)}: give distinct parts among {sorted(PART_WEIGHTS)}")
        self = cls(out, clock)
        self.data = {"format": BUDGET_FORMAT, "budget_s": budget, "reserve_s": reserve(budget),
                     "weights": {str(p): PART_WEIGHTS[p] for p in parts}, "order": list(parts),
                     "started": clock(), "partial": True, "parts": {}}
        self.save()
        return self

    def save(self) -> None:
        write_json(self.path, self.data)

    def elapsed(self) -> float:
        return self.clock() - float(self.data["started"])

    def part(self, part: int) -> dict[str, Any]:
        """Part ``part`` begins: its share of the time left, over the parts still to run."""
        order = self.data["order"]
        if part not in order:
            raise ValueError(f"part {part} is not in this run's parts {order}")
        left = self.data["budget_s"] - self.data["reserve_s"] - self.elapsed()
        weights = [PART_WEIGHTS[p] for p in order[order.index(part):]]
        record: dict[str, Any] = {"share_s": round(share(left, weights), 3), "start_s": round(self.elapsed(), 3),
                                  "used_s": None, "stopped_at_deadline": False, "failed": None, "steps": {}}
        self.data["parts"][str(part)] = record
        self.save()
        return record

    def record(self, part: int) -> dict[str, Any]:
        """Part ``part``'s record (it must have begun)."""
        if str(part) not in self.data.get("parts", {}):
            raise ValueError(f"part {part} has not begun in {self.path} (`part OUT {part}` first)")
        return self.data["parts"][str(part)]

    def step_share(self, part: int, name: str) -> float:
        """Seconds sized step ``name`` of ``part`` gets if it begins now: its weight's share of the part's time
        left over the part's sized steps from it on."""
        record, sized = self.record(part), list(STEPS[part])
        if name not in sized:
            raise ValueError(f"{name} is not a sized step of part {part} (those are {', '.join(sized)})")
        left = record["start_s"] + record["share_s"] - self.elapsed()
        return share(left, [STEPS[part][s].weight for s in sized[sized.index(name):]])

    def step(self, part: int, name: str) -> tuple[int, float]:
        """Step ``name`` of ``part`` begins: its hard limit in whole seconds (0: none, an unsized step) and its
        deadline (Unix seconds; 0: none). A step that stops at its deadline itself gets ``GRACE_S`` more."""
        record = self.record(part)
        entry: dict[str, Any] = {"share_s": None, "start_s": round(self.elapsed(), 3), "used_s": None, "rc": None,
                                 "stopped_at_deadline": False}
        limit, deadline = 0, 0.0
        if name in STEPS[part]:
            seconds = self.step_share(part, name)
            entry["share_s"] = round(seconds, 3)
            deadline = self.clock() + seconds
            limit = max(1, math.ceil(seconds)) + (GRACE_S if STEPS[part][name].result else 0)
        record["steps"][name] = entry
        self.save()
        return limit, deadline

    def done(self, part: int, name: str, rc: int) -> str:
        """Step ``name`` ended with exit status ``rc``: ok, stopped (at its deadline: ``timeout``'s 124 or 137 on
        a sized step, or its result says so) or failed."""
        record = self.record(part)
        if name not in record["steps"]:
            raise ValueError(f"step {name} of part {part} has not begun (`step OUT {part} {name}` first)")
        entry = record["steps"][name]
        entry["used_s"], entry["rc"] = round(self.elapsed() - entry["start_s"], 3), rc
        step = STEPS[part].get(name)
        stopped = step is not None and rc in (124, 137)
        if step is not None and rc == 0 and step.result:
            result = self.path.parent / step.result
            stopped = result.exists() and bool(json.loads(result.read_text()).get("stopped_at_deadline"))
        entry["stopped_at_deadline"] = stopped
        record["stopped_at_deadline"] = record["stopped_at_deadline"] or stopped
        status = "stopped" if stopped else "ok" if rc == 0 else "failed"
        if status == "failed":
            record["failed"] = name
        self.save()
        return status

    def end(self, part: int) -> None:
        """Part ``part`` ended (the run, after its last part)."""
        record = self.record(part)
        record["used_s"] = round(self.elapsed() - record["start_s"], 3)
        self.data["partial"] = part != self.data["order"][-1]
        self.data["used_s"] = round(self.elapsed(), 3)
        self.save()

    def stopped(self, part: int, name: str) -> bool:
        """Whether step ``name`` of ``part`` stopped at its deadline."""
        steps = self.data.get("parts", {}).get(str(part), {}).get("steps", {})
        return bool(steps.get(name, {}).get("stopped_at_deadline"))


_CALIBRATE_LINES = {
    "attention": re.compile(r"attention d=\s*(?P<d>\d+)(?: as (?P<docs>\d+) documents)?: fwd\s+(?P<fwd>\S+) ms\s+"
                            r"bwd\s+(?P<bwd>\S+) ms"),
    "linear": re.compile(r"linear\s+t=\s*(?P<t>\d+): fwd\s+(?P<fwd>\S+) ms\s+bwd\s+(?P<bwd>\S+) ms"),
    "held_out": re.compile(r"held out t=\s*(?P<t>\d+) \(\s*(?P<docs>\d+) documents\): fwd\s+(?P<fwd>\S+) ms\s+"
                           r"bwd\s+(?P<bwd>\S+) ms"),
    "table": re.compile(r"table q=\s*(?P<q>\d+) kv=\s*(?P<kv>\d+):\s+(?P<tflops>\S+) TFLOP/s"),
}


def summarize_calibrate(out: str | Path) -> dict[str, Any]:
    """``OUT/calibrate.json``: what ``wlb calibrate`` logged (``OUT/calibrate.log``), point by point; partial
    unless it wrote ``OUT/profile.json`` (a run stopped at its share by ``timeout`` writes none)."""
    out = Path(out)
    text = (out / "calibrate.log").read_text(errors="replace") if (out / "calibrate.log").exists() else ""
    points: dict[str, list[dict[str, float]]] = {key: [] for key in _CALIBRATE_LINES}
    for line in text.splitlines():
        for key, pattern in _CALIBRATE_LINES.items():
            match = pattern.search(line)
            if match:
                points[key].append({k: float(v) for k, v in match.groupdict().items() if v is not None})
    done = (out / "profile.json").exists()
    result = {"profile": "profile.json" if done else None, "log": "calibrate.log", **points, "partial": not done,
              "stopped_at_deadline": Budget(out).stopped(2, "calibrate")}
    write_json(out / "calibrate.json", result)
    return result


def summarize_train(out: str | Path, dry: bool) -> dict[str, Any]:
    """``OUT/train.json``: each training run's losses and iteration times from its log; a run stopped at its
    share keeps what it logged (flagged), one that ended by itself must have logged a loss."""
    out = Path(out)
    if dry:
        device = "CPU (dry run)"
    else:
        import torch

        device = torch.cuda.get_device_name()
    runs = {}
    for name in ("train_wlb", "train_stock"):
        text = (out / f"{name}.log").read_text(errors="replace")
        losses = [float(x) for x in re.findall(r"lm loss: ([0-9.eE+-]+)", text)]
        times = [float(x) for x in re.findall(r"elapsed time per iteration \(ms\): ([0-9.]+)", text)]
        stopped = Budget(out).stopped(3, name)
        if not losses and not stopped:
            raise ValueError(f"{name}: no 'lm loss' in {out / (name + '.log')}")
        runs[name] = {"losses": losses, "ms_per_iteration": times, "wlb_lines": text.count("megatron_wlb"),
                      "stopped_at_deadline": stopped}
    result = {"device": device, "runs": runs, "partial": any(r["stopped_at_deadline"] for r in runs.values()),
              "stopped_at_deadline": any(r["stopped_at_deadline"] for r in runs.values())}
    write_json(out / "train.json", result)
    return result


def main(argv: list[str] | None = None) -> int:
    """The commands gpu_run.sh calls (see the module's docstring); a bad argument is a one-line error."""
    args = list(sys.argv[1:] if argv is None else argv)
    usage = ("usage: python -m megatron_wlb.kit start OUT BUDGET PARTS | part OUT PART | step OUT PART NAME | "
             "done OUT PART NAME RC | end OUT PART | iterations OUT [--dry] | summarize-calibrate OUT | "
             "summarize-train OUT [--dry]")
    try:
        command, rest = args[0], args[1:]
        if command == "start" and len(rest) == 3:
            Budget.start(rest[0], float(rest[1]), [int(p) for p in rest[2].split(",")])
        elif command == "part" and len(rest) == 2:
            record = Budget(rest[0]).part(int(rest[1]))
            print(f"{record['share_s']:.0f}")
        elif command == "step" and len(rest) == 3:
            limit, deadline = Budget(rest[0]).step(int(rest[1]), rest[2])
            print(limit, f"{deadline:.3f}")
        elif command == "done" and len(rest) == 4:
            status = Budget(rest[0]).done(int(rest[1]), rest[2], int(rest[3]))
            print(status)
            return 1 if status == "failed" else 0
        elif command == "end" and len(rest) == 2:
            Budget(rest[0]).end(int(rest[1]))
        elif command == "iterations" and rest and set(rest[1:]) <= {"--dry"}:
            print(iterations(Budget(rest[0]).step_share(3, "train_wlb"), dry="--dry" in rest))
        elif command == "summarize-calibrate" and len(rest) == 1:
            summarize_calibrate(rest[0])
        elif command == "summarize-train" and rest and set(rest[1:]) <= {"--dry"}:
            runs = summarize_train(rest[0], dry="--dry" in rest)["runs"]
            print(json.dumps({k: {"iterations": len(v["losses"]), "last_loss": (v["losses"] or [None])[-1],
                                  "stopped_at_deadline": v["stopped_at_deadline"]} for k, v in runs.items()}))
        else:
            raise ValueError(usage)
    except IndexError:
        print(f"megatron_wlb.kit: error: {usage}", file=sys.stderr)
        return 2
    except (ValueError, KeyError, OSError) as exc:
        print(f"megatron_wlb.kit: error: {exc}", file=sys.stderr)
        return 2
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
