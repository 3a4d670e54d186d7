"""Latency of attention and linear work, analytic from the model shape or calibrated by measurement.

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

from abc import ABC, abstractmethod
from pathlib import Path

import numpy as np

from megatron_wlb.costmodel.fit import PROFILE_FORMAT, ProfileFit, fit_profile, load_profile
from megatron_wlb.costmodel.shapes import (
    H100,
    Counts,
    Hardware,
    ModelShape,
    ParallelLayout,
    causal_pairs,
    check_expert_layout,
    get_model,
)


def _ring_seconds(bytes_per_gpu: np.ndarray, group: int, gbps: float) -> np.ndarray:
    """Bandwidth time of a ring all-gather / reduce-scatter where each of ``group`` GPUs
    contributes ``bytes_per_gpu``; the per-call latency is charged once per micro-batch."""
    if group <= 1:
        return np.zeros_like(bytes_per_gpu, dtype=np.float64)
    return (group - 1) * bytes_per_gpu / (gbps * 1e9)


class CostModel(ABC):
    """Per-layer forward latency on one GPU; subclasses provide the two compute kernels.

    ``measured_runs``: whether ``attention_run`` was fitted to whole measured micro-batches, so it
    already holds the kernel's efficiency on short runs (and its tiles): the CP layouts then price
    query runs with it as it is, instead of dividing by a kernel-efficiency table (``cp.layouts``).
    """

    measured_runs: bool = False

    def __init__(self, model: ModelShape, layout: ParallelLayout, hardware: Hardware = H100):
        check_expert_layout(model, layout)
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
        if self.layout.ep > 1 and self.model.is_moe:  # 2 all-to-alls per MoE layer (mean over the layers)
            return (calls + 2.0 * self.model.moe_fraction) * self.hardware.collective_latency_s
        return calls * self.hardware.collective_latency_s

    def size_cost(self, rank_tokens: Counts, rank_pairs: Counts) -> np.ndarray:
        """Forward seconds per layer of micro-batches as a whole, beyond the sum of their documents and the
        fixed overhead, on a GPU holding ``rank_tokens`` of them and computing ``rank_pairs`` causal pairs: 0
        here (the analytic model is additive); a calibrated profile that kept a whole-micro-batch term
        (``fit.TERMS``) prices it (``packing.metrics.microbatch_seconds`` adds it to every micro-batch)."""
        return np.zeros(np.broadcast(np.asarray(rank_tokens), np.asarray(rank_pairs)).shape)

    @property
    def prices_size(self) -> bool:
        """Whether ``size_cost`` can be non-zero: the price of a micro-batch is then not the sum of its
        documents, and a packer places by the marginal cost of a document (``packing.greedy.place_greedy``)."""
        return False

    @property
    def empty_seconds(self) -> tuple[float, float]:
        """(forward, backward) seconds per layer of a micro-batch that holds nothing on this GPU (Megatron runs it
        all the same): 0 for the analytic model; a calibrated profile's measured ones."""
        return 0.0, 0.0

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

    def ep_comm(self, tokens: Counts) -> np.ndarray:
        """Expert parallelism's two all-to-alls of an MoE layer (dispatch and combine) for ``tokens`` tokens
        on one GPU (its CP share), mean over the layers; zero for a dense model or EP 1.

        Each GPU of the TP group routes its ``1 / tp`` of the tokens (sequence parallel), each to
        ``model.expert_load`` experts, as bf16 ``hidden``-wide rows; ``(ep - 1) / ep`` of them leave for the
        other EP ranks, which sit ``tp`` GPUs apart (Megatron's expert grid, expert TP = tp)."""
        t = np.asarray(tokens, dtype=np.float64)
        ep = self.layout.ep
        if ep <= 1 or not self.model.is_moe:
            return np.zeros_like(t)
        tp = self.layout.tp
        bytes_per_gpu = (t / tp) * self.model.expert_load * self.model.hidden * 2.0
        one = (ep - 1) / ep * bytes_per_gpu / (self.hardware.link_gbps(tp * ep) * 1e9)
        return 2.0 * self.model.moe_fraction * one

    def comm(self, rank_tokens: Counts, tokens: Counts) -> np.ndarray:
        """Every collective of one layer on a GPU holding ``rank_tokens`` of a micro-batch's (or a
        document's) ``tokens``: TP, CP and, for MoE, EP (the simulator's sum; ``linear`` adds the same terms)."""
        out = self.tp_comm(rank_tokens) + self.cp_comm(tokens)
        if self.layout.ep > 1 and self.model.is_moe:
            out = out + self.ep_comm(rank_tokens)
        return out

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
        """W_l per document: GEMMs and TP/CP (and MoE's EP) collectives on its tokens, shared by the CP group."""
        d = _as_lengths(lengths).astype(np.float64)
        per_gpu = d / self.layout.cp
        out = self.linear_compute(per_gpu) + self.tp_comm(per_gpu) + self.cp_comm(d)
        if self.layout.ep > 1 and self.model.is_moe:
            out = out + self.ep_comm(per_gpu)
        return out

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


class CalibratedCostModel(CostModel):
    """Latencies fitted to a measured profile, rescaled to the target model shape and TP degree.

    The profile is measured for one model shape at one TP degree; attention coefficients scale
    with heads x head_dim per GPU and GEMM coefficients with FLOPs per token per GPU, so a 7B
    profile also prices other Llama shapes (to first order). Collectives are analytic on top of a
    kernel-sweep profile; a micro-batch profile (from a training trace) measured them inside its
    times already, so none are added (exact at the measured layout, scaled with the compute elsewhere).
    """

    def __init__(self, profile: dict, model: ModelShape, layout: ParallelLayout,
                 hardware: Hardware = H100, fit: ProfileFit | None = None):
        self.profile = profile
        self.fit = fit_profile(profile) if fit is None else fit
        self._collectives_measured = self.measured_runs = self.fit.form == "micro_batches"
        prof_model = ModelShape(**profile["model"])
        prof_tp = int(profile.get("tp", 1))
        self._attn_scale = (model.attention_flops_per_pair() / layout.tp) / (
            prof_model.attention_flops_per_pair() / prof_tp)
        self._linear_scale = (model.linear_flops_per_token() / layout.tp) / (
            prof_model.linear_flops_per_token() / prof_tp)
        self._kv_scale = (max(1.0, model.num_kv_heads / layout.tp) * model.head_dim) / (
            max(1.0, prof_model.num_kv_heads / prof_tp) * prof_model.head_dim)
        hw = Hardware(**{**hardware.__dict__, "name": f"{profile.get('device', 'GPU')} (calibrated)",
                         "bwd_attention": self.fit.bwd_attention, "bwd_linear": self.fit.bwd_linear})
        super().__init__(model, layout, hw)

    @classmethod
    def from_json(cls, path: str | Path, model: ModelShape, layout: ParallelLayout,
                  hardware: Hardware = H100) -> CalibratedCostModel:
        return cls(load_profile(path), model, layout, hardware)

    @classmethod
    def from_fit(cls, fit: ProfileFit, model: ModelShape, layout: ParallelLayout, hardware: Hardware = H100,
                 source: str = "a fit") -> CalibratedCostModel:
        """The model of a fit made at ``model`` and ``layout.tp`` itself (the online refit): no profile file;
        ``source`` names it in the hardware's name."""
        profile = {"format": PROFILE_FORMAT, "device": source, "model": model.to_dict(), "tp": layout.tp}
        return cls(profile, model, layout, hardware, fit=fit)

    def attention_run(self, q_len: Counts, kv_len: Counts) -> np.ndarray:
        q = np.asarray(q_len, dtype=np.float64)
        per_pair = self.fit.per_pair(q) if self.fit.pair_lengths else self.fit.attn_per_pair
        t = per_pair * causal_pairs(q_len, kv_len) + self.fit.attn_per_query * q
        # the per-run constant is a call's fixed cost (launch, the reference kernel's loop): not rescaled
        return t * self._attn_scale + np.where(q > 0, self.fit.attn_per_run, 0.0)

    def linear_compute(self, tokens: Counts) -> np.ndarray:
        return self.fit.linear_per_token * np.asarray(tokens, dtype=np.float64) * self._linear_scale

    def size_cost(self, rank_tokens: Counts, rank_pairs: Counts) -> np.ndarray:
        # measured at the profile's shape: rescaled like the GEMMs (tokens^2) and attention (tokens x pairs)
        t, p = np.asarray(rank_tokens, dtype=np.float64), np.asarray(rank_pairs, dtype=np.float64)
        return t * (self.fit.per_token_sq * self._linear_scale * t + self.fit.per_token_pair * self._attn_scale * p)

    @property
    def prices_size(self) -> bool:
        return self.fit.per_token_sq > 0 or self.fit.per_token_pair > 0

    @property
    def empty_seconds(self) -> tuple[float, float]:
        """The profile's measured empty micro-batch; without one, its fixed cost of a micro-batch (what an empty one
        still runs: the launches and the collectives' latency)."""
        if self.fit.empty_fwd + self.fit.empty_bwd > 0:
            return self.fit.empty_fwd, self.fit.empty_bwd
        return self.microbatch_overhead, self.microbatch_overhead * self.hardware.bwd_linear

    def tp_comm(self, tokens: Counts) -> np.ndarray:
        if self._collectives_measured:
            return np.zeros_like(np.asarray(tokens, dtype=np.float64))
        return super().tp_comm(tokens)

    def cp_comm(self, tokens: Counts) -> np.ndarray:
        """A micro-batch profile's fitted K/V all-gather (``ProfileFit.cp_kv_token`` per token gathered from the
        other ``cp - 1`` ranks, scaled with the K/V width per GPU like attention), else the analytic one."""
        if not self._collectives_measured:
            return super().cp_comm(tokens)
        cp = self.layout.cp
        gathered = np.asarray(tokens, dtype=np.float64) * (cp - 1) / cp
        return self.fit.cp_cost(0.0, gathered) * self._kv_scale

    def ep_comm(self, tokens: Counts) -> np.ndarray:
        if self._collectives_measured:
            return np.zeros_like(np.asarray(tokens, dtype=np.float64))
        return super().ep_comm(tokens)

    @property
    def microbatch_overhead(self) -> float:
        """The fit's fixed cost of a micro-batch, plus its collectives' latency: a micro-batch profile's fitted CP
        all-gather steps (``cp - 1`` on a CP group of ``cp``), or the analytic calls on top of a kernel sweep."""
        if self._collectives_measured:
            return self.fit.overhead + float(self.fit.cp_cost(self.layout.cp - 1, 0.0))
        return super().microbatch_overhead + self.fit.overhead


def build_cost_model(model: ModelShape | str, layout: ParallelLayout,
                     profile: str | Path | None = None, hardware: Hardware = H100) -> CostModel:
    """The analytic model, or the calibrated one when a profile path is given."""
    shape = get_model(model) if isinstance(model, str) else model
    if profile is None:
        return AnalyticCostModel(shape, layout, hardware)
    return CalibratedCostModel.from_json(profile, shape, layout, hardware)
