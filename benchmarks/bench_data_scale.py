"""Per-rank memory and start-up of the data path at 1e6 .. 1e9 documents (issues 22, 37), training and CLI.

For each size: a synthetic Megatron indexed dataset (``PREFIX.idx`` in megatron-core's layout, written a
chunk at a time, lengths drawn log-normal around ~1.6K tokens, and a sparse ``PREFIX.bin`` of the right
size: no tokens are written or read), then, in a fresh process per measurement:

- training (one rank): what a training rank does before its first step: open the reader (the index
  validation included), size the stream to cover one epoch of the corpus, and plan the first iteration
  with the wlb packer through ``WlbDataIterator``; without and with ``--data-cache-path`` (the epoch
  order is the keyed Feistel permutation, ``reader.ORDER_FEISTEL``: evaluated per block of positions,
  nothing built or cached, so the two should not differ). Recorded: seconds to the first plan, of the
  reader's open and of the epoch order alone ("order ready in": the permutation's set-up), peak
  RSS (``VmHWM``), the peak and final anonymous (private) and file-backed resident memory (the ``.idx``
  pages: page cache, shared by a node's ranks);
- the CLI: ``wlb pack --data-prefix`` (``CLI_ITERATIONS`` global batches) and ``wlb analyze
  --data-prefix`` (its default sample of at most 1e6 documents, one ordering, ``ANALYZE_ITERATIONS``
  iterations): wall seconds and the same memory figures.

Each measurement starts with the corpus out of the page cache (``evict``: ``posix_fadvise(DONTNEED)`` on the
``.idx`` and ``.bin`` after an ``fsync``, ``/proc/sys/vm/drop_caches`` only where that left pages and it is
writable; the pages still resident are counted with ``mincore`` and recorded), so start-up reads the ``.idx``
from disk as a fresh node does. The reader checks a fixed sample of the ``.idx`` at open and each other document
when it first reads it (issue 57 item 8): recorded as the sequences checked at open and by the first plan.

A size that the disk cannot hold (the ``.idx`` is 20 bytes a document) is replaced by the largest of
``FALLBACK_SIZES`` that fits, said in the result. (Before issue 49 the order was a numpy shuffle held in
memory or built into a cache file, 4 bytes a document: see the git history of the results.)

    flock /work/bench.lock python benchmarks/bench_data_scale.py --page
    python benchmarks/bench_data_scale.py --sizes 1e9 --cli-commands pack    # skip analyze's 1e6-document sample
    python benchmarks/bench_data_scale.py --sizes 1e5 --out /tmp/scale     # quick
"""

from __future__ import annotations

import argparse
import contextlib
import io
import json
import os
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parent))
from _results import RESULTS_PAGE, replace_block, replace_readme_table, write_result  # noqa: E402

ROOT = Path(__file__).resolve().parents[1]
README_MARK = "<!-- scale-table -->"
README_CLI_MARK = "<!-- scale-cli-table -->"
README_BEGIN, README_END = "<!-- scale-summary -->", "<!-- /scale-summary -->"
#: a training rank's start-up: (label, with ``--data-cache-path``)
MODES = (("no --data-cache-path", False), ("--data-cache-path", True))

CONFIG = "550m_64k"
MEAN_TOKENS = 1600
#: documents generated per chunk of a synthetic index (each chunk seeded on its own: a chunk's lengths do
#: not depend on the corpus size)
WRITE_CHUNK = 1 << 22
#: global batches ``wlb pack`` plans; iterations (one ordering) ``wlb analyze`` simulates
CLI_ITERATIONS, ANALYZE_ITERATIONS = 20, 2
#: what a size that does not fit falls back to, largest first
FALLBACK_SIZES = (500_000_000, 300_000_000, 200_000_000, 100_000_000)
#: bytes a document: the .idx (int32 length, int64 pointer, int64 document index); the epoch order needs none
IDX_BYTES, ORDER_BYTES = 20, 0
#: disk and memory left free beyond what a size needs
SPARE_BYTES = 2 << 30
#: the targets at the largest size: private memory per training rank, seconds to the first plan
RANK_PRIVATE_TARGET_MIB, FIRST_PLAN_TARGET_S = 256, 10.0


def lengths_chunks(documents: int, seed: int = 0):
    """A callable giving the synthetic lengths a chunk at a time, the same chunks each call."""
    def chunks():
        for k, at in enumerate(range(0, documents, WRITE_CHUNK)):
            rng = np.random.default_rng([seed, k])
            size = min(WRITE_CHUNK, documents - at)
            yield np.clip(rng.lognormal(np.log(MEAN_TOKENS) - 0.5, 1.0, size=size), 1, 60_000).astype(np.int32)
    return chunks


def write_corpus(prefix: Path, documents: int, seed: int = 0) -> int:
    """A synthetic ``prefix.idx`` (written a chunk at a time) + sparse ``prefix.bin``; returns the tokens."""
    from megatron_wlb.data.indexed import read_index, write_index_chunks

    write_index_chunks(prefix, lengths_chunks(documents, seed))
    index = read_index(prefix)  # the tokens from the last entry: no third pass over the lengths
    tokens = (int(index.sequence_pointers[-1]) // index.dtype.itemsize + int(index.sequence_lengths[-1])
              if documents else 0)
    del index
    with open(f"{prefix}.bin", "wb") as f:
        f.truncate(2 * tokens)
    return tokens


PAGE_BYTES = 4096


def resident_bytes(path: str | Path) -> int:
    """Bytes of ``path`` in the page cache (``mincore`` over a map of the whole file, through ctypes)."""
    import ctypes
    import mmap

    size = os.path.getsize(path)
    if not size:
        return 0
    libc = ctypes.CDLL(None, use_errno=True)
    libc.mmap.restype = ctypes.c_void_p
    libc.mmap.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int, ctypes.c_int, ctypes.c_int, ctypes.c_long]
    libc.mincore.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_void_p]
    libc.munmap.argtypes = [ctypes.c_void_p, ctypes.c_size_t]
    pages = -(-size // PAGE_BYTES)
    vector = (ctypes.c_ubyte * pages)()
    fd = os.open(path, os.O_RDONLY)
    try:
        addr = libc.mmap(None, size, mmap.PROT_READ, mmap.MAP_SHARED, fd, 0)
        if addr in (None, ctypes.c_void_p(-1).value):
            raise OSError(ctypes.get_errno(), f"mmap of {path} for mincore failed")
        try:
            if libc.mincore(ctypes.c_void_p(addr), size, vector) != 0:
                raise OSError(ctypes.get_errno(), f"mincore of {path} failed")
        finally:
            libc.munmap(ctypes.c_void_p(addr), size)
    finally:
        os.close(fd)
    return int(np.count_nonzero(np.frombuffer(vector, dtype=np.uint8) & 1)) * PAGE_BYTES


def evict(paths: list[Path]) -> dict:
    """Take ``paths`` out of the page cache: ``fsync`` (dirty pages cannot be dropped) and
    ``posix_fadvise(DONTNEED)`` (unprivileged, the files' clean pages); ``/proc/sys/vm/drop_caches`` only
    when pages are still resident and it is writable. Returns the method and the bytes still resident
    (``mincore``), before and after: the check that the next measurement starts cold."""
    before = sum(resident_bytes(p) for p in paths)
    for path in paths:
        fd = os.open(path, os.O_RDONLY)
        try:
            os.fsync(fd)
            os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
        finally:
            os.close(fd)
    method = "posix_fadvise(DONTNEED)"
    after = sum(resident_bytes(p) for p in paths)
    if after > 1 << 20:
        try:
            with open("/proc/sys/vm/drop_caches", "w") as f:
                f.write("1\n")
            method += " + drop_caches"
        except OSError:
            method += " (drop_caches not permitted)"
        after = sum(resident_bytes(p) for p in paths)
    return {"eviction": method, "resident_before_mib": before / 2**20, "resident_after_mib": after / 2**20}


def memory_available() -> int:
    for line in Path("/proc/meminfo").read_text().splitlines():
        if line.startswith("MemAvailable:"):
            return int(line.split()[1]) * 1024
    return 0


def fitting_size(documents: int, free_disk: int, free_memory: int) -> int:
    """``documents`` if its files (``.idx`` and order file) fit the free disk and its in-memory order
    the free memory, else the largest of ``FALLBACK_SIZES`` below it that does (0: none)."""
    for size in (documents, *(f for f in FALLBACK_SIZES if f < documents)):
        if (size * (IDX_BYTES + ORDER_BYTES) + SPARE_BYTES <= free_disk
                and size * ORDER_BYTES + SPARE_BYTES <= free_memory):
            return size
    return 0


def status_kib(field: str) -> int:
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith(field + ":"):
            return int(line.split()[1])
    return 0


class PeakSampler:
    """The largest RssAnon and RssFile of this process, sampled every ``interval`` seconds in a thread
    (``VmHWM`` counts both together: mapped file pages, shared and reclaimable, and private memory)."""

    def __init__(self, interval: float = 0.01):
        import threading

        self.peak = {"RssAnon": 0, "RssFile": 0}
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, args=(interval,), daemon=True)
        self._thread.start()

    def _run(self, interval: float) -> None:
        while not self._stop.wait(interval):
            for field in self.peak:
                self.peak[field] = max(self.peak[field], status_kib(field))

    def stop(self) -> dict[str, int]:
        self._stop.set()
        self._thread.join()
        return self.peak


def measure_rank(prefix: str, tokens: int, cache: str | None = None) -> dict:
    """One rank's start-up (run in a fresh process); ``cache``: the epoch order cache directory."""
    from megatron_wlb.config import load_config
    from megatron_wlb.data.reader import DocumentReader
    from megatron_wlb.megatron.data.packed import WlbDataIterator
    from megatron_wlb.packing import make_packer

    before = status_kib("VmRSS")
    sampler = PeakSampler()
    start = time.perf_counter()
    reader = DocumentReader([(prefix, 1.0)], split="1,0,0", seed=1234, order_cache=cache)
    opened = time.perf_counter() - start
    order_s = [0.0]
    epoch_order = reader._epoch_order

    def timed_order(i: int, epoch: int) -> np.ndarray:  # the seconds of the epoch order alone
        t = time.perf_counter()
        try:
            return epoch_order(i, epoch)
        finally:
            order_s[0] += time.perf_counter() - t

    reader._epoch_order = timed_order  # type: ignore[method-assign]
    config = load_config(CONFIG).packing
    iterator = WlbDataIterator(reader, reader.stream(tokens), make_packer("wlb", config), 0)
    iterator.next_plan()
    first_plan = time.perf_counter() - start
    checked_by_first_plan = reader.sources[0].documents_checked
    for _ in range(18):
        iterator.next_plan()
    t = time.perf_counter()
    iterator.next_plan()
    later_plan = time.perf_counter() - t
    t = time.perf_counter()
    state = iterator.state_dict()
    checkpoint = time.perf_counter() - t
    peak = sampler.stop()
    source = reader.sources[0]
    return {"peak_anon_mib": peak["RssAnon"] / 1024, "peak_file_mib": peak["RssFile"] / 1024,
            "checked_at_open": source.checked_at_open, "checked_by_first_plan": checked_by_first_plan,
            "open_s": opened, "order_s": order_s[0],
            "first_plan_s": first_plan, "plan_20_s": later_plan, "checkpoint_state_s": checkpoint,
            "peak_rss_mib": status_kib("VmHWM") / 1024, "rss_before_mib": before / 1024,
            "rss_anon_mib": status_kib("RssAnon") / 1024, "rss_file_mib": status_kib("RssFile") / 1024,
            "window_documents": int(iterator._source.ids.size) if iterator._source is not None else 0,
            "stream_position": state["stream_position"]}


def measure_cli(command: str, prefix: str, workdir: str) -> dict:
    """``wlb pack`` or ``wlb analyze`` on ``prefix`` (run in a fresh process): wall seconds and memory."""
    from megatron_wlb.cli.main import main

    argv = {"pack": ["pack", "--config", CONFIG, "--data-prefix", prefix, "--iterations", str(CLI_ITERATIONS),
                     "--json"],
            "analyze": ["analyze", "--config", CONFIG, "--data-prefix", prefix, "--iterations",
                        str(ANALYZE_ITERATIONS), "--shuffles", "1", "--out", os.path.join(workdir, "analyze"),
                        "--json", os.path.join(workdir, "analyze.json")]}[command]
    before = status_kib("VmRSS")
    sampler = PeakSampler()
    start = time.perf_counter()
    printed, errors = io.StringIO(), io.StringIO()
    with contextlib.redirect_stdout(printed), contextlib.redirect_stderr(errors):
        rc = main(argv)
    wall = time.perf_counter() - start
    peak = sampler.stop()
    if rc:
        raise SystemExit(f"wlb {command} failed ({rc}): {errors.getvalue().strip()}")
    shown = [a if a != prefix else "PREFIX" for a in argv if not a.startswith(workdir) and a not in ("--out", "--json")]
    row = {"cli": command, "command": "wlb " + " ".join(shown),
           "wall_s": wall, "peak_anon_mib": peak["RssAnon"] / 1024, "peak_file_mib": peak["RssFile"] / 1024,
           "peak_rss_mib": status_kib("VmHWM") / 1024, "rss_before_mib": before / 1024,
           "rss_anon_mib": status_kib("RssAnon") / 1024}
    if command == "pack":
        report = json.loads(printed.getvalue())
        row.update(iterations=report["iterations"], documents_read=report["documents_read"])
    else:
        verdict = json.loads(Path(workdir, "analyze.json").read_text())
        row.update(iterations=verdict["iterations"], documents_read=verdict["documents_analyzed"],
                   documents_in_corpus=verdict["documents_in_corpus"], sampled=verdict["sampled"])
    return row


def training_table(result: dict) -> str:
    lines = ["| documents | epoch order | .idx | open (validate) | order ready in | first plan | 20th plan "
             "| checkpoint state | peak RSS | peak private | private at end | peak file pages (shared) |",
             "|---:|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|"]
    for row in result["rows"]:
        lines.append(f"| {row['documents']:.0e} | {row['order']} | {row['idx_mib']:.0f} MiB | {row['open_s']:.1f} s | "
                     f"{row['order_s']:.1f} s | {row['first_plan_s']:.1f} s | {row['plan_20_s'] * 1e3:.0f} ms | "
                     f"{row['checkpoint_state_s']:.2f} s | {row['peak_rss_mib']:.0f} MiB | "
                     f"{row['peak_anon_mib']:.0f} MiB | {row['rss_anon_mib']:.0f} MiB | "
                     f"{row['peak_file_mib']:.0f} MiB |")
    return "\n".join(lines) + "\n"


def cli_table(result: dict) -> str:
    lines = ["| documents | command | documents read | wall | peak RSS | peak private | private at end "
             "| peak file pages (shared) |", "|---:|---|---:|---:|---:|---:|---:|---:|"]
    for row in result["cli_rows"]:
        read = f"{row['documents_read']:,}" + (f" (a sample of {row['documents_in_corpus']:,})"
                                              if row.get("sampled") else "")
        lines.append(f"| {row['documents']:.0e} | `{row['command']}` | {read} | {row['wall_s']:.0f} s | "
                     f"{row['peak_rss_mib']:.0f} MiB | {row['peak_anon_mib']:.0f} MiB | "
                     f"{row['rss_anon_mib']:.0f} MiB | {row['peak_file_mib']:.0f} MiB |")
    return "\n".join(lines) + "\n"


def readme_summary(result: dict) -> str:
    """The targets at the largest size run (every number from ``result``)."""
    top = max(row["documents"] for row in result["rows"])
    rows = {row["order"]: row for row in result["rows"] if row["documents"] == top}
    cli = {row["cli"]: row for row in result["cli_rows"] if row["documents"] == top}

    def verdict(ok: bool) -> str:
        return "met" if ok else "not met"

    lines = []
    if result.get("fallback"):
        lines.append(f"- {result['fallback']}")
    plain, cached = rows[MODES[0][0]], rows[MODES[1][0]]
    worst = max(plain["peak_anon_mib"], cached["peak_anon_mib"])
    cli_peaks = "; ".join(f"`wlb {name}` peaks at {cli[name]['peak_anon_mib']:.0f} MiB" if name in cli else
                          f"`wlb {name}` not run (--cli-commands)" for name in ("pack", "analyze"))
    lines.append(f"- Private memory at {top:.0e} documents, target <= {RANK_PRIVATE_TARGET_MIB} MiB per training "
                 f"rank with or without --data-cache-path: {plain['peak_anon_mib']:.0f} MiB without, "
                 f"{cached['peak_anon_mib']:.0f} MiB with ({verdict(worst <= RANK_PRIVATE_TARGET_MIB)}; "
                 f"{plain['rss_anon_mib']:.0f} / {cached['rss_anon_mib']:.0f} MiB at the end); "
                 + (f"`wlb pack` peaks at {cli['pack']['peak_anon_mib']:.0f} MiB, `wlb analyze` at "
                    f"{cli['analyze']['peak_anon_mib']:.0f} MiB" if len(cli) == 2 else cli_peaks)
                 + ". The epoch order is a keyed Feistel permutation evaluated per block of positions: no order is "
                 "built, held or cached.")
    slowest = max(plain["first_plan_s"], cached["first_plan_s"])
    if "checked_at_open" in plain:  # issue 57 item 8: a sample at open, each other document when first read
        opening = (f"opening the corpus (a fixed sample of {plain['checked_at_open']:,} sequences of the .idx checked, "
                   f"each other document when first read: {plain['checked_by_first_plan']:,} by the first plan)")
    else:
        opening = "opening and validating the corpus (the whole .idx is checked)"
    lines.append(f"- First plan at {top:.0e} documents, target <= {FIRST_PLAN_TARGET_S:.0f} s: "
                 f"{plain['first_plan_s']:.1f} s without the cache, {cached['first_plan_s']:.1f} s with it "
                 f"({verdict(slowest <= FIRST_PLAN_TARGET_S)}), of which {opening} "
                 f"{plain['open_s']:.1f} / {cached['open_s']:.1f} s and the epoch order's "
                 f"set-up {plain['order_s']:.3f} / {cached['order_s']:.3f} s.")
    measured = [row for row in result["rows"] + result["cli_rows"] if "eviction" in row]
    if measured:
        methods = " / ".join(sorted({row["eviction"] for row in measured}))
        after, before = (max(r[key] for r in measured) for key in ("resident_after_mib", "resident_before_mib"))
        lines.append(f"- Page cache: every measurement started cold, the .idx and .bin evicted with {methods} and "
                     f"checked with mincore: at most {after:.1f} MiB of them still resident (up to {before:.0f} MiB "
                     "before).")
    return "\n".join(lines)


def to_markdown(result: dict) -> str:
    intro = (f"Data path at scale: one rank, {result['config']} wlb packer, stream of one epoch; the CLI with "
             f"--data-prefix; {result['machine']}.")
    return (f"{intro}\n\n{training_table(result)}\n{cli_table(result)}\n{readme_summary(result)}\n")


def replace_readme_block(readme: Path, text: str) -> None:
    replace_block(readme, README_BEGIN, README_END, text)


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--sizes", default="1e6,1e7,1e8,1e9", help="documents per corpus, comma-separated")
    p.add_argument("--out", default="benchmarks/results/data_scale", help="result path without suffix")
    p.add_argument("--workdir", default=None, help="where the synthetic corpora go (default: a temp dir)")
    p.add_argument("--page", action="store_true",
                   help=f"also write the tables and summary into benchmarks/results.md ({README_MARK}, "
                        f"{README_CLI_MARK}, "
                        f"{README_BEGIN})")
    p.add_argument("--cli-commands", default="pack,analyze",
                   help="the CLI rows, comma-separated (pack, analyze; 'none': no CLI row): analyze reads the "
                        ".idx entries of its 1e6-document sample, spread over the whole file (~30-60 s at 1e9)")
    p.add_argument("--rank", nargs="+", metavar="PREFIX TOKENS [CACHE]", help=argparse.SUPPRESS)
    p.add_argument("--cli", nargs=3, metavar="COMMAND PREFIX WORKDIR", help=argparse.SUPPRESS)
    args = p.parse_args(argv)
    commands = [c for c in args.cli_commands.split(",") if c and c != "none"]
    if any(c not in ("pack", "analyze") for c in commands):
        p.error(f"--cli-commands {args.cli_commands!r}: give pack, analyze (comma-separated) or none")
    if args.rank:
        print(json.dumps(measure_rank(args.rank[0], int(args.rank[1]), *args.rank[2:])))
        return
    if args.cli:
        print(json.dumps(measure_cli(*args.cli)))
        return
    from megatron_wlb.provenance import machine

    rows, cli_rows, notes = [], [], []
    with tempfile.TemporaryDirectory(dir=args.workdir) as tmp:
        for requested in (int(float(s)) for s in args.sizes.split(",")):
            free_disk, free_memory = shutil.disk_usage(tmp).free, memory_available()
            size = fitting_size(requested, free_disk, free_memory)
            if size != requested:
                notes.append(f"{requested:.0e} documents do not fit this machine ({free_disk / 2**30:.0f} GiB of disk "
                             f"free, {free_memory / 2**30:.0f} GiB of memory available; they need "
                             f"{requested * (IDX_BYTES + ORDER_BYTES) / 2**30:.0f} GiB of disk and "
                             f"{requested * ORDER_BYTES / 2**30:.0f} GiB of memory): "
                             + (f"ran {size:.0e} instead." if size else "skipped."))
                print(notes[-1], file=sys.stderr, flush=True)
                if not size:
                    continue
            prefix = Path(tmp) / f"synthetic_{size}"
            t = time.perf_counter()
            tokens = write_corpus(prefix, size)
            written = time.perf_counter() - t
            cache = Path(tmp) / f"cache_{size}"
            common = {"documents": size, "tokens": tokens, "idx_mib": os.path.getsize(f"{prefix}.idx") / 2**20,
                      "write_s": written}
            files = [Path(f"{prefix}.idx"), Path(f"{prefix}.bin")]
            try:
                for label, cached in MODES:
                    command = [sys.executable, __file__, "--rank", str(prefix), str(tokens)] + (
                        [str(cache)] if cached else [])
                    cold = evict(files)
                    proc = subprocess.run(command, capture_output=True, text=True, check=True)
                    row = {**common, "order": label, **cold, **json.loads(proc.stdout.strip().splitlines()[-1])}
                    print(json.dumps(row), flush=True)
                    rows.append(row)
                for name in commands:
                    work = Path(tmp) / f"cli_{size}_{name}"
                    work.mkdir()
                    cold = evict(files)
                    proc = subprocess.run([sys.executable, __file__, "--cli", name, str(prefix), str(work)],
                                          capture_output=True, text=True, check=True)
                    row = {**common, **cold, **json.loads(proc.stdout.strip().splitlines()[-1])}
                    print(json.dumps(row), flush=True)
                    cli_rows.append(row)
                    shutil.rmtree(work)
            finally:  # the big files go whatever happened
                for path in files:
                    path.unlink(missing_ok=True)
                shutil.rmtree(cache, ignore_errors=True)
    result = {"config": CONFIG, "machine": machine(), "rows": rows, "cli_rows": cli_rows,
              "fallback": " ".join(notes)}
    write_result(args.out, result, to_markdown)
    if args.page:
        readme = RESULTS_PAGE
        replace_readme_table(readme, README_MARK, training_table(result))
        replace_readme_table(readme, README_CLI_MARK, cli_table(result))
        replace_readme_block(readme, readme_summary(result))


if __name__ == "__main__":
    main()
