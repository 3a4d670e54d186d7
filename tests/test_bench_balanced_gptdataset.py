"""benchmarks/bench_balanced_gptdataset.py: the balance targets in GPTDataset order (a short run on one stream)."""

from __future__ import annotations

import importlib.util
import json
from pathlib import Path

import pytest

pytestmark = pytest.mark.slow
pytest.importorskip("torch")
pytest.importorskip("megatron.core.datasets.gpt_dataset")

ROOT = Path(__file__).resolve().parents[1]


def _module():
    spec = importlib.util.spec_from_file_location("bench_balanced_gptdataset",
                                                  ROOT / "benchmarks" / "bench_balanced_gptdataset.py")
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


def test_a_short_run_writes_sane_targets(tmp_path):
    mod = _module()
    out = tmp_path / "balanced"
    assert mod.main(["--iterations", "4", "--streams", "stdlib", "--dp", "1", "--out", str(out)]) == 0
    result = json.loads(out.with_suffix(".json").read_text())
    assert result["versions"]["megatron-core"] != "not installed" and "cores" in result["machine"]
    assert result["targets"] == {"schedule_ratio": {"1": 1.01, "4": 1.02}, "fill_p5": 0.95, "mean_delay": 0.5}
    (table,) = result["tables"]
    assert (table["stream"], table["dp"], table["n"], table["seq_len"]) == ("stdlib", 1, 4, 131072)
    assert table["samples"] >= 4 * 4 and table["epochs"] >= 1
    base, off, on = table["rows"]
    assert [r["iterations"] for r in table["rows"]] == [4, 4, 4]
    assert base["packer"] == "original" and base["mean_delay"] == 0 and base["fill_p5"] == 1.0
    assert off["overrides"]["read_ahead"] is False and on["overrides"]["read_ahead"] is True
    assert off["early_tokens"] == 0  # read_ahead off trains no sample before the sampler gives it
    for r in table["rows"]:
        assert 0.9 < r["schedule_ratio"] < 2 and 0 < r["fill_p5"] <= 1.0 + 1e-9 and r["mean_delay"] >= 0
        assert r["pairs_per_token"] > 0
    md = out.with_suffix(".md").read_text()
    assert "| stdlib | 1 |" in md and "megatron-core" in md


def test_unknown_stream_fails_before_any_work():
    with pytest.raises(SystemExit, match="corpus 'nope' is not built"):
        _module().main(["--streams", "nope"])
