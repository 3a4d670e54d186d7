"""``wlb analyze --data-prefix``: the concat-and-cut baseline and the balanced concat-and-cut train
megatron-core's real GPTDataset samples (issue 30, item 5), and without megatron-core analyze says in
one line that it follows its own order instead."""

from __future__ import annotations

import json
import sys
import warnings

import numpy as np
import pytest
import yaml

from megatron_wlb.cli.main import main
from megatron_wlb.data.samples import piece_sample

pytest.importorskip("torch")
pytest.importorskip("megatron.core.datasets.gpt_dataset")

SEQ_LEN = 1024
MICRO_BATCHES = 4  # DP 1: the global batch
ITERATIONS = 6
SEED = 1234


@pytest.fixture(scope="module")
def labelled_corpus(tmp_path_factory):
    """A .bin/.idx whose every token names its document (document k holds tokens k + 1), heavy-tailed
    lengths, and a small config (seq_len 1024, N = 4, DP 1)."""
    from megatron_wlb.data.reader import write_indexed_dataset

    d = tmp_path_factory.mktemp("gpt")
    rng = np.random.default_rng(7)
    lengths = np.minimum(3000, rng.lognormal(5.5, 1.2, size=1500).astype(np.int64) + 1)
    write_indexed_dataset(str(d / "c"), [np.full(n, k + 1) for k, n in enumerate(lengths.tolist())])
    cfg = {"name": "tiny_1k", "model": "550m", "seq_len": SEQ_LEN, "layout": {"tp": 1, "cp": 1, "pp": 2, "dp": 1},
           "micro_batches": MICRO_BATCHES}
    (d / "tiny.yaml").write_text(yaml.safe_dump(cfg))
    return d


def _megatron_dataset(prefix: str, num_samples: int, cache: str):
    """megatron-core's train GPTDataset of ``prefix`` as pretrain_gpt.py builds it (not through our module)."""
    from megatron.core.datasets.blended_megatron_dataset_builder import BlendedMegatronDatasetBuilder
    from megatron.core.datasets.gpt_dataset import GPTDataset, GPTDatasetConfig
    from megatron.core.tokenizers.text.libraries.null_tokenizer import NullTokenizer

    config = GPTDatasetConfig(random_seed=SEED, sequence_length=SEQ_LEN, blend=([prefix], None), split="1,0,0",
                              path_to_cache=cache, tokenizer=NullTokenizer(1 << 17), reset_position_ids=True,
                              reset_attention_mask=True, eod_mask_loss=False, create_attention_mask=False)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        return BlendedMegatronDatasetBuilder(GPTDataset, [num_samples, 0, 0], lambda: True, config).build()[0]


def _sample_pieces(dataset, j: int) -> tuple[list[int], list[int]]:
    """(document ids, run lengths) of sample j's input tokens, read from its tokens (k + 1 = document k)."""
    tokens, doc_ids = dataset._query_document_sample_shuffle_indices(j)[:2]  # 0.19 adds per-document counts
    tokens = np.asarray(tokens[:SEQ_LEN], dtype=np.int64)
    edges = np.flatnonzero(np.diff(tokens)) + 1
    starts = np.concatenate([[0], edges])
    runs = np.diff(np.append(starts, SEQ_LEN))
    docs = (tokens[starts] - 1).tolist()
    assert docs == [int(x) for x in doc_ids][:len(docs)]  # the tokens name the documents GPTDataset says
    return docs, runs.tolist()


def _run_analyze(corpus, monkeypatch, extra: list[str] = ()) -> list[list]:
    """Run ``wlb analyze --data-prefix`` (one ordering); return every method's packed batches, in order."""
    import megatron_wlb.sim.iteration as iteration

    packed: list[list] = []
    real = iteration.packing_summary

    def record(batches, cost, seq_len=None):
        packed.append(list(batches))
        return real(batches, cost, seq_len)

    monkeypatch.setattr(iteration, "packing_summary", record)
    assert main(["analyze", "--data-prefix", str(corpus / "c"), "--config", str(corpus / "tiny.yaml"),
                 "--shuffles", "1", "--seed", str(SEED), "--iterations", str(ITERATIONS), "--virtual-stages", "1",
                 "--out", str(corpus / "out"), "--json", str(corpus / "v.json"), *extra]) == 0
    return packed


def test_baseline_and_balanced_train_gptdataset_samples(labelled_corpus, monkeypatch, capsys, tmp_path):
    from megatron_wlb.sim.experiments import ANALYZE_METHODS, BALANCED_CUT, PLAIN

    packed = _run_analyze(labelled_corpus, monkeypatch)
    assert len(packed) == len(ANALYZE_METHODS)
    names = [m.name for m in ANALYZE_METHODS]
    baseline, balanced = packed[names.index(PLAIN.name)], packed[names.index(BALANCED_CUT.name)]
    dataset = _megatron_dataset(str(labelled_corpus / "c"), ITERATIONS * MICRO_BATCHES, str(tmp_path))
    assert len(baseline) == ITERATIONS
    samples: dict[int, list[int]] = {}
    for i, batch in enumerate(baseline):  # each micro-batch is one sample, in the sampler's order
        for m, mb in enumerate(batch.micro_batches):
            j = i * MICRO_BATCHES + m
            _, runs = _sample_pieces(dataset, j)
            samples[j] = runs
            assert [piece_sample(p.doc_id, SEQ_LEN)[0] for p in mb.pieces] == [j] * len(runs)
            assert list(mb.lengths) == runs, (i, m)
    # the balanced one regroups those samples' pieces, never before the iteration the sampler gives them
    trained = []
    for batch in balanced:
        for p in batch.pieces():
            j, start = piece_sample(p.doc_id, SEQ_LEN)
            assert j // MICRO_BATCHES <= batch.iteration and p.arrival == j // MICRO_BATCHES
            trained.append((j, start, p.length))
    given = {(j, int(s), n) for j, runs in samples.items()
             for s, n in zip(np.cumsum([0, *runs[:-1]]).tolist(), runs)}
    assert set(trained) <= given and len(trained) == len(set(trained))
    assert sum(n for _, _, n in trained) >= 0.9 * ITERATIONS * MICRO_BATCHES * SEQ_LEN
    report = (labelled_corpus / "out" / "report.md").read_text()
    assert "train megatron-core's GPTDataset samples" in report
    assert "not GPTDataset's" not in capsys.readouterr().err


def test_without_megatron_core_one_line_says_the_order_differs(labelled_corpus, monkeypatch, capsys):
    monkeypatch.setitem(sys.modules, "megatron.core.datasets.gpt_dataset", None)  # import fails
    packed = _run_analyze(labelled_corpus, monkeypatch)
    err = [line for line in capsys.readouterr().err.splitlines() if "GPTDataset" in line]
    assert len(err) == 1 and "not Megatron GPTDataset's sample order" in err[0] and "megatron-core" in err[0]
    assert len(packed[0]) == ITERATIONS  # the reader's order still runs
    assert json.loads((labelled_corpus / "v.json").read_text())["iterations"] == ITERATIONS


def test_lengths_order_is_gptdatasets_own(labelled_corpus, tmp_path):
    """A bare lengths array gets the very indices megatron-core builds for a .bin/.idx of those documents."""
    from megatron_wlb.data.indexed import read_idx_lengths
    from megatron_wlb.megatron.data.sample_orders import LengthsDataset, gpt_sample_order

    lengths = read_idx_lengths(labelled_corpus / "c")
    order, _ = gpt_sample_order(np.asarray(lengths), SEQ_LEN, 50, SEED)
    dataset = _megatron_dataset(str(labelled_corpus / "c"), 50, str(tmp_path))
    for name in ("document_index", "sample_index", "shuffle_index"):
        assert np.array_equal(getattr(order.datasets[0], name), getattr(dataset, name)), name
    with pytest.raises(ValueError, match="non-empty 1-D array"):
        LengthsDataset(np.array([3, 0, 2]))
    with pytest.raises(ValueError, match="train split"):
        gpt_sample_order(np.asarray(lengths), SEQ_LEN, 50, SEED, split="0,1,0")
