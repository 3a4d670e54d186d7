"""benchmarks/bench_cost_fit.py: the within-iteration error separates the machine's drift from the model's error."""

from __future__ import annotations

import numpy as np
import pytest
from conftest import load_script


def _profile(speeds: np.ndarray, noise: float, seed: int = 0) -> dict:
    """Micro-batches whose time is a fixed linear cost times their iteration's speed (and a little noise)."""
    from megatron_wlb.costmodel import PROFILE_FORMAT, ModelShape

    rng = np.random.default_rng(seed)
    rows = 8 * speeds.size
    iteration = np.repeat(np.arange(speeds.size), 8)
    tokens = rng.integers(2_000, 6_000, rows).astype(float)
    pairs = tokens * rng.integers(200, 2_000, rows)
    runs = rng.integers(1, 6, rows).astype(float)
    fwd = (3e-8 * pairs + 2e-5 * tokens + 1e-3 * runs) * speeds[iteration] * rng.lognormal(0, noise, rows)
    model = ModelShape("tiny", hidden=64, num_layers=2, num_heads=4, num_kv_heads=4, ffn_hidden=256, vocab=300)
    return {"format": PROFILE_FORMAT, "device": "cpu", "model": model.to_dict(), "tp": 1,
            "micro_batches": {"pairs": pairs.tolist(), "tokens": tokens.tolist(), "head_tokens": tokens.tolist(),
                              "runs": runs.tolist(), "fwd_s": fwd.tolist(), "bwd_s": (1.5 * fwd).tolist(),
                              "iteration": iteration.tolist()}}


def test_a_drifting_machine_is_accurate_within_an_iteration():
    bench = load_script("bench_cost_fit")
    from megatron_wlb.costmodel import holdout_every, holdout_mape

    speeds = np.exp(np.random.default_rng(1).normal(0, 0.2, 40))  # the machine drifts 20% between iterations
    profile = _profile(speeds, noise=0.01)
    within = bench.within_iteration(profile, 5)
    mask, _ = holdout_every(np.asarray(profile["micro_batches"]["iteration"]), 5)
    plain = holdout_mape(profile, mask)["mape"]
    assert within["mape"] < 0.03 < 0.1 < plain  # the drift is the plain error, not the model's
    assert within["held_out"] >= 40 and within["speed_p10_p90"][0] < 0.85 < 1.15 < within["speed_p10_p90"][1]


def test_without_drift_within_iteration_matches_the_plain_error():
    bench = load_script("bench_cost_fit")
    within = bench.within_iteration(_profile(np.ones(40), noise=0.05), 5)
    assert within["mape"] == pytest.approx(0.04, abs=0.015)  # the lognormal noise's mean absolute error
    assert within["speed_p10_p90"][1] - within["speed_p10_p90"][0] < 0.1
