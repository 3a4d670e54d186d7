"""A tiny mixture-of-experts GPT through Megatron-LM's own training loop on CPU (gloo) with the WLB-LLM hooks
(issue 36): 4 experts, top-2, the alltoall token dispatcher, packed by ``--wlb-packing wlb`` with the cost model
of the MoE shape (``cost_model_from_args`` maps Megatron's MoE flags): it trains, the loss falls, every planned
document's tokens reach the model exactly once."""

from __future__ import annotations

import pytest

pytest.importorskip("torch")
from test_megatron_train import assert_documents_once, assert_trains, corpus, train  # noqa: E402,F401

pytestmark = pytest.mark.slow  # Megatron training runs

#: 4 experts of FFN 64, top-2, Megatron's alltoall dispatcher (the one that takes PP's variable-length
#: micro-batches), the aux-loss router; every layer MoE
MOE_FLAGS = ("--num-experts", "4", "--moe-router-topk", "2", "--moe-ffn-hidden-size", "64",
             "--moe-token-dispatcher-type", "alltoall", "--moe-router-load-balancing-type", "aux_loss",
             "--moe-aux-loss-coeff", "1e-2")


def _logged_model(run) -> dict:
    import re

    m = re.search(r"cost model AnalyticCostModel\((\w+), (\S+),", run.log)
    return {"name": m.group(1), "layout": m.group(2)} if m else {}


def test_tiny_moe_pp2_trains_with_wlb_packing(tmp_path, corpus):  # noqa: F811
    run = train(tmp_path, "moe_pp2", corpus, *MOE_FLAGS, "--wlb-packing", "wlb", env={"PP": "2"})
    assert_trains(run)
    assert_documents_once(run)
    assert "[wlb] iteration" in run.log


def test_tiny_moe_ep2_dp2_trains_with_wlb_packing(tmp_path, corpus):  # noqa: F811
    run = train(tmp_path, "moe_ep2", corpus, *MOE_FLAGS, "--expert-model-parallel-size", "2", "--wlb-packing",
                "wlb", env={"DP": "2"})
    assert_trains(run)
    assert_documents_once(run)
