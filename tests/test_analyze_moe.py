"""``wlb analyze`` on an MoE config (issue 36): the dense job of equal active parameters simulated on the same
orderings, printed beside it with the attention share per micro-batch, in the report and the JSON."""

from __future__ import annotations

import json

import numpy as np
import pytest
import yaml

from megatron_wlb.cli.main import main
from megatron_wlb.config import config_from_dict, load_config
from megatron_wlb.costmodel import build_cost_model
from megatron_wlb.data import load_lengths
from megatron_wlb.sim.moe import attention_shares

MOE_CONFIGS = ("mixtral8x7b_64k", "mixtral8x7b_128k", "qwen3_30b_a3b_64k", "qwen3_30b_a3b_128k")


@pytest.mark.parametrize("name", MOE_CONFIGS)
def test_shipped_moe_configs_load_with_their_model_cards(name):
    cfg = load_config(name)
    assert cfg.model.is_moe and cfg.layout.world_size == 64 and cfg.layout.ep > 1
    assert cfg.layout.tp * cfg.layout.ep == 8  # the all-to-alls stay inside one node
    dense = cfg.dense_counterpart()
    assert not dense.model.is_moe and dense.layout.ep == 1 and dense.layout.world_size == 64
    assert dense.model.active_parameters() == pytest.approx(cfg.model.active_parameters(), rel=1e-4)


def test_attention_share_per_micro_batch():
    cfg = load_config("qwen3_30b_a3b_64k")
    lengths = load_lengths()
    moe = attention_shares(build_cost_model(cfg.model, cfg.layout), lengths, cfg.seq_len, 64)
    dense_cfg = cfg.dense_counterpart()
    dense = attention_shares(build_cost_model(dense_cfg.model, dense_cfg.layout), lengths, cfg.seq_len, 64)
    assert moe.shape == dense.shape == (64,) and np.all((moe > 0) & (moe < 1))
    # equal FLOPs per token, but the MoE job also moves every token to 8 experts and back (EP all-to-alls)
    assert np.all(moe < dense)
    # one 64K document: attention's share is at its highest; many short ones: at its lowest
    one = attention_shares(build_cost_model(cfg.model, cfg.layout), np.array([65536]), 65536, 1)
    short = attention_shares(build_cost_model(cfg.model, cfg.layout), np.full(64, 1024), 65536, 1)
    assert one[0] > 5 * short[0]
    with pytest.raises(ValueError, match="micro_batches must be >= 1"):
        attention_shares(build_cost_model(cfg.model, cfg.layout), lengths, 65536, 0)


def test_analyze_prints_the_moe_job_beside_its_dense_counterpart(tmp_path, capsys):
    rng = np.random.default_rng(7)
    lengths = np.minimum(rng.lognormal(7.5, 1.4, size=6000).astype(np.int64) + 1, 40000)
    np.save(tmp_path / "lengths.npy", lengths)
    raw = {"name": "tiny_moe_16k", "seq_len": 16384, "micro_batches": 4,
           "model": {"hidden_size": 1024, "num_layers": 8, "num_attention_heads": 8, "num_query_groups": 2,
                     "ffn_hidden_size": 2816, "num_experts": 8, "moe_router_topk": 2, "moe_ffn_hidden_size": 1024},
           "layout": {"tp": 2, "cp": 2, "pp": 2, "dp": 2, "ep": 4}}
    (tmp_path / "moe.yaml").write_text(yaml.safe_dump(raw))
    config_from_dict(raw)  # valid
    out = tmp_path / "out"
    assert main(["analyze", "--config", str(tmp_path / "moe.yaml"), "--lengths", str(tmp_path / "lengths.npy"),
                 "--iterations", "4", "--shuffles", "2", "--out", str(out), "--json", str(tmp_path / "v.json")]) == 0
    printed = capsys.readouterr().out
    assert "beside the dense model of equal active parameters" in printed
    assert "attention share per micro-batch" in printed
    result = json.loads((tmp_path / "v.json").read_text())
    moe = result["moe"]
    assert moe["dense_counterpart"]["layout"] == "TP2-CP2-PP2-DP2" and "ep" not in moe["dense_counterpart"]["model"]
    assert moe["active_parameters"] < moe["parameters"]
    assert 0 < moe["attention_share"]["moe"]["mean"] < moe["attention_share"]["dense"]["mean"] < 1
    assert set(moe["dense_counterpart"]["speedup"]) == set(result["speedup"])
    report = (out / "report.md").read_text()
    assert "## MoE custom beside the dense model" in report and (out / "dense-counterpart" / "report.md").exists()


def test_reproduce_runs_the_moe_configs(tmp_path, capsys):
    out = tmp_path / "rep"
    assert main(["reproduce", "--configs", "mixtral8x7b_64k", "--iterations", "2", "--out", str(out)]) == 0
    report = (out / "report.md").read_text()
    assert "| mixtral8x7b_64k | (2,2,4,4) | 64 |" in report
