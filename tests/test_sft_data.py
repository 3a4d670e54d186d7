"""The SFT intake gives every conversation exactly what Megatron's own ``SFTDataset`` gives it (issue 50).

Megatron-LM's ``SFTDataset`` (the 0.19.2 wheel's ``megatron/training/datasets/sft_dataset.py``) runs here
over a jsonl of conversations with a tokenizer and chat template built locally (``sft_fixtures``), through
Megatron's own ``SFTTokenizer`` (``build_tokenizer`` for ``--tokenizer-type SFTTokenizer``). Its low-level
dataset is the file's lines' ``"messages"`` (``SFTLowLevelDataset`` reads the same through HF ``datasets``,
which is not installed here).
"""

from __future__ import annotations

import json
import warnings
from pathlib import Path

import numpy as np
import pytest

pytest.importorskip("torch")
pytest.importorskip("transformers")
pytest.importorskip("megatron.core.tokenizers.text.libraries.sft_tokenizer")

import sft_fixtures as F  # noqa: E402

from megatron_wlb.data.sft import (  # noqa: E402
    IGNORE_INDEX,
    SftCorpus,
    SftInputError,
    jsonl_lengths,
    split_conversations,
)

SEQ = 256


@pytest.fixture(scope="module")
def sft(tmp_path_factory):
    root = tmp_path_factory.mktemp("sft")
    F.build_tokenizer(root / "tok")
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        tokenizer = F.megatron_sft_tokenizer(root / "tok")
    path = F.write_corpus(root / "chat.jsonl", 120, seed=3, scale=1.5)
    return root, tokenizer, path


def _sft_dataset(lines: list[list[dict]], tokenizer, seq: int = SEQ, cp: int = 1):
    """Megatron's own SFTDataset over ``lines`` (each a line's messages), one sample a line."""
    from megatron_wlb.megatron.args.compat import install_python_shims

    install_python_shims()  # the 0.19 wheel's megatron.training needs typing.override
    from megatron.core.datasets.gpt_dataset import GPTDatasetConfig
    from megatron.core.datasets.utils import Split
    from megatron.training.datasets.sft_dataset import SFTDataset

    config = GPTDatasetConfig(random_seed=1234, sequence_length=seq, blend=None, blend_per_split=None, split="100,0,0",
                              path_to_cache=None, tokenizer=tokenizer, reset_position_ids=False,
                              reset_attention_mask=False, eod_mask_loss=False, create_attention_mask=False,
                              context_parallel_size=cp)
    return SFTDataset(lines, "chat.jsonl", np.arange(len(lines)), len(lines), Split.train, config)


def _lines(path: Path) -> list[list[dict]]:
    return [json.loads(t)["messages"] for t in open(path) if t.strip()]


def test_split_conversations_is_megatrons(sft):
    from megatron_wlb.megatron.args.compat import install_python_shims

    install_python_shims()
    from megatron.training.datasets.sft_dataset import SFTDataset

    _, _, path = sft
    for messages in _lines(path):
        assert split_conversations(messages) == SFTDataset._split_conversations(None, messages)


@pytest.mark.parametrize("seq", [SEQ, 64], ids=["fits", "cut"])
def test_every_conversation_equals_sftdatasets_sample(sft, seq):
    """``samples="whole"``: each conversation is SFTDataset's sample of a line holding it alone: inputs, labels
    and loss mask equal element by element (the long ones cut to the window as SFTDataset cuts them, and
    counted)."""
    _, tokenizer, path = sft
    conversations = [c for m in _lines(path) for c in split_conversations(m)]
    corpus = SftCorpus.build(path, tokenizer, seq, samples="whole")
    dataset = _sft_dataset(conversations, tokenizer, seq)
    assert corpus.num_documents == len(conversations) == len(dataset)
    for doc in range(corpus.num_documents):
        tokens, labels, mask = corpus.sample(doc)
        item = dataset[doc]
        n = tokens.size
        assert n <= seq
        np.testing.assert_array_equal(tokens, item["tokens"][:n].numpy())
        np.testing.assert_array_equal(labels, item["labels"][:n].numpy())
        np.testing.assert_array_equal(mask, item["loss_mask"][:n].numpy())
        np.testing.assert_array_equal(np.arange(n), item["position_ids"][:n].numpy())
        assert not item["loss_mask"][n:].any()  # the rest of SFTDataset's window is padding
        assert (labels == IGNORE_INDEX).any()  # prompts masked
        assert mask.any() or n == seq  # replies trained (a cut one may have lost its reply)
    uncut = jsonl_lengths(path, tokenizer)
    assert corpus.counts.cut == int((uncut > seq).sum()) > 0
    assert corpus.counts.untrained_tokens == int((uncut[uncut > seq] - seq).sum())
    assert "cut to it" in corpus.note()


# -- bad input: one line naming the line or the missing piece -----------------------------------------------
@pytest.mark.parametrize("text, named", [
    ('{"messages": [{"role": "user", "content": "w1"}, {"role": "assistant", "content": "w2"}]}\n{"messages": [\n',
     ":2: not JSON"),
    ('{"messages": [{"role": "user", "content": "w1"}, {"role": "assistant", "content": "w2"}]}\n\n{"text": "w1"}\n',
     ':3: no "messages" key'),
    ('{"messages": [{"role": "system", "content": "w1"}, {"role": "user", "content": "w2"}, '
     '{"role": "assistant", "content": "w3"}, {"role": "system", "content": "w4"}, '
     '{"role": "user", "content": "w5"}]}\n',
     ":1: conversation 2 has no assistant turn (roles: system, user)"),
    ('{"messages": [{"role": "user", "content": "w1"}, {"role": "bot", "content": "w2"}]}\n', ":1: message 2 has role"),
    # issue 57: roles as Megatron's templates spell them; an orphan assistant turn; the first conversation's line
    ('{"messages": [{"role": "User", "content": "w1"}, {"role": "Assistant", "content": "w2"}]}\n',
     ":1: message 1 has role 'User'; use one of system, user, assistant, tool (lowercase"),
    ('\n{"messages": [{"role": "system", "content": "w1"}, {"role": "assistant", "content": "w2"}]}\n',
     ":2 conversation 1: message 2 is an assistant turn that follows no user or tool turn"),
])
def test_bad_jsonl_is_one_line_naming_the_line(sft, tmp_path, text, named):
    _, tokenizer, _ = sft
    bad = tmp_path / "bad.jsonl"
    bad.write_text(text)
    with pytest.raises(SftInputError) as err:
        SftCorpus.build(bad, tokenizer, SEQ)
    assert named in str(err.value) and str(bad) in str(err.value) and "\n" not in str(err.value)


def test_a_tokenizer_without_a_chat_template_is_named(sft, tmp_path):
    root, _, path = sft
    F.build_tokenizer(tmp_path / "plain", chat_template=None)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        plain = F.megatron_sft_tokenizer(tmp_path / "plain", prompt_format="default")
    with pytest.raises(SftInputError) as err:
        SftCorpus.build(path, plain, SEQ)
    assert "no chat template" in str(err.value) and "\n" not in str(err.value)
    # the same tokenizer with its own template trains every token (Megatron's default format)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        own = F.megatron_sft_tokenizer(root / "tok", prompt_format="default")
    corpus = SftCorpus.build(path, own, SEQ)
    assert corpus.num_documents > 100


def test_sft_flags_wlb_cannot_honour_are_one_line_each(tmp_path):
    import types

    from megatron_wlb.megatron.args.settings import WlbSettings
    from megatron_wlb.megatron.args.validation import sft_problems

    jsonl = tmp_path / "c.jsonl"
    jsonl.write_text("")
    args = types.SimpleNamespace(sft=True, tokenizer_type="SFTTokenizer", seq_length=SEQ, data_path=[str(jsonl)],
                                 train_data_path=None, valid_data_path=None, test_data_path=None)
    assert sft_problems(args, WlbSettings()) == []
    args.tokenizer_type, args.data_path = "NullTokenizer", [str(tmp_path / "missing.jsonl")]
    problems = sft_problems(args, WlbSettings(pieces="concat-and-cut", cut="any"))
    assert len(problems) == 4 and all("\n" not in p for p in problems)
    assert any("--tokenizer-type SFTTokenizer" in p for p in problems)
    assert any("--wlb-pieces documents" in p for p in problems)
    assert any("packing.cut split" in p for p in problems)
    assert any("missing.jsonl: no such file" in p for p in problems)


def test_mains_tokenizer_where_it_differs_is_what_the_intake_gives(sft, tmp_path):
    """Main's SFTTokenizer masks the prompts under the ``identity`` prompt format too (0.19 trains every token
    there); the intake calls the tokenizer's own ``tokenize_conversation``, so it follows whichever is run."""
    import importlib.util
    import os
    import subprocess

    from conftest import DEFAULT_MEGATRON_LM, MEGATRON_LM_VAR

    source = os.environ.get(MEGATRON_LM_VAR) or DEFAULT_MEGATRON_LM
    got = subprocess.run(["git", "-C", source, "show", "main:megatron/core/tokenizers/text/libraries/sft_tokenizer.py"],
                         capture_output=True, text=True)
    if got.returncode:
        pytest.skip(f"no Megatron-LM main at {source} (set {MEGATRON_LM_VAR})")
    (tmp_path / "main_sft_tokenizer.py").write_text(got.stdout)
    spec = importlib.util.spec_from_file_location("main_sft_tokenizer", tmp_path / "main_sft_tokenizer.py")
    main_module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(main_module)
    from megatron.core.tokenizers.text.libraries.sft_tokenizer import SFTTokenizer as Release

    root, _, _ = sft
    path = tmp_path / "spaced.jsonl"
    turns = [{"role": "system", "content": "w1 w2 "}, {"role": "user", "content": "w3 w4 w5 "},
             {"role": "assistant", "content": "w6 w7 "}]
    path.write_text(json.dumps({"messages": turns}) + "\n")

    class Pad:  # the raw SFTTokenizer names its pad ``pad_id`` (Megatron's wrapper says ``pad``)
        def __init__(self, inner):
            self.inner, self.pad = inner, inner.pad_id

        def tokenize_conversation(self, *args, **kwargs):
            return self.inner.tokenize_conversation(*args, **kwargs)

    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        release = SftCorpus.build(path, Pad(Release(str(root / "tok"), "identity")), SEQ)
        main = SftCorpus.build(path, Pad(main_module.SFTTokenizer(str(root / "tok"), "identity")), SEQ)
    np.testing.assert_array_equal(release.tokens, main.tokens)
    assert not (release.labels == IGNORE_INDEX).any()  # 0.19: every token trained
    assert (main.labels[:4] == IGNORE_INDEX).all() and (main.labels[4:] != IGNORE_INDEX).all()  # main: the reply


def test_sft_reader_splits_blends_and_reads_each_piece_with_its_own_labels(sft, tmp_path):
    """The conversations of a weighted blend of two jsonl files through the training reader: train and valid
    splits disjoint, every stream id (past the first epoch too) read as its conversation's SFTDataset arrays."""
    import types

    from megatron_wlb.megatron.data.sft import sft_reader

    _, tokenizer, path = sft
    other = F.write_corpus(tmp_path / "other.jsonl", 40, seed=9)
    args = types.SimpleNamespace(sft=True, seq_length=SEQ, seed=1234, split="90,10,0",
                                 data_path=["0.7", str(path), "0.3", str(other)], train_data_path=None,
                                 valid_data_path=None, test_data_path=None)
    notes: list[str] = []
    train_reader, read_piece = sft_reader(args, "train", tokenizer, print_fn=notes.append)
    valid_reader, _ = sft_reader(args, "valid", tokenizer)
    corpora = [SftCorpus.build(p, tokenizer, SEQ) for p in (path, other)]
    # split by lines, as Megatron splits SFTDataset: train holds the first 90% of each file's lines
    firsts = [c.source("90,10,0", "train")[1] for c in corpora]
    valid_firsts = [c.source("90,10,0", "valid")[1] for c in corpora]
    assert firsts == [0, 0] and all(v == int(c.arrays.lines[round(0.9 * c.num_lines)])
                                    for v, c in zip(valid_firsts, corpora, strict=True))
    assert train_reader.num_documents == sum(valid_firsts)
    ids, lengths = train_reader.stream(3 * sum(int(c.lengths.sum()) for c in corpora)).collect()
    valid_ids, _ = valid_reader.stream(10_000).collect()
    train_docs = {(w, d) for w, d in (train_reader.locate(int(i))[1:] for i in ids)}
    valid_docs = {(w, valid_firsts[w] + d) for w, d in (valid_reader.locate(int(i))[1:] for i in valid_ids)}
    assert train_docs and valid_docs and not train_docs & valid_docs
    assert int(ids.max()) >= train_reader.num_documents  # a later epoch
    for stream_id, n in zip(ids.tolist(), lengths.tolist(), strict=True):
        _, which, doc = train_reader.locate(stream_id)
        want = corpora[which].sample(doc)
        got = read_piece(stream_id, 0, n)
        for a, b in zip(got, want, strict=True):
            np.testing.assert_array_equal(a, b)
    assert any("dropped after it" in line for line in notes)


# -- issue 58: SFTDataset's own samples, multi-conversation lines, every prompt format, CP 1 and 2 -------------
#: every prompt format megatron-core 0.19's SFTTokenizer ships
PROMPT_FORMATS = ("nemotron-nano-v2", "nemotron-h-aligned", "identity", "default")


def _multi_corpus(path: Path, lines: int, seed: int) -> Path:
    """Lines of 1-5 conversations each (SFTDataset splits them at each system turn), some over the window."""
    rng = np.random.default_rng(seed)
    with open(path, "w") as f:
        for _ in range(lines):
            messages = [t for _ in range(int(rng.integers(1, 6))) for t in F.conversation(rng, 1.0)]
            f.write(json.dumps({"messages": messages}) + "\n")
    return path


@pytest.fixture(scope="module")
def multi(tmp_path_factory):
    root = tmp_path_factory.mktemp("multi")
    F.build_tokenizer(root / "tok")
    return root, _multi_corpus(root / "multi.jsonl", 60, seed=11)


@pytest.mark.parametrize("cp", [1, 2], ids=["cp1", "cp2"])
@pytest.mark.parametrize("fmt", PROMPT_FORMATS)
def test_documents_are_sftdatasets_samples_line_by_line(multi, fmt, cp):
    """Megatron's own SFTDataset over the jsonl's lines (one sample a line): our documents of each line, side by
    side, are its sample's inputs, labels and loss mask (the cross-conversation label, the cut and dropped
    conversations included), its cu_seqlens their bounds; what follows is its masked padding."""
    root, path = multi
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        tokenizer = F.megatron_sft_tokenizer(root / "tok", prompt_format=fmt)
    seq = 96
    corpus = SftCorpus.build(path, tokenizer, seq, context_parallel=cp)
    lines = _lines(path)
    dataset = _sft_dataset(lines, tokenizer, seq, cp=cp)
    assert corpus.num_lines == len(lines)
    crossing = 0
    for line in range(len(lines)):
        item = dataset[line]
        a, b = int(corpus.arrays.lines[line]), int(corpus.arrays.lines[line + 1])
        got = [corpus.sample(doc) for doc in range(a, b)]
        tokens, labels, mask = (np.concatenate([g[i] for g in got]) for i in range(3))
        n = tokens.size
        np.testing.assert_array_equal(tokens, item["tokens"][:n].numpy())
        np.testing.assert_array_equal(labels, item["labels"][:n].numpy())
        np.testing.assert_array_equal(mask, item["loss_mask"][:n].numpy())
        assert not item["loss_mask"][n:].any()
        cu = item["cu_seqlens"].numpy()
        bounds = np.concatenate([[0], np.cumsum([g[0].size for g in got])])
        np.testing.assert_array_equal(bounds[:-1], cu[:b - a])
        for _, _, msk in got[:-1]:
            crossing += int(msk[-1] == 1)  # a conversation's last label: the next one's first token, trained
    c = corpus.counts
    assert c.cut > 0 and c.dropped > 0 and c.conversations == sum(len(split_conversations(m)) for m in lines)
    if fmt in ("identity", "default") and cp == 1:
        assert crossing > 0
    assert "dropped after it" in corpus.note()


def test_whole_conversations_are_a_named_choice_counted(multi):
    root, path = multi
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        tokenizer = F.megatron_sft_tokenizer(root / "tok", prompt_format="identity")
    whole = SftCorpus.build(path, tokenizer, 96, samples="whole")
    conversations = [c for m in _lines(path) for c in split_conversations(m)]
    assert whole.num_documents == len(conversations) == whole.counts.conversations
    assert whole.counts.dropped == 0 and whole.counts.cut > 0
    for doc in range(whole.num_documents):
        assert whole.sample(doc)[2][-1] == 0  # each conversation's last label is the pad
    assert "sft.samples whole" in whole.note()


@pytest.mark.parametrize("layout", ["per-sequence", "per-document", "adaptive"])
def test_cp2_shards_gather_back_to_sftdatasets_samples(multi, layout):
    """CP 2: the documents of several lines packed into one micro-batch and sharded over 2 CP ranks by our
    layouts; the ranks' rows gathered back are SFTDataset's samples' inputs, labels, loss masks and positions,
    each token on exactly one rank."""
    from megatron_wlb.cp.plan import CPSharding, rank_batch

    root, path = multi
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        tokenizer = F.megatron_sft_tokenizer(root / "tok", prompt_format="identity")
    seq, cp, lines = 96, 2, 8
    corpus = SftCorpus.build(path, tokenizer, seq, context_parallel=cp)
    dataset = _sft_dataset(_lines(path), tokenizer, seq, cp=cp)
    docs = range(int(corpus.arrays.lines[0]), int(corpus.arrays.lines[lines]))
    lengths = np.asarray([int(corpus.lengths[d]) for d in docs])
    packed = tuple(np.concatenate([corpus.sample(d)[i] for d in docs]) for i in range(3))
    want = {"tokens": [], "labels": [], "loss_mask": [], "position_ids": []}
    for line in range(lines):
        item = dataset[line]
        n = int(sum(int(corpus.lengths[d]) for d in range(int(corpus.arrays.lines[line]),
                                                           int(corpus.arrays.lines[line + 1]))))
        for key in want:
            want[key].append(item[key][:n].numpy())
    size = int(lengths.sum())
    got = [np.full(size, -7, dtype=np.float64) for _ in range(4)]
    seen = np.zeros(size, dtype=np.int64)
    for rank in range(cp):
        batch = rank_batch(lengths, CPSharding(layout, cp, rank, sequence_multiple=2 * cp), packed=packed)
        rows = batch.rows
        real = rows >= 0
        seen[rows[real]] += 1
        for k, values in enumerate((batch.tokens, batch.labels, batch.loss_mask, batch.position_ids)):
            got[k][rows[real]] = values[0][real]
    assert (seen == 1).all()
    for k, key in enumerate(want):
        np.testing.assert_array_equal(got[k], np.concatenate(want[key]).astype(np.float64), err_msg=key)
