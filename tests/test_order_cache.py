"""The epoch order cache (``DocumentReader(order_cache=...)``, Megatron's ``--data-cache-path``): a large
dataset's epoch order is built once into a file and memory-mapped by every rank of a node. The order is
the in-memory one; resume stays exact; ranks racing to build it get one good file; a damaged file is
found by its checksums and rebuilt; an unusable directory is refused naming it."""

from __future__ import annotations

import multiprocessing
import os
import types

import numpy as np
import pytest
from test_stream_scale import synthetic  # the sparse synthetic corpus, one definition

from megatron_wlb.data import reader as reader_module
from megatron_wlb.data.reader import (
    ORDER_HEADER_BYTES,
    DocumentReader,
    cached_order,
    check_order_file,
    order_cache_file,
    shuffled_order,
)
from megatron_wlb.megatron.data import WlbDataIterator
from megatron_wlb.packing import PackingConfig, make_packer


@pytest.fixture
def small_threshold(monkeypatch):
    """Cache every order of at least 100 documents (the default keeps orders under 1e6 in memory)."""
    monkeypatch.setattr(reader_module, "ORDER_CACHE_MIN_DOCUMENTS", 100)


def blend(tmp_path, cache: str | None) -> DocumentReader:
    rng = np.random.default_rng(0)
    if (tmp_path / "a.idx").exists():
        prefixes = (str(tmp_path / "a"), str(tmp_path / "b"))
    else:
        prefixes = (synthetic(tmp_path, "a", rng.integers(1, 3000, size=4000)),
                    synthetic(tmp_path, "b", rng.integers(1, 500, size=300)))
    return DocumentReader([(prefixes[0], 0.7), (prefixes[1], 0.3)], split="9,1,0", seed=5, order_cache=cache)


def test_the_cached_order_is_the_in_memory_order(tmp_path):
    for documents in (1, 1000, 1_234_567):
        got = cached_order(str(tmp_path / "cache"), 3, 1, 4, documents)
        assert isinstance(got, np.memmap) and np.array_equal(got, shuffled_order(3, 1, 4, documents))
    assert check_order_file(order_cache_file(str(tmp_path / "cache"), 3, 1, 4, 1000), 3, 1, 4, 1000) is None


def test_a_cached_stream_is_the_stream_and_resumes_exactly(tmp_path, small_threshold):
    cache = str(tmp_path / "cache")
    plain, cached = blend(tmp_path, None), blend(tmp_path, cache)
    tokens = 40_000_000  # ~10 epochs of a, ~200 of b
    ids, lengths = plain.stream(tokens).collect()
    got_ids, got_lengths = cached.stream(tokens).collect()
    assert np.array_equal(got_ids, ids) and np.array_equal(got_lengths, lengths)
    assert isinstance(cached._epoch_order(0, 3), np.memmap)  # file-backed, not private memory
    assert len([f for f in os.listdir(cache) if f.endswith(".bin")]) > 10  # epochs of a and of b
    cfg = PackingConfig(seq_len=4096, n=2, dp=2, max_seq_len=6144)
    full = WlbDataIterator(plain, plain.stream(30 * cfg.tokens_per_iteration), make_packer("wlb", cfg), 0)
    plans = [full.next_plan().micro_batches for _ in range(12)]
    first = WlbDataIterator(cached, cached.stream(30 * cfg.tokens_per_iteration), make_packer("wlb", cfg), 0)
    for _ in range(5):
        first.next_plan()
    resumed_reader = blend(tmp_path, cache)  # a restarted rank: maps the files the first run built
    resumed = WlbDataIterator(resumed_reader, resumed_reader.stream(30 * cfg.tokens_per_iteration),
                              make_packer("wlb", cfg), 0)
    resumed.load_state_dict(first.state_dict())
    assert [resumed.next_plan().micro_batches for _ in range(7)] == plans[5:]


def _build_in_a_process(directory: str, documents: int, queue) -> None:
    order = cached_order(directory, 11, 0, 0, documents)
    queue.put(int(np.asarray(order, dtype=np.int64) @ np.arange(documents, dtype=np.int64)))


def test_ranks_racing_to_build_get_one_good_file(tmp_path):
    documents, directory = 2_000_003, str(tmp_path / "cache")
    context = multiprocessing.get_context("spawn")
    queue = context.Queue()
    ranks = [context.Process(target=_build_in_a_process, args=(directory, documents, queue)) for _ in range(4)]
    for p in ranks:
        p.start()
    for p in ranks:
        p.join(120)
    assert [p.exitcode for p in ranks] == [0] * 4
    expected = int(shuffled_order(11, 0, 0, documents).astype(np.int64) @ np.arange(documents, dtype=np.int64))
    assert [queue.get(timeout=5) for _ in ranks] == [expected] * 4
    path = order_cache_file(directory, 11, 0, 0, documents)
    assert sorted(os.listdir(directory)) == sorted([os.path.basename(path), os.path.basename(path) + ".lock"])
    assert check_order_file(path, 11, 0, 0, documents) is None


@pytest.mark.parametrize("damage, reason", [
    ("body", "the order's checksum fails"),
    ("header", "the header checksum fails"),
    ("truncate", "bytes, expected"),
    ("other epoch", "its header is for seed, dataset, epoch, documents, bytes = [7, 0, 2, 5000, 4]"),
])
def test_a_damaged_cache_file_is_found_and_rebuilt(tmp_path, damage, reason):
    directory = str(tmp_path / "cache")
    path = order_cache_file(directory, 7, 0, 1, 5000)
    cached_order(directory, 7, 0, 1, 5000)
    if damage == "other epoch":  # another epoch's (valid) file under this name
        cached_order(directory, 7, 0, 2, 5000)
        os.replace(order_cache_file(directory, 7, 0, 2, 5000), path)
    else:
        with open(path, "r+b") as f:
            if damage == "truncate":
                f.truncate(ORDER_HEADER_BYTES + 100)
            else:
                f.seek(ORDER_HEADER_BYTES + 4 * 1234 if damage == "body" else 20)
                byte = f.read(1)
                f.seek(-1, os.SEEK_CUR)
                f.write(bytes([byte[0] ^ 0x5A]))
    assert reason in check_order_file(path, 7, 0, 1, 5000)
    with pytest.warns(UserWarning, match=f"epoch order cache {path}: .*; rebuilding it"):
        order = cached_order(directory, 7, 0, 1, 5000)
    assert np.array_equal(order, shuffled_order(7, 0, 1, 5000))
    assert check_order_file(path, 7, 0, 1, 5000) is None


def test_an_unusable_cache_directory_is_refused_naming_it(tmp_path):
    blocker = tmp_path / "a_file"
    blocker.write_text("")
    with pytest.raises(ValueError, match=f"--data-cache-path {blocker}/cache: cannot write the epoch order cache"):
        cached_order(str(blocker / "cache"), 1, 0, 0, 10)


def test_megatron_data_cache_path_reaches_the_reader(tmp_path):
    from megatron_wlb.megatron import reader_from_args

    prefix = synthetic(tmp_path, "c", np.full(50, 7))
    args = types.SimpleNamespace(data_path=[prefix], split="1,0,0", seed=3, data_cache_path=str(tmp_path / "cache"))
    assert reader_from_args(args).order_cache == str(tmp_path / "cache")
    args.data_cache_path = None
    assert reader_from_args(args).order_cache is None
