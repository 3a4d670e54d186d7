"""Megatron-LM's own training loop, end to end on CPU (gloo), with the WLB-LLM hooks.

Each test launches ``tests/megatron_train_probe.py`` as a one-node world (tests/rank_launch.py: the ranks
torchrun starts, without its agent; ``megatron_wlb.megatron.cpu`` plus records: losses, iteration-1
gradients, tokens of every document that reached the model) on a tiny GPT and real text (the standard
library as a byte-level .bin/.idx).

Two ways in: ``megatron_wlb.megatron.launcher`` over the installed megatron-core's
``megatron.training`` (0.19.x ships it; CI installs 0.19.2), and the pinned Megatron-LM checkout's
patched ``pretrain_gpt.py`` (core_v0.16.1), run wherever ``MEGATRON_LM`` (conftest's one lookup)
names a git repository holding the pinned commit; the test checks out and patches a copy.
"""

from __future__ import annotations

import importlib.util
import json
import os
import re
import shutil
import subprocess
import sys
from dataclasses import dataclass
from pathlib import Path

import pytest
from conftest import job_python_env
from packaging.version import Version
from rank_launch import run_ranks

torch = pytest.importorskip("torch")
pytestmark = pytest.mark.slow  # Megatron training runs: minutes; `pytest -m "not slow"` is the fast lane

REPO = Path(__file__).resolve().parents[1]
PROBE = REPO / "tests" / "megatron_train_probe.py"
TIMEOUT = 420


def _training_code_installed() -> bool:
    try:
        return importlib.util.find_spec("megatron.training") is not None
    except ModuleNotFoundError:
        return False


if not _training_code_installed():
    reason = ("megatron.training is not installed: pip install --no-deps --ignore-requires-python "
              "megatron-core==0.19.2 (see the README's test command)")
    if os.environ.get("CI"):
        pytest.fail(reason, pytrace=False)
    pytest.skip(reason, allow_module_level=True)


@dataclass
class Run:
    """What one training run left behind (per rank records, merged)."""

    log: str
    ranks: dict[int, dict]
    out: Path

    @property
    def losses(self) -> dict[int, float]:
        """lm loss per iteration (from a last-stage rank; all of them agree)."""
        for record in self.ranks.values():
            if record["losses"] and all(v is not None for v in record["losses"].values()):
                return {int(k): v for k, v in record["losses"].items()}
        raise AssertionError(f"no rank recorded losses; log tail:\n{self.log[-3000:]}")

    def grads(self, rank: int = 0) -> dict[str, torch.Tensor]:
        return torch.load(self.out / f"rank{rank}_grads.pt")

    def doc_tokens(self) -> list[dict[int, int]]:
        """Tokens per document that reached the model, per data iterator (model chunk), summed over the
        ranks that count (TP rank 0 of the last stage, every CP and DP rank)."""
        merged: list[dict[int, int]] = []
        for record in self.ranks.values():
            for which, counts in enumerate(record["doc_tokens"]):
                while len(merged) <= which:
                    merged.append({})
                for doc, n in counts.items():
                    merged[which][int(doc)] = merged[which].get(int(doc), 0) + n
        return merged

    def planned_tokens(self) -> dict[int, int]:
        """Tokens per document in the plans of the iterations trained (every DP rank's micro-batches)."""
        plans = next(r["plans"] for r in self.ranks.values() if r["plans"])
        planned: dict[int, int] = {}
        for plan in plans:
            for doc, length in plan:
                planned[doc] = planned.get(doc, 0) + length
        return planned


def train(tmp_path: Path, name: str, corpus: str | None, *flags: str, env: dict | None = None,
          pretrain_gpt: str | None = None, expect_ok: bool = True) -> Run:
    """Run the probe as the ranks of a one-node world (``rank_launch.run_ranks``: torchrun's worker environment,
    without its agent) with the layout in ``env`` (TP/CP/PP/VPP/DP) and ``flags`` (no
    ``--data-path`` where ``corpus`` is None: Megatron's mock data)."""
    from megatron_wlb.megatron.cpu import layout_from_env, world_size

    env = {**os.environ, **(env or {})}
    layout, _ = layout_from_env(env)
    out = tmp_path / name
    out.mkdir()
    env["WLB_PROBE_OUT"] = str(out)
    env.pop("CUDA_VISIBLE_DEVICES", None)
    entry = ["--pretrain-gpt", pretrain_gpt] if pretrain_gpt else []
    args = [str(PROBE), *entry, "--tiny-gpt", *(["--data-path", corpus] if corpus else []), *flags]
    proc = run_ranks(args, world_size(layout), env=env, cwd=tmp_path, timeout=TIMEOUT)
    log = proc.stdout + proc.stderr
    (out / "train.log").write_text(log)
    if expect_ok:
        assert proc.returncode == 0, f"training failed (rc {proc.returncode}); log tail:\n{log[-6000:]}"
    ranks = {}
    for path in out.glob("rank*.json"):
        ranks[int(path.stem[4:])] = json.loads(path.read_text())
    run = Run(log=log, ranks=ranks, out=out)
    if not expect_ok:
        run.returncode = proc.returncode  # type: ignore[attr-defined]
    return run


def assert_trains(run: Run, iterations: int = 4) -> None:
    losses = run.losses
    assert sorted(losses) == list(range(1, iterations + 1)), losses
    assert all(v == v and abs(v) < 1e3 for v in losses.values()), losses
    assert losses[iterations] < losses[1], f"the loss did not fall: {losses}"
    assert run.log.count(" iteration ") >= iterations  # Megatron's own iteration lines
    # the launcher destroys the process groups once training returns (an exit with gloo's threads alive can abort)
    assert all(r.get("process_groups_released") for r in run.ranks.values()), "a rank left its process groups up"


def assert_documents_once(run: Run) -> None:
    """Every planned document's tokens reached the model exactly once (per model chunk)."""
    planned = run.planned_tokens()
    seen = run.doc_tokens()
    assert planned and seen, "nothing recorded"
    for chunk, counts in enumerate(seen):
        differ = {d: (planned.get(d), counts.get(d)) for d in set(planned) | set(counts)
                  if planned.get(d) != counts.get(d)}
        assert not differ, f"model chunk {chunk}: (planned, seen) tokens of the documents that differ: {differ}"


def assert_trace(run: Run, ranks: int, chunks: int = 1, iterations: int = 4) -> None:
    """The timing trace (``--wlb-trace``) has exactly one row per micro-batch per chunk per rank, each
    with a measured forward and backward, the planned documents, and one iteration row per rank."""
    from collections import Counter

    from megatron_wlb.costmodel.trace import read_trace

    trace = read_trace(run.out / "trace.jsonl")
    assert len(trace.headers) == ranks
    n = Counter((r.iteration, r.rank, r.chunk) for r in trace.micro_batches)
    assert {k[0] for k in n} == set(range(iterations)) and {k[1] for k in n} == set(range(ranks))
    assert {k[2] for k in n} == set(range(chunks))
    assert len(n) == iterations * ranks * chunks
    counts = set(n.values())
    assert len(counts) == 1, f"ranks or chunks timed different numbers of micro-batches: {counts}"
    (per_chunk,) = counts
    for key in n:
        indices = sorted(r.micro_batch for r in trace.micro_batches if (r.iteration, r.rank, r.chunk) == key)
        assert indices == list(range(per_chunk)), f"{key}: micro-batch indices {indices}"
    assert all(r.fwd_s > 0 and r.bwd_s > 0 and r.layers >= 1 for r in trace.micro_batches)
    assert Counter((r.iteration, r.rank) for r in trace.iterations) == {(i, k): 1 for i in range(iterations)
                                                                        for k in range(ranks)}
    assert all(r.wall_s >= r.compute_s > 0 for r in trace.iterations)
    plans = next(r["plans"] for r in run.ranks.values() if r["plans"])
    for it, plan in enumerate(plans[:iterations]):
        traced = sorted(x for r in trace.micro_batches if r.iteration == it and r.pp == 0 and r.chunk == 0
                        and r.cp == 0 and r.tp == 0 for x in r.lengths)
        assert traced == sorted(length for _, length in plan), f"iteration {it}: traced lengths differ from the plan"
    assert run.log.count("[wlb] measured iteration") == iterations


# --- the launcher over the installed megatron.training -------------------------------------------------------
def test_tp2_pp2_trains_and_every_document_reaches_the_model_once(tmp_path, text_corpus):
    run = train(tmp_path, "tp2pp2", text_corpus, "--wlb-packer", "wlb", "--wlb-cp-sharding", "per-document",
                env={"TP": "2", "PP": "2"})
    assert_trains(run)
    from megatron_wlb.megatron.version import is_supported

    assert all(is_supported(r["core_version"]) for r in run.ranks.values())
    assert_documents_once(run)
    assert "[wlb] iteration" in run.log


@pytest.fixture(scope="module")
def cp_runs(tmp_path_factory, text_corpus):
    """CP=1 and CP=2 with every layout on the same plan. The plan comes from concat-and-cut packing, which
    does not depend on the layout (wlb weighs work with a cost model of the layout, so its plans may
    differ between CP=1 and CP=2); several documents share every micro-batch either way."""
    tmp = tmp_path_factory.mktemp("cp")
    runs = {"cp1": train(tmp, "cp1", text_corpus, "--wlb-packer", "original", "--wlb-cp-sharding", "per-document")}
    for layout in ("per-sequence", "per-document", "adaptive", "hybrid"):
        runs[layout] = train(tmp, layout, text_corpus, "--wlb-packer", "original", "--wlb-cp-sharding", layout,
                             env={"CP": "2"})
    return runs


def test_cp_layouts_train_the_same_plan(cp_runs):
    plans = {name: next(r["plans"] for r in run.ranks.values() if r["plans"]) for name, run in cp_runs.items()}
    reference = plans["cp1"]
    for name, plan in plans.items():
        assert plan == reference, f"{name} planned other micro-batches than CP=1"


def test_cp_layouts_give_the_same_loss_and_gradients_as_cp1(cp_runs):
    base = cp_runs["cp1"]
    base_grads = base.grads(0)
    for name in ("per-sequence", "per-document", "adaptive", "hybrid"):
        run = cp_runs[name]
        assert_trains(run)
        assert run.losses[1] == pytest.approx(base.losses[1], rel=1e-5, abs=1e-6), name
        grads = run.grads(0)
        assert grads.keys() == base_grads.keys()
        for key, ref in base_grads.items():
            torch.testing.assert_close(grads[key], ref, rtol=1e-4, atol=1e-6,
                                       msg=lambda m, k=key, n=name: f"{n} {k}: {m}")


def test_cp_layouts_deliver_every_document_once(cp_runs):
    for run in cp_runs.values():
        assert_documents_once(run)


@pytest.mark.skipif(importlib.util.find_spec("transformer_engine") is None,
                    reason="TransformerEngine is not importable (it builds only with CUDA): per-document-te is "
                           "TE's own THD attention, run where TE is installed")
def test_cp2_per_document_te_matches_cp1(tmp_path, text_corpus, cp_runs):
    run = train(tmp_path, "te", text_corpus, "--wlb-packer", "original", "--wlb-cp-sharding", "per-document-te",
                "--transformer-impl", "transformer_engine", env={"CP": "2"})
    assert run.losses[1] == pytest.approx(cp_runs["cp1"].losses[1], rel=1e-5)


def test_pp4_variable_length_micro_batches(tmp_path, text_corpus):
    """Four stages, micro-batches of different lengths every step (shapes exchanged per micro-batch)."""
    run = train(tmp_path, "pp4", text_corpus, "--num-layers", "4", "--wlb-packer", "wlb",
                env={"PP": "4"})
    assert_trains(run)
    assert_documents_once(run)


def test_interleaved_pipeline_vpp2(tmp_path, text_corpus):
    run = train(tmp_path, "vpp2", text_corpus, "--num-layers", "4", "--wlb-packer", "wlb",
                "--wlb-trace", str(tmp_path / "vpp2" / "trace.jsonl"), env={"PP": "2", "VPP": "2"})
    assert_trains(run)
    assert_documents_once(run)  # each model chunk's iterator saw every planned document once
    assert_trace(run, ranks=2, chunks=2)


def test_dp2_with_overlapped_grad_reduce(tmp_path, text_corpus):
    run = train(tmp_path, "dp2", text_corpus, "--wlb-packer", "wlb", "--overlap-grad-reduce",
                "--wlb-trace", str(tmp_path / "dp2" / "trace.jsonl"), env={"DP": "2"})
    assert_trains(run)
    assert_documents_once(run)
    assert_trace(run, ranks=2)
    for record in run.ranks.values():  # the plan agreement ran before every step, each well under 50 ms
        assert record["agreement"]["checks"] == 4 and record["agreement"]["seconds"] < 4 * 0.05, record


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
    stops = _startup_stops(run, "--data-path #1 .idx: ")
    assert len(stops) >= 1 and re.search(r"\.idx: [0-9a-f]{16} \(stdlib_text_document\) on rank 0, [0-9a-f]{16} "
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


def test_recomputation_leaves_the_losses_unchanged(tmp_path, text_corpus, cp_runs):
    run = train(tmp_path, "recompute", text_corpus, "--wlb-packer", "original", "--wlb-cp-sharding", "per-document",
                "--recompute-granularity", "full", "--recompute-method", "uniform", "--recompute-num-layers", "1")
    base = cp_runs["cp1"].losses
    assert run.losses == pytest.approx(base, rel=1e-5)


def test_sequence_parallel_gives_the_losses_of_tp2_without_it(tmp_path, text_corpus):
    """TP2 x CP2 with sequence parallelism: every CP rank's tokens padded to a multiple of TP (our
    local padding rows), the same losses as without SP."""
    flags = ("--wlb-packer", "wlb", "--wlb-cp-sharding", "adaptive")
    plain = train(tmp_path, "tp2cp2", text_corpus, *flags, env={"TP": "2", "CP": "2"})
    sp = train(tmp_path, "tp2cp2_sp", text_corpus, *flags, "--sequence-parallel", env={"TP": "2", "CP": "2"})
    assert_trains(sp)
    assert sp.losses == pytest.approx(plain.losses, rel=1e-5)
    assert_documents_once(sp)


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


def stock_samples(corpus: str, tmp_path: Path, iterations: int, first: int = 0, dp: int = 2,
                  eod_mask_loss: bool = True, inter_document: bool = False) -> dict[int, tuple]:
    """What a stock job trains over ``iterations`` steps from ``first``: megatron-core's GPTDataset built as
    the run built it, read in the order of Megatron's own ``MegatronPretrainingSampler`` at DP ``dp``:
    piece id (position * seq_length + start) -> (iteration, sha256 of its tokens, labels and loss mask).
    ``inter_document``: masked with ``--dataloader-inter-document-masking`` instead of the ``--reset-*`` flags."""
    import hashlib
    import types

    import numpy as np

    from megatron_wlb.megatron.compat import install_python_shims

    install_python_shims()
    from megatron.core.tokenizers.text.libraries.null_tokenizer import NullTokenizer
    from megatron.training.datasets.data_samplers import MegatronPretrainingSampler

    from megatron_wlb.megatron.gpt_datasets import build_train_dataset
    from megatron_wlb.megatron.gpt_samples import MegatronSamples

    seq, gbs, train_iters = 256, 4, 4
    args = types.SimpleNamespace(seed=1234, seq_length=seq, data_path=[corpus], split="98,2,0",
                                 data_cache_path=str(tmp_path / f"stock_cache{'_inter' * inter_document}"),
                                 mmap_bin_files=True, reset_position_ids=not inter_document,
                                 reset_attention_mask=not inter_document, eod_mask_loss=eod_mask_loss,
                                 dataloader_inter_document_masking=inter_document,
                                 data_args_path=None, per_split_data_args_path=None, train_data_path=None,
                                 valid_data_path=None, test_data_path=None)
    samples = MegatronSamples(build_train_dataset(args, NullTokenizer(300), (train_iters * gbs, 0, 0)))
    out = {}
    for rank in range(dp):
        sampler = iter(MegatronPretrainingSampler(len(samples), first * gbs, 1, rank, dp))
        for _ in range(iterations * gbs // dp):
            (j,) = next(sampler)
            tokens, labels, mask, positions = samples.sample(j)
            starts = np.flatnonzero(positions == 0)
            for a, b in zip(starts.tolist(), np.append(starts[1:], seq).tolist()):
                h = hashlib.sha256()
                for arr in (tokens[a:b], labels[a:b], mask[a:b]):
                    h.update(np.ascontiguousarray(arr, dtype=np.float64).tobytes())
                out[j * seq + a] = (j // gbs, h.hexdigest())
    return out


def fed_pieces(run: Run) -> dict[int, str]:
    """Every piece that reached the model in ``run`` (any rank): id -> digest of its data (ranks agree)."""
    fed: dict[int, str] = {}
    for record in run.ranks.values():
        for doc, digest in record["piece_data"].items():
            assert fed.setdefault(int(doc), digest) == digest
    return fed


def assert_fed_stock_samples(run: Run, stock: dict[int, tuple[int, str]]) -> dict[int, str]:
    """Every piece that reached the model in ``run`` is a piece of a ``stock`` sample (``stock_samples``), with
    Megatron's own tokens, labels and loss mask; the pieces fed (``fed_pieces``)."""
    fed = fed_pieces(run)
    assert fed and set(fed) <= set(stock), f"pieces the stock job does not train: {sorted(set(fed) - set(stock))[:5]}"
    assert all(fed[k] == stock[k][1] for k in fed), "a piece's tokens, labels or loss mask differ from Megatron's"
    return fed


def test_balanced_gptdataset_pp2_trains_the_stock_jobs_samples(tmp_path, eod_corpus):
    """The same at PP2 (every stage plans alike; the last stage's loss is over Megatron's labels)."""
    run = train(tmp_path, "pp2", eod_corpus, "--wlb-packer", "wlb", "--wlb-pieces", "concat-and-cut",
                "--reset-attention-mask", "--reset-position-ids", env={"PP": "2"})
    assert_trains(run)
    assert_documents_once(run)
    assert_fed_stock_samples(run, stock_samples(eod_corpus, tmp_path, 4, dp=1, eod_mask_loss=False))


def test_balanced_gptdataset_honours_inter_document_masking(tmp_path, text_corpus):
    """``--dataloader-inter-document-masking`` (how megatron-core 0.19+ users ask for per-document masking) with
    the balanced concat-and-cut intake at DP2 through Megatron's loop: the pieces that reach the model are the
    stock job's samples cut at GPTDataset's own document boundaries (its per-document ``cu_seqlens`` and position
    ids), with Megatron's tokens, labels and loss mask; a text_corpus whose documents do not end with the tokenizer's
    EOD trains (boundaries come from the .idx, not from EOD tokens)."""
    run = train(tmp_path, "inter_document", text_corpus, "--wlb-packer", "wlb", "--wlb-pieces", "concat-and-cut",
                "--dataloader-inter-document-masking", env={"DP": "2"})
    assert_trains(run)
    assert_documents_once(run)
    stock = stock_samples(text_corpus, tmp_path, 4, eod_mask_loss=False, inter_document=True)
    assert_fed_stock_samples(run, stock)
    whole = {k for k in stock if k % 256 == 0}
    assert len(stock) > len(whole), "GPTDataset cut no sample at a document boundary: nothing was masked"


def test_balanced_gptdataset_through_megatrons_loop(tmp_path, eod_corpus):
    """``--wlb-pieces concat-and-cut`` at DP2 through Megatron's loop trains the stock job's samples: every
    piece that reached the model is a piece of a sample Megatron's GPTDataset + sampler give the same steps,
    with Megatron's own tokens, labels and loss mask, at or after its step; the rest wait (bounded). A job
    without per-document masking is refused in one line; a stock checkpoint (no WLB state) continues from
    its consumed samples."""
    ckpt = tmp_path / "ckpt"
    masking = ("--reset-attention-mask", "--reset-position-ids", "--eod-mask-loss")
    common = ("--wlb-packer", "wlb", "--wlb-pieces", "concat-and-cut", *masking, "--save", str(ckpt),
              "--save-interval", "2", "--ckpt-format", "torch")
    full = train(tmp_path, "balanced", eod_corpus, *common, env={"DP": "2"})
    assert_trains(full)
    assert_documents_once(full)
    stock = stock_samples(eod_corpus, tmp_path, 4)
    fed = assert_fed_stock_samples(full, stock)
    plans = next(r["pieces"] for r in full.ranks.values() if r["pieces"])
    for it, plan in enumerate(plans):
        assert all(stock[doc][0] <= it for doc, _, _ in plan), f"iteration {it} trained a later step's piece"
    waiting = set(stock) - set(fed)
    assert len(waiting) <= 4 * 4, f"{len(waiting)} of {len(stock)} pieces wait after 4 steps"

    refused = train(tmp_path, "refused", eod_corpus, "--wlb-packer", "wlb", "--wlb-pieces", "concat-and-cut",
                    env={"DP": "2"}, expect_ok=False)
    assert refused.returncode != 0  # type: ignore[attr-defined]
    assert re.search(r"--wlb-pieces concat-and-cut trains Megatron's samples regrouped per document, but this job "
                     r"attends across documents[^\n]*--dataloader-inter-document-masking", refused.log)

    # documents that end with another id than the tokenizer's EOD: --reset-* would find no document end
    import sysconfig

    from megatron_wlb.data.reader import BYTE_EOD, byte_documents, write_indexed_dataset

    wrong = str(tmp_path / "wrong_eod_text_document")
    paths = sorted(str(p) for p in Path(sysconfig.get_paths()["stdlib"]).glob("*.py"))
    write_indexed_dataset(wrong, byte_documents(paths, separator="\n\n", eod=BYTE_EOD, max_bytes=200_000))
    no_eod = train(tmp_path, "no_eod", wrong, *common[:4], *masking, env={"DP": "2"}, expect_ok=False)
    assert no_eod.returncode != 0  # type: ignore[attr-defined]
    line = next(x for x in no_eod.log.splitlines() if "EOD id 299" in x)
    assert f"last ids: {BYTE_EOD}" in line and wrong in line
    assert not re.search(r'File "[^"]*megatron_wlb/', no_eod.log), "the refusal came with our traceback"

    # a stock checkpoint: the same files without our sidecar (what pretrain_gpt.py saves)
    shutil.rmtree(ckpt / "iter_0000004", ignore_errors=True)
    (ckpt / "iter_0000002" / "wlb_packer_state.json").unlink()
    (ckpt / "latest_checkpointed_iteration.txt").write_text("2")
    resumed = train(tmp_path, "from_stock", eod_corpus, *common, "--load", str(ckpt), env={"DP": "2"})
    # the reverse switch: a stock run resumes from consumed_train_samples = 2 global batches, so it would skip
    # exactly the tokens of those samples still waiting in our packer, and the save says how many
    saved = torch.load(ckpt / "iter_0000002" / "mp_rank_00" / "model_optim_rng.pt", weights_only=False)
    assert saved["args"].consumed_train_samples == 2 * 4
    first_two = {doc for plan in plans[:2] for doc, _, _ in plan}
    lengths = {doc: length for plan in plans for doc, _, length in plan}
    waiting_at_2 = [k for k in stock if stock[k][0] < 2 and k not in first_two]
    said = re.search(r"checkpoint at iteration 2: (\d+) tokens of Megatron.s samples wait in the packer", full.log)
    assert said and int(said.group(1)) == sum(lengths.get(k, 0) for k in waiting_at_2)
    assert all(k in lengths for k in waiting_at_2)  # trained by iteration 4 (within the delay bound)
    assert "holds no wlb_packer_state.json (a stock Megatron run)" in resumed.log
    later = stock_samples(eod_corpus, tmp_path, 2, first=2)
    pieces = {doc for plan in next(r["pieces"] for r in resumed.ranks.values() if r["pieces"]) for doc, _, _ in plan}
    assert pieces and pieces <= set(later), "the resumed run trained pieces of samples the stock job already had"


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


def test_own_corpus_with_token_ids_beyond_the_tiny_vocabulary(tmp_path):
    """A user's corpus whose ids exceed the tiny GPT's default vocabulary (300): the harness takes the vocabulary
    from the data and trains; a --vocab-size too small for it is refused in one line naming the largest id."""
    import numpy as np

    from megatron_wlb.data.reader import write_indexed_dataset

    rng = np.random.default_rng(1)
    docs = [rng.integers(0, 1200, size=int(n)) for n in rng.integers(30, 600, size=800)]
    prefix = write_indexed_dataset(str(tmp_path / "own_text_document"), docs)
    run = train(tmp_path, "own", prefix, "--wlb-packer", "wlb")
    assert_trains(run)
    assert "vocab_size ...................................... 1200" in run.log  # max id 1199 + 1
    refused = train(tmp_path, "small_vocab", prefix, "--vocab-size", "512", expect_ok=False)
    assert refused.returncode != 0  # type: ignore[attr-defined]
    assert "holds token id 1199; give --vocab-size 1200 or more" in refused.log


def test_online_cost_model_refits_agree_and_resume_exactly(tmp_path, text_corpus):
    """--wlb-cost-model online at DP2: the refits run (the ranks' coefficients and plan digests are checked
    equal inside), the packer plans with the refitted model, and a run resumed from a checkpoint taken
    after a refit plans (and trains) exactly what the uninterrupted run did until the next refit."""
    ckpt = tmp_path / "ckpt"
    settings = tmp_path / "refit.yaml"  # a settings file: the research knob refit_interval is a YAML key
    settings.write_text("cost: {refit_interval: 2}\n")
    common = ("--wlb-packer", "wlb", "--wlb-cost-model", "online", "--wlb-config", str(settings), "--train-iters", "6",
              "--save", str(ckpt), "--save-interval", "4", "--ckpt-format", "torch")
    full = train(tmp_path, "full", text_corpus, *common, env={"DP": "2"})
    assert_trains(full, iterations=6)
    refits = [line for line in full.log.splitlines() if "online cost model refit at iteration" in line]
    assert [line.split("iteration ")[1].split()[0] for line in refits] == ["4", "6"], refits
    (ckpt / "latest_checkpointed_iteration.txt").write_text("4")
    resumed = train(tmp_path, "resumed", text_corpus, *common, "--load", str(ckpt), env={"DP": "2"})
    plans = {name: next(r["plans"] for r in run.ranks.values() if r["plans"]) for name, run in
             (("full", full), ("resumed", resumed))}
    # plans of iterations 5 and 6 use the refit of iteration 4 in both runs
    assert plans["resumed"][:2] == plans["full"][4:6]
    assert [resumed.losses[1], resumed.losses[2]] == pytest.approx([full.losses[5], full.losses[6]], rel=1e-5)


# --- the pinned Megatron-LM checkout (core_v0.16.1): its patched pretrain_gpt.py, and our launcher over it ----
def _pinned_checkout(tmp_path_factory) -> Path:
    """A patched checkout of the pinned commit (conftest.pinned_megatron_checkout); skipped without one."""
    from conftest import pinned_megatron_checkout

    dest = pinned_megatron_checkout(tmp_path_factory.mktemp("pinned") / "Megatron-LM")
    subprocess.run([str(REPO / "scripts" / "apply_patches.sh"), str(dest)], check=True, capture_output=True)
    return dest


@pytest.fixture(scope="module")
def pinned(tmp_path_factory) -> Path:
    return _pinned_checkout(tmp_path_factory)


def _pinned_env(checkout: Path, **layout: str) -> dict:
    # Megatron compiles its dataset helpers with `make`: for this interpreter, as the user scripts do
    built_here = {k: v for k, v in job_python_env().items() if k in ("PATH", "PYENV_VERSION")}
    return {**layout, **built_here, "PYTHONPATH": f"{checkout}{os.pathsep}{os.environ.get('PYTHONPATH', '')}"}


def test_patched_pretrain_gpt_of_the_pinned_checkout_trains_pp4(tmp_path, text_corpus, pinned):
    """The pinned pretrain_gpt.py, patched: middle stages (PP=4) get their packed-sequence params."""
    run = train(tmp_path, "pinned_pp4", text_corpus, "--num-layers", "4", "--wlb-packer", "wlb",
                env=_pinned_env(pinned, PP="4"), pretrain_gpt=str(pinned / "pretrain_gpt.py"))
    assert_trains(run)
    assert {Version(r["core_version"]).base_version for r in run.ranks.values()} == {"0.16.1"}


def test_launcher_over_the_pinned_checkout_cp2_pp2(tmp_path, text_corpus, pinned):
    """apply() from our launcher (no patch) on core_v0.16.1's training code."""
    run = train(tmp_path, "pinned_launcher", text_corpus, "--wlb-packer", "wlb", "--wlb-cp-sharding", "adaptive",
                env=_pinned_env(pinned, CP="2", PP="2"))
    assert_trains(run)
    assert {Version(r["core_version"]).base_version for r in run.ranks.values()} == {"0.16.1"}
    assert_documents_once(run)


# --- a Megatron-LM core_v0.19.0 checkout: its own pretrain_gpt.py (model builders, loss), patched ------------
@pytest.fixture(scope="module")
def checkout_019(tmp_path_factory) -> Path:
    """A core_v0.19.0 checkout patched with patches/core_v0.19.0 (from the repository MEGATRON_LM names, as
    for the pinned one); skipped, saying which commit is missing, without one."""
    from conftest import megatron_checkout

    dest = megatron_checkout(tmp_path_factory.mktemp("v019") / "Megatron-LM", "core_v0.19.0")
    subprocess.run([str(REPO / "scripts" / "apply_patches.sh"), str(dest)], check=True, capture_output=True)
    return dest


def test_patched_pretrain_gpt_of_the_019_checkout_trains_pp4(tmp_path, text_corpus, checkout_019):
    """The checkout's own get_batch/forward_step/loss (patched), its gpt_builders, our data: PP4's middle
    stages get their packed-sequence params, and every planned document reaches the model once."""
    run = train(tmp_path, "v019_pp4", text_corpus, "--num-layers", "4", "--wlb-packer", "wlb",
                env=_pinned_env(checkout_019, PP="4"), pretrain_gpt=str(checkout_019 / "pretrain_gpt.py"))
    assert_trains(run)
    assert {Version(r["core_version"]).release[:2] for r in run.ranks.values()} == {(0, 19)}
    assert all("+" in r["core_version"] for r in run.ranks.values())  # the checkout's megatron, not the wheel
    assert_documents_once(run)


def test_019_checkout_torch_dist_resume_with_cp2(tmp_path, text_corpus, checkout_019):
    """Megatron's default checkpoint format through the checkout's pretrain_gpt.py at CP2: resumed losses
    are the uninterrupted run's."""
    ckpt = tmp_path / "ckpt"
    common = ("--wlb-packer", "wlb", "--wlb-cp-sharding", "adaptive", "--save", str(ckpt), "--save-interval", "2",
              "--ckpt-format", "torch_dist")
    script = str(checkout_019 / "pretrain_gpt.py")
    full = train(tmp_path, "full", text_corpus, *common, env=_pinned_env(checkout_019, CP="2"), pretrain_gpt=script)
    shutil.rmtree(ckpt / "iter_0000004", ignore_errors=True)
    (ckpt / "latest_checkpointed_iteration.txt").write_text("2")
    resumed = train(tmp_path, "resumed", text_corpus, *common, "--load", str(ckpt),
                    env=_pinned_env(checkout_019, CP="2"), pretrain_gpt=script)
    assert [resumed.losses[1], resumed.losses[2]] == pytest.approx([full.losses[3], full.losses[4]], rel=1e-5)


def test_apply_alone_is_refused_on_core_019_naming_the_ways_in():
    """apply() inserted into an unpatched core >= 0.18 pretrain_gpt.py would die at the first step (its get_batch
    indexes a dict on TP rank 0 only): it is refused at start-up, naming the patch and the launcher."""
    code = ("import megatron_wlb.megatron as W\n"
            "try:\n    W.apply()\nexcept RuntimeError as e:\n    print('REFUSED', e)\n")
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=300,
                          env={**os.environ, "PYTHONPATH": f"{REPO}{os.pathsep}{os.environ.get('PYTHONPATH', '')}"})
    assert "REFUSED" in proc.stdout, proc.stderr[-3000:]
    assert "scripts/apply_patches.sh" in proc.stdout and "megatron_wlb.megatron.launcher" in proc.stdout


# --- Megatron-LM main (core 0.20.0 at version.MAIN_COMMIT), main after PR #6742, dev: our launcher over each ----
@pytest.mark.parametrize("name, series", [("main", (0, 20)), ("main-6742", (0, 20)), ("dev", (0, 19))])
def test_launcher_over_a_main_checkout_cp2_pp2(tmp_path, text_corpus, name, series):
    """Our launcher with a Megatron-LM main (pinned, and after PR #6742) or dev checkout on PYTHONPATH (from the
    repository MEGATRON_LM names; skipped, naming the commit, without one). dev's TransformerConfig refuses local
    attention at CP > 1 unless cp_comm_type is all_gather, which is what our CP attention does: the launcher
    sets it (before, every rank died at start-up)."""
    from conftest import megatron_checkout

    from megatron_wlb.megatron.version import MOVING_CHECKOUTS

    main = megatron_checkout(tmp_path / f"Megatron-LM-{name}", name, commit=MOVING_CHECKOUTS[name])
    run = train(tmp_path, f"{name}_cp2_pp2", text_corpus, "--wlb-packer", "wlb", "--wlb-cp-sharding", "adaptive",
                env=_pinned_env(main, CP="2", PP="2"))
    assert_trains(run)
    assert {Version(r["core_version"]).release[:2] for r in run.ranks.values()} == {series}
    assert_documents_once(run)


@pytest.mark.parametrize("name, flags, named", [
    ("dev", ("--dynamic-context-parallel", "--max-seqlen-per-dp-cp-rank", "128"),
     ("--dynamic-context-parallel", "--wlb-cp-sharding adaptive", "--max-seqlen-per-dp-cp-rank 128")),
    ("main-6742", ("--sequence-packing-scheduler", "wlb", "--use-varlen-dataset"),
     ("--sequence-packing-scheduler wlb", "--wlb-packer wlb", "--use-varlen-dataset")),
])
def test_flags_that_bypass_ours_are_refused_through_the_launcher(tmp_path, text_corpus, name, flags, named):
    """Megatron's own variable-length machinery asked for through our launcher (dev's dynamic CP; main's
    scheduler flag, whose choices take "wlb" once registered, and its varlen dataset): every rank stops at
    start-up with one line naming each flag and our equivalent, before Megatron's own checks and without a
    traceback of ours."""
    from conftest import megatron_checkout

    from megatron_wlb.megatron.version import MOVING_CHECKOUTS

    checkout = megatron_checkout(tmp_path / f"Megatron-LM-{name}", name, commit=MOVING_CHECKOUTS[name])
    run = train(tmp_path, f"{name}_refused", text_corpus, "--wlb-packer", "wlb", *flags,
                env=_pinned_env(checkout, CP="2"), expect_ok=False)
    assert run.returncode != 0  # type: ignore[attr-defined]
    line = next((x for x in run.log.splitlines() if "megatron_wlb: invalid WLB-LLM configuration" in x), "")
    assert all(part in line for part in named) and "our equivalent" in line, run.log[-4000:]
    assert not re.search(r'File "[^"]*megatron_wlb/', run.log), "the refusal came with our traceback"


@pytest.mark.parametrize("name", ["main-6742", "dev"])
def test_mains_own_packing_path_with_wlb_trains_through_pretrain_gpt(tmp_path, name):
    """Main after PR #6742 and dev, each its own pretrain_gpt.py (no apply(), no patch) with
    ``--sequence-packing-scheduler wlb`` at DP2: its train_step calls its wrap_data_iterator -> run() (gather
    the global batch's lengths over DP, our plan, reroute, pack THD micro-batches) over its MockVarlenDataset
    samples (its VarlenDataset reads HF/parquet/jsonl, not .bin/.idx), and the loss falls; evaluation goes the
    same way. With ``--transformer-impl local`` our attention serves the THD micro-batches (Megatron's local
    attention has none), so TransformerConfig's TransformerEngine >= 2.9 check, which guards TE's THD
    attention, is lifted for that case alone; with TE's layers and no TE >= 2.9 the run stops in one line."""
    from conftest import megatron_checkout

    from megatron_wlb.megatron.version import MOVING_CHECKOUTS

    checkout = megatron_checkout(tmp_path / f"Megatron-LM-{name}", name, commit=MOVING_CHECKOUTS[name])
    # --eval-iters 1: evaluation goes through wrap_data_iterator too (and dev's mock data refuses an empty split)
    flags = ("--mock-data", "--use-varlen-dataset", "--sequence-packing-scheduler", "wlb",
             "--max-seqlen-per-dp-cp-rank", "512", "--moe-token-dispatcher-type", "alltoall", "--eval-iters", "1")
    script = str(checkout / "pretrain_gpt.py")
    run = train(tmp_path, f"{name}_own_path", None, *flags, env=_pinned_env(checkout, DP="2"), pretrain_gpt=script)
    assert_trains(run)
    series = (0, 19) if name == "dev" else (0, 20)  # dev's package_info says 0.19.0
    assert {Version(r["core_version"]).release[:2] for r in run.ranks.values()} == {series}
    assert "> megatron_wlb: Megatron's sequence-packing path plans with WlbPackingScheduler" in run.log
    assert "validation loss at iteration 4" in run.log
    te = train(tmp_path, f"{name}_te", None, *flags, "--transformer-impl", "transformer_engine",
               env=_pinned_env(checkout, DP="2"), pretrain_gpt=script, expect_ok=False)
    assert te.returncode != 0  # type: ignore[attr-defined]
    line = next((x for x in te.log.splitlines() if x.startswith("megatron_wlb: --sequence-packing-scheduler wlb")), "")
    assert "TransformerEngine >= 2.9.0" in line and "--transformer-impl local" in line, te.log[-3000:]
