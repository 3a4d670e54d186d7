"""The tokenized SFT cache on disk: built once, memory-mapped by every rank (issue 50, scale).

One cache holds every conversation of one jsonl, tokenized by one tokenizer and cut to one ``seq_len``,
as two Megatron indexed datasets (megatron-core's ``.bin``/``.idx`` layout, int32 tokens, one sequence a
conversation: ``indexed.write_index_chunks`` writes the ``.idx``) and a manifest:

- ``PREFIX.tokens.bin/.idx``: each conversation's token ids (its length is its sequence length in the
  ``.idx``: a rank reads the lengths from the mapped ``.idx``, never the tokens);
- ``PREFIX.targets.bin/.idx``: its targets (``IGNORE_INDEX`` outside the trained turns), the same layout;
- ``PREFIX.json``: what the cache was built from (the jsonl's path, size, mtime and sha256, the tokenizer's
  identity, ``seq_len``) and its counts; written last, so a cache without it is one being built.

``PREFIX`` is ``DIR/wlb-sft-<jsonl stem>-<key>`` where the key hashes the jsonl's absolute path, the
tokenizer's identity and ``seq_len``: another tokenizer or window is another cache; a jsonl changed since
(size or mtime, then its sha256) makes the cache stale (rebuilt, said in one line). Ranks starting together
take turns on ``PREFIX.lock`` (``flock``): the first builds, the others wait and then map its files, as the
epoch-order cache of ``--data-cache-path`` does (``reader.cached_order``). A cache whose files disagree
with its manifest (a truncated ``.bin``, a copy cut short) is refused in one line naming the file.

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

from megatron_wlb.data.indexed import check_bin_matches_idx, read_index, write_index_chunks

#: bump when the files' layout or meaning changes (an old cache is then another key, never misread)
CACHE_FORMAT = 1
#: the dtype of tokens and targets on disk (megatron-core's code 4: int32)
CACHE_DTYPE = np.int32
#: conversations gathered before their tokens are written (the builder's memory: one batch)
WRITE_BATCH_TOKENS = 1 << 20
#: lengths read back at a time while the ``.idx`` is written
_LENGTH_CHUNK = 1 << 22


class SftCacheError(ValueError):
    """A cache that cannot be used or built (one line, naming the file and what to do)."""


def cache_prefix(directory: str, jsonl: str, tokenizer_identity: str, seq_len: int) -> str:
    """``DIR/wlb-sft-<stem>-<key>``: the key hashes the jsonl's absolute path, the tokenizer and ``seq_len``."""
    key = hashlib.sha256(json.dumps([CACHE_FORMAT, os.path.abspath(jsonl), tokenizer_identity, int(seq_len)])
                         .encode()).hexdigest()[:16]
    stem = Path(jsonl).stem.replace(" ", "_")[:40] or "data"
    return os.path.join(directory, f"wlb-sft-{stem}-{key}")


def default_cache_dir(jsonl: str) -> str:
    """Where a jsonl's cache goes without ``--data-cache-path``: ``cache/`` beside it (as Megatron puts a
    dataset's index cache beside the dataset)."""
    return os.path.join(os.path.dirname(os.path.abspath(jsonl)), "cache")


def file_sha256(path: str, chunk: int = 1 << 24) -> str:
    """sha256 of a file, read a chunk at a time."""
    h = hashlib.sha256()
    with open(path, "rb") as f:
        while block := f.read(chunk):
            h.update(block)
    return h.hexdigest()


@dataclass(frozen=True)
class CachedArrays:
    """A cache's files mapped: lengths and pointers are views of the ``.idx`` (nothing is copied per
    conversation), tokens and targets views of the ``.bin`` files."""

    prefix: str
    manifest: dict[str, Any]
    lengths: np.ndarray   # int32 [N], view of PREFIX.tokens.idx
    starts: np.ndarray    # int64 [N], byte offsets into both .bin files (view)
    tokens: np.ndarray    # int32, PREFIX.tokens.bin mapped
    targets: np.ndarray   # int32, PREFIX.targets.bin mapped


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


def stale_reason(manifest: dict[str, Any], jsonl: str) -> str | None:
    """Why a cache's manifest no longer describes ``jsonl`` (None: it does). Size and mtime decide when
    they match; otherwise the file's sha256 does (a copy or a touch of the same bytes keeps the cache)."""
    st = os.stat(jsonl)
    if st.st_size == manifest.get("jsonl_bytes") and st.st_mtime_ns == manifest.get("jsonl_mtime_ns"):
        return None
    if st.st_size != manifest.get("jsonl_bytes"):
        return f"{jsonl} has {st.st_size} bytes, the cache was built from {manifest.get('jsonl_bytes')}"
    if file_sha256(jsonl) != manifest.get("jsonl_sha256"):
        return f"{jsonl} changed since the cache was built (its sha256 differs)"
    return None


def map_cache(prefix: str) -> CachedArrays:
    """Map a built cache, checked: each ``.bin`` the size its ``.idx`` describes, the two ``.idx`` alike,
    the counts those of the manifest. Anything else is one ``SftCacheError`` line naming the file."""
    manifest = read_manifest(prefix)
    if manifest is None:
        raise SftCacheError(f"SFT cache {prefix}.json: missing; build the cache first")
    fix = f"remove {prefix}.* to rebuild it"
    try:
        for part in ("tokens", "targets"):
            check_bin_matches_idx(f"{prefix}.{part}")
        index = read_index(f"{prefix}.tokens")
        other = read_index(f"{prefix}.targets")
    except (ValueError, OSError) as exc:
        raise SftCacheError(f"SFT cache damaged: {str(exc).splitlines()[0]}; {fix}") from None
    n = int(index.sequence_lengths.size)
    if n != manifest.get("conversations") or int(other.sequence_lengths.size) != n:
        raise SftCacheError(f"SFT cache {prefix}: the .idx files list {n} and {int(other.sequence_lengths.size)} "
                            f"conversations, the manifest {manifest.get('conversations')}; {fix}")
    if index.dtype != np.dtype(CACHE_DTYPE) or other.dtype != np.dtype(CACHE_DTYPE):
        raise SftCacheError(f"SFT cache {prefix}: token dtype {index.dtype}/{other.dtype}, expected int32; {fix}")
    tokens = np.memmap(f"{prefix}.tokens.bin", dtype=CACHE_DTYPE, mode="r")
    targets = np.memmap(f"{prefix}.targets.bin", dtype=CACHE_DTYPE, mode="r")
    if tokens.size != targets.size:
        raise SftCacheError(f"SFT cache {prefix}: {tokens.size} tokens but {targets.size} targets; {fix}")
    return CachedArrays(prefix, manifest, index.sequence_lengths, index.sequence_pointers, tokens, targets)


def _lengths_chunks(path: str, count: int) -> Callable[[], Iterator[np.ndarray]]:
    def chunks() -> Iterator[np.ndarray]:
        for at in range(0, count, _LENGTH_CHUNK):
            yield np.fromfile(path, dtype=np.int32, count=min(_LENGTH_CHUNK, count - at), offset=4 * at)
    return chunks


def write_cache(prefix: str, batches: Iterable[tuple[np.ndarray, np.ndarray, np.ndarray]],
                manifest: Callable[[int, int], dict[str, Any]]) -> None:
    """Write a cache at ``prefix`` from batches of (lengths, tokens, targets) (each batch's tokens and targets
    concatenated, ``lengths`` summing to their size), then its manifest (``manifest(conversations, tokens)``
    gives its fields). Everything is written under temporary names and renamed, the manifest last: a reader
    sees a whole cache or none. Memory: one batch."""
    directory = os.path.dirname(prefix) or "."
    tmp = tempfile.mkdtemp(dir=directory, prefix=os.path.basename(prefix) + ".", suffix=".tmp")
    try:
        lengths_path = os.path.join(tmp, "lengths")
        conversations = total = 0
        with open(lengths_path, "wb") as fl, open(os.path.join(tmp, "t.tokens.bin"), "wb") as ft, \
                open(os.path.join(tmp, "t.targets.bin"), "wb") as fg:
            for lengths, tokens, targets in batches:
                lengths = np.asarray(lengths, dtype=np.int32)
                if int(lengths.sum(dtype=np.int64)) != np.size(tokens) or np.size(tokens) != np.size(targets):
                    raise ValueError(f"a batch of {lengths.size} lengths summing to {int(lengths.sum())} with "
                                     f"{np.size(tokens)} tokens and {np.size(targets)} targets")
                lengths.tofile(fl)
                np.asarray(tokens, dtype=CACHE_DTYPE).tofile(ft)
                np.asarray(targets, dtype=CACHE_DTYPE).tofile(fg)
                conversations += int(lengths.size)
                total += int(np.size(tokens))
        for part in ("tokens", "targets"):
            write_index_chunks(os.path.join(tmp, f"t.{part}"), _lengths_chunks(lengths_path, conversations),
                               dtype=CACHE_DTYPE)
        with open(os.path.join(tmp, "t.json"), "w") as f:
            json.dump(manifest(conversations, total), f, indent=1)
        for part in ("tokens.bin", "tokens.idx", "targets.bin", "targets.idx", "json"):
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


__all__ = ["CACHE_FORMAT", "CachedArrays", "SftCacheError", "cache_prefix", "default_cache_dir", "file_sha256",
           "locked_build", "map_cache", "read_manifest", "stale_reason", "write_cache"]
