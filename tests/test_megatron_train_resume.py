"""Megatron's own loop (CPU, gloo): start-up agreement across ranks, checkpoints and resumes
(``megatron_train_runs``)."""

from __future__ import annotations

import json
import re
import shutil
from pathlib import Path

import pytest
from megatron_train_runs import Run, assert_trains, train

torch = pytest.importorskip("torch")
pytestmark = pytest.mark.slow  # Megatron training runs: minutes; `pytest -m "not slow"` is the fast lane


def longer_copy(corpus: str, prefix: str) -> str:
    """A copy of ``corpus`` whose documents are each one token longer (a stale or re-tokenised copy)."""
    import numpy as np
    from megatron.core.datasets.indexed_dataset import IndexedDataset

    from megatron_wlb.data.reader import write_indexed_dataset

    ds = IndexedDataset(corpus)
    write_indexed_dataset(prefix, [np.append(ds[i], 10) for i in range(len(ds))])
    return prefix


def _startup_stops(run: Run, part: str) -> list[str]:
    """The start-up agreement's one-line refusals in ``run``'s log (every rank raises it) naming ``part``."""
    assert run.returncode != 0  # type: ignore[attr-defined]
    stops = [line for line in run.log.splitlines()
             if "megatron_wlb: the ranks start with different settings or data" in line and part in line]
    assert all(not r["losses"] for r in run.ranks.values()), "a rank trained a step"
    assert " iteration        1/" not in run.log
    return stops


@pytest.mark.parametrize("layout", [{"DP": "2"}, {"TP": "2"}])
def test_a_rank_reading_other_data_stops_every_rank_at_start_up(tmp_path, text_corpus, layout):
    """Rank 1 reads a copy of the text_corpus whose documents are one token longer: before the first step, every
    rank stops with one line naming the dataset whose .idx differs and the ranks of each copy (without the
    checks, DP2 trained both plans silently and TP2 aborted inside gloo naming nothing; the per-step plan
    agreement behind it: ``test_plan_agreement.py``)."""
    other = longer_copy(text_corpus, str(tmp_path / "copy_text_document"))
    name = "_".join(f"{k}{v}" for k, v in layout.items())
    run = train(tmp_path, name, text_corpus, "--wlb-packer", "wlb",
                env={**layout, "WLB_PROBE_RANK_DATA": f"1:{other}"}, expect_ok=False)
    stops = _startup_stops(run, "--data-path #1 .idx-pages: ")
    assert len(stops) >= 1 and re.search(r"\.idx-pages: [0-9a-f]{16} \(stdlib_text_document\) on rank 0, [0-9a-f]{16} "
                                         r"\(copy_text_document\) on rank 1", stops[0]), run.log[-4000:]
    assert "Every rank must get the same flags and files" in stops[0]


def zeroed_copy(corpus: str, prefix: str, fraction: float = 0.6) -> str:
    """``corpus`` with the same .idx and a same-size .bin whose first ``fraction`` is zeros (a preallocating copy
    interrupted midway)."""
    import shutil

    shutil.copyfile(f"{corpus}.idx", f"{prefix}.idx")
    data = bytearray(Path(f"{corpus}.bin").read_bytes())
    cut = int(len(data) * fraction)
    data[:cut] = bytes(cut)
    Path(f"{prefix}.bin").write_bytes(bytes(data))
    return prefix


def _profile(path: Path) -> str:
    """A calibrated cost-model profile (micro-batch times of a made-up machine) for the tiny GPT."""
    import numpy as np

    from megatron_wlb.costmodel import PROFILE_FORMAT, ModelShape

    rng = np.random.default_rng(0)
    tokens = rng.integers(500, 4000, 64).astype(float)
    pairs, runs = tokens * rng.integers(100, 1500, 64), rng.integers(1, 6, 64).astype(float)
    fwd = 3e-8 * pairs + 2e-5 * tokens + 1e-3 * runs
    model = ModelShape("tiny", hidden=64, num_layers=2, num_heads=4, num_kv_heads=4, ffn_hidden=128, vocab=300)
    path.write_text(json.dumps({"format": PROFILE_FORMAT, "device": "cpu", "model": model.to_dict(), "tp": 1,
                                "micro_batches": {"pairs": pairs.tolist(), "tokens": tokens.tolist(),
                                                  "head_tokens": tokens.tolist(), "runs": runs.tolist(),
                                                  "fwd_s": fwd.tolist(), "bwd_s": (1.5 * fwd).tolist()}}))
    return str(path)


@pytest.mark.parametrize("case", ["cost-profile", "cp-sharding", "log-interval", "zeroed-bin"])
def test_a_rank_started_otherwise_stops_every_rank_at_start_up(tmp_path, text_corpus, case):
    """Issue 37: D1 (a CP rank with another --wlb-cost-profile or --wlb-cp-sharding laid some micro-batches out
    differently and trained with rc 0), D6 (--wlb-log-interval on one rank: a hang or SIGABRT in gloo, no cause
    named), D2 (a same-size .bin with its first 60% zeroed: one DP rank trained on zeros). Now every rank stops
    before the first step naming what differs."""
    layout = {"CP": "2"} if case in ("cost-profile", "cp-sharding") else {"DP": "2"}
    env = dict(layout)
    if case == "cost-profile":
        env["WLB_PROBE_RANK_FLAGS"] = f"1:--wlb-cost-profile {_profile(tmp_path / 'profile.json')}"
        part = "--wlb-cost-profile (content): none on rank 0, "
    elif case == "cp-sharding":
        env["WLB_PROBE_RANK_FLAGS"] = "1:--wlb-cp-sharding per-document"
        part = "--wlb-cp-sharding: adaptive on rank 0, per-document on rank 1"
    elif case == "log-interval":
        env["WLB_PROBE_RANK_FLAGS"] = "1:--wlb-log-interval 2"
        part = "--wlb-log-interval: 1 on rank 0, 2 on rank 1"
    else:
        env["WLB_PROBE_RANK_DATA"] = "1:" + zeroed_copy(text_corpus, str(tmp_path / "zeroed_text_document"))
        part = ".bin: "
    run = train(tmp_path, case, text_corpus, "--wlb-packer", "wlb", "--wlb-cp-sharding", "adaptive", env=env,
                expect_ok=False)
    stops = _startup_stops(run, part)
    assert stops, run.log[-4000:]
    if case == "zeroed-bin":
        assert ".idx" not in stops[0] and "interrupted midway" in stops[0]
    if case == "cost-profile":
        assert "cost model: " in stops[0]


#: the DP2 run that saves Megatron's torch-format checkpoint at iterations 2 and 4 (``dp2_saved``)
SAVED_FLAGS = ("--wlb-packer", "wlb", "--save-interval", "2", "--ckpt-format", "torch")


@pytest.fixture(scope="module")
def dp2_saved(tmp_path_factory, text_corpus) -> tuple[Run, Path]:
    """One uninterrupted DP2 run of 4 iterations saving at 2 and 4 (``SAVED_FLAGS``), shared by the resume tests
    (each resumes a copy: ``saved_copy``); the run and its checkpoint folder."""
    tmp = tmp_path_factory.mktemp("dp2_saved")
    ckpt = tmp / "ckpt"
    run = train(tmp, "full", text_corpus, *SAVED_FLAGS, "--save", str(ckpt), env={"DP": "2"})
    return run, ckpt


def saved_copy(dp2_saved: tuple[Run, Path], dest: Path) -> tuple[Run, Path]:
    """``dp2_saved``'s run and a copy of its checkpoint at ``dest`` (a test may change or resume into it)."""
    run, ckpt = dp2_saved
    shutil.copytree(ckpt, dest)
    return run, dest


def test_a_resume_onto_a_zeroed_copy_is_refused(tmp_path, text_corpus, dp2_saved):
    """D2 on resume: a checkpoint trained on the text_corpus, resumed with every rank reading a same-size copy whose
    .bin is partly zeros, is refused at start-up naming the file (it was accepted); the same files resume."""
    first, ckpt = saved_copy(dp2_saved, tmp_path / "ckpt")
    common = (*SAVED_FLAGS, "--save", str(ckpt))
    assert_trains(first)
    sidecar = json.loads((ckpt / "iter_0000004" / "wlb_packer_state.json").read_text())
    assert sidecar["version"] == 4 and any(name.endswith(".bin") for name in sidecar["fingerprint"])
    (ckpt / "latest_checkpointed_iteration.txt").write_text("2")
    (tmp_path / "copy").mkdir()
    zeroed = zeroed_copy(text_corpus, str(tmp_path / "copy" / Path(text_corpus).name))  # the same name on another mount
    refused = train(tmp_path, "refused", zeroed, *common, "--load", str(ckpt), env={"DP": "2"}, expect_ok=False)
    assert refused.returncode != 0  # type: ignore[attr-defined]
    assert re.search(r"megatron_wlb: the data differs from what the checkpoint at iteration 2 trained on "
                     r"\(--data-path #1 \.bin: [0-9a-f]{16} -> [0-9a-f]{16} \(stdlib_text_document\);", refused.log), \
        refused.log[-4000:]
    resumed = train(tmp_path, "resumed", text_corpus, *common, "--load", str(ckpt), env={"DP": "2"})
    assert [resumed.losses[1], resumed.losses[2]] == pytest.approx([first.losses[3], first.losses[4]], rel=1e-5)


@pytest.mark.parametrize("ckpt_format", ["torch", "torch_dist"])
def test_checkpoint_resume_equals_an_uninterrupted_run(tmp_path, text_corpus, ckpt_format, request):
    """torch_dist is Megatron's default format (its writer needs psutil, and spawns a process that re-imports
    the launching script: the probe keeps its training under the __main__ guard). The torch format resumes
    the shared ``dp2_saved`` run."""
    ckpt = tmp_path / "ckpt"
    common = ("--wlb-packer", "wlb", "--save-interval", "2", "--ckpt-format", ckpt_format, "--save", str(ckpt))
    if ckpt_format == "torch":
        assert common[:-2] == SAVED_FLAGS  # what dp2_saved ran
        full, _ = saved_copy(request.getfixturevalue("dp2_saved"), ckpt)
    else:
        full = train(tmp_path, "full", text_corpus, *common, env={"DP": "2"})
    if ckpt_format == "torch_dist":
        assert (ckpt / "iter_0000002" / "metadata.json").is_file()  # Megatron's distributed checkpoint
    shutil.rmtree(ckpt / "iter_0000004", ignore_errors=True)
    (ckpt / "latest_checkpointed_iteration.txt").write_text("2")
    resumed = train(tmp_path, "resumed", text_corpus, *common, "--load", str(ckpt), env={"DP": "2"})
    assert sorted(resumed.losses) == [1, 2], resumed.losses  # the probe counts steps from the restart
    assert [resumed.losses[1], resumed.losses[2]] == pytest.approx([full.losses[3], full.losses[4]], rel=1e-5)


def test_dp_size_change_and_data_stream_reset_on_resume(tmp_path, text_corpus, dp2_saved):
    """Saved at DP2 (iteration 2 of 4): resumed at DP1 with the same global batch, the saved plans continue and
    the losses are the uninterrupted run's; another global batch is refused naming the one that continues;
    --wlb-reset-data-stream restarts the documents at the first plan while Megatron keeps its iteration."""
    full, ckpt = saved_copy(dp2_saved, tmp_path / "ckpt")
    common = (*SAVED_FLAGS, "--save", str(ckpt))
    shutil.rmtree(ckpt / "iter_0000004", ignore_errors=True)
    (ckpt / "latest_checkpointed_iteration.txt").write_text("2")

    def plans(run: Run) -> list:
        return next(r["plans"] for r in run.ranks.values() if r["plans"])

    dp1 = train(tmp_path, "dp1", text_corpus, *common, "--load", str(ckpt), "--save", str(tmp_path / "ckpt_dp1"),
                env={"DP": "1"})
    assert plans(dp1)[:2] == plans(full)[2:4]
    assert [dp1.losses[1], dp1.losses[2]] == pytest.approx([full.losses[3], full.losses[4]], rel=1e-5)
    # (Megatron's own LR-scheduler check refuses another global batch first unless told to override it)
    refused = train(tmp_path, "gbs2", text_corpus, *common, "--load", str(ckpt), "--global-batch-size", "2",
                    "--override-opt_param-scheduler", env={"DP": "1"}, expect_ok=False)
    assert refused.returncode != 0  # type: ignore[attr-defined]
    assert "resume with --global-batch-size 4 (now 2)" in refused.log
    reset = train(tmp_path, "reset", text_corpus, *common, "--load", str(ckpt), "--save", str(tmp_path / "ckpt_reset"),
                  "--wlb-reset-data-stream", env={"DP": "2"})
    assert "--wlb-reset-data-stream: the data stream restarts at its first document at iteration 2" in reset.log
    assert plans(reset)[0] == plans(full)[0]  # the documents start over ...
    assert "iteration        3/       4" in reset.log and "iteration        1/" not in reset.log  # ... the steps not
    # issue 37 D15: the flag left in a requeue script, resumed from the checkpoint saved after the reset: ignored,
    # the stream goes on where the reset run stopped (its third plan: the uninterrupted run's third)
    again = train(tmp_path, "requeued", text_corpus, *common, "--load", str(tmp_path / "ckpt_reset"),
                  "--train-iters", "5", "--override-opt_param-scheduler", "--save", str(tmp_path / "ckpt_requeued"),
                  "--wlb-reset-data-stream", env={"DP": "2"})
    assert "--wlb-reset-data-stream ignored: the checkpoint at iteration 4 was saved after the data-stream reset " \
           "at iteration 2" in again.log
    assert plans(again)[0] == plans(full)[2] != plans(full)[0]
