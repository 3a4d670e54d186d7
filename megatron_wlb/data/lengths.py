"""The one check of a document-length array (what every stream, dataset and layout reads through)."""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np


def validate_lengths(lengths: Sequence[int] | np.ndarray, what: str = "document lengths") -> np.ndarray:
    """Return ``lengths`` as int64, or raise naming the first bad entry (zero, negative, non-integer)."""
    arr = np.asarray(lengths)
    if arr.ndim != 1:
        raise ValueError(f"{what} must be a 1-D sequence, got shape {arr.shape}")
    if arr.size == 0:
        return arr.astype(np.int64)
    if arr.dtype.kind == "f":
        bad = np.flatnonzero(arr != np.floor(arr))
        if bad.size:
            raise ValueError(f"{what}[{bad[0]}] = {arr[bad[0]]!r} is not an integer; lengths count tokens")
    elif arr.dtype.kind not in "iu":
        raise ValueError(f"{what} must be integers, got dtype {arr.dtype}")
    arr = arr.astype(np.int64)
    bad = np.flatnonzero(arr < 1)
    if bad.size:
        raise ValueError(f"{what}[{bad[0]}] = {arr[bad[0]]}; every document needs at least 1 token")
    return arr
