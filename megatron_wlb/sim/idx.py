"""Document lengths of a Megatron indexed dataset (``PREFIX.idx``), for ``wlb analyze``/``simulate``.

With megatron-core importable and ``PREFIX.bin`` present, ``IndexedDataset(PREFIX)`` reads them;
otherwise we parse the ``.idx`` ourselves (it alone holds the lengths). The format we rely on is
megatron-core's ``_IndexWriter`` (``megatron/core/datasets/indexed_dataset.py``, version 1):

========  ======================  =============================================================
bytes     type                    content
========  ======================  =============================================================
9         ``b"MMIDIDX\\x00\\x00"``    magic
8         uint64 LE               version, must be 1
1         uint8                   dtype code of the token ids in ``.bin``
8         uint64 LE               S = number of sequences
8         uint64 LE               D = number of entries of ``document_indices`` (documents + 1)
4 S       int32                   ``sequence_lengths`` (tokens per sequence)
8 S       int64                   ``sequence_pointers`` (byte offsets into ``.bin``)
8 D       int64                   ``document_indices``: document i spans sequences
                                  ``[document_indices[i], document_indices[i + 1])``
========  ======================  =============================================================

A document's length is the sum of its sequences' lengths (for GPT pre-training data each document
is one sequence). Empty documents are reported, not dropped silently: ``read_idx_lengths`` raises
on them unless ``skip_empty`` is set.
"""

from __future__ import annotations

import struct
from pathlib import Path

import numpy as np

IDX_MAGIC = b"MMIDIDX\x00\x00"
_HEADER_BYTES = 9 + 8 + 1 + 8 + 8


def _prefix(path: str | Path) -> Path:
    p = Path(path)
    return p.with_suffix("") if p.suffix in (".idx", ".bin") else p


def parse_idx(prefix: str | Path) -> tuple[np.ndarray, np.ndarray]:
    """(sequence_lengths int64 [S], document_indices int64 [D]) parsed from ``PREFIX.idx``."""
    idx = _prefix(prefix).with_name(_prefix(prefix).name + ".idx")
    if not idx.exists():
        raise FileNotFoundError(f"{idx} does not exist; --data-prefix takes PREFIX of PREFIX.idx/.bin")
    size = idx.stat().st_size
    with open(idx, "rb") as f:
        head = f.read(_HEADER_BYTES)
    if len(head) < _HEADER_BYTES or head[:9] != IDX_MAGIC:
        raise ValueError(f"{idx}: not a Megatron indexed-dataset index (magic {head[:9]!r}, expected {IDX_MAGIC!r})")
    version, = struct.unpack("<Q", head[9:17])
    if version != 1:
        raise ValueError(f"{idx}: index version {version}; this reader knows version 1")
    n_seq, n_doc = struct.unpack("<QQ", head[18:34])
    need = _HEADER_BYTES + 4 * n_seq + 8 * n_seq + 8 * n_doc
    if size < need:
        raise ValueError(f"{idx}: truncated, {size} bytes but the header announces {n_seq} sequences and "
                         f"{n_doc} document indices ({need} bytes)")
    mm = np.memmap(idx, mode="r", dtype=np.uint8)
    seq = np.frombuffer(mm, dtype=np.int32, count=n_seq, offset=_HEADER_BYTES).astype(np.int64)
    docs = np.frombuffer(mm, dtype=np.int64, count=n_doc, offset=_HEADER_BYTES + 12 * n_seq).copy()
    return seq, docs


def _megatron_arrays(prefix: Path) -> tuple[np.ndarray, np.ndarray] | None:
    if not prefix.with_name(prefix.name + ".bin").exists():
        return None
    try:
        from megatron.core.datasets.indexed_dataset import IndexedDataset
    except ImportError:
        return None
    ds = IndexedDataset(str(prefix))
    # copies: the arrays are views of the dataset's memory map, which closes with the dataset
    seq = np.array(ds.index.sequence_lengths, dtype=np.int64, copy=True)
    docs = np.array(ds.index.document_indices, dtype=np.int64, copy=True)
    del ds
    return seq, docs


def read_idx_lengths(prefix: str | Path, backend: str = "auto", skip_empty: bool = False) -> np.ndarray:
    """Document lengths (int64, dataset order) of the indexed dataset ``PREFIX``.

    ``backend``: ``"megatron"`` (``IndexedDataset``; needs megatron-core and ``PREFIX.bin``),
    ``"parse"`` (this module's reader, ``.idx`` only) or ``"auto"`` (megatron when it can, else parse).
    """
    if backend not in ("auto", "megatron", "parse"):
        raise ValueError(f"backend={backend!r}; choose auto, megatron or parse")
    p = _prefix(prefix)
    arrays = None
    if backend in ("auto", "megatron"):
        arrays = _megatron_arrays(p)
        if arrays is None and backend == "megatron":
            raise FileNotFoundError(f"megatron backend needs megatron-core and {p}.bin")
    seq, docs = arrays if arrays is not None else parse_idx(p)
    if docs.size < 1 or docs[0] != 0 or docs[-1] != seq.size or np.any(np.diff(docs) < 0):
        raise ValueError(f"{p}.idx: document_indices do not partition its {seq.size} sequences")
    csum = np.concatenate([[0], np.cumsum(seq)])
    lengths = csum[docs[1:]] - csum[docs[:-1]]
    empty = np.flatnonzero(lengths < 1)
    if empty.size and not skip_empty:
        raise ValueError(f"{p}.idx: document {empty[0]} (and {empty.size - 1} more) has no tokens; "
                         "pass skip_empty=True to leave empty documents out")
    return lengths[lengths >= 1] if empty.size else lengths
