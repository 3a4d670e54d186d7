"""Cost model: per-document latency W(d) = W_a(d) + W_l(d), analytic or calibrated (kernel sweeps on a GPU
or a CPU, or measured micro-batches of a training trace)."""

from megatron_wlb.costmodel.model import (
    PROFILE_FORMAT,
    AnalyticCostModel,
    CalibratedCostModel,
    CostModel,
    ProfileFit,
    build_cost_model,
    causal_pairs,
    fit_profile,
    head_ratio,
    holdout_every,
    holdout_mape,
    load_profile,
    nnls_gram,
)
from megatron_wlb.costmodel.refit import RefitStats, cost_model_from_state
from megatron_wlb.costmodel.shapes import (
    H100,
    MODELS,
    Hardware,
    ModelShape,
    ParallelLayout,
    check_expert_layout,
    get_model,
)

__all__ = [
    "H100", "MODELS", "check_expert_layout", "PROFILE_FORMAT", "AnalyticCostModel", "CalibratedCostModel", "CostModel",
    "Hardware", "ModelShape", "ParallelLayout", "ProfileFit", "build_cost_model", "causal_pairs",
    "fit_profile", "get_model", "head_ratio", "holdout_every", "holdout_mape", "load_profile",
    "nnls_gram", "RefitStats", "cost_model_from_state",
]
