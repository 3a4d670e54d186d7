"""Issue 48: the dynamic-CP planner within Megatron's micro-batch count (``plan_dynamic_cp(max_micro_batches=)``)."""

from __future__ import annotations

import numpy as np
import pytest

from megatron_wlb.costmodel import ParallelLayout, build_cost_model
from megatron_wlb.cp.dynamic import group_cost_models, lower_bound, memory_bound, plan_dynamic_cp
from megatron_wlb.cp.layouts import build_layout

WINDOW = 131072
CAP = WINDOW // 2


def _costs(ranks: int) -> dict:
    return group_cost_models(build_cost_model("7b", ParallelLayout(tp=8, cp=2, dp=max(1, ranks // 2))), ranks)


def _packed(seed: int, dp: int, n: int, fill: float) -> np.ndarray:
    """What a packer hands the pool: dp x n micro-batches of at most a window each, filled to about ``fill``
    with heavy-tailed documents (so a fixed CP 2 group per DP rank runs it in ``n`` micro-batches)."""
    rng = np.random.default_rng(seed)
    out: list[int] = []
    for _ in range(dp * n):
        room = int(WINDOW * fill)
        while room > 16:
            d = int(min(room, max(16, rng.pareto(0.8) * 3000)))
            out.append(d)
            room -= d
    return np.array(rng.permutation(out), dtype=np.int64)


def _check(plan, lengths: np.ndarray, ranks: int, limit: int) -> None:
    assert plan.steps <= limit and all(len(m) <= limit for m in plan.rank_micro_batches)
    assert sorted(i for mb in plan.micro_batches for i in mb.docs) == list(range(lengths.size))  # each once
    for mb in plan.micro_batches:
        assert mb.size & (mb.size - 1) == 0 and mb.first_rank % mb.size == 0 and mb.first_rank + mb.size <= ranks
        assert mb.tokens == int(lengths[list(mb.docs)].sum()) <= mb.size * CAP
    for k, step in enumerate(plan.rank_groups()):  # a group's micro-batch at the same step on every member
        for mb in plan.micro_batches:
            held = [j for j in mb.ranks if k < len(plan.rank_micro_batches[j]) and plan.rank_micro_batches[j][k] is mb]
            assert held in ([], list(mb.ranks))
        assert len(step) == ranks


@pytest.mark.parametrize(("dp", "seed"), [(2, 0), (2, 1), (3, 2), (4, 3), (8, 4)])
def test_a_packer_full_batch_fits_megatrons_count(dp: int, seed: int) -> None:
    """Micro-batches filled to 97% of the window: the fixed groups run them in n steps, so the planner must too,
    and it stays above the lower bound and near the plan without a limit."""
    n, ranks = 4, 2 * dp
    lengths = _packed(seed, dp, n, 0.97)
    costs = _costs(ranks)
    free = plan_dynamic_cp(lengths, ranks, CAP, costs)
    plan = plan_dynamic_cp(lengths, ranks, CAP, costs, max_micro_batches=n)
    _check(plan, lengths, ranks, n)
    assert plan.slowest_seconds >= lower_bound(lengths, ranks, CAP, costs) * (1 - 1e-9)
    assert plan.slowest_seconds <= 1.25 * free.slowest_seconds


@pytest.mark.parametrize("ranks", [4, 6, 16])
def test_a_limit_the_free_plan_meets_loses_nothing_and_a_tighter_one_is_kept(ranks: int) -> None:
    lengths = _packed(ranks, ranks // 2, 3, 0.8)
    costs = _costs(ranks)
    free = plan_dynamic_cp(lengths, ranks, CAP, costs)
    same = plan_dynamic_cp(lengths, ranks, CAP, costs, max_micro_batches=free.steps)
    # within the count the free plan meets, no worse (the count's repair of a longer candidate may even find better)
    assert same.slowest_seconds <= free.slowest_seconds * (1 + 1e-12) and same.steps <= free.steps
    need = -(-int(lengths.sum()) // (ranks * CAP))
    for limit in range(need, free.steps):
        _check(plan_dynamic_cp(lengths, ranks, CAP, costs, max_micro_batches=limit), lengths, ranks, limit)


def test_too_few_micro_batches_is_one_line_naming_both_counts() -> None:
    lengths = _packed(5, 2, 4, 0.99)
    extra = np.concatenate([lengths, [CAP]])  # more tokens than 4 steps of 4 ranks x 64K hold
    with pytest.raises(ValueError, match=r"^the dynamic-CP plan of this global batch needs 5 micro-batches on its "
                                         r"busiest rank, but Megatron runs 4 per iteration \(max_micro_batches=4; "
                                         r".*give at least 5") as err:
        plan_dynamic_cp(extra, 4, CAP, _costs(4), max_micro_batches=4)
    assert "\n" not in str(err.value)
    # three documents over half the pool's capacity cannot share a micro-batch: three steps at least
    with pytest.raises(ValueError, match=r"needs 3 micro-batches on its busiest rank, but Megatron runs 2 .*"
                                         r"3 documents over 65536 tokens each need the 2-rank group alone"):
        plan_dynamic_cp(np.array([70000, 70000, 70000]), 2, CAP, _costs(2), max_micro_batches=2)
    _check(plan_dynamic_cp(np.array([70000, 70000, 70000]), 2, CAP, _costs(2), max_micro_batches=3),
           np.array([70000, 70000, 70000]), 2, 3)
    for bad in (0, -1, 2.5, True):
        with pytest.raises(ValueError, match="max_micro_batches=.*positive whole number"):
            plan_dynamic_cp(np.array([5]), 2, CAP, _costs(2), max_micro_batches=bad)


def test_lower_bound_is_below_every_plan_and_above_the_memory_bound() -> None:
    for seed in range(4):
        lengths = _packed(seed, 4, 4, 0.9)
        costs = _costs(8)
        plan = plan_dynamic_cp(lengths, 8, CAP, costs)
        bound = lower_bound(lengths, 8, CAP, costs)
        assert memory_bound(lengths, 8, CAP, costs) <= bound <= plan.slowest_seconds * (1 + 1e-9)
    # one window-long document on 8 ranks: the bound is its price on all 8 (it cannot be shared finer)
    one = np.array([WINDOW])
    costs = _costs(8)
    assert lower_bound(one, 8, CAP, costs) == pytest.approx(plan_dynamic_cp(one, 8, CAP, costs).slowest_seconds,
                                                            rel=0.01)


def _exact(seed: int, dp: int, n: int) -> tuple[np.ndarray, list[list[list[int]]]]:
    """dp x n micro-batches filled to exactly a window (concat-and-cut pieces), with the packer's placement."""
    rng = np.random.default_rng(seed)
    lengths: list[int] = []
    fixed: list[list[list[int]]] = [[[] for _ in range(n)] for _ in range(dp)]
    for r in range(dp):
        for k in range(n):
            room = WINDOW
            while room:
                d = int(min(room, max(16, rng.pareto(0.8) * 3000)))
                fixed[r][k].append(len(lengths))
                lengths.append(d)
                room -= d
    return np.array(lengths, dtype=np.int64), fixed


@pytest.mark.parametrize(("dp", "seed"), [(1, 0), (2, 1), (3, 2), (8, 3)])
def test_windows_filled_exactly_fit_with_the_packers_plan(dp: int, seed: int) -> None:
    """Every micro-batch exactly a window: a first-fit packing may need one step more, the packer's own placement
    (``fixed_plan``) does not, so the planner always has a plan within Megatron's count."""
    n, ranks = 4, 2 * dp
    lengths, fixed = _exact(seed, dp, n)
    costs = _costs(ranks)
    plan = plan_dynamic_cp(lengths, ranks, CAP, costs, max_micro_batches=n, fixed_plan=fixed)
    _check(plan, lengths, ranks, n)
    def priced(mb: list[int]) -> float:  # a CP 2 group's micro-batch: its slowest rank's share as laid out (issue 61)
        fwd, bwd = build_layout("per-document", lengths[mb], 2, cost=costs[2]).seconds(costs[2])
        return float((fwd + bwd).max())

    on_fixed = max(sum(priced(mb) for mb in fixed[r]) for r in range(dp))
    assert plan.slowest_seconds <= on_fixed * (1 + 1e-9)  # never behind the packer's fixed CP 2 groups
    with pytest.raises(ValueError, match="fixed_plan must hold each of the"):
        plan_dynamic_cp(lengths, ranks, CAP, costs, max_micro_batches=n, fixed_plan=[fixed[0][:-1]] + fixed[1:])


def test_the_recorded_comparison_is_above_its_lower_bound() -> None:
    """benchmarks/results/dynamic_cp_scheduler.json: ours is never below ``lower_bound``, which is never below
    ``memory_bound`` (so the gap reported against it is a gap any plan shares)."""
    import json
    from pathlib import Path

    rows = json.loads((Path(__file__).resolve().parents[1] / "benchmarks" / "results" /
                       "dynamic_cp_scheduler.json").read_text())["rows"]
    for row in rows:
        assert row["dynamic"]["over_ideal"] >= row["lower_bound_over_ideal"] * (1 - 1e-9)
        assert row["lower_bound_over_ideal"] >= row["memory_bound_over_ideal"] * (1 - 1e-9)


def test_a_packer_plan_over_the_slots_memory_is_not_a_fallback() -> None:
    """A fixed plan whose micro-batch exceeds its group's memory at the pool's cap is no plan: it is ignored (the
    search's own plan, or the one-line refusal, stands)."""
    lengths = np.array([60000, 60000, 60000, 60000], dtype=np.int64)
    fixed = [[[0, 1, 2]], [[3]]]  # 180,000 tokens on a CP 1 group of one 64K slot
    plan = plan_dynamic_cp(lengths, 2, CAP, _costs(2), max_micro_batches=2, fixed_plan=fixed)
    _check(plan, lengths, 2, 2)
