"""Megatron's own loop (CPU, gloo): the balanced mode trains exactly the samples megatron-core's GPTDataset gives
the stock job (``megatron_train_runs``)."""

from __future__ import annotations

import re
import shutil
from pathlib import Path

import pytest
from megatron_train_runs import assert_documents_once, assert_fed_stock_samples, assert_trains, stock_samples, train

torch = pytest.importorskip("torch")
pytestmark = pytest.mark.slow  # Megatron training runs: minutes; `pytest -m "not slow"` is the fast lane


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

    # a stock checkpoint: the same files without our sidecar and without our flags in Megatron's saved args (what
    # an unpatched pretrain_gpt.py saves; a checkpoint whose args show our flags but has no sidecar is refused)
    shutil.rmtree(ckpt / "iter_0000004", ignore_errors=True)
    (ckpt / "iter_0000002" / "wlb_packer_state.json").unlink()
    (ckpt / "latest_checkpointed_iteration.txt").write_text("2")
    for state_file in (ckpt / "iter_0000002").glob("*/model_optim_rng.pt"):
        state = torch.load(state_file, weights_only=False)
        for name in [n for n in vars(state["args"]) if n.startswith("wlb_")]:
            delattr(state["args"], name)
        torch.save(state, state_file)
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
