"""Latency of attention and linear work, analytic from the model shape or calibrated on a GPU.

Every estimate is *forward seconds of one transformer layer on one GPU*. Backward is the forward
times ``hardware.bwd_attention`` / ``hardware.bwd_linear``. A document of ``d`` tokens costs

    W(d) = W_a(d) + W_l(d)

where W_a is causal attention (quadratic in d) and W_l the GEMMs plus the TP and CP collectives
(linear in d), both per GPU of a TP x CP group that shares the work evenly. The workload of a
micro-batch is the sum over its documents plus a fixed per-micro-batch launch cost. This is the
paper's Eq. 2 objective; the packers balance it, the simulator turns it into time.

A *query run* generalises a document to CP shards: ``q`` consecutive queries of one document
whose last query sits at document position ``kv - 1``; under a causal mask it attends
``q * kv - q * (q - 1) / 2`` (query, key) pairs. A whole document is the run ``q = kv = d``.
"""

from __future__ import annotations

import json
from abc import ABC, abstractmethod
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np

from megatron_wlb.costmodel.shapes import H100, Hardware, ModelShape, ParallelLayout

PROFILE_FORMAT = "megatron-wlb-profile/1"
#: token or pair counts: a number (fractional per-GPU shares too) or an array of them
Counts = np.ndarray | float


def causal_pairs(q_len: Counts, kv_len: Counts) -> np.ndarray:
    """(query, key) pairs a causal query run of ``q_len`` queries ending at key ``kv_len`` attends."""
    q = np.asarray(q_len, dtype=np.float64)
    kv = np.asarray(kv_len, dtype=np.float64)
    if np.any(q > kv):
        raise ValueError("a query run cannot be longer than the keys it ends at (q_len > kv_len)")
    return q * kv - q * (q - 1.0) / 2.0


def _ring_seconds(bytes_per_gpu: np.ndarray, group: int, gbps: float) -> np.ndarray:
    """Bandwidth time of a ring all-gather / reduce-scatter where each of ``group`` GPUs
    contributes ``bytes_per_gpu``; the per-call latency is charged once per micro-batch."""
    if group <= 1:
        return np.zeros_like(bytes_per_gpu, dtype=np.float64)
    return (group - 1) * bytes_per_gpu / (gbps * 1e9)


class CostModel(ABC):
    """Per-layer forward latency on one GPU; subclasses provide the two compute kernels."""

    def __init__(self, model: ModelShape, layout: ParallelLayout, hardware: Hardware = H100):
        self.model = model
        self.layout = layout
        self.hardware = hardware

    # -- kernels (one GPU, its TP share of heads / columns) -------------------------------------
    @abstractmethod
    def attention_run(self, q_len: Counts, kv_len: Counts) -> np.ndarray:
        """Forward seconds of causal attention for query runs (vectorised)."""

    @abstractmethod
    def linear_compute(self, tokens: Counts) -> np.ndarray:
        """Forward seconds of one layer's GEMMs for ``tokens`` tokens on one GPU (vectorised)."""

    @property
    def microbatch_overhead(self) -> float:
        """Fixed forward seconds per micro-batch and layer, independent of its size: the latency
        of the collectives (4 TP calls, 1 CP all-gather) plus any measured launch cost."""
        calls = 4 * (self.layout.tp > 1) + (self.layout.cp > 1)
        return calls * self.hardware.collective_latency_s

    # -- communication ---------------------------------------------------------------------------
    def tp_comm(self, tokens: Counts) -> np.ndarray:
        """TP collectives for ``tokens`` tokens on one GPU: two all-reduces of the activations."""
        tp = self.layout.tp
        t = np.asarray(tokens, dtype=np.float64)
        shard_bytes = t * self.model.hidden * 2.0 / tp  # bf16, reduce-scatter + all-gather halves
        return 2.0 * 2.0 * _ring_seconds(shard_bytes, tp, self.hardware.link_gbps(tp))

    def cp_comm(self, tokens: Counts) -> np.ndarray:
        """All-gather of K and V across the CP group, for ``tokens`` tokens of a micro-batch."""
        cp, tp = self.layout.cp, self.layout.tp
        t = np.asarray(tokens, dtype=np.float64)
        kv_heads_per_gpu = max(1.0, self.model.num_kv_heads / tp)
        bytes_per_gpu = (t / cp) * 2.0 * kv_heads_per_gpu * self.model.head_dim * 2.0
        return _ring_seconds(bytes_per_gpu, cp, self.hardware.link_gbps(tp * cp))

    def pp_send(self, tokens: Counts, sequence_parallel: bool = True) -> np.ndarray:
        """Seconds to send a micro-batch's activations (or their gradients) to the next PP rank.

        Each GPU of a TP x CP group sends its share of ``tokens x hidden`` bf16 values over its own
        link: ``tokens / cp`` rows without sequence parallelism, ``tokens / (cp * tp)`` with it
        (Megatron's PP sends then carry the sequence-parallel shard), plus one call latency.
        """
        lay = self.layout
        rows = np.asarray(tokens, dtype=np.float64) / (lay.cp * (lay.tp if sequence_parallel else 1))
        gbps = self.hardware.link_gbps(2 * lay.tp * lay.cp)
        return rows * self.model.hidden * 2.0 / (gbps * 1e9) + self.hardware.collective_latency_s

    # -- per-document workload W(d) = W_a(d) + W_l(d) -------------------------------------------
    def attention(self, lengths: np.ndarray) -> np.ndarray:
        """W_a per document: causal attention shared evenly by the CP group."""
        d = _as_lengths(lengths)
        return self.attention_run(d, d) / self.layout.cp

    def linear(self, lengths: np.ndarray) -> np.ndarray:
        """W_l per document: GEMMs and TP/CP collectives on its tokens, shared by the CP group."""
        d = _as_lengths(lengths).astype(np.float64)
        per_gpu = d / self.layout.cp
        return self.linear_compute(per_gpu) + self.tp_comm(per_gpu) + self.cp_comm(d)

    def workload(self, lengths: np.ndarray) -> np.ndarray:
        """W(d) per document, forward seconds per layer per GPU."""
        return self.attention(lengths) + self.linear(lengths)

    # -- backward: the hardware's backward / forward ratios of attention and GEMMs ------------------
    def backward(self, attention: np.ndarray, linear: np.ndarray) -> np.ndarray:
        """Backward seconds of work whose forward is ``attention`` + ``linear`` seconds."""
        hw = self.hardware
        return hw.bwd_attention * attention + hw.bwd_linear * linear

    def forward_backward(self, attention: np.ndarray, linear: np.ndarray) -> np.ndarray:
        """Forward + backward seconds of work whose forward is ``attention`` + ``linear`` seconds."""
        hw = self.hardware
        return attention * (1.0 + hw.bwd_attention) + linear * (1.0 + hw.bwd_linear)

    def describe(self) -> str:
        return f"{type(self).__name__}({self.model.name}, {self.layout}, {self.hardware.name})"


def _as_lengths(lengths: np.ndarray | list[int] | int) -> np.ndarray:
    d = np.atleast_1d(np.asarray(lengths))
    if d.size and (d.dtype.kind not in "iu" or d.min() < 0):
        raise ValueError(f"document lengths must be non-negative integers, got dtype {d.dtype} "
                         f"with minimum {d.min() if d.size else None}")
    return d


class AnalyticCostModel(CostModel):
    """FLOPs divided by achieved throughput; no measurement needed."""

    def attention_run(self, q_len: Counts, kv_len: Counts) -> np.ndarray:
        flops = causal_pairs(q_len, kv_len) * self.model.attention_flops_per_pair() / self.layout.tp
        return flops / (self.hardware.attention_tflops * 1e12)

    def linear_compute(self, tokens: Counts) -> np.ndarray:
        flops = np.asarray(tokens, dtype=np.float64) * self.model.linear_flops_per_token() / self.layout.tp
        return flops / (self.hardware.gemm_tflops * 1e12)


@dataclass(frozen=True)
class ProfileFit:
    """Least-squares fit of measured latencies: attention = a*pairs + b*q, linear = c*tokens, plus
    a constant per micro-batch; ``*_rel_err`` is the mean relative error on the measured points."""

    attn_per_pair: float
    attn_per_query: float
    linear_per_token: float
    overhead: float
    attn_rel_err: float
    linear_rel_err: float
    bwd_attention: float
    bwd_linear: float
    extra: dict = field(default_factory=dict)


def fit_profile(profile: dict) -> ProfileFit:
    """Fit a measured profile (format ``megatron-wlb-profile/1``, see ``load_profile``)."""
    attn = profile["attention"]
    lin = profile["linear"]
    d = np.asarray(attn["lengths"], dtype=np.float64)
    ta = np.asarray(attn["fwd_s"], dtype=np.float64)
    t = np.asarray(lin["tokens"], dtype=np.float64)
    tl = np.asarray(lin["fwd_s"], dtype=np.float64)
    if d.size < 3 or t.size < 2:
        raise ValueError(f"a profile needs >= 3 attention and >= 2 linear points, got {d.size} and {t.size}")
    pairs = causal_pairs(d, d)
    # Relative least squares (divide rows by the measurement) so short lengths count as much as long.
    a_mat = np.stack([pairs, d, np.ones_like(d)], axis=1) / ta[:, None]
    a_coef, *_ = np.linalg.lstsq(a_mat, np.ones_like(ta), rcond=None)
    l_mat = np.stack([t, np.ones_like(t)], axis=1) / tl[:, None]
    l_coef, *_ = np.linalg.lstsq(l_mat, np.ones_like(tl), rcond=None)
    a_coef = np.maximum(a_coef, 0.0)
    l_coef = np.maximum(l_coef, 0.0)
    pred_a = a_coef[0] * pairs + a_coef[1] * d + a_coef[2]
    pred_l = l_coef[0] * t + l_coef[1]

    def ratio(section: dict, default: float) -> float:
        if "bwd_s" not in section:
            return default
        return float(np.median(np.asarray(section["bwd_s"]) / np.asarray(section["fwd_s"])))

    return ProfileFit(
        attn_per_pair=float(a_coef[0]),
        attn_per_query=float(a_coef[1]),
        linear_per_token=float(l_coef[0]),
        overhead=float(a_coef[2] + l_coef[1]),
        attn_rel_err=float(np.mean(np.abs(pred_a - ta) / ta)),
        linear_rel_err=float(np.mean(np.abs(pred_l - tl) / tl)),
        bwd_attention=ratio(attn, H100.bwd_attention),
        bwd_linear=ratio(lin, H100.bwd_linear),
    )


def load_profile(path: str | Path) -> dict:
    """Read and validate a profile JSON written by ``wlb calibrate`` (``megatron_wlb/cli/calibrate.py``).

    Format: ``{"format": "megatron-wlb-profile/1", "device": str, "model": ModelShape fields,
    "tp": int, "attention": {"lengths": [...], "fwd_s": [...], "bwd_s": [...]},
    "linear": {"tokens": [...], "fwd_s": [...], "bwd_s": [...]}}``, per layer, one GPU.
    """
    try:
        with open(path) as f:
            profile = json.load(f)
    except (json.JSONDecodeError, UnicodeDecodeError) as exc:
        raise ValueError(f"{path}: not valid JSON ({exc})") from None
    if not isinstance(profile, dict):
        raise ValueError(f"{path}: expected a JSON object (format {PROFILE_FORMAT!r}), got a {type(profile).__name__}")
    if profile.get("format") != PROFILE_FORMAT:
        raise ValueError(f"{path}: format is {profile.get('format')!r}, expected {PROFILE_FORMAT!r}")
    for section, key in (("attention", "lengths"), ("linear", "tokens")):
        if section not in profile or key not in profile[section] or "fwd_s" not in profile[section]:
            raise ValueError(f"{path}: missing {section}.{key} or {section}.fwd_s")
        if len(profile[section][key]) != len(profile[section]["fwd_s"]):
            raise ValueError(f"{path}: {section}.{key} and {section}.fwd_s differ in length")
        if min(profile[section]["fwd_s"]) <= 0:
            raise ValueError(f"{path}: {section}.fwd_s holds a non-positive latency")
    return profile


class CalibratedCostModel(CostModel):
    """Latencies fitted to a GPU profile, rescaled to the target model shape and TP degree.

    The profile is measured for one model shape at one TP degree; attention coefficients scale
    with heads x head_dim per GPU and GEMM coefficients with FLOPs per token per GPU, so a 7B
    profile also prices other Llama shapes (to first order). Collectives stay analytic.
    """

    def __init__(self, profile: dict, model: ModelShape, layout: ParallelLayout,
                 hardware: Hardware = H100):
        self.profile = profile
        self.fit = fit_profile(profile)
        prof_model = ModelShape(**profile["model"])
        prof_tp = int(profile.get("tp", 1))
        self._attn_scale = (model.attention_flops_per_pair() / layout.tp) / (
            prof_model.attention_flops_per_pair() / prof_tp)
        self._linear_scale = (model.linear_flops_per_token() / layout.tp) / (
            prof_model.linear_flops_per_token() / prof_tp)
        hw = Hardware(**{**hardware.__dict__, "name": f"{profile.get('device', 'GPU')} (calibrated)",
                         "bwd_attention": self.fit.bwd_attention, "bwd_linear": self.fit.bwd_linear})
        super().__init__(model, layout, hw)

    @classmethod
    def from_json(cls, path: str | Path, model: ModelShape, layout: ParallelLayout,
                  hardware: Hardware = H100) -> CalibratedCostModel:
        return cls(load_profile(path), model, layout, hardware)

    def attention_run(self, q_len: Counts, kv_len: Counts) -> np.ndarray:
        q = np.asarray(q_len, dtype=np.float64)
        t = self.fit.attn_per_pair * causal_pairs(q_len, kv_len) + self.fit.attn_per_query * q
        return t * self._attn_scale

    def linear_compute(self, tokens: Counts) -> np.ndarray:
        return self.fit.linear_per_token * np.asarray(tokens, dtype=np.float64) * self._linear_scale

    @property
    def microbatch_overhead(self) -> float:
        return super().microbatch_overhead + self.fit.overhead


def build_cost_model(model: ModelShape | str, layout: ParallelLayout,
                     profile: str | Path | None = None, hardware: Hardware = H100) -> CostModel:
    """The analytic model, or the calibrated one when a profile path is given."""
    from megatron_wlb.costmodel.shapes import get_model

    shape = get_model(model) if isinstance(model, str) else model
    if profile is None:
        return AnalyticCostModel(shape, layout, hardware)
    return CalibratedCostModel.from_json(profile, shape, layout, hardware)
