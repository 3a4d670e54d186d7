"""Megatron's ``--data-path`` (a dataset prefix, or a weighted blend) at document level: one parser and
one blend for the CLI (``wlb pack``/``bench``/``analyze``) and the Megatron adapter."""

from __future__ import annotations

import math
from collections.abc import Callable, Iterable, Sequence

import numpy as np

from megatron_wlb.data.indexed import read_idx_lengths
from megatron_wlb.data.lengths import validate_lengths

#: Megatron GPTDataset's default shuffle seed
DEFAULT_SEED = 1234


def data_path_problems(given: Iterable[tuple[str, Sequence[str] | str | None]],
                       problem_of: Callable[[str, str], str | None]) -> list[str]:
    """The problems of the data paths a run was given: for each ``(option, value)`` with a value, the error of a
    value ``parse_data_path`` refuses, else ``problem_of(option, path)`` for each path in it (None: fine)."""
    problems: list[str] = []
    for option, value in given:
        if not value:
            continue
        try:
            paths = [path for path, _ in parse_data_path(value)]
        except ValueError as exc:
            problems.append(str(exc))
            continue
        problems.extend(problem for path in paths if (problem := problem_of(option, path)) is not None)
    return problems


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
    if not math.isfinite(sum(w for _, w in out if w is not None)):
        raise ValueError(f"--data-path {' '.join(tokens)}: the weights sum past the largest float; scale them down "
                         "(only their ratios matter)")
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


def start_times(lengths: np.ndarray, weight: float, before: int = 0) -> np.ndarray:
    """The one blend rule: a dataset read in order schedules each document at the tokens before it
    over the dataset's weight, so every dataset holds its weight's share of the tokens read so far
    (the document-level analogue of Megatron's BlendedDataset). ``before``: the dataset's tokens
    scheduled before ``lengths[0]`` (a stream generated a chunk at a time)."""
    lengths = np.asarray(lengths, dtype=np.int64)
    return (before + np.cumsum(lengths) - lengths) / float(weight)


def interleave(keys: Sequence[np.ndarray]) -> tuple[np.ndarray, np.ndarray]:
    """Merge datasets' documents by start time, ties by dataset index: (dataset, position in it) in
    stream order."""
    which = np.concatenate([np.full(k.size, i, dtype=np.int64) for i, k in enumerate(keys)])
    position = np.concatenate([np.arange(k.size, dtype=np.int64) for k in keys])
    order = np.lexsort((which, np.concatenate(keys)))
    return which[order], position[order]


def blend(datasets: list[np.ndarray], weights: list[float] | None) -> tuple[np.ndarray, list[int]]:
    """Interleave datasets by ``start_times`` until the first one runs out, so no document repeats.
    Returns (stream, documents used per dataset); ``weights=None`` concatenates."""
    if weights is None:
        return np.concatenate(datasets), [d.size for d in datasets]
    if len(weights) != len(datasets):
        raise ValueError(f"{len(weights)} weights for {len(datasets)} datasets")
    horizon = min(float(d.sum()) / w for d, w in zip(datasets, weights, strict=True))
    keys = [k[k < horizon] for k in (start_times(d, w) for d, w in zip(datasets, weights, strict=True))]
    which, position = interleave(keys)
    stream = np.concatenate(datasets)[np.concatenate([[0], np.cumsum([d.size for d in datasets])])[which] + position]
    return stream, [int(k.size) for k in keys]


def read_blend(data_path: Sequence[str] | str, seed: int | None = DEFAULT_SEED,
               datasets: Sequence[np.ndarray] | None = None) -> tuple[np.ndarray, str, int]:
    """Document lengths of a ``--data-path`` blend, each dataset shuffled as Megatron does (``seed``
    + 7919 x its index; None keeps file order): (stream, description, documents not read).
    ``datasets``: each prefix's lengths (file order) when the caller has read them (``wlb analyze``
    reads them through the training reader, or a sample of them); else read from each ``.idx``."""
    parts = parse_data_path(data_path)
    if datasets is None:
        datasets = [validate_lengths(read_idx_lengths(prefix), what=f"lengths in {prefix}.idx") for prefix, _ in parts]
    elif len(datasets) != len(parts):
        raise ValueError(f"{len(datasets)} datasets' lengths for the {len(parts)} prefixes of --data-path")
    datasets = list(datasets)
    if seed is not None:
        datasets = [shuffle_documents(d, seed + 7919 * i) for i, d in enumerate(datasets)]
    weights = normalised_weights(parts)
    stream, used = blend(datasets, weights)
    shares = [f"{w:.3g} x " for w in weights] if weights is not None else [""] * len(parts)
    desc = " + ".join(f"{share}{prefix}.idx ({d.size:,} documents, {u:,} used)"
                      for (prefix, _), share, d, u in zip(parts, shares, datasets, used, strict=True))
    return stream, desc, int(sum(d.size - u for d, u in zip(datasets, used, strict=True)))
