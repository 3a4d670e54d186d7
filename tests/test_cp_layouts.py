"""Invariants of the CP shard layouts, checked against independent per-token oracles."""

from __future__ import annotations

import json

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from megatron_wlb.costmodel import AnalyticCostModel, ParallelLayout, get_model
from megatron_wlb.cp import LAYOUT_NAMES, KernelEfficiency, attention_work, build_layout, default_cost_model
from megatron_wlb.cp.efficiency import EFFICIENCY_FORMAT, default_table

FLAT = KernelEfficiency(np.array([1.0, 2.0]), np.array([1.0, 2.0]), np.full((2, 2), 100.0), tile=1)
lengths_st = st.lists(st.integers(1, 70), min_size=1, max_size=12)
cp_st = st.sampled_from([1, 2, 3, 4, 8])


def _doc_of(padded: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    cu = np.concatenate([[0], np.cumsum(padded)])
    doc = np.repeat(np.arange(padded.size), padded)
    return doc, cu


def _te_oracle(padded: np.ndarray, cp: int) -> list[list[int]]:
    """Per token: chunk = offset // (P / 2cp); rank = chunk if chunk < cp else 2cp - 1 - chunk."""
    owned = [[] for _ in range(cp)]
    pos = 0
    for p in padded.tolist():
        size = p // (2 * cp)
        for o in range(p):
            chunk = o // size
            owned[chunk if chunk < cp else 2 * cp - 1 - chunk].append(pos + o)
        pos += p
    return owned


def _check_invariants(lay, cp: int) -> None:
    padded = lay.padded_lengths
    total = int(padded.sum())
    doc, cu = _doc_of(padded)
    all_tokens = np.concatenate([r.token_index for r in lay.ranks]) if total else np.zeros(0, np.int64)
    # every token owned by exactly one rank (nothing dropped or duplicated)
    assert np.array_equal(np.sort(all_tokens), np.arange(total))
    assert lay.rank_tokens.sum() == total and len(lay.ranks) == cp
    for r in lay.ranks:
        t = r.token_index
        runs = r.runs
        assert np.array_equal(t, np.concatenate([np.arange(a, b) for a, b in runs]) if runs.size else t)
        if runs.shape[0] > 1:   # maximal runs: never two adjacent ones that could merge
            assert np.all(runs[1:, 0] != runs[:-1, 1])
        assert np.array_equal(r.position_ids, t - cu[doc[t]])
        q = r.query_lengths
        kv = r.key_lengths
        assert r.cu_seqlens_q[0] == 0 and r.cu_seqlens_q[-1] == t.size and r.cu_seqlens_q.dtype == np.int32
        assert np.all(q >= 1) and np.all(q <= kv)
        starts = r.cu_seqlens_q[:-1].astype(np.int64)
        ends = r.cu_seqlens_q[1:].astype(np.int64)
        expected_kv = []
        for a, b, k in zip(starts, ends, kv):
            run = t[a:b]
            assert np.all(np.diff(run) == 1), "a query run must be consecutive positions"
            assert doc[run[0]] == doc[run[-1]], "a query run must not cross a document"
            assert k == run[-1] + 1 - cu[doc[run[0]]], "keys = document start .. run end"
            expected_kv.append(np.arange(cu[doc[run[0]]], run[-1] + 1))
        kv_index = np.concatenate(expected_kv) if expected_kv else np.zeros(0, np.int64)
        assert np.array_equal(r.kv_index, kv_index)
        assert r.max_seqlen_q == (q.max() if q.size else 0) and r.max_seqlen_k == (kv.max() if kv.size else 0)
        assert r.rank_counts == tuple(int(x) for x in lay.rank_tokens)
    if total:
        gp = lay.ranks[0].gather_position
        assert np.array_equal(gp[all_tokens], np.arange(total))
        offsets = np.concatenate([[0], np.cumsum(lay.rank_tokens)])
        width = int(lay.rank_tokens.max()) + 3
        for r in lay.ranks:   # rows of a padded gather buffer, built from runs, agree with the positions
            pos = gp[r.kv_index]
            owner = np.searchsorted(offsets, pos, side="right") - 1
            assert np.array_equal(r.gather_rows(width), owner * width + pos - offsets[owner])


@settings(max_examples=60, deadline=None)
@given(lengths=lengths_st, cp=cp_st, layout=st.sampled_from(LAYOUT_NAMES), tile=st.sampled_from([1, 4, 128]))
def test_layout_invariants(lengths, cp, layout, tile):
    lay = build_layout(layout, lengths, cp, tile=tile)
    _check_invariants(lay, cp)
    assert lay.requested == layout
    if layout == "adaptive":
        assert lay.name in ("per-sequence", "per-document")
        fwd, bwd = lay.seconds(default_cost_model(), tile=tile)  # each rank's share priced as laid out
        assert float((fwd + bwd).max()) == pytest.approx(min(lay.estimates.values()))
    elif layout == "hybrid":
        assert lay.name in ("hybrid", "per-sequence")
        assert set(lay.estimates) == {"hybrid", "per-sequence"}
        assert lay.estimates["hybrid" if lay.name == "hybrid" else "per-sequence"] == min(lay.estimates.values())
    else:
        assert lay.name == layout
    if layout != "per-document-te":
        assert np.array_equal(lay.padded_lengths, lengths)


@settings(max_examples=60, deadline=None)
@given(lengths=lengths_st, cp=cp_st, layout=st.sampled_from(["per-sequence", "per-document"]))
def test_equal_count_guarantee(lengths, cp, layout):
    """Rank k holds floor(T/cp) + (k < T % cp) tokens: counts differ by <= 1, equal iff cp | T."""
    total = sum(lengths)
    lay = build_layout(layout, lengths, cp)
    expected = total // cp + (np.arange(cp) < total % cp)
    assert np.array_equal(lay.rank_tokens, expected)


@settings(max_examples=40, deadline=None)
@given(lengths=lengths_st, cp=cp_st)
def test_per_document_te_matches_transformer_engine(lengths, cp):
    lay = build_layout("per-document-te", lengths, cp)
    padded = lay.padded_lengths
    assert np.all(padded % (2 * cp) == 0) and np.all(padded >= lengths) and np.all(padded - lengths < 2 * cp)
    for r, owned in zip(lay.ranks, _te_oracle(padded, cp)):
        assert r.token_index.tolist() == owned
    assert len(set(lay.rank_tokens.tolist())) == 1


def test_te_golden_vectors():
    lay = build_layout("per-document-te", [8, 8], 2)
    assert lay.ranks[0].token_index.tolist() == [0, 1, 6, 7, 8, 9, 14, 15]
    assert lay.ranks[1].token_index.tolist() == [2, 3, 4, 5, 10, 11, 12, 13]
    # a document that needs padding: [5, 3] -> padded [8, 4], cp=2
    lay = build_layout("per-document-te", [5, 3], 2)
    assert lay.padded_lengths.tolist() == [8, 4]
    assert lay.ranks[0].token_index.tolist() == [0, 1, 6, 7, 8, 11]
    assert lay.to_json() == {"layout": "per-document-te", "padded_lengths": [8, 4],
                             "ranks": [[[0, 2], [6, 9], [11, 12]], [[2, 6], [9, 11]]]}


@settings(max_examples=40, deadline=None)
@given(chunks=st.lists(st.integers(1, 6), min_size=1, max_size=6), cp=cp_st)
def test_megatron_head_tail_when_divisible(chunks, cp):
    """Divisible lengths: per-sequence is Megatron's 2cp split of the sample, per-document the same
    split of every document (rank r: chunks r and 2cp-1-r)."""
    lengths = [c * 2 * cp for c in chunks]
    total = sum(lengths)
    seq = build_layout("per-sequence", lengths, cp)
    size = total // (2 * cp)
    for r, shard in enumerate(seq.ranks):
        want = np.r_[r * size:(r + 1) * size, (2 * cp - 1 - r) * size:(2 * cp - r) * size]
        assert np.array_equal(shard.token_index, want)
    doc = build_layout("per-document", lengths, cp)
    te = build_layout("per-document-te", lengths, cp)
    for a, b in zip(doc.ranks, te.ranks):
        assert np.array_equal(a.token_index, b.token_index)


def test_per_document_remainder_stays_contiguous_and_rotates():
    # 2cp = 8; document of 11 tokens: 3 leftover tokens grow the head chunks of ranks 0, 1, 2
    # (chunk sizes 2 2 2 1 | 1 1 1 1). The counter runs on: the second document's 3 tokens go to
    # ranks 3, 0, 1, in chunk order (rank 0's, rank 1's, rank 3's head chunk).
    lay = build_layout("per-document", [11, 3], 4)
    assert [r.runs.tolist() for r in lay.ranks] == [
        [[0, 2], [10, 12]], [[2, 4], [9, 10], [12, 13]], [[4, 6], [8, 9]], [[6, 8], [13, 14]]]
    assert lay.rank_tokens.tolist() == [4, 4, 3, 3]   # 14 tokens: floor(14/4) + (k < 2)


def test_pure_flops_per_document_is_exactly_balanced():
    """Without tile rounding and with a flat efficiency table, per-document splits of divisible
    documents give every rank the same causal pairs, and the ranks' work sums to the documents'."""
    cost = default_cost_model()
    lengths = [16, 48, 8, 96]
    lay = build_layout("per-document", lengths, 4, tile=1, efficiency=FLAT)
    assert lay.imbalance == pytest.approx(1.0, abs=1e-12)
    total = float(np.sum(cost.attention_run(np.array(lengths), np.array(lengths))))
    for name in ("per-sequence", "per-document", "hybrid"):
        w = build_layout(name, lengths, 4, tile=1, efficiency=FLAT).rank_work.sum()
        assert w == pytest.approx(total, rel=1e-12)


def test_work_units_follow_the_cost_model():
    """work is in the cost model's units: TP=2 halves it; large shapes cost attention_run(q, kv)."""
    tp1 = AnalyticCostModel(get_model("7b"), ParallelLayout(tp=1))
    tp2 = AnalyticCostModel(get_model("7b"), ParallelLayout(tp=2))
    a = build_layout("per-document", [4096, 8192], 2, cost=tp1)
    b = build_layout("per-document", [4096, 8192], 2, cost=tp2)
    assert np.allclose(b.rank_work * 2, a.rank_work)
    big = attention_work(np.array([65536]), np.array([131072]), tp1, KernelEfficiency.default(), 128)
    assert big[0] == pytest.approx(float(tp1.attention_run(65536, 131072)), rel=0.01)


def test_tile_rounding_and_efficiency_change_the_adaptive_choice():
    # 16 documents of 64 tokens, cp=4: per-document cuts them into 8-token shards.
    small = [64] * 16
    assert build_layout("adaptive", small, 4, tile=128).name == "per-sequence"
    # pure FLOPs: per-document is balanced, per-sequence is not -> per-document
    skewed = [8, 8, 8, 8, 480]
    assert build_layout("adaptive", skewed, 4, tile=1, efficiency=FLAT).name == "per-document"


def test_hybrid_never_slower_than_static_layouts_and_respects_the_token_cap():
    from megatron_wlb.data import load_lengths

    lengths = load_lengths()[:4000]
    cut = np.searchsorted(np.cumsum(lengths), 131072)
    for cp, mb in ((4, lengths[:cut]), (16, lengths[:cut]), (8, lengths[200:260])):
        hyb = build_layout("hybrid", mb, cp)
        per_token = float(default_cost_model().linear_compute(1.0))
        for static in ("per-document", "per-sequence"):
            other = build_layout(static, mb, cp)
            step = (other.rank_work + per_token * other.rank_tokens).max()
            assert (hyb.rank_work + per_token * hyb.rank_tokens).max() <= step * (1 + 1e-12)
        cap = np.ceil(mb.sum() / cp * 1.05)
        assert hyb.rank_tokens.max() <= cap
        _check_invariants(hyb, cp)
    # a micro-batch of many small documents: hybrid keeps them whole and beats both static layouts
    mix = [131072 // 2] + [600] * 100
    times = {n: build_layout(n, mix, 4).max_work for n in ("per-sequence", "per-document", "adaptive", "hybrid")}
    assert times["hybrid"] < min(times["per-sequence"], times["per-document"], times["adaptive"])


def test_per_document_imbalance_on_the_embedded_distribution():
    """Concat-and-cut 128K micro-batches of the embedded (DistCA-published) length stream."""
    from megatron_wlb.data import load_lengths

    lengths = load_lengths()[:3000]
    pieces, room, cur = [], 131072, []
    for d in lengths.tolist():
        while d:
            t = min(d, room)
            cur.append(t)
            d, room = d - t, room - t
            if room == 0:
                pieces.append(cur)
                cur, room = [], 131072
    assert len(pieces) >= 10
    for cp in (4, 16):
        imb = [build_layout("per-document", mb, cp).imbalance for mb in pieces[:10]]
        seq = [build_layout("per-sequence", mb, cp).imbalance for mb in pieces[:10]]
        assert np.mean(imb) <= 1.01 and np.mean(seq) > 1.1


def test_empty_and_tiny_micro_batches():
    lay = build_layout("per-document", [], 4)
    assert lay.rank_tokens.tolist() == [0, 0, 0, 0] and lay.imbalance == 1.0
    assert lay.to_json() == {"layout": "per-document", "padded_lengths": [], "ranks": [[], [], [], []]}
    lay = build_layout("per-sequence", [1], 4)
    assert lay.rank_tokens.tolist() == [1, 0, 0, 0]
    assert lay.ranks[1].kv_index.size == 0 and lay.ranks[1].max_seqlen_q == 0
    _check_invariants(build_layout("hybrid", [1] * 9, 8, tile=1), 8)


def test_bad_inputs_raise_clear_errors():
    with pytest.raises(ValueError, match="unknown CP layout 'ring'.*per-sequence"):
        build_layout("ring", [4], 2)
    with pytest.raises(ValueError, match="cp must be a positive integer"):
        build_layout("per-document", [4], 0)
    with pytest.raises(ValueError, match="cp must be a positive integer"):
        build_layout("per-document", [4], True)
    with pytest.raises(ValueError, match="tile must be a positive integer"):
        build_layout("per-document", [4], 2, tile=0)
    with pytest.raises(ValueError, match=r"\[1\] = 0"):
        build_layout("per-document", [4, 0], 2)
    with pytest.raises(ValueError, match="1-D"):
        build_layout("per-document", [[4]], 2)
    with pytest.raises(ValueError, match="token_slack"):
        build_layout("hybrid", [4], 2, token_slack=-1)
    with pytest.raises(ValueError, match="unknown CP layout 'per-document-choice'"):  # the old alias: one name
        build_layout("per-document-choice", [4, 4], 2)


def test_to_json_contract_is_serialisable():
    lay = build_layout("adaptive", [5, 1, 3, 10], 2)
    line = json.loads(json.dumps(lay.to_json()))
    assert set(line) == {"layout", "padded_lengths", "ranks"}
    assert line["layout"] == lay.name and len(line["ranks"]) == 2
    owned = sorted(p for rank in line["ranks"] for a, b in rank for p in range(a, b))
    assert owned == list(range(19))


def test_efficiency_table_io_and_lookup(tmp_path):
    table = default_table()
    path = tmp_path / "eff.json"
    table.to_json(path)
    loaded = KernelEfficiency.from_json(path)
    assert np.allclose(loaded.table, table.table, rtol=1e-5)
    q = np.array([128, 384, 1024, 131072])
    kv = np.array([128, 4096, 1024, 131072])
    assert np.allclose(loaded.relative_padded(q, kv, 128), loaded.relative(q, kv))
    assert np.all(loaded.relative(q, kv) <= 1.0) and loaded.relative(128, 128) < 0.2
    # measured tables may leave impossible shapes (q > kv) null
    data = {"format": EFFICIENCY_FORMAT, "q_lens": [128, 256], "kv_lens": [128, 256],
            "tflops": [[50.0, 80.0], [None, 120.0]]}
    path.write_text(json.dumps(data))
    t = KernelEfficiency.from_json(path)
    assert t.table[1, 0] == 50.0 and t.peak == 120.0
    data["tflops"][0][0] = None
    path.write_text(json.dumps(data))
    with pytest.raises(ValueError, match="only impossible shapes"):
        KernelEfficiency.from_json(path)
    path.write_text(json.dumps({**data, "format": "other"}))
    with pytest.raises(ValueError, match="format"):
        KernelEfficiency.from_json(path)
    path.write_text(json.dumps({**data, "q_lens": [256, 128]}))
    with pytest.raises(ValueError, match="strictly increasing"):
        KernelEfficiency.from_json(path)
    with pytest.raises(FileNotFoundError):
        KernelEfficiency.from_json(tmp_path / "missing.json")
    # a measured table is used: a flat one removes the kernel-efficiency correction
    lay_default = build_layout("per-document", [300, 300], 4)
    lay_flat = build_layout("per-document", [300, 300], 4, efficiency=FLAT)
    assert lay_flat.max_work < lay_default.max_work


@pytest.mark.parametrize("name", ["per-sequence", "per-document", "adaptive", "hybrid", "per-document-te"])
def test_kept_key_rows_stay_within_the_all_gather_bound(name):
    """The K/V rows a rank materialises for backward (sum of its runs' key lengths) stay near
    (2c+1)/(2c) x the micro-batch's tokens: what S_max costs in attention memory (docs/megatron_launch.md)."""
    rng = np.random.default_rng(7)
    for _ in range(60):
        c = int(rng.choice([2, 4, 8]))
        lengths = rng.integers(1, 5000, size=int(rng.integers(1, 12)))
        if rng.random() < 0.3:
            lengths[rng.integers(lengths.size)] = int(rng.integers(20000, 60000))
        layout = build_layout(name, lengths, c)
        total = int(np.sum(layout.padded_lengths))
        kept = max(int(np.sum(s.key_lengths)) for s in layout.ranks)
        assert kept <= 1.01 * (2 * c + 1) / (2 * c) * total + 256, (name, c, lengths.tolist())
