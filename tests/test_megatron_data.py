"""The document-level data path over real .bin/.idx files written with megatron-core from stdlib text."""

from __future__ import annotations

import dataclasses
import os
import sysconfig
from collections import defaultdict

import numpy as np
import pytest
import torch

from megatron_wlb.cp.plan import CPSharding
from megatron_wlb.data.reader import (
    BYTE_EOD,
    DocumentReader,
    IndexedSource,
    byte_documents,
    parse_split,
    split_ranges,
    write_indexed_dataset,
)
from megatron_wlb.data.reader import weighted_prefixes as parse_data_path
from megatron_wlb.megatron.data.packed import WlbDataIterator, dumps_state, plan_digest, rank_micro_batch
from megatron_wlb.packing import make_packer
from megatron_wlb.packing.types import DocPiece, MicroBatch, PackingConfig


def stdlib_files(start: int, stop: int) -> list[str]:
    root = sysconfig.get_paths()["stdlib"]
    names = sorted(n for n in os.listdir(root) if n.endswith(".py"))
    return [os.path.join(root, n) for n in names[start:stop]]


@pytest.fixture(scope="module")
def two_datasets(tmp_path_factory):
    """Two datasets of byte-level documents (stdlib files cut at blank-line pairs) and their documents."""
    d = tmp_path_factory.mktemp("idx")
    docs_a = byte_documents(stdlib_files(0, 16))
    docs_b = byte_documents(stdlib_files(16, 30))
    a = write_indexed_dataset(str(d / "a_text_document"), docs_a)
    b = write_indexed_dataset(str(d / "b_text_document"), docs_b)
    return {"a": a, "b": b, "docs_a": docs_a, "docs_b": docs_b}


def test_flag_parsers():
    assert parse_data_path(["/x/a", "/x/b"]) == [("/x/a", 1.0), ("/x/b", 1.0)]
    assert parse_data_path("0.7 /x/a 0.3 /x/b") == [("/x/a", 0.7), ("/x/b", 0.3)]
    with pytest.raises(ValueError, match="WEIGHT PREFIX pairs"):
        parse_data_path(["0.7", "/x/a", "0.3"])
    with pytest.raises(ValueError, match="looks like a weight"):
        parse_data_path(["/x/a", "0.3"])
    assert parse_split("969,30,1") == pytest.approx((0.969, 0.030, 0.001))
    assert parse_split("98/2") == pytest.approx((0.98, 0.02, 0.0))
    with pytest.raises(ValueError, match="--split"):
        parse_split("a,b")
    ranges = split_ranges(1000, "969,30,1")
    assert ranges == [(0, 969), (969, 999), (999, 1000)]
    assert split_ranges(7, "1,1,1")[-1][1] == 7


def test_documents_read_back_exactly(two_datasets, tmp_path):
    src = IndexedSource.open(two_datasets["a"])
    assert src.num_documents == len(two_datasets["docs_a"])
    assert np.array_equal(src.lengths, [len(x) for x in two_datasets["docs_a"]])
    for k in (0, 3, src.num_documents - 1):
        doc = two_datasets["docs_a"][k]
        assert np.array_equal(src.read(k, 0, len(doc)), doc)
        assert np.array_equal(src.read(k, 5, 7), doc[5:12])
        assert src.read(k, 0, len(doc))[-1] == BYTE_EOD
    text = bytes(src.read(0, 0, int(src.lengths[0]) - 1).astype(np.uint8)).decode()
    with open(stdlib_files(0, 1)[0]) as f:
        assert f.read().startswith(text)
    with pytest.raises(ValueError, match=r"drop the extension"):
        IndexedSource.open(two_datasets["a"] + ".bin")
    with pytest.raises(ValueError, match=r"no .*nowhere\.idx"):
        IndexedSource.open(str(tmp_path / "nowhere"))
    with pytest.raises(ValueError, match="outside document"):
        src.read(0, int(src.lengths[0]) - 2, 5)
    # a document of several sequences (document_indices groups them) reads as one contiguous document
    from megatron.core.datasets.indexed_dataset import IndexedDatasetBuilder

    prefix = str(tmp_path / "multi")
    builder = IndexedDatasetBuilder(prefix + ".bin", dtype=np.uint16)
    builder.add_item(torch.tensor([1, 2, 3]))
    builder.add_item(torch.tensor([4, 5]))
    builder.end_document()
    builder.add_item(torch.tensor([9]))
    builder.end_document()
    builder.finalize(prefix + ".idx")
    multi = IndexedSource.open(prefix)
    assert multi.lengths.tolist() == [5, 1]
    assert multi.read(0, 1, 4).tolist() == [2, 3, 4, 5]


def test_split_shuffle_and_epochs(two_datasets):
    reader = DocumentReader([(two_datasets["a"], 1.0)], split="8,1,1", seed=7)
    (b, e), = reader.ranges
    n_train = e - b
    epoch_tokens = int(reader.sources[0].lengths[b:e].sum())
    stream = reader.stream(int(2.5 * epoch_tokens))
    ids = stream.doc_ids
    # stream ids are unique, and each full epoch is a permutation of the train documents
    assert len(set(ids.tolist())) == ids.size
    for epoch in (0, 1):
        chunk = ids[epoch * n_train:(epoch + 1) * n_train]
        locs = [reader.locate(i) for i in chunk]
        assert {ep for ep, _, _ in locs} == {epoch}
        assert sorted(doc for _, _, doc in locs) == list(range(b, e))
    assert not np.array_equal(ids[:n_train] % reader.num_documents, ids[n_train:2 * n_train] % reader.num_documents)
    assert np.array_equal(stream.lengths, [reader.sources[0].lengths[reader.locate(i)[2]] for i in ids])
    # the same seed gives the same order; another seed another one
    assert np.array_equal(DocumentReader([(two_datasets["a"], 1.0)], split="8,1,1", seed=7).stream(10_000).doc_ids,
                          reader.stream(10_000).doc_ids)
    assert not np.array_equal(DocumentReader([(two_datasets["a"], 1.0)], split="8,1,1", seed=8).stream(10_000).doc_ids,
                              reader.stream(10_000).doc_ids)
    # the valid split holds other documents than train
    valid = DocumentReader([(two_datasets["a"], 1.0)], split="8,1,1", split_name="valid", seed=7)
    valid_docs = {valid.locate(i)[2] for i in valid.stream(1000).doc_ids}
    assert valid_docs and not valid_docs & set(range(b, e))
    with pytest.raises(ValueError, match="holds no documents"):
        DocumentReader([(two_datasets["a"], 1.0)], split="1,0,0", split_name="test")


def test_blend_follows_weights_and_streams_are_prefix_stable(two_datasets):
    reader = DocumentReader([(two_datasets["a"], 0.75), (two_datasets["b"], 0.25)], split="1,0,0", seed=3)
    short, long = reader.stream(60_000), reader.stream(240_000)
    assert np.array_equal(long.doc_ids[:len(short)], short.doc_ids)
    assert np.array_equal(long.lengths[:len(short)], short.lengths)
    which = np.array([reader.locate(i)[1] for i in long.doc_ids])
    tokens_a = int(long.lengths[which == 0].sum())
    tokens_b = int(long.lengths[which == 1].sum())
    biggest = int(max(reader.sources[0].lengths.max(), reader.sources[1].lengths.max()))
    assert abs(tokens_a - 0.75 * (tokens_a + tokens_b)) <= 2 * biggest
    # stream ids are global: dataset b's ids start after dataset a's documents
    assert all(i % reader.num_documents >= reader.sources[0].num_documents for i in long.doc_ids[which == 1])
    assert np.array_equal(reader.read(int(long.doc_ids[0]), 0, int(long.lengths[0])),
                          (two_datasets["docs_a"] + two_datasets["docs_b"])[reader.locate(int(long.doc_ids[0]))[2]
                                                                 + (which[0] == 1) * len(two_datasets["docs_a"])])


def test_thd_micro_batch_convention():
    docs = {10: np.arange(100, 110), 11: np.arange(200, 205), 12: np.arange(300, 320)}

    def read(doc_id, offset, length):
        return docs[doc_id][offset:offset + length]

    mb = MicroBatch((DocPiece(10, 0, 10, 0), DocPiece(11, 0, 5, 0), DocPiece(12, 8, 6, 0)), capacity=32)
    out = rank_micro_batch(read, mb, CPSharding())
    assert out.tokens.shape == (1, 21) and out.tokens.dtype == np.int64
    assert out.segment_lengths.tolist() == [10, 5, 6] and out.rope_length == 10
    tok, lab, mask, pos = (a[0] for a in (out.tokens, out.labels, out.loss_mask, out.position_ids))
    assert tok.tolist() == list(range(100, 110)) + list(range(200, 205)) + list(range(308, 314))
    # labels: next token of the same piece; the last token of every piece is not trained
    assert lab[:9].tolist() == list(range(101, 110)) and lab[10:14].tolist() == list(range(201, 205))
    assert mask.tolist() == [1.0] * 9 + [0.0] + [1.0] * 4 + [0.0] + [1.0] * 5 + [0.0]
    assert pos.tolist() == list(range(10)) + list(range(5)) + list(range(6))  # restart per piece
    padded = rank_micro_batch(read, mb, CPSharding(sequence_multiple=8))
    assert padded.tokens.shape == (1, 24) and padded.segment_lengths.tolist() == [10, 5, 6, 3]
    assert padded.loss_mask[0, 21:].sum() == 0 and padded.tokens[0, 21:].tolist() == [0, 0, 0]
    empty = rank_micro_batch(read, MicroBatch((), capacity=32), CPSharding(sequence_multiple=4))
    assert empty.tokens.shape == (1, 8) and empty.segment_lengths.tolist() == [8]
    assert empty.loss_mask.sum() == 0 and empty.rope_length == 8
    with pytest.raises(ValueError, match="read 3 tokens for a piece of 6"):
        rank_micro_batch(lambda d, o, n: np.zeros(3, dtype=np.int64), MicroBatch((DocPiece(1, 0, 6, 0),), 8),
                         CPSharding())


@pytest.mark.parametrize("packer_name", ["original", "fixed-greedy", "wlb"])
def test_iterator_slices_cover_every_token_once(two_datasets, packer_name):
    reader = DocumentReader([(two_datasets["a"], 0.5), (two_datasets["b"], 0.5)], split="1,0,0", seed=11)
    cfg = PackingConfig(seq_len=2048, n=4, dp=2, max_seq_len=4096 if packer_name == "wlb" else None, max_delay=2)
    stream = reader.stream(12 * cfg.tokens_per_iteration)
    its = [WlbDataIterator(reader, stream, make_packer(packer_name, cfg), r) for r in range(cfg.dp)]
    # first iteration with tensors: each rank gets n micro-batches = its slice of the same global plan
    per_rank = [[next(it) for _ in range(cfg.n)] for it in its]
    assert plan_digest(its[0].current) == plan_digest(its[1].current)
    for r, it in enumerate(its):
        for mb, got in zip(it.current.for_dp_rank(r), per_rank[r]):
            assert got.micro_batch == mb
            if not mb.pieces:  # an empty micro-batch runs as one untrained padding segment
                assert got.segment_lengths.tolist() == [2] and got.loss_mask.sum() == 0
                continue
            assert np.array_equal(np.concatenate([[0], np.cumsum(got.segment_lengths)]), mb.cu_seqlens())
            expect = np.concatenate([reader.read(p.doc_id, p.offset, p.length) for p in mb.pieces])
            assert np.array_equal(got.tokens[0], expect)
            assert got.tokens.shape[1] <= mb.capacity
    # the rest of the stream by plan only: every token of every document exactly once, in DP order
    covered: dict[int, list[tuple[int, int]]] = defaultdict(list)
    first = its[0].current
    batches = [first]
    while True:
        try:
            plans = [it.next_plan() for it in its]
        except StopIteration:
            break
        assert len({plan_digest(p) for p in plans}) == 1
        batches.append(plans[0])
    for b in batches:
        union = [mb for r in range(b.dp) for mb in b.for_dp_rank(r)]
        assert union == list(b.micro_batches)
        for p in b.pieces():
            covered[p.doc_id].append((p.offset, p.length))
    assert set(covered) == set(stream.doc_ids.tolist())
    for doc_id, length in zip(stream.doc_ids.tolist(), stream.lengths.tolist()):
        spans = sorted(covered[doc_id])
        assert spans[0][0] == 0 and sum(n for _, n in spans) == length
        assert all(o1 + n1 == o2 for (o1, n1), (o2, _) in zip(spans, spans[1:]))


def test_iteration_metrics_values():
    from megatron_wlb.megatron.state.wlb_logging import WlbMetricsLogger, iteration_metrics, wrap_training_log
    from megatron_wlb.packing.types import GlobalBatch

    def mb(*lens, arrival=0):
        return MicroBatch(tuple(DocPiece(i, 0, n, arrival) for i, n in enumerate(lens)), capacity=100)

    # DP 2 x N 2; without a cost model a piece of d tokens weighs d**2 (the paper's Eq. 1 objective)
    batch = GlobalBatch(iteration=3, micro_batches=(mb(60, 20), mb(40), mb(30, 30, arrival=1), mb(50, 10)),
                        dp=2, n=2, plan_seconds=0.002)
    m = iteration_metrics(batch, cost=None, seq_len=100)
    lat = np.array([[60**2 + 20**2, 40**2], [2 * 30**2, 50**2 + 10**2]], dtype=float)
    per_rank = lat.max(axis=1) * 2 / lat.sum(axis=1)
    assert m.imbalance == pytest.approx(per_rank.mean()) and m.imbalance_max == pytest.approx(per_rank.max())
    assert m.imbalance_global == pytest.approx(lat.max() / lat.mean())
    assert m.tokens == 240 and m.unused_capacity == pytest.approx(1 - 240 / 400)
    assert m.mean_delay == pytest.approx((3 * 180 + 2 * 60) / 240) and m.max_delay == 3
    assert m.plan_ms == pytest.approx(2.0)

    class Recorder:  # stands for Megatron's tensorboard writer: records what it is given
        def __init__(self):
            self.scalars = {}

        def add_scalar(self, key, value, step):
            self.scalars[(key, step)] = value

    tb, lines = Recorder(), []
    logger = WlbMetricsLogger(None, 100, log_interval=2, print_fn=lines.append, tb_writer=lambda: tb,
                              wandb_writer=lambda: None)
    logger.on_batch(batch)

    def training_log(loss_dict, total_loss_dict, learning_rate, iteration, *rest):
        return "megatron-result"

    hooked = wrap_training_log(training_log, lambda: logger)
    assert hooked({}, {}, 1e-4, 3, 1.0) == "megatron-result" and not lines  # off the interval
    assert hooked({}, {}, 1e-4, 4, 1.0) == "megatron-result"
    assert len(lines) == 1 and "imbalance" in lines[0] and "tokens 240" in lines[0]
    assert tb.scalars[("wlb/imbalance", 4)] == pytest.approx(m.imbalance)
    assert tb.scalars[("wlb/unused_capacity", 4)] == pytest.approx(0.4)


def test_a_truncated_bin_is_refused_at_start_up_naming_the_file(tmp_path):
    prefix = write_indexed_dataset(str(tmp_path / "t_text_document"), [np.arange(1, 50), np.arange(1, 30)])
    IndexedSource.open(prefix)  # intact: opens
    with open(prefix + ".bin", "r+b") as f:
        f.truncate(os.path.getsize(prefix + ".bin") - 10)
    with pytest.raises(ValueError, match=r"t_text_document\.bin: .* the \.bin is truncated"):
        IndexedSource.open(prefix)


def test_logger_reports_true_throughput_over_packed_documents():
    from megatron_wlb.costmodel import ModelShape, ParallelLayout, build_cost_model
    from megatron_wlb.megatron.state.wlb_logging import WlbMetricsLogger
    from megatron_wlb.packing.types import GlobalBatch

    shape = ModelShape("t", hidden=64, num_layers=2, num_heads=4, num_kv_heads=4, ffn_hidden=128, vocab=100)
    cost = build_cost_model(shape, ParallelLayout(tp=1, cp=2, pp=1, dp=1))
    logger = WlbMetricsLogger(cost, 100)
    assert logger.throughput(now=10.0) is None  # the first line has no interval yet
    for it in range(2):
        mbs = (MicroBatch((DocPiece(2 * it, 0, 30, it), DocPiece(2 * it + 1, 0, 70, it)), 150),)
        logger.on_batch(GlobalBatch(it, mbs, dp=1, n=1))
    tokens_per_s, tflops = logger.throughput(now=12.0)
    assert tokens_per_s == pytest.approx(200 / 2.0)
    assert tflops == pytest.approx(2 * shape.training_flops([30, 70]) / 2.0 / 2 / 1e12)  # 2 GPUs


def test_prefetching_iterator_yields_the_same_micro_batches_built_on_its_thread(two_datasets):
    """issue 20, item 11: the next micro-batch of an iteration is built on the prefetch thread; the
    micro-batches, their plans and their order are the plain iterator's; the data state saves between
    iterations and resumes alike; the first micro-batch of each iteration (its packing) stays on the
    caller's thread (after an online refit, before a checkpoint)."""
    import threading

    from megatron_wlb.megatron.data import prefetch

    reader = DocumentReader([(two_datasets["a"], 0.5), (two_datasets["b"], 0.5)], split="1,0,0", seed=11)
    cfg = PackingConfig(seq_len=2048, n=4, dp=1, max_seq_len=4096, max_delay=2)
    stream = reader.stream(6 * cfg.tokens_per_iteration)
    sharding = CPSharding("per-document", 2, 1)
    plain = WlbDataIterator(reader, stream, make_packer("wlb", cfg), 0, sharding=sharding)
    threads: list[str] = []
    original_produce = WlbDataIterator.produce

    def produce(self):
        threads.append(threading.current_thread().name)
        return original_produce(self)

    inner = WlbDataIterator(reader, stream, make_packer("wlb", cfg), 0, sharding=sharding)
    inner.produce = produce.__get__(inner)
    fetching = prefetch.PrefetchingIterator(inner)
    assert prefetch.unwrap(fetching) is inner
    for iteration in range(3):
        for index in range(cfg.n):
            want, got = next(plain), next(fetching)
            assert got.micro_batch == want.micro_batch and np.array_equal(got.tokens, want.tokens)
            assert np.array_equal(got.rows, want.rows)
            assert fetching.last is got and inner.last is got and fetching.position == plain.position == index + 1
            assert fetching.iteration == plain.iteration == iteration
        assert dumps_state(fetching.state_dict()) == dumps_state(plain.state_dict())
    per_iteration = [threads[i * cfg.n:(i + 1) * cfg.n] for i in range(3)]
    assert all(t[0] == "MainThread" and all(n.startswith("wlb-prefetch") for n in t[1:]) for t in per_iteration)
    assert fetching.prefetched == 3 * (cfg.n - 1)
    fetching.close()
    # the upload a thread started (``stage``) is kept by the prefetcher beside the micro-batch, not on it, and
    # handed out once (``take_staged``, what ``cp_hooks.upload_micro_batch`` asks); the first of an iteration
    # is built on the critical path, unstaged
    staged = prefetch.PrefetchingIterator(WlbDataIterator(reader, reader.stream(6 * cfg.tokens_per_iteration),
                                                          make_packer("wlb", cfg), 0, sharding=sharding),
                                          stage=lambda batch: ("uploaded", batch.micro_batch))
    batches = [next(staged) for _ in range(cfg.n)]
    assert prefetch.take_staged(batches[0]) is None
    for batch in batches[1:]:
        assert prefetch.take_staged(batch) == ("uploaded", batch.micro_batch)
        assert prefetch.take_staged(batch) is None
    assert "staged" not in {f.name for f in dataclasses.fields(batches[0])}
    staged.close()
