"""--wlb-* flags: provider composition, parsing real flag lists, and fail-fast misconfiguration checks."""

from __future__ import annotations

import argparse

import pytest

from megatron_wlb.megatron.args import (
    add_wlb_args,
    compose_providers,
    cost_model_from_args,
    num_microbatches_from_args,
    packing_config_from_args,
    settings_from_args,
    validate_wlb_args,
    wlb_extra_args_provider,
)
from megatron_wlb.megatron.settings import WlbSettings
from megatron_wlb.megatron.version import check_core_version, is_supported


def megatron_like_parser(extra_args_provider=None) -> argparse.ArgumentParser:
    """Megatron's parse_args shape: its parser, its own flags (the ones we read), then the provider slot."""
    parser = argparse.ArgumentParser(description="Megatron-LM Arguments", allow_abbrev=False)
    g = parser.add_argument_group(title="megatron")
    g.add_argument("--seq-length", type=int, default=None)
    g.add_argument("--micro-batch-size", type=int, default=None)
    g.add_argument("--global-batch-size", type=int, default=None)
    g.add_argument("--rampup-batch-size", nargs="*", default=None)
    g.add_argument("--tensor-model-parallel-size", type=int, default=1)
    g.add_argument("--pipeline-model-parallel-size", type=int, default=1)
    g.add_argument("--context-parallel-size", type=int, default=1)
    g.add_argument("--data-path", nargs="*", default=None)
    g.add_argument("--train-data-path", nargs="*", default=None)
    g.add_argument("--mock-data", action="store_true")
    g.add_argument("--split", type=str, default=None)
    g.add_argument("--seed", type=int, default=1234)
    g.add_argument("--num-layers", type=int, default=None)
    g.add_argument("--hidden-size", type=int, default=None)
    g.add_argument("--num-attention-heads", type=int, default=None)
    g.add_argument("--ffn-hidden-size", type=int, default=None)
    g.add_argument("--swiglu", action="store_true")
    g.add_argument("--hybrid-context-parallel", action="store_true")
    g.add_argument("--dataloader-type", default=None, choices=["single", "cyclic", "external"])
    if extra_args_provider is not None:
        parser = extra_args_provider(parser)
    return parser


def parse(flags: list[str], world_size: int = 8, provider=None):
    """Parse like Megatron and derive data_parallel_size as its validate_args does."""
    args = megatron_like_parser(provider or wlb_extra_args_provider()).parse_args(flags)
    args.data_parallel_size = world_size // (args.tensor_model_parallel_size * args.pipeline_model_parallel_size
                                             * args.context_parallel_size)
    args.variable_seq_lengths = False  # Megatron's validate_args forces it off
    return args


BASE = ["--seq-length", "4096", "--micro-batch-size", "1", "--global-batch-size", "8",
        "--tensor-model-parallel-size", "2", "--pipeline-model-parallel-size", "2",
        "--data-path", "0.7", "/data/a_text_document", "0.3", "/data/b_text_document",
        "--num-layers", "4", "--hidden-size", "256", "--num-attention-heads", "8"]


def test_provider_composes_with_an_existing_one():
    seen = []

    def modelopt_like(parser):
        parser.add_argument("--export-te-mcore-model", action="store_true")
        seen.append("modelopt")
        return parser

    provider = wlb_extra_args_provider(modelopt_like)
    args = parse(BASE + ["--export-te-mcore-model", "--wlb-packing", "fixed-greedy"], provider=provider)
    assert seen == ["modelopt"]
    assert args.export_te_mcore_model is True and args.wlb_packing == "fixed-greedy"
    # composing twice (apply() called twice, or a patched checkout that also passes ours) is harmless
    twice = compose_providers(provider, wlb_extra_args_provider())
    args2 = megatron_like_parser(twice).parse_args(BASE + ["--wlb-max-delay", "2"])
    assert args2.wlb_max_delay == 2
    # a provider that mutates in place and returns None keeps the parser
    in_place = compose_providers(lambda p: None, add_wlb_args)
    assert megatron_like_parser(in_place).parse_args(["--wlb-window", "3"]).wlb_window == 3


def test_defaults_and_full_flag_list():
    args = parse(BASE)
    s = validate_wlb_args(args, te_available=False, highspy_available=True)
    assert s == WlbSettings()
    assert args.variable_seq_lengths is True
    args = parse(BASE + ["--wlb-packing", "wlb", "--wlb-queue-thresholds", "2048,4096", "--wlb-num-queues", "3",
                         "--wlb-max-seq-len", "8192", "--wlb-max-delay", "3", "--wlb-window", "2",
                         "--wlb-cp-sharding", "per-sequence", "--wlb-log-interval", "10"])
    s = validate_wlb_args(args, te_available=False, highspy_available=True)
    assert s.queue_thresholds == (2048, 4096) and s.num_queues == 3 and s.max_seq_len == 8192
    assert (s.max_delay, s.window, s.cp_sharding, s.log_interval) == (3, 2, "per-sequence", 10)
    cfg = packing_config_from_args(args, s)
    # 8 GPUs / (TP2 x PP2) = DP2; 8 sequences of micro-batch 1 over DP2 -> 4 micro-batches per rank
    assert (cfg.seq_len, cfg.n, cfg.dp, cfg.capacity_var, cfg.seed) == (4096, 4, 2, 8192, 1234)
    assert num_microbatches_from_args(args) == 4


def test_config_supplies_defaults_and_flags_override_it():
    flags = ["--seq-length", "131072", "--micro-batch-size", "1", "--global-batch-size", "4",
             "--tensor-model-parallel-size", "8", "--context-parallel-size", "2",
             "--pipeline-model-parallel-size", "4", "--data-path", "/d/x", "--num-layers", "32",
             "--hidden-size", "4096", "--num-attention-heads", "32"]
    args = parse(flags + ["--wlb-config", "7b_128k", "--wlb-max-delay", "1"], world_size=64)
    s = validate_wlb_args(args, te_available=False, highspy_available=True)
    assert s.config == "7b_128k" and s.packing == "wlb" and s.max_delay == 1 and s.num_queues == 2
    cost = cost_model_from_args(args, s)
    assert cost.layout.tp == 8 and cost.layout.cp == 2 and cost.model.hidden == 4096
    # the same config on a different layout is refused with what to change
    args = parse(flags[:7] + ["2"] + flags[8:] + ["--wlb-config", "7b_128k"], world_size=64)
    with pytest.raises(ValueError, match="pick the config of this layout"):
        validate_wlb_args(args, te_available=False, highspy_available=True)


@pytest.mark.parametrize("extra, match", [
    (["--wlb-max-seq-len", "2048"], r"--wlb-max-seq-len 2048 is below --seq-length 4096; raise"),
    (["--wlb-cp-sharding", "per-document-te"], r"transformer_engine is not installed"),
    (["--wlb-config", "no_such_config"], r"--wlb-config 'no_such_config' is neither a YAML file nor one of"),
    (["--wlb-queue-thresholds", "100000"], r"exceeds the micro-batch capacity 4096"),
    (["--wlb-cost-profile", "/nonexistent/profile.json"], r"no such file"),
    (["--mock-data"], r"--mock-data has no documents"),
    (["--hybrid-context-parallel"], r"remove --hybrid-context-parallel"),
    (["--dataloader-type", "external"], r"use single or cyclic"),
])
def test_misconfigurations_fail_with_what_to_change(extra, match):
    args = parse(BASE + extra)
    with pytest.raises(ValueError, match=match):
        validate_wlb_args(args, te_available=False, highspy_available=True)


def test_more_misconfigurations():
    args = parse([*BASE[:2], "--micro-batch-size", "2", *BASE[4:]])
    with pytest.raises(ValueError, match="set --micro-batch-size 1"):
        validate_wlb_args(args, te_available=False, highspy_available=True)
    args = parse(BASE + ["--wlb-packing", "fixed-solver"])
    with pytest.raises(ValueError, match="pip install highspy"):
        validate_wlb_args(args, te_available=False, highspy_available=False)
    assert validate_wlb_args(parse(BASE + ["--wlb-packing", "fixed-solver"]), te_available=False,
                             highspy_available=True).packing == "fixed-solver"
    s = validate_wlb_args(parse(BASE + ["--wlb-cp-sharding", "per-document-te"]), te_available=True,
                          highspy_available=True)
    assert s.cp_sharding == "per-document-te"
    # several problems are reported together
    args = parse([*BASE[:2], "--micro-batch-size", "4", *BASE[4:], "--wlb-max-seq-len", "100", "--mock-data"])
    with pytest.raises(ValueError) as err:
        validate_wlb_args(args, te_available=False, highspy_available=True)
    assert str(err.value).count("\n  - ") == 3
    # argparse itself rejects unknown choices and bad thresholds reach WlbSettings' check
    with pytest.raises(SystemExit):
        parse(BASE + ["--wlb-packing", "best"])
    with pytest.raises(ValueError, match="strictly increasing"):
        settings_from_args(parse(BASE + ["--wlb-queue-thresholds", "4096,1024"]))
    with pytest.raises(ValueError, match="give 'auto' or comma-separated"):
        settings_from_args(parse(BASE + ["--wlb-queue-thresholds", "big"]))


def test_version_check_names_the_supported_range():
    assert check_core_version() == "0.16.1"  # the installed wheel CI tests against
    assert is_supported("0.16.0") and is_supported("0.19.2") and is_supported("0.17.0rc1")
    assert not is_supported("0.15.3") and not is_supported("0.20.0") and not is_supported("1.0")
    with pytest.raises(RuntimeError, match=r">=0.16 <0.20"):
        check_core_version("0.14.0")
