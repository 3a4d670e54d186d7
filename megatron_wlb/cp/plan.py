"""One micro-batch as one CP rank runs it: one host record, built once, where the packer's plan is.

The path of a micro-batch from the length stream to the kernel (see ``megatron_wlb.megatron``)::

    packer: MicroBatch (document pieces)
      -> micro_batch_lengths(): the packed sequence's segments (pieces, then one padding segment)
      -> layout_micro_batch(): ShardLayout, every CP rank's runs (cp/layouts.py)
      -> rank_batch(): RankMicroBatch, this rank's rows, tokens, positions, padding and kernel metadata
      -> cp.device.upload(): DeviceBatch (batch tensors + the Varlen record), one copy from pinned memory

Every CP rank builds the same layout from the same pieces (the packer is deterministic), so no
rank waits for another and nothing travels device -> host. Pure numpy: no torch, no global state.

Padding policy (all of it lives here):

- *sequence padding*: the micro-batch's token count ``T`` is rounded up to ``sequence_multiple``
  (CP, times TP under sequence parallelism) by one trailing padding segment, so per-sequence and
  per-document layouts give every CP rank ``T / CP`` tokens; an empty micro-batch (a packer may
  leave one while its queues fill) becomes one padding segment of ``2 * sequence_multiple`` tokens,
  so every pipeline stage still runs all its micro-batches. Padding tokens carry loss_mask 0.
- *TE document padding* (``per-document-te``): TE pads every document to a multiple of ``2 * CP``;
  under sequence parallelism one more padding document makes every rank's count a multiple of TP.
- *rank padding* (our layouts under sequence parallelism): ``local_pad`` rows after a rank's own
  tokens make its count a multiple of TP; the attention leaves them out.

A layout as a mask, CP=2, per-document, documents ``aaaaaaaa bbbb`` (``rows`` of rank 0 = ``0 1 6 7
8 11``; each query run attends causally to its document's keys up to the run's end)::

    position  0 1 2 3 4 5 6 7 | 8 9 10 11
    rank      0 0 1 1 1 1 0 0 | 0 1  1  0
"""

from __future__ import annotations

from dataclasses import dataclass, field

import numpy as np

from megatron_wlb.costmodel import CostModel
from megatron_wlb.cp.layouts import LAYOUT_NAMES, RankShard, ShardLayout, build_layout
from megatron_wlb.packing.types import MAX_MICRO_BATCH_TOKENS, MicroBatch

__all__ = ["CPSharding", "Packed", "RankMicroBatch", "layout_batch", "layout_micro_batch", "micro_batch_lengths",
           "rank_batch"]


@dataclass(frozen=True)
class CPSharding:
    """How every micro-batch of a run is cut over its CP group (identical on every rank but ``cp_rank``).

    - ``layout``: a name of ``cp.layouts.LAYOUT_NAMES``.
    - ``sequence_multiple``: the micro-batch's token count is padded to a multiple of this.
    - ``rank_multiple``: every rank's token count is padded to a multiple of this (TP under SP).
    - ``te_attention``: build TransformerEngine's varlen fields (``per-document-te`` only).
    - ``cost``: prices attention for ``adaptive`` / ``hybrid`` (None: the layouts' default).
    """

    layout: str = "per-sequence"
    cp_size: int = 1
    cp_rank: int = 0
    sequence_multiple: int = 1
    rank_multiple: int = 1
    te_attention: bool = False
    cost: CostModel | None = field(default=None, compare=False)

    def __post_init__(self) -> None:
        if self.layout not in LAYOUT_NAMES:
            raise ValueError(f"CP layout {self.layout!r}; valid: {', '.join(LAYOUT_NAMES)}")
        if self.cp_size < 1 or not 0 <= self.cp_rank < self.cp_size:
            raise ValueError(f"cp_rank={self.cp_rank} is outside the CP group of size {self.cp_size}")
        if self.sequence_multiple < 1 or self.rank_multiple < 1:
            raise ValueError(f"sequence_multiple={self.sequence_multiple} and rank_multiple={self.rank_multiple} "
                             "must be >= 1")
        if self.te_attention and self.layout != "per-document-te":
            raise ValueError(f"te_attention needs the per-document-te layout, got {self.layout!r}")

    @property
    def empty_tokens(self) -> int:
        """Tokens of the padding segment that stands in for an empty micro-batch."""
        return 2 * self.sequence_multiple


def micro_batch_lengths(piece_lengths: np.ndarray | list[int], sequence_multiple: int = 1,
                        empty_tokens: int = 1) -> np.ndarray:
    """Segments of the packed sequence: the pieces' lengths, then one padding segment (if any) that
    rounds the total up to ``sequence_multiple``; no pieces: one padding segment of ``empty_tokens``
    rounded up to ``sequence_multiple``."""
    if sequence_multiple < 1 or empty_tokens < 1:
        raise ValueError(f"sequence_multiple and empty_tokens must be >= 1, got {sequence_multiple}, {empty_tokens}")
    lengths = np.asarray(piece_lengths, dtype=np.int64).reshape(-1)
    if lengths.size and int(lengths.min()) < 1:
        raise ValueError(f"piece lengths must be >= 1, got {lengths.tolist()[:16]}")
    total = int(lengths.sum())
    pad = (-total) % sequence_multiple if total else -(-empty_tokens // sequence_multiple) * sequence_multiple
    if total + pad > MAX_MICRO_BATCH_TOKENS:
        raise ValueError(f"a micro-batch of {total + pad} tokens (padding included): attention kernels index its "
                         f"tokens with int32 (cu_seqlens), so at most {MAX_MICRO_BATCH_TOKENS} (2**31 - 1)")
    return np.append(lengths, pad) if pad else lengths


@dataclass(frozen=True, eq=False)
class RankMicroBatch:
    """One micro-batch on one CP rank, on the host: built once (``rank_batch``), uploaded once
    (``cp.device.upload``), read by the embedding, the loss, RoPE and every attention layer.

    ``layout`` holds every rank's shard (the CP ranks' layouts agree by construction); ``rows`` [R]
    maps each local row to its position in the packed sequence, -1 for a padding row (TE document
    padding, rank padding); ``tokens`` / ``labels`` / ``loss_mask`` / ``position_ids`` ``[1, R]`` are
    the rows' inputs (padding rows 0) and RoPE positions (within their document); ``local_pad``
    trailing rows are rank padding (our layouts under SP; they attend to nothing); ``rope_length`` is
    how many rotary positions the model must compute (1 + the largest position, at least the longest
    segment).

    Attention: ``cu_seqlens_q`` / ``cu_seqlens_k`` (int32) and ``max_seqlen_*`` are this rank's query
    runs and their key segments; ``key_pieces`` ``[P, 2]`` (first row, length) are where those keys lie
    in the padded all-gather buffer (O(runs); the device expands them). On the TE path
    (``cu_seqlens_padded`` set) they are TransformerEngine's THD fields instead: real document offsets
    (the padding document counts as one), the documents padded to 2*CP, and no key pieces.
    ``micro_batch`` is the packer's plan (document pieces).
    """

    layout: ShardLayout
    rank: int
    segment_lengths: np.ndarray
    rows: np.ndarray
    tokens: np.ndarray
    labels: np.ndarray
    loss_mask: np.ndarray
    position_ids: np.ndarray
    local_pad: int
    rope_length: int
    cu_seqlens_q: np.ndarray
    cu_seqlens_k: np.ndarray
    max_seqlen_q: int
    max_seqlen_k: int
    key_pieces: np.ndarray
    cu_seqlens_padded: np.ndarray | None = None
    micro_batch: MicroBatch | None = None
    #: dynamic CP (``cp.dynamic_steps``): the (first slot, size) block of the pool whose process group runs this
    #: micro-batch; None: the run's fixed CP group
    block: tuple[int, int] | None = None

    @property
    def shard(self) -> RankShard:
        return self.layout.ranks[self.rank]

    @property
    def rank_counts(self) -> tuple[int, ...]:
        return self.shard.rank_counts

    @property
    def num_rows(self) -> int:
        return int(self.rows.size)

    @property
    def identity_segments(self) -> bool:
        """Whether the key segments are exactly this rank's rows in order (CP = 1, no overlapping runs): O(runs)."""
        if self.cu_seqlens_padded is not None or len(self.rank_counts) != 1:
            return False
        base, length = self.key_pieces[:, 0], self.key_pieces[:, 1]
        if base.size == 0:
            return self.shard.num_tokens == 0
        ends = base + length
        return bool(base[0] == 0 and np.all(base[1:] == ends[:-1]) and int(ends[-1]) == self.shard.num_tokens)

    def take(self, values: np.ndarray, fill: int | float = 0) -> np.ndarray:
        """This rank's rows of a ``[T]`` (or ``[1, T]``) array over the packed sequence, ``fill`` in
        padding rows; the result keeps ``values``' leading shape."""
        return _take(self.rows, values, fill)


def _take(rows: np.ndarray, values: np.ndarray, fill: int | float = 0) -> np.ndarray:
    flat = np.asarray(values).reshape(-1)
    out = np.where(rows >= 0, flat[np.maximum(rows, 0)], fill).astype(flat.dtype, copy=False)
    return out.reshape(np.shape(values)[:-1] + (rows.size,))


def _cu(lengths: np.ndarray) -> np.ndarray:
    return np.concatenate([[0], np.cumsum(lengths)]).astype(np.int64)


def _te_padding_document(lengths: np.ndarray, cp: int, multiple: int) -> np.ndarray:
    """``lengths`` plus, if needed, one trailing document of 2*cp*j tokens so that TE's per-document layout
    (each document padded to a multiple of 2*cp) gives every rank a multiple of ``multiple`` tokens."""
    per_rank = int(np.sum(-(-lengths // (2 * cp)) * 2))  # each padded document puts 2 * ceil(d / 2cp) on a rank
    for j in range(multiple + 1):
        if (per_rank + 2 * j) % multiple == 0:
            return lengths if j == 0 else np.append(lengths, 2 * cp * j)
    raise ValueError(f"no TE padding gives a multiple of {multiple} tokens per CP rank")


def layout_micro_batch(segment_lengths: np.ndarray, sharding: CPSharding) -> ShardLayout:
    """The CP layout of a packed sequence of ``segment_lengths`` (``micro_batch_lengths``' output): the
    same on every rank of the CP group (what ``cp.layouts.layout_digest`` and the agreement compare)."""
    lengths = _segments(segment_lengths)
    if sharding.te_attention and sharding.rank_multiple > 1:
        lengths = _te_padding_document(lengths, sharding.cp_size, sharding.rank_multiple)
    return build_layout(sharding.layout, lengths, sharding.cp_size, cost=sharding.cost)


def _segments(segment_lengths: np.ndarray) -> np.ndarray:
    lengths = np.asarray(segment_lengths, dtype=np.int64)
    if lengths.size == 0 or int(lengths.min()) < 1:
        raise ValueError(f"a micro-batch needs segments of >= 1 token, got {lengths.tolist()[:16]}")
    return lengths


#: a packed sequence's tokens, labels and loss mask, ``[T]`` each
Packed = tuple[np.ndarray, np.ndarray, np.ndarray]


def rank_batch(segment_lengths: np.ndarray, sharding: CPSharding, *, layout: ShardLayout | None = None,
               packed: Packed | None = None, micro_batch: MicroBatch | None = None) -> RankMicroBatch:
    """``sharding``'s CP rank's host record of a packed sequence of ``segment_lengths``: its rows of
    ``packed`` (tokens, labels, loss mask over the sequence; None: zeros, for attention-only use) laid
    out by ``layout`` (None: ``layout_micro_batch``)."""
    lengths = _segments(segment_lengths)
    rank = sharding.cp_rank
    layout = layout_micro_batch(lengths, sharding) if layout is None else layout
    if layout.cp != sharding.cp_size:
        raise ValueError(f"a layout over {layout.cp} CP ranks for a CP group of {sharding.cp_size}")
    size = int(lengths.sum())
    if packed is not None and any(np.size(a) != size for a in packed):
        raise ValueError(f"tokens, labels and loss mask of {[np.size(a) for a in packed]} entries for a packed "
                         f"sequence of {size} tokens")
    shard = layout.ranks[rank]
    layout_lengths = layout.lengths
    padded = np.asarray(layout.padded_lengths, dtype=np.int64)
    token_index = shard.token_index
    positions = shard.position_ids
    if np.array_equal(lengths, padded):
        rows = token_index
    else:  # TE padding (its documents', its padding document): padded positions -> real ones, -1 where TE pads
        real = np.append(lengths, np.zeros(layout_lengths.size - lengths.size, dtype=np.int64))
        doc = np.searchsorted(_cu(padded), token_index, side="right") - 1
        within = token_index - _cu(padded)[doc]
        rows = np.where(within < real[doc], _cu(real)[doc] + within, -1)
    rope_length = max(int(padded.max()), int(positions.max()) + 1 if positions.size else 1)
    local_pad = 0 if sharding.te_attention else (-rows.size) % sharding.rank_multiple
    if local_pad:
        rows = np.append(rows, np.full(local_pad, -1, dtype=np.int64))
        positions = np.append(positions, np.zeros(local_pad, dtype=np.int64))
    if packed is None:
        packed = (np.zeros(size, np.int64), np.zeros(size, np.int64), np.zeros(size, np.float32))
    tokens, labels, loss_mask = (_take(rows, a)[None] for a in packed)
    if sharding.te_attention:
        te_docs = np.where(np.arange(layout_lengths.size) < lengths.size, layout_lengths, padded)
        cu = _cu(te_docs).astype(np.int32)
        return RankMicroBatch(layout, rank, lengths, rows, tokens, labels, loss_mask, positions[None], 0,
                              rope_length, cu, cu, int(padded.max()), int(padded.max()),
                              np.zeros((0, 2), dtype=np.int64), _cu(padded).astype(np.int32), micro_batch)
    return RankMicroBatch(layout, rank, lengths, rows, tokens, labels, loss_mask, positions[None], local_pad,
                          rope_length, shard.cu_seqlens_q, shard.cu_seqlens_k, int(shard.max_seqlen_q),
                          int(shard.max_seqlen_k), np.stack(shard.gather_pieces(), axis=1), None, micro_batch)


def layout_batch(layout: ShardLayout, rank: int) -> RankMicroBatch:
    """Rank ``rank``'s attention-only host record of ``layout`` (no tokens; tests, benchmarks, kernel checks)."""
    return rank_batch(layout.lengths, CPSharding(layout.requested, layout.cp, rank), layout=layout)
