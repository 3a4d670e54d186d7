"""All-gather context-parallel attention that accepts any shard layout (Llama-3 style CP).

Each CP rank holds q, k, v of its own tokens, in its layout order (``RankShard.token_index``),
shaped ``[tokens, heads, head_dim]`` (GQA: fewer k/v heads than q heads), and the micro-batch's
``Varlen`` kernel record and ``GatherPlan`` (``cp.device.upload``: one copy per micro-batch, read by every layer).
Forward:

1. K and V (written once into one padded buffer: one collective) are all-gathered over the CP
   group: rank 0's tokens, then rank 1's, ... (each rank's block padded to the largest count, so
   unequal counts are fine; at CP = 1 nothing is gathered, and with one run per document nothing is
   copied either);
2. ``segment_index`` (``GatherPlan``) picks, for every query run, its document's keys
   ``[doc_start, run_end)`` out of the gathered buffer: a materialised copy, because the key
   segments of one document's runs overlap;
3. one varlen kernel call with ``cu_seqlens_q`` / ``cu_seqlens_k`` and a bottom-right-aligned causal
   mask (query ``i`` of a run of ``n`` queries over ``m`` keys sees keys ``j <= i + m - n``).

Backward: dq comes straight from the kernel; dK/dV of the segments are scatter-added into the
gathered layout and reduce-scattered, so each rank receives the gradient of its own k and v summed
over every rank that attended to them. :class:`AllGatherKV` is that collective pair as an autograd
function; the kernel's own autograd does the rest, so any differentiable kernel plugs in.

Kernel backends: ``torch-varlen`` (``torch.nn.attention.varlen.varlen_attn``; CUDA only),
``flash-attn`` (``flash_attn.flash_attn_varlen_func``; CUDA only) and ``reference`` (plain torch,
one matmul per query run; CPU only, the ground truth for tests). ``auto`` picks torch-varlen, then
flash-attn on CUDA (refusing when neither imports) and the reference path on the CPU.
"""

from __future__ import annotations

import functools
import importlib.util
import inspect
import logging
import math
from collections.abc import Callable, Sequence
from typing import Any

import numpy as np
import torch
import torch.distributed as dist

from megatron_wlb.cp.device import GatherPlan, Varlen

BACKENDS = ("auto", "torch-varlen", "flash-attn", "reference")


# ------------------------------------------------------------------------------------------------
# kernels
# ------------------------------------------------------------------------------------------------

def _expand_kv_heads(x: torch.Tensor, heads: int) -> torch.Tensor:
    return x if x.shape[1] == heads else x.repeat_interleave(heads // x.shape[1], dim=1)


def reference_varlen_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
                               cu_seqlens_q: Sequence[int] | np.ndarray | torch.Tensor,
                               cu_seqlens_k: Sequence[int] | np.ndarray | torch.Tensor,
                               softmax_scale: float | None = None) -> torch.Tensor:
    """Varlen causal attention, bottom-right aligned, one matmul per query run (differentiable).

    ``q`` [Tq, H, D]; ``k``, ``v`` [Tk, Hkv, D]; run ``i`` is queries ``cu_q[i]:cu_q[i+1]`` against
    keys ``cu_k[i]:cu_k[i+1]``; query ``a`` of an ``n``-query run over ``m`` keys sees keys
    ``b <= a + m - n``. Computes in float32 (or float64 if given) and returns ``q``'s dtype.
    """
    heads, dim = q.shape[1], q.shape[2]
    scale = 1.0 / math.sqrt(dim) if softmax_scale is None else softmax_scale
    work_dtype = torch.float64 if q.dtype == torch.float64 else torch.float32
    cq = [int(x) for x in cu_seqlens_q]
    ck = [int(x) for x in cu_seqlens_k]
    outs = []
    for i in range(len(cq) - 1):
        qs = q[cq[i]:cq[i + 1]].to(work_dtype).transpose(0, 1)                       # [H, n, D]
        ks = _expand_kv_heads(k[ck[i]:ck[i + 1]], heads).to(work_dtype).transpose(0, 1)  # [H, m, D]
        vs = _expand_kv_heads(v[ck[i]:ck[i + 1]], heads).to(work_dtype).transpose(0, 1)
        n, m = qs.shape[1], ks.shape[1]
        scores = torch.matmul(qs, ks.transpose(1, 2)) * scale
        allowed = (torch.arange(m, device=q.device)[None, :]
                   <= torch.arange(n, device=q.device)[:, None] + (m - n))
        scores = scores.masked_fill(~allowed, float("-inf"))
        outs.append(torch.matmul(torch.softmax(scores, dim=-1), vs).transpose(0, 1))
    if not outs:
        return q * 0.0
    return torch.cat(outs, dim=0).to(q.dtype)


def reference_document_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
                                 cu_seqlens: Sequence[int] | np.ndarray | torch.Tensor,
                                 softmax_scale: float | None = None) -> torch.Tensor:
    """Single-process ground truth: document-causal attention over a packed [T, H, D] sequence."""
    cu = [int(x) for x in (cu_seqlens.tolist() if hasattr(cu_seqlens, "tolist") else cu_seqlens)]
    if cu[0] != 0 or cu[-1] != q.shape[0] or any(b < a for a, b in zip(cu, cu[1:])):
        raise ValueError(f"cu_seqlens must rise from 0 to the {q.shape[0]} tokens of q, got {cu[:4]}...{cu[-2:]}")
    return reference_varlen_attention(q, k, v, cu, cu, softmax_scale)


@functools.lru_cache(maxsize=8)
def kernel_parameters(fn: Callable) -> frozenset[str]:
    """The parameter names of a kernel function, inspected once per function (not once per layer call)."""
    return frozenset(inspect.signature(fn).parameters)


@functools.lru_cache(maxsize=1)
def _aten_flash_ops() -> tuple[Any, Any, bool] | None:
    """torch's own flash kernel ops (``aten::_flash_attention_forward/backward``, what ``varlen_attn`` calls),
    and whether they take ``window_size_left/right``; None where this torch has none."""
    ops = torch.ops.aten
    if not (hasattr(ops, "_flash_attention_forward") and hasattr(ops, "_flash_attention_backward")):
        return None
    names = {a.name for a in ops._flash_attention_forward.default._schema.arguments}
    return ops._flash_attention_forward, ops._flash_attention_backward, "window_size_left" in names


class FlashVarlenGQA(torch.autograd.Function):
    """Bottom-right causal varlen attention on torch's flash kernel with fewer K/V heads than query heads.

    torch 2.11's ``varlen_attn`` has no ``enable_gqa``: K/V would have to be repeated to every query head
    and that copy saved for backward, in every layer (4x the K/V bytes for 32/8 heads). The flash kernel
    under it takes ``Hq = g * Hkv`` natively (forward and backward, dK/dV summed over each group), so this
    calls it directly and saves K/V as they are."""

    @staticmethod
    def forward(ctx, q, k, v, cu_q, cu_k, max_q: int, max_k: int, scale: float):
        fwd, _, window = _aten_flash_ops()  # type: ignore[misc]
        kwargs: dict[str, Any] = {"scale": scale}
        if window:
            kwargs.update(window_size_left=-1, window_size_right=0)
        out, lse, philox_seed, philox_offset, _ = fwd(q, k, v, cu_q, cu_k, max_q, max_k, 0.0, True, False, **kwargs)
        ctx.save_for_backward(q, k, v, out, lse, cu_q, cu_k, philox_seed, philox_offset)
        ctx.call = (max_q, max_k, kwargs)
        return out

    @staticmethod
    def backward(ctx, grad_out):
        _, bwd, _ = _aten_flash_ops()  # type: ignore[misc]
        q, k, v, out, lse, cu_q, cu_k, philox_seed, philox_offset = ctx.saved_tensors
        max_q, max_k, kwargs = ctx.call
        dq, dk, dv = bwd(grad_out.contiguous(), q, k, v, out, lse, cu_q, cu_k, max_q, max_k, 0.0, True, philox_seed,
                         philox_offset, **kwargs)
        return dq, dk, dv, None, None, None, None, None


def _torch_varlen(q, k, v, cu_q, cu_k, max_q, max_k, scale):
    """``varlen_attn`` with the arguments its signature has (feature-detected once, not version-guessed);
    GQA without ``enable_gqa`` goes to the flash kernel directly (``FlashVarlenGQA``), never repeated K/V."""
    from torch.nn.attention.varlen import varlen_attn

    params = kernel_parameters(varlen_attn)
    gqa = k.shape[1] != q.shape[1]
    if gqa and "enable_gqa" not in params and _aten_flash_ops() is not None:
        return FlashVarlenGQA.apply(q, k, v, cu_q, cu_k, max_q, max_k, scale)
    kwargs = {}
    if "scale" in params:
        kwargs["scale"] = scale
    elif not math.isclose(scale, 1.0 / math.sqrt(q.shape[-1]), rel_tol=1e-12):
        q = q * (scale * math.sqrt(q.shape[-1]))  # the first public signature has no scale: fold it into q
    if "window_size" in params:
        kwargs["window_size"] = (-1, 0)          # causal, bottom-right aligned (flash semantics)
    else:
        kwargs["is_causal"] = True               # the older signature's spelling
    if gqa:
        if "enable_gqa" in params:
            kwargs["enable_gqa"] = True
        else:  # no flash op to call directly (not seen in a torch that has varlen_attn)
            k, v = _expand_kv_heads(k, q.shape[1]), _expand_kv_heads(v, q.shape[1])
    return varlen_attn(q, k, v, cu_q, cu_k, max_q, max_k, **kwargs)


def _flash_attn(q, k, v, cu_q, cu_k, max_q, max_k, scale):
    from flash_attn import flash_attn_varlen_func

    return flash_attn_varlen_func(q, k, v, cu_q, cu_k, max_q, max_k, dropout_p=0.0, softmax_scale=scale,
                                  causal=True)


def _torch_varlen_available() -> bool:
    return importlib.util.find_spec("torch.nn.attention.varlen") is not None


@functools.cache
def _log_backend(name: str, device_type: str) -> None:
    """Say once per process which kernel the CP attention runs (and on what)."""
    logging.getLogger(__name__).info("megatron_wlb CP attention kernel: %s on %s", name, device_type)


def resolve_backend(backend: str, device: torch.device, dtype: torch.dtype | None = None) -> str:
    """The kernel that ``backend`` means on ``device`` for ``dtype`` (``auto``: torch-varlen, then
    flash-attn on CUDA; the reference path on the CPU).

    The reference path (a Python loop of matmuls) is refused on CUDA: it would crawl or run out of
    memory at long context. ``auto`` on CUDA therefore needs a varlen kernel and fp16/bf16 inputs.
    """
    if backend not in BACKENDS:
        raise ValueError(f"unknown attention backend {backend!r}; valid: {', '.join(BACKENDS)}")
    cuda = device.type == "cuda"
    half = dtype in (torch.float16, torch.bfloat16) if dtype is not None else True
    if backend == "auto":
        if not cuda:
            return "reference"
        if not half:
            raise ValueError(f"CP attention on CUDA runs fp16/bf16 kernels, got {dtype}; train with --bf16 or --fp16")
        if _torch_varlen_available():
            return "torch-varlen"
        if importlib.util.find_spec("flash_attn") is not None:
            return "flash-attn"
        raise ValueError("no varlen attention kernel on this GPU: torch.nn.attention.varlen (torch >= 2.9) and "
                         "flash_attn are both missing; upgrade torch or pip install flash-attn (the reference "
                         "path is CPU-only)")
    if backend == "reference" and cuda:
        raise ValueError("attention backend 'reference' is a CPU test path (one matmul per query run); on CUDA use "
                         "'auto', 'torch-varlen' or 'flash-attn'")
    if backend in ("torch-varlen", "flash-attn") and not cuda:
        raise ValueError(f"attention backend {backend!r} needs CUDA tensors, got device {device}; "
                         "use 'reference' (or 'auto') on CPU")
    if backend in ("torch-varlen", "flash-attn") and not half:
        raise ValueError(f"attention backend {backend!r} runs fp16/bf16 only, got {dtype}")
    if backend == "flash-attn" and importlib.util.find_spec("flash_attn") is None:
        raise ValueError("attention backend 'flash-attn' requested but flash_attn is not installed")
    if backend == "torch-varlen" and not _torch_varlen_available():
        raise ValueError("attention backend 'torch-varlen' needs torch.nn.attention.varlen (torch >= 2.9)")
    return backend


def varlen_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, cu_seqlens_q: np.ndarray | torch.Tensor,
                     cu_seqlens_k: np.ndarray | torch.Tensor, max_seqlen_q: int, max_seqlen_k: int,
                     backend: str = "auto", softmax_scale: float | None = None) -> torch.Tensor:
    """Bottom-right causal varlen attention with the chosen kernel (differentiable). ``cu_seqlens_*``
    are host arrays or int32 tensors already on ``q``'s device (then used as they are)."""
    name = resolve_backend(backend, q.device, q.dtype)
    _log_backend(name, q.device.type)
    scale = 1.0 / math.sqrt(q.shape[-1]) if softmax_scale is None else softmax_scale
    if name == "reference" or len(cu_seqlens_q) <= 1:
        return reference_varlen_attention(q, k, v, cu_seqlens_q, cu_seqlens_k, scale)
    q, k, v = q.contiguous(), k.contiguous(), v.contiguous()
    cu_q = torch.as_tensor(cu_seqlens_q, dtype=torch.int32, device=q.device)
    cu_k = torch.as_tensor(cu_seqlens_k, dtype=torch.int32, device=q.device)
    fn = _torch_varlen if name == "torch-varlen" else _flash_attn
    return fn(q, k, v, cu_q, cu_k, int(max_seqlen_q), int(max_seqlen_k), scale)


# ------------------------------------------------------------------------------------------------
# communication
# ------------------------------------------------------------------------------------------------

def _all_gather(out: torch.Tensor, inp: torch.Tensor, group) -> None:
    fn = getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor
    fn(out, inp, group=group)


def _reduce_scatter(out: torch.Tensor, inp: torch.Tensor, group) -> None:
    fn = getattr(dist, "reduce_scatter_single", None) or dist.reduce_scatter_tensor
    fn(out, inp, op=dist.ReduceOp.SUM, group=group)


def _scatter_add_rows(buf: torch.Tensor, rows: torch.Tensor, grad: torch.Tensor, occurrence: torch.Tensor | None,
                      levels: int) -> None:
    """``buf[rows[i]] += grad[i]``. Rows repeat (the key segments of one document's query runs overlap), and
    a CUDA ``index_add_`` adds repeats in whatever order its atomics land. With ``occurrence`` (the i-th
    repeat of its row, ``levels`` = most repeats) the sum runs one level at a time: within a level every
    row gets at most one non-zero term, so the result is the same on every run (``--deterministic-mode``)."""
    if occurrence is None or levels <= 1:
        buf.index_add_(0, rows, grad)
        return
    for level in range(levels):
        keep = (occurrence == level).to(grad.dtype).view(-1, *([1] * (grad.dim() - 1)))
        buf.index_add_(0, rows, grad * keep)


class AllGatherKV(torch.autograd.Function):
    """Forward: all-gather the ranks' K and V (written once into one padded ``[width, 2, Hkv, D]`` buffer:
    one collective) and pick the key segments ``seg_index`` as two contiguous tensors (K, V). Backward:
    scatter-add the segments' gradients into the gathered layout and reduce-scatter them to their owners."""

    @staticmethod
    def forward(ctx, k: torch.Tensor, v: torch.Tensor, seg_index: torch.Tensor, occurrence: torch.Tensor | None,
                levels: int, counts: tuple[int, ...], rank: int, group):
        cp = len(counts)
        width = max(counts) if counts else 0
        local = k.shape[0]
        ctx.meta = (counts, rank, group, width, local, levels)
        ctx.save_for_backward(seg_index, occurrence)
        if cp == 1:
            return k.index_select(0, seg_index), v.index_select(0, seg_index)
        padded = k.new_empty((width, 2) + tuple(k.shape[1:]))
        padded[:local, 0] = k
        padded[:local, 1] = v
        padded[local:] = 0
        gathered = k.new_empty((cp * width, 2) + tuple(k.shape[1:]))
        _all_gather(gathered, padded, group)
        return gathered[:, 0].index_select(0, seg_index), gathered[:, 1].index_select(0, seg_index)

    @staticmethod
    def backward(ctx, grad_k: torch.Tensor | None, grad_v: torch.Tensor | None):
        seg_index, occurrence = ctx.saved_tensors
        counts, rank, group, width, local, levels = ctx.meta
        cp = len(counts)
        like = grad_k if grad_k is not None else grad_v
        assert like is not None, "autograd calls backward with at least one gradient"
        rows = local if cp == 1 else cp * width
        buf = like.new_zeros((rows, 2) + tuple(like.shape[1:]))
        for i, grad in enumerate((grad_k, grad_v)):
            if grad is not None:
                _scatter_add_rows(buf[:, i], seg_index, grad, occurrence, levels)
        none = (None,) * 6
        if cp == 1:
            return buf[:, 0], buf[:, 1], *none
        mine = like.new_empty((width, 2) + tuple(like.shape[1:]))
        _reduce_scatter(mine, buf, group)
        return mine[:local, 0], mine[:local, 1], *none


def _check(q, k, v, gather: GatherPlan, group) -> None:
    for name, t in (("q", q), ("k", k), ("v", v)):
        if t.dim() != 3:
            raise ValueError(f"{name} must be [tokens, heads, head_dim], got shape {tuple(t.shape)}")
    if k.shape != v.shape:
        raise ValueError(f"k and v must have the same shape, got {tuple(k.shape)} and {tuple(v.shape)}")
    n = gather.num_tokens
    if q.shape[0] != n or k.shape[0] != n:
        raise ValueError(f"rank {gather.rank} owns {n} tokens in its layout but q has {q.shape[0]} and k "
                         f"{k.shape[0]}; pass this rank's tokens in its layout order (RankShard.token_index)")
    if q.shape[2] != k.shape[2]:
        raise ValueError(f"q and k head_dim differ: {q.shape[2]} vs {k.shape[2]}")
    if q.shape[1] % k.shape[1]:
        raise ValueError(f"q heads ({q.shape[1]}) must be a multiple of k/v heads ({k.shape[1]}) for GQA")
    cp = len(gather.rank_counts)
    if cp > 1 or (group is not None):
        if not dist.is_initialized():
            raise ValueError(f"the layout has cp={cp} ranks but torch.distributed is not initialised")
        size, rank = dist.get_world_size(group), dist.get_rank(group)
        if size != cp or rank != gather.rank:
            raise ValueError(f"process group has size {size} and this process is rank {rank}, but the shard is rank "
                             f"{gather.rank} of a cp={cp} layout; pass the CP group and this rank's shard")


def all_gather_cp_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, varlen: Varlen, gather: GatherPlan,
                            group=None, backend: str = "auto", softmax_scale: float | None = None) -> torch.Tensor:
    """Document-causal attention of this rank's queries over the whole micro-batch's keys.

    ``q`` [T_r, H, D], ``k``/``v`` [T_r, Hkv, D] in the layout's order (``RankShard.token_index``);
    ``varlen`` and ``gather`` are the rank's kernel record and all-gather plan (``cp.device.upload``, once per
    micro-batch; tests: ``upload(cp.plan.layout_batch(layout, rank), device)``); ``group`` is the CP process group
    (``None``: the default group; single-process when the layout has cp=1). Returns [T_r, H, D]. Differentiable
    w.r.t. q, k, v (dk/dv reduce-scattered to their owners).
    """
    if not isinstance(varlen, Varlen) or not isinstance(gather, GatherPlan):
        raise ValueError(f"the attention reads a Varlen record and a GatherPlan (cp.device.upload(...).varlen, "
                         f".gather), got {type(varlen).__name__} and {type(gather).__name__}")
    if varlen.te:
        raise ValueError("a per-document-te micro-batch carries TransformerEngine's THD fields, not the all-gather "
                         "attention's metadata")
    _check(q, k, v, gather, group)
    if gather.identity_segments:  # CP = 1, one run per document: the segments are k and v themselves
        k_seg, v_seg = k, v
    else:
        k_seg, v_seg = AllGatherKV.apply(k, v, gather.segment_index, gather.occurrence, gather.levels,
                                         gather.rank_counts, gather.rank, group)
    if varlen.num_runs < 1:
        # No queries here; keep the (empty) K/V segments in the graph so this rank still joins the
        # backward reduce-scatter that the other ranks start.
        return q * 0.0 + (k_seg.sum() + v_seg.sum()) * 0.0
    return varlen_attention(q, k_seg, v_seg, varlen.cu_seqlens_q, varlen.cu_seqlens_k,
                            varlen.max_seqlen_q, varlen.max_seqlen_k, backend, softmax_scale)


class AllGatherCPAttention(torch.nn.Module):
    """:func:`all_gather_cp_attention` as a module (no parameters): ``forward(q, k, v, varlen, gather, group)``."""

    def __init__(self, backend: str = "auto", softmax_scale: float | None = None):
        super().__init__()
        if backend not in BACKENDS:
            raise ValueError(f"unknown attention backend {backend!r}; valid: {', '.join(BACKENDS)}")
        self.backend = backend
        self.softmax_scale = softmax_scale

    def forward(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, varlen: Varlen, gather: GatherPlan,
                group=None):
        return all_gather_cp_attention(q, k, v, varlen, gather, group, self.backend, self.softmax_scale)

    def extra_repr(self) -> str:
        return f"backend={self.backend!r}, softmax_scale={self.softmax_scale}"
