#!/usr/bin/env python
"""Paired measurement: one Megatron training process trains two data plans alternately, ABBA.

Run by ``benchmarks/bench_paired.py`` under torchrun, exactly as ``megatron_wlb.megatron.entry.cpu`` runs (our
launcher, Megatron's own loop), with one change: the training iterator is a ``PairedDataIterator``.
Method A is the run's ``--wlb-*`` flags; method B the same with ``WLB_PAIRED_B`` (a JSON object of
``WlbSettings`` fields, e.g. ``{"packer": "original"}``) and, with ``WLB_PAIRED_B_DEAL=megatron``, B's
micro-batches dealt as Megatron's sampler deals samples (DP rank r takes r, r + DP, ...). Both read
the same stream, each through its own cursor, so global batch k of A and of B come from the same
samples (``--wlb-pieces concat-and-cut``) or the same documents. Training steps 2k and 2k + 1 are
pair k: A then B for even k, B then A for odd k (ABBA), so the machine's drift cancels in each pair.
The optimizer steps after both (it is a timing run: the model sees every global batch twice).

Dynamic CP on one side (``--wlb-cp-sharding dynamic`` as A, a fixed-group layout as B): the run starts as a dynamic
run (every block's process group made at start-up); a step of A plans its global batch over the DP x CP pool and
runs each micro-batch on its block's group, a step of B lays its micro-batches out over Megatron's fixed CP group
(a micro-batch without a block runs there). The planner keeps Megatron's micro-batch count per slot, so both methods
train every global batch.

Per rank it writes ``WLB_PAIRED_OUT/rank{R}.json``: every training step's wall seconds (perf_counter
around Megatron's ``train_step``), its method, its tokens and its global batch's piece lengths (``step_record``;
under dynamic CP also the planner's prediction and this slot's groups). The micro-batches' forward and backward
times are in the ``--wlb-trace`` files (trace iteration = training step).
"""

from __future__ import annotations

import dataclasses
import json
import os
import sys
import time
from typing import Any

from megatron_wlb.cp.dynamic import DynamicCPPlan
from megatron_wlb.cp.dynamic_steps import DynamicPool
from megatron_wlb.megatron.data.packed import WlbDataIterator
from megatron_wlb.packing.types import GlobalBatch

METHODS = ("A", "B")


def method_of(step: int) -> str:
    """Which method trains training step ``step`` (0-based): ABBA over pairs."""
    pair, second = divmod(int(step), 2)
    first = 0 if pair % 2 == 0 else 1
    return METHODS[first if second == 0 else 1 - first]


def megatron_deal(batch: GlobalBatch) -> GlobalBatch:
    """The plan's micro-batches in the order that gives DP rank r micro-batches r, r + DP, ... (as
    ``MegatronPretrainingSampler`` gives samples) under ``WlbDataIterator``'s contiguous shares."""
    dp, n = batch.dp, batch.n
    order = [j for r in range(dp) for j in range(r, dp * n, dp)]
    return dataclasses.replace(batch, micro_batches=tuple(batch.micro_batches[j] for j in order))


class PairedDataIterator(WlbDataIterator):
    """A's iterator, whose plans alternate with B's (``method_of``): both plan global batch k from their
    own cursor over the same stream; step 2k and 2k + 1 train them. Everything else (CP planning,
    prefetch, timing, plan agreement) sees an ordinary ``WlbDataIterator`` whose plan iteration is
    the training step."""

    def __init__(self, a: WlbDataIterator, b: WlbDataIterator, deal_b: bool = False):
        super().__init__(a.reader, a.stream, a.packer, a.dp_rank, a.sharding, a.on_batch, read=a.read,
                         read_piece=a.read_piece, dynamic=a.dynamic)
        if b.n != a.n or b.dp_size != a.dp_size:
            raise ValueError(f"paired methods plan different layouts: A {a.dp_size} x {a.n}, B {b.dp_size} x {b.n}")
        self.other = b
        #: each method's CP sharding, dynamic-CP pool and token readers (kept here: ``self.sharding`` is the current
        #: method's): B may read other pieces than A (stock Megatron's GPTDataset samples against whole documents)
        self.shardings = {"A": a.sharding, "B": b.sharding}
        self.pools = {"A": _recording(a.dynamic), "B": _recording(b.dynamic)}
        self.readers = {"A": (a.read, a.read_piece), "B": (b.read, b.read_piece)}
        self.deal_b = deal_b
        self.step = 0
        self.method = ""
        self._plans: dict[str, Any] = {}
        self._pair: dict[str, GlobalBatch] = {}

    def _next_batch(self) -> GlobalBatch:
        if not self._plans:
            self._plans = {m: it.packer.pack_source(it.stream.cursor()) for m, it in zip(METHODS, (self, self.other))}
        if self.step % 2 == 0:
            self._pair = {m: next(plans) for m, plans in self._plans.items()}  # StopIteration ends training
        self.method = method_of(self.step)
        batch = self._pair[self.method]
        if self.method == "B" and self.deal_b:
            batch = megatron_deal(batch)
        batch = dataclasses.replace(batch, iteration=self.step)
        self.sharding = self.shardings[self.method]
        self.dynamic = self.pools[self.method]
        self.read, self.read_piece = self.readers[self.method]
        self.layouts, self._cp_layouts = (), ()  # a dynamic-CP step lays out none: no stale layouts agreed
        self.step += 1
        return self._take(batch)


class PlanRecordingPool:
    """A ``DynamicPool`` that keeps the plan it made last: the planner's own prediction of the step (its slowest
    slot) and the group each of this slot's micro-batches ran on, recorded with the step's wall."""

    def __init__(self, pool: DynamicPool):
        self.pool = pool
        self.last: DynamicCPPlan | None = None

    def __getattr__(self, name: str) -> Any:
        return getattr(self.pool, name)

    def plan(self, lengths: Any, *args: Any, **kwargs: Any) -> DynamicCPPlan:
        self.last = self.pool.plan(lengths, *args, **kwargs)
        return self.last


def _recording(pool: DynamicPool | None) -> Any:
    return None if pool is None else PlanRecordingPool(pool)


def step_record(it: PairedDataIterator) -> dict[str, Any]:
    """What ``timed_step`` records of the step ``it`` just gave besides its wall: the global batch's piece lengths
    per micro-batch (both methods of a pair train the same ones), and under dynamic CP the planner's predicted
    slowest slot (seconds per layer, ``DynamicCPPlan.slowest_seconds``) and each of this slot's micro-batches'
    group, ``[first slot, size]`` (None: an empty one, alone)."""
    batch = it.current
    out: dict[str, Any] = {"method": it.method, "tokens": batch.tokens if batch is not None else 0}
    if batch is not None:
        out["lengths"] = [[int(x) for x in mb.lengths] for mb in batch.micro_batches]
    pool = it.dynamic
    if isinstance(pool, PlanRecordingPool) and pool.last is not None:
        out["plan_slowest_s"] = pool.last.slowest_seconds
        out["slot"] = pool.slot
        out["max_tokens_per_rank"] = pool.max_tokens_per_rank
        out["blocks"] = [None if s is None else [s.first_rank, s.size] for s in it._steps]
    return out


#: MiB of heap every rank touches before training (``WLB_PREFAULT_MB``): with glibc's heap kept
#: (``measurement_env``), the pages a micro-batch needs are then already mapped, so the first micro-batch of a new,
#: larger shape does not pay page faults that a repeat of it (or any later one) does not: without it, the A/A
#: comparison measured the first of each pair's largest micro-batches 20% slower than the same micro-batch second
PREFAULT_BLOCK_MB = 64


def prefault(megabytes: int) -> None:
    """Touch ``megabytes`` of heap in blocks below glibc's mmap threshold and free them: the heap keeps the pages."""
    import torch

    blocks = [torch.zeros(PREFAULT_BLOCK_MB << 20, dtype=torch.uint8) for _ in range(megabytes // PREFAULT_BLOCK_MB)]
    del blocks


def main() -> None:
    argv = sys.argv[1:]
    prefault(int(os.environ.get("WLB_PREFAULT_MB", "0")))
    from megatron_wlb.megatron.entry import cpu

    cpu.install_cpu_redirects()
    from megatron.training import training

    import megatron_wlb.megatron as wlb
    from megatron_wlb.megatron.args.settings import WlbSettings

    out = os.environ["WLB_PAIRED_OUT"]
    rank = int(os.environ.get("RANK", "0"))
    b_fields = json.loads(os.environ.get("WLB_PAIRED_B", "{}"))
    deal_b = os.environ.get("WLB_PAIRED_B_DEAL", "") == "megatron"
    build = wlb.build_train_iterator
    built: list[PairedDataIterator] = []

    def paired(args: Any, settings: WlbSettings, dp_rank: int, cp_rank: int = 0, **kwargs: Any) -> Any:
        if kwargs.get("split_name", "train") != "train":
            return build(args, settings, dp_rank, cp_rank, **kwargs)
        a = build(args, settings, dp_rank, cp_rank, **kwargs)
        b = build(args, dataclasses.replace(settings, **b_fields), dp_rank, cp_rank,
                  **{**kwargs, "on_batch": None})
        built.append(PairedDataIterator(a, b, deal_b))
        return built[-1]

    wlb.build_train_iterator = paired  # the iterator hook looks it up at call time
    record: dict[str, Any] = {"steps": []}
    train_step = training.train_step

    def timed_step(*args: Any, **kwargs: Any) -> Any:
        start = time.perf_counter()
        result = train_step(*args, **kwargs)
        wall = time.perf_counter() - start
        it = built[0] if built else None
        record["steps"].append({"step": len(record["steps"]), "wall_s": wall,
                                **(step_record(it) if it is not None else {"method": "", "tokens": 0})})
        with open(os.path.join(out, f"rank{rank}.json"), "w") as f:
            json.dump(record, f)
        return result

    training.train_step = timed_step
    cpu.main(argv)


if __name__ == "__main__":
    main()
