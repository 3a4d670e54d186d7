"""The balanced concat-and-cut trains exactly what megatron-core's real GPTDataset gives (issue 30).

Every check runs megatron-core's own ``BlendedMegatronDatasetBuilder(GPTDataset, ...)`` over a real
``.bin/.idx`` (one dataset, and a 2-way blend) and compares what our iterators feed the model, DP rank
by DP rank, with what the stock job reads: ``dataset[j]`` for the samples ``MegatronPretrainingSampler``
gives each iteration (positions ``[i * global_batch, (i + 1) * global_batch)``).
"""

from __future__ import annotations

import types
import warnings
from collections import Counter

import numpy as np
import pytest

pytest.importorskip("torch")
pytest.importorskip("megatron.core.datasets.gpt_dataset")

from megatron_wlb.costmodel import AnalyticCostModel, ParallelLayout, get_model  # noqa: E402
from megatron_wlb.data.reader import write_indexed_dataset  # noqa: E402
from megatron_wlb.megatron.args.validation import masking_problem  # noqa: E402
from megatron_wlb.megatron.data.gpt_datasets import build_train_dataset  # noqa: E402
from megatron_wlb.megatron.data.gpt_samples import MegatronSamples, sample_order  # noqa: E402
from megatron_wlb.megatron.data.packed import WlbDataIterator  # noqa: E402
from megatron_wlb.packing import PackingConfig, make_packer  # noqa: E402

SEQ, GBS, DP = 256, 8, 2
COST = AnalyticCostModel(get_model("550m"), ParallelLayout())


def _tokenizer():
    from megatron.core.tokenizers.text.libraries.null_tokenizer import NullTokenizer

    return NullTokenizer(300)  # eod 299


def _corpus(prefix: str, count: int, seed: int, eod: int) -> None:
    """Heavy-tailed documents of byte tokens, each ending with the tokenizer's EOD (as preprocess_data.py
    --append-eod writes them)."""
    rng = np.random.default_rng(seed)
    docs = []
    for _ in range(count):
        n = int(min(4 * SEQ, rng.pareto(1.1) * 40 + 2))
        doc = rng.integers(0, 256, n)
        doc[-1] = eod
        docs.append(doc)
    write_indexed_dataset(prefix, docs)


@pytest.fixture(scope="module")
def corpora(tmp_path_factory):
    root = tmp_path_factory.mktemp("gptdataset")
    eod = _tokenizer().eod
    _corpus(str(root / "a"), 700, 1, eod)
    _corpus(str(root / "b"), 500, 2, eod)
    return root


def _args(root, blend: bool, **flags):
    data = ["0.3", str(root / "a"), "0.7", str(root / "b")] if blend else [str(root / "a")]
    values = dict(seed=1234, seq_length=SEQ, data_path=data, split="98,2,0", data_cache_path=str(root / "cache"),
                  mmap_bin_files=True, reset_position_ids=True, reset_attention_mask=True, eod_mask_loss=False,
                  data_args_path=None, per_split_data_args_path=None, train_data_path=None, valid_data_path=None,
                  test_data_path=None, global_batch_size=GBS, eval_iters=0, train_samples=None,
                  tensor_model_parallel_size=1, sequence_parallel=False, context_parallel_size=1,
                  data_parallel_size=DP)
    values.update(flags)
    return types.SimpleNamespace(**values)


def _dataset(args, iterations: int):
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        return build_train_dataset(args, _tokenizer(), (iterations * GBS, 0, 0))


def _iterators(samples: MegatronSamples, first: int = 0, **knobs):
    config = PackingConfig(seq_len=SEQ, n=GBS // DP, dp=DP, pieces="concat-and-cut", read_ahead=False, **knobs)
    return [WlbDataIterator(None, samples.stream(first), make_packer("wlb", config, COST), r, read_piece=samples.piece)
            for r in range(DP)]


def _stock_pieces(samples: MegatronSamples, first: int, stop: int) -> dict[int, tuple[int, tuple]]:
    """The stock job's pieces of samples [first, stop): stream id -> (GPTDataset's iteration, its arrays)."""
    out = {}
    for j in range(first, stop):
        tokens, labels, loss_mask, positions = samples.sample(j)
        starts = np.flatnonzero(positions == 0)
        for a, b in zip(starts, np.append(starts[1:], SEQ)):
            out[j * SEQ + int(a)] = (j // GBS, (tokens[a:b], labels[a:b], loss_mask[a:b]))
    return out


def _train(iterators, iterations: int, offset: int = 0) -> dict[int, tuple[int, tuple]]:
    """What every DP rank's iterator feeds the model over ``iterations``: stream id -> (iteration, arrays)."""
    fed: dict[int, tuple[int, tuple]] = {}
    start = [it.packer.iteration for it in iterators]
    for i in range(iterations):
        for it in iterators:
            for _ in range(it.n):
                mb = it.produce()
                assert it.iteration == start[0] + i and it.packer.iteration == start[0] + i + 1
                at = 0
                for p in mb.micro_batch.pieces:
                    rows = slice(at, at + p.length)
                    assert np.array_equal(mb.position_ids[0, rows], np.arange(p.length))  # restart per piece
                    assert p.doc_id not in fed, f"piece {p.doc_id} trained twice"
                    fed[p.doc_id] = (offset + i, (mb.tokens[0, rows], mb.labels[0, rows], mb.loss_mask[0, rows]))
                    at += p.length
                assert not mb.loss_mask[0, at:].any()  # padding trains nothing
    return fed


@pytest.mark.parametrize("blend", [False, True], ids=["one-dataset", "blend"])
@pytest.mark.parametrize("epochs", [0.5, 1.0, 1.5, 1.9])
def test_balanced_trains_gptdatasets_samples(corpora, blend, epochs):
    probe = _dataset(_args(corpora, blend), 1)
    per_epoch = len(probe) if not blend else sum(len(d) for d in probe.datasets)  # samples in one pass (about)
    iterations = max(2, int(round(epochs * per_epoch / GBS)))
    samples = MegatronSamples(_dataset(_args(corpora, blend), iterations))
    stock = _stock_pieces(samples, 0, iterations * GBS)
    its = _iterators(samples)
    fed = _train(its, iterations)
    max_delay = its[0].packer.config.max_delay

    waiting = set(stock) - set(fed)
    assert set(fed) <= set(stock), "a piece of a sample Megatron gives later (or never) was trained"
    assert len(waiting) <= GBS * max_delay, f"{len(waiting)} of {len(stock)} pieces still wait at the end"
    # the waiting ones are what the packer holds, and they wait within the delay bound
    assert sum(stock[k][1][0].size for k in waiting) == its[0].packer.pending()
    assert all(stock[k][0] >= iterations - 1 - max_delay for k in waiting)
    for k, (i, arrays) in fed.items():
        given, expected = stock[k]
        assert given <= i <= given + max_delay, f"piece {k}: Megatron gives it at {given}, trained at {i}"
        for ours, theirs in zip(arrays, expected):
            assert np.array_equal(ours, theirs), f"piece {k} differs from Megatron's sample"
    # the same (input, label) pairs and attention work as the stock job over the same samples
    pairs = Counter((int(t), int(lab)) for _, (tok, labs, mask) in fed.values()
                    for t, lab, m in zip(tok, labs, mask) if m)
    expected_pairs = Counter((int(t), int(lab)) for k, (_, (tok, labs, mask)) in stock.items() if k not in waiting
                             for t, lab, m in zip(tok, labs, mask) if m)
    assert pairs == expected_pairs
    attention = sum(a[0].size * (a[0].size + 1) // 2 for _, a in fed.values())
    assert attention == sum(a[0].size * (a[0].size + 1) // 2 for k, (_, a) in stock.items() if k not in waiting)
    if blend:  # every sample is one dataset's own window (BlendedDataset), so every piece is
        order = sample_order(samples.dataset)
        counts, datasets, *_ = order.document_pieces(np.arange(iterations * GBS))
        owner = np.repeat(np.arange(counts.size), counts)
        assert all(np.unique(datasets[owner == j]).size == 1 for j in range(counts.size))


def test_window_edge_labels_and_eod_loss_mask_are_megatrons(corpora):
    """The last input of a window predicts the window's next token (GPTDataset reads S + 1 tokens); with
    --eod-mask-loss an EOD input trains nothing; both as Megatron's own sample has them."""
    args = _args(corpora, False, eod_mask_loss=True)
    samples = MegatronSamples(_dataset(args, 20))
    fed = _train(_iterators(samples), 20)
    eod = _tokenizer().eod
    edges = 0
    for k, (_, (tokens, labels, mask)) in fed.items():
        j, start = divmod(k, SEQ)
        text = samples.dataset._query_document_sample_shuffle_indices(j)[0]
        assert np.array_equal(labels, text[start + 1:start + 1 + tokens.size])  # the next token of the window
        assert np.array_equal(mask == 0, tokens == eod)
        edges += start + tokens.size == SEQ and tokens[-1] != eod
    assert edges > 0 and all(mask[-1] == 1 for k, (_, (t, _, mask)) in fed.items()
                             if k % SEQ + t.size == SEQ and t[-1] != eod)


def test_inter_document_masking_cuts_at_gptdatasets_own_boundaries(corpora):
    """--dataloader-inter-document-masking: pieces at GPTDataset's cu_seqlens, which equal the document
    pieces of its index arrays."""
    args = _args(corpora, False, reset_position_ids=False, reset_attention_mask=False,
                 dataloader_inter_document_masking=True)
    samples = MegatronSamples(_dataset(args, 10))
    positions = np.arange(10 * GBS)
    counts, lengths = samples.segments(positions)
    assert (counts, lengths) == tuple(map(np.asarray, (counts, lengths)))
    order_counts, order_lengths = sample_order(samples.dataset).segments(positions)
    assert np.array_equal(counts, order_counts) and np.array_equal(lengths, order_lengths)
    # planning then reads no sample: the stream cuts from the index arrays, to the same pieces
    cursor = samples.stream(0).cursor()
    assert np.array_equal(cursor.window(0, lengths.size)[0], lengths)
    assert cursor.segment != samples.segments
    for j in positions[:20]:
        cu = samples.dataset[int(j)]["cu_seqlens"].numpy()
        cu = cu[:int(np.flatnonzero(cu == SEQ)[0]) + 1]
        at = int(np.sum(counts[:j]))
        assert np.array_equal(np.diff(cu), lengths[at:at + counts[j]])


def test_a_corpus_without_the_tokenizers_eod_is_named(corpora, tmp_path):
    from megatron_wlb.megatron.data.gpt_samples import eod_problem

    assert eod_problem(_dataset(_args(corpora, True), 2)) is None
    _corpus(str(tmp_path / "b"), 300, 3, 256)  # ends its documents with 256, the tokenizer's EOD is 299
    mixed = types.SimpleNamespace(**{**vars(_args(corpora, True)), "data_path": [
        "0.3", str(corpora / "a"), "0.7", str(tmp_path / "b")], "data_cache_path": str(tmp_path / "cache")})
    problem = eod_problem(_dataset(mixed, 2))
    assert problem is not None and "EOD id 299" in problem and str(tmp_path / "b") in problem
    assert "none of" in problem and "last ids: 256" in problem and "\n" not in problem
    # issue 49 (9): a corpus where only document 0 ends with the EOD passed (any hit among the samples was taken)
    rng = np.random.default_rng(5)
    docs = [rng.integers(0, 256, int(n)) for n in rng.integers(20, 400, 2000)]
    docs[0][-1] = _tokenizer().eod
    write_indexed_dataset(str(tmp_path / "c"), docs)
    one = types.SimpleNamespace(**{**vars(_args(corpora, False)), "data_path": [str(tmp_path / "c")],
                                   "data_cache_path": str(tmp_path / "cache")})
    problem = eod_problem(_dataset(one, 2))
    assert problem is not None and "only 1 of 64 sampled documents" in problem, problem


def test_a_job_that_attends_across_documents_is_refused(corpora):
    assert "--reset-attention-mask" in masking_problem(_args(corpora, False, reset_position_ids=False,
                                                             reset_attention_mask=False))
    assert "--reset-position-ids" in masking_problem(_args(corpora, False, reset_position_ids=False))
    assert masking_problem(_args(corpora, False)) is None
    import argparse

    from megatron_wlb.megatron.args.flags import add_wlb_args
    from megatron_wlb.megatron.args.validation import validate_wlb_args

    parser = argparse.ArgumentParser()
    add_wlb_args(parser)
    args = parser.parse_args(["--wlb-pieces", "concat-and-cut"])
    for k, v in vars(_args(corpora, False, reset_position_ids=False, reset_attention_mask=False)).items():
        setattr(args, k, v)
    args.micro_batch_size, args.pipeline_model_parallel_size = 1, 1
    with pytest.raises(ValueError) as err:
        validate_wlb_args(args, check_files=False)
    problem = [line for line in str(err.value).splitlines() if "attends across documents" in line]
    assert len(problem) == 1 and "--dataloader-inter-document-masking" in problem[0]


def test_resume_from_a_checkpoint_of_either_kind(corpora):
    """A balanced checkpoint resumes exactly (its saved sample and piece); a stock one (consumed samples
    only) continues with Megatron's next sample and trains every piece of it once."""
    samples = MegatronSamples(_dataset(_args(corpora, False), 30))
    whole = _train(_iterators(samples), 30)
    first = _iterators(samples)
    head = _train(first, 12)
    state = first[0].state_dict()
    assert state["stream_digest"].startswith("samples:")
    again = _iterators(samples)
    for it in again:
        it.load_state_dict(state)
    tail = _train(again, 18, offset=12)
    assert {**head, **tail}.keys() == whole.keys()
    assert all(whole[k][0] == v[0] for k, v in {**head, **tail}.items())
    # a stock checkpoint at iteration 12: Megatron consumed 12 * GBS samples
    stock = _iterators(samples, first=12 * GBS)
    fed = _train(stock, 18, offset=12)
    expected = _stock_pieces(samples, 12 * GBS, 30 * GBS)
    assert set(fed) <= set(expected) and len(expected) - len(fed) == sum(1 for k in expected if k not in fed)
    assert sum(expected[k][1][0].size for k in set(expected) - set(fed)) == stock[0].packer.pending()
    with pytest.raises(ValueError, match=r"--train-samples need change\): resume with the saved flags, or pass "
                                         r"--wlb-reset-data-stream"):
        other = MegatronSamples(_dataset(_args(corpora, True), 30))
        _iterators(other)[0].load_state_dict(state)


def test_a_sample_token_beyond_the_vocabulary_stops_the_run_in_one_line(corpora):
    """Issue 57 (6): the CPU harness no longer reads the whole corpus to size the vocabulary, so a token id beyond
    it is met when Megatron's sample is read: one line naming the sample, the id and the --vocab-size that
    covers it, never an IndexError in the embedding."""
    from megatron_wlb.megatron.args.validation import RunRefusal

    dataset = _dataset(_args(corpora, False), 4)
    top = max(int(MegatronSamples(dataset).sample(j)[0].max()) for j in range(GBS))
    with pytest.raises(RunRefusal) as caught:
        _train(_iterators(MegatronSamples(dataset, vocab_size=200)), 4)
    message = str(caught.value)
    assert "\n" not in message and message.startswith("megatron_wlb: iteration 0: Megatron's sample ")
    assert "is outside the model's vocabulary of 200 (ids 0..199): set --vocab-size / the tokenizer to at least" \
        in message
    fed = _train(_iterators(MegatronSamples(dataset, vocab_size=top + 1)), 1)  # the vocabulary that covers it
    assert fed
