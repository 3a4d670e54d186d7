"""benchmarks/bench_moe.py: MoE jobs beside their dense counterparts on the corpora (a short run), and the
docs' numbers are the recorded run's."""

from __future__ import annotations

import json
import re
from pathlib import Path

import pytest
from conftest import load_script

ROOT = Path(__file__).resolve().parents[1]


def test_a_short_run_writes_both_jobs_per_config(tmp_path):
    mod = load_script("bench_moe")
    out = tmp_path / "moe"
    assert mod.main(["--iterations", "2", "--streams", "wlbllm", "--configs", "qwen3_30b_a3b_64k",
                     "--out", str(out)]) == 0
    result = json.loads(out.with_suffix(".json").read_text())
    (row,) = result["rows"]
    assert row["moe"]["layout"] == "TP1-CP4-PP4-DP4-EP8" and row["dense"]["layout"] == "TP1-CP4-PP4-DP4"
    assert row["dense"]["model"] == "qwen3-30b-a3b-dense"
    for kind in ("moe", "dense"):
        assert all(v > 0 for v in row[kind]["speedup"].values())
    assert 0 < row["moe"]["attention_share"]["mean"] < row["dense"]["attention_share"]["mean"] < 1
    assert "| wlbllm | qwen3_30b_a3b_64k |" in out.with_suffix(".md").read_text()


def test_dense_configs_are_refused():
    mod = load_script("bench_moe")
    with pytest.raises(SystemExit):
        mod.main(["--configs", "7b_64k"])


def test_the_docs_table_and_sentence_are_the_recorded_run():
    mod = load_script("bench_moe")
    result = json.loads((ROOT / "benchmarks" / "results" / "moe_verdict.json").read_text())
    docs = (ROOT / "docs" / "simulator.md").read_text()
    assert mod.DOCS_MARK + "\n" + mod.summary_table(result) in docs
    assert len({r["stream"] for r in result["rows"]}) == 9 and len(result["configs"]) == 4
    means = {s: mod.corpus_means(result, s) for s in {r["stream"] for r in result["rows"]}}
    ratios = [g[f"moe {m}"] / g[f"dense {m}"] for g in means.values() for m in ("WLB-LLM", "Balanced concat-and-cut")]
    assert "within 4% either way" in docs and all(0.96 <= r <= 1.04 for r in ratios)
    drops = [g["dense attention"] - g["moe attention"] for g in means.values()]
    assert "share by 0.04 to 0.06" in docs and all(0.035 <= d < 0.065 for d in drops)
    w = means["wlbllm"]
    sentence = f"wlbllm {w['moe WLB-LLM']:.3f}x against {w['dense WLB-LLM']:.3f}x"
    assert re.sub(r"\s+", " ", sentence) in re.sub(r"\s+", " ", docs)
