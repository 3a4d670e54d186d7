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

A size that the disk cannot hold (the ``.idx`` is 20 bytes a document) is replaced by the largest of
``FALLBACK_SIZES`` that fits, said in the result. (Before issue 49 the order was a numpy shuffle held in
memory or built into a cache file, 4 bytes a document: see the git history of the results.)

    flock /work/bench.lock python benchmarks/bench_data_scale.py --page
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
from _results import RESULTS_PAGE, replace_readme_table, write_result  # noqa: E402

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
    from megatron_wlb.data.indexed import write_index_chunks

    chunks = lengths_chunks(documents, seed)
    write_index_chunks(prefix, chunks)
    tokens = sum(int(c.sum(dtype=np.int64)) for c in chunks())
    with open(f"{prefix}.bin", "wb") as f:
        f.truncate(2 * tokens)
    return tokens


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
    from megatron_wlb.megatron.data import WlbDataIterator
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
    for _ in range(18):
        iterator.next_plan()
    t = time.perf_counter()
    iterator.next_plan()
    later_plan = time.perf_counter() - t
    t = time.perf_counter()
    state = iterator.state_dict()
    checkpoint = time.perf_counter() - t
    peak = sampler.stop()
    return {"peak_anon_mib": peak["RssAnon"] / 1024, "peak_file_mib": peak["RssFile"] / 1024,
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
    lines.append(f"- Private memory at {top:.0e} documents, target <= {RANK_PRIVATE_TARGET_MIB} MiB per training "
                 f"rank with or without --data-cache-path: {plain['peak_anon_mib']:.0f} MiB without, "
                 f"{cached['peak_anon_mib']:.0f} MiB with ({verdict(worst <= RANK_PRIVATE_TARGET_MIB)}; "
                 f"{plain['rss_anon_mib']:.0f} / {cached['rss_anon_mib']:.0f} MiB at the end); `wlb pack` peaks at "
                 f"{cli['pack']['peak_anon_mib']:.0f} MiB, `wlb analyze` at {cli['analyze']['peak_anon_mib']:.0f} "
                 "MiB. The epoch order is a keyed Feistel permutation evaluated per block of positions: no order is "
                 "built, held or cached.")
    slowest = max(plain["first_plan_s"], cached["first_plan_s"])
    lines.append(f"- First plan at {top:.0e} documents, target <= {FIRST_PLAN_TARGET_S:.0f} s: "
                 f"{plain['first_plan_s']:.1f} s without the cache, {cached['first_plan_s']:.1f} s with it "
                 f"({verdict(slowest <= FIRST_PLAN_TARGET_S)}), of which opening and validating the corpus (the "
                 f"whole .idx is checked) {plain['open_s']:.1f} / {cached['open_s']:.1f} s and the epoch order's "
                 f"set-up {plain['order_s']:.3f} / {cached['order_s']:.3f} s.")
    return "\n".join(lines)


def to_markdown(result: dict) -> str:
    intro = (f"Data path at scale: one rank, {result['config']} wlb packer, stream of one epoch; the CLI with "
             f"--data-prefix; {result['machine']}.")
    return (f"{intro}\n\n{training_table(result)}\n{cli_table(result)}\n{readme_summary(result)}\n")


def replace_readme_block(readme: Path, text: str) -> None:
    content = readme.read_text()
    a, b = content.find(README_BEGIN), content.find(README_END)
    if a < 0 or b < a:
        raise SystemExit(f"{readme}: no {README_BEGIN} ... {README_END} block")
    readme.write_text(content[:a + len(README_BEGIN)] + "\n" + text + "\n" + content[b:])


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--sizes", default="1e6,1e7,1e8,1e9", help="documents per corpus, comma-separated")
    p.add_argument("--out", default="benchmarks/results/data_scale", help="result path without suffix")
    p.add_argument("--workdir", default=None, help="where the synthetic corpora go (default: a temp dir)")
    p.add_argument("--page", action="store_true",
                   help=f"also write the tables and summary into benchmarks/results.md ({README_MARK}, "
                        f"{README_CLI_MARK}, "
                        f"{README_BEGIN})")
    p.add_argument("--rank", nargs="+", metavar="PREFIX TOKENS [CACHE]", help=argparse.SUPPRESS)
    p.add_argument("--cli", nargs=3, metavar="COMMAND PREFIX WORKDIR", help=argparse.SUPPRESS)
    args = p.parse_args(argv)
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
            try:
                for label, cached in MODES:
                    command = [sys.executable, __file__, "--rank", str(prefix), str(tokens)] + (
                        [str(cache)] if cached else [])
                    proc = subprocess.run(command, capture_output=True, text=True, check=True)
                    row = {**common, "order": label, **json.loads(proc.stdout.strip().splitlines()[-1])}
                    print(json.dumps(row), flush=True)
                    rows.append(row)
                for name in ("pack", "analyze"):
                    work = Path(tmp) / f"cli_{size}_{name}"
                    work.mkdir()
                    proc = subprocess.run([sys.executable, __file__, "--cli", name, str(prefix), str(work)],
                                          capture_output=True, text=True, check=True)
                    row = {**common, **json.loads(proc.stdout.strip().splitlines()[-1])}
                    print(json.dumps(row), flush=True)
                    cli_rows.append(row)
                    shutil.rmtree(work)
            finally:  # the big files go whatever happened
                for path in [Path(f"{prefix}.idx"), Path(f"{prefix}.bin")]:
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
