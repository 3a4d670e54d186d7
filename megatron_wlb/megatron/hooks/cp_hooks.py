"""CP hooks: a ``RankMicroBatch`` becomes Megatron's batch and ``PackedSeqParams`` in one upload.

The data iterator has already built the micro-batch's host record for this CP rank
(``cp.plan.RankMicroBatch``). ``upload_micro_batch`` moves it to the device once (``cp.device.upload``:
one pinned buffer, one copy) and hands Megatron its batch tensors and, apart from them, the kernel's
``Varlen`` record inside a ``WlbPackedSeqParams``, the ``PackedSeqParams`` that Megatron threads from
``forward_step`` through ``GPTModel`` to every layer: the one route of the record. Every attention layer of
the forward (and of its recomputation and backward) reads it there, and RoPE through the params its attention
was called with (``rope.attention_scope``); nothing is read back to the host. No tensor carries the record.

Where Megatron's own ``get_batch`` stands between our iterator and the model (the pinned 0.16
``pretrain_gpt.get_batch``, the patched 0.19 one), it hands on a batch dict whose ``cu_seqlens`` it may copy:
``pinned_batch_fields`` hands the micro-batch's params out (``hand_out``) and the next step of that same
``get_batch`` / ``forward_step`` takes them back (``packed_seq_params_of``), checked against the ``cu_seqlens``
it holds by count and device (not by identity or value). A missing or untaken hand-out raises in one line.

``install(settings)`` (``megatron_wlb.megatron.apply()`` calls it once args are validated):

- core < 0.18 (pinned core_v0.16.1): rebinds ``get_thd_batch_on_this_cp_rank`` (the packed path of
  the pinned ``pretrain_gpt.get_batch``) so that it gives back the params our TP-rank hook handed out; a THD
  batch with none handed out goes to Megatron's own function (raising where every batch is ours);
- makes every ``SelfAttention`` built afterwards use ``WlbCoreAttention`` and rotate RoPE by the
  plan's positions (``megatron_wlb.megatron.hooks.attention``), unless TE's attention is kept
  (``per-document-te``, whose params are TE's own THD fields).

Middle pipeline stages of the pinned ``pretrain_gpt.get_batch`` get no batch; the patch in
``patches/`` calls ``packed_seq_params_from_iterator(data_iterator)`` there (metadata only).
"""

from __future__ import annotations

import importlib
import importlib.util
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist
from megatron.core import parallel_state

from megatron_wlb.cp.device import DeviceBatch, upload
from megatron_wlb.cp.dynamic_groups import block_groups, group_of
from megatron_wlb.cp.plan import RankMicroBatch
from megatron_wlb.megatron.args.settings import WlbSettings
from megatron_wlb.megatron.data.device import training_device
from megatron_wlb.megatron.data.prefetch import take_staged
from megatron_wlb.megatron.hooks import attention as wlb_attention
from megatron_wlb.megatron.hooks import table as hooks
from megatron_wlb.megatron.hooks.attention import WlbPackedSeqParams, every_batch_is_packed
from megatron_wlb.megatron.hooks.rebind import original_of, wrapping


def te_available() -> bool:
    """Whether TransformerEngine is importable (decides the ``per-document-te`` attention path)."""
    return importlib.util.find_spec("transformer_engine") is not None


def _cp_group() -> Any:
    return parallel_state.get_context_parallel_group(check_initialized=False)


def upload_micro_batch(batch: RankMicroBatch, device: torch.device | None = None, *, cp_group: Any = None,
                       tokens: bool = True) -> tuple[dict[str, torch.Tensor | None], WlbPackedSeqParams]:
    """``batch`` on ``device`` (default: ``training_device()``) as Megatron reads it: its batch (tokens,
    labels, loss_mask, attention_mask None, position_ids; empty with ``tokens=False``, for stages that need
    only the params) and its ``WlbPackedSeqParams``. The copy is ``cp.device.upload``'s (one, from pinned
    memory); a batch the prefetcher already sent (``stage_upload``, ``prefetch.take_staged``) is not copied again."""
    device = training_device() if device is None else device
    staged = take_staged(batch)
    if isinstance(staged, Staged) and staged.device == device and tokens:
        stream = torch.cuda.current_stream(device)
        stream.wait_event(staged.event)  # sent on a side stream (stage_upload): wait, no host work
        on_device = staged.batch
        for tensor in on_device.tensors():
            tensor.record_stream(stream)  # the caching allocator must not reuse them before this stream is done
    else:
        on_device = upload(batch, device, tokens=tokens)
    group = block_group(batch)  # dynamic CP: the micro-batch's block
    return megatron_batch(on_device, group if group is not None else _cp_group() if cp_group is None else cp_group)


#: dynamic CP: this rank's pool's block process groups, ``(first slot, size) -> group`` (``make_dynamic_groups``)
_DYNAMIC_GROUPS: dict[tuple[int, int], Any] = {}


def make_dynamic_groups(dp_rank: int, cp_rank: int, cp_size: int) -> None:
    """Dynamic CP: the process group of every aligned block of every DP x CP pool, made once at start-up by every
    rank (``new_group`` is collective over the world); this rank keeps its pool's. Its slot in the pool is
    ``dp_rank x CP + cp_rank`` (what the data iterator plans with), checked against Megatron's DP x CP group."""
    if _DYNAMIC_GROUPS:
        return
    pool_group = parallel_state.get_data_parallel_group(with_context_parallel=True)
    pool = [int(r) for r in dist.get_process_group_ranks(pool_group)]
    slot = dp_rank * cp_size + cp_rank
    if pool.index(dist.get_rank()) != slot:
        raise RuntimeError(f"dynamic CP: rank {dist.get_rank()} is slot {pool.index(dist.get_rank())} of its DP x CP "
                           f"group {pool}, not dp_rank x CP + cp_rank = {slot}")
    pools: list[Any] = [None] * dist.get_world_size()
    dist.all_gather_object(pools, pool)
    _DYNAMIC_GROUPS.update(block_groups(sorted({tuple(p) for p in pools})))


def block_group(batch: RankMicroBatch) -> Any:
    """Dynamic CP: the process group of the micro-batch's block (``make_dynamic_groups``); None otherwise."""
    return None if batch.block is None else group_of(_DYNAMIC_GROUPS, *batch.block)


def megatron_batch(batch: DeviceBatch, cp_group: Any) -> tuple[dict[str, torch.Tensor | None], WlbPackedSeqParams]:
    """Megatron's batch dict and ``WlbPackedSeqParams`` over the tensors of ``batch`` (no copy); ``cp_group``:
    the micro-batch's (the run's, or with dynamic CP its block's)."""
    data: dict[str, torch.Tensor | None] = {}
    if batch.tokens is not None:
        data = {"tokens": batch.tokens, "labels": batch.labels, "loss_mask": batch.loss_mask, "attention_mask": None,
                "position_ids": batch.position_ids}
    return data, packed_seq_params(batch, cp_group)


def packed_seq_params(batch: DeviceBatch, cp_group: Any) -> WlbPackedSeqParams:
    """The ``WlbPackedSeqParams`` of an uploaded micro-batch: its kernel record's fields in Megatron's names, the
    record itself and its all-gather plan; ``cp_group``: the micro-batch's (the all-gather attention's)."""
    varlen, gather = batch.varlen, batch.gather
    if varlen.te:
        # TE infers padding between sequences whenever the padded offsets are another tensor, which rules
        # out its FlashAttention backend: nothing padded, the same tensor (``upload`` makes it so). cp_group
        # None, as in Megatron's own THD path: a group here would make TEDotProductAttention re-set its CP
        # group every call (dynamic CP)
        return WlbPackedSeqParams(qkv_format="thd", cu_seqlens_q=varlen.cu_seqlens_q, cu_seqlens_kv=varlen.cu_seqlens_k,
                                  cu_seqlens_q_padded=varlen.cu_seqlens_padded,
                                  cu_seqlens_kv_padded=varlen.cu_seqlens_padded, max_seqlen_q=varlen.max_seqlen_q,
                                  max_seqlen_kv=varlen.max_seqlen_k, cp_group=None, varlen=varlen, gather=gather)
    # max_seqlen_* the kernel's (the longest query run, key segment); the rotary table is sized by the record
    # (rope.wrap_get_rotary_seq_len), RoPE reads the record through the params its attention holds
    return WlbPackedSeqParams(qkv_format="thd", cu_seqlens_q=varlen.cu_seqlens_q, cu_seqlens_kv=varlen.cu_seqlens_k,
                              max_seqlen_q=varlen.max_seqlen_q, max_seqlen_kv=varlen.max_seqlen_k,
                              cp_group=cp_group, varlen=varlen, gather=gather)


@dataclass(frozen=True)
class Staged:
    """A micro-batch's upload sent on a side stream by the prefetch thread (``stage_upload``): ``batch`` is usable
    on ``device`` once ``event`` has completed."""
    device: torch.device
    event: Any
    batch: DeviceBatch


_SIDE_STREAMS: dict[Any, Any] = {}


def stage_upload(batch: RankMicroBatch, device: torch.device) -> Staged | None:
    """``batch``'s upload (``cp.device.upload``) started on a side stream of ``device`` (run on the prefetch
    thread, which keeps it: ``prefetch.take_staged``); ``upload_micro_batch`` makes the compute stream wait for it.
    None off CUDA (nothing to overlap)."""
    if device.type != "cuda":
        return None
    torch.cuda.set_device(device)
    stream = _SIDE_STREAMS.setdefault(device, torch.cuda.Stream(device))
    with torch.cuda.stream(stream):
        on_device = upload(batch, device)
        event = torch.cuda.Event()
        event.record(stream)
    return Staged(device, event, on_device)


class _HandedOut:
    """The params of the micro-batch a ``get_batch`` has handed out and its next step has not yet taken."""
    params: WlbPackedSeqParams | None = None


_HANDED = _HandedOut()


def hand_out(params: WlbPackedSeqParams) -> None:
    """Keep ``params`` for the ``packed_seq_params_of`` of the same ``get_batch`` / ``forward_step`` (every
    micro-batch is handed out and taken back before the next one is read, whatever the pipeline schedule)."""
    if _HANDED.params is not None:
        raise RuntimeError("megatron_wlb: get_batch read a WLB micro-batch while the previous one's params were never "
                           "taken back (packed_seq_params_of): its forward_step did not build them from its cu_seqlens "
                           "(use the patch of this release, patches/, or "
                           "python -m megatron_wlb.megatron.entry.launcher)")
    _HANDED.params = params


def handed_out() -> bool:
    """Whether a micro-batch's params wait for ``packed_seq_params_of``."""
    return _HANDED.params is not None


def packed_seq_params_of(cu_seqlens: Any) -> WlbPackedSeqParams:
    """The params of the micro-batch whose ``cu_seqlens`` a ``get_batch`` handed on (``hand_out``): taken back by
    the pinned 0.16 THD hook below and the patched 0.19 ``forward_step`` (``patches/core_v0.19.0``). Megatron's
    code may have copied the tensor (``.to()``, ``.clone()``, ``.contiguous()``, a batch dimension): it is checked
    by count and device only. None handed out, or another micro-batch's count or device, raise."""
    params, _HANDED.params = _HANDED.params, None
    if params is None:
        raise RuntimeError(f"megatron_wlb: forward_step got cu_seqlens ({_described(cu_seqlens)}) but no WLB "
                           "micro-batch was handed out by get_batch (pinned_batch_fields), so its record is lost; "
                           "use the patch of this release, patches/, or python -m megatron_wlb.megatron.entry.launcher")
    expect = params.cu_seqlens_q
    if not isinstance(cu_seqlens, torch.Tensor) or cu_seqlens.numel() != expect.numel() \
            or cu_seqlens.device != expect.device:
        raise RuntimeError(f"megatron_wlb: forward_step got cu_seqlens ({_described(cu_seqlens)}), not those of the "
                           f"micro-batch get_batch handed out ({_described(expect)})")
    return params


def _described(cu_seqlens: Any) -> str:
    if not isinstance(cu_seqlens, torch.Tensor):
        return f"a {type(cu_seqlens).__name__}"
    return f"{cu_seqlens.numel()} entries on {cu_seqlens.device}"


def get_thd_batch_on_this_cp_rank(batch: dict[str, Any], cu_seqlens: Any, cu_seqlens_padded: Any, max_seqlen: Any,
                                  cp_size: int | None = None, cp_rank: int | None = None):
    """Megatron's signature (the THD path of the pinned ``pretrain_gpt.get_batch``). After our TP-rank hook
    handed out a micro-batch (``hand_out``; the batch is this rank's already), its params come back; any other
    THD batch goes to Megatron's own function, unless every batch of this run is ours (its record was lost)."""
    if handed_out():
        return batch, packed_seq_params_of(cu_seqlens)
    if every_batch_is_packed():
        raise RuntimeError(f"megatron_wlb: get_thd_batch_on_this_cp_rank got cu_seqlens ({_described(cu_seqlens)}) "
                           "but no WLB micro-batch was handed out, and every batch of this run is one: its record "
                           "was lost")
    return _installed().originals["get_thd_batch_on_this_cp_rank"](batch, cu_seqlens, cu_seqlens_padded, max_seqlen,
                                                                   cp_size, cp_rank)


def wrap_get_thd_batch_on_this_cp_rank(original: Callable) -> Callable:
    """Megatron's ``get_thd_batch_on_this_cp_rank`` replaced by ours (``hooks.HOOKS``; ours calls the original
    for any batch that is not a WLB one)."""

    @wrapping(original)
    def thd_batch(*args: Any, **kwargs: Any) -> Any:
        return get_thd_batch_on_this_cp_rank(*args, **kwargs)

    return thd_batch


def pinned_batch_fields(batch: RankMicroBatch) -> dict[str, Any]:
    """``iterators.pinned_tp_rank_batch``'s fields: the uploaded batch, the record's ``cu_seqlens`` and
    ``max_seqlen`` as the host tensor the pinned ``get_batch``'s ``dim()`` check reads; the params are handed out
    (``hand_out``), for ``get_thd_batch_on_this_cp_rank`` / the patched ``forward_step`` to take back."""
    data, params = upload_micro_batch(batch)
    hand_out(params)
    return {**data, "cu_seqlens": params.cu_seqlens_q,
            "max_seqlen": torch.tensor([params.max_seqlen_q], dtype=torch.int32)}


def packed_seq_params_from_iterator(data_iterator: Iterator[RankMicroBatch] | None) -> WlbPackedSeqParams:
    """Middle pipeline stages: this CP rank's params of the next micro-batch (metadata only),
    identical to the first and last stages'."""
    if data_iterator is None:
        raise RuntimeError("WLB-LLM with pipeline parallelism needs the data iterator on middle pipeline stages "
                           "(their attention needs the micro-batch's layout); megatron_wlb's data hook builds it on "
                           "every rank, so check that megatron_wlb.megatron.apply() ran")
    batch = next(data_iterator)
    if not isinstance(batch, RankMicroBatch):
        raise RuntimeError(f"a middle-stage micro-batch is a {type(batch).__name__}, not a WLB RankMicroBatch; "
                           "WLB-LLM micro-batches come from megatron_wlb's data iterator")
    return upload_micro_batch(batch, tokens=False)[1]


# ----------------------------------------------------------------------------------------------------
# The installed state
# ----------------------------------------------------------------------------------------------------


@dataclass(frozen=True)
class _Installed:
    settings: WlbSettings
    #: the Megatron functions install() replaced (only those this release has)
    originals: dict[str, Callable]


_STATE: dict[str, _Installed] = {}


def _installed() -> _Installed:
    if "cp" not in _STATE:
        raise RuntimeError("megatron_wlb CP hooks are not installed: call megatron_wlb.megatron.apply() "
                           "(or cp_hooks.install(settings)) before training")
    return _STATE["cp"]


def install(settings: WlbSettings) -> None:
    """Install the CP hooks for ``settings`` (idempotent: a second call replaces the settings only).

    Raises ValueError for ``per-document-te`` without TransformerEngine (use ``per-document``: same
    balance, no padding, our all-gather attention).
    """

    if not isinstance(settings, WlbSettings):
        raise TypeError(f"install() takes a WlbSettings, got {type(settings).__name__}")
    te_attention = settings.cp_sharding == "per-document-te"
    if te_attention and not te_available():
        raise ValueError("--wlb-cp-sharding per-document-te keeps TransformerEngine's attention, but "
                         "transformer_engine is not installed; use --wlb-cp-sharding per-document (same layout "
                         "without padding, WLB all-gather attention) or install TransformerEngine")
    previous = _STATE.get("cp")
    # gone from core_v0.18 on (the THD path of pretrain_gpt.get_batch was rewritten; our launcher uploads itself)
    hooks.install("cp")
    thd = "get_thd_batch_on_this_cp_rank"
    originals = previous.originals if previous else \
        ({thd: original_of(hooks.current(thd))} if hooks.is_installed(thd) else {})
    _STATE["cp"] = _Installed(settings=settings, originals=originals)
    wlb_attention.install_core_attention(enabled=not te_attention)


def uninstall() -> None:
    """Undo ``install`` (tests; a training process has no reason to)."""
    state = _STATE.pop("cp", None)
    _HANDED.params = None
    if state is None:
        return
    hooks.uninstall("cp")
    wlb_attention.install_core_attention(enabled=False)


__all__ = ["Staged", "WlbPackedSeqParams", "block_group", "get_thd_batch_on_this_cp_rank", "hand_out", "handed_out",
           "install", "make_dynamic_groups", "megatron_batch", "packed_seq_params", "packed_seq_params_from_iterator",
           "packed_seq_params_of", "pinned_batch_fields", "stage_upload", "te_available", "training_device",
           "uninstall", "upload_micro_batch"]
