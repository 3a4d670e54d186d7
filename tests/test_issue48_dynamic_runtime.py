"""Issue 48 (2): dynamic CP at run time — process groups per aligned block, every slot's micro-batch per step,
and our all-gather CP attention over each micro-batch's own group.

A plan over a DP2 x CP2 pool (4 slots) with mixed document lengths (one needs 4 ranks, one 2, the rest fit
one) is run step by step on 4 gloo processes: at every step each slot builds its record
(``cp.dynamic_steps.step_batch``), runs ``all_gather_cp_attention`` over its block's process group
(``cp.dynamic_groups.block_groups``, made once, in one order on every rank) while the other blocks run theirs
at the same time, and backpropagates a per-token loss. Outputs and q/k/v gradients, gathered per token over
the pool, equal single-process document-causal attention over all documents (the CP 1 run) within 1e-5, and
every token of every document is computed exactly once.

The data iterator (no Megatron) gives a group's members the same micro-batch at the same step over a DP2 x CP2
pool, every token once; through Megatron's loop (torchrun, gloo, the tiny GPT, ``slow``) DP2 x CP2 and TP2 (SP)
x CP2 with ``--wlb-cp-sharding dynamic`` train the CP 1 run's loss and grad norm within 1e-5 relative, every
document once, and a resume from iteration 2 trains iterations 3 and 4 the same.
"""

from __future__ import annotations

import numpy as np
import pytest
import torch
from conftest import run_world

from megatron_wlb.costmodel import ParallelLayout, build_cost_model
from megatron_wlb.cp.dynamic import group_cost_models, plan_dynamic_cp
from megatron_wlb.cp.dynamic_steps import aligned_blocks, slot_step, step_batch

#: mixed lengths: 300 tokens need 4 ranks under the cap, 200 need 2, the rest fit one
LENGTHS = np.array([300, 40, 17, 120, 5, 64, 200, 33, 9, 90, 1, 2], dtype=np.int64)
CAP = 128
SLOTS = 4
HEADS, KV_HEADS, DIM = 4, 2, 8


def _plan():
    costs = group_cost_models(build_cost_model("7b", ParallelLayout(tp=1, cp=2, dp=2)), SLOTS)
    return plan_dynamic_cp(LENGTHS, SLOTS, CAP, costs)


def _starts() -> np.ndarray:
    return np.concatenate([[0], np.cumsum(LENGTHS)[:-1]])


def _packed_of(docs: tuple[int, ...], segments: np.ndarray):
    """The documents' global token numbers as tokens and labels (so a row names its token), loss mask 1; the
    padding segment (if any) -1 with loss mask 0."""
    starts = _starts()
    ids = np.concatenate([np.arange(starts[d], starts[d] + LENGTHS[d]) for d in docs]).astype(np.int64)
    pad = int(np.sum(segments)) - ids.size
    mask = np.concatenate([np.ones(ids.size, dtype=np.float32), np.zeros(pad, dtype=np.float32)])
    ids = np.concatenate([ids, np.full(pad, -1, dtype=np.int64)])
    return ids, ids, mask


def test_aligned_blocks_are_every_power_of_two_block_in_one_order():
    assert aligned_blocks(4) == [(0, 2), (2, 2), (0, 4)]
    assert aligned_blocks(8, largest=4) == [(0, 2), (2, 2), (4, 2), (6, 2), (0, 4), (4, 4)]
    assert aligned_blocks(6) == [(0, 2), (2, 2), (4, 2), (0, 4)]
    assert aligned_blocks(1) == []
    with pytest.raises(ValueError, match="ranks=0"):
        aligned_blocks(0)


def test_every_slot_runs_every_step_and_every_token_runs_once():
    plan = _plan()
    sizes = {mb.size for mb in plan.micro_batches}
    assert sizes == {1, 2, 4}, sizes  # the test exercises every group size of the pool
    seen = np.zeros(int(LENGTHS.sum()), dtype=np.int64)
    for step in range(plan.steps):
        for slot in range(SLOTS):
            mb = slot_step(plan, slot, step)
            batch = step_batch(mb, slot, LENGTHS, _packed_of)
            if mb is None:  # an empty micro-batch: padding whose loss counts nothing
                assert batch.loss_mask.sum() == 0 and batch.layout.cp == 1
                continue
            for other in mb.ranks:  # a group's members run the same micro-batch at the same step
                assert slot_step(plan, other, step) is mb
            assert batch.layout.cp == mb.size and batch.loss_mask.all()
            np.add.at(seen, batch.tokens[0], 1)
    assert (seen == 1).all(), np.flatnonzero(seen != 1)[:10]
    pair = next(mb for mb in plan.micro_batches if mb.size == 2)
    outsider = (pair.first_rank + 2) % SLOTS
    with pytest.raises(ValueError, match=f"slot {outsider} is not a member"):
        step_batch(pair, outsider, LENGTHS, _packed_of)
    with pytest.raises(ValueError, match="step 99 is outside"):
        slot_step(plan, 0, 99)


def test_sequence_parallel_pads_every_slot_to_a_multiple_of_tp():
    plan = _plan()
    seen = np.zeros(int(LENGTHS.sum()), dtype=np.int64)
    for step in range(plan.steps):
        for slot in range(SLOTS):
            batch = step_batch(slot_step(plan, slot, step), slot, LENGTHS, _packed_of, rank_multiple=4)
            assert batch.rows.size % 4 == 0, (step, slot, batch.rows.size)
            assert batch.local_pad == (-(batch.rows.size - batch.local_pad)) % 4
            assert (batch.rows[batch.rows.size - batch.local_pad:] == -1).all()
            assert batch.loss_mask[0, batch.rows < 0].sum() == 0
            np.add.at(seen, batch.tokens[0, batch.loss_mask[0] > 0], 1)
    assert (seen == 1).all()


def _worker(rank: int, world: int) -> None:
    import torch.distributed as dist

    from megatron_wlb.cp.attention import all_gather_cp_attention
    from megatron_wlb.cp.device import upload
    from megatron_wlb.cp.dynamic_groups import block_groups, group_of

    torch.manual_seed(0)
    total = int(LENGTHS.sum())
    q = torch.randn(total, HEADS, DIM, dtype=torch.float64)
    k = torch.randn(total, KV_HEADS, DIM, dtype=torch.float64)
    v = torch.randn(total, KV_HEADS, DIM, dtype=torch.float64)
    weight = torch.randn(total, HEADS, DIM, dtype=torch.float64)
    groups = block_groups([list(range(world))])
    mine = [b for b in aligned_blocks(world) if rank in range(b[0], b[0] + b[1])]
    assert sorted(groups) == sorted([(rank, 1), *mine])
    plan = _plan()
    out = torch.zeros_like(q)
    grads = [torch.zeros_like(t) for t in (q, k, v)]
    count = torch.zeros(total, dtype=torch.float64)
    for step in range(plan.steps):
        mb = slot_step(plan, rank, step)
        batch = step_batch(mb, rank, LENGTHS, _packed_of)
        if mb is None:
            continue
        rows = torch.as_tensor(batch.tokens[0])
        mine = [t[rows].clone().requires_grad_() for t in (q, k, v)]
        on_device = upload(batch, "cpu")
        got = all_gather_cp_attention(*mine, on_device.varlen, on_device.gather,
                                      group_of(groups, mb.first_rank, mb.size))
        (got * weight[rows]).sum().backward()
        out.index_add_(0, rows, got.detach())
        count.index_add_(0, rows, torch.ones(rows.numel(), dtype=torch.float64))
        for acc, t in zip(grads, mine, strict=True):
            acc.index_add_(0, rows, t.grad)
    for t in (out, count, *grads):
        dist.all_reduce(t)
    assert (count == 1).all(), "every token of every document runs exactly once"
    # the CP 1 run: every document whole on one process
    from megatron_wlb.cp.attention import reference_document_attention

    ref_in = [t.clone().requires_grad_() for t in (q, k, v)]
    cu = np.concatenate([[0], np.cumsum(LENGTHS)])
    ref = reference_document_attention(*ref_in, cu)
    (ref * weight).sum().backward()
    torch.testing.assert_close(out, ref.detach(), rtol=1e-5, atol=1e-7)
    for name, got_grad, t in zip("qkv", grads, ref_in, strict=True):
        torch.testing.assert_close(got_grad, t.grad, rtol=1e-5, atol=1e-7, msg=lambda m, n=name: f"d{n}: {m}")


def test_group_attention_over_a_dp2_cp2_pool_equals_cp1():
    run_world(_worker, SLOTS)


# --- through Megatron's loop -----------------------------------------------------------------------------------
ITERATIONS = 4
#: the tiny GPT's --seq-length 256 gives the packer a capacity of 384 (1.5 x): at CP 2 a slot holds at most 192
#: tokens of a micro-batch, so every piece over 192 tokens runs on a group of (at least) 2 slots
SLOT_CAP = 192


def train_dynamic(tmp_path, name: str, corpus: str, env: dict, *flags: str, global_batch: int = 8):
    """The tiny GPT through Megatron's loop: ``ITERATIONS`` iterations of the original packer's plans."""
    from megatron_train_runs import train

    return train(tmp_path, name, corpus, "--wlb-packer", "original", "--global-batch-size", str(global_batch),
                 "--train-iters", str(ITERATIONS), *flags, env=env)


def plans_of(run) -> list:
    return next(r["plans"] for r in run.ranks.values() if r["plans"])


def grad_norms_of(run) -> dict[int, float]:
    return {int(k): v for k, v in next(r["grad_norms"] for r in run.ranks.values()).items()}


def assert_equals_cp1(base, run) -> None:
    """``run`` trained ``base``'s plans with the same losses and grad norms (1e-5 relative), every document once,
    and some piece over a slot's cap (it ran on a group)."""
    from megatron_train_runs import assert_documents_once

    assert plans_of(run) == plans_of(base)
    assert any(length > SLOT_CAP for plan in plans_of(run) for _, length in plan)
    norms, got = grad_norms_of(base), grad_norms_of(run)
    assert sorted(run.losses) == sorted(norms) == list(range(1, ITERATIONS + 1))
    for it, loss in base.losses.items():
        assert run.losses[it] == pytest.approx(loss, rel=1e-5), (it, run.losses, base.losses)
        assert got[it] == pytest.approx(norms[it], rel=1e-5), (it, got, norms)
    assert_documents_once(run)


@pytest.fixture(scope="module")
def dynamic_runs(tmp_path_factory, text_corpus):
    """The CP 1 run (DP2) and the dynamic DP2 x CP2 run of the same plans, the latter saving at iterations 2 and 4;
    its checkpoint folder."""
    tmp = tmp_path_factory.mktemp("dynamic_cp")
    base = train_dynamic(tmp, "cp1", text_corpus, {"DP": "2"}, "--wlb-cp-sharding", "per-document")
    ckpt = tmp / "ckpt"
    run = train_dynamic(tmp, "dynamic", text_corpus, {"DP": "2", "CP": "2"}, *_saving(ckpt))
    return base, run, ckpt


def _saving(ckpt) -> tuple[str, ...]:
    return "--wlb-cp-sharding", "dynamic", "--save-interval", "2", "--ckpt-format", "torch", "--save", str(ckpt)


@pytest.mark.slow
def test_dynamic_cp_training_at_dp2_cp2_equals_cp1(dynamic_runs):
    """DP2 x CP2 with ``--wlb-cp-sharding dynamic`` trains the CP 1 run's (DP2, the same plans) loss and grad norm
    within 1e-5 relative at every iteration, every document's tokens once over the pool."""
    from megatron_train_runs import assert_trains

    base, run, _ = dynamic_runs
    assert_trains(run, ITERATIONS)
    assert_equals_cp1(base, run)
    # mixed lengths: every iteration has pieces a slot cannot hold alone (a group of 2 ran them) and short ones
    for plan in plans_of(run):
        lengths = [length for _, length in plan]
        assert max(lengths) > SLOT_CAP and min(lengths) < SLOT_CAP // 2, lengths


@pytest.mark.slow
def test_dynamic_cp_resumes_to_the_same_iterations(tmp_path, text_corpus, dynamic_runs):
    """Resumed from its iteration-2 checkpoint, the dynamic run trains iterations 3 and 4 with the CP 1 run's
    plans, loss and grad norm (within 1e-5), every document once."""
    import shutil

    from megatron_train_runs import assert_documents_once

    base, _, saved = dynamic_runs
    ckpt = tmp_path / "ckpt"
    shutil.copytree(saved, ckpt)
    (ckpt / "latest_checkpointed_iteration.txt").write_text("2")
    resumed = train_dynamic(tmp_path, "resumed", text_corpus, {"DP": "2", "CP": "2"}, *_saving(ckpt),
                            "--load", str(ckpt))
    assert plans_of(resumed) == plans_of(base)[2:]
    norms, resumed_norms = grad_norms_of(base), grad_norms_of(resumed)
    for it in (1, 2):
        assert resumed.losses[it] == pytest.approx(base.losses[it + 2], rel=1e-5), (it, resumed.losses)
        assert resumed_norms[it] == pytest.approx(norms[it + 2], rel=1e-5), (it, resumed_norms)
    assert_documents_once(resumed)


@pytest.mark.slow
def test_dynamic_cp_under_tp2_sequence_parallel_equals_cp1(tmp_path, text_corpus):
    """TP2 with --sequence-parallel, CP2 (a pool of 2 slots, each slot's rows padded to a multiple of TP): the loss
    and grad norm of TP2 at CP 1 within 1e-5 at every iteration, every document once."""
    base = train_dynamic(tmp_path, "tp2", text_corpus, {"TP": "2"}, "--sequence-parallel", "--wlb-cp-sharding",
                         "per-document", global_batch=4)
    run = train_dynamic(tmp_path, "tp2_dynamic", text_corpus, {"TP": "2", "CP": "2"}, "--sequence-parallel",
                        "--wlb-cp-sharding", "dynamic", global_batch=4)
    assert_equals_cp1(base, run)


# --- the iterator (no Megatron): every slot of a DP2 x CP2 pool, step by step ------------------------------------
def stdlib_pool_inputs(tmp_path, n: int, files: int, iterations: int):
    """A DP2 x CP2 pool's inputs: a reader over the first ``files`` stdlib ``.py`` files (a Megatron .bin/.idx),
    its stream of ``iterations`` iterations of ``n`` micro-batches of 512 tokens a DP rank, that packing
    config, and the 7b cost model at CP2 x DP2."""
    import os
    import sysconfig

    from megatron_wlb.data.reader import DocumentReader, byte_documents, write_indexed_dataset
    from megatron_wlb.packing.types import PackingConfig

    root = sysconfig.get_paths()["stdlib"]
    paths = sorted(os.path.join(root, f) for f in os.listdir(root) if f.endswith(".py"))[:files]
    prefix = write_indexed_dataset(str(tmp_path / "a_text_document"), byte_documents(paths))
    reader = DocumentReader([(prefix, 1.0)], split="1,0,0", seed=3)
    cfg = PackingConfig(seq_len=512, n=n, dp=2)
    return reader, reader.stream(iterations * cfg.tokens_per_iteration), cfg, \
        build_cost_model("7b", ParallelLayout(tp=1, cp=2, dp=2))


def _pool_iterators(tmp_path, n: int, cap: int):
    from megatron_wlb.cp.dynamic_steps import DynamicPool
    from megatron_wlb.megatron.data.packed import WlbDataIterator
    from megatron_wlb.packing import make_packer

    reader, stream, cfg, cost = stdlib_pool_inputs(tmp_path, n, files=12, iterations=6)
    return reader, [WlbDataIterator(reader, stream, make_packer("original", cfg), slot // 2,
                                    dynamic=DynamicPool(SLOTS, slot, cap, cost)) for slot in range(SLOTS)]


def test_the_iterator_gives_every_slot_its_group_step_and_every_token_once(tmp_path):
    reader, its = _pool_iterators(tmp_path, n=4, cap=768 // 2)  # capacity 1.5 x 512 over CP 2
    sizes: set[int] = set()
    for _ in range(2):  # iterations
        steps = [[next(it) for _ in range(it.n)] for it in its]
        batch = its[0].current
        covered = {(p.doc_id, p.offset): np.zeros(p.length, dtype=np.int64)
                   for mb in batch.micro_batches for p in mb.pieces}
        for slot, records in enumerate(steps):
            for step, rec in enumerate(records):
                first, size = rec.block
                assert first <= slot < first + size and first % size == 0
                sizes.add(size)
                for member in range(first, first + size):  # the group's members run it at the same step
                    assert steps[member][step].micro_batch == rec.micro_batch and steps[member][step].block == rec.block
                if not rec.micro_batch.pieces:
                    assert size == 1 and rec.loss_mask.sum() == 0
                    continue
                starts = np.concatenate([[0], np.cumsum(rec.micro_batch.lengths)])
                for i, p in enumerate(rec.micro_batch.pieces):
                    mine = (rec.rows >= starts[i]) & (rec.rows < starts[i + 1])
                    within = rec.rows[mine] - starts[i]
                    covered[(p.doc_id, p.offset)][within] += 1
                    assert np.array_equal(rec.tokens[0, mine], reader.read(p.doc_id, p.offset, p.length)[within])
        assert all((c == 1).all() for c in covered.values()), "every token of the global batch once over the pool"
    assert 2 in sizes and 1 in sizes, sizes
    # a plan that needs more micro-batches than Megatron runs per iteration stops in one line
    (tmp_path / "tight").mkdir()
    _, tight = _pool_iterators(tmp_path / "tight", n=1, cap=128)  # 4 x 128: the longest piece fits
    from megatron_wlb.megatron.args.validation import RunRefusal

    with pytest.raises(RunRefusal, match=r"^megatron_wlb: iteration 0: the dynamic-CP plan of this global batch needs "
                                          r"\d+ micro-batches on its busiest rank, but Megatron runs 1 per"):
        next(tight[0])
