"""What ``wlb pack`` / ``wlb bench`` print and the ``wlb analyze`` figures show: every metric with its
unit and meaning, the pipeline schedule beside the numbers, a Gantt caption that says when an
iteration holds released outliers, a speedup legend that fits and covers no bar (issue 24, item 5)."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest

from megatron_wlb.cli.main import main


def test_pack_prints_every_metric_with_unit_and_meaning(capsys, tmp_path: Path):
    from megatron_wlb.cli.common import METRIC_LEGEND

    assert main(["pack", "--config", "550m_64k", "--iterations", "6", "--json"]) == 0
    keys = set(json.loads(capsys.readouterr().out))
    assert keys <= set(METRIC_LEGEND), f"metrics without a legend entry: {sorted(keys - set(METRIC_LEGEND))}"
    assert main(["pack", "--config", "550m_64k", "--iterations", "6"]) == 0
    out = capsys.readouterr().out.splitlines()
    assert out[0].startswith("# budget = DP x N x seq_len")
    rows = {line.split(":", 1)[0].strip(): line for line in out[1:]}
    assert set(rows) == keys
    for key, line in rows.items():
        unit, meaning = METRIC_LEGEND[key]
        assert f"# {meaning}" in line and unit in line, line
    assert "fraction of the budget" in rows["min_fill"] and "README" in rows["min_fill"]
    assert "iterations per token" in rows["mean_delay"]
    assert rows["schedule"].split(":", 1)[1].split("#")[0].strip() == "plain 1F1B"  # 550m_64k: virtual_stages 1


def test_pack_and_bench_help_carry_the_legend(capsys):
    from megatron_wlb.cli.common import METRIC_LEGEND

    for command in ("pack", "bench"):
        with pytest.raises(SystemExit):
            main([command, "--help"])
        text = " ".join(capsys.readouterr().out.split())
        for key in (METRIC_LEGEND if command == "pack" else ("min_fill", "schedule_ratio", "mean_delay")):
            assert " ".join(METRIC_LEGEND[key][1].split()) in text, (command, key)


def test_bench_names_the_schedule_beside_its_numbers(capsys, tmp_path: Path):
    assert main(["bench", "--quick", "--config", "550m_64k", "--iterations", "2", "--solver-iterations", "1",
                 "--out", str(tmp_path)]) == 0
    md = (tmp_path / "packing_bench.md").read_text()
    heading = next(line for line in md.splitlines() if line.startswith("## wlbllm"))
    assert heading.endswith("plain 1F1B)") and "slowest rank / balanced under plain 1F1B" in md
    assert "min fill [fraction of the budget]" in md
    assert json.loads((tmp_path / "packing_bench.json").read_text())["tables"][0]["schedule"] == "plain 1F1B"
    capsys.readouterr()


@pytest.fixture(scope="module")
def comparison():
    """7b_128k on the embedded stream, 12 iterations under interleaved 1F1B with events kept: WLB-LLM
    releases delayed outliers in some iterations."""
    from megatron_wlb.config import load_config
    from megatron_wlb.data import load_lengths
    from megatron_wlb.sim.experiments import ANALYZE_METHODS, compare

    return compare(load_config("7b_128k"), load_lengths(), 12, ANALYZE_METHODS, keep_events=True, virtual_stages=2)


def _saved_figures(monkeypatch) -> list:
    """Record every figure saved (``Figure.savefig``) so a test can inspect it after the call."""
    from matplotlib.figure import Figure

    saved: list = []
    original = Figure.savefig

    def savefig(self, *args, **kwargs):
        original(self, *args, **kwargs)
        saved.append(self)

    monkeypatch.setattr(Figure, "savefig", savefig)
    return saved


def test_gantt_says_when_an_iteration_holds_released_outliers(comparison, monkeypatch, tmp_path: Path):
    from megatron_wlb.sim.report import fig_gantt

    wlb = comparison.runs["WLB-LLM"].iterations
    held = [k for k, r in enumerate(wlb) if r.delayed_pieces]
    assert held, "no WLB-LLM iteration released a delayed outlier in 12 iterations"
    k = held[0]
    saved = _saved_figures(monkeypatch)
    fig_gantt(comparison, tmp_path / "gantt.png", iteration=k)
    titles = dict(zip(("Plain-4D", "WLB-LLM"), (ax.get_title() for ax in saved[-1].axes)))
    for name, title in titles.items():
        r = comparison.runs[name].iterations[k]
        assert title.startswith(f"{name}: ") and f"{r.tokens:,} tokens" in title and "ms per 1K tokens" in title
        assert ("held back from earlier iterations" in title) == (r.delayed_pieces > 0), title
        if r.delayed_pieces:
            assert f"{r.delayed_tokens:,} tokens: delayed outliers" in title
    assert "interleaved 1F1B, v = 2" in saved[-1].get_suptitle()


@pytest.mark.parametrize("configs", [1, 3])
def test_speedup_legend_fits_and_covers_no_bar(comparison, monkeypatch, tmp_path: Path, configs: int):
    from matplotlib.patches import Rectangle

    from megatron_wlb.sim.report import fig_speedups

    saved = _saved_figures(monkeypatch)
    fig_speedups([comparison] * configs, tmp_path / "speedups.png", "speedups")
    from matplotlib.backends.backend_agg import FigureCanvasAgg

    fig = saved[-1]
    canvas = FigureCanvasAgg(fig)  # the saved figure was closed: draw it again as it was saved
    canvas.draw()
    renderer = canvas.get_renderer()
    legends = [*fig.legends, *[ax.get_legend() for ax in fig.axes if ax.get_legend() is not None]]
    assert len(legends) == 1
    box = legends[0].get_window_extent(renderer)
    page = fig.bbox
    assert page.x0 - 1 <= box.x0 and box.x1 <= page.x1 + 1 and page.y0 - 1 <= box.y0 and box.y1 <= page.y1 + 1, \
        (box, page)
    ax = fig.axes[0]
    bars = [p for p in ax.patches if isinstance(p, Rectangle) and p.get_height() > 0]
    assert bars
    from matplotlib.transforms import Bbox

    for bar in bars:
        visible = Bbox.intersection(bar.get_window_extent(renderer), ax.bbox)  # bars are clipped to the axes
        assert visible is None or not box.overlaps(visible), "the legend covers a bar"
    labels = [t.get_text() for t in legends[0].get_texts()]
    assert "WLB-LLM" in " ".join(labels) and np.all([len(t) < 60 for t in labels])
