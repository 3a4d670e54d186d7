"""Issue 37 D13: ``wlb pack / bench / analyze`` read an indexed corpus as the training reader does.

The CLI's ``--data-prefix`` / ``--data-path`` go through ``data.reader`` (``IndexedSource``, ``DocumentReader``):
the ``.bin`` size and the ``.idx`` pointers are checked as at training start-up (before: only the ``.idx``
was read, so a truncated copy was packed silently), and the corpus is streamed through a moving window
of memory-mapped views (before: ~31 bytes a document, 964 MiB at 3e7 documents). ``wlb analyze`` samples
a corpus larger than ``--max-documents`` and says so. The memory numbers at 1e8-1e9 documents are
``benchmarks/bench_data_scale.py``'s (benchmarks/results/data_scale.md); here the same property is checked at a
size a test can afford: no per-document array of the corpus is allocated.
"""

from __future__ import annotations

import json
import tracemalloc
from pathlib import Path

import numpy as np
import pytest

from megatron_wlb.cli.main import main
from megatron_wlb.data.indexed import write_index


def corpus(prefix: Path, lengths, dtype=np.uint16, bin_bytes: int | None = None) -> str:
    """``prefix.idx`` (megatron-core's layout) and a sparse ``prefix.bin`` of the size it describes
    (or ``bin_bytes``)."""
    lengths = np.asarray(lengths)
    write_index(prefix, lengths, dtype)
    size = int(lengths.sum(dtype=np.int64)) * np.dtype(dtype).itemsize if bin_bytes is None else bin_bytes
    with open(f"{prefix}.bin", "wb") as f:
        f.truncate(size)
    return str(prefix)


def lognormal(documents: int, seed: int = 0) -> np.ndarray:
    rng = np.random.default_rng(seed)
    return np.clip(rng.lognormal(np.log(1600) - 0.5, 1.0, size=documents), 1, 60_000).astype(np.int32)


def one_error_line(capsys, argv: list[str]) -> str:
    rc = main(argv)
    err = capsys.readouterr().err
    lines = [line for line in err.splitlines() if line.strip()]
    assert rc == 2 and len(lines) == 1 and "Traceback" not in err, err
    assert lines[0].startswith(f"wlb {argv[0]}: error: "), err
    return lines[0]


@pytest.fixture
def truncated(tmp_path: Path) -> str:
    lengths = [3000, 60000, 200, 9000] * 50
    return corpus(tmp_path / "short", lengths, bin_bytes=2 * sum(lengths) - 2)  # an interrupted copy


@pytest.mark.parametrize("argv", [
    ["pack", "--config", "550m_64k", "--iterations", "1", "--data-prefix", "{p}"],
    ["pack", "--config", "550m_64k", "--iterations", "1", "--data-path", "0.5", "{p}", "0.5", "{p}"],
    ["bench", "--config", "550m_64k", "--quick", "--iterations", "1", "--lengths", "", "--data-prefix", "{p}"],
    ["analyze", "--config", "550m_64k", "--iterations", "1", "--shuffles", "1", "--data-prefix", "{p}"],
    ["analyze", "--config", "550m_64k", "--iterations", "1", "--shuffles", "1", "--data-path", "{p}"],
], ids=["pack-prefix", "pack-path", "bench-prefix", "analyze-prefix", "analyze-path"])
def test_a_bin_shorter_than_its_idx_is_refused_in_one_line(capsys, tmp_path, truncated, argv):
    """Before: the CLI read PREFIX.idx alone and packed a corpus training would refuse."""
    line = one_error_line(capsys, [a.format(p=truncated) for a in argv] + (
        ["--out", str(tmp_path / "out")] if argv[0] == "analyze" else []))
    assert f"{truncated}.bin: 7219998 bytes, but {truncated}.idx describes 7220000 bytes" in line, line
    assert "truncated" in line and "re-copy or rebuild" in line, line


def test_pointers_that_disagree_with_the_lengths_are_refused(capsys, tmp_path):
    """The pointer check training makes (lengths 10,10 corrupted to 7,13: same total, documents shifted)."""
    lengths = np.array([10, 10, 5], dtype=np.int32)
    prefix = tmp_path / "shifted"
    write_index(prefix, np.array([7, 13, 5], dtype=np.int32), np.uint16,
                sequence_pointers=np.array([0, 20, 40], dtype=np.int64))
    Path(f"{prefix}.bin").write_bytes(b"\0" * 2 * int(lengths.sum()))
    line = one_error_line(capsys, ["pack", "--config", "550m_64k", "--data-prefix", str(prefix)])
    assert "document 1 (sequence 1) starts at byte 20" in line and "rebuild" in line, line


def test_a_missing_bin_names_the_flag(capsys, tmp_path):
    prefix = tmp_path / "nobin"
    write_index(prefix, np.array([5, 6], dtype=np.int32), np.uint16)
    line = one_error_line(capsys, ["pack", "--config", "550m_64k", "--data-prefix", str(prefix)])
    assert f"--data-prefix {prefix}: no {prefix}.bin" in line, line


def test_pack_streams_the_file_order_the_array_path_packed(capsys, tmp_path):
    """The lazy path packs the same documents in the same order as packing the whole array did."""
    from megatron_wlb.cli.common import run_packer
    from megatron_wlb.config import load_config
    from megatron_wlb.costmodel import build_cost_model
    from megatron_wlb.data.indexed import read_idx_lengths
    from megatron_wlb.packing import make_packer

    prefix = corpus(tmp_path / "c", lognormal(30_000, seed=3))
    plan = tmp_path / "plan.jsonl"
    assert main(["pack", "--config", "550m_64k", "--data-prefix", prefix, "--iterations", "4", "--out", str(plan),
                 "--json"]) == 0
    report = json.loads(capsys.readouterr().out)
    got = [json.loads(line)["micro_batches"] for line in plan.read_text().splitlines()]
    config = load_config("550m_64k")
    packer = make_packer(config.packer, config.packing, build_cost_model(config.model, config.layout))
    expect = [[[[p.doc_id, p.offset, p.length] for p in mb.pieces] for mb in b.micro_batches]
              for b in run_packer(packer, read_idx_lengths(prefix), 4)]
    assert got == expect and report["documents_read"] == packer.position


def test_pack_data_path_is_the_training_readers_stream(capsys, tmp_path):
    """``wlb pack --data-path`` packs the stream wlb's training reader gives (--seed 1234 --split 1,0,0):
    the plan's document ids are the reader's stream ids, in its order."""
    from megatron_wlb.data.reader import DocumentReader

    a = corpus(tmp_path / "a", lognormal(3000, seed=1))
    b = corpus(tmp_path / "b", lognormal(5000, seed=2))
    plan = tmp_path / "plan.jsonl"
    assert main(["pack", "--config", "550m_64k", "--packer", "original", "--data-path", "0.3", a, "0.7", b,
                 "--out", str(plan), "--json"]) == 0
    report = json.loads(capsys.readouterr().out)
    ids = [p[0] for line in plan.read_text().splitlines() for mb in json.loads(line)["micro_batches"] for p in mb]
    reader = DocumentReader.from_data_path(["0.3", a, "0.7", b], split="1,0,0", seed=1234)
    stream_ids, _ = reader.stream(reader.epoch_tokens()).collect()
    assert sorted(set(ids)) == sorted(stream_ids.tolist()) and report["documents_read"] == stream_ids.size
    first = list(dict.fromkeys(ids))  # the original packer keeps the stream order
    assert first == stream_ids.tolist()
    assert len(set(stream_ids.tolist())) == stream_ids.size  # one pass: no document twice


def test_pack_builds_no_per_document_array_of_the_corpus(capsys, tmp_path, monkeypatch):
    """Memory grows with the window, not the corpus: packing 2 iterations of a 6e6-document corpus
    allocates (tracemalloc, numpy's buffers included) less than one int64 array of the corpus (48 MB);
    the whole-array path allocated ~31 bytes a document (186 MB here). The pointer check's chunk is made
    small so that its temporaries (not the corpus) do not dominate."""
    from megatron_wlb.data import indexed

    documents = 6_000_000
    prefix = corpus(tmp_path / "big", lognormal(documents))
    monkeypatch.setattr(indexed, "CHECK_CHUNK", 1 << 16)
    tracemalloc.start()
    try:
        assert main(["pack", "--config", "550m_64k", "--data-prefix", prefix, "--iterations", "2", "--json"]) == 0
        _, peak = tracemalloc.get_traced_memory()
    finally:
        tracemalloc.stop()
    assert json.loads(capsys.readouterr().out)["iterations"] == 2
    assert peak < 8 * documents, f"peak {peak / 2**20:.0f} MiB allocated for a {documents:,}-document corpus"


def test_analyze_samples_a_large_corpus_and_says_so(capsys, tmp_path):
    prefix = corpus(tmp_path / "c", lognormal(50_000, seed=4))
    js = tmp_path / "v.json"
    assert main(["analyze", "--config", "550m_64k", "--data-prefix", prefix, "--max-documents", "20000",
                 "--shuffles", "1", "--iterations", "1", "--out", str(tmp_path / "out"), "--json", str(js)]) == 0
    out, err = capsys.readouterr()
    assert "a uniform sample of 20,000 of its 50,000 documents" in out
    assert "A sample: 20,000 of the corpus' 50,000 documents" in err
    verdict = json.loads(js.read_text())
    assert (verdict["documents_analyzed"], verdict["documents_in_corpus"], verdict["sampled"]) == (20000, 50000, True)
    assert "A sample: 20,000 of the corpus' 50,000 documents" in (tmp_path / "out" / "report.md").read_text()
    assert main(["analyze", "--config", "550m_64k", "--data-prefix", prefix, "--shuffles", "1", "--iterations", "1",
                 "--out", str(tmp_path / "out2"), "--json", str(js)]) == 0
    assert "uniform sample" not in capsys.readouterr().out
    assert (json.loads(js.read_text())["documents_analyzed"], json.loads(js.read_text())["sampled"]) == (50000, False)


def test_a_sample_is_uniform_and_in_file_order(tmp_path):
    from megatron_wlb.data.reader import IndexedSource

    lengths = np.arange(1, 100_001, dtype=np.int32)
    src = IndexedSource.open(corpus(tmp_path / "u", lengths))
    picked = src.sample_lengths(10_000, seed=5)
    assert picked.size == 10_000 and np.all(np.diff(picked) > 0)  # distinct, in file order
    assert abs(picked.mean() - lengths.mean()) < 0.03 * lengths.mean()
    assert np.array_equal(picked, src.sample_lengths(10_000, seed=5))
    assert src.sample_lengths().tolist() == lengths.tolist() and src.tokens_in() == int(lengths.sum())


def test_an_index_written_a_chunk_at_a_time_is_the_same_file(tmp_path):
    """``write_index_chunks`` (the benchmark's 1e9-document indexes) writes what ``write_index`` writes."""
    from megatron_wlb.data.indexed import check_bin_matches_idx, write_index_chunks

    lengths = lognormal(100_003, seed=6)
    write_index(tmp_path / "whole", lengths)
    assert write_index_chunks(tmp_path / "chunked", lambda: (lengths[i:i + 7000] for i in range(0, lengths.size,
                                                                                                  7000))) == 100_003
    assert (tmp_path / "whole.idx").read_bytes() == (tmp_path / "chunked.idx").read_bytes()
    with open(tmp_path / "chunked.bin", "wb") as f:
        f.truncate(2 * int(lengths.sum(dtype=np.int64)))
    assert check_bin_matches_idx(tmp_path / "chunked").one_sequence_per_document


def test_analyze_samples_each_dataset_of_a_blend_alike(capsys, tmp_path):
    """A ``--data-path`` blend over ``--max-documents``: the same share of each dataset is sampled (odd
    lengths tag dataset a), then blended and shuffled as without sampling."""
    a = corpus(tmp_path / "a", 2 * (lognormal(20_000, seed=7) // 2) + 1)
    b = corpus(tmp_path / "b", 2 * (lognormal(60_000, seed=8) // 2 + 1))
    js = tmp_path / "v.json"
    assert main(["analyze", "--config", "550m_64k", "--data-path", "0.25", a, "0.75", b, "--max-documents", "8000",
                 "--shuffles", "1", "--iterations", "1", "--out", str(tmp_path / "out"), "--json", str(js)]) == 0
    out, err = capsys.readouterr()
    verdict = json.loads(js.read_text())
    assert (verdict["documents_analyzed"], verdict["documents_in_corpus"]) == (8000, 80_000), verdict
    assert "the same share of each dataset" in err and "a uniform sample of 8,000 of its 80,000 documents" in out
    report = (tmp_path / "out" / "report.md").read_text()
    assert "(2,000 documents" in report and "(6,000 documents" in report, report[:2000]
