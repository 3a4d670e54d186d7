"""README numbers come from their results files: a README number that drifts from its benchmark's
latest recorded run fails here (rerun the benchmark with ``--readme``)."""

from __future__ import annotations

import json
from pathlib import Path

from conftest import load_script

ROOT = Path(__file__).resolve().parents[1]
README = (ROOT / "README.md").read_text()


def _result(name: str) -> dict:
    return json.loads((ROOT / "docs" / "results" / f"{name}.json").read_text())


def test_the_verdict_table_is_the_recorded_run():
    mod = load_script("bench_verdict")
    assert mod.summary_table(_result("verdict")).strip() in README


def test_the_balanced_gptdataset_sentences_are_the_recorded_run():
    mod = load_script("bench_balanced_gptdataset")
    block = README.split(mod.README_BEGIN, 1)[1].split(mod.README_END, 1)[0]
    assert block.strip() == mod.readme_summary(_result("balanced_gptdataset")).strip()


def test_the_paired_block_is_the_recorded_run():
    mod = load_script("bench_paired")
    block = README.split(mod.README_BEGIN, 1)[1].split(mod.README_END, 1)[0]
    assert block.strip() == mod.readme_summary(_result("paired")).strip()


def test_the_main_scheduler_tables_are_the_recorded_runs():
    """Main's dp_balanced and dev's default_dynamic_cp against wlb (scripts/bench_main_scheduler.py)."""
    mod = load_script("bench_main_scheduler")
    assert mod.readme_table(_result("main_scheduler")).strip() in README
    assert mod.dynamic_readme_table(_result("dynamic_cp_scheduler")).strip() in README
