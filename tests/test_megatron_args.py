"""--wlb-* flags: provider composition, parsing real flag lists, and fail-fast misconfiguration checks."""

from __future__ import annotations

import argparse
import os

import pytest

from megatron_wlb.megatron.args.flags import (
    add_wlb_args,
    compose_providers,
    settings_from_args,
    wlb_extra_args_provider,
)
from megatron_wlb.megatron.args.settings import WlbSettings
from megatron_wlb.megatron.args.validation import (
    cost_model_from_args,
    num_microbatches_from_args,
    packing_config_from_args,
    validate_wlb_args,
)
from megatron_wlb.megatron.args.version import check_core_version, is_supported


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
    # main after PR #6742, dev, PR #7000 (tests/test_megatron_args.py::test_flags_that_bypass_ours_are_refused)
    g.add_argument("--sequence-packing-scheduler", type=str, default=None, choices=["dp_balanced"])
    g.add_argument("--use-varlen-dataset", action="store_true")
    g.add_argument("--dynamic-context-parallel", action="store_true")
    g.add_argument("--max-seqlen-per-dp-cp-rank", type=int, default=None)
    g.add_argument("--pipeline-p2p-fixed-shape", action="store_true")
    g.add_argument("--dataloader-inter-document-masking", action="store_true")
    g.add_argument("--dataloader-type", default=None, choices=["single", "cyclic", "external"])
    g.add_argument("--num-experts", type=int, default=None)
    g.add_argument("--position-embedding-type", default="learned_absolute", choices=["learned_absolute", "rope"])
    g.add_argument("--max-position-embeddings", type=int, default=None)
    g.add_argument("--moe-token-dispatcher-type", default="allgather", choices=["allgather", "alltoall", "flex"])
    g.add_argument("--cp-comm-type", nargs="+", type=str, default=["p2p"])
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
    args = parse(BASE + ["--export-te-mcore-model", "--wlb-packer", "fixed-greedy"], provider=provider)
    assert seen == ["modelopt"]
    assert args.export_te_mcore_model is True and args.wlb_packer == "fixed-greedy"
    # composing twice (apply() called twice, or a patched checkout that also passes ours) is harmless
    twice = compose_providers(provider, wlb_extra_args_provider())
    args2 = megatron_like_parser(twice).parse_args(BASE + ["--wlb-max-delay", "2"])
    assert args2.wlb_max_delay == 2
    # a provider that mutates in place and returns None keeps the parser
    in_place = compose_providers(lambda p: None, add_wlb_args)
    assert megatron_like_parser(in_place).parse_args(["--wlb-max-delay", "3"]).wlb_max_delay == 3


def settings_file(tmp_path, text: str) -> str:
    """A settings file (--wlb-config): the research knobs are YAML keys, not flags."""
    path = tmp_path / "settings.yaml"
    path.write_text(text)
    return str(path)


def test_defaults_and_full_flag_list(tmp_path):
    args = parse(BASE)
    s = validate_wlb_args(args, te_available=False, highspy_available=True, check_files=False)
    assert s == WlbSettings()
    assert args.variable_seq_lengths is True  # PP2: stages exchange per-micro-batch shapes
    assert args.moe_token_dispatcher_type == "alltoall"  # dense model: TransformerConfig needs it
    args = parse(BASE[:9] + ["1"] + BASE[10:], world_size=2)  # PP1: no shape exchange needed
    validate_wlb_args(args, te_available=False, highspy_available=True, check_files=False)
    assert args.variable_seq_lengths is False and args.moe_token_dispatcher_type == "allgather"
    moe = parse(BASE + ["--num-experts", "4"])
    with pytest.raises(ValueError, match="--moe-token-dispatcher-type alltoall"):
        validate_wlb_args(moe, te_available=False, highspy_available=True, check_files=False)
    research = settings_file(tmp_path, "packing: {queue_thresholds: [2048, 4096], num_queues: 3, window: 2}\n")
    args = parse(BASE + ["--wlb-packer", "wlb", "--wlb-config", research,
                         "--wlb-max-seq-len", "8192", "--wlb-max-delay", "3",
                         "--wlb-cp-sharding", "per-sequence", "--wlb-log-interval", "10"])
    s = validate_wlb_args(args, te_available=False, highspy_available=True, check_files=False)
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
    s = validate_wlb_args(args, te_available=False, highspy_available=True, check_files=False)
    assert s.config == "7b_128k" and s.packer == "wlb" and s.max_delay == 1 and s.num_queues == 2
    cost = cost_model_from_args(args, s)
    assert cost.layout.tp == 8 and cost.layout.cp == 2 and cost.model.hidden == 4096
    # the same config on a different layout is refused with what to change
    args = parse(flags[:7] + ["2"] + flags[8:] + ["--wlb-config", "7b_128k"], world_size=64)
    with pytest.raises(ValueError, match="pick the config of this layout"):
        validate_wlb_args(args, te_available=False, highspy_available=True, check_files=False)


@pytest.mark.parametrize("extra, match", [
    (["--wlb-max-seq-len", "2048"], r"--wlb-max-seq-len 2048 is below --seq-length 4096; raise"),
    (["--wlb-cp-sharding", "per-document-te"], r"transformer_engine is not installed"),
    (["--wlb-config", "no_such_config"], r"--wlb-config 'no_such_config' is neither a YAML file nor one of"),
    (["--wlb-config", "SETTINGS:packing: {queue_thresholds: [100000]}"],  # S_max defaults to 1.5 x seq_length
     r"packing.queue_thresholds 100000: 100000 exceeds the wlb micro-batch capacity max_seq_len=6144"),
    (["--position-embedding-type", "learned_absolute", "--max-position-embeddings", "4096"],
     r"raise --max-position-embeddings to 6144"),
    (["--wlb-cost-profile", "/nonexistent/profile.json"], r"no such file"),
    (["--mock-data"], r"--mock-data has no documents"),
    (["--hybrid-context-parallel"], r"--hybrid-context-parallel picks .*; remove it \(our equivalent: "
                                    r"--wlb-cp-sharding dynamic .*--wlb-cp-sharding adaptive"),
    (["--dataloader-type", "external"], r"use single or cyclic"),
])
def test_misconfigurations_fail_with_what_to_change(extra, match, tmp_path):
    extra = [settings_file(tmp_path, a[len("SETTINGS:"):]) if a.startswith("SETTINGS:") else a for a in extra]
    args = parse(BASE + extra)
    with pytest.raises(ValueError, match=match):
        validate_wlb_args(args, te_available=False, highspy_available=True, check_files=False)


@pytest.mark.parametrize("extra, equivalent", [
    (["--sequence-packing-scheduler", "dp_balanced"], "--wlb-packer wlb"),
    (["--use-varlen-dataset"], "--wlb-packer wlb with --data-path"),
    (["--dynamic-context-parallel"], "--wlb-cp-sharding dynamic"),
    (["--max-seqlen-per-dp-cp-rank", "2048"], "--wlb-max-seq-len"),
    (["--pipeline-p2p-fixed-shape"], "nothing to set: WLB turns the shape exchange on"),
])
def test_flags_that_bypass_ours_are_refused(extra, equivalent):
    """Flags of megatron-core 0.19 / main after #6742 / dev / PR #7000 that would replace or bypass what our hooks
    feed: refused in one line naming the flag and our equivalent, before Megatron's own checks of them."""
    from megatron_wlb.megatron.args.validation import StartupError, refuse_bypassing_flags

    args = parse(BASE + extra)
    with pytest.raises(ValueError) as err:
        validate_wlb_args(args, te_available=False, highspy_available=True, check_files=False)
    text = str(err.value)
    assert "\n" not in text and extra[0] in text and f"our equivalent: {equivalent}" in text, text
    with pytest.raises(StartupError, match=extra[0]):
        refuse_bypassing_flags(args)


def test_inter_document_masking_and_p2p_shape_flag_at_pp1_are_accepted():
    """--dataloader-inter-document-masking asks for per-document attention, which our micro-batches give (it is
    honoured, not refused); the fixed-shape p2p flag means nothing without pipeline stages."""
    from megatron_wlb.megatron.args.validation import refuse_bypassing_flags

    args = parse(BASE + ["--dataloader-inter-document-masking"])
    assert validate_wlb_args(args, te_available=False, highspy_available=True, check_files=False).packer == "wlb"
    pp1 = [*BASE[:8], "--pipeline-model-parallel-size", "1", *BASE[10:], "--pipeline-p2p-fixed-shape"]
    refuse_bypassing_flags(parse(pp1))
    validate_wlb_args(parse(pp1), te_available=False, highspy_available=True, check_files=False)


@pytest.mark.parametrize("sharding, expected", [("adaptive", "all_gather"), ("per-document", "all_gather"),
                                                ("per-document-te", "p2p")])
def test_cp_comm_type_is_what_our_attention_does(sharding, expected):
    """With CP > 1 our CP attention all-gathers K/V: args.cp_comm_type says so (Megatron-LM dev's TransformerConfig
    refuses local attention at CP > 1 otherwise); TransformerEngine's attention (per-document-te) keeps the flag."""
    cp2 = [*BASE[:8], "--pipeline-model-parallel-size", "1", *BASE[10:], "--context-parallel-size", "2"]
    args = parse(cp2 + ["--wlb-cp-sharding", sharding])
    args.cp_comm_type = "p2p"  # Megatron's validate_args unwraps a one-element list
    validate_wlb_args(args, te_available=True, highspy_available=True, check_files=False)
    assert args.cp_comm_type == expected
    args = parse(cp2 + ["--wlb-cp-sharding", sharding, "--cp-comm-type", "p2p", "a2a"])
    validate_wlb_args(args, te_available=True, highspy_available=True, check_files=False)
    assert args.cp_comm_type == ([expected] * 2 if expected == "all_gather" else ["p2p", "a2a"])


def test_data_path_files_are_checked_at_start_up(tmp_path):
    from megatron_wlb.data.reader import write_indexed_dataset

    real = write_indexed_dataset(str(tmp_path / "real_text_document"), [[1, 2, 3], [4, 5]])
    args = parse(BASE[:10] + ["--data-path", "0.5", real, "0.5", str(tmp_path / "missing")] + BASE[15:])
    with pytest.raises(ValueError, match=r"--data-path: no .*missing\.bin/\.idx") as err:
        validate_wlb_args(args, te_available=False, highspy_available=True)
    assert "real_text_document" not in str(err.value)
    args = parse(BASE[:10] + ["--data-path", real] + BASE[15:])
    assert validate_wlb_args(args, te_available=False, highspy_available=True).packer == "wlb"


def test_more_misconfigurations(capsys, tmp_path):
    args = parse([*BASE[:2], "--micro-batch-size", "2", *BASE[4:]])
    with pytest.raises(ValueError, match="set --micro-batch-size 1"):
        validate_wlb_args(args, te_available=False, highspy_available=True, check_files=False)
    args = parse(BASE + ["--wlb-packer", "fixed-solver"])
    with pytest.raises(ValueError, match="pip install highspy"):
        validate_wlb_args(args, te_available=False, highspy_available=False, check_files=False)
    assert validate_wlb_args(parse(BASE + ["--wlb-packer", "fixed-solver"]), te_available=False,
                             highspy_available=True, check_files=False).packer == "fixed-solver"
    s = validate_wlb_args(parse(BASE + ["--wlb-cp-sharding", "per-document-te"]), te_available=True,
                          highspy_available=True, check_files=False)
    assert s.cp_sharding == "per-document-te"
    # several problems are reported together
    args = parse([*BASE[:2], "--micro-batch-size", "4", *BASE[4:], "--wlb-max-seq-len", "100", "--mock-data"])
    with pytest.raises(ValueError) as err:
        validate_wlb_args(args, te_available=False, highspy_available=True, check_files=False)
    assert "\n" not in str(err.value) and "3 problems: (1) " in str(err.value) and "; (3) " in str(err.value)
    # argparse itself rejects unknown choices and values of the wrong type; ranges reach WlbSettings' check
    with pytest.raises(SystemExit):
        parse(BASE + ["--wlb-packer", "best"])
    with pytest.raises(ValueError, match="strictly increasing"):
        settings_from_args(parse(BASE + ["--wlb-config",
                                         settings_file(tmp_path, "packing: {queue_thresholds: [4096, 1024]}")]))
    with pytest.raises(ValueError, match="give 'auto' or comma-separated"):
        settings_from_args(parse(BASE + ["--wlb-config", settings_file(tmp_path, "packing: {queue_thresholds: big}")]))
    with pytest.raises(SystemExit):
        parse(BASE + ["--wlb-max-delay", "big"])
    assert "--wlb-max-delay" in capsys.readouterr().err


def test_version_check_admits_the_releases_ci_trains_with():
    from packaging.version import Version

    from megatron_wlb.megatron.args.version import TESTED_RELEASES

    # whichever CI installed; the wheel may add a local part (0.19.2+<git hash>)
    assert Version(check_core_version()).base_version in TESTED_RELEASES
    assert is_supported("0.16.1") and is_supported("0.19.2") and is_supported("0.19.3rc0")
    assert not is_supported("0.17.1") and not is_supported("0.18.2")  # nothing trains with them in CI
    assert is_supported("0.20.0")  # Megatron-LM main (a checkout; version.MAIN_COMMIT)
    assert not is_supported("0.15.3") and not is_supported("0.21.0") and not is_supported("1.0")
    with pytest.raises(RuntimeError, match=r"0.16.x: .*0.19.x: .*0.20.x: .*CI trains with 0.16.1, 0.19.2, 0.20.0"):
        check_core_version("0.18.0")
    with pytest.raises(ValueError, match="cannot read megatron-core version 'banana'"):
        is_supported("banana")


# -- apply() inside the pinned Megatron-LM training code (when a checkout or the mirror is present) --------

APPLY_SCRIPT = r'''
import json, os, sys, sysconfig
import megatron_wlb.megatron as W
rt = W.apply()
assert W.apply() is rt  # idempotent
import megatron.training.arguments as A, megatron.training.global_vars as GV
import megatron.training.training as T, megatron.training.checkpointing as C, megatron.training.utils as U
import megatron.training.initialize as I
hooked = {mod.__name__ + "." + name: hasattr(getattr(mod, name), "__wlb_original__") for mod, name in [
    (A, "parse_args"), (A, "validate_args"), (I, "parse_args"), (I, "validate_args"), (C, "save_checkpoint"),
    (T, "build_train_valid_test_data_iterators"), (T, "save_checkpoint"),
    (T, "load_checkpoint"), (T, "training_log"), (U, "get_batch_on_this_tp_rank")]}
from megatron_wlb.data.reader import byte_documents, write_indexed_dataset
root = sysconfig.get_paths()["stdlib"]
names = sorted(n for n in os.listdir(root) if n.endswith(".py"))[:10]
prefix = write_indexed_dataset(os.path.join(sys.argv[1], "text_document"),
                               byte_documents([os.path.join(root, n) for n in names]))
os.environ.update(WORLD_SIZE="1", RANK="0", LOCAL_RANK="0", MASTER_ADDR="127.0.0.1", MASTER_PORT=sys.argv[2])
base = ["pretrain_gpt.py", "--num-layers", "2", "--hidden-size", "64", "--num-attention-heads", "4",
        "--seq-length", "256", "--max-position-embeddings", "1024", "--micro-batch-size", "1",
        "--global-batch-size", "4", "--train-iters", "10", "--lr", "1e-4", "--data-path", prefix,
        "--tokenizer-type", "NullTokenizer", "--vocab-size", "257"]
sys.argv = base + ["--wlb-max-seq-len", "128"]
bad = A.parse_args(None)
try:
    A.validate_args(bad, {})
    bad_msg = ""
except ValueError as e:
    bad_msg = str(e)
sys.argv = base + ["--my-extra", "5", "--wlb-max-seq-len", "512", "--wlb-cp-sharding", "per-document"]
args = A.parse_args(lambda p: (p.add_argument("--my-extra", type=int, default=3), p)[1])
A.validate_args(args, {})
import torch.distributed as dist
from megatron.core import parallel_state
dist.init_process_group("gloo", rank=0, world_size=1)
parallel_state.initialize_model_parallel(1, 1)
GV.set_args(args)
import pretrain_gpt  # the pinned, unpatched script: apply() already rebound what it imported
from megatron.core.rerun_state_machine import RerunDataIterator
it = W.build_train_iterator(args, rt.settings, parallel_state.get_data_parallel_rank())
tokens, labels, loss_mask, attention_mask, position_ids, params = pretrain_gpt.get_batch(RerunDataIterator(it))
mb = it.current.for_dp_rank(0)[0]
# the data hook (its Megatron original needs CUDA for a flags broadcast; a loader-less one stands in)
from megatron_wlb.megatron.hooks import training_hooks
mods = {name: sys.modules["megatron.training." + name] for name in training_hooks.TRAINING_MODULES}
build = training_hooks.wrap_build_train_valid_test_data_iterators(
    lambda provider: (None, "megatron-valid", "megatron-test"), mods)
train_it, valid_it, test_it = build(None)
first = next(train_it)
hook = {"train": type(train_it.iterable).__name__, "valid": type(getattr(valid_it, "iterable", valid_it)).__name__,
        "test": test_it, "same_as_direct": first.tokens.tolist() == tokens.tolist(),
        "registered": len(rt.registry.iterators), "logged": rt.logger.metrics().tokens > 0}
print(json.dumps({"hooked": hooked, "bad": bad_msg, "my_extra": args.my_extra, "packing": rt.settings.packer,
                  "max_seq_len": rt.settings.max_seq_len, "T": tokens.shape[1], "expect_T": mb.tokens,
                  "labels_shift": bool((labels[0, :-1][loss_mask[0, :-1] > 0]
                                        == tokens[0, 1:][loss_mask[0, :-1] > 0]).all()),
                  "cu": params.cu_seqlens_q.tolist(), "shard_tokens": int(params.gather.num_tokens),
                  "qkv_format": params.qkv_format, "attention_mask": attention_mask is None, "hook": hook}))
'''


@pytest.mark.slow
def test_apply_inside_the_pinned_training_code(tmp_path):
    """apply() on Megatron's real parse_args/validate_args/get_batch (training code of the pinned commit)."""
    import json
    import socket
    import subprocess
    import sys

    from conftest import pinned_megatron_checkout

    code = str(pinned_megatron_checkout(tmp_path / "megatron-lm"))
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([code, root]), "PYTHONWARNINGS": "ignore"}
    proc = subprocess.run([sys.executable, "-c", APPLY_SCRIPT, str(tmp_path), str(port)], capture_output=True,
                          text=True, env=env, timeout=240, cwd=str(tmp_path))
    assert proc.returncode == 0, proc.stderr[-4000:]
    out = json.loads(proc.stdout.strip().splitlines()[-1])
    assert all(out["hooked"].values()), out["hooked"]
    assert "--wlb-max-seq-len 128 is below --seq-length 256" in out["bad"]
    assert out["my_extra"] == 5 and out["packing"] == "wlb" and out["max_seq_len"] == 512
    assert out["T"] == out["expect_T"] and out["labels_shift"]
    # CP size 1: this rank's shard (cp_hooks' query runs) holds every token of the micro-batch
    assert out["cu"][-1] == out["T"] and out["shard_tokens"] == out["T"]
    assert out["qkv_format"] == "thd" and out["attention_mask"]
    # the data hook: our iterator for training (same first micro-batch as built directly), our valid
    # iterator over the valid split, Megatron's test loader where the test share (1/1000) holds no document
    hook = out["hook"]
    # (training reads through the prefetching wrapper, megatron/data/prefetch.py; validation reads it directly)
    assert hook["train"] == "PrefetchingIterator" and hook["valid"] == "WlbDataIterator"
    assert hook["test"] == "megatron-test" and hook["same_as_direct"] and hook["registered"] == 1
    assert hook["logged"]


def test_help_prints_our_flags_without_megatrons(monkeypatch, capsys):
    """issue 20, item 12: Megatron 0.19.2's --help crashes on a stray '%'; ours prints the --wlb-* flags alone,
    from the launcher (before any Megatron import) and from the parse_args hook of a patched pretrain_gpt."""
    import sys

    import megatron_wlb.megatron as W
    from megatron_wlb.megatron.entry import launcher
    from megatron_wlb.megatron.hooks.training_hooks import wrap_parse_args

    def crashing_parse_args(*a, **k):  # what megatron-core 0.19.2's help does
        raise ValueError("unsupported format character ')' (0x29) at index 52")

    monkeypatch.setattr(W, "apply", lambda **k: (_ for _ in ()).throw(AssertionError("apply ran for --help")))
    launcher.main(["--num-layers", "2", "--help"])
    out = capsys.readouterr().out
    assert "--wlb-packer" in out and "--wlb-cp-sharding" in out and "arguments.py" in out
    monkeypatch.setattr(sys, "argv", ["pretrain_gpt.py", "-h"])
    with pytest.raises(SystemExit) as exit_info:
        wrap_parse_args(crashing_parse_args)()
    assert exit_info.value.code == 0 and "--wlb-max-seq-len" in capsys.readouterr().out
    monkeypatch.setattr(sys, "argv", ["pretrain_gpt.py", "--", "--help"])  # after "--": not ours
    with pytest.raises(ValueError, match="unsupported format"):
        wrap_parse_args(crashing_parse_args)()


def test_a_field_megatron_dropped_or_renamed_is_named_not_read_as_none():
    """Every field of the typed view outside ``MAY_BE_ABSENT`` must be on Megatron's args: one missing (a flag a
    release renamed) is named; those that some release lacks, or that Megatron sets later, are not."""
    import dataclasses

    from megatron_wlb.megatron.args.megatron_args import MAY_BE_ABSENT, MegatronArgs

    names = [f.name for f in dataclasses.fields(MegatronArgs)]
    full = argparse.Namespace(**dict.fromkeys(names))
    assert MegatronArgs.missing_fields(full) == []
    delattr(full, "non_persistent_global_ckpt_dir")
    for name in MAY_BE_ABSENT:
        delattr(full, name)
    assert MegatronArgs.missing_fields(full) == ["non_persistent_global_ckpt_dir"]
    assert set(MAY_BE_ABSENT) < set(names)  # the table names fields of the view, no stale ones


def test_start_up_stops_in_one_line_on_a_field_megatron_lacks():
    """``validate_args``'s hook names the missing field and the release instead of reading None for it."""
    import dataclasses

    pytest.importorskip("torch")
    from megatron_wlb.megatron.args.megatron_args import MAY_BE_ABSENT, MegatronArgs
    from megatron_wlb.megatron.args.validation import StartupError
    from megatron_wlb.megatron.hooks.training_hooks import wrap_validate_args

    args = argparse.Namespace(**{f.name: None for f in dataclasses.fields(MegatronArgs)
                                 if f.name not in MAY_BE_ABSENT and f.name != "seq_length"})
    with pytest.raises(StartupError, match=r"^megatron_wlb: Megatron's args lack seq_length \(megatron-core "
                                           r"[^)]+\): this release dropped or renamed them") as exc:
        wrap_validate_args(lambda a, defaults: a)(args)
    assert "\n" not in str(exc.value)
