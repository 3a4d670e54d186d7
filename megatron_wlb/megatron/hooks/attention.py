"""``WlbCoreAttention``: a Megatron core-attention module that runs WLB-LLM's all-gather CP attention.

Megatron's ``SelfAttention`` calls its core attention as
``core_attention(query, key, value, attention_mask, attn_mask_type=..., attention_bias=...,
packed_seq_params=...)``. With a packed (THD) micro-batch Megatron has already squeezed q/k/v to
``[T, heads, head_dim]`` and expects ``[T, heads * head_dim]`` back; otherwise they are
``[s, b, heads, head_dim]`` and it expects ``[s, b, heads * head_dim]``. This module:

- with ``WlbPackedSeqParams`` carrying our ``Varlen`` record and ``GatherPlan`` (``cp_hooks``' non-TE layouts):
  calls ``megatron_wlb.cp.attention.all_gather_cp_attention(q, k, v, varlen, gather, group)`` over the params'
  group (dynamic CP: the micro-batch's own), else the layer's (``pg_collection.cp``, else ``parallel_state``'s);
  GQA passes through (k/v keep their ``num_query_groups`` heads and are all-gathered un-repeated);
- otherwise (no WLB metadata: Megatron's own batches, e.g. a non-WLB eval loader, or TE's THD params)
  delegates to the core attention the layer spec asked for (TE's or the local one), built alongside.

It is installed by wrapping ``SelfAttention.__init__`` so that every self-attention built afterwards
gets it whatever layer spec the model uses (``install_core_attention``); ``swap_core_attention(spec)``
does the same on an explicit ``ModuleSpec`` tree. The all-gather attention has no attention dropout,
no sliding window and no softmax variants: those configurations are refused when the module is built.

RoPE and the rotary table follow the plan's positions: ``hooks.rope`` (installed in the same phase).
"""

from __future__ import annotations

import dataclasses
import functools
import math
from collections import OrderedDict
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch
from megatron.core import parallel_state
from megatron.core.packed_seq_params import PackedSeqParams
from megatron.core.transformer.attention import SelfAttentionSubmodules
from megatron.core.transformer.enums import AttnMaskType
from megatron.core.transformer.module import MegatronModule
from megatron.core.transformer.spec_utils import ModuleSpec

from megatron_wlb.cp.attention import all_gather_cp_attention, varlen_attention
from megatron_wlb.cp.device import GatherPlan, Varlen
from megatron_wlb.megatron.hooks import table as hooks
from megatron_wlb.megatron.hooks.rebind import wrapping
from megatron_wlb.megatron.state.process import runtime

_CAUSAL = {AttnMaskType.causal, AttnMaskType.padding_causal}


@dataclass
class WlbPackedSeqParams(PackedSeqParams):
    """``PackedSeqParams`` plus this CP rank's ``Varlen`` kernel record and ``GatherPlan``: Megatron threads the
    params from ``forward_step`` through ``GPTModel`` to every layer, the one route of both. Built by
    ``cp_hooks.packed_seq_params`` only, always with both (params without are refused wherever they arrive:
    ``record_of``)."""
    varlen: Varlen | None = None
    gather: GatherPlan | None = None


def record_of(params: Any, where: str) -> Varlen | None:
    """The ``Varlen`` record of the micro-batch whose params ``where`` (the attention, RoPE) was handed; None for
    Megatron's own batch (no params, or its plain ``PackedSeqParams``). Raises for WLB params without their record,
    and for Megatron's own THD params where every batch of this run is a WLB micro-batch (its record was lost)."""
    if isinstance(params, WlbPackedSeqParams):
        if params.varlen is None or params.gather is None:
            raise RuntimeError(f"megatron_wlb: {where} got WlbPackedSeqParams without their Varlen record or "
                               "GatherPlan; build them with cp_hooks.packed_seq_params (or upload_micro_batch), "
                               "which always sets both")
        return params.varlen
    if getattr(params, "qkv_format", None) == "thd" and every_batch_is_packed():
        raise RuntimeError(f"megatron_wlb: {where} got Megatron's own {type(params).__name__} (no WLB record) but "
                           "every batch of this run is a WLB micro-batch: its record was lost between get_batch and "
                           "the model; the params must be the ones cp_hooks built (cp_hooks.packed_seq_params_of)")
    return None


def _unsupported(config: Any, attention_dropout: float | None) -> list[str]:
    problems = []
    dropout = config.attention_dropout if attention_dropout is None else attention_dropout
    if dropout:
        problems.append(f"attention dropout {dropout} (pass --attention-dropout 0.0)")
    if getattr(config, "window_size", None) is not None:
        problems.append(f"sliding-window attention window_size={config.window_size}")
    if getattr(config, "softmax_type", "vanilla") != "vanilla":
        problems.append(f"softmax_type={config.softmax_type!r} (only 'vanilla')")
    if getattr(config, "multi_latent_attention", False):
        problems.append("multi-latent attention")
    return problems


class WlbCoreAttention(MegatronModule):
    """Core attention for WLB-LLM layouts; ``inner`` is the spec's own core attention class (or None).

    Constructor arguments are Megatron's core-attention builder keywords (``CoreAttentionBuilder``).
    """

    def __init__(self, config: Any, layer_number: int, attn_mask_type: AttnMaskType, attention_type: str,
                 attention_dropout: float | None = None, softmax_scale: float | None = None,
                 cp_comm_type: str | None = None, pg_collection: Any = None, inner: Any = None) -> None:
        super().__init__(config=config)
        problems = _unsupported(config, attention_dropout)
        if problems:
            raise ValueError("WLB-LLM all-gather CP attention does not support " + "; ".join(problems)
                             + ". Change these settings, or use --wlb-cp-sharding per-document-te with "
                             "TransformerEngine to keep TE's attention.")
        self.attn_mask_type = attn_mask_type
        self.layer_number = layer_number
        head_dim = config.kv_channels
        self.softmax_scale = softmax_scale if softmax_scale is not None else 1.0 / math.sqrt(head_dim)
        self.pg_collection = pg_collection
        # The fallback lives outside the module tree (a plain attribute) and its state is presented
        # under our own prefix, so checkpoints keep stock Megatron's keys (…core_attention._extra_state
        # for TE), loadable both ways. It has no parameters (vanilla softmax is enforced above).
        object.__setattr__(self, "inner", None)
        self.inner_error: str | None = None
        if inner is not None:
            kwargs = dict(config=config, layer_number=layer_number, attn_mask_type=attn_mask_type,
                          attention_type=attention_type, cp_comm_type=cp_comm_type, softmax_scale=softmax_scale,
                          pg_collection=pg_collection)
            if attention_dropout is not None:
                kwargs["attention_dropout"] = attention_dropout
            try:
                built = inner(**kwargs)
            except AssertionError as exc:  # the local DotProductAttention refuses CP > 1
                self.inner_error = f"{getattr(inner, '__name__', inner)}: {exc}"
            else:
                if any(True for _ in built.parameters()):  # they would silently miss the optimizer
                    raise ValueError(f"{type(built).__name__} has parameters; WlbCoreAttention only wraps "
                                     "parameter-free core attentions")
                object.__setattr__(self, "inner", built)

    # -- the fallback's state, under this module's prefix ------------------------------------------------
    def train(self, mode: bool = True):
        super().train(mode)
        if self.inner is not None:
            self.inner.train(mode)
        return self

    def _apply(self, fn, *args, **kwargs):
        super()._apply(fn, *args, **kwargs)
        if self.inner is not None:
            self.inner._apply(fn, *args, **kwargs)
        return self

    def state_dict(self, *args, destination=None, prefix="", keep_vars=False):
        if destination is None:
            destination = OrderedDict()
        if self.inner is not None:
            self.inner.state_dict(destination=destination, prefix=prefix, keep_vars=keep_vars)
        return destination

    def _load_from_state_dict(self, state_dict, prefix, local_metadata, strict, missing_keys, unexpected_keys,
                              error_msgs):
        def load(module, module_prefix):
            module._load_from_state_dict(state_dict, module_prefix, local_metadata, strict, missing_keys,
                                         unexpected_keys, error_msgs)
            for name, child in module._modules.items():
                if child is not None:
                    load(child, module_prefix + name + ".")

        if self.inner is not None:
            load(self.inner, prefix)

    def sharded_state_dict(self, prefix: str = "", sharded_offsets: tuple = (), metadata: dict | None = None):
        if self.inner is None or not hasattr(self.inner, "sharded_state_dict"):
            return {}
        return self.inner.sharded_state_dict(prefix=prefix, sharded_offsets=sharded_offsets, metadata=metadata)

    def cp_group(self) -> Any:
        """The CP process group: the layer's ``pg_collection.cp``, else parallel_state's (None: no CP)."""
        group = getattr(self.pg_collection, "cp", None) if self.pg_collection is not None else None
        if group is None and parallel_state.model_parallel_is_initialized():
            group = parallel_state.get_context_parallel_group()
        return group

    def forward(self, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor, attention_mask: Any = None,
                attn_mask_type: AttnMaskType | None = None, attention_bias: Any = None,
                packed_seq_params: Any = None) -> torch.Tensor:
        """q [T, Hq, D] / k, v [T, Hkv, D] (THD) or [s, b=1, H, D]; returns [T, Hq*D] or [s, 1, Hq*D]."""
        varlen = record_of(packed_seq_params, "the attention")
        if varlen is None and getattr(packed_seq_params, "qkv_format", None) == "thd":
            return self._megatron_thd(query, key, value, attn_mask_type, packed_seq_params)
        if varlen is None or varlen.te:
            if packed_seq_params is None and every_batch_is_packed():
                raise RuntimeError("a micro-batch reached the attention without packed-sequence params, but every "
                                   "batch of this run is a packed WLB micro-batch: the fallback attention would "
                                   "attend across its documents. The entry point's get_batch must give every "
                                   "pipeline stage the params (megatron_wlb.megatron.entry.launcher, or the patched "
                                   "pretrain_gpt.py)")
            if self.inner is None:
                raise RuntimeError("WlbCoreAttention got a batch without WLB-LLM shard metadata and has no "
                                   "fallback core attention"
                                   + (f" ({self.inner_error})" if self.inner_error else "")
                                   + "; feed packed (cu_seqlens) micro-batches through megatron_wlb's data hook")
            return self.inner(query, key, value, attention_mask, attn_mask_type=attn_mask_type,
                              attention_bias=attention_bias, packed_seq_params=packed_seq_params)
        mask_type = attn_mask_type if attn_mask_type is not None else self.attn_mask_type
        if mask_type not in _CAUSAL:
            raise ValueError(f"WLB-LLM attention is document-causal; got attn_mask_type={mask_type}")
        if attention_bias is not None:
            raise ValueError("WLB-LLM attention takes no attention_bias")
        group = packed_seq_params.cp_group  # the micro-batch's (dynamic CP: its block's), else the layer's
        return wlb_attention_forward(query, key, value, varlen, packed_seq_params.gather,
                                     self.cp_group() if group is None else group, self.softmax_scale)

    def _megatron_thd(self, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor,
                      attn_mask_type: AttnMaskType | None, params: Any) -> torch.Tensor:
        """Megatron's own THD micro-batch (``PackedSeqParams`` from its sequence-packing path, e.g. main's
        ``wrap_data_iterator`` with our scheduler): document-causal varlen attention over its ``cu_seqlens``
        (the padded ones where given, which cover every row) at CP 1, where the local attention has no THD path;
        with CP > 1 Megatron shards THD rows with TransformerEngine, which this attention does not follow."""
        group = self.cp_group()
        if group is not None and torch.distributed.get_world_size(group) > 1:
            raise ValueError("WLB-LLM attention got Megatron's own THD micro-batch at CP > 1 (sharded by "
                             "TransformerEngine's thd_get_partitioned_indices); use TransformerEngine's attention "
                             "there, or our data path (megatron_wlb.megatron.entry.launcher) for CP")
        mask_type = attn_mask_type if attn_mask_type is not None else self.attn_mask_type
        if mask_type not in _CAUSAL:
            raise ValueError(f"WLB-LLM attention is document-causal; got attn_mask_type={mask_type}")
        padded = getattr(params, "cu_seqlens_q_padded", None) is not None
        cu_q = params.cu_seqlens_q_padded if padded else params.cu_seqlens_q
        cu_k = params.cu_seqlens_kv_padded if padded else params.cu_seqlens_kv
        q, k, v = (t[:, 0] if t.dim() == 4 else t for t in (query, key, value))
        if q.device.type == "cpu":  # the reference kernel takes host offsets
            cu_q, cu_k = cu_q.cpu().numpy(), cu_k.cpu().numpy()
        max_q = int(params.max_seqlen_q) if params.max_seqlen_q is not None else int((cu_q[1:] - cu_q[:-1]).max())
        max_k = int(params.max_seqlen_kv) if params.max_seqlen_kv is not None else max_q
        out = varlen_attention(q, k, v, cu_q, cu_k, max_q, max_k, softmax_scale=self.softmax_scale)
        out = out.reshape(out.shape[0], -1)
        return out.unsqueeze(1) if query.dim() == 4 else out


def every_batch_is_packed() -> bool:
    """Whether this process trains and evaluates on WLB iterators only (no Megatron loader in use)."""
    rt = runtime()
    return rt.registry is not None and bool(rt.registry.iterators) and not rt.megatron_loaders


def wlb_attention_forward(query: torch.Tensor, key: torch.Tensor, value: torch.Tensor, varlen: Varlen,
                          gather: GatherPlan, group: Any, softmax_scale: float | None = None) -> torch.Tensor:
    """The tensor plumbing of ``WlbCoreAttention`` (separate so tests can drive it without a layer).

    Accepts THD ``[T, H, D]`` or ``[s, b, H, D]`` with b == 1 (a packed micro-batch), runs the
    all-gather CP attention on ``[T, H, D]`` with the micro-batch's ``varlen`` record and ``gather`` plan and
    returns ``[T, H*D]`` or ``[s, b, H*D]``. The last ``gather.local_pad`` rows (sequence-parallel
    padding) attend to nothing: their output is zero.
    """
    sbhd = query.dim() == 4
    if sbhd:
        if query.shape[1] != 1 or key.shape[1] != 1 or value.shape[1] != 1:
            raise ValueError(f"packed micro-batches have batch size 1; got q {tuple(query.shape)}, "
                             f"k {tuple(key.shape)}, v {tuple(value.shape)} ([s, b, heads, head_dim])")
        q, k, v = query[:, 0], key[:, 0], value[:, 0]
    elif query.dim() == 3:
        q, k, v = query, key, value
    else:
        raise ValueError(f"query must be [T, heads, head_dim] or [s, b, heads, head_dim], got {tuple(query.shape)}")
    if k.shape != v.shape or k.shape[0] != q.shape[0] or k.shape[2] != q.shape[2] or q.shape[1] % k.shape[1]:
        raise ValueError(f"q {tuple(q.shape)}, k {tuple(k.shape)}, v {tuple(v.shape)}: k and v must match, share "
                         "q's tokens and head_dim, and q's heads must be a multiple of k's (GQA)")
    n_local, local_pad = gather.num_tokens, gather.local_pad
    if q.shape[0] != n_local + local_pad:
        raise ValueError(f"{q.shape[0]} local tokens but this rank's shard holds {n_local}"
                         + (f" plus {local_pad} padding rows" if local_pad else ""))
    if local_pad:
        q, k, v = q[:n_local], k[:n_local], v[:n_local]
    out = all_gather_cp_attention(q, k, v, varlen, gather, group, softmax_scale=softmax_scale)
    out = out.reshape(n_local, -1)
    if local_pad:
        out = torch.cat([out, out.new_zeros(local_pad, out.shape[1])])
    return out.unsqueeze(1) if sbhd else out


def _builder(inner: Any) -> Any:
    """A core-attention builder (Megatron's ``CoreAttentionBuilder``) making ``WlbCoreAttention(inner=...)``."""
    if isinstance(inner, functools.partial) and inner.func is WlbCoreAttention:
        return inner
    return functools.partial(WlbCoreAttention, inner=inner)


def swap_core_attention(spec: Any) -> Any:
    """Return ``spec`` (a ``ModuleSpec`` tree) with every self-attention's ``core_attention`` wrapped in
    ``WlbCoreAttention``; the input is not modified."""
    if isinstance(spec, SelfAttentionSubmodules):
        return dataclasses.replace(spec, core_attention=_builder(spec.core_attention))
    if isinstance(spec, ModuleSpec):
        return dataclasses.replace(spec, submodules=swap_core_attention(spec.submodules))
    if isinstance(spec, list | tuple):
        return type(spec)(swap_core_attention(s) for s in spec)
    if dataclasses.is_dataclass(spec) and not isinstance(spec, type):
        changes = {f.name: swap_core_attention(getattr(spec, f.name)) for f in dataclasses.fields(spec)
                   if isinstance(getattr(spec, f.name), ModuleSpec | SelfAttentionSubmodules | list | tuple)}
        return dataclasses.replace(spec, **changes) if changes else spec
    return spec


def wrap_self_attention_init(original: Callable) -> Callable:
    """``SelfAttention.__init__`` building ``WlbCoreAttention`` around the spec's core attention (``hooks.HOOKS``)."""

    @wrapping(original)
    @functools.wraps(original)
    def __init__(self, config, submodules, *args, **kwargs):
        submodules = dataclasses.replace(submodules, core_attention=_builder(submodules.core_attention))
        original(self, config, submodules, *args, **kwargs)

    return __init__


#: the hooks that make every SelfAttention built afterwards ours (``hooks.HOOKS``, phase ``attention``)
ATTENTION_HOOKS = ("SelfAttention.__init__", "Attention.forward", "apply_rotary_pos_emb",
                   "RotaryEmbedding.get_rotary_seq_len")


def install_core_attention(enabled: bool = True) -> None:
    """Make every ``SelfAttention`` built from now on use ``WlbCoreAttention``, and RoPE follow the
    plan's positions (``enabled=False`` undoes both)."""
    if enabled:
        hooks.install("attention")
    else:
        hooks.uninstall("attention")


__all__ = ["WlbCoreAttention", "WlbPackedSeqParams", "install_core_attention", "record_of", "swap_core_attention",
           "wlb_attention_forward"]
