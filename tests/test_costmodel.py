"""Cost model: closed forms of the analytic model, and the calibrated fit recovering known curves."""

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
    get_model,
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
