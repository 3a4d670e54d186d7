"""The adapter as a table of hooks (issues 47, 60): ``hooks.HOOKS`` lists every Megatron function megatron_wlb replaces,
and nothing else replaces one. After every phase is installed into a real Megatron (the installed megatron-core
wheel, and the core_v0.16.1, core_v0.19.0, main, main after #6742 and dev checkouts where the Megatron-LM mirror holds
them: conftest.megatron_checkout), the hooks installed are exactly those the table gives that release, and every
attribute of Megatron's modules and classes that changed is compared against the table: a replacement installed
anywhere but ``hooks.install_hook`` (an unmarked value) or one the table does not list fails. A Megatron function a
required hook replaces, removed from the real module (as a release renaming it would), stops the phase in one line
before anything of it is installed."""

from __future__ import annotations

import inspect
import json
import os
import subprocess
import sys
from collections import Counter
from pathlib import Path

import pytest

from megatron_wlb.megatron.args.validation import Refusal
from megatron_wlb.megatron.args.version import MOVING_CHECKOUTS
from megatron_wlb.megatron.hooks import table as hooks

ROOT = Path(__file__).resolve().parents[1]

#: run in a fresh process: apply() and every phase change the process for good
DIFF_SCRIPT = r'''
import importlib, json, sys, types
from megatron_wlb.megatron.args.compat import install_python_shims
install_python_shims()
MODULES = ["megatron.training." + m for m in ("arguments", "initialize", "training", "checkpointing", "utils",
                                               "global_vars")] + [
    "megatron.core.pipeline_parallel.schedules", "megatron.core.pipeline_parallel.p2p_communication",
    "megatron.core.distributed.finalize_model_grads", "megatron.core.transformer.attention",
    "megatron.core.models.common.embeddings.rotary_pos_embedding",
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
    from megatron_wlb.megatron.hooks import table as hooks

    problems = []
    for key, value in after.items():
        if key not in before or before[key] is value:
            continue
        mod_name, path = key
        head = (mod_name, path.split(".")[0])
        if "." in path and before.get(head) is not after.get(head):
            continue  # an attribute of a class a hook replaced whole (PackingSchedulerEnum): that class is checked
        names = hooks.hooks_in(lookup(mod_name, path))
        hook = hooks.BY_NAME.get(names[0]) if names else None
        if hook is None:
            problems.append(f"{mod_name}.{path}: replaced, not by a hooks.HOOKS entry")
        elif hook.everywhere and (path.split(".")[-1] != hook.attr or (hook.only and mod_name not in hook.only)):
            problems.append(f"{mod_name}.{path}: {hook.name} installed where the table does not put it")
        elif not hook.everywhere and (mod_name, path) != (hook.module, hook.attr):
            problems.append(f"{mod_name}.{path}: {hook.name} installed where the table does not put it")
    return problems


def refusals():
    """Per phase, its first hook required on this release with its target deleted (a release that renamed it):
    what installing the phase says (the target restored after)."""
    from megatron_wlb.megatron.hooks import table as hooks

    out = {}
    for phase in hooks.PHASES:
        for hook in hooks.HOOKS:
            found = hooks._owner(hook)
            if hook.phase != phase or hooks.release() not in hook.required or found[1] not in vars(found[0]):
                continue
            owner, attr = found
            saved = vars(owner)[attr]
            delattr(owner, attr)
            if getattr(owner, attr, None) is not None:  # inherited (SelfAttention.__init__): not a renamed target
                setattr(owner, attr, saved)
                continue
            try:
                hooks.install(phase)
                out[phase] = "installed"
            except hooks.MissingHookTarget as exc:
                out[phase] = str(exc)
            finally:
                setattr(owner, attr, saved)
            break
    return out


refused = refusals()
before = snapshot()
import megatron_wlb.megatron as W
from megatron_wlb.megatron.hooks import table as hooks
from megatron_wlb.megatron.hooks import training_hooks
from megatron_wlb.megatron.entry.cpu_redirects import install_megatron_redirects
from megatron_wlb.megatron.args.settings import WlbSettings

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
print(json.dumps({"clean": clean, "rogue": rogue, "installed": installed, "stacked": stacked,
                  "release": hooks.release(), "refused": refused}))
'''


def _diff(env: dict[str, str], cwd: Path) -> dict:
    proc = subprocess.run([sys.executable, "-c", DIFF_SCRIPT], capture_output=True, text=True, env=env, timeout=300,
                          cwd=str(cwd))
    assert proc.returncode == 0, proc.stderr[-4000:]
    return json.loads(proc.stdout.strip().splitlines()[-1])


def assert_refused(out: dict, runs_as: str) -> None:
    """Every phase with a hook required on ``runs_as`` refused, in one line, once that hook's target was deleted."""
    phases = sorted({h.phase for h in hooks.HOOKS if runs_as in h.required})
    assert sorted(out["refused"]) == phases
    for phase, line in out["refused"].items():
        assert "\n" not in line and f"is required on Megatron-LM {runs_as}, but this megatron-core" in line, \
            (phase, line)


def expected(release: str) -> list[str]:
    """The hooks the table installs on ``release`` (the diff script's Megatron: not the CUDA machine's choices)."""
    return sorted(h.name for h in hooks.HOOKS if release in h.releases)


def test_the_table_is_well_formed():
    """Unique names, known phases and releases, a one-line reason for each, factories that exist in the module that
    owns them (no pass-through in between), and the apply phase's options fitting its factories."""
    pytest.importorskip("megatron.core")
    from megatron_wlb.megatron.args.compat import install_python_shims

    install_python_shims()
    assert len({h.name for h in hooks.HOOKS}) == len(hooks.HOOKS)
    for hook in hooks.HOOKS:
        assert hook.phase in hooks.PHASES and hook.why and "\n" not in hook.why, hook
        assert hook.releases and hook.releases <= hooks.RELEASES and hook.required <= hook.releases, hook
        factory = hooks._factory(hook)
        module, function = hook.make.split(":")
        assert callable(factory) and (factory.__module__, factory.__name__) == (module, function), hook
        assert not hook.only or hook.everywhere, hook
    with pytest.raises(ValueError, match="must be known releases"):
        hooks.Hook("x", "m", "a", frozenset({"0.17"}), "why", "apply", "m:f")
    # the 15 timing wrappers, the training loop's 8 (4 built in training_hooks, 4 where their logic lives), the
    # attention's 4 (SelfAttention.__init__ and RoPE, issue 47; Attention.forward holding the params RoPE reads and
    # the rotary table's length, issue 60)
    assert sum(h.phase == "timing" for h in hooks.HOOKS) == 15
    apply_owners = Counter(h.make.split(":")[0].rsplit(".", 1)[1] for h in hooks.HOOKS if h.phase == "apply")
    assert apply_owners == {"training_hooks": 4, "checkpoint": 2, "agreement": 1, "wlb_logging": 1, "startup": 2}
    assert sum(h.phase == "attention" for h in hooks.HOOKS) == 4
    # every hook the CI-trained releases share is required on each (only release-specific ones are not)
    assert all(h.required == hooks.SERIES for h in hooks.HOOKS if h.releases == hooks.RELEASES)
    from megatron_wlb.megatron.hooks.training_hooks import apply_phase_options

    for name, options in apply_phase_options().items():
        assert hooks.BY_NAME[name].phase == "apply"
        inspect.signature(hooks._factory(hooks.BY_NAME[name])).bind(None, **options)  # every keyword it takes
    with pytest.raises(ValueError, match="does not install"):
        hooks.install("cpu", {"train_step": {}})


def test_releases_are_named_from_the_core_version():
    assert [hooks.release(v) for v in ("0.16.1", "0.19.2", "0.19.0rc1", "0.20.0", "0.17.0", "x")] == \
        ["0.16", "0.19", "0.19", "main", None, None]


#: (hook, what a release renames: the function, or the class that holds it)
RENAMED = [("train_step", "train_step"), ("apply_rotary_pos_emb", "apply_rotary_pos_emb"),
           ("SelfAttention.__init__", "SelfAttention"), ("P2PCommunicator._communicate_shapes", "P2PCommunicator"),
           ("P2PCommunicator.send_forward", "P2PCommunicator.send_forward"),
           ("initialize_megatron", "initialize_megatron")]


@pytest.mark.parametrize("name, renamed", RENAMED, ids=[r[0] for r in RENAMED])
def test_a_renamed_megatron_function_stops_its_phase_in_one_line(monkeypatch, name, renamed):
    """The installed wheel (0.19) with what a required hook replaces deleted from the real module: installing the
    phase raises one line naming the hook, the release and the missing attribute, and installs nothing."""
    pytest.importorskip("megatron.core")
    import importlib

    from megatron_wlb.megatron.args.compat import install_python_shims

    install_python_shims()
    hook = hooks.BY_NAME[name]
    *owner_path, attr = renamed.split(".")
    owner = importlib.import_module(hook.module)  # Megatron's real module
    for part in owner_path:
        owner = getattr(owner, part)
    monkeypatch.delattr(owner, attr)
    phase = [h.name for h in hooks.HOOKS if h.phase == hook.phase]
    before = {n: hooks.current(n) for n in phase}
    with pytest.raises(hooks.MissingHookTarget) as refused:
        hooks.install(hook.phase)
    message = str(refused.value)
    assert isinstance(refused.value, Refusal)  # the entry points exit with the line alone (exit_on_startup_error)
    assert "\n" not in message and f"hook {name!r}" in message
    assert "is required on Megatron-LM 0.19, but this megatron-core 0.19" in message
    assert f"has no {hook.module}.{renamed} (renamed or removed)" in message
    assert {n: hooks.current(n) for n in phase} == before  # nothing of the phase installed
    with pytest.raises(hooks.MissingHookTarget, match=f"hook {name!r}"):
        hooks.install_hook(name)


def test_a_hook_of_another_release_is_skipped_quietly_here():
    """core 0.16's TP-rank batch function is gone from the 0.19 wheel: not required here, nothing installed (and
    required on 0.16, where its absence would be named)."""
    pytest.importorskip("megatron.core")
    from megatron_wlb.megatron.args.compat import install_python_shims

    install_python_shims()
    assert hooks.current("get_batch_on_this_tp_rank") is None
    assert hooks.missing_target("get_batch_on_this_tp_rank") == ""
    assert hooks.install_hook("get_batch_on_this_tp_rank") is None
    assert "has no megatron.training.utils.get_batch_on_this_tp_rank" in \
        hooks.missing_target("get_batch_on_this_tp_rank", on="0.16")
    assert "has no module megatron.legacy" in hooks.missing_target("fused_kernels.load", on="0.16")


def test_only_the_table_replaces_megatron_functions_installed_wheel(tmp_path):
    """megatron-core 0.19 (the installed wheel): every phase installed, exactly the table's 0.19 hooks, every change
    accounted for by the table."""
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
    assert out["release"] == "0.19"
    assert out["installed"] == expected("0.19")
    assert_refused(out, "0.19")
    assert "get_batch_on_this_tp_rank" not in out["installed"]  # gone from core 0.18 on


#: (the table's release, conftest.megatron_checkout's tag, its commit (None: patches/<tag>/PINNED_COMMIT), the release
#: its version names at run time)
CHECKOUTS = [("0.16", "core_v0.16.1", None, "0.16"), ("0.19", "core_v0.19.0", None, "0.19"),
             ("main", "main", MOVING_CHECKOUTS["main"], "main"),
             ("main-6742", "main-6742", MOVING_CHECKOUTS["main-6742"], "main"),
             ("dev", "dev", MOVING_CHECKOUTS["dev"], "0.19")]


@pytest.mark.slow
@pytest.mark.parametrize("release, tag, commit, runs_as", CHECKOUTS, ids=[c[0] for c in CHECKOUTS])
def test_only_the_table_replaces_megatron_functions_checkouts(tmp_path, release, tag, commit, runs_as):
    """Each Megatron-LM checkout CI runs (skipped, saying how to provide it, where the mirror lacks it): every phase
    installed without a missing required hook, exactly the table's hooks of that release, every change the table's."""
    from conftest import megatron_checkout

    code = str(megatron_checkout(tmp_path / "megatron-lm", tag, commit))
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([code, str(ROOT)]), "PYTHONWARNINGS": "ignore"}
    out = _diff(env, tmp_path)
    assert out["clean"] == [], out["clean"]
    assert out["stacked"] == []
    assert len(out["rogue"]) == 1
    assert out["release"] == runs_as
    assert out["installed"] == expected(release)
    assert_refused(out, runs_as)
