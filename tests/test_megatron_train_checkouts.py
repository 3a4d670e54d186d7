"""Megatron's own loop (CPU, gloo) through Megatron-LM checkouts: the pinned core_v0.16.1 and core_v0.19.0 trees
patched, main and dev through the launcher (``megatron_train_runs``)."""

from __future__ import annotations

import os
import re
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
from conftest import job_python_env
from megatron_train_runs import REPO, assert_documents_once, assert_trains, train
from packaging.version import Version

torch = pytest.importorskip("torch")
pytestmark = pytest.mark.slow  # Megatron training runs: minutes; `pytest -m "not slow"` is the fast lane


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
    assert "scripts/apply_patches.sh" in proc.stdout and "megatron_wlb.megatron.entry.launcher" in proc.stdout


# --- Megatron-LM main (core 0.20.0 at version.MAIN_COMMIT), main after PR #6742, dev: our launcher over each ----
@pytest.mark.parametrize("name, series", [("main", (0, 20)), ("main-6742", (0, 20)), ("dev", (0, 19))])
def test_launcher_over_a_main_checkout_cp2_pp2(tmp_path, text_corpus, name, series):
    """Our launcher with a Megatron-LM main (pinned, and after PR #6742) or dev checkout on PYTHONPATH (from the
    repository MEGATRON_LM names; skipped, naming the commit, without one). dev's TransformerConfig refuses local
    attention at CP > 1 unless cp_comm_type is all_gather, which is what our CP attention does: the launcher
    sets it (before, every rank died at start-up)."""
    from conftest import megatron_checkout

    from megatron_wlb.megatron.args.version import MOVING_CHECKOUTS

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

    from megatron_wlb.megatron.args.version import MOVING_CHECKOUTS

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

    from megatron_wlb.megatron.args.version import MOVING_CHECKOUTS

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
