"""The corpora of benchmarks/build_corpora.py: how the new shapes are measured (HTML text of a book,
sessions of a system log) and that tests/data/corpora/corpora.json describes the saved lengths."""

from __future__ import annotations

import json
import sys
from pathlib import Path

import numpy as np
import pytest

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "benchmarks"))
import build_corpora  # noqa: E402

CORPORA = ROOT / "tests" / "data" / "corpora"


def test_html_text_drops_markup_scripts_and_styles():
    page = (b"<html><head><style>p {color: red}</style><script>var x = '<p>';</script></head>"
            b"<body><h1>Title</h1>\n\n  <p>Hello &amp; w\xc3\xb6rld</p></body></html>")
    assert build_corpora.html_text_bytes(page) == len("Title Hello & wörld".encode())


def test_log_sessions_cover_every_byte_once():
    dpkg = (b"2025-06-24 14:36:25 startup archives unpack\n2025-06-24 14:36:25 upgrade a 1 2\n"
            b"2025-06-24 14:40:00 startup packages configure\n2025-06-24 14:40:01 configure a 2\n"
            b"2025-06-25 09:00:00 startup archives unpack\n")
    sizes = build_corpora.session_sizes(dpkg, "dpkg.log")
    assert len(sizes) == 3 and sum(sizes) == len(dpkg)
    history = b"\nStart-Date: 1\nCommandline: x\nEnd-Date: 1\n\nStart-Date: 2\nEnd-Date: 2\n"
    sizes = build_corpora.session_sizes(history, "history.log")
    assert sizes == [1, len(b"Start-Date: 1\nCommandline: x\nEnd-Date: 1\n\n"), len(b"Start-Date: 2\nEnd-Date: 2\n")]
    assert build_corpora.session_sizes(b"one file, one document\n", "npm-debug.log") == [23]


@pytest.mark.parametrize("name", build_corpora.CORPORA)
def test_corpora_json_describes_the_saved_lengths(name):
    """Every corpus, the new shapes (books, logs, data) included, is saved small with its statistics
    and how it was built."""
    index = json.loads((CORPORA / "corpora.json").read_text())
    path = CORPORA / f"{name}.npy"
    assert path.stat().st_size < 2 * 2**20
    lengths = np.load(path)
    assert lengths.dtype == np.int64 and lengths.min() >= 1
    entry = index[name]
    assert entry["built_from"] == build_corpora.BUILT_FROM[name]
    assert {k: entry[k] for k in entry if k != "built_from"} == pytest.approx(build_corpora.describe(lengths))
