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

import json
from abc import ABC, abstractmethod
from collections.abc import Sequence
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any

import numpy as np

from megatron_wlb.costmodel.shapes import H100, Hardware, ModelShape, ParallelLayout, check_expert_layout

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


def head_ratio(model: ModelShape) -> float:
    """Forward FLOPs per token of the LM head over those of one layer's GEMMs: the simulator prices the
    head at this many layers' ``linear_compute`` (``sim.iteration``), and the trace fit does the same."""
    return 2.0 * model.hidden * model.vocab / model.linear_flops_per_token()


@dataclass(frozen=True)
class ProfileFit:
    """A fitted profile, per layer and GPU at the profile's own shape and TP: attention =
    ``attn_per_pair`` x pairs + ``attn_per_query`` x queries + ``attn_per_run`` per query run (a document,
    or its piece on a CP rank: the reference kernel's per-document loop), GEMMs = ``linear_per_token`` x
    tokens, plus ``overhead`` per micro-batch; backward = ``bwd_attention`` x attention + ``bwd_linear`` x
    (GEMMs + overhead), the convention of ``CalibratedCostModel`` and ``packing.metrics``.

    ``form``: the section fitted, ``"kernels"`` (attention and GEMM sweeps) or ``"micro_batches"``
    (measured whole micro-batches, collectives included); ``*_rel_err``: mean relative error on the
    fitted points (kernels: of each sweep's forward; micro-batches: both of forward + backward);
    ``head_ratio``: micro-batch points' LM-head tokens are priced at this many layers' GEMMs.
    """

    attn_per_pair: float
    attn_per_query: float
    linear_per_token: float
    overhead: float
    attn_rel_err: float
    linear_rel_err: float
    bwd_attention: float
    bwd_linear: float
    extra: dict = field(default_factory=dict)
    form: str = "kernels"
    head_ratio: float = 0.0
    attn_per_run: float = 0.0
    pair_lengths: tuple[float, ...] = ()
    pair_costs: tuple[float, ...] = ()

    def __post_init__(self) -> None:
        # a checkpoint's JSON gives lists: hold tuples of floats, as a fit made here does
        object.__setattr__(self, "pair_lengths", tuple(float(x) for x in self.pair_lengths))
        object.__setattr__(self, "pair_costs", tuple(float(x) for x in self.pair_costs))
        if len(self.pair_lengths) != len(self.pair_costs):
            raise ValueError(f"attention table of {len(self.pair_lengths)} lengths and {len(self.pair_costs)} costs: "
                             "give one forward cost per pair for each length")

    def per_pair(self, q_len: Counts) -> np.ndarray:
        """Forward seconds per causal pair of query runs of ``q_len`` queries: the table interpolated in
        log2(length) (``costmodel.table``), or ``attn_per_pair`` for every length without a table."""
        q = np.asarray(q_len, dtype=np.float64)
        if not self.pair_lengths:
            return np.full(q.shape, self.attn_per_pair)
        from megatron_wlb.costmodel.table import pair_basis

        return (pair_basis(q.ravel(), self.pair_lengths) @ np.asarray(self.pair_costs)).reshape(q.shape)

    def predict(self, pairs: Counts, tokens: Counts, head_tokens: Counts = 0.0, runs: Counts = 1.0,
                table: np.ndarray | None = None) -> tuple[np.ndarray, np.ndarray]:
        """(forward, backward) seconds per layer of micro-batches with these causal (query, key) pairs, query
        tokens and query runs (documents) on one GPU (``head_tokens``: tokens whose LM head the point also
        ran, per layer). ``table``: the points' ``table.table_columns`` at this fit's ``pair_lengths``, which
        a fit with a table needs to price pairs by their runs' lengths (without it: ``attn_per_pair``)."""
        p, t, h, r = (np.asarray(x, dtype=np.float64) for x in (pairs, tokens, head_tokens, runs))
        if self.pair_lengths and table is not None:
            pair_cost = np.asarray(table, dtype=np.float64) @ np.asarray(self.pair_costs)
        else:
            pair_cost = self.attn_per_pair * p
        attn = pair_cost + self.attn_per_query * t + self.attn_per_run * r
        lin = self.linear_per_token * (t + self.head_ratio * h) + self.overhead
        return attn + lin, self.bwd_attention * attn + self.bwd_linear * lin


def nnls_gram(gram: np.ndarray, rhs: np.ndarray, points: float) -> np.ndarray:
    """Non-negative ``c`` minimising ``|A c - 1|^2`` from its normal equations alone (``gram = A^T A``,
    ``rhs = A^T 1``, ``points`` = the rows), so statistics summed over ranks fit as the rows would. Exact
    for the few columns here: the optimum is the unconstrained fit on its own support, so every support
    is tried and the non-negative one with the least residual kept (columns scaled to unit norm first)."""
    g, r = np.asarray(gram, dtype=np.float64), np.asarray(rhs, dtype=np.float64)
    scale = np.sqrt(np.diag(g)).copy()
    scale[scale == 0] = 1.0
    g, r = g / np.outer(scale, scale), r / scale
    best, best_res = np.zeros(r.size), float(points)
    for support in range(1, 2 ** r.size):
        cols = [j for j in range(r.size) if support >> j & 1]
        sub = g[np.ix_(cols, cols)]
        coef, *_ = np.linalg.lstsq(sub, r[cols], rcond=None)
        if np.any(coef < 0):
            continue
        res = float(points - 2.0 * coef @ r[cols] + coef @ sub @ coef)
        if res < best_res:
            best, best_res = np.zeros(r.size), res
            best[cols] = coef
    return best / scale


def _nnls_relative(x: np.ndarray, y: np.ndarray) -> np.ndarray:
    """Non-negative ``c`` minimising ``sum(((x @ c - y) / y) ** 2)``: relative least squares, so short
    measurements count as much as long ones (``nnls_gram`` on the rows ``x / y``, target 1)."""
    a = x / y[:, None]
    return nnls_gram(a.T @ a, a.sum(axis=0), float(y.size))


def fit_profile(profile: dict) -> ProfileFit:
    """Fit a measured profile (see ``load_profile``). A profile with both forms is fitted from its
    ``micro_batches``: whole measured micro-batches are what the cost model predicts (kernels, launches,
    collectives and all), so they win over the kernel sweeps of the same profile."""
    if "micro_batches" in profile:
        return _fit_micro_batches(profile)
    return _fit_kernels(profile)


def _bwd_ratio(section: dict, default: float) -> float:
    if "bwd_s" not in section:
        return default
    return float(np.median(np.asarray(section["bwd_s"], dtype=np.float64) / np.asarray(section["fwd_s"])))


def _fit_kernels(profile: dict) -> ProfileFit:
    """attention fwd = a*pairs + b*queries (+ r*documents) + c_a over the sweep's calls (``lengths`` tokens
    as ``documents`` equal documents, 1 when not given; the per-document term only when some call has
    several), GEMMs fwd = c*t + c_l; backward ratios are the medians of the measured bwd / fwd."""
    attn = profile["attention"]
    lin = profile["linear"]
    d = np.asarray(attn["lengths"], dtype=np.float64)
    k = np.asarray(attn.get("documents", np.ones_like(d)), dtype=np.float64)
    ta = np.asarray(attn["fwd_s"], dtype=np.float64)
    t = np.asarray(lin["tokens"], dtype=np.float64)
    tl = np.asarray(lin["fwd_s"], dtype=np.float64)
    if d.size < 3 or t.size < 2:
        raise ValueError(f"a profile needs >= 3 attention and >= 2 linear points, got {d.size} and {t.size}")
    pairs = k * causal_pairs(d / k, d / k)
    per_run = bool(np.any(k != k[0]))
    a_x = np.stack([pairs, d, *([k] if per_run else []), np.ones_like(d)], axis=1)
    a_coef = _nnls_relative(a_x, ta)
    l_x = np.stack([t, np.ones_like(t)], axis=1)
    l_coef = _nnls_relative(l_x, tl)
    table: dict[str, Any] = {}
    knots = _knots(profile)
    if knots:
        from megatron_wlb.costmodel.table import fit_table, pair_basis

        cols = pairs[:, None] * pair_basis(d / k, knots)
        tf = fit_table(np.concatenate([cols, a_x[:, 1:]], axis=1), ta, len(knots), float(a_coef[0]))
        costs = tf.coef[:len(knots)]
        a_coef = np.concatenate([[float(cols.sum(axis=0) @ costs / cols.sum())], tf.coef[len(knots):]])
        a_x = np.concatenate([cols, a_x[:, 1:]], axis=1)
        a_coef_x = tf.coef
        table = {"pair_lengths": knots, "pair_costs": tuple(float(c) for c in costs),
                 "extra": {"table": _table_extra(tf)}}
    else:
        a_coef_x = a_coef
    return ProfileFit(
        attn_per_pair=float(a_coef[0]),
        attn_per_query=float(a_coef[1]),
        attn_per_run=float(a_coef[2]) if per_run else 0.0,
        linear_per_token=float(l_coef[0]),
        overhead=float(a_coef[-1] + l_coef[1]),
        attn_rel_err=float(np.mean(np.abs(a_x @ a_coef_x - ta) / ta)),
        linear_rel_err=float(np.mean(np.abs(l_x @ l_coef - tl) / tl)),
        bwd_attention=_bwd_ratio(attn, H100.bwd_attention),
        bwd_linear=_bwd_ratio(lin, H100.bwd_linear),
        **table,
    )


def _knots(profile: dict) -> tuple[float, ...]:
    """The profile's attention-table knots (``"attention_table": {"lengths"}``), () without a table."""
    from megatron_wlb.costmodel.table import check_knots

    table = profile.get("attention_table")
    return () if table is None else check_knots(table["lengths"])


def _table_extra(tf: Any) -> dict[str, Any]:
    """What a table fit reports beside its coefficients: its conditioning and its fitted error."""
    return {"condition": tf.condition, "condition_regularised": tf.condition_regularised, "rel_err": tf.rel_err,
            "coef": tf.coef.tolist()}


def table_of(section: dict, fit: ProfileFit) -> np.ndarray | None:
    """``table.table_columns`` of a ``micro_batches``-like section at ``fit``'s knots (None without a table);
    a one-line error when the section lacks its runs (``run_lengths`` and ``run_pairs``)."""
    if not fit.pair_lengths:
        return None
    from megatron_wlb.costmodel.table import table_columns

    if "run_lengths" not in section or "run_pairs" not in section:
        raise ValueError("micro-batches without run_lengths / run_pairs: a fit with an attention table prices "
                         "each query run by its length; record them (costmodel.trace.profile_points does)")
    return table_columns(section["run_lengths"], section["run_pairs"], fit.pair_lengths)


def _fit_micro_batches(profile: dict) -> ProfileFit:
    """The fit of measured micro-batches (``costmodel.refit.RefitStats.fit``, the online refit's own, so
    that both agree), with its mean relative error of forward + backward on the fitted points."""
    from megatron_wlb.costmodel.refit import RefitStats, design

    mb = profile["micro_batches"]
    model = ModelShape(**profile["model"])
    if len(mb["fwd_s"]) < 3:
        raise ValueError(f"a micro_batches profile needs >= 3 measured micro-batches, got {len(mb['fwd_s'])}")
    fit = RefitStats.of(mb, model).fit(model)
    x, f, b = design(mb, model)
    knots = _knots(profile)
    if knots:
        fit = _table_micro_batches(fit, mb, x, f, b, knots)
    pred_f, pred_b = fit.predict(mb["pairs"], mb["tokens"], mb.get("head_tokens", 0.0), mb.get("runs", 0.0),
                                 table_of(mb, fit))
    err = float(np.mean(np.abs(pred_f + pred_b - (f + b)) / (f + b)))
    cf, cb = np.asarray(fit.extra["fwd"]), np.asarray(fit.extra["bwd"])
    extra = {**fit.extra, "fwd_rel_err": float(np.mean(np.abs(x @ cf - f) / f)),
             "bwd_rel_err": float(np.mean(np.abs(x @ cb - b) / b))}
    return replace(fit, attn_rel_err=err, linear_rel_err=err, extra=extra)


def _table_micro_batches(base: ProfileFit, mb: dict, x: np.ndarray, f: np.ndarray, b: np.ndarray,
                         knots: tuple[float, ...]) -> ProfileFit:
    """The table form of a micro-batch fit: forward + backward = sum over knots of c_k x (pairs at knot k) +
    per-token + per-run + per-micro-batch terms (``table.fit_table``), split into forward and backward by
    ``base``'s (the one-knot fit's) bwd / fwd ratios, so the fitted total is priced exactly."""
    from megatron_wlb.costmodel.table import fit_table, table_columns

    cols = table_columns(mb["run_lengths"], mb["run_pairs"], knots)
    keep = (f > 0) & (b > 0)
    ba, bl = base.bwd_attention, base.bwd_linear
    xt = np.concatenate([cols, x[:, 1:]], axis=1)
    tf = fit_table(xt[keep], (f + b)[keep], len(knots), base.attn_per_pair * (1.0 + ba))
    k = len(knots)
    costs = tf.coef[:k] / (1.0 + ba)
    mean_cost = float(cols.sum(axis=0) @ costs / cols.sum()) if cols.sum() > 0 else base.attn_per_pair
    return replace(base, attn_per_pair=mean_cost, pair_lengths=knots, pair_costs=tuple(float(c) for c in costs),
                   linear_per_token=float(tf.coef[k] / (1.0 + bl)), attn_per_run=float(tf.coef[k + 1] / (1.0 + ba)),
                   overhead=float(tf.coef[k + 2] / (1.0 + bl)), extra={**base.extra, "table": _table_extra(tf)})


def holdout_every(groups: Sequence[int] | np.ndarray, every: int = 5) -> tuple[np.ndarray, str]:
    """A deterministic held-out split: (mask, description). A point is held out when its group (a
    training iteration: all ranks' rows of a micro-batch leave the fit together) is ``every - 1``
    modulo ``every``; when that holds out none or all, every ``every``-th point instead."""
    if every < 2:
        raise ValueError(f"holdout every {every}: must be >= 2 (1 would hold out everything)")
    g = np.asarray(groups, dtype=np.int64)
    mask = g % every == every - 1
    if mask.any() and not mask.all():
        return mask, f"iterations i with i % {every} == {every - 1}"
    return np.arange(g.size) % every == every - 1, f"every {every}th micro-batch"


def select_points(section: dict, mask: np.ndarray) -> dict:
    """The points of a ``micro_batches`` section where ``mask`` is true (its per-point lists)."""
    n = mask.size
    return {k: [x for x, m in zip(v, mask) if m] if isinstance(v, list) and len(v) == n else v
            for k, v in section.items()}


def holdout_mape(profile: dict, held_out: dict | np.ndarray) -> dict[str, Any]:
    """``{"mape", "micro_batches"}``: the mean absolute percentage error of the fitted forward + backward
    seconds of micro-batches left out of the fit. ``held_out`` is a ``micro_batches``-like section measured
    apart from ``profile`` (then ``profile`` is fitted as it is), or a boolean mask over
    ``profile["micro_batches"]`` (those points are taken out of the fit and predicted)."""
    if isinstance(held_out, dict):
        fitted, test = profile, held_out
    else:
        mask = np.asarray(held_out, dtype=bool)
        section = profile["micro_batches"]
        if mask.shape != (len(section["fwd_s"]),):
            raise ValueError(f"held-out mask of shape {mask.shape} for {len(section['fwd_s'])} micro-batches")
        fitted, test = {**profile, "micro_batches": select_points(section, ~mask)}, select_points(section, mask)
    if not len(test["fwd_s"]):
        raise ValueError("no held-out micro-batches to check the fit on")
    fit = fit_profile(fitted)
    pred_f, pred_b = fit.predict(test["pairs"], test["tokens"], test.get("head_tokens", 0.0),
                                 test.get("runs", test.get("documents", 1.0)), table_of(test, fit))
    measured = np.asarray(test["fwd_s"], dtype=np.float64) + np.asarray(test["bwd_s"], dtype=np.float64)
    return {"mape": float(np.mean(np.abs(pred_f + pred_b - measured) / measured)),
            "micro_batches": len(test["fwd_s"])}


def _series(where: str, section: dict, key: str, minimum: float, strict: bool) -> int:
    """Check ``section[key]`` is a non-empty list of finite numbers > (or >=) ``minimum``; its length."""
    values = section.get(key)
    if not isinstance(values, list) or not values or not all(
            isinstance(v, (int, float)) and not isinstance(v, bool) and np.isfinite(v) for v in values):
        raise ValueError(f"{where}.{key}: expected a non-empty list of numbers, got {str(values)[:60]}")
    low = min(values)
    if low < minimum or (strict and low == minimum):
        raise ValueError(f"{where}.{key} holds {low}: every value must be {'>' if strict else '>='} {minimum:g}")
    return len(values)


def load_profile(path: str | Path) -> dict:
    """Read and validate a profile JSON written by ``wlb calibrate`` (``megatron_wlb/cli/calibrate.py``).

    Format ``megatron-wlb-profile/1``: ``{"format", "device": str, "model": ModelShape fields, "tp": int}``
    and one or both forms of measurements, per layer on one GPU at that TP:

    - kernel sweeps: ``"attention": {"lengths", "fwd_s", "bwd_s"}`` (one causal document of each length;
      optional ``"documents"``: the call's ``lengths`` tokens were that many equal documents) and
      ``"linear": {"tokens", "fwd_s", "bwd_s"}`` (the layer's GEMMs);
    - measured micro-batches: ``"micro_batches": {"pairs", "tokens", "fwd_s", "bwd_s"}`` (each one's causal
      (query, key) pairs and query tokens on that GPU and its seconds divided by the layers measured;
      optional ``"head_tokens"``: the tokens whose LM head the time includes, also per layer; ``"runs"``,
      ``"run_lengths"`` and ``"run_pairs"``: its query runs' count, and each run's length and pairs).

    Optional ``"attention_table": {"lengths": [knots]}``: attention's per-pair cost is then fitted per query
    run length, interpolated in log2(length) between these knots (``costmodel.table``; the micro-batch form
    then needs ``run_lengths`` and ``run_pairs``); without it, one cost per pair (a one-knot table: the
    profiles written before the table load and price as they did). ``wlb calibrate`` also writes the fitted
    ``"per_pair_fwd_s"`` beside the knots, for the reader (the fit is remade from the measurements).

    ``fit_profile`` fits the micro-batches when both are there. Every error is one line naming the field.
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
    try:
        ModelShape(**profile["model"])
    except (KeyError, TypeError, ValueError) as exc:
        raise ValueError(f"{path}: model: expected a mapping of ModelShape fields ({exc})") from None
    if not isinstance(profile.get("tp", 1), int) or profile.get("tp", 1) < 1:
        raise ValueError(f"{path}: tp {profile.get('tp')!r}: must be a positive integer")
    kernels = [s for s in ("attention", "linear") if s in profile]
    if not kernels and "micro_batches" not in profile:
        raise ValueError(f"{path}: no measurements: give the kernel sweeps (attention and linear) or "
                         "micro_batches (measured micro-batches), or both")
    for section, key in (("attention", "lengths"), ("linear", "tokens")) if kernels else ():
        if not isinstance(profile.get(section), dict) or key not in profile[section] or "fwd_s" not in profile[section]:
            raise ValueError(f"{path}: missing {section}.{key} or {section}.fwd_s")
        where = f"{path}: {section}"
        sizes = {_series(where, profile[section], key, 1, False), _series(where, profile[section], "fwd_s", 0, True)}
        for optional, low in (("bwd_s", 0), ("documents", 1)):
            if optional in profile[section]:
                sizes.add(_series(where, profile[section], optional, low, optional == "bwd_s"))
        if len(sizes) > 1:
            raise ValueError(f"{path}: {section}.{key} and {section}.fwd_s / bwd_s / documents differ in length")
        docs = profile[section].get("documents")
        if docs is not None and any(n % k for n, k in zip(profile[section][key], docs)):
            raise ValueError(f"{path}: {section}.documents must divide {section}.{key} (equal documents per call)")
    if "micro_batches" in profile:
        mb = profile["micro_batches"]
        where = f"{path}: micro_batches"
        if not isinstance(mb, dict):
            raise ValueError(f"{where}: expected an object with pairs, tokens, fwd_s and bwd_s")
        checks = [("pairs", 0, False), ("tokens", 0, True), ("fwd_s", 0, True), ("bwd_s", 0, True)]
        if "head_tokens" in mb:
            checks.append(("head_tokens", 0, False))
        counts = {k: _series(where, mb, k, low, strict) for k, low, strict in checks}
        if len(set(counts.values())) > 1:
            raise ValueError(f"{where}: {', '.join(counts)} differ in length ({', '.join(map(str, counts.values()))})")
        for key in ("run_lengths", "run_pairs"):
            runs = mb.get(key)
            if runs is not None and (not isinstance(runs, list) or len(runs) != counts["fwd_s"] or not all(
                    isinstance(r, list) for r in runs)):
                raise ValueError(f"{where}.{key}: expected one list per micro-batch ({counts['fwd_s']} lists)")
    if "attention_table" in profile:
        table = profile["attention_table"]
        if not isinstance(table, dict) or "lengths" not in table:
            raise ValueError(f"{path}: attention_table {str(table)[:60]}: expected {{\"lengths\": [knot lengths]}}")
        from megatron_wlb.costmodel.table import check_knots

        check_knots(table["lengths"], f"{path}: attention_table.lengths")
        if "micro_batches" in profile and not {"run_lengths", "run_pairs"} <= set(profile["micro_batches"]):
            raise ValueError(f"{path}: attention_table needs micro_batches.run_lengths and run_pairs (each query "
                             "run's length and pairs); drop the table for the linear-in-pairs fit")
    return profile


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

    def tp_comm(self, tokens: Counts) -> np.ndarray:
        if self._collectives_measured:
            return np.zeros_like(np.asarray(tokens, dtype=np.float64))
        return super().tp_comm(tokens)

    def cp_comm(self, tokens: Counts) -> np.ndarray:
        if self._collectives_measured:
            return np.zeros_like(np.asarray(tokens, dtype=np.float64))
        return super().cp_comm(tokens)

    def ep_comm(self, tokens: Counts) -> np.ndarray:
        if self._collectives_measured:
            return np.zeros_like(np.asarray(tokens, dtype=np.float64))
        return super().ep_comm(tokens)

    @property
    def microbatch_overhead(self) -> float:
        collectives = 0.0 if self._collectives_measured else super().microbatch_overhead
        return collectives + self.fit.overhead


def build_cost_model(model: ModelShape | str, layout: ParallelLayout,
                     profile: str | Path | None = None, hardware: Hardware = H100) -> CostModel:
    """The analytic model, or the calibrated one when a profile path is given."""
    from megatron_wlb.costmodel.shapes import get_model

    shape = get_model(model) if isinstance(model, str) else model
    if profile is None:
        return AnalyticCostModel(shape, layout, hardware)
    return CalibratedCostModel.from_json(profile, shape, layout, hardware)
