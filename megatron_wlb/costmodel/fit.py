"""Fitting the cost model to measurements: a profile's kernel sweeps or measured micro-batches, the online
refit's normal equations (``RefitStats``, statistics that add across ranks), and the held-out error.

The one module where measured seconds become coefficients (``ProfileFit``); ``model.CalibratedCostModel``
prices with them and ``refit`` carries a refitted fit through a checkpoint. Pure: numpy only, no torch.
"""

from __future__ import annotations

import json
from collections.abc import Sequence
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any

import numpy as np

from megatron_wlb.costmodel.shapes import H100, Counts, ModelShape, causal_pairs, head_ratio
from megatron_wlb.costmodel.table import check_knots, fit_table, nnls_gram, pair_basis, table_columns

PROFILE_FORMAT = "megatron-wlb-profile/1"
#: the micro-batch fit's columns: causal pairs, tokens (the LM head's at its price in layers), query runs, 1 per
#: micro-batch, two terms of the micro-batch as a whole (what it costs beyond the sum of its documents): its
#: tokens squared and its tokens times its pairs, and two of CP communication: ``g - 1`` per micro-batch on a CP
#: group of ``g`` ranks (a ring all-gather's steps: its latency) and the K/V tokens a rank gathers from the others,
#: ``T (g - 1) / g`` of a micro-batch of ``T`` tokens (its bytes); both 0 on CP 1
TERMS = ("pairs", "tokens", "runs", "micro_batch", "tokens_sq", "tokens_pairs", "cp_calls", "cp_kv")
COLUMNS = len(TERMS)
#: the terms every micro-batch fit keeps; the others are kept only where they lower the held-out error
BASE_TERMS = TERMS[:4]
#: a candidate term is kept when it lowers the held-out ratio error (``held_out_errors``) by at least this share of it
#: and by ``RATIO_RESOLUTION``, without raising the held-out MAPE by more than this share (not noise)
KEEP_MARGIN = 0.05
#: the least absolute drop of the held-out ratio error a kept term must make: 0.2% of a predicted speed-up is below
#: what any comparison here resolves
RATIO_RESOLUTION = 0.002


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
    ``per_token_sq`` / ``per_token_pair``: forward seconds per squared token / per token x pair of a
    micro-batch on one GPU (its CP rank's tokens and pairs): the price of a micro-batch as a whole, beyond the
    sum of its documents (the machine pays more per token and per pair in a larger micro-batch), charged
    backward like GEMMs; 0 unless a micro-batch fit kept the term (``terms``). ``cp_call`` / ``cp_kv_token``: forward
    seconds per all-gather step of a CP group (``g - 1`` of them per micro-batch on ``g`` ranks) and per K/V token a
    rank gathers (``T (g - 1) / g``), charged backward like GEMMs (the terms ``cp_calls`` and ``cp_kv``).
    ``empty_fwd`` / ``empty_bwd``: the measured seconds per layer of a micro-batch that holds nothing on this rank
    (Megatron still runs it: a dynamic-CP slot done before its count), 0 when none was measured.
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
    per_token_sq: float = 0.0
    per_token_pair: float = 0.0
    terms: tuple[str, ...] = ()
    cp_call: float = 0.0
    cp_kv_token: float = 0.0
    empty_fwd: float = 0.0
    empty_bwd: float = 0.0

    def __post_init__(self) -> None:
        # a checkpoint's JSON gives lists: hold tuples of floats, as a fit made here does
        object.__setattr__(self, "pair_lengths", tuple(float(x) for x in self.pair_lengths))
        object.__setattr__(self, "pair_costs", tuple(float(x) for x in self.pair_costs))
        object.__setattr__(self, "terms", tuple(str(x) for x in self.terms))
        if len(self.pair_lengths) != len(self.pair_costs):
            raise ValueError(f"attention table of {len(self.pair_lengths)} lengths and {len(self.pair_costs)} costs: "
                             "give one forward cost per pair for each length")

    def per_pair(self, q_len: Counts) -> np.ndarray:
        """Forward seconds per causal pair of query runs of ``q_len`` queries: the table interpolated in
        log2(length) (``costmodel.table``), or ``attn_per_pair`` for every length without a table."""
        q = np.asarray(q_len, dtype=np.float64)
        if not self.pair_lengths:
            return np.full(q.shape, self.attn_per_pair)
        return (pair_basis(q.ravel(), self.pair_lengths) @ np.asarray(self.pair_costs)).reshape(q.shape)

    def size_cost(self, tokens: Counts, pairs: Counts) -> np.ndarray:
        """Forward seconds per layer of micro-batches of these tokens and pairs (one GPU's) as a whole, beyond
        their documents: ``per_token_sq * t^2 + per_token_pair * t * p`` (0 without those terms)."""
        t, p = np.asarray(tokens, dtype=np.float64), np.asarray(pairs, dtype=np.float64)
        return t * (self.per_token_sq * t + self.per_token_pair * p)

    def cp_cost(self, cp_calls: Counts, cp_kv: Counts) -> np.ndarray:
        """Forward seconds per layer of a CP group's communication for one micro-batch: ``cp_calls`` all-gather
        steps (``g - 1``) and ``cp_kv`` K/V tokens gathered from the other ranks (0 on CP 1)."""
        return self.cp_call * np.asarray(cp_calls, dtype=np.float64) + self.cp_kv_token * np.asarray(
            cp_kv, dtype=np.float64)

    def predict(self, pairs: Counts, tokens: Counts, head_tokens: Counts = 0.0, runs: Counts = 1.0,
                table: np.ndarray | None = None, cp_calls: Counts = 0.0, cp_kv: Counts = 0.0
                ) -> tuple[np.ndarray, np.ndarray]:
        """(forward, backward) seconds per layer of micro-batches with these causal (query, key) pairs, query
        tokens and query runs (documents) on one GPU (``head_tokens``: tokens whose LM head the point also
        ran, per layer; ``cp_calls`` / ``cp_kv``: its CP group's all-gather steps and gathered tokens).
        ``table``: the points' ``table.table_columns`` at this fit's ``pair_lengths``, which a fit with a table
        needs to price pairs by their runs' lengths (without it: ``attn_per_pair``)."""
        p, t, h, r = (np.asarray(x, dtype=np.float64) for x in (pairs, tokens, head_tokens, runs))
        if self.pair_lengths and table is not None:
            pair_cost = np.asarray(table, dtype=np.float64) @ np.asarray(self.pair_costs)
        else:
            pair_cost = self.attn_per_pair * p
        attn = pair_cost + self.attn_per_query * t + self.attn_per_run * r
        lin = (self.linear_per_token * (t + self.head_ratio * h) + self.overhead + self.size_cost(t, p)
               + self.cp_cost(cp_calls, cp_kv))
        return attn + lin, self.bwd_attention * attn + self.bwd_linear * lin

    def predict_points(self, section: dict) -> tuple[np.ndarray, np.ndarray]:
        """``predict`` of a ``micro_batches``-like section's points (its optional columns 0 where absent)."""
        return self.predict(section["pairs"], section["tokens"], section.get("head_tokens", 0.0),
                            section.get("runs", section.get("documents", 1.0)), table_of(section, self),
                            section.get("cp_calls", 0.0), section.get("cp_kv", 0.0))


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
    if "run_lengths" not in section or "run_pairs" not in section:
        raise ValueError("micro-batches without run_lengths / run_pairs: a fit with an attention table prices "
                         "each query run by its length; record them (costmodel.trace.profile_points does)")
    return table_columns(section["run_lengths"], section["run_pairs"], fit.pair_lengths)


def _fit_micro_batches(profile: dict) -> ProfileFit:
    """The fit of measured micro-batches (``RefitStats.fit``, the online refit's own, so
    that both agree), with its mean relative error of forward + backward on the fitted points."""
    mb = profile["micro_batches"]
    model = ModelShape(**profile["model"])
    if len(mb["fwd_s"]) < 3:
        raise ValueError(f"a micro_batches profile needs >= 3 measured micro-batches, got {len(mb['fwd_s'])}")
    fit = RefitStats.of(mb, model).fit(model, profile_terms(profile))
    x, f, b = design(mb, model)
    knots = _knots(profile)
    if knots:
        fit = _table_micro_batches(fit, mb, x, f, b, knots)
    empty = profile.get("empty_micro_batches") or {}
    if empty.get("fwd_s"):
        fit = replace(fit, empty_fwd=float(np.median(empty["fwd_s"])), empty_bwd=float(np.median(empty["bwd_s"])))
    pred_f, pred_b = fit.predict(mb["pairs"], mb["tokens"], mb.get("head_tokens", 0.0), mb.get("runs", 0.0),
                                 table_of(mb, fit), mb.get("cp_calls", 0.0), mb.get("cp_kv", 0.0))
    err = float(np.mean(np.abs(pred_f + pred_b - (f + b)) / (f + b)))
    cf, cb = np.asarray(fit.extra["fwd"]), np.asarray(fit.extra["bwd"])
    extra = {**fit.extra, "fwd_rel_err": float(np.mean(np.abs(x @ cf - f) / f)),
             "bwd_rel_err": float(np.mean(np.abs(x @ cb - b) / b))}
    return replace(fit, attn_rel_err=err, linear_rel_err=err, extra=extra)


def profile_terms(profile: dict) -> tuple[str, ...]:
    """The micro-batch terms a profile fits: its ``"terms"`` (what ``wlb calibrate --from-trace`` chose by
    held-out error, ``select_terms``), or the base terms (a profile written before the choice prices as it did)."""
    return check_terms(profile.get("terms", BASE_TERMS), "profile terms")


def _groups(section: dict, every: int) -> tuple[np.ndarray, str]:
    """Held-out groups of a ``micro_batches`` section: its points' ``packing`` labels when they name two or
    more packings (leave one packing out: the error a plan of another packer meets), else the iterations
    (``holdout_every``: one group held out, the rest fitted)."""
    labels = section.get("packing")
    if isinstance(labels, list) and len(labels) == len(section["fwd_s"]) and len(set(labels)) >= 2:
        names = sorted(set(labels))
        return np.array([names.index(x) for x in labels]), "packing"
    mask, _ = holdout_every(np.asarray(section.get("iteration", range(len(section["fwd_s"]))), dtype=np.int64), every)
    return mask.astype(np.int64), "iterations"


def held_out_errors(profile: dict, every: int = 5) -> dict[str, Any]:
    """The held-out errors of a fit, per group of ``_groups``: each group's points predicted by a fit of the others.

    ``{"by": "packing" | "iterations", "mape": mean over groups, "groups": {label: MAPE}, "biases": {label:
    slowest-rank bias}, "ratio_error": ...}``. The MAPE is per micro-batch; the bias (``slowest_rank_bias``) is what
    a packing's or layout's predicted time per iteration is off by, and ``ratio_error`` the root mean square of the
    log ratio of two groups' biases over every pair of groups, as a relative error: how far a predicted speed-up of
    one packing or layout over another is from the measured one, which is what a planner compares (None with fewer
    than two held-out groups)."""
    section = profile["micro_batches"]
    groups, by = _groups(section, every)
    labels = sorted(set(section["packing"])) if by == "packing" else ["fitted", "held out"]
    mape: dict[str, float] = {}
    biases: dict[str, float] = {}
    for g in np.unique(groups):
        if by == "iterations" and g == 0:
            continue  # the fitted iterations: only the held-out group is predicted
        held = holdout_mape(profile, groups == g)
        mape[labels[int(g)]] = held["mape"]
        if held["bias"] is not None:
            biases[labels[int(g)]] = held["bias"]
    logs = np.log(list(biases.values()))
    pairs = [(a - b) ** 2 for i, a in enumerate(logs) for b in logs[i + 1:]]
    ratio = float(np.expm1(np.sqrt(np.mean(pairs)))) if pairs else None
    return {"by": by, "mape": float(np.mean(list(mape.values()))), "groups": mape, "biases": biases,
            "ratio_error": ratio}


def _better(trial: dict[str, Any], best: dict[str, Any]) -> bool:
    """Whether a fit with one more term (``trial``'s held-out errors) is better than ``best``'s by more than noise: its
    ratio error lower by ``KEEP_MARGIN`` of it and by ``RATIO_RESOLUTION``, its MAPE not higher by more than
    ``KEEP_MARGIN`` of it; where no ratio error exists (one packing), its MAPE lower by ``KEEP_MARGIN`` of it."""
    if trial["ratio_error"] is None or best["ratio_error"] is None:
        return bool(trial["mape"] < best["mape"] * (1.0 - KEEP_MARGIN))
    return bool(trial["ratio_error"] < best["ratio_error"] * (1.0 - KEEP_MARGIN)
                and best["ratio_error"] - trial["ratio_error"] >= RATIO_RESOLUTION
                and trial["mape"] <= best["mape"] * (1.0 + KEEP_MARGIN))


def _criterion(errors: dict[str, Any]) -> float:
    """What the term search minimises: the ratio error where there is one, else the MAPE."""
    return float(errors["mape"] if errors["ratio_error"] is None else errors["ratio_error"])


def select_terms(profile: dict, every: int = 5) -> tuple[tuple[str, ...], dict[str, Any]]:
    """The micro-batch terms to fit: the base terms, then, one at a time, the candidate term (``TERMS`` beyond the
    base) with the least held-out ratio error between packings and layouts (``held_out_errors``; with one packing,
    the least held-out MAPE), while it is better by more than noise (``_better``). Candidate terms whose column is 0
    on every point (CP communication in a trace without CP) are not tried. Returns the terms and the report of why:
    every candidate's held-out errors at each step, and the machine's noise floor (``noise_floor``)."""
    kept: tuple[str, ...] = BASE_TERMS
    best = held_out_errors({**profile, "terms": list(kept)}, every)
    x, _, _ = design(profile["micro_batches"], ModelShape(**profile["model"]))
    left = [t for t in TERMS[len(BASE_TERMS):] if np.any(x[:, TERMS.index(t)] != 0)]
    report: dict[str, Any] = {"base": best, "steps": [], "noise_floor": noise_floor(profile["micro_batches"]),
                              "criterion": "mape" if best["ratio_error"] is None else "ratio_error"}
    while left:
        trials = {t: held_out_errors({**profile, "terms": [*kept, t]}, every) for t in left}
        term = min(trials, key=lambda t: _criterion(trials[t]))
        keep = _better(trials[term], best)
        report["steps"].append({"from": {"mape": best["mape"], "ratio_error": best["ratio_error"]},
                                "tried": {t: {"mape": v["mape"], "ratio_error": v["ratio_error"]}
                                          for t, v in trials.items()},
                                "kept": term if keep else None})
        if not keep:
            break
        kept, best = check_terms([*kept, term]), trials[term]
        left.remove(term)
    report["terms"], report["mape"], report["ratio_error"] = list(kept), best["mape"], best["ratio_error"]
    report["biases"] = best["biases"]
    report["resolved"] = _resolved(report, TERMS[len(BASE_TERMS):])
    return kept, report


def _resolved(report: dict[str, Any], candidates: Sequence[str]) -> dict[str, str]:
    """Per candidate term, whether the data resolve it: "kept" (it lowered the held-out error by more than noise),
    "unresolved" (its best trial moved the error by less than ``_better`` asks) or "no data" (its column is 0 on
    every point: never tried)."""
    out: dict[str, str] = {}
    for term in candidates:
        if any(step["kept"] == term for step in report["steps"]):
            out[term] = "kept"
        elif any(term in step["tried"] for step in report["steps"]):
            out[term] = "unresolved"
        else:
            out[term] = "no data"
    return out


def _table_micro_batches(base: ProfileFit, mb: dict, x: np.ndarray, f: np.ndarray, b: np.ndarray,
                         knots: tuple[float, ...]) -> ProfileFit:
    """The table form of a micro-batch fit: forward + backward = sum over knots of c_k x (pairs at knot k) +
    per-token + per-run + per-micro-batch terms (``table.fit_table``), split into forward and backward by
    ``base``'s (the one-knot fit's) bwd / fwd ratios, so the fitted total is priced exactly."""
    cols = table_columns(mb["run_lengths"], mb["run_pairs"], knots)
    keep = (f > 0) & (b > 0)
    ba, bl = base.bwd_attention, base.bwd_linear
    kept = np.array([t in base.terms for t in TERMS[1:]], dtype=np.float64)  # a term left out: its column 0
    xt = np.concatenate([cols, x[:, 1:] * kept], axis=1)
    tf = fit_table(xt[keep], (f + b)[keep], len(knots), base.attn_per_pair * (1.0 + ba))
    k = len(knots)
    costs = tf.coef[:k] / (1.0 + ba)
    mean_cost = float(cols.sum(axis=0) @ costs / cols.sum()) if cols.sum() > 0 else base.attn_per_pair
    return replace(base, attn_per_pair=mean_cost, pair_lengths=knots, pair_costs=tuple(float(c) for c in costs),
                   linear_per_token=float(tf.coef[k] / (1.0 + bl)), attn_per_run=float(tf.coef[k + 1] / (1.0 + ba)),
                   overhead=float(tf.coef[k + 2] / (1.0 + bl)), per_token_sq=float(tf.coef[k + 3] / (1.0 + bl)),
                   per_token_pair=float(tf.coef[k + 4] / (1.0 + bl)), cp_call=float(tf.coef[k + 5] / (1.0 + bl)),
                   cp_kv_token=float(tf.coef[k + 6] / (1.0 + bl)),
                   extra={**base.extra, "table": _table_extra(tf)})


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
    pred_f, pred_b = fit.predict_points(test)
    measured = np.asarray(test["fwd_s"], dtype=np.float64) + np.asarray(test["bwd_s"], dtype=np.float64)
    return {"mape": float(np.mean(np.abs(pred_f + pred_b - measured) / measured)),
            "micro_batches": len(test["fwd_s"]), "bias": slowest_rank_bias(test, pred_f + pred_b, measured)}


def slowest_rank_bias(section: dict, predicted: np.ndarray, measured: np.ndarray) -> float | None:
    """The signed bias that decides a plan's predicted speed-up: per iteration, the slowest rank's predicted seconds
    over its measured (each rank's micro-batches summed; ``section``'s ``iteration`` and ``rank`` per point), the
    geometric mean over iterations; None without ranks. A bias shared by two packings cancels in their ratio, so
    the ratio error between packings is the spread of their biases (``held_out_errors``)."""
    ranks, iterations = section.get("rank"), section.get("iteration")
    if not isinstance(ranks, list) or not isinstance(iterations, list) or len(ranks) != len(measured):
        return None
    pred: dict[int, dict[int, float]] = {}
    meas: dict[int, dict[int, float]] = {}
    for it, rank, p, m in zip(iterations, ranks, predicted, measured):
        pred.setdefault(int(it), {}).setdefault(int(rank), 0.0)
        meas.setdefault(int(it), {}).setdefault(int(rank), 0.0)
        pred[int(it)][int(rank)] += float(p)
        meas[int(it)][int(rank)] += float(m)
    logs = [np.log(max(pred[it].values()) / max(meas[it].values())) for it in pred if max(meas[it].values()) > 0]
    return float(np.exp(np.mean(logs))) if logs else None


def noise_floor(section: dict) -> dict[str, Any]:
    """The machine's noise on identical micro-batches: points of the same packing, rank and content (tokens, pairs,
    runs and run lengths) measured more than once (the paired harness trains each global batch twice), their
    mean relative deviation from their own mean. No model can predict a point closer than this on average, so a
    held-out MAPE near it is the floor, not the model. ``{"mape": None}`` when no micro-batch repeats."""
    n = len(section["fwd_s"])
    labels = section.get("packing") or [""] * n
    ranks = section.get("rank") or [0] * n
    runs = section.get("run_lengths") or [[]] * n
    seconds = np.asarray(section["fwd_s"], dtype=np.float64) + np.asarray(section["bwd_s"], dtype=np.float64)
    groups: dict[tuple, list[float]] = {}
    for i in range(n):
        key = (labels[i], ranks[i], section["tokens"][i], section["pairs"][i], tuple(runs[i]))
        groups.setdefault(key, []).append(float(seconds[i]))
    devs = [abs(x - np.mean(v)) / np.mean(v) for v in groups.values() if len(v) > 1 for x in v]
    return {"mape": float(np.mean(devs)) if devs else None, "repeated_points": len(devs)}


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
      ``"run_lengths"`` and ``"run_pairs"``: its query runs' count, and each run's length and pairs;
      ``"packing"``: the packing whose plan it ran, for the held-out error across packings). Optional
      ``"terms"``: the micro-batch terms fitted (``TERMS``; default the base terms; ``select_terms`` chooses).

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
        for optional in ("head_tokens", "cp_calls", "cp_kv"):
            if optional in mb:
                checks.append((optional, 0, False))
        counts = {k: _series(where, mb, k, low, strict) for k, low, strict in checks}
        if len(set(counts.values())) > 1:
            raise ValueError(f"{where}: {', '.join(counts)} differ in length ({', '.join(map(str, counts.values()))})")
        labels = mb.get("packing")
        if labels is not None and (not isinstance(labels, list) or len(labels) != counts["fwd_s"] or not all(
                isinstance(x, str) for x in labels)):
            raise ValueError(f"{where}.packing: expected one packing name per micro-batch ({counts['fwd_s']} strings)")
        for key in ("run_lengths", "run_pairs"):
            runs = mb.get(key)
            if runs is not None and (not isinstance(runs, list) or len(runs) != counts["fwd_s"] or not all(
                    isinstance(r, list) for r in runs)):
                raise ValueError(f"{where}.{key}: expected one list per micro-batch ({counts['fwd_s']} lists)")
    empty = profile.get("empty_micro_batches")
    if empty is not None:
        where = f"{path}: empty_micro_batches"
        if not isinstance(empty, dict) or len({_series(where, empty, k, 0, False) for k in ("fwd_s", "bwd_s")}) > 1:
            raise ValueError(f"{where}: expected {{\"fwd_s\": [...], \"bwd_s\": [...]}} of one length")
    if "terms" in profile:
        if "micro_batches" not in profile or not isinstance(profile["terms"], list):
            raise ValueError(f"{path}: terms {str(profile['terms'])[:60]}: a list of micro-batch fit terms, with "
                             "micro_batches")
        check_terms(profile["terms"], f"{path}: terms")
    if "attention_table" in profile:
        table = profile["attention_table"]
        if not isinstance(table, dict) or "lengths" not in table:
            raise ValueError(f"{path}: attention_table {str(table)[:60]}: expected {{\"lengths\": [knot lengths]}}")
        check_knots(table["lengths"], f"{path}: attention_table.lengths")
        if "micro_batches" in profile and not {"run_lengths", "run_pairs"} <= set(profile["micro_batches"]):
            raise ValueError(f"{path}: attention_table needs micro_batches.run_lengths and run_pairs (each query "
                             "run's length and pairs); drop the table for the linear-in-pairs fit")
    return profile


def design(points: dict[str, Any], model: ModelShape) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """(x, forward, backward) of a ``micro_batches`` section (``costmodel.trace.profile_points``): columns
    ``TERMS``; a section without ``runs`` (or ``head_tokens``) has that column 0, and its coefficient 0."""
    p, t, f, b = (np.asarray(points[k], dtype=np.float64) for k in ("pairs", "tokens", "fwd_s", "bwd_s"))
    head = np.asarray(points.get("head_tokens", np.zeros_like(t)), dtype=np.float64)
    runs = np.asarray(points.get("runs", np.zeros_like(t)), dtype=np.float64)
    calls = np.asarray(points.get("cp_calls", np.zeros_like(t)), dtype=np.float64)
    kv = np.asarray(points.get("cp_kv", np.zeros_like(t)), dtype=np.float64)
    x = np.stack([p, t + head_ratio(model) * head, runs, np.ones_like(t), t * t, t * p, calls, kv], axis=1)
    return x, f, b


def check_terms(terms: Sequence[str], where: str = "terms") -> tuple[str, ...]:
    """``terms`` as a tuple in ``TERMS`` order; a one-line error naming an unknown or missing base term."""
    given = tuple(str(t) for t in terms)
    unknown = sorted(set(given) - set(TERMS))
    if unknown or not set(BASE_TERMS) <= set(given):
        raise ValueError(f"{where} {list(given)}: expected the base terms {list(BASE_TERMS)} and any of "
                         f"{list(TERMS[len(BASE_TERMS):])}" + (f" (unknown: {', '.join(unknown)})" if unknown else ""))
    return tuple(t for t in TERMS if t in given)


#: a backward / forward ratio of two coefficients is taken only where each is fitted to within this relative
#: standard error; else the mean measured ratio stands in (``RefitStats.fit``)
RATIO_RTOL = 0.25


@dataclass(frozen=True)
class RefitStats:
    """Normal equations of the relative least-squares fits (rows of ``x / y``, target 1) of forward and
    backward, and the sum of backward / forward ratios; ``vector()`` / ``from_vector`` for a SUM all-reduce."""

    gram_fwd: np.ndarray
    rhs_fwd: np.ndarray
    gram_bwd: np.ndarray
    rhs_bwd: np.ndarray
    points: float
    ratio_sum: float

    SIZE = 2 * (COLUMNS * COLUMNS + COLUMNS) + 2

    @classmethod
    def empty(cls) -> RefitStats:
        return cls.from_vector(np.zeros(cls.SIZE))

    @classmethod
    def of(cls, points: dict[str, Any], model: ModelShape) -> RefitStats:
        """The statistics of measured micro-batches (points with positive times only)."""
        x, f, b = design(points, model)
        keep = (f > 0) & (b > 0)
        x, f, b = x[keep], f[keep], b[keep]
        af, ab = x / f[:, None], x / b[:, None]
        return cls(af.T @ af, af.sum(axis=0), ab.T @ ab, ab.sum(axis=0), float(f.size), float((b / f).sum()))

    def vector(self) -> np.ndarray:
        return np.concatenate([self.gram_fwd.ravel(), self.rhs_fwd, self.gram_bwd.ravel(), self.rhs_bwd,
                               [self.points, self.ratio_sum]])

    @classmethod
    def from_vector(cls, v: np.ndarray) -> RefitStats:
        v = np.asarray(v, dtype=np.float64)
        if v.shape != (cls.SIZE,):
            raise ValueError(f"refit statistics: expected {cls.SIZE} numbers, got shape {v.shape}")
        g = COLUMNS * COLUMNS
        k = g + COLUMNS
        return cls(v[:g].reshape(COLUMNS, COLUMNS), v[g:k], v[k:k + g].reshape(COLUMNS, COLUMNS),
                   v[k + g:2 * k], float(v[-2]), float(v[-1]))

    def __add__(self, other: RefitStats) -> RefitStats:
        return RefitStats.from_vector(self.vector() + other.vector())

    def _relative_errors(self, gram: np.ndarray, rhs: np.ndarray, coef: np.ndarray, cols: list[int]) -> set[int]:
        """The columns of ``cols`` whose fitted coefficient's standard error (the least-squares estimate from the
        normal equations and the residual) exceeds ``RATIO_RTOL`` of it: the rows do not determine it."""
        dof = self.points - len(cols)
        if dof <= 0:
            return set(cols)
        g, c = gram[np.ix_(cols, cols)], coef[cols]
        residual = max(self.points - 2.0 * float(c @ rhs[cols]) + float(c @ g @ c), 0.0)  # sum of (1 - x.c / y)^2
        scale = np.sqrt(np.diag(g))
        scale[scale == 0] = 1.0
        variance = np.diag(np.linalg.pinv(g / np.outer(scale, scale), rcond=1e-12)) / scale ** 2 * residual / dof
        error = np.sqrt(np.maximum(variance, 0.0))
        return {col for col, e, value in zip(cols, error, c) if not (value > 0 and e <= RATIO_RTOL * value)}

    def fit(self, model: ModelShape, terms: Sequence[str] = BASE_TERMS) -> ProfileFit:
        """The micro-batch fit (``fit_profile`` fits a profile's ``micro_batches`` section with it):
        forward and backward each ``a*pairs + b*tokens + r*runs + c`` (+ ``s*tokens^2`` and
        ``u*tokens*pairs`` with the terms ``tokens_sq`` and ``tokens_pairs``), non-negative, over the
        columns of ``terms`` only. bwd_attention = a_b / a_f and bwd_linear = b_b / b_f (the mean measured
        ratio where a coefficient is 0 or not determined by the rows: its standard error over ``RATIO_RTOL``).
        The cost model charges the per-run, per-micro-batch and whole-micro-batch terms forward and
        x bwd_attention / bwd_linear backward, so they are set to
        (r_f + r_b) / (1 + bwd_attention), (c_f + c_b) / (1 + bwd_linear), (s_f + s_b) / (1 + bwd_linear)
        and (u_f + u_b) / (1 + bwd_linear): the forward + backward the packer balances is the fitted one
        exactly, only its split is approximate."""
        if self.points < 3:
            raise ValueError(f"a micro-batch fit needs >= 3 measured micro-batches, got {self.points:g}")
        kept = check_terms(terms)
        cols = [TERMS.index(t) for t in kept]

        def solve(gram: np.ndarray, rhs: np.ndarray) -> np.ndarray:
            out = np.zeros(COLUMNS)
            out[cols] = nnls_gram(gram[np.ix_(cols, cols)], rhs[cols], self.points)
            return out

        cf, cb = solve(self.gram_fwd, self.rhs_fwd), solve(self.gram_bwd, self.rhs_bwd)
        mean_ratio = self.ratio_sum / self.points
        # a ratio of coefficients the rows do not determine (few rows, or columns moving together: packed
        # micro-batches of one size) is noise: 16 rows of a CPU run gave bwd/fwd 4.50 where the mean was ~2
        loose = (self._relative_errors(self.gram_fwd, self.rhs_fwd, cf, cols)
                 | self._relative_errors(self.gram_bwd, self.rhs_bwd, cb, cols))
        guarded = [name for name, i in (("bwd_attention", 0), ("bwd_linear", 1))
                   if not (cf[i] > 0 and cb[i] > 0) or i in loose]
        bwd_attention = float(cb[0] / cf[0]) if "bwd_attention" not in guarded else mean_ratio
        bwd_linear = float(cb[1] / cf[1]) if "bwd_linear" not in guarded else mean_ratio
        # every coefficient as (forward + backward) / (1 + its backward ratio): the fitted total is priced exactly,
        # a guarded ratio only moves the split (for an unguarded one this is the forward coefficient itself)
        return ProfileFit(attn_per_pair=float((cf[0] + cb[0]) / (1.0 + bwd_attention)), attn_per_query=0.0,
                          linear_per_token=float((cf[1] + cb[1]) / (1.0 + bwd_linear)),
                          overhead=float((cf[3] + cb[3]) / (1.0 + bwd_linear)), attn_rel_err=float("nan"),
                          linear_rel_err=float("nan"), bwd_attention=bwd_attention, bwd_linear=bwd_linear,
                          form="micro_batches", head_ratio=head_ratio(model),
                          attn_per_run=float((cf[2] + cb[2]) / (1.0 + bwd_attention)),
                          per_token_sq=float((cf[4] + cb[4]) / (1.0 + bwd_linear)),
                          per_token_pair=float((cf[5] + cb[5]) / (1.0 + bwd_linear)), terms=kept,
                          cp_call=float((cf[6] + cb[6]) / (1.0 + bwd_linear)),
                          cp_kv_token=float((cf[7] + cb[7]) / (1.0 + bwd_linear)),
                          extra={"fwd": cf.tolist(), "bwd": cb.tolist(), "points": int(self.points),
                                 "ratio_from_mean": guarded})
