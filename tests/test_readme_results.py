"""Numbers come from their results files: a number of the results page (benchmarks/results.md) that drifts from its
benchmark's latest recorded run fails here (rerun the benchmark with ``--page``), and so does the README's
headline table (``benchmarks/headline.py --write``)."""

from __future__ import annotations

import json
from pathlib import Path

from conftest import load_script

ROOT = Path(__file__).resolve().parents[1]
README = (ROOT / "benchmarks" / "results.md").read_text()  # the results page: every benchmark's block


def _result(name: str) -> dict:
    return json.loads((ROOT / "benchmarks" / "results" / f"{name}.json").read_text())


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


def test_the_layout_choice_block_is_the_recorded_run():
    """Issue 59: the chooser's predicted order beside the measured one on the results page is
    ``bench_layout_choice.py``'s recorded run (benchmarks/results/layout_choice.json)."""
    mod = load_script("bench_layout_choice")
    result = _result("layout_choice")
    block = README.split(mod.README_BEGIN, 1)[1].split(mod.README_END, 1)[0]
    assert block.strip() == mod.readme_summary(result).strip()
    # the figures the block states are the file's own
    assert f"`top_choice_over_best_measured` = {result['top_choice_over_best_measured']:.3f}" in block
    for layout in result["layouts"]:
        assert f"| {layout['label']} |" in block and f"{layout['measured_iteration_s']:.3f} [" in block


def test_the_agreement_table_is_the_recorded_run():
    mod = load_script("bench_plan_agreement")
    block = README.split(mod.README_MARKER + "\n", 1)[1].split(mod.README_END, 1)[0]
    assert block == mod.readme_block(_result("plan_agreement"))


def test_the_data_scale_tables_and_summary_are_the_recorded_run():
    """Issue 37: the training and CLI tables and the targets' summary at the largest size (1e9 documents,
    or what this machine allowed) are ``bench_data_scale.py``'s recorded run."""
    mod = load_script("bench_data_scale")
    result = _result("data_scale")
    for marker, table in ((mod.README_MARK, mod.training_table(result)), (mod.README_CLI_MARK, mod.cli_table(result))):
        after = README.split(marker + "\n", 1)[1]
        assert after.startswith(table), f"README's table after {marker} is not benchmarks/results/data_scale.json's"
    block = README.split(mod.README_BEGIN, 1)[1].split(mod.README_END, 1)[0]
    assert block.strip() == mod.readme_summary(result).strip()
    assert max(row["documents"] for row in result["cli_rows"]) == max(row["documents"] for row in result["rows"])


def test_the_readme_headline_is_the_recorded_results():
    mod = load_script("headline")
    readme = (ROOT / "README.md").read_text()
    block = readme.split(mod.BEGIN + "\n", 1)[1].split(mod.END, 1)[0]
    assert block == mod.current()


def test_the_reproduce_block_is_the_recorded_report():
    block = README.split("<!-- reproduce-table -->", 1)[1].split("<!-- /reproduce-table -->", 1)[0]
    assert block.strip() == (ROOT / "benchmarks" / "results" / "reproduce" / "readme.md").read_text().strip()


def test_the_main_scheduler_tables_are_the_recorded_runs():
    """Main's dp_balanced and dev's default_dynamic_cp against wlb (benchmarks/bench_main_scheduler.py)."""
    mod = load_script("bench_main_scheduler")
    assert mod.readme_table(_result("main_scheduler")).strip() in README
    assert mod.dynamic_readme_table(_result("dynamic_cp_scheduler")).strip() in README


def test_the_docs_batch_path_and_layout_build_numbers_are_the_recorded_runs():
    """docs/megatron_launch.md's host cost of the batch path and docs/cp.md's layout build times quote the latest
    ``bench_batch_path`` / ``bench_layouts`` results (rounded as printed)."""
    rows = _result("batch_path")["rows"]
    launch = " ".join((ROOT / "docs" / "megatron_launch.md").read_text().split())

    def span(key: str, fmt: str) -> str:
        values = [r[key] for r in rows]
        return f"{format(min(values), fmt)} to {format(max(values), fmt)}"

    for quoted in (f"takes {span('plan_ms', '.2f')} ms", f"upload {span('upload_ms', '.2f')} ms",
                   f"takes {span('per_layer_before_ms', '.2f')} ms", f"saves {span('saved_ms', '.1f')} ms"):
        assert quoted in launch, f"docs/megatron_launch.md does not say {quoted!r} (rerun bench_batch_path.py)"
    timing = _result("cp_layouts")["timing"]["layouts"]
    cp_doc = " ".join((ROOT / "docs" / "cp.md").read_text().split())
    names = ("per-sequence", "per-document", "adaptive", "hybrid")
    build = ", ".join(f"{timing[n]['build_cpu_ms_median']:.2f} ms ({n})" for n in names)
    tokens = " / ".join(f"{timing[n]['with_rank_tokens_cpu_ms_median']:.2f}" for n in names)
    assert build in cp_doc, f"docs/cp.md does not say {build!r} (rerun bench_layouts.py)"
    assert f"{tokens} ms" in cp_doc, f"docs/cp.md does not say {tokens!r} ms (rerun bench_layouts.py)"


def test_the_paper_comparison_table_is_the_recorded_run():
    mod = load_script("bench_packing")
    assert mod.paper_table(_result("packing_bench")).strip() in README


def test_the_readme_stays_a_front_page():
    """The README is the quick start, what it does, when it pays, the headline and status (issue 60): at most 250
    lines, the rest in docs/, and every docs page it links exists."""
    import re

    text = (ROOT / "README.md").read_text()
    lines = text.splitlines()
    assert len(lines) <= 250, f"README.md has {len(lines)} lines: move detail into docs/"
    for target in re.findall(r"\]\(((?:docs|benchmarks)/[^)#]+)", text):
        assert (ROOT / target).exists(), f"README links {target}, which does not exist"
