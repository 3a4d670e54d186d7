"""Iteration simulator: stage costs from the cost model, DP, bounds, monotonicity, dynamic CP, .idx."""

from dataclasses import replace
from types import SimpleNamespace

import numpy as np
import pytest

from megatron_wlb.config import load_config
from megatron_wlb.costmodel import AnalyticCostModel, Hardware, ParallelLayout, get_model
from megatron_wlb.packing.types import DocPiece, GlobalBatch, MicroBatch
from megatron_wlb.schedule import simulate_pipeline
from megatron_wlb.sim.dyncp import doc_cp_sizes, dynamic_cp_layout
from megatron_wlb.sim.iteration import IterationSimulator, split_documents, stage_layers


def balanced(name, lengths, cp, cost):
    """A synthetic CP layout: attention and tokens shared exactly evenly."""
    w = float(np.sum(cost.attention_run(lengths, lengths))) / cp
    return SimpleNamespace(name="even", rank_work=np.full(cp, w), rank_tokens=np.full(cp, lengths.sum() / cp),
                           rank_pairs=np.full(cp, float((lengths * (lengths + 1) / 2).sum()) / cp))


def skewed(name, lengths, cp, cost):
    """Rank 0 does 1.5x its share of attention (a stand-in for per-sequence imbalance)."""
    w = float(np.sum(cost.attention_run(lengths, lengths))) / cp
    work = np.full(cp, w)
    work[0] *= 1.5
    return SimpleNamespace(name="skewed", rank_work=work, rank_tokens=np.full(cp, lengths.sum() / cp),
                           rank_pairs=np.full(cp, float((lengths * (lengths + 1) / 2).sum()) / cp))


def small_config(pp=4, dp=1, cp=2, tp=2, n=4, seq_len=8192, virtual=1):
    cfg = load_config("7b_64k")
    lay = ParallelLayout(tp=tp, cp=cp, pp=pp, dp=dp)
    return replace(cfg, name="tiny", layout=lay, seq_len=seq_len, virtual_stages=virtual,
                   packing=replace(cfg.packing, seq_len=seq_len, n=n, dp=dp, max_seq_len=None))


def batch_of(lengths_per_mb, dp=1, capacity=8192, iteration=0):
    mbs = []
    doc = 0
    for lens in lengths_per_mb:
        pieces = []
        for d in lens:
            pieces.append(DocPiece(doc, 0, int(d), iteration))
            doc += 1
        mbs.append(MicroBatch(tuple(pieces), capacity))
    return GlobalBatch(iteration, tuple(mbs), dp, len(mbs) // dp)


def test_stage_layers_split_evenly():
    assert stage_layers(32, 4).tolist() == [8, 8, 8, 8]
    assert stage_layers(126, 16).sum() == 126 and set(stage_layers(126, 16).tolist()) == {7, 8}
    with pytest.raises(ValueError, match="pp=5"):
        stage_layers(4, 5)


def test_microbatch_cost_matches_cost_model_by_hand():
    cfg = small_config()
    cost = AnalyticCostModel(cfg.model, cfg.layout)
    sim = IterationSimulator(cfg, cost, "skewed", layout_builder=skewed)
    lengths = np.array([3000, 1000, 4192])
    c = sim.microbatch_cost(lengths)
    w = float(np.sum(cost.attention_run(lengths, lengths))) / 2 * 1.5
    tok = lengths.sum() / 2
    comm = float(cost.tp_comm(tok)) + float(cost.cp_comm(lengths.sum()))
    fwd = w + float(cost.linear_compute(tok)) + comm + cost.microbatch_overhead
    # the one price of a CP rank's share (packing.metrics.share_seconds): collectives and the overhead backward
    # scale like GEMMs, as the packer prices them
    bwd = cost.hardware.bwd_attention * w + cost.hardware.bwd_linear * (float(cost.linear_compute(tok)) + comm
                                                                        + cost.microbatch_overhead)
    assert c.fwd == pytest.approx(fwd) and c.bwd == pytest.approx(bwd)
    assert c.layout == "skewed" and c.tokens == 8192
    assert sim.microbatch_cost(lengths) is c  # cached


def test_uniform_batch_is_textbook_plus_transfers_and_head():
    # Fast links and no latency: transfers vanish; without the LM head, uniform micro-batches
    # give the textbook 1F1B time. The head sits on the last stage only.
    hw = Hardware(intra_node_gbps=1e12, inter_node_gbps=1e12, collective_latency_s=0.0)
    cfg = small_config(pp=4, n=8)
    cost = AnalyticCostModel(cfg.model, cfg.layout, hw)
    sim = IterationSimulator(cfg, cost, "even", layout_builder=balanced, dp_sync=False)
    batch = batch_of([[4096, 4096]] * 8)
    res = sim.simulate(batch)
    fwd, bwd, p2p, _ = sim.stage_tables(batch.micro_batches)
    assert np.allclose(p2p, 0.0, atol=1e-9)
    tf, tb = fwd[0, 0], bwd[0, 0]
    head_f, head_b = fwd[-1, 0] - tf, bwd[-1, 0] - tb
    assert head_f > 0 and head_b > 0
    p, m = 4, 8
    # the last stage is the bottleneck: it runs every micro-batch back to back after the fill
    expect = 3 * tf + m * (tf + tb + head_f + head_b) + 3 * tb
    assert res.time == pytest.approx(expect, rel=1e-6)
    fwd_nohead = fwd.copy()
    fwd_nohead[-1] = tf
    bwd_nohead = bwd.copy()
    bwd_nohead[-1] = tb
    plain = simulate_pipeline(fwd_nohead, bwd_nohead)
    assert plain.makespan == pytest.approx((m + p - 1) * (tf + tb))
    assert plain.bubble_fraction == pytest.approx((p - 1) / (m + p - 1))


def test_dp_ranks_wait_for_the_slowest_and_the_gradient_sync():
    cfg = small_config(pp=2, dp=2, n=2)
    cost = AnalyticCostModel(cfg.model, cfg.layout)
    sim = IterationSimulator(cfg, cost, "even", layout_builder=balanced)
    light = [[1024] * 8, [1024] * 8]
    heavy = [[8192], [8192]]
    res = sim.simulate(batch_of(light + heavy, dp=2))
    assert res.pipeline_time[1] > res.pipeline_time[0]
    assert sim.dp_sync_seconds > 0
    assert res.time == pytest.approx(res.pipeline_time.max() + sim.dp_sync_seconds)
    assert res.time >= res.gpu_busy.max()
    assert res.gpu_compute.shape == (2, 2, 2) and res.mb_latency.shape == (2, 2)
    # packing metrics of the batch: rank 0 holds two equal micro-batches, rank 1 two equal ones,
    # so per rank the degree is 1; over all four micro-batches the heavy ones stand out
    assert res.packing_imbalance == pytest.approx(1.0)
    assert res.packing_imbalance_global > 1.05


def test_never_shorter_than_busiest_gpu_and_monotone_in_work():
    rng = np.random.default_rng(0)
    cfg = small_config(pp=4, n=4, seq_len=16384)
    cost = AnalyticCostModel(cfg.model, cfg.layout)
    sim = IterationSimulator(cfg, cost, "even", layout_builder=balanced)
    for _ in range(20):
        mbs = [list(rng.integers(1, 6000, size=rng.integers(1, 5))) for _ in range(4)]
        base = sim.simulate(batch_of(mbs, capacity=16384))
        assert base.time >= base.gpu_busy.max() - 1e-12
        j = int(rng.integers(0, 4))
        mbs[j] = mbs[j] + [int(rng.integers(1, 6000))]
        more = sim.simulate(batch_of(mbs, capacity=16384))
        assert more.time >= base.time - 1e-12


def test_variable_length_micro_batches_beyond_seq_len():
    cfg = small_config(pp=2, n=2, seq_len=8192)
    cost = AnalyticCostModel(cfg.model, cfg.layout)
    sim = IterationSimulator(cfg, cost, "even", layout_builder=balanced)
    res = sim.simulate(batch_of([[12288], [100, 200]], capacity=12288))
    assert res.mb_tokens.tolist() == [[12288, 300]]
    assert res.mb_latency[0, 0] > 10 * res.mb_latency[0, 1]
    empty = sim.simulate(batch_of([[], [4096]]))
    assert empty.mb_latency[0, 0] == 0.0 and empty.time > 0


def test_interleaved_config_runs_virtual_stages():
    cfg = small_config(pp=2, n=4, virtual=2)
    cost = AnalyticCostModel(cfg.model, cfg.layout)
    one = IterationSimulator(replace(cfg, virtual_stages=1), cost, "even", layout_builder=balanced)
    two = IterationSimulator(cfg, cost, "even", layout_builder=balanced, keep_events=True)
    batch = batch_of([[4096, 4096]] * 4)
    r1, r2 = one.simulate(batch), two.simulate(batch)
    assert r2.time < r1.time  # the bubble shrinks
    assert {e.chunk for e in r2.pipelines[0].events} == {0, 1}


def test_layout_mismatch_and_bad_batch_are_named():
    cfg = small_config()
    with pytest.raises(ValueError, match="does not match"):
        IterationSimulator(cfg, AnalyticCostModel(cfg.model, ParallelLayout(tp=1, cp=2)), "even")
    sim = IterationSimulator(cfg, AnalyticCostModel(cfg.model, cfg.layout), "even", layout_builder=balanced)
    with pytest.raises(ValueError, match="dp=2"):
        sim.simulate(batch_of([[10]] * 8, dp=2))


def test_split_documents_keeps_every_token():
    d = np.array([5, 10, 11, 3, 25])
    out = split_documents(d, 10)
    assert out.tolist() == [5, 10, 10, 1, 3, 10, 10, 5]
    assert out.sum() == d.sum() and out.max() <= 10
    assert split_documents(d, 100) is not None and split_documents(d, 100).tolist() == d.tolist()


def test_dynamic_cp_sizes_and_conservation():
    assert doc_cp_sizes(np.array([1000, 32768, 40000, 70000, 200000]), 4, 32768).tolist() == [1, 1, 2, 4, 4]
    cost = AnalyticCostModel(get_model("7b"), ParallelLayout(tp=8, cp=4))
    lengths = np.array([70000, 20000, 3000, 3000, 2000, 1000, 30000])
    lay = dynamic_cp_layout(lengths, 4, cost, max_seqlen_per_rank=32768)
    assert lay.rank_tokens.sum() == pytest.approx(lengths.sum())
    assert lay.doc_cp.tolist() == [4, 1, 1, 1, 1, 1, 1]
    assert np.all(lay.rank_work > 0) and lay.imbalance >= 1.0
    # four equal short documents on four ranks: one each, perfectly balanced
    even = dynamic_cp_layout(np.array([5000] * 4), 4, cost, max_seqlen_per_rank=8192)
    assert even.rank_tokens.tolist() == [5000] * 4 and even.imbalance == pytest.approx(1.0)
    with pytest.raises(ValueError, match="power-of-two"):
        doc_cp_sizes(np.array([10]), 3, 8)


def test_every_layout_satisfies_the_layout_protocol():
    """The simulator reads layouts through ``cp.protocols.Layout``: the real shard layouts, Megatron's
    dynamic-CP stand-in and the tests' stand-ins all have its name, rank_work and rank_tokens."""
    from megatron_wlb.cp.protocols import Layout
    from megatron_wlb.sim.iteration import default_layout_builder

    cost = AnalyticCostModel(get_model("7b"), ParallelLayout(cp=4))
    lengths = np.array([3000, 500, 12000, 64])
    for name in ("per-sequence", "per-document", "adaptive", "dynamic-cp"):
        layout = default_layout_builder(name, lengths, 4, cost, seq_len=16384)
        assert isinstance(layout, Layout), name
        assert layout.rank_work.shape == (4,) and layout.rank_tokens.sum() >= lengths.sum()
    assert isinstance(balanced("even", lengths, 4, cost), Layout)
    assert not isinstance(SimpleNamespace(rank_work=np.zeros(4), rank_tokens=np.zeros(4)), Layout)  # no name
