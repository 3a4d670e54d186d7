"""The launchers start jobs the start-up check accepts: for every shipped config, the flags of its
sbatch script (on the config's layout) and of scripts/launch_local.sh on one 8-GPU node (the layout
fitted to the node) pass ``validate_wlb_args`` after Megatron-style parsing, and resolve to the
config's packing choices. (tests/test_patch.py checks the same flags against the pinned Megatron's
own parser when a checkout is available.)"""

from __future__ import annotations

import argparse
import subprocess
from pathlib import Path

import conftest
import pytest

from megatron_wlb.config import list_configs, load_config
from megatron_wlb.megatron.args.flags import wlb_extra_args_provider
from megatron_wlb.megatron.args.validation import cost_model_from_args, packing_config_from_args, validate_wlb_args

ROOT = Path(__file__).resolve().parents[1]


def megatron_flags_parser() -> argparse.ArgumentParser:
    """The Megatron flags the start-up check reads, with Megatron's defaults, plus ours."""
    p = argparse.ArgumentParser(allow_abbrev=False)
    for flag in ("--seq-length", "--micro-batch-size", "--global-batch-size", "--num-layers", "--hidden-size",
                 "--num-attention-heads", "--ffn-hidden-size", "--max-position-embeddings", "--num-experts",
                 "--num-query-groups"):
        p.add_argument(flag, type=int, default=None)
    for flag in ("--tensor-model-parallel-size", "--pipeline-model-parallel-size", "--context-parallel-size"):
        p.add_argument(flag, type=int, default=1)
    p.add_argument("--seed", type=int, default=1234)
    p.add_argument("--data-path", nargs="*", default=None)
    p.add_argument("--position-embedding-type", default="learned_absolute")
    p.add_argument("--moe-token-dispatcher-type", default="allgather")
    for flag in ("--swiglu", "--group-query-attention", "--mock-data"):
        p.add_argument(flag, action="store_true")
    return wlb_extra_args_provider()(p)


def start_up_check(argv: list[str], world: int):
    args, _ = megatron_flags_parser().parse_known_args(argv)
    lay = args.tensor_model_parallel_size * args.context_parallel_size * args.pipeline_model_parallel_size
    assert world % lay == 0, (world, lay)
    args.data_parallel_size = world // lay
    args.variable_seq_lengths = False
    settings = validate_wlb_args(args, te_available=False, highspy_available=True, check_files=False)
    return args, settings


def fake_cluster(tmp_path: Path) -> dict:
    """One node: conftest's stub cluster environment."""
    env, _ = conftest.fake_cluster(tmp_path, nodes=("node-a",), nodelist="node-a")
    return env


def after_script(words: list[str]) -> list[str]:
    i = next(i for i, w in enumerate(words) if w.endswith("pretrain_gpt.py"))
    return words[i + 1:]


def same_packing(settings, run) -> None:
    assert settings.packer == run.packer and settings.cp_sharding == run.cp_sharding
    for name, value in settings.knob_values().items():
        assert value == getattr(run.packing, name), name


@pytest.mark.parametrize("name", list_configs())
def test_sbatch_flags_pass_the_start_up_check(name: str, tmp_path: Path):
    run = load_config(name)
    env = fake_cluster(tmp_path)
    nodes = max(1, run.layout.world_size // 8)
    res = subprocess.run(["bash", str(ROOT / "scripts" / "slurm" / f"{name}.sbatch")],
                         env={**env, "SLURM_NNODES": str(nodes)}, capture_output=True, text=True, timeout=60,
                         cwd=tmp_path)
    assert res.returncode == 0, res.stderr
    argv = after_script((tmp_path / "argv.txt").read_text().splitlines())
    args, settings = start_up_check(argv, run.layout.world_size)
    assert settings.config == name
    same_packing(settings, run)
    assert packing_config_from_args(args, settings).n == run.packing.n
    assert cost_model_from_args(args, settings).model.hidden == run.model.hidden


@pytest.mark.parametrize("name", list_configs())
def test_launch_local_on_one_8_gpu_node_passes_the_start_up_check(name: str, tmp_path: Path):
    run = load_config(name)
    env = {**fake_cluster(tmp_path), "NPROC": "8", "DRY_RUN": "1"}
    res = subprocess.run(["bash", str(ROOT / "scripts" / "launch_local.sh"), name], env=env, capture_output=True,
                         text=True, timeout=60, cwd=tmp_path)
    assert res.returncode == 0, res.stderr
    argv = after_script(res.stdout.split())
    args, settings = start_up_check(argv, 8)
    same_packing(settings, run)
    tp, cp, pp = args.tensor_model_parallel_size, args.context_parallel_size, args.pipeline_model_parallel_size
    assert 8 % (tp * cp * pp) == 0 and run.model.num_heads % tp == 0 and run.model.num_layers % pp == 0
    if (tp, cp, pp, args.data_parallel_size) == (run.layout.tp, run.layout.cp, run.layout.pp, run.layout.dp):
        assert settings.config == name
    else:
        assert settings.config is None  # --wlb-config would be refused on another layout


def test_the_config_flag_on_a_scaled_layout_is_what_the_check_refuses(tmp_path: Path):
    """Why launch_local drops --wlb-config when it rescales: the check refuses it (issue 13)."""
    env = {**fake_cluster(tmp_path), "NPROC": "8", "DRY_RUN": "1"}
    res = subprocess.run(["bash", str(ROOT / "scripts" / "launch_local.sh"), "7b_128k"], env=env,
                         capture_output=True, text=True, timeout=60, cwd=tmp_path)
    argv = after_script(res.stdout.split()) + ["--wlb-config", "7b_128k"]
    with pytest.raises(ValueError, match="pick the config of this layout"):
        start_up_check(argv, 8)
