"""The adapter as a table of hooks (issue 47): ``hooks.HOOKS`` lists every Megatron function megatron_wlb replaces,
and nothing else replaces one. After every phase is installed into a real Megatron (the installed megatron-core
wheel, and the pinned core_v0.16.1 checkout where the mirror is present), every attribute of Megatron's modules and
classes that changed is compared against the table: a replacement installed anywhere but ``hooks.install_hook``
(an unmarked value) or one the table does not list fails."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from megatron_wlb.megatron import hooks

ROOT = Path(__file__).resolve().parents[1]

#: run in a fresh process: apply() and every phase change the process for good
DIFF_SCRIPT = r'''
import importlib, json, sys, types
from megatron_wlb.megatron.compat import install_python_shims
install_python_shims()
MODULES = ["megatron.training." + m for m in ("arguments", "initialize", "training", "checkpointing", "utils",
                                               "global_vars")] + [
    "megatron.core.pipeline_parallel.schedules", "megatron.core.pipeline_parallel.p2p_communication",
    "megatron.core.distributed.finalize_model_grads", "megatron.core.transformer.attention",
    "megatron.core.transformer.torch_norm", "megatron.core.tensor_parallel.random", "megatron.core.datasets.utils",
    "megatron.core.utils", "megatron.core.model_parallel_config", "megatron.core.transformer.transformer_config",
    "megatron.core.datasets.data_schedule", "megatron.legacy.fused_kernels"]
for name in MODULES:
    try:
        importlib.import_module(name)
    except ImportError:
        pass


def snapshot():
    """{(module, attribute or Class.attribute): id of its value} of every loaded Megatron module."""
    out = {}
    for mod_name, module in list(sys.modules.items()):
        if not (mod_name == "megatron" or mod_name.startswith("megatron.")) or module is None:
            continue
        for attr, value in list(vars(module).items()):
            if isinstance(value, types.ModuleType):
                continue  # a submodule imported since: not a replacement
            out[(mod_name, attr)] = value
            if isinstance(value, type) and value.__module__ == mod_name:
                for cls_attr, cls_value in list(vars(value).items()):
                    out[(mod_name, f"{attr}.{cls_attr}")] = cls_value
    return out


def lookup(mod_name, path):
    value = sys.modules[mod_name]
    for part in path.split("."):
        value = getattr(value, part)
    return value


def unlisted(before, after):
    """Every changed attribute that no hooks.HOOKS entry accounts for."""
    from megatron_wlb.megatron import hooks

    problems = []
    for key, value in after.items():
        if key not in before or before[key] is value:
            continue
        mod_name, path = key
        names = hooks.hooks_in(lookup(mod_name, path))
        hook = hooks.BY_NAME.get(names[0]) if names else None
        if hook is None:
            problems.append(f"{mod_name}.{path}: replaced, not by a hooks.HOOKS entry")
        elif hook.everywhere and (path.split(".")[-1] != hook.attr or (hook.only and mod_name not in hook.only)):
            problems.append(f"{mod_name}.{path}: {hook.name} installed where the table does not put it")
        elif not hook.everywhere and (mod_name, path) != (hook.module, hook.attr):
            problems.append(f"{mod_name}.{path}: {hook.name} installed where the table does not put it")
    return problems


before = snapshot()
import megatron_wlb.megatron as W
from megatron_wlb.megatron import hooks, training_hooks
from megatron_wlb.megatron.cpu_redirects import install_megatron_redirects
from megatron_wlb.megatron.settings import WlbSettings

W.apply(middle_stage_batches=True)
training_hooks.install_validated_hooks(WlbSettings(cp_sharding="per-document"), pipeline=True)
install_megatron_redirects()
W.apply(middle_stage_batches=True)  # idempotent: nothing installed twice
training_hooks.install_validated_hooks(WlbSettings(cp_sharding="per-document"), pipeline=True)
after = snapshot()
clean = unlisted(before, after)
installed = sorted(h.name for h in hooks.HOOKS if hooks.is_installed(h.name))
stacked = sorted(h.name for h in hooks.HOOKS if hooks.hooks_in(hooks.current(h.name)).count(h.name) > 1)
# a replacement made outside the table must be caught
schedules = sys.modules["megatron.core.pipeline_parallel.schedules"]
schedules.get_forward_backward_func = lambda *a, **k: None
rogue = unlisted(before, snapshot())
print(json.dumps({"clean": clean, "rogue": rogue, "installed": installed, "stacked": stacked}))
'''


def _diff(env: dict[str, str], cwd: Path) -> dict:
    proc = subprocess.run([sys.executable, "-c", DIFF_SCRIPT], capture_output=True, text=True, env=env, timeout=300,
                          cwd=str(cwd))
    assert proc.returncode == 0, proc.stderr[-4000:]
    return json.loads(proc.stdout.strip().splitlines()[-1])


def test_the_table_is_well_formed():
    """Unique names, known phases, a one-line reason and releases for each, factories that exist."""
    pytest.importorskip("megatron.core")
    assert len({h.name for h in hooks.HOOKS}) == len(hooks.HOOKS)
    for hook in hooks.HOOKS:
        assert hook.phase in hooks.PHASES and hook.why and "\n" not in hook.why and hook.releases, hook
        assert callable(hooks._factory(hook)), hook
        assert not hook.only or hook.everywhere, hook
    # the 15 timing wrappers, the training loop's 8, the attention's 2 (SelfAttention.__init__ and RoPE: the
    # varlen record reaches RoPE through the params' cu_seqlens, no SelfAttention.forward wrapper; issue 47)
    assert sum(h.phase == "timing" for h in hooks.HOOKS) == 15
    assert sum(h.phase == "apply" and h.make.startswith("megatron_wlb.megatron.training_hooks:")
               for h in hooks.HOOKS) == 8
    assert sum(h.phase == "attention" for h in hooks.HOOKS) == 2


def test_only_the_table_replaces_megatron_functions_installed_wheel(tmp_path):
    """megatron-core 0.19 (the installed wheel): every phase installed, every change accounted for by the table."""
    import importlib.util

    pytest.importorskip("megatron.core")
    if importlib.util.find_spec("megatron.training") is None:
        pytest.skip("this megatron-core ships no megatron/training")
    env = {**os.environ, "PYTHONPATH": str(ROOT), "PYTHONWARNINGS": "ignore"}
    out = _diff(env, tmp_path)
    assert out["clean"] == [], out["clean"]
    assert out["stacked"] == []
    assert out["rogue"] == ["megatron.core.pipeline_parallel.schedules.get_forward_backward_func: replaced, not by a "
                            "hooks.HOOKS entry"]
    assert {"parse_args", "validate_args", "train_step", "forward_step", "SelfAttention.__init__",
            "P2PCommunicator._communicate_shapes", "initialize_megatron"} <= set(out["installed"])
    assert "get_batch_on_this_tp_rank" not in out["installed"]  # gone from core 0.18 on


@pytest.mark.slow
def test_only_the_table_replaces_megatron_functions_pinned_checkout(tmp_path):
    """The pinned core_v0.16.1 checkout: also the TP-rank batch, the THD pass-through and fused_kernels.load."""
    from conftest import pinned_megatron_checkout

    code = str(pinned_megatron_checkout(tmp_path / "megatron-lm"))
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([code, str(ROOT)]), "PYTHONWARNINGS": "ignore"}
    out = _diff(env, tmp_path)
    assert out["clean"] == [], out["clean"]
    assert out["stacked"] == []
    assert len(out["rogue"]) == 1
    assert {"get_batch_on_this_tp_rank", "get_thd_batch_on_this_cp_rank", "fused_kernels.load",
            "train_step"} <= set(out["installed"])
