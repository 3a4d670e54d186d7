"""benchmarks/bench_verdict.py: the per-corpus verdict table (a short run on the embedded stream)."""

from __future__ import annotations

import importlib.util
import json
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]


def _module():
    spec = importlib.util.spec_from_file_location("bench_verdict", ROOT / "benchmarks" / "bench_verdict.py")
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


def test_a_short_run_writes_the_table_and_the_readme(tmp_path, monkeypatch):
    mod = _module()
    out = tmp_path / "verdict"
    assert mod.main(["--iterations", "3", "--streams", "wlbllm", "--configs", "550m_64k,7b_64k",
                     "--out", str(out)]) == 0
    result = json.loads(out.with_suffix(".json").read_text())
    assert [(r["stream"], r["config"]) for r in result["rows"]] == [("wlbllm", "550m_64k"), ("wlbllm", "7b_64k")]
    for r in result["rows"]:
        assert set(r["speedup"]) == {"Plain-4D whole-doc", "WLB-LLM", "Balanced concat-and-cut"}
        assert all(v > 0 for v in r["speedup"].values())
    assert result["advice"]["wlbllm"][-1].startswith("**Use ")
    md = out.with_suffix(".md").read_text()
    assert "| wlbllm | 550m_64k |" in md and result["advice"]["wlbllm"][-1] in md
    readme = tmp_path / "README.md"
    readme.write_text("intro\n<!-- verdict-table -->\n| old |\n|---|\nafter\n")
    mod.update_readme(result, readme)
    text = readme.read_text()
    assert "| old |" not in text and text.endswith("after\n") and "| wlbllm | " in text


def test_unknown_inputs_fail_before_any_work():
    mod = _module()
    with pytest.raises(SystemExit, match="corpus 'nope' is not built"):
        mod.main(["--streams", "nope"])
    with pytest.raises(FileNotFoundError, match="no config 'nope'"):
        mod.main(["--configs", "nope"])
