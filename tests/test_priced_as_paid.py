"""Priced as paid (issue 46): a micro-batch's price is what the machine pays for it as a whole, not the sum of
its documents. A micro-batch fit keeps a whole-micro-batch term (tokens^2, tokens x pairs) only where it lowers
the held-out error across packings; ``wlb calibrate --from-trace`` takes traces of several packings and reports
the error per packing; the packers place by the marginal cost of a document under that price; every consumer
prices a micro-batch with the one function. Pure numpy: no torch."""

from __future__ import annotations

import contextlib
import io
import itertools
import json
from dataclasses import replace
from pathlib import Path

import numpy as np
import pytest

from megatron_wlb.cli.main import main
from megatron_wlb.costmodel import (
    PROFILE_FORMAT,
    AnalyticCostModel,
    CalibratedCostModel,
    ModelShape,
    ParallelLayout,
    causal_pairs,
    fit_profile,
    load_profile,
)
from megatron_wlb.costmodel.fit import BASE_TERMS, held_out_errors, select_terms
from megatron_wlb.costmodel.trace import TRACE_FORMAT, MicroBatchRow, row_to_json, trace_path_for_rank
from megatron_wlb.packing import make_packer, place_greedy
from megatron_wlb.packing.metrics import (
    SizePrice,
    bins_seconds,
    microbatch_latency,
    microbatch_seconds,
    piece_latency,
    piece_pairs,
    size_price,
)
from megatron_wlb.packing.types import MicroBatch, PackingConfig

MODEL = ModelShape("tiny", hidden=64, num_layers=2, num_heads=4, num_kv_heads=4, ffn_hidden=256, vocab=300,
                   swiglu=False)
#: per layer, forward: seconds per causal pair, per token, per micro-batch and per squared micro-batch token
A, B, C, S = 3e-8, 4e-6, 2e-4, 4e-10
BWD_A, BWD_L = 1.5, 1.4


def _time(docs: np.ndarray, size: float) -> tuple[float, float]:
    """(forward, backward) seconds per layer of a micro-batch of these documents, ``size`` per token^2."""
    t, p = float(docs.sum()), float(causal_pairs(docs, docs).sum())
    attn, lin = A * p, B * t + C + size * t * t
    return attn + lin, BWD_A * attn + BWD_L * lin


def write_trace(path: Path, packer: str, low: int, high: int, size: float = S, iterations: int = 16,
                seed: int = 0, noise: float = 0.01) -> Path:
    """One DP rank's trace of a run whose packer (named in the header) made micro-batches of ``low``-``high``
    tokens from documents of 64-1,500 tokens; times from ``_time`` with relative noise."""
    rng = np.random.default_rng(seed)
    header = {"kind": "header", "format": TRACE_FORMAT, "rank": 0, "device": "synthetic CPU", "clock": "cpu",
              "model": MODEL.to_dict(), "layout": {"tp": 1, "cp": 1, "pp": 1, "dp": 1, "vpp": 1},
              "cost_model": "analytic", "settings": {"packer": packer, "pieces": "documents"}}
    lines = [json.dumps(header)]
    for it, mb in itertools.product(range(iterations), range(4)):
        target = int(rng.integers(low, high + 1))
        docs: list[int] = []
        while sum(docs) < target:
            docs.append(int(min(rng.integers(64, 1500), max(1, target - sum(docs)))))
        d = np.asarray(docs, dtype=np.int64)
        fwd, bwd = _time(d, size)
        lines.append(row_to_json(MicroBatchRow(
            iteration=it, rank=0, dp=0, pp=0, cp=0, tp=0, chunk=0, micro_batch=mb, layers=1, tokens=int(d.sum()),
            sum_d2=float((d.astype(float) ** 2).sum()), lengths=tuple(docs), rank_tokens=int(d.sum()),
            rank_pairs=float(causal_pairs(d, d).sum()), rank_runs=int(d.size), pred_fwd_s=0.0, pred_bwd_s=0.0,
            fwd_s=fwd * (1 + noise * rng.standard_normal()), bwd_s=bwd * (1 + noise * rng.standard_normal()),
            data_s=0.0, wait_fwd_s=0.0, wait_bwd_s=0.0)))
    trace_path_for_rank(path, 0).write_text("\n".join(lines) + "\n")
    return path


def _calibrate(*args: str) -> str:
    buf = io.StringIO()
    with contextlib.redirect_stdout(buf):
        assert main(["calibrate", *args]) == 0
    return buf.getvalue()


@pytest.fixture(scope="module")
def two_packings(tmp_path_factory) -> tuple[Path, Path]:
    """Traces of a packer of small micro-batches and of one of large ones, the machine paying ``S`` per token^2."""
    tmp = tmp_path_factory.mktemp("packings")
    return (write_trace(tmp / "small.jsonl", "fixed-greedy", 1500, 4000, seed=1),
            write_trace(tmp / "large.jsonl", "wlb", 4000, 7000, seed=2))


def test_calibrate_keeps_the_size_term_and_reports_the_error_per_packing(two_packings, tmp_path):
    out = tmp_path / "profile.json"
    stdout = _calibrate("--from-trace", *map(str, two_packings), "--out", str(out), "--knots", "1")
    profile = load_profile(out)
    kept = [t for t in profile["terms"] if t not in BASE_TERMS]
    assert profile["terms"][:4] == list(BASE_TERMS) and len(kept) == 1 and kept[0] in ("tokens_sq", "tokens_pairs")
    held = profile["holdout"]["packings"]
    assert set(held) == {"fixed-greedy", "wlb"} and max(held.values()) < 0.03
    assert "held-out MAPE per packing" in stdout and f"kept {kept[0]}" in stdout
    fit = fit_profile(profile)
    assert fit.per_token_sq > 0 or fit.per_token_pair > 0
    # without the term, a fit of one packing misprices the other: the error the term removes
    base = held_out_errors({**profile, "terms": list(BASE_TERMS)})
    assert base["by"] == "packing" and base["mape"] > 1.3 * np.mean(list(held.values()))


def test_an_additive_machine_keeps_the_base_terms(tmp_path):
    traces = [write_trace(tmp_path / "a.jsonl", "fixed-greedy", 1500, 4000, size=0.0, seed=3),
              write_trace(tmp_path / "b.jsonl", "wlb", 4000, 7000, size=0.0, seed=4)]
    out = tmp_path / "profile.json"
    stdout = _calibrate("--from-trace", *map(str, traces), "--out", str(out), "--knots", "1")
    profile = load_profile(out)
    assert profile["terms"] == list(BASE_TERMS) and "none kept" in stdout
    assert not CalibratedCostModel(profile, MODEL, ParallelLayout()).prices_size


def test_select_terms_on_one_packing_holds_out_iterations(two_packings):
    from megatron_wlb.costmodel.trace import profile_points, read_trace

    trace = read_trace(two_packings[1])
    points = profile_points(trace.micro_batches, {"pp": 1, "cp": 1})
    profile = {"format": PROFILE_FORMAT, "device": "x", "model": MODEL.to_dict(), "tp": 1, "micro_batches": points}
    terms, report = select_terms(profile)
    assert report["base"]["by"] == "iterations" and "tokens_sq" in terms or "tokens_pairs" in terms


def test_a_profile_without_terms_prices_as_before(tmp_path, two_packings):
    """A profile written before the choice has no "terms": the base fit, additive, as it priced then."""
    out = tmp_path / "p.json"
    _calibrate("--from-trace", str(two_packings[0]), "--out", str(out), "--knots", "1")
    profile = json.loads(out.read_text())
    old = {k: v for k, v in profile.items() if k not in ("terms", "term_selection")}
    fit = fit_profile(old)
    assert fit.terms == BASE_TERMS and fit.per_token_sq == 0.0 and fit.per_token_pair == 0.0
    bad = tmp_path / "bad.json"
    bad.write_text(json.dumps({**profile, "terms": ["pairs", "tokens", "runs", "micro_batch", "tokens_cubed"]}))
    with pytest.raises(ValueError, match="tokens_cubed"):
        load_profile(bad)


# -- the one price ---------------------------------------------------------------------------------------------
@pytest.fixture(scope="module")
def sized_cost(two_packings, tmp_path_factory) -> CalibratedCostModel:
    out = tmp_path_factory.mktemp("cost") / "profile.json"
    _calibrate("--from-trace", *map(str, two_packings), "--out", str(out), "--knots", "1")
    return CalibratedCostModel.from_json(out, MODEL, ParallelLayout(dp=2))


def test_every_micro_batch_price_adds_the_size_term(sized_cost):
    cost = sized_cost
    assert cost.prices_size and size_price(cost)
    assert not size_price(AnalyticCostModel(MODEL, ParallelLayout()))
    d = np.array([3000, 1500, 700])
    alone = float(piece_latency(cost, d).sum())
    whole = microbatch_latency(cost, MicroBatch(tuple(_pieces(d)), 8192))
    expected = alone + cost.microbatch_overhead * (1 + cost.hardware.bwd_linear) + float(size_price(cost)(
        d.sum(), piece_pairs(d).sum()))
    assert whole == pytest.approx(expected)
    fwd, bwd = bins_seconds(cost, [d, np.array([], dtype=np.int64)])
    assert fwd[0] + bwd[0] == pytest.approx(whole) and fwd[1] == bwd[1] == 0.0
    with pytest.raises(ValueError, match="tokens and pairs"):
        microbatch_seconds(cost, np.array([alone]), np.array([alone / 2]))


def _pieces(lengths: np.ndarray):
    from megatron_wlb.packing.types import DocPiece

    return [DocPiece(i, 0, int(x), 0) for i, x in enumerate(lengths)]


def test_place_greedy_takes_the_least_price_after_the_piece():
    """Against brute force: each item goes to the bin whose price after it is least among those with room (every
    bin may be priced: ``max_visits=None``; the default prices the few least-priced bins)."""
    rng = np.random.default_rng(0)
    size = SizePrice(tokens_sq=1e-3, tokens_pairs=2e-7)
    for _ in range(40):
        bins, cap = int(rng.integers(2, 7)), 600
        lengths = sorted(rng.integers(1, 300, size=int(rng.integers(3, 20))).tolist(), reverse=True)
        weights = [float(d) ** 1.5 for d in lengths]
        work, toks, pairs = [0.0] * bins, [0] * bins, [0.0] * bins
        where = place_greedy(lengths, weights, work, toks, cap, size, pairs, max_visits=None)
        w2, t2, p2 = [0.0] * bins, [0] * bins, [0.0] * bins
        for d, w, j in zip(lengths, weights, where):
            p = d * (d + 1) / 2
            after = [w2[k] + w + float(size(t2[k] + d, p2[k] + p)) if t2[k] + d <= cap else np.inf
                     for k in range(bins)]
            best = int(np.argmin(after)) if np.isfinite(min(after)) else -1
            if best >= 0:
                assert after[j] == pytest.approx(after[best], rel=1e-12)
                w2[j] += w
                t2[j] += d
                p2[j] += p
            else:
                assert j == -1
        assert toks == t2


def test_place_greedy_without_a_size_price_is_the_additive_placement():
    rng = np.random.default_rng(1)
    lengths = sorted(rng.integers(1, 300, size=50).tolist(), reverse=True)
    weights = [float(d) ** 2 for d in lengths]
    a = place_greedy(lengths, weights, [0.0] * 6, [0] * 6, 900)
    b = place_greedy(lengths, weights, [0.0] * 6, [0] * 6, 900, SizePrice(), [0.0] * 6)
    assert a == b


@pytest.mark.parametrize("packer", ["wlb", "fixed-greedy"])
def test_packers_balance_the_price_the_machine_pays(sized_cost, packer):
    """Under a non-additive price, placing by the marginal cost leaves the slowest micro-batch cheaper than
    placing by the sum of the documents (the same packer with the size term hidden from it), every document once."""
    from megatron_wlb.data import load_lengths

    lengths = load_lengths()[:3000] // 16 + 1
    config = PackingConfig(dp=2, n=4, seq_len=4096, max_seq_len=6144)
    fit = sized_cost.fit
    hidden = CalibratedCostModel.from_fit(replace(fit, per_token_sq=0.0, per_token_pair=0.0), sized_cost.model,
                                          sized_cost.layout)
    assert not hidden.prices_size
    plans = {name: list(make_packer(packer, config, cost).pack(lengths))[:20]
             for name, cost in (("aware", sized_cost), ("blind", hidden))}
    for batches in plans.values():
        seen = [(q.doc_id, q.offset, q.length) for b in batches for q in b.pieces()]
        assert len(seen) == len(set(seen))
    worst = {name: np.mean([max(microbatch_latency(sized_cost, mb) for mb in b.micro_batches) for b in batches])
             for name, batches in plans.items()}
    assert worst["aware"] < worst["blind"]
