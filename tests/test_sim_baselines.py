"""The whole-document baseline, PP send size under sequence parallelism, and interleaved chunk tables."""

from dataclasses import replace

import numpy as np
import pytest

from megatron_wlb.config import load_config
from megatron_wlb.costmodel import AnalyticCostModel, ParallelLayout
from megatron_wlb.packing import make_packer
from megatron_wlb.packing.types import DocPiece, GlobalBatch, MicroBatch, PackingConfig
from megatron_wlb.packing.whole_document import WholeDocumentPacker
from megatron_wlb.sim.iteration import IterationSimulator, stage_layers


def pack_all(lengths, seq_len=100, n=2, dp=1):
    pk = make_packer("whole-document", PackingConfig(seq_len=seq_len, n=n, dp=dp))
    assert isinstance(pk, WholeDocumentPacker)
    return pk, list(pk.pack(lengths))


def test_whole_document_keeps_documents_whole_and_in_arrival_order():
    rng = np.random.default_rng(0)
    lengths = rng.integers(1, 100, size=400)
    pk, batches = pack_all(lengths)
    seen = [p for b in batches for mb in b.micro_batches for p in mb.pieces]
    # every document exactly once, whole
    assert sorted(p.doc_id for p in seen) == list(range(lengths.size))
    assert all(p.offset == 0 and p.length == lengths[p.doc_id] for p in seen)
    for b in batches:
        for mb in b.micro_batches:
            assert mb.tokens <= 100
            ids = [p.doc_id for p in mb.pieces]
            assert ids == sorted(ids)  # first-fit keeps arrival order inside a micro-batch
    # no document waits more than one iteration beyond the one it was read in: backlog stays bounded
    emitted = {p.doc_id: b.iteration for b in batches for mb in b.micro_batches for p in mb.pieces}
    arrival = {p.doc_id: p.arrival for p in seen}
    assert max(emitted[d] - arrival[d] for d in emitted) <= 2
    assert pk.pending() == 0


def test_whole_document_first_fit_and_carry():
    # seq_len 10, 2 micro-batches: 6 -> mb0, 6 -> mb1, 3 -> mb0, 5 fits nowhere (4 and 4 left) -> next iteration
    pk = make_packer("whole-document", PackingConfig(seq_len=10, n=2, dp=1))
    batches = list(pk.pack(np.array([6, 6, 3, 5, 9])))
    first = [[p.length for p in mb.pieces] for mb in batches[0].micro_batches]
    assert first == [[6, 3], [6]]
    second = [[p.length for p in mb.pieces] for mb in batches[1].micro_batches]
    assert second[0][0] == 5  # the carried document goes first
    assert sum(len(mb) for it in batches for mb in [[p for m in it.micro_batches for p in m.pieces]]) == 5


def test_whole_document_state_round_trip():
    lengths = np.random.default_rng(1).integers(1, 90, size=300)
    ref = [tuple(tuple(p for p in mb.pieces) for mb in b.micro_batches) for b in pack_all(lengths)[1]]
    pk = make_packer("whole-document", PackingConfig(seq_len=100, n=2, dp=1))
    it = pk.pack(lengths)
    head = [next(it) for _ in range(5)]
    state = pk.state_dict()
    pk2 = make_packer("whole-document", PackingConfig(seq_len=100, n=2, dp=1))
    pk2.load_state_dict(state)
    rest = list(pk2.pack(lengths))
    got = [tuple(tuple(p for p in mb.pieces) for mb in b.micro_batches) for b in head + rest]
    assert got == ref


def test_pp_send_is_the_sequence_parallel_shard():
    cfg = load_config("7b_128k")  # TP 8, CP 2
    cost = AnalyticCostModel(cfg.model, cfg.layout)
    lat = cost.hardware.collective_latency_s
    full = float(cost.pp_send(131072, sequence_parallel=False)) - lat
    shard = float(cost.pp_send(131072, sequence_parallel=True)) - lat
    assert full == pytest.approx(8 * shard)
    gbps = cost.hardware.link_gbps(2 * 8 * 2)
    assert full == pytest.approx(131072 / 2 * cfg.model.hidden * 2 / (gbps * 1e9))
    mb = MicroBatch((DocPiece(0, 0, 131072, 0),), 131072)
    with_sp = IterationSimulator(cfg, cost, "per-sequence").microbatch_cost(mb.lengths).p2p
    without = IterationSimulator(cfg, cost, "per-sequence", sequence_parallel=False).microbatch_cost(mb.lengths).p2p
    assert without - lat == pytest.approx(8 * (with_sp - lat))


def test_interleaved_chunk_tables_split_layers_and_put_the_head_last():
    cfg = load_config("7b_64k")
    lay = ParallelLayout(tp=2, cp=2, pp=4, dp=1)
    cfg = replace(cfg, layout=lay, seq_len=8192, virtual_stages=2,
                  packing=replace(cfg.packing, seq_len=8192, n=4, dp=1, max_seq_len=None))
    cost = AnalyticCostModel(cfg.model, cfg.layout)
    sim = IterationSimulator(cfg, cost, "per-sequence")
    mbs = [MicroBatch((DocPiece(j, 0, 1000 * (j + 1), 0),), 8192) for j in range(4)]
    fwd, bwd, p2p, costs = sim.chunk_tables(mbs, 2)
    f2, b2, _, _ = sim.stage_tables(mbs)
    assert fwd.shape == (2, 4, 4)
    np.testing.assert_allclose(fwd.sum(axis=0), f2)  # same work per stage, split over the chunks
    np.testing.assert_allclose(bwd.sum(axis=0), b2)
    per_chunk = stage_layers(int(sim.layers[0]), 2)
    np.testing.assert_allclose(fwd[0, 0], per_chunk[0] * np.array([c.fwd for c in costs]))
    head = np.array([c.head_fwd for c in costs])
    np.testing.assert_allclose(fwd[1, -1] - fwd[0, -1], head)  # the LM head sits on the last chunk only
    # and the simulator runs it: interleaving shortens this imbalanced iteration
    batch = GlobalBatch(0, tuple(mbs), 1, 4)
    t2 = sim.simulate(batch).time
    t1 = IterationSimulator(replace(cfg, virtual_stages=1), cost, "per-sequence").simulate(batch).time
    assert t2 < t1
