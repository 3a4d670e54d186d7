"""Issue 48 (2, PP > 1): ``--wlb-cp-sharding dynamic`` through Megatron's 1F1B pipeline schedule.

Every stage's ranks plan the same dynamic-CP plan from the agreed global plan (the same slot of their stage's
DP x CP pool: the same groups, micro-batches and order on every stage), so each pipeline of slots runs the same
micro-batch at the same schedule position on every stage; the activations between stages have per-micro-batch
shapes (``variable_seq_lengths``), and middle stages build each micro-batch's attention metadata and group from
the same record. PP2 x CP2 (4 ranks, gloo, the tiny GPT) trains the CP 1 run's (PP2) loss and grad norm within
1e-5 relative at every iteration, every document once, each slot's two stages running the same micro-batch at
every step (from the timing trace). The pinned core 0.16 ``get_batch`` path (whose middle and other stages get
their params back as handed out with the ``cu_seqlens``) keeps each micro-batch's group.
"""

from __future__ import annotations

import pytest
from test_issue48_dynamic_runtime import ITERATIONS, assert_equals_cp1, train_dynamic


@pytest.mark.slow
def test_dynamic_cp_at_pp2_cp2_equals_cp1(tmp_path, text_corpus):
    from megatron_train_runs import assert_trains

    base = train_dynamic(tmp_path, "pp2", text_corpus, {"PP": "2"}, "--wlb-cp-sharding", "per-document",
                         global_batch=4)
    run = train_dynamic(tmp_path, "pp2_dynamic", text_corpus, {"PP": "2", "CP": "2"}, "--wlb-cp-sharding", "dynamic",
                        "--wlb-trace", str(tmp_path / "pp2_dynamic" / "trace.jsonl"), global_batch=4)
    assert_trains(run, ITERATIONS)
    assert_equals_cp1(base, run)
    _assert_stages_run_the_same_groups(run)


def _assert_stages_run_the_same_groups(run) -> None:
    """From the timing trace: at every step both stages of a slot's pipeline run the same micro-batch (its
    pieces and this rank's share), some micro-batches run alone and some over the group of 2, and at some step
    the two slots' pipelines run different micro-batches."""
    from megatron_wlb.costmodel.trace import read_trace

    trace = read_trace(run.out / "trace.jsonl")
    slot_of = {r.rank: r.cp for r in trace.iterations}  # Megatron's CP rank: the slot of the DP1 x CP2 pool
    assert sorted(slot_of.values()) == [0, 0, 1, 1]
    runs: dict[tuple[int, int, int], dict[int, tuple]] = {}
    for r in trace.micro_batches:
        runs.setdefault((r.iteration, r.micro_batch, slot_of[r.rank]), {})[r.pp] = (r.lengths, r.rank_tokens)
    assert len(runs) == ITERATIONS * 4 * 2  # 4 micro-batches per iteration, 2 slots
    assert all(stages[0] == stages[1] for stages in runs.values()), "the stages of a pipeline ran other micro-batches"
    alone = [k for k, v in runs.items() if v[0][0] and v[0][1] == sum(v[0][0])]
    grouped = [k for k, v in runs.items() if v[0][0] and v[0][1] < sum(v[0][0])]
    assert alone and grouped, (alone, grouped)
    assert any(runs[(it, mb, 0)][0][0] != runs[(it, mb, 1)][0][0] for it, mb, _ in runs)


def test_the_pinned_get_batch_path_keeps_the_micro_batchs_group(monkeypatch):
    """The pinned ``pretrain_gpt.get_batch`` hands our THD hook only the ``cu_seqlens``: the params it takes back
    (``cp_hooks.hand_out``) name the micro-batch's dynamic-CP group (not the run's fixed CP group), as the direct
    upload does."""
    import numpy as np

    from megatron_wlb.cp.dynamic import GroupMicroBatch
    from megatron_wlb.cp.dynamic_steps import step_batch
    from megatron_wlb.megatron.hooks import cp_hooks

    lengths = np.array([100, 50], dtype=np.int64)

    def packed_of(docs, segments):
        size = int(np.sum(segments))
        return np.arange(size, dtype=np.int64), np.arange(size, dtype=np.int64), np.ones(size, dtype=np.float32)

    record = step_batch(GroupMicroBatch(2, 2, (0, 1), 150, 1.0), 3, lengths, packed_of)
    group = object()
    monkeypatch.setitem(cp_hooks._DYNAMIC_GROUPS, (2, 2), group)
    assert record.block == (2, 2)
    fields = cp_hooks.pinned_batch_fields(record)
    _, params = cp_hooks.get_thd_batch_on_this_cp_rank({}, fields["cu_seqlens"], None, fields["max_seqlen"])
    assert params.cp_group is group
    fields = cp_hooks.pinned_batch_fields(record)
    assert cp_hooks.packed_seq_params_of(fields["cu_seqlens"]).cp_group is group  # the patched 0.19 forward_step's
    assert cp_hooks.upload_micro_batch(record, tokens=False)[1].cp_group is group  # a middle stage's params
