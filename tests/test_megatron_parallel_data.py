"""8 gloo processes under megatron-core's parallel_state (TP2/PP2/DP2, CP2/DP4, TP2/CP2/DP2): every rank
builds the reader + packer alone; all ranks' global plans are identical, each DP rank gets exactly its
slice, the union over DP ranks is the global batch, and TP/CP/PP peers read identical micro-batches."""

from __future__ import annotations

import hashlib
import os
import sysconfig
from argparse import Namespace

import pytest
from conftest import run_world

from megatron_wlb.data.reader import byte_documents, write_indexed_dataset

WORLD = 8
LAYOUTS = [  # (tp, cp, pp) -> dp = 8 / (tp * cp * pp)
    (2, 1, 2),
    (1, 2, 1),
    (2, 2, 1),
]
ITERATIONS = 4


def megatron_args(data_prefix: str, tp: int, cp: int, pp: int, packing_n: int = 2) -> Namespace:
    dp = WORLD // (tp * cp * pp)
    return Namespace(seq_length=1024, micro_batch_size=1, global_batch_size=packing_n * dp, data_parallel_size=dp,
                     tensor_model_parallel_size=tp, context_parallel_size=cp, pipeline_model_parallel_size=pp,
                     train_iters=ITERATIONS, seed=1234, hidden_size=256, num_layers=4, num_attention_heads=8,
                     ffn_hidden_size=1024, data_path=[data_prefix], split="98,2,0", sequence_parallel=tp > 1)


def worker(rank: int, world: int, data_prefix: str) -> None:
    """Every layout of LAYOUTS in turn on this gloo world: each rank builds its iterator; rank 0 checks."""
    import torch.distributed as dist
    from megatron.core import parallel_state

    from megatron_wlb.megatron import build_train_iterator
    from megatron_wlb.megatron.args.flags import settings_from_args
    from megatron_wlb.megatron.data.packed import plan_digest

    for tp, cp, pp in LAYOUTS:
        parallel_state.initialize_model_parallel(tensor_model_parallel_size=tp, pipeline_model_parallel_size=pp,
                                                 context_parallel_size=cp)
        args = megatron_args(data_prefix, tp, cp, pp)
        args.wlb_packer, args.wlb_max_seq_len = "wlb", 2048
        settings = settings_from_args(args)
        dp_rank = parallel_state.get_data_parallel_rank()
        assert parallel_state.get_data_parallel_world_size() == args.data_parallel_size
        it = build_train_iterator(args, settings, dp_rank, parallel_state.get_context_parallel_rank())
        for _ in range(ITERATIONS):
            mbs = [next(it) for _ in range(it.n)]  # exactly n micro-batches per step on every rank
            plan = it.current
            mine = [[(p.doc_id, p.offset, p.length) for p in mb.pieces] for mb in plan.for_dp_rank(dp_rank)]
            from megatron_wlb.cp.layouts import layout_digest

            # every peer of a DP rank: the same micro-batches and layouts; of a (DP, CP) rank: the same rows
            data_hash = hashlib.sha256(b"".join(m.segment_lengths.tobytes() + str(layout_digest(m.layout))
                                                .encode() for m in mbs)).hexdigest()
            rows_hash = hashlib.sha256(b"".join(m.tokens.tobytes() + m.labels.tobytes() for m in mbs)).hexdigest()
            # T is a multiple of CP x TP (sequence parallel): equal CP shards that split over TP
            pad_ok = all(int(m.segment_lengths.sum()) % (cp * tp) == 0
                         and m.segment_lengths.sum() >= sum(p.length for p in m.micro_batch.pieces)
                         and m.tokens.shape[1] % (tp if args.sequence_parallel else 1) == 0 for m in mbs)
            record = {"rank": rank, "dp_rank": dp_rank, "digest": plan_digest(plan), "mine": mine,
                      "all": [[(p.doc_id, p.offset, p.length) for p in mb.pieces] for mb in plan.micro_batches],
                      "hash": data_hash, "pad_ok": pad_ok, "n": len(mbs),
                      "cp_rank": parallel_state.get_context_parallel_rank(), "rows": rows_hash}
            gathered = [None] * world
            dist.all_gather_object(gathered, record)
            if rank == 0:
                check(gathered, (tp, cp, pp), args.data_parallel_size, it.n)
        parallel_state.destroy_model_parallel()


def check(records: list[dict], layout: tuple[int, int, int], dp: int, n: int) -> None:
    """Rank 0's assertions over every rank's record of one iteration."""
    assert len({r["digest"] for r in records}) == 1, f"{layout}: ranks disagree on the global plan"
    full = records[0]["all"]
    assert len(full) == dp * n
    by_dp: dict[int, list[dict]] = {}
    for r in records:
        assert r["n"] == n and r["pad_ok"], f"{layout}: rank {r['rank']} read {r['n']} micro-batches or bad padding"
        assert r["mine"] == full[r["dp_rank"] * n:(r["dp_rank"] + 1) * n], f"{layout}: rank {r['rank']} slice"
        by_dp.setdefault(r["dp_rank"], []).append(r)
    assert sorted(by_dp) == list(range(dp)), f"{layout}: DP ranks {sorted(by_dp)}"
    union = [mb for d in range(dp) for mb in by_dp[d][0]["mine"]]
    assert union == full, f"{layout}: the DP slices do not make up the global batch"
    for d, peers in by_dp.items():  # TP/CP/PP peers of one DP rank: the same micro-batches and layouts
        assert len(peers) == len(records) // dp and len({p["hash"] for p in peers}) == 1, f"{layout}: DP {d} peers"
        for c in {p.get("cp_rank", 0) for p in peers}:  # TP/PP peers of one (DP, CP) rank: the same rows
            assert len({p.get("rows") for p in peers if p.get("cp_rank", 0) == c}) == 1, f"{layout}: DP {d} CP {c}"


def test_all_ranks_compute_the_same_plan_and_take_their_slice(tmp_path):
    root = sysconfig.get_paths()["stdlib"]
    names = sorted(n for n in os.listdir(root) if n.endswith(".py"))[50:70]
    prefix = write_indexed_dataset(str(tmp_path / "text_document"),
                                   byte_documents([os.path.join(root, n) for n in names]))
    # fork: the workers inherit this process's torch + megatron.core imports (spawn would pay ~9 s of
    # imports per process on a 2-core runner); nothing CUDA or distributed is initialised before it.
    from megatron.core import parallel_state  # noqa: F401

    run_world(worker, WORLD, start_method="fork", data_prefix=prefix)


def test_the_cross_rank_check_catches_a_wrong_slice():
    """The assertions above can fail: a rank holding another rank's slice, or another plan, is caught."""
    full = [[(1, 0, 5)], [(2, 0, 3)], [(3, 0, 4)], [(4, 0, 6)]]
    good = [{"rank": r, "dp_rank": r // 2, "digest": "x", "all": full, "mine": full[(r // 2) * 2:(r // 2) * 2 + 2],
             "hash": f"h{r // 2}", "pad_ok": True, "n": 2} for r in range(4)]
    check(good, (2, 1, 1), dp=2, n=2)
    wrong_slice = [dict(r) for r in good]
    wrong_slice[3]["mine"] = full[:2]
    with pytest.raises(AssertionError, match="slice"):
        check(wrong_slice, (2, 1, 1), dp=2, n=2)
    other_plan = [dict(r) for r in good]
    other_plan[1]["digest"] = "y"
    with pytest.raises(AssertionError, match="disagree"):
        check(other_plan, (2, 1, 1), dp=2, n=2)
    peer_differs = [dict(r) for r in good]
    peer_differs[1]["hash"] = "other"
    with pytest.raises(AssertionError, match="peers"):
        check(peer_differs, (2, 1, 1), dp=2, n=2)
