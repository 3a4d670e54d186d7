"""Cost model: closed forms of the analytic model, the calibrated fit recovering known curves (kernel sweeps and
measured micro-batches), and the held-out MAPE that checks a fit."""

import json

import numpy as np
import pytest

from megatron_wlb.costmodel import (
    PROFILE_FORMAT,
    AnalyticCostModel,
    CalibratedCostModel,
    ModelShape,
    ParallelLayout,
    build_cost_model,
    causal_pairs,
    fit_profile,
    get_model,
    holdout_every,
    holdout_mape,
    load_profile,
    nnls_gram,
)


def test_causal_pairs_whole_document_and_run():
    assert causal_pairs(4, 4) == 10  # 1 + 2 + 3 + 4
    assert causal_pairs(2, 4) == 7  # queries at positions 2, 3 see 3 + 4 keys
    with pytest.raises(ValueError, match="q_len > kv_len"):
        causal_pairs(5, 4)


def test_attention_is_quadratic_and_linear_is_linear():
    cost = AnalyticCostModel(get_model("7b"), ParallelLayout())
    a1, a2 = cost.attention(np.array([8192, 16384]))
    l1, l2 = cost.linear(np.array([8192, 16384]))
    assert a2 / a1 == pytest.approx(4.0, rel=1e-3)
    assert l2 / l1 == pytest.approx(2.0, rel=1e-9)


def test_workload_matches_flop_count():
    shape = get_model("7b")
    cost = AnalyticCostModel(shape, ParallelLayout())
    d = 4096
    flops = shape.linear_flops_per_token() * d
    assert cost.linear(np.array([d]))[0] == pytest.approx(flops / (cost.hardware.gemm_tflops * 1e12))
    attn = shape.attention_flops_per_pair() * d * (d + 1) / 2
    assert cost.attention(np.array([d]))[0] == pytest.approx(attn / (cost.hardware.attention_tflops * 1e12))


def test_tp_and_cp_divide_work_and_add_communication():
    shape = get_model("7b")
    single = AnalyticCostModel(shape, ParallelLayout())
    split = AnalyticCostModel(shape, ParallelLayout(tp=4, cp=2))
    d = np.array([65536])
    assert split.attention(d)[0] == pytest.approx(single.attention(d)[0] / 8)
    assert split.linear(d)[0] > single.linear(d)[0] / 8  # collectives are not free
    assert single.tp_comm(d)[0] == 0 and single.cp_comm(d)[0] == 0


def test_microbatch_cost_sums_documents_plus_overhead():
    """The one micro-batch cost (packing.metrics.microbatch_seconds): pieces' forward and
    backward seconds, plus the fixed overhead of a non-empty micro-batch; an empty one costs 0.
    The packer's dealing step and the metrics both read it."""
    from megatron_wlb.packing.metrics import microbatch_seconds, piece_forward, piece_latency

    cost = build_cost_model("70b", ParallelLayout(tp=8, cp=4))
    lengths = np.array([100, 2000, 30000])
    hw = cost.hardware
    fwd, bwd = microbatch_seconds(cost, np.array([piece_latency(cost, lengths).sum(), 0.0]),
                                  np.array([piece_forward(cost, lengths).sum(), 0.0]))
    assert fwd[0] == pytest.approx(cost.workload(lengths).sum() + cost.microbatch_overhead)
    assert bwd[0] == pytest.approx(hw.bwd_attention * cost.attention(lengths).sum()
                                   + hw.bwd_linear * (cost.linear(lengths).sum() + cost.microbatch_overhead))
    assert (fwd[1], bwd[1]) == (0.0, 0.0)
    assert cost.backward(np.array(1.0), np.array(0.0)) == hw.bwd_attention
    assert cost.forward_backward(np.array(0.0), np.array(1.0)) == 1.0 + hw.bwd_linear
    d2_fwd, d2_bwd = microbatch_seconds(None, np.array([9.0]))
    assert (d2_fwd[0], d2_bwd[0]) == (3.0, 6.0)  # d**2 weights without a cost model, split 1 : 2
    with pytest.raises(ValueError, match="forward seconds"):
        microbatch_seconds(cost, np.array([1.0]))


def test_bad_shapes_and_lengths_are_named():
    with pytest.raises(ValueError, match="num_kv_heads"):
        ModelShape("x", hidden=64, num_layers=1, num_heads=4, num_kv_heads=3, ffn_hidden=8, vocab=8)
    with pytest.raises(ValueError, match="tp"):
        ParallelLayout(tp=0)
    with pytest.raises(ValueError, match="unknown model"):
        get_model("13x")
    with pytest.raises(ValueError, match="non-negative integers"):
        AnalyticCostModel(get_model("7b"), ParallelLayout()).workload(np.array([1.5]))


def _synthetic_profile(a=3e-13, b=2e-9, c=1.5e-8, overhead=4e-5, noise=0.0, seed=0):
    rng = np.random.default_rng(seed)
    lengths = np.array([128, 512, 2048, 8192, 32768, 131072])
    tokens = np.array([1024, 4096, 16384, 65536])
    attn = a * causal_pairs(lengths, lengths) + b * lengths + overhead / 2
    lin = c * tokens + overhead / 2
    attn *= 1 + noise * rng.standard_normal(attn.size)
    lin *= 1 + noise * rng.standard_normal(lin.size)
    return {
        "format": PROFILE_FORMAT, "device": "synthetic", "model": get_model("7b").to_dict(), "tp": 1,
        "attention": {"lengths": lengths.tolist(), "fwd_s": attn.tolist(), "bwd_s": (2.4 * attn).tolist()},
        "linear": {"tokens": tokens.tolist(), "fwd_s": lin.tolist(), "bwd_s": (2.1 * lin).tolist()},
    }


def test_calibrated_fit_recovers_known_coefficients(tmp_path):
    path = tmp_path / "profile.json"
    path.write_text(json.dumps(_synthetic_profile()))
    cost = CalibratedCostModel.from_json(path, get_model("7b"), ParallelLayout())
    assert cost.fit.attn_per_pair == pytest.approx(3e-13, rel=1e-6)
    assert cost.fit.linear_per_token == pytest.approx(1.5e-8, rel=1e-6)
    assert cost.fit.attn_rel_err < 1e-6
    assert cost.hardware.bwd_attention == pytest.approx(2.4)
    assert cost.hardware.bwd_linear == pytest.approx(2.1)


def test_calibrated_model_rescales_to_tp_and_heads(tmp_path):
    path = tmp_path / "profile.json"
    path.write_text(json.dumps(_synthetic_profile(noise=0.02)))
    base = CalibratedCostModel.from_json(path, get_model("7b"), ParallelLayout())
    tp2 = CalibratedCostModel.from_json(path, get_model("7b"), ParallelLayout(tp=2))
    d = np.array([16384])
    assert tp2.attention_run(d, d)[0] == pytest.approx(base.attention_run(d, d)[0] / 2)
    assert tp2.linear_compute(d)[0] == pytest.approx(base.linear_compute(d)[0] / 2)
    assert base.fit.attn_rel_err < 0.05


def test_profile_validation_names_the_problem(tmp_path):
    bad = _synthetic_profile()
    bad["format"] = "other"
    path = tmp_path / "bad.json"
    path.write_text(json.dumps(bad))
    with pytest.raises(ValueError, match="format"):
        build_cost_model("7b", ParallelLayout(), profile=path)
    bad = _synthetic_profile()
    bad["linear"]["fwd_s"] = bad["linear"]["fwd_s"][:-1]
    path.write_text(json.dumps(bad))
    with pytest.raises(ValueError, match="differ in length"):
        build_cost_model("7b", ParallelLayout(), profile=path)


def test_training_flops_count_attention_within_documents_only():
    from megatron_wlb.costmodel.shapes import ModelShape

    shape = ModelShape("t", hidden=64, num_layers=2, num_heads=4, num_kv_heads=4, ffn_hidden=128, vocab=100)
    per_token = 2 * shape.linear_flops_per_token() + 2 * 64 * 100  # layers' GEMMs + LM head
    one = shape.training_flops([10])
    two = shape.training_flops([5, 5])  # same tokens, two documents: fewer attention pairs
    assert one - two == pytest.approx(3 * 2 * shape.attention_flops_per_pair() * (55 - 30))
    assert two == pytest.approx(3 * (10 * per_token + 2 * shape.attention_flops_per_pair() * 30))


#: per layer: s/pair, s/token, s/micro-batch forward; backward / forward of attention and of the GEMMs
MB_TRUE = (5e-13, 2e-8, 3e-5, 2.4, 2.1)


def _micro_batch_points(n=40, noise=0.0, seed=1, coef=MB_TRUE):
    """Measured micro-batches of several documents: fwd = a*pairs + b*tokens + c, backward with the cost
    model's convention (bwd_attention x attention + bwd_linear x (GEMMs + overhead))."""
    a, b, c, ra, rl = coef
    rng = np.random.default_rng(seed)
    pairs, tokens = [], []
    for _ in range(n):
        docs = rng.integers(64, 32768, size=rng.integers(1, 8))
        pairs.append(float(causal_pairs(docs, docs).sum()))
        tokens.append(float(docs.sum()))
    p, t = np.array(pairs), np.array(tokens)
    fwd = (a * p + b * t + c) * (1 + noise * rng.standard_normal(n))
    bwd = (ra * a * p + rl * (b * t + c)) * (1 + noise * rng.standard_normal(n))
    return {"pairs": pairs, "tokens": tokens, "fwd_s": fwd.tolist(), "bwd_s": bwd.tolist()}


def _mb_profile(points, **extra):
    return {"format": PROFILE_FORMAT, "device": "synthetic", "model": get_model("7b").to_dict(), "tp": 1,
            "micro_batches": points, **extra}


@pytest.mark.parametrize("noise", [0.0, 0.02])
def test_micro_batch_fit_recovers_known_coefficients(noise):
    fit = fit_profile(_mb_profile(_micro_batch_points(n=80, noise=noise)))
    a, b, c, ra, rl = MB_TRUE
    rel = 1e-6 if noise == 0 else 0.1  # pairs and tokens correlate: each coefficient moves more than the noise
    assert fit.form == "micro_batches" and fit.attn_per_query == 0.0
    assert fit.attn_per_pair == pytest.approx(a, rel=rel)
    assert fit.linear_per_token == pytest.approx(b, rel=rel)
    assert fit.bwd_attention == pytest.approx(ra, rel=rel)
    assert fit.bwd_linear == pytest.approx(rl, rel=rel)
    assert fit.overhead == pytest.approx(c, rel=1e-6 if noise == 0 else 0.2)
    assert fit.attn_rel_err < (1e-9 if noise == 0 else 0.05)


def test_kernel_fit_recovers_known_coefficients_under_noise():
    fit = fit_profile(_synthetic_profile(noise=0.02))
    assert fit.form == "kernels"
    assert fit.attn_per_pair == pytest.approx(3e-13, rel=0.05)
    assert fit.linear_per_token == pytest.approx(1.5e-8, rel=0.05)


def test_kernel_fit_tells_a_documents_cost_from_a_calls(tmp_path):
    """Sweep calls of one document and of 8 equal documents: the per-document constant (the CPU reference
    kernel's loop) is fitted apart from the per-call one, and the calibrated model charges it per run."""
    profile = _synthetic_profile()
    lengths = np.array(profile["attention"]["lengths"] + [8192, 32768, 131072])
    docs = np.array([1] * 6 + [8] * 3)
    attn = 3e-13 * docs * causal_pairs(lengths / docs, lengths / docs) + 2e-9 * lengths + 5e-5 * docs + 2e-5
    profile["attention"] = {"lengths": lengths.tolist(), "documents": docs.tolist(), "fwd_s": attn.tolist(),
                            "bwd_s": (2.4 * attn).tolist()}
    path = tmp_path / "p.json"
    path.write_text(json.dumps(profile))
    cost = build_cost_model(get_model("7b"), ParallelLayout(tp=2), profile=path)
    assert cost.fit.attn_per_run == pytest.approx(5e-5, rel=1e-5)
    assert cost.fit.attn_per_pair == pytest.approx(3e-13, rel=1e-5)
    assert cost.fit.overhead == pytest.approx(2e-5 + 2e-5, rel=1e-4)  # the call's + the GEMMs' constants
    d = np.array([1000])
    assert cost.attention_run(d, d)[0] == pytest.approx((3e-13 * 500500 + 2e-9 * 1000) / 2 + 5e-5)  # tp 2
    assert cost.attention_run(np.array([0]), np.array([0]))[0] == 0.0
    profile["attention"]["documents"][-1] = 7
    path.write_text(json.dumps(profile))
    with pytest.raises(ValueError, match="documents must divide"):
        load_profile(path)


def test_both_forms_fit_the_micro_batches_and_the_calibrated_model_agrees(tmp_path):
    """A profile with kernel sweeps and measured micro-batches is fitted from the micro-batches; the
    calibrated model built on it prices a micro-batch of whole documents (cp 1, tp 1) as the fit does:
    its attention + GEMMs + overhead forward, backward by its ratios, overhead x (1 + bwd_linear)."""
    from megatron_wlb.packing.metrics import overhead_seconds

    profile = {**_synthetic_profile(), "micro_batches": _micro_batch_points()}
    path = tmp_path / "both.json"
    path.write_text(json.dumps(profile))
    cost = build_cost_model(get_model("7b"), ParallelLayout(), profile=path)
    assert isinstance(cost, CalibratedCostModel) and cost.fit.form == "micro_batches"
    a, b, c, ra, rl = MB_TRUE
    assert cost.microbatch_overhead == pytest.approx(c, rel=1e-6)
    docs = np.array([1000, 5000, 20000])
    attn, lin = cost.attention(docs).sum(), cost.linear(docs).sum()
    pairs, tokens = float(causal_pairs(docs, docs).sum()), float(docs.sum())
    assert attn == pytest.approx(a * pairs, rel=1e-6) and lin == pytest.approx(b * tokens, rel=1e-6)
    true_fwd, true_bwd = a * pairs + b * tokens + c, ra * a * pairs + rl * (b * tokens + c)
    assert attn + lin + overhead_seconds(cost, backward=False) == pytest.approx(true_fwd, rel=1e-6)
    assert float(cost.backward(attn, lin)) + overhead_seconds(cost) - overhead_seconds(cost, backward=False) \
        == pytest.approx(true_bwd, rel=1e-6)
    pred_f, pred_b = cost.fit.predict(pairs, tokens)
    assert (pred_f, pred_b) == (pytest.approx(true_fwd, rel=1e-6), pytest.approx(true_bwd, rel=1e-6))


def test_overhead_keeps_the_fitted_forward_plus_backward_total():
    """When the measured backward constant is not bwd_linear x the forward one, the overhead is chosen
    so that forward + backward (what the packer balances) keeps the fitted total."""
    pts = _micro_batch_points()
    pts["bwd_s"] = (np.array(pts["bwd_s"]) + 1e-4).tolist()  # c_b = 2.1 * 3e-5 + 1e-4
    fit = fit_profile(_mb_profile(pts))
    assert fit.overhead * (1 + fit.bwd_linear) == pytest.approx(3e-5 + 2.1 * 3e-5 + 1e-4, rel=1e-4)


def test_holdout_mape_small_when_right_large_when_wrong():
    points = _micro_batch_points(n=50, noise=0.02)
    mask, how = holdout_every(np.arange(50) // 2)  # "iterations" of two micro-batches
    assert mask.sum() == 10 and "i % 5 == 4" in how
    good = holdout_mape(_mb_profile(points), mask)
    assert good["micro_batches"] == 10 and good["mape"] < 0.05
    # the kernel profile measured a device twice as fast as the one the micro-batches ran on
    slow = _micro_batch_points(n=10, noise=0.0, coef=(6e-13, 3e-8, 4e-5, 2.5, 2.0))
    kernels = _synthetic_profile()
    assert holdout_mape(kernels, {k: (np.array(v) * 2).tolist() if k.endswith("_s") else v
                                  for k, v in slow.items()})["mape"] > 0.4
    # a model that cannot bend: timings quadratic in tokens beyond pairs
    bent = dict(points, fwd_s=(np.array(points["fwd_s"]) * (1 + np.array(points["tokens"]) / 2e4)).tolist())
    assert holdout_mape(_mb_profile(bent), mask)["mape"] > 0.1


def test_holdout_every_falls_back_to_every_kth_point():
    mask, how = holdout_every([3, 3, 3, 3, 3, 3])  # one iteration: nothing or everything held out by iteration
    assert mask.tolist() == [False, False, False, False, True, False] and "every 5th" in how
    with pytest.raises(ValueError, match="must be >= 2"):
        holdout_every([1, 2], every=1)


def test_nnls_keeps_coefficients_non_negative():
    rng = np.random.default_rng(0)
    x = np.stack([rng.uniform(1, 10, 30), np.ones(30)], axis=1)
    y = np.maximum(2.0 * x[:, 0] - 3.0, 0.5)  # an unconstrained fit wants a negative constant
    a = x / y[:, None]
    coef = nnls_gram(a.T @ a, a.sum(axis=0), float(y.size))
    assert (coef >= 0).all() and coef[1] == 0.0 and coef[0] > 0


def test_profile_forms_are_validated_in_one_line(tmp_path):
    path = tmp_path / "p.json"

    def error(profile) -> str:
        path.write_text(json.dumps(profile))
        with pytest.raises(ValueError) as info:
            load_profile(path)
        assert "\n" not in str(info.value)
        return str(info.value)

    base = _mb_profile(_micro_batch_points(n=5))
    assert "no measurements" in error({k: v for k, v in base.items() if k != "micro_batches"})
    assert "micro_batches.bwd_s" in error(_mb_profile({k: v for k, v in base["micro_batches"].items()
                                                       if k != "bwd_s"}))
    assert "differ in length" in error(_mb_profile({**base["micro_batches"], "pairs": [1.0, 2.0]}))
    assert "micro_batches.fwd_s holds 0" in error(_mb_profile({**base["micro_batches"],
                                                               "fwd_s": [0.0] * 5}))
    assert "micro_batches.tokens: expected a non-empty list" in error(_mb_profile({**base["micro_batches"],
                                                                                   "tokens": 7}))
    assert "model" in error({**base, "model": {"hidden": 64}})
    fine = {**base, **{k: v for k, v in _synthetic_profile().items() if k in ("attention", "linear")}}
    path.write_text(json.dumps(fine))
    assert load_profile(path)["micro_batches"] == base["micro_batches"]
