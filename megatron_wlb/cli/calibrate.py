"""``wlb calibrate``: measure the configured model's per-layer latencies on this machine (its GPU, or its
CPU when it has none) or fit them from a training trace, and write the cost-model profile
(``--cost-profile`` / ``--wlb-cost-profile``); measuring also writes the adaptive layout's kernel table.

    wlb calibrate --config 7b_128k --out profile.json        # on a GPU node (bf16, CUDA events)
    wlb calibrate --config my.yaml --out profile.json         # no GPU: the CPU, fp32, the config's real shapes
    wlb calibrate --from-trace trace.jsonl --out profile.json # fit to a training run's --wlb-trace
    wlb calibrate --smoke --out /tmp/profile.json             # the CI check: tiny shapes, CPU

What is measured, per transformer layer on one device at the config's TP degree:

- attention: causal self-attention of ONE document of each length in ``--lengths`` (query heads
  and key/value heads divided by TP), and the three longest again as 8 equal documents (a call's fixed
  cost apart from a document's), forward and backward timed separately;
- linear: the layer's GEMMs (QKV, output projection, MLP; SwiGLU when the model has it) over each
  token count in ``--tokens``, forward and backward;
- held out: ``--holdout`` composite micro-batches (several documents of seeded random lengths through
  the layer's GEMMs and varlen attention, forward and backward), left out of the fit; the fitted
  model's mean absolute percentage error (MAPE) on their forward + backward is printed and stored.

On the CPU (no CUDA, or ``--device cpu``) the attention kernel is ``reference`` (plain torch) in fp32
and the default grids stop where one measured call would exceed ``CpuBudget`` (a long-context config's
128K lengths would take hours), which the output says.

Writes ``OUT`` in the ``megatron-wlb-profile/1`` format that ``costmodel.load_profile`` reads
(``{"format", "device", "model", "tp", "attention": {"lengths", "documents", "fwd_s", "bwd_s"}, "linear":
{"tokens", "fwd_s", "bwd_s"}, "holdout": {"mape", "micro_batches", "measured"}}``) and ``OUT`` with
suffix ``.efficiency.json``: the achieved attention TFLOP/s over (query run, key range) shapes in the
``megatron-wlb-attn-efficiency/1`` format of ``cp/data/default_efficiency.json`` (``wlb shard --kernel-table``).

``--from-trace`` reads every rank's file of a ``--wlb-trace`` (``costmodel.trace``), drops the first
``--skip-iters`` iterations, and writes the profile's measured-micro-batch form (``"micro_batches"``: each
row's causal pairs and tokens on its rank, its seconds per layer); every ``--holdout-every``-th
iteration is held out for the MAPE, then the written fit uses every row. A trace times whole
micro-batches, not kernel shapes: it gives no kernel table.
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from collections.abc import Callable
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any, TypeVar

import numpy as np

from megatron_wlb.cli.common import output_file, positive
from megatron_wlb.config import load_config
from megatron_wlb.costmodel import (
    PROFILE_FORMAT,
    CalibratedCostModel,
    ModelShape,
    ParallelLayout,
    ProfileFit,
    causal_pairs,
    fit_profile,
    holdout_every,
    holdout_mape,
    load_profile,
)
from megatron_wlb.costmodel.fit import BASE_TERMS, KEEP_MARGIN, RATIO_RESOLUTION, held_out_errors, select_terms
from megatron_wlb.costmodel.table import MAX_KNOTS, choose_knots
from megatron_wlb.costmodel.trace import empty_points, profile_points, read_trace, trace_packing, trace_setup
from megatron_wlb.cp.efficiency import EFFICIENCY_FORMAT, KernelEfficiency
from megatron_wlb.packing.types import resolve_max_seq_len
from megatron_wlb.provenance import machine

#: a line of progress to stderr
Log = Callable[[str], None]
#: query, key and value tensors of one attention call (torch is imported only when measuring)
QKV = tuple[Any, Any, Any]
_S = TypeVar("_S")

#: the smoke run's model: every dimension tiny, GQA and SwiGLU on so that their code paths run
SMOKE_MODEL = ModelShape("smoke", hidden=64, num_layers=2, num_heads=4, num_kv_heads=2, ffn_hidden=128, vocab=256,
                         swiglu=True)
#: the fewest trace rows (after warm-up) a fit plus its held-out check accepts
MIN_TRACE_POINTS = 6


@dataclass(frozen=True)
class SmokeGrid:
    """The smoke run's measurement grid (the flags' values of a CPU run that measures nothing)."""

    lengths: str = "16,32,64,128"
    tokens: str = "32,64,128,256"
    q_lens: str = "4,8,16"
    kv_lens: str = "8,16"
    tile: int = 4
    table_tokens: int = 32
    warmup: int = 1
    iters: int = 2
    holdout: int = 3


SMOKE = SmokeGrid()


@dataclass(frozen=True)
class CpuBudget:
    """The CPU's defaults: grids in half-octave steps from ``start`` while one call's forward stays within
    ``flops`` (~0.1-0.5 s on a few cores in fp32) and the reference kernel's fp32 scores of one document
    (heads x d x d) within ``score_bytes``, at least ``points`` values even past the budget; ``warmup``
    untimed and ``iters`` timed calls per shape, more while less than ``min_seconds`` was timed."""

    flops: float = 4e9
    score_bytes: float = 2.0 ** 28
    start: int = 64
    points: int = 5
    warmup: int = 2
    iters: int = 5
    min_seconds: float = 0.15


CPU = CpuBudget()


@dataclass
class Plan:
    """What one measuring run does: model, device, kernel and grids, with notes for the output."""

    model: ModelShape
    tp: int
    dtype: Any
    device: Any
    device_name: str
    backend: str
    lengths: list[int]
    tokens: list[int]
    q_lens: list[int]
    kv_lens: list[int]
    table_tokens: int
    tile: int
    warmup: int
    iters: int
    holdout: int
    holdout_tokens: int
    notes: list[str] = field(default_factory=list)
    min_seconds: float = 0.0
    threads: int | None = None
    #: expert parallelism of an MoE config: the layer holds num_experts / ep experts
    ep: int = 1


def add_parser(subparsers: argparse._SubParsersAction) -> None:
    p = subparsers.add_parser("calibrate", help="measure attention and linear latency on this GPU or CPU (or fit "
                              "them from a training trace); write the cost-model profile and the kernel table",
                              description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--out", required=True, metavar="PROFILE.json", help="cost-model profile to write")
    p.add_argument("--efficiency-out", default=None, metavar="JSON",
                   help="kernel-efficiency table to write (default: OUT with suffix .efficiency.json)")
    p.add_argument("--config", default="7b_128k",
                   help="config (shipped name or YAML) whose model and TP are measured (default 7b_128k)")
    p.add_argument("--tp", type=int, default=None, help="tensor-parallel size (default: the config's)")
    p.add_argument("--device", choices=("auto", "cuda", "cpu"), default="auto",
                   help="where to measure (default auto: the GPU if torch sees one, else the CPU)")
    p.add_argument("--lengths", default=None,
                   help="comma-separated document lengths for attention (default: 512 .. the config's seq_len, x2; "
                        "CPU: 64 .. in half octaves, as far as the CPU budget allows)")
    p.add_argument("--tokens", default=None,
                   help="comma-separated token counts for the linear part (default 1024 .. 32768, x2; CPU: 64 .. "
                        "S_max in half octaves, within the CPU budget)")
    p.add_argument("--q-lens", default=None,
                   help="efficiency table: query-run lengths (default 128 .. 128K, x2; CPU: octaves of the lengths)")
    p.add_argument("--kv-lens", default=None,
                   help="efficiency table: key lengths (default 128 .. 128K, x2; CPU: octaves of the lengths)")
    p.add_argument("--table-tokens", type=int, default=None,
                   help="efficiency table: key tokens per kernel call (runs = tokens // kv; default 131072, CPU: "
                        "the longest length)")
    p.add_argument("--tile", type=int, default=128, help="attention kernel tile recorded in the table (default 128)")
    p.add_argument("--dtype", choices=("bf16", "fp16", "fp32"), default=None,
                   help="dtype (default bf16 on a GPU, fp32 on the CPU)")
    p.add_argument("--backend", default="auto", help="attention kernel: auto | torch-varlen | flash-attn | reference "
                   "(auto: a varlen kernel on a GPU, reference on the CPU)")
    p.add_argument("--warmup", type=int, default=None,
                   help=f"untimed calls per measured shape (default 3 on a GPU, {CPU.warmup} on the CPU)")
    p.add_argument("--skip-iters", type=int, default=None,
                   help="--from-trace: the trace's first iterations, dropped (default 2)")
    p.add_argument("--threads", type=int, default=None,
                   help="CPU: torch threads (default: torch's, i.e. OMP_NUM_THREADS or every core); give what each "
                        "training process uses, 1 for one process per core")
    p.add_argument("--iters", type=int, default=None,
                   help="timed calls per shape, the mean of their middle half kept (default 10 on a GPU; 5 on the "
                        "CPU, more while less than --min-seconds was timed)")
    p.add_argument("--min-seconds", type=float, default=None,
                   help=f"CPU: repeat a shape's timed calls until this many seconds were timed (default "
                        f"{CPU.min_seconds}; 0 for --iters calls only)")
    p.add_argument("--holdout", type=int, default=8,
                   help="composite micro-batches measured apart from the fit, for its held-out MAPE (default 8)")
    p.add_argument("--seed", type=int, default=0, help="seed of the random tensors and held-out documents (default 0)")
    p.add_argument("--from-trace", default=None, nargs="+", metavar="TRACE",
                   help="fit the profile to training traces (--wlb-trace TRACE; every rank's file) instead of "
                        "measuring kernels; traces of several packings (e.g. wlb and fixed-greedy runs) give the "
                        "held-out error per packing and choose the micro-batch terms by it")
    p.add_argument("--holdout-every", type=int, default=5,
                   help="--from-trace: hold out iterations i with i %% K == K-1 for the MAPE (default 5)")
    p.add_argument("--knots", type=int, default=MAX_KNOTS,
                   help=f"attention's per-pair cost as a table over at most this many query-run lengths, "
                        f"interpolated in log2 length (default {MAX_KNOTS}; 1: one cost per pair, the linear-in-pairs "
                        "form of profiles written before the table)")
    p.add_argument("--smoke", action="store_true",
                   help="CPU, fp32, a tiny model and grid: exercises the code path (CI), measures nothing useful")
    p.set_defaults(func=run)


def int_list(text: str, flag: str) -> list[int]:
    try:
        values = [int(x) for x in text.replace(" ", "").split(",") if x]
    except ValueError:
        raise ValueError(f"{flag} {text!r}: give comma-separated positive integers") from None
    if not values or any(v < 1 for v in values) or any(a >= b for a, b in zip(values, values[1:])):
        raise ValueError(f"{flag} {text!r}: give strictly increasing positive integers")
    return values


def budget_grid(limit: int, cost: Callable[[int], float], budget: CpuBudget = CPU) -> tuple[list[int], str]:
    """``budget.start`` x sqrt(2)^i up to ``limit`` while ``cost(v) <= 1`` (1 = the budget), at least
    ``budget.points`` values; and a note naming where the budget stopped it ('' if it did not). Half-octave
    steps: single CPU shapes are noisy (allocations), so the fit gets more of them."""
    grid: list[int] = []
    i = 0
    while True:
        v = int(round(budget.start * 2 ** (i / 2)))
        if len(grid) >= budget.points and (v > limit or cost(v) > 1.0):
            break
        grid.append(v)
        i += 1
    capped = v <= limit and cost(v) > 1.0
    return grid, (f"stops at {grid[-1]} of {limit}" if capped else "")


def middle_mean(samples: list[float]) -> float:
    """The mean of the middle half of ``samples`` (interquartile mean): robust to a stray slow call like a
    median, but it averages the two modes of a bimodal kernel (the CPU reference attention's allocations
    make some shapes alternate between two speeds) instead of picking one."""
    x = np.sort(np.asarray(samples, dtype=np.float64))
    lo = x.size // 4
    return float(x[lo:x.size - lo].mean())


def cpu_clock(device: Any, threads: int | None) -> Callable[[], float]:
    """The calibration's clock: on a CPU with one torch thread the calling thread does all the work, so its CPU
    time (``time.thread_time``) is the op's time without the waits a shared machine adds; else wall time."""
    return time.thread_time if device.type == "cpu" and threads == 1 else time.perf_counter


class Timer:
    """Seconds of a callable (``middle_mean`` of its samples): ``clock`` around it, after a device sync
    (perf_counter; on a CPU with one torch thread ``time.thread_time``, see ``cpu_clock``).
    With ``min_seconds``, short calls are repeated past ``iters`` (up to ``max_iters``) until that much
    was timed, so that a millisecond call is not at the mercy of a few samples on a shared CPU."""

    def __init__(self, torch: Any, device: Any, warmup: int, iters: int, min_seconds: float = 0.0,
                 max_iters: int = 50, clock: Callable[[], float] = time.perf_counter):
        self.torch, self.device, self.warmup, self.iters = torch, device, warmup, iters
        self.min_seconds, self.max_iters, self.clock = min_seconds, max(iters, max_iters), clock

    def _sync(self) -> None:
        if self.device.type == "cuda":
            self.torch.cuda.synchronize(self.device)

    def measure(self, setup: Callable[[], _S], timed: Callable[[_S], object]) -> float:
        """``middle_mean`` over ``iters`` (or more) of ``timed(setup())``; only ``timed`` is inside the clock."""
        samples: list[float] = []
        i = 0
        while len(samples) < self.iters or (sum(samples) < self.min_seconds and len(samples) < self.max_iters):
            state = setup()
            self._sync()
            t0 = self.clock()
            timed(state)
            self._sync()
            if i >= self.warmup:
                samples.append(self.clock() - t0)
            i += 1
        return middle_mean(samples)

    def forward_backward(self, make_input: Callable[[], Any], fn: Callable[[Any], Any]) -> tuple[float, float]:
        """(forward, backward) seconds of ``fn`` on fresh inputs: the forward without autograd, the
        backward of an output built outside the clock."""
        torch = self.torch

        def forward(x: Any) -> None:
            with torch.no_grad():
                fn(x)

        def with_graph() -> tuple[Any, Any]:
            out = fn(make_input())
            return out, torch.ones_like(out)

        return self.measure(make_input, forward), self.measure(with_graph, lambda s: s[0].backward(s[1]))


class Layer:
    """One transformer layer's GEMMs on one device at TP (QKV, output projection, MLP; SwiGLU when the
    model has it), random weights. Between QKV and the output projection: causal varlen attention over
    the documents ``cu`` (a composite micro-batch), or, without ``cu`` (the linear sweep), the query
    columns standing in for its output."""

    def __init__(self, torch: Any, model: ModelShape, tp: int, dtype: Any, device: Any, backend: str, ep: int = 1):
        self.torch, self.model, self.backend = torch, model, backend
        self.heads, self.kv_heads, self.dim = model.num_heads // tp, model.num_kv_heads // tp, model.head_dim
        h = model.hidden

        def weight(rows: int, cols: int) -> Any:
            return (torch.randn(rows, cols, device=device, dtype=dtype) / cols ** 0.5).requires_grad_(True)

        def mlp(ffn: int) -> tuple[Any, Any]:
            return weight((2 if model.swiglu else 1) * ffn // tp, h), weight(h, ffn // tp)

        q_cols, kv_cols = self.heads * self.dim, self.kv_heads * self.dim
        self.w_qkv, self.w_o = weight(q_cols + 2 * kv_cols, h), weight(h, q_cols)
        self.experts: list[tuple[Any, Any]] = []
        self.shared: tuple[Any, Any] | None = None
        if model.is_moe:
            # an MoE layer (every layer of the measured shape, ``measured_shape``): the router, this EP rank's
            # num_experts / ep experts (expert TP = tp) and the shared expert
            self.router = weight(model.num_experts or 1, h)
            self.experts = [mlp(model.expert_ffn_hidden) for _ in range(max(1, (model.num_experts or 1) // ep))]
            if model.moe_shared_expert_hidden:
                self.shared = mlp(model.moe_shared_expert_hidden)
        else:
            self.w_up, self.w_down = mlp(model.ffn_hidden)

    def __call__(self, x: Any, cu: Any = None, longest: int | None = None) -> Any:
        """One layer over ``x``; ``cu``: the documents' offsets (a device tensor, uploaded before the timed
        region, or host ints) and ``longest`` their longest (host int)."""
        import torch.nn.functional as F

        from megatron_wlb.cp.attention import varlen_attention  # imports torch: only when measuring

        q_cols, kv_cols = self.heads * self.dim, self.kv_heads * self.dim
        qkv = F.linear(x, self.w_qkv)
        if cu is None:
            attn = qkv[:, :q_cols]
        else:
            t = x.shape[0]
            longest = int(np.diff(np.asarray(cu)).max()) if longest is None else longest
            q = qkv[:, :q_cols].reshape(t, self.heads, self.dim)
            k = qkv[:, q_cols:q_cols + kv_cols].reshape(t, self.kv_heads, self.dim)
            v = qkv[:, q_cols + kv_cols:].reshape(t, self.kv_heads, self.dim)
            attn = varlen_attention(q, k, v, cu, cu, longest, longest, backend=self.backend).reshape(t, q_cols)
        y = F.linear(attn, self.w_o)
        if self.experts:
            return self.moe(x + y)
        return self.mlp(x + y, self.w_up, self.w_down)

    def mlp(self, x: Any, w_up: Any, w_down: Any) -> Any:
        import torch.nn.functional as F

        up = F.linear(x, w_up)
        if self.model.swiglu:
            gate, val = up.chunk(2, dim=-1)
            up = F.silu(gate) * val
        else:
            up = F.gelu(up)
        return F.linear(up, w_down)

    def moe(self, x: Any) -> Any:
        """The MoE MLP on one EP rank: router scores and top-k, the dispatcher's local permutation of
        ``expert_load`` x tokens rows into expert order, each local expert on its even share of them (the
        balanced expectation; the all-to-alls between EP ranks are priced analytically, as TP/CP's), the
        weighted un-permutation back to the tokens, and the shared expert."""
        torch, model = self.torch, self.model
        import torch.nn.functional as F

        t = x.shape[0]
        probs = torch.softmax(F.linear(x, self.router).float(), dim=-1)
        weights, _ = torch.topk(probs, model.moe_topk, dim=-1)
        rows = max(1, int(round(t * model.expert_load)))
        token = torch.arange(rows, device=x.device) % t  # each assignment's token
        dispatched = x.index_select(0, token)
        chunks = dispatched.tensor_split(len(self.experts))
        out = torch.cat([self.mlp(c, up, down) for c, (up, down) in zip(chunks, self.experts)])
        scale = weights.to(x.dtype).reshape(-1).repeat(rows // (t * model.moe_topk) + 1)[:rows, None]
        combined = torch.zeros_like(x).index_add(0, token, out * scale)
        if self.shared is not None:
            combined = combined + self.mlp(x, *self.shared)
        return combined


def measured_shape(model: ModelShape) -> ModelShape:
    """The shape ``Layer`` measures: an MoE model's MoE layer (a layer pattern with dense layers too is
    priced from it by FLOPs, as other shapes are); a dense model as it is."""
    if model.is_moe and model.moe_layer_freq != 1:
        return replace(model, moe_layer_freq=1)
    return model


def attention_calls(lengths: list[int], split: int = 8, count: int = 3, shortest: int = 8) -> list[tuple[int, int]]:
    """(tokens, documents) of the attention sweep's calls: one document of each length, then the ``count``
    longest lengths again as ``split`` equal documents (at least ``shortest`` tokens each), so that the fit
    tells a call's fixed cost from a document's (the CPU reference kernel loops over documents)."""
    calls = [(d, 1) for d in lengths]
    calls += [(d // split * split, split) for d in lengths[-count:] if d // split >= shortest]
    return calls


def measure_attention(torch: Any, timer: Timer, model: ModelShape, tp: int, lengths: list[int], dtype: Any,
                      backend: str, log: Log) -> dict[str, list[Any]]:
    """Forward and backward seconds of causal attention over each call of ``attention_calls(lengths)``, one
    layer, one GPU."""
    from megatron_wlb.cp.attention import varlen_attention  # imports torch: only when measuring

    heads, kv_heads, dim = model.num_heads // tp, model.num_kv_heads // tp, model.head_dim
    out: dict[str, list[Any]] = {"lengths": [], "documents": [], "fwd_s": [], "bwd_s": []}
    for d, k in attention_calls(lengths):
        cu = torch.as_tensor(np.arange(k + 1, dtype=np.int32) * (d // k), device=timer.device)  # untimed upload

        def make(d: int = d) -> QKV:
            q = torch.randn(d, heads, dim, device=timer.device, dtype=dtype, requires_grad=True)
            k = torch.randn(d, kv_heads, dim, device=timer.device, dtype=dtype, requires_grad=True)
            v = torch.randn(d, kv_heads, dim, device=timer.device, dtype=dtype, requires_grad=True)
            return q, k, v

        def attend(qkv: QKV, cu: Any = cu, longest: int = d // k) -> Any:
            return varlen_attention(*qkv, cu, cu, longest, longest, backend=backend)

        f, b = timer.forward_backward(make, attend)
        for key, value in (("lengths", d), ("documents", k), ("fwd_s", f), ("bwd_s", b)):
            out[key].append(value)
        log(f"attention d={d:>7}{f' as {k} documents' if k > 1 else ''}: fwd {f * 1e3:9.3f} ms  bwd {b * 1e3:9.3f} ms")
    return out


def measure_linear(torch: Any, timer: Timer, layer: Layer, tokens: list[int], dtype: Any,
                   log: Log) -> dict[str, list[Any]]:
    """Forward and backward seconds of one layer's GEMMs over each token count, one device at TP."""
    fwd: list[float] = []
    bwd: list[float] = []
    for t in tokens:
        def make(t: int = t) -> Any:
            return torch.randn(t, layer.model.hidden, device=timer.device, dtype=dtype, requires_grad=True)

        f, b = timer.forward_backward(make, layer)
        fwd.append(f)
        bwd.append(b)
        log(f"linear  t={t:>7}: fwd {f * 1e3:9.3f} ms  bwd {b * 1e3:9.3f} ms")
    return {"tokens": tokens, "fwd_s": fwd, "bwd_s": bwd}


def composite_micro_batches(n: int, max_tokens: int, max_doc: int, seed: int, min_tokens: int = 1) -> list[list[int]]:
    """``n`` seeded micro-batches of several documents: tokens uniform in [max(max_tokens / 4, min_tokens),
    max_tokens] (inside the swept range: a check of the fit, not of its extrapolation), document lengths
    log-uniform in [8, max_doc] (the last cut to fit), mixing attention-heavy and GEMM-heavy work as packed
    training data does."""
    rng = np.random.default_rng(seed)
    low = min(max_tokens, max(1, max_tokens // 4, min_tokens))
    out: list[list[int]] = []
    for _ in range(n):
        total = int(rng.integers(low, max_tokens + 1))
        docs: list[int] = []
        while sum(docs) < total:
            d = int(np.exp(rng.uniform(np.log(min(8, max_doc)), np.log(max_doc))))
            docs.append(min(max(d, 1), total - sum(docs)))
        out.append(docs)
    return out


def measure_micro_batches(torch: Any, timer: Timer, layer: Layer, micro_batches: list[list[int]], dtype: Any,
                          log: Log) -> dict[str, list[Any]]:
    """Forward and backward seconds of one layer over each composite micro-batch (its documents through
    the GEMMs and causal varlen attention): the ``micro_batches`` section a fit is checked against."""
    out: dict[str, list[Any]] = {"pairs": [], "tokens": [], "runs": [], "fwd_s": [], "bwd_s": [],
                                 "run_lengths": [], "run_pairs": []}
    for docs in micro_batches:
        lengths = np.asarray(docs, dtype=np.int64)
        cu = np.concatenate([[0], np.cumsum(lengths)]).astype(np.int32)

        def make(t: int = int(cu[-1])) -> Any:
            return torch.randn(t, layer.model.hidden, device=timer.device, dtype=dtype, requires_grad=True)

        on_device = torch.as_tensor(cu, device=timer.device)  # uploaded once, outside the timed region

        def run_layer(x: Any, cu: Any = on_device, longest: int = int(lengths.max())) -> Any:
            return layer(x, cu, longest)

        f, b = timer.forward_backward(make, run_layer)
        out["pairs"].append(float(causal_pairs(lengths, lengths).sum()))
        out["tokens"].append(int(cu[-1]))
        out["fwd_s"].append(f)
        out["bwd_s"].append(b)
        out["runs"].append(len(docs))
        out["run_lengths"].append([int(d) for d in docs])
        out["run_pairs"].append([float(p) for p in causal_pairs(lengths, lengths)])
        log(f"held out t={int(cu[-1]):>7} ({len(docs):>3} documents): fwd {f * 1e3:9.3f} ms  bwd {b * 1e3:9.3f} ms")
    return out


def measure_efficiency(torch: Any, timer: Timer, model: ModelShape, tp: int, q_lens: list[int], kv_lens: list[int],
                       table_tokens: int, tile: int, dtype: Any, backend: str, device_name: str,
                       log: Log) -> KernelEfficiency:
    """Achieved forward TFLOP/s of bottom-right causal query runs (q queries over kv keys), q <= kv."""
    from megatron_wlb.cp.attention import reference_varlen_attention, varlen_attention  # imports torch

    heads, kv_heads, dim = model.num_heads // tp, model.num_kv_heads // tp, model.head_dim
    # the kernel must mask bottom-right (a CP rank's queries see all earlier keys): check on runs with q < kv
    cu_q, cu_k = np.array([0, 3, 20, 21], dtype=np.int32), np.array([0, 40, 57, 66], dtype=np.int32)
    gen = torch.Generator(device="cpu").manual_seed(0)
    q = torch.randn(21, heads, dim, generator=gen).to(timer.device, dtype)
    k = torch.randn(66, kv_heads, dim, generator=gen).to(timer.device, dtype)
    v = torch.randn(66, kv_heads, dim, generator=gen).to(timer.device, dtype)
    with torch.no_grad():
        dev_q, dev_k = (torch.as_tensor(cu, device=timer.device) for cu in (cu_q, cu_k))
        err = float((varlen_attention(q, k, v, dev_q, dev_k, 17, 40, backend=backend).float()
                     - reference_varlen_attention(q.float(), k.float(), v.float(), cu_q.tolist(),
                                                  cu_k.tolist()).float()).abs().max())
    if not err <= (1e-4 if dtype == torch.float32 else 2e-2):
        raise ValueError(f"attention backend {backend!r} disagrees with bottom-right causal attention (max abs "
                         f"error {err:.3g}); its causal mask is probably top-left aligned; choose another --backend")
    flops_per_pair = 4.0 * heads * dim
    table: list[list[float]] = []
    for q_len in q_lens:
        row: list[float] = []
        for kv_len in kv_lens:
            if q_len > kv_len:
                row.append(np.nan)  # impossible shape: KernelEfficiency fills it from the diagonal
                continue
            runs = max(1, table_tokens // kv_len)
            cq = torch.as_tensor(np.arange(runs + 1, dtype=np.int32) * q_len, device=timer.device)  # untimed
            ck = torch.as_tensor(np.arange(runs + 1, dtype=np.int32) * kv_len, device=timer.device)

            def make(runs: int = runs, q_len: int = q_len, kv_len: int = kv_len) -> QKV:
                return (torch.randn(runs * q_len, heads, dim, device=timer.device, dtype=dtype),
                        torch.randn(runs * kv_len, kv_heads, dim, device=timer.device, dtype=dtype),
                        torch.randn(runs * kv_len, kv_heads, dim, device=timer.device, dtype=dtype))

            def forward(qkv: QKV, cq: Any = cq, ck: Any = ck, q_len: int = q_len,
                        kv_len: int = kv_len) -> None:
                with torch.no_grad():
                    varlen_attention(*qkv, cq, ck, q_len, kv_len, backend=backend)

            seconds = timer.measure(make, forward)
            row.append(runs * float(causal_pairs(q_len, kv_len)) * flops_per_pair / seconds / 1e12)
            log(f"table q={q_len:>7} kv={kv_len:>7}: {row[-1]:9.4g} TFLOP/s")
        table.append(row)
    return KernelEfficiency(np.asarray(q_lens), np.asarray(kv_lens), np.asarray(table, dtype=np.float64), tile=tile,
                            device=device_name, source=f"wlb calibrate (backend {backend}, bottom-right check error "
                                                       f"{err:.1e}, {heads} heads x {dim} per GPU)")


def plan_measurement(args: argparse.Namespace, torch: Any) -> Plan:
    """The run's model, device and grids from the flags: the smoke grid, a GPU's defaults, or the CPU's
    defaults capped by ``CpuBudget`` (flags given explicitly are kept as they are)."""
    from megatron_wlb.cp.attention import BACKENDS  # imports torch: only when measuring

    if args.backend not in BACKENDS:
        raise ValueError(f"--backend {args.backend!r}: choose one of {', '.join(BACKENDS)}")
    if args.smoke:
        given = [flag for flag, value in (("--lengths", args.lengths), ("--tokens", args.tokens),
                                          ("--q-lens", args.q_lens), ("--kv-lens", args.kv_lens), ("--tp", args.tp),
                                          ("--table-tokens", args.table_tokens), ("--dtype", args.dtype),
                                          ("--warmup", args.warmup), ("--iters", args.iters),
                                          ("--threads", args.threads), ("--min-seconds", args.min_seconds))
                 if value is not None]
        given += ["--backend"] * (args.backend not in ("auto", "reference")) + ["--device"] * (args.device == "cuda")
        if given:
            raise ValueError(f"--smoke runs a fixed tiny grid on the CPU with the reference kernel; it takes no "
                             f"{', '.join(given)} (drop them, or run without --smoke to measure)")
        lengths = int_list(SMOKE.lengths, "--lengths")
        return Plan(SMOKE_MODEL, 1, torch.float32, torch.device("cpu"),
                    f"CPU smoke run ({machine()}; not a measurement)", "reference", lengths,
                    int_list(SMOKE.tokens, "--tokens"), int_list(SMOKE.q_lens, "--q-lens"),
                    int_list(SMOKE.kv_lens, "--kv-lens"), SMOKE.table_tokens, SMOKE.tile, SMOKE.warmup, SMOKE.iters,
                    SMOKE.holdout, lengths[-1])
    cuda = torch.cuda.is_available()
    if args.device == "cuda" and not cuda:
        raise ValueError("--device cuda: torch sees no CUDA device; leave --device at auto (or cpu) to measure "
                         "this machine's CPU")
    on_gpu = cuda and args.device != "cpu"
    config = load_config(args.config)
    model, tp = measured_shape(config.model), args.tp or config.layout.tp
    positive(tp, "--tp")
    for what, n in (("num_heads", model.num_heads), ("num_kv_heads", model.num_kv_heads),
                    ("ffn_hidden", model.expert_ffn_hidden if model.is_moe else model.ffn_hidden),
                    ("hidden", model.hidden)):
        if n % tp:
            raise ValueError(f"--tp {tp} does not divide the model's {what} ({n})")
    dtype = {"bf16": torch.bfloat16, "fp16": torch.float16, "fp32": torch.float32}[
        args.dtype or ("bf16" if on_gpu else "fp32")]
    s_max = resolve_max_seq_len(config.seq_len, config.packing.max_seq_len)
    notes: list[str] = []
    if on_gpu:
        device = torch.device("cuda")
        device_name = torch.cuda.get_device_name(device)
        lengths = int_list(args.lengths or ",".join(str(512 * 2**i) for i in range(12)
                                                    if 512 * 2**i <= config.seq_len), "--lengths")
        tokens = int_list(args.tokens or "1024,2048,4096,8192,16384,32768", "--tokens")
        grid = ",".join(str(128 * 2**i) for i in range(11))
        q_lens, kv_lens = int_list(args.q_lens or grid, "--q-lens"), int_list(args.kv_lens or grid, "--kv-lens")
        table_tokens, warmup, iters = args.table_tokens or 131072, 3, 10
    else:
        threads = args.threads or torch.get_num_threads()
        device, device_name = torch.device("cpu"), f"CPU: {machine()}; {threads} torch thread(s)"
        heads = model.num_heads // tp
        attn_flops, lin_flops = model.attention_flops_per_pair() / tp, model.linear_flops_per_token() / tp

        def attn_cost(d: int) -> float:
            return max(float(causal_pairs(d, d)) * attn_flops / CPU.flops, 4.0 * heads * d * d / CPU.score_bytes)

        if args.lengths:
            lengths = int_list(args.lengths, "--lengths")
        else:
            lengths, note = budget_grid(config.seq_len, attn_cost)
            notes.append(f"lengths {lengths[0]}..{lengths[-1]} ({note or 'up to seq_len ' + str(config.seq_len)})")
        if args.tokens:
            tokens = int_list(args.tokens, "--tokens")
        else:
            tokens, note = budget_grid(s_max, lambda t: t * lin_flops / CPU.flops)
            notes.append(f"tokens {tokens[0]}..{tokens[-1]} ({note or 'up to S_max ' + str(s_max)})")
        octaves = lengths[::-2][::-1]  # the table interpolates in log2: whole octaves ending at the longest
        q_lens = int_list(args.q_lens, "--q-lens") if args.q_lens else octaves
        kv_lens = int_list(args.kv_lens, "--kv-lens") if args.kv_lens else octaves
        table_tokens, warmup, iters = args.table_tokens or lengths[-1], CPU.warmup, CPU.iters
        if notes:
            notes = [f"CPU budget ({CPU.flops:.0e} forward FLOPs or {CPU.score_bytes / 2**20:.0f} MiB of attention "
                     f"scores per call): " + ", ".join(notes)]
    backend = "reference" if args.backend == "auto" and not on_gpu else args.backend
    return Plan(model, tp, dtype, device, device_name, backend, lengths, tokens, q_lens, kv_lens, table_tokens,
                args.tile, warmup if args.warmup is None else args.warmup, iters if args.iters is None else args.iters,
                args.holdout, min(s_max, tokens[-1]), notes,
                0.0 if on_gpu else (CPU.min_seconds if args.min_seconds is None else max(0.0, args.min_seconds)),
                None if on_gpu else threads, config.layout.ep)


def fit_line(fit: ProfileFit) -> str:
    """One line with the fitted coefficients."""
    per_run = f" + {fit.attn_per_run:.3e} s/document" if fit.attn_per_run else ""
    if fit.form == "micro_batches":
        whole = "".join(f" + {c:.3e} s/{unit}" for c, unit in ((fit.per_token_sq, "token^2"),
                                                                 (fit.per_token_pair, "token x pair")) if c)
        return (f"fit (per layer): {fit.attn_per_pair:.3e} s/pair + {fit.linear_per_token:.3e} s/token{per_run} + "
                f"{fit.overhead:.3e} s/micro-batch{whole} forward (mean rel. error of fwd+bwd {fit.attn_rel_err:.1%} "
                f"on the fitted rows), bwd/fwd {fit.bwd_attention:.2f} (attention) {fit.bwd_linear:.2f} (linear)")
    return (f"fit: attention {fit.attn_per_pair:.3e} s/pair + {fit.attn_per_query:.3e} s/query{per_run} (mean rel. "
            f"error {fit.attn_rel_err:.1%}), linear {fit.linear_per_token:.3e} s/token ({fit.linear_rel_err:.1%}), "
            f"bwd/fwd {fit.bwd_attention:.2f} (attention) {fit.bwd_linear:.2f} (linear)")


def terms_line(selection: dict[str, Any]) -> str:
    """Which micro-batch terms the fit kept and why (``fit.select_terms``'s report), in one line: per step every
    candidate's held-out ratio error between packings and layouts (or MAPE, with one packing), and the noise floor."""
    by, criterion = selection["base"]["by"], selection.get("criterion", "mape")
    name = "ratio error" if criterion == "ratio_error" else "MAPE"

    def of(errors: dict[str, Any]) -> float:
        return float(errors[criterion])

    steps = "; ".join(f"{', '.join(f'+{t} {of(v):.1%}' for t, v in step['tried'].items())} "
                      f"({'kept ' + step['kept'] if step['kept'] else 'none kept'})" for step in selection["steps"])
    extra = [t for t in selection["terms"] if t not in BASE_TERMS]
    floor = (selection.get("noise_floor") or {}).get("mape")
    rule = (f"a term is kept when it lowers the held-out ratio error by >= {KEEP_MARGIN:.0%} of it and by "
            f">= {RATIO_RESOLUTION:.1%}" if criterion == "ratio_error" else
            f"a term is kept when it lowers the held-out MAPE by >= {KEEP_MARGIN:.0%} of it")
    return (f"micro-batch terms: {', '.join(selection['terms'])} (held out by {by}, {name}: base terms "
            f"{of(selection['base']):.1%}; {steps or 'no candidate term varies'}; {rule}; noise floor "
            + (f"{floor:.1%} on repeated micro-batches" if floor is not None else "unknown: no micro-batch repeats")
            + f"){'' if extra else ': the price is the sum of the documents'}")


def table_note(profile: dict[str, Any]) -> str:
    """The attention table's knots, per-pair costs and conditioning, and the one-cost-per-pair fit's held-out
    MAPE beside it ('' without a table)."""
    table = profile.get("attention_table")
    if table is None:
        return ""
    costs = ", ".join(f"{d:g}: {c:.3g}" for d, c in zip(table["lengths"], table["per_pair_fwd_s"]))
    return (f"\nattention table (query-run length: forward s/pair) {costs}; condition number of the scaled fit "
            f"{table['condition']:.3g} ({table['condition_regularised']:.3g} regularised); one cost per pair "
            f"instead: held-out MAPE {profile['holdout']['linear_in_pairs_mape']:.1%}")


def log(line: str) -> None:
    """A line of progress on stderr."""
    print(line, file=sys.stderr, flush=True)


def run(args: argparse.Namespace) -> int:
    out = output_file(args.out)
    if args.from_trace is not None:
        return run_from_trace(args, out)
    try:
        import torch
    except ImportError:
        raise ValueError("wlb calibrate measures with torch, which is not installed: pip install torch "
                         "(the rest of wlb does not need it)") from None
    eff_out = output_file(args.efficiency_out or out.with_suffix(".efficiency.json"), "--efficiency-out")
    for flag in ("iters", "table_tokens", "tile", "holdout", "threads"):
        value = getattr(args, flag)
        if value is not None:
            positive(value, "--" + flag.replace("_", "-"))
    if args.warmup is not None and args.warmup < 0:
        raise ValueError(f"--warmup {args.warmup}: must be >= 0")
    plan = plan_measurement(args, torch)
    if len(plan.lengths) < 3 or len(plan.tokens) < 2:
        raise ValueError(f"the profile fit needs >= 3 --lengths and >= 2 --tokens, got {len(plan.lengths)} and "
                         f"{len(plan.tokens)}")
    log(f"calibrating {plan.model.name} (hidden {plan.model.hidden}, {plan.model.num_heads} heads) at TP {plan.tp} on "
        f"{plan.device_name}, {plan.dtype}, attention {plan.backend}, warmup {plan.warmup}, iters {plan.iters}")
    for note in plan.notes:
        log(note)
    if plan.threads is not None:
        torch.set_num_threads(plan.threads)
    torch.manual_seed(args.seed)
    clock = cpu_clock(plan.device, plan.threads)
    timer = Timer(torch, plan.device, plan.warmup, plan.iters, plan.min_seconds, clock=clock)
    layer = Layer(torch, plan.model, plan.tp, plan.dtype, plan.device, plan.backend, plan.ep)
    start = time.perf_counter()
    profile: dict[str, Any] = {
        "format": PROFILE_FORMAT, "device": plan.device_name, "model": plan.model.to_dict(), "tp": plan.tp,
        "attention": measure_attention(torch, timer, plan.model, plan.tp, plan.lengths, plan.dtype, plan.backend, log),
        "linear": measure_linear(torch, timer, layer, plan.tokens, plan.dtype, log),
        "source": f"wlb calibrate{' --smoke' if args.smoke else ''} torch={torch.__version__} dtype={plan.dtype} "
                  f"warmup={plan.warmup} iters={plan.iters} min_seconds={plan.min_seconds} threads={plan.threads} "
                  f"clock={'thread' if clock is time.thread_time else 'wall'}"
                  + "".join(f"; {n}" for n in plan.notes),
    }
    docs = composite_micro_batches(plan.holdout, plan.holdout_tokens, plan.lengths[-1], args.seed, plan.tokens[0])
    held = measure_micro_batches(torch, timer, layer, docs, plan.dtype, log)
    attn = profile["attention"]
    runs = np.asarray(attn["lengths"], dtype=np.float64) / np.asarray(attn["documents"], dtype=np.float64)
    add_table(profile, runs, np.asarray(attn["documents"]) * causal_pairs(runs, runs), args.knots)
    profile["holdout"] = {**holdout_mape(profile, held), "measured": held}
    if "attention_table" in profile:
        profile["holdout"]["linear_in_pairs_mape"] = holdout_mape(without_table(profile), held)["mape"]
    efficiency = measure_efficiency(torch, timer, plan.model, plan.tp, plan.q_lens, plan.kv_lens, plan.table_tokens,
                                    plan.tile, plan.dtype, plan.backend, plan.device_name, log)
    out.write_text(json.dumps(profile, indent=1) + "\n")
    efficiency.to_json(eff_out)
    load_profile(out)  # what --cost-profile will read: fail here, not in a later run
    KernelEfficiency.from_json(eff_out)
    print(f"wrote {out} ({PROFILE_FORMAT}) and {eff_out} ({EFFICIENCY_FORMAT}) in "
          f"{time.perf_counter() - start:.1f} s on {plan.device_name}")
    for note in plan.notes:
        print(note)
    print(fit_line(fit_profile(profile)))
    print(f"held-out MAPE {profile['holdout']['mape']:.1%} of forward + backward on {len(docs)} composite "
          f"micro-batches ({min(map(len, docs))}-{max(map(len, docs))} documents, "
          f"{min(held['tokens'])}-{max(held['tokens'])} tokens; measured apart, not in the fit)" + table_note(profile))
    print(f"use: wlb analyze --cost-profile {out} ...; Megatron: --wlb-cost-profile {out}; "
          f"wlb shard --kernel-table {eff_out}")
    return 0


def add_table(profile: dict[str, Any], run_lengths: np.ndarray, run_pairs: np.ndarray, knots: int) -> None:
    """Give ``profile`` its attention table: knots placed on these query runs (``table.choose_knots``, at
    most ``knots``) and the fitted forward seconds per pair at each, for the reader; none for ``knots`` 1
    or when the runs span less than an octave (one knot: the linear-in-pairs form)."""
    positive(knots, "--knots")
    if knots == 1:
        return
    chosen = choose_knots(run_lengths, run_pairs, knots)
    if len(chosen) < 2:
        return
    profile["attention_table"] = {"lengths": list(chosen)}
    fit = fit_profile(profile)
    profile["attention_table"].update(per_pair_fwd_s=list(fit.pair_costs), condition=fit.extra["table"]["condition"],
                                      condition_regularised=fit.extra["table"]["condition_regularised"])


def without_table(profile: dict[str, Any]) -> dict[str, Any]:
    """``profile`` fitted the old way: one cost per pair (the comparison the output prints)."""
    return {k: v for k, v in profile.items() if k != "attention_table"}


def run_from_trace(args: argparse.Namespace, out: Path) -> int:
    """``--from-trace``: the micro-batch profile of a training trace, with its held-out MAPE."""

    if args.efficiency_out is not None:
        raise ValueError("--efficiency-out: a trace times whole micro-batches, not kernel shapes, so --from-trace "
                         "writes no kernel table; measure one with `wlb calibrate` without --from-trace")
    if args.warmup is not None:
        raise ValueError(f"--warmup {args.warmup}: --warmup is the untimed calls per measured shape; with --from-trace "
                         "drop the trace's first iterations with --skip-iters N")
    warmup = 2 if args.skip_iters is None else args.skip_iters
    if warmup < 0:
        raise ValueError(f"--skip-iters {warmup}: must be >= 0 (iterations dropped from the start of the trace)")
    if args.holdout_every < 2:
        raise ValueError(f"--holdout-every {args.holdout_every}: must be >= 2")
    traces = [read_trace(path) for path in args.from_trace]
    named = " ".join(args.from_trace)
    setups = [trace_setup(t) for t in traces]
    for path, other in zip(args.from_trace[1:], setups[1:]):
        tp, tp0 = other["layout"].get("tp", 1), setups[0]["layout"].get("tp", 1)
        if other["model"] != setups[0]["model"] or tp != tp0:
            raise ValueError(f"--from-trace {path}: model {other['model']} / TP {tp} differ from "
                             f"{args.from_trace[0]}'s ({setups[0]['model']} / TP {tp0}): fit the traces of one model "
                             "and TP degree together (their DP, CP and PP may differ)")
    setup = setups[0]
    if not any(t.micro_batches for t in traces):
        raise ValueError(f"--from-trace {named}: no micro_batch rows (the run wrote only headers; "
                         "trace a run that gets through some iterations)")
    points: dict[str, list[Any]] = {}
    empty: dict[str, list[float]] = {"fwd_s": [], "bwd_s": []}
    for trace, traced in zip(traces, setups):
        clock = str(trace.headers[0].get("clock", "cpu"))
        rows = trace.after_warmup(warmup).micro_batches
        mine = profile_points(rows, traced["layout"], clock)
        mine["packing"] = [trace_packing(trace)] * len(mine["fwd_s"])
        for key, values in mine.items():
            points.setdefault(key, []).extend(values)
        for key, values in empty_points(rows, clock).items():
            empty[key].extend(values)
    packings = sorted(set(points["packing"]))
    n = len(points["fwd_s"])
    if n < MIN_TRACE_POINTS:
        raise ValueError(f"--from-trace {named}: {n} usable micro-batch rows after --skip-iters {warmup} "
                         f"({sum(len(t.micro_batches) for t in traces)} in the trace); the fit and its held-out check "
                         f"need >= {MIN_TRACE_POINTS}: trace more iterations or lower --skip-iters")
    model = ModelShape(**setup["model"])
    tp = int(setup["layout"].get("tp", 1))
    profile: dict[str, Any] = {
        "format": PROFILE_FORMAT, "device": setup["device"], "model": model.to_dict(), "tp": tp,
        "micro_batches": points,
        "source": f"wlb calibrate --from-trace {named} --skip-iters {warmup}: {n} rows of "
                  f"{sum(len(t.headers) for t in traces)} rank file(s) of {len(packings)} packing(s) "
                  f"({', '.join(packings)}), layouts "
                  f"{', '.join(sorted({str(x['layout']) for x in setups}))}",
    }
    if empty["fwd_s"]:
        profile["empty_micro_batches"] = empty
    mask, split = holdout_every(np.asarray(points["iteration"], dtype=np.int64), args.holdout_every)
    if (~mask).sum() < 3:
        raise ValueError(f"--from-trace {named}: holding out {split} leaves {(~mask).sum()} rows to fit; "
                         "trace more iterations")
    lengths, pairs = (np.concatenate([np.asarray(r, dtype=np.float64) for r in points[k]])
                      for k in ("run_lengths", "run_pairs"))
    add_table(profile, lengths, pairs, args.knots)
    terms, selection = select_terms(profile, args.holdout_every)
    profile["terms"] = list(terms)
    profile["term_selection"] = selection
    add_table(profile, lengths, pairs, args.knots)  # the table's per-pair costs for the reader, with those terms
    profile["holdout"] = {**holdout_mape(profile, mask), "split": split}
    if len(packings) > 1:
        profile["holdout"]["packings"] = held_out_errors(profile, args.holdout_every)["groups"]
    if "attention_table" in profile:
        profile["holdout"]["linear_in_pairs_mape"] = holdout_mape(without_table(profile), mask)["mape"]
    out.write_text(json.dumps(profile, indent=1) + "\n")
    load_profile(out)  # what --cost-profile / --wlb-cost-profile will read: fail here, not in a later run
    CalibratedCostModel(profile, model, ParallelLayout(tp=tp))
    fit = fit_profile(profile)
    print(f"wrote {out} ({PROFILE_FORMAT}, measured micro-batches) from {n} micro-batch rows of "
          f"{sum(len(t.headers) for t in traces)} rank file(s), iterations >= {warmup}, device {setup['device']}")
    print(fit_line(fit))
    print(terms_line(selection))
    held = profile["holdout"]
    print(f"held-out MAPE {held['mape']:.1%} of forward + backward on {held['micro_batches']} rows ({split}; fitted "
          "without them; the written fit uses every row)" + table_note(profile))
    if "packings" in held:
        print("held-out MAPE per packing (each predicted by a fit of the others): "
              + ", ".join(f"{k} {v:.1%}" for k, v in held["packings"].items()))
        biases = selection.get("biases") or {}
        if biases:
            print("held-out slowest-rank bias per packing (predicted over measured per iteration; a ratio of two "
                  "packings is off by the ratio of their biases): " + ", ".join(f"{k} {v:.3f}" for k, v in
                                                                                biases.items()))
    if "empty_micro_batches" in profile:
        print(f"empty micro-batches: {len(empty['fwd_s'])} measured, {fit.empty_fwd + fit.empty_bwd:.3g} s per layer "
              "each (forward + backward, the median)")
    print("no kernel-efficiency table: a trace times whole micro-batches, not kernel shapes (wlb shard keeps "
          "its shipped table, or measure one with `wlb calibrate`)")
    print(f"use: wlb analyze --cost-profile {out} ...; Megatron: --wlb-cost-profile {out}")
    return 0
