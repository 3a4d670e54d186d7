"""A tiny mixture-of-experts GPT through Megatron-LM's own training loop on CPU (gloo) with the WLB-LLM hooks
(issue 36): 4 experts, top-2, the alltoall token dispatcher, packed by ``--wlb-packer wlb`` with the cost model
of the MoE shape (``cost_model_from_args`` maps Megatron's MoE flags): it trains, the loss falls, every planned
document's tokens reach the model exactly once."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest

pytest.importorskip("torch")
from megatron_train_runs import (  # noqa: E402,F401
    assert_documents_once,
    assert_fed_stock_samples,
    assert_trains,
    stock_samples,
    train,
)

pytestmark = pytest.mark.slow  # Megatron training runs

#: 4 experts of FFN 64, top-2, Megatron's alltoall dispatcher (the one that takes PP's variable-length
#: micro-batches), the aux-loss router; every layer MoE
MOE_FLAGS = ("--num-experts", "4", "--moe-router-topk", "2", "--moe-ffn-hidden-size", "64",
             "--moe-token-dispatcher-type", "alltoall", "--moe-router-load-balancing-type", "aux_loss",
             "--moe-aux-loss-coeff", "1e-2")


#: the traced PP2 runs that ``wlb calibrate --from-trace`` fits: 14 iterations, thread clock
TRACED_ITERATIONS = 14


def traced_pp2_run(tmp_path: Path, name: str, corpus: str, *flags: str):
    """A PP2 run of ``TRACED_ITERATIONS`` with ``--wlb-trace NAME/trace.jsonl`` (thread clock)."""
    return train(tmp_path, name, corpus, *flags, "--train-iters", str(TRACED_ITERATIONS), "--wlb-packer", "wlb",
                 "--wlb-trace", str(tmp_path / name / "trace.jsonl"), env={"PP": "2", "WLB_TRACE_CLOCK": "thread"})


@pytest.fixture(scope="module")
def moe_pp2(tmp_path_factory, text_corpus):  # noqa: F811
    """The traced MoE PP2 run (``traced_pp2_run``), shared: it trains (test below) and is fitted (the trace test)."""
    return traced_pp2_run(tmp_path_factory.mktemp("moe_pp2"), "moe", text_corpus, *MOE_FLAGS)


#: the EP2 x DP2 run's flags (``moe_ep2``), the resumed run's too
MOE_EP2_SAVED = (*MOE_FLAGS, "--expert-model-parallel-size", "2", "--wlb-packer", "wlb", "--save-interval", "2",
                 "--ckpt-format", "torch")


@pytest.fixture(scope="module")
def moe_ep2(tmp_path_factory, text_corpus):  # noqa: F811
    """The MoE run at EP2 x DP2, traced and saving Megatron's torch checkpoint at iterations 2 and 4, shared: it
    trains (test below) and is resumed (the resume test). The run and its checkpoint folder."""
    tmp = tmp_path_factory.mktemp("moe_ep2")
    ckpt = tmp / "ckpt"
    run = train(tmp, "full", text_corpus, *MOE_EP2_SAVED, "--save", str(ckpt), "--wlb-trace",
                str(tmp / "full" / "trace.jsonl"), env={"DP": "2"})
    return run, ckpt


def test_tiny_moe_pp2_trains_with_wlb_packer(moe_pp2):
    assert_trains(moe_pp2, iterations=TRACED_ITERATIONS)
    assert_documents_once(moe_pp2)
    assert "[wlb] iteration" in moe_pp2.log


def test_tiny_moe_ep2_dp2_trains_with_wlb_packer(moe_ep2):
    run, _ = moe_ep2
    trace = run.out / "trace.jsonl"
    assert_trains(run)
    assert_documents_once(run)
    from megatron_wlb.costmodel.trace import read_trace

    header = read_trace(trace).headers[0]  # the packer's cost model: MoE shape, EP 2
    assert header["model"]["num_experts"] == 4 and header["model"]["moe_ffn_hidden"] == 64
    assert "DP2-EP2" in header["cost_model"]


def _calibrate(trace: Path, out: Path, capsys) -> tuple[dict, str]:
    from megatron_wlb.cli.main import main

    assert main(["calibrate", "--from-trace", str(trace), "--out", str(out), "--holdout-every", "3"]) == 0
    return json.loads(out.read_text()), capsys.readouterr().out


def test_moe_trace_fits_a_cost_model_beside_the_dense_one(tmp_path, text_corpus, capsys, moe_pp2):  # noqa: F811
    """``--wlb-trace`` times the MoE run and ``wlb calibrate --from-trace`` fits it (the experts, router and
    dispatcher inside its per-token term), with a held-out MAPE beside the same run's dense model's."""
    fits = {}
    for name, run in (("moe", moe_pp2), ("dense", traced_pp2_run(tmp_path, "dense", text_corpus))):
        assert_trains(run, iterations=TRACED_ITERATIONS)
        fits[name] = _calibrate(run.out / "trace.jsonl", tmp_path / f"{name}.json", capsys)
    moe, dense = fits["moe"][0], fits["dense"][0]
    assert moe["model"]["num_experts"] == 4 and "num_experts" not in dense["model"]
    for profile, printed in fits.values():
        mape = profile["holdout"]["mape"]
        assert 0 <= mape < 1.0, printed
    with capsys.disabled():
        print(f"\nheld-out MAPE of the trace fit: MoE {moe['holdout']['mape']:.1%}, "
              f"dense {dense['holdout']['mape']:.1%}")


def test_tiny_moe_balanced_concat_and_cut_pp2_trains_the_stock_jobs_samples(tmp_path, eod_corpus):  # noqa: F811
    """``--wlb-pieces concat-and-cut``: the MoE job trains megatron-core's own GPTDataset samples, balanced."""
    run = train(tmp_path, "moe_cut", eod_corpus, *MOE_FLAGS, "--wlb-packer", "wlb", "--wlb-pieces", "concat-and-cut",
                "--reset-attention-mask", "--reset-position-ids", env={"PP": "2"})
    assert_trains(run)
    assert_documents_once(run)
    assert_fed_stock_samples(run, stock_samples(eod_corpus, tmp_path, 4, dp=1, eod_mask_loss=False))


def test_tiny_moe_ep2_resume_equals_an_uninterrupted_run(tmp_path, text_corpus, moe_ep2):  # noqa: F811
    full, saved = moe_ep2
    ckpt = tmp_path / "ckpt"
    shutil.copytree(saved, ckpt)
    common = (*MOE_EP2_SAVED, "--save", str(ckpt))
    shutil.rmtree(ckpt / "iter_0000004", ignore_errors=True)
    (ckpt / "latest_checkpointed_iteration.txt").write_text("2")
    resumed = train(tmp_path, "resumed", text_corpus, *common, "--load", str(ckpt), env={"DP": "2"})
    assert sorted(resumed.losses) == [1, 2], resumed.losses  # the probe counts steps from the restart
    assert [resumed.losses[1], resumed.losses[2]] == pytest.approx([full.losses[3], full.losses[4]], rel=1e-5)


def test_tiny_moe_online_refit_at_ep2_agrees_and_trains(tmp_path, text_corpus):  # noqa: F811
    """--wlb-cost-model online on the MoE job at EP2 x DP2: the refits run on schedule (every rank's coefficients
    and plan digests checked equal inside), and the packer keeps planning with the refitted model."""
    settings = tmp_path / "refit.yaml"  # a settings file: the research knob refit_interval is a YAML key
    settings.write_text("cost: {refit_interval: 2}\n")
    run = train(tmp_path, "moe_online", text_corpus, *MOE_FLAGS, "--expert-model-parallel-size", "2", "--wlb-packer",
                "wlb", "--wlb-cost-model", "online", "--wlb-config", str(settings), "--train-iters", "6",
                env={"DP": "2"})
    assert_trains(run, iterations=6)
    assert_documents_once(run)
    refits = [line for line in run.log.splitlines() if "online cost model refit at iteration" in line]
    assert [line.split("iteration ")[1].split()[0] for line in refits] == ["4", "6"], refits
