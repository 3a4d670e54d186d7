"""``wlb analyze --choose-layout`` (issue 59): the layouts it enumerates, the memory it prices (megatron-core's own
accounting), the ranking, the command as the README writes it, and its one-line errors."""

from __future__ import annotations

import itertools
import json
from pathlib import Path

import numpy as np
import pytest

from megatron_wlb.cli.main import main
from megatron_wlb.config import load_config
from megatron_wlb.costmodel import build_cost_model, get_model
from megatron_wlb.data import load_lengths
from megatron_wlb.sim.experiments import TABLE1_CONFIGS, compare
from megatron_wlb.sim.layout_search import (
    MemoryNeed,
    enumerate_layouts,
    layout_config,
    micro_batch_tokens,
    search,
)


@pytest.mark.parametrize("model,seq_len,gpus,batch,v", [("7b", 131072, 8, 4, 1), ("7b", 131072, 64, 4, 2),
                                                        ("70b", 131072, 64, 4, 1), ("550m", 65536, 12, 6, 1),
                                                        ("30b", 65536, 32, 8, 1)])
def test_enumeration_is_every_valid_layout_and_only_those(model: str, seq_len: int, gpus: int, batch: int, v: int):
    shape = get_model(model)
    choices = enumerate_layouts(shape, seq_len, gpus, batch, virtual_stages=v)
    assert choices
    for c in choices:
        lay = c.layout
        assert lay.tp * lay.cp * lay.pp * lay.dp == gpus
        assert lay.tp <= 8 and shape.num_heads % lay.tp == 0 and shape.num_kv_heads % lay.tp == 0
        assert shape.num_layers % lay.pp == 0 and seq_len % (2 * lay.cp) == 0
        assert batch % lay.dp == 0 and c.micro_batches == batch // lay.dp
        if c.virtual_stages > 1:
            assert shape.num_layers % (lay.pp * c.virtual_stages) == 0 and c.micro_batches % lay.pp == 0
    # and every valid one is there (an independent brute force over all 4-tuples)
    expected = {(tp, cp, pp, dp) for tp, cp, pp, dp in itertools.product(range(1, gpus + 1), repeat=4)
                if tp * cp * pp * dp == gpus and tp <= 8 and shape.num_heads % tp == 0 and shape.num_kv_heads % tp == 0
                and shape.num_layers % pp == 0 and seq_len % (2 * cp) == 0 and batch % dp == 0}
    got = {(c.layout.tp, c.layout.cp, c.layout.pp, c.layout.dp) for c in choices if c.virtual_stages == 1}
    assert got == expected
    assert len(choices) == len({(c.layout, c.virtual_stages) for c in choices})


@pytest.fixture(scope="module")
def megatron_memory_usage():
    """megatron-core's theoretical_memory_usage module, as the chooser imports it (seconds: it loads torch)."""
    pytest.importorskip("megatron.core")
    from megatron_wlb.cli.choose_layout import megatron_memory_module

    return megatron_memory_module()[0]


@pytest.mark.parametrize("name", TABLE1_CONFIGS)
def test_memory_is_megatron_cores_report_for_the_same_arguments(name: str, megatron_memory_usage, capsys):
    from megatron_wlb.cli.choose_layout import megatron_memory, megatron_namespace
    from megatron_wlb.sim.experiments import WLB

    cfg = load_config(name)
    for tokens in (cfg.seq_len, micro_batch_tokens(cfg, WLB)):
        need = megatron_memory(cfg, tokens)
        args = megatron_namespace(cfg, tokens, "selective")
        _, _, total_mib = megatron_memory_usage.report_theoretical_memory(args, num_microbatches=cfg.micro_batches)
        assert need.total_gib == pytest.approx(total_mib / 1024, rel=1e-12)
        # the arguments are the layout's: one CP rank's tokens, the distributed optimizer's DP x CP, SP at TP > 1
        assert args.seq_length == -(-tokens // cfg.layout.cp)
        assert args.data_parallel_size == cfg.layout.dp * cfg.layout.cp
        assert args.sequence_parallel == (cfg.layout.tp > 1)
        assert (args.tensor_model_parallel_size, args.context_parallel_size, args.pipeline_model_parallel_size) == \
            (cfg.layout.tp, cfg.layout.cp, cfg.layout.pp)
    assert "Theoretical memory footprints" in capsys.readouterr().out


def test_megatron_counts_the_models_parameters(megatron_memory_usage):
    """The namespace carries the model: megatron-core's weight count at TP = PP = DP = 1 without the distributed
    optimizer (18 bytes a parameter) is the cost model's parameter count, up to norms and vocabulary padding."""
    from megatron_wlb.cli.choose_layout import megatron_namespace

    for name in ("7b_128k", "70b_128k"):
        cfg = load_config(name)
        one = layout_config(cfg, enumerate_layouts(cfg.model, cfg.seq_len, 1, 1)[0])
        args = megatron_namespace(one, cfg.seq_len, "selective")
        args.use_distributed_optimizer = False
        params = megatron_memory_usage.compute_weight_and_optimizer_memory(args) / 18
        assert params == pytest.approx(cfg.model.parameters(), rel=2e-3)


def test_search_ranks_by_the_simulators_tokens_per_second():
    cfg = load_config("550m_64k")
    lengths = load_lengths("wlbllm")[:20000]
    choices = enumerate_layouts(cfg.model, cfg.seq_len, 4, 4)

    def memory(c, tokens):  # a stand-in budget: the layouts of TP x CP >= 2 fit, at most 1.25 x seq_len a micro-batch
        fits = c.layout.tp * c.layout.cp >= 2 and tokens <= 1.25 * c.seq_len
        return MemoryNeed(10.0, 10.0 if fits else 100.0)

    result = search(cfg, lengths, choices, 2, 40.0, memory, lambda c: build_cost_model(c.model, c.layout))
    speeds = [c.tokens_per_second for c in result.candidates]
    assert speeds == sorted(speeds, reverse=True) and len(speeds) >= 3
    assert {u.choice for u in result.unfit} == {c for c in choices if c.layout.tp * c.layout.cp < 2}
    assert all(c.memory.total_gib <= 40 for c in result.candidates)
    # S_max 1.5 x seq_len does not fit: WLB-LLM runs at S_max = seq_len; the stock packing at seq_len
    assert {c.method.name for c in result.candidates if c.cp_sharding != "dynamic"} == \
        {"WLB-LLM, S_max = seq_len", "Balanced concat-and-cut, S_max = seq_len", "Plain-4D"}
    # each candidate's figure is the simulator's own on that layout
    top = next(c for c in result.candidates if c.cp_sharding != "dynamic")
    at = layout_config(cfg, top.choice)
    run = compare(at, lengths, 2, [top.method], cost=build_cost_model(at.model, at.layout)).runs[top.method.name]
    assert top.tokens_per_second == pytest.approx(run.throughput, rel=1e-12)


def test_the_readme_command_runs_and_prints_the_flags(tmp_path: Path, capsys, megatron_memory_usage):
    out = tmp_path / "choice.json"
    rc = main(["analyze", "--lengths", "wlbllm", "--config", "7b_128k", "--choose-layout", "--gpus", "8",
               "--gpu-memory", "80", "--json", str(out)])
    printed = capsys.readouterr()
    assert rc == 0, printed.err
    data = json.loads(out.read_text())
    assert data["analytic"] is True and "analytic cost model" in printed.out
    speeds = [c["tokens_per_second"] for c in data["candidates"]]
    assert speeds and speeds == sorted(speeds, reverse=True)
    assert all(c["memory_gib"] <= 80 for c in data["candidates"]) and all(u["memory_gib"] > 80 for u in data["unfit"])
    assert len(data["candidates"]) and data["layouts"] == len({c["label"] for c in data["candidates"]}) + len(
        data["unfit"])
    best = data["candidates"][0]
    flags = data["best_flags"]
    line = " ".join(flags["megatron"])
    assert line in printed.out and " ".join(flags["wlb"]) in printed.out
    lay = best["layout"]
    for flag, value in (("--tensor-model-parallel-size", lay["tp"]), ("--context-parallel-size", lay["cp"]),
                        ("--pipeline-model-parallel-size", lay["pp"]), ("--seq-length", 131072),
                        ("--micro-batch-size", 1), ("--global-batch-size", 4)):
        assert f"{flag} {value}" in line
    assert flags["wlb"][:4] == ["--wlb-packer", best["packer"], "--wlb-cp-sharding", best["cp_sharding"]]
    # every candidate carries its own --wlb-* flags (the best's are the printed ones)
    assert best["wlb_flags"] == flags["wlb"]
    for c in data["candidates"]:
        assert c["wlb_flags"][:4] == ["--wlb-packer", c["packer"], "--wlb-cp-sharding", c["cp_sharding"]]
        assert ("--wlb-pieces" in c["wlb_flags"]) == (c["overrides"].get("pieces") == "concat-and-cut")
    # Megatron's own parser reads them, with the model's flags
    from megatron_wlb.cli.choose_layout import megatron_parser, model_flags

    parsed = megatron_parser().parse_args(model_flags(load_config("7b_128k")) + flags["megatron"])
    assert (parsed.tensor_model_parallel_size, parsed.context_parallel_size, parsed.pipeline_model_parallel_size) == \
        (lay["tp"], lay["cp"], lay["pp"])
    assert "layout 1/" in printed.err  # progress lines on stderr


def test_speedup_over_the_current_config_is_one_for_itself(tmp_path: Path, capsys, megatron_memory_usage):
    yaml = tmp_path / "small.yaml"
    yaml.write_text("model: 550m\nseq_len: 16384\nlayout: {tp: 1, cp: 2, pp: 2, dp: 2}\nmicro_batches: 4\n")
    out = tmp_path / "c.json"
    rc = main(["analyze", "--lengths", "wlbllm", "--config", str(yaml), "--choose-layout", "--gpus", "8",
               "--gpu-memory", "80", "--current-config", str(yaml), "--iterations", "2", "--json", str(out)])
    assert rc == 0, capsys.readouterr().err
    data = json.loads(out.read_text())
    same = [c for c in data["candidates"] if c["label"] == "TP1 CP2 PP2 DP2" and c["method"] == "WLB-LLM"]
    assert len(same) == 1 and same[0]["speedup_over_current"] == pytest.approx(1.0, rel=1e-12)
    assert all(np.isfinite(c["speedup_over_current"]) for c in data["candidates"])


@pytest.mark.parametrize("flags,named", [(["--gpus", "0", "--gpu-memory", "80"], "--gpus 0"),
                                         (["--gpus", "8", "--gpu-memory", "-1"], "--gpu-memory -1"),
                                         (["--gpus", "8"], "--gpu-memory"),
                                         (["--gpus", "7", "--gpu-memory", "80"], "--gpus 7"),
                                         (["--gpus", "8", "--gpu-memory", "80", "--current-config", "70b_128k"],
                                          "--current-config 70b_128k"),
                                         (["--gpus", "8", "--gpu-memory", "80", "--current-config", "7b_128k"],
                                          "not --gpus 8")])
def test_a_bad_value_is_one_line(flags: list[str], named: str, capsys):
    rc = main(["analyze", "--lengths", "wlbllm", "--config", "7b_128k", "--choose-layout", *flags])
    err = capsys.readouterr().err
    assert rc == 2 and named in err and len(err.strip().splitlines()) == 1, err
