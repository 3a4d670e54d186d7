"""Per-rank memory and start-up of the data path at 1e6 / 1e7 / 1e8 documents (issue 22).

For each size: a synthetic Megatron indexed dataset (``PREFIX.idx`` in megatron-core's layout, lengths
drawn log-normal around ~1.6K tokens, and a sparse ``PREFIX.bin`` of the right size: no tokens are
written or read), then, in a fresh process per size (one rank), what a training rank does before its
first step: open the reader (the index validation included), size the stream to cover one epoch of
the corpus, and plan the first iteration with the wlb packer through ``WlbDataIterator``. Recorded:
seconds to the first plan (and of the reader's open alone), peak RSS (``VmHWM``), and at the end the
anonymous (private) and file-backed (the ``.idx`` pages and a cached epoch order, shared by the ranks
of a node through the page cache) resident memory, plus a checkpoint's digest and the 20th plan's seconds.

Each size runs three ways: the epoch order in memory (no ``--data-cache-path``), and with an order cache
directory twice: the rank that builds the order file, then a rank that finds it and maps it.

    flock /work/bench.lock python scripts/bench_data_scale.py --readme
    python scripts/bench_data_scale.py --sizes 1e5 --out /tmp/scale     # quick
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parent))
from _results import replace_readme_table, write_result  # noqa: E402

ROOT = Path(__file__).resolve().parents[1]
README_MARK = "<!-- scale-table -->"
#: how the epoch order is held: (label, with an order cache directory, the file already built)
MODES = (("in memory", False, False), ("cache: builds", True, False), ("cache: maps", True, True))

CONFIG = "550m_64k"
MEAN_TOKENS = 1600


def write_corpus(prefix: Path, documents: int, seed: int = 0) -> int:
    """A synthetic ``prefix.idx`` + sparse ``prefix.bin``; returns the corpus' tokens."""
    from megatron_wlb.data.indexed import write_index

    rng = np.random.default_rng(seed)
    lengths = np.clip(rng.lognormal(np.log(MEAN_TOKENS) - 0.5, 1.0, size=documents), 1, 60_000).astype(np.int32)
    write_index(prefix, lengths)
    tokens = int(lengths.sum(dtype=np.int64))
    with open(f"{prefix}.bin", "wb") as f:
        f.truncate(2 * tokens)
    return tokens


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
            "open_s": opened, "first_plan_s": first_plan, "plan_20_s": later_plan, "checkpoint_state_s": checkpoint,
            "peak_rss_mib": status_kib("VmHWM") / 1024, "rss_before_mib": before / 1024,
            "rss_anon_mib": status_kib("RssAnon") / 1024, "rss_file_mib": status_kib("RssFile") / 1024,
            "window_documents": int(iterator._source.ids.size) if iterator._source is not None else 0,
            "stream_position": state["stream_position"]}


def to_markdown(result: dict) -> str:
    lines = [f"Data path at scale: one rank, {result['config']} wlb packer, stream of one epoch; "
             f"{result['machine']}.", "",
             "| documents | epoch order | .idx | open (validate) | first plan | 20th plan | checkpoint state "
             "| peak RSS | peak private | private at end | peak file pages (shared) |",
             "|---:|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|"]
    for row in result["rows"]:
        lines.append(f"| {row['documents']:.0e} | {row['order']} | {row['idx_mib']:.0f} MiB | {row['open_s']:.1f} s | "
                     f"{row['first_plan_s']:.1f} s | {row['plan_20_s'] * 1e3:.0f} ms | "
                     f"{row['checkpoint_state_s']:.2f} s | {row['peak_rss_mib']:.0f} MiB | "
                     f"{row['peak_anon_mib']:.0f} MiB | {row['rss_anon_mib']:.0f} MiB | "
                     f"{row['peak_file_mib']:.0f} MiB |")
    return "\n".join(lines) + "\n"


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--sizes", default="1e6,1e7,1e8", help="documents per corpus, comma-separated")
    p.add_argument("--out", default="docs/results/data_scale", help="result path without suffix")
    p.add_argument("--workdir", default=None, help="where the synthetic corpora go (default: a temp dir)")
    p.add_argument("--readme", action="store_true", help=f"also write the table into README.md (after {README_MARK})")
    p.add_argument("--rank", nargs="+", metavar="PREFIX TOKENS [CACHE]", help=argparse.SUPPRESS)
    args = p.parse_args(argv)
    if args.rank:
        print(json.dumps(measure_rank(args.rank[0], int(args.rank[1]), *args.rank[2:])))
        return
    from megatron_wlb.cli.common import machine

    rows = []
    with tempfile.TemporaryDirectory(dir=args.workdir) as tmp:
        for size in (int(float(s)) for s in args.sizes.split(",")):
            prefix = Path(tmp) / f"synthetic_{size}"
            t = time.perf_counter()
            tokens = write_corpus(prefix, size)
            written = time.perf_counter() - t
            cache = Path(tmp) / f"cache_{size}"
            for label, cached, _built in MODES:  # "cache: maps" finds the file "cache: builds" wrote
                command = [sys.executable, __file__, "--rank", str(prefix), str(tokens)] + ([str(cache)] if cached
                                                                                            else [])
                proc = subprocess.run(command, capture_output=True, text=True, check=True)
                row = {"documents": size, "order": label, "tokens": tokens,
                       "idx_mib": os.path.getsize(f"{prefix}.idx") / 2**20, "write_s": written,
                       **json.loads(proc.stdout.strip().splitlines()[-1])}
                print(json.dumps(row), flush=True)
                rows.append(row)
            for path in [Path(f"{prefix}.idx"), Path(f"{prefix}.bin"), *cache.iterdir()]:
                path.unlink()
    result = {"config": CONFIG, "machine": machine(), "rows": rows}
    write_result(args.out, result, to_markdown)
    if args.readme:
        replace_readme_table(ROOT / "README.md", README_MARK, to_markdown(result).split("\n\n", 1)[1])


if __name__ == "__main__":
    main()
