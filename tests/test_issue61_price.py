"""Predicted as measured, CP included (issue 61): each CP rank priced as laid out, CP communication and empty
micro-batches in the calibrated price, terms chosen by the held-out ratio error between packings and layouts, and
the dynamic-CP planner never slower (by its price) than the fixed groups. Pure numpy: no torch."""

from __future__ import annotations

import itertools
import json
from pathlib import Path

import numpy as np
import pytest
from test_priced_as_paid import MODEL, _calibrate  # the tiny GPT's shape; `wlb calibrate` in this process

from megatron_wlb.costmodel import (
    AnalyticCostModel,
    CalibratedCostModel,
    ParallelLayout,
    causal_pairs,
    fit_profile,
    get_model,
    load_profile,
)
from megatron_wlb.costmodel.trace import TRACE_FORMAT, MicroBatchRow, row_to_json, trace_path_for_rank
from megatron_wlb.cp.dynamic import group_cost_models, plan_dynamic_cp
from megatron_wlb.cp.dynamic_steps import packer_placement
from megatron_wlb.cp.efficiency import KernelEfficiency
from megatron_wlb.cp.layouts import build_layout
from megatron_wlb.packing.metrics import bins_seconds, share_seconds

#: the synthetic machine, per layer forward: per causal pair, per token, per micro-batch, per CP all-gather step,
#: per K/V token gathered; an empty micro-batch's forward and backward
A, B, C, CALL, KV = 3e-8, 4e-6, 2e-4, 1.5e-3, 2e-6
EMPTY_F, EMPTY_B = 4e-4, 6e-4
BWD_A, BWD_L = 1.5, 1.4


def _machine(tokens: float, pairs: float, group: int, total: float) -> tuple[float, float]:
    attn = A * pairs
    lin = B * tokens + C + CALL * (group - 1) + KV * total * (group - 1) / group
    return attn + lin, BWD_A * attn + BWD_L * lin


def _docs(rng: np.random.Generator, target: int) -> np.ndarray:
    docs: list[int] = []
    while sum(docs) < target:
        docs.append(int(min(rng.integers(32, 3000), max(1, target - sum(docs)))))
    return np.asarray(docs, dtype=np.int64)


def write_trace(path: Path, packer: str, sharding: str, cp: int, seed: int, iterations: int = 14,
                empties: int = 0, noise: float = 0.01) -> Path:
    """One DP rank's CP group's trace (``cp`` rank files' rows in one file) of micro-batches laid out by ``sharding``,
    timed by ``_machine`` with relative noise; ``empties`` empty micro-batches per iteration."""
    rng = np.random.default_rng(seed)
    header = {"kind": "header", "format": TRACE_FORMAT, "rank": 0, "device": "synthetic CPU", "clock": "cpu",
              "model": MODEL.to_dict(), "layout": {"tp": 1, "cp": cp, "pp": 1, "dp": 1, "vpp": 1},
              "cost_model": "analytic", "settings": {"packer": packer, "pieces": "documents", "cp_sharding": sharding}}
    lines = [json.dumps(header)]
    for it, mb in itertools.product(range(iterations), range(4 + empties)):
        d = _docs(rng, int(rng.integers(1500, 6000))) if mb < 4 else np.zeros(0, dtype=np.int64)
        layout = build_layout(sharding, d, cp) if d.size else None
        for r in range(cp):
            q: tuple[int, ...] = ()
            kv: tuple[int, ...] = ()
            if layout is None:
                tokens, pairs, runs, fwd, bwd = 0, 0.0, 0, EMPTY_F, EMPTY_B
            else:
                shard = layout.ranks[r]
                q, kv = tuple(int(x) for x in shard.query_lengths), tuple(int(x) for x in shard.key_lengths)
                tokens = int(shard.num_tokens)
                pairs = float(causal_pairs(shard.query_lengths, shard.key_lengths).sum())
                runs = int(shard.query_runs.shape[0])
                fwd, bwd = _machine(tokens, pairs, cp, float(d.sum()))
            lines.append(row_to_json(MicroBatchRow(
                iteration=it, rank=r, dp=0, pp=0, cp=r, tp=0, chunk=0, micro_batch=mb, layers=1, tokens=int(d.sum()),
                sum_d2=float((d.astype(float) ** 2).sum()), lengths=tuple(int(x) for x in d), rank_tokens=tokens,
                rank_pairs=pairs, rank_runs=runs, pred_fwd_s=0.0, pred_bwd_s=0.0,
                fwd_s=fwd * (1 + noise * rng.standard_normal()), bwd_s=bwd * (1 + noise * rng.standard_normal()),
                data_s=0.0, wait_fwd_s=0.0, wait_bwd_s=0.0, group=cp, run_q=q, run_kv=kv)))
    trace_path_for_rank(path, 0).write_text("\n".join(lines) + "\n")
    return path


# -- each CP rank priced as laid out ---------------------------------------------------------------------------
def test_per_sequence_sharding_is_priced_uneven_and_cp1_is_the_micro_batch_price():
    cost = AnalyticCostModel(get_model("7b"), ParallelLayout(cp=2))  # attention most of the work at 41K tokens
    lengths = np.array([30000] + [1000] * 11)
    seq = build_layout("per-sequence", lengths, 2, cost=cost, tile=1)
    doc = build_layout("per-document", lengths, 2, cost=cost, tile=1)
    seq_f, seq_b = seq.seconds(cost, tile=1)
    doc_f, doc_b = doc.seconds(cost, tile=1)
    # per-sequence gives one rank most of the long document's pairs: priced so, not as an even share
    assert (seq_f + seq_b).max() > 1.2 * (doc_f + doc_b).max()
    assert (doc_f + doc_b).max() / (doc_f + doc_b).min() < 1.05
    assert seq.rank_pairs.sum() == pytest.approx(causal_pairs(lengths, lengths).sum())
    # CP 1: a rank's share is the whole micro-batch, priced exactly as the packer prices it (with the kernel at
    # full efficiency: the analytic layouts derate short query runs by the kernel table, the packer does not)
    one = AnalyticCostModel(get_model("7b"), ParallelLayout())
    flat = KernelEfficiency.flat()
    f1, b1 = build_layout("per-document", lengths, 1, cost=one, tile=1).seconds(one, efficiency=flat, tile=1)
    f, b = bins_seconds(one, [lengths])
    assert f1[0] == pytest.approx(f[0]) and b1[0] == pytest.approx(b[0])
    # the adaptive chooser compares the two by that price and takes the faster
    chosen = build_layout("adaptive", lengths, 2, cost=cost, tile=1)
    assert chosen.name == "per-document" and chosen.estimates["per-sequence"] > chosen.estimates["per-document"]


# -- CP communication and empty micro-batches in the calibrated price ------------------------------------------
@pytest.fixture(scope="module")
def layouts(tmp_path_factory) -> list[Path]:
    """Traces of CP 1 (two packers) and CP 2 (per-document with empty micro-batches, and per-sequence)."""
    tmp = tmp_path_factory.mktemp("layouts")
    return [write_trace(tmp / "a.jsonl", "fixed-greedy", "per-sequence", 1, seed=1),
            write_trace(tmp / "b.jsonl", "wlb", "per-sequence", 1, seed=2),
            write_trace(tmp / "c.jsonl", "wlb", "per-document", 2, seed=3, empties=1),
            write_trace(tmp / "d.jsonl", "wlb", "per-sequence", 2, seed=4)]


def test_calibration_over_layouts_fits_cp_communication_and_empty_micro_batches(layouts, tmp_path):
    out = tmp_path / "profile.json"
    stdout = _calibrate("--from-trace", *map(str, layouts), "--out", str(out), "--knots", "1")
    profile = load_profile(out)
    assert {"cp_calls", "cp_kv"} & set(profile["terms"]), profile["term_selection"]
    fit = fit_profile(profile)
    assert fit.empty_fwd + fit.empty_bwd == pytest.approx(EMPTY_F + EMPTY_B, rel=0.05)
    empty_f, empty_b = share_seconds(CalibratedCostModel(profile, MODEL, ParallelLayout(cp=2)), np.zeros(2),
                                     np.zeros(2), np.zeros(2), 0.0)
    assert np.allclose(empty_f + empty_b, fit.empty_fwd + fit.empty_bwd)  # an empty micro-batch costs that much
    # the fitted CP price of a CP2 micro-batch is the machine's within a few percent
    cp2 = CalibratedCostModel(profile, MODEL, ParallelLayout(cp=2))
    lengths = np.array([2500, 900, 400, 200])
    layout = build_layout("per-sequence", lengths, 2, cost=cp2)
    fwd, bwd = layout.seconds(cp2)
    truth = [sum(_machine(float(r.num_tokens), float(causal_pairs(r.query_lengths, r.key_lengths).sum()), 2,
                          float(lengths.sum()))) for r in layout.ranks]
    assert np.allclose(fwd + bwd, truth, rtol=0.05)
    # the ratio between layouts is what decides plans: held out, every layout's bias is within 2% of the others
    assert profile["term_selection"]["resolved"]["cp_kv"] == "kept"
    biases = profile["term_selection"]["biases"]
    assert len(biases) == 4 and max(biases.values()) / min(biases.values()) < 1.02
    assert "noise floor" in stdout and "slowest-rank bias" in stdout and "empty micro-batches: 24 measured" in stdout


def test_without_cp_terms_the_layouts_ratio_is_mispriced(layouts, tmp_path):
    """What the CP terms buy, measured on what they decide: a fit kept to the base terms misprices CP2 against CP1."""
    from megatron_wlb.costmodel.fit import BASE_TERMS, held_out_errors

    out = tmp_path / "profile.json"
    _calibrate("--from-trace", *map(str, layouts), "--out", str(out), "--knots", "1")
    profile = json.loads(out.read_text())
    base = held_out_errors({**profile, "terms": list(BASE_TERMS)})
    kept = held_out_errors(profile)
    assert base["ratio_error"] > 2 * kept["ratio_error"] and base["ratio_error"] > 0.02


# -- the dynamic-CP planner decides with that price -----------------------------------------------------------
def test_dynamic_cp_never_plans_slower_than_the_fixed_groups_and_prices_its_empties():
    cost = AnalyticCostModel(MODEL, ParallelLayout(dp=2, cp=2))
    costs = group_cost_models(cost, 4)
    rng = np.random.default_rng(7)
    chose_fixed = 0
    for _ in range(12):
        mbs = [_docs(rng, int(rng.integers(500, 4000))).tolist() for _ in range(8)]
        lengths, placement = packer_placement(mbs, 4)
        plan = plan_dynamic_cp(lengths, 4, 4096, costs, max_micro_batches=4, fixed_plan=placement)
        # the same documents as packed, on the fixed CP2 groups (DP rank r's micro-batches on slots 2r, 2r + 1)
        on_fixed = [sum(float(np.sum(bins_seconds(costs[2], [np.asarray(mb)]))) for mb in mbs[r * 4:(r + 1) * 4])
                    for r in range(2)]
        assert plan.slowest_seconds <= max(on_fixed) * (1 + 1e-9)
        chose_fixed += plan.fixed
        assert plan.count == 4
        empties = [4 - len(m) for m in plan.rank_micro_batches]
        assert np.allclose(plan.slot_seconds, plan.rank_seconds + np.asarray(empties) * plan.empty_seconds)
    assert chose_fixed < 12  # it plans dynamically where that is faster


def test_a_cp_row_is_fitted_on_its_own_query_runs(layouts):
    """A CP rank's attention table points are its own query runs (the trace records them), not a share of each
    document: per-sequence sharding gives one rank a whole document and the other none of it."""
    from megatron_wlb.costmodel.trace import profile_points, read_trace

    trace = read_trace(layouts[3])  # CP2 per-sequence
    points = profile_points(trace.micro_batches, {"cp": 2, "pp": 1})
    rows = [r for r in trace.micro_batches if r.lengths and r.rank_tokens]
    assert [list(r.run_q) for r in rows] == points["run_lengths"]
    assert np.allclose([sum(p) for p in points["run_pairs"]], points["pairs"])
    assert any(max(r.run_q) > max(r.lengths) / 2 for r in rows)  # a run longer than a document's even share
