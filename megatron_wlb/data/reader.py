"""Megatron indexed datasets at document level: blend, split, epoch shuffle and stable stream ids.

Megatron's ``GPTDataset`` concatenates documents and cuts them at ``--seq-length``; WLB-LLM packs
whole documents instead. This module reads the same ``PREFIX.bin/.idx`` files at document level,
with neither torch nor megatron-core (``indexed.read_index`` parses the index):

- ``DocumentReader``: one or more prefixes (a blend, weighted like ``--data-path 0.7 A 0.3 B``), a
  train/valid/test split by document ranges (``--split 969,30,1``), and an epoch-shuffled order from
  a seed. ``stream(tokens)`` returns the first documents of that order (ids and lengths) covering
  ``tokens`` tokens; a longer request returns a longer stream with the same prefix, so a resumed
  run with more iterations replays the same documents. The stream is lazy: a packer reads it
  through a ``StreamCursor``, a window generated a chunk at a time, so a rank holds the window
  and views of the ``.idx``, not the stream.
- The epoch order (``order``, recorded in checkpoints by ``describe``): ``ORDER_FEISTEL`` (the
  default) is a keyed pseudo-random permutation evaluated per block of positions
  (``permutation.KeyedPermutation``, key: seed, dataset, epoch): no build step, no file, O(1)
  memory at any corpus size, the same on every rank by construction. ``ORDER_NUMPY_SHUFFLE`` is the
  order of checkpoints saved before it (a numpy shuffle: 4 bytes a document in memory, or, with an
  order cache directory, ``order_cache``, Megatron's ``--data-cache-path``, built once into a file
  there and memory-mapped by the ranks of a node); a resumed run keeps the order its checkpoint
  names. A cache file's space is reserved before it is written (a full disk is a one-line refusal,
  not a SIGBUS), its modes let a team share the directory (``cache_modes``), and every refusal names
  ``--data-cache-path`` and why.
- Stream ids are global and stable: ``epoch * num_documents + global_doc``, where ``global_doc`` is
  the dataset's offset (datasets in ``--data-path`` order) plus the document's index in its .idx.
- ``write_indexed_dataset`` writes such files with megatron-core's own builder (tests, smoke runs).
"""

from __future__ import annotations

import hashlib
import math
import mmap
import os
import struct
import tempfile
from collections.abc import Sequence
from typing import Any

import numpy as np

from megatron_wlb.data.blend import interleave, parse_data_path, start_times
from megatron_wlb.data.indexed import (
    IndexFile,
    check_bin_matches_idx,
    check_documents,
    document_lengths,
    read_index,
    sample_ranges,
)
from megatron_wlb.data.permutation import KeyedPermutation
from megatron_wlb.data.window import MovingWindow

#: Megatron's default ``--split`` (train, valid, test weights)
DEFAULT_SPLIT = "969,30,1"
SPLIT_NAMES: tuple[str, ...] = ("train", "valid", "test")
#: tokens read at a time when scanning a .bin for its smallest and largest token ids
SCAN_CHUNK_TOKENS = 1 << 24
#: tokens of each dataset ``check_vocabulary`` scans at start-up (1 GiB of int32 ids); reads check the rest
VOCAB_SCAN_TOKENS = 1 << 28


class OutOfVocabulary(ValueError):  # noqa: N818 - a refusal of the data, named for what it finds
    """A token id the model's embedding cannot look up, met at start-up or when read (one line: the data, the
    id, the valid ids and the flag that sets the vocabulary)."""


def too_large_token(where: str, top: int, vocab_size: int, flag: str = "--vocab-size") -> OutOfVocabulary:
    """The one-line refusal of token id ``top`` (>= ``vocab_size``) found in ``where``."""
    return OutOfVocabulary(f"{where}: token id {top} is outside the model's vocabulary of {vocab_size} (ids "
                           f"0..{vocab_size - 1}): set {flag} to at least {top + 1} (or the tokenizer the data was "
                           "made with)")


def refuse_empty(source: IndexedSource, documents: np.ndarray, lengths: np.ndarray) -> None:
    """One line naming the lowest of ``documents`` whose length (``lengths``, the same order) is below 1 token."""
    if lengths.size and int(lengths.min()) < 1:
        bad = int(np.min(documents[lengths < 1]))
        raise ValueError(f"{source.prefix}: document {bad} is empty; every document needs at least 1 token")


# -- Megatron's data flags ---------------------------------------------------------------------------
def weighted_prefixes(data_path: Sequence[str] | str) -> list[tuple[str, float]]:
    """``--data-path`` tokens -> [(prefix, weight)]: ``A B`` (equal weights) or ``0.7 A 0.3 B``
    (``blend.parse_data_path``, the one parser, with unweighted prefixes weighing 1)."""
    return [(prefix, 1.0 if weight is None else weight) for prefix, weight in parse_data_path(data_path)]


def parse_split(split: str | Sequence[float]) -> tuple[float, float, float]:
    """``"969,30,1"`` (or ``"98/2/0"``) -> normalised train/valid/test fractions."""
    if isinstance(split, str):
        parts = [p for p in split.replace("/", ",").split(",") if p.strip()]
        try:
            values = [float(p) for p in parts]
        except ValueError:
            raise ValueError(f"--split {split!r}: give comma-separated weights such as 969,30,1") from None
    else:
        values = [float(v) for v in split]
    if not 1 <= len(values) <= 3 or not all(math.isfinite(v) and v >= 0 for v in values) or sum(values) <= 0:
        raise ValueError(f"--split {split!r}: give up to three non-negative weights (train,valid,test) "
                         "with a positive sum")
    values += [0.0] * (3 - len(values))
    total = sum(values)
    return (values[0] / total, values[1] / total, values[2] / total)


def split_ranges(num_documents: int, split: str | Sequence[float]) -> list[tuple[int, int]]:
    """Document ranges [begin, end) of train, valid and test (like Megatron's split indices)."""
    fractions = parse_split(split)
    bounds = [0]
    acc = 0.0
    for f in fractions:
        acc += f
        bounds.append(int(round(acc * num_documents)))
    bounds[-1] = num_documents
    for i in range(1, 4):
        bounds[i] = max(bounds[i], bounds[i - 1])
    return [(bounds[i], bounds[i + 1]) for i in range(3)]


# -- reading documents -------------------------------------------------------------------------------
class IndexedSource:
    """Documents of one indexed dataset: lengths from ``PREFIX.idx`` (``indexed.read_index``, the one
    parser) and tokens straight from ``PREFIX.bin`` (memory-mapped), where a document's sequences lie
    back to back from its first sequence's pointer. For one sequence per document (GPT data) the
    lengths and pointers stay views of the ``.idx`` (no per-document copy in memory), and ``open`` checks
    a fixed sample of the index (``indexed.sample_ranges``): each other document is checked when its length
    is first read (``lengths_of``, ``indexed.check_documents``), so opening reads ~3 MB of the ``.idx`` at
    any size. ``checked_at_open``: the sequences checked at open; ``documents_checked``: those checked since.
    """

    def __init__(self, prefix: str, lengths: np.ndarray, starts: np.ndarray, tokens: np.ndarray,
                 itemsize: int = 1, token_range: tuple[int, int] | None = None, index: IndexFile | None = None,
                 bin_bytes: int = 0, checked_at_open: int = 0):
        self.prefix = prefix
        self.lengths = lengths
        self.starts = starts          # where each document starts in ``tokens``, in units of ``itemsize`` bytes
        self.tokens = tokens
        self.itemsize = int(itemsize)
        self._token_range = token_range  # (smallest, largest) token id when known (else scanned once)
        #: the index whose documents are checked as they are read (None: checked whole at open, or not ours)
        self.index, self.bin_bytes = index, int(bin_bytes)
        self.checked_at_open, self.documents_checked = int(checked_at_open), 0

    @classmethod
    def open(cls, prefix: str, mmap: bool = True, flag: str = "--data-path") -> IndexedSource:
        """Open ``prefix.bin/.idx`` (checked to belong together: a truncated .bin fails here, named);
        ``flag`` is the option that named ``prefix`` (in the messages)."""
        missing = [ext for ext in (".idx", ".bin") if not os.path.isfile(prefix + ext)]
        if ".idx" not in missing:
            read_index(prefix)  # a damaged .idx is named as such, before a missing .bin
        if missing:
            hint = f" (drop the extension: {prefix[:-4]})" if prefix.endswith((".bin", ".idx")) else ""
            only = " (only the .bin is there)" if missing == [".idx"] else ""
            raise ValueError(f"{flag} {prefix}: no {' / '.join(prefix + m for m in missing)}{only}; give the "
                             f"prefix of a Megatron indexed dataset (PREFIX.bin + PREFIX.idx){hint}")
        checked = check_bin_matches_idx(prefix, sampled=True)
        index = read_index(prefix)
        bin_path = prefix + ".bin"
        if not index.document_indices.size or index.document_indices.size == 1:
            raise ValueError(f"{prefix}.idx lists no documents (and {bin_path} is empty); give a dataset with "
                             "documents, or leave this prefix out of --data-path")
        tokens = np.memmap(bin_path, dtype=index.dtype, mode="r") if mmap else np.fromfile(bin_path, index.dtype)
        if checked.one_sequence_per_document:
            return cls(prefix, index.sequence_lengths, index.sequence_pointers, tokens, index.dtype.itemsize,
                       index=index, bin_bytes=checked.bin_bytes, checked_at_open=checked.checked_sequences)
        lengths = document_lengths(index.sequence_lengths, index.document_indices, f"{prefix}.idx")
        starts = index.sequence_pointers[index.document_indices[:-1]]
        return cls(prefix, lengths, starts, tokens, index.dtype.itemsize, checked_at_open=checked.checked_sequences)

    @property
    def num_documents(self) -> int:
        return int(self.lengths.size)

    def lengths_of(self, documents: np.ndarray) -> np.ndarray:
        """Lengths (int64) of ``documents``, each checked first when the index was sampled at open
        (``indexed.check_documents``: a damaged entry is a one-line ValueError naming the file and document)."""
        docs = np.asarray(documents, dtype=np.int64)
        if self.index is not None and docs.size:
            check_documents(self.index, docs, f"{self.prefix}.idx", self.bin_bytes)
            self.documents_checked += int(docs.size)
        return np.asarray(self.lengths[docs], dtype=np.int64)

    def sample_lengths(self, count: int | None = None, seed: int = 0) -> np.ndarray:
        """Lengths (int64, file order) of every document, or of ``count`` of them drawn uniformly without
        replacement (``numpy.random.default_rng(seed)``), kept in file order: only those entries of the
        mapped ``.idx`` are read, so memory grows with ``count``, not with the corpus."""
        n = self.num_documents
        if count is None or count >= n:
            return np.concatenate([self.lengths_of(np.arange(at, min(n, at + STREAM_CHUNK), dtype=np.int64))
                                   for at in range(0, n, STREAM_CHUNK)])
        if count < 1:
            raise ValueError(f"{self.prefix}: a sample needs at least 1 document, got {count}")
        picked = np.sort(np.random.default_rng(seed).choice(n, size=int(count), replace=False))
        return self.lengths_of(picked)

    def tokens_in(self, begin: int = 0, end: int | None = None) -> int:
        """Tokens of documents ``[begin, end)`` (all by default): of a sampled index, the bytes between the first
        one's start and the last one's end (both checked: O(1)); else summed a chunk at a time (no copy)."""
        stop = self.num_documents if end is None else min(int(end), self.num_documents)
        if self.index is not None and stop > begin:
            last = int(self.lengths_of(np.asarray([begin, stop - 1]))[1])
            return (int(self.starts[stop - 1]) + last * self.itemsize - int(self.starts[begin])) // self.itemsize
        return sum(int(np.sum(self.lengths[at:min(stop, at + STREAM_CHUNK)], dtype=np.int64))
                   for at in range(int(begin), stop, STREAM_CHUNK))

    def token_id_range(self, limit: int | None = None) -> tuple[int, int]:
        """(smallest, largest) token id in ``PREFIX.bin`` ((0, -1) if empty), or in its first ``limit``
        tokens: one chunked pass over the file, so memory stays constant whatever its size; the whole
        file's is remembered for this source."""
        if limit is not None and limit < self.tokens.size:
            return self._scan(int(limit))
        if self._token_range is None:
            self._token_range = self._scan(int(self.tokens.size))
        return self._token_range

    def max_token_id(self, limit: int | None = None) -> int:
        """The largest token id (-1 if empty), of the whole file or its first ``limit`` tokens."""
        return self.token_id_range(limit)[1]

    def min_token_id(self, limit: int | None = None) -> int:
        """The smallest token id (0 if empty): negative in a signed ``.bin`` (an int8 corpus's bytes >= 128)."""
        return self.token_id_range(limit)[0]

    def _scan(self, count: int) -> tuple[int, int]:
        if count <= 0:
            return 0, -1
        low, top = None, -1
        for at in range(0, count, SCAN_CHUNK_TOKENS):
            chunk = self.tokens[at:min(count, at + SCAN_CHUNK_TOKENS)]
            low = int(np.min(chunk)) if low is None else min(low, int(np.min(chunk)))
            top = max(top, int(np.max(chunk)))
        return (0 if low is None else low), top

    def read(self, doc: int, offset: int, length: int) -> np.ndarray:
        """Tokens ``[offset, offset + length)`` of document ``doc`` (its sequences are contiguous)."""
        if not (0 <= offset and offset + length <= self.lengths[doc]):
            raise ValueError(f"{self.prefix}: tokens [{offset}, {offset + length}) are outside document "
                             f"{doc} of {self.lengths[doc]} tokens")
        start = int(self.starts[doc]) // self.itemsize + int(offset)
        return np.asarray(self.tokens[start:start + int(length)], dtype=np.int64)


#: documents a stream generates per dataset at a time (its window grows by about this much)
STREAM_CHUNK = 1 << 18
#: the documents of a stream's first chunk per dataset (then doubling up to ``STREAM_CHUNK``): a shuffled
#: order spreads a chunk over the whole .idx, whose pages a cold start reads one at a time
FIRST_STREAM_CHUNK = 1 << 12


# -- epoch orders ------------------------------------------------------------------------------------------
#: the epoch order of a new run: a keyed Feistel permutation evaluated per position (no build, no file)
ORDER_FEISTEL = "feistel-v1"
#: the epoch order of checkpoints saved before ``ORDER_FEISTEL`` (their data state names no order): a numpy
#: shuffle, in memory or built once into a file shared by the ranks of a node (``cached_order``)
ORDER_NUMPY_SHUFFLE = "numpy-shuffle"
ORDERS = (ORDER_FEISTEL, ORDER_NUMPY_SHUFFLE)

#: an epoch order of fewer documents than this stays in memory even with an order cache (4 MB as int32)
ORDER_CACHE_MIN_DOCUMENTS = 1_000_000
ORDER_MAGIC = b"WLBORDR1"
#: magic, seed, dataset index, epoch, documents, bytes a document, sha256 of the order
_ORDER_FIELDS = struct.Struct("<8sqqqqq32s")
#: the header: the fields, the first 16 bytes of their sha256, zero padding (the order starts aligned)
ORDER_HEADER_BYTES = 128
#: documents written or hashed at a time while building or checking an order file
_ORDER_IO_CHUNK = 1 << 24


def order_dtype(documents: int) -> np.dtype:
    """int32 while it fits (4 bytes a document), else int64."""
    return np.dtype(np.int32 if documents < 2**31 else np.int64)


def shuffled_order(seed: int, dataset: int, epoch: int, documents: int) -> np.ndarray:
    """``0..documents-1`` shuffled by ``numpy.random.default_rng([seed, dataset, epoch])``, in memory."""
    docs = np.arange(documents, dtype=order_dtype(documents))
    np.random.default_rng([seed, dataset, epoch]).shuffle(docs)
    return docs


def order_cache_file(directory: str, seed: int, dataset: int, epoch: int, documents: int) -> str:
    """The file of one epoch order: it depends only on these four numbers (not on the tokens)."""
    return os.path.join(directory, f"wlb-order-seed{seed}-dataset{dataset}-epoch{epoch}-docs{documents}.bin")


def _order_header(seed: int, dataset: int, epoch: int, documents: int, body_sha256: bytes) -> bytes:
    fields = _ORDER_FIELDS.pack(ORDER_MAGIC, seed, dataset, epoch, documents, order_dtype(documents).itemsize,
                                body_sha256)
    return (fields + hashlib.sha256(fields).digest()[:16]).ljust(ORDER_HEADER_BYTES, b"\0")


def _body_sha256(f: Any, documents: int, itemsize: int) -> bytes:
    """sha256 of an order file's body, read (not mapped) a chunk at a time."""
    h = hashlib.sha256()
    f.seek(ORDER_HEADER_BYTES)
    left = documents * itemsize
    while left:
        block = f.read(min(left, _ORDER_IO_CHUNK * itemsize))
        if not block:
            break
        h.update(block)
        left -= len(block)
    return h.digest()


def check_order_file(path: str, seed: int, dataset: int, epoch: int, documents: int) -> str | None:
    """Why the order file at ``path`` cannot be used (None: it can): missing, wrong size, a header
    that is not ours, for another seed/dataset/epoch/size, damaged, or an order whose checksum fails."""
    return _map_order_file(path, seed, dataset, epoch, documents)[1]


def _map_order_file(path: str, seed: int, dataset: int, epoch: int, documents: int
                    ) -> tuple[np.ndarray | None, str | None]:
    """(the order memory-mapped, None) from the file checked, or (None, why it cannot be used)."""
    itemsize = order_dtype(documents).itemsize
    try:
        with open(path, "rb") as f:  # checked and mapped through one descriptor: the same file
            size = os.fstat(f.fileno()).st_size
            if size != ORDER_HEADER_BYTES + documents * itemsize:
                return None, f"it has {size} bytes, expected {ORDER_HEADER_BYTES + documents * itemsize}"
            head = f.read(ORDER_HEADER_BYTES)
            fields = head[:_ORDER_FIELDS.size]
            if hashlib.sha256(fields).digest()[:16] != head[_ORDER_FIELDS.size:_ORDER_FIELDS.size + 16]:
                return None, "the header checksum fails"
            magic, *key, body = _ORDER_FIELDS.unpack(fields)
            if magic != ORDER_MAGIC or key != [seed, dataset, epoch, documents, itemsize]:
                return None, (f"its header is for seed, dataset, epoch, documents, bytes = {key[:5]}, expected "
                              f"{[seed, dataset, epoch, documents, itemsize]}")
            if _body_sha256(f, documents, itemsize) != body:
                return None, "the order's checksum fails"
            return np.memmap(f, dtype=order_dtype(documents), mode="r", offset=ORDER_HEADER_BYTES,
                             shape=(documents,)), None
    except FileNotFoundError:
        return None, "missing"
    except OSError as exc:
        return None, f"it cannot be read ({exc.strerror})"


def _umask() -> int:
    """This process's umask (``/proc/self/status``; else set and restored, as nothing else reads it)."""
    try:
        with open("/proc/self/status") as f:
            for line in f:
                if line.startswith("Umask:"):
                    return int(line.split()[1], 8)
    except (OSError, ValueError, IndexError):
        pass
    mask = os.umask(0o022)
    os.umask(mask)
    return mask


def cache_modes() -> tuple[int, int]:
    """(order file mode, lock file mode) under this process's umask. An order file is readable as any
    new file (0644 under umask 022) and never written after its rename; the lock is also writable by
    the group when the group may read it (0664 under 022), so a team sharing ``--data-cache-path`` can
    take it; a private umask (077) keeps both private (0600)."""
    umask = _umask()
    lock = 0o666 & ~umask
    return 0o644 & ~umask, (lock | 0o020 if lock & 0o040 else lock)


def _free_bytes(directory: str) -> int:
    """Bytes an unprivileged user may still write in ``directory``'s file system (-1 if unknown)."""
    try:
        st = os.statvfs(directory)
    except OSError:
        return -1
    return int(st.f_bavail) * int(st.f_frsize)


def _memory_available() -> int:
    """Bytes of memory the kernel reports available (``MemAvailable``; 0 where unknown)."""
    try:
        with open("/proc/meminfo") as f:
            for line in f:
                if line.startswith("MemAvailable:"):
                    return int(line.split()[1]) * 1024
    except (OSError, ValueError, IndexError):
        pass
    return 0


#: an order of at most this share of the available memory is shuffled in memory and written a chunk at a
#: time (as fast as ``shuffled_order``: the random swaps of a shuffle inside the file's map are several
#: times slower at 1e9 documents: 426 s against 73 s in issue 37); a larger one is shuffled in the map (page cache, not
#: private memory). The building rank holds the order privately only while it builds (4 GB at 1e9
#: documents, freed before the file is mapped); 0 always shuffles in the map
ORDER_IN_MEMORY_SHARE = 0.5


def _reserve(fd: int, size: int, path: str) -> None:
    """Reserve ``size`` bytes for the order file being built at ``path`` before anything is written, so
    a full disk is a message here, not a SIGBUS in every rank's map later: one line naming
    ``--data-cache-path``, the bytes needed and free."""
    import errno

    directory = os.path.dirname(path) or "."
    fallocate = getattr(os, "posix_fallocate", None)
    try:
        if fallocate is None:
            raise OSError(errno.EOPNOTSUPP, os.strerror(errno.EOPNOTSUPP))
        fallocate(fd, 0, size)
        return
    except OSError as exc:
        failure = exc
    try:
        os.ftruncate(fd, 0)  # give back what a partial reservation took, so ``free`` is what it is
    except OSError:
        pass
    free = _free_bytes(directory)
    if failure.errno in (errno.EOPNOTSUPP, errno.ENOSYS, errno.EINVAL) and (free < 0 or free >= size):
        os.ftruncate(fd, size)  # this file system cannot reserve: the free space was the check
        return
    have = f"{free} are free there" if free >= 0 else "the free space there is unknown"
    raise ValueError(f"--data-cache-path {directory}: the epoch order {os.path.basename(path)} needs {size} bytes "
                     f"and {have} ({failure.strerror}); free space, give another --data-cache-path, or none to keep "
                     "the orders in memory")


def _write_in_chunks(f: Any, order: np.ndarray, digest: Any) -> None:
    """Write ``order`` after the header a chunk at a time, hashing each chunk into ``digest``."""
    f.seek(ORDER_HEADER_BYTES)
    for at in range(0, order.size, _ORDER_IO_CHUNK):
        block = order[at:at + _ORDER_IO_CHUNK].data  # contiguous: a view, no copy
        digest.update(block)
        f.write(block)


def _write_order_file(path: str, seed: int, dataset: int, epoch: int, documents: int) -> None:
    """Build the order in a temporary file (its space reserved first, ``_reserve``; mode ``cache_modes``),
    hashed as it is written, then rename it to ``path`` atomically: readers see the whole file or none.
    The shuffle runs in memory when the order fits ``ORDER_IN_MEMORY_SHARE`` of the available memory,
    else inside the file's memory map; the result is ``shuffled_order`` either way."""
    dtype = order_dtype(documents)
    size = ORDER_HEADER_BYTES + documents * dtype.itemsize
    fd, tmp = tempfile.mkstemp(dir=os.path.dirname(path) or ".", prefix=os.path.basename(path) + ".", suffix=".tmp")
    try:
        with os.fdopen(fd, "w+b") as f:
            os.fchmod(f.fileno(), cache_modes()[0])
            _reserve(f.fileno(), size, path)
            digest = hashlib.sha256()
            if documents * dtype.itemsize <= ORDER_IN_MEMORY_SHARE * _memory_available():
                _write_in_chunks(f, shuffled_order(seed, dataset, epoch, documents), digest)  # freed on return
            else:
                with mmap.mmap(f.fileno(), 0) as mm:
                    body = np.frombuffer(mm, dtype=dtype, count=documents, offset=ORDER_HEADER_BYTES)
                    for at in range(0, documents, _ORDER_IO_CHUNK):
                        body[at:at + _ORDER_IO_CHUNK] = np.arange(at, min(documents, at + _ORDER_IO_CHUNK),
                                                                  dtype=dtype)
                    np.random.default_rng([seed, dataset, epoch]).shuffle(body)  # as ``shuffled_order``
                    for at in range(0, documents, _ORDER_IO_CHUNK):
                        digest.update(body[at:at + _ORDER_IO_CHUNK].data)
                    del body  # the map cannot close while an array views it
                    mm.flush()
            f.seek(0)
            f.write(_order_header(seed, dataset, epoch, documents, digest.digest()))
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, path)
    except BaseException:
        try:
            os.unlink(tmp)
        except OSError:
            pass
        raise


def _remove_stale_temps(path: str) -> list[str]:
    """Remove the temporary files builds of ``path`` that were killed left behind (each as large as the
    order); call it holding the order's lock, when no build of it can be running. Returns their names."""
    directory, name = os.path.split(path)
    removed: list[str] = []
    try:
        entries = os.listdir(directory or ".")
    except OSError:
        return removed
    for entry in entries:
        if entry.startswith(name + ".") and entry.endswith(".tmp"):
            try:
                os.unlink(os.path.join(directory, entry))
                removed.append(entry)
            except OSError:
                pass
    return removed


def _open_lock(path: str) -> tuple[int, bool]:
    """(a descriptor of the lock file ``path``, whether it is read-only). A missing lock is created with
    ``cache_modes``'s lock mode; an existing one is opened whoever created it, read-only when this user
    may not write it (``flock`` needs no write access)."""
    mode = cache_modes()[1]
    try:
        fd = os.open(path, os.O_RDWR | os.O_CREAT | os.O_EXCL, mode)
    except FileExistsError:
        pass
    else:
        try:
            os.fchmod(fd, mode)  # creation applied the umask; the group's write bit is the point
        except OSError:
            pass
        return fd, False
    try:
        return os.open(path, os.O_RDWR), False
    except PermissionError:
        return os.open(path, os.O_RDONLY), True


def _cannot(exc: OSError) -> str:
    """An OSError as a short reason: what failed and on which file."""
    what = exc.strerror or str(exc)
    return f"{what}: {exc.filename}" if exc.filename else what


def cached_order(directory: str, seed: int, dataset: int, epoch: int, documents: int) -> np.ndarray:
    """The epoch order of ``shuffled_order``, memory-mapped from ``directory`` (built there first if
    missing or unusable). Ranks starting together take turns on a lock file, so one of them builds and
    the others map its file; a file that fails its check is rebuilt (a warning names it and why), and
    temporary files a killed build left are removed first. Any user who may write the directory can
    take the lock and rebuild (``cache_modes``: files team-readable, the lock group-writable). Every
    refusal is one ``ValueError`` line naming ``--data-cache-path``, why, and why the file was unusable."""
    import fcntl
    import warnings

    path = order_cache_file(directory, seed, dataset, epoch, documents)
    order, problem = _map_order_file(path, seed, dataset, epoch, documents)
    if order is not None:
        return order
    flag = f"--data-cache-path {directory}"
    if os.path.isdir(path):
        raise ValueError(f"{flag}: {path} is a directory, where the epoch order file belongs; remove it, or give "
                         "another --data-cache-path")
    found = f"{os.path.basename(path)}: {problem}"
    advice = "give a writable directory, or none to keep the orders in memory"
    try:
        os.makedirs(directory, exist_ok=True)
        fd, read_only = _open_lock(path + ".lock")
    except OSError as exc:
        raise ValueError(f"{flag}: cannot write the epoch order cache there ({_cannot(exc)}; {found}); "
                         f"{advice}") from None
    with os.fdopen(fd, "rb" if read_only else "r+b") as lock:
        if read_only:
            warnings.warn(f"epoch order cache lock {path}.lock is not writable by this user: locking it read-only "
                          "(make it group-writable, or remove it, to share the cache)", stacklevel=2)
        try:
            fcntl.flock(lock.fileno(), fcntl.LOCK_EX)
        except OSError as exc:
            how = ", opened read-only as this user may not write it" if read_only else ""
            raise ValueError(f"{flag}: cannot lock {path}.lock ({exc.strerror}{how}; {found}); make the lock "
                             f"writable by this user, or {advice}") from None
        order, problem = _map_order_file(path, seed, dataset, epoch, documents)  # built while we waited?
        if order is None:
            found = f"{os.path.basename(path)}: {problem}"
            if problem != "missing":
                warnings.warn(f"epoch order cache {path}: {problem}; rebuilding it", stacklevel=2)
            _remove_stale_temps(path)
            try:
                _write_order_file(path, seed, dataset, epoch, documents)
            except OSError as exc:
                raise ValueError(f"{flag}: cannot write the epoch order cache there ({_cannot(exc)}; {found}); "
                                 f"{advice}") from None
            order, problem = _map_order_file(path, seed, dataset, epoch, documents)
    if order is None:
        raise ValueError(f"epoch order cache {path}: {problem} right after it was written; check the file system "
                         "of --data-cache-path")
    return order


class DocumentStream:
    """The reader's order of documents up to virtual time ``tokens``: stable stream ids and lengths in
    arrival order, generated lazily. ``cursor()`` reads it through a moving window (what a packer
    reads: memory grows with the window, not with the corpus); ``digest(count)`` checks a restored
    run's stream. ``doc_ids``/``lengths``/``len()``/``tokens`` materialise it whole (small streams,
    tests)."""

    def __init__(self, reader: DocumentReader, tokens: int):
        self.reader = reader
        self.requested_tokens = int(tokens)

    def cursor(self) -> StreamCursor:
        return StreamCursor(self.reader, self.requested_tokens)

    def digest(self, count: int) -> str | None:
        """sha256 of the first ``count`` documents (ids and lengths); None if the stream is shorter."""
        return self.cursor().digest(count)

    def collect(self) -> tuple[np.ndarray, np.ndarray]:
        """(stream ids, lengths) of the whole stream, materialised."""
        cursor = self.cursor()
        while cursor.generate():
            pass
        return cursor.ids, cursor.lengths

    @property
    def doc_ids(self) -> np.ndarray:
        return self.collect()[0]

    @property
    def lengths(self) -> np.ndarray:
        return self.collect()[1]

    @property
    def tokens(self) -> int:
        return int(self.lengths.sum())

    def __len__(self) -> int:
        return int(self.collect()[0].size)


class _DatasetCursor:
    """One dataset's documents in stream order: epoch-shuffled, each scheduled at its start time
    (``blend.start_times``), up to virtual time ``tokens``; one epoch's order (4 bytes a document, or
    memory-mapped from the order cache) is held at a time, none in file order (``shuffle`` off)."""

    def __init__(self, reader: DocumentReader, i: int, tokens: int):
        self.reader, self.i, self.tokens = reader, i, tokens
        self.weight = float(reader.weights[i])
        self.begin, self.end = reader.ranges[i]
        self.epoch, self.at = 0, 0
        self.order: np.ndarray | KeyedPermutation | None = None
        self.before = 0  # tokens of this dataset scheduled before the next document
        self.done = False

    def next_chunk(self, size: int) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
        """(start times, stream ids, lengths) of up to ``size`` next documents (within one epoch)."""
        count = self.end - self.begin
        if not self.reader.shuffle:  # file order: computed a chunk at a time, nothing held
            local = np.arange(self.at, min(count, self.at + size), dtype=np.int64)
        else:
            if self.order is None:
                self.order = self.reader._epoch_order(self.i, self.epoch)
            local = self.order[self.at:self.at + size]
        docs = local.astype(np.int64) + self.begin
        source = self.reader.sources[self.i]
        lengths = source.lengths_of(docs)  # checked as first read (a sampled index)
        refuse_empty(source, docs, lengths)
        keys = start_times(lengths, self.weight, self.before)
        keep = int(np.searchsorted(keys, self.tokens, side="left"))  # keys < tokens
        if keep < keys.size:
            self.done = True
        docs, lengths, keys = docs[:keep], lengths[:keep], keys[:keep]
        self.before += int(lengths.sum())
        ids = self.epoch * self.reader.num_documents + int(self.reader.offsets[self.i]) + docs
        self.at += local.size
        if self.at >= count:
            self.epoch, self.at, self.order = self.epoch + 1, 0, None
        return keys, ids, lengths


class StreamCursor(MovingWindow):
    """A ``DocumentStream`` read through a moving window (a ``packing.base.StreamSource``): datasets'
    documents are merged by start time (ties by dataset index, as ``blend.interleave``) a chunk at a
    time; ``window(start, stop)`` forgets what lies before ``start`` (hashed first, for ``digest``)."""

    def __init__(self, reader: DocumentReader, tokens: int, chunk: int = STREAM_CHUNK):
        super().__init__()
        self.chunk = chunk
        self.datasets = [_DatasetCursor(reader, i, tokens) for i in range(len(reader.sources))]
        empty = (np.zeros(0), np.zeros(0, dtype=np.int64), np.zeros(0, dtype=np.int64))
        self.pending = [empty for _ in self.datasets]
        #: per dataset, the documents its next chunk asks for: ``FIRST_STREAM_CHUNK``, doubling up to ``chunk``
        #: (the first plan reads a few thousand documents' entries of the .idx, not ``chunk`` of them)
        self._sizes = [min(chunk, FIRST_STREAM_CHUNK) for _ in self.datasets]
        self._ids_hash, self._lengths_hash = hashlib.sha256(), hashlib.sha256()

    def generate(self) -> bool:
        """Merge the next chunk of documents into the window; False at the end of the stream."""
        for d, cur in enumerate(self.datasets):
            if not self.pending[d][0].size and not cur.done:
                self.pending[d] = cur.next_chunk(self._sizes[d])
                self._sizes[d] = min(self.chunk, 2 * self._sizes[d])
        live = [d for d in range(len(self.datasets)) if self.pending[d][0].size]
        if not live:
            return False
        # everything up to the earliest last pending start time (ties: lower dataset first) is final
        horizon, first = min((float(self.pending[d][0][-1]), d) for d in live)
        parts = []
        for d in live:
            keys, ids, lengths = self.pending[d]
            take = int(np.searchsorted(keys, horizon, side="right" if d <= first else "left"))
            parts.append((keys[:take], ids[:take], lengths[:take]))
            self.pending[d] = (keys[take:], ids[take:], lengths[take:])
        which, position = interleave([k for k, _, _ in parts])
        offsets = np.concatenate([[0], np.cumsum([k.size for k, _, _ in parts])])[which] + position
        self.ids = np.concatenate([self.ids, np.concatenate([i for _, i, _ in parts])[offsets]])
        self.lengths = np.concatenate([self.lengths, np.concatenate([n for _, _, n in parts])[offsets]])
        return True

    def _drop(self, count: int) -> None:
        """Hash the window's first ``count`` documents (for ``digest``), then drop them."""
        self._ids_hash.update(np.ascontiguousarray(self.ids[:count]).tobytes())
        self._lengths_hash.update(np.ascontiguousarray(self.lengths[:count]).tobytes())
        super()._drop(count)

    def digest(self, count: int) -> str | None:
        """sha256 of the first ``count`` documents (ids, then lengths, each hashed in order), or None
        when the stream is shorter; forgets the documents before ``count``."""
        if count < self.start:
            raise ValueError(f"digest of the first {count} documents: this cursor is past them ({self.start})")
        while self.stop < count and self.generate():
            self._forget(min(count, self.stop))
        if self.stop < count:
            return None
        self._forget(count)
        return hashlib.sha256(self._ids_hash.digest() + self._lengths_hash.digest()).hexdigest()


class DocumentReader:
    """Blend + split + epoch-shuffled order over indexed datasets, at document level.

    ``sources``: ``IndexedSource`` objects (or prefixes, opened with megatron-core) with weights.
    Blending is by tokens: document k of dataset i is scheduled at virtual time
    ``tokens_before_k / weight_i`` (weights normalised), and the stream is all documents in that
    order, so each dataset contributes tokens in proportion to its weight. Within a dataset, the
    documents of the chosen split range are visited in a fresh permutation every epoch
    (``order``: ``ORDER_FEISTEL``, a ``KeyedPermutation`` keyed by ``[seed, dataset, epoch]``, or the
    older ``ORDER_NUMPY_SHUFFLE``, ``numpy.random.default_rng([seed, dataset, epoch])``), or in file order
    if ``shuffle`` is off. ``order_cache``: with ``ORDER_NUMPY_SHUFFLE``, a directory where the epoch orders
    of datasets with at least ``ORDER_CACHE_MIN_DOCUMENTS`` documents are built once and memory-mapped
    (``cached_order``); None keeps them in memory. The order is the same either way.
    """

    def __init__(self, sources: Sequence[tuple[IndexedSource | str, float]], split: str = DEFAULT_SPLIT,
                 split_name: str = "train", seed: int = 1234, shuffle: bool = True, mmap: bool = True,
                 order_cache: str | None = None, order: str = ORDER_FEISTEL):
        if not sources:
            raise ValueError("DocumentReader needs at least one (source, weight)")
        if split_name not in SPLIT_NAMES:
            raise ValueError(f"split_name={split_name!r}; choose one of {', '.join(SPLIT_NAMES)}")
        self.sources: list[IndexedSource] = []
        weights = []
        for src, w in sources:
            if not w > 0:
                raise ValueError(f"blend weight {w!r} of {src!r} must be positive")
            self.sources.append(IndexedSource.open(src, mmap) if isinstance(src, str) else src)
            weights.append(float(w))
        if not math.isfinite(sum(weights)):
            raise ValueError(f"blend weights {weights} sum past the largest float; scale them down (only their "
                             "ratios matter)")
        self.weights = np.asarray(weights) / sum(weights)
        self.split = split
        self.split_name = split_name
        self.seed = int(seed)
        self.shuffle = shuffle
        self.order_cache = order_cache
        self.order = ORDER_FEISTEL
        self.use_order(order)
        #: per dataset, the latest mapped epoch order (epoch, order): checked once, shared by its cursors;
        #: an older epoch's map is released when the next one is mapped
        self._mapped_orders: dict[int, tuple[int, np.ndarray]] = {}
        #: set by ``check_vocabulary``: every read then refuses token ids at or beyond it
        self.vocab_size: int | None = None
        self.vocab_flag = "--vocab-size"
        sizes = [s.num_documents for s in self.sources]
        self.offsets = np.concatenate([[0], np.cumsum(sizes)]).astype(np.int64)
        self.num_documents = int(self.offsets[-1])
        which = SPLIT_NAMES.index(split_name)
        self.ranges = [split_ranges(n, split)[which] for n in sizes]
        for src, (b, e) in zip(self.sources, self.ranges):
            if e <= b:
                raise ValueError(f"{src.prefix}: the {split_name} split of --split {split} holds no documents "
                                 f"(of {src.num_documents}); raise its share or add data")
            for lo, hi in sample_ranges(src.num_documents):  # all of a small index; the rest when read
                if max(lo, b) < min(hi, e):
                    docs = np.arange(max(lo, b), min(hi, e), dtype=np.int64)
                    refuse_empty(src, docs, np.asarray(src.lengths[docs], dtype=np.int64))

    @classmethod
    def from_data_path(cls, data_path: Sequence[str] | str, **kwargs: Any) -> DocumentReader:
        return cls(weighted_prefixes(data_path), **kwargs)

    def max_token_id(self) -> int:
        """The largest token id in any of the blended datasets (each scanned once)."""
        return max(src.max_token_id() for src in self.sources)

    def check_vocabulary(self, vocab_size: int, flag: str = "--vocab-size") -> None:
        """Refuse data whose token ids the model's embedding (``vocab_size`` rows) cannot look up (negative,
        or ``vocab_size`` and up), naming the dataset, the id and the valid range; ``flag`` is what sets it.
        At start-up each dataset's first ``VOCAB_SCAN_TOKENS`` tokens are scanned (the whole file when
        smaller: start-up must not read a trillion-token corpus); from then on every ``read`` checks the
        tokens it returns, so a bad id anywhere stops the run when it is read, with the same message."""
        self.vocab_size, self.vocab_flag = int(vocab_size), flag
        for src in self.sources:
            dtype = src.tokens.dtype
            if np.issubdtype(dtype, np.integer) and np.iinfo(dtype).min >= 0 and np.iinfo(dtype).max < vocab_size:
                continue  # the file's dtype cannot hold an id outside the vocabulary: nothing to scan
            self._refuse_outside_vocabulary(src, *src.token_id_range(VOCAB_SCAN_TOKENS))

    def _refuse_outside_vocabulary(self, src: IndexedSource, low: int, top: int) -> None:
        """One line naming the dataset, its first bad id (``low`` if negative, else ``top`` if too large)
        and the valid ids."""
        vocab = self.vocab_size
        if vocab is None:
            return
        valid = f"the model's vocabulary of {vocab} (ids 0..{vocab - 1})"
        if low < 0:
            dtype = np.dtype(src.tokens.dtype)
            raise OutOfVocabulary(f"{src.prefix}: token id {low} is outside {valid}: its .bin holds {dtype.name} ids, "
                                  "and a negative id indexes no embedding row; rebuild the dataset with an unsigned or "
                                  "wider dtype (megatron-core picks uint16 for vocabularies under 65500, else int32)")
        if top >= vocab:
            raise too_large_token(src.prefix, top, vocab, self.vocab_flag)

    def describe(self) -> dict[str, Any]:
        """What determines the stream (saved with checkpoints, compared on resume)."""
        return {"prefixes": [s.prefix for s in self.sources], "weights": [float(w) for w in self.weights],
                "documents": [s.num_documents for s in self.sources], "split": list(parse_split(self.split)),
                "split_name": self.split_name, "seed": self.seed, "shuffle": self.shuffle, "order": self.order}

    def use_order(self, order: str) -> None:
        """Visit each epoch in ``order`` (one of ``ORDERS``): a resumed run takes its checkpoint's."""
        if order not in ORDERS:
            raise ValueError(f"epoch order {order!r} is not one this build knows ({', '.join(ORDERS)}); resume "
                             "with the megatron_wlb release that saved the checkpoint")
        self.order = order

    def _epoch_order(self, i: int, epoch: int) -> np.ndarray | KeyedPermutation:
        """Dataset ``i``'s split range in epoch ``epoch``'s order, relative to the range's start, sliced by
        the cursors: ``ORDER_FEISTEL``, a ``KeyedPermutation`` keyed by ``[seed, i, epoch]`` (evaluated per
        slice, nothing held); ``ORDER_NUMPY_SHUFFLE``, a ``numpy.random.default_rng([seed, i, epoch])``
        shuffle (int32 while it fits: 4 bytes a document), memory-mapped from the order cache when there is
        one and the range is large. Only with ``shuffle`` on: in file order the cursors compute the
        positions and hold no order."""
        b, e = self.ranges[i]
        if self.order == ORDER_FEISTEL:
            return KeyedPermutation(e - b, (self.seed, i, epoch))
        if self.order_cache is not None and e - b >= ORDER_CACHE_MIN_DOCUMENTS:
            held = self._mapped_orders.get(i)
            if held is None or held[0] != epoch:
                held = self._mapped_orders[i] = (epoch, cached_order(self.order_cache, self.seed, i, epoch, e - b))
            return held[1]
        return shuffled_order(self.seed, i, epoch, e - b)

    def epoch_tokens(self) -> int:
        """The virtual time at which the blend's first dataset has been read once (its split range, in
        its epoch's order): ``stream(epoch_tokens())`` is one pass over the corpus, no document repeated
        (one dataset: every document once; a blend: as ``blend.blend``, the others up to that time)."""
        return max(1, math.floor(min(src.tokens_in(b, e) / float(w)
                                    for src, (b, e), w in zip(self.sources, self.ranges, self.weights, strict=True))))

    def stream(self, tokens: int) -> DocumentStream:
        """The documents scheduled before virtual time ``tokens`` (about that many tokens), lazily."""
        if tokens < 1:
            raise ValueError(f"stream needs a positive token count, got {tokens}")
        return DocumentStream(self, int(tokens))

    def locate(self, stream_id: int) -> tuple[int, int, int]:
        """Stream id -> (epoch, dataset index, document index in that dataset's .idx)."""
        epoch, global_doc = divmod(int(stream_id), self.num_documents)
        i = int(np.searchsorted(self.offsets, global_doc, side="right")) - 1
        return epoch, i, global_doc - int(self.offsets[i])

    def read(self, stream_id: int, offset: int, length: int) -> np.ndarray:
        _, i, doc = self.locate(stream_id)
        tokens = self.sources[i].read(doc, offset, length)
        if self.vocab_size is not None and tokens.size:
            self._refuse_outside_vocabulary(self.sources[i], int(tokens.min()), int(tokens.max()))
        return tokens


# -- writing indexed datasets (tests, smoke runs, quick experiments) -------------------------------------
BYTE_EOD = 256  # byte-level tokens are 0..255; 256 ends a document (vocabulary of 257)


def byte_documents(paths: Sequence[str], separator: str | None = "\n\n\n", eod: int | None = BYTE_EOD,
                   max_bytes: int | None = None) -> list[np.ndarray]:
    """Byte-level token documents from text files: each file cut at ``separator`` (None: whole files),
    each document followed by ``eod``. Empty chunks are skipped; ``max_bytes`` caps the total read."""
    docs: list[np.ndarray] = []
    budget = max_bytes
    for path in paths:
        with open(path, "rb") as f:
            data = f.read()
        chunks = data.split(separator.encode()) if separator else [data]
        for chunk in chunks:
            if not chunk.strip():
                continue
            if budget is not None:
                if budget <= 0:
                    return docs
                chunk = chunk[:budget]
                budget -= len(chunk)
            arr = np.frombuffer(chunk, dtype=np.uint8).astype(np.int64)
            docs.append(np.append(arr, eod) if eod is not None else arr)
    return docs


def write_indexed_dataset(prefix: str, documents: Sequence[np.ndarray | Sequence[int]],
                          dtype: type = np.uint16) -> str:
    """Write ``prefix.bin/.idx`` with megatron-core's ``IndexedDatasetBuilder``, one sequence per document."""
    import torch
    from megatron.core.datasets.indexed_dataset import IndexedDatasetBuilder, get_bin_path, get_idx_path

    builder = IndexedDatasetBuilder(get_bin_path(prefix), dtype=dtype)
    for doc in documents:
        arr = np.asarray(doc, dtype=np.int64)
        if arr.size == 0:
            raise ValueError("write_indexed_dataset: empty document; every document needs at least 1 token")
        builder.add_item(torch.from_numpy(arr))
        builder.end_document()
    builder.finalize(get_idx_path(prefix))
    return prefix
