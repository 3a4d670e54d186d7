"""Issue 49, the open items: the whole-document order as a keyed permutation (scale), ranks whose GPTDataset
index caches differ (item 1), refusals as one line on every rank (item 7), and extending a balanced run
(item 5). The Megatron-loop tests share one balanced run (``B``: ``--wlb-pieces concat-and-cut
--reset-attention-mask --reset-position-ids --global-batch-size 4`` at DP2) and its GPTDataset cache."""

from __future__ import annotations

import glob
import os
import re
import shutil
import subprocess
import sys

import numpy as np
import pytest

from megatron_wlb.data.permutation import KeyedPermutation
from megatron_wlb.data.reader import ORDER_FEISTEL, ORDER_NUMPY_SHUFFLE, DocumentReader
from megatron_wlb.megatron.data.packed import WlbDataIterator
from megatron_wlb.packing import PackingConfig, make_packer

pytest.importorskip("megatron.core.datasets.gpt_dataset")
from test_balanced_gptdataset import corpora  # noqa: E402,F401  (the shared GPTDataset corpora fixture)
from test_order_cache import blend  # noqa: E402  (the two-corpus blend, one definition)


# -- the keyed permutation (scale) --------------------------------------------------------------------------
@pytest.mark.parametrize("size", [0, 1, 2, 3, 5, 7, 8, 9, 63, 64, 65, 1000, 4097, 65_537, 300_001])
def test_the_keyed_permutation_is_a_bijection_of_any_size(size):
    values = KeyedPermutation(size, (1234, 0, 3))[:]
    assert values.dtype == np.int64 and values.size == size
    assert np.array_equal(np.sort(values), np.arange(size))
    if size >= 64:
        assert not np.array_equal(values, np.arange(size))  # shuffled
        assert abs(np.corrcoef(np.arange(size), values)[0, 1]) < 0.2


def test_the_keyed_permutation_is_the_same_per_block_per_key_and_in_another_process():
    perm = KeyedPermutation(100_003, (7, 1, 2))
    whole = perm[:]
    blocks = np.concatenate([perm[a:a + 4099] for a in range(0, 100_003, 4099)])
    assert np.array_equal(blocks, whole)
    assert np.array_equal(perm.at([5, 0, 100_002]), whole[[5, 0, 100_002]])
    assert not np.array_equal(KeyedPermutation(100_003, (7, 1, 3))[:], whole)  # another epoch
    assert not np.array_equal(KeyedPermutation(100_003, (8, 1, 2))[:], whole)  # another seed
    code = ("import sys; from megatron_wlb.data.permutation import KeyedPermutation as K; "
            "sys.stdout.write(','.join(map(str, K(100003, (7, 1, 2))[99000:99050])))")
    other = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True,
                           env={**os.environ, "PYTHONHASHSEED": "12345"}).stdout
    assert other == ",".join(map(str, whole[99000:99050]))  # another process, another hash seed: the same


def test_a_billion_document_permutation_holds_nothing():
    perm = KeyedPermutation(10**9, (1234, 0, 0))
    block = perm[10**9 - 1000:]
    assert block.size == 1000 and np.unique(block).size == 1000 and int(block.max()) < 10**9
    assert len(perm.__dict__) <= 6 and all(np.asarray(v).nbytes <= 64 for v in perm.__dict__.values())


def test_the_reader_visits_each_document_once_per_epoch_in_the_feistel_order(tmp_path):
    blend(tmp_path)  # writes the corpora
    reader = DocumentReader([(str(tmp_path / "a"), 1.0)], split="9,1,0", seed=5, order_cache=str(tmp_path / "cache"))
    assert reader.order == ORDER_FEISTEL and reader.describe()["order"] == ORDER_FEISTEL
    b, e = reader.ranges[0]
    ids, _ = reader.stream(reader.epoch_tokens()).collect()
    assert np.array_equal(np.sort(ids), np.arange(b, e))  # the split range once, no repeat
    assert np.array_equal(ids, KeyedPermutation(e - b, (5, 0, 0))[:] + b)
    assert not os.path.exists(tmp_path / "cache")  # no order file is built, whatever --data-cache-path says
    reader = blend(tmp_path)
    legacy = blend(tmp_path, order=ORDER_NUMPY_SHUFFLE)
    assert not np.array_equal(legacy.stream(20_000_000).collect()[0], reader.stream(20_000_000).collect()[0])
    with pytest.raises(ValueError, match="epoch order 'nope' is not one this build knows"):
        blend(tmp_path, order="nope")


def test_a_checkpoint_saved_before_the_feistel_order_resumes_in_its_own_order(tmp_path):
    """A data state saved by a release whose reader had no ``order`` (the numpy shuffle) resumes in that order:
    the plans after the resume are the uninterrupted old run's; a new state names its order."""
    cfg = PackingConfig(seq_len=4096, n=2, dp=2, max_seq_len=6144)
    tokens = 30 * cfg.tokens_per_iteration
    old_reader = blend(tmp_path, order=ORDER_NUMPY_SHUFFLE)
    full = WlbDataIterator(old_reader, old_reader.stream(tokens), make_packer("wlb", cfg), 0)
    plans = [full.next_plan().micro_batches for _ in range(10)]
    first = WlbDataIterator(old_reader, old_reader.stream(tokens), make_packer("wlb", cfg), 0)
    for _ in range(4):
        first.next_plan()
    state = first.state_dict()
    assert state["reader"]["order"] == ORDER_NUMPY_SHUFFLE
    del state["reader"]["order"]  # as the releases before issue 49 saved it
    new_reader = blend(tmp_path)  # this release's default: the Feistel order
    resumed = WlbDataIterator(new_reader, new_reader.stream(tokens), make_packer("wlb", cfg), 0)
    resumed.load_state_dict(state)
    assert new_reader.order == ORDER_NUMPY_SHUFFLE
    assert [resumed.next_plan().micro_batches for _ in range(6)] == plans[4:]
    fresh = blend(tmp_path)
    feistel = WlbDataIterator(fresh, fresh.stream(tokens), make_packer("wlb", cfg), 0)
    feistel.next_plan()
    assert feistel.state_dict()["reader"]["order"] == ORDER_FEISTEL
    assert feistel.current.micro_batches != plans[0]


# -- what fills Megatron's samples (items 1 and 5), over megatron-core's real GPTDataset ------------------------
def test_the_sample_identity_sees_swapped_one_piece_samples_and_witnesses_the_order(corpora, tmp_path):  # noqa: F811
    """Item 1's key differs when a copy of the cache swaps two samples whose pieces look alike, and the line
    names the position, the array and each rank's file; item 5's witness accepts a longer run of the same epochs
    and refuses another seed."""
    from test_balanced_gptdataset import GBS, _args, _dataset

    from megatron_wlb.megatron.data.gpt_samples import MegatronSamples
    from megatron_wlb.megatron.data.sample_agreement import SampleIdentity, describe_disagreement, index_cache_files

    args = _args(corpora, False)
    dataset = _dataset(args, 6)
    files = index_cache_files(dataset)
    ones = [p for p in range(len(dataset)) if dataset.sample_index[dataset.shuffle_index[p]][0]
            == dataset.sample_index[dataset.shuffle_index[p] + 1][0]][:2]
    copy = tmp_path / "copy"
    shutil.copytree(os.path.dirname(files["shuffle_index"][0]), copy)
    swapped = np.load(files["shuffle_index"][0])
    swapped[ones] = swapped[ones[::-1]]
    np.save(copy / os.path.basename(files["shuffle_index"][0]), swapped)
    other = _dataset(_args(corpora, False, data_cache_path=str(copy)), 6)
    samples = MegatronSamples(dataset)
    mine, theirs = SampleIdentity(dataset, samples.seq_len), SampleIdentity(other, samples.seq_len)
    cfg = PackingConfig(seq_len=samples.seq_len, n=2, dp=2, max_seq_len=samples.seq_len, read_ahead=False)
    it = WlbDataIterator(None, samples.stream(0), make_packer("fixed-greedy", cfg), 0, read_piece=samples.piece,
                         sample_identity=mine)
    batch = it.next_plan()
    while ones[1] not in mine.positions(batch):
        assert mine.key(batch) == theirs.key(batch)  # the same samples there
        batch = it.next_plan()
    assert mine.key(batch) != theirs.key(batch)
    line = describe_disagreement(batch.iteration, [(mine.key(batch), mine.witness(batch)),
                                                   (theirs.key(batch), theirs.witness(batch))])
    assert f"at training position {ones[0] if ones[0] in mine.positions(batch) else ones[1]} rank 1 read" in line
    assert "their GPTDataset shuffle_index differs" in line and str(copy) in line and files["shuffle_index"][0] in line
    witness = mine.order_witness(5 * GBS)
    assert SampleIdentity(_dataset(args, 12), samples.seq_len).same_order(witness)  # a longer run, one epoch
    assert not SampleIdentity(_dataset(_args(corpora, False, seed=7), 12), samples.seq_len).same_order(witness)


# -- through Megatron's loop ---------------------------------------------------------------------------------
BALANCED = ("--wlb-packer", "wlb", "--wlb-pieces", "concat-and-cut", "--reset-attention-mask",
            "--reset-position-ids", "--global-batch-size", "4")


@pytest.fixture(scope="module")
def balanced(tmp_path_factory, eod_corpus):
    """One untampered balanced run at DP2 with its GPTDataset cache (the reference the tampered runs differ from)."""
    from megatron_train_runs import train

    root = tmp_path_factory.mktemp("round4")
    cache = root / "cache"
    run = train(root, "reference", eod_corpus, *BALANCED, "--data-cache-path", str(cache), "--train-iters", "5",
                "--save", str(root / "ckpt"), "--save-interval", "5", "--ckpt-format", "torch", env={"DP": "2"})
    return root, cache, run


def _train_index(cache, array: str, samples: int = 20) -> str:
    """The cached GPTDataset train ``array`` of the job with ``samples`` train samples (the reference run's 5 x 4)."""
    import json

    for description in glob.glob(str(cache / "*-GPTDataset-train-description.txt")):
        if json.loads(open(description).read())["num_samples"] == samples:
            return description.replace("description.txt", f"{array}.npy")
    raise AssertionError(f"no GPTDataset train indices of {samples} samples in {cache}")


def _one_piece_positions(cache, corpus: str, positions: int) -> list[int]:
    """Training positions among the first ``positions`` whose sample lies inside one document (one piece)."""
    shuffle = np.load(_train_index(cache, "shuffle_index"))
    sample = np.load(_train_index(cache, "sample_index"))
    return [p for p in range(positions) if sample[shuffle[p]][0] == sample[shuffle[p] + 1][0]]


@pytest.mark.slow
def test_ranks_whose_gptdataset_index_caches_differ_stop_naming_the_rank_and_the_file(balanced, eod_corpus):
    """Item 1: rank 1 reads a copy of the job's --data-cache-path whose shuffle_index.npy swaps two one-piece
    samples (the plan's pieces are the same on both ranks): every rank stops at the step that trains them with
    one line naming rank 1, the array and its cache file (before: rc 0, the losses apart from iteration 3)."""
    from megatron_train_runs import train

    root, cache, reference = balanced
    assert "their GPTDataset" not in reference.log  # the untampered run agrees every step
    copy = root / "cache_rank1"
    shutil.copytree(cache, copy)
    ones = _one_piece_positions(copy, eod_corpus, 20)
    assert len(ones) >= 2, ones
    path = _train_index(copy, "shuffle_index")
    shuffle = np.load(path)
    p, q = ones[-2], ones[-1]
    shuffle[[p, q]] = shuffle[[q, p]]
    np.save(path, shuffle)
    run = train(root, "tampered", eod_corpus, *BALANCED, "--data-cache-path", str(cache), "--train-iters", "5",
                env={"DP": "2", "WLB_PROBE_RANK_FLAGS": f"1:--data-cache-path {copy}"}, expect_ok=False)
    assert run.returncode != 0  # type: ignore[attr-defined]
    stops = [line for line in run.log.splitlines() if "but Megatron's samples behind them differ" in line]
    assert len(stops) >= 2, run.log[-4000:]  # every rank
    assert f"at training position {p} rank 1 read document" in stops[0]
    assert "their GPTDataset shuffle_index differs" in stops[0]
    assert f"{path} on rank 1" in stops[0] and str(cache) in stops[0]
    assert "Traceback" not in run.log or "megatron_wlb/" not in run.log.split("Traceback", 1)[1][:4000]


def rank_tracebacks(log: str) -> int:
    """Tracebacks the training ranks printed: every ``Traceback`` but torchrun's own report that a worker
    failed (its agent raises ``ChildFailedError`` whenever a rank exits non-zero, however it exits)."""
    blocks = log.split("Traceback (most recent call last):")[1:]
    return sum("ChildFailedError" not in block.split("\n=====", 1)[0] for block in blocks)


def _refused_in_one_line(run, needle: str) -> str:
    """The one line every rank stopped with (containing ``needle``), and no rank's traceback in the output."""
    assert run.returncode != 0, run.log[-3000:]  # type: ignore[attr-defined]
    assert rank_tracebacks(run.log) == 0, run.log[run.log.index("Traceback"):][:3000]
    lines = [line for line in run.log.splitlines() if needle in line]
    assert lines, run.log[-3000:]
    assert all(not r["losses"] for r in run.ranks.values()), "a rank trained a step"
    return lines[0]


@pytest.mark.slow
def test_a_balanced_run_extends_its_train_iters_while_megatrons_order_is_the_same(balanced, eod_corpus):
    """Item 5: resuming the balanced run with a larger --train-iters (megatron-core's dataset description, so its
    hash, changes with the sample count) continues from the saved sample when the order up to it is the same
    (before: refused on every rank naming flags that had not changed); a length whose epochs reshuffle the
    samples is refused in one line naming --wlb-reset-data-stream (item 7: no traceback)."""
    from megatron_train_runs import train

    root, cache, reference = balanced
    common = (*BALANCED, "--data-cache-path", str(cache), "--load", str(root / "ckpt"), "--ckpt-format", "torch",
              "--override-opt_param-scheduler")  # Megatron's own way to a longer schedule
    longer = train(root, "longer", eod_corpus, *common, "--train-iters", "8", env={"DP": "2"})
    assert len(longer.losses) == 3 and re.search(r"iteration +6/ +8 ", longer.log), longer.log[-3000:]
    assert re.search(r"iteration +8/ +8 ", longer.log)
    saved = int(next(r["pieces"] for r in reference.ranks.values() if r["pieces"])[-1][-1][0]) // 256
    resumed = next(r["pieces"] for r in longer.ranks.values() if r["pieces"])
    assert min(doc // 256 for plan in resumed for doc, _, _ in plan) >= saved - 8  # from the saved samples on
    far = train(root, "reshuffled", eod_corpus, *common, "--train-iters", "1500", env={"DP": "2"}, expect_ok=False)
    line = _refused_in_one_line(far, "cannot resume the checkpoint at iteration 5")
    assert "are not this run's" in line and "--wlb-reset-data-stream" in line


@pytest.mark.slow
def test_a_balanced_run_stopped_before_its_first_sidecar_is_refused_not_resumed_as_stock(balanced, eod_corpus):
    """Issue 57 (1): the balanced run's first (and only) checkpoint without its sidecar (a job killed between
    Megatron's save and ours) was resumed as a stock Megatron run, its waiting pieces never trained. Megatron's own
    saved args carry our --wlb-* flags: every rank refuses in one line naming --wlb-reset-data-stream."""
    from megatron_train_runs import train

    from megatron_wlb.megatron.state.checkpoint_files import SIDECAR_NAME

    root, cache, _ = balanced
    killed = root / "ckpt_killed"
    shutil.copytree(root / "ckpt", killed)
    os.remove(killed / "iter_0000005" / SIDECAR_NAME)
    run = train(root, "killed", eod_corpus, *BALANCED, "--data-cache-path", str(cache), "--load", str(killed),
                "--ckpt-format", "torch", "--train-iters", "6", "--override-opt_param-scheduler", env={"DP": "2"},
                expect_ok=False)
    line = _refused_in_one_line(run, "resumes at iteration 5 but holds no " + SIDECAR_NAME)
    assert "--ckpt-step N" in line and "pass --wlb-reset-data-stream to continue Megatron's samples" in line


@pytest.mark.slow
def test_start_up_and_cache_refusals_are_one_line_on_every_rank(balanced, eod_corpus):
    """Item 7: a balanced job with an empty train split; one rank with another --seed (named by the start-up
    agreement, which now runs before megatron-core builds anything) or its own empty --data-cache-path; a
    truncated cached .npy: each stops in one line, 0 tracebacks (before: megatron-core's FileNotFoundError,
    numpy's ValueError and our ValueError with every rank's traceback)."""
    from megatron_train_runs import train

    root, cache, _ = balanced
    empty = train(root, "empty_split", eod_corpus, *BALANCED, "--split", "0,100,0", env={"DP": "2"},
                  expect_ok=False)
    assert "--split '0,100,0'" in _refused_in_one_line(empty, "Megatron built no train dataset")
    seed = train(root, "seed", eod_corpus, *BALANCED, "--data-cache-path", str(cache),
                 env={"DP": "2", "WLB_PROBE_RANK_FLAGS": "1:--seed 99"}, expect_ok=False)
    assert "--seed: 1234 on rank 0, 99 on rank 1" in _refused_in_one_line(seed, "start with different settings")
    own = root / "own_cache"
    alone = train(root, "own_cache", eod_corpus, *BALANCED, "--data-cache-path", str(cache),
                  env={"DP": "2", "WLB_PROBE_RANK_FLAGS": f"1:--data-cache-path {own}"}, expect_ok=False)
    line = _refused_in_one_line(alone, "found no GPTDataset index file")
    assert f"{own}/" in line and "rank 1" in line
    damaged = root / "damaged_cache"
    shutil.copytree(cache, damaged)
    path = _train_index(damaged, "shuffle_index")
    with open(path, "r+b") as f:
        f.truncate(os.path.getsize(path) // 2)
    cut = train(root, "truncated", eod_corpus, *BALANCED, "--data-cache-path", str(damaged), "--train-iters", "5",
                env={"DP": "2"}, expect_ok=False)
    assert path in _refused_in_one_line(cut, "cannot read its GPTDataset index cache")
