"""Document-length streams: the embedded distribution and users' own length files.

``dist_wlbllm.json`` (99,519 lengths in arrival order) mimics the 128K-context job of WLB-LLM
(OSDI'25, Figure 3). It was published by the DistCA authors (github hao-ai-lab/DistCA,
``distca/simulator/data/dist_wlbllm.json``) as a stand-in for the paper's data; it is not a
real corpus.
"""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np

EMBEDDED = Path(__file__).with_name("dist_wlbllm.json")
EMBEDDED_NAME = "wlbllm"


def load_lengths(source: str | Path | None = None) -> np.ndarray:
    """Document lengths (int64, arrival order) from ``source``.

    ``None`` or ``"wlbllm"`` is the embedded distribution. A path may be ``.json`` (a list of
    integers, or an object with a ``"lengths"`` list), ``.npy``, or text with one integer per
    line (``.txt``, ``.csv``; ``#`` comments and blank lines skipped).
    """
    from megatron_wlb.packing.base import validate_lengths

    if source is None or str(source) == EMBEDDED_NAME:
        path = EMBEDDED
    else:
        path = Path(source)
    if not path.exists():
        raise FileNotFoundError(f"length file {path} does not exist (use {EMBEDDED_NAME!r} for the embedded one)")
    suffix = path.suffix.lower()
    if suffix == ".json":
        data = json.loads(path.read_text())
        if isinstance(data, dict):
            if "lengths" not in data:
                raise ValueError(f"{path}: a JSON object needs a 'lengths' list, found keys {sorted(data)}")
            data = data["lengths"]
        arr = np.asarray(data)
    elif suffix == ".npy":
        arr = np.load(path)
    else:
        rows = []
        for lineno, line in enumerate(path.read_text().splitlines(), 1):
            line = line.split("#", 1)[0].strip().split(",")[0].strip()
            if not line:
                continue
            try:
                rows.append(int(line))
            except ValueError:
                raise ValueError(f"{path}:{lineno}: {line!r} is not an integer length") from None
        arr = np.asarray(rows, dtype=np.int64)
    return validate_lengths(arr, what=f"lengths in {path.name}")
