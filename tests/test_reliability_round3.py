"""Issue 37 (reliability round 3): the refit agreement over a real gloo world (D5), token ids checked both
ways (D3) and start-up problems in one line (D14). The epoch order cache's items (D4, D8-D11) are in
test_order_cache.py; the checkpoint items (D7, D15) in test_megatron_checkpoint.py; data prefixes holding a
space (D12) in test_analyze.py."""

from __future__ import annotations

import importlib.util

import numpy as np
import pytest

pytest.importorskip("torch")

from conftest import run_world  # noqa: E402


# -- D5: timing.all_reduce returns new arrays, so the refit's MIN and MAX can differ ---------------------------
def _world_min_max(rank: int, world: int) -> None:
    from megatron_wlb.megatron.state import timing

    mine = np.array([float(rank), 10.0 - rank, 5.0])
    low, high = timing.all_reduce(mine, "min"), timing.all_reduce(mine, "max")
    assert mine.tolist() == [float(rank), 10.0 - rank, 5.0], "the caller's array was written"
    assert low is not mine and high is not mine and low is not high
    assert low.tolist() == [0.0, 10.0 - (world - 1), 5.0], low
    assert high.tolist() == [float(world - 1), 10.0, 5.0], high
    assert timing.all_reduce(mine, "sum").tolist() == [sum(range(world)), 10.0 * world - sum(range(world)), 5.0 * world]


def test_all_reduce_min_and_max_of_one_array_differ_over_gloo():
    run_world(_world_min_max, 2, start_method="fork")


def _plan(doc: int):
    from megatron_wlb.packing.types import DocPiece, GlobalBatch, MicroBatch

    return GlobalBatch(iteration=3, micro_batches=(MicroBatch((DocPiece(doc, 0, 100, 0),), 4096),), dp=1, n=1)


def _world_refit(rank: int, world: int, disagree: bool) -> None:
    from test_online_refit import MODEL, synthetic_points

    from megatron_wlb.costmodel import ParallelLayout, build_cost_model
    from megatron_wlb.costmodel.fit import RefitStats
    from megatron_wlb.megatron.state import timing
    from megatron_wlb.megatron.state.online import OnlineRefit

    points, _ = synthetic_points(n=12)
    part = {k: v[rank::world] for k, v in points.items()}
    refit = OnlineRefit(build_cost_model(MODEL, ParallelLayout(1, 1, 1, 1)),
                        {"tp": 1, "cp": 1, "pp": 1, "dp": world, "vpp": 1}, interval=2,
                        apply=lambda cost, state: None, plan=lambda: _plan(7 + rank if disagree else 7))
    refit.stats = RefitStats.of(part, MODEL)
    if not disagree:
        state = refit.refit(3, timing.all_reduce)
        assert state is not None and refit.refits == 1
        return
    with pytest.raises(RuntimeError, match="the ranks disagree on the plan digests at iteration 4"):
        refit.refit(3, timing.all_reduce)


@pytest.mark.parametrize("disagree", [False, True])
def test_the_refit_agreement_fires_over_gloo_when_ranks_trained_other_plans(disagree):
    run_world(_world_refit, 2, start_method="fork", disagree=disagree)


# -- D3: token ids checked both ways -----------------------------------------------------------------------
def _corpus(tmp_path, name: str, tokens: np.ndarray, lengths: list[int]) -> str:
    from megatron_wlb.data.indexed import write_index

    prefix = write_index(tmp_path / name, np.asarray(lengths), tokens.dtype.type)
    tokens.tofile(f"{prefix}.bin")
    return str(prefix)


def test_an_int8_corpus_with_negative_ids_is_refused_at_start_up(tmp_path):
    from megatron_wlb.data.reader import DocumentReader, IndexedSource

    raw = np.frombuffer(bytes([10, 20, 30, 200, 40, 50, 60, 70]), dtype=np.int8)  # byte 200 reads as -56
    prefix = _corpus(tmp_path, "bytes", raw, [4, 4])
    assert IndexedSource.open(prefix).token_id_range() == (-56, 70)
    reader = DocumentReader([(prefix, 1.0)], split="1,0,0")
    with pytest.raises(ValueError, match=r"bytes: token id -56 is outside the model's vocabulary of 300 "
                       r"\(ids 0\.\.299\): its \.bin holds int8 ids") as caught:
        reader.check_vocabulary(300)
    assert "\n" not in str(caught.value)


def test_a_negative_id_beyond_the_start_up_scan_stops_the_run_when_read(tmp_path, monkeypatch):
    import megatron_wlb.data.reader as reader_mod
    from megatron_wlb.data.reader import DocumentReader

    tokens = np.arange(40, dtype=np.int16)
    tokens[33] = -7
    prefix = _corpus(tmp_path, "signed", tokens, [10, 10, 10, 10])
    monkeypatch.setattr(reader_mod, "VOCAB_SCAN_TOKENS", 16)
    reader = DocumentReader([(prefix, 1.0)], split="1,0,0", shuffle=False)
    reader.check_vocabulary(1000)  # the scanned prefix is sound
    assert reader.read(0, 0, 10).tolist() == list(range(10))
    with pytest.raises(ValueError, match=r"signed: token id -7 is outside the model's vocabulary of 1000 "
                       r"\(ids 0\.\.999\)"):
        reader.read(3, 0, 10)
    monkeypatch.setattr(reader_mod, "VOCAB_SCAN_TOKENS", 1 << 28)
    with pytest.raises(ValueError, match=r"token id -7 is outside"):
        DocumentReader([(prefix, 1.0)], split="1,0,0").check_vocabulary(1000)


# -- D14: start-up problems exit with one line, no traceback ----------------------------------------------------
def _start(argv: list[str], tmp_path) -> tuple[int, str]:
    """Run the CPU entry point (Megatron's loop through our launcher) in a fresh process: (exit code, stderr)."""
    import os
    import subprocess
    import sys
    from pathlib import Path

    root = str(Path(__file__).resolve().parents[1])
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([root, os.environ.get("PYTHONPATH", "")]),
           "CUDA_VISIBLE_DEVICES": "", "PYTHONWARNINGS": "ignore"}
    for name in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "WLB_PIN_CORES"):
        env.pop(name, None)
    proc = subprocess.run([sys.executable, "-m", "megatron_wlb.megatron.entry.cpu", *argv], env=env, cwd=tmp_path,
                          capture_output=True, text=True, timeout=300)
    return proc.returncode, proc.stderr


@pytest.fixture(scope="module")
def real_prefix(tmp_path_factory) -> str:
    from megatron_wlb.megatron.entry.cpu import write_text_corpus

    prefix = str(tmp_path_factory.mktemp("startup") / "text_document")
    write_text_corpus(prefix, max_bytes=20_000)
    return prefix


def _one_line(stderr: str, needle: str) -> str:
    assert "Traceback" not in stderr, stderr[-3000:]
    lines = [line for line in stderr.splitlines() if needle in line]
    assert len(lines) == 1, stderr[-3000:]
    return lines[0]


@pytest.mark.skipif(importlib.util.find_spec("megatron.training") is None, reason="needs megatron.training")
def test_start_up_problems_exit_with_one_line_and_no_traceback(real_prefix, tmp_path):
    from megatron_wlb.megatron.entry.cpu import TINY_GPT_ARGS

    # bad blend weights, read by the harness (--tiny-gpt sizes the vocabulary from the data first)
    rc, err = _start(["--tiny-gpt", "--data-path", "0.5", real_prefix, "nan", real_prefix], tmp_path)
    assert rc == 1 and "weight 'nan' before" in _one_line(err, "weight 'nan'")
    # missing data and a bad --wlb-* value, checked after Megatron's own validation: one line naming both
    missing = str(tmp_path / "missing")
    rc, err = _start([*TINY_GPT_ARGS, "--data-path", missing, "--wlb-max-seq-len", "100"], tmp_path)
    line = _one_line(err, "invalid WLB-LLM configuration")
    assert rc == 1 and "2 problems" in line and "--wlb-max-seq-len 100 is below --seq-length 256" in line
    assert f"no {missing}.bin/.idx" in line
    # a flag argparse rejects: its one-line error, without Megatron's usage of several hundred lines
    rc, err = _start(["--tiny-gpt", "--data-path", real_prefix, "--wlb-packer", "best"], tmp_path)
    assert rc == 2 and "invalid choice: 'best'" in _one_line(err, "--wlb-packer")
    assert "usage:" not in err
    # a flag Megatron's own validate_args asserts on: its message in one line, where it stands
    rc, err = _start(["--tiny-gpt", "--data-path", real_prefix, "--tensor-model-parallel-size", "2"], tmp_path)
    line = _one_line(err, "Megatron's validate_args rejects these flags")
    assert rc == 1 and "world size (1) is not divisible" in line and "megatron/training/arguments.py:" in line
