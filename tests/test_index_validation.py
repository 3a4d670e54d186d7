"""A corrupted ``.idx`` never feeds wrong tokens: its pointers are checked against its lengths and dtype
at start-up (``indexed.check_pointers``), vectorised, and every refusal is one line naming the file and
the first bad document. Each corruption below keeps the total size the ``.bin`` check compares."""

from __future__ import annotations

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
