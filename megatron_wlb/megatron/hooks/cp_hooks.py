"""CP hooks: a ``RankMicroBatch`` becomes Megatron's batch and ``PackedSeqParams`` in one upload.

The data iterator has already built the micro-batch's host record for this CP rank
(``cp.plan.RankMicroBatch``). ``upload_micro_batch`` moves it to the device once (``cp.device.upload``:
one pinned buffer, one copy) and hands Megatron its batch tensors and, apart from them, the kernel's
``Varlen`` record inside a ``WlbPackedSeqParams``, the ``PackedSeqParams`` that Megatron threads from
``forward_step`` through ``GPTModel`` to every layer: the one route of the record. Every attention layer of
the forward (and of its recomputation and backward) reads it there, and RoPE through the params'
``cu_seqlens`` (``cp.device.varlen_of``); nothing is read back to the host.

``install(settings)`` (``megatron_wlb.megatron.apply()`` calls it once args are validated):

- core < 0.18 (pinned core_v0.16.1): rebinds ``get_thd_batch_on_this_cp_rank`` (the packed path of
  the pinned ``pretrain_gpt.get_batch``) so that the ``cu_seqlens`` our TP-rank hook uploaded give back
  their record's params; any other THD batch goes to Megatron's own function;
- makes every ``SelfAttention`` built afterwards use ``WlbCoreAttention`` and rotate RoPE by the
  plan's positions (``megatron_wlb.megatron.hooks.attention``), unless TE's attention is kept
  (``per-document-te``, whose params are TE's own THD fields).

Middle pipeline stages of the pinned ``pretrain_gpt.get_batch`` get no batch; the patch in
``patches/`` calls ``packed_seq_params_from_iterator(data_iterator)`` there (metadata only).
"""

from __future__ import annotations

import dataclasses
import importlib
import importlib.util
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist
from megatron.core import parallel_state
from megatron.core.packed_seq_params import PackedSeqParams

from megatron_wlb.cp.device import DeviceBatch, Varlen, carrier, upload, varlen_of
from megatron_wlb.cp.dynamic_groups import block_groups, group_of
from megatron_wlb.cp.plan import RankMicroBatch
from megatron_wlb.megatron.args.settings import WlbSettings
from megatron_wlb.megatron.data.device import training_device
from megatron_wlb.megatron.hooks import attention as wlb_attention
from megatron_wlb.megatron.hooks import table as hooks
from megatron_wlb.megatron.hooks.rebind import original_of, wrapping


@dataclass
class WlbPackedSeqParams(PackedSeqParams):
    """``PackedSeqParams`` plus this CP rank's ``Varlen`` record (None: not a WLB micro-batch): Megatron
    threads the params from ``forward_step`` through ``GPTModel`` to every layer."""
    varlen: Varlen | None = None


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
    memory); a batch ``stage_upload`` already sent is not copied again."""
    device = training_device() if device is None else device
    staged = batch.staged
    if staged is not None and staged[0] == device and tokens:
        _, event, on_device = staged  # sent on a side stream (stage_upload): wait, no host work
        stream = torch.cuda.current_stream(device)
        stream.wait_event(event)
        for tensor in on_device.tensors():
            tensor.record_stream(stream)  # the caching allocator must not reuse them before this stream is done
    else:
        on_device = upload(batch, device, tokens=tokens, group=block_group(batch))
    return megatron_batch(on_device, _cp_group() if cp_group is None else cp_group)


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
    the run's, unless the record names its own (dynamic CP)."""
    data: dict[str, torch.Tensor | None] = {}
    if batch.tokens is not None:
        data = {"tokens": batch.tokens, "labels": batch.labels, "loss_mask": batch.loss_mask, "attention_mask": None,
                "position_ids": batch.position_ids}
    return data, packed_seq_params(batch.varlen, cp_group)


def packed_seq_params(varlen: Varlen, cp_group: Any) -> WlbPackedSeqParams:
    """The ``WlbPackedSeqParams`` of a record: its kernel fields in Megatron's names, and the record itself;
    the CP group is the record's own (dynamic CP) or else ``cp_group``."""
    cp_group = cp_group if varlen.group is None else varlen.group
    if varlen.te:
        # TE infers padding between sequences whenever the padded offsets are another tensor, which rules
        # out its FlashAttention backend: nothing padded, the same tensor (``upload`` makes it so). cp_group
        # None, as in Megatron's own THD path: a group here would make TEDotProductAttention re-set its CP
        # group every call (dynamic CP)
        return WlbPackedSeqParams(qkv_format="thd", cu_seqlens_q=varlen.cu_seqlens_q, cu_seqlens_kv=varlen.cu_seqlens_k,
                                  cu_seqlens_q_padded=varlen.cu_seqlens_padded,
                                  cu_seqlens_kv_padded=varlen.cu_seqlens_padded, max_seqlen_q=varlen.max_seqlen_q,
                                  max_seqlen_kv=varlen.max_seqlen_k, cp_group=None, varlen=varlen)
    # the cu_seqlens Megatron hands RoPE carry the record (cp.device.carrier): RoPE finds it there
    cu_q = carrier(varlen, varlen.cu_seqlens_q)
    cu_k = cu_q if varlen.cu_seqlens_k is varlen.cu_seqlens_q else carrier(varlen, varlen.cu_seqlens_k)
    return WlbPackedSeqParams(qkv_format="thd", cu_seqlens_q=cu_q, cu_seqlens_kv=cu_k,
                              max_seqlen_q=varlen.rope_length, max_seqlen_kv=varlen.rope_length,
                              cp_group=cp_group, varlen=varlen)


_SIDE_STREAMS: dict[Any, Any] = {}


def stage_upload(batch: RankMicroBatch, device: torch.device) -> RankMicroBatch:
    """``batch`` with its upload (``cp.device.upload``) started on a side stream of ``device`` (run on the
    prefetch thread); ``upload_micro_batch`` makes the compute stream wait for it."""
    if device.type != "cuda":
        return batch
    torch.cuda.set_device(device)
    stream = _SIDE_STREAMS.setdefault(device, torch.cuda.Stream(device))
    with torch.cuda.stream(stream):
        on_device = upload(batch, device, group=block_group(batch))
        event = torch.cuda.Event()
        event.record(stream)
    return dataclasses.replace(batch, staged=(device, event, on_device))


def packed_seq_params_of(cu_seqlens: Any) -> WlbPackedSeqParams:
    """The params of the micro-batch whose record the carrier ``cu_seqlens`` holds (``cp.device.carrier``): what a
    ``get_batch`` handed the ``cu_seqlens`` of one of our micro-batches builds them from (the pinned 0.16 THD
    hook below; the patched 0.19 ``forward_step``, ``patches/core_v0.19.0``)."""
    varlen = varlen_of(cu_seqlens)
    if varlen is None:
        raise RuntimeError(f"megatron_wlb: cu_seqlens of type {type(cu_seqlens).__name__} carry no WLB-LLM micro-batch "
                           "record; WLB-LLM's get_batch hands on the cu_seqlens megatron_wlb uploaded (use the patch "
                           "of this release, patches/, or python -m megatron_wlb.megatron.entry.launcher)")
    return packed_seq_params(varlen, _cp_group())


def get_thd_batch_on_this_cp_rank(batch: dict[str, Any], cu_seqlens: Any, cu_seqlens_padded: Any, max_seqlen: Any,
                                  cp_size: int | None = None, cp_rank: int | None = None):
    """Megatron's signature (the THD path of the pinned ``pretrain_gpt.get_batch``). Our TP-rank hook
    hands in the uploaded ``cu_seqlens`` of a ``Varlen`` record (the batch is this rank's already): its
    params come back; any other THD batch goes to Megatron's own function."""
    if varlen_of(cu_seqlens) is not None:
        return batch, packed_seq_params_of(cu_seqlens)
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
    """``iterators.pinned_tp_rank_batch``'s fields: the uploaded batch, the record's ``cu_seqlens`` (from which
    ``get_thd_batch_on_this_cp_rank`` gives back its params) and ``max_seqlen`` as the host tensor the
    pinned ``get_batch``'s ``dim()`` check reads."""
    data, params = upload_micro_batch(batch)
    varlen = params.varlen
    if varlen is None:  # pragma: no cover - upload_micro_batch always sets it
        raise RuntimeError("an uploaded micro-batch without its Varlen record")
    return {**data, "cu_seqlens": carrier(varlen, varlen.cu_seqlens_q),
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
    if state is None:
        return
    hooks.uninstall("cp")
    wlb_attention.install_core_attention(enabled=False)


__all__ = ["WlbPackedSeqParams", "block_group", "get_thd_batch_on_this_cp_rank", "install", "make_dynamic_groups",
           "megatron_batch", "packed_seq_params", "packed_seq_params_from_iterator", "packed_seq_params_of",
           "te_available", "training_device", "uninstall", "upload_micro_batch"]
