"""``wlb calibrate``: measure the configured model's per-layer latencies on this GPU and write the
cost-model profile (``--profile`` / ``--wlb-cost-profile``) and the adaptive layout's kernel table.

    wlb calibrate --config 7b_128k --out profile.json        # on a GPU node (bf16, CUDA events)
    wlb calibrate --smoke --out /tmp/profile.json             # the same code path, tiny shapes, CPU

What is measured, per transformer layer on one GPU at the config's TP degree:

- attention: causal self-attention of ONE document of each length in ``--lengths`` (query heads
  and key/value heads divided by TP), forward and backward timed separately;
- linear: the layer's GEMMs (QKV, output projection, MLP; SwiGLU when the model has it) over each
  token count in ``--tokens``, forward and backward.

Writes ``OUT`` in the ``megatron-wlb-profile/1`` format that ``costmodel.load_profile`` reads
(``{"format", "device", "model", "tp", "attention": {"lengths", "fwd_s", "bwd_s"}, "linear":
{"tokens", "fwd_s", "bwd_s"}}``) and ``OUT`` with suffix ``.efficiency.json``: the achieved
attention TFLOP/s over (query run, key range) shapes in the ``megatron-wlb-attn-efficiency/1``
format of ``cp/data/default_efficiency.json`` (``wlb shard --profile``). Without ``--smoke`` it
needs CUDA; ``--smoke`` runs on the CPU in fp32 on a tiny model: a test of the code path, not a
measurement of anything.
"""

from __future__ import annotations

import argparse
import json
import platform
import statistics
import sys
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, TypeVar

import numpy as np

from megatron_wlb.cli.common import output_file, positive
from megatron_wlb.costmodel import PROFILE_FORMAT, ModelShape, causal_pairs, fit_profile, load_profile
from megatron_wlb.cp.efficiency import EFFICIENCY_FORMAT, KernelEfficiency

#: a line of progress to stderr
Log = Callable[[str], None]
#: query, key and value tensors of one attention call (torch is imported only when measuring)
QKV = tuple[Any, Any, Any]
_S = TypeVar("_S")

#: the smoke run's model: every dimension tiny, GQA and SwiGLU on so that their code paths run
SMOKE_MODEL = ModelShape("smoke", hidden=64, num_layers=2, num_heads=4, num_kv_heads=2, ffn_hidden=128, vocab=256,
                         swiglu=True)


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


SMOKE = SmokeGrid()


def add_parser(subparsers: argparse._SubParsersAction) -> None:
    p = subparsers.add_parser("calibrate", help="measure attention and linear latency on this GPU; write the "
                              "cost-model profile and the kernel-efficiency table",
                              description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--out", required=True, metavar="PROFILE.json", help="cost-model profile to write")
    p.add_argument("--efficiency-out", default=None, metavar="JSON",
                   help="kernel-efficiency table to write (default: OUT with suffix .efficiency.json)")
    p.add_argument("--config", default="7b_128k", help="config whose model and TP are measured (default 7b_128k)")
    p.add_argument("--tp", type=int, default=None, help="tensor-parallel size (default: the config's)")
    p.add_argument("--lengths", default=None,
                   help="comma-separated document lengths for attention (default: 512 .. the config's seq_len, x2)")
    p.add_argument("--tokens", default="1024,2048,4096,8192,16384,32768",
                   help="comma-separated token counts for the linear part (default 1024 .. 32768, x2)")
    p.add_argument("--q-lens", default=",".join(str(128 * 2**i) for i in range(11)),
                   help="efficiency table: query-run lengths (default 128 .. 128K, x2)")
    p.add_argument("--kv-lens", default=",".join(str(128 * 2**i) for i in range(11)),
                   help="efficiency table: key lengths (default 128 .. 128K, x2)")
    p.add_argument("--table-tokens", type=int, default=131072,
                   help="efficiency table: key tokens per kernel call (runs = tokens // kv; default 131072)")
    p.add_argument("--tile", type=int, default=128, help="attention kernel tile recorded in the table (default 128)")
    p.add_argument("--dtype", choices=("bf16", "fp16", "fp32"), default="bf16", help="GPU dtype (default bf16)")
    p.add_argument("--backend", default="auto", help="attention kernel: auto | torch-varlen | flash-attn | reference")
    p.add_argument("--warmup", type=int, default=3, help="untimed calls per shape (default 3)")
    p.add_argument("--iters", type=int, default=10, help="timed calls per shape, median kept (default 10)")
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


class Timer:
    """Median seconds of a callable: CUDA events on a GPU, perf_counter on the CPU."""

    def __init__(self, torch: Any, device: Any, warmup: int, iters: int):
        self.torch, self.device, self.warmup, self.iters = torch, device, warmup, iters

    def _sync(self) -> None:
        if self.device.type == "cuda":
            self.torch.cuda.synchronize(self.device)

    def measure(self, setup: Callable[[], _S], timed: Callable[[_S], object]) -> float:
        """Median over ``iters`` of ``timed(setup())``; only ``timed`` is inside the clock."""
        samples = []
        for i in range(self.warmup + self.iters):
            state = setup()
            self._sync()
            t0 = time.perf_counter()
            timed(state)
            self._sync()
            if i >= self.warmup:
                samples.append(time.perf_counter() - t0)
        return float(statistics.median(samples))


def measure_attention(torch: Any, timer: Timer, model: ModelShape, tp: int, lengths: list[int], dtype: Any,
                      backend: str, log: Log) -> dict[str, list[Any]]:
    """Forward and backward seconds of one causal document of each length, one layer, one GPU."""
    from megatron_wlb.cp.attention import varlen_attention

    heads, kv_heads, dim = model.num_heads // tp, model.num_kv_heads // tp, model.head_dim
    fwd: list[float] = []
    bwd: list[float] = []
    for d in lengths:
        cu = np.array([0, d], dtype=np.int32)

        def make(d: int = d) -> QKV:
            q = torch.randn(d, heads, dim, device=timer.device, dtype=dtype, requires_grad=True)
            k = torch.randn(d, kv_heads, dim, device=timer.device, dtype=dtype, requires_grad=True)
            v = torch.randn(d, kv_heads, dim, device=timer.device, dtype=dtype, requires_grad=True)
            return q, k, v

        def forward(qkv: QKV, d: int = d, cu: np.ndarray = cu) -> None:
            with torch.no_grad():
                varlen_attention(*qkv, cu, cu, d, d, backend=backend)

        def with_graph(d: int = d, cu: np.ndarray = cu) -> tuple[Any, Any]:
            qkv = make(d)
            out = varlen_attention(*qkv, cu, cu, d, d, backend=backend)
            return out, torch.ones_like(out)

        fwd.append(timer.measure(make, forward))
        bwd.append(timer.measure(with_graph, lambda s: s[0].backward(s[1])))
        log(f"attention d={d:>7}: fwd {fwd[-1] * 1e3:9.3f} ms  bwd {bwd[-1] * 1e3:9.3f} ms")
    return {"lengths": lengths, "fwd_s": fwd, "bwd_s": bwd}


def measure_linear(torch: Any, timer: Timer, model: ModelShape, tp: int, tokens: list[int], dtype: Any,
                   log: Log) -> dict[str, list[Any]]:
    """Forward and backward seconds of one layer's GEMMs over each token count, one GPU at TP."""
    import torch.nn.functional as F

    h, dev = model.hidden, timer.device
    qkv_out = (model.hidden + 2 * model.kv_hidden) // tp
    up_out = (2 if model.swiglu else 1) * model.ffn_hidden // tp

    def weight(rows: int, cols: int) -> Any:
        return (torch.randn(rows, cols, device=dev, dtype=dtype) / cols ** 0.5).requires_grad_(True)

    w_qkv, w_o = weight(qkv_out, h), weight(h, model.hidden // tp)
    w_up, w_down = weight(up_out, h), weight(h, model.ffn_hidden // tp)

    def layer(x: Any) -> Any:
        qkv = F.linear(x, w_qkv)
        y = F.linear(qkv[:, : model.hidden // tp], w_o)
        up = F.linear(x + y, w_up)
        if model.swiglu:
            gate, val = up.chunk(2, dim=-1)
            up = F.silu(gate) * val
        else:
            up = F.gelu(up)
        return F.linear(up, w_down)

    fwd: list[float] = []
    bwd: list[float] = []
    for t in tokens:
        def make(t: int = t) -> Any:
            return torch.randn(t, h, device=dev, dtype=dtype, requires_grad=True)

        def forward(x: Any) -> None:
            with torch.no_grad():
                layer(x)

        def with_graph(t: int = t) -> tuple[Any, Any]:
            out = layer(make(t))
            return out, torch.ones_like(out)

        fwd.append(timer.measure(make, forward))
        bwd.append(timer.measure(with_graph, lambda s: s[0].backward(s[1])))
        log(f"linear  t={t:>7}: fwd {fwd[-1] * 1e3:9.3f} ms  bwd {bwd[-1] * 1e3:9.3f} ms")
    return {"tokens": tokens, "fwd_s": fwd, "bwd_s": bwd}


def measure_efficiency(torch: Any, timer: Timer, model: ModelShape, tp: int, q_lens: list[int], kv_lens: list[int],
                       table_tokens: int, tile: int, dtype: Any, backend: str, device_name: str,
                       log: Log) -> KernelEfficiency:
    """Achieved forward TFLOP/s of bottom-right causal query runs (q queries over kv keys), q <= kv."""
    from megatron_wlb.cp.attention import reference_varlen_attention, varlen_attention

    heads, kv_heads, dim = model.num_heads // tp, model.num_kv_heads // tp, model.head_dim
    # the kernel must mask bottom-right (a CP rank's queries see all earlier keys): check on runs with q < kv
    cu_q, cu_k = np.array([0, 3, 20, 21], dtype=np.int32), np.array([0, 40, 57, 66], dtype=np.int32)
    gen = torch.Generator(device="cpu").manual_seed(0)
    q = torch.randn(21, heads, dim, generator=gen).to(timer.device, dtype)
    k = torch.randn(66, kv_heads, dim, generator=gen).to(timer.device, dtype)
    v = torch.randn(66, kv_heads, dim, generator=gen).to(timer.device, dtype)
    with torch.no_grad():
        err = float((varlen_attention(q, k, v, cu_q, cu_k, 17, 40, backend=backend).float()
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
            cq = np.arange(runs + 1, dtype=np.int32) * q_len
            ck = np.arange(runs + 1, dtype=np.int32) * kv_len

            def make(runs: int = runs, q_len: int = q_len, kv_len: int = kv_len) -> QKV:
                return (torch.randn(runs * q_len, heads, dim, device=timer.device, dtype=dtype),
                        torch.randn(runs * kv_len, kv_heads, dim, device=timer.device, dtype=dtype),
                        torch.randn(runs * kv_len, kv_heads, dim, device=timer.device, dtype=dtype))

            def forward(qkv: QKV, cq: np.ndarray = cq, ck: np.ndarray = ck, q_len: int = q_len,
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


def run(args: argparse.Namespace) -> int:
    try:
        import torch
    except ImportError:
        raise ValueError("wlb calibrate measures with torch, which is not installed: pip install torch "
                         "(the rest of wlb does not need it)") from None
    from megatron_wlb.config import load_config

    if not args.smoke and not torch.cuda.is_available():
        raise ValueError("wlb calibrate measures this machine's GPU, but torch sees no CUDA device; run it on a GPU "
                         "node, or pass --smoke for the CPU smoke run (tiny shapes, not a measurement)")
    out = output_file(args.out)
    eff_out = output_file(args.efficiency_out or out.with_suffix(".efficiency.json"), "--efficiency-out")
    for flag in ("warmup", "iters", "table_tokens", "tile"):
        if flag != "warmup":
            positive(getattr(args, flag), "--" + flag.replace("_", "-"))
    if args.warmup < 0:
        raise ValueError(f"--warmup {args.warmup}: must be >= 0")
    config = load_config(args.config)
    if args.smoke:
        model, tp, dtype, device, backend = SMOKE_MODEL, 1, torch.float32, torch.device("cpu"), "reference"
        lengths, tokens = int_list(SMOKE.lengths, "--lengths"), int_list(SMOKE.tokens, "--tokens")
        q_lens, kv_lens = int_list(SMOKE.q_lens, "--q-lens"), int_list(SMOKE.kv_lens, "--kv-lens")
        tile, table_tokens, warmup, iters = SMOKE.tile, SMOKE.table_tokens, SMOKE.warmup, SMOKE.iters
        device_name = f"CPU smoke run ({platform.processor() or platform.machine()}; not a measurement)"
        torch.manual_seed(0)
    else:
        model, tp = config.model, args.tp or config.layout.tp
        dtype = {"bf16": torch.bfloat16, "fp16": torch.float16, "fp32": torch.float32}[args.dtype]
        device, backend = torch.device("cuda"), args.backend
        default_lengths = ",".join(str(512 * 2**i) for i in range(12) if 512 * 2**i <= config.seq_len)
        lengths = int_list(args.lengths or default_lengths, "--lengths")
        tokens = int_list(args.tokens, "--tokens")
        q_lens, kv_lens = int_list(args.q_lens, "--q-lens"), int_list(args.kv_lens, "--kv-lens")
        tile, table_tokens, warmup, iters = args.tile, args.table_tokens, args.warmup, args.iters
        device_name = torch.cuda.get_device_name(device)
    positive(tp, "--tp")
    for what, n in (("num_heads", model.num_heads), ("num_kv_heads", model.num_kv_heads),
                    ("ffn_hidden", model.ffn_hidden), ("hidden", model.hidden)):
        if n % tp:
            raise ValueError(f"--tp {tp} does not divide the model's {what} ({n})")
    if len(lengths) < 3 or len(tokens) < 2:
        raise ValueError(f"the profile fit needs >= 3 --lengths and >= 2 --tokens, got {len(lengths)} and "
                         f"{len(tokens)}")

    def log(line: str) -> None:
        print(line, file=sys.stderr, flush=True)

    timer = Timer(torch, device, warmup, iters)
    start = time.perf_counter()
    profile: dict[str, Any] = {
        "format": PROFILE_FORMAT, "device": device_name, "model": model.to_dict(), "tp": tp,
        "attention": measure_attention(torch, timer, model, tp, lengths, dtype, backend, log),
        "linear": measure_linear(torch, timer, model, tp, tokens, dtype, log),
        "source": f"wlb calibrate{' --smoke' if args.smoke else ''} torch={torch.__version__} dtype={dtype} "
                  f"warmup={warmup} iters={iters}",
    }
    efficiency = measure_efficiency(torch, timer, model, tp, q_lens, kv_lens, table_tokens, tile, dtype, backend,
                                    device_name, log)
    out.write_text(json.dumps(profile, indent=1) + "\n")
    efficiency.to_json(eff_out)
    load_profile(out)  # what --profile will read: fail here, not in a later run
    KernelEfficiency.from_json(eff_out)
    fit = fit_profile(profile)
    print(f"wrote {out} ({PROFILE_FORMAT}) and {eff_out} ({EFFICIENCY_FORMAT}) in "
          f"{time.perf_counter() - start:.1f} s on {device_name}")
    print(f"fit: attention {fit.attn_per_pair:.3e} s/pair + {fit.attn_per_query:.3e} s/query (mean rel. error "
          f"{fit.attn_rel_err:.1%}), linear {fit.linear_per_token:.3e} s/token ({fit.linear_rel_err:.1%}), "
          f"bwd/fwd {fit.bwd_attention:.2f} (attention) {fit.bwd_linear:.2f} (linear)")
    print(f"use: wlb analyze --profile {out} ...; Megatron: --wlb-cost-profile {out}; "
          f"wlb shard --profile {eff_out}")
    return 0
