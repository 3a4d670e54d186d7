"""Issue 47: the user's knobs on the command line, the research ones in YAML; lazy imports few and explained."""

from __future__ import annotations

import argparse
import ast
import dataclasses
from pathlib import Path

import pytest

from megatron_wlb.config import RunChoices, load_choices, load_config
from megatron_wlb.megatron.args.flags import (
    FLAGS,
    YAML_ONLY,
    add_wlb_args,
    config_flags,
    one_line_errors,
    settings_from_args,
)
from megatron_wlb.megatron.args.settings import USER_FLAGS, WlbSettings

ROOT = Path(__file__).resolve().parents[1]
ADAPTER = ROOT / "megatron_wlb" / "megatron"
#: issue 47's targets
MAX_FLAGS = 12
#: 21 since issue 57: reading Megatron's saved args from a checkpoint needs torch, which importing the adapter does not
MAX_LAZY_IMPORTS = 21


def _parser() -> argparse.ArgumentParser:
    return one_line_errors(add_wlb_args(argparse.ArgumentParser(prog="pretrain")))


def _visible_wlb_flags(parser: argparse.ArgumentParser) -> list[str]:
    return sorted({flag for action in parser._actions if action.help != argparse.SUPPRESS
                   for flag in action.option_strings if flag.startswith("--wlb-")})


def test_the_flags_are_the_users_choices_only():
    flags = _visible_wlb_flags(_parser())
    assert len(flags) <= MAX_FLAGS, flags
    assert set(flags) == {*FLAGS.values(), "--wlb-reset-data-stream"}
    assert set(FLAGS) == set(USER_FLAGS) and not set(USER_FLAGS) & set(YAML_ONLY)
    assert set(USER_FLAGS) | set(YAML_ONLY) == set(WlbSettings.names())  # every setting is settable somewhere


@pytest.mark.parametrize("name", YAML_ONLY)
def test_a_research_knob_passed_as_a_flag_names_its_yaml_key(name: str, capsys):
    flag = "--wlb-" + name.replace("_", "-")
    with pytest.raises(SystemExit) as exit_:
        _parser().parse_args([flag, "1"])
    assert exit_.value.code == 2
    err = capsys.readouterr().err.strip()
    key = {"refit_interval": "cost.refit_interval", "sft_samples": "sft.samples"}.get(name, f"packing.{name}")
    assert len(err.splitlines()) == 1 and f"{flag} is not a flag: set {key} in the YAML of --wlb-config" in err, err


def test_a_settings_file_sets_research_knobs_for_a_run_of_any_shape(tmp_path: Path):
    path = tmp_path / "tweaks.yaml"
    path.write_text("packing: {window: 2, queue_thresholds: [2048, 8192], release: grouped}\n"
                    "cp: {sharding: per-document}\ncost: {refit_interval: 7}\n")
    choices = load_choices(str(path))
    assert isinstance(choices, RunChoices)
    s = settings_from_args(_parser().parse_args(["--wlb-config", str(path), "--wlb-max-delay", "3"]))
    assert (s.window, s.queue_thresholds, s.release, s.refit_interval) == (2, (2048, 8192), "grouped", 7)
    assert (s.cp_sharding, s.max_delay, s.config) == ("per-document", 3, str(path))
    # the flag wins over the file, the file over the preset
    s = settings_from_args(_parser().parse_args(["--wlb-config", str(path), "--wlb-cp-sharding", "adaptive"]))
    assert s.cp_sharding == "adaptive" and s.window == 2


@pytest.mark.parametrize("text, match", [
    ("packing: {windw: 2}\n", r"unknown packing key\(s\) 'windw'"),
    ("seq_len_x: 3\n", r"unknown key\(s\) 'seq_len_x' in a settings file"),
    ("packing: {window: 2}\nseq_len: 4096\n", r"missing required key 'model'"),  # a run config: checked whole
    ("cp_sharding: adaptive\n", r"unknown key\(s\) 'cp_sharding' in a settings file.*valid keys: .*cp"),
])
def test_a_bad_settings_file_is_one_line(tmp_path: Path, text: str, match: str):
    path = tmp_path / "bad.yaml"
    path.write_text(text)
    with pytest.raises(ValueError, match=match) as err:
        load_choices(str(path))
    assert "\n" not in str(err.value)


def test_config_flags_refuse_a_research_knob_no_flag_carries():
    run = load_config("7b_64k")
    assert config_flags(run)[:2] == ["--wlb-packer", "wlb"]
    tweaked = dataclasses.replace(run, packing=dataclasses.replace(run.packing, window=3))
    with pytest.raises(ValueError, match="sets packing.window, which no --wlb-\\* flag gives"):
        config_flags(tweaked)


def test_no_hidden_old_spellings():
    """Issue 47: no alias flags (the old --wlb-packing, --wlb-min-fill, ...), hidden or not: only the refusals
    of the research knobs are hidden, each a setting's own name."""
    hidden = sorted({flag for action in _parser()._actions if action.help == argparse.SUPPRESS
                     for flag in action.option_strings})
    assert hidden == sorted("--wlb-" + name.replace("_", "-") for name in YAML_ONLY)


def _lazy_imports() -> list[tuple[str, int, bool]]:
    """(file, line, commented) of every import inside a function of megatron_wlb/megatron/: commented when a
    line of the statement, or the line above it, carries a ``#`` comment saying why it is lazy."""
    found = []
    for path in sorted(ADAPTER.rglob("*.py")):
        lines = path.read_text().splitlines()
        for func in ast.walk(ast.parse("\n".join(lines))):
            if not isinstance(func, ast.FunctionDef | ast.AsyncFunctionDef):
                continue
            for node in ast.walk(func):
                if isinstance(node, ast.Import | ast.ImportFrom):
                    span = lines[node.lineno - 2: node.end_lineno]
                    found.append((path.name, node.lineno, any("#" in line for line in span)))
    return sorted(set(found))


def test_lazy_imports_in_the_adapter_are_few_and_each_says_why():
    found = _lazy_imports()
    assert len(found) <= MAX_LAZY_IMPORTS, f"{len(found)} imports inside functions (<= {MAX_LAZY_IMPORTS}): {found}"
    bare = [f"{name}:{line}" for name, line, commented in found if not commented]
    assert not bare, f"lazy imports without a comment saying why: {bare}"


def test_adapter_modules_stay_short():
    long = {p.name: n for p in ADAPTER.rglob("*.py") if (n := len(p.read_text().splitlines())) > 400}
    assert not long, long
