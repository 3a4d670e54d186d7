"""``--sft`` with WLB's flags through Megatron's own training loop on the CPU (issue 50).

The probe (``megatron_train_probe.py``) runs ``pretrain_gpt``'s loop with ``--sft --tokenizer-type SFTTokenizer``
over a jsonl of conversations and a tokenizer with a chat template built locally (``sft_fixtures``), at DP2, PP2
and CP2, and records what every rank fed the model (at CP2 each rank's rows, gathered over the CP group here).
Each document's tokens, labels and loss mask are checked against Megatron's own ``SFTDataset`` (its segment of
its line's sample), every conversation of the first epoch is trained exactly once, and a run resumed from a
checkpoint gives the uninterrupted run's losses.
"""

from __future__ import annotations

import hashlib
import re
import shutil
import warnings
from collections import Counter

import numpy as np
import pytest

pytest.importorskip("torch")
pytest.importorskip("transformers")

import sft_fixtures as F  # noqa: E402
from megatron_train_runs import Run, assert_documents_once, assert_trains, train  # noqa: E402
from test_sft_data import _sft_dataset  # noqa: E402

from megatron_wlb.data.sft import SftCorpus  # noqa: E402

SEQ = 256  # the tiny GPT's --seq-length
ITERS = 4  # the run; it saves at SAVE and the resumed run restarts there
SAVE = ITERS // 2


@pytest.fixture(scope="module")
def sft(tmp_path_factory):
    root = tmp_path_factory.mktemp("sft_loop")
    F.build_tokenizer(root / "tok")
    path = F.write_corpus(root / "chat.jsonl", 40, seed=11)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        tokenizer = F.megatron_sft_tokenizer(root / "tok")
    return root, path, tokenizer


def _flags(root, path) -> tuple[str, ...]:
    return ("--sft", "--tokenizer-type", "SFTTokenizer", "--tokenizer-model", str(root / "tok"),
            "--sft-tokenizer-prompt-format", "nemotron-h-aligned", "--split", "100,0,0")


def _expected_piece_data(path, tokenizer, cp: int = 1) -> dict[int, str]:
    """sha256 of each document's (tokens, labels, loss mask) as Megatron's SFTDataset gives it (one sample a
    jsonl line, each conversation's segment of it a document; under ``cp`` > 1 each padded to 2 x CP), hashed
    as the probe hashes what reached the model."""
    import json

    lines = [json.loads(t)["messages"] for t in open(path) if t.strip()]
    dataset = _sft_dataset(lines, tokenizer, SEQ, cp=cp)
    corpus = SftCorpus.build(path, tokenizer, SEQ, context_parallel=cp)
    out = {}
    for line in range(len(lines)):
        item, at = dataset[line], 0
        for doc in range(int(corpus.arrays.lines[line]), int(corpus.arrays.lines[line + 1])):
            n = int(corpus.lengths[doc])
            h = hashlib.sha256()
            for key in ("tokens", "labels", "loss_mask"):
                h.update(np.ascontiguousarray(item[key][at:at + n].numpy(), dtype=np.float64).tobytes())
            out[doc] = h.hexdigest()
            at += n
    return out


def _fed(run: Run) -> dict[int, str]:
    fed: dict[int, str] = {}
    for record in run.ranks.values():
        for doc, digest in record["piece_data"].items():
            assert fed.get(int(doc), digest) == digest
            fed[int(doc)] = digest
    return fed


def _assert_sftdatasets_data_once(run: Run, expected: dict[int, str]) -> None:
    n = len(expected)
    plans = next(r["pieces"] for r in run.ranks.values() if r["pieces"])
    trained = Counter(doc for plan in plans for doc, offset, _ in plan if offset == 0)
    assert all(offset == 0 for plan in plans for _, offset, _ in plan), "a conversation was cut"
    assert max(trained.values()) == 1, "a conversation was trained twice"
    first_epoch = {d for d in trained if d < n}
    # a conversation not trained yet is one the packer holds for a later iteration, named at the end
    waiting = re.search(r"waiting for a later iteration: ([0-9, ]+)\)", run.log)
    held = {int(d) for d in waiting.group(1).split(",")} if waiting else set()
    lost = sorted(set(range(n)) - first_epoch - held)
    assert not lost, f"epoch 0 lost conversations {lost}"
    assert len(first_epoch) >= n - 3 and not held & set(trained)
    fed = _fed(run)
    assert set(fed) >= first_epoch
    differ = [d for d in fed if fed[d] != expected[d % n]]
    assert not differ, f"conversations whose tokens, labels or loss mask differ from SFTDataset's: {differ}"


@pytest.fixture(scope="module")
def full(sft, tmp_path_factory):
    root, path, _ = sft
    tmp = tmp_path_factory.mktemp("sft_full")
    return tmp, train(tmp, "full", str(path), *_flags(root, path), "--train-iters", str(ITERS), "--save",
                      str(tmp / "ckpt"), "--save-interval", str(SAVE), "--ckpt-format", "torch", env={"DP": "2"})


@pytest.fixture(scope="module")
def expected(sft) -> dict[int, str]:
    """What SFTDataset gives each conversation (hashed), computed once for the module's runs."""
    _, path, tokenizer = sft
    return _expected_piece_data(path, tokenizer)


def test_sft_trains_every_conversation_once_with_sftdatasets_data_at_dp2(full, expected):
    _, run = full
    assert_trains(run, ITERS)
    assert_documents_once(run)
    _assert_sftdatasets_data_once(run, expected)
    assert run.log.count("tokenized in") == 1  # one of the two ranks built the SFT cache, the other mapped it
    assert "conversations cut at the window" in run.log  # the one long conversation, said


def test_sft_resume_equals_the_uninterrupted_run(sft, full):
    root, path, _ = sft
    tmp, run = full
    ckpt = tmp / "ckpt"
    shutil.rmtree(ckpt / f"iter_{ITERS:07d}", ignore_errors=True)
    (ckpt / "latest_checkpointed_iteration.txt").write_text(str(SAVE))
    resumed = train(tmp, "resumed", str(path), *_flags(root, path), "--train-iters", str(ITERS), "--save",
                    str(ckpt), "--save-interval", str(SAVE), "--ckpt-format", "torch", "--load", str(ckpt),
                    env={"DP": "2"})
    assert "tokenized in" not in resumed.log  # the restart maps the cache the first run built
    after = range(1, ITERS - SAVE + 1)  # the probe counts steps from the restart
    assert sorted(resumed.losses) == list(after), resumed.losses
    assert [resumed.losses[k] for k in after] == pytest.approx([run.losses[SAVE + k] for k in after], rel=1e-5)
    plans = next(r["plans"] for r in run.ranks.values() if r["plans"])
    again = next(r["plans"] for r in resumed.ranks.values() if r["plans"])
    assert again == plans[SAVE:]


def test_sft_pp2_trains_sftdatasets_data(sft, expected, tmp_path):
    root, path, _ = sft
    run = train(tmp_path, "pp2", str(path), *_flags(root, path), "--train-iters", "3", env={"PP": "2"})
    assert_trains(run, 3)
    assert_documents_once(run)
    fed = _fed(run)
    assert fed and all(fed[d] == expected[d % len(expected)] for d in fed)


def test_sft_cp2_trains_sftdatasets_data_gathered_over_the_cp_group(sft, tmp_path):
    """CP 2 through Megatron's loop (adaptive layout): each document's rows, gathered over the two CP ranks,
    cover it exactly once and are SFTDataset's CP-2 sample's tokens, labels and loss mask (its 2 x CP padding
    included)."""
    root, path, tokenizer = sft
    run = train(tmp_path, "cp2", str(path), *_flags(root, path), "--wlb-cp-sharding", "adaptive", "--train-iters",
                "3", env={"CP": "2", "WLB_PROBE_PIECE_ROWS": "1"})
    assert_trains(run, 3)
    assert_documents_once(run)
    assert sorted(r["parallel"]["cp"] for r in run.ranks.values()) == [0, 1]
    expected = _expected_piece_data(path, tokenizer, cp=2)
    plans = next(r["plans"] for r in run.ranks.values() if r["plans"])
    trained = {doc: n for plan in plans[:3] for doc, n in plan}
    assert len(trained) >= 5
    split = 0
    for doc, n in trained.items():
        parts = [r["piece_rows"][str(doc)] for r in run.ranks.values()]  # both CP ranks fed its micro-batch
        split += all(p[0] for p in parts)  # the layout may keep a short document on one rank
        at = np.concatenate([p[0] for p in parts])
        assert sorted(at.tolist()) == list(range(n)), f"document {doc}: its positions are not each on one rank"
        order = np.argsort(at)
        h = hashlib.sha256()
        for k in (1, 2, 3):
            h.update(np.ascontiguousarray(np.concatenate([p[k] for p in parts])[order], dtype=np.float64).tobytes())
        assert h.hexdigest() == expected[doc % len(expected)], f"document {doc} differs from SFTDataset's at CP 2"
    assert split > 0, "no document was sharded over the two CP ranks"


def test_sft_samples_whole_is_a_yaml_choice_said_at_start_up(sft, tmp_path):
    """``sft.samples: whole`` in a settings file: every conversation its own document, said in one line."""
    root, path, _ = sft
    settings = tmp_path / "whole.yaml"
    settings.write_text("sft: {samples: whole}\n")
    run = train(tmp_path, "whole", str(path), *_flags(root, path), "--train-iters", "2", "--wlb-config",
                str(settings))
    assert_trains(run, 2)
    assert "sft.samples whole: " in run.log and "conversations each a document" in run.log


@pytest.mark.parametrize("text, said", [
    ('{"messages": [{"role": "User", "content": "w1"}, {"role": "Assistant", "content": "w2"}]}\n',
     "message 1 has role 'User'; use one of system, user, assistant, tool"),
    ('{"messages": [{"role": "system", "content": "w1"}, {"role": "assistant", "content": "w2"}]}\n',
     "message 2 is an assistant turn that follows no user or tool turn"),
], ids=["capitalised roles", "assistant only"])
def test_an_sft_refusal_through_the_launcher_is_one_line_without_a_traceback(sft, tmp_path, text, said):
    root, _, _ = sft
    bad = tmp_path / "bad.jsonl"
    bad.write_text(text)
    run = train(tmp_path, "bad", str(bad), *_flags(root, bad), "--train-iters", "2", env={"DP": "2"},
                expect_ok=False)
    assert run.returncode != 0  # type: ignore[attr-defined]
    lines = [line for line in run.log.splitlines() if said in line]
    assert lines and all(f"{bad}:1" in line for line in lines), run.log[-3000:]
    assert "Traceback" not in run.log, run.log[-3000:]
