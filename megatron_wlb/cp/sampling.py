"""Micro-batches for CP benchmarks: Megatron-style concat-and-cut of a document-length stream."""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np


def concat_and_cut(lengths: np.ndarray, seq_len: int, count: int | None = None,
                   indices: Sequence[int] | None = None) -> list[np.ndarray]:
    """Micro-batches of exactly ``seq_len`` tokens, as Megatron's GPTDataset builds samples:
    documents back to back, cut every ``seq_len`` tokens (a cut document continues in the next
    micro-batch). Returns the first ``count`` micro-batches, or those numbered ``indices``, each as
    its document pieces in order. ``available(lengths, seq_len)`` says how many there are."""
    lengths = np.asarray(lengths, dtype=np.int64)
    if seq_len < 1:
        raise ValueError(f"seq_len must be >= 1, got {seq_len}")
    if (count is None) == (indices is None):
        raise ValueError("pass exactly one of count and indices")
    ends = np.cumsum(lengths)
    total = int(ends[-1]) if ends.size else 0
    wanted = list(range(count)) if indices is None else [int(i) for i in indices]
    if wanted and (min(wanted) < 0 or (max(wanted) + 1) * seq_len > total):
        raise ValueError(f"the stream holds {total // seq_len} micro-batches of {seq_len} tokens; "
                         f"asked for numbers {min(wanted)}..{max(wanted)}")
    starts = ends - lengths
    out = []
    for i in wanted:
        lo, hi = i * seq_len, (i + 1) * seq_len
        first = int(np.searchsorted(ends, lo, side="right"))
        last = int(np.searchsorted(ends, hi, side="left"))
        piece = np.minimum(ends[first:last + 1], hi) - np.maximum(starts[first:last + 1], lo)
        out.append(piece[piece > 0])
    return out


def available(lengths: np.ndarray, seq_len: int) -> int:
    """How many full ``seq_len``-token micro-batches the stream yields."""
    return int(np.asarray(lengths, dtype=np.int64).sum()) // seq_len
