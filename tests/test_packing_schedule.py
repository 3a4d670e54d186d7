"""The objective (slowest DP rank's pipeline time), dealing to DP ranks and ordering within a rank."""

from __future__ import annotations

import dataclasses
import itertools
from collections import Counter
from itertools import islice

import numpy as np
import pytest

from megatron_wlb.config import load_config
from megatron_wlb.costmodel import build_cost_model
from megatron_wlb.packing import PackingConfig, make_packer, summarize
from megatron_wlb.packing.metrics import schedule_times, slowest_rank_schedule_time
from megatron_wlb.packing.pipeline import ScheduleTimer, deal_and_order, fixed_order
from megatron_wlb.packing.types import DocPiece, GlobalBatch, MicroBatch
from megatron_wlb.schedule import simulate_pipeline


@pytest.mark.parametrize("p, m, v", [(1, 1, 1), (2, 3, 1), (4, 4, 1), (4, 9, 1), (8, 4, 1), (4, 8, 2), (2, 6, 3)])
def test_timer_equals_the_simulator(p, m, v):
    rng = np.random.default_rng(p * 100 + m * 10 + v)
    timer = ScheduleTimer(p, m, v)
    for _ in range(20):
        f = rng.random(m) * rng.choice([1.0, 10.0], size=m)
        b = f * rng.uniform(1.5, 3.0, size=m)
        want = simulate_pipeline(np.broadcast_to(f, (p, m)), np.broadcast_to(b, (p, m)), virtual_stages=v,
                                 keep_events=False).makespan
        assert timer.makespan(f.tolist(), b.tolist()) == pytest.approx(want, rel=1e-12)


def test_fixed_order_rule():
    totals = [5.0, 9.0, 1.0, 7.0, 3.0]
    # second-heaviest, heaviest, the rest descending: lightest last
    assert fixed_order(totals, range(5)) == [3, 1, 0, 4, 2]


def test_order_within_a_rank_is_near_the_best_permutation():
    rng = np.random.default_rng(0)
    timer = ScheduleTimer(4, 4)
    worse = []
    for _ in range(200):
        w = rng.pareto(1.5, size=4) + 0.2
        f, b = (w / 3).tolist(), (2 * w / 3).tolist()
        perm = deal_and_order(f, b, dp=1, n=4, stages=4)
        got = timer.makespan([f[i] for i in perm], [b[i] for i in perm])
        best = min(timer.makespan([f[i] for i in o], [b[i] for i in o]) for o in itertools.permutations(range(4)))
        placement = timer.makespan(f, b)
        assert best <= got * (1 + 1e-12)
        assert got <= placement * (1 + 1e-12)  # never worse than running in placement order
        worse.append(got / best)
    assert max(worse) < 1.01


def test_dealing_spreads_heavy_micro_batches_over_ranks():
    # Placement put the four heavy micro-batches first, i.e. all on DP rank 0.
    dp, n = 4, 4
    w = [10.0] * 4 + [1.0] * 12
    f, b = [x / 3 for x in w], [2 * x / 3 for x in w]
    perm = deal_and_order(f, b, dp, n, stages=4)
    assert sorted(perm) == list(range(16))
    ranks = [perm[r * n:(r + 1) * n] for r in range(dp)]
    assert [sum(i < 4 for i in rk) for rk in ranks] == [1, 1, 1, 1]
    timer = ScheduleTimer(4, n)

    def slowest(order):
        return max(timer.makespan([f[i] for i in order[r * n:(r + 1) * n]], [b[i] for i in order[r * n:(r + 1) * n]])
                   for r in range(dp))

    one_heavy = min(timer.makespan([f[i] for i in o], [b[i] for i in o]) for o in itertools.permutations([0, 4, 5, 6]))
    assert slowest(perm) == pytest.approx(one_heavy)  # every rank runs one heavy in its best order
    assert slowest(perm) < 0.6 * slowest(list(range(16)))
    assert deal_and_order(f, b, dp, n, stages=4) == perm  # deterministic


def _heavy_tailed(size=6000, seed=4):
    return (np.random.default_rng(seed).pareto(1.1, size=size) * 2500 + 30).astype(np.int64)


def test_dealing_changes_placement_only_and_lowers_the_objective(run7b_dp4):
    config, cost = run7b_dp4
    cfg = dataclasses.replace(config.packing, dp=4)
    lengths = _heavy_tailed()
    on = list(islice(make_packer("wlb", cfg, cost).pack(lengths), 40))
    off = list(islice(make_packer("wlb", dataclasses.replace(cfg, schedule_order=False), cost).pack(lengths), 40))
    for a, b in zip(on, off):  # same micro-batches, same delays: only their rank and order moved
        assert Counter(mb.pieces for mb in a.micro_batches) == Counter(mb.pieces for mb in b.micro_batches)
    m_on, m_off = summarize(on, cost, cfg.seq_len), summarize(off, cost, cfg.seq_len)
    assert m_on.mean_delay == m_off.mean_delay
    assert m_on.schedule_ratio < m_off.schedule_ratio


def test_schedule_ratio_is_one_for_identical_micro_batches():
    mbs = tuple(MicroBatch((DocPiece(i, 0, 100, 0),), 128) for i in range(8))
    batch = GlobalBatch(0, mbs, dp=2, n=4)
    slow, ideal = slowest_rank_schedule_time(None, batch)
    assert slow == pytest.approx(ideal)
    m = summarize([batch], None, seq_len=100)
    assert m.schedule_ratio == pytest.approx(1.0) and m.min_fill == pytest.approx(1.0)


def test_schedule_times_play_the_simulator():
    lengths = [[50, 10, 10, 10], [30, 30, 30, 20]]
    mbs = tuple(MicroBatch((DocPiece(10 * r + j, 0, d, 0),), 64) for r, row in enumerate(lengths)
                for j, d in enumerate(row))
    batch = GlobalBatch(0, mbs, dp=2, n=4)
    got = schedule_times(None, batch, stages=2)
    for r, row in enumerate(lengths):
        w = np.asarray(row, dtype=float) ** 2
        want = simulate_pipeline(np.broadcast_to(w / 3, (2, 4)), np.broadcast_to(2 * w / 3, (2, 4)),
                                 keep_events=False).makespan
        assert got[r] == pytest.approx(want)


def test_interleaved_objective_config():
    with pytest.raises(ValueError, match="virtual_stages=2 .* needs n=6 divisible by pipeline_stages=4"):
        PackingConfig(seq_len=10, n=6, pipeline_stages=4, virtual_stages=2)
    cfg = PackingConfig(seq_len=100, n=4, dp=2, pipeline_stages=2, virtual_stages=2)
    batches = list(make_packer("wlb", cfg).pack(_heavy_tailed(300) % 140 + 1))
    assert sum(b.tokens for b in batches) > 0


# -- outlier grouping and the fill rule -----------------------------------------------------------
def test_release_groups_outliers_of_similar_length():
    # Queue (thresholds [60]): outliers 62, 98, 64, 97, 63, 99 arrive, one per iteration; R = dp * n
    # = 2. With group_by_work the oldest (62) waits for a partner of similar work (64: 98 is too
    # heavy for the 5-token documents to balance), without it 62 goes out with 98.
    lengths = []
    for d in (62, 98, 64, 97, 63, 99):
        lengths += [d] + [5] * 30
    cfg = PackingConfig(seq_len=100, n=2, dp=1, max_seq_len=150, queue_thresholds=(60,), max_delay=20,
                        fill="read-ahead", schedule_order=False)
    for release, want in (("balanced", {62, 64}), ("oldest", {62, 98})):
        batches = list(make_packer("wlb", dataclasses.replace(cfg, release=release)).pack(lengths))
        first_release = next(b for b in batches if any(p.length >= 60 for p in b.pieces()))
        assert {p.length for p in first_release.pieces() if p.length >= 60} == want


def test_no_near_empty_iteration_while_pieces_wait():
    # A document 12 x S_max long puts the intake in debt for many iterations; its pieces wait in
    # a queue that releases R at a time. Rule: an iteration holds fewer than fill_target x the token
    # budget only if no waiting piece fits in the room left (here: never).
    lengths = [40] * 30 + [12 * 150 + 7] + [40] * 200
    # the fill rule (f) alone: without the read-ahead fill (h), which tops iterations up first
    cfg = PackingConfig(seq_len=100, n=4, dp=1, max_seq_len=150, max_delay=6, fill="waiting", fill_target=0.5)
    budget = cfg.tokens_per_iteration
    packer = make_packer("wlb", cfg)
    batches = []
    for b in packer.pack(lengths):
        batches.append(b)
        if packer.pending() > 0:
            assert b.tokens >= 0.5 * budget, (b.iteration, b.tokens)
    off = list(make_packer("wlb", dataclasses.replace(cfg, fill="off")).pack(lengths))
    assert min(b.tokens for b in off[:-3]) < 0.5 * budget  # without the rule it happens
    assert sum(b.tokens for b in batches) == sum(lengths)


# -- the opt-in cut policy --------------------------------------------------------------------------
def _lonely_outliers():
    lengths = []
    for k in range(12):
        lengths += [140 if k % 2 else 400] + [10] * 200  # one outlier per ~5 iterations, R = 4
    return np.asarray(lengths)


@pytest.mark.parametrize("policy", ["split", "overlong", "any"])
def test_cut_policy_counts_and_scope(policy):
    lengths = _lonely_outliers()
    cfg = PackingConfig(seq_len=100, n=2, dp=2, max_seq_len=150, max_delay=2, cut=policy,
                        fill="read-ahead")
    packer = make_packer("wlb", cfg)
    batches = list(packer.pack(lengths))
    pieces = [p for b in batches for p in b.pieces()]
    assert sum(p.length for p in pieces) == int(lengths.sum())
    assert max(b.iteration - p.arrival for b in batches for p in b.pieces()) <= 2
    by_doc: dict[int, list] = {}
    for p in pieces:
        by_doc.setdefault(p.doc_id, []).append(p)
    cut_140 = [d for d, ps in by_doc.items() if lengths[d] == 140 and len(ps) > 1]
    cut_400 = [d for d, ps in by_doc.items() if lengths[d] == 400 and len(ps) > 3]  # 3 = the oversize split
    stats = packer.cut_stats
    if policy == "split":
        assert not cut_140 and not cut_400 and stats == {"cut_points": 0, "tokens": 0, "pieces": 0}
    else:
        assert stats["cut_points"] > 0 and stats["pieces"] > stats["cut_points"]
        assert cut_400 and (bool(cut_140) == (policy == "any"))
        extra_pieces = sum(len(ps) - (1 if lengths[d] <= 150 else 3) for d, ps in by_doc.items())
        assert extra_pieces == stats["cut_points"]


def _debt_then_lonely_outlier():
    # a document 6x S_max puts the intake in debt (the fill rule then releases waiting pieces early);
    # a lone 140-token outlier per cycle never gathers the R = 4 companions of a group release
    lengths = []
    for _ in range(6):
        lengths += [10] * 40 + [900] + [10] * 5 + [140] + [10] * 60
    return np.asarray(lengths)


@pytest.mark.parametrize("policy", ["split", "overlong", "any"])
def test_cut_policy_cuts_what_the_fill_rule_releases_into_an_unbalanced_iteration(policy):
    """When the fill rule must release an outlier into an iteration whose ordinary documents cannot
    balance it, the cut policy cuts it into the fewest pieces that can be balanced (140 tokens
    against 150 ordinary tokens in 4 micro-batches: 4 pieces of 35), counted in cut_stats; the
    delay bound holds and every token is emitted once."""
    lengths = _debt_then_lonely_outlier()
    cfg = PackingConfig(seq_len=100, n=4, dp=1, max_seq_len=150, max_delay=8, cut=policy,
                        fill="waiting", fill_target=0.5)  # the fill rule (f) alone: no read-ahead fill (h)
    packer = make_packer("wlb", cfg)
    batches = list(packer.pack(lengths))
    assert packer.fill_releases > 0
    pieces = [p for b in batches for p in b.pieces()]
    by_doc: dict[int, list] = {}
    for p in pieces:
        by_doc.setdefault(p.doc_id, []).append(p)
    assert sorted(by_doc) == list(range(lengths.size))
    for d, ps in by_doc.items():  # each document exactly once: contiguous pieces covering it
        ps.sort(key=lambda p: p.offset)
        assert ps[0].offset == 0 and sum(p.length for p in ps) == lengths[d]
        assert all(a.offset + a.length == b.offset for a, b in zip(ps, ps[1:]))
    assert max(b.iteration - p.arrival for b in batches for p in b.pieces()) <= cfg.max_delay
    ratios = []
    for b in batches:
        w = [sum(x * x for x in mb.lengths) for mb in b.micro_batches]
        if sum(w):
            ratios.append(max(w) / np.mean(w))
    lonely = [len(by_doc[d]) for d in range(lengths.size) if lengths[d] == 140]
    extra = sum(len(ps) - (1 if lengths[d] <= 150 else 6) for d, ps in by_doc.items())
    assert extra == packer.cut_stats["cut_points"]
    if policy == "any":
        assert set(lonely) == {4}, lonely  # the fewest pieces that balance, no more
        assert max(ratios) <= 1.2, ratios  # what is left: 10-token granularity
    else:
        assert set(lonely) == {1}  # documents within S_max are cut only by "any"
        assert max(ratios) > 3


@pytest.mark.parametrize("p, m, v", [(4, 4, 1), (4, 3, 1), (2, 6, 3), (8, 16, 1)])
def test_batched_makespans_equal_the_scalar_timer_bit_for_bit(p, m, v):
    """``makespans`` (the exhaustive order search's one vectorised pass) gives exactly ``makespan``
    per row, so the orders it picks, and the plans, are the scalar loop's."""
    rng = np.random.default_rng(p + m + v)
    timer = ScheduleTimer(p, m, v)
    f = rng.pareto(1.5, size=(30, m)) + 0.1
    b = f * rng.uniform(1.5, 3.0, size=(30, m))
    got = timer.makespans(f, b)
    assert got.tolist() == [timer.makespan(f[r].tolist(), b[r].tolist()) for r in range(30)]


def test_packer_latency_table_equals_the_cost_model():
    """The packer's latency lookup gives the cost model's numbers, inside the table and beyond it."""
    run = load_config("7b_128k")
    cost = build_cost_model(run.model, run.layout)
    packer = make_packer("wlb", run.packing, cost)
    probe = np.array([0, 1, 2, 4095, 131072, packer.capacity, packer.capacity + 1, 10 * packer.capacity])
    from megatron_wlb.packing.metrics import piece_latency
    assert packer.latency(probe).tolist() == piece_latency(cost, probe).tolist()
    assert packer.latency([]).size == 0
    other = build_cost_model(run.model, dataclasses.replace(run.layout, tp=run.layout.tp * 2))
    packer.set_cost(other, {})
    assert packer.latency(probe).tolist() == piece_latency(other, probe).tolist()  # the table follows the model


def test_whole_piece_floor():
    """The floor equals the balanced schedule when no piece outweighs the mean; a dominant piece sits
    alone at its own latency and the rest share evenly, and no arrangement of the real micro-batches
    with that piece whole beats it."""
    from megatron_wlb.packing.metrics import balanced_schedule_time, whole_piece_floor_time

    even = GlobalBatch(0, tuple(MicroBatch((DocPiece(i, 0, 100, 0),), 1000) for i in range(4)), 1, 4)
    assert whole_piece_floor_time(None, even) == pytest.approx(balanced_schedule_time(None, even), rel=1e-12)
    big = [MicroBatch((DocPiece(0, 0, 900, 0),), 1000)] + \
        [MicroBatch(tuple(DocPiece(10 * j + k, 0, 100, 0) for k in range(3)), 1000) for j in range(1, 4)]
    batch = GlobalBatch(0, tuple(big), 1, 4)
    floor = whole_piece_floor_time(None, batch)
    assert floor > balanced_schedule_time(None, batch) * 1.2  # 900**2 dwarfs the mean
    timer = ScheduleTimer(4, 4)
    w = [900.0 ** 2] + [3 * 100.0 ** 2] * 3
    best = min(timer.makespan([w[i] / 3 for i in o], [2 * w[i] / 3 for i in o])
               for o in itertools.permutations(range(4)))
    assert floor == pytest.approx(best, rel=1e-12)  # the real plan already is the floor here
    m = summarize([batch], None, 1000)
    assert m.schedule_floor == pytest.approx(floor / balanced_schedule_time(None, batch), rel=1e-12)
    assert m.schedule_ratio >= m.schedule_floor * (1 - 1e-12)


def test_outlier_threshold_follows_a_refitted_cost_model():
    """After ``set_cost`` the auto L_1 is the one a packer built with the new model derives from the
    same stream (one length per histogram bin: the work rescale is exact), not the old model's."""
    run = load_config("7b_128k")
    old = build_cost_model(run.model, run.layout)
    new = build_cost_model(run.model, dataclasses.replace(run.layout, cp=run.layout.cp * 4))
    cfg = dataclasses.replace(run.packing, max_delay=4)
    lengths = np.tile(np.array([700, 3000, 9000, 20000, 70000, 150000], dtype=np.int64), 300)
    refit = make_packer("wlb", cfg, old)
    plans = refit.pack(lengths)
    for _ in range(6):
        next(plans)
    fresh = make_packer("wlb", cfg, new)
    plans_fresh = fresh.pack(lengths)
    for _ in range(6):
        next(plans_fresh)
    assert refit.thresholds() != fresh.thresholds()  # the two models disagree on what is an outlier
    refit.set_cost(new, {})
    assert refit.thresholds() == fresh.thresholds()
