"""CP hooks inside real megatron-core 0.16.1 process groups (gloo, CPU): sharding, metadata, attention.

One multi-process run (torch.multiprocessing spawn, 8 gloo processes, a free port, a hard timeout so
a hang fails the test) initialises ``parallel_state`` three times in turn, TP2/CP2/PP2, TP1/CP4/DP2 and
TP1/CP2/DP4, and checks for every layout that: the patched ``megatron.core.utils.get_batch_on_this_cp_rank``
gives each CP rank exactly its layout's tokens; the CP ranks' tokens together tile the (padded)
micro-batch, each position once; the stashed ``WlbPackedSeqParams`` matches the layout; the THD entry
point and the middle-stage entry point agree; batches without cu_seqlens go through Megatron's own
head-tail split; TP peers hold identical shards. With CP = 2 (under TP2) and CP = 4: ``WlbCoreAttention``
(THD and [s, b, h, d] inputs, GQA) over the CP group equals single-process document-causal attention,
and a whole Megatron ``SelfAttention`` (local spec, RoPE, GQA) under CP equals the same layer without CP,
forward and (CP-summed) weight gradients.
Single-process tests cover the cu_seqlens parsing, errors, the TE path's params and the RoPE hook.
"""

from __future__ import annotations

import numpy as np
import pytest
import torch

pytest.importorskip("megatron.core")

from conftest import run_world  # noqa: E402

LAYOUTS = ("per-sequence", "per-document", "per-document-te", "adaptive", "hybrid")


# ---------------------------------------------------------------------------------------------------
# shared helpers (run inside the workers)
# ---------------------------------------------------------------------------------------------------

def _micro_batch(seed: int, tail: int = 0):
    """A packed micro-batch with short (1, 2 tokens) and long documents; ``tail`` tokens past cu_seqlens."""
    rng = np.random.default_rng(seed)
    lengths = np.concatenate([[1, 2], rng.integers(1, 40, size=5), [rng.integers(40, 90)]])
    rng.shuffle(lengths)
    total = int(lengths.sum()) + tail
    tokens = torch.as_tensor(rng.integers(0, 50_000, size=total), dtype=torch.long).view(1, -1)
    cu = torch.as_tensor(np.concatenate([[0], np.cumsum(lengths)]), dtype=torch.int32)
    segs = list(lengths) + ([tail] if tail else [])
    pos = torch.as_tensor(np.concatenate([np.arange(n) for n in segs]), dtype=torch.long).view(1, -1)
    batch = {"tokens": tokens, "labels": tokens + 7, "loss_mask": torch.ones(1, total),
             "attention_mask": None, "position_ids": pos, "cu_seqlens": cu,
             "max_seqlen": torch.tensor([int(max(segs))], dtype=torch.int32)}
    return batch, np.asarray(segs, dtype=np.int64)


def _padded_view(values: torch.Tensor, lengths: np.ndarray, padded: np.ndarray) -> torch.Tensor:
    """[1, T] values laid out in the padded micro-batch (padding = -1)."""
    out = torch.full((1, int(padded.sum())), -1, dtype=values.dtype)
    src = dst = 0
    for n, p in zip(lengths, padded):
        out[0, dst:dst + n] = values[0, src:src + n]
        src, dst = src + int(n), dst + int(p)
    return out


def _check_layouts(cp_group, cp_size: int, cp_rank: int, seed: int) -> None:
    """Every layout through the patched Megatron functions: tokens, tiling, metadata, entry points."""
    import torch.distributed as dist
    from megatron.core import utils as mcore_utils

    from megatron_wlb.cp.layouts import build_layout
    from megatron_wlb.megatron import cp_hooks
    from megatron_wlb.megatron.settings import WlbSettings

    for i, name in enumerate(LAYOUTS):
        for tail in (0, 3):
            batch, segs = _micro_batch(seed * 100 + i, tail)
            if name == "per-document-te":  # TE path needs TE; the padded layout itself runs without it
                cp_hooks.install(WlbSettings(cp_sharding="per-document"))
                out, params = cp_hooks.shard_packed_batch(dict(batch), batch["cu_seqlens"], batch["max_seqlen"],
                                                          sharding=name, cp_size=cp_size, cp_rank=cp_rank,
                                                          cp_group=cp_group)
            else:
                cp_hooks.install(WlbSettings(cp_sharding=name))
                assert mcore_utils.get_batch_on_this_cp_rank is cp_hooks.get_batch_on_this_cp_rank
                out = mcore_utils.get_batch_on_this_cp_rank(dict(batch))
                params = out.pop("packed_seq_params")
            layout = build_layout(name, segs, cp_size)
            shard = layout.ranks[cp_rank]
            padded = np.asarray(layout.padded_lengths)
            assert params.wlb_layout == layout.name
            for field in ("token_index", "position_ids", "cu_seqlens_q", "cu_seqlens_k", "kv_index"):
                assert np.array_equal(getattr(params.wlb_shard, field), getattr(shard, field)), (name, field)
            idx = torch.as_tensor(shard.token_index)
            full_tokens = _padded_view(batch["tokens"], segs, padded)
            expect = full_tokens[:, idx].clamp(min=0)  # padding slots hold token 0
            assert torch.equal(out["tokens"], expect), name
            assert torch.equal(out["labels"][expect > 0], (expect + 7)[expect > 0])
            pad = full_tokens[0, idx] < 0
            assert torch.equal(out["loss_mask"][0], (~pad).float())
            assert torch.equal(out["position_ids"][0], torch.as_tensor(shard.position_ids)), name
            assert "cu_seqlens" not in out and "max_seqlen" not in out and out["attention_mask"] is None
            # metadata Megatron's attention and RoPE read
            assert params.qkv_format == "thd" and params.cp_group is cp_group
            assert np.array_equal(params.cu_seqlens_q.numpy(), shard.cu_seqlens_q)
            assert params.cu_seqlens_q.dtype == torch.int32
            assert params.max_seqlen_q >= int(padded.max())
            assert torch.equal(getattr(params.cu_seqlens_q, cp_hooks.ROPE_POSITIONS_ATTR), out["position_ids"][0])
            # the CP ranks' token positions tile the padded micro-batch, each exactly once
            gathered = [None] * cp_size
            dist.all_gather_object(gathered, (shard.token_index.tolist(), out["tokens"][0][~pad].tolist()),
                                   group=cp_group)
            positions = np.concatenate([np.asarray(g[0], dtype=np.int64) for g in gathered])
            assert np.array_equal(np.sort(positions), np.arange(int(padded.sum()))), name
            real = sorted(t for g in gathered for t in g[1])
            assert real == sorted(batch["tokens"][0].tolist()), name
            # the THD entry point (pretrain_gpt's packed path) and the middle-stage one agree
            if name != "per-document-te":
                # Megatron's name where it exists (core < 0.18, rebound to ours), else ours directly
                thd_entry = getattr(mcore_utils, "get_thd_batch_on_this_cp_rank",
                                    cp_hooks.get_thd_batch_on_this_cp_rank)
                thd_out, thd_params = thd_entry(
                    {k: v for k, v in batch.items() if k not in ("cu_seqlens", "max_seqlen")},
                    batch["cu_seqlens"], None, batch["max_seqlen"])
                assert torch.equal(thd_out["tokens"], out["tokens"])
                assert np.array_equal(thd_params.wlb_shard.token_index, shard.token_index)
                mid = cp_hooks.packed_seq_params_from_iterator(iter([batch]))
                assert np.array_equal(mid.wlb_shard.token_index, shard.token_index)
                assert torch.equal(mid.wlb_position_ids, params.wlb_position_ids)
    # no cu_seqlens: Megatron's own head-tail split of a fixed-length sample
    cp_hooks.install(WlbSettings(cp_sharding="per-document"))
    seq = 8 * cp_size
    plain = {"tokens": torch.arange(seq).view(1, -1), "labels": torch.arange(seq).view(1, -1) + 1,
             "loss_mask": torch.ones(1, seq), "attention_mask": None, "position_ids": torch.arange(seq).view(1, -1)}
    import inspect

    original = cp_hooks._installed().originals["get_batch_on_this_cp_rank"]
    legacy = "is_hybrid_cp" not in inspect.signature(original).parameters
    got = mcore_utils.get_batch_on_this_cp_rank(dict(plain)) if legacy else \
        mcore_utils.get_batch_on_this_cp_rank(dict(plain), False, cp_group)
    chunk = seq // (2 * cp_size)
    want = torch.cat([torch.arange(cp_rank * chunk, (cp_rank + 1) * chunk),
                      torch.arange((2 * cp_size - 1 - cp_rank) * chunk, (2 * cp_size - cp_rank) * chunk)])
    assert torch.equal(got["tokens"][0], want) and "packed_seq_params" not in got
    cp_hooks.uninstall()
    assert mcore_utils.get_batch_on_this_cp_rank is not cp_hooks.get_batch_on_this_cp_rank


def _check_core_attention(cp_group, cp_size: int, cp_rank: int) -> None:
    """WlbCoreAttention over the CP group == single-process document-causal attention (GQA, THD and sbhd)."""
    from megatron.core.transformer.enums import AttnMaskType
    from megatron.core.transformer.transformer_config import TransformerConfig

    from megatron_wlb.cp.attention import reference_document_attention
    from megatron_wlb.megatron import cp_hooks
    from megatron_wlb.megatron.attention import WlbCoreAttention

    heads, groups, dim = 4, 2, 8
    cfg = TransformerConfig(num_layers=1, hidden_size=heads * dim, num_attention_heads=heads, num_query_groups=groups,
                            kv_channels=dim, context_parallel_size=cp_size, attention_dropout=0.0,
                            hidden_dropout=0.0, use_cpu_initialization=True)
    module = WlbCoreAttention(cfg, 1, AttnMaskType.causal, "self", pg_collection=None)
    for name in ("per-sequence", "per-document", "hybrid", "per-document-te"):
        batch, segs = _micro_batch(7)
        _, params = cp_hooks.shard_packed_batch(dict(batch), batch["cu_seqlens"], batch["max_seqlen"],
                                                sharding=name, cp_size=cp_size, cp_rank=cp_rank, cp_group=cp_group)
        padded = _padded_lengths(name, segs, cp_size)
        total = int(padded.sum())
        gen = torch.Generator().manual_seed(11)  # identical full q/k/v on every rank
        q = torch.randn(total, heads, dim, generator=gen)
        k = torch.randn(total, groups, dim, generator=gen)
        v = torch.randn(total, groups, dim, generator=gen)
        ref = reference_document_attention(q, k, v, np.concatenate([[0], np.cumsum(padded)]))
        idx = torch.as_tensor(params.wlb_shard.token_index)
        want = ref[idx].reshape(len(idx), -1)
        got = module(q[idx], k[idx], v[idx], None, attn_mask_type=AttnMaskType.causal, packed_seq_params=params)
        assert got.shape == (len(idx), heads * dim)
        torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)
        got4 = module(q[idx].unsqueeze(1), k[idx].unsqueeze(1), v[idx].unsqueeze(1), None,
                      attn_mask_type=AttnMaskType.causal, packed_seq_params=params)
        assert got4.shape == (len(idx), 1, heads * dim)
        torch.testing.assert_close(got4[:, 0], want, rtol=1e-5, atol=1e-5)
    # sequence-parallel padding rows (local_multiple): the real rows are unchanged, the padding rows are 0
    _, params = cp_hooks.shard_packed_batch(dict(batch), batch["cu_seqlens"], batch["max_seqlen"], sharding="hybrid",
                                            cp_size=cp_size, cp_rank=cp_rank, cp_group=cp_group, local_multiple=8)
    padded = _padded_lengths("hybrid", segs, cp_size)
    ref = reference_document_attention(q[:int(padded.sum())], k[:int(padded.sum())], v[:int(padded.sum())],
                                       np.concatenate([[0], np.cumsum(padded)]))
    idx = torch.as_tensor(params.wlb_shard.token_index)
    n, pad = len(idx), params.wlb_local_pad
    assert (n + pad) % 8 == 0 and pad < 8
    rows = [t[idx] for t in (q, k, v)]
    rows = [torch.cat([r, torch.randn(pad, *r.shape[1:])]) for r in rows]
    got = module(*rows, None, attn_mask_type=AttnMaskType.causal, packed_seq_params=params)
    torch.testing.assert_close(got[:n], ref[idx].reshape(n, -1), rtol=1e-5, atol=1e-5)
    assert torch.all(got[n:] == 0)
    with pytest.raises(RuntimeError, match="without WLB-LLM shard metadata"):
        module(q[:4], k[:4], v[:4], None, packed_seq_params=None)


def _padded_lengths(name: str, segs: np.ndarray, cp: int) -> np.ndarray:
    from megatron_wlb.cp.layouts import build_layout

    return np.asarray(build_layout(name, segs, cp).padded_lengths)


def _check_self_attention(cp_size: int, cp_rank: int) -> None:
    """A Megatron SelfAttention (local spec, RoPE, GQA) under CP == the same weights without CP."""
    import torch.distributed as dist
    from megatron.core import parallel_state
    from megatron.core.models.common.embeddings.rotary_pos_embedding import RotaryEmbedding
    from megatron.core.models.gpt.gpt_layer_specs import get_gpt_layer_local_spec
    from megatron.core.process_groups_config import ProcessGroupCollection
    from megatron.core.transformer.spec_utils import build_module
    from megatron.core.transformer.transformer_config import TransformerConfig

    from megatron_wlb.megatron import cp_hooks
    from megatron_wlb.megatron.attention import WlbCoreAttention
    from megatron_wlb.megatron.settings import WlbSettings

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
    batch, segs = _micro_batch(3)
    total = int(segs.sum())
    x = torch.randn(total, 1, hidden, generator=torch.Generator().manual_seed(9))
    rope = RotaryEmbedding(kv_channels=dim, rotary_percent=1.0, use_cpu_initialization=True)
    _, params = cp_hooks.shard_packed_batch(dict(batch), batch["cu_seqlens"], batch["max_seqlen"],
                                            sharding="per-document", cp_size=cp_size, cp_rank=cp_rank,
                                            cp_group=parallel_state.get_context_parallel_group())
    _, params1 = cp_hooks.shard_packed_batch(dict(batch), batch["cu_seqlens"], batch["max_seqlen"],
                                             sharding="per-document", cp_size=1, cp_rank=0, cp_group=pgs.cp)
    # RotaryEmbedding.forward moves to CUDA; build its [S, 1, 1, dim] table the same way on CPU
    angles = torch.outer(torch.arange(params.max_seqlen_q, dtype=rope.inv_freq.dtype), rope.inv_freq)
    freqs = torch.cat((angles, angles), dim=-1)[:, None, None, :]
    idx = torch.as_tensor(params.wlb_shard.token_index)
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
        dist.all_reduce(g, group=parallel_state.get_context_parallel_group())
        torch.testing.assert_close(g, p1.grad, rtol=1e-4, atol=1e-5, msg=lambda m, n=name: f"{n}: {m}")
    # without the RoPE hook Megatron's THD RoPE would rotate by the wrong positions: the hook matters
    cp_hooks.uninstall()
    wrong = cp_hooks.shard_packed_batch(dict(batch), batch["cu_seqlens"], batch["max_seqlen"], sharding="per-document",
                                        cp_size=cp_size, cp_rank=cp_rank,
                                        cp_group=parallel_state.get_context_parallel_group())[1]
    for t in (wrong.cu_seqlens_q, wrong.cu_seqlens_kv):
        delattr(t, cp_hooks.ROPE_POSITIONS_ATTR)
    try:
        bad, _ = layer(x[idx], None, rotary_pos_emb=freqs, packed_seq_params=wrong)
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

                _, segs = _micro_batch(seed)
                mine = build_layout("adaptive", segs, cp_size).ranks[cp_rank].token_index.tolist()
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
    """One spawn (process start-up and the megatron.core import dominate), three 4D layouts in turn."""
    run_world(_worker_cp, 8, configs=[(2, 2, 2, True), (1, 4, 1, True), (1, 2, 1, False)])


# ---------------------------------------------------------------------------------------------------
# single-process checks
# ---------------------------------------------------------------------------------------------------

def test_lengths_from_cu_seqlens():
    from megatron_wlb.megatron.cp_hooks import lengths_from_cu_seqlens

    assert lengths_from_cu_seqlens(torch.tensor([0, 3, 3, 10], dtype=torch.int32)).tolist() == [3, 7]
    assert lengths_from_cu_seqlens(torch.tensor([[0, 4, 6]]), total_tokens=9).tolist() == [4, 2, 3]
    for bad, match in (([1, 4], "start at 0"), ([0, 5, 3], "non-decreasing"), ([0, 0], "empty")):
        with pytest.raises(ValueError, match=match):
            lengths_from_cu_seqlens(bad)
    with pytest.raises(ValueError, match="holds only 5"):
        lengths_from_cu_seqlens([0, 6], total_tokens=5)


def test_shard_errors_and_te_requirement():
    from megatron_wlb.megatron import cp_hooks
    from megatron_wlb.megatron.settings import WlbSettings

    batch, _ = _micro_batch(1)
    with pytest.raises(ValueError, match="outside the CP group"):
        cp_hooks.shard_packed_batch(dict(batch), batch["cu_seqlens"], None, sharding="per-document", cp_size=2,
                                    cp_rank=2)
    dense = dict(batch, attention_mask=torch.ones(1, 1, 4, 4, dtype=torch.bool))
    with pytest.raises(ValueError, match="attention_mask"):
        cp_hooks.shard_packed_batch(dense, batch["cu_seqlens"], None, sharding="per-document", cp_size=2, cp_rank=0)
    two = dict(batch, tokens=batch["tokens"].repeat(2, 1))
    with pytest.raises(ValueError, match=r"\[1, T\]"):
        cp_hooks.shard_packed_batch(two, batch["cu_seqlens"], None, sharding="per-document", cp_size=2, cp_rank=0)
    if not cp_hooks.te_available():
        with pytest.raises(ValueError, match="per-document-te.*transformer_engine is not installed"):
            cp_hooks.install(WlbSettings(cp_sharding="per-document-te"))
    with pytest.raises(RuntimeError, match="not installed"):
        cp_hooks.get_thd_batch_on_this_cp_rank(dict(batch), batch["cu_seqlens"], None, None, 2, 0)


def test_te_params_describe_te_layout():
    """The TE path's params: real and padded offsets of TE's per-document layout (golden vector)."""
    from megatron_wlb.megatron import cp_hooks

    tokens = torch.arange(1, 17).view(1, -1)
    batch = {"tokens": tokens, "position_ids": torch.cat([torch.arange(8), torch.arange(8)]).view(1, -1)}
    out, params = cp_hooks.shard_packed_batch(batch, torch.tensor([0, 8, 16]), 8, sharding="per-document-te",
                                              cp_size=2, cp_rank=0, te_attention=True)
    assert out["tokens"][0].tolist() == [1, 2, 7, 8, 9, 10, 15, 16]  # rank 0 owns [0,1,6,7,8,9,14,15]
    assert params.wlb_shard is None and params.cu_seqlens_q_padded.tolist() == [0, 8, 16]
    assert params.cp_group is None  # as Megatron's own THD path: TE keeps the CP group it was built with
    assert params.max_seqlen_q == 8 and params.qkv_format == "thd"
    out, params = cp_hooks.shard_packed_batch({"tokens": torch.arange(1, 7).view(1, -1)}, torch.tensor([0, 3, 6]),
                                              3, sharding="per-document-te", cp_size=2, cp_rank=1, te_attention=True)
    assert params.cu_seqlens_q.tolist() == [0, 3, 6] and params.cu_seqlens_q_padded.tolist() == [0, 4, 8]
    assert out["tokens"][0].tolist() == [2, 3, 5, 6]  # rank 1 owns padded positions [1, 2, 5, 6]
    assert not hasattr(params.cu_seqlens_q, cp_hooks.ROPE_POSITIONS_ATTR)  # Megatron's THD RoPE is right here


def test_sequence_parallel_padding():
    """local_multiple (TP under --sequence-parallel): every rank's row count becomes a multiple of it."""
    from megatron_wlb.megatron import cp_hooks

    batch, segs = _micro_batch(6)
    for name in ("hybrid", "per-document", "per-sequence"):
        seen = []
        for rank in range(4):
            out, params = cp_hooks.shard_packed_batch(dict(batch), batch["cu_seqlens"], batch["max_seqlen"],
                                                      sharding=name, cp_size=4, cp_rank=rank, local_multiple=4)
            n, pad = len(params.wlb_shard.token_index), params.wlb_local_pad
            assert out["tokens"].shape[1] == n + pad and (n + pad) % 4 == 0 and 0 <= pad < 4
            assert torch.all(out["loss_mask"][0, n:] == 0) and torch.all(out["tokens"][0, n:] == 0)
            assert params.wlb_position_ids.numel() == n + pad
            seen += out["tokens"][0, :n].tolist()
        assert sorted(seen) == sorted(batch["tokens"][0].tolist())  # padding rows add no tokens, lose none
    # TE path: one trailing padding document (identical on every rank) instead of local rows
    tokens = torch.arange(1, 7).view(1, -1)
    counts = []
    for rank in range(2):
        out, params = cp_hooks.shard_packed_batch({"tokens": tokens, "loss_mask": torch.ones(1, 6)},
                                                  torch.tensor([0, 3, 6]), 3, sharding="per-document-te", cp_size=2,
                                                  cp_rank=rank, te_attention=True, local_multiple=8)
        assert params.cu_seqlens_q.tolist() == [0, 3, 6, 14] and params.cu_seqlens_q_padded.tolist() == [0, 4, 8, 16]
        counts.append(out["tokens"].shape[1])
        assert out["loss_mask"].sum() == (out["tokens"] > 0).sum()
    assert counts == [8, 8]
    with pytest.raises(ValueError, match="local_multiple"):
        cp_hooks.shard_packed_batch(dict(batch), batch["cu_seqlens"], None, sharding="per-document", cp_size=2,
                                    cp_rank=0, local_multiple=0)


def test_rope_hook_rotates_by_true_positions():
    """The wrapped apply_rotary_pos_emb rotates each local token by its own document position."""
    from megatron.core.models.common.embeddings.rope_utils import _apply_rotary_pos_emb_bshd, apply_rotary_pos_emb
    from megatron.core.transformer.transformer_config import TransformerConfig

    from megatron_wlb.megatron import cp_hooks

    cfg = TransformerConfig(num_layers=1, hidden_size=16, num_attention_heads=2, use_cpu_initialization=True)
    batch, segs = _micro_batch(4)
    total = int(segs.sum())
    t = torch.randn(total, 2, 8)
    freqs = torch.randn(int(segs.max()), 1, 1, 8)
    full = _apply_rotary_pos_emb_bshd(t.unsqueeze(1), freqs[batch["position_ids"][0]]).squeeze(1)
    hooked = cp_hooks.wlb_apply_rotary_pos_emb(apply_rotary_pos_emb)
    for rank in range(2):
        _, params = cp_hooks.shard_packed_batch(dict(batch), batch["cu_seqlens"], batch["max_seqlen"],
                                                sharding="hybrid", cp_size=2, cp_rank=rank)
        idx = torch.as_tensor(params.wlb_shard.token_index)
        for cu in (params.cu_seqlens_q, params.cu_seqlens_kv):
            torch.testing.assert_close(hooked(t[idx], freqs, cfg, cu_seqlens=cu), full[idx])
    with pytest.raises(ValueError, match="beyond"):
        hooked(t[idx], freqs[:2], cfg, cu_seqlens=params.cu_seqlens_q)


def test_swap_core_attention_on_spec():
    from megatron.core.models.gpt.gpt_layer_specs import get_gpt_layer_local_spec
    from megatron.core.transformer.dot_product_attention import DotProductAttention

    from megatron_wlb.megatron.attention import WlbCoreAttention, swap_core_attention

    spec = get_gpt_layer_local_spec()
    swapped = swap_core_attention(spec)
    core = swapped.submodules.self_attention.submodules.core_attention
    assert core.func is WlbCoreAttention and core.keywords["inner"] is DotProductAttention
    assert spec.submodules.self_attention.submodules.core_attention is DotProductAttention  # input untouched
    assert swap_core_attention(swapped).submodules.self_attention.submodules.core_attention is core  # idempotent


def test_unsupported_attention_configs_are_refused():
    from megatron.core.transformer.enums import AttnMaskType
    from megatron.core.transformer.transformer_config import TransformerConfig

    from megatron_wlb.megatron.attention import WlbCoreAttention

    cfg = TransformerConfig(num_layers=1, hidden_size=16, num_attention_heads=2, attention_dropout=0.1,
                            use_cpu_initialization=True)
    with pytest.raises(ValueError, match="--attention-dropout 0.0"):
        WlbCoreAttention(cfg, 1, AttnMaskType.causal, "self")


def test_install_builds_the_run_cost_model():
    """install(settings, args) weighs adaptive layouts with the run's model; --wlb-config's otherwise."""
    from types import SimpleNamespace

    from megatron_wlb.megatron import cp_hooks
    from megatron_wlb.megatron.settings import WlbSettings

    args = SimpleNamespace(hidden_size=64, num_layers=2, num_attention_heads=4, num_query_groups=2,
                           group_query_attention=True, ffn_hidden_size=128, padded_vocab_size=256, swiglu=True,
                           tensor_model_parallel_size=1, context_parallel_size=2, pipeline_model_parallel_size=1,
                           data_parallel_size=1)
    try:
        cp_hooks.install(WlbSettings(cp_sharding="adaptive"), args)
        cost = cp_hooks._installed().cost
        assert cost is not None and cost.model.hidden == 64 and cost.model.num_kv_heads == 2
        cp_hooks.install(WlbSettings(cp_sharding="adaptive", config="7b_64k"))
        assert cp_hooks._installed().cost.model.name == "7b"
        cp_hooks.install(WlbSettings(cp_sharding="adaptive"))
        assert cp_hooks._installed().cost is None
    finally:
        cp_hooks.uninstall()


def test_core_attention_keeps_stock_checkpoint_keys():
    """The wrapped core attention's state appears under stock Megatron's keys and loads back (strict)."""
    from megatron.core.transformer.enums import AttnMaskType
    from megatron.core.transformer.transformer_config import TransformerConfig

    from megatron_wlb.megatron.attention import WlbCoreAttention

    class Inner(torch.nn.Module):  # stands in for TE's attention and its _extra_state-like state
        def __init__(self, **kwargs):
            super().__init__()
            self.register_buffer("scale", torch.ones(2))
            self.child = torch.nn.Module()
            self.child.register_buffer("weight", torch.zeros(1))

    class WithParams(torch.nn.Module):
        def __init__(self, **kwargs):
            super().__init__()
            self.offset = torch.nn.Parameter(torch.zeros(2))

    cfg = TransformerConfig(num_layers=1, hidden_size=16, num_attention_heads=2, attention_dropout=0.0,
                            use_cpu_initialization=True)

    def layer():
        parent = torch.nn.Module()
        parent.core_attention = WlbCoreAttention(cfg, 1, AttnMaskType.causal, "self", inner=Inner)
        return parent

    a, b = layer(), layer()
    with torch.no_grad():
        a.core_attention.inner.scale.fill_(3.0)
        a.core_attention.inner.child.weight.fill_(5.0)
    state = a.state_dict()
    assert set(state) == {"core_attention.scale", "core_attention.child.weight"}
    b.load_state_dict(state, strict=True)
    assert torch.all(b.core_attention.inner.scale == 3.0) and float(b.core_attention.inner.child.weight) == 5.0
    with pytest.raises(ValueError, match="parameter-free"):
        WlbCoreAttention(cfg, 1, AttnMaskType.causal, "self", inner=WithParams)
    with pytest.raises(RuntimeError, match="Unexpected key"):
        b.load_state_dict({**state, "core_attention.inner.scale": torch.ones(2)}, strict=True)
    b.eval()
    assert not b.core_attention.inner.training


def test_install_rebinds_every_importer_and_survives_lazy_modules():
    """A module that imported Megatron's function (as pretrain_gpt does) is rebound; lazy modules whose
    __getattr__ raises are left alone; uninstall restores the originals."""
    import sys
    import types

    from megatron.core import utils as mcore_utils

    from megatron_wlb.megatron import cp_hooks
    from megatron_wlb.megatron.settings import WlbSettings

    original = mcore_utils.get_batch_on_this_cp_rank
    importer = types.ModuleType("fake_pretrain_gpt")
    importer.get_batch_on_this_cp_rank = original
    thd = getattr(mcore_utils, "get_thd_batch_on_this_cp_rank", None)  # core < 0.18 only
    if thd is not None:
        importer.get_thd_batch_on_this_cp_rank = thd

    class Lazy(types.ModuleType):
        def __getattr__(self, name):
            raise ImportError(f"lazy module: {name}")

    sys.modules["fake_pretrain_gpt"], sys.modules["fake_lazy"] = importer, Lazy("fake_lazy")
    try:
        cp_hooks.install(WlbSettings(cp_sharding="per-document"))
        assert importer.get_batch_on_this_cp_rank is cp_hooks.get_batch_on_this_cp_rank
        if thd is not None:
            assert importer.get_thd_batch_on_this_cp_rank is cp_hooks.get_thd_batch_on_this_cp_rank
        cp_hooks.uninstall()
        assert importer.get_batch_on_this_cp_rank is original
        assert mcore_utils.get_batch_on_this_cp_rank is original
        if thd is not None:
            assert importer.get_thd_batch_on_this_cp_rank is thd
    finally:
        cp_hooks.uninstall()
        del sys.modules["fake_pretrain_gpt"], sys.modules["fake_lazy"]


def _agreement_worker(rank, world):
    import torch.distributed as dist

    from megatron_wlb.cp.layouts import build_layout
    from megatron_wlb.megatron.cp_hooks import check_layout_agreement

    group = dist.new_group(list(range(world)))
    same = build_layout("per-document", np.array([30, 50, 20]), world)
    check_layout_agreement(same, group)  # equal layouts pass
    other = build_layout("per-document", np.array([30, 50, 20] if rank == 0 else [50, 30, 20]), world)
    with pytest.raises(RuntimeError, match="CP ranks built different per-document layouts"):
        check_layout_agreement(other, group)  # equal token counts, different documents: refused on every rank


def test_cp_ranks_that_build_different_layouts_are_refused():
    run_world(_agreement_worker, 2)


def test_fallback_attention_refuses_batches_without_params_when_every_batch_is_packed(monkeypatch):
    """A packed micro-batch that lost its params on the way would attend across its documents."""
    from megatron.core.transformer.enums import AttnMaskType
    from megatron.core.transformer.transformer_config import TransformerConfig

    import megatron_wlb.megatron as adapter
    from megatron_wlb.megatron.attention import WlbCoreAttention
    from megatron_wlb.megatron.checkpoint import DataStateRegistry

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
