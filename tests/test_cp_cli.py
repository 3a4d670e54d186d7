"""``wlb shard``: the JSON-lines contract, profiles of both formats, and clear input errors."""

from __future__ import annotations

import json

import numpy as np

from megatron_wlb.cli.main import main
from megatron_wlb.cp import build_layout
from megatron_wlb.cp.efficiency import default_table


def _write(tmp_path, rows):
    path = tmp_path / "mbs.jsonl"
    path.write_text("\n".join(json.dumps(r) for r in rows) + "\n\n")
    return path


def test_shard_writes_the_contract(tmp_path, capsys):
    rows = [[5, 1, 3, 10], [8, 8], [1]]
    mbs = _write(tmp_path, rows)
    out = tmp_path / "out" / "shards.jsonl"
    for layout in ("per-sequence", "per-document", "per-document-te", "adaptive", "hybrid"):
        assert main(["shard", "--micro-batches", str(mbs), "--cp", "2", "--cp-sharding", layout,
                     "--out", str(out)]) == 0
        lines = [json.loads(x) for x in out.read_text().splitlines()]
        assert len(lines) == len(rows)
        for row, line in zip(rows, lines):
            assert set(line) == {"layout", "padded_lengths", "ranks"}
            assert line == build_layout(layout, row, 2).to_json()
            total = sum(line["padded_lengths"])
            owned = sorted(p for rank in line["ranks"] for a, b in rank for p in range(a, b))
            assert owned == list(range(total))
        if layout == "per-document-te":
            assert lines[1]["ranks"][0] == [[0, 2], [6, 10], [14, 16]]
            assert lines[0]["padded_lengths"] == [8, 4, 4, 12]
        else:
            assert [x["padded_lengths"] for x in lines] == rows
    text = capsys.readouterr().out
    assert "imbalance" in text and "3 micro-batches" in text


def test_shard_profile_formats(tmp_path):
    mbs = _write(tmp_path, [[64] * 16, [8, 8, 8, 8, 480]])
    eff = tmp_path / "eff.json"
    default_table().to_json(eff)
    out = tmp_path / "o.jsonl"
    assert main(["shard", "--micro-batches", str(mbs), "--cp", "4", "--cp-sharding", "adaptive",
                 "--kernel-table", str(eff), "--out", str(out)]) == 0
    first = json.loads(out.read_text().splitlines()[0])
    assert first["layout"] == "per-sequence"        # 8-token shards waste most of a 128-token tile
    assert main(["shard", "--micro-batches", str(mbs), "--cp", "4", "--cp-sharding", "adaptive", "--tile", "1",
                 "--kernel-table", str(eff), "--out", str(out)]) == 0
    bad = tmp_path / "bad.json"
    bad.write_text(json.dumps({"format": "nope"}))
    assert main(["shard", "--micro-batches", str(mbs), "--cp", "4", "--cp-sharding", "adaptive",
                 "--kernel-table", str(bad), "--out", str(out)]) == 2


def test_shard_input_errors(tmp_path, capsys):
    out = tmp_path / "o.jsonl"
    bad = tmp_path / "bad.jsonl"
    for text, message in (("[1, 2]\n[3, x]\n", "bad.jsonl:2: not valid JSON"),
                          ('{"a": 1}\n', "expected a JSON list"),
                          ("[4, 0]\n", ">= 1")):
        bad.write_text(text)
        assert main(["shard", "--micro-batches", str(bad), "--cp", "2", "--cp-sharding", "per-document",
                     "--out", str(out)]) == 2
        assert message in capsys.readouterr().err
    assert main(["shard", "--micro-batches", str(tmp_path / "none"), "--cp", "2", "--cp-sharding", "per-document",
                 "--out", str(out)]) == 2
    bad.write_text("[3]\n")
    assert main(["shard", "--micro-batches", str(bad), "--cp", "0", "--cp-sharding", "per-document",
                 "--out", str(out)]) == 2
    assert "--cp 0: must be 1 .. 65536" in capsys.readouterr().err
    assert np.array_equal(build_layout("per-document", [3], 1).rank_tokens, [3])
