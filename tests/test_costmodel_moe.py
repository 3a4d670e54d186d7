"""Mixture-of-experts in the cost model (issue 36): the shapes of the public model cards, FLOPs per token
against the dense model of equal active parameters, the attention share, expert load under a capacity
factor, Megatron's --moe-layer-freq, the EP all-to-alls, Megatron's argument names, and dense unchanged."""

from __future__ import annotations

from types import SimpleNamespace

import numpy as np
import pytest

from megatron_wlb.config import config_from_dict, megatron_moe_fields
from megatron_wlb.costmodel import (
    AnalyticCostModel,
    CalibratedCostModel,
    ModelShape,
    ParallelLayout,
    get_model,
)

TINY = dict(hidden=256, num_layers=4, num_heads=4, num_kv_heads=4, ffn_hidden=512, vocab=1000)


def moe(name: str = "tiny-moe", **kw) -> ModelShape:
    return ModelShape(name, **{**TINY, "num_experts": 4, "moe_topk": 2, **kw})


def attention_share(cost, d: int) -> float:
    """Forward + backward attention over the whole of a one-document micro-batch of ``d`` tokens."""
    lengths = np.array([d])
    a, lin = cost.attention(lengths), cost.linear(lengths)
    hw = cost.hardware
    return float(a[0] * (1 + hw.bwd_attention) / cost.forward_backward(a, lin)[0])


@pytest.mark.parametrize("name, total, active", [("mixtral-8x7b", 46.7e9, 12.9e9), ("qwen3-30b-a3b", 30.5e9, 3.35e9)])
def test_shipped_moe_shapes_have_the_model_cards_parameter_counts(name, total, active):
    shape = get_model(name)
    assert shape.parameters() == pytest.approx(total, rel=0.01)
    assert shape.active_parameters() == pytest.approx(active, rel=0.01)
    assert shape.moe_layers == shape.num_layers and shape.is_moe


def test_moe_linear_flops_equal_the_dense_model_of_equal_active_parameters():
    for name in ("mixtral-8x7b", "qwen3-30b-a3b"):
        shape = get_model(name)
        dense = shape.dense_counterpart()
        assert not dense.is_moe and dense.attention_flops_per_pair() == shape.attention_flops_per_pair()
        assert dense.active_parameters() == pytest.approx(shape.active_parameters(), rel=1e-4)
        assert shape.linear_flops_per_token() == pytest.approx(dense.linear_flops_per_token(), rel=1e-4)
        # and far below a dense model of the same total size (every expert's FFN in each layer)
        same_size = ModelShape("same-size", hidden=shape.hidden, num_layers=shape.num_layers,
                               num_heads=shape.num_heads, num_kv_heads=shape.num_kv_heads,
                               ffn_hidden=shape.num_experts * shape.expert_ffn_hidden, vocab=shape.vocab,
                               kv_channels=shape.kv_channels)
        assert same_size.parameters() == pytest.approx(shape.parameters(), rel=1e-3)
        ratio = shape.linear_flops_per_token() / same_size.linear_flops_per_token()
        assert ratio < 0.3, ratio


def test_attention_share_is_larger_for_moe_than_for_a_dense_model_of_its_size():
    shape = get_model("mixtral-8x7b")
    same_size = ModelShape("same-size", hidden=4096, num_layers=32, num_heads=32, num_kv_heads=8,
                           ffn_hidden=8 * 14336, vocab=32000)
    layout = ParallelLayout(tp=8)
    share_moe = attention_share(AnalyticCostModel(shape, layout), 65536)
    share_dense = attention_share(AnalyticCostModel(same_size, layout), 65536)
    share_active = attention_share(AnalyticCostModel(shape.dense_counterpart(), layout), 65536)
    assert share_moe > 1.5 * share_dense
    assert share_moe == pytest.approx(share_active, rel=1e-3)  # EP 1: the same work as its dense counterpart


def test_capacity_factor_prices_the_busiest_expert_and_dropless_prices_topk():
    dropless, padded = moe(), moe(moe_capacity_factor=1.5)
    assert dropless.expert_load == 2.0 and padded.expert_load == 3.0
    expert_flops = 2.0 * 3 * 256 * 512  # one routed expert per token, forward, SwiGLU
    assert padded.linear_flops_per_token() - dropless.linear_flops_per_token() == pytest.approx(expert_flops)
    assert padded.model_linear_flops_per_token() == dropless.linear_flops_per_token()  # MFU counts top-k
    assert padded.training_flops([100]) == dropless.training_flops([100])


def test_router_and_shared_expert_are_in_the_flops():
    base = moe()
    shared = moe(moe_shared_expert_hidden=128)
    assert shared.linear_flops_per_token() - base.linear_flops_per_token() == pytest.approx(2.0 * 3 * 256 * 128)
    dense = ModelShape("d", **TINY)
    # an MoE layer of top-2 experts of FFN 256 = the dense FFN 512 plus the router GEMM (hidden x experts)
    half = moe(moe_ffn_hidden=256)
    assert half.linear_flops_per_token() - dense.linear_flops_per_token() == pytest.approx(2.0 * 256 * 4)


def test_moe_layer_freq_reads_as_megatron_does():
    every_other = moe(moe_layer_freq=2)
    assert every_other.moe_layer_pattern() == (1, 0, 1, 0)
    assert moe(moe_layer_freq=[1, 0, 1, 0]) == moe(moe_layer_freq=(1, 0, 1, 0))
    assert moe(moe_layer_freq=(1, 0, 1, 0)).linear_flops_per_token() == every_other.linear_flops_per_token()
    all_moe, dense = moe(moe_ffn_hidden=1024), ModelShape("d", **TINY)
    half = moe(moe_ffn_hidden=1024, moe_layer_freq=2)
    assert half.linear_flops_per_token() == pytest.approx(
        (all_moe.linear_flops_per_token() + dense.linear_flops_per_token()) / 2)
    assert moe(moe_layer_freq=3).moe_layer_pattern() == (1, 0, 0, 1)
    with pytest.raises(ValueError, match=r"moe_layer_freq=\[1, 0\]: a pattern must hold one 0 .* 4 of them"):
        moe(moe_layer_freq=[1, 0])
    with pytest.raises(ValueError, match="moe_topk=8 routes each token to more experts than num_experts=4"):
        moe(moe_topk=8)
    with pytest.raises(ValueError, match="moe_capacity_factor=1.0 needs num_experts"):
        ModelShape("d", **TINY, moe_capacity_factor=1.0)


def test_expert_parallel_all_to_all_bytes():
    shape = moe(moe_layer_freq=2)
    layout = ParallelLayout(tp=2, cp=2, dp=4, ep=4)
    cost = AnalyticCostModel(shape, layout)
    tokens = 4096.0
    # two all-to-alls (dispatch, combine) of the GPU's 1/tp of the tokens, top-2 bf16 rows of hidden, 3/4 leave,
    # on half of the layers; EP ranks sit tp apart: 2 x 4 = 8 GPUs, one NVLink node
    one = (4 - 1) / 4 * (tokens / 2) * 2 * 256 * 2.0 / (cost.hardware.intra_node_gbps * 1e9)
    assert float(cost.ep_comm(tokens)) == pytest.approx(2 * 0.5 * one)
    across = AnalyticCostModel(shape, ParallelLayout(tp=4, cp=4, dp=4, ep=4))  # 16 GPUs: InfiniBand
    assert float(across.ep_comm(tokens)) > float(AnalyticCostModel(shape, ParallelLayout(tp=4, cp=4, dp=4, ep=2))
                                                  .ep_comm(tokens))
    no_ep = AnalyticCostModel(shape, ParallelLayout(tp=2, cp=2, dp=4))
    d = np.array([8192])
    assert float(no_ep.ep_comm(tokens)) == 0.0
    assert cost.linear(d)[0] == pytest.approx(no_ep.linear(d)[0] + float(cost.ep_comm(8192 / 2)))
    assert cost.microbatch_overhead == pytest.approx(no_ep.microbatch_overhead + 2 * 0.5 * 10e-6)
    assert float(cost.comm(2048.0, 4096.0)) == pytest.approx(
        float(cost.tp_comm(2048.0) + cost.cp_comm(4096.0) + cost.ep_comm(2048.0)))
    # a kernel-sweep calibration adds the analytic all-to-alls as it adds TP/CP collectives
    profile = {"format": "megatron-wlb-profile/1", "model": shape.to_dict(), "tp": 2,
               "attention": {"lengths": [1024, 2048, 4096], "fwd_s": [1e-4, 4e-4, 1.6e-3]},
               "linear": {"tokens": [1024, 4096], "fwd_s": [1e-4, 4e-4]}}
    calibrated = CalibratedCostModel(profile, shape, layout)
    assert float(calibrated.ep_comm(tokens)) == float(cost.ep_comm(tokens))


def test_expert_layout_is_checked():
    with pytest.raises(ValueError, match="ep=3 must divide tp x cp x dp = 4"):
        ParallelLayout(cp=2, dp=2, ep=3)
    with pytest.raises(ValueError, match="ep=2 .* needs an MoE model"):
        AnalyticCostModel(ModelShape("d", **TINY), ParallelLayout(dp=2, ep=2))
    with pytest.raises(ValueError, match="ep=8 does not divide num_experts=4"):
        AnalyticCostModel(moe(), ParallelLayout(dp=8, ep=8))
    assert str(ParallelLayout(tp=2, dp=4, ep=4)) == "TP2-CP1-PP1-DP4-EP4"
    assert str(ParallelLayout(tp=2, dp=4)) == "TP2-CP1-PP1-DP4"


def test_calibration_rescales_moe_gemms_by_active_flops():
    dense = ModelShape("d", **TINY)
    profile = {"format": "megatron-wlb-profile/1", "model": dense.to_dict(), "tp": 1,
               "attention": {"lengths": [1024, 2048, 4096], "fwd_s": [1e-4, 4e-4, 1.6e-3]},
               "linear": {"tokens": [1024, 4096], "fwd_s": [1e-4, 4e-4]}}
    shape = moe(moe_topk=1, moe_ffn_hidden=1024)
    a = CalibratedCostModel(profile, dense, ParallelLayout())
    b = CalibratedCostModel(profile, shape, ParallelLayout())
    ratio = shape.linear_flops_per_token() / dense.linear_flops_per_token()
    assert float(b.linear_compute(1000.0)) == pytest.approx(float(a.linear_compute(1000.0)) * ratio)


def test_dense_shapes_and_layouts_are_unchanged():
    # the dense dict (profiles, run logs) has exactly the fields it had before MoE
    assert list(get_model("7b").to_dict()) == ["name", "hidden", "num_layers", "num_heads", "num_kv_heads",
                                               "ffn_hidden", "vocab", "swiglu"]
    shape = get_model("70b")
    qkv = 8192 * (8192 + 2 * 1024)
    assert shape.linear_flops_per_token() == 2.0 * (qkv + 8192 * 8192 + 3 * 8192 * 28672)
    assert shape.dense_counterpart() is shape and shape.expert_parameters() == 0
    assert shape.active_parameters() == shape.parameters()
    cost = AnalyticCostModel(shape, ParallelLayout(tp=8, cp=2))
    d = np.array([1000, 65536])
    per_gpu = d.astype(np.float64) / 2
    expected = cost.linear_compute(per_gpu) + cost.tp_comm(per_gpu) + cost.cp_comm(d)
    assert np.array_equal(cost.linear(d), expected)  # bit-identical: no EP term added
    assert cost.microbatch_overhead == 5 * cost.hardware.collective_latency_s
    # a profile with a MoE shape round-trips through JSON (its pattern as a list)
    pattern = moe(moe_layer_freq=(1, 1, 0, 1), moe_capacity_factor=1.25)
    assert ModelShape(**pattern.to_dict()) == pattern


def test_megatron_argument_names_map_onto_the_shape():
    args = SimpleNamespace(hidden_size=2048, num_attention_heads=32, kv_channels=128, num_experts=128,
                           moe_router_topk=8, moe_ffn_hidden_size=768, moe_shared_expert_intermediate_size=None,
                           moe_layer_freq=1, moe_expert_capacity_factor=None, multi_latent_attention=False)
    assert megatron_moe_fields(args) == {"kv_channels": 128, "num_experts": 128, "moe_topk": 8,
                                         "moe_ffn_hidden": 768, "moe_layer_freq": 1}
    dense = SimpleNamespace(hidden_size=4096, num_attention_heads=32, kv_channels=128, num_experts=None)
    assert megatron_moe_fields(dense) == {}
    with pytest.raises(ValueError, match="--multi-latent-attention: multi-latent attention"):
        megatron_moe_fields(SimpleNamespace(multi_latent_attention=True))
    pattern = SimpleNamespace(num_experts=4, moe_layer_freq=[1, 0, 1, 0])
    assert megatron_moe_fields(pattern)["moe_layer_freq"] == (1, 0, 1, 0)


def test_cost_model_from_megatron_args_prices_moe_and_ep():
    from megatron_wlb.megatron.args.validation import cost_model_from_args

    args = SimpleNamespace(hidden_size=256, num_layers=4, num_attention_heads=4, group_query_attention=False,
                           num_query_groups=None, ffn_hidden_size=512, padded_vocab_size=1000, swiglu=True,
                           kv_channels=64, num_experts=4, moe_router_topk=2, moe_ffn_hidden_size=256,
                           moe_shared_expert_intermediate_size=None, moe_layer_freq=1,
                           moe_expert_capacity_factor=None, multi_latent_attention=False,
                           tensor_model_parallel_size=1, context_parallel_size=1, pipeline_model_parallel_size=2,
                           data_parallel_size=2, expert_model_parallel_size=2)
    cost = cost_model_from_args(args, SimpleNamespace(cost_profile=None))
    assert cost.model == moe(moe_ffn_hidden=256, name="megatron", swiglu=True)
    assert cost.layout.ep == 2 and float(cost.ep_comm(100.0)) > 0


def test_yaml_model_in_megatron_moe_names():
    base = {"name": "t", "seq_len": 8192, "layout": {"tp": 2, "cp": 2, "pp": 2, "dp": 2, "ep": 4},
            "model": {"hidden_size": 256, "num_layers": 4, "num_attention_heads": 4, "ffn_hidden_size": 512,
                      "num_experts": 8, "moe_router_topk": 2, "moe_ffn_hidden_size": 128,
                      "moe_shared_expert_intermediate_size": 256, "moe_layer_freq": "1,0,1,1",
                      "moe_expert_capacity_factor": 1.25}}
    cfg = config_from_dict(base, source="moe.yaml")
    assert cfg.layout.ep == 4 and cfg.model.moe_layer_pattern() == (1, 0, 1, 1)
    assert (cfg.model.moe_ffn_hidden, cfg.model.moe_shared_expert_hidden, cfg.model.moe_capacity_factor) == \
        (128, 256, 1.25)
    with pytest.raises(ValueError, match=r"moe.yaml: layout ep=16 does not divide num_experts=8"):
        config_from_dict({**base, "layout": {"tp": 2, "cp": 2, "pp": 2, "dp": 4, "ep": 16}}, source="moe.yaml")


TINY_MOE_YAML = """
model: {num_layers: 2, hidden_size: 64, num_attention_heads: 4, ffn_hidden_size: 256, vocab_size: 300,
        num_experts: 4, moe_router_topk: 2, moe_ffn_hidden_size: 64, moe_shared_expert_intermediate_size: 32,
        moe_layer_freq: [1, 0]}
seq_len: 256
layout: {tp: 1, cp: 1, pp: 1, dp: 2, ep: 2}
"""


def test_calibrate_measures_the_moe_layer(tmp_path, capsys):
    """``wlb calibrate`` at an MoE config's shapes: the router, this EP rank's experts (num_experts / ep)
    on top-k x tokens dispatched rows, the shared expert; the profile names the measured (all-MoE) layer."""
    torch = pytest.importorskip("torch")
    from megatron_wlb.cli.calibrate import Layer, measured_shape
    from megatron_wlb.cli.main import main
    from megatron_wlb.costmodel import load_profile

    shape = ModelShape("m", hidden=64, num_layers=2, num_heads=4, num_kv_heads=4, ffn_hidden=256, vocab=300,
                       num_experts=4, moe_topk=2, moe_ffn_hidden=64, moe_shared_expert_hidden=32,
                       moe_layer_freq=(1, 0))
    layer = Layer(torch, measured_shape(shape), 1, torch.float32, torch.device("cpu"), "reference", ep=2)
    assert len(layer.experts) == 2 and layer.shared is not None and layer.router.shape == (4, 64)
    x = torch.randn(10, 64, requires_grad=True)
    y = layer(x)
    y.sum().backward()
    assert y.shape == (10, 64) and layer.router.grad is not None and layer.experts[1][1].grad is not None
    path = tmp_path / "moe.yaml"
    path.write_text(TINY_MOE_YAML)
    out = tmp_path / "p.json"
    assert main(["calibrate", "--config", str(path), "--device", "cpu", "--out", str(out), "--iters", "2",
                 "--warmup", "0", "--min-seconds", "0", "--holdout", "3", "--threads", "1"]) == 0
    profile = load_profile(out)
    assert profile["model"]["num_experts"] == 4 and "moe_layer_freq" not in profile["model"]  # all MoE: measured
    assert profile["holdout"]["mape"] >= 0
    calibrated = CalibratedCostModel(profile, shape, ParallelLayout(dp=2, ep=2))
    # the mixed pattern (half the layers dense) is priced from the MoE layer by FLOPs
    assert calibrated._linear_scale == pytest.approx(shape.linear_flops_per_token()
                                                     / measured_shape(shape).linear_flops_per_token())


def test_multi_latent_attention_is_refused_at_start_up_in_one_line():
    from test_megatron_args import BASE, parse

    from megatron_wlb.megatron.args.validation import validate_wlb_args

    args = parse(BASE)
    args.multi_latent_attention = True  # Megatron's --multi-latent-attention
    with pytest.raises(ValueError, match=r"--multi-latent-attention: multi-latent attention \(MLA.*not priced") as e:
        validate_wlb_args(args, te_available=False, highspy_available=True, check_files=False)
    assert "\n" not in str(e.value)
    args.multi_latent_attention = False
    validate_wlb_args(args, te_available=False, highspy_available=True, check_files=False)
