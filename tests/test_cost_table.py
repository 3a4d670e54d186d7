"""Attention's per-pair cost as a table over query-run lengths (costmodel.table): fitted where a cost linear
in pairs cannot be, old profiles unchanged, conditioning guarded."""

from __future__ import annotations

import json

import numpy as np
import pytest

from megatron_wlb.costmodel import (
    PROFILE_FORMAT,
    CalibratedCostModel,
    ModelShape,
    ParallelLayout,
    fit_profile,
    holdout_every,
    holdout_mape,
    load_profile,
)
from megatron_wlb.costmodel.table import choose_knots, fit_table, pair_basis, table_columns

MODEL = ModelShape("t", hidden=64, num_layers=2, num_heads=4, num_kv_heads=4, ffn_hidden=256, vocab=300, swiglu=True)


def true_per_pair(d: np.ndarray) -> np.ndarray:
    """A CPU-like per-pair cost: flat to 128, rising 1.6x from 256 to 1,024 (cache), flat after."""
    x = np.clip(np.log2(np.maximum(d, 1.0)), 8.0, 10.0)
    return 20e-9 * (1.0 + 0.3 * (x - 8.0))


def synthetic_profile(n: int = 200, seed: int = 0, noise: float = 0.0) -> dict:
    """Packed micro-batches of 1,024 tokens, heavy-tailed documents, timed by a model whose per-pair cost
    rises with the document's length; forward = 45% of forward + backward."""
    rng = np.random.default_rng(seed)
    pts: dict[str, list] = {k: [] for k in ("pairs", "tokens", "runs", "head_tokens", "fwd_s", "bwd_s", "iteration",
                                            "run_lengths", "run_pairs")}
    for i in range(n):
        docs: list[int] = []
        while sum(docs) < 1024:
            docs.append(int(min(np.exp(rng.uniform(np.log(16), np.log(1024))), 1024 - sum(docs))))
        d = np.asarray(docs, dtype=np.float64)
        pairs = d * (d + 1) / 2
        total = pairs @ true_per_pair(d) + 4e-6 * d.sum() + 1e-4 * d.size + 2e-3
        total *= 1.0 + noise * rng.standard_normal()
        for key, value in (("pairs", pairs.sum()), ("tokens", d.sum()), ("runs", d.size), ("head_tokens", 0.0),
                           ("fwd_s", 0.45 * total), ("bwd_s", 0.55 * total), ("iteration", i),
                           ("run_lengths", d.astype(int).tolist()), ("run_pairs", pairs.tolist())):
            pts[key].append(value)
    return {"format": PROFILE_FORMAT, "device": "synthetic", "model": MODEL.to_dict(), "tp": 1, "micro_batches": pts}


def with_table(profile: dict, knots: int = 5) -> dict:
    mb = profile["micro_batches"]
    lengths = np.concatenate([np.asarray(r, dtype=np.float64) for r in mb["run_lengths"]])
    pairs = np.concatenate([np.asarray(r, dtype=np.float64) for r in mb["run_pairs"]])
    return {**profile, "attention_table": {"lengths": list(choose_knots(lengths, pairs, knots))}}


def test_pair_basis_interpolates_in_log_length_and_clamps():
    basis = pair_basis([64, 256, 512, 1024, 4096], [256.0, 1024.0])
    np.testing.assert_allclose(basis, [[1, 0], [1, 0], [0.5, 0.5], [0, 1], [0, 1]])
    assert np.allclose(pair_basis([3, 300], [100.0]), 1.0)  # one knot: one cost per pair


def test_table_fits_a_rising_per_pair_cost_that_a_linear_cost_cannot():
    profile = synthetic_profile()
    mask, _ = holdout_every(np.asarray(profile["micro_batches"]["iteration"]), 5)
    old = holdout_mape(profile, mask)["mape"]
    new = holdout_mape(with_table(profile), mask)["mape"]
    assert new <= 0.02 and new < old / 5  # the linear cost's error is the table's many times over
    fit = fit_profile(with_table(profile))
    per_pair = fit.per_pair(np.array([256.0, 1024.0]))
    assert 1.3 < per_pair[1] / per_pair[0] < 1.7  # truth 1.6, pulled toward flat by the smoothing
    assert np.isfinite(fit.extra["table"]["condition_regularised"])


def test_calibrated_model_prices_runs_by_their_length():
    profile = with_table(synthetic_profile())
    cost, fit = CalibratedCostModel(profile, MODEL, ParallelLayout()), fit_profile(profile)
    d = np.array([64.0, 256.0, 700.0, 1024.0])
    np.testing.assert_allclose(cost.attention_run(d, d) - fit.attn_per_run, fit.per_pair(d) * d * (d + 1) / 2)
    assert fit.per_pair(1024.0) > 1.3 * fit.per_pair(256.0)


def test_old_profiles_load_and_price_as_before(tmp_path):
    """A profile without a table is the one-knot form: no table, attention_run linear in pairs."""
    profile = synthetic_profile(n=40)
    for key in ("run_lengths", "run_pairs"):
        del profile["micro_batches"][key]
    path = tmp_path / "old.json"
    path.write_text(json.dumps(profile))
    fit = fit_profile(load_profile(path))
    assert fit.pair_lengths == () and fit.pair_costs == ()
    cost = CalibratedCostModel.from_json(path, MODEL, ParallelLayout())
    a = cost.attention_run(np.array([100.0, 1000.0]), np.array([100.0, 1000.0]))
    np.testing.assert_allclose(a, fit.attn_per_pair * np.array([5050.0, 500500.0]) + fit.attn_per_run)
    with pytest.raises(ValueError, match="run_lengths and run_pairs"):
        path.write_text(json.dumps({**profile, "attention_table": {"lengths": [64, 512]}}))
        load_profile(path)
    with pytest.raises(ValueError, match="strictly increasing"):
        path.write_text(json.dumps({**synthetic_profile(n=5), "attention_table": {"lengths": [512, 64]}}))
        load_profile(path)


def test_conditioning_guard_gives_finite_non_negative_fits():
    """Equal-token micro-batches (per-token and constant columns collinear) and knots no run sits between
    (two identical knot columns): the fit is finite and non-negative, and says how ill-conditioned."""
    rng = np.random.default_rng(1)
    d = rng.integers(50, 60, size=(30, 1)).astype(np.float64)
    pairs = d * (d + 1) / 2
    cols = table_columns(d.astype(int).tolist(), pairs.tolist(), [64.0, 128.0, 256.0])
    x = np.concatenate([cols, np.full((30, 1), 1024.0), np.ones((30, 1))], axis=1)
    y = pairs[:, 0] * 2e-8 + 1024 * 4e-6 + 1e-3
    tf = fit_table(x, y, knots=3, flat_cost=2e-8)
    assert np.all(np.isfinite(tf.coef)) and np.all(tf.coef >= 0)
    assert tf.condition > 1e6 and tf.condition_regularised < tf.condition
    assert tf.rel_err < 0.01
    with pytest.raises(ValueError, match="positive time"):
        fit_table(x, -y, knots=3, flat_cost=2e-8)


def test_calibrate_from_trace_writes_the_table_and_knots_1_the_old_form(tmp_path, capsys):
    from test_trace_fit import write_trace

    from megatron_wlb.cli.main import main

    trace = write_trace(tmp_path / "trace.jsonl")
    assert main(["calibrate", "--from-trace", str(trace), "--out", str(tmp_path / "t.json")]) == 0
    out = capsys.readouterr().out
    profile = load_profile(tmp_path / "t.json")
    table = profile["attention_table"]
    assert len(table["lengths"]) >= 2 and len(table["per_pair_fwd_s"]) == len(table["lengths"])
    assert profile["holdout"]["mape"] < 0.04 and "linear_in_pairs_mape" in profile["holdout"]
    assert "attention table" in out and "condition number" in out
    assert main(["calibrate", "--from-trace", str(trace), "--out", str(tmp_path / "o.json"), "--knots", "1"]) == 0
    assert "attention_table" not in load_profile(tmp_path / "o.json")
