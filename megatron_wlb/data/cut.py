"""Megatron GPTDataset's concat-and-cut, as pure functions over a document-length stream.

Documents are laid back to back and the token stream is cut every ``seq_len`` tokens; a piece is
the part of one document inside one window, and it is a document for attention purposes. The
``original`` packer, the ``pieces="concat-and-cut"`` intake of every other packer and the CP
benchmarks' sampler (``cp/sampling.py``) all cut here, so they cut at the same points.
"""

from __future__ import annotations

from collections.abc import Iterable

import numpy as np


def concat_and_cut(lengths: np.ndarray, seq_len: int, micro_batches: Iterable[int]
                   ) -> list[tuple[np.ndarray, np.ndarray, np.ndarray]]:
    """Megatron's concat-and-cut: documents of ``lengths`` back to back, cut every ``seq_len`` tokens.

    For each micro-batch number k (tokens ``[k * seq_len, (k + 1) * seq_len)`` of the concatenation)
    returns its pieces in order as (document index, offset in the document, piece length) arrays. A
    micro-batch running past the end of the stream is partial (or empty).
    """
    counts, docs, offsets, sizes = concat_and_cut_flat(lengths, seq_len, micro_batches)
    edges = np.cumsum(counts)[:-1]
    return list(zip(np.split(docs, edges), np.split(offsets, edges), np.split(sizes, edges)))


def concat_and_cut_flat(lengths: np.ndarray, seq_len: int, micro_batches: Iterable[int]
                        ) -> tuple[np.ndarray, np.ndarray, np.ndarray, np.ndarray]:
    """``concat_and_cut`` as flat arrays: (pieces per micro-batch, then every piece's document
    index, offset in the document and length, micro-batch after micro-batch)."""
    lengths = np.asarray(lengths, dtype=np.int64)
    ends = np.cumsum(lengths)
    starts = ends - lengths
    lo = np.fromiter(micro_batches, dtype=np.int64) * seq_len
    hi = lo + seq_len
    first = np.searchsorted(ends, lo, side="right")
    last = np.minimum(np.searchsorted(ends, hi, side="left"), lengths.size - 1)
    overlap = np.maximum(last - first + 1, 0)  # documents overlapping each micro-batch (some with 0 tokens)
    window = np.repeat(np.arange(lo.size), overlap)
    docs = np.repeat(first, overlap) + np.arange(int(overlap.sum())) - np.repeat(np.cumsum(overlap) - overlap, overlap)
    begin = np.maximum(starts[docs], lo[window])
    size = np.minimum(ends[docs], hi[window]) - begin
    keep = size > 0
    counts = np.bincount(window[keep], minlength=lo.size)
    return counts, docs[keep], (begin - starts[docs])[keep], size[keep]


def window_pieces(lengths: np.ndarray, stream_offset: int, seq_len: int
                  ) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """The concat-and-cut pieces of consecutive documents whose first token sits at ``stream_offset``
    of the concatenated stream (cut points at every multiple of ``seq_len`` of that stream).

    Returns (document index into ``lengths``, offset in the document, piece length), in stream
    order; every piece is 1 to ``seq_len`` tokens and the pieces of a document tile it exactly.
    Cost O(documents + pieces)."""
    lengths = np.asarray(lengths, dtype=np.int64)
    if seq_len < 1:
        raise ValueError(f"seq_len must be >= 1, got {seq_len}")
    if stream_offset < 0:
        raise ValueError(f"stream_offset must be >= 0, got {stream_offset}")
    if lengths.size == 0:
        empty = np.zeros(0, dtype=np.int64)
        return empty, empty, empty
    ends = stream_offset + np.cumsum(lengths)
    starts = ends - lengths
    # window boundaries strictly inside each document: multiples of seq_len in (start, end)
    first_cut = starts // seq_len + 1
    last_cut = (ends - 1) // seq_len
    cuts = np.maximum(last_cut - first_cut + 1, 0)
    counts = cuts + 1
    doc = np.repeat(np.arange(lengths.size, dtype=np.int64), counts)
    k = np.arange(int(counts.sum()), dtype=np.int64) - np.repeat(np.cumsum(counts) - counts, counts)
    # piece k of a document starts at its start (k = 0) or at its k-th cut point
    begin = np.where(k == 0, starts[doc], (first_cut[doc] + k - 1) * seq_len)
    stop = np.minimum(ends[doc], (begin // seq_len + 1) * seq_len)
    return doc, begin - starts[doc], stop - begin
