"""A corrupted ``.idx`` never feeds wrong tokens: its pointers are checked against its lengths and dtype
at start-up (``indexed.check_pointers``), vectorised, and every refusal is one line naming the file and
the first bad document. Each corruption below keeps the total size the ``.bin`` check compares. An index of
one sequence per document is checked whole when small, else from a fixed sample at open and each other
document when the reader first reads it (issue 57 item 8), with the same messages."""

from __future__ import annotations

import os
from pathlib import Path

import numpy as np
import pytest

from megatron_wlb.data.indexed import IDX_MAGIC, check_bin_matches_idx, check_pointers, read_index, write_index
from megatron_wlb.data.reader import DocumentReader, IndexedSource


def dataset(tmp_path: Path, name: str, lengths: list[int], pointers: list[int] | None = None,
            documents: list[int] | None = None, tokens: int | None = None) -> str:
    """``name.idx`` with these lengths (and pointers / document indices, if given) and a ``.bin`` whose
    token i is i (uint16), holding ``tokens`` tokens (default: the lengths' sum)."""
    prefix = tmp_path / name
    write_index(prefix, np.asarray(lengths), np.uint16, None if pointers is None else np.asarray(pointers),
                None if documents is None else np.asarray(documents))
    np.arange(sum(lengths) if tokens is None else tokens, dtype=np.uint16).tofile(f"{prefix}.bin")
    return str(prefix)


def test_a_sound_index_passes_and_reads_back(tmp_path):
    prefix = dataset(tmp_path, "ok", [10, 10, 5])
    check_bin_matches_idx(prefix)
    source = IndexedSource.open(prefix)
    assert source.read(1, 0, 10).tolist() == list(range(10, 20))
    # several sequences per document, back to back
    multi = dataset(tmp_path, "multi", [3, 4, 5], documents=[0, 2, 3])
    assert IndexedSource.open(multi).read(0, 0, 7).tolist() == list(range(7))


@pytest.mark.parametrize("lengths, pointers, bad", [
    ([7, 13, 5], [0, 20, 40], 1),      # lengths 10,10 -> 7,13: same total, document 1 would read 3 tokens of 2
    ([10, 10, 10, 10], [0, 20, 6, 60], 2),   # a middle pointer 40 -> 6
    ([10, 10, 5], [0, -1000, 40], 1),  # a negative pointer (read back as an empty array)
    ([10, 10, 5], [0, 21, 40], 1),     # not a multiple of the 2-byte tokens
    ([10, 10, 5], [2, 20, 40], 0),     # the first sequence does not start the .bin
])
def test_pointers_that_disagree_with_the_lengths_are_refused(tmp_path, lengths, pointers, bad):
    prefix = dataset(tmp_path, "bad", lengths, pointers)
    pattern = rf"bad\.idx: document {bad} \(sequence {bad}\) starts at byte {pointers[bad]} of the \.bin.*corrupted"
    with pytest.raises(ValueError, match=pattern) as caught:
        check_bin_matches_idx(prefix)
    assert "\n" not in str(caught.value)
    with pytest.raises(ValueError, match=pattern):  # the reader (Megatron's data path) refuses it too
        DocumentReader([(prefix, 1.0)], split="1,0,0")


def test_a_negative_length_names_its_document(tmp_path):
    prefix = dataset(tmp_path, "neg", [10, 10, 5], documents=[0, 1, 3], tokens=25)
    raw = bytearray(Path(f"{prefix}.idx").read_bytes())
    raw[34 + 4 * 2:34 + 4 * 3] = np.int32(-5).tobytes()  # sequence 2 (document 1's second)
    Path(f"{prefix}.idx").write_bytes(bytes(raw))
    with pytest.raises(ValueError, match=r"neg\.idx: document 1 \(sequence 2\) has a negative length -5"):
        check_pointers(read_index(prefix), f"{prefix}.idx")


def test_a_truncated_header_is_not_reported_as_bad_magic(tmp_path):
    prefix = dataset(tmp_path, "cut", [10, 10])
    whole = Path(f"{prefix}.idx").read_bytes()
    for keep in (5, 9, 20):
        Path(f"{prefix}.idx").write_bytes(whole[:keep])
        with pytest.raises(ValueError, match=rf"cut\.idx: truncated header, {keep} bytes of 34") as caught:
            read_index(prefix)
        assert "magic" not in str(caught.value)
    Path(f"{prefix}.idx").write_bytes(b"NOTANIDX" + whole[8:])
    with pytest.raises(ValueError, match="magic"):
        read_index(prefix)
    Path(f"{prefix}.idx").write_bytes(IDX_MAGIC[:4] + b"x")
    with pytest.raises(ValueError, match="magic"):
        read_index(prefix)


def test_empty_files_are_named(tmp_path):
    Path(tmp_path / "void.idx").write_bytes(b"")
    Path(tmp_path / "void.bin").write_bytes(b"")
    with pytest.raises(ValueError, match=r"void\.idx: empty file \(0 bytes\)"):
        read_index(tmp_path / "void")
    prefix = dataset(tmp_path, "nodocs", [])
    with pytest.raises(ValueError, match=r"nodocs\.idx lists no documents \(and .*nodocs\.bin is empty\)"):
        IndexedSource.open(prefix)


# -- a sampled check at open, each other document checked when first read (issue 57 item 8) -------------------
BIG = 1_000_000


@pytest.fixture(scope="module")
def big(tmp_path_factory) -> tuple[Path, bytes]:
    """A sound index of ``BIG`` one-sequence documents (lengths 1..100) and a sparse ``.bin``; its bytes."""
    from megatron_wlb.data.indexed import write_index_chunks

    prefix = tmp_path_factory.mktemp("big") / "corpus"
    lengths = (np.arange(BIG, dtype=np.int64) * 7919 % 100 + 1).astype(np.int32)
    write_index_chunks(prefix, lambda: iter([lengths]))
    with open(f"{prefix}.bin", "wb") as f:
        f.truncate(2 * int(lengths.sum()))
    return prefix, Path(f"{prefix}.idx").read_bytes()


def copy_of(big: tuple[Path, bytes], tmp_path: Path, damage: dict[str, dict[int, int]] | None = None) -> str:
    """``big`` copied into ``tmp_path`` (the ``.bin`` sparse) with entries changed: ``{array: {entry: value}}``."""
    source, raw = big
    prefix = tmp_path / "corpus"
    data = bytearray(raw)
    offsets = {"lengths": (34, 4, np.int32), "pointers": (34 + 4 * BIG, 8, np.int64),
               "documents": (34 + 12 * BIG, 8, np.int64)}
    for name, entries in (damage or {}).items():
        base, size, dtype = offsets[name]
        for at, value in entries.items():
            data[base + size * at:base + size * (at + 1)] = dtype(value).tobytes()
    Path(f"{prefix}.idx").write_bytes(bytes(data))
    with open(f"{prefix}.bin", "wb") as f:
        f.truncate(os.path.getsize(f"{source}.bin"))
    return str(prefix)


def far_document() -> int:
    """A document in the middle of the widest gap between the ranges the open check samples."""
    from megatron_wlb.data.indexed import sample_ranges

    ranges = sample_ranges(BIG)
    gap = max(zip(ranges, ranges[1:]), key=lambda pair: pair[1][0] - pair[0][1])
    return (gap[0][1] + gap[1][0]) // 2


def sampled_document() -> int:
    """A document inside a sampled range that is neither the first nor the last."""
    from megatron_wlb.data.indexed import sample_ranges

    lo, hi = sample_ranges(BIG)[len(sample_ranges(BIG)) // 2]
    return (lo + hi) // 2


def damages(big: tuple[Path, bytes], k: int) -> dict[str, tuple[dict[str, dict[int, int]], str]]:
    """Damages of document ``k`` (each keeps the .bin's size), and the message each gives."""
    raw = big[1]
    length = int(np.frombuffer(raw, np.int32, 1, 34 + 4 * k)[0])
    nxt = int(np.frombuffer(raw, np.int32, 1, 34 + 4 * (k + 1))[0])
    pointer = int(np.frombuffer(raw, np.int64, 1, 34 + 4 * BIG + 8 * (k + 1))[0])
    return {
        "lengths swapped": ({"lengths": {k: length - 1, k + 1: nxt + 1}},
                            rf"document {k + 1} \(sequence {k + 1}\) starts at byte {pointer} of the \.bin, but the "
                            rf"2-byte token lengths before it end at byte {pointer - 2} \(a corrupted \.idx"),
        "negative length": ({"lengths": {k: -5}}, rf"document {k} \(sequence {k}\) has a negative length -5"),
        "pointer": ({"pointers": {k + 1: pointer + 1}}, rf"document {k + 1} \(sequence {k + 1}\) starts at byte "
                                                       rf"{pointer + 1} of the \.bin"),
        "document index": ({"documents": {k: k + 1}}, rf"document_indices do not partition its {BIG} sequences"),
        "empty": ({"lengths": {k: 0, k + 1: nxt + length}, "pointers": {k + 1: pointer - 2 * length}},
                  rf"document {k} is empty; every document needs at least 1 token"),
    }


def test_a_sound_index_opens_from_a_bounded_sample(big, tmp_path):
    from megatron_wlb.data.indexed import SAMPLE_BLOCK, SAMPLE_BLOCKS
    from megatron_wlb.data.reader import FIRST_STREAM_CHUNK

    prefix = copy_of(big, tmp_path)
    reader = DocumentReader([(prefix, 1.0)], split="1,0,0")
    source = reader.sources[0]
    assert source.checked_at_open == SAMPLE_BLOCKS * SAMPLE_BLOCK < BIG // 3
    assert source.documents_checked == 0
    cursor = reader.stream(10_000_000).cursor()
    cursor.generate()
    assert source.documents_checked == FIRST_STREAM_CHUNK  # what the first plan's window read, no more
    assert reader.epoch_tokens() == int(np.frombuffer(big[1], np.int32, BIG, 34).sum())  # from 2 documents' entries
    assert source.documents_checked == FIRST_STREAM_CHUNK + 2
    assert check_pointers(read_index(prefix), "x").checked_sequences == BIG  # the whole check, for comparison


@pytest.mark.parametrize("kind", ["lengths swapped", "negative length", "pointer", "document index", "empty"])
def test_damage_far_from_the_sample_is_refused_when_first_read(big, tmp_path, kind):
    k = far_document()
    damage, message = damages(big, k)[kind]
    prefix = copy_of(big, tmp_path, damage)
    for shuffle in (False, True):
        reader = DocumentReader([(prefix, 1.0)], split="1,0,0", shuffle=shuffle)  # opens: not sampled
        cursor = reader.stream(reader.epoch_tokens()).cursor()
        read = 0
        # in file order the first damaged document is met first; shuffled, either of the two it spoils may be
        expected = message if not shuffle else rf"(document ({k}|{k + 1}|{k + 2})\b|document_indices\[)"
        with pytest.raises(ValueError, match=rf"corpus(\.idx)?: .*{expected}") as caught:
            while cursor.generate():
                read = cursor.stop
        assert "\n" not in str(caught.value) and str(tmp_path / "corpus") in str(caught.value)
        if not shuffle:  # in file order: the documents before the damaged one's chunk were read first
            assert 0 < read <= k


@pytest.mark.parametrize("kind", ["lengths swapped", "negative length", "pointer", "document index", "empty"])
def test_damage_in_a_sampled_place_is_refused_at_open(big, tmp_path, kind):
    k = sampled_document()
    damage, message = damages(big, k)[kind]
    prefix = copy_of(big, tmp_path, damage)
    with pytest.raises(ValueError, match=rf"corpus(\.idx)?: .*{message}") as caught:
        DocumentReader([(prefix, 1.0)], split="1,0,0")
    assert "\n" not in str(caught.value)


def test_the_cli_sample_checks_the_documents_it_reads(big, tmp_path):
    """``wlb analyze --data-prefix`` reads its sample's lengths through the same check: a damaged document far
    from the open sample is refused when the sample holds it, and a sample without it reads no damage."""
    from megatron_wlb.cli.common import corpus_sample

    k = far_document()
    damage, message = damages(big, k)["negative length"]
    prefix = copy_of(big, tmp_path, damage)
    with pytest.raises(ValueError, match=rf"corpus\.idx: {message}") as caught:
        corpus_sample([prefix], "--data-prefix", None, 0)  # every document
    assert "\n" not in str(caught.value)
    datasets, read, total = corpus_sample([prefix], "--data-prefix", 1000, 0)
    assert read == 1000 and total == BIG and int(datasets[0].min()) >= 1


def test_prefetch_asks_for_every_page_a_document_check_reads(tmp_path):
    """``IndexFile.prefetch`` (issued by ``check_documents`` before its scattered reads of a cold ``.idx``) names
    each page holding a checked document's length, its and the next pointer and document index, and no page
    twice; an index without a map asks for nothing."""
    import mmap

    from megatron_wlb.data.indexed import _HEADER_BYTES, IndexFile, check_documents, read_index, write_index

    n = 300_000
    lengths = np.random.default_rng(0).integers(1, 4000, size=n).astype(np.int32)
    prefix = tmp_path / "c"
    write_index(prefix, lengths)
    index = read_index(prefix)

    class Recorder:
        def __init__(self, size: int) -> None:
            self.size, self.calls = size, []

        def __len__(self) -> int:
            return self.size

        def madvise(self, option: int, start: int, length: int) -> None:
            self.calls.append((option, start, length))

    recorder = Recorder(len(index.mapping))
    spied = IndexFile(index.sequence_lengths, index.document_indices, index.sequence_pointers, index.dtype,
                      index.path, recorder)  # type: ignore[arg-type]
    ids = np.array([0, 7, 4095, 150_000, 150_001, n - 1])
    (tmp_path / "c.bin").write_bytes(b"")
    os.truncate(tmp_path / "c.bin", int(lengths.astype(np.int64).sum()) * 2)
    check_documents(spied, ids, "c.idx", int(lengths.astype(np.int64).sum()) * 2)
    asked = {start for option, start, _ in recorder.calls if option == mmap.MADV_WILLNEED}
    assert len(asked) == len(recorder.calls)  # each page once
    page = mmap.PAGESIZE
    for i in ids:
        nxt = min(int(i) + 1, n - 1)
        for offset in (_HEADER_BYTES + 4 * i, _HEADER_BYTES + 4 * n + 8 * i, _HEADER_BYTES + 4 * n + 8 * nxt,
                       _HEADER_BYTES + 12 * n + 8 * i, _HEADER_BYTES + 12 * n + 8 * (i + 1)):
            assert int(offset) // page * page in asked, (int(i), int(offset))
    assert all(0 < length <= page and start + length <= recorder.size for _, start, length in recorder.calls)
    IndexFile(index.sequence_lengths, index.document_indices, index.sequence_pointers, index.dtype).prefetch(ids)
