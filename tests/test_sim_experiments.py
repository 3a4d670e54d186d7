"""Experiments, reports and CLIs: structure and sanity (not the packers' exact numbers)."""

from dataclasses import replace

import numpy as np
import pytest

from megatron_wlb.cli.main import main
from megatron_wlb.config import load_config
from megatron_wlb.costmodel import ParallelLayout
from megatron_wlb.sim.experiments import (
    CASE_METRICS,
    DYNCP,
    FIXED,
    MAIN_METHODS,
    PLAIN,
    WHOLE,
    WLB,
    Method,
    Table,
    breakdown_table,
    case_study_table,
    compare,
    table1,
    with_window,
)
from megatron_wlb.sim.report import ReproduceSettings, analyze, reproduce


def tiny(seq_len=16384, pp=4, dp=1, cp=2, tp=2):
    cfg = load_config("7b_64k")
    lay = ParallelLayout(tp=tp, cp=cp, pp=pp, dp=dp)
    return replace(cfg, name=f"tiny_{seq_len // 1024}k", seq_len=seq_len, layout=lay,
                   packing=replace(cfg.packing, seq_len=seq_len, n=pp, dp=dp, max_seq_len=None))


def bursty_stream(seq_len, n, iterations, long_first=False):
    """Per iteration: short documents, then n documents of seq_len/2 (or the other way round).
    Concat-and-cut puts two long documents into each of the last n/2 micro-batches and only short
    ones into the rest; spreading one long document per micro-batch is obviously better."""
    out = []
    for _ in range(iterations):
        longs = [seq_len // 2] * n
        shorts = [256] * (n * seq_len // 2 // 256)
        out += longs + shorts if long_first else shorts + longs
    return np.array(out, dtype=np.int64)


def test_wlb_beats_plain_where_it_obviously_should():
    cfg = tiny(seq_len=65536)
    lengths = bursty_stream(cfg.seq_len, cfg.micro_batches, 12)
    comp = compare(cfg, lengths, 8, (PLAIN, WLB))
    assert comp.speedup(PLAIN.name) == pytest.approx(1.0)
    assert comp.speedup(WLB.name) > 1.05
    assert comp.runs[WLB.name].pp_imbalance < comp.runs[PLAIN.name].pp_imbalance


def test_heavy_micro_batches_first_shorten_1f1b():
    # The same imbalanced micro-batches cost less when the heavy ones run first: under 1F1B the
    # first micro-batch's forward and the last one's backward are on the critical path.
    cfg = tiny(seq_len=65536)
    late = bursty_stream(cfg.seq_len, cfg.micro_batches, 6)
    heavy_first = Method("hf", "original", "per-sequence", order="heavy-first")
    comp = compare(cfg, late, 4, (PLAIN, heavy_first))
    assert comp.speedup("hf") > 1.01
    for a, b in zip(comp.runs["hf"].iterations, comp.runs[PLAIN.name].iterations):
        assert a.time <= b.time * (1 + 1e-9)
    assert comp.runs["hf"].pp_imbalance == pytest.approx(comp.runs[PLAIN.name].pp_imbalance)


def test_compare_tables_have_every_config_and_method():
    lengths = np.random.default_rng(1).integers(100, 12000, size=3000)
    comps = [compare(tiny(16384), lengths, 3), compare(tiny(32768), lengths, 3)]
    t = table1(comps)
    assert isinstance(t, Table)
    others = [m.name for m in MAIN_METHODS if m not in (PLAIN, WHOLE)]
    assert t.columns[3:] == (*[f"{m} / {b}" for m in others for b in ("concat-and-cut", "whole-document")],
                             "whole-document / concat-and-cut")
    names = t.column("config")
    assert names[:2] == ["tiny_16k", "tiny_32k"]
    speedups = [v for row in t.rows[:2] for v in row[3:]]
    assert all(np.isfinite(v) and 0.3 < v < 3.0 for v in speedups)
    # every cell is the throughput ratio of the two runs it names; the average row their geo-mean
    col = t.column(f"{WLB.name} / whole-document")
    for c, value in zip(comps, col):
        assert value == pytest.approx(c.runs[WLB.name].throughput / c.runs[WHOLE.name].throughput)
    assert col[t.column("config").index("**avg all** (geo-mean)")] == pytest.approx(np.sqrt(col[0] * col[1]))
    md = t.to_markdown()
    assert md.count("\n") == len(t.rows) + 1 + 2 * len(t.notes)
    b = breakdown_table(comps[0])
    assert b.column("method") == [m.name for m in MAIN_METHODS]
    assert b.column("speedup / whole-document")[1] == pytest.approx(1.0)
    for run in comps[0].runs.values():
        assert len(run.iterations) == 3 and run.tokens > 0
        assert run.packing_metrics["iterations"] == 3


def test_methods_use_their_layouts():
    lengths = np.random.default_rng(2).integers(100, 9000, size=2000)
    comp = compare(tiny(), lengths, 2, (PLAIN, FIXED, DYNCP))
    assert set(comp.runs[PLAIN.name].layouts) == {"per-sequence"}
    assert set(comp.runs[FIXED.name].layouts) == {"per-document"}
    assert set(comp.runs[DYNCP.name].layouts) == {"dynamic-cp"}


def test_s_max_factor_and_window():
    cfg = tiny()
    m = Method("w", "wlb", "adaptive", s_max_factor=1.3)
    assert m.packing_overrides(cfg)["max_seq_len"] % (2 * cfg.layout.cp) == 0
    assert m.packing_overrides(cfg)["max_seq_len"] >= 1.3 * cfg.seq_len
    w = with_window(load_config("7b_128k"), 163840)
    assert w.seq_len == w.packing.seq_len == 163840 and w.layout == load_config("7b_128k").layout
    with pytest.raises(ValueError, match="divisible"):
        with_window(load_config("7b_128k"), 1001)


def test_case_study_table_on_a_small_dp_layout():
    lengths = np.random.default_rng(3).integers(100, 12000, size=3000)
    comp = compare(tiny(pp=2, dp=2, cp=4, tp=1), lengths, 2, (PLAIN, WLB))
    t = case_study_table(comp)
    slowest = t.column("slowest GPU / mean (avg over iters)")
    assert all(s >= 1.0 for s in slowest)
    assert t.column("per-GPU metric") == [*CASE_METRICS, *CASE_METRICS]
    # each row is the metric it names, computed from the simulated iterations
    run = comp.runs[PLAIN.name]
    assert slowest[0] == pytest.approx(np.mean([r.gpu_compute_imbalance for r in run.iterations]))
    assert slowest[1] == pytest.approx(np.mean([r.gpu_attention_imbalance for r in run.iterations]))
    assert slowest[1] != pytest.approx(slowest[0])


def test_analyze_writes_report_and_figures(tmp_path):
    lengths = np.random.default_rng(4).integers(100, 12000, size=2000)
    streams = [lengths, lengths[::-1]]
    path, table, verdict = analyze(tmp_path / "a", tiny(), streams, 3, methods=(PLAIN, WHOLE, WLB), source="random",
                                   reference=lengths[:500])
    text = path.read_text()
    assert "| Plain-4D | 1.00 |" in text and verdict.shuffles == 2 and verdict.iterations == 3
    per_order = [compare(tiny(), s, 3, (PLAIN, WLB)).speedup(WLB.name) for s in streams]
    s = verdict.summary(PLAIN.name, WLB.name)
    assert s["min"] == pytest.approx(min(per_order)) and s["max"] == pytest.approx(max(per_order))
    assert f"{s['mean']:.3f} [{s['min']:.3f}, {s['max']:.3f}]" in text
    for png in ("speedups.png", "latency_distribution.png", "gantt.png", "length_distribution.png"):
        assert (tmp_path / "a" / png).stat().st_size > 2000
        assert f"({png})" in text


def test_reproduce_small_writes_all_sections(tmp_path):
    settings = ReproduceSettings(iterations=2, breakdown_iterations=2, sweep_iterations=1, case_iterations=1,
                                 s_max_sensitivity=(1.0, 1.5))
    lengths = np.random.default_rng(5).integers(100, 30000, size=6000)
    path = reproduce(tmp_path / "r", lengths, settings, configs=("7b_128k",), source="random")
    text = path.read_text()
    for heading in ("Speedup per Table 1 config", "Ablation", "Pipeline schedule sweep", "Breakdown on 7b_128k",
                    "Sensitivity to S_max", "Speedup vs context window", "8K-GPU case study", "Why ours differ"):
        assert heading in text
    assert len(list((tmp_path / "r").glob("*.png"))) == 5
    assert "| 7b_128k |" in (tmp_path / "r" / "readme.md").read_text()


def test_report_prose_follows_the_results():
    """The text quotes the numbers of the run it describes: two streams, two different texts, each
    holding its own averages (a hard-coded number would make this fail)."""
    from megatron_wlb.sim.experiments import average_speedup
    from megatron_wlb.sim.report import headline, run_reproduce, why_text

    settings = ReproduceSettings(iterations=2, breakdown_iterations=2, sweep_iterations=1, case_iterations=1,
                                 s_max_sensitivity=(1.5,))
    rng = np.random.default_rng(9)
    texts = []
    for lengths in (rng.integers(100, 30000, size=6000), rng.integers(100, 130000, size=3000)):
        res = run_reproduce(lengths, settings, configs=("7b_128k",))
        h = headline(res)
        assert h["whole_avg"] == pytest.approx(average_speedup(res.main, WLB.name, WHOLE.name))
        assert h["old"] == pytest.approx(average_speedup(res.grid[(1, False)], WLB.name, PLAIN.name))
        text = why_text(res)
        for key in ("v1_whole", "v2_whole", "v4_whole", "v1_cut"):
            assert f"{h[key]:.2f}x" in text
        bd = res.breakdown
        assert f"{bd.speedup('var-len packing + outlier delay', WHOLE.name):.2f}x over whole-document" in text
        texts.append(text)
    assert texts[0] != texts[1]


def _write_indexed_dataset(prefix, docs):
    torch = pytest.importorskip("torch")
    from megatron.core.datasets.indexed_dataset import IndexedDatasetBuilder

    builder = IndexedDatasetBuilder(f"{prefix}.bin", dtype=np.int32)
    for doc in docs:
        if len(doc) == 1:
            builder.add_item(torch.arange(doc[0], dtype=torch.int32))
            builder.end_document()
        else:  # a document of several sequences
            builder.add_document(torch.arange(sum(doc), dtype=torch.int32), list(doc))
    builder.finalize(f"{prefix}.idx")


def test_idx_lengths_from_a_real_megatron_dataset(tmp_path):
    from megatron_wlb.data.indexed import parse_idx, read_idx_lengths

    prefix = tmp_path / "corpus"
    docs = [(5,), (3, 4), (1,), (130,), (2, 2, 2)]
    _write_indexed_dataset(prefix, docs)
    expect = [sum(d) for d in docs]
    assert read_idx_lengths(prefix, backend="megatron").tolist() == expect
    assert read_idx_lengths(prefix, backend="parse").tolist() == expect
    assert read_idx_lengths(f"{prefix}.idx").tolist() == expect
    seq, doc_idx = parse_idx(prefix)
    assert seq.tolist() == [5, 3, 4, 1, 130, 2, 2, 2] and doc_idx.tolist() == [0, 1, 3, 4, 5, 8]
    # the .idx alone suffices
    lone = tmp_path / "lone"
    lone.with_suffix(".idx").write_bytes(prefix.with_suffix(".idx").read_bytes())
    assert read_idx_lengths(lone).tolist() == expect
    bad = tmp_path / "bad"
    bad.with_suffix(".idx").write_bytes(b"NOTANIDX" + bytes(40))
    with pytest.raises(ValueError, match="magic"):
        read_idx_lengths(bad)
    trunc = tmp_path / "trunc"
    trunc.with_suffix(".idx").write_bytes(prefix.with_suffix(".idx").read_bytes()[:40])
    with pytest.raises(ValueError, match="truncated"):
        read_idx_lengths(trunc)


def test_cli_simulate_analyze_reproduce(tmp_path, capsys):
    lengths_file = tmp_path / "lengths.txt"
    lengths_file.write_text("\n".join(str(x) for x in np.random.default_rng(6).integers(100, 20000, size=800)))
    assert main(["simulate", "--config", "7b_64k", "--iterations", "2", "--lengths", str(lengths_file),
                 "--json", str(tmp_path / "s.json")]) == 0
    out = capsys.readouterr().out
    assert "ms/iteration" in out and (tmp_path / "s.json").exists()
    import json

    rows = json.loads((tmp_path / "s.json").read_text())["iterations"]
    assert len(rows) == 2 and {"time_s", "bubble_fraction", "packing_imbalance", "micro_batch_latency_s",
                               "pp_rank_busy_s"} <= set(rows[0])
    assert main(["simulate", "--config", "7b_64k", "--iterations", "2", "--cp-sharding", "dynamic-cp",
                 "--packer", "original", "--lengths", str(lengths_file)]) == 0
    assert main(["analyze", "--lengths", str(lengths_file), "--config", "7b_64k", "--iterations", "2",
                 "--out", str(tmp_path / "an")]) == 0
    assert "WLB-LLM" in capsys.readouterr().out and (tmp_path / "an" / "report.md").exists()
    prefix = tmp_path / "ds"
    _write_indexed_dataset(prefix, [(int(x),) for x in np.random.default_rng(7).integers(100, 20000, size=400)])
    assert main(["analyze", "--data-prefix", str(prefix), "--config", "7b_64k", "--iterations", "2",
                 "--out", str(tmp_path / "an2")]) == 0
    assert main(["simulate", "--config", "7b_64k", "--iterations", "0", "--lengths", str(lengths_file)]) == 2
    assert "--iterations 0: must be a positive integer" in capsys.readouterr().err
    readme = tmp_path / "README.md"
    readme.write_text("# x\nbefore\n<!-- reproduce-table -->\nold table\n<!-- /reproduce-table -->\nafter\n")
    assert main(["reproduce", "--out", str(tmp_path / "rep"), "--iterations", "1", "--configs", "550m_64k",
                 "--lengths", str(lengths_file), "--page", str(readme)]) == 0
    assert (tmp_path / "rep" / "report.md").exists()
    text = readme.read_text()
    assert "old table" not in text and text.startswith("# x\nbefore\n") and text.endswith("after\n")
    assert (tmp_path / "rep" / "readme.md").read_text().strip() in text
    assert (tmp_path / "img" / "reproduce_speedups.png").stat().st_size > 2000


def test_calibrated_profile_drives_the_simulator(tmp_path, capsys):
    """A measured profile replaces the analytic kernels: doubling every measured latency slows the
    simulated iteration down, and the calibrated backward factors are used."""
    import json

    from megatron_wlb.costmodel import PROFILE_FORMAT, causal_pairs, get_model

    def profile(scale):
        lengths = np.array([128, 512, 2048, 8192, 32768, 131072])
        tokens = np.array([1024, 4096, 16384, 65536])
        attn = scale * (3.4e-11 * causal_pairs(lengths, lengths) + 2e-9 * lengths + 2e-5)  # ~H100, 7B
        lin = scale * (6.3e-7 * tokens + 2e-5)
        return {"format": PROFILE_FORMAT, "device": "synthetic", "model": get_model("7b").to_dict(), "tp": 1,
                "attention": {"lengths": lengths.tolist(), "fwd_s": attn.tolist(), "bwd_s": (2.4 * attn).tolist()},
                "linear": {"tokens": tokens.tolist(), "fwd_s": lin.tolist(), "bwd_s": (2.1 * lin).tolist()}}

    lengths_file = tmp_path / "l.txt"
    lengths_file.write_text("\n".join(str(x) for x in np.random.default_rng(8).integers(100, 20000, size=600)))
    times = []
    for scale in (1.0, 2.0):
        path = tmp_path / f"p{scale}.json"
        path.write_text(json.dumps(profile(scale)))
        out = tmp_path / f"s{scale}.json"
        assert main(["simulate", "--config", "7b_64k", "--iterations", "2", "--lengths", str(lengths_file),
                     "--cost-profile", str(path), "--json", str(out)]) == 0
        data = json.loads(out.read_text())
        assert "calibrated" in data["cost_model"]
        times.append(sum(r["time_s"] for r in data["iterations"]))
    capsys.readouterr()
    assert times[1] > 1.5 * times[0]


def test_one_progress_type_from_the_cli_to_the_simulator():
    """``sim.iteration.Progress`` is the only progress callback: ``simulate_stream``, ``compare`` and
    the CLI's tqdm bar all take or are ``progress(items, desc, total)``, and items pass unchanged."""
    from megatron_wlb.cli.common import tqdm_progress
    from megatron_wlb.costmodel import build_cost_model
    from megatron_wlb.sim.iteration import simulate_stream

    calls = []

    def progress(items, desc, total):
        calls.append((desc, total))
        return items

    cfg = tiny(seq_len=65536)
    lengths = bursty_stream(cfg.seq_len, cfg.micro_batches, 6)
    cost = build_cost_model(cfg.model, cfg.layout)
    quiet = simulate_stream(cfg, cost, "wlb", "adaptive", lengths, 3)
    shown = simulate_stream(cfg, cost, "wlb", "adaptive", lengths, 3, progress=progress)
    assert [r.time for r in shown.iterations] == [r.time for r in quiet.iterations]
    compare(cfg, lengths, 2, (PLAIN, WLB), progress=progress)
    assert calls == [(f"{cfg.name} wlb+adaptive", 3), (f"{cfg.name} {PLAIN.name}", 2), (f"{cfg.name} {WLB.name}", 2)]
    assert list(tqdm_progress(iter([1, 2, 3]), "test", None)) == [1, 2, 3]


def test_a_schedule_override_reaches_the_packers_objective_too():
    """``--virtual-stages`` / ``compare(virtual_stages=v)``: the simulator and the wlb packer's
    schedule objective (``packing.virtual_stages``) run the same schedule (it used to be the
    simulator only, so wlb ordered micro-batches for plain 1F1B under an interleaved headline)."""
    from megatron_wlb.cli.common import with_virtual_stages
    from megatron_wlb.config import load_config

    cfg = load_config("7b_128k")
    assert cfg.virtual_stages == cfg.packing.virtual_stages == 1
    for two in (cfg.with_virtual_stages(2), with_virtual_stages(cfg, 2)):
        assert two.virtual_stages == two.packing.virtual_stages == 2
