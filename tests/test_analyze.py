"""``wlb analyze`` on a real corpus (.bin/.idx written from this Python's standard library): the
verdict does not hinge on the file order, the iteration count is the real one, blends follow their
weights, and the JSON carries the verdict."""

import json
import os
import sys
import sysconfig
from pathlib import Path

import numpy as np
import pytest
import yaml

from megatron_wlb.cli.main import main
from megatron_wlb.data.blend import blend, normalised_weights, parse_data_path, shuffle_documents
from megatron_wlb.data.indexed import read_idx_lengths
from megatron_wlb.sim.experiments import PAPER_VIRTUAL_STAGES, schedule_label
from megatron_wlb.sim.iteration import split_documents

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "scripts"))
from build_text_corpus import text_files, write_corpus  # noqa: E402


@pytest.fixture(scope="module")
def stdlib_corpora(tmp_path_factory):
    """The stdlib's top-level .py files as documents (4-byte tokens), in directory order and reversed,
    and a small config that gets a few dozen iterations out of them."""
    d = tmp_path_factory.mktemp("corpus")
    root = sysconfig.get_paths()["stdlib"]
    files = [f for f in text_files([root], "*.py") if os.path.dirname(f) == root]
    assert len(files) > 150
    write_corpus(str(d / "fwd"), files)
    write_corpus(str(d / "rev"), files[::-1])
    write_corpus(str(d / "half"), files[: len(files) // 2])
    cfg = {"name": "small_16k", "model": "550m", "seq_len": 16384, "layout": {"tp": 1, "cp": 2, "pp": 2, "dp": 1},
           "micro_batches": 4, "virtual_stages": PAPER_VIRTUAL_STAGES}  # analyze runs the config's schedule
    (d / "small.yaml").write_text(yaml.safe_dump(cfg))
    return d


def test_parse_data_path_reads_megatron_blends():
    assert parse_data_path(["0.7", "A", "0.3", "B"]) == [("A", 0.7), ("B", 0.3)]
    assert normalised_weights(parse_data_path(["2", "A", "6", "B"])) == [0.25, 0.75]
    assert parse_data_path(["A", "B"]) == [("A", None), ("B", None)]
    assert normalised_weights(parse_data_path("A B")) is None
    for bad, match in ((["0.7", "A", "0.3"], "odd"), (["-1", "A"], "positive"), (["A", "0.3"], "weight"),
                       (["0.5", "A", "0.5", "0.1"], "prefix"), ([], "empty"), (["nan", "A"], "positive"),
                       (["inf", "A", "1", "B"], "positive")):
        with pytest.raises(ValueError, match=match):
            parse_data_path(bad)


def test_blend_holds_each_weight_share_of_tokens():
    rng = np.random.default_rng(0)
    a = 2 * rng.integers(1, 250, size=4000) + 1  # odd lengths tag dataset a, even ones b
    b = 2 * rng.integers(1, 2500, size=4000)
    stream, used = blend([a, b], [0.25, 0.75])
    assert stream.size == sum(used) and min(a.size - used[0], b.size - used[1]) == 0
    share_a = np.cumsum(np.where(stream % 2 == 1, stream, 0)) / np.cumsum(stream)
    for k in (stream.size // 10, stream.size // 2, stream.size - 1):
        assert abs(share_a[k] - 0.25) < 0.02
    assert np.array_equal(stream[stream % 2 == 1], a[:used[0]])  # each dataset keeps its own order
    cat, used = blend([a, b], None)
    assert np.array_equal(cat, np.concatenate([a, b])) and used == [a.size, b.size]


def test_shuffle_is_seeded_megatron_style_permutation():
    x = np.arange(1, 1001)
    s1, s2 = shuffle_documents(x, 1234), shuffle_documents(x, 1234)
    assert np.array_equal(s1, s2) and not np.array_equal(s1, x)
    assert np.array_equal(np.sort(s1), x)
    order = np.arange(1000)
    np.random.RandomState(1234).shuffle(order)
    assert np.array_equal(s1, x[order])


def test_verdict_overlaps_across_file_orders_and_json(stdlib_corpora, capsys):
    cfg = str(stdlib_corpora / "small.yaml")
    verdicts = {}
    for name in ("fwd", "rev"):
        js = stdlib_corpora / f"{name}.json"
        assert main(["analyze", "--data-prefix", str(stdlib_corpora / name), "--config", cfg, "--shuffles", "5",
                     "--out", str(stdlib_corpora / f"out_{name}"), "--json", str(js)]) == 0
        verdicts[name] = json.loads(js.read_text())
    lengths = read_idx_lengths(stdlib_corpora / "fwd")
    for v in verdicts.values():
        assert v["shuffles"] == 5
        assert v["iterations"] == int(split_documents(lengths, 16384).sum()) // (4 * 16384)  # the whole stdlib_corpora
        assert set(v["speedup"]) == {"Plain-4D whole-doc", "Fixed-4D", "WLB-LLM", "Balanced concat-and-cut",
                                     "Megatron dyn-CP", "Fixed-greedy, window 4"}
        # the strongest baseline at equal delay is a baseline of the verdict, with every method's delay
        over_window = v["speedup_over"]["fixed-greedy, window 4"]
        assert set(over_window) == set(v["speedup"]) - {"Fixed-greedy, window 4"} | {"Plain-4D"}
        assert 0 < v["mean_delay_iterations"]["Fixed-greedy, window 4"] < 4
        assert any(line.startswith("Against the strongest baseline at equal delay") for line in v["recommendation"])
        # the config's schedule (here the README headline's), named beside the numbers
        assert v["schedule"] == schedule_label(PAPER_VIRTUAL_STAGES) != schedule_label(1)
        assert any(line.startswith("**Use ") for line in v["recommendation"])
        for s in v["speedup"].values():
            assert s["min"] <= s["mean"] <= s["max"]
    for method in ("WLB-LLM", "Fixed-4D"):
        a, b = verdicts["fwd"]["speedup"][method], verdicts["rev"]["speedup"][method]
        assert a["min"] <= b["max"] and b["min"] <= a["max"], (method, a, b)
    report = (stdlib_corpora / "out_fwd" / "report.md").read_text()
    assert verdicts["fwd"]["recommendation"][-1] in report
    out = capsys.readouterr().out
    verdict_title = next(line for line in out.splitlines() if line.startswith("Verdict:"))
    assert schedule_label(PAPER_VIRTUAL_STAGES) in verdict_title and "/ fixed-greedy, window 4" in out
    assert f"orderings per method, {schedule_label(PAPER_VIRTUAL_STAGES)}" in out
    assert "5 shuffles" in report and f"{verdicts['fwd']['iterations']} full iterations" in report
    assert (stdlib_corpora / "out_fwd" / "length_distribution.png").stat().st_size > 2000
    capsys.readouterr()


def test_fewer_iterations_than_asked_are_reported(stdlib_corpora, capsys):
    cfg = str(stdlib_corpora / "small.yaml")
    js = stdlib_corpora / "many.json"
    assert main(["analyze", "--data-prefix", str(stdlib_corpora / "half"), "--config", cfg, "--shuffles", "1",
                 "--iterations", "100000", "--out", str(stdlib_corpora / "out_many"), "--json", str(js)]) == 0
    err = capsys.readouterr().err
    got = json.loads(js.read_text())["iterations"]
    assert got < 100000 and f"so {got} were run" in err
    assert "**Warning:**" in (stdlib_corpora / "out_many" / "report.md").read_text()
    assert main(["analyze", "--data-prefix", str(stdlib_corpora / "half"), "--config", cfg, "--shuffles", "1",
                 "--iterations", "3", "--out", str(stdlib_corpora / "out_3"), "--json", str(js)]) == 0
    assert json.loads(js.read_text())["iterations"] == 3
    assert "A sample: the first 3 of" in (stdlib_corpora / "out_3" / "report.md").read_text()


def test_schedule_told_otherwise(stdlib_corpora, capsys):
    """``--virtual-stages 1`` runs plain 1F1B and says so in the verdict, the JSON and the report."""
    js = stdlib_corpora / "plain.json"
    assert main(["analyze", "--data-prefix", str(stdlib_corpora / "half"), "--config",
                 str(stdlib_corpora / "small.yaml"), "--shuffles", "1", "--iterations", "2", "--virtual-stages", "1",
                 "--out", str(stdlib_corpora / "out_plain"), "--json", str(js)]) == 0
    assert json.loads(js.read_text())["schedule"] == "plain 1F1B"
    assert "Verdict:" in capsys.readouterr().out
    assert "shuffles of 2 iterations, plain 1F1B" in (stdlib_corpora / "out_plain" / "report.md").read_text()


def test_blend_on_the_command_line(stdlib_corpora, capsys):
    cfg = str(stdlib_corpora / "small.yaml")
    js = stdlib_corpora / "blend.json"
    assert main(["analyze", "--data-path", "0.5", str(stdlib_corpora / "fwd"), "0.5", str(stdlib_corpora / "half"),
                 "--config", cfg, "--shuffles", "3", "--iterations", "4", "--out", str(stdlib_corpora / "out_b"),
                 "--json", str(js)]) == 0
    assert json.loads(js.read_text())["shuffles"] == 3
    report = (stdlib_corpora / "out_b" / "report.md").read_text()
    assert "blend 0.5 x" in report and "documents of the others are not read" in report
    assert main(["analyze", "--data-path", "0.5", str(stdlib_corpora / "fwd"), "0.5", "--config", cfg,
                 "--out", str(stdlib_corpora / "out_bad")]) == 2
    assert "odd" in capsys.readouterr().err


def test_recommendation_calls_documents_whole_only_when_it_clears_the_same_data():
    """The verdict's advice: balanced concat-and-cut (today's data) unless WLB-LLM with documents whole
    beats its mean in every ordering; the sentences name the cost of keeping documents whole."""
    from megatron_wlb.sim.report import Verdict, recommendation

    def verdict(wlb: list[float], cut: list[float]) -> Verdict:
        return Verdict({"Plain-4D": {"Plain-4D whole-doc": [0.85, 0.86], "WLB-LLM": wlb,
                                     "Balanced concat-and-cut": cut},
                        "Plain-4D whole-doc": {"Plain-4D": [1.17, 1.16], "WLB-LLM": [w / 0.855 for w in wlb],
                                               "Balanced concat-and-cut": [c / 0.855 for c in cut]}}, 10, 2)

    lines = recommendation(verdict([0.95, 0.97], [1.10, 1.12]))
    assert "costs 0.855x" in lines[0] and lines[-1].startswith("**Use `--wlb-pieces concat-and-cut`**")
    assert "faster here" in lines[-1]
    lines = recommendation(verdict([1.30, 1.34], [1.10, 1.12]))
    assert lines[-1].startswith("**Use WLB-LLM with documents whole**") and "1.189x" in lines[-1]  # 1.32 / 1.11
    lines = recommendation(verdict([1.05, 1.20], [1.10, 1.12]))  # overlapping: the same data wins
    assert lines[-1].startswith("**Use `--wlb-pieces concat-and-cut`**") and "spread" in lines[-1]
    assert recommendation(Verdict({"Plain-4D": {"WLB-LLM": [1.0]}}, 1, 1)) == []


def test_data_prefixes_holding_a_space_work_in_pack_bench_and_analyze(stdlib_corpora, tmp_path, capsys):
    """Issue 37 D12: a --data-path prefix in a folder whose name holds a space stays one prefix in every
    subcommand (the stream name quotes it), on a real .bin/.idx stdlib_corpora."""
    import shlex

    from megatron_wlb.cli.common import read_stream

    root = sysconfig.get_paths()["stdlib"]
    files = [f for f in text_files([root], "*.py") if os.path.dirname(f) == root]
    spaced = tmp_path / "my stdlib_corpora"
    spaced.mkdir()
    a, b = str(spaced / "part a"), str(spaced / "b")
    lengths_a, lengths_b = write_corpus(a, files[:80]), write_corpus(b, files[80:160])
    assert main(["pack", "--config", "550m_64k", "--data-path", "0.5", a, "0.5", b, "--json",
                 "--iterations", "2"]) == 0
    report = json.loads(capsys.readouterr().out)
    assert report["lengths"] == f"data-path:0.5 '{a}' 0.5 '{b}'" and report["iterations"] == 2
    assert shlex.split(report["lengths"][len("data-path:"):]) == ["0.5", a, "0.5", b]
    assert main(["pack", "--config", "550m_64k", "--data-path", a, "--json"]) == 0
    assert json.loads(capsys.readouterr().out)["documents_read"] == lengths_a.size
    assert read_stream(f"data-path:{shlex.join([b])}").size == lengths_b.size
    with pytest.raises(ValueError, match="No closing quotation.*quote a prefix holding a space"):
        read_stream(f"data-path:1 '{a}")
    assert main(["bench", "--config", "550m_64k", "--quick", "--iterations", "2", "--solver-iterations", "1",
                 "--lengths", "", "--data-path", "1", a, "1", b]) == 0
    assert f"data-path:1 '{a}' 1 '{b}'" in capsys.readouterr().out
    js = spaced / "analyze.json"
    assert main(["analyze", "--data-path", a, "--config", str(stdlib_corpora / "small.yaml"), "--shuffles", "1",
                 "--iterations", "2", "--out", str(spaced / "out"), "--json", str(js)]) == 0
    assert json.loads(js.read_text())["iterations"] == 2
