"""Configs and knobs: every typed PackingConfig field is a YAML key and a --wlb-* flag (generated,
so a new field needs no list kept by hand), bad YAML is a one-line error naming what is valid, and a
model can be described with Megatron-LM's own argument names."""

from __future__ import annotations

import argparse
import json
import re
import subprocess
import sys
import typing
from dataclasses import dataclass
from pathlib import Path
from typing import Literal

import pytest
import yaml

from megatron_wlb.config import (
    CONFIG_DIR,
    PACKING_KNOBS,
    config_from_dict,
    dataclass_knobs,
    knob_yaml,
    list_configs,
    load_config,
)
from megatron_wlb.megatron.args.flags import FLAGS, add_wlb_args, config_flags, settings_from_args
from megatron_wlb.megatron.args.settings import FLAG_KNOBS, WlbSettings
from megatron_wlb.megatron.args.validation import packing_config_from_args

ROOT = Path(__file__).resolve().parents[1]
BASE = {"name": "t", "model": "7b", "seq_len": 8192, "layout": {"tp": 1, "cp": 2, "pp": 2, "dp": 2}}


def other_value(knob, seq_len: int = 8192):
    """A valid value of ``knob`` different from its default, derived from its type alone (the first
    candidate that a config with ``seq_len`` accepts, so fields with range checks work too)."""
    hint, d = knob.hint, knob.default
    args = typing.get_args(hint)
    if knob.choices:
        candidates = [c for c in knob.choices if c != d]
    elif any(typing.get_origin(a) is tuple for a in args):
        candidates = [(1000, 3000)]
    elif hint is bool:
        candidates = [not d]
    elif bool in args:
        candidates = [False, True]
    elif hint is float or float in args:
        base = d if isinstance(d, float) else 1.0
        candidates = [base / 2, base * 2 + 0.5, 0.25, 0.9, 2.0, 10.0]
    elif hint is int or int in args:
        base = d if isinstance(d, int) else seq_len
        candidates = [base + 1, base * 2, 2 * seq_len, 1, 2, 64]
    else:
        raise AssertionError(f"no test value for {knob.name}: {hint}")
    for value in candidates:
        if value == d:
            continue
        try:
            config_from_dict({**BASE, "seq_len": seq_len, **knob_yaml(knob.name, value)})
        except ValueError:
            continue
        return value
    raise AssertionError(f"no accepted test value for {knob.name} among {candidates}")


def test_knobs_are_the_typed_fields_of_packing_config():
    from dataclasses import fields

    from megatron_wlb.config import RUN_FIELDS
    from megatron_wlb.packing.types import PackingConfig

    run_derived = set(RUN_FIELDS) - {"seed"}  # set from the run (seq_len, n, dp, the pipeline), not knobs
    assert {"seq_len", "n", "dp", "pipeline_stages", "virtual_stages"} <= run_derived
    typed = {f.name for f in fields(PackingConfig) if f.name not in run_derived
             and typing.get_origin(typing.get_type_hints(PackingConfig)[f.name]) is not dict
             and typing.get_type_hints(PackingConfig)[f.name] is not dict}
    assert set(PACKING_KNOBS) == typed
    assert set(FLAG_KNOBS) == typed - {"seed"}  # Megatron's --seed sets it


@pytest.mark.parametrize("name", list(PACKING_KNOBS))
def test_every_knob_is_a_yaml_key(name: str):
    knob = PACKING_KNOBS[name]
    value = other_value(knob)
    run = config_from_dict({**BASE, **knob_yaml(name, value)})
    assert getattr(run.packing, name) == value
    # the YAML text round-trips too (lists for tuples)
    text = yaml.safe_dump({**BASE, **knob_yaml(name, list(value) if isinstance(value, tuple) else value)})
    assert getattr(config_from_dict(yaml.safe_load(text)).packing, name) == value


@pytest.mark.parametrize("name", list(PACKING_KNOBS))
def test_every_knob_is_a_wlb_pack_set_key(name: str):
    """``wlb pack --set <YAML key>=V`` sets any knob, read as its type; the knobs a user chooses are options too."""
    from megatron_wlb.cli.main import build_parser
    from megatron_wlb.cli.pack import CHOSEN_KNOBS, overrides
    from megatron_wlb.config import knob_yaml_key

    value = other_value(PACKING_KNOBS[name])
    text = ",".join(map(str, value)) if isinstance(value, tuple) else str(value)
    args = build_parser().parse_args(["pack", "--set", f"{knob_yaml_key(name)}={text}"])
    assert overrides(args) == {name: value}
    if name in CHOSEN_KNOBS:
        assert overrides(build_parser().parse_args(["pack", PACKING_KNOBS[name].flag("--"), text])) == {name: value}


@pytest.mark.parametrize("argv, match", [
    (["--set", "packing.windw=4"], r"^--set 'packing.windw=4': give KEY=VALUE with KEY one of packing.max_seq_len, "
                                   r".*packing.window, .*cost.refit_interval$"),
    (["--set", "packing.window"], r"^--set 'packing.window': give KEY=VALUE"),
    (["--set", "window=4"], r"^--set 'window=4': give KEY=VALUE"),
    (["--set", "packing.window=big"], r"^--set packing.window='big': give an integer$"),
    (["--set", "packing.release=global"], r"^--set packing.release='global': give 'balanced', 'grouped', 'oldest'"),
    (["--set", "packing.fill_target=2"], r"^--set packing.fill_target='2': fill_target"),
    (["--max-delay", "3", "--set", "packing.max_delay=2"], r"packing.max_delay is already given \(--max-delay\)"),
])
def test_a_bad_wlb_pack_set_is_one_line_naming_it(argv: list[str], match: str, capsys):
    from megatron_wlb.cli.main import main

    assert main(["pack", "--lengths", "stdlib", "--iterations", "1", *argv]) != 0
    err = capsys.readouterr().err.strip()
    assert len(err.splitlines()) == 1, err
    assert re.search(match, err.removeprefix("wlb pack: error: ")), err


def test_wlb_pack_set_reaches_the_packer(capsys):
    from megatron_wlb.cli.main import main

    def report(*argv: str) -> dict:
        assert main(["pack", "--config", "550m_64k", "--lengths", "stdlib", "--iterations", "3", "--json", *argv]) == 0
        return json.loads(capsys.readouterr().out)

    default, paper = report(), report("--set", "packing.release=paper", "--set", "packing.fill=off")
    assert default["balanced_releases"] > 0 and paper["balanced_releases"] == 0
    assert paper["imbalance"] != default["imbalance"]


@pytest.mark.parametrize("name", list(FLAG_KNOBS))
def test_every_knob_is_a_wlb_flag_or_a_settings_file_key(name: str, tmp_path: Path):
    """A user's knob is a --wlb-* flag; a research knob is a key of a settings file given to --wlb-config."""
    knob = FLAG_KNOBS[name]
    value = other_value(knob)
    text = ",".join(map(str, value)) if isinstance(value, tuple) else str(value)
    parser = add_wlb_args(argparse.ArgumentParser())
    if name in FLAGS:
        args = parser.parse_args([FLAGS[name], text])
    else:
        settings_file = tmp_path / "settings.yaml"
        settings_file.write_text(yaml.safe_dump(knob_yaml(name, list(value) if isinstance(value, tuple) else value)))
        args = parser.parse_args(["--wlb-config", str(settings_file)])
    args.seq_length, args.micro_batch_size, args.global_batch_size, args.data_parallel_size = 8192, 1, 4, 1
    settings = settings_from_args(args)
    assert getattr(settings, name) == value
    assert getattr(packing_config_from_args(args, settings), name) == value
    assert settings.to_dict()[name] == (list(value) if isinstance(value, tuple) else value)


def test_mechanism_picks_up_a_new_field_with_no_list_to_edit():
    @dataclass(frozen=True)
    class Future:
        """Settings.

        - ``outlier_fraction``: share of the mean latency above which a document is an outlier.
        - ``release``: when a queue releases documents.
        """

        outlier_fraction: float = 0.7
        release: Literal["global", "rank"] = "global"
        extra: dict | None = None

    knobs = dataclass_knobs(Future)
    assert list(knobs) == ["outlier_fraction", "release", "extra"]
    assert knobs["outlier_fraction"].flag() == "--wlb-outlier-fraction"
    assert knobs["outlier_fraction"].help.startswith("share of the mean latency")
    assert knobs["outlier_fraction"].parse("0.5", "--wlb-outlier-fraction") == 0.5
    assert knobs["release"].choices == ("global", "rank")
    with pytest.raises(ValueError, match=r"--wlb-release='ranks': give 'global', 'rank'"):
        knobs["release"].parse("ranks", "--wlb-release")
    with pytest.raises(ValueError, match="give a number"):
        knobs["outlier_fraction"].parse("nan", "--wlb-outlier-fraction")


@pytest.mark.parametrize("patch, match", [
    ({"packing": {"outlier_fracton": 0.5}}, r"unknown packing key\(s\) 'outlier_fracton'; valid: packer, "),
    ({"cp": {"sharding": "ring"}}, r"cp.sharding='ring' is not a CP layout; choose one of per-sequence"),
    ({"cp_sharding": "adaptive"}, r"unknown key\(s\) 'cp_sharding'; valid keys: name, description, model, seq_len"),
    ({"cp": {"layout": "adaptive"}}, r"unknown cp key\(s\) 'layout'; valid: sharding"),
    ({"logging": {"log_interval": 0}}, r"logging.log_interval=0: must be a positive integer"),
    ({"cost": {"profile": 3}}, r"cost.profile=3: give "),
    ({"modle": "7b"}, r"unknown key\(s\) 'modle'; valid keys: name, "),
    ({"packing": {"packer": "best"}}, r"packing.packer='best'; choose one of"),
    ({"packing": {"max_delay": -1}}, r"packing.max_delay=-1: max_delay must be a non-negative"),
    ({"packing": {"window": "two"}}, r"packing.window='two': give an integer"),
    ({"packing": {"queue_thresholds": [9000, 10]}}, r"strictly increasing"),
    ({"packing": {"max_seq_len": 100}}, r"max_seq_len=100 is below seq_len=8192"),
    ({"layout": {"tp": 0}}, r"layout.tp=0: must be a positive integer"),
    ({"layout": {"tp": 1, "xp": 2}}, r"layout must map tp/cp/pp/dp"),
    ({"layout": {"tp": 1, "ep": 2}}, r"ParallelLayout.ep=2 must divide tp x cp x dp = 1"),
    ({"layout": {"tp": 2, "ep": 2}}, r"layout ep=2 \(expert parallelism\) needs an MoE model"),
    ({"model": {"hidden_size": 1024, "num_layers": 4, "num_attention_heads": 8, "ffn_hidden_size": 4096,
                "num_experts": 4, "moe_layer_freq": [1, 0]}}, r"moe_layer_freq=\[1, 0\]: a pattern must hold one"),
    ({"model": {"hidden_size": 1024, "num_layers": 4, "num_attention_heads": 8, "ffn_hidden_size": 4096,
                "multi_latent_attention": True}}, r"model.multi_latent_attention=True: multi-latent attention"),
    ({"seq_len": 8191}, r"must be divisible by 2 x cp"),
    ({"seq_len": "8k"}, r"seq_len='8k': must be a positive integer"),
    ({"model": "8b"}, r"model '8b' is not a shipped shape"),
    ({"model": {"hidden_size": 1024, "num_layers": 4, "num_attention_heads": 8, "fnn_hidden_size": 4096}},
     r"unknown model key 'fnn_hidden_size'; valid: .*ffn_hidden_size"),
    ({"model": {"hidden_size": 1024, "num_layers": 4}}, r"model is missing num_heads, num_kv_heads, ffn_hidden"),
    ({"micro_batches": 0}, r"micro_batches=0"),
])
def test_bad_config_values_name_what_is_valid(patch, match):
    with pytest.raises(ValueError, match=match) as err:
        config_from_dict({**BASE, **patch}, source="my.yaml")
    assert "\n" not in str(err.value) and str(err.value).startswith("my.yaml")


def test_model_in_megatron_key_names(tmp_path: Path):
    path = tmp_path / "mine.yaml"
    path.write_text("""
model:                      # Megatron-LM's argument names (--hidden-size ...)
  num_layers: 32
  hidden_size: 4096
  num_attention_heads: 32
  num_query_groups: 8
  ffn_hidden_size: 14336
  vocab_size: 128256
  swiglu: true
seq_len: 65536
layout: {tp: 4, cp: 2, pp: 1, dp: 1}
""")
    run = load_config(path)
    m = run.model
    assert (m.hidden, m.num_layers, m.num_heads, m.num_kv_heads, m.ffn_hidden, m.vocab) == \
        (4096, 32, 32, 8, 14336, 128256)
    assert run.name == "mine" and run.packer == "wlb" and run.packing.n == 1
    same = config_from_dict({"model": {"hidden": 4096, "num_layers": 32, "num_heads": 32, "num_kv_heads": 8,
                                       "ffn_hidden": 14336, "vocab": 128256}, "seq_len": 65536,
                             "layout": {"tp": 4, "cp": 2}})
    assert same.model.to_dict() | {"name": "x"} == m.to_dict() | {"name": "x"}


def test_yaml_syntax_error_is_one_line(tmp_path: Path):
    bad = tmp_path / "bad.yaml"
    bad.write_text("name: x\nlayout: {tp: 1, cp: 2\nseq_len: 4\n")
    with pytest.raises(ValueError, match=r"bad.yaml: not valid YAML at line \d+") as err:
        load_config(bad)
    assert "\n" not in str(err.value)
    (tmp_path / "list.yaml").write_text("- 1\n- 2\n")
    with pytest.raises(ValueError, match="expected a mapping at the top level"):
        load_config(tmp_path / "list.yaml")


def test_shipped_configs_load_from_package_resources():
    names = list_configs()
    assert "7b_128k" in names and len(names) == len(list(CONFIG_DIR.iterdir()))
    for name in names:
        run = load_config(name)
        assert run.name == name
    assert load_config(Path(str(CONFIG_DIR)) / "7b_64k.yaml") == load_config("7b_64k")
    with pytest.raises(FileNotFoundError, match="not one of 30b_128k"):
        load_config("7b_256k")


@pytest.mark.parametrize("name", list_configs())
def test_config_flags_reproduce_the_config_without_its_layout(name: str):
    """What launch_local passes when it rescales the layout: the same settings as --wlb-config."""
    run = load_config(name)
    parser = add_wlb_args(argparse.ArgumentParser())
    from_config = settings_from_args(parser.parse_args(["--wlb-config", name]))
    from_flags = settings_from_args(parser.parse_args(config_flags(run)))
    assert from_flags == WlbSettings(**{**from_config.knob_values(), "packer": from_config.packer,
                                        "cp_sharding": from_config.cp_sharding})


def test_flag_table_in_the_docs_matches_the_code():
    """docs/megatron.md's --wlb-* table is generated from the code; it must be current."""
    res = subprocess.run([sys.executable, "-m", "megatron_wlb.megatron.args.flags", "--check-docs"],
                         capture_output=True, text=True, cwd=ROOT, env={"PYTHONPATH": str(ROOT), "PATH": "/usr/bin"})
    assert res.returncode == 0, res.stdout + res.stderr


def test_core_imports_without_highspy():
    """HiGHS is needed only by the fixed-solver packer: config and the Megatron adapter import without it."""
    code = ("import sys; sys.modules['highspy'] = None\n"  # an import of highspy now raises ImportError
            "import megatron_wlb.config, megatron_wlb.megatron.args.flags\n"
            "print('ok')")
    res = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, cwd=ROOT,
                         env={"PYTHONPATH": str(ROOT), "PATH": "/usr/bin:/bin"})
    assert res.stdout.strip() == "ok", res.stderr


def test_the_docs_own_model_example_loads(tmp_path: Path):
    text = (ROOT / "docs" / "megatron_launch.md").read_text()
    section = text[text.index("### Your own model"):]
    block = section[section.index("```yaml") + len("```yaml"):]
    block = block[:block.index("```")]
    (tmp_path / "mine.yaml").write_text(block)
    run = load_config(tmp_path / "mine.yaml")
    assert run.model.num_kv_heads == 8 and run.model.ffn_hidden == 14336 and run.packing.max_delay == 4
    assert run.cp.sharding == run.cp_sharding == "per-document" and run.packing.capacity_var == 98304


def test_settings_behave_like_a_frozen_dataclass():
    import copy
    import pickle
    from dataclasses import replace

    s = WlbSettings(max_delay=3, queue_thresholds="100,200")
    assert (s.max_delay, s.queue_thresholds, s.window) == (3, (100, 200), 1)
    r = replace(s, cp_sharding="per-document")
    assert r.max_delay == 3 and r.cp_sharding == "per-document"
    assert pickle.loads(pickle.dumps(r)) == r == copy.deepcopy(r) and hash(r) == hash(replace(r))
    assert WlbSettings(max_delay=FLAG_KNOBS["max_delay"].default) == WlbSettings()  # defaults are not stored
    with pytest.raises(ValueError, match="unknown WLB setting.*max_dealy"):
        WlbSettings(max_dealy=3)
    with pytest.raises(AttributeError):
        _ = s.no_such_setting
