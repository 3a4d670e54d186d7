#!/usr/bin/env python
"""Derive document-length corpora from files on this machine: ``python scripts/build_corpora.py [--out DIR]``.

Each corpus is the token lengths (ceil(bytes / 4), the usual ~4 bytes per token of BPE
tokenizers on English and code) of a family of real files, in a seeded random order (training
data is shuffled), written as ``DIR/<name>.npy`` (int64) with a ``DIR/corpora.json`` summary.
Only lengths are written, never contents. Default DIR: docs/results/corpora.

Corpora (different shapes: code has a heavy tail of huge generated files, documentation is
mostly short with rare long manuals, prose sits in between):

- ``stdlib``:   the Python standard library's .py files (the running interpreter's);
- ``pypkgs``:   .py files of the installed site-packages (the packer's held-out source corpus);
- ``headers``:  C/C++ headers (.h, .hpp, .cuh) under /usr/include and site-packages;
- ``docs``:     /usr/share/doc and /usr/share/man (gzip members counted uncompressed);
- ``prose``:    .md / .rst / .txt files outside /proc and the project checkouts.
"""

from __future__ import annotations

import argparse
import gzip
import json
import os
import struct
import sys
import sysconfig
from collections.abc import Iterable, Iterator
from pathlib import Path

import numpy as np

ROOT = Path(__file__).resolve().parents[1]
BYTES_PER_TOKEN = 4


def _walk(roots: Iterable[Path], suffixes: tuple[str, ...], skip: tuple[str, ...] = ()) -> Iterator[Path]:
    for root in roots:
        if not root.exists():
            continue
        for dirpath, dirnames, filenames in os.walk(root, followlinks=False):
            dirnames[:] = sorted(d for d in dirnames if not any(str(Path(dirpath, d)).startswith(s) for s in skip))
            for name in sorted(filenames):
                if not suffixes or name.endswith(suffixes):
                    path = Path(dirpath, name)
                    if path.is_file() and not path.is_symlink():
                        yield path


def _bytes(path: Path) -> int:
    """Size in bytes; a .gz file's uncompressed size (the gzip trailer's ISIZE, mod 2**32)."""
    if path.suffix == ".gz":
        try:
            with open(path, "rb") as f:
                f.seek(-4, os.SEEK_END)
                return struct.unpack("<I", f.read(4))[0]
        except (OSError, struct.error, gzip.BadGzipFile):
            return 0
    return path.stat().st_size


def corpus_paths(name: str) -> Iterator[Path]:
    stdlib = Path(sysconfig.get_paths()["stdlib"])
    site = Path(sysconfig.get_paths()["purelib"])
    if name == "stdlib":
        return (p for p in _walk([stdlib], (".py",)) if "site-packages" not in p.parts)
    if name == "pypkgs":
        return _walk([site], (".py",))
    if name == "headers":
        return _walk([Path("/usr/include"), site], (".h", ".hpp", ".cuh"))
    if name == "docs":
        return _walk([Path("/usr/share/doc"), Path("/usr/share/man")], ())
    if name == "prose":
        return _walk([Path("/")], (".md", ".rst", ".txt"),
                     skip=("/proc", "/sys", "/dev", "/work", "/tmp", "/usr/share/doc", "/usr/share/man"))
    raise ValueError(f"unknown corpus {name!r}; choose one of {', '.join(CORPORA)}")


CORPORA = ("stdlib", "pypkgs", "headers", "docs", "prose")


def build(name: str, seed: int = 0) -> np.ndarray:
    """Token lengths of the corpus, shuffled with ``seed`` (empty files are skipped: no tokens)."""
    sizes = np.array([_bytes(p) for p in corpus_paths(name)], dtype=np.int64)
    sizes = sizes[sizes > 0]
    lengths = (sizes + BYTES_PER_TOKEN - 1) // BYTES_PER_TOKEN
    return lengths[np.random.default_rng(seed).permutation(lengths.size)]


def describe(lengths: np.ndarray) -> dict:
    q = np.percentile(lengths, [50, 90, 99]).tolist()
    return {"documents": int(lengths.size), "tokens": int(lengths.sum()), "median": q[0], "p90": q[1],
            "p99": q[2], "max": int(lengths.max()), "over_128k": int((lengths > 131072).sum()),
            "token_share_over_64k": float(lengths[lengths > 65536].sum() / lengths.sum())}


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--out", default=str(ROOT / "docs" / "results" / "corpora"))
    ap.add_argument("--corpora", default=",".join(CORPORA))
    ap.add_argument("--seed", type=int, default=0)
    args = ap.parse_args(argv)
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    summary = {}
    for name in [c.strip() for c in args.corpora.split(",") if c.strip()]:
        lengths = build(name, args.seed)
        np.save(out / f"{name}.npy", lengths)
        summary[name] = describe(lengths)
        print(name, summary[name], file=sys.stderr)
    (out / "corpora.json").write_text(json.dumps(summary, indent=1) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
