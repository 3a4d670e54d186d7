"""All-gather CP attention on real multi-process gloo groups (CP = 2 and 4) against single-process
document-causal attention: forward output and dq, dk, dv, for every layout and mixed document lengths
(documents shorter than 2CP, length-1 documents, single-token runs, ranks with no tokens)."""

from __future__ import annotations

import numpy as np
import pytest
import torch
import torch.distributed as dist
from conftest import run_world

from megatron_wlb.cp.attention import (
    AllGatherCPAttention,
    all_gather_cp_attention,
    reference_document_attention,
    reference_varlen_attention,
    resolve_backend,
)
from megatron_wlb.cp.device import DeviceBatch, upload
from megatron_wlb.cp.layouts import LAYOUT_NAMES, ShardLayout, build_layout
from megatron_wlb.cp.plan import layout_batch

HEADS, KV_HEADS, DIM = 4, 2, 8


def _meta(layout: ShardLayout, rank: int) -> DeviceBatch:
    """Rank ``rank``'s upload of ``layout`` (its ``varlen`` record and ``gather`` plan), as the training path makes
    it (one upload)."""
    return upload(layout_batch(layout, rank), "cpu", tokens=False)


def _length_mixes(cp: int, seed: int) -> list[list[int]]:
    rng = np.random.default_rng(seed)
    mixes = [
        [1],                                       # fewer tokens than ranks: some ranks own nothing
        [1, 1, 2 * cp - 1, 1],                     # only documents shorter than 2CP
        [3 * cp + 1],                              # one document, remainder tokens
        [2 * cp, 1, 5, 4 * cp + 3, 2],
    ]
    for _ in range(3):
        n = int(rng.integers(2, 7))
        mixes.append(rng.choice([1, 2, 3, 7, 16, 29, 40, 57], size=n).tolist())
    return mixes


def _check_case(lengths: list[int], cp: int, rank: int, layout: str, tile: int, seed: int, group) -> None:
    lay = build_layout(layout, lengths, cp, tile=tile)
    padded = lay.padded_lengths
    total = int(padded.sum())
    cu = np.concatenate([[0], np.cumsum(padded)])
    gen = torch.Generator().manual_seed(seed)
    q = torch.randn(total, HEADS, DIM, generator=gen, requires_grad=True)
    k = torch.randn(total, KV_HEADS, DIM, generator=gen, requires_grad=True)
    v = torch.randn(total, KV_HEADS, DIM, generator=gen, requires_grad=True)
    g = torch.randn(total, HEADS, DIM, generator=gen)
    ref = reference_document_attention(q, k, v, cu)
    (ref * g).sum().backward()

    shard = lay.ranks[rank]
    idx = torch.as_tensor(shard.token_index)
    ql = q.detach()[idx].clone().requires_grad_(True)
    kl = k.detach()[idx].clone().requires_grad_(True)
    vl = v.detach()[idx].clone().requires_grad_(True)
    meta = _meta(lay, rank)
    out = AllGatherCPAttention(backend="auto")(ql, kl, vl, meta.varlen, meta.gather, group)
    (out * g[idx]).sum().backward()
    what = f"layout={layout} (used {lay.name}) lengths={lengths} cp={cp} rank={rank} tile={tile}"
    torch.testing.assert_close(out, ref.detach()[idx], rtol=1e-4, atol=1e-5, msg=lambda m: f"out {what}: {m}")
    torch.testing.assert_close(ql.grad, q.grad[idx], rtol=1e-4, atol=1e-5, msg=lambda m: f"dq {what}: {m}")
    torch.testing.assert_close(kl.grad, k.grad[idx], rtol=1e-4, atol=1e-5, msg=lambda m: f"dk {what}: {m}")
    torch.testing.assert_close(vl.grad, v.grad[idx], rtol=1e-4, atol=1e-5, msg=lambda m: f"dv {what}: {m}")


def _worker(rank: int, cp: int) -> None:
    group = dist.new_group(list(range(cp)))
    case = 0
    for mix_id, lengths in enumerate(_length_mixes(cp, seed=cp)):
        for layout in LAYOUT_NAMES:
            for tile in (1, 4) if layout in ("hybrid", "adaptive") else (1,):
                _check_case(lengths, cp, rank, layout, tile, seed=1000 * mix_id + case, group=group)
                case += 1
    # Metadata that does not match the process group fails before any collective (no hang).
    lay = build_layout("per-document", [5, 9], cp)
    wrong = _meta(lay, (rank + 1) % cp)
    n = wrong.gather.num_tokens
    try:
        all_gather_cp_attention(torch.zeros(n, HEADS, DIM), torch.zeros(n, KV_HEADS, DIM),
                                torch.zeros(n, KV_HEADS, DIM), wrong.varlen, wrong.gather, group)
    except ValueError as exc:
        assert "rank" in str(exc), exc
    else:
        raise AssertionError("a shard of another rank was accepted")


@pytest.mark.parametrize("cp", [2, 4])
def test_all_gather_cp_attention_matches_reference(cp):
    run_world(_worker, cp, start_method="fork")


def test_single_process_cp1_and_errors():
    lay = build_layout("per-document", [3, 1, 6], 1)
    shard = _meta(lay, 0)
    gen = torch.Generator().manual_seed(0)
    q, k, v = (torch.randn(10, h, DIM, generator=gen) for h in (HEADS, KV_HEADS, KV_HEADS))
    out = all_gather_cp_attention(q, k, v, shard.varlen, shard.gather, None)
    torch.testing.assert_close(out, reference_document_attention(q, k, v, [0, 3, 4, 10]))
    with pytest.raises(ValueError, match="owns 10 tokens"):
        all_gather_cp_attention(q[:9], k[:9], v[:9], shard.varlen, shard.gather, None)
    with pytest.raises(ValueError, match="multiple of k/v heads"):
        all_gather_cp_attention(torch.randn(10, 3, DIM), k, v, shard.varlen, shard.gather, None)
    with pytest.raises(ValueError, match="tokens, heads, head_dim"):
        all_gather_cp_attention(q.reshape(10, -1), k, v, shard.varlen, shard.gather, None)
    with pytest.raises(ValueError, match="not initialised"):
        two = _meta(build_layout("per-sequence", [3, 1, 6], 2), 0)
        all_gather_cp_attention(q[:5], k[:5], v[:5], two.varlen, two.gather, None)
    with pytest.raises(ValueError, match="reads a Varlen record"):
        all_gather_cp_attention(q, k, v, lay.ranks[0], shard.gather, None)  # type: ignore[arg-type]
    with pytest.raises(ValueError, match="unknown attention backend"):
        AllGatherCPAttention(backend="ring")
    with pytest.raises(ValueError, match="needs CUDA"):
        resolve_backend("torch-varlen", torch.device("cpu"))
    assert resolve_backend("auto", torch.device("cpu")) == "reference"
    with pytest.raises(ValueError, match="cu_seqlens"):
        reference_document_attention(q, k, v, [0, 3, 9])


def test_reference_is_bottom_right_causal():
    """A query run of n queries over m keys: query i sees keys 0..i+m-n (checked against a dense mask)."""
    gen = torch.Generator().manual_seed(1)
    q, k, v = torch.randn(3, 1, 4, generator=gen), torch.randn(7, 1, 4, generator=gen), torch.randn(7, 1, 4,
                                                                                                     generator=gen)
    out = reference_varlen_attention(q, k, v, [0, 3], [0, 7])
    scores = (q[:, 0] @ k[:, 0].T) / 2.0
    mask = torch.arange(7)[None, :] <= torch.arange(3)[:, None] + 4
    dense = torch.softmax(scores.masked_fill(~mask, float("-inf")), dim=-1) @ v[:, 0]
    torch.testing.assert_close(out[:, 0], dense)
    # the last query sees every key, the first one all but the last two
    assert mask[2].all() and mask[0].sum() == 5


def test_per_document_te_padding_leaves_real_tokens_unchanged():
    """TE's padding sits at each document's end, so real tokens' outputs equal the unpadded ones."""
    lengths = [5, 1, 6]
    lay = build_layout("per-document-te", lengths, 2)
    gen = torch.Generator().manual_seed(2)
    total = int(lay.padded_lengths.sum())
    q, k, v = (torch.randn(total, h, DIM, generator=gen) for h in (HEADS, KV_HEADS, KV_HEADS))
    pcu = np.concatenate([[0], np.cumsum(lay.padded_lengths)])
    padded_out = reference_document_attention(q, k, v, pcu)
    real = np.concatenate([np.arange(s, s + n) for s, n in zip(pcu[:-1], lengths)])
    r = torch.as_tensor(real)
    plain = reference_document_attention(q[r], k[r], v[r], np.concatenate([[0], np.cumsum(lengths)]))
    torch.testing.assert_close(padded_out[r], plain)


def test_segment_index_expands_gather_pieces_on_the_device():
    for name in LAYOUT_NAMES:
        lay = build_layout(name, [7, 1, 30, 2, 16], 4, tile=4)
        for rank, shard in enumerate(lay.ranks):
            rows = _meta(lay, rank).gather.segment_index
            assert rows.dtype == torch.long
            assert rows.tolist() == shard.gather_rows().tolist()
            assert rows.numel() == shard.kv_index.size


# --- kernel plumbing, tested on CPU with stand-in kernels (the GPU kernels themselves run only on GPUs) -------
def _install_fake_varlen(monkeypatch, signature_has_scale: bool):
    """Replace torch.nn.attention.varlen.varlen_attn with a recorder of the given signature."""
    import torch.nn.attention.varlen as varlen_mod

    calls = []
    if signature_has_scale:
        def fake(q, k, v, cu_q, cu_k, max_q, max_k, *, scale=None, window_size=(-1, -1), enable_gqa=False):
            calls.append({"q": q, "k": k, "scale": scale, "window_size": window_size, "enable_gqa": enable_gqa})
            return q
    else:
        def fake(q, k, v, cu_q, cu_k, max_q, max_k, *, is_causal=False):  # the first public signature
            calls.append({"q": q, "k": k, "is_causal": is_causal})
            return q
    monkeypatch.setattr(varlen_mod, "varlen_attn", fake)
    return calls


def test_torch_varlen_passes_scale_only_where_the_signature_has_it(monkeypatch):
    import megatron_wlb.cp.attention as attention
    from megatron_wlb.cp.attention import _torch_varlen

    q, k = torch.ones(4, 4, 16), torch.ones(4, 2, 16)
    monkeypatch.setattr(attention, "_aten_flash_ops", lambda: None)  # no flash op to call directly: expand
    calls = _install_fake_varlen(monkeypatch, signature_has_scale=False)
    _torch_varlen(q, k, k, None, None, 4, 4, 0.5)            # non-default scale, no scale= in the signature
    assert "scale" not in calls[0] and calls[0]["is_causal"] is True
    torch.testing.assert_close(calls[0]["q"], q * (0.5 * 4.0))  # folded into q: softmax(q k^T / sqrt(d))
    assert calls[0]["k"].shape[1] == 4                          # GQA expanded: no enable_gqa in this signature
    _torch_varlen(q, k, k, None, None, 4, 4, 0.25)           # the default 1/sqrt(16): q untouched
    assert calls[1]["q"] is q
    calls = _install_fake_varlen(monkeypatch, signature_has_scale=True)
    _torch_varlen(q, k, k, None, None, 4, 4, 0.5)
    assert calls[0]["scale"] == 0.5 and calls[0]["window_size"] == (-1, 0) and calls[0]["enable_gqa"] is True
    assert calls[0]["q"] is q and calls[0]["k"].shape[1] == 2


def test_cuda_never_falls_back_to_the_reference_path(monkeypatch):
    import megatron_wlb.cp.attention as attention

    cuda = torch.device("cuda", 0)  # a device object only: nothing runs on it
    monkeypatch.setattr(attention, "_torch_varlen_available", lambda: True)
    assert resolve_backend("auto", cuda, torch.bfloat16) == "torch-varlen"
    with pytest.raises(ValueError, match="fp16/bf16"):
        resolve_backend("auto", cuda, torch.float32)
    with pytest.raises(ValueError, match="CPU test path"):
        resolve_backend("reference", cuda, torch.bfloat16)
    monkeypatch.setattr(attention, "_torch_varlen_available", lambda: False)
    real_find_spec = attention.importlib.util.find_spec
    monkeypatch.setattr(attention.importlib.util, "find_spec",
                        lambda name, *a: None if name == "flash_attn" else real_find_spec(name, *a))
    with pytest.raises(ValueError, match="no varlen attention kernel"):
        resolve_backend("auto", cuda, torch.bfloat16)
    assert resolve_backend("auto", torch.device("cpu"), torch.float32) == "reference"


def test_flash_attn_gets_causal_bottom_right_and_the_scale(monkeypatch):
    """flash_attn_varlen_func: causal=True (bottom-right aligned in flash-attn >= 2.1), no dropout, our scale."""
    import sys
    import types

    from megatron_wlb.cp.attention import _flash_attn

    calls = []
    fake = types.ModuleType("flash_attn")

    def flash_attn_varlen_func(q, k, v, cu_q, cu_k, max_q, max_k, *, dropout_p, softmax_scale, causal):
        calls.append({"cu_q": cu_q, "max_q": max_q, "max_k": max_k, "dropout_p": dropout_p,
                      "softmax_scale": softmax_scale, "causal": causal, "k_heads": k.shape[1]})
        return q

    fake.flash_attn_varlen_func = flash_attn_varlen_func
    monkeypatch.setitem(sys.modules, "flash_attn", fake)
    q, k = torch.ones(5, 4, 8), torch.ones(5, 2, 8)
    cu = torch.tensor([0, 2, 5], dtype=torch.int32)
    _flash_attn(q, k, k, cu, cu, 3, 3, 0.125)
    assert calls == [{"cu_q": cu, "max_q": 3, "max_k": 3, "dropout_p": 0.0, "softmax_scale": 0.125, "causal": True,
                      "k_heads": 2}]  # GQA passes through un-repeated: flash-attn handles it


def test_the_kernel_gets_the_uploaded_metadata_as_is(monkeypatch):
    """all_gather_cp_attention with a Varlen record: the kernel receives the very cu_seqlens tensors
    uploaded once per micro-batch (no per-layer copy) and host ints for max_seqlen; the result is the
    reference's."""
    import megatron_wlb.cp.attention as attention
    from megatron_wlb.cp.attention import all_gather_cp_attention, reference_varlen_attention

    layout = build_layout("per-document", np.array([7, 3, 12]), 1)
    meta = _meta(layout, 0)
    seen = []

    def kernel(q, k, v, cu_q, cu_k, max_q, max_k, scale):
        seen.append((cu_q, cu_k, max_q, max_k))
        return reference_varlen_attention(q, k, v, cu_q, cu_k, scale)

    monkeypatch.setattr(attention, "resolve_backend", lambda backend, device, dtype=None: "torch-varlen")
    monkeypatch.setattr(attention, "_torch_varlen", kernel)
    gen = torch.Generator().manual_seed(3)
    q, k, v = (torch.randn(22, h, DIM, generator=gen) for h in (HEADS, KV_HEADS, KV_HEADS))
    for _ in range(2):  # two layers of one forward: the same tensors both times
        out = all_gather_cp_attention(q, k, v, meta.varlen, meta.gather, None)
    assert all(s[0] is meta.varlen.cu_seqlens_q and s[1] is meta.varlen.cu_seqlens_k for s in seen) and len(seen) == 2
    assert all(type(s[2]) is int and type(s[3]) is int for s in seen)
    torch.testing.assert_close(out, reference_document_attention(q, k, v, [0, 7, 10, 22]))


# --- torch 2.11's varlen_attn (no enable_gqa) and the flash kernel under it, as CPU stand-ins -------------------
class _StandInVarlen(torch.autograd.Function):
    """torch 2.11's varlen op: saves q, k, v, out and lse for backward (so repeated K/V would be saved)."""

    @staticmethod
    def forward(ctx, q, k, v, cu_q, cu_k, scale):
        out = reference_varlen_attention(q, k, v, cu_q, cu_k, scale)
        ctx.save_for_backward(q, k, v, out, q.new_zeros(q.shape[1], q.shape[0]))
        ctx.cu = (cu_q, cu_k, scale)
        return out

    @staticmethod
    def backward(ctx, grad):
        q, k, v, _, _ = ctx.saved_tensors
        with torch.enable_grad():
            q, k, v = (t.detach().requires_grad_(True) for t in (q, k, v))
            out = reference_varlen_attention(q, k, v, *ctx.cu)
            dq, dk, dv = torch.autograd.grad(out, (q, k, v), grad)
        return dq, dk, dv, None, None, None


def _install_torch_211(monkeypatch):
    """varlen_attn with torch 2.11's exact public signature (no enable_gqa: equal heads only, as its kernel call
    is written) and aten's flash ops as stand-ins with the flash kernel's semantics: Hq = g * Hkv natively,
    causal bottom-right, dK/dV per K/V head. Returns the calls each saw."""
    import torch.nn.attention.varlen as varlen_mod

    import megatron_wlb.cp.attention as attention

    seen: dict[str, list] = {"varlen": [], "fwd": [], "bwd": []}

    def varlen_attn(query, key, value, cu_seq_q, cu_seq_k, max_q, max_k, *, return_aux=None, scale=None,
                    window_size=(-1, -1)):
        assert key.shape[1] == query.shape[1], "torch 2.11's varlen_attn has no enable_gqa"
        assert tuple(window_size) == (-1, 0)
        seen["varlen"].append(key.shape[1])
        return _StandInVarlen.apply(query, key, value, cu_seq_q, cu_seq_k, scale)

    def flash_fwd(q, k, v, cu_q, cu_k, max_q, max_k, dropout_p, is_causal, return_debug_mask, *, scale=None,
                  window_size_left=None, window_size_right=None):
        assert dropout_p == 0.0 and is_causal and (window_size_left, window_size_right) == (-1, 0)
        seen["fwd"].append(k.shape[1])
        out = reference_varlen_attention(q, k, v, cu_q, cu_k, scale)
        empty = q.new_empty(0)
        return out, q.new_zeros(q.shape[1], q.shape[0]), empty, empty, empty

    def flash_bwd(grad_out, q, k, v, out, lse, cu_q, cu_k, max_q, max_k, dropout_p, is_causal, seed, offset, *,
                  scale=None, window_size_left=None, window_size_right=None):
        seen["bwd"].append(k.shape[1])
        with torch.enable_grad():
            q, k, v = (t.detach().requires_grad_(True) for t in (q, k, v))
            ref = reference_varlen_attention(q, k, v, cu_q, cu_k, scale)
            return torch.autograd.grad(ref, (q, k, v), grad_out)

    monkeypatch.setattr(varlen_mod, "varlen_attn", varlen_attn)
    monkeypatch.setattr(attention, "_aten_flash_ops", lambda: (flash_fwd, flash_bwd, True))
    return seen


def _saved_bytes(fn) -> int:
    """Bytes autograd saves for backward while ``fn()`` runs (each storage once)."""
    storages: dict[int, int] = {}

    def pack(t):
        storages[t.untyped_storage().data_ptr()] = t.untyped_storage().nbytes()
        return t

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        fn()
    return sum(storages.values())


def test_gqa_on_torch_211_keeps_kv_heads_and_its_saved_bytes(monkeypatch):
    """issue 20, item 7: without enable_gqa, GQA runs the flash kernel with Hkv heads (no repeat_interleave),
    forward and backward equal the reference, and autograd saves the K/V bytes once, not Hq/Hkv times."""
    import megatron_wlb.cp.attention as attention

    seen = _install_torch_211(monkeypatch)
    heads, kv_heads, dim, tokens = 8, 2, 16, 64
    cu = torch.tensor([0, 24, 64], dtype=torch.int32)
    gen = torch.Generator().manual_seed(4)
    q, k, v = (torch.randn(tokens, h, dim, generator=gen, requires_grad=True) for h in (heads, kv_heads, kv_heads))

    def run():
        return attention._torch_varlen(q, k, v, cu, cu, 40, 40, 0.25)

    out = run()
    out.sum().backward()
    assert seen["fwd"] == [kv_heads] and seen["bwd"] == [kv_heads] and seen["varlen"] == []
    grads = [t.grad.clone() for t in (q, k, v)]
    for t in (q, k, v):
        t.grad = None
    ref = reference_varlen_attention(q, k, v, cu, cu, 0.25)
    ref.sum().backward()
    torch.testing.assert_close(out, ref)
    for got, want in zip(grads, (q.grad, k.grad, v.grad)):
        torch.testing.assert_close(got, want)
    new = _saved_bytes(run)
    monkeypatch.setattr(attention, "_aten_flash_ops", lambda: None)  # the old path: repeat K/V to every head
    old = _saved_bytes(run)
    assert seen["varlen"] == [heads]
    kv_bytes = 2 * tokens * kv_heads * dim * 4
    # the old path saved K and V repeated to every query head; the new one saves them once (and cu_seqlens)
    assert old - new == (heads // kv_heads - 1) * kv_bytes - cu.untyped_storage().nbytes()


def test_kernel_signature_is_inspected_once(monkeypatch):
    """issue 20, item 8: inspect.signature(varlen_attn) ran on every layer call (~200 us each)."""
    import megatron_wlb.cp.attention as attention

    _install_torch_211(monkeypatch)
    attention.kernel_parameters.cache_clear()
    counted = []
    real = attention.inspect.signature
    monkeypatch.setattr(attention.inspect, "signature", lambda fn: counted.append(fn) or real(fn))
    q = torch.randn(6, 2, 8)
    cu = torch.tensor([0, 6], dtype=torch.int32)
    for _ in range(5):
        attention._torch_varlen(q, q, q, cu, cu, 6, 6, 8 ** -0.5)
    assert len(counted) == 1


def test_cp1_passes_kv_to_the_kernel_without_copies(monkeypatch):
    """issue 20, item 10: at CP = 1 with one run per document (hybrid) the key segments are k and v themselves;
    layouts that cut a document into overlapping runs (per-document's head and tail) still copy segments."""
    import megatron_wlb.cp.attention as attention

    seen = []

    def kernel(q, k, v, cu_q, cu_k, max_q, max_k, scale):
        seen.append((k.data_ptr(), v.data_ptr()))
        return reference_varlen_attention(q, k, v, cu_q, cu_k, scale)

    monkeypatch.setattr(attention, "resolve_backend", lambda backend, device, dtype=None: "torch-varlen")
    monkeypatch.setattr(attention, "_torch_varlen", kernel)
    meta = _meta(build_layout("hybrid", np.array([7, 3, 12]), 1), 0)
    assert meta.gather.identity_segments
    gen = torch.Generator().manual_seed(5)
    q, k, v = (torch.randn(22, h, DIM, generator=gen) for h in (HEADS, KV_HEADS, KV_HEADS))
    all_gather_cp_attention(q, k, v, meta.varlen, meta.gather, None)
    assert seen == [(k.data_ptr(), v.data_ptr())]
    split = _meta(build_layout("per-document", np.array([7, 3, 12]), 1), 0)
    assert not split.gather.identity_segments
    out = all_gather_cp_attention(q, k, v, split.varlen, split.gather, None)
    torch.testing.assert_close(out, reference_document_attention(q, k, v, [0, 7, 10, 22]))
    two = build_layout("hybrid", np.array([7, 3, 12]), 2)
    assert not any(_meta(two, rank).gather.identity_segments for rank in range(2))


def _deterministic_worker(rank: int, cp: int) -> None:
    """Under deterministic algorithms, every index_add_ of the backward gives each row at most one non-zero term
    (a CUDA index_add_ adds repeated rows in atomics' order), and the gradients are the reference's."""
    torch.use_deterministic_algorithms(True)
    calls = []
    real = torch.Tensor.index_add_

    def checked(self, dim, index, source, **kw):
        nonzero = source.reshape(source.shape[0], -1).ne(0).any(1)
        rows = index[nonzero]
        calls.append(int(rows.numel() - rows.unique().numel()))
        return real(self, dim, index, source, **kw)

    torch.Tensor.index_add_ = checked  # this worker process only
    group = dist.new_group(list(range(cp)))
    _check_case([9, 4, 30], cp, rank, "per-document", 1, seed=7, group=group)
    assert calls and max(calls) == 0, calls


def test_backward_is_deterministic_under_deterministic_mode():
    run_world(_deterministic_worker, 2, start_method="fork")


def test_row_occurrence_counts_repeats():
    from megatron_wlb.cp.device import row_occurrence

    assert row_occurrence(np.array([5, 3, 5, 5, 3, 1])).tolist() == [0, 0, 1, 2, 1, 0]
    assert row_occurrence(np.array([], dtype=np.int64)).tolist() == []
