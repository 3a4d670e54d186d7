"""Mixture-of-experts jobs beside their dense counterparts: the attention share of each micro-batch and what
balancing buys each (issue 36).

With top-k routing an MoE layer's GEMMs cost what a dense model of the *active* parameters costs per token,
while attention costs what the backbone's heads cost: against a dense model of the same size, causal
attention's quadratic term is a larger share of every micro-batch, so unequal documents unbalance the
pipeline more. Against the dense model of equal active parameters (``ModelShape.dense_counterpart``: the
same backbone, a dense MLP of the active size) the FLOPs are the same, and what differs is what the MoE
adds per token: the EP all-to-alls and the router (and a capacity factor's padding), which lower the
attention share. ``attention_shares`` measures that share on Megatron's own micro-batches.
"""

from __future__ import annotations

import numpy as np

from megatron_wlb.costmodel import CostModel, ModelShape
from megatron_wlb.data.cut import concat_and_cut_flat
from megatron_wlb.packing.metrics import overhead_seconds, piece_latency, piece_pairs, size_seconds
from megatron_wlb.sim.experiments import BALANCED_CUT, BASELINE_LABELS, PLAIN, WHOLE, WLB, Table
from megatron_wlb.sim.report import Verdict


def attention_shares(cost: CostModel, lengths: np.ndarray, seq_len: int, micro_batches: int) -> np.ndarray:
    """Per micro-batch of Megatron's concat-and-cut (the first ``micro_batches`` windows of ``seq_len``
    tokens of ``lengths`` laid back to back), the share of its forward + backward seconds per layer that
    causal attention takes: attention over attention + GEMMs + collectives (TP, CP, EP) + the fixed
    per-micro-batch cost, as the packer and the simulator price them."""
    if micro_batches < 1:
        raise ValueError(f"micro_batches must be >= 1, got {micro_batches}")
    counts, _, _, sizes = concat_and_cut_flat(np.asarray(lengths, dtype=np.int64), seq_len, range(micro_batches))
    counts = counts[counts > 0]
    if not counts.size:
        raise ValueError(f"no tokens to cut into micro-batches of {seq_len} tokens")
    hw = cost.hardware
    attention = cost.attention(sizes) * (1.0 + hw.bwd_attention)
    total = piece_latency(cost, sizes)
    mb = np.repeat(np.arange(counts.size), counts)
    attn = np.bincount(mb, weights=attention, minlength=counts.size)
    mb_tokens = np.bincount(mb, weights=sizes, minlength=counts.size)
    mb_pairs = np.bincount(mb, weights=piece_pairs(sizes), minlength=counts.size)
    whole = np.bincount(mb, weights=total, minlength=counts.size) + overhead_seconds(cost) \
        + size_seconds(cost, mb_tokens, mb_pairs)
    return attn / whole


def share_summary(shares: np.ndarray) -> dict[str, float]:
    """``{"mean", "p10", "p90", "max"}`` of per-micro-batch attention shares."""
    s = np.asarray(shares, dtype=np.float64)
    return {"mean": float(s.mean()), "p10": float(np.percentile(s, 10)), "p90": float(np.percentile(s, 90)),
            "max": float(s.max())}


def moe_table(model: ModelShape, dense: ModelShape, moe_verdict: Verdict, dense_verdict: Verdict,
             moe_shares: np.ndarray, dense_shares: np.ndarray) -> Table:
    """The MoE job beside its dense counterpart: active and total parameters, the attention share per
    micro-batch (mean [p10, p90]), and each balanced method's speedup over concat-and-cut and over
    whole-document (mean [min, max] over the orderings)."""
    def share(s: np.ndarray) -> str:
        x = share_summary(s)
        return f"{x['mean']:.3f} [{x['p10']:.3f}, {x['p90']:.3f}]"

    def speedup(v: Verdict, base: str, method: str) -> str:
        if base not in v.speedups or method not in v.speedups[base]:
            return "-"
        x = v.summary(base, method)
        return f"{x['mean']:.3f} [{x['min']:.3f}, {x['max']:.3f}]"

    rows: list[tuple] = [
        ("parameters, active / total (B)", f"{model.active_parameters() / 1e9:.2f} / {model.parameters() / 1e9:.2f}",
         f"{dense.active_parameters() / 1e9:.2f} / {dense.parameters() / 1e9:.2f}"),
        ("attention share per micro-batch, mean [p10, p90]", share(moe_shares), share(dense_shares)),
    ]
    for method in (WLB.name, BALANCED_CUT.name):
        for base in (PLAIN.name, WHOLE.name):
            if method == BALANCED_CUT.name and base == WHOLE.name:
                continue
            rows.append((f"{method} / {BASELINE_LABELS.get(base, base)}", speedup(moe_verdict, base, method),
                         speedup(dense_verdict, base, method)))
    return Table(f"MoE {model.name} beside the dense model of equal active parameters ({dense.name}: the same "
                 f"backbone, a dense FFN of {dense.ffn_hidden})",
                 ("", model.name, dense.name), tuple(rows),
                 notes=("Attention share: causal attention's forward + backward seconds over the whole micro-batch's "
                        "(GEMMs, TP/CP/EP collectives and its fixed cost included), per layer, on Megatron's "
                        "concat-and-cut micro-batches of the corpus (first ordering).",))
