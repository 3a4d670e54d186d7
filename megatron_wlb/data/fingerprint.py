"""What a copy of a dataset holds, in two short digests: a sample of the ``.idx`` and of the ``.bin``.

Every rank of a job reads the corpus from its own path (a shared mount, or a node-local copy). A copy
that differs trains other data silently: a stale or re-tokenised ``.idx`` changes the plan (the plan
agreement sees that), but a ``.bin`` of the right size whose bytes differ does not (a preallocating
copy interrupted midway leaves zeros; the packer never reads a token). ``dataset_fingerprint`` gives:

- ``idx``: sha256 of the ``.idx``'s size and ``IDX_SAMPLE_PAGES`` pages spread evenly over it (the header
  and the last entries included; an index of at most 4 MiB, ~200K documents, whole). Until issue 57 it was
  the whole file, which the reader's check then read anyway; now that the reader checks a sample at open
  and each document when first read, hashing it would be most of start-up (7.8 s with a cold page cache
  at 1e8 documents here, so ~80 s at 1e9). A copy of other
  documents (re-tokenised, stale, other lengths) differs in every page; a few entries that differ between
  two sampled pages are seen by the plan agreement of the iteration that plans those documents (the plan
  holds their lengths) and by the reader's check of each document it reads;
- ``bin``: sha256 of the ``.bin``'s size and ``BIN_SAMPLE_PAGES`` pages spread evenly over it, the first
  and the last included: a fixed cost at any size (4 MiB read), which sees any damage or difference
  wider than the gap between pages (``size / BIN_SAMPLE_PAGES``), not a single changed token between two
  sampled pages.

Pure (files in, strings out): the Megatron adapter compares them over the world at start-up and
against a checkpoint's on resume (``megatron_wlb.megatron.state.agreement``).
"""

from __future__ import annotations

import hashlib
import os
from pathlib import Path

from megatron_wlb.data.indexed import dataset_prefix

__all__ = ["BIN_SAMPLE_PAGES", "IDX_SAMPLE_PAGES", "PAGE_BYTES", "dataset_fingerprint", "file_sha256", "sampled_sha256"]

#: pages of the ``.bin`` the fingerprint reads (evenly spaced, first and last included)
BIN_SAMPLE_PAGES = 1024
#: pages of the ``.idx`` the fingerprint reads (evenly spaced, first and last included)
IDX_SAMPLE_PAGES = 1024
PAGE_BYTES = 4096
_READ_BYTES = 16 << 20  # streaming reads of the .idx: bounded memory at any size


def file_sha256(path: str | Path) -> str:
    """sha256 of a whole file, read in bounded chunks."""
    digest = hashlib.sha256()
    with open(path, "rb") as f:
        buffer = bytearray(_READ_BYTES)
        view = memoryview(buffer)
        while True:
            got = f.readinto(buffer)
            if not got:
                break
            digest.update(view[:got])
    return digest.hexdigest()


def sampled_sha256(path: str | Path, pages: int = BIN_SAMPLE_PAGES, page_bytes: int = PAGE_BYTES) -> str:
    """sha256 of a file's size and ``pages`` pages of ``page_bytes`` spread evenly over it (the first
    page starts at byte 0, the last ends at the file's end; a small file is read whole)."""
    if pages < 2 or page_bytes < 1:
        raise ValueError(f"pages={pages} and page_bytes={page_bytes}: need at least 2 pages of at least 1 byte")
    size = os.path.getsize(path)
    digest = hashlib.sha256(f"{size}:{page_bytes}:".encode())
    with open(path, "rb") as f:
        if size <= pages * page_bytes:
            digest.update(f.read())
            return digest.hexdigest()
        last = size - page_bytes
        for i in range(pages):
            f.seek(last * i // (pages - 1))
            digest.update(f.read(page_bytes))
    return digest.hexdigest()


def dataset_fingerprint(prefix: str | Path) -> dict[str, str]:
    """``{"idx": sampled sha256 of PREFIX.idx, "bin": sampled sha256 of PREFIX.bin}`` (sizes included): a fixed
    ~8 MiB read at any size."""
    p = dataset_prefix(prefix)
    return {"idx": sampled_sha256(f"{p}.idx", IDX_SAMPLE_PAGES), "bin": sampled_sha256(f"{p}.bin")}
