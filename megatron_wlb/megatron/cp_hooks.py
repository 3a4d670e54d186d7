"""CP hooks: WLB-LLM's context-parallel layouts inside a Megatron-LM process.

``install(settings)`` (called by ``megatron_wlb.megatron.apply()`` once args are parsed) does three things:

1. **Sharding.** It replaces Megatron's ``get_batch_on_this_cp_rank(batch, cp_group=None)`` and
   ``get_thd_batch_on_this_cp_rank(batch, cu_seqlens, cu_seqlens_padded, max_seqlen, cp_size=None,
   cp_rank=None)`` (megatron/core/utils.py at the pinned commit) with versions that keep those signatures
   but, for a packed (THD) micro-batch, compute ``build_layout(settings.cp_sharding, lengths, cp_size)``
   from the micro-batch's ``cu_seqlens`` (deterministic: every CP rank computes the same layout) and
   select this rank's ``token_index`` from every ``[1, T]`` tensor. Batches without ``cu_seqlens`` go
   to Megatron's own function unchanged. The names are replaced in every loaded module that bound the
   originals (``megatron.core.utils``, ``megatron.training.utils`` and ``pretrain_gpt`` run as
   ``__main__``), so the pinned ``pretrain_gpt.get_batch`` calls ours without edits.
2. **Metadata.** The rank's ``RankShard`` travels to the attention inside the ``PackedSeqParams`` that
   Megatron already threads from ``forward_step`` through ``GPTModel`` to every core attention:
   ``WlbPackedSeqParams`` is a ``PackedSeqParams`` subclass with three extra fields (``wlb_shard``,
   ``wlb_layout``, ``wlb_position_ids``). For the TE path (``per-document-te`` with TransformerEngine)
   the same class carries TE's usual fields (``cu_seqlens_*``/``*_padded``/``max_seqlen_*``) and
   ``wlb_shard=None``, so TE's attention sees exactly what Megatron's own THD path gives it.
3. **Attention and RoPE.** Unless the TE path is taken, every ``SelfAttention`` built afterwards gets
   ``megatron_wlb.megatron.attention.WlbCoreAttention`` as its core attention (wrapping the spec's
   original one for batches without WLB metadata). Megatron's THD RoPE assumes TE's per-document
   head-tail layout, so ``apply_rotary_pos_emb`` as used by ``megatron.core.transformer.attention`` is
   wrapped: for our params it rotates each local token by its own position id (``wlb_position_ids``,
   reached through an attribute on the ``cu_seqlens`` tensors Megatron passes to it).

Middle pipeline stages get no batch in the pinned ``pretrain_gpt.get_batch``; the patch in ``patches/``
calls ``packed_seq_params_from_iterator(data_iterator)`` there so their attention gets the same shard.
"""

from __future__ import annotations

import importlib
import importlib.util
import inspect
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import numpy as np
import torch
from megatron.core.packed_seq_params import PackedSeqParams

from megatron_wlb.megatron.rebind import rebind
from megatron_wlb.megatron.settings import WlbSettings

#: attribute set on the cu_seqlens tensors of our params; holds the local RoPE position ids
ROPE_POSITIONS_ATTR = "_wlb_rope_position_ids"
#: keys that are metadata, never [1, T] token tensors
_META_KEYS = ("cu_seqlens", "cu_seqlens_padded", "max_seqlen", "local_cp_size", "packed_seq_params")


@dataclass
class WlbPackedSeqParams(PackedSeqParams):
    """``PackedSeqParams`` plus this CP rank's WLB-LLM shard (what the core attention needs).

    ``wlb_shard`` is the ``megatron_wlb.cp.layouts.RankShard`` of this rank (None on the TE path, where
    TE's own fields describe the layout); ``wlb_layout`` the layout actually used (for ``adaptive`` the
    chosen one); ``wlb_position_ids`` int64 [T_r] the RoPE positions of this rank's tokens;
    ``wlb_local_pad`` the padding rows appended after the shard's tokens on this rank (sequence
    parallelism needs every rank's token count to be a multiple of TP; they attend to nothing and
    carry loss_mask 0).
    """

    wlb_shard: Any = None
    wlb_layout: str | None = None
    wlb_position_ids: torch.Tensor | None = None
    wlb_local_pad: int = 0


def te_available() -> bool:
    """Whether TransformerEngine is importable (decides the ``per-document-te`` attention path)."""
    return importlib.util.find_spec("transformer_engine") is not None


def lengths_from_cu_seqlens(cu_seqlens: Any, total_tokens: int | None = None) -> np.ndarray:
    """Document lengths of a packed micro-batch from its ``cu_seqlens`` ([n+1] or [1, n+1]).

    Empty segments (repeated offsets, e.g. a padded cu_seqlens) hold no tokens and are left out.
    Tokens after ``cu_seqlens[-1]`` (up to ``total_tokens``) form one extra trailing segment, so every
    token of the micro-batch belongs to some segment and none is dropped.
    """
    cu = np.asarray(cu_seqlens.detach().cpu() if isinstance(cu_seqlens, torch.Tensor) else cu_seqlens,
                    dtype=np.int64)
    if cu.ndim == 2 and cu.shape[0] == 1:
        cu = cu[0]
    if cu.ndim != 1 or cu.size < 1:
        raise ValueError(f"cu_seqlens must be a 1-D offsets vector [num_docs + 1] (or [1, num_docs + 1]), "
                         f"got shape {tuple(cu.shape)}")
    if cu[0] != 0 or np.any(np.diff(cu) < 0):
        raise ValueError(f"cu_seqlens must start at 0 and be non-decreasing, got {cu.tolist()[:16]}")
    end = int(cu[-1])
    if total_tokens is not None:
        if end > total_tokens:
            raise ValueError(f"cu_seqlens ends at {end} but the micro-batch holds only {total_tokens} tokens")
        if end < total_tokens:
            cu = np.append(cu, total_tokens)
    lengths = np.diff(cu)
    lengths = lengths[lengths > 0]
    if lengths.size == 0:
        raise ValueError("cu_seqlens describes an empty micro-batch (no tokens)")
    return lengths


def _cu(lengths: np.ndarray) -> np.ndarray:
    return np.concatenate([[0], np.cumsum(lengths)]).astype(np.int64)


def _max_seqlen(value: Any) -> int | None:
    if value is None:
        return None
    if isinstance(value, torch.Tensor):
        return int(value.max().item()) if value.numel() else None
    return int(value)


def _source_index(lengths: np.ndarray, padded: np.ndarray, token_index: np.ndarray) -> np.ndarray:
    """For positions of the padded micro-batch, the unpadded position they hold (-1 for padding)."""
    if np.array_equal(lengths, padded):
        return token_index
    pad_start = _cu(padded)[:-1]
    doc = np.searchsorted(_cu(padded), token_index, side="right") - 1
    within = token_index - pad_start[doc]
    return np.where(within < lengths[doc], _cu(lengths)[:-1][doc] + within, -1)


def shard_packed_batch(batch: dict[str, Any], cu_seqlens: Any, max_seqlen: Any, *, sharding: str, cp_size: int,
                       cp_rank: int, cp_group: Any = None, te_attention: bool = False, cost: Any = None,
                       local_multiple: int = 1) -> tuple[dict[str, Any], WlbPackedSeqParams]:
    """This CP rank's part of one packed micro-batch, and the params its attention needs.

    ``batch`` maps names to ``[1, T]`` tensors (tokens, labels, loss_mask, position_ids, ...; None
    entries and metadata keys pass through untouched; a dense ``attention_mask`` is refused, THD has
    none). Every CP rank calls this with the same ``cu_seqlens`` and gets the same layout; rank r keeps
    ``layout.ranks[r].token_index``. Layouts that pad documents (``per-document-te``) pad every tensor
    with zeros (loss_mask 0). ``te_attention`` makes the params TE's (cu_seqlens + padded offsets).
    ``local_multiple`` (TP under sequence parallelism) rounds every rank's token count up to a
    multiple: TE's layout gets one trailing padding document (the same on every rank); ours get
    ``wlb_local_pad`` padding rows after the shard's tokens, which ``WlbCoreAttention`` leaves out.
    """
    from megatron_wlb.cp.layouts import build_layout

    tensors = {k: v for k, v in batch.items() if k not in _META_KEYS and v is not None}
    if "attention_mask" in tensors:
        raise ValueError("a packed (cu_seqlens) micro-batch must not carry a dense attention_mask; "
                         "drop --create-attention-mask-in-dataloader / --reset-attention-mask")
    if not tensors:
        raise ValueError(f"batch has no token tensors to shard (keys: {sorted(batch)})")
    sizes = {k: tuple(v.shape) for k, v in tensors.items()}
    first = next(iter(tensors.values()))
    total = first.shape[1] if first.dim() >= 2 else -1
    for v in tensors.values():
        if v.dim() < 2 or v.shape[0] != 1 or v.shape[1] != total:
            raise ValueError(f"packed micro-batches are [1, T] (micro-batch-size 1); got shapes {sizes}")
    if not 0 <= cp_rank < cp_size:
        raise ValueError(f"cp_rank={cp_rank} is outside the CP group of size {cp_size}")
    if local_multiple < 1:
        raise ValueError(f"local_multiple must be >= 1, got {local_multiple}")
    lengths = lengths_from_cu_seqlens(cu_seqlens, total)
    if te_attention and local_multiple > 1:
        lengths = _te_padding_document(lengths, cp_size, local_multiple)
    layout = build_layout(sharding, lengths, cp_size, cost=cost)
    if cp_group is not None and cp_size > 1 and _STATE.get("agreement_checks", 0) > 0:
        _STATE["agreement_checks"] -= 1
        check_layout_agreement(layout, cp_group)
    shard = layout.ranks[cp_rank]
    padded = np.asarray(layout.padded_lengths, dtype=np.int64)
    if te_attention and local_multiple > 1 and lengths.sum() > total:  # the padding document holds no tokens
        lengths = lengths.copy()
        lengths[-1] = 0
    device = next(iter(tensors.values())).device
    source = _source_index(lengths, padded, np.asarray(shard.token_index, dtype=np.int64))
    src = torch.as_tensor(np.maximum(source, 0), dtype=torch.long, device=device)
    pad = torch.as_tensor(source < 0, device=device) if np.any(source < 0) else None
    out = dict(batch)
    for key, val in tensors.items():
        sel = val.index_select(1, src)
        if pad is not None:
            sel = sel.masked_fill(pad.view(1, -1, *([1] * (sel.dim() - 2))), 0)
        out[key] = sel
    shard_pos = torch.as_tensor(np.asarray(shard.position_ids, dtype=np.int64), device=device)
    if "position_ids" in out:
        if pad is not None:  # padding slots continue their document's positions
            out["position_ids"] = torch.where(pad.view(1, -1), shard_pos.view(1, -1).to(out["position_ids"].dtype),
                                              out["position_ids"])
        rope_pos = out["position_ids"][0].to(torch.long)
    else:
        rope_pos = shard_pos
    max_pos = int(rope_pos.max().item()) + 1 if rope_pos.numel() else 1
    longest = max(int(padded.max()), _max_seqlen(max_seqlen) or 0, max_pos)
    for key in ("cu_seqlens", "cu_seqlens_padded", "max_seqlen"):
        out.pop(key, None)
    if te_attention:
        real = np.where(lengths > 0, lengths, padded)  # TE sees the padding document as a (masked) document
        cu_real = torch.as_tensor(_cu(real), dtype=torch.int32, device=device)
        cu_pad = torch.as_tensor(_cu(padded), dtype=torch.int32, device=device)
        params = WlbPackedSeqParams(qkv_format="thd", cu_seqlens_q=cu_real, cu_seqlens_kv=cu_real,
                                    cu_seqlens_q_padded=cu_pad, cu_seqlens_kv_padded=cu_pad,
                                    max_seqlen_q=int(padded.max()), max_seqlen_kv=int(padded.max()),
                                    # None, as in Megatron's own THD path: a cp_group here would make
                                    # TEDotProductAttention re-set its CP group every call (dynamic CP)
                                    cp_group=None, wlb_shard=None, wlb_layout=layout.name,
                                    wlb_position_ids=rope_pos)
        return out, params
    local_pad = (-len(source)) % local_multiple
    if local_pad:
        for key in tensors:
            val = out[key]
            out[key] = torch.cat([val, val.new_zeros((1, local_pad, *val.shape[2:]))], dim=1)
        rope_pos = torch.cat([rope_pos, rope_pos.new_zeros(local_pad)])
    cu_q = torch.as_tensor(np.asarray(shard.cu_seqlens_q), dtype=torch.int32, device=device)
    cu_k = torch.as_tensor(np.asarray(shard.cu_seqlens_k), dtype=torch.int32, device=device)
    for t in (cu_q, cu_k):  # what our apply_rotary_pos_emb wrapper looks for (see module docstring)
        setattr(t, ROPE_POSITIONS_ATTR, rope_pos)
        setattr(t, ROPE_POSITIONS_ATTR + "_end", max_pos)  # 1 + largest position: checked without a sync
    params = WlbPackedSeqParams(qkv_format="thd", cu_seqlens_q=cu_q, cu_seqlens_kv=cu_k,
                                max_seqlen_q=longest, max_seqlen_kv=longest, cp_group=cp_group,
                                wlb_shard=shard, wlb_layout=layout.name, wlb_position_ids=rope_pos,
                                wlb_local_pad=local_pad)
    return out, params


def check_layout_agreement(layout: Any, group: Any) -> None:
    """Raise on every rank if the CP ranks of ``group`` built different layouts of one micro-batch.

    One all-gather of an 8-byte digest and a host sync: run on the first ``AGREEMENT_CHECKS``
    micro-batches only. Disagreeing ranks (other data, another cost model) would otherwise attend to
    the wrong tokens silently, or abort the process group when their token counts differ.
    """
    import torch.distributed as dist

    from megatron_wlb.cp.layouts import layout_digest

    device = torch.device("cuda", torch.cuda.current_device()) if torch.cuda.is_available() else torch.device("cpu")
    mine = torch.tensor([layout_digest(layout)], dtype=torch.int64, device=device)
    every = torch.empty(dist.get_world_size(group), dtype=torch.int64, device=device)
    dist.all_gather_into_tensor(every, mine, group=group)
    digests = every.tolist()
    if len(set(digests)) > 1:
        raise RuntimeError(f"CP ranks built different {layout.name} layouts of the same micro-batch (digests "
                           f"{digests}): they read different documents or use different --wlb-* settings or cost "
                           "profiles; give every rank the same data, flags and files")


#: micro-batches whose layout the CP ranks compare at start-up (check_layout_agreement)
AGREEMENT_CHECKS = 4


def _te_padding_document(lengths: np.ndarray, cp: int, multiple: int) -> np.ndarray:
    """``lengths`` plus, if needed, one trailing document of 2*cp*j tokens so that TE's per-document layout
    (each document padded to a multiple of 2*cp) gives every rank a multiple of ``multiple`` tokens."""
    per_rank = int(np.sum(-(-lengths // (2 * cp)) * 2))  # each padded document puts 2 * ceil(d / 2cp) on a rank
    for j in range(multiple + 1):
        if (per_rank + 2 * j) % multiple == 0:
            return lengths if j == 0 else np.append(lengths, 2 * cp * j)
    raise ValueError(f"no TE padding gives a multiple of {multiple} tokens per CP rank")


# ----------------------------------------------------------------------------------------------------
# The installed state and the Megatron-signature replacements
# ----------------------------------------------------------------------------------------------------


@dataclass(frozen=True)
class _Installed:
    settings: WlbSettings
    te_attention: bool
    cost: Any
    originals: dict[str, Callable]
    local_multiple: int = 1
    original_parameters: tuple[str, ...] = ()


_STATE: dict[str, Any] = {}


def _installed() -> _Installed:
    if "cp" not in _STATE:
        raise RuntimeError("megatron_wlb CP hooks are not installed: call megatron_wlb.megatron.apply() "
                           "(or cp_hooks.install(settings)) before training")
    return _STATE["cp"]


def _cp_topology(cp_group: Any = None, cp_size: int | None = None, cp_rank: int | None = None):
    from megatron.core import parallel_state

    if cp_group is None and parallel_state.model_parallel_is_initialized():
        cp_group = parallel_state.get_context_parallel_group()
    if cp_size is None:
        cp_size = cp_group.size() if cp_group is not None else 1
    if cp_rank is None:
        cp_rank = cp_group.rank() if cp_group is not None else 0
    return cp_group, int(cp_size), int(cp_rank)


def get_batch_on_this_cp_rank(batch: dict[str, Any], *args: Any, **kwargs: Any) -> dict[str, Any]:
    """Megatron's ``get_batch_on_this_cp_rank`` for both signatures: ``(batch, cp_group=None)`` (core <
    0.18) and ``(batch, is_hybrid_cp, cp_group=None, hybrid_cp_group_func=None,
    use_per_sequence_balancing=False)`` (core >= 0.18). A packed batch (has ``cu_seqlens``) is sharded
    with our layout and gets its ``WlbPackedSeqParams`` under ``batch["packed_seq_params"]``; any other
    batch goes to Megatron's own function unchanged."""
    state = _installed()
    if batch.get("cu_seqlens") is None:
        return state.originals["get_batch_on_this_cp_rank"](batch, *args, **kwargs)
    legacy = "is_hybrid_cp" not in state.original_parameters
    if kwargs.get("is_hybrid_cp") or (not legacy and args and args[0]):
        raise ValueError("WLB-LLM layouts replace Megatron's hybrid context parallelism: "
                         "drop --hybrid-context-parallel")
    cp_group = kwargs.get("cp_group")
    if cp_group is None and args:
        cp_group = args[0] if legacy else (args[1] if len(args) > 1 else None)
    group, size, rank = _cp_topology(cp_group)
    out, params = shard_packed_batch(batch, batch["cu_seqlens"], batch.get("max_seqlen"),
                                     sharding=state.settings.cp_sharding, cp_size=size, cp_rank=rank,
                                     cp_group=group, te_attention=state.te_attention, cost=state.cost,
                                     local_multiple=state.local_multiple)
    out["packed_seq_params"] = params
    return out


def get_thd_batch_on_this_cp_rank(batch: dict[str, Any], cu_seqlens: Any, cu_seqlens_padded: Any, max_seqlen: Any,
                                  cp_size: int | None = None, cp_rank: int | None = None):
    """Megatron's signature (the THD path of ``pretrain_gpt.get_batch``): our layout instead of TE's
    ``thd_get_partitioned_indices``. ``cu_seqlens_padded`` is ignored: our layouts pad (or not) themselves."""
    state = _installed()
    group, size, rank = _cp_topology(None, cp_size, cp_rank)
    return shard_packed_batch(batch, cu_seqlens, max_seqlen, sharding=state.settings.cp_sharding, cp_size=size,
                              cp_rank=rank, cp_group=group, te_attention=state.te_attention, cost=state.cost,
                              local_multiple=state.local_multiple)


def packed_seq_params_from_iterator(data_iterator: Any) -> WlbPackedSeqParams:
    """Middle pipeline stages: read one micro-batch's metadata (``cu_seqlens``, ``max_seqlen``) from the
    data iterator and return this CP rank's params, identical to the first/last stage's."""
    state = _installed()
    if data_iterator is None:
        raise RuntimeError("WLB-LLM with pipeline parallelism needs the data iterator on middle pipeline stages "
                           "(their attention needs the micro-batch's cu_seqlens); megatron_wlb's data hook "
                           "builds it on every rank, so check that megatron_wlb.megatron.apply() ran")
    batch = next(data_iterator)
    cu = batch.get("cu_seqlens")
    if cu is None:
        raise RuntimeError("a middle-stage micro-batch has no cu_seqlens; WLB-LLM micro-batches are packed (THD)")
    lengths = lengths_from_cu_seqlens(cu)
    group, size, rank = _cp_topology()
    # Metadata only: shard a stand-in position tensor of the micro-batch's length.
    stand_in = {"position_ids": torch.as_tensor(np.concatenate([np.arange(n) for n in lengths]),
                                                dtype=torch.long).view(1, -1)}
    if "position_ids" in batch and batch["position_ids"] is not None:
        stand_in["position_ids"] = torch.as_tensor(batch["position_ids"]).view(1, -1)
    device = torch.device("cuda", torch.cuda.current_device()) if torch.cuda.is_available() else torch.device("cpu")
    stand_in = {k: v.to(device) for k, v in stand_in.items()}
    _, params = shard_packed_batch(stand_in, cu, batch.get("max_seqlen"), sharding=state.settings.cp_sharding,
                                   cp_size=size, cp_rank=rank, cp_group=group, te_attention=state.te_attention,
                                   cost=state.cost, local_multiple=state.local_multiple)
    return params


def wlb_apply_rotary_pos_emb(original: Callable) -> Callable:
    """Wrap Megatron's ``apply_rotary_pos_emb(t, freqs, config, cu_seqlens=None, mscale=1.0, cp_group=None)``:
    for our params' cu_seqlens, rotate token i of ``t`` [T, H, D] by ``freqs[position_ids[i]]``."""
    from megatron.core.models.common.embeddings.rope_utils import _apply_rotary_pos_emb_bshd

    def apply_rotary_pos_emb(t, freqs, config, cu_seqlens=None, mscale=1.0, cp_group=None):
        positions = getattr(cu_seqlens, ROPE_POSITIONS_ATTR, None) if cu_seqlens is not None else None
        if positions is None:
            return original(t, freqs, config, cu_seqlens=cu_seqlens, mscale=mscale, cp_group=cp_group)
        if positions.numel() != t.shape[0]:
            raise ValueError(f"RoPE: {positions.numel()} position ids for {t.shape[0]} local tokens")
        end = getattr(cu_seqlens, ROPE_POSITIONS_ATTR + "_end", None)
        if end is None or end > freqs.shape[0]:
            raise ValueError(f"RoPE: position {None if end is None else end - 1} beyond the {freqs.shape[0]} "
                             "rotary positions computed (max_seqlen too small)")
        local = freqs.index_select(0, positions.to(freqs.device))
        return _apply_rotary_pos_emb_bshd(t.unsqueeze(1), local, rotary_interleaved=config.rotary_interleaved,
                                          multi_latent_attention=config.multi_latent_attention,
                                          mscale=mscale).squeeze(1)

    apply_rotary_pos_emb.__wlb_original__ = original
    return apply_rotary_pos_emb


def _rebind(name: str, original: Callable | None, replacement: Callable | None) -> list[str]:
    if original is None or replacement is None:  # the function does not exist in this Megatron release
        return []
    return rebind(name, original, replacement, skip=(__name__,))


def _cost_model(settings: WlbSettings, args: Any = None) -> Any:
    """The cost model ``adaptive``/``hybrid`` layouts weigh work with: the run's own model flags (Megatron's
    ``args``), else --wlb-config's model and layout, else None (the layouts' default, 7B at TP=1)."""
    from megatron_wlb.costmodel import build_cost_model

    if args is not None:
        from megatron_wlb.megatron.args import cost_model_from_args

        return cost_model_from_args(args, settings)
    if settings.config is not None:
        from megatron_wlb.config import load_config

        run = load_config(settings.config)
        return build_cost_model(run.model, run.layout, settings.cost_profile)
    return None


def install(settings: WlbSettings, args: Any = None) -> None:
    """Install the CP hooks for ``settings`` (idempotent: a second call replaces the settings only).

    ``args`` (Megatron's parsed args, optional) gives the cost model its model shape, and with
    ``--sequence-parallel`` makes every CP rank's token count a multiple of TP.
    Raises ValueError for ``per-document-te`` without TransformerEngine (use ``per-document``: same
    balance, no padding, our all-gather attention).
    """
    if not isinstance(settings, WlbSettings):
        raise TypeError(f"install() takes a WlbSettings, got {type(settings).__name__}")
    te = te_available()
    te_attention = settings.cp_sharding == "per-document-te"
    if te_attention and not te:
        raise ValueError("--wlb-cp-sharding per-document-te keeps TransformerEngine's attention, but "
                         "transformer_engine is not installed; use --wlb-cp-sharding per-document (same layout "
                         "without padding, WLB all-gather attention) or install TransformerEngine")
    utils = importlib.import_module("megatron.core.utils")
    previous = _STATE.get("cp")
    originals = dict(previous.originals) if previous else {
        "get_batch_on_this_cp_rank": utils.get_batch_on_this_cp_rank,
        # gone from core_v0.18 on (the THD path of pretrain_gpt.get_batch was rewritten)
        "get_thd_batch_on_this_cp_rank": getattr(utils, "get_thd_batch_on_this_cp_rank", None),
    }
    multiple = 1
    if args is not None and getattr(args, "sequence_parallel", False):
        multiple = int(getattr(args, "tensor_model_parallel_size", 1) or 1)
    _STATE["agreement_checks"] = AGREEMENT_CHECKS
    _STATE["cp"] = _Installed(settings=settings, te_attention=te_attention, cost=_cost_model(settings, args),
                              originals=originals, local_multiple=multiple,
                              original_parameters=tuple(
                                  inspect.signature(originals["get_batch_on_this_cp_rank"]).parameters))
    if previous is None:
        try:  # bind the training utils first so the scan below rebinds its copy too
            importlib.import_module("megatron.training.utils")
        except Exception:  # noqa: BLE001 - megatron.training is absent from the wheel; core alone is fine
            pass
        _rebind("get_batch_on_this_cp_rank", originals["get_batch_on_this_cp_rank"],
                            get_batch_on_this_cp_rank)
        _rebind("get_thd_batch_on_this_cp_rank", originals["get_thd_batch_on_this_cp_rank"],
                            get_thd_batch_on_this_cp_rank)
        attn_mod = importlib.import_module("megatron.core.transformer.attention")
        if not hasattr(attn_mod.apply_rotary_pos_emb, "__wlb_original__"):
            attn_mod.apply_rotary_pos_emb = wlb_apply_rotary_pos_emb(attn_mod.apply_rotary_pos_emb)
    from megatron_wlb.megatron import attention as wlb_attention

    wlb_attention.install_core_attention(enabled=not te_attention)


def uninstall() -> None:
    """Undo ``install`` (tests; a training process has no reason to)."""
    state = _STATE.pop("cp", None)
    if state is None:
        return
    _rebind("get_batch_on_this_cp_rank", get_batch_on_this_cp_rank,
                        state.originals["get_batch_on_this_cp_rank"])
    _rebind("get_thd_batch_on_this_cp_rank", get_thd_batch_on_this_cp_rank,
                        state.originals["get_thd_batch_on_this_cp_rank"])
    attn_mod = importlib.import_module("megatron.core.transformer.attention")
    original = getattr(attn_mod.apply_rotary_pos_emb, "__wlb_original__", None)
    if original is not None:
        attn_mod.apply_rotary_pos_emb = original
    from megatron_wlb.megatron import attention as wlb_attention

    wlb_attention.install_core_attention(enabled=False)


__all__ = [
    "ROPE_POSITIONS_ATTR", "WlbPackedSeqParams", "get_batch_on_this_cp_rank", "get_thd_batch_on_this_cp_rank",
    "install", "lengths_from_cu_seqlens", "packed_seq_params_from_iterator", "shard_packed_batch",
    "te_available", "uninstall", "wlb_apply_rotary_pos_emb",
]
