"""Context-parallel level of WLB-LLM: shard layouts (numpy only) and all-gather CP attention (torch).

``from megatron_wlb.cp import build_layout`` does not import torch; the attention lives in
``megatron_wlb.cp.attention``.
"""

from megatron_wlb.cp.efficiency import EFFICIENCY_FORMAT, KernelEfficiency, default_table
from megatron_wlb.cp.layouts import (
    LAYOUT_NAMES,
    RankShard,
    ShardLayout,
    attention_work,
    build_layout,
    default_cost_model,
)
from megatron_wlb.cp.protocols import Layout, LayoutBuilder

__all__ = [
    "EFFICIENCY_FORMAT", "LAYOUT_NAMES", "KernelEfficiency", "Layout", "LayoutBuilder", "RankShard",
    "ShardLayout",
    "attention_work", "build_layout", "default_cost_model", "default_table",
]
