"""Cost model: per-document latency W(d) = W_a(d) + W_l(d), analytic or calibrated on a GPU."""

from megatron_wlb.costmodel.model import (
    PROFILE_FORMAT,
    AnalyticCostModel,
    CalibratedCostModel,
    CostModel,
    ProfileFit,
    build_cost_model,
    causal_pairs,
    fit_profile,
    load_profile,
)
from megatron_wlb.costmodel.shapes import H100, MODELS, Hardware, ModelShape, ParallelLayout, get_model

__all__ = [
    "H100", "MODELS", "PROFILE_FORMAT", "AnalyticCostModel", "CalibratedCostModel", "CostModel",
    "Hardware", "ModelShape", "ParallelLayout", "ProfileFit", "build_cost_model", "causal_pairs",
    "fit_profile", "get_model", "load_profile",
]
