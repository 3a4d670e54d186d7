"""Issue 48: the dynamic-CP planner (``cp.dynamic``) — a CP group per micro-batch over a stage's DP x CP ranks."""

from __future__ import annotations

import numpy as np
import pytest

from megatron_wlb.costmodel import ParallelLayout, build_cost_model
from megatron_wlb.cp.dynamic import group_cost_models, plan_dynamic_cp
from megatron_wlb.cp.layouts import build_layout
from megatron_wlb.packing.metrics import piece_latency

WINDOW = 131072
CAP = WINDOW // 2


def _costs(ranks: int) -> dict:
    return group_cost_models(build_cost_model("7b", ParallelLayout(tp=8, cp=2, dp=ranks // 2)), ranks)


def _heavy_tailed(seed: int, tokens: int) -> np.ndarray:
    rng = np.random.default_rng(seed)
    out, total = [], 0
    while total < tokens:
        d = int(min(WINDOW, max(16, rng.pareto(0.9) * 2000)))
        out.append(d)
        total += d
    return np.array(out, dtype=np.int64)


@pytest.mark.parametrize("ranks", [2, 4, 6, 16])
def test_plan_places_every_document_once_on_aligned_power_of_two_groups(ranks: int) -> None:
    lengths = _heavy_tailed(ranks, ranks * 2 * WINDOW)
    costs = _costs(ranks)
    plan = plan_dynamic_cp(lengths, ranks, CAP, costs)
    docs = sorted(i for mb in plan.micro_batches for i in mb.docs)
    assert docs == list(range(lengths.size))
    for mb in plan.micro_batches:
        assert mb.size & (mb.size - 1) == 0 and mb.first_rank % mb.size == 0 and mb.first_rank + mb.size <= ranks
        assert mb.tokens == int(lengths[list(mb.docs)].sum()) <= mb.size * CAP  # the memory cap per rank
        cost = costs[mb.size]
        price = piece_latency(cost, lengths[list(mb.docs)]).sum() + cost.microbatch_overhead * (
            1 + cost.hardware.bwd_linear)
        assert mb.seconds == pytest.approx(price, rel=0.05)  # CP collectives of the group's size priced (the kernel
        # table derates short runs: a few percent); exactly: its slowest member's share as the runtime lays it out
        fwd, bwd = build_layout("per-document", lengths[list(mb.docs)], mb.size, cost=cost).seconds(cost)
        assert mb.seconds == pytest.approx(float((fwd + bwd).max()), rel=1e-12)
    # a group's micro-batch sits at the same step on every member: no member waits for another
    for k, step in enumerate(plan.rank_groups()):
        for mb in plan.micro_batches:
            held = [j for j in mb.ranks if k < len(plan.rank_micro_batches[j]) and plan.rank_micro_batches[j][k] is mb]
            assert held in ([], list(mb.ranks))
        assert len(step) == ranks
    sums = [sum(mb.seconds for mb in mbs) for mbs in plan.rank_micro_batches]
    np.testing.assert_allclose(plan.rank_seconds, sums)
    assert plan.over_ideal >= 1.0


def test_long_documents_get_groups_short_ones_stay_local() -> None:
    lengths = np.array([WINDOW, WINDOW] + [512] * 400, dtype=np.int64)
    plan = plan_dynamic_cp(lengths, 8, CAP, _costs(8))
    size_of = {i: mb.size for mb in plan.micro_batches for i in mb.docs}
    assert size_of[0] >= 2 and size_of[1] >= 2  # 128K tokens do not fit one rank's 64K
    assert sum(size_of[i] == 1 for i in range(2, lengths.size)) > 350  # no all-gather for short documents


def test_balanced_stream_is_near_ideal_and_beats_a_fixed_group() -> None:
    lengths = np.full(512, 4096, dtype=np.int64)
    costs = _costs(8)
    plan = plan_dynamic_cp(lengths, 8, CAP, costs)
    assert plan.over_ideal < 1.02
    fixed = float(piece_latency(costs[2], lengths).sum()) / 4  # every document on a fixed CP 2 group
    assert plan.slowest_seconds < fixed


def test_heavy_tail_spreads_a_window_long_document() -> None:
    lengths = np.array([WINDOW] + [2048] * 60, dtype=np.int64)  # one document is most of the work
    plan = plan_dynamic_cp(lengths, 16, CAP, _costs(16))
    size = next(mb.size for mb in plan.micro_batches if 0 in mb.docs)
    assert size > 2  # wider than its memory minimum: shorter than waiting for one CP 2 group
    only_memory = plan_dynamic_cp(lengths, 16, CAP, _costs(16), alphas=(float("inf"),), promotions=0)
    assert plan.slowest_seconds < only_memory.slowest_seconds


def test_bad_input_is_one_line() -> None:
    with pytest.raises(ValueError, match="needs 4 ranks .* largest group is 2"):
        plan_dynamic_cp(np.array([WINDOW * 2]), 2, CAP, _costs(2))
    with pytest.raises(ValueError, match="ranks=0"):
        plan_dynamic_cp(np.array([5]), 0, CAP, _costs(2))
    with pytest.raises(ValueError, match="lengths must be >= 1"):
        plan_dynamic_cp(np.array([0]), 2, CAP, _costs(2))
    assert plan_dynamic_cp(np.zeros(0, dtype=np.int64), 4, CAP, _costs(4)).micro_batches == []


def test_the_results_page_holds_the_recorded_dynamic_cp_run() -> None:
    """benchmarks/results.md's two dynamic-CP tables are the latest ``bench_main_scheduler.py --dynamic-cp`` run,
    which charged communication to every planner and planned every document once (the script checks it)."""
    import json
    from pathlib import Path

    from conftest import load_script

    root = Path(__file__).resolve().parents[1]
    page = (root / "benchmarks" / "results.md").read_text()
    result = json.loads((root / "benchmarks" / "results" / "dynamic_cp_scheduler.json").read_text())
    mod = load_script("bench_main_scheduler")
    assert result["communication_charged"] and mod.dynamic_readme_table(result).strip() in page
    assert mod.intake_table(result).strip() in page
    for row in result["rows"]:  # ours is never below its lower bound, nor below the ideal
        assert row["dynamic"]["over_ideal"] >= row["memory_bound_over_ideal"] * (1 - 1e-9) >= 1 - 1e-9


def test_the_grid_scorer_agrees_with_the_planner_and_charges_communication() -> None:
    """The benchmark's DP x CP grid scorer (ranks joined by a shared sample start together) gives the planner's
    own predicted time: no group waits for a member. A fixed CP 2 plan pays the all-gather on every document."""
    from conftest import load_script

    from megatron_wlb.packing.metrics import overhead_seconds

    mod = load_script("bench_main_scheduler")
    lengths = _heavy_tailed(7, 16 * WINDOW)
    costs = _costs(16)
    prices = {g: piece_latency(c, lengths) for g, c in costs.items()}
    overheads = {g: overhead_seconds(c) for g, c in costs.items()}
    plan = plan_dynamic_cp(lengths, 16, CAP, costs)
    # (the scorer prices documents apart; the plan its micro-batches as laid out, issue 61: within a few percent)
    assert mod.rank_groups_critical_path(plan.rank_groups(), prices, overheads) == pytest.approx(plan.slowest_seconds,
                                                                                               rel=0.02)
    pairs = [[[i for i in range(lengths.size) if i % 8 == j // 2] for j in range(16)]]  # DP rank r's CP pair
    fixed = mod.rank_groups_critical_path(pairs, prices, overheads)
    owner = np.arange(lengths.size) % 8
    assert fixed == pytest.approx(max(prices[2][owner == r].sum() for r in range(8)) + overheads[2])
    assert fixed > plan.slowest_seconds
