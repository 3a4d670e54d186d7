"""The start-up agreement and the per-iteration CP layout agreement (``megatron_wlb.megatron.state.agreement``,
``megatron_wlb.data.fingerprint``): issue 37's D1 (a CP rank with another cost profile or CP sharding laid
micro-batches out differently from micro-batch 4 on, rc 0), D2 (a same-size ``.bin`` with zeroed bytes trained
silently, and was accepted on resume) and D6 (a flag that changes collectives but not the plan hung or
aborted). Pure parts here and over a real gloo world; through Megatron's loop in ``test_megatron_train.py``."""

from __future__ import annotations

import hashlib
import os
from argparse import Namespace

import numpy as np
import pytest
from conftest import run_world

from megatron_wlb.data import fingerprint as fp
from megatron_wlb.megatron.state.agreement import (
    RunFingerprint,
    describe_fingerprint_disagreement,
    describe_layout_disagreement,
    resume_data_refusal,
)


def _zeroed_copy(src: str, dst: str, fraction: float) -> None:
    """``src`` copied to ``dst`` with its first ``fraction`` of bytes zeroed (an interrupted preallocating copy)."""
    data = bytearray(open(src, "rb").read())
    data[:int(len(data) * fraction)] = bytes(int(len(data) * fraction))
    open(dst, "wb").write(bytes(data))


def test_the_sampled_bin_digest_sees_a_zeroed_copy_and_reads_a_fixed_amount(tmp_path):
    rng = np.random.default_rng(0)
    src = tmp_path / "a.bin"
    src.write_bytes(rng.integers(1, 255, 20_000_000, dtype=np.uint8).tobytes())
    same, zeroed, tail = tmp_path / "same.bin", tmp_path / "zeroed.bin", tmp_path / "tail.bin"
    same.write_bytes(src.read_bytes())
    _zeroed_copy(str(src), str(zeroed), 0.6)
    data = bytearray(src.read_bytes())
    data[-1] ^= 1  # the last byte: on the last sampled page
    tail.write_bytes(bytes(data))
    digest = fp.sampled_sha256(src)
    assert fp.sampled_sha256(same) == digest
    assert fp.sampled_sha256(zeroed) != digest and fp.sampled_sha256(tail) != digest
    grown = tmp_path / "grown.bin"
    grown.write_bytes(src.read_bytes() + b"\0")
    assert fp.sampled_sha256(grown) != digest  # the size is part of it
    # what it cannot see, by design: one byte between two sampled pages
    gap = (len(data) - fp.PAGE_BYTES) // (fp.BIN_SAMPLE_PAGES - 1)
    data = bytearray(src.read_bytes())
    data[gap // 2 + fp.PAGE_BYTES] ^= 1
    between = tmp_path / "between.bin"
    between.write_bytes(bytes(data))
    assert fp.sampled_sha256(between) == digest
    small = tmp_path / "small.bin"
    small.write_bytes(b"abc")
    assert fp.sampled_sha256(small) != fp.sampled_sha256(tmp_path / "same.bin")
    with pytest.raises(ValueError, match="pages=1"):
        fp.sampled_sha256(src, pages=1)


def test_the_idx_digest_is_the_whole_file_read_in_bounded_chunks(tmp_path, monkeypatch):
    path = tmp_path / "x.idx"
    payload = os.urandom(100_003)
    path.write_bytes(payload)
    monkeypatch.setattr(fp, "_READ_BYTES", 4096)
    assert fp.file_sha256(path) == hashlib.sha256(payload).hexdigest()


def test_a_dataset_fingerprint_changes_with_either_file(tmp_path):
    from megatron_wlb.data.reader import write_indexed_dataset

    rng = np.random.default_rng(1)
    docs = [rng.integers(1, 250, int(n)) for n in rng.integers(50, 400, 200)]
    a = write_indexed_dataset(str(tmp_path / "a"), docs)
    b = write_indexed_dataset(str(tmp_path / "b"), docs)
    assert fp.dataset_fingerprint(a) == fp.dataset_fingerprint(b)
    _zeroed_copy(f"{a}.bin", f"{b}.bin", 0.6)
    got = fp.dataset_fingerprint(b)
    assert got["idx"] == fp.dataset_fingerprint(a)["idx"] and got["bin"] != fp.dataset_fingerprint(a)["bin"]


def test_the_disagreement_names_each_part_and_its_ranks():
    def fingerprint(interval: str, bin_digest: str, file: str) -> RunFingerprint:
        parts = (("--wlb-packer", "wlb"), ("--wlb-log-interval", interval), ("--data-path #1 .bin", bin_digest),
                 ("--data-path #1 .idx", "cccc"))
        return RunFingerprint(parts, (("--data-path #1 .bin", file), ("--data-path #1 .idx", file)))

    base, other = fingerprint("1", "aaaa", "c"), fingerprint("5", "bbbb", "d")
    text = describe_fingerprint_disagreement([base, base, other, base])
    assert text.startswith("megatron_wlb: the ranks start with different settings or data")
    assert "--wlb-log-interval: 1 on ranks 0-1,3, 5 on rank 2" in text
    assert "--data-path #1 .bin: aaaa (c) on ranks 0-1,3, bbbb (d) on rank 2" in text
    assert ".idx" not in text  # the same index under another name is the same data
    assert "--wlb-packer" not in text and "interrupted midway" in text and "\n" not in text


def test_a_resume_on_other_data_is_refused_naming_the_file():
    now = RunFingerprint((("--wlb-packer", "wlb"), ("--data-path #1 .idx", "i1"), ("--data-path #1 .bin", "b2")),
                         (("--data-path #1 .bin", "c_text_document"),))
    assert now.datasets() == {"--data-path #1 .idx": "i1", "--data-path #1 .bin": "b2"}
    assert resume_data_refusal(None, now, 8) is None  # a sidecar before version 4
    assert resume_data_refusal({"--data-path #1 .idx": "i1", "--data-path #1 .bin": "b2"}, now, 8) is None
    text = resume_data_refusal({"--data-path #1 .idx": "i1", "--data-path #1 .bin": "b1"}, now, 8)
    assert text is not None and "checkpoint at iteration 8" in text
    assert "--data-path #1 .bin: b1 -> b2 (c_text_document)" in text
    assert "--wlb-reset-data-stream" in text and ".bin: sampled pages" in text and ".idx:" not in text
    # an SFT jsonl is spoken of as one: its whole file's digest, no .idx or .bin
    sft = RunFingerprint((("--data-path #1 .jsonl", "j2"),), (("--data-path #1 .jsonl", "chat.jsonl"),))
    text = resume_data_refusal({"--data-path #1 .jsonl": "j1"}, sft, 8)
    assert text is not None and "--data-path #1 .jsonl: j1 -> j2 (chat.jsonl); .jsonl: the whole file)" in text
    assert ".idx" not in text and ".bin" not in text and "\n" not in text


def test_the_idx_digest_is_sampled_and_a_checkpoint_of_the_whole_file_digest_still_resumes(tmp_path):
    """Issue 57: the ``.idx`` digest reads its size and ``IDX_SAMPLE_PAGES`` pages (a fixed ~4 MiB at any size,
    not 19 GB at 1e9 documents), under part ``.idx-pages``; a sidecar saved with the whole-file digest (part
    ``.idx``) is not compared on it, and its other parts still are."""
    from megatron_wlb.data.indexed import write_index
    from megatron_wlb.megatron.state.agreement import IDX_PART

    lengths = np.arange(1, 600_001) % 97 + 1  # a 12 MB .idx: sampled, not read whole
    write_index(tmp_path / "a", lengths)
    np.zeros(1, dtype=np.uint16).tofile(tmp_path / "a.bin")
    got = fp.dataset_fingerprint(tmp_path / "a")
    assert got["idx"] == fp.sampled_sha256(tmp_path / "a.idx", fp.IDX_SAMPLE_PAGES)
    write_index(tmp_path / "b", lengths + 1)  # other lengths: every page differs
    np.zeros(1, dtype=np.uint16).tofile(tmp_path / "b.bin")
    assert fp.dataset_fingerprint(tmp_path / "b")["idx"] != got["idx"]
    now = RunFingerprint(((f"--data-path #1 {IDX_PART}", "p1"), ("--data-path #1 .bin", "b2")))
    assert resume_data_refusal({"--data-path #1 .idx": "whole", "--data-path #1 .bin": "b2"}, now, 8) is None
    text = resume_data_refusal({"--data-path #1 .idx": "whole", "--data-path #1 .bin": "b1"}, now, 8)
    assert text is not None and "--data-path #1 .bin: b1 -> b2" in text
    text = resume_data_refusal({f"--data-path #1 {IDX_PART}": "p0"}, now, 8)
    assert text is not None and f"{IDX_PART}: its size and sampled pages" in text


def test_the_layout_disagreement_names_the_dp_rank_and_the_micro_batch():
    same = [["per-sequence", 11], ["per-document", 12]]
    every = [(0, 0, same), (1, 0, same), (2, 1, same), (3, 1, [["per-sequence", 11], ["per-sequence", 13]])]
    text = describe_layout_disagreement(4, 1, every)
    assert "the CP ranks of DP rank 1 laid out micro-batch 1 of iteration 4 differently" in text
    assert "per-document (digest c) on ranks 2" in text and "per-sequence (digest d) on ranks 3" in text
    assert "--wlb-cost-profile" in text


# -- over a real gloo world -----------------------------------------------------------------------------------
def _args(**extra) -> Namespace:
    base = dict(seq_length=1024, micro_batch_size=1, global_batch_size=4, data_parallel_size=1,
                tensor_model_parallel_size=1, context_parallel_size=2, pipeline_model_parallel_size=1, train_iters=6,
                seed=1234, hidden_size=256, num_layers=4, num_attention_heads=8, ffn_hidden_size=1024, split="98,2,0",
                wlb_packer="wlb", wlb_max_seq_len=2048, wlb_cp_sharding="adaptive")
    return Namespace(**{**base, **extra})


def _startup_worker(rank: int, world: int, prefix: str, zeroed: str) -> None:
    import torch

    from megatron_wlb.megatron.args.flags import settings_from_args
    from megatron_wlb.megatron.args.validation import cost_model_from_args, packing_config_from_args
    from megatron_wlb.megatron.state.agreement import check_startup_agreement, dataset_parts, run_fingerprint

    def fingerprint(args):
        settings = settings_from_args(args)
        return run_fingerprint(args, settings, packing_config_from_args(args, settings),
                               cost_model_from_args(args, settings), dataset_parts(args))

    args = _args(data_path=[prefix])
    check_startup_agreement(fingerprint(args), device=torch.device("cpu"))  # alike: passes
    other = _args(data_path=[prefix], wlb_log_interval=5 if rank == 2 else 1)
    with pytest.raises(RuntimeError, match=r"--wlb-log-interval: 1 on ranks 0-1, 5 on rank 2"):
        check_startup_agreement(fingerprint(other), device=torch.device("cpu"))
    # issue 49 (4): ranks told to train for different lengths hung in the later iteration's agreement
    longer = _args(data_path=[prefix], train_iters=5 if rank == 1 else 4)
    with pytest.raises(RuntimeError, match=r"--train-iters: 4 on ranks 0,2, 5 on rank 1"):
        check_startup_agreement(fingerprint(longer), device=torch.device("cpu"))
    copy = _args(data_path=[zeroed if rank == 1 else prefix])
    with pytest.raises(RuntimeError, match=r"--data-path #1 \.bin: [0-9a-f]{16} \(a_text_document\) on ranks 0,2, "
                                           r"[0-9a-f]{16} \(a_text_document\) on rank 1.*interrupted midway"):
        check_startup_agreement(fingerprint(copy), device=torch.device("cpu"))


def test_every_rank_stops_at_start_up_on_another_setting_or_a_zeroed_copy(tmp_path):
    from megatron_wlb.data.reader import write_indexed_dataset

    rng = np.random.default_rng(2)
    docs = [rng.integers(1, 250, int(n)) for n in rng.integers(20, 1500, 400)]
    prefix = write_indexed_dataset(str(tmp_path / "a_text_document"), docs)
    zeroed = str(tmp_path / "copy" / "a_text_document")
    os.makedirs(os.path.dirname(zeroed))
    open(f"{zeroed}.idx", "wb").write(open(f"{prefix}.idx", "rb").read())
    _zeroed_copy(f"{prefix}.bin", f"{zeroed}.bin", 0.6)
    run_world(_startup_worker, 3, start_method="fork", prefix=str(prefix), zeroed=zeroed)


def _layout_worker(rank: int, world: int, prefix: str) -> None:
    """CP2 (one DP rank): rank 1 lays out with another CP sharding (a rank given another --wlb-cp-sharding or cost
    profile trained with rc 0 before; the start-up agreement now stops that first, so this is the last line)."""
    from dataclasses import replace

    import torch

    from megatron_wlb.megatron import build_train_iterator, cp_sharding_from_args
    from megatron_wlb.megatron.args.flags import settings_from_args
    from megatron_wlb.megatron.state.agreement import check_plan_agreement

    args = _args(data_path=[prefix])
    settings = settings_from_args(args)
    iterator = build_train_iterator(args, settings, 0, rank)
    if rank == 1:  # per-document where rank 0 chooses per micro-batch (adaptive), as --wlb-cp-sharding did
        iterator.sharding = cp_sharding_from_args(args, replace(settings, cp_sharding="per-document"), rank,
                                                  iterator.packer.cost)
    stopped = None
    for _ in range(6):
        batch = iterator.prepare()
        try:
            check_plan_agreement(batch, device=torch.device("cpu"), dp_rank=0, dp_size=1, layouts=iterator.layouts)
        except RuntimeError as exc:
            stopped = str(exc)
            break
        for _ in range(iterator.n):
            next(iterator)
    assert stopped is not None and "the CP ranks of DP rank 0 laid out micro-batch" in stopped, stopped


def test_cp_ranks_that_lay_out_differently_stop_every_rank_in_that_iteration(tmp_path):
    from megatron_wlb.data.reader import write_indexed_dataset

    rng = np.random.default_rng(3)
    docs = [rng.integers(1, 250, int(n)) for n in np.concatenate([rng.integers(20, 200, 300),
                                                                  rng.integers(900, 2000, 60)])]
    rng.shuffle(docs)
    prefix = write_indexed_dataset(str(tmp_path / "b_text_document"), docs)
    run_world(_layout_worker, 2, start_method="fork", prefix=str(prefix))


def _slots_worker(rank: int, world: int) -> None:
    """DP2 x CP2: each DP rank's layouts are its own; only a CP group that disagrees stops the world."""
    import torch

    from megatron_wlb.megatron.state.agreement import check_plan_agreement

    dp_rank = rank // 2
    mine = [("per-sequence", 100 + dp_rank), ("per-document", 200 + dp_rank)]
    check_plan_agreement(None, device=torch.device("cpu"), dp_rank=dp_rank, dp_size=2, layouts=mine)
    if rank == 3:
        mine = [mine[0], ("per-sequence", 999)]
    with pytest.raises(RuntimeError, match="the CP ranks of DP rank 1 laid out micro-batch 1 of iteration -1"):
        check_plan_agreement(None, device=torch.device("cpu"), dp_rank=dp_rank, dp_size=2, layouts=mine)


def test_each_dp_ranks_layouts_are_compared_within_its_cp_group():
    run_world(_slots_worker, 4, start_method="fork")
