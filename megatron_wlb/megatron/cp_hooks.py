"""CP hooks: a ``RankMicroBatch`` becomes Megatron's batch and ``PackedSeqParams`` in one upload.

The data iterator has already planned the micro-batch for this CP rank on the host
(``cp.plan.RankPlan``). ``upload_micro_batch`` moves it to the device once: the token tensors, and
one immutable ``WlbVarlen`` record (kernel metadata, RoPE positions) inside a
``WlbPackedSeqParams``, the ``PackedSeqParams`` that Megatron threads from ``forward_step`` through
``GPTModel`` to every layer. Every attention layer of the forward (and of its recomputation and
backward) reuses those device tensors; nothing is read back to the host.

``install(settings)`` (``megatron_wlb.megatron.apply()`` calls it once args are validated):

- core < 0.18 (pinned core_v0.16.1): rebinds ``get_thd_batch_on_this_cp_rank`` (the packed path of
  the pinned ``pretrain_gpt.get_batch``) so the params our TP-rank hook uploaded pass straight
  through; any other THD batch goes to Megatron's own function;
- makes every ``SelfAttention`` built afterwards use ``WlbCoreAttention`` and rotate RoPE by the
  plan's positions (``megatron_wlb.megatron.attention``), unless TE's attention is kept
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

import numpy as np
import torch
from megatron.core.packed_seq_params import PackedSeqParams

from megatron_wlb.cp.attention import CPAttentionMetadata
from megatron_wlb.megatron.data import RankMicroBatch
from megatron_wlb.megatron.rebind import rebind
from megatron_wlb.megatron.settings import WlbSettings


@dataclass(frozen=True, eq=False)
class WlbVarlen:
    """What this rank's layers need of one micro-batch, on the device, built once per micro-batch.

    ``attention``: the all-gather CP attention's metadata (None on the TE path, where TE's fields
    describe the layout); ``rope_positions`` long ``[R]``: each local row's RoPE position;
    ``rope_length``: rotary positions the model must compute; ``layout``: the layout used (for
    ``adaptive``, the chosen one); ``local_pad``: trailing padding rows (sequence parallelism).
    """

    attention: CPAttentionMetadata | None
    rope_positions: torch.Tensor
    rope_length: int
    layout: str
    local_pad: int = 0


@dataclass
class WlbPackedSeqParams(PackedSeqParams):
    """``PackedSeqParams`` plus this CP rank's ``WlbVarlen`` (None: not a WLB micro-batch)."""

    wlb: WlbVarlen | None = None


def te_available() -> bool:
    """Whether TransformerEngine is importable (decides the ``per-document-te`` attention path)."""
    return importlib.util.find_spec("transformer_engine") is not None


def training_device() -> torch.device:
    """This rank's device: its current GPU, else the CPU."""
    return torch.device("cuda", torch.cuda.current_device()) if torch.cuda.is_available() else torch.device("cpu")


def _cp_group() -> Any:
    from megatron.core import parallel_state

    return parallel_state.get_context_parallel_group(check_initialized=False)


def upload_micro_batch(batch: RankMicroBatch, device: torch.device | None = None, *, cp_group: Any = None,
                       tokens: bool = True, pin_memory: bool = False
                       ) -> tuple[dict[str, torch.Tensor | None], WlbPackedSeqParams]:
    """Move one ``RankMicroBatch`` to ``device`` (default: ``training_device()``): Megatron's batch
    (tokens, labels, loss_mask, attention_mask None, position_ids; empty with ``tokens=False``, for
    stages that need only the params) and its ``WlbPackedSeqParams``. Host -> device copies only
    (``pin_memory``: from pinned host memory); a batch ``stage_upload`` already sent is not copied again."""
    device = training_device() if device is None else device
    staged = batch.staged
    if staged is not None and staged[0] == device and tokens:
        _, event, staged_data, staged_params = staged  # sent on a side stream (stage_upload): wait, no host work
        stream = torch.cuda.current_stream(device)
        stream.wait_event(event)
        for tensor in _device_tensors(staged_data, staged_params):
            tensor.record_stream(stream)  # the caching allocator must not reuse them before this stream is done
        return staged_data, staged_params
    plan = batch.plan
    cp_group = _cp_group() if cp_group is None else cp_group
    pin = pin_memory and device.type == "cuda"

    def up(array: Any, dtype: torch.dtype) -> torch.Tensor:
        host = torch.from_numpy(array)
        if pin:  # a non-blocking copy from pageable memory would sync; from pinned memory it does not
            host = host.pin_memory()
        return host.to(device=device, dtype=dtype, non_blocking=True)

    data: dict[str, torch.Tensor | None] = {}
    if tokens:
        data = {"tokens": up(batch.tokens, torch.long), "labels": up(batch.labels, torch.long),
                "loss_mask": up(batch.loss_mask, torch.float32), "attention_mask": None,
                "position_ids": up(batch.position_ids, torch.long)}
    rope = up(plan.positions, torch.long)
    if plan.te is not None:
        te = plan.te
        cu = up(te.cu_seqlens, torch.int32)
        # TE infers padding between sequences whenever the padded offsets are another tensor, which rules
        # out its FlashAttention backend: nothing padded, the same tensor
        padded = not np.array_equal(te.cu_seqlens, te.cu_seqlens_padded)
        cu_padded = up(te.cu_seqlens_padded, torch.int32) if padded else cu
        # cp_group None, as in Megatron's own THD path: a group here would make TEDotProductAttention
        # re-set its CP group every call (dynamic CP)
        params = WlbPackedSeqParams(qkv_format="thd", cu_seqlens_q=cu, cu_seqlens_kv=cu, cu_seqlens_q_padded=cu_padded,
                                    cu_seqlens_kv_padded=cu_padded, max_seqlen_q=te.max_seqlen,
                                    max_seqlen_kv=te.max_seqlen, cp_group=None,
                                    wlb=WlbVarlen(None, rope, plan.rope_length, plan.layout.name))
        return data, params
    meta = CPAttentionMetadata.from_shard(plan.shard, device)
    params = WlbPackedSeqParams(qkv_format="thd", cu_seqlens_q=meta.cu_seqlens_q, cu_seqlens_kv=meta.cu_seqlens_k,
                                max_seqlen_q=plan.rope_length, max_seqlen_kv=plan.rope_length, cp_group=cp_group,
                                wlb=WlbVarlen(meta, rope, plan.rope_length, plan.layout.name, plan.local_pad))
    return data, params


def _device_tensors(data: dict[str, Any], params: WlbPackedSeqParams) -> list[torch.Tensor]:
    found = [t for t in data.values() if isinstance(t, torch.Tensor)]
    for name in ("cu_seqlens_q", "cu_seqlens_kv", "cu_seqlens_q_padded", "cu_seqlens_kv_padded"):
        value = getattr(params, name, None)
        if isinstance(value, torch.Tensor):
            found.append(value)
    wlb = params.wlb
    if wlb is not None:
        found.append(wlb.rope_positions)
        if wlb.attention is not None:
            found += [wlb.attention.cu_seqlens_q, wlb.attention.cu_seqlens_k, wlb.attention.segment_index]
            if wlb.attention.occurrence is not None:
                found.append(wlb.attention.occurrence)
    return found


_SIDE_STREAMS: dict[Any, Any] = {}


def stage_upload(batch: RankMicroBatch, device: torch.device) -> RankMicroBatch:
    """``batch`` with its upload started on a side stream of ``device`` from pinned memory (run on the
    prefetch thread); ``upload_micro_batch`` makes the compute stream wait for it."""
    import dataclasses

    if device.type != "cuda":
        return batch
    torch.cuda.set_device(device)
    stream = _SIDE_STREAMS.setdefault(device, torch.cuda.Stream(device))
    with torch.cuda.stream(stream):
        data, params = upload_micro_batch(batch, device, cp_group=None, pin_memory=True)
        event = torch.cuda.Event()
        event.record(stream)
    return dataclasses.replace(batch, staged=(device, event, data, params))


def get_thd_batch_on_this_cp_rank(batch: dict[str, Any], cu_seqlens: Any, cu_seqlens_padded: Any, max_seqlen: Any,
                                  cp_size: int | None = None, cp_rank: int | None = None):
    """Megatron's signature (the THD path of the pinned ``pretrain_gpt.get_batch``). Our TP-rank hook
    hands the uploaded ``WlbPackedSeqParams`` in as ``cu_seqlens`` (the batch is this rank's already);
    any other THD batch goes to Megatron's own function."""
    if isinstance(cu_seqlens, WlbPackedSeqParams):
        return batch, cu_seqlens
    return _installed().originals["get_thd_batch_on_this_cp_rank"](batch, cu_seqlens, cu_seqlens_padded, max_seqlen,
                                                                   cp_size, cp_rank)


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
    from megatron_wlb.megatron import attention as wlb_attention

    if not isinstance(settings, WlbSettings):
        raise TypeError(f"install() takes a WlbSettings, got {type(settings).__name__}")
    te_attention = settings.cp_sharding == "per-document-te"
    if te_attention and not te_available():
        raise ValueError("--wlb-cp-sharding per-document-te keeps TransformerEngine's attention, but "
                         "transformer_engine is not installed; use --wlb-cp-sharding per-document (same layout "
                         "without padding, WLB all-gather attention) or install TransformerEngine")
    previous = _STATE.get("cp")
    utils = importlib.import_module("megatron.core.utils")
    # gone from core_v0.18 on (the THD path of pretrain_gpt.get_batch was rewritten; our launcher uploads itself)
    originals = previous.originals if previous else {
        name: getattr(utils, name) for name in ("get_thd_batch_on_this_cp_rank",) if hasattr(utils, name)}
    _STATE["cp"] = _Installed(settings=settings, originals=originals)
    if previous is None and "get_thd_batch_on_this_cp_rank" in originals:
        rebind("get_thd_batch_on_this_cp_rank", originals["get_thd_batch_on_this_cp_rank"],
               get_thd_batch_on_this_cp_rank, skip=(__name__,))
    wlb_attention.install_core_attention(enabled=not te_attention)


def uninstall() -> None:
    """Undo ``install`` (tests; a training process has no reason to)."""
    from megatron_wlb.megatron import attention as wlb_attention

    state = _STATE.pop("cp", None)
    if state is None:
        return
    for name, original in state.originals.items():
        rebind(name, get_thd_batch_on_this_cp_rank, original, skip=(__name__,))
    wlb_attention.install_core_attention(enabled=False)


__all__ = ["WlbPackedSeqParams", "WlbVarlen", "get_thd_batch_on_this_cp_rank", "install",
           "packed_seq_params_from_iterator", "te_available", "training_device", "uninstall", "upload_micro_batch"]
