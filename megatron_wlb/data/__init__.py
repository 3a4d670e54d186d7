"""Document-length streams: the embedded distribution and users' own length files.

``dist_wlbllm.json`` (99,519 lengths in arrival order) mimics the 128K-context job of WLB-LLM
(OSDI'25, Figure 3). It was published by the DistCA authors (github hao-ai-lab/DistCA,
``distca/simulator/data/dist_wlbllm.json``) as a stand-in for the paper's data; it is not a
real corpus.

Below packing and cp: ``lengths.validate_lengths`` is the one check of a length array, ``cut`` is
Megatron's concat-and-cut over a length stream (what ``original``, the ``pieces="concat-and-cut"``
intake and the CP sampler cut with).
"""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np

from megatron_wlb.data.lengths import validate_lengths

EMBEDDED = Path(__file__).with_name("dist_wlbllm.json")
EMBEDDED_NAME = "wlbllm"


#: the longest document length a file may hold (2**40 tokens); beyond it a value is a unit mistake,
#: and int64 arithmetic downstream (token sums over a stream) must not overflow
MAX_DOCUMENT_TOKENS = 2**40


def _checked(arr: np.ndarray, path: Path) -> np.ndarray:
    """Lengths as int64, or a one-line error naming the file, the entry and what is valid."""
    arr = np.asarray(arr)
    if arr.dtype == object or arr.dtype.kind not in "iuf":
        raise ValueError(f"{path}: lengths must be a flat list of integers (got {arr.dtype} values, "
                         f"e.g. {arr.ravel()[:1].tolist()})")
    if arr.ndim != 1:
        raise ValueError(f"{path}: lengths must be a flat list of integers, got an array of shape {arr.shape}")
    if arr.dtype.kind == "f":
        bad = np.flatnonzero(~np.isfinite(arr))
        if bad.size:
            raise ValueError(f"{path}: entry {bad[0]} is {float(arr[bad[0]])}; lengths are finite token counts")
        frac = np.flatnonzero(arr != np.floor(arr))
        if frac.size:
            raise ValueError(f"{path}: entry {frac[0]} is {float(arr[frac[0]])}; lengths are whole token counts")
    too_big = np.flatnonzero(arr > MAX_DOCUMENT_TOKENS)
    if too_big.size:
        raise ValueError(f"{path}: entry {too_big[0]} = {arr[too_big[0]]!r} tokens exceeds the largest document "
                         f"length {MAX_DOCUMENT_TOKENS} (2**40)")
    return arr


def load_lengths(source: str | Path | None = None) -> np.ndarray:
    """Document lengths (int64, arrival order) from ``source``.

    ``None`` or ``"wlbllm"`` is the embedded distribution. A path may be ``.json`` (a list of
    integers, or an object with a ``"lengths"`` list), ``.npy``, or text with one integer per
    line (``.txt``, ``.csv`` with one column; ``#`` comments and blank lines skipped). A line with
    several fields is an error, not its first field silently.
    """
    if source is None or str(source) == EMBEDDED_NAME:
        path = EMBEDDED
    else:
        path = Path(source)
    if not path.exists():
        raise FileNotFoundError(f"length file {path} does not exist (use {EMBEDDED_NAME!r} for the embedded one)")
    if not path.is_file():
        raise ValueError(f"length file {path} is a directory; give a .json / .npy / .txt file of lengths")
    suffix = path.suffix.lower()
    if suffix == ".json":
        try:
            data = json.loads(path.read_text())
        except (json.JSONDecodeError, UnicodeDecodeError) as exc:
            raise ValueError(f"{path}: not valid JSON ({exc})") from None
        if isinstance(data, dict):
            if "lengths" not in data:
                raise ValueError(f"{path}: a JSON object needs a 'lengths' list, found keys {sorted(data)}")
            data = data["lengths"]
        if not isinstance(data, list) or not all(isinstance(x, (int, float)) and not isinstance(x, bool)
                                                 for x in data):
            raise ValueError(f"{path}: expected a JSON list of integer lengths (or {{\"lengths\": [...]}})")
        if any(isinstance(x, int) and abs(x) > MAX_DOCUMENT_TOKENS for x in data):
            i = next(i for i, x in enumerate(data) if isinstance(x, int) and abs(x) > MAX_DOCUMENT_TOKENS)
            raise ValueError(f"{path}: entry {i} = {data[i]} is not a document length in [1, 2**40]")
        arr = _checked(np.asarray(data, dtype=np.float64 if any(isinstance(x, float) for x in data) else np.int64),
                       path)
    elif suffix == ".npy":
        try:
            arr = _checked(np.load(path, allow_pickle=False), path)
        except (OSError, ValueError) as exc:
            if str(path) in str(exc):
                raise
            raise ValueError(f"{path}: not a numeric .npy array ({exc})") from None
    else:
        rows = []
        try:
            text = path.read_text()
        except UnicodeDecodeError:
            raise ValueError(f"{path}: not a text file; give one integer length per line, or .json / .npy") from None
        for lineno, line in enumerate(text.splitlines(), 1):
            line = line.split("#", 1)[0].strip()
            if not line:
                continue
            fields = [f for f in line.replace(",", " ").split() if f]
            if len(fields) != 1:
                raise ValueError(f"{path}:{lineno}: {line!r} holds {len(fields)} fields; give one integer length "
                                 "per line")
            try:
                value = int(fields[0])
            except ValueError:
                raise ValueError(f"{path}:{lineno}: {fields[0]!r} is not an integer length") from None
            if not 1 <= value <= MAX_DOCUMENT_TOKENS:
                raise ValueError(f"{path}:{lineno}: {value} is not a document length in [1, 2**40]")
            rows.append(value)
        arr = np.asarray(rows, dtype=np.int64)
    return validate_lengths(arr, what=f"lengths in {path.name}")


def stdlib_lengths() -> np.ndarray:
    """Token lengths (ceil(bytes / 4)) of this Python's standard-library .py files, in sorted path order:
    a real length distribution on every machine (``--lengths stdlib``)."""
    import sysconfig

    root = Path(sysconfig.get_paths()["stdlib"])
    files = sorted(p for p in root.rglob("*.py") if "site-packages" not in p.parts and p.is_file())
    sizes = np.array([p.stat().st_size for p in files], dtype=np.int64)
    return np.maximum(1, (sizes + 3) // 4)
