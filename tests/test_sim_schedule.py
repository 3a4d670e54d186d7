"""Pipeline schedule engine against closed forms and invariants (no packers, no cost model)."""

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from megatron_wlb.schedule import op_order, simulate_pipeline, textbook_1f1b


@pytest.mark.parametrize("p,m,tf,tb", [(4, 4, 1.0, 2.0), (4, 8, 1.0, 1.0), (4, 8, 3.0, 1.0), (8, 16, 0.5, 1.1),
                                       (1, 5, 1.0, 2.0), (4, 2, 1.0, 2.0), (16, 16, 0.2, 0.5)])
def test_uniform_1f1b_is_textbook(p, m, tf, tb):
    res = simulate_pipeline(np.full((p, m), tf), np.full((p, m), tb))
    assert res.makespan == pytest.approx((m + p - 1) * (tf + tb))
    assert res.bubble_fraction == pytest.approx((p - 1) / (m + p - 1))
    assert np.allclose(res.busy, m * (tf + tb))


@pytest.mark.parametrize("p,m,v", [(4, 8, 2), (4, 16, 2), (4, 16, 4), (2, 8, 2), (4, 4, 2), (8, 16, 2)])
def test_virtual_stages_shrink_bubble_by_v(p, m, v):
    tf, tb = 1.0, 2.0
    plain = simulate_pipeline(np.full((p, m), tf), np.full((p, m), tb))
    inter = simulate_pipeline(np.full((p, m), tf), np.full((p, m), tb), virtual_stages=v)
    bubble_plain = plain.makespan - m * (tf + tb)
    bubble_inter = inter.makespan - m * (tf + tb)
    assert bubble_plain == pytest.approx((p - 1) * (tf + tb))
    assert bubble_inter == pytest.approx(bubble_plain / v)
    expect_time, expect_frac = textbook_1f1b(p, m, tf, tb, v)
    assert inter.makespan == pytest.approx(expect_time)
    assert inter.bubble_fraction == pytest.approx(expect_frac)
    assert inter.bubble_fraction == pytest.approx((p - 1) / (v * m + p - 1))


def test_single_micro_batch_pays_every_hop_twice():
    p, tf, tb, c = 5, 1.0, 2.0, 0.25
    res = simulate_pipeline(np.full((p, 1), tf), np.full((p, 1), tb), p2p=c)
    assert res.makespan == pytest.approx(p * (tf + tb) + 2 * (p - 1) * c)


def test_op_orders_cover_every_operation_once():
    for p, m, v in [(4, 4, 1), (4, 8, 2), (3, 6, 3), (4, 2, 1)]:
        for s in range(p):
            order = op_order(s, p, m, v)
            assert len(order) == 2 * m * v == len(set(order))
            # a rank never runs a backward before its own forward of the same chunk and micro-batch
            seen = set()
            for kind, c, j in order:
                if kind == "B":
                    assert ("F", c, j) in seen
                seen.add((kind, c, j))


def _check_events(res, fwd, bwd, p2p):
    p, m = fwd.shape
    by_stage = {}
    end = {}
    for e in res.events:
        by_stage.setdefault(e.stage, []).append(e)
        end[(e.kind, e.chunk, e.stage, e.micro_batch)] = e.end
    for evs in by_stage.values():  # no overlap on a rank
        evs.sort(key=lambda e: e.start)
        for a, b in zip(evs, evs[1:]):
            assert b.start >= a.end - 1e-12
    for e in res.events:  # data dependencies and transfers respected (v == 1)
        if e.kind == "F" and e.stage > 0:
            assert e.start >= end[("F", 0, e.stage - 1, e.micro_batch)] + p2p - 1e-12
        if e.kind == "B" and e.stage < p - 1:
            assert e.start >= end[("B", 0, e.stage + 1, e.micro_batch)] + p2p - 1e-12
        if e.kind == "B" and e.stage == p - 1:
            assert e.start >= end[("F", 0, e.stage, e.micro_batch)] - 1e-12


times = st.integers(min_value=2, max_value=5).flatmap(
    lambda p: st.integers(min_value=1, max_value=8).flatmap(
        lambda m: st.tuples(st.just(p), st.just(m),
                            st.lists(st.floats(0.01, 5.0), min_size=2 * p * m, max_size=2 * p * m))))


@settings(max_examples=60, deadline=None)
@given(times, st.floats(0.0, 0.5))
def test_never_shorter_than_busiest_gpu_and_dependencies_hold(spec, p2p):
    p, m, flat = spec
    arr = np.array(flat).reshape(2, p, m)
    res = simulate_pipeline(arr[0], arr[1], p2p=p2p)
    assert res.makespan >= res.busy.max() - 1e-9
    assert np.allclose(res.busy, arr[0].sum(axis=1) + arr[1].sum(axis=1))
    # critical path of any micro-batch alone through all stages
    alone = arr[0].sum(axis=0) + arr[1].sum(axis=0) + 2 * (p - 1) * p2p
    assert res.makespan >= alone.max() - 1e-9
    assert 0.0 <= res.bubble_fraction < 1.0
    _check_events(res, arr[0], arr[1], p2p)


@settings(max_examples=60, deadline=None)
@given(times, st.integers(0, 10_000), st.floats(0.01, 3.0), st.booleans())
def test_more_work_never_finishes_earlier(spec, pick, extra, backward):
    p, m, flat = spec
    arr = np.array(flat).reshape(2, p, m)
    base = simulate_pipeline(arr[0], arr[1])
    more = arr.copy()
    more[int(backward)].flat[pick % (p * m)] += extra
    assert simulate_pipeline(more[0], more[1]).makespan >= base.makespan - 1e-9


@settings(max_examples=30, deadline=None)
@given(st.integers(2, 4), st.integers(1, 3), st.integers(2, 3), st.data())
def test_interleaved_invariants_with_variable_times(p, k, v, data):
    m = k * p
    flat = data.draw(st.lists(st.floats(0.01, 4.0), min_size=2 * v * p * m, max_size=2 * v * p * m))
    arr = np.array(flat).reshape(2, v, p, m)
    res = simulate_pipeline(arr[0], arr[1], virtual_stages=v)
    assert res.makespan >= res.busy.max() - 1e-9
    assert np.allclose(res.busy, arr.sum(axis=(0, 1, 3)))
    assert len(res.events) == 2 * v * p * m


def test_variable_lengths_straggler_sets_the_pace():
    # One heavy micro-batch on a 4-stage pipeline: it passes every stage, so the iteration grows
    # by at least its extra work once per stage it crosses on the critical path.
    p, m = 4, 4
    fwd = np.ones((p, m))
    bwd = 2 * np.ones((p, m))
    base = simulate_pipeline(fwd, bwd).makespan
    fwd[:, 2] *= 2
    bwd[:, 2] *= 2
    heavy = simulate_pipeline(fwd, bwd).makespan
    assert heavy >= base + 3.0  # at least one stage's extra (1 + 2) on the critical path
    assert heavy <= base + p * 3.0


def test_bad_inputs_are_named():
    with pytest.raises(ValueError, match="shape"):
        simulate_pipeline(np.ones(3), np.ones(3))
    with pytest.raises(ValueError, match="differ"):
        simulate_pipeline(np.ones((2, 3)), np.ones((2, 4)))
    with pytest.raises(ValueError, match="non-negative"):
        simulate_pipeline(-np.ones((2, 3)), np.ones((2, 3)))
    with pytest.raises(ValueError, match="divisible"):
        simulate_pipeline(np.ones((4, 6)), np.ones((4, 6)), virtual_stages=2)
    with pytest.raises(ValueError, match="virtual_stages"):
        simulate_pipeline(np.ones((4, 4)), np.ones((4, 4)), virtual_stages=0)
