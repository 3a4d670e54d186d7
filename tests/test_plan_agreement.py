"""The plan agreement (``megatron_wlb.megatron.state.agreement``): every rank of the world trains one global
plan. A gloo world whose ranks build their own reader + packer (``build_train_iterator``): alike, the
check passes every iteration; one rank reading a copy of the corpus whose documents are one token
longer, every rank stops at the first iteration naming the ranks and the first differing document.
(Through Megatron's own loop: ``test_megatron_train_resume.py::test_a_rank_reading_other_data_...``.)"""

from __future__ import annotations

import os
import sysconfig

import numpy as np
import pytest
from conftest import run_world

from megatron_wlb.megatron.state.agreement import NO_PLAN_KEY, _ranges, describe_disagreement, plan_key
from megatron_wlb.packing.types import DocPiece, GlobalBatch, MicroBatch

WORLD = 3
ITERATIONS = 3


def test_describe_names_the_ranks_and_the_first_differing_piece():
    same = [(0, 11, [(0, 5, 0, 10), (0, 7, 0, 3), (1, 9, 0, 4)])] * 2
    other = [(0, 22, [(0, 5, 0, 10), (0, 7, 0, 4), (1, 9, 0, 4)])]
    text = describe_disagreement([*same, *other, *same])
    assert text.startswith("megatron_wlb: the ranks planned 2 different global batches for iteration 0: rank 2 "
                           "vs ranks 0-1,3-4, first difference at piece 1: document 7 (offset 0, 4 tokens, "
                           "micro-batch 0) on rank 2 vs document 7 (offset 0, 3 tokens, micro-batch 0) on rank 0. ")
    ended = describe_disagreement([same[0], (-1, NO_PLAN_KEY, [])])
    assert "rank 1 planned iteration -1, rank 0 iteration 0" in ended
    assert _ranges([0, 1, 2, 5, 7, 8]) == "0-2,5,7-8"


def test_the_key_follows_every_piece():
    mb = MicroBatch((DocPiece(3, 0, 10, 0), DocPiece(4, 0, 6, 0)), 32)
    base = GlobalBatch(0, (mb, mb), dp=2, n=1)
    moved = GlobalBatch(0, (mb, MicroBatch((DocPiece(3, 0, 10, 0), DocPiece(4, 0, 7, 0)), 32)), dp=2, n=1)
    assert plan_key(base) == plan_key(GlobalBatch(0, (mb, mb), dp=2, n=1))
    assert plan_key(base) != plan_key(moved) and 0 <= plan_key(base) < NO_PLAN_KEY
    assert plan_key(None) == NO_PLAN_KEY


def worker(rank: int, world: int, prefix: str, longer: str) -> None:
    from argparse import Namespace

    from megatron_wlb.megatron import build_train_iterator
    from megatron_wlb.megatron.args.flags import settings_from_args
    from megatron_wlb.megatron.state.agreement import check_plan_agreement

    def iterator(data: str, dp_rank: int):
        args = Namespace(seq_length=1024, micro_batch_size=1, global_batch_size=2 * world, data_parallel_size=world,
                         tensor_model_parallel_size=1, context_parallel_size=1, pipeline_model_parallel_size=1,
                         train_iters=ITERATIONS, seed=1234, hidden_size=256, num_layers=4, num_attention_heads=8,
                         ffn_hidden_size=1024, data_path=[data], split="98,2,0", wlb_packer="wlb",
                         wlb_max_seq_len=2048)
        return build_train_iterator(args, settings_from_args(args), dp_rank)

    import torch

    cpu = torch.device("cpu")
    alike = iterator(prefix, rank)
    for _ in range(ITERATIONS):
        assert check_plan_agreement(alike.prepare(), device=cpu) < 1.0
        assert alike.prepare() is alike.current  # planned once: reading it does not plan again
        for _ in range(alike.n):
            next(alike)
    assert check_plan_agreement(alike.prepare(), device=cpu) < 1.0  # the stream goes on (slack) alike
    divergent = iterator(longer if rank == 1 else prefix, rank)
    with pytest.raises(RuntimeError) as caught:  # the first iteration with a document end in it (long documents
        for _ in range(ITERATIONS):              # cut into whole pieces plan alike on both copies)
            check_plan_agreement(divergent.prepare(), device=cpu)
            for _ in range(divergent.n):
                next(divergent)
    text = str(caught.value)
    assert (f"planned 2 different global batches for iteration {divergent.iteration}: rank 1 vs ranks 0,2, first "
            "difference at piece ") in text
    ref = [(m, p.doc_id, p.offset, p.length) for m, mb in enumerate(divergent.current.micro_batches)
           for p in mb.pieces]
    if rank != 1:  # this rank's plan is the reference: the message names its piece where rank 1's plan leaves it
        at = int(text.split("first difference at piece ")[1].split(":")[0])
        m, doc, offset, length = ref[at]
        assert f"vs document {doc} (offset {offset}, {length} tokens, micro-batch {m}) on rank 0." in text


def test_every_rank_stops_when_one_reads_a_longer_copy(tmp_path):
    from megatron_wlb.data.reader import byte_documents, write_indexed_dataset

    root = sysconfig.get_paths()["stdlib"]
    names = sorted(n for n in os.listdir(root) if n.endswith(".py"))[50:70]
    docs = byte_documents([os.path.join(root, n) for n in names])
    prefix = write_indexed_dataset(str(tmp_path / "text_document"), docs)
    longer = write_indexed_dataset(str(tmp_path / "copy_text_document"), [np.append(d, 10) for d in docs])
    from megatron.core import parallel_state  # noqa: F401  (fork: the workers inherit the imports)

    run_world(worker, WORLD, start_method="fork", prefix=prefix, longer=longer)
