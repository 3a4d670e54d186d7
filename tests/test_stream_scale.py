"""The document stream scales: a packer reads it through a window (``StreamCursor``) generated a chunk at
a time, so a rank holds the window and one epoch's order, not the stream; a many-epoch stream starts at
once; the lazy stream is the same stream, chunk size or window notwithstanding; resume stays exact.
(``benchmarks/bench_data_scale.py`` measures memory and start-up at 1e6..1e8 documents.)"""

from __future__ import annotations

import time

import numpy as np
import pytest

from megatron_wlb.data.indexed import write_index
from megatron_wlb.data.reader import DocumentReader, StreamCursor
from megatron_wlb.megatron.data.packed import WlbDataIterator
from megatron_wlb.packing import PackingConfig, make_packer


def synthetic(tmp_path, name: str, lengths: np.ndarray) -> str:
    """``name.idx`` with these lengths and a sparse ``.bin`` of the right size (no tokens written)."""
    prefix = write_index(tmp_path / name, lengths)
    with open(f"{prefix}.bin", "wb") as f:
        f.truncate(int(np.sum(lengths, dtype=np.int64)) * 2)
    return str(prefix)


@pytest.fixture
def blend(tmp_path) -> DocumentReader:
    rng = np.random.default_rng(0)
    a = synthetic(tmp_path, "a", rng.integers(1, 3000, size=4000))
    b = synthetic(tmp_path, "b", rng.integers(1, 500, size=300))
    return DocumentReader([(a, 0.7), (b, 0.3)], split="9,1,0", seed=5)


def read_all(cursor: StreamCursor, step: int) -> tuple[np.ndarray, np.ndarray, int]:
    """Read the cursor to its end ``step`` documents at a time; (ids, lengths, largest window held)."""
    ids, lengths, held, at = [], [], 0, 0
    while True:
        n, i = cursor.window(at, at + step)
        held = max(held, int(cursor.ids.size))
        if not n.size:
            return np.concatenate(ids), np.concatenate(lengths), held
        ids.append(i.copy())
        lengths.append(n.copy())
        at += n.size


def test_the_window_is_the_stream_and_stays_small(blend):
    tokens = 40_000_000  # ~10 epochs of a, ~200 of b
    ids, lengths = blend.stream(tokens).collect()
    assert ids.size > 20_000
    for chunk in (7, 1000):
        got_ids, got_lengths, held = read_all(StreamCursor(blend, tokens, chunk=chunk), step=50)
        assert np.array_equal(got_ids, ids) and np.array_equal(got_lengths, lengths)
        assert held <= 4 * (2 * chunk + 100), held  # the window, not the stream
    in_a = ids % blend.num_documents < 4000
    epochs = ids[in_a] // blend.num_documents
    assert epochs.max() >= 5
    for epoch in range(int(epochs.max())):  # every whole epoch of dataset a holds each train document once
        docs = ids[in_a][epochs == epoch] % blend.num_documents
        assert np.array_equal(np.sort(docs), np.arange(3600))


def test_the_digest_of_a_read_cursor_equals_a_fresh_one(blend):
    stream = blend.stream(5_000_000)
    cursor = stream.cursor()
    cursor.window(1234, 1300)  # forgets what lies before 1234
    assert cursor.digest(1500) == stream.digest(1500) == stream.cursor().digest(1500)
    assert stream.digest(1499) != stream.digest(1500)
    assert stream.digest(10**9) is None  # the stream is shorter
    with pytest.raises(ValueError, match="already passed"):
        cursor.window(0, 10)


def test_a_many_epoch_stream_starts_at_once(tmp_path):
    """20 documents of 300 tokens over ~166,667 epochs: the stream used to be built whole up front
    (37.6 s); now a packer's first window takes a few epochs' work."""
    reader = DocumentReader([(synthetic(tmp_path, "tiny", np.full(20, 300)), 1.0)], split="1,0,0", seed=1)
    start = time.perf_counter()
    stream = reader.stream(20 * 300 * 166_667)
    lengths, ids = stream.cursor().window(0, 1000)
    assert time.perf_counter() - start < 1.0
    assert lengths.size == 1000 and set((ids % 20).tolist()) == set(range(20)) and int(ids.max()) // 20 == 49


def test_resume_reads_on_exactly_from_a_lazy_stream(blend):
    cfg = PackingConfig(seq_len=4096, n=2, dp=2, max_seq_len=6144)
    stream = blend.stream(30 * cfg.tokens_per_iteration)
    full = WlbDataIterator(blend, stream, make_packer("wlb", cfg), 0)
    plans = [full.next_plan() for _ in range(12)]
    first = WlbDataIterator(blend, stream, make_packer("wlb", cfg), 0)
    for _ in range(5):
        first.next_plan()
    state = first.state_dict()
    resumed = WlbDataIterator(blend, blend.stream(30 * cfg.tokens_per_iteration), make_packer("wlb", cfg), 0)
    resumed.load_state_dict(state)
    assert [resumed.next_plan().micro_batches for _ in range(7)] == [p.micro_batches for p in plans[5:]]
    other = DocumentReader([(s.prefix, w) for s, w in zip(blend.sources, (0.5, 0.5))], split="9,1,0", seed=5)
    state["reader"] = None  # only the stream differs now: its digest catches it
    with pytest.raises(ValueError, match="does not start with the"):
        WlbDataIterator(other, other.stream(30 * cfg.tokens_per_iteration), make_packer("wlb", cfg), 0
                        ).load_state_dict(state)


def test_file_order_holds_no_epoch_order(tmp_path):
    """With ``shuffle`` off the documents come in file order, computed a chunk at a time: no epoch
    order (4 bytes a document) is held."""
    reader = DocumentReader([(synthetic(tmp_path, "plain", np.full(1000, 30)), 1.0)], split="1,0,0", shuffle=False)
    cursor = StreamCursor(reader, 30 * 2500, chunk=64)
    lengths, ids = cursor.window(0, 2400)
    assert np.array_equal(ids, np.arange(2400)) and (lengths == 30).all()  # epochs 0, 1, 2 in file order
    assert all(d.order is None for d in cursor.datasets)
