"""The device record of one micro-batch: ``upload`` copies a host ``RankMicroBatch`` to the device once, as the
batch tensors and, apart from them, two small records: the kernel's ``Varlen`` (cu_seqlens, max lengths, positions)
and the all-gather attention's ``GatherPlan`` (which all-gathered K/V rows each query run reads).

Every array of the host record (tokens, labels, loss mask, positions, cu_seqlens, the key pieces,
and under deterministic algorithms the repeat count of each key row) is written into ONE pinned
host buffer (pinned where CUDA is available), which goes to the device with ONE non-blocking copy;
the ``DeviceBatch``, ``Varlen`` and ``GatherPlan`` fields are views of it, plus the key rows of the all-gather
buffer, expanded on the device from the O(runs) pieces. Every number a kernel call needs (``max_seqlen_*``, token
counts, the total key count) is a host int, so nothing reads a device tensor back.
This is the only place the batch path copies host -> device.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch

from megatron_wlb.cp.layouts import expand_runs
from megatron_wlb.cp.plan import RankMicroBatch

_ALIGN = 8  # bytes: every view starts at a multiple of the largest element size


@dataclass(frozen=True, eq=False)
class Varlen:
    """The kernel record of one micro-batch on one CP rank (as TorchTitan's varlen metadata): made by ``upload``
    only, once per micro-batch; read by the varlen kernel of every attention layer and by RoPE, both from the
    micro-batch's packed-sequence params (``WlbPackedSeqParams.varlen``). No tensor carries it.

    ``cu_seqlens_q`` / ``cu_seqlens_k`` int32 (this rank's query runs, their key segments) and ``max_seqlen_q`` /
    ``max_seqlen_k`` (host ints: the longest query run and key segment, what the kernel is called with);
    ``positions`` long ``[R]`` (each row's position in its document: RoPE's) and ``rope_length`` (the rotary table
    they need: 1 + the largest, at least the longest segment); on the TE path (``cu_seqlens_padded`` set) TE's THD
    offsets.
    """

    cu_seqlens_q: torch.Tensor
    cu_seqlens_k: torch.Tensor
    max_seqlen_q: int
    max_seqlen_k: int
    positions: torch.Tensor
    rope_length: int
    cu_seqlens_padded: torch.Tensor | None = None

    @property
    def num_runs(self) -> int:
        """This rank's query runs (a host int: the tensor's shape)."""
        return self.cu_seqlens_q.shape[0] - 1

    @property
    def te(self) -> bool:
        """Whether this is TransformerEngine's THD path (``per-document-te``), not the all-gather attention."""
        return self.cu_seqlens_padded is not None

    def tensors(self) -> list[torch.Tensor]:
        """Every device tensor of the record."""
        return [t for t in (self.positions, self.cu_seqlens_q, self.cu_seqlens_k, self.cu_seqlens_padded)
                if t is not None]


@dataclass(frozen=True, eq=False)
class GatherPlan:
    """The all-gather attention's plan of one micro-batch on one CP rank, apart from the kernel record: made by
    ``upload`` only, read by ``cp.attention.all_gather_cp_attention`` (``WlbPackedSeqParams.gather``).

    ``segment_index`` long (rows of the padded all-gather buffer holding each query run's keys), ``occurrence`` /
    ``levels`` (the repeat of each segment row, deterministic backward only), ``rank`` and ``rank_counts`` (rows per
    CP rank), ``identity_segments`` (CP = 1, the key segments are the local rows in order: K/V go to the kernel as
    they are); ``local_pad`` trailing rows are rank padding (sequence parallelism). ``layout`` is the CP layout used
    (for ``adaptive``, the chosen one). The process group is the params' (``cp_group``).
    """

    segment_index: torch.Tensor
    occurrence: torch.Tensor | None
    levels: int
    rank: int
    rank_counts: tuple[int, ...]
    identity_segments: bool
    layout: str
    local_pad: int = 0

    @property
    def num_tokens(self) -> int:
        """This rank's own tokens (its rows less the rank padding)."""
        return self.rank_counts[self.rank]

    def tensors(self) -> list[torch.Tensor]:
        """Every device tensor of the plan."""
        return [t for t in (self.segment_index, self.occurrence) if t is not None]


@dataclass(frozen=True, eq=False)
class DeviceBatch:
    """One micro-batch on one CP rank, on the device (made by ``upload`` only): the batch tensors Megatron
    reads, ``tokens`` / ``labels`` / ``loss_mask`` / ``position_ids`` ``[1, R]`` (None: a metadata-only
    upload, for middle pipeline stages), and apart from them the kernel's ``varlen`` record and the all-gather
    ``gather`` plan."""

    tokens: torch.Tensor | None
    labels: torch.Tensor | None
    loss_mask: torch.Tensor | None
    position_ids: torch.Tensor | None
    varlen: Varlen
    gather: GatherPlan

    def tensors(self) -> list[torch.Tensor]:
        """Every device tensor of the micro-batch (to keep them alive on another stream)."""
        return [t for t in (self.tokens, self.labels, self.loss_mask, self.position_ids) if t is not None] + \
            self.varlen.tensors() + self.gather.tensors()


def row_occurrence(rows: np.ndarray) -> np.ndarray:
    """For each entry of ``rows``, how many earlier entries hold the same row (0 for the first)."""
    rows = np.asarray(rows)
    if rows.size == 0:
        return np.zeros(0, dtype=np.int64)
    order = np.argsort(rows, kind="stable")
    ranked = rows[order]
    index = np.arange(rows.size)
    starts = np.maximum.accumulate(np.where(np.r_[True, ranked[1:] != ranked[:-1]], index, 0))
    occurrence = np.empty(rows.size, dtype=np.int64)
    occurrence[order] = index - starts
    return occurrence


def _expand_pieces(base: torch.Tensor, length: torch.Tensor, total: int) -> torch.Tensor:
    """``cat(arange(b, b + n) for b, n in pieces)`` on the pieces' device (``total``: the host-known sum)."""
    if base.numel() == 0:
        return base
    offsets = torch.cumsum(length, 0) - length                      # first output index of each piece
    return torch.repeat_interleave(base - offsets, length, output_size=total) + torch.arange(total, device=base.device)


def upload(batch: RankMicroBatch, device: torch.device | str, *, tokens: bool = True) -> DeviceBatch:
    """``batch`` on ``device``: one host buffer (pinned where CUDA is available), one non-blocking copy.
    ``tokens=False``: the metadata only (no tokens, labels, loss mask)."""
    device = torch.device(device)
    base, length = batch.key_pieces[:, 0], batch.key_pieces[:, 1]
    occurrence = None
    if torch.are_deterministic_algorithms_enabled() and batch.cu_seqlens_padded is None:
        occurrence = row_occurrence(expand_runs(base, length))
    parts: dict[str, np.ndarray] = {}
    if tokens:
        parts.update(tokens=batch.tokens.astype(np.int64, copy=False), labels=batch.labels.astype(np.int64, copy=False),
                     loss_mask=batch.loss_mask.astype(np.float32, copy=False))
    parts.update(position_ids=batch.position_ids.astype(np.int64, copy=False),
                 cu_seqlens_q=batch.cu_seqlens_q.astype(np.int32, copy=False),
                 base=base.astype(np.int64, copy=False), length=length.astype(np.int64, copy=False))
    te = batch.cu_seqlens_padded is not None
    same_k = te or batch.cu_seqlens_k is batch.cu_seqlens_q
    if not same_k:
        parts["cu_seqlens_k"] = batch.cu_seqlens_k.astype(np.int32, copy=False)
    padded_alias = batch.cu_seqlens_padded is not None and np.array_equal(batch.cu_seqlens_padded, batch.cu_seqlens_q)
    if batch.cu_seqlens_padded is not None and not padded_alias:
        parts["cu_seqlens_padded"] = batch.cu_seqlens_padded.astype(np.int32, copy=False)
    if occurrence is not None:
        parts["occurrence"] = occurrence.astype(np.int32)
    offsets, at = {}, 0
    for name, array in parts.items():
        offsets[name] = at
        at += -(-array.nbytes // _ALIGN) * _ALIGN
    flat = np.empty(max(at, _ALIGN), dtype=np.uint8)
    for name, array in parts.items():
        flat[offsets[name]:offsets[name] + array.nbytes] = np.ascontiguousarray(array).reshape(-1).view(np.uint8)
    host = torch.from_numpy(flat)
    if device.type == "cuda" and torch.cuda.is_available():
        host = host.pin_memory()  # a non-blocking copy from pageable memory would sync; from pinned memory it does not
    on_device = host.to(device, non_blocking=True)

    def view(name: str, dtype: torch.dtype) -> torch.Tensor:
        array = parts[name]
        return on_device[offsets[name]:offsets[name] + array.nbytes].view(dtype).reshape(array.shape)

    position_ids = view("position_ids", torch.long)
    cu_q = view("cu_seqlens_q", torch.int32)
    cu_k = cu_q if same_k else view("cu_seqlens_k", torch.int32)
    cu_padded = None if not te else (cu_q if padded_alias else view("cu_seqlens_padded", torch.int32))
    segment_index = _expand_pieces(view("base", torch.long), view("length", torch.long), int(length.sum()))
    varlen = Varlen(
        cu_seqlens_q=cu_q, cu_seqlens_k=cu_k, max_seqlen_q=int(batch.max_seqlen_q),
        max_seqlen_k=int(batch.max_seqlen_k), positions=position_ids[0], rope_length=int(batch.rope_length),
        cu_seqlens_padded=cu_padded)
    gather = GatherPlan(
        segment_index=segment_index, occurrence=view("occurrence", torch.int32) if occurrence is not None else None,
        levels=int(occurrence.max()) + 1 if occurrence is not None and occurrence.size else 1, rank=int(batch.rank),
        rank_counts=tuple(int(c) for c in batch.rank_counts), identity_segments=batch.identity_segments,
        layout=batch.layout.name, local_pad=int(batch.local_pad))
    return DeviceBatch(
        tokens=view("tokens", torch.long) if tokens else None,
        labels=view("labels", torch.long) if tokens else None,
        loss_mask=view("loss_mask", torch.float32) if tokens else None,
        position_ids=position_ids if tokens else None, varlen=varlen, gather=gather)


__all__ = ["DeviceBatch", "GatherPlan", "Varlen", "row_occurrence", "upload"]
