"""The tokenized SFT cache on disk: built once, memory-mapped by every rank (issue 50, scale).

One cache holds the documents of one jsonl (``data.sft``: Megatron's ``SFTDataset`` samples' conversations,
or every conversation whole), tokenized by one tokenizer for one ``seq_len``, as two Megatron indexed
datasets (megatron-core's ``.bin``/``.idx`` layout, int32, one sequence a document: ``indexed.write_index_chunks``
writes the ``.idx``), a line index and a manifest:

- ``PREFIX.tokens.bin/.idx``: each document's input token ids (its length is its sequence length in the
  ``.idx``: a rank reads the lengths from the mapped ``.idx``, never the tokens);
- ``PREFIX.labels.bin/.idx``: its labels (the next token's target: ``IGNORE_INDEX`` outside the trained
  turns, the pad id where nothing follows), the same layout;
- ``PREFIX.lines.bin``: int64, the first document of every jsonl line and the document count last
  (Megatron splits train/valid/test by lines);
- ``PREFIX.json``: what the cache was built from (the jsonl's sha256, the tokenizer's identity,
  ``seq_len``, the sample mode) and its counts, and ``digest``: the sha256 of every other file's size and
  sampled pages (``fingerprint.sampled_sha256``) and of the manifest's other fields. Written last, so a
  cache without it is one being built.

``PREFIX`` is ``DIR/wlb-sft-<jsonl stem>-<key>`` where the key hashes the jsonl's CONTENT (its sha256,
streamed at every start: an edit keeping size and mtime is another key), the tokenizer's identity, ``seq_len``
and the sample mode. Opening recomputes the digest (a fixed cost at any size) and refuses a cache whose files
or manifest changed since, in one line naming the file. Ranks starting together take turns on
``PREFIX.lock`` (``flock``): the first builds, the others wait and then map its files.

Pure: numpy and the standard library.
"""

from __future__ import annotations

import hashlib
import json
import os
import tempfile
from collections.abc import Callable, Iterable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np

from megatron_wlb.data.fingerprint import file_sha256, sampled_sha256
from megatron_wlb.data.indexed import check_bin_matches_idx, read_index, write_index_chunks

#: bump when the files' layout or meaning changes (an old cache is then another key, never misread)
CACHE_FORMAT = 2
#: the dtype of tokens and labels on disk (megatron-core's code 4: int32)
CACHE_DTYPE = np.int32
#: documents gathered before their tokens are written (the builder's memory: one batch)
WRITE_BATCH_TOKENS = 1 << 20
#: lengths read back at a time while the ``.idx`` is written
_LENGTH_CHUNK = 1 << 22
#: the cache's files beside its manifest, in the order the digest reads them
CACHE_FILES = ("tokens.bin", "tokens.idx", "labels.bin", "labels.idx", "lines.bin")


class SftCacheError(ValueError):
    """A cache that cannot be used or built (one line, naming the file and what to do)."""


def cache_prefix(directory: str, jsonl: str, key_fields: list[Any]) -> str:
    """``DIR/wlb-sft-<stem>-<key>``: the key hashes ``key_fields`` (the jsonl's sha256, the tokenizer's
    identity, ``seq_len``, the sample mode) and the cache format."""
    key = hashlib.sha256(json.dumps([CACHE_FORMAT, *key_fields]).encode()).hexdigest()[:16]
    stem = Path(jsonl).stem.replace(" ", "_")[:40] or "data"
    return os.path.join(directory, f"wlb-sft-{stem}-{key}")


def default_cache_dir(jsonl: str) -> str:
    """Where a jsonl's cache goes without ``--data-cache-path``: ``cache/`` beside it (as Megatron puts a
    dataset's index cache beside the dataset)."""
    return os.path.join(os.path.dirname(os.path.abspath(jsonl)), "cache")


@dataclass(frozen=True)
class CachedArrays:
    """A cache's files mapped: lengths and pointers are views of the ``.idx`` (nothing is copied per
    document), tokens, labels and line starts views of the ``.bin`` files."""

    prefix: str
    manifest: dict[str, Any]
    lengths: np.ndarray   # int32 [N], view of PREFIX.tokens.idx
    starts: np.ndarray    # int64 [N], byte offsets into both .bin files (view)
    tokens: np.ndarray    # int32, PREFIX.tokens.bin mapped
    labels: np.ndarray    # int32, PREFIX.labels.bin mapped
    lines: np.ndarray     # int64 [lines + 1], PREFIX.lines.bin mapped: each line's first document


def read_manifest(prefix: str) -> dict[str, Any] | None:
    """A cache's manifest (None: there is none, the cache is missing or being built)."""
    try:
        with open(prefix + ".json") as f:
            data = json.load(f)
    except (FileNotFoundError, NotADirectoryError):
        return None
    except (OSError, ValueError) as exc:
        why = exc.strerror if isinstance(exc, OSError) else str(exc).splitlines()[0]
        raise SftCacheError(f"SFT cache {prefix}.json: unreadable ({why}); remove {prefix}.* to rebuild it") from None
    return data if isinstance(data, dict) else None


def cache_digest(prefix: str, manifest: dict[str, Any]) -> str:
    """sha256 of the cache files' sizes and sampled pages (``CACHE_FILES``) and of the manifest's fields but
    ``digest``: what the builder writes last and every open checks (a fixed cost at any size)."""
    h = hashlib.sha256(json.dumps({k: v for k, v in manifest.items() if k != "digest"}, sort_keys=True).encode())
    for part in CACHE_FILES:
        h.update(sampled_sha256(f"{prefix}.{part}").encode())
    return h.hexdigest()


def map_cache(prefix: str) -> CachedArrays:
    """Map a built cache, checked: its digest (files and manifest unchanged since the build), each ``.bin``
    the size its ``.idx`` describes, the counts those of the manifest. Anything else is one ``SftCacheError``
    line naming the file."""
    manifest = read_manifest(prefix)
    if manifest is None:
        raise SftCacheError(f"SFT cache {prefix}.json: missing; build the cache first")
    fix = f"remove {prefix}.* to rebuild it"
    try:
        for part in ("tokens", "labels"):
            check_bin_matches_idx(f"{prefix}.{part}")
        index = read_index(f"{prefix}.tokens")
        other = read_index(f"{prefix}.labels")
        digest = cache_digest(prefix, manifest)
    except (ValueError, OSError) as exc:
        raise SftCacheError(f"SFT cache damaged: {str(exc).splitlines()[0]}; {fix}") from None
    if digest != manifest.get("digest"):
        raise SftCacheError(f"SFT cache {prefix}: its files or manifest changed since it was built (the digest "
                            f"differs); {fix}")
    n = int(index.sequence_lengths.size)
    if n != manifest.get("documents") or int(other.sequence_lengths.size) != n:
        raise SftCacheError(f"SFT cache {prefix}: the .idx files list {n} and {int(other.sequence_lengths.size)} "
                            f"documents, the manifest {manifest.get('documents')}; {fix}")
    if index.dtype != np.dtype(CACHE_DTYPE) or other.dtype != np.dtype(CACHE_DTYPE):
        raise SftCacheError(f"SFT cache {prefix}: token dtype {index.dtype}/{other.dtype}, expected int32; {fix}")
    tokens = np.memmap(f"{prefix}.tokens.bin", dtype=CACHE_DTYPE, mode="r")
    labels = np.memmap(f"{prefix}.labels.bin", dtype=CACHE_DTYPE, mode="r")
    lines = np.memmap(f"{prefix}.lines.bin", dtype=np.int64, mode="r")
    if tokens.size != labels.size:
        raise SftCacheError(f"SFT cache {prefix}: {tokens.size} tokens but {labels.size} labels; {fix}")
    if lines.size != int(manifest.get("lines", -1)) + 1 or int(lines[-1]) != n or int(lines[0]) != 0:
        raise SftCacheError(f"SFT cache {prefix}.lines.bin: does not index {manifest.get('lines')} lines of {n} "
                            f"documents; {fix}")
    return CachedArrays(prefix, manifest, index.sequence_lengths, index.sequence_pointers, tokens, labels, lines)


def _lengths_chunks(path: str, count: int) -> Callable[[], Iterator[np.ndarray]]:
    def chunks() -> Iterator[np.ndarray]:
        for at in range(0, count, _LENGTH_CHUNK):
            yield np.fromfile(path, dtype=np.int32, count=min(_LENGTH_CHUNK, count - at), offset=4 * at)
    return chunks


def write_cache(prefix: str, batches: Iterable[tuple[np.ndarray, np.ndarray, np.ndarray, np.ndarray]],
                manifest: Callable[[int, int, int], dict[str, Any]]) -> None:
    """Write a cache at ``prefix`` from batches of (lengths, tokens, labels, documents per line) (each batch's
    tokens and labels concatenated, ``lengths`` summing to their size, whole lines), then its manifest
    (``manifest(documents, tokens, lines)`` gives its fields; the digest is added). Everything is written under
    temporary names and renamed, the manifest last: a reader sees a whole cache or none. Memory: one batch."""
    directory = os.path.dirname(prefix) or "."
    tmp = tempfile.mkdtemp(dir=directory, prefix=os.path.basename(prefix) + ".", suffix=".tmp")
    try:
        lengths_path = os.path.join(tmp, "lengths")
        documents = total = lines = 0
        with open(lengths_path, "wb") as fl, open(os.path.join(tmp, "t.tokens.bin"), "wb") as ft, \
                open(os.path.join(tmp, "t.labels.bin"), "wb") as fg, \
                open(os.path.join(tmp, "t.lines.bin"), "wb") as fn:
            np.zeros(1, dtype=np.int64).tofile(fn)
            for lengths, tokens, labels, per_line in batches:
                lengths = np.asarray(lengths, dtype=np.int32)
                per_line = np.asarray(per_line, dtype=np.int64)
                if int(lengths.sum(dtype=np.int64)) != np.size(tokens) or np.size(tokens) != np.size(labels) or \
                        int(per_line.sum()) != lengths.size:
                    raise ValueError(f"a batch of {lengths.size} lengths summing to {int(lengths.sum())} with "
                                     f"{np.size(tokens)} tokens, {np.size(labels)} labels, {int(per_line.sum())} "
                                     "documents in its lines")
                lengths.tofile(fl)
                np.asarray(tokens, dtype=CACHE_DTYPE).tofile(ft)
                np.asarray(labels, dtype=CACHE_DTYPE).tofile(fg)
                (documents + np.cumsum(per_line)).astype(np.int64).tofile(fn)
                documents += int(lengths.size)
                lines += int(per_line.size)
                total += int(np.size(tokens))
        for part in ("tokens", "labels"):
            write_index_chunks(os.path.join(tmp, f"t.{part}"), _lengths_chunks(lengths_path, documents),
                               dtype=CACHE_DTYPE)
        fields = manifest(documents, total, lines)
        fields["digest"] = cache_digest(os.path.join(tmp, "t"), fields)
        with open(os.path.join(tmp, "t.json"), "w") as f:
            json.dump(fields, f, indent=1)
        for part in (*CACHE_FILES, "json"):
            os.replace(os.path.join(tmp, f"t.{part}"), f"{prefix}.{part}")
    finally:
        for name in os.listdir(tmp):
            os.unlink(os.path.join(tmp, name))
        os.rmdir(tmp)


def locked_build(prefix: str, usable: Callable[[], str | None], build: Callable[[str | None], None]) -> None:
    """Make the cache at ``prefix`` usable: ``usable()`` says why it is not (None: it is); if it is not, take
    ``PREFIX.lock`` (ranks starting together wait here while the first builds), ask again, and ``build(why)``
    if still needed. Temporary directories a killed build left are removed under the lock."""
    import fcntl

    if usable() is None:
        return
    directory = os.path.dirname(prefix) or "."
    try:
        os.makedirs(directory, exist_ok=True)
        fd = os.open(prefix + ".lock", os.O_RDWR | os.O_CREAT, 0o664)
    except OSError as exc:
        raise SftCacheError(f"--data-cache-path {directory}: cannot write the SFT cache there ({exc.strerror}); give "
                            "a writable --data-cache-path") from None
    with os.fdopen(fd, "r+b") as lock:
        fcntl.flock(lock.fileno(), fcntl.LOCK_EX)
        why = usable()
        if why is None:
            return
        base = os.path.basename(prefix) + "."
        for entry in os.listdir(directory):
            if entry.startswith(base) and entry.endswith(".tmp"):
                stale = os.path.join(directory, entry)
                for name in os.listdir(stale):
                    os.unlink(os.path.join(stale, name))
                os.rmdir(stale)
        try:
            os.unlink(prefix + ".json")  # newcomers see "being built" (and wait on the lock), not the old one
        except FileNotFoundError:
            pass
        try:
            build(why)
        except OSError as exc:
            raise SftCacheError(f"--data-cache-path {directory}: cannot write the SFT cache there "
                                f"({exc.strerror}: {exc.filename}); give a writable --data-cache-path with room for "
                                "8 bytes a token") from None


__all__ = ["CACHE_FILES", "CACHE_FORMAT", "CachedArrays", "SftCacheError", "cache_digest", "cache_prefix",
           "default_cache_dir", "file_sha256", "locked_build", "map_cache", "read_manifest", "write_cache"]
