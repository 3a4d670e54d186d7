"""RoPE for WLB micro-batches: rows rotated by the plan's positions, the rotary table sized by them.

RoPE: Megatron's THD RoPE assumes TE's per-document head-tail layout. ``install_core_attention`` also
replaces ``apply_rotary_pos_emb`` as ``megatron.core.transformer.attention`` calls it: inside an attention called
with a WLB micro-batch's params (``Attention.forward`` is wrapped to hold them for the call: ``attention_scope``),
it rotates each local row by its position (``Varlen.positions``); the record reaches RoPE by the params, as
it reaches the attention, recomputation included; no tensor carries it. Packed ``cu_seqlens`` with no params in
scope, or WLB params without their record, raise: RoPE never falls back to Megatron's own for a WLB micro-batch.
The rotary table is sized by ``RotaryEmbedding.get_rotary_seq_len`` (wrapped: ``Varlen.rope_length`` for ours),
so the params' ``max_seqlen_q`` / ``max_seqlen_kv`` stay the kernel's.
"""

from __future__ import annotations

import functools
import inspect
import threading
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from typing import Any

from megatron.core.models.common.embeddings.rope_utils import _apply_rotary_pos_emb_bshd  # the per-row rotation
from megatron.core.transformer.attention import Attention  # the class whose forward calls RoPE

from megatron_wlb.megatron.hooks import table as hooks
from megatron_wlb.megatron.hooks.attention import record_of
from megatron_wlb.megatron.hooks.rebind import wrapping


class _Scope(threading.local):
    """The packed-sequence params of the attention call running on this thread (``attention_scope``)."""
    params: Any = None
    inside: bool = False


_SCOPE = _Scope()


@contextmanager
def attention_scope(params: Any) -> Iterator[None]:
    """Within it, RoPE (``wlb_apply_rotary_pos_emb``) reads ``params``: those of the attention call that holds it
    (``wrap_attention_forward``; recomputation reruns the call, and so the scope)."""
    previous = (_SCOPE.params, _SCOPE.inside)
    _SCOPE.params, _SCOPE.inside = params, True
    try:
        yield
    finally:
        _SCOPE.params, _SCOPE.inside = previous


#: the RoPE function ``megatron.core.transformer.attention`` calls (replaced there by ``install_core_attention``)
ROPE_NAME = "apply_rotary_pos_emb"


def wlb_apply_rotary_pos_emb(original: Callable) -> Callable:
    """Wrap Megatron's ``apply_rotary_pos_emb(t, freqs, config, cu_seqlens=None, mscale=1.0, cp_group=None)``:
    inside an attention called with a WLB micro-batch's params (``attention_scope``), rotate row i of ``t``
    [R, H, D] by ``freqs[positions[i]]`` (the record's). Packed ``cu_seqlens`` with no params in scope raise."""
    @wrapping(original)
    def apply_rotary_pos_emb(t, freqs, config, cu_seqlens=None, mscale=1.0, cp_group=None, **extra):
        # extra: keywords newer Megatron passes (main: mla_rotary_interleaved, inverse,
        # mla_output_remove_interleaving, max_seqlen), handed to Megatron's function as given
        if cu_seqlens is None:  # not a packed batch
            return original(t, freqs, config, cu_seqlens=cu_seqlens, mscale=mscale, cp_group=cp_group, **extra)
        if not _SCOPE.inside or _SCOPE.params is None:
            held = ", ".join(hooks.hooks_in(Attention.forward)) or "none"
            raise RuntimeError("megatron_wlb: RoPE got packed cu_seqlens outside an attention call holding its "
                               f"packed-sequence params (hooks on Attention.forward: {held}), so the micro-batch's "
                               "record is lost")
        varlen = record_of(_SCOPE.params, "RoPE")
        if varlen is None or varlen.te:
            return original(t, freqs, config, cu_seqlens=cu_seqlens, mscale=mscale, cp_group=cp_group, **extra)
        expected = {varlen.cu_seqlens_q.numel(), varlen.cu_seqlens_k.numel()}
        if cu_seqlens.numel() not in expected or cu_seqlens.device != varlen.cu_seqlens_q.device:
            raise RuntimeError(f"megatron_wlb: RoPE got cu_seqlens of {cu_seqlens.numel()} entries on "
                               f"{cu_seqlens.device}, not those of the micro-batch its attention holds "
                               f"({' or '.join(map(str, sorted(expected)))} on {varlen.cu_seqlens_q.device})")
        unsupported = sorted(k for k in ("inverse", "mla_rotary_interleaved", "mla_output_remove_interleaving")
                             if extra.get(k))
        if unsupported:
            raise ValueError(f"RoPE: {', '.join(unsupported)} is not supported for WLB packed micro-batches")
        if varlen.positions.shape[0] != t.shape[0]:
            raise ValueError(f"RoPE: {varlen.positions.shape[0]} position ids for {t.shape[0]} local tokens")
        if varlen.rope_length > freqs.shape[0]:
            raise ValueError(f"RoPE: position {varlen.rope_length - 1} beyond the {freqs.shape[0]} rotary positions "
                             "computed (max_seqlen too small)")
        local = freqs.index_select(0, varlen.positions)
        return _apply_rotary_pos_emb_bshd(t.unsqueeze(1), local, rotary_interleaved=config.rotary_interleaved,
                                          multi_latent_attention=config.multi_latent_attention,
                                          mscale=mscale).squeeze(1)

    return apply_rotary_pos_emb


def _argument(original: Callable, name: str) -> Callable[[tuple, dict], Any]:
    """A reader of argument ``name`` of a call to method ``original`` (given ``self``-less args, kwargs)."""
    parameters = list(inspect.signature(original).parameters)
    if name not in parameters:
        raise RuntimeError(f"megatron_wlb: {original.__qualname__}({', '.join(parameters)}) takes no {name} in this "
                           "Megatron, where megatron_wlb reads the micro-batch's record: this release is not supported")
    index = parameters.index(name) - 1  # less self

    def read(args: tuple, kwargs: dict) -> Any:
        return kwargs[name] if name in kwargs else (args[index] if len(args) > index else None)

    return read


def wrap_attention_forward(original: Callable) -> Callable:
    """``Attention.forward`` holding its ``packed_seq_params`` for the call (``attention_scope``), where RoPE reads
    them (``hooks.HOOKS``)."""
    params_of = _argument(original, "packed_seq_params")

    @wrapping(original)
    @functools.wraps(original)
    def forward(self, *args, **kwargs):
        with attention_scope(params_of(args, kwargs)):
            return original(self, *args, **kwargs)

    return forward


def wrap_get_rotary_seq_len(original: Callable) -> Callable:
    """``RotaryEmbedding.get_rotary_seq_len``: for a WLB micro-batch the rotary table its positions need
    (``Varlen.rope_length``), since its params' ``max_seqlen_*`` are the kernel's, not the largest position
    (``hooks.HOOKS``)."""
    params_of = _argument(original, "packed_seq_params")

    @wrapping(original)
    @functools.wraps(original)
    def get_rotary_seq_len(self, *args, **kwargs):
        varlen = record_of(params_of(args, kwargs), "the rotary table")
        if varlen is not None and not varlen.te:
            return varlen.rope_length
        return original(self, *args, **kwargs)

    return get_rotary_seq_len


__all__ = ["ROPE_NAME", "attention_scope", "wlb_apply_rotary_pos_emb", "wrap_attention_forward",
           "wrap_get_rotary_seq_len"]
