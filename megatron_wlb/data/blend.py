"""Megatron's ``--data-path`` (a dataset prefix, or a weighted blend) at document level: one parser and
one blend for the CLI (``wlb pack``/``bench``/``analyze``) and the Megatron adapter."""

from __future__ import annotations

import math
from collections.abc import Sequence

import numpy as np

#: Megatron GPTDataset's default shuffle seed
DEFAULT_SEED = 1234


def parse_data_path(data_path: Sequence[str] | str) -> list[tuple[str, float | None]]:
    """``A B`` -> ``[("A", None), ("B", None)]`` (no weights) or ``0.7 A 0.3 B`` -> ``[("A", 0.7), ("B", 0.3)]``
    (weights as given, positive and finite), as Megatron's ``--data-path`` reads them; one-line errors."""
    tokens = data_path.split() if isinstance(data_path, str) else [str(t) for t in data_path]
    if not tokens:
        raise ValueError("--data-path is empty; give one or more PREFIX (of PREFIX.bin/.idx), "
                         "or WEIGHT PREFIX pairs")

    def number(text: str) -> float | None:
        try:
            return float(text)
        except ValueError:
            return None

    if len(tokens) == 1 or number(tokens[0]) is None:
        weights = [t for t in tokens if number(t) is not None]
        if weights:
            raise ValueError(f"--data-path {' '.join(tokens)}: {weights[0]!r} looks like a weight; give a weight "
                             "before every prefix ('0.7 A 0.3 B') or none at all ('A B')")
        return [(t, None) for t in tokens]
    if len(tokens) % 2:
        raise ValueError(f"--data-path {' '.join(tokens)}: weighted blends need WEIGHT PREFIX pairs, "
                         f"got an odd number ({len(tokens)}) of entries")
    out: list[tuple[str, float | None]] = []
    for w, prefix in zip(tokens[::2], tokens[1::2], strict=True):
        weight = number(w)
        if weight is None or not (weight > 0 and math.isfinite(weight)):
            raise ValueError(f"--data-path: weight {w!r} before {prefix!r} must be a positive number")
        if number(prefix) is not None:
            raise ValueError(f"--data-path: {prefix!r} sits where a dataset prefix belongs")
        out.append((prefix, weight))
    return out


def normalised_weights(parts: Sequence[tuple[str, float | None]]) -> list[float] | None:
    """The blend's weights summing to 1, or None for an unweighted list (concatenated)."""
    weights = [w for _, w in parts if w is not None]
    if len(weights) < len(parts):  # parse_data_path gives all weights or none
        return None
    total = sum(weights)
    return [w / total for w in weights]


def shuffle_documents(lengths: np.ndarray, seed: int) -> np.ndarray:
    """The documents in the order Megatron's GPTDataset visits them in one epoch: a numpy
    ``RandomState(seed)`` permutation of the document index."""
    order = np.arange(lengths.size, dtype=np.int64)
    np.random.RandomState(seed % 2**32).shuffle(order)
    return lengths[order]


def blend(datasets: list[np.ndarray], weights: list[float] | None) -> tuple[np.ndarray, list[int]]:
    """Interleave datasets so that each holds its weight's share of the tokens read so far (the
    document-level analogue of Megatron's BlendedDataset, which fills each sample from the dataset
    furthest behind its weight). Returns (stream, documents used per dataset): the stream ends
    when the first dataset runs out, so no document repeats; ``weights=None`` concatenates."""
    if weights is None:
        return np.concatenate(datasets), [d.size for d in datasets]
    if len(weights) != len(datasets):
        raise ValueError(f"{len(weights)} weights for {len(datasets)} datasets")
    # a document's "time" is the tokens of its dataset up to its end over the dataset's weight
    ends = [np.cumsum(d) / w for d, w in zip(datasets, weights, strict=True)]
    horizon = min(float(e[-1]) for e in ends)
    used = [int(np.searchsorted(e, horizon, side="right")) for e in ends]
    keys = np.concatenate([e[:u] for e, u in zip(ends, used, strict=True)])
    docs = np.concatenate([d[:u] for d, u in zip(datasets, used, strict=True)])
    return docs[np.argsort(keys, kind="stable")], used


def read_blend(data_path: Sequence[str] | str, seed: int | None = DEFAULT_SEED) -> tuple[np.ndarray, str, int]:
    """Document lengths of a ``--data-path`` blend, each dataset shuffled as Megatron does (``seed``
    + 7919 x its index; None keeps file order): (stream, description, documents not read)."""
    from megatron_wlb.data.indexed import read_idx_lengths
    from megatron_wlb.packing.base import validate_lengths

    parts = parse_data_path(data_path)
    datasets = [validate_lengths(read_idx_lengths(prefix), what=f"lengths in {prefix}.idx") for prefix, _ in parts]
    if seed is not None:
        datasets = [shuffle_documents(d, seed + 7919 * i) for i, d in enumerate(datasets)]
    weights = normalised_weights(parts)
    stream, used = blend(datasets, weights)
    shares = [f"{w:.3g} x " for w in weights] if weights is not None else [""] * len(parts)
    desc = " + ".join(f"{share}{prefix}.idx ({d.size:,} documents, {u:,} used)"
                      for (prefix, _), share, d, u in zip(parts, shares, datasets, used, strict=True))
    return stream, desc, int(sum(d.size - u for d, u in zip(datasets, used, strict=True)))
