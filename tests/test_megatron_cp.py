"""The one-plan batch path inside real megatron-core process groups (gloo, CPU): plan, upload, attention.

One multi-process run (8 gloo processes, a hard timeout so a hang fails the test) initialises
``parallel_state`` three times in turn, TP2/CP2/PP2, TP1/CP4/DP2 and TP1/CP2/DP4, and checks for every
layout that a micro-batch planned by the data path (``data.rank_micro_batch``) and uploaded once
(``cp_hooks.upload_micro_batch``) gives each CP rank exactly its layout's tokens, labels and positions;
that the CP ranks' tokens together tile the (padded) micro-batch, each position once; that the params
match the layout; that the middle-stage entry point gives the same params; that Megatron's own CP
split is left alone; that TP peers hold identical shards. With CP = 2 (under TP2) and CP = 4:
``WlbCoreAttention`` (THD and [s, b, h, d] inputs, GQA) over the CP group equals single-process
document-causal attention, and a whole Megatron ``SelfAttention`` (local spec, RoPE, GQA) under CP
equals the same layer without CP, forward and (CP-summed) weight gradients.
Single-process tests cover errors, the TE path's params, sequence-parallel padding and the RoPE hook.
"""

from __future__ import annotations

import dataclasses

import numpy as np
import pytest
import torch

pytest.importorskip("megatron.core")

from conftest import run_world  # noqa: E402

LAYOUTS = ("per-sequence", "per-document", "per-document-te", "adaptive", "hybrid")


# ---------------------------------------------------------------------------------------------------
# shared helpers (run inside the workers)
# ---------------------------------------------------------------------------------------------------

def _micro_batch(seed: int):
    """A packed micro-batch's pieces (short documents of 1 and 2 tokens, and long ones) over one token
    array; returns (MicroBatch, read function, the packed tokens)."""
    from megatron_wlb.packing.types import DocPiece, MicroBatch

    rng = np.random.default_rng(seed)
    lengths = np.concatenate([[1, 2], rng.integers(1, 40, size=5), [rng.integers(40, 90)]])
    rng.shuffle(lengths)
    tokens = rng.integers(1, 50_000, size=int(lengths.sum()))
    starts = np.concatenate([[0], np.cumsum(lengths)[:-1]])
    pieces = tuple(DocPiece(i, 0, int(n), 0) for i, n in enumerate(lengths))

    def read(doc: int, offset: int, length: int) -> np.ndarray:
        return tokens[starts[doc] + offset: starts[doc] + offset + length]

    return MicroBatch(pieces, capacity=int(lengths.sum()) + 64), read, tokens


def _planned(seed: int, name: str, cp_size: int, cp_rank: int, *, sequence_multiple: int = 1,
             rank_multiple: int = 1, cp_group=None):
    """(RankMicroBatch, uploaded batch, params, segment lengths, packed tokens) of one micro-batch."""
    from megatron_wlb.cp.plan import CPSharding
    from megatron_wlb.megatron.data.packed import rank_micro_batch
    from megatron_wlb.megatron.hooks.cp_hooks import upload_micro_batch

    mb, read, tokens = _micro_batch(seed)
    sharding = CPSharding(name, cp_size, cp_rank, sequence_multiple=sequence_multiple, rank_multiple=rank_multiple,
                          te_attention=name == "per-document-te")
    batch = rank_micro_batch(read, mb, sharding)
    data, params = upload_micro_batch(batch, torch.device("cpu"), cp_group=cp_group)
    return batch, data, params, batch.segment_lengths, tokens


def _padded_view(values: np.ndarray, lengths: np.ndarray, padded: np.ndarray) -> np.ndarray:
    """[T] values laid out in the padded micro-batch (padding = -1)."""
    out = np.full(int(padded.sum()), -1, dtype=np.int64)
    src = dst = 0
    for n, p in zip(lengths, padded):
        out[dst:dst + n] = values[src:src + n]
        src, dst = src + int(n), dst + int(p)
    return out


def _check_layouts(cp_group, cp_size: int, cp_rank: int, seed: int) -> None:
    """Every layout through the data path and the upload: tokens, tiling, metadata, entry points."""
    import torch.distributed as dist
    from megatron.core import utils as mcore_utils

    from megatron_wlb.cp.layouts import build_layout
    from megatron_wlb.megatron.args.settings import WlbSettings
    from megatron_wlb.megatron.hooks import cp_hooks

    original_split = mcore_utils.get_batch_on_this_cp_rank
    cp_hooks.install(WlbSettings(cp_sharding="per-document"))
    assert mcore_utils.get_batch_on_this_cp_rank is original_split  # Megatron's own CP split stays
    for i, name in enumerate(LAYOUTS):
        for multiple in (1, 7):
            batch, data, params, segs, tokens = _planned(seed * 100 + i, name, cp_size, cp_rank,
                                                         sequence_multiple=multiple, cp_group=cp_group)
            layout = build_layout(name, segs, cp_size)
            shard = layout.ranks[cp_rank]
            padded = np.asarray(layout.padded_lengths)
            assert params.gather.layout == layout.name and batch.layout.name == layout.name
            real = np.concatenate([tokens, np.zeros(int(segs.sum()) - tokens.size, dtype=np.int64)])
            full = _padded_view(real, segs, padded)[shard.token_index]
            expect = np.maximum(full, 0)  # TE's padding slots hold token 0
            assert np.array_equal(data["tokens"][0].numpy(), expect), name
            # labels: the next token of the same piece; the last token of a piece (and padding) has none
            bounds = np.concatenate([[0], np.cumsum(segs)])
            labels, mask = np.zeros_like(real), np.zeros_like(real)
            for j in range(len(batch.micro_batch.pieces)):
                a, b = bounds[j], bounds[j + 1]
                labels[a:b - 1], mask[a:b - 1] = real[a + 1:b], 1
            assert np.array_equal(data["labels"][0].numpy(),
                                  np.maximum(_padded_view(labels, segs, padded)[shard.token_index], 0)), name
            assert np.array_equal(data["loss_mask"][0].numpy(),
                                  np.maximum(_padded_view(mask, segs, padded)[shard.token_index], 0)), name
            held = expect > 0
            assert torch.equal(data["position_ids"][0], torch.as_tensor(shard.position_ids)), name
            assert data["attention_mask"] is None
            if name == "per-document-te":  # TE's own THD fields, and no CP group (TE keeps its own)
                assert params.varlen.te and params.cp_group is None
                assert np.array_equal(params.cu_seqlens_q_padded.numpy(), np.concatenate([[0], np.cumsum(padded)]))
            else:
                meta = params.varlen
                assert params.qkv_format == "thd" and params.cp_group is cp_group
                # the params' cu_seqlens are the record's own tensors (no carrier view); max_seqlen_* the kernel's
                assert params.cu_seqlens_q is meta.cu_seqlens_q and meta.cu_seqlens_q.dtype == torch.int32
                assert params.max_seqlen_q == meta.max_seqlen_q == int(np.diff(shard.cu_seqlens_q).max(initial=0))
                assert params.max_seqlen_kv == meta.max_seqlen_k == int(np.diff(shard.cu_seqlens_k).max(initial=0))
                assert np.array_equal(meta.cu_seqlens_q.numpy(), shard.cu_seqlens_q)
                assert np.array_equal(params.gather.segment_index.numpy(), shard.gather_rows())
                # the middle-stage entry point: the same params, without the tokens
                mid = cp_hooks.packed_seq_params_from_iterator(iter([batch]))
                assert torch.equal(mid.gather.segment_index, params.gather.segment_index)
                assert torch.equal(mid.varlen.positions, params.varlen.positions)
                # the pinned pretrain_gpt's THD path: the params our TP-rank hook handed out come back, whatever
                # copy of their cu_seqlens Megatron's get_batch hands on
                cp_hooks.hand_out(params)
                same = cp_hooks.get_thd_batch_on_this_cp_rank(dict(data), params.cu_seqlens_q.clone(), None, None)
                assert same[1] is params and same[0]["tokens"] is data["tokens"]
            # the CP ranks' token positions tile the padded micro-batch, each exactly once
            gathered = [None] * cp_size
            dist.all_gather_object(gathered, (shard.token_index.tolist(), expect[held].tolist()), group=cp_group)
            positions = np.concatenate([np.asarray(g[0], dtype=np.int64) for g in gathered])
            assert np.array_equal(np.sort(positions), np.arange(int(padded.sum()))), name
            assert sorted(t for g in gathered for t in g[1]) == sorted(tokens.tolist()), name
    cp_hooks.uninstall()


def _check_core_attention(cp_group, cp_size: int, cp_rank: int) -> None:
    """WlbCoreAttention over the CP group == single-process document-causal attention (GQA, THD and sbhd)."""
    from megatron.core.transformer.enums import AttnMaskType
    from megatron.core.transformer.transformer_config import TransformerConfig

    from megatron_wlb.cp.attention import reference_document_attention
    from megatron_wlb.megatron.hooks.attention import WlbCoreAttention

    heads, groups, dim = 4, 2, 8
    cfg = TransformerConfig(num_layers=1, hidden_size=heads * dim, num_attention_heads=heads, num_query_groups=groups,
                            kv_channels=dim, context_parallel_size=cp_size, attention_dropout=0.0,
                            hidden_dropout=0.0, use_cpu_initialization=True)
    module = WlbCoreAttention(cfg, 1, AttnMaskType.causal, "self", pg_collection=None)
    for name in ("per-sequence", "per-document", "hybrid"):
        batch, _, params, segs, _ = _planned(7, name, cp_size, cp_rank, cp_group=cp_group)
        total = int(segs.sum())
        gen = torch.Generator().manual_seed(11)  # identical full q/k/v on every rank
        q = torch.randn(total, heads, dim, generator=gen)
        k = torch.randn(total, groups, dim, generator=gen)
        v = torch.randn(total, groups, dim, generator=gen)
        ref = reference_document_attention(q, k, v, np.concatenate([[0], np.cumsum(segs)]))
        idx = torch.as_tensor(batch.shard.token_index)
        want = ref[idx].reshape(len(idx), -1)
        got = module(q[idx], k[idx], v[idx], None, attn_mask_type=AttnMaskType.causal, packed_seq_params=params)
        assert got.shape == (len(idx), heads * dim)
        torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)
        got4 = module(q[idx].unsqueeze(1), k[idx].unsqueeze(1), v[idx].unsqueeze(1), None,
                      attn_mask_type=AttnMaskType.causal, packed_seq_params=params)
        assert got4.shape == (len(idx), 1, heads * dim)
        torch.testing.assert_close(got4[:, 0], want, rtol=1e-5, atol=1e-5)
    # sequence-parallel padding rows (rank_multiple): the real rows are unchanged, the padding rows are 0
    batch, _, params, segs, _ = _planned(7, "hybrid", cp_size, cp_rank, rank_multiple=8, cp_group=cp_group)
    idx = torch.as_tensor(batch.shard.token_index)
    n, pad = len(idx), params.gather.local_pad
    assert (n + pad) % 8 == 0 and pad < 8 and batch.num_rows == n + pad
    rows = [t[idx] for t in (q, k, v)]
    rows = [torch.cat([r, torch.randn(pad, *r.shape[1:])]) for r in rows]
    got = module(*rows, None, attn_mask_type=AttnMaskType.causal, packed_seq_params=params)
    torch.testing.assert_close(got[:n], ref[idx].reshape(n, -1), rtol=1e-5, atol=1e-5)
    assert torch.all(got[n:] == 0)
    with pytest.raises(RuntimeError, match="without WLB-LLM shard metadata"):
        module(q[:4], k[:4], v[:4], None, packed_seq_params=None)


def _check_self_attention(cp_size: int, cp_rank: int) -> None:
    """A Megatron SelfAttention (local spec, RoPE, GQA) under CP == the same weights without CP."""
    import torch.distributed as dist
    from megatron.core import parallel_state
    from megatron.core.models.common.embeddings.rotary_pos_embedding import RotaryEmbedding
    from megatron.core.models.gpt.gpt_layer_specs import get_gpt_layer_local_spec
    from megatron.core.process_groups_config import ProcessGroupCollection
    from megatron.core.transformer.spec_utils import build_module
    from megatron.core.transformer.transformer_config import TransformerConfig

    from megatron_wlb.megatron.args.settings import WlbSettings
    from megatron_wlb.megatron.hooks import cp_hooks
    from megatron_wlb.megatron.hooks.attention import WlbCoreAttention

    heads, groups, dim = 4, 2, 8
    hidden = heads * dim
    cfg = TransformerConfig(num_layers=1, hidden_size=hidden, num_attention_heads=heads, num_query_groups=groups,
                            kv_channels=dim, context_parallel_size=cp_size, attention_dropout=0.0,
                            hidden_dropout=0.0, use_cpu_initialization=True, add_bias_linear=False)
    spec = get_gpt_layer_local_spec().submodules.self_attention
    cp_hooks.install(WlbSettings(cp_sharding="per-document"))
    torch.manual_seed(5)
    layer = build_module(spec, config=cfg, layer_number=1)
    assert isinstance(layer.core_attention, WlbCoreAttention)
    # the reference layer: same weights, a CP group of one (every rank alone)
    singles = [dist.new_group([r]) for r in range(dist.get_world_size())]
    pgs = ProcessGroupCollection()
    pgs.tp = parallel_state.get_tensor_model_parallel_group()
    pgs.cp = singles[dist.get_rank()]
    cfg1 = TransformerConfig(num_layers=1, hidden_size=hidden, num_attention_heads=heads, num_query_groups=groups,
                             kv_channels=dim, context_parallel_size=1, attention_dropout=0.0, hidden_dropout=0.0,
                             use_cpu_initialization=True, add_bias_linear=False)
    ref_layer = build_module(spec, config=cfg1, layer_number=1,
                             pg_collection=pgs)
    ref_layer.load_state_dict(layer.state_dict())
    group = parallel_state.get_context_parallel_group()
    batch, _, params, segs, _ = _planned(3, "per-document", cp_size, cp_rank, cp_group=group)
    _, _, params1, _, _ = _planned(3, "per-document", 1, 0, cp_group=pgs.cp)
    total = int(segs.sum())
    x = torch.randn(total, 1, hidden, generator=torch.Generator().manual_seed(9))
    rope = RotaryEmbedding(kv_channels=dim, rotary_percent=1.0, use_cpu_initialization=True)
    # RotaryEmbedding.forward moves to CUDA; build its [S, 1, 1, dim] table the same way on CPU
    angles = torch.outer(torch.arange(params.varlen.rope_length, dtype=rope.inv_freq.dtype), rope.inv_freq)
    freqs = torch.cat((angles, angles), dim=-1)[:, None, None, :]
    idx = torch.as_tensor(batch.shard.token_index)
    out, _ = layer(x[idx], None, rotary_pos_emb=freqs, packed_seq_params=params)
    ref, _ = ref_layer(x, None, rotary_pos_emb=freqs, packed_seq_params=params1)
    torch.testing.assert_close(out, ref[idx], rtol=1e-4, atol=1e-5)
    # backward: the CP ranks' weight gradients, summed over the CP group (as Megatron's DP x CP grad
    # reduction does), equal the gradients of the layer run without CP
    grad_out = torch.randn(total, 1, hidden, generator=torch.Generator().manual_seed(13))
    (out * grad_out[idx]).sum().backward()
    (ref * grad_out).sum().backward()
    for (name, p), (_, p1) in zip(layer.named_parameters(), ref_layer.named_parameters(), strict=True):
        g = p.grad.clone()
        dist.all_reduce(g, group=group)
        torch.testing.assert_close(g, p1.grad, rtol=1e-4, atol=1e-5, msg=lambda m, n=name: f"{n}: {m}")
    # without the RoPE hook Megatron's THD RoPE would rotate by the wrong positions: the hook matters
    cp_hooks.uninstall()
    try:
        with torch.no_grad():
            bad, _ = layer(x[idx], None, rotary_pos_emb=freqs, packed_seq_params=params)
        assert not torch.allclose(bad, ref[idx], atol=1e-3)
    except (RuntimeError, ValueError):
        pass  # Megatron's own THD RoPE may also just refuse our layout's shapes


# ---------------------------------------------------------------------------------------------------
# workers
# ---------------------------------------------------------------------------------------------------

def _worker_cp(rank, world, configs):
    """For each (tp, cp, pp, attention) in turn: initialise parallel_state, check, destroy."""
    import torch.distributed as dist
    from megatron.core import parallel_state

    for tp, cp, pp, attention in configs:
        parallel_state.initialize_model_parallel(tensor_model_parallel_size=tp, pipeline_model_parallel_size=pp,
                                                 context_parallel_size=cp)
        try:
            group = parallel_state.get_context_parallel_group()
            cp_size = parallel_state.get_context_parallel_world_size()
            cp_rank = parallel_state.get_context_parallel_rank()
            assert cp_size == cp and group.size() == cp
            assert parallel_state.get_data_parallel_world_size() == world // (tp * cp * pp)
            seed = parallel_state.get_data_parallel_rank() + 10 * parallel_state.get_pipeline_model_parallel_rank()
            _check_layouts(group, cp_size, cp_rank, seed)
            if tp > 1:  # TP peers hold identical shards
                from megatron_wlb.cp.layouts import build_layout

                mb, _, _ = _micro_batch(seed)
                layout = build_layout("adaptive", [p.length for p in mb.pieces], cp_size)
                mine = layout.ranks[cp_rank].token_index.tolist()
                peers = [None] * tp
                dist.all_gather_object(peers, mine, group=parallel_state.get_tensor_model_parallel_group())
                assert all(p == mine for p in peers)
            if attention:
                _check_core_attention(group, cp_size, cp_rank)
                _check_self_attention(cp_size, cp_rank)
        finally:
            parallel_state.destroy_model_parallel()
        dist.barrier()


@pytest.mark.slow
def test_world8_tp2_cp2_pp2_then_cp4_dp2_then_cp2_dp4():
    """One world, three 4D layouts in turn. Its 8 processes fork from this one with megatron.core's modules
    already imported (each would otherwise spend seconds of CPU importing them, 8 at once on the 2 cores)."""
    import megatron.core.models.gpt.gpt_layer_specs  # noqa: F401 - what the workers import, imported once here
    import megatron.core.parallel_state  # noqa: F401

    run_world(_worker_cp, 8, start_method="fork",
              configs=[(2, 2, 2, True), (1, 4, 1, True), (1, 2, 1, False)])


# ---------------------------------------------------------------------------------------------------
# single-process checks
# ---------------------------------------------------------------------------------------------------

def test_plan_errors_and_te_requirement():
    from megatron_wlb.cp.plan import CPSharding, micro_batch_lengths, rank_batch
    from megatron_wlb.megatron.args.settings import WlbSettings
    from megatron_wlb.megatron.hooks import cp_hooks

    with pytest.raises(ValueError, match="outside the CP group"):
        CPSharding("per-document", 2, 2)
    with pytest.raises(ValueError, match="must be >= 1"):
        CPSharding("per-document", 2, 0, rank_multiple=0)
    with pytest.raises(ValueError, match="te_attention needs the per-document-te"):
        CPSharding("per-document", 2, 0, te_attention=True)
    with pytest.raises(ValueError, match="CP layout 'ring'"):
        CPSharding("ring", 2, 0)
    with pytest.raises(ValueError, match=">= 1 token"):
        rank_batch(np.array([3, 0]), CPSharding())
    with pytest.raises(ValueError, match="of \\[4, 4, 4\\] entries for a packed sequence of 3 tokens"):
        rank_batch(np.array([3]), CPSharding(), packed=(np.zeros(4), np.zeros(4), np.zeros(4)))
    assert micro_batch_lengths([5, 4], 4).tolist() == [5, 4, 3]
    assert micro_batch_lengths([], 4, empty_tokens=6).tolist() == [8]
    if not cp_hooks.te_available():
        with pytest.raises(ValueError, match="per-document-te.*transformer_engine is not installed"):
            cp_hooks.install(WlbSettings(cp_sharding="per-document-te"))
    with pytest.raises(RuntimeError, match="not installed"):
        cp_hooks.get_thd_batch_on_this_cp_rank({}, torch.tensor([0, 4]), None, None, 2, 0)
    with pytest.raises(RuntimeError, match="not a WLB RankMicroBatch"):
        cp_hooks.packed_seq_params_from_iterator(iter([{"tokens": torch.zeros(1, 4)}]))


def _te_rank(lengths: list[int], rank: int, rank_multiple: int = 1):
    from megatron_wlb.cp.plan import CPSharding, rank_batch
    from megatron_wlb.megatron.hooks.cp_hooks import upload_micro_batch

    tokens = np.arange(1, sum(lengths) + 1)
    rows = rank_batch(np.array(lengths), CPSharding("per-document-te", 2, rank, rank_multiple=rank_multiple,
                                                    te_attention=True),
                      packed=(tokens, tokens, np.ones(tokens.size, dtype=np.float32)))
    return upload_micro_batch(rows, torch.device("cpu"), cp_group=None)


def test_te_padding_document_rows_are_padding():
    """per-document-te under sequence parallelism: when the real documents need no TE padding but the ranks need a
    padding document, that document's rows are padding (token 0, loss mask 0), not rows past the sequence."""
    out, params = _te_rank([4], 0, rank_multiple=4)  # TE layout [4, 4]: rank 0 holds [0, 3] and [4, 7]
    assert out["tokens"][0].tolist() == [1, 4, 0, 0] and out["loss_mask"][0].tolist() == [1.0, 1.0, 0.0, 0.0]
    assert params.cu_seqlens_q.tolist() == [0, 4, 8] and params.varlen.te


def test_te_params_describe_te_layout():
    """The TE path's params: real and padded offsets of TE's per-document layout (golden vectors)."""
    out, params = _te_rank([8, 8], 0)
    assert out["tokens"][0].tolist() == [1, 2, 7, 8, 9, 10, 15, 16]  # rank 0 owns [0,1,6,7,8,9,14,15]
    assert params.varlen.te and params.cu_seqlens_q_padded.tolist() == [0, 8, 16]
    assert params.cp_group is None  # as Megatron's own THD path: TE keeps the CP group it was built with
    assert params.max_seqlen_q == 8 and params.qkv_format == "thd"
    # nothing padded: the padded offsets are the very tensor of the real ones (TE would otherwise infer padding
    # between sequences and rule out its FlashAttention backend; issue 20, item 9)
    assert params.cu_seqlens_q_padded is params.cu_seqlens_q and params.cu_seqlens_kv_padded is params.cu_seqlens_q
    out, params = _te_rank([3, 3], 1)
    assert params.cu_seqlens_q.tolist() == [0, 3, 6] and params.cu_seqlens_q_padded.tolist() == [0, 4, 8]
    assert params.cu_seqlens_q_padded is not params.cu_seqlens_q
    assert out["tokens"][0].tolist() == [2, 3, 5, 6]  # rank 1 owns padded positions [1, 2, 5, 6]


def test_sequence_parallel_padding():
    """rank_multiple (TP under --sequence-parallel): every rank's row count becomes a multiple of it."""
    for name in ("hybrid", "per-document", "per-sequence"):
        seen = []
        for rank in range(4):
            batch, out, params, _, tokens = _planned(6, name, 4, rank, rank_multiple=4)
            n, pad = len(batch.shard.token_index), params.gather.local_pad
            assert out["tokens"].shape[1] == n + pad and (n + pad) % 4 == 0 and 0 <= pad < 4
            assert torch.all(out["loss_mask"][0, n:] == 0) and torch.all(out["tokens"][0, n:] == 0)
            assert params.varlen.positions.numel() == n + pad
            seen += out["tokens"][0, :n].tolist()
        assert sorted(seen) == sorted(tokens.tolist())  # padding rows add no tokens, lose none
    # TE path: one trailing padding document (identical on every rank) instead of local rows
    counts = []
    for rank in range(2):
        out, params = _te_rank([3, 3], rank, rank_multiple=8)
        assert params.cu_seqlens_q.tolist() == [0, 3, 6, 14] and params.cu_seqlens_q_padded.tolist() == [0, 4, 8, 16]
        counts.append(out["tokens"].shape[1])
        assert out["loss_mask"].sum() == (out["tokens"] > 0).sum()
    assert counts == [8, 8]


def test_rope_hook_rotates_by_true_positions():
    """The wrapped apply_rotary_pos_emb rotates each local token by its own document position, inside an attention
    called with a WLB micro-batch's params (whatever copy of their cu_seqlens it is handed); Megatron's own params
    and unpacked batches go to Megatron's RoPE; a lost record raises, it never falls back (issue 60)."""
    from megatron.core.models.common.embeddings.rope_utils import _apply_rotary_pos_emb_bshd
    from megatron.core.packed_seq_params import PackedSeqParams
    from megatron.core.transformer.transformer_config import TransformerConfig

    from megatron_wlb.megatron.hooks import rope
    from megatron_wlb.megatron.hooks.attention import WlbPackedSeqParams
    from megatron_wlb.megatron.hooks.rope import attention_scope

    cfg = TransformerConfig(num_layers=1, hidden_size=16, num_attention_heads=2, use_cpu_initialization=True)
    fallen_through = []

    def megatron_rope(t, freqs, config, cu_seqlens=None, mscale=1.0, cp_group=None):
        fallen_through.append(cu_seqlens)
        return t

    hooked = rope.wlb_apply_rotary_pos_emb(megatron_rope)
    for rank in range(2):
        batch, _, params, segs, _ = _planned(4, "hybrid", 2, rank)
        total = int(segs.sum())
        t = torch.randn(total, 2, 8, generator=torch.Generator().manual_seed(1))
        freqs = torch.randn(int(segs.max()), 1, 1, 8, generator=torch.Generator().manual_seed(2))
        positions = torch.as_tensor(np.concatenate([np.arange(n) for n in segs]))
        full = _apply_rotary_pos_emb_bshd(t.unsqueeze(1), freqs[positions]).squeeze(1)
        idx = torch.as_tensor(batch.shard.token_index)
        cu = params.cu_seqlens_q
        with attention_scope(params):
            # the params' cu_seqlens, or any copy Megatron's code might make of them: the record is the params'
            for given in (cu, params.cu_seqlens_kv, cu.clone(), cu.to(torch.int32, copy=True), cu.contiguous(),
                          cu.view(1, -1)[0].clone()):
                torch.testing.assert_close(hooked(t[idx], freqs, cfg, cu_seqlens=given), full[idx])
            with pytest.raises(ValueError, match="beyond"):
                hooked(t[idx], freqs[:2], cfg, cu_seqlens=cu)
            with pytest.raises(RuntimeError, match="not those of the micro-batch"):
                hooked(t[idx], freqs, cfg, cu_seqlens=torch.zeros(cu.numel() + 1, dtype=torch.int32))
            hooked(t[idx], freqs, cfg, cu_seqlens=None)  # an unpacked call: Megatron's own
        assert len(fallen_through) == 1
        # Megatron's own THD params in scope: Megatron's RoPE (a run that also reads Megatron's loaders)
        with attention_scope(PackedSeqParams(qkv_format="thd", cu_seqlens_q=cu, cu_seqlens_kv=cu)):
            hooked(t[idx], freqs, cfg, cu_seqlens=cu)
        assert len(fallen_through) == 2
        fallen_through.clear()
        # the record lost: packed cu_seqlens outside an attention holding params, or WLB params without a record
        with pytest.raises(RuntimeError, match="record is lost"):
            hooked(t[idx], freqs, cfg, cu_seqlens=cu)
        with attention_scope(None), pytest.raises(RuntimeError, match="record is lost"):
            hooked(t[idx], freqs, cfg, cu_seqlens=cu)
        with attention_scope(WlbPackedSeqParams(qkv_format="thd", cu_seqlens_q=cu, cu_seqlens_kv=cu)), \
                pytest.raises(RuntimeError, match="without their Varlen record"):
            hooked(t[idx], freqs, cfg, cu_seqlens=cu)
        assert fallen_through == []


def test_rope_refuses_megatrons_own_params_when_every_batch_is_ours(monkeypatch):
    """Where every batch of the run is a WLB micro-batch, plain PackedSeqParams reaching RoPE mean the record was
    lost (rebuilt by Megatron's code from the tensors): RoPE raises instead of rotating Megatron's way."""
    from megatron.core.packed_seq_params import PackedSeqParams
    from megatron.core.transformer.transformer_config import TransformerConfig

    from megatron_wlb.megatron.hooks import rope
    from megatron_wlb.megatron.state import process as adapter
    from megatron_wlb.megatron.state.checkpoint import DataStateRegistry

    cfg = TransformerConfig(num_layers=1, hidden_size=16, num_attention_heads=2, use_cpu_initialization=True)
    hooked = rope.wlb_apply_rotary_pos_emb(lambda t, *a, **k: t)
    _, _, params, segs, _ = _planned(4, "hybrid", 1, 0)
    registry = DataStateRegistry()
    registry.iterators.append(object())
    monkeypatch.setattr(adapter, "_RUNTIME", adapter.Runtime(registry=registry))
    rebuilt = PackedSeqParams(qkv_format="thd", cu_seqlens_q=params.cu_seqlens_q.clone(),
                              cu_seqlens_kv=params.cu_seqlens_kv.clone())
    x = torch.randn(int(segs.sum()), 2, 8)
    with rope.attention_scope(rebuilt), pytest.raises(RuntimeError, match="record was lost"):
        hooked(x, torch.randn(int(segs.max()), 1, 1, 8), cfg, cu_seqlens=rebuilt.cu_seqlens_q)


def test_the_get_batch_route_survives_copies_and_raises_when_lost(monkeypatch):
    """The pinned 0.16 get_batch and the patched 0.19 forward_step take back the params ``pinned_batch_fields``
    handed out, whatever copy of its cu_seqlens Megatron's code made (issue 60); none handed out, one never taken,
    or another micro-batch's cu_seqlens raise in one line."""
    from megatron_wlb.megatron.hooks import cp_hooks
    from megatron_wlb.megatron.state import process as adapter
    from megatron_wlb.megatron.state.checkpoint import DataStateRegistry

    batch, _, _, _, _ = _planned(5, "per-document", 2, 1)
    copies = [lambda c: c, lambda c: c.clone(), lambda c: c.to("cpu", copy=True), lambda c: c.contiguous(),
              lambda c: c.unsqueeze(0), lambda c: c.view(1, -1).clone()]
    for copy in copies:
        fields = cp_hooks.pinned_batch_fields(batch)
        params = cp_hooks.packed_seq_params_of(copy(fields["cu_seqlens"]))
        assert params.cu_seqlens_q is fields["cu_seqlens"] and params.varlen is not None
        assert params.max_seqlen_q == int(fields["max_seqlen"][0]) == params.varlen.max_seqlen_q
    with pytest.raises(RuntimeError, match="no WLB micro-batch was handed out"):
        cp_hooks.packed_seq_params_of(fields["cu_seqlens"])
    fields = cp_hooks.pinned_batch_fields(batch)
    with pytest.raises(RuntimeError, match="never taken back"):
        cp_hooks.pinned_batch_fields(batch)
    with pytest.raises(RuntimeError, match=r"not those of the micro-batch get_batch handed out \(\d+ entries"):
        cp_hooks.packed_seq_params_of(fields["cu_seqlens"][:-1].clone())
    assert not cp_hooks.handed_out()  # taken, even when refused: the next micro-batch starts clean
    # the pinned 0.16 THD hook with nothing handed out: Megatron's own batch, unless every batch is ours
    registry = DataStateRegistry()
    registry.iterators.append(object())
    monkeypatch.setattr(adapter, "_RUNTIME", adapter.Runtime(registry=registry))
    with pytest.raises(RuntimeError, match="its record was lost"):
        cp_hooks.get_thd_batch_on_this_cp_rank({}, fields["cu_seqlens"].clone(), None, None)


def test_max_seqlen_is_the_kernels_and_the_rotary_table_the_plans():
    """The params' max_seqlen_q / max_seqlen_kv are the longest query run and key segment the kernel sees (issue
    60: they held the rotary table's length); ``RotaryEmbedding.get_rotary_seq_len``, wrapped, sizes the table by
    the record's ``rope_length`` for a WLB micro-batch and is Megatron's own otherwise."""
    from megatron.core.packed_seq_params import PackedSeqParams

    from megatron_wlb.megatron.hooks import rope

    def megatron_len(self, inference_context, transformer, transformer_input, transformer_config,
                     packed_seq_params=None, *, inference_params=None):
        return max(packed_seq_params.max_seqlen_q, packed_seq_params.max_seqlen_kv)

    wrapped = rope.wrap_get_rotary_seq_len(megatron_len)
    for name in ("per-sequence", "per-document", "hybrid"):
        for rank in range(2):
            batch, _, params, _, _ = _planned(8, name, 2, rank)
            shard = batch.shard
            assert params.max_seqlen_q == int(np.diff(shard.cu_seqlens_q).max(initial=0)) == shard.max_seqlen_q
            assert params.max_seqlen_kv == int(np.diff(shard.cu_seqlens_k).max(initial=0)) == shard.max_seqlen_k
            rope_length = params.varlen.rope_length
            assert rope_length == max(int(batch.position_ids.max()) + 1, int(batch.segment_lengths.max()))
            assert wrapped(None, None, None, None, None, params) == rope_length
            assert wrapped(None, None, None, None, None, packed_seq_params=params) == rope_length
    plain = PackedSeqParams(qkv_format="thd", max_seqlen_q=7, max_seqlen_kv=9)
    assert wrapped(None, None, None, None, None, plain) == 9

    def renamed(self, inference_context, transformer, transformer_input, transformer_config, packed=None):
        return 0

    with pytest.raises(RuntimeError, match="takes no packed_seq_params"):  # a release that renamed the argument
        rope.wrap_get_rotary_seq_len(renamed)


def test_swap_core_attention_on_spec():
    from megatron.core.models.gpt.gpt_layer_specs import get_gpt_layer_local_spec
    from megatron.core.transformer.dot_product_attention import DotProductAttention

    from megatron_wlb.megatron.hooks.attention import WlbCoreAttention, swap_core_attention

    spec = get_gpt_layer_local_spec()
    swapped = swap_core_attention(spec)
    core = swapped.submodules.self_attention.submodules.core_attention
    assert core.func is WlbCoreAttention and core.keywords["inner"] is DotProductAttention
    assert spec.submodules.self_attention.submodules.core_attention is DotProductAttention  # input untouched
    assert swap_core_attention(swapped).submodules.self_attention.submodules.core_attention is core  # idempotent


def test_unsupported_attention_configs_are_refused():
    from megatron.core.transformer.enums import AttnMaskType
    from megatron.core.transformer.transformer_config import TransformerConfig

    from megatron_wlb.megatron.hooks.attention import WlbCoreAttention

    cfg = TransformerConfig(num_layers=1, hidden_size=16, num_attention_heads=2, attention_dropout=0.1,
                            use_cpu_initialization=True)
    with pytest.raises(ValueError, match="--attention-dropout 0.0"):
        WlbCoreAttention(cfg, 1, AttnMaskType.causal, "self")


def test_cp_sharding_from_args_uses_the_run_model_and_padding():
    """The iterator's CP plan: the run's layout and cost model; T padded to CP (x TP under SP)."""
    from types import SimpleNamespace

    from megatron_wlb.megatron import cp_sharding_from_args
    from megatron_wlb.megatron.args.settings import WlbSettings
    from megatron_wlb.megatron.args.validation import cost_model_from_args

    args = SimpleNamespace(hidden_size=64, num_layers=2, num_attention_heads=4, num_query_groups=2,
                           group_query_attention=True, ffn_hidden_size=128, padded_vocab_size=256, swiglu=True,
                           tensor_model_parallel_size=2, context_parallel_size=2, pipeline_model_parallel_size=1,
                           data_parallel_size=1, sequence_parallel=True)
    settings = WlbSettings(cp_sharding="adaptive")
    cost = cost_model_from_args(args, settings)
    sharding = cp_sharding_from_args(args, settings, 1, cost)
    assert sharding.cost is cost and cost.model.hidden == 64 and cost.model.num_kv_heads == 2
    assert (sharding.layout, sharding.cp_size, sharding.cp_rank) == ("adaptive", 2, 1)
    assert (sharding.sequence_multiple, sharding.rank_multiple, sharding.te_attention) == (4, 2, False)
    args.sequence_parallel = False
    assert cp_sharding_from_args(args, settings, 0).sequence_multiple == 2


def test_rebind_reaches_every_importer_and_survives_lazy_modules():
    """A module that imported a function (as pretrain_gpt imports Megatron's) is rebound; lazy modules
    whose __getattr__ raises are left alone; rebinding back restores the original everywhere."""
    import sys
    import types

    from megatron_wlb.megatron.hooks.rebind import rebind

    def original():
        return "megatron"

    def replacement():
        return "wlb"

    importer, owner = types.ModuleType("fake_pretrain_gpt"), types.ModuleType("fake_core_utils")
    importer.get_batch = owner.get_batch = original

    class Lazy(types.ModuleType):
        def __getattr__(self, name):
            raise ImportError(f"lazy module: {name}")

    sys.modules.update(fake_pretrain_gpt=importer, fake_core_utils=owner, fake_lazy=Lazy("fake_lazy"))
    try:
        assert sorted(rebind("get_batch", original, replacement)) == ["fake_core_utils", "fake_pretrain_gpt"]
        assert importer.get_batch is replacement and owner.get_batch is replacement
        rebind("get_batch", replacement, original, skip=("fake_core_utils",))
        assert importer.get_batch is original and owner.get_batch is replacement
    finally:
        for name in ("fake_pretrain_gpt", "fake_core_utils", "fake_lazy"):
            del sys.modules[name]


def test_fallback_attention_refuses_batches_without_params_when_every_batch_is_packed(monkeypatch):
    """A packed micro-batch that lost its params on the way would attend across its documents."""
    from megatron.core.transformer.enums import AttnMaskType
    from megatron.core.transformer.transformer_config import TransformerConfig

    from megatron_wlb.megatron.hooks.attention import WlbCoreAttention
    from megatron_wlb.megatron.state import process as adapter
    from megatron_wlb.megatron.state.checkpoint import DataStateRegistry

    calls = []

    class Inner(torch.nn.Module):
        def __init__(self, **kwargs):
            super().__init__()

        def forward(self, q, k, v, mask, **kwargs):
            calls.append(kwargs.get("packed_seq_params"))
            return q.flatten(-2)

    cfg = TransformerConfig(num_layers=1, hidden_size=16, num_attention_heads=2, attention_dropout=0.0,
                            use_cpu_initialization=True)
    module = WlbCoreAttention(cfg, 1, AttnMaskType.causal, "self", inner=Inner)
    q = torch.zeros(4, 1, 2, 8)
    registry = DataStateRegistry()
    registry.iterators.append(object())  # a WLB iterator is in use
    monkeypatch.setattr(adapter, "_RUNTIME", adapter.Runtime(registry=registry))
    with pytest.raises(RuntimeError, match="without packed-sequence params"):
        module(q, q, q, None)
    monkeypatch.setattr(adapter, "_RUNTIME", adapter.Runtime(registry=registry, megatron_loaders=True))
    module(q, q, q, None)  # Megatron's own (unpacked) batches in the run: the fallback is right
    monkeypatch.setattr(adapter, "_RUNTIME", adapter.Runtime())
    module(q, q, q, None)  # no WLB data at all
    assert calls == [None, None]


def test_the_batch_path_reads_nothing_back_from_the_device(monkeypatch):
    """get_batch (one upload) and every attention layer's forward and backward up to the kernel never turn a
    tensor into a host value: with Tensor.item/tolist/cpu/numpy/__int__/__float__/__bool__/__index__ made to
    fail, a micro-batch goes from the iterator through two layers. (On a GPU each would be a sync.)"""
    from megatron.core.transformer.enums import AttnMaskType
    from megatron.core.transformer.transformer_config import TransformerConfig

    import megatron_wlb.cp.attention as cp_attention
    from megatron_wlb.cp.plan import CPSharding
    from megatron_wlb.megatron.data.packed import rank_micro_batch
    from megatron_wlb.megatron.entry import launcher
    from megatron_wlb.megatron.hooks.attention import WlbCoreAttention

    mb, read, _ = _micro_batch(5)
    batch = rank_micro_batch(read, mb, CPSharding("hybrid", rank_multiple=4))
    cfg = TransformerConfig(num_layers=2, hidden_size=16, num_attention_heads=2, attention_dropout=0.0,
                            use_cpu_initialization=True)
    layers = [WlbCoreAttention(cfg, n, AttnMaskType.causal, "self") for n in (1, 2)]

    def kernel(q, k, v, cu_q, cu_k, max_q, max_k, scale):  # stands in for the GPU kernel: shapes only
        assert type(max_q) is int and type(max_k) is int and cu_q.dtype == torch.int32
        return q * 1.0 + (k.sum() + v.sum()) * 0.0

    monkeypatch.setattr(cp_attention, "resolve_backend", lambda backend, device, dtype=None: "torch-varlen")
    monkeypatch.setattr(cp_attention, "_torch_varlen", kernel)

    def device_to_host(*args, **kwargs):
        raise AssertionError("a tensor was read back to the host in the batch path")

    for name in ("item", "tolist", "cpu", "numpy", "__int__", "__float__", "__bool__", "__index__"):
        monkeypatch.setattr(torch.Tensor, name, device_to_host)
    tokens, labels, loss_mask, position_ids, params = launcher.get_batch(iter([batch]))
    rows = tokens.shape[1]
    q = torch.randn(rows, 2, 8, requires_grad=True)
    out = q
    for layer in layers:  # every layer reads the same device tensors of the one upload
        out = layer(out.view(rows, 2, 8), out.view(rows, 2, 8), out.view(rows, 2, 8), None,
                    attn_mask_type=AttnMaskType.causal, packed_seq_params=params)
    out.sum().backward()
    monkeypatch.undo()
    assert q.grad is not None and rows == batch.num_rows and rows % 4 == 0


def test_the_varlen_record_travels_in_the_params_alone():
    """Issue 47 / 60: one varlen record, kept apart from the batch tensors, reaching the attention and RoPE by the
    params alone (no tensor carries it); nothing holds it once the params are gone (no cycle)."""
    import gc
    import weakref

    from megatron_wlb.cp.device import GatherPlan, Varlen

    # the kernel record is small (TorchTitan's has 5 fields): cu_seqlens, max lengths, positions; the all-gather
    # plan apart; neither holds a batch tensor or a process group
    assert [f.name for f in dataclasses.fields(Varlen)] == ["cu_seqlens_q", "cu_seqlens_k", "max_seqlen_q",
                                                            "max_seqlen_k", "positions", "rope_length",
                                                            "cu_seqlens_padded"]
    assert not {"tokens", "labels", "loss_mask", "position_ids", "group"} & \
        {f.name for f in (*dataclasses.fields(Varlen), *dataclasses.fields(GatherPlan))}
    _, data, params, _, _ = _planned(3, "hybrid", 2, 1)
    tensors = [t for t in (*data.values(), params.cu_seqlens_q, params.cu_seqlens_kv, *params.varlen.tensors(),
                           *params.gather.tensors()) if isinstance(t, torch.Tensor)]
    assert not [t for t in tensors if any(isinstance(v, Varlen | GatherPlan) for v in vars(t).values())]
    record = weakref.ref(params.varlen)
    gc.disable()
    try:
        del params
        assert record() is None  # freed by reference counting
    finally:
        gc.enable()


def test_rope_hook_passes_newer_megatron_keywords_through():
    """Megatron-LM main calls apply_rotary_pos_emb with more keywords (max_seqlen, inverse, ...): the hook hands
    them to Megatron's function outside a WLB micro-batch, ignores max_seqlen for ours (positions come from the
    plan) and refuses what it cannot do there."""
    from megatron.core.transformer.transformer_config import TransformerConfig

    from megatron_wlb.megatron.hooks import rope

    cfg = TransformerConfig(num_layers=1, hidden_size=16, num_attention_heads=2, use_cpu_initialization=True)
    seen = []

    def main_rope(t, freqs, config, cu_seqlens=None, mscale=1.0, cp_group=None, mla_rotary_interleaved=False,
                  inverse=False, mla_output_remove_interleaving=False, max_seqlen=None):
        seen.append({"inverse": inverse, "max_seqlen": max_seqlen})
        return t

    hooked = rope.wlb_apply_rotary_pos_emb(main_rope)
    t = torch.randn(6, 2, 8)
    freqs = torch.randn(8, 1, 1, 8)
    hooked(t, freqs, cfg, cu_seqlens=None, inverse=True, max_seqlen=6)
    assert seen == [{"inverse": True, "max_seqlen": 6}]
    batch, _, params, segs, _ = _planned(4, "hybrid", 1, 0)
    x = torch.randn(int(segs.sum()), 2, 8)
    with rope.attention_scope(params):
        out = hooked(x, torch.randn(int(segs.max()), 1, 1, 8), cfg, cu_seqlens=params.cu_seqlens_q, max_seqlen=5)
        assert out.shape == x.shape and len(seen) == 1  # ours: rotated by the plan's positions
        with pytest.raises(ValueError, match="inverse is not supported"):
            hooked(x, torch.randn(int(segs.max()), 1, 1, 8), cfg, cu_seqlens=params.cu_seqlens_q, inverse=True)


def test_the_device_record_is_one_buffer_copied_once():
    """cp.device.upload: every array of the host record lands in one buffer (one host -> device copy, from pinned
    memory on CUDA); the fields are views of it and equal the host record's; the TE path uses the same upload."""
    from megatron_wlb.cp.device import upload

    batch, data, params, _, _ = _planned(6, "per-document", 2, 1, rank_multiple=4)
    device = upload(batch, "cpu")
    varlen = device.varlen
    views = [device.tokens, device.labels, device.loss_mask, device.position_ids, varlen.positions,
             varlen.cu_seqlens_q, varlen.cu_seqlens_k]
    assert len({t.untyped_storage().data_ptr() for t in views}) == 1
    assert device.tokens.tolist() == batch.tokens.tolist() and device.loss_mask.tolist() == batch.loss_mask.tolist()
    assert varlen.cu_seqlens_k.tolist() == batch.cu_seqlens_k.tolist() and device.gather.local_pad == batch.local_pad
    assert device.gather.segment_index.tolist() == batch.shard.gather_rows().tolist()
    meta = upload(batch, "cpu", tokens=False)  # middle stages: the metadata only, from the same function
    assert meta.tokens is None and meta.gather.segment_index.tolist() == device.gather.segment_index.tolist()
    out, te = _te_rank([3, 3], 1)
    assert te.varlen.te and te.cu_seqlens_q.untyped_storage().data_ptr() == out["tokens"].untyped_storage().data_ptr()
