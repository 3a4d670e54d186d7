#!/usr/bin/env python
"""Derive document-length corpora from files on this machine: ``python benchmarks/build_corpora.py [--out DIR]``.

Each corpus is the token lengths (ceil(bytes / 4), the usual ~4 bytes per token of BPE
tokenizers on English and code) of a family of real files, in a seeded random order (training
data is shuffled), written as ``DIR/<name>.npy`` (int64) with a ``DIR/corpora.json`` summary.
Only lengths are written, never contents. Default DIR: tests/data/corpora.

Corpora (different shapes: code has a heavy tail of huge generated files, documentation is
mostly short with rare long manuals, prose sits in between):

- ``stdlib``:   the Python standard library's .py files (the running interpreter's);
- ``pypkgs``:   .py files of the installed site-packages (the packer's held-out source corpus);
- ``headers``:  C/C++ headers (.h, .hpp, .cuh) under /usr/include and site-packages;
- ``docs``:     /usr/share/doc and /usr/share/man (gzip members counted uncompressed);
- ``prose``:    .md / .rst / .txt files outside /proc and the project checkouts;
- ``books``:    very long prose, one document per whole book: every mdBook's single-page edition
                (``print.html``, HTML tags, scripts and styles stripped, entities decoded, whitespace
                runs collapsed) under the Rust toolchains' docs (each book once), every GNU info manual
                (all its ``.info-N`` parts together, uncompressed) and the license texts of
                /usr/share/common-licenses (each text once);
- ``logs``:     log files (``*.log``, ``*.log.N``, gzipped ones uncompressed, /var/log, npm's debug
                logs), binary ones (journal, wtmp) skipped; the append-only system logs are cut at their
                session markers (apt history ``Start-Date:``, apt term ``Log started:``, dpkg
                ``startup``, update-alternatives ``run with``), one document per session;
- ``data``:     data files (.json, .jsonl, .csv, .tsv, .xml, .yaml, .yml, .toml, gzipped ones
                uncompressed) outside /proc, the project checkouts and /usr/share/package-lists (the
                sandbox's registry name lists), each distinct content once.

Existing entries of ``corpora.json`` are kept (a corpus is rebuilt only when named in ``--corpora``),
and every entry gets the statistics of ``describe``.
"""

from __future__ import annotations

import argparse
import gzip
import hashlib
import html
import json
import os
import re
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


CORPORA = ("stdlib", "pypkgs", "headers", "docs", "prose", "books", "logs", "data")
#: how each corpus is built, for ``corpora.json``
BUILT_FROM = {
    "stdlib": "the running Python's standard library .py files",
    "pypkgs": ".py files of the installed site-packages",
    "headers": "C/C++ headers (.h, .hpp, .cuh) under /usr/include and site-packages",
    "docs": "/usr/share/doc and /usr/share/man, one document per file (gzip counted uncompressed)",
    "prose": ".md / .rst / .txt files outside /proc, /sys, /dev, /work, /tmp, /usr/share/doc and /usr/share/man",
    "books": "whole books, one document each: the Rust toolchains' mdBook print.html editions (tags, scripts "
             "and styles stripped, whitespace collapsed; each book once), GNU info manuals (all parts "
             "together) and /usr/share/common-licenses texts (each once)",
    "logs": "*.log / *.log.N / *.log.gz files, /var/log and npm debug logs (binary logs skipped); apt history, "
            "apt term, dpkg and update-alternatives logs cut at their session markers, one document per session",
    "data": ".json/.jsonl/.csv/.tsv/.xml/.yaml/.yml/.toml files (gzipped ones uncompressed) outside /proc, "
            "/sys, /dev, /work, /tmp and /usr/share/package-lists, each distinct content once",
}
#: directories no corpus reads (kernel views, the project checkouts, scratch space, the sandbox's
#: registry name lists, which are not files of this system's software)
SKIP = ("/proc", "/sys", "/dev", "/work", "/tmp", "/usr/share/package-lists")
DATA_SUFFIXES = (".json", ".jsonl", ".csv", ".tsv", ".xml", ".yaml", ".yml", ".toml")
#: session markers of append-only system logs: (file name, regex of a line that starts a session)
LOG_SESSIONS = (("history.log", r"^Start-Date:"), ("term.log", r"^Log started:"), ("dpkg.log", r"^\S+ \S+ startup "),
                ("alternatives.log", r"^update-alternatives \S+ \S+ run with "))


def _read(path: Path) -> bytes:
    """The file's bytes, a .gz file's uncompressed; b"" when unreadable."""
    try:
        if path.suffix == ".gz":
            with gzip.open(path, "rb") as f:
                return f.read()
        return path.read_bytes()
    except (OSError, EOFError, gzip.BadGzipFile):
        return b""


_HTML_DROP = re.compile(rb"<(script|style)\b.*?</\1\s*>", re.S | re.I)
_HTML_TAG = re.compile(rb"<[^>]*>")
_SPACE = re.compile(r"\s+")


def html_text_bytes(raw: bytes) -> int:
    """UTF-8 bytes of an HTML page's text: scripts, styles and tags dropped, entities decoded,
    whitespace runs collapsed to one space."""
    text = _HTML_TAG.sub(b" ", _HTML_DROP.sub(b" ", raw)).decode("utf-8", "replace")
    return len(_SPACE.sub(" ", html.unescape(text)).strip().encode("utf-8"))


def book_sizes() -> Iterator[int]:
    """Byte sizes of whole books: mdBook print.html editions, GNU info manuals, license texts."""
    homes = [Path(os.environ.get("RUSTUP_HOME", Path.home() / ".rustup"))]
    seen: set[str] = set()
    for path in _walk([h / "toolchains" for h in homes], ("print.html",)):
        parts = path.parts
        key = "/".join(parts[parts.index("html") + 1:]) if "html" in parts else str(path)
        if key not in seen:  # the same book in another toolchain
            seen.add(key)
            yield html_text_bytes(_read(path))
    manuals: dict[str, int] = {}
    for path in _walk([Path("/usr/share/info")], ()):
        name = re.sub(r"\.info(-\d+)?(\.gz)?$", "", path.name)
        if name != path.name and name != "dir":
            manuals[name] = manuals.get(name, 0) + len(_read(path))
    yield from manuals.values()
    hashes: set[str] = set()
    for path in _walk([Path("/usr/share/common-licenses")], ()):
        raw = _read(path)
        digest = hashlib.sha1(raw).hexdigest()
        if digest not in hashes:
            hashes.add(digest)
            yield len(raw)


def _is_log(path: Path) -> bool:
    name = path.name.removesuffix(".gz")
    return (name.endswith(".log") or re.search(r"\.log\.\d+$", name) is not None
            or str(path).startswith("/var/log/"))


def log_sizes() -> Iterator[int]:
    """Byte sizes of log documents: one per file, or one per session of the system logs that append
    sessions (``LOG_SESSIONS``); binary files skipped."""
    for path in _walk([Path("/")], (), skip=SKIP):
        if not _is_log(path):
            continue
        raw = _read(path)
        if not raw or b"\0" in raw[:8192]:
            continue
        yield from session_sizes(raw, path.name.removesuffix(".gz"))


def session_sizes(raw: bytes, name: str) -> list[int]:
    """Byte sizes of the sessions of log ``name`` (``LOG_SESSIONS``; the whole file when it has no
    markers): every byte in exactly one session, any text before the first marker a session of its own."""
    marker = next((m for log, m in LOG_SESSIONS if log == name), None)
    if marker is None:
        return [len(raw)] if raw else []
    starts = [m.start() for m in re.finditer(marker.encode(), raw, re.M)]
    bounds = sorted({0, *starts, len(raw)})
    return [b - a for a, b in zip(bounds, bounds[1:]) if b > a]


def data_sizes() -> Iterator[int]:
    """Byte sizes of data files, each distinct content once."""
    hashes: set[str] = set()
    for path in _walk([Path("/")], (), skip=SKIP):
        if not path.name.removesuffix(".gz").endswith(DATA_SUFFIXES):
            continue
        raw = _read(path)
        digest = hashlib.sha1(raw).hexdigest()
        if digest not in hashes:
            hashes.add(digest)
            yield len(raw)


def corpus_sizes(name: str) -> Iterator[int]:
    """Byte sizes of the corpus's documents."""
    if name == "books":
        return book_sizes()
    if name == "logs":
        return log_sizes()
    if name == "data":
        return data_sizes()
    return (_bytes(p) for p in corpus_paths(name))


def build(name: str, seed: int = 0) -> np.ndarray:
    """Token lengths of the corpus, shuffled with ``seed`` (empty files are skipped: no tokens)."""
    sizes = np.fromiter(corpus_sizes(name), dtype=np.int64)
    sizes = sizes[sizes > 0]
    lengths = (sizes + BYTES_PER_TOKEN - 1) // BYTES_PER_TOKEN
    return lengths[np.random.default_rng(seed).permutation(lengths.size)]


def describe(lengths: np.ndarray) -> dict:
    q = np.percentile(lengths, [50, 90, 99]).tolist()
    return {"documents": int(lengths.size), "tokens": int(lengths.sum()), "median": q[0], "p90": q[1],
            "p99": q[2], "max": int(lengths.max()), "over_128k": int((lengths > 131072).sum()),
            "token_share_over_64k": float(lengths[lengths > 65536].sum() / lengths.sum()),
            "token_share_over_128k": float(lengths[lengths > 131072].sum() / lengths.sum())}


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--out", default=str(ROOT / "tests" / "data" / "corpora"))
    ap.add_argument("--corpora", default=",".join(CORPORA))
    ap.add_argument("--seed", type=int, default=0)
    args = ap.parse_args(argv)
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    names = [c.strip() for c in args.corpora.split(",") if c.strip()]
    unknown = [n for n in names if n not in CORPORA]
    if unknown:
        ap.error(f"--corpora {','.join(unknown)}: choose from {', '.join(CORPORA)}")
    index = out / "corpora.json"
    summary = json.loads(index.read_text()) if index.exists() else {}
    for name in names:
        lengths = build(name, args.seed)
        np.save(out / f"{name}.npy", lengths)
        summary[name] = describe(lengths)
        print(name, summary[name], file=sys.stderr)
    for name in summary:  # entries built before: the statistics of their saved lengths
        if (out / f"{name}.npy").exists():
            summary[name] = {"built_from": BUILT_FROM.get(name, ""), **describe(np.load(out / f"{name}.npy"))}
    index.write_text(json.dumps(summary, indent=1) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
