"""Per-rank memory of the SFT intake over its tokenized cache at 1e5 .. 1e7 conversations (issue 50, scale).

Reading side: for each size, a cache written directly in its format (``data.sft_cache.write_cache``: Megatron
``.bin``/``.idx`` tokens and targets, int32, short conversations of 4..40 tokens, its manifest naming a one-line
jsonl), then, in a fresh process, what a training rank does before and while it trains: map the cache
(``SftCorpus.build``: the manifest, the jsonl's stat, the ``.idx``/``.bin`` checks), open a ``DocumentReader``
over it with the epoch order cached in the same directory (as ``--sft`` does), plan ``PLANS`` iterations with
the wlb packer (``8b_sft_32k``) and read ``READS`` conversations' tokens, labels and loss masks through the
reader's stream ids. Recorded: seconds, and the peak and final private (``RssAnon``) and file-backed
(``RssFile``: the mapped cache's pages, page cache shared by a node's ranks) resident memory.

Building side: a jsonl of short conversations tokenized into the cache (``--build-sizes``) by a word-level
tokenizer in Python (the chat template's cost is not the point): seconds and the builder's peak private
memory (one batch of ``WRITE_BATCH_TOKENS`` tokens held at a time).

    exec 9>/work/BENCH_LOCK; flock 9; python benchmarks/bench_sft_scale.py
    python benchmarks/bench_sft_scale.py --sizes 1e5 --build-sizes 1e4 --out /tmp/sft_scale   # quick
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
from _results import record  # noqa: E402
from bench_data_scale import PeakSampler, status_kib  # noqa: E402

CONFIG = "8b_sft_32k"
SEQ = 4096
PLANS, READS = 20, 10_000
#: two ranks start one after the other over each cache: the first also builds the epoch order files (of a
#: dataset of 1e6 conversations or more: ``reader.ORDER_CACHE_MIN_DOCUMENTS``), the second maps them
RANKS = ("first", "later")
#: conversations generated per batch of the synthetic cache
BATCH = 1 << 20


class WordTokenizer:
    """``w<i>`` -> i + 10, each turn led by its role's id; targets are the assistant turns' tokens."""

    pad = 0
    roles = {"system": 1, "user": 2, "assistant": 3, "tool": 4}

    def tokenize_conversation(self, conversation, return_target, add_generation_prompt):
        tokens: list[int] = []
        targets: list[int] = []
        for message in conversation:
            ids = [self.roles[message["role"]]] + [10 + int(w[1:]) if w[1:].isdigit() else 5
                                                   for w in message["content"].split()]
            tokens += ids
            targets += ids if message["role"] == "assistant" else [-100] * len(ids)
        return np.asarray(tokens), np.asarray(targets)


def conversation(rng: np.random.Generator) -> list[dict]:
    def words(n: int) -> str:
        return " ".join(f"w{i}" for i in rng.integers(0, 50, n))

    return [{"role": "system", "content": words(1)}, {"role": "user", "content": words(int(rng.integers(1, 18)))},
            {"role": "assistant", "content": words(int(rng.integers(1, 18)))}]


def write_synthetic_cache(directory: Path, conversations: int) -> tuple[Path, int]:
    """A cache of ``conversations`` written in its format, for a one-line jsonl whose conversation is its first."""
    from megatron_wlb.data.sft import tokenizer_identity
    from megatron_wlb.data.sft_cache import CACHE_FORMAT, cache_prefix, file_sha256, write_cache

    tokenizer = WordTokenizer()
    jsonl = directory / f"chat_{conversations}.jsonl"
    first = conversation(np.random.default_rng(0))
    jsonl.write_text(json.dumps({"messages": first}) + "\n")
    first_tokens, first_targets = tokenizer.tokenize_conversation(first, True, False)
    identity = tokenizer_identity(tokenizer)
    content = file_sha256(jsonl)
    prefix = cache_prefix(str(directory / "cache"), str(jsonl), [content, identity, SEQ, "megatron", 1])
    os.makedirs(directory / "cache", exist_ok=True)

    def batches():
        for at in range(0, conversations, BATCH):
            rng = np.random.default_rng(at + 1)
            lengths = rng.integers(4, 41, min(BATCH, conversations - at)).astype(np.int32)
            if at == 0:
                lengths[0] = first_tokens.size
            tokens = rng.integers(10, 60, int(lengths.sum()), dtype=np.int32)
            targets = np.where(rng.random(tokens.size) < 0.5, tokens, -100).astype(np.int32)
            if at == 0:
                tokens[:first_tokens.size], targets[:first_tokens.size] = first_tokens, first_targets
            yield lengths, tokens, targets, np.ones(lengths.size, dtype=np.int64)  # a conversation a line

    st = jsonl.stat()

    def manifest(n: int, total: int, lines: int) -> dict:
        return {"format": CACHE_FORMAT, "jsonl": str(jsonl.resolve()), "jsonl_bytes": st.st_size,
                "jsonl_sha256": content, "tokenizer": identity, "seq_len": SEQ, "pad": 0, "samples": "megatron",
                "context_parallel": 1, "documents": n, "tokens": total, "lines": lines, "conversations": n,
                "cut": 0, "dropped": 0, "untrained_tokens": 0, "token_min": 1, "token_max": 59}

    write_cache(prefix, batches(), manifest)
    return jsonl, os.path.getsize(f"{prefix}.tokens.bin") // 4


def measure_reader(jsonl: str) -> dict:
    """One rank over a built cache (run in a fresh process)."""
    from megatron_wlb.config import load_config
    from megatron_wlb.data.reader import DocumentReader
    from megatron_wlb.data.sft import SftCorpus
    from megatron_wlb.data.sft_cache import default_cache_dir
    from megatron_wlb.megatron.data.packed import WlbDataIterator
    from megatron_wlb.packing import make_packer

    before = status_kib("RssAnon")
    sampler = PeakSampler()
    start = time.perf_counter()
    corpus = SftCorpus.build(jsonl, WordTokenizer(), SEQ)
    assert not corpus.built, "the benchmark's cache was not found: the reader tokenized"
    mapped = time.perf_counter() - start
    reader = DocumentReader([(corpus.source()[0], 1.0)], split="1,0,0", seed=1234, order_cache=default_cache_dir(jsonl))
    config = load_config(CONFIG).packing
    tokens = (PLANS + config.max_delay + config.window + 2) * config.tokens_per_iteration  # as stream_tokens_for
    iterator = WlbDataIterator(reader, reader.stream(tokens), make_packer("wlb", config), 0)
    iterator.next_plan()
    first_plan = time.perf_counter() - start
    for _ in range(PLANS - 1):
        iterator.next_plan()
    t = time.perf_counter()
    stream_ids = np.random.default_rng(0).integers(0, reader.num_documents, READS)
    read_tokens = 0
    for stream_id in stream_ids.tolist():
        _, _, doc = reader.locate(stream_id)
        inputs, labels, mask = corpus.piece(doc, 0, int(corpus.lengths[doc]))
        read_tokens += inputs.size
    reads = time.perf_counter() - t
    peak = sampler.stop()
    return {"map_s": mapped, "first_plan_s": first_plan, "reads_s": reads, "read_tokens": read_tokens,
            "anon_before_mib": before / 1024, "peak_anon_mib": peak["RssAnon"] / 1024,
            "peak_file_mib": peak["RssFile"] / 1024, "anon_end_mib": status_kib("RssAnon") / 1024,
            "file_end_mib": status_kib("RssFile") / 1024}


def measure_build(jsonl: str) -> dict:
    """Tokenize ``jsonl`` into its cache (run in a fresh process)."""
    from megatron_wlb.data.sft import SftCorpus

    before = status_kib("RssAnon")
    sampler = PeakSampler()
    t = time.perf_counter()
    corpus = SftCorpus.build(jsonl, WordTokenizer(), SEQ, print_fn=lambda line: print(line, file=sys.stderr))
    wall = time.perf_counter() - t
    peak = sampler.stop()
    return {"built": corpus.built, "build_s": wall, "tokens": int(corpus.tokens.size),
            "anon_before_mib": before / 1024, "peak_anon_mib": peak["RssAnon"] / 1024,
            "anon_end_mib": status_kib("RssAnon") / 1024}


def write_jsonl(path: Path, conversations: int) -> int:
    rng = np.random.default_rng(1)
    with open(path, "w") as f:
        for _ in range(conversations):
            f.write(json.dumps({"messages": conversation(rng)}) + "\n")
    return path.stat().st_size


def held_before_mib(row: dict) -> float:
    """What the intake held per rank before the cache: int32 tokens and targets, and per conversation its
    length, start and line (int64 each)."""
    return (8 * row["tokens"] + 24 * row["conversations"]) / 2**20


def to_markdown(result: dict) -> str:
    lines = [f"SFT intake over its tokenized cache (issue 50, scale): {result['machine']}.", "",
             "Reading side: one rank maps a cache written in its format, plans "
             f"{PLANS} iterations ({CONFIG}, wlb) and reads {READS:,} conversations.", "",
             "| conversations | rank | tokens | cache on disk | map (checks) | first plan | reads | peak private | "
             "private at end | peak file pages (shared) | held in memory before (8 B a token, 24 a conversation) |",
             "|---:|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|"]
    for r in result["reading"]:
        lines.append(f"| {r['conversations']:.0e} | {r['rank']} | {r['tokens']:,} | {r['cache_mib']:.0f} MiB | "
                     f"{r['map_s']:.2f} s | "
                     f"{r['first_plan_s']:.2f} s | {r['reads_s']:.2f} s | {r['peak_anon_mib']:.0f} MiB | "
                     f"{r['anon_end_mib']:.0f} MiB | {r['peak_file_mib']:.0f} MiB | {held_before_mib(r):.0f} MiB |")
    if result["building"]:
        lines += ["", "Building side: a jsonl tokenized into the cache (Python word-level tokenizer).", "",
                  "| conversations | jsonl | tokens | build | conversations/s | peak private | private at end |",
                  "|---:|---:|---:|---:|---:|---:|---:|"]
        for r in result["building"]:
            lines.append(f"| {r['conversations']:.0e} | {r['jsonl_mib']:.0f} MiB | {r['tokens']:,} | "
                         f"{r['build_s']:.1f} s | {r['conversations'] / r['build_s']:,.0f} | "
                         f"{r['peak_anon_mib']:.0f} MiB | {r['anon_end_mib']:.0f} MiB |")
    later = [r for r in result["reading"] if r["rank"] == "later"]
    first = [r for r in result["reading"] if r["rank"] == "first"]
    if len(later) > 1:
        low, top = later[0], later[-1]
        lines += ["", f"- Private memory of a rank that maps the cache (and the epoch orders): peak "
                  f"{low['peak_anon_mib']:.0f} MiB at {low['conversations']:.0e} conversations, "
                  f"{top['peak_anon_mib']:.0f} MiB at {top['conversations']:.0e} "
                  f"({top['conversations'] / low['conversations']:.0f}x the corpus); at the end "
                  f"{low['anon_end_mib']:.0f} and {top['anon_end_mib']:.0f} MiB. The rank that builds the epoch order "
                  f"file peaks at {first[-1]['peak_anon_mib']:.0f} MiB at {top['conversations']:.0e} (4 bytes a "
                  f"conversation while it shuffles). Holding the corpus as before would take "
                  f"{held_before_mib(top):.0f} MiB at {top['conversations']:.0e}.",
                  "- File pages are the maps' pages resident in this process (page cache: shared by a node's ranks, "
                  "reclaimable); with the cache just written they are all cached, and the kernel maps cached "
                  "neighbours around each page read (fault-around), so they exceed the tokens read."]
    return "\n".join(lines) + "\n"


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--sizes", default="1e5,1e6,1e7", help="conversations per synthetic cache, comma-separated")
    p.add_argument("--build-sizes", default="1e5,1e6", help="conversations per jsonl tokenized into a cache")
    p.add_argument("--out", default="benchmarks/results/sft_scale", help="result path without suffix")
    p.add_argument("--workdir", default=None, help="where the synthetic data goes (default: a temp dir)")
    p.add_argument("--read", help=argparse.SUPPRESS)
    p.add_argument("--build", help=argparse.SUPPRESS)
    args = p.parse_args(argv)
    if args.read:
        print(json.dumps(measure_reader(args.read)))
        return 0
    if args.build:
        print(json.dumps(measure_build(args.build)))
        return 0
    from megatron_wlb.provenance import machine

    reading, building = [], []
    with tempfile.TemporaryDirectory(dir=args.workdir) as tmp:
        for n in (int(float(s)) for s in args.sizes.split(",") if s):
            directory = Path(tmp) / f"read_{n}"
            directory.mkdir()
            t = time.perf_counter()
            jsonl, tokens = write_synthetic_cache(directory, n)
            written = time.perf_counter() - t
            cache_bytes = sum(f.stat().st_size for f in (directory / "cache").iterdir())
            for rank in RANKS:  # the second finds the epoch order files the first wrote (1e6 conversations up)
                proc = subprocess.run([sys.executable, __file__, "--read", str(jsonl)], capture_output=True,
                                      text=True, check=True)
                row = {"conversations": n, "rank": rank, "tokens": tokens, "cache_mib": cache_bytes / 2**20,
                       "write_s": written, **json.loads(proc.stdout.strip().splitlines()[-1])}
                print(json.dumps(row), flush=True)
                reading.append(row)
            for f in (directory / "cache").iterdir():
                f.unlink()
        for n in (int(float(s)) for s in args.build_sizes.split(",") if s):
            directory = Path(tmp) / f"build_{n}"
            directory.mkdir()
            jsonl = directory / "chat.jsonl"
            size = write_jsonl(jsonl, n)
            proc = subprocess.run([sys.executable, __file__, "--build", str(jsonl)], capture_output=True, text=True,
                                  check=True)
            row = {"conversations": n, "jsonl_mib": size / 2**20, **json.loads(proc.stdout.strip().splitlines()[-1])}
            print(json.dumps(row), flush=True)
            building.append(row)
    result = {"machine": machine(), "config": CONFIG, "seq_len": SEQ, "plans": PLANS, "reads": READS,
              "reading": reading, "building": building}
    return record(args.out, result, to_markdown)


if __name__ == "__main__":
    raise SystemExit(main())
