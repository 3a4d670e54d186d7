"""The README's install (Python 3.11 + the megatron-core 0.19 wheel with --ignore-requires-python) runs the
launcher; import failures name their real cause; token ids outside the vocabulary are refused at start-up."""

from __future__ import annotations

import importlib.util
import os
import subprocess
import sys
import typing
from pathlib import Path
from types import SimpleNamespace

import numpy as np
import pytest

REPO = Path(__file__).resolve().parents[1]


def _has_training_code() -> bool:
    try:
        return importlib.util.find_spec("megatron.training") is not None
    except ModuleNotFoundError:
        return False


def test_python_shim_stands_in_typing_override(monkeypatch):
    import typing_extensions

    from megatron_wlb.megatron.args.compat import install_python_shims

    monkeypatch.delattr(typing, "override", raising=False)
    assert install_python_shims() is True
    assert typing.override is typing_extensions.override  # type: ignore[attr-defined]
    assert install_python_shims() is False  # already there (or Python >= 3.12): nothing to do


@pytest.mark.skipif(not _has_training_code(), reason="megatron.training is not installed (megatron-core 0.19 wheel)")
def test_launcher_help_runs_on_the_readme_install():
    """`python -m megatron_wlb.megatron.entry.launcher --help` on this interpreter (3.11 in CI: typing.override is
    missing there) prints our flags (Megatron's own --help is left to Megatron: issue 20) instead of dying,
    and with the shim the launcher's imports of Megatron's training code succeed."""
    env = {**os.environ, "PYTHONPATH": f"{REPO}{os.pathsep}{os.environ.get('PYTHONPATH', '')}"}
    proc = subprocess.run([sys.executable, "-m", "megatron_wlb.megatron.entry.launcher", "--help"], env=env,
                          capture_output=True, text=True, timeout=300)
    out = proc.stdout + proc.stderr
    assert proc.returncode == 0, out[-3000:]
    assert "--wlb-packer" in out and "Traceback" not in out
    code = ("from megatron_wlb.megatron.args.compat import install_python_shims; install_python_shims(); "
            "import megatron.training.training, megatron.training.arguments")
    proc = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, (proc.stdout + proc.stderr)[-3000:]


def test_import_failures_name_the_real_cause():
    from megatron_wlb.megatron import training_import_error

    missing_dep = ModuleNotFoundError("No module named 'six'", name="six")
    message = training_import_error("arguments", missing_dep)
    assert "'six'" in message and "pip install six" in message and "does not ship" not in message
    python = ImportError("cannot import name 'override' from 'typing'")
    message = training_import_error("training", python)
    assert "override" in message and "checkout" not in message
    absent = ModuleNotFoundError("No module named 'megatron.training'", name="megatron.training")
    message = training_import_error("arguments", absent)
    assert "megatron-core==" in message and "megatron/training" in message


@pytest.fixture()
def wide_ids(tmp_path) -> str:
    """A dataset whose token ids reach 1000 (beyond the tiny GPT's default vocabulary of 300)."""
    pytest.importorskip("megatron.core")
    from megatron_wlb.data.reader import write_indexed_dataset

    rng = np.random.default_rng(0)
    docs = [rng.integers(0, 900, size=int(n)) for n in rng.integers(20, 400, size=300)]
    docs[123][5] = 1000
    prefix = str(tmp_path / "wide_text_document")
    write_indexed_dataset(prefix, docs)
    return prefix


def test_reader_refuses_ids_outside_the_vocabulary(wide_ids):
    from megatron_wlb.data.reader import DocumentReader, IndexedSource

    assert IndexedSource.open(wide_ids).max_token_id() == 1000
    reader = DocumentReader.from_data_path(wide_ids)
    reader.check_vocabulary(1001)
    with pytest.raises(ValueError, match=r"token id 1000 is outside the model's vocabulary of 384.*at least 1001"):
        reader.check_vocabulary(384)


def test_an_id_beyond_the_start_up_scan_stops_the_run_when_read(wide_ids, monkeypatch):
    """Start-up scans a bounded prefix of each dataset (a trillion-token corpus is not read at start-up);
    an id beyond the vocabulary past that prefix is refused, with the same message, when it is read."""
    import megatron_wlb.data.reader as reader_mod
    from megatron_wlb.data.reader import DocumentReader

    monkeypatch.setattr(reader_mod, "VOCAB_SCAN_TOKENS", 16)  # the id 1000 lies far beyond 16 tokens
    reader = DocumentReader.from_data_path(wide_ids, split="1,0,0", shuffle=False)
    reader.check_vocabulary(901)  # passes: the scanned prefix holds ids < 900
    assert reader.read(0, 0, 10).max() < 900
    with pytest.raises(ValueError, match=r"token id 1000 is outside the model's vocabulary of 901.*at least 1001"):
        for doc in range(reader.num_documents):
            reader.read(doc, 0, int(reader.sources[0].lengths[reader.locate(doc)[2]]))


def test_every_split_reader_checks_the_model_vocabulary(wide_ids):
    from megatron_wlb.megatron import reader_from_args

    args = SimpleNamespace(data_path=[wide_ids], split="90,5,5", seed=1, padded_vocab_size=384)
    for split in ("train", "valid", "test"):
        with pytest.raises(ValueError, match="token id 1000"):
            reader_from_args(args, split)
    args.padded_vocab_size = 1024
    assert reader_from_args(args, "train").num_documents == 300


def test_cpu_harness_takes_the_vocabulary_from_the_data(wide_ids, tmp_path):
    from megatron_wlb.data.reader import byte_documents, write_indexed_dataset
    from megatron_wlb.megatron.entry.cpu import tiny_gpt_vocab_flags

    assert tiny_gpt_vocab_flags(["--data-path", wide_ids]) == ["--vocab-size", "1001"]
    # train_cpu.sh puts its default corpus first; the user's --data-path (the last) is what trains
    small = str(tmp_path / "bytes_text_document")
    write_indexed_dataset(small, byte_documents([__file__]))
    assert tiny_gpt_vocab_flags(["--data-path", wide_ids, "--data-path", "1", small]) == []
    assert tiny_gpt_vocab_flags(["--data-path", small, "--data-path", "0.5", small, "0.5", wide_ids]) == \
        ["--vocab-size", "1001"]
    # a --vocab-size given is the model's: the reader refuses an id beyond it (start-up sample, then every read)
    assert tiny_gpt_vocab_flags(["--data-path", wide_ids, "--vocab-size", "512"]) == []
    assert tiny_gpt_vocab_flags(["--train-data-path", wide_ids, "--vocab-size", "2000"]) == []
    with pytest.raises(SystemExit, match=r"--vocab-size 'x': give a positive integer"):
        tiny_gpt_vocab_flags(["--data-path", wide_ids, "--vocab-size", "x"])


def test_cpu_harness_start_up_reads_no_token_it_does_not_need(tmp_path, monkeypatch):
    """Issue 57 (6): --tiny-gpt read every token of the corpus at start-up (14 GB at 1e8 documents, even with
    --vocab-size). Now: nothing with --vocab-size or a byte corpus, else each dataset's first VOCAB_SCAN_TOKENS
    tokens; an id beyond them is refused in one line when it is read, naming the --vocab-size that covers it."""
    import megatron_wlb.data.reader as reader_mod
    import megatron_wlb.megatron.entry.cpu as cpu_mod
    from megatron_wlb.data.reader import DocumentReader, IndexedSource, byte_documents, write_indexed_dataset
    from megatron_wlb.megatron.entry.cpu import tiny_gpt_vocab_flags

    wide = str(tmp_path / "far_text_document")
    docs = [np.full(10, 400 + i, dtype=np.int64) for i in range(6)]
    docs[5][7] = 5000  # beyond the sampled prefix
    write_indexed_dataset(wide, docs)
    small = str(tmp_path / "bytes_text_document")
    write_indexed_dataset(small, byte_documents([__file__], eod=None), dtype=np.uint8)
    assert IndexedSource.open(small).tokens.dtype == np.uint8
    docs_text = "".join((Path(__file__).parents[1] / "docs" / name).read_text().replace("\n", " ")
                        for name in ("megatron.md", "megatron_launch.md"))
    assert reader_mod.VOCAB_SCAN_TOKENS == 2 ** 28 and docs_text.count("first 2^28 tokens") == 2  # the docs' figure
    scanned: list[int] = []
    scan = IndexedSource._scan
    monkeypatch.setattr(IndexedSource, "_scan", lambda self, count: (scanned.append(count), scan(self, count))[1])
    monkeypatch.setattr(cpu_mod, "VOCAB_SCAN_TOKENS", 16)
    monkeypatch.setattr(reader_mod, "VOCAB_SCAN_TOKENS", 16)
    assert tiny_gpt_vocab_flags(["--data-path", wide, "--vocab-size", "600"]) == [] and scanned == []
    assert tiny_gpt_vocab_flags(["--data-path", small]) == [] and scanned == []  # uint8: no id beyond 300
    assert tiny_gpt_vocab_flags(["--data-path", wide]) == ["--vocab-size", "402"] and scanned == [16]
    assert IndexedSource.open(wide).tokens.size == 60  # the rest was not read
    reader = DocumentReader([(wide, 1.0)], split="1,0,0", shuffle=False)
    reader.check_vocabulary(402)  # the start-up sample is sound
    assert reader.read(0, 0, 10).tolist() == [400] * 10
    with pytest.raises(ValueError) as caught:
        reader.read(5, 0, 10)
    assert "\n" not in str(caught.value) and "token id 5000 is outside the model's vocabulary of 402" in \
        str(caught.value) and "at least 5001" in str(caught.value)


def test_help_percents_are_escaped_once():
    import argparse

    from megatron_wlb.megatron.args.flags import escape_help_percents

    parser = argparse.ArgumentParser()
    parser.add_argument("--headroom", help="e.g. 1.10 = 10%) of %(default)s, 100%% sure", default=3)
    escape_help_percents(escape_help_percents(parser))  # twice: apply() may compose our provider twice
    assert "10%) of 3, 100% sure" in " ".join(parser.format_help().split())


def test_a_script_without_main_guard_is_refused_in_the_spawned_child(tmp_path):
    """Megatron's torch_dist writer starts a spawn-method manager, which re-imports the launching script: a
    script that trains at module level is refused there in one line instead of training a second time."""
    script = tmp_path / "train_without_guard.py"
    script.write_text("import multiprocessing\n"
                      "from megatron_wlb.megatron.entry import cpu\n"
                      "cpu.install_cpu_redirects()\n"
                      "print('TRAINING', flush=True)\n"
                      "multiprocessing.get_context('spawn').Manager().Queue()  # what the torch_dist writer does\n")
    env = {**os.environ, "PYTHONPATH": f"{REPO}{os.pathsep}{os.environ.get('PYTHONPATH', '')}"}
    proc = subprocess.run([sys.executable, str(script)], env=env, capture_output=True, text=True, timeout=120)
    assert proc.returncode != 0
    assert proc.stdout.count("TRAINING") == 1, proc.stdout
    assert "is being re-imported by a multiprocessing child" in proc.stderr
    assert 'if __name__ == "__main__":' in proc.stderr


@pytest.mark.slow
def test_offline_tokenizer_and_preprocess_data_recipe(tmp_path):
    """The docs' recipe on the README's install: scripts/train_tokenizer.py, then the core_v0.19.0 checkout's
    tools/preprocess_data.py through `python -m megatron_wlb.megatron.args.compat` (it imports typing.override);
    the result reads back with every id inside the tokenizer's vocabulary."""
    import json
    import sysconfig

    pytest.importorskip("tokenizers")
    pytest.importorskip("transformers")
    from conftest import megatron_checkout

    checkout = megatron_checkout(tmp_path / "Megatron-LM", "core_v0.19.0")
    files = sorted(Path(sysconfig.get_paths()["stdlib"]).glob("*.py"))[:40]
    corpus = tmp_path / "corpus.jsonl"
    corpus.write_text("".join(json.dumps({"text": p.read_text()}) + "\n" for p in files))
    env = {**os.environ, "PYTHONPATH": f"{REPO}{os.pathsep}{os.environ.get('PYTHONPATH', '')}",
           "HF_HUB_OFFLINE": "1"}
    made = subprocess.run([sys.executable, str(REPO / "scripts" / "train_tokenizer.py"), "--input", str(corpus),
                           "--vocab-size", "1000", "--out", str(tmp_path / "tok")], env=env, capture_output=True,
                          text=True, timeout=300)
    assert made.returncode == 0, made.stderr
    (tmp_path / "data").mkdir()
    proc = subprocess.run([sys.executable, "-m", "megatron_wlb.megatron.args.compat",
                           str(checkout / "tools" / "preprocess_data.py"), "--input", str(corpus), "--output-prefix",
                           str(tmp_path / "data" / "corpus"), "--tokenizer-type", "HuggingFaceTokenizer",
                           "--tokenizer-model", str(tmp_path / "tok"), "--append-eod", "--workers", "1"],
                          env=env, capture_output=True, text=True, timeout=300, cwd=tmp_path)
    assert proc.returncode == 0, proc.stderr[-3000:]
    from megatron_wlb.data.reader import DocumentReader

    reader = DocumentReader.from_data_path(str(tmp_path / "data" / "corpus_text_document"), split="1,0,0")
    assert reader.num_documents == len(files)
    assert 256 < reader.max_token_id() < 1000  # merges were used, and every id is in the vocabulary
