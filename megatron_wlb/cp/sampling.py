"""Micro-batches for CP benchmarks: Megatron-style concat-and-cut of a document-length stream."""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np

from megatron_wlb.data.cut import concat_and_cut as cut_stream

#: how CP reports (bench_layouts, gpu_cp_latency) name where their micro-batches come from
SAMPLE_SOURCE = ("cut Megatron-style (concat-and-cut) from the embedded length stream "
                 "(megatron_wlb/data/dist_wlbllm.json, published by the DistCA authors as a stand-in for "
                 "WLB-LLM's data)")


def concat_and_cut(lengths: np.ndarray, seq_len: int, count: int | None = None,
                   indices: Sequence[int] | None = None) -> list[np.ndarray]:
    """Micro-batches of exactly ``seq_len`` tokens, as Megatron's GPTDataset builds samples
    (``data.cut.concat_and_cut``: documents back to back, cut every ``seq_len`` tokens).
    Returns the first ``count`` micro-batches, or those numbered ``indices``, each as its piece
    lengths in order. ``available(lengths, seq_len)`` says how many there are."""
    lengths = np.asarray(lengths, dtype=np.int64)
    if seq_len < 1:
        raise ValueError(f"seq_len must be >= 1, got {seq_len}")
    if indices is None:
        if count is None:
            raise ValueError("pass exactly one of count and indices")
        wanted = list(range(count))
    elif count is not None:
        raise ValueError("pass exactly one of count and indices")
    else:
        wanted = [int(i) for i in indices]
    total = int(lengths.sum())
    if wanted and (min(wanted) < 0 or (max(wanted) + 1) * seq_len > total):
        raise ValueError(f"the stream holds {total // seq_len} micro-batches of {seq_len} tokens; "
                         f"asked for numbers {min(wanted)}..{max(wanted)}")
    return [sizes for _, _, sizes in cut_stream(lengths, seq_len, wanted)]


def available(lengths: np.ndarray, seq_len: int) -> int:
    """How many full ``seq_len``-token micro-batches the stream yields."""
    return int(np.asarray(lengths, dtype=np.int64).sum()) // seq_len
