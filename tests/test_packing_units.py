"""Unit tests of the packers, the HiGHS model, the metrics and the two CLI commands."""

from __future__ import annotations

import dataclasses
import itertools
import json
from itertools import islice

import numpy as np
import pytest

from megatron_wlb.cli.main import main
from megatron_wlb.data.lengths import validate_lengths
from megatron_wlb.packing import (
    PackingConfig,
    imbalance_global,
    imbalance_per_rank,
    make_packer,
    place_greedy,
    solve_assignment,
    summarize,
)
from megatron_wlb.packing.metrics import piece_latency
from megatron_wlb.packing.solver import decode_counts, length_groups, model_columns


def first(packer, lengths, k):
    return list(islice(packer.pack(lengths), k))


# -- original -----------------------------------------------------------------------------------
def test_original_is_concat_and_cut():
    rng = np.random.default_rng(3)
    lengths = rng.integers(1, 300, size=400)
    cfg = PackingConfig(seq_len=256, n=3, dp=2)
    batches = list(make_packer("original", cfg).pack(lengths))
    # Independent reconstruction: micro-batch k holds tokens [k*S, (k+1)*S) of the concatenation.
    starts = np.concatenate([[0], np.cumsum(lengths)])
    mbs = [mb for b in batches for mb in b.micro_batches]
    total = int(lengths.sum())
    assert len(mbs) >= -(-total // 256)
    for k, mb in enumerate(mbs):
        lo, hi = min(k * 256, total), min((k + 1) * 256, total)
        got = [(int(starts[p.doc_id]) + p.offset, p.length) for p in mb.pieces]
        pos = lo
        for g0, gl in got:
            assert g0 == pos
            pos += gl
        assert pos == hi
        assert mb.capacity == 256


def test_original_packer_and_cp_sampler_cut_alike():
    """The packer (streaming, one budget per iteration) and the CP benchmarks' sampler (random
    access by micro-batch number) cut the same stream at the same tokens, across iteration edges."""
    from megatron_wlb.cp.sampling import available, concat_and_cut

    rng = np.random.default_rng(5)
    lengths = rng.integers(1, 2000, size=600)
    cfg = PackingConfig(seq_len=512, n=2, dp=3)
    mbs = [mb for b in make_packer("original", cfg).pack(lengths) for mb in b.micro_batches]
    full = available(lengths, 512)
    sampled = concat_and_cut(lengths, 512, count=full)
    assert [mb.lengths.tolist() for mb in mbs[:full]] == [m.tolist() for m in sampled]
    assert any(len(m) > 1 for m in sampled) and any(mb.pieces[0].offset > 0 for mb in mbs[:full])
    tail = [p for mb in mbs[full:] for p in mb.pieces]
    assert sum(p.length for p in tail) == int(lengths.sum()) - 512 * full  # the partial tail is emitted



def test_original_drop_and_error_policies():
    lengths = [10, 700, 20]
    drop = make_packer("original", PackingConfig(seq_len=256, n=1, cut="drop"))
    assert sum(b.tokens for b in drop.pack(lengths)) == 30 and drop.dropped == [(1, 700)]
    with pytest.raises(ValueError, match="document 1 has 700 tokens"):
        list(make_packer("original", PackingConfig(seq_len=256, n=1, cut="error")).pack(lengths))


# -- fixed packers ------------------------------------------------------------------------------
def test_place_greedy_least_loaded_that_fits():
    work, toks = [0.0, 0.0], [0, 0]
    where = place_greedy([6, 5, 4, 3], [36.0, 25.0, 16.0, 9.0], work, toks, cap=10)
    assert where == [0, 1, 1, 0]  # 4 -> bin 1 (least work); 3 -> bin 0 (bin 1 has 9 of 10 tokens)
    assert toks == [9, 9] and work == [45.0, 41.0]
    assert place_greedy([11], [1.0], [0.0], [0], cap=10) == [-1]
    assert place_greedy([10, 1], [100.0, 1.0], [0.0], [0], cap=10) == [0, -1]  # exactly full, then no room


def test_fixed_packers_beat_original_on_embedded(run7b, embedded_lengths):
    (config, cost), lengths = run7b, embedded_lengths
    orig = summarize(first(make_packer("original", config.packing, cost), lengths, 24), cost).imbalance
    greedy = summarize(first(make_packer("fixed-greedy", dataclasses.replace(config.packing, window=4), cost),
                             lengths, 24), cost).imbalance
    solver = summarize(first(make_packer("fixed-solver", dataclasses.replace(config.packing, window=2), cost),
                             lengths, 12), cost).imbalance
    assert greedy < orig and solver < orig
    wlb = summarize(first(make_packer("wlb", config.packing, cost), lengths, 24), cost).imbalance
    assert wlb < greedy


def brute_force_max(lengths, weights, bins, cap):
    best = np.inf
    for assign in itertools.product(range(bins), repeat=len(lengths)):
        a = np.asarray(assign)
        if np.bincount(a, weights=lengths, minlength=bins).max() <= cap:
            best = min(best, np.bincount(a, weights=weights, minlength=bins).max())
    return best


@pytest.mark.parametrize("seed", [0, 1, 2])
def test_solver_optimal_on_small_instances(seed):
    rng = np.random.default_rng(seed)
    lengths = np.sort(rng.integers(5, 60, size=8))[::-1].copy()
    weights = lengths.astype(float) ** 2
    bins, cap = 3, int(lengths.sum() / 3 * 1.3)
    greedy = place_greedy(lengths.tolist(), weights.tolist(), [0.0] * bins, [0] * bins, cap)
    assert min(greedy) >= 0
    relabel = {}
    start = np.array([relabel.setdefault(j, len(relabel)) for j in greedy])
    choice, status, bound = solve_assignment(lengths, weights, bins, cap, start=start,
                                             node_limit=100000, rel_gap=0.0)
    assert status == "Optimal"
    assert choice is not None and choice.min() >= 0 and choice.max() < bins
    assert np.bincount(choice, weights=lengths, minlength=bins).max() <= cap
    got = np.bincount(choice, weights=weights, minlength=bins).max()
    assert got <= np.bincount(start, weights=weights, minlength=bins).max() + 1e-9
    assert got == pytest.approx(brute_force_max(lengths, weights, bins, cap), rel=1e-6)


@pytest.mark.parametrize("seed", [0, 1])
def test_solver_optimal_with_repeated_lengths(seed):
    # Pieces of equal length are one group with an integer count per bin; still optimal, and
    # every piece is assigned exactly once.
    rng = np.random.default_rng(10 + seed)
    lengths = np.sort(rng.choice([7, 12, 20, 31], size=8))[::-1].copy()
    weights = lengths.astype(float) ** 2
    bins, cap = 3, int(lengths.sum() / 3 * 1.2)
    greedy = place_greedy(lengths.tolist(), weights.tolist(), [0.0] * bins, [0] * bins, cap)
    relabel = {}
    start = np.array([relabel.setdefault(j, len(relabel)) for j in greedy])
    stats = {}
    choice, status, _ = solve_assignment(lengths, weights, bins, cap, start=start, node_limit=100000,
                                         rel_gap=0.0, stats=stats)
    assert status == "Optimal" and stats["groups"] == np.unique(lengths).size
    assert choice is not None and choice.shape == lengths.shape and choice.min() >= 0 and choice.max() < bins
    assert np.bincount(choice, weights=lengths, minlength=bins).max() <= cap
    got = np.bincount(choice, weights=weights, minlength=bins).max()
    assert got == pytest.approx(brute_force_max(lengths, weights, bins, cap), rel=1e-6)


def test_solver_model_is_per_piece_when_lengths_are_distinct():
    # Distinct lengths: one group per piece, piece i in bins 0..i (the per-piece model of Eq. 1).
    lengths = np.arange(40, 10, -1)
    assert model_columns(lengths, 7) == int(np.minimum(np.arange(lengths.size) + 1, 7).sum())
    assert model_columns(np.ones(224, dtype=np.int64), 70) == 70


def test_solver_bounded_on_a_window_of_equal_pieces():
    # Issue 22: 224 one-token documents into 70 bins was a 13K-binary model taking ~60 s of CPU
    # per plan at solver_nodes >= 1. Grouped, it is 70 columns solved in a handful of nodes and
    # simplex iterations, so a column cap of 1,000 no longer skips it.
    packing = PackingConfig(seq_len=4, n=10, dp=7, window=1, solver_nodes=5, solver_max_columns=1000)
    packer = make_packer("fixed-solver", packing)
    batches = first(packer, np.ones(224, dtype=np.int64), 1)
    assert packer.skipped_windows == 0 and packer.solver_status == {"Optimal": 1}
    pieces = [p for mb in batches[0].micro_batches for p in mb.pieces]
    assert sorted(p.doc_id for p in pieces) == list(range(224))
    assert max(mb.tokens for mb in batches[0].micro_batches) == 4
    stats = {}
    choice, status, _ = solve_assignment(np.ones(224), np.ones(224), 70, 4, start=np.arange(224) % 70,
                                         node_limit=5, stats=stats)
    assert choice is not None and np.bincount(choice, minlength=70).max() == 4
    assert stats["columns"] == 70 and stats["nodes"] <= 5 and stats["simplex_iterations"] < 1000


def test_solver_decode_keeps_pieces_in_their_warm_start_bins():
    # Counts per (length group, bin) -> bin per piece: the greedy bins where the counts allow.
    group, _, _, _ = length_groups(np.array([5, 5, 5, 3, 3, 3, 3, 1]))
    start = np.array([0, 1, 2, 2, 1, 0, 2, 1])
    same = np.zeros((3, 3), dtype=np.int64)
    np.add.at(same, (group, start), 1)
    assert np.array_equal(decode_counts(group, same, start), start)
    moved = same.copy()
    moved[1] = [2, 1, 1]  # one 3-token piece moves from bin 2 to bin 0
    choice = decode_counts(group, moved, start)
    got = np.zeros((3, 3), dtype=np.int64)
    np.add.at(got, (group, choice), 1)
    assert np.array_equal(got, moved) and (choice != start).sum() == 1


def test_solver_packer_reports_highs_status(run7b, embedded_lengths):
    (config, cost), lengths = run7b, embedded_lengths
    packer = make_packer("fixed-solver", dataclasses.replace(config.packing, window=2), cost)
    first(packer, lengths, 4)
    assert sum(packer.solver_status.values()) >= 1
    assert set(packer.solver_status) <= {"Optimal", "Solution limit reached", "Time limit reached"}


# -- wlb ----------------------------------------------------------------------------------------
def test_wlb_outlier_queue_releases_n_at_a_time():
    # seq_len 100, 4 micro-batches; one outlier (90 tokens >= L_1 = 80) per iteration among short docs.
    lengths = []
    for _ in range(12):
        lengths += [90] + [10] * 31
    cfg = PackingConfig(seq_len=100, n=4, dp=1, max_seq_len=160, queue_thresholds=(80,), max_delay=10)
    packer = make_packer("wlb", cfg)
    batches = list(packer.pack(lengths))
    outliers_per_iter = [sum(p.length == 90 for p in b.pieces()) for b in batches]
    released = [c for c in outliers_per_iter[:11] if c]
    assert released and all(c == 4 for c in released), outliers_per_iter
    for b in batches[:11]:
        assert all(sum(p.length == 90 for p in mb.pieces) <= 1 for mb in b.micro_batches)
    assert sum(outliers_per_iter) == 12


@pytest.mark.parametrize("release", ["balanced", "paper"])
def test_wlb_release_group_size_across_dp(release):
    # dp 2 x n 3: a release hands one outlier to each of the 6 micro-batches at once (R = dp * n)
    group = 6
    lengths = []
    for _ in range(18):
        lengths += [90] + [10] * 51
    cfg = PackingConfig(seq_len=100, n=3, dp=2, max_seq_len=160, queue_thresholds=(80,), max_delay=20,
                        release=release)
    batches = list(make_packer("wlb", cfg).pack(lengths))
    counts = [sum(p.length == 90 for p in b.pieces()) for b in batches[:16]]
    assert {c for c in counts if c} == {group}, counts
    with pytest.raises(ValueError, match="release='dp'"):
        make_packer("wlb", dataclasses.replace(cfg, release="dp"))


def test_state_rejects_other_knobs():
    cfg = PackingConfig(seq_len=100, n=2, outlier_fraction=0.7)
    state = make_packer("wlb", cfg).state_dict()
    with pytest.raises(ValueError, match="outlier_fraction: saved 0.7, now 0.5"):
        make_packer("wlb", dataclasses.replace(cfg, outlier_fraction=0.5)).load_state_dict(state)


@pytest.mark.parametrize("max_delay", [0, 1, 3])
def test_wlb_max_delay_never_exceeded(run7b, embedded_lengths, max_delay):
    (config, cost), lengths = run7b, embedded_lengths
    cfg = dataclasses.replace(config.packing, max_delay=max_delay)
    batches = first(make_packer("wlb", cfg, cost), lengths, 60)
    assert max(b.iteration - p.arrival for b in batches for p in b.pieces()) <= max_delay
    assert summarize(batches, cost).max_delay <= max_delay


@pytest.mark.parametrize("count", [10, 200])
def test_piece_orders_are_total_and_the_fast_sort_agrees(count):
    """One set of sort keys for every packer; the lexsort path (64+ pieces) orders exactly as the key."""
    from megatron_wlb.packing.types import (
        DocPiece,
        largest_first_key,
        oldest_first_key,
        shortest_first_key,
        sort_largest_first,
    )

    rng = np.random.default_rng(count)
    pieces = [DocPiece(int(d), int(o), int(n), int(a)) for d, o, n, a in
              zip(rng.integers(0, 20, count), rng.integers(0, 3, count) * 100, rng.integers(1, 6, count),
                  rng.integers(0, 4, count))]
    pieces = list(dict.fromkeys(pieces))  # distinct, with many ties in length and arrival
    assert sort_largest_first(pieces) == sorted(pieces, key=largest_first_key)
    lengths = [p.length for p in sort_largest_first(pieces)]
    assert lengths == sorted(lengths, reverse=True)
    assert [p.length for p in sorted(pieces, key=shortest_first_key)] == sorted(lengths)
    assert [p.arrival for p in sorted(pieces, key=oldest_first_key)] == sorted(p.arrival for p in pieces)


def test_diagnostics_are_a_method_of_every_packer(run7b, embedded_lengths):
    """``Packer.diagnostics()``: nothing for the plain packers, wlb's thresholds and counts, the
    solver's HiGHS statuses; and ``wlb pack --json`` reports them."""
    (config, cost), lengths = run7b, embedded_lengths
    for name in ("original", "fixed-greedy"):
        packer = make_packer(name, config.packing, cost)
        first(packer, lengths, 2)
        assert packer.diagnostics() == {}
    wlb = make_packer("wlb", dataclasses.replace(config.packing, max_delay=0), cost)
    first(wlb, lengths, 20)
    diag = wlb.diagnostics()
    assert diag["thresholds"] == list(wlb.thresholds()) and diag["forced_splits"] == wlb.forced_splits
    assert set(diag) == {"thresholds", "forced_splits", "fill_releases", "cut_stats", "delay_overruns",
                         "read_ahead_tokens", "balanced_releases"}
    json.dumps(diag)
    solver = make_packer("fixed-solver", config.packing, cost)
    first(solver, lengths, 2)
    assert solver.diagnostics() == {"solver_status": solver.solver_status, "skipped_windows": solver.skipped_windows}


def auto_thresholds(lengths, seq_len=4096, n=4, **kw):
    cfg = PackingConfig(seq_len=seq_len, n=n, **kw)
    packer = make_packer("wlb", cfg)
    batches = list(packer.pack(lengths))
    return packer, batches


def test_auto_thresholds_shapes():
    rng = np.random.default_rng(0)
    # uniform short: nothing is an outlier, nothing waits
    packer, batches = auto_thresholds(rng.integers(50, 150, size=2000))
    assert packer.thresholds()[0] > 150
    assert summarize(batches, None).max_delay == 0
    # heavy tail: L_1 sits in the tail, above the median and within the capacity
    heavy = np.minimum(6000, (20 / (1 - rng.random(3000)) ** 1.3).astype(int))
    # (fill "read-ahead": on a stream where most tokens are outliers the fill rule's top-up from waiting
    # pieces trades balance for fill, see tests/test_packing_schedule.py; this checks the thresholds)
    packer, batches = auto_thresholds(heavy, num_queues=3, fill="read-ahead")
    th = packer.thresholds()
    assert np.median(heavy) < th[0] <= packer.capacity and list(th) == sorted(set(th))
    assert summarize(batches, None).imbalance < summarize(
        list(make_packer("original", PackingConfig(seq_len=4096, n=4)).pack(heavy)), None).imbalance
    # all long: every document is an outlier, queued and released in groups
    packer, batches = auto_thresholds(np.full(200, 3500))
    assert packer.thresholds()[0] <= 3500
    assert sum(b.tokens for b in batches) == 200 * 3500


def test_auto_thresholds_survive_resume(run7b, embedded_lengths):
    (config, cost), lengths = run7b, embedded_lengths
    a = make_packer("wlb", config.packing, cost)
    first(a, lengths, 10)
    b = make_packer("wlb", config.packing, cost)
    b.load_state_dict(json.loads(json.dumps(a.state_dict())))
    assert b.thresholds() == a.thresholds() and len(a.thresholds()) >= 1


# -- errors and oversize ------------------------------------------------------------------------
@pytest.mark.parametrize("bad, needle", [([3, 0, 2], "= 0"), ([4, -7], "-7"), ([1.0, 2.5], "2.5"),
                                         (["a"], "dtype")])
def test_bad_lengths_named(bad, needle):
    with pytest.raises(ValueError, match=needle):
        validate_lengths(bad)


@pytest.mark.parametrize("kwargs, needle", [
    ({"seq_len": 128, "n": 0}, "n must be a positive integer, got 0"),
    ({"seq_len": 128, "n": 2, "max_seq_len": 64}, "max_seq_len=64 is below seq_len=128"),
    ({"seq_len": 128, "n": 2, "cut": "trim"}, "cut='trim'"),
    ({"seq_len": 128, "n": 2, "queue_thresholds": (50, 20)}, r"\(50, 20\)"),
    ({"seq_len": -5, "n": 2}, "seq_len must be a positive integer, got -5"),
])
def test_bad_config_named(kwargs, needle):
    with pytest.raises(ValueError, match=needle):
        PackingConfig(**kwargs)


@pytest.mark.parametrize("name, kwargs, needle", [
    ("wlb", {"queue_thresholds": (100, 400)}, "400 exceeds the wlb micro-batch capacity max_seq_len=150"),
    ("wlb", {"outlier_fraction": -1}, "outlier_fraction=-1"),
    ("wlb", {"release": "all"}, "release='all'"),
    ("wlb", {"cut": "some"}, "cut='some'"),
    ("fixed-solver", {"solver_nodes": 2.5}, "solver_nodes=2.5"),
    ("fixed-solver", {"solver_max_columns": 0}, "solver_max_columns must be a positive integer, got 0"),
])
def test_bad_packer_knobs_named(name, kwargs, needle):
    with pytest.raises(ValueError, match=needle):
        make_packer(name, PackingConfig(seq_len=100, n=2, max_seq_len=150, **kwargs))


def test_unknown_packer_and_foreign_state():
    with pytest.raises(ValueError, match="unknown packer 'best'"):
        make_packer("best", PackingConfig(seq_len=8, n=1))
    state = make_packer("wlb", PackingConfig(seq_len=8, n=1)).state_dict()
    with pytest.raises(ValueError, match="'wlb' packer, not 'fixed-greedy'"):
        make_packer("fixed-greedy", PackingConfig(seq_len=8, n=1)).load_state_dict(state)


@pytest.mark.parametrize("name", ["fixed-greedy", "fixed-solver", "wlb"])
def test_oversize_policies(name):
    lengths = [30, 500, 40]
    cfg = PackingConfig(seq_len=100, n=2, max_seq_len=150)
    split = make_packer(name, cfg)
    pieces = [p for b in split.pack(lengths) for p in b.pieces() if p.doc_id == 1]
    assert sorted((p.offset, p.length) for p in pieces)[0] == (0, split.capacity)
    assert sum(p.length for p in pieces) == 500 and all(p.length <= split.capacity for p in pieces)
    drop = make_packer(name, dataclasses.replace(cfg, cut="drop"))
    batches = list(drop.pack(lengths))
    assert drop.dropped == [(1, 500)] and sum(b.tokens for b in batches) == 70
    with pytest.raises(ValueError, match=f"document 1 has 500 tokens, more than the {name} packer's capacity"):
        list(make_packer(name, dataclasses.replace(cfg, cut="error")).pack(lengths))


# -- metrics ------------------------------------------------------------------------------------
def test_imbalance_definitions():
    lat = np.array([[1.0, 1.0, 2.0, 0.0], [1.0, 1.0, 1.0, 1.0]])
    assert imbalance_per_rank(lat).tolist() == [2.0, 1.0]  # 2 * 4 / 4 and 1 * 4 / 4
    assert imbalance_global(lat) == pytest.approx(2.0 / (8 / 8))
    assert piece_latency(None, [3])[0] == 9.0


def test_summarize_delay_and_capacity():
    cfg = PackingConfig(seq_len=100, n=2, max_seq_len=150, queue_thresholds=(60,), max_delay=2)
    batches = list(make_packer("wlb", cfg).pack(([70] + [10] * 19) * 3))
    m = summarize(batches, None, cfg.seq_len)
    toks = sum(b.tokens for b in batches)
    assert toks == 780 and m.tokens == 780
    assert m.unused_capacity == pytest.approx(1 - 780 / (150 * 2 * len(batches)))
    assert 0 < m.mean_delay <= 2 and m.max_delay <= 2


# -- CLI ----------------------------------------------------------------------------------------
def test_cli_pack_writes_plan(tmp_path, capsys):
    lengths = tmp_path / "lengths.txt"
    lengths.write_text("\n".join(str(x) for x in [5000, 70000, 3000, 120000] * 30))
    out = tmp_path / "plan.jsonl"
    assert main(["pack", "--lengths", str(lengths), "--config", "7b_128k", "--packer", "fixed-greedy",
                 "--iterations", "5", "--out", str(out), "--json"]) == 0
    report = json.loads(capsys.readouterr().out)
    rows = [json.loads(line) for line in out.read_text().splitlines()]
    assert len(rows) == report["iterations"] == 5
    assert rows[0]["iteration"] == 0 and len(rows[0]["micro_batches"]) == 4
    assert all(sum(p[2] for p in mb) <= 131072 for r in rows for mb in r["micro_batches"])
    assert main(["pack", "--lengths", str(lengths), "--iterations", "0"]) == 2


def test_cli_bench_quick(tmp_path, capsys):
    assert main(["bench", "--quick", "--iterations", "3", "--solver-iterations", "2", "--lengths", "stdlib",
                 "--out", str(tmp_path)]) == 0
    data = json.loads((tmp_path / "packing_bench.json").read_text())
    assert data["tables"][0]["stream"] == "stdlib" and data["tables"][0]["documents"] > 100
    assert "| Original |" in (tmp_path / "packing_bench.md").read_text()
    assert "Machine:" in capsys.readouterr().out
