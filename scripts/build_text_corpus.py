#!/usr/bin/env python
"""Build a real Megatron indexed dataset (PREFIX.bin / PREFIX.idx) from text files on this machine.

One file is one document; its bytes are cut into 4-byte tokens (int32, the last one zero-padded),
about what a BPE tokenizer gives for source code and prose, so document lengths keep the real
corpus's shape. Nothing of the corpus is committed: rerun this to get it back. Example (the Python
standard library, ~13k documents, in directory order and reversed)::

    python scripts/build_text_corpus.py --out /tmp/stdlib --root /root/.pyenv/versions/3.11.7/lib/python3.11
    python scripts/build_text_corpus.py --out /tmp/stdlib_rev --root ... --order reverse
    wlb analyze --data-prefix /tmp/stdlib --config 7b_64k --json /tmp/a.json

The .idx follows megatron-core's ``_IndexWriter`` (version 1; see ``megatron_wlb/data/indexed.py``).
"""

from __future__ import annotations

import argparse
import fnmatch
import os
import struct
import sys

import numpy as np

IDX_MAGIC = b"MMIDIDX\x00\x00"
INT32_CODE = 4  # megatron-core DType.int32
BYTES_PER_TOKEN = 4


def text_files(roots: list[str], pattern: str, skip: tuple[str, ...] = ("__pycache__",)) -> list[str]:
    """Every non-empty file matching ``pattern`` under ``roots``, in sorted directory order."""
    out = []
    for root in roots:
        for dirpath, dirnames, filenames in os.walk(root):
            dirnames[:] = sorted(d for d in dirnames if d not in skip)
            for name in sorted(filenames):
                path = os.path.join(dirpath, name)
                if fnmatch.fnmatch(name, pattern) and os.path.isfile(path) and os.path.getsize(path) > 0:
                    out.append(path)
    return out


def tokens_of(data: bytes) -> np.ndarray:
    pad = (-len(data)) % BYTES_PER_TOKEN
    return np.frombuffer(data + b"\x00" * pad, dtype="<i4")


def write_corpus(prefix: str, files: list[str]) -> np.ndarray:
    """Write PREFIX.bin/.idx, one document per file; return the document lengths in tokens."""
    lengths = []
    with open(prefix + ".bin", "wb") as out:
        for path in files:
            with open(path, "rb") as f:
                tok = tokens_of(f.read())
            out.write(tok.tobytes())
            lengths.append(tok.size)
    seq = np.asarray(lengths, dtype=np.int32)
    pointers = np.concatenate([[0], np.cumsum(seq.astype(np.int64) * 4)[:-1]]).astype(np.int64)
    docs = np.arange(seq.size + 1, dtype=np.int64)
    with open(prefix + ".idx", "wb") as f:
        f.write(IDX_MAGIC)
        f.write(struct.pack("<Q", 1))
        f.write(struct.pack("<B", INT32_CODE))
        f.write(struct.pack("<Q", seq.size))
        f.write(struct.pack("<Q", docs.size))
        f.write(seq.tobytes())
        f.write(pointers.tobytes())
        f.write(docs.tobytes())
    return seq.astype(np.int64)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--out", required=True, metavar="PREFIX", help="writes PREFIX.bin and PREFIX.idx")
    ap.add_argument("--root", nargs="+", default=[os.path.dirname(os.__file__)],
                    help="directories to read (default: this Python's standard library)")
    ap.add_argument("--pattern", default="*.py", help="file name pattern (default *.py)")
    ap.add_argument("--order", choices=("sorted", "reverse"), default="sorted",
                    help="document order in the dataset (default: sorted directory order)")
    args = ap.parse_args(argv)
    files = text_files(args.root, args.pattern)
    if not files:
        print(f"no files matching {args.pattern!r} under {args.root}", file=sys.stderr)
        return 2
    if args.order == "reverse":
        files = files[::-1]
    lengths = write_corpus(args.out, files)
    print(f"{args.out}.idx: {lengths.size:,} documents, {int(lengths.sum()):,} tokens, median "
          f"{int(np.median(lengths)):,}, max {int(lengths.max()):,}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
