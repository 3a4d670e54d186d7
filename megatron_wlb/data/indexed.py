"""The one reader of Megatron indexed datasets (``PREFIX.idx`` / ``PREFIX.bin``) in megatron_wlb.

The CLI (``--data-prefix``), the simulator and the Megatron adapter all read document lengths
here: parsing the ``.idx`` takes milliseconds and needs neither torch nor megatron-core (whose
import alone takes seconds). The format is megatron-core's ``_IndexWriter``
(``megatron/core/datasets/indexed_dataset.py``, version 1):

========  ======================  =============================================================
bytes     type                    content
========  ======================  =============================================================
9         ``b"MMIDIDX\\x00\\x00"``    magic
8         uint64 LE               version, must be 1
1         uint8                   dtype code of the token ids in ``.bin`` (``DTYPE_CODES``)
8         uint64 LE               S = number of sequences
8         uint64 LE               D = number of entries of ``document_indices`` (documents + 1)
4 S       int32                   ``sequence_lengths`` (tokens per sequence)
8 S       int64                   ``sequence_pointers`` (byte offsets into ``.bin``)
8 D       int64                   ``document_indices``: document i spans sequences
                                  ``[document_indices[i], document_indices[i + 1])``
========  ======================  =============================================================

A document's length is the sum of its sequences' lengths (for GPT pre-training data each document
is one sequence). Empty documents are reported, not dropped silently: ``read_idx_lengths`` raises
on them unless ``skip_empty`` is set. Every error is one line naming the file.
"""

from __future__ import annotations

import mmap
import struct
from collections.abc import Callable, Iterable
from dataclasses import dataclass
from pathlib import Path

import numpy as np

IDX_MAGIC = b"MMIDIDX\x00\x00"
_HEADER_BYTES = 9 + 8 + 1 + 8 + 8
#: megatron-core's ``DType`` codes -> the token dtype of ``.bin``
DTYPE_CODES: dict[int, type] = {1: np.uint8, 2: np.int8, 3: np.int16, 4: np.int32, 5: np.int64, 6: np.float64,
                                7: np.float32, 8: np.uint16}


def dataset_prefix(path: str | Path) -> Path:
    """``PREFIX`` of ``PREFIX``, ``PREFIX.idx`` or ``PREFIX.bin``."""
    p = Path(path)
    return p.with_suffix("") if p.suffix in (".idx", ".bin") else p


def _with_ext(prefix: Path, ext: str) -> Path:
    return prefix.with_name(prefix.name + ext)


@dataclass(frozen=True)
class IndexFile:
    """The arrays of a ``PREFIX.idx``: what the ``.bin`` holds and where."""

    sequence_lengths: np.ndarray   # int32 [S]: tokens per sequence (a read-only view of the file)
    document_indices: np.ndarray   # int64 [D]: document i spans sequences [D[i], D[i + 1]) (view)
    sequence_pointers: np.ndarray  # int64 [S]: byte offset of each sequence in the .bin (view)
    dtype: np.dtype                # token dtype of the .bin
    path: Path | None = None       # the .idx (``chunk`` reads from it without mapping it)
    mapping: mmap.mmap | None = None  # the map the views read (``prefetch`` asks the kernel for its pages)

    def prefetch(self, sequences: np.ndarray) -> None:
        """Ask the kernel, all at once, for the pages holding ``sequences``' entries (their lengths, their and the
        next sequence's pointers and document indices): the scattered entries an epoch order reads from a cold
        ``.idx`` then arrive as one batch of reads instead of one wait each (a 1e9-document index: ~12k pages
        for a first plan). Nothing is read or held here; without a map, nothing is done."""
        ids = np.asarray(sequences, dtype=np.int64)
        if self.mapping is None or not ids.size:
            return
        n_seq, size = int(self.sequence_lengths.size), len(self.mapping)
        ends = np.minimum(ids + 1, max(n_seq - 1, 0))
        offsets = np.concatenate([
            _HEADER_BYTES + 4 * ids, _HEADER_BYTES + 4 * ids + 3,
            *(_HEADER_BYTES + 4 * n_seq + 8 * k + e for k in (ids, ends) for e in (0, 7)),
            *(_HEADER_BYTES + 12 * n_seq + 8 * k + e for k in (ids, ids + 1) for e in (0, 7))])
        for page in np.unique(offsets[offsets < size] // mmap.PAGESIZE):
            start = int(page) * mmap.PAGESIZE
            self.mapping.madvise(mmap.MADV_WILLNEED, start, min(mmap.PAGESIZE, size - start))

    def chunk(self, name: str, lo: int, hi: int) -> np.ndarray:
        """Entries ``[lo, hi)`` of one of the arrays (int64), read from the file when there is one: a
        scan over a 1e8-document index then costs a chunk of memory, not the mapped file's pages."""
        array = getattr(self, name)
        hi = min(hi, int(array.size))
        if self.path is None or hi <= lo:
            return np.asarray(array[lo:hi], dtype=np.int64)
        n_seq = int(self.sequence_lengths.size)
        base, itemsize = {"sequence_lengths": (_HEADER_BYTES, 4), "sequence_pointers": (_HEADER_BYTES + 4 * n_seq, 8),
                          "document_indices": (_HEADER_BYTES + 12 * n_seq, 8)}[name]
        return np.fromfile(self.path, dtype=array.dtype, count=hi - lo, offset=base + itemsize * lo).astype(np.int64)


@dataclass(frozen=True)
class IndexCheck:
    """What ``check_pointers`` (or the sampled check of ``check_bin_matches_idx``) found: the bytes the
    ``.bin`` must hold, whether every document is one sequence (GPT pre-training data; document i is then
    sequence i), and how many sequences were checked (all of them, or the sample: ``sample_ranges``)."""

    bin_bytes: int
    one_sequence_per_document: bool
    checked_sequences: int = 0


def read_index(prefix: str | Path) -> IndexFile:
    """Parse ``PREFIX.idx`` (one-line errors naming the file)."""
    p = dataset_prefix(prefix)
    idx = _with_ext(p, ".idx")
    if not idx.exists():
        other = " (only the .bin is there)" if _with_ext(p, ".bin").exists() else ""
        raise FileNotFoundError(f"{idx} does not exist{other}; --data-prefix takes PREFIX of a Megatron indexed "
                                "dataset PREFIX.idx/.bin, without the extension")
    if not idx.is_file():
        raise ValueError(f"{idx} is a directory, not a Megatron .idx file")
    size = idx.stat().st_size
    with open(idx, "rb") as f:
        head = f.read(_HEADER_BYTES)
    if not head:
        raise ValueError(f"{idx}: empty file (0 bytes), not a Megatron .idx; rebuild or re-copy PREFIX.bin/.idx")
    if head[:9] != IDX_MAGIC[:len(head)] or (len(head) >= 9 and head[:9] != IDX_MAGIC):
        raise ValueError(f"{idx}: not a Megatron indexed-dataset index (magic {head[:9]!r}, expected {IDX_MAGIC!r})")
    if len(head) < _HEADER_BYTES:
        raise ValueError(f"{idx}: truncated header, {len(head)} bytes of {_HEADER_BYTES} (an interrupted copy?); "
                         "re-copy or rebuild PREFIX.bin/.idx")
    version, = struct.unpack("<Q", head[9:17])
    if version != 1:
        raise ValueError(f"{idx}: index version {version}; this reader knows version 1")
    code = head[17]
    if code not in DTYPE_CODES:
        raise ValueError(f"{idx}: token dtype code {code} is not one of megatron-core's {sorted(DTYPE_CODES)}")
    n_seq, n_doc = struct.unpack("<QQ", head[18:34])
    need = _HEADER_BYTES + 4 * n_seq + 8 * n_seq + 8 * n_doc
    if size < need:
        raise ValueError(f"{idx}: truncated, {size} bytes but the header announces {n_seq} sequences and "
                         f"{n_doc} document indices ({need} bytes)")
    with open(idx, "rb") as f:  # views, no copies: pages are read as they are used
        mm = mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_READ)
    # an epoch order reads entries scattered over the file: no readahead around each (at 1e9 documents a first
    # plan's 4,096 documents otherwise pulled 2 GB of the .idx into the page cache); ``prefetch`` batches them
    mm.madvise(mmap.MADV_RANDOM)
    seq = np.frombuffer(mm, dtype=np.int32, count=n_seq, offset=_HEADER_BYTES)
    pointers = np.frombuffer(mm, dtype=np.int64, count=n_seq, offset=_HEADER_BYTES + 4 * n_seq)
    docs = np.frombuffer(mm, dtype=np.int64, count=n_doc, offset=_HEADER_BYTES + 12 * n_seq)
    return IndexFile(seq, docs, pointers, np.dtype(DTYPE_CODES[code]), idx, mm)


def write_index(prefix: str | Path, sequence_lengths: np.ndarray, dtype: type = np.uint16,
                sequence_pointers: np.ndarray | None = None, document_indices: np.ndarray | None = None) -> Path:
    """Write ``PREFIX.idx`` in megatron-core's layout (no ``.bin``): one sequence per document and the
    pointers its writer computes unless given (tests of corrupted indexes, synthetic benchmarks)."""
    p = dataset_prefix(prefix)
    code = next(c for c, t in DTYPE_CODES.items() if t is dtype)
    seq = np.asarray(sequence_lengths, dtype=np.int32)
    if sequence_pointers is None:
        sequence_pointers = np.zeros(seq.size, dtype=np.int64)
        np.cumsum(seq[:-1], dtype=np.int64, out=sequence_pointers[1:])
        sequence_pointers *= np.dtype(dtype).itemsize
    docs = np.arange(seq.size + 1, dtype=np.int64) if document_indices is None else document_indices
    with open(_with_ext(p, ".idx"), "wb") as f:
        f.write(IDX_MAGIC + struct.pack("<Q", 1) + struct.pack("<B", code) + struct.pack("<QQ", seq.size, len(docs)))
        for array in (seq, np.asarray(sequence_pointers, dtype=np.int64), np.asarray(docs, dtype=np.int64)):
            array.tofile(f)
    return p


def write_index_chunks(prefix: str | Path, chunks: Callable[[], Iterable[np.ndarray]], dtype: type = np.uint16) -> int:
    """Write ``PREFIX.idx`` as ``write_index`` does (one sequence per document, megatron-core's pointers) from
    lengths given a chunk at a time: ``chunks()`` is called twice (the lengths, then the pointers) and must
    give the same chunks both times, so memory holds one chunk whatever the size (synthetic indexes of 1e9
    documents). Returns the number of documents."""
    p = dataset_prefix(prefix)
    code = next(c for c, t in DTYPE_CODES.items() if t is dtype)
    itemsize = np.dtype(dtype).itemsize
    with open(_with_ext(p, ".idx"), "wb") as f:
        f.seek(_HEADER_BYTES)
        count = 0
        for chunk in chunks():
            np.asarray(chunk, dtype=np.int32).tofile(f)
            count += int(np.size(chunk))
        end = 0
        for chunk in chunks():
            ends = end + np.cumsum(np.asarray(chunk, dtype=np.int64)) * itemsize
            (ends - np.asarray(chunk, dtype=np.int64) * itemsize).tofile(f)
            end = int(ends[-1]) if ends.size else end
        for at in range(0, count + 1, CHECK_CHUNK):
            np.arange(at, min(count + 1, at + CHECK_CHUNK), dtype=np.int64).tofile(f)
        f.seek(0)
        f.write(IDX_MAGIC + struct.pack("<Q", 1) + struct.pack("<B", code) + struct.pack("<QQ", count, count + 1))
    return count


def parse_idx(prefix: str | Path) -> tuple[np.ndarray, np.ndarray]:
    """(sequence_lengths int64 [S], document_indices int64 [D]) parsed from ``PREFIX.idx``."""
    index = read_index(prefix)
    return index.sequence_lengths, index.document_indices


def document_lengths(sequence_lengths: np.ndarray, document_indices: np.ndarray, where: str) -> np.ndarray:
    """Tokens per document from an index's arrays; ``where`` names the dataset in the error."""
    seq = np.asarray(sequence_lengths, dtype=np.int64)
    docs = np.asarray(document_indices, dtype=np.int64)
    if docs.size < 1 or docs[0] != 0 or docs[-1] != seq.size or np.any(np.diff(docs) < 0):
        raise ValueError(f"{where}: document_indices do not partition its {seq.size} sequences (not a valid .idx)")
    if np.any(seq < 0):
        raise ValueError(f"{where}: sequence {int(np.flatnonzero(seq < 0)[0])} has a negative length")
    csum = np.concatenate([[0], np.cumsum(seq)])
    return csum[docs[1:]] - csum[docs[:-1]]


def read_idx_lengths(prefix: str | Path, backend: str = "parse", skip_empty: bool = False) -> np.ndarray:
    """Document lengths (int64, dataset order) of the indexed dataset ``PREFIX``.

    ``backend``: ``"parse"`` (this module, ``.idx`` only; the default, and what ``"auto"`` means)
    or ``"megatron"`` (megatron-core's ``IndexedDataset``, needs ``PREFIX.bin``; a cross-check).
    """
    if backend not in ("auto", "megatron", "parse"):
        raise ValueError(f"backend={backend!r}; choose parse (or auto) or megatron")
    p = dataset_prefix(prefix)
    if backend == "megatron":
        seq, docs = _megatron_arrays(p)
    else:
        seq, docs = parse_idx(p)
    lengths = document_lengths(seq, docs, f"{p}.idx")
    empty = np.flatnonzero(lengths < 1)
    if empty.size and not skip_empty:
        raise ValueError(f"{p}.idx: document {empty[0]} (and {empty.size - 1} more) has no tokens; "
                         "pass skip_empty=True to leave empty documents out")
    return lengths[lengths >= 1] if empty.size else lengths


def _megatron_arrays(prefix: Path) -> tuple[np.ndarray, np.ndarray]:
    if not _with_ext(prefix, ".bin").exists():
        raise FileNotFoundError(f"megatron backend needs {prefix}.bin")
    try:
        from megatron.core.datasets.indexed_dataset import IndexedDataset
    except ImportError:
        raise FileNotFoundError("megatron backend needs megatron-core (pip install megatron-core)") from None
    ds = IndexedDataset(str(prefix))
    # copies: the arrays are views of the dataset's memory map, which closes with the dataset
    seq = np.array(ds.index.sequence_lengths, dtype=np.int64, copy=True)
    docs = np.array(ds.index.document_indices, dtype=np.int64, copy=True)
    del ds
    return seq, docs


#: sequences checked per vectorised step of ``check_pointers``: bounds its temporaries (~50 MB at 1M
#: entries; 4M entries peaked at ~220 MB of private memory at 1e8 documents) at ~1 ms per step
CHECK_CHUNK = 1 << 20
#: the sampled check at open (``sample_ranges``): this many blocks of ``SAMPLE_BLOCK`` consecutive sequences,
#: the first and the last block and the others at seeded positions: ~3 MB of the ``.idx`` at any size; an
#: index of at most ``SAMPLE_BLOCKS * SAMPLE_BLOCK`` sequences is checked whole
SAMPLE_BLOCKS, SAMPLE_BLOCK = 64, 4096
SAMPLE_SEED = 20260057


def sample_ranges(count: int) -> list[tuple[int, int]]:
    """The sorted, disjoint ranges of ``[0, count)`` the sampled check reads: all of it when
    ``count <= SAMPLE_BLOCKS * SAMPLE_BLOCK``, else ``SAMPLE_BLOCKS`` blocks of ``SAMPLE_BLOCK`` (the first,
    the last, and the others drawn with ``SAMPLE_SEED``: the same on every rank and every run)."""
    if count <= SAMPLE_BLOCKS * SAMPLE_BLOCK:
        return [(0, count)] if count else []
    slots = count // SAMPLE_BLOCK  # whole blocks before the last (partial) one
    inner = np.random.default_rng(SAMPLE_SEED).choice(np.arange(1, slots), size=SAMPLE_BLOCKS - 2, replace=False)
    starts = sorted({0, *(int(b) * SAMPLE_BLOCK for b in inner), count - SAMPLE_BLOCK})
    ranges: list[tuple[int, int]] = []
    for lo in starts:
        if ranges and lo < ranges[-1][1]:
            ranges[-1] = (ranges[-1][0], lo + SAMPLE_BLOCK)
        else:
            ranges.append((lo, lo + SAMPLE_BLOCK))
    return ranges


def _check_entries(where: str, docs: np.ndarray, seqs: np.ndarray, lengths: np.ndarray, starts: np.ndarray,
                   nexts: np.ndarray, itemsize: int, limit: int | None) -> None:
    """The one check of sequences (``seqs``, ascending, with their ``lengths``, ``starts`` = pointers and
    ``nexts`` = the next sequence's pointer, or where the last one must end): a non-negative length, a start
    on a token boundary inside the ``.bin`` (``limit`` bytes, when known) and the next sequence starting
    where this one ends. Over all sequences from a first pointer 0 this is megatron-core's layout
    (``check_pointers``); over some, each of them is sound on its own (``check_documents``). Raises a
    one-line ValueError naming ``where`` and the first bad document."""
    ends = starts + lengths * itemsize
    bad_length = lengths < 0
    bad_start = (starts < 0) | (starts % itemsize != 0)
    past_end = (ends > limit) if limit is not None else np.zeros(seqs.size, dtype=bool)
    bad = np.flatnonzero(bad_length | bad_start | past_end | (nexts != ends))
    if not bad.size:
        return
    k = int(bad[0])
    i = int(seqs[k])
    fix = "(a corrupted .idx); rebuild PREFIX.bin/.idx"
    if bad_length[k]:
        raise ValueError(f"{where}: document {_document_of(docs, i)} (sequence {i}) has a negative length "
                         f"{int(lengths[k])} {fix}")
    if bad_start[k]:
        raise ValueError(f"{where}: document {_document_of(docs, i)} (sequence {i}) starts at byte {int(starts[k])} "
                         f"of the .bin, which is not where a {itemsize}-byte token starts {fix}")
    if past_end[k]:
        raise ValueError(f"{where}: document {_document_of(docs, i)} (sequence {i}) ends at byte {int(ends[k])} of "
                         f"the .bin, past its {limit} bytes {fix}")
    raise ValueError(f"{where}: document {_document_of(docs, i + 1)} (sequence {i + 1}) starts at byte "
                     f"{int(nexts[k])} of the .bin, but the {itemsize}-byte token lengths before it end at byte "
                     f"{int(ends[k])} (a corrupted .idx: its pointers and lengths disagree); rebuild PREFIX.bin/.idx")


def _check_range(index: IndexFile, lo: int, hi: int, where: str, limit: int | None, mapped: bool) -> None:
    """``_check_entries`` over sequences ``[lo, hi)`` (read from the file, or from the map when ``mapped``);
    the last sequence's end is its own (the ``.bin``'s size is compared by the caller)."""
    n_seq = int(index.sequence_lengths.size)
    if mapped:
        lengths = np.asarray(index.sequence_lengths[lo:hi], dtype=np.int64)
        starts = np.asarray(index.sequence_pointers[lo:min(hi + 1, n_seq)], dtype=np.int64)
    else:
        lengths = index.chunk("sequence_lengths", lo, hi)
        starts = index.chunk("sequence_pointers", lo, hi + 1)
    nexts = starts[1:]
    if hi >= n_seq:  # the last sequence ends where its length says (the .bin's size is the caller's check)
        nexts = np.append(nexts, starts[-1] + lengths[-1] * int(index.dtype.itemsize))
    _check_entries(where, index.document_indices, np.arange(lo, hi, dtype=np.int64), lengths, starts[:hi - lo],
                   nexts, int(index.dtype.itemsize), limit)


def _first_pointer(index: IndexFile, where: str) -> None:
    """The first sequence starts the ``.bin`` (megatron-core's writer; the anchor of the other checks)."""
    first = int(index.sequence_pointers[0])
    if first != 0:
        raise ValueError(f"{where}: document 0 (sequence 0) starts at byte {first} of the .bin, but the "
                         f"{int(index.dtype.itemsize)}-byte token lengths before it end at byte 0 (a corrupted .idx: "
                         "its pointers and lengths disagree); rebuild PREFIX.bin/.idx")


def _not_a_partition(where: str, n_seq: int, detail: str = "") -> ValueError:
    return ValueError(f"{where}: document_indices do not partition its {n_seq} sequences (not a valid .idx){detail}")


def check_pointers(index: IndexFile, where: str) -> IndexCheck:
    """Raise a one-line ValueError naming ``where`` and the first bad document unless every sequence
    starts where the lengths before it end: ``sequence_pointers[i] == itemsize * sum(lengths[:i])``
    (megatron-core's writer; this makes them monotone, consistent with the lengths and dtype, and
    the documents' sequences back to back), and ``document_indices`` partition the sequences.

    Vectorised over chunks of ``CHECK_CHUNK`` entries read from the file (``_check_entries``, the one
    check). Without it, lengths 10,10 corrupted to 7,13 (the same total) would hand out 3 tokens of one
    document as part of the next.
    """
    docs = index.document_indices
    n_seq = int(index.sequence_lengths.size)
    itemsize = int(index.dtype.itemsize)
    if n_seq:
        _first_pointer(index, where)
    for lo in range(0, n_seq, CHECK_CHUNK):
        _check_range(index, lo, min(n_seq, lo + CHECK_CHUNK), where, None, mapped=False)
    end = int(index.sequence_pointers[-1]) + itemsize * int(index.sequence_lengths[-1]) if n_seq else 0
    one_each = int(docs.size) == n_seq + 1
    previous = 0
    for lo in range(0, int(docs.size), CHECK_CHUNK):
        chunk = index.chunk("document_indices", lo, lo + CHECK_CHUNK)
        steps = np.diff(chunk, prepend=previous if lo else chunk[0])
        if (lo == 0 and int(chunk[0]) != 0) or int(steps.min()) < 0 or int(chunk.max()) > n_seq:
            raise _not_a_partition(where, n_seq)
        one_each = one_each and bool(np.all(steps[1 if lo == 0 else 0:] == 1))
        previous = int(chunk[-1])
    if not docs.size or previous != n_seq:
        raise _not_a_partition(where, n_seq)
    return IndexCheck(end, one_each, n_seq)


def check_documents(index: IndexFile, documents: np.ndarray, where: str, bin_bytes: int) -> None:
    """Check documents of a one-sequence-per-document index as they are first read (after the sampled check
    at open, ``check_bin_matches_idx(sampled=True)``): each document is sequence i (``document_indices``
    i and i + 1), and that sequence is sound on its own (``_check_entries``: a non-negative length, a
    start on a token boundary, its end inside the ``bin_bytes`` of the ``.bin`` and where the next sequence
    starts). Any one damaged entry of the ``.idx`` fails the check of a document that reads it, with the
    message the whole check at open gave. Reads only those entries (of the mapped ``.idx``)."""
    ids = np.unique(np.asarray(documents, dtype=np.int64))
    if not ids.size:
        return
    n_seq = int(index.sequence_lengths.size)
    if int(ids[0]) < 0 or int(ids[-1]) >= n_seq:
        raise IndexError(f"{where}: documents {int(ids[0])}..{int(ids[-1])} are outside its {n_seq} documents")
    index.prefetch(ids)
    docs = index.document_indices
    for at, expected in ((docs[ids], ids), (docs[ids + 1], ids + 1)):
        wrong = np.flatnonzero(at != expected)
        if wrong.size:
            k = int(wrong[0])
            raise _not_a_partition(where, n_seq, f": document_indices[{int(expected[k])}] is {int(at[k])}, expected "
                                                 f"{int(expected[k])} (one sequence per document)")
    itemsize = int(index.dtype.itemsize)
    lengths = np.asarray(index.sequence_lengths[ids], dtype=np.int64)
    starts = np.asarray(index.sequence_pointers[ids], dtype=np.int64)
    nexts = np.asarray(index.sequence_pointers[np.minimum(ids + 1, n_seq - 1)], dtype=np.int64)
    nexts[ids == n_seq - 1] = bin_bytes  # the last sequence ends the .bin
    _check_entries(where, docs, ids, lengths, starts, nexts, itemsize, bin_bytes)


def _document_of(document_indices: np.ndarray, sequence: int) -> int:
    """The document holding ``sequence`` (document i spans ``[D[i], D[i + 1])``)."""
    return max(0, int(np.searchsorted(document_indices, sequence, side="right")) - 1)


def check_bin_matches_idx(prefix: str | Path, sampled: bool = False) -> IndexCheck:
    """Raise a one-line ValueError when ``PREFIX.idx`` is inconsistent (``check_pointers``) or
    ``PREFIX.bin`` is not the size it describes.

    The ``.idx`` says where each sequence starts in the ``.bin`` and how many tokens of which dtype
    it holds; a truncated ``.bin`` (an interrupted copy) would make training read past its end, a
    padded or different one means the two files do not belong together.

    ``sampled``: for an index of one sequence per document (its header says so: D = S + 1), check what is
    O(1) (the header, the sizes, the first and last entries, the ``.bin``'s size against the last pointer
    and length) and the sequences of ``sample_ranges`` only, a fixed ~3 MB of the ``.idx`` at any size;
    the reader then checks each document as it first reads it (``check_documents``, the same messages).
    Other indexes are checked whole.
    """
    p = dataset_prefix(prefix)
    index = read_index(p)
    seq, itemsize = index.sequence_lengths, index.dtype.itemsize
    bin_path = _with_ext(p, ".bin")
    if not bin_path.is_file():
        raise FileNotFoundError(f"{bin_path} does not exist (or is not a file); {p}.idx needs its .bin")
    where = f"{p}.idx"
    n_seq, docs = int(seq.size), index.document_indices
    if sampled and n_seq and int(docs.size) == n_seq + 1:
        if int(docs[0]) != 0 or int(docs[-1]) != n_seq:
            raise _not_a_partition(where, n_seq)
        _first_pointer(index, where)
        ranges = sample_ranges(n_seq)
        for lo, hi in ranges:  # the pointers and lengths, each block with the pointer after it
            _check_range(index, lo, hi, where, None, mapped=False)
            chunk = index.chunk("document_indices", lo, hi + 1)
            if not np.array_equal(chunk, np.arange(lo, lo + chunk.size)):
                raise _not_a_partition(where, n_seq, " (one sequence per document, as its header says, expected)")
        checked = IndexCheck(int(index.sequence_pointers[-1]) + itemsize * int(seq[-1]), True,
                             sum(hi - lo for lo, hi in ranges))
    else:
        checked = check_pointers(index, where)
    expected = checked.bin_bytes
    actual = bin_path.stat().st_size
    if actual != expected:
        kind = "truncated" if actual < expected else "larger than its index"
        raise ValueError(f"{bin_path}: {actual} bytes, but {p}.idx describes {expected} bytes ({seq.size} "
                         f"sequences of {itemsize}-byte tokens): the .bin is {kind}; re-copy or rebuild "
                         "PREFIX.bin/.idx together")
    return checked
