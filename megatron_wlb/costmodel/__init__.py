"""Cost model: per-document latency W(d) = W_a(d) + W_l(d), analytic or calibrated (kernel sweeps on a GPU
or a CPU, or measured micro-batches of a training trace)."""

from megatron_wlb.costmodel.fit import (
    PROFILE_FORMAT,
    ProfileFit,
    RefitStats,
    fit_profile,
    holdout_every,
    holdout_mape,
    load_profile,
)
from megatron_wlb.costmodel.model import AnalyticCostModel, CalibratedCostModel, CostModel, build_cost_model
from megatron_wlb.costmodel.refit import cost_model_from_state
from megatron_wlb.costmodel.shapes import (
    H100,
    MODELS,
    Hardware,
    ModelShape,
    ParallelLayout,
    causal_pairs,
    check_expert_layout,
    get_model,
    head_ratio,
)
from megatron_wlb.costmodel.table import nnls_gram

__all__ = [
    "H100", "MODELS", "check_expert_layout", "PROFILE_FORMAT", "AnalyticCostModel", "CalibratedCostModel", "CostModel",
    "Hardware", "ModelShape", "ParallelLayout", "ProfileFit", "build_cost_model", "causal_pairs",
    "fit_profile", "get_model", "head_ratio", "holdout_every", "holdout_mape", "load_profile",
    "nnls_gram", "RefitStats", "cost_model_from_state",
]
