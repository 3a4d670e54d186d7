"""The tokenized SFT cache (issue 50, scale): built once, reused, rebuilt when the jsonl changes, refused
when damaged, built by one of the processes starting together.

The data layer takes any tokenizer with Megatron's ``tokenize_conversation`` and ``pad``; here a word-level
one counts its calls (that the cache is equal to Megatron's ``SFTDataset`` is ``test_sft_data``'s check,
through Megatron's own ``SFTTokenizer``).
"""

from __future__ import annotations

import json
import os
import threading
from pathlib import Path

import numpy as np
import pytest

from megatron_wlb.data.indexed import read_index
from megatron_wlb.data.sft import IGNORE_INDEX, SftCorpus
from megatron_wlb.data.sft_cache import SftCacheError

SEQ = 64


class CountingTokenizer:
    """Words ``w<i>`` -> id i + 10; each turn starts with its role's id; only assistant turns are targets."""

    pad = 0
    roles = {"system": 1, "user": 2, "assistant": 3, "tool": 4}

    def __init__(self, offset: int = 10) -> None:
        self.calls, self.offset = 0, offset
        self.lock = threading.Lock()

    def tokenize_conversation(self, conversation, return_target, add_generation_prompt):
        with self.lock:
            self.calls += 1
        tokens: list[int] = []
        targets: list[int] = []
        for message in conversation:
            ids = [self.roles[message["role"]]] + [self.offset + int(w[1:]) if w[1:].isdigit() else 5
                                                   for w in message["content"].split()]
            tokens += ids
            targets += ids if message["role"] == "assistant" else [IGNORE_INDEX] * len(ids)
        return np.asarray(tokens), np.asarray(targets)


def _write(path: Path, conversations: int, seed: int = 0) -> Path:
    rng = np.random.default_rng(seed)
    with open(path, "w") as f:
        for _ in range(conversations):
            turns = [{"role": "system", "content": "w1"},
                     {"role": "user", "content": " ".join(f"w{i}" for i in rng.integers(0, 50, rng.integers(1, 30)))},
                     {"role": "assistant", "content": " ".join(f"w{i}" for i in rng.integers(0, 50,
                                                                                             rng.integers(1, 60)))}]
            f.write(json.dumps({"messages": turns}) + "\n")
    return path


def _expected(path: Path, tokenizer: CountingTokenizer) -> list[tuple[np.ndarray, np.ndarray]]:
    out = []
    for text in open(path):
        tokens, targets = tokenizer.tokenize_conversation(json.loads(text)["messages"], True, False)
        out.append((tokens[:SEQ], targets[:SEQ]))
    return out


def _cache_files(directory: Path) -> list[Path]:
    return sorted(p for p in directory.iterdir() if p.suffix in (".bin", ".idx", ".json"))


def test_the_cache_is_built_once_then_mapped_without_tokenizing(tmp_path):
    jsonl = _write(tmp_path / "chat.jsonl", 200)
    tokenizer = CountingTokenizer()
    first = SftCorpus.build(jsonl, tokenizer, SEQ)
    assert first.built and tokenizer.calls > 200
    files = _cache_files(tmp_path / "cache")
    assert [p.name.split(".", 1)[1] for p in files] == ["json", "labels.bin", "labels.idx", "lines.bin",
                                                        "tokens.bin", "tokens.idx"]
    mtimes = [p.stat().st_mtime_ns for p in files]
    tokenizer.calls = 0
    again = SftCorpus.build(jsonl, tokenizer, SEQ)
    assert not again.built and tokenizer.calls <= 2  # the identity probe and the first conversation
    assert [p.stat().st_mtime_ns for p in _cache_files(tmp_path / "cache")] == mtimes
    # lengths come from the mapped .idx (Megatron's layout), each conversation's arrays from the mapped .bin
    assert isinstance(again.tokens, np.memmap) and again.lengths.base is not None
    idx = read_index(str(files[-1].with_suffix("")))
    np.testing.assert_array_equal(idx.sequence_lengths, again.lengths)
    expected = _expected(jsonl, tokenizer)
    assert again.num_documents == len(expected)
    truncated = sum(len(t) == SEQ for t, _ in expected)
    for doc, (tokens, targets) in enumerate(expected):
        got_tokens, labels, mask = again.sample(doc)
        np.testing.assert_array_equal(got_tokens, tokens)
        np.testing.assert_array_equal(labels, np.append(targets[1:], 0))
        np.testing.assert_array_equal(mask, (np.append(targets[1:], 0) > 0).astype(np.float32))
    assert again.counts.cut == first.counts.cut <= truncated
    # another window is another cache (beside the first)
    SftCorpus.build(jsonl, tokenizer, SEQ // 2)
    assert len(_cache_files(tmp_path / "cache")) == 12


def test_a_changed_jsonl_rebuilds_the_cache_and_says_so(tmp_path):
    jsonl = _write(tmp_path / "chat.jsonl", 50)
    tokenizer = CountingTokenizer()
    before = SftCorpus.build(jsonl, tokenizer, SEQ, cache_dir=str(tmp_path / "c"))
    n = before.num_documents
    _write(jsonl, 60, seed=1)
    notes: list[str] = []
    after = SftCorpus.build(jsonl, tokenizer, SEQ, cache_dir=str(tmp_path / "c"), print_fn=notes.append)
    assert after.built and after.num_documents == 60 != n
    np.testing.assert_array_equal(after.sample(59)[0], _expected(jsonl, tokenizer)[59][0])
    # the same bytes written again (a new mtime) keep the cache: its content decides
    os.utime(jsonl, ns=(1, 1))
    assert not SftCorpus.build(jsonl, tokenizer, SEQ, cache_dir=str(tmp_path / "c")).built
    # a tokenizer alike in class, pad and template (the same key) but with another vocabulary: the jsonl's
    # first conversation, checked against the cache, tells
    other = CountingTokenizer(offset=20)
    notes.clear()
    rebuilt = SftCorpus.build(jsonl, other, SEQ, cache_dir=str(tmp_path / "c"), print_fn=notes.append)
    assert rebuilt.built and any("other tokens than the cache holds" in line for line in notes)
    np.testing.assert_array_equal(rebuilt.sample(0)[0], _expected(jsonl, other)[0][0])


@pytest.mark.parametrize("part", ["tokens.bin", "labels.bin", "tokens.idx"])
def test_a_truncated_cache_file_is_one_line_naming_it(tmp_path, part):
    jsonl = _write(tmp_path / "chat.jsonl", 30)
    tokenizer = CountingTokenizer()
    SftCorpus.build(jsonl, tokenizer, SEQ, cache_dir=str(tmp_path / "c"))
    damaged = next((tmp_path / "c").glob(f"*.{part}"))
    with open(damaged, "r+b") as f:
        f.truncate(damaged.stat().st_size - 8)
    with pytest.raises(SftCacheError) as err:
        SftCorpus.build(jsonl, tokenizer, SEQ, cache_dir=str(tmp_path / "c"))
    message = str(err.value)
    assert "\n" not in message and "truncated" in message and damaged.name.split(".")[0] in message
    assert "to rebuild it" in message


def test_processes_starting_together_build_it_once(tmp_path):
    """Four starts at once (threads: each takes the lock through its own descriptor, as processes do): one
    tokenizes, the others wait on the lock and map its files."""
    jsonl = _write(tmp_path / "chat.jsonl", 300)
    tokenizer = CountingTokenizer()
    corpora: list[SftCorpus] = []
    threads = [threading.Thread(target=lambda: corpora.append(SftCorpus.build(jsonl, tokenizer, SEQ)))
               for _ in range(4)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert len(corpora) == 4 and sum(c.built for c in corpora) == 1
    assert tokenizer.calls < 300 + 4 * 2 + 1 + 300  # one pass over the file (plus each start's two probes)
    assert len({c.arrays.prefix for c in corpora}) == 1
    assert not list((tmp_path / "cache").glob("*.tmp"))


def test_an_unwritable_cache_directory_is_one_line(tmp_path):
    jsonl = _write(tmp_path / "chat.jsonl", 5)
    blocker = tmp_path / "file"
    blocker.write_text("")
    with pytest.raises(SftCacheError) as err:
        SftCorpus.build(jsonl, CountingTokenizer(), SEQ, cache_dir=str(blocker / "sub"))
    assert "\n" not in str(err.value) and "--data-cache-path" in str(err.value)


def test_a_long_build_prints_its_progress(tmp_path, monkeypatch):
    import megatron_wlb.data.sft as sft

    monkeypatch.setattr(sft, "PROGRESS_SECONDS", 0.0)
    monkeypatch.setattr(sft, "WRITE_BATCH_TOKENS", 256)  # several batches: the builder holds one at a time
    jsonl = _write(tmp_path / "chat.jsonl", 40)
    notes: list[str] = []
    corpus = SftCorpus.build(jsonl, CountingTokenizer(), SEQ, print_fn=notes.append)
    progress = [line for line in notes if "tokenizing" in line and "% of the file" in line]
    assert len(progress) == 40 and "40 conversations, 100.0% of the file" in progress[-1]
    assert corpus.num_documents == 40 and sum("tokenized in" in line for line in notes) == 1
    tokenizer = CountingTokenizer()
    for doc, (tokens, _) in enumerate(_expected(jsonl, tokenizer)):
        np.testing.assert_array_equal(corpus.sample(doc)[0], tokens)


def test_the_docs_scale_figures_are_the_recorded_run():
    """docs/sft.md quotes benchmarks/results/sft_scale.json (bench_sft_scale.py): the 1e7 rank's memory."""
    root = Path(__file__).resolve().parents[1]
    result = json.loads((root / "benchmarks" / "results" / "sft_scale.json").read_text())
    docs = (root / "docs" / "sft.md").read_text()
    top = next(r for r in result["reading"] if r["conversations"] == 10**7 and r["rank"] == "later")
    end, peak = top["anon_end_mib"], top["peak_anon_mib"]
    assert f"ends at {end:.0f} MiB of private memory and peaks at {peak:.0f} MiB" in docs
    held = (8 * top["tokens"] + 24 * top["conversations"]) / 2**20
    assert f"Holding the\n  1e7 conversations in memory as before took {held:.0f} MiB" in docs
    assert top["peak_anon_mib"] < 128 and top["peak_anon_mib"] < held / 10


# -- issue 57: a cache keyed by content, checked by content, its ids by the tokenizer's vocabulary ---------------
def test_a_same_size_edit_with_its_mtime_restored_is_retokenized(tmp_path):
    jsonl = _write(tmp_path / "chat.jsonl", 40)
    tokenizer = CountingTokenizer()
    SftCorpus.build(jsonl, tokenizer, SEQ)
    st = jsonl.stat()
    text = jsonl.read_text()
    edited = text.replace("w1", "w2", 3)  # the same size: w1 -> w2
    assert edited != text and len(edited) == len(text)
    jsonl.write_text(edited)
    os.utime(jsonl, ns=(st.st_atime_ns, st.st_mtime_ns))  # as touch -r / rsync -t leave it
    assert jsonl.stat().st_size == st.st_size and jsonl.stat().st_mtime_ns == st.st_mtime_ns
    after = SftCorpus.build(jsonl, tokenizer, SEQ)
    assert after.built
    for doc, (tokens, _) in enumerate(_expected(jsonl, tokenizer)):
        np.testing.assert_array_equal(after.sample(doc)[0], tokens)


def _damage_token(prefix: str) -> None:
    tokens = np.memmap(prefix + ".tokens.bin", dtype=np.int32, mode="r+")
    tokens[len(tokens) // 2] += 1
    tokens.flush()


def _damage_label(prefix: str) -> None:
    labels = np.memmap(prefix + ".labels.bin", dtype=np.int32, mode="r+")
    labels[int(np.flatnonzero(labels != IGNORE_INDEX)[-3])] = IGNORE_INDEX
    labels.flush()


def _damage_token_max(prefix: str) -> None:
    manifest = json.loads(Path(prefix + ".json").read_text())
    manifest["token_max"] = 10
    Path(prefix + ".json").write_text(json.dumps(manifest, indent=1))


@pytest.mark.parametrize("damage", [_damage_token, _damage_label, _damage_token_max],
                         ids=["a changed token", "a target set to -100", "a false token_max"])
def test_a_damaged_cache_keeping_its_sizes_is_refused(tmp_path, damage):
    jsonl = _write(tmp_path / "chat.jsonl", 40)
    tokenizer = CountingTokenizer()
    first = SftCorpus.build(jsonl, tokenizer, SEQ)
    prefix = first.arrays.prefix
    sizes = {p.name: p.stat().st_size for p in _cache_files(tmp_path / "cache")}
    damage(prefix)
    assert {p.name: p.stat().st_size for p in _cache_files(tmp_path / "cache")}.keys() == sizes.keys()
    with pytest.raises(SftCacheError) as err:
        SftCorpus.build(jsonl, tokenizer, SEQ)
    assert "\n" not in str(err.value) and "digest differs" in str(err.value) and prefix in str(err.value)


def test_an_id_outside_the_tokenizers_vocabulary_is_one_line_at_start_up(tmp_path):
    class Small(CountingTokenizer):
        vocab_size = 40  # w30 and up tokenize to 40 and up

    jsonl = _write(tmp_path / "chat.jsonl", 20)
    with pytest.raises(ValueError) as err:
        SftCorpus.build(jsonl, Small(), SEQ)
    assert "\n" not in str(err.value) and "outside its own vocabulary of 40" in str(err.value)


def test_an_out_of_vocabulary_id_in_a_cache_is_refused_in_one_line_when_read(tmp_path):
    """A cache whose digest holds (rewritten after the damage, as a faulty builder would leave it) but which
    holds an id past the vocabulary: the reader's start-up scan and every piece read refuse it in one line,
    never an IndexError in the embedding."""
    import types

    from megatron_wlb.data.sft_cache import cache_digest
    from megatron_wlb.megatron.data.sft import sft_reader

    class Vocab(CountingTokenizer):
        vocab_size = 100

    import megatron_wlb.megatron.data.sft as adapter

    jsonl = _write(tmp_path / "chat.jsonl", 30)
    tokenizer = Vocab()
    args = types.SimpleNamespace(sft=True, seq_length=SEQ, seed=1234, split="100,0,0", data_path=[str(jsonl)],
                                 train_data_path=None, valid_data_path=None, test_data_path=None)
    sft_reader(args, "train", tokenizer)  # builds the cache the adapter keys (its tokenizer files' digest)
    prefix = str(next((tmp_path / "cache").glob("*.json"))).removesuffix(".json")
    adapter._CORPORA.clear()  # a fresh start maps it again
    tokens = np.memmap(prefix + ".tokens.bin", dtype=np.int32, mode="r+")
    tokens[-1] = 100_000
    tokens.flush()
    manifest = json.loads(Path(prefix + ".json").read_text())
    manifest["digest"] = cache_digest(prefix, manifest)
    Path(prefix + ".json").write_text(json.dumps(manifest))
    reader, read_piece = sft_reader(args, "train", tokenizer)
    with pytest.raises(ValueError) as err:
        reader.check_vocabulary(100, "the tokenizer")
    assert "\n" not in str(err.value) and "token id 100000" in str(err.value)
    last = next(i for i in range(reader.num_documents) if reader.locate(i)[2] == reader.num_documents - 1)
    with pytest.raises(ValueError) as err:
        read_piece(last, 0, int(reader.sources[0].lengths[-1]))
    assert "\n" not in str(err.value) and "outside the tokenizer's vocabulary of 100" in str(err.value)
