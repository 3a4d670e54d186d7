"""Megatron-LM's own training loop, end to end on CPU (gloo), with the WLB-LLM hooks: every layout (TP, PP, VPP, CP,
DP, SP, recomputation), our own corpora and the online refit. The runs are ``megatron_train_runs.train``."""

from __future__ import annotations

import importlib.util

import pytest
from megatron_train_runs import assert_documents_once, assert_trace, assert_trains, train

torch = pytest.importorskip("torch")
pytestmark = pytest.mark.slow  # Megatron training runs: minutes; `pytest -m "not slow"` is the fast lane


def test_tp2_pp2_trains_and_every_document_reaches_the_model_once(tmp_path, text_corpus):
    run = train(tmp_path, "tp2pp2", text_corpus, "--wlb-packer", "wlb", "--wlb-cp-sharding", "per-document",
                env={"TP": "2", "PP": "2"})
    assert_trains(run)
    from megatron_wlb.megatron.args.version import is_supported

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


def test_own_corpus_with_token_ids_beyond_the_tiny_vocabulary(tmp_path):
    """A user's corpus whose ids exceed the tiny GPT's default vocabulary (300): the harness takes the vocabulary
    from the data and trains; a --vocab-size too small for it is refused in one line naming the largest id (issue
    57 item 6: by the reader's start-up check in the ranks, the harness reads no data when it is given)."""
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
    refusals = [line for line in refused.log.splitlines() if "token id 1199 is outside" in line]
    assert refusals and all(line.endswith("token id 1199 is outside the model's vocabulary of 512 (ids 0..511): set "
                                          "--vocab-size / the tokenizer to at least 1200 (or the tokenizer the data "
                                          "was made with)") for line in refusals)
    assert "Traceback" not in refused.log


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
